"""The tiny call's forward+backward: what autotune measures at the first call, against
what each backend takes in steady loops.

``benchmarks/results/workloads-h200.md`` read ``tiny (1,1,16,64) fwd_bwd``: auto 0.397
ms against 0.257 for torch_sdpa_efficient. On one (1, 1, 16, 64) bf16 input with
gradients, this makes ``attention()``'s first call (autotune measures it, into a fresh
measurement file, with the autotune settings given) and prints the measurement: each
backend's best round and spread, and what ranked first. Then it times
F.scaled_dot_product_attention, ``attention()`` and ``attention()`` pinned to each of
PyTorch's kernels, each step a forward and ``backward``, in interleaved rounds of 200
steps (minimum and median per step)::

    python benchmarks/tiny_backward_probe.py [--rounds 3] [--round-ms 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnhub
from attnhub import autotune, measured
from attnhub.timing import loop_ms

_CUDA = torch.device("cuda")
PINNED = ("torch_sdpa", "torch_sdpa_efficient", "torch_sdpa_flash", "torch_sdpa_cudnn")


def _loop_us(step: Callable[[], Any], calls: int = 200) -> float:
    return loop_ms(step, _CUDA, calls) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=autotune.ROUNDS)
    parser.add_argument("--round-ms", type=float, default=autotune.ROUND_MS)
    parser.add_argument("--steady-rounds", type=int, default=15)
    args = parser.parse_args()
    autotune.ROUNDS, autotune.ROUND_MS = args.rounds, args.round_ms
    scratch = tempfile.mkdtemp()
    os.environ["ATTNHUB_MEASUREMENTS"] = str(Path(scratch) / "measured.json")
    measured.forget_stores()

    def leaf() -> torch.Tensor:
        return torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    q, k, v = leaf(), leaf(), leaf()
    grad = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    attnhub.attention(q, k, v).backward(grad)  # the first call: autotune measures
    decision = attnhub.explain(q, k, v)
    found = measured.store_for(_CUDA).get(decision.request)
    print(f"autotune ROUNDS={args.rounds} ROUND_MS={args.round_ms}: chose {decision.chosen}")
    if found is not None:
        for name, ms in sorted(found.ms.items(), key=lambda item: item[1]):
            print(f"measured {name:22s} {ms * 1e3:7.1f} us  spread {found.spread.get(name, 0):.1%}")

    def pinned(name: str) -> Callable[[], Any]:
        return lambda: attnhub.attention(q, k, v, backend=name).backward(grad)

    ways: dict[str, Callable[[], Any]] = {
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v).backward(grad),
        "auto": lambda: attnhub.attention(q, k, v).backward(grad),
        **{name: pinned(name) for name in PINNED},
    }
    for step in ways.values():
        _loop_us(step, 20)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.steady_rounds):
        for name, step in ways.items():
            times[name].append(_loop_us(step))
    for name, t in times.items():
        print(f"steady {name:22s} min {min(t):7.1f} us  median {statistics.median(t):7.1f} us")


if __name__ == "__main__":
    main()
