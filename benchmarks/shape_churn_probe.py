"""Per-call cost of each backend when every call has a new key length, as in decoding.

Autotune times a backend on one call's tensors, repeated: a cost paid once per shape
(a cuDNN execution plan, a compile with static shapes, a launch-argument
specialization) is paid in its warm-up and then hidden. A decoding step's key length
grows by one every token, so such costs recur at every step. This probe times, for
each eligible backend pinned by name, calls that repeat one shape and calls whose key
length is new each time, and prints both (wall clock per call, host time included)::

    python benchmarks/shape_churn_probe.py [--json OUT] [--calls 200]

Shapes: the decoding steps of a Llama-style model in Hugging Face's sdpa path (grouped
query heads folded into the query rows: q (8, 4, 4, 128), k/v (8, 4, Nk, 128), bf16)
and the same with q (8, 16, 1, 128) against 4 KV heads (GQA).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import attnhub

BACKENDS = ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_cudnn", "torch_sdpa_efficient", "triton_flash")  # fmt: skip


def _per_call_us(fn, keys) -> float:  # type: ignore[no-untyped-def]
    for k in keys[:3]:
        fn(k)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in keys:
        fn(k)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / len(keys) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype, device = torch.bfloat16, torch.device("cuda")
    results = []
    for label, hq, nq in (("folded 4 rows, MHA 4/4", 4, 4), ("GQA 16/4, Nq 1", 16, 1)):
        q = torch.randn(8, hq, nq, 128, dtype=dtype, device=device)
        pool = torch.randn(8, 4, 513 + 2 * args.calls, 128, dtype=dtype, device=device)
        fixed = [pool[:, :, :520]] * args.calls
        # A new length every call (as decoding), each a fresh view like a growing cache.
        churn = [pool[:, :, : 600 + i] for i in range(args.calls)]
        calls = {"F.sdpa": lambda k: F.scaled_dot_product_attention(q, k, k, enable_gqa=hq != 4)}  # noqa: B023
        for name in BACKENDS:
            try:
                attnhub.attention(q, pool[:, :, :520], pool[:, :, :520], backend=name)
            except Exception as exc:
                results.append(
                    {"shape": label, "backend": name, "skipped": str(exc).splitlines()[0]}
                )
                continue
            calls[name] = lambda k, name=name: attnhub.attention(q, k, k, backend=name)  # noqa: B023
        for name, fn in calls.items():
            row = {
                "shape": label,
                "backend": name,
                "fixed_us": _per_call_us(fn, fixed),
                "new_length_each_call_us": _per_call_us(fn, churn),
            }
            results.append(row)
            print(f"{label:24} {name:22} fixed {row['fixed_us']:8.1f} us   new length each call {row['new_length_each_call_us']:8.1f} us")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
