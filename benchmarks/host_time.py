"""Host (CPU) time per attention call on a CUDA machine.

1. **Tiny call** (default; issue 17, item 3: triton_flash <= +10 us over
   ``F.scaled_dot_product_attention``): q, k, v of shape ``--shape`` (default
   (1, 1, 16, 64)), ``--dtype`` (default bf16), no gradient, as a decode step calls
   attention. Times, in interleaved rounds (a slow spell of the shared host hits every
   call alike), ``--calls`` calls of each of:

   - ``sdpa``: ``F.scaled_dot_product_attention(q, k, v)``;
   - ``triton_flash_op``: ``ops.flash_attention(q, k, v, return_lse=False)``, the
     backend's op without dispatch (what ``attnhub.attention`` runs once it has chosen);
   - ``triton_flash_op_lse``: the same returning the lse (one more output);
   - ``attnhub_pinned``: ``attnhub.attention(q, k, v, backend="triton_flash")``;
   - ``attnhub_auto``: ``attnhub.attention(q, k, v)`` (attnhub's own choice, named in
     the output).

   A kernel of this size takes a few microseconds on the GPU, so the calls are
   host-bound and the time to issue them is the host time per call. Each round issues
   the calls without waiting and synchronizes after (outside the timed loop); a call's
   time is the median over rounds (and the fastest round, beside it), and its
   overhead the median over rounds of its time minus sdpa's in the same round.
   Outputs are checked against sdpa's first. Writes ``host-time-tiny.json`` and
   ``host-time-tiny.md`` to the directory argument.
2. ``--profile``: the earlier diagnostic (enqueue against wall time and a cProfile of
   50 forward+backward calls for dense N=1K, block-sparse density 0.05, SDPA flash, and
   float_mask_probe's padded training step: no mask, float, bool, stock F.sdpa), then
   per case the forward's and the backward's host time each issued to an idle GPU,
   how many steps took triton_flash's full path instead of a launch plan, whether a
   step synchronizes (the first such operation's stack) and the CUDA runtime calls of
   one step, printed to stdout; ``--profile-only TEXT``: the cases whose name contains
   TEXT.

    python3 benchmarks/host_time.py OUT_DIR [--calls 200] [--rounds 50] [--profile]
        [--profile-only=mask]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub

CALLS = 50
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def tiny_calls(
    shape: tuple[int, ...], dtype: torch.dtype, device: str = "cuda"
) -> tuple[dict[str, Callable[[], Any]], str, torch.Tensor]:
    """The calls of the tiny section, attnhub's own choice for them, and sdpa's output."""
    from attnhub.backends.triton_flash import ops

    torch.manual_seed(0)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    calls: dict[str, Callable[[], Any]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "triton_flash_op": lambda: ops.flash_attention(q, k, v, return_lse=False)[0],
        "triton_flash_op_lse": lambda: ops.flash_attention(q, k, v)[0],
        "attnhub_pinned": lambda: attnhub.attention(q, k, v, backend="triton_flash"),
        "attnhub_auto": lambda: attnhub.attention(q, k, v),
    }
    chosen = attnhub.explain(q, k, v).chosen
    return calls, str(chosen), calls["sdpa"]()


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_tiny(
    calls: dict[str, Callable[[], Any]],
    n: int,
    rounds: int,
    device: str = "cuda",
    warmup: int = 200,
) -> dict[str, dict[str, float]]:
    """Per call: median and fastest round (us per call), and the median over rounds of
    its time minus sdpa's in the same round."""
    for fn in calls.values():  # warm up: compile, build plans, fill caches
        for _ in range(warmup):
            fn()
    _synchronize(device)
    per_round: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            per_round[name].append((time.perf_counter() - start) / n * 1e6)
    _synchronize(device)
    sdpa = per_round["sdpa"]
    return {
        name: {
            "median_us": round(statistics.median(times), 3),
            "fastest_us": round(min(times), 3),
            "over_sdpa_median_us": round(statistics.median(t - s for t, s in zip(times, sdpa)), 3),
        }
        for name, times in per_round.items()
    }


