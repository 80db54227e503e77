"""What timing a call needs, shared by autotune (runtime) and the benchmarks (tooling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotated(names: Sequence[str], repeat: int) -> tuple[str, ...]:
    """``names`` starting from the ``repeat``-th (modulo their number): timed in this
    order round by round, each competitor runs in each position equally often over a
    multiple of ``len(names)`` rounds, so that a host or clock that drifts during a run
    favours none of them."""
    start = repeat % len(names) if names else 0
    return (*names[start:], *names[:start])
