"""Host (CPU) time per attention call on a CUDA machine.

For each case: *enqueue* (seconds to issue 50 calls without waiting, per call) against
*wall* (the same 50 calls and a synchronize, per call), then a cProfile of 50
forward+backward calls. When enqueue is about equal to wall the call is host-bound:
the GPU waits for Python. A diagnostic for benchmarks/NOTES.md (issue 4's N=1K points,
issue 5's low densities); prints to stdout.

    python3 benchmarks/host_time.py
"""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any

import torch

import attnhub
from attnhub.bench import build_layout

CALLS = 50


def case(
    name: str,
    b: int,
    h: int,
    n: int,
    d: int,
    backend: str,
    layout: Any = None,
    causal: bool = False,
) -> None:
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    kw: dict[str, Any] = {"backend": backend, "causal": causal}
    if layout is not None:
        kw["block_sparse"] = layout

    def fwd() -> None:
        with torch.no_grad():
            attnhub.attention(q, k, v, **kw)

    def fwd_bwd() -> None:
        out = attnhub.attention(q, k, v, **kw)
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
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        fwd_bwd()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


def main() -> None:
    case("dense D64 N1K", 16, 32, 1024, 64, "triton_flash")
    case("dense D128 N1K causal", 16, 16, 1024, 128, "triton_flash", causal=True)
    layout = build_layout(("random", 0.05), 8192, 128, device="cuda")
    case("bs random 0.05", 2, 16, 8192, 128, "triton_blocksparse", layout)
    case("sdpa flash D64 N1K", 16, 32, 1024, 64, "torch_sdpa_flash")


if __name__ == "__main__":
    main()