def _env(device: str) -> dict[str, Any]:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def tiny(
    out_dir: str, shape: tuple[int, ...], dtype_name: str, n: int, rounds: int, device: str = "cuda"
) -> dict:
    """The tiny section: times the calls, writes host-time-tiny.json and .md to
    ``out_dir``, prints the table and returns the report."""
    calls, chosen, reference = tiny_calls(shape, DTYPES[dtype_name], device)
    checks = {
        name: float((fn().float() - reference.float()).abs().max())
        for name, fn in calls.items()
        if name != "sdpa"
    }
    results = time_tiny(calls, n, rounds, device, warmup=200 if device.startswith("cuda") else 2)
    report = {
        "env": _env(device),
        "shape": list(shape),
        "dtype": dtype_name,
        "grad": False,
        "calls_per_round": n,
        "rounds": rounds,
        "attnhub_auto_chose": chosen,
        "max_abs_diff_vs_sdpa": checks,
        "us_per_call": results,
        "bar": "triton_flash tiny call <= +10 us over F.scaled_dot_product_attention (issue 17)",
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "host-time-tiny.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [
        f"# Host time per call, {tuple(shape)} {dtype_name}, no grad",
        "",
        f"{report['env']['gpu']}, torch {report['env']['torch']}, triton "
        f"{report['env']['triton']}, {report['env']['date']}; {rounds} interleaved rounds of "
        f"{n} calls; attnhub's own choice: {chosen}.",
        "",
        "| call | median us/call | fastest round | over sdpa (median of rounds) | max abs diff vs sdpa |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        diff = "" if name == "sdpa" else f"{checks[name]:.2e}"
        over = "" if name == "sdpa" else f"{r['over_sdpa_median_us']:+.2f}"
        lines.append(f"| {name} | {r['median_us']:.2f} | {r['fastest_us']:.2f} | {over} | {diff} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "host-time-tiny.md"), "w") as f:
        f.write(text)
    print(text)
    return report


# ---------------------------------------------------------------- --profile


def case(
    name: str,
    b: int,
    h: int,
    n: int,
    d: int,
    backend: str,
    layout: Any = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> None:
    """Enqueue against wall time of forward and forward+backward, then a cProfile.
    ``backend`` "stock": F.scaled_dot_product_attention itself (``mask`` its attn_mask)."""
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    kw: dict[str, Any] = {"backend": backend, "causal": causal}
    if layout is not None:
        kw["block_sparse"] = layout

    def call() -> torch.Tensor:
        if backend == "stock":
            return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
        return attnhub.attention(q, k, v, mask, **kw)

    def fwd() -> None:
        with torch.no_grad():
            call()

    def fwd_bwd() -> None:
        out = call()
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    for fn, mode in ((fwd, "fwd"), (fwd_bwd, "fwd_bwd")):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        enqueue = (time.perf_counter() - start) / CALLS
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / CALLS
        print(f"{name} {mode}: enqueue {enqueue * 1e3:.3f} ms/iter, wall {wall * 1e3:.3f} ms/iter")
    phases(name, call, dout, q, k, v)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        fwd_bwd()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


def _timed_step(
    call: Callable[[], torch.Tensor],
    dout: torch.Tensor,
    inputs: tuple[torch.Tensor, ...],
    times: dict[str, list[float]],
) -> None:
    """One step, its forward and its backward each issued to an idle GPU and timed."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    middle = time.perf_counter()
    torch.cuda.synchronize()
    resumed = time.perf_counter()
    out.backward(dout)
    end = time.perf_counter()
    for t in inputs:
        t.grad = None
    times["forward"].append(middle - start)
    times["backward"].append(end - resumed)


def phases(
    case_name: str, call: Callable[[], torch.Tensor], dout: torch.Tensor, *inputs: torch.Tensor
) -> None:
    """The host time of the forward and of the backward, each issued to an idle GPU
    (median of CALLS) and how many of them took triton_flash's full path instead of a
    launch plan (ops._PLANS: none should, after the warm-up), then whether a step
    synchronizes with the GPU (the first operation that does, with its stack, from
    PyTorch's sync debug mode) and the profiler's CUDA runtime calls of one step (how
    many launches, and their host time)."""
    from attnhub.backends.triton_flash import ops

    full_paths = {"_forward": 0, "_bwd_full": 0}
    originals = {function: getattr(ops, function) for function in full_paths}

    def counted(function: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            full_paths[function] += 1
            return originals[function](*args, **kwargs)

        return run

    for function in full_paths:
        setattr(ops, function, counted(function))
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    try:
        for _ in range(CALLS):
            _timed_step(call, dout, inputs, times)
    finally:
        for function, original in originals.items():
            setattr(ops, function, original)
    medians = ", ".join(f"{k} {statistics.median(v) * 1e6:.1f} us" for k, v in times.items())
    print(f"{case_name} host time to an idle GPU: {medians}; triton_flash's full path "
          f"(no launch plan) ran {full_paths['_forward']} forwards and "
          f"{full_paths['_bwd_full']} backwards in {CALLS} steps")  # fmt: skip
    torch.cuda.set_sync_debug_mode("error")
    try:
        call().backward(dout)
        print(f"{case_name}: no synchronization in a step")
    except RuntimeError as exc:
        import traceback

        print(f"{case_name}: a step synchronizes: {exc}")
        traceback.print_exc(limit=12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call().backward(dout)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith("cu")]  # cuda*, cu* calls
    summary = ", ".join(f"{e.key} x{e.count} {e.cpu_time_total:.0f} us" for e in rows)
    print(f"{case_name} CUDA runtime calls in a step: {summary}")


def profile_cases(only: str) -> None:
    """The cases whose name contains ``only`` (every case where it is empty)."""
    from float_mask_probe import padded_float_mask  # this folder's, on sys.path as a script

    from attnhub.bench import build_layout

    def padded(backend: str, kind: str | None) -> tuple:
        """float_mask_probe's training step: B8 H12 N1024 D64, finfo.min padding keys
        and rows (as a float mask, or the same as bool; None: no mask)."""
        low = torch.finfo(torch.bfloat16).min
        mask = padded_float_mask(8, 1024, torch.bfloat16, torch.Generator().manual_seed(0), low)
        masks = {None: None, "float": mask, "bool": mask > low}
        return (8, 12, 1024, 64, backend, None, False, masks[kind])

    layout = ("random", 0.05), 8192, 128
    cases: dict[str, Callable[[], tuple]] = {
        "dense D64 N1K": lambda: (16, 32, 1024, 64, "triton_flash"),
        "dense D128 N1K causal": lambda: (16, 16, 1024, 128, "triton_flash", None, True),
        "bs random 0.05": lambda: (
            2,
            16,
            8192,
            128,
            "triton_blocksparse",
            build_layout(*layout, device="cuda"),
        ),
        "sdpa flash D64 N1K": lambda: (16, 32, 1024, 64, "torch_sdpa_flash"),
        "mask none D64 B8H12": lambda: padded("triton_flash", None),
        "mask float D64 B8H12": lambda: padded("triton_flash", "float"),
        "mask bool D64 B8H12": lambda: padded("triton_flash", "bool"),
        "mask float D64 B8H12 stock": lambda: padded("stock", "float"),
    }
    for name, arguments in cases.items():
        if only in name:
            case(name, *arguments())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for host-time-tiny.json and .md")
    parser.add_argument("--shape", default="1,1,16,64", help="B,H,N,D (default %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="also the profile section")
    parser.add_argument("--profile-only", default="", metavar="TEXT",
                        help="the profile section's cases whose name contains TEXT")  # fmt: skip
    parser.add_argument("--device", default="cuda",
                        help="cuda (the measurement); cpu with TRITON_INTERPRET=1 only checks the script")  # fmt: skip
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    tiny(args.out_dir, shape, args.dtype, args.calls, args.rounds, args.device)
    if args.profile:
        profile_cases(args.profile_only)


if __name__ == "__main__":
    main()
