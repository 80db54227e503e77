"""The row blocks' program order (HEAVY_FIRST) A/B: triton_flash's causal forward and
backward with the last row block first and in grid order, beside PyTorch's flash (FA2)
and cuDNN kernels and FlexAttention, in one process.

Under a causal band the last row blocks walk the most keys; in grid order each head's
heaviest block starts last, so the grid can end on one heavy program running alone
(``common._row_block``; ``ops._heavy_first`` turns the reversed order on for causal
calls). Each way runs through ``attnhub.attention(backend=...)``; the two triton_flash
ways differ only by ``tuning.override(heavy_first=...)``, and their outputs and
gradients must be bitwise equal (checked). Times are CUDA events (the fastest window of
each round, the fastest round), the ways interleaved in a rotating order each round::

    python benchmarks/row_order_probe.py [--shapes "16,16,1024,128;4,16,4096,128"] \
        [--dtypes bf16,fp16] [--rounds 3] [--json FILE]

The defaults are the benchmark grid's causal points (B = 16384 / N, H = 16) and issue
19's head-dim-256 point (B4 H8 N4096).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

import torch

import attnhub
from attnhub.backends.triton_flash import tuning
from attnhub.timing import event_ms, rotated

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SHAPES = ";".join(
    [f"{16384 // n},16,{n},{d}" for d in (64, 128) for n in (1024, 4096, 16384)] + ["4,8,4096,256"]
)
# name -> (backend, heavy_first override or None)
WAYS: dict[str, tuple[str, bool | None]] = {
    "heavy_first": ("triton_flash", True),
    "grid_order": ("triton_flash", False),
    "fa2": ("torch_sdpa_flash", None),
    "cudnn": ("torch_sdpa_cudnn", None),
    "flex": ("flex_attention", None),
}


def _scope(heavy: bool | None) -> contextlib.AbstractContextManager[Any]:
    return tuning.override(heavy_first=heavy) if heavy is not None else contextlib.nullcontext()


def _steps(way: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor):  # type: ignore[no-untyped-def]
    """(forward, backward) callables of one way; the backward reuses one forward's graph."""
    backend, heavy = WAYS[way]

    def forward() -> torch.Tensor:
        # With grad enabled, as the grid bench times forwards.
        with _scope(heavy):
            return attnhub.attention(q, k, v, causal=True, backend=backend)  # type: ignore[no-any-return]

    with _scope(heavy):
        out = attnhub.attention(q, k, v, causal=True, backend=backend)

    def backward() -> tuple[torch.Tensor, ...]:
        with _scope(heavy):
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

    return forward, backward


def _iters(fn: Any) -> int:
    """Calls per timing window: about 40 ms of device time, 5..200 calls."""
    ms = event_ms(fn, 3)
    return max(5, min(200, int(40 / max(ms, 1e-3))))


def probe(b: int, h: int, n: int, d: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))  # fmt: skip
    g = torch.randn_like(q)
    ways, skipped = {}, {}
    for way in WAYS:
        try:
            ways[way] = _steps(way, q, k, v, g)
            ways[way][1]()
        except Exception as error:  # a backend this machine lacks: reported, not fatal
            skipped[way] = f"{type(error).__name__}: {str(error)[:160]}"
    # The two orders must agree bit for bit (outputs and gradients).
    same = all(
        torch.equal(a, c)
        for a, c in zip(
            (ways["heavy_first"][0](), *ways["heavy_first"][1]()),
            (ways["grid_order"][0](), *ways["grid_order"][1]()),
        )
    )
    ref = ways["fa2"][0]() if "fa2" in ways else None
    diff = (
        (ways["heavy_first"][0]().float() - ref.float()).abs().max().item()
        if ref is not None
        else None
    )
    best: dict[str, dict[str, float]] = {"fwd": {}, "bwd": {}}
    iters = {(way, mode): _iters(ways[way][i]) for way in ways for i, mode in enumerate(best)}
    for r in range(rounds):
        for way in rotated(list(ways), r):
            for i, mode in enumerate(best):
                ms = event_ms(ways[way][i], iters[way, mode], warmup=2, windows=2)
                best[mode][way] = min(best[mode].get(way, float("inf")), ms)
    flops = {"fwd": 4 * b * h * n * n * d / 2, "bwd": 2.5 * 4 * b * h * n * n * d / 2}
    return {
        "shape": [b, h, n, d], "dtype": str(dtype).removeprefix("torch."), "causal": True,
        "bitwise_same_orders": same, "max_abs_diff_vs_fa2": diff, "skipped": skipped,
        "ms": best,
        "tflops": {m: {w: flops[m] / t / 1e9 for w, t in best[m].items()} for m in best},
    }  # fmt: skip


def _line(row: dict[str, Any], mode: str) -> str:
    t = row["tflops"][mode]
    hf = t["heavy_first"]
    ratios = [f"heavy/grid {hf / t['grid_order']:.3f}"] + [
        f"heavy/{w} {hf / t[w]:.2f}" for w in ("fa2", "cudnn", "flex") if w in t
    ]
    cells = " ".join(f"{w} {x:.0f}" for w, x in t.items())
    b, h, n, d = row["shape"]
    return f"{row['dtype']} B{b} H{h} N{n} D{d} causal {mode}: {cells} TFLOP/s | " + ", ".join(
        ratios
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="B,H,N,D;... (default: the grid's)"
    )
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, attnhub {attnhub.__version__}"
    )
    rows = []
    for dtype_name in args.dtypes.split(","):
        for text in args.shapes.split(";"):
            b, h, n, d = (int(x) for x in text.split(","))
            row = probe(b, h, n, d, DTYPES[dtype_name], args.rounds)
            rows.append(row)
            for mode in ("fwd", "bwd"):
                print(_line(row, mode))
            print(f"    orders bitwise equal: {row['bitwise_same_orders']}; max |out - fa2| "
                  f"{row['max_abs_diff_vs_fa2']}; skipped: {row['skipped'] or 'nothing'}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
