"""``auto`` against the backend it chose, timed call by call in alternation (CUDA only).

``attnhub bench`` times each competitor in its own do_bench window. Between windows the
same cuDNN kernel read up to 10% apart
(``benchmarks/results/archive/auto-paired-h200-2026-11-30-*-first.json``: two bench
passes, cuDNN against itself 0.90-1.09, sd 2.9%), so auto/best from one grid run cannot
resolve issue 4's 0.97 bar when auto runs the best backend's own kernel.
Here every rep times each call once, in rotating order, each after an L2 flush (as
do_bench does) between CUDA events, and the medians are compared. The backend is timed
twice under two names (``chosen``, ``chosen_again``): that ratio is the method's own
noise floor.

Per point of issue 4's grid (bf16 and fp16; D 64, 128; N 1K, 4K, 16K; B = 16384 / N,
H = 2048 / D; causal or not): the forward without gradients and forward+backward, on
``attnhub.bench``'s inputs and calls (``attnhub.attention`` with and without
``backend=``).

    python benchmarks/auto_paired.py OUT.json [--target-ms 150] [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence

import torch

from attnhub import bench

FLUSH_BYTES = 256 * 2**20  # do_bench's L2 flush buffer
DEVICE = torch.device("cuda")


def paired_ms(
    fns: dict[str, Callable[[], object]], target_ms: float, grads: Sequence[torch.Tensor]
) -> tuple[dict[str, float], int]:
    """Median ms per call of each of ``fns``, timed in alternation; and the reps run."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE)
    names = list(fns)

    def once(name: str) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        for t in grads:
            t.grad = None
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fns[name]()
        end.record()
        return start, end

    for name in names:  # warm up: compiles, allocator, cuDNN plans
        once(name)
    torch.cuda.synchronize()
    probe = [once(names[0]) for _ in range(3)]
    torch.cuda.synchronize()
    each = statistics.median(s.elapsed_time(e) for s, e in probe)
    reps = max(10, min(300, int(target_ms / max(each, 1e-3))))
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {n: [] for n in names}
    for i in range(reps):
        shift = i % len(names)  # rotate who goes first: no call always follows the flush
        for name in names[shift:] + names[:shift]:
            events[name].append(once(name))
    torch.cuda.synchronize()
    return {
        n: statistics.median(s.elapsed_time(e) for s, e in ev) for n, ev in events.items()
    }, reps


def point_rows(point: bench.Point, target_ms: float) -> list[dict]:
    x = bench._make_inputs(point, DEVICE)
    auto = bench._attnhub_calls(bench.AUTO, point, x)
    rows = []
    for mode, kind in (("fwd", "fwd"), ("fwd_bwd", "train")):
        chosen = auto.chosen[kind]
        named = bench._attnhub_calls(chosen, point, x)
        again = bench._attnhub_calls(chosen, point, x)
        if mode == "fwd":
            fns = {"auto": auto.fwd, "chosen": named.fwd, "chosen_again": again.fwd}
            grads: Sequence[torch.Tensor] = ()
        else:

            def train(call: Callable[[], torch.Tensor]) -> Callable[[], None]:
                return lambda: call().backward(x.dout)

            fns = {
                "auto": train(auto.fwd_train),
                "chosen": train(named.fwd_train),
                "chosen_again": train(again.fwd_train),
            }
            grads = x.grads
        ms, reps = paired_ms(fns, target_ms, grads)
        row = {"dtype": point.dtype, "D": point.head_dim, "N": point.seqlen, "B": point.batch,
               "H": point.heads, "causal": point.causal, "mode": mode, "chosen": chosen,
               "reps": reps, **{f"{n}_ms": round(v, 5) for n, v in ms.items()},
               "chosen_over_auto": round(ms["chosen"] / ms["auto"], 4),
               "chosen_over_chosen_again": round(ms["chosen"] / ms["chosen_again"], 4)}  # fmt: skip
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument(
        "--target-ms", type=float, default=150.0, help="time per call kind per point"
    )
    parser.add_argument("--commit", help="the tree's commit, recorded in env")
    args = parser.parse_args()
    rows = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128):
            for n in (1024, 4096, 16384):
                for causal in (False, True):
                    point = bench.Point(dtype, 16384 // n, 2048 // d, n, d, causal)
                    rows += point_rows(point, args.target_ms)
                    torch.cuda.empty_cache()
    ratios = [r["chosen_over_auto"] for r in rows]
    floor = [r["chosen_over_chosen_again"] for r in rows]
    summary = {
        "chosen_over_auto": {"min": min(ratios), "max": max(ratios), "median": statistics.median(ratios)},
        "chosen_over_chosen_again": {"min": min(floor), "max": max(floor)},
        "chosen": sorted({r["chosen"] for r in rows}),
    }  # fmt: skip
    print(summary)
    env = bench.environment(DEVICE, args.commit)
    with open(args.output, "w") as f:
        json.dump({"env": env, "summary": summary, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
