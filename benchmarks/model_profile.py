"""Where a model's step spends its GPU time: attention kernels against everything else.

``attnhub bench --models`` gives tokens per second; this says why a ratio is what it is.
For each model and way (stock ``sdpa``, ``patch``, ``attn_implementation="attnhub"``)
it runs one warm training step (or ``generate``) under ``torch.profiler`` and sums the
CUDA kernels' device time, split into attention kernels (names matched by
``ATTENTION_KERNELS``) and the rest, with the heaviest kernels listed. Kernel time, not
wall clock: host gaps (launch overhead, Python) show as the difference between the
step's wall clock and the kernels' sum.

    python benchmarks/model_profile.py [--models gemma2-window1024-softcap50] [--host-top 40] \
        [--task train|generate|generate_padded|prefill_padded] [--top 8] [--json FILE]

``prefill_padded``: one forward of generate_padded's left-padded prompts under no_grad.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import re
import time
from collections import defaultdict
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from attnhub import bench_models as bm

# Kernel names of the attention implementations the ways can run: PyTorch's flash,
# efficient and cuDNN kernels, attnhub's Triton kernels, FlexAttention's, and the math
# path's softmax (stock's masked calls on the math kernel run bmm + softmax: the bmm
# shows under "other"; the softmax is the marker).
ATTENTION_KERNELS = re.compile(
    r"flash|fmha|attn|attention|cudnn_generated|sdpa|_fwd_kernel|_bwd_|triton_tem|softmax",
    re.IGNORECASE,
)


TASKS = ("train", "generate", "generate_padded", "prefill_padded")

# Unprofiled runs timed per way; the fastest is its wall clock (one run drifts by tens
# of percent on the shared host, 2026-12-02).
WALL_REPEATS = 3


def _kernels(prof: Any) -> dict[str, float]:
    """Device microseconds per kernel name over the profile."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key] += event.self_device_time_total
    return totals


def _host_profile(fn: Any, top: int) -> list[tuple[str, int, float, float]]:
    """cProfile of one run of ``fn``: the ``top`` functions by cumulative time, as
    (function, calls, own ms, cumulative ms). Where a way's host time goes, beside the
    kernels' device time."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [
        (f"{pstats.func_std_string(func)}", calls, own * 1e3, cumulative * 1e3)
        for func, (_, calls, own, cumulative, _) in stats.items()
    ]
    return sorted(rows, key=lambda r: -r[3])[:top]


def _prefill(model: Any, prompts: torch.Tensor, mask: torch.Tensor) -> None:
    """One forward of the left-padded prompts under no_grad: a padded generate's
    prefill (a (B, 1, N, N) mask that the patch reads for its structure)."""
    with torch.no_grad():
        model(prompts, attention_mask=mask)


def profile_way(
    spec: bm.ModelSpec,
    way: str,
    task: str,
    device: torch.device,
    top: int,
    host_top: int = 0,
) -> dict[str, Any]:
    ids, generate = bm._inputs(spec, 32000, device)
    model, implementation = bm.build(spec, way, torch.bfloat16, device, 32000)
    if task == "train":
        fn = functools.partial(bm._train_step, model, ids)
    elif task == "prefill_padded":
        fn = functools.partial(_prefill, model, *generate["generate_padded"])
    else:
        fn = functools.partial(bm._generate, model, *generate[task], spec.new_tokens)
    with bm._context(way):
        fn()
        fn()
        walls = []
        for _ in range(WALL_REPEATS):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - start)
        wall = min(walls)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        host = _host_profile(fn, host_top) if host_top else []
    totals = _kernels(prof)
    attention = {k: v for k, v in totals.items() if ATTENTION_KERNELS.search(k)}
    heaviest = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {
        "model": spec.name, "way": way, "implementation": implementation, "task": task,
        "wall_ms": wall * 1e3, "kernels_ms": sum(totals.values()) / 1e3,
        "attention_ms": sum(attention.values()) / 1e3,
        "attention_kernels": {k: v / 1e3 for k, v in sorted(attention.items(), key=lambda kv: -kv[1])},
        "heaviest": [(k, v / 1e3) for k, v in heaviest],
        "host": host,
    }  # fmt: skip


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | task | way | wall ms | kernels ms | attention ms | other kernels ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['task']} | {r['way']} | {r['wall_ms']:.1f} | {r['kernels_ms']:.1f} | "
            f"{r['attention_ms']:.1f} | {r['kernels_ms'] - r['attention_ms']:.1f} |"
        )
    for r in rows:
        lines += ["", f"{r['model']} {r['task']} {r['way']}: attention kernels (ms)"]
        lines += [f"- {v:.2f} {k[:110]}" for k, v in list(r["attention_kernels"].items())[:6]]
        lines += ["  heaviest kernels (ms):"]
        lines += [f"  - {v:.2f} {k[:110]}" for k, v in r["heaviest"]]
        if r["host"]:
            lines += ["  host (cProfile of one run): calls, own ms, cumulative ms, function:"]
            lines += [f"  - {n} {own:.1f} {cum:.1f} {f[-110:]}" for f, n, own, cum in r["host"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma2-window1024-softcap50")
    parser.add_argument("--task", choices=TASKS, default="train")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--host-top",
        type=int,
        default=0,
        help="also cProfile one run per way, listing this many functions",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    names = args.models.split(",")
    specs = [m for m in bm.MODELS if m.name in names]
    rows = []
    for spec in specs:
        for way in bm.WAYS:
            rows.append(profile_way(spec, way, args.task, device, args.top, args.host_top))
            torch.cuda.empty_cache()  # the way's model is gone with profile_way's frame
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
