"""Sampled calls of F.scaled_dot_product_attention under ``attnhub.patch()``, each checked
against the float64 reference and against PyTorch's own error on the same call
(:mod:`attnhub.testing.patched`: what is drawn and the rule), beyond the seeds that
tests/test_patch_sampled.py runs. Prints each failing call (its id names its draw),
progress every 50 calls, and what served the patched calls; exits 1 if any failed.

    python benchmarks/patch_fuzz.py [--device cuda] [--seed 0] [--cases 500]
    TRITON_INTERPRET=1 python benchmarks/patch_fuzz.py --backend triton_flash --cases 100

``--backend``: the patch's ``backend=`` (calls no named backend can serve go to
PyTorch's own function, as the patch does). On the GPU each new call signature
compiles Triton kernels and is timed by autotune on its first call (100-150 calls in
400 s on an H100, three processes at once); ``ATTNHUB_AUTOTUNE=0`` skips the timing
(the table and the cost model rank then, as under tracing).
"""

from __future__ import annotations

import argparse
import sys

from attnhub.testing.patched import patched_call_problems, sample_sdpa_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--backend", default=None, help="the patch's backend= (default: any)")
    args = parser.parse_args()
    failures = done = 0
    served: dict[str, int] = {}
    try:
        for call in sample_sdpa_calls(args.device, args.cases, args.seed):
            found, by = patched_call_problems(call, args.device, args.backend)
            for name, n in by.items():
                served[name] = served.get(name, 0) + n
            if found:
                failures += 1
                print(f"{call.id} served {by}: {'; '.join(found)}", flush=True)
            done += 1
            if done % 50 == 0:
                print(f"{done} cases, {failures} failing", flush=True)
    except KeyboardInterrupt:  # cut at a time limit (SIGINT): the summary of what ran
        print(f"interrupted after {done} cases")
    print(f"seed {args.seed}, {args.device}: {done} cases, {failures} failing; "
          f"patched calls served by {dict(sorted(served.items()))}")  # fmt: skip
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
