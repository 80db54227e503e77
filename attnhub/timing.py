"""What timing a call needs, shared by autotune (runtime) and the benchmarks (tooling)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop_ms(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Wall-clock milliseconds per call of ``calls`` calls of ``fn`` in a row, host time
    included, the device synchronized at both ends."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls * 1e3


def event_ms(fn: Callable[[], Any], iters: int, *, warmup: int = 3, windows: int = 1) -> float:
    """Device milliseconds per call of ``fn`` on the current CUDA device: CUDA events
    around ``iters`` calls in a row, after ``warmup`` calls; with ``windows`` > 1 the
    fastest of that many such windows, which keeps the host's noise out of a probe.
    Host time shows only where it starves the device (use ``loop_ms`` to count it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(windows):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def rotated(names: Sequence[str], repeat: int) -> tuple[str, ...]:
    """``names`` starting from the ``repeat``-th (modulo their number): timed in this
    order round by round, each competitor runs in each position equally often over a
    multiple of ``len(names)`` rounds, so that a host or clock that drifts during a run
    favours none of them."""
    start = repeat % len(names) if names else 0
    return (*names[start:], *names[:start])
