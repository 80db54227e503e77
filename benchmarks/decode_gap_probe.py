"""Where a decode call's time goes: PyTorch's own call against attnhub's, one shape.

``benchmarks/results/workloads-h200.md`` has ``decode 4K D128 GQA 32/8`` (B 8, Hq 32 /
Hkv 8, Nq 1, Nk 4096, D 128) at 39.8 us a call through F.scaled_dot_product_attention
and 45.1 us through ``attention(backend="torch_sdpa")``, which calls the same function:
more than attnhub's per-call overhead (about 2 us, ``benchmarks/overhead.py``). This
probe times each way of making that call three ways, interleaved over rounds (the
fastest round of each is printed):

- ``enqueue``: host time per call of a loop, until its last call returns (what the
  host pays; the loop is short enough that the launch queue never fills);
- ``wall``: until the device has finished the loop (what the bench reports: the
  larger of host and device time, roughly);
- ``device``: CUDA-event time per call of the loop (the kernels, and the gaps between
  them where the host falls behind);

and lists the CUDA kernels one call launches (``torch.profiler``)::

    python benchmarks/decode_gap_probe.py [--shape 8,32,8,4096,128] [--calls 200] \
        [--layers] [--profile N [--profile-ways triton_flash,backend=None]]

``--layers``: also triton_flash's decode path timed from each of its layers down (the
backend's runner, its general dense-decode entry, ``decode_attention``, the lengths,
its cached plan, the plan's split launch alone, and ``torch.empty`` of the output):
what each layer adds to the launch.

``--profile N``: also a cProfile of one loop of each way whose name contains one of
``--profile-ways`` (the N functions with the most own time): where a way's host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub


def _ways(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], Any]]:
    gqa = q.shape[1] != k.shape[1]
    sdpa = F.scaled_dot_product_attention
    ways: dict[str, Callable[[], Any]] = {
        "F.sdpa(enable_gqa)": lambda: sdpa(q, k, v, enable_gqa=gqa),
        # As attnhub bench --workloads calls it.
        "F.sdpa(attn_mask=None, is_causal=False, enable_gqa)": lambda: sdpa(
            q, k, v, attn_mask=None, is_causal=False, enable_gqa=gqa
        ),
    }
    for backend in ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_cudnn", "triton_flash", None):
        if backend is not None and attnhub.get_registry().unavailable_reason(backend):
            continue
        try:  # as the workloads bench calls it: decode is bottom-right causal
            attnhub.attention(q, k, v, None, causal=True, alignment="bottom_right", backend=backend)
        except attnhub.NoBackendError:
            continue
        ways[f"attention(causal, bottom_right, backend={backend})"] = (
            lambda backend=backend: attnhub.attention(
                q, k, v, None, causal=True, alignment="bottom_right", window=None, backend=backend
            )
        )  # fmt: skip
    ways["attention(backend=torch_sdpa), defaults"] = lambda: attnhub.attention(
        q, k, v, backend="torch_sdpa"
    )
    return ways


def _triton_layers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    """triton_flash's decode path entered at each of its layers (module docstring)."""
    from attnhub.backends.triton_flash import decode, serving
    from attnhub.request import AttentionParams

    params = AttentionParams(causal=True, alignment="bottom_right", scale=q.shape[-1] ** -0.5)
    lengths = serving._full_lengths(k)
    decode.decode_attention(q, k, v, lengths, scale=params.scale)  # records the plan
    plan = decode._PLANS[decode._plan_key(q, k, v, lengths, None, None, params.scale, None, None, True, None)]  # fmt: skip
    out = torch.empty(plan.out_shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
    strides = decode._input_strides(q, k, v, None, (0, 0))
    runner = serving.dense_decode_runner(params)
    layers: dict[str, Callable[[], Any]] = {
        "  serving.dense_decode_runner(params)": lambda: runner(q, k, v, None),
        "  serving.forward_dense_decode": lambda: serving.forward_dense_decode(q, k, v, None, params),
        "  decode.decode_attention (full lengths given)": lambda: decode.decode_attention(
            q, k, v, lengths, scale=params.scale
        ),
        "  serving._full_lengths": lambda: serving._full_lengths(k),
        "  the cached plan": lambda: plan(q, k, v, lengths, None, None, False),
        "  the plan's split launch alone": lambda: plan.split.with_leading(
            strides, q, k, v, lengths, lengths, out, out, lse, lse, q
        ),
        "  torch.empty of the output": lambda: torch.empty(
            plan.out_shape, device=q.device, dtype=q.dtype
        ),
    }  # fmt: skip
    if plan.part_numel:  # a split call: its launch alone needs partials and a merge
        del layers["  the plan's split launch alone"]
    return layers


def _loop_us(fn: Callable[[], Any], calls: int) -> tuple[float, float, float]:
    """(enqueue, wall, device) microseconds per call of one loop of ``calls`` calls."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    finished = time.perf_counter()
    per_call = 1e6 / calls
    return (
        (enqueued - start) * per_call,
        (finished - start) * per_call,
        begin.elapsed_time(end) * 1e-3 * per_call,
    )


def _kernels(fn: Callable[[], Any]) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        f"{e.key[:90]} ({e.device_time_total / max(e.count, 1):.1f} us)"
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,32,8,4096,128", help="B,Hq,Hkv,Nk,D")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--profile-ways", default="triton_flash,backend=None")
    args = parser.parse_args()
    b, hq, hkv, nk, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    ways = _ways(q, k, v)
    if args.layers and "attention(causal, bottom_right, backend=triton_flash)" in ways:
        ways.update(_triton_layers(q, k, v))
    for fn in ways.values():  # warm: autotune, caches, cuDNN plans
        for _ in range(20):
            fn()
    best: dict[str, list[float]] = {name: [float("inf")] * 3 for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            best[name] = [min(a, x) for a, x in zip(best[name], _loop_us(fn, args.calls))]
    print(f"q {tuple(q.shape)} k/v {tuple(k.shape)} bf16, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; per call, fastest of {args.rounds} rounds of {args.calls}")  # fmt: skip
    print(f"{'way':<62} {'enqueue us':>10} {'wall us':>8} {'device us':>9}")
    for name, (enqueue, wall, device) in best.items():
        print(f"{name:<62} {enqueue:>10.1f} {wall:>8.1f} {device:>9.1f}")
    kernels = {name: _kernels(fn) for name, fn in ways.items()}
    for name, names in kernels.items():
        print(f"{name}:\n  " + "\n  ".join(names))
    if args.profile:
        for name, fn in ways.items():
            if any(part in name for part in args.profile_ways.split(",")):
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    fn()
                profiler.disable()
                torch.cuda.synchronize()
                print(f"\n## {name}: cProfile of {args.calls} calls, by own time")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "best_us": best, "kernels": kernels}, f, indent=1)


if __name__ == "__main__":
    main()
