"""The tiny call's forward+backward, auto against the kernel it is reported to run.

``benchmarks/results/workloads-h200.md`` reads ``tiny (1,1,16,64) fwd_bwd``: auto 0.397
ms against 0.257 for torch_sdpa_efficient, which auto was said to pick (0.196 / 0.152
on 2026-12-03). This times, on one (1, 1, 16, 64) bf16 input with gradients,
F.scaled_dot_product_attention, ``attention()``, and ``attention()`` pinned to
torch_sdpa_efficient and to torch_sdpa, each step a forward and ``backward``, in 15
interleaved rounds of 200 steps (minimum and median per step), and says what served
``attention()``'s steps (``attnhub.stats()``) and why (``attnhub.explain``)::

    python benchmarks/tiny_backward_probe.py
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub
from attnhub import measured
from attnhub.timing import loop_ms

_CUDA = torch.device("cuda")


def _loop_us(step: Callable[[], Any], calls: int = 200) -> float:
    return loop_ms(step, _CUDA, calls) * 1e3


def main() -> None:
    def leaf() -> torch.Tensor:
        return torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(), leaf(), leaf()
    grad = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    ways: dict[str, Callable[[], Any]] = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v).backward(grad),
        "auto": lambda: attnhub.attention(q, k, v).backward(grad),
        "torch_sdpa_efficient": lambda: attnhub.attention(
            q, k, v, backend="torch_sdpa_efficient"
        ).backward(grad),
        "torch_sdpa": lambda: attnhub.attention(q, k, v, backend="torch_sdpa").backward(grad),
    }
    for step in ways.values():
        _loop_us(step, 20)
    attnhub.reset_stats()
    ways["auto"]()
    served = attnhub.stats()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(15):
        for name, step in ways.items():
            times[name].append(_loop_us(step))
    for name, t in times.items():
        print(
            f"tiny fwd_bwd {name:22s} min {min(t):7.1f} us  median {statistics.median(t):7.1f} us"
        )
    print(f"auto's step served by: {served}")
    # What ranked it: the measurement autotune took at the first call (times, spreads).
    decision = attnhub.explain(q, k, v)
    print(decision)
    found = measured.store_for(_CUDA).get(decision.request)
    if found is not None:
        for name, ms in sorted(found.ms.items(), key=lambda item: item[1]):
            print(f"measured {name:22s} {ms * 1e3:7.1f} us  spread {found.spread.get(name, 0):.1%}")


if __name__ == "__main__":
    main()
