"""``attnhub.timing``: the timers autotune and the benchmarks share."""

from __future__ import annotations

import types

import pytest
import torch

from attnhub import timing


def test_loop_ms_divides_the_wall_time_by_the_calls(monkeypatch):
    reads = iter([10.0, 10.5])  # two clock reads: 0.5 s around the loop
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))
    calls = []
    assert timing.loop_ms(lambda: calls.append(1), torch.device("cpu"), 4) == 125.0
    assert len(calls) == 4


def test_rotated_puts_each_name_in_each_position_once_a_cycle():
    names = ("a", "b", "c")
    orders = [timing.rotated(names, r) for r in range(3)]
    assert orders == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b")]
    assert timing.rotated(names, 4) == orders[1]
    assert timing.rotated((), 2) == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_gpu_event_ms_times_the_device_work_of_one_call():
    """A kernel that spins a known number of cycles reads twice as long at twice the
    cycles; the warm-ups and every window's calls run."""
    calls = []

    def spin(cycles: int) -> None:
        calls.append(cycles)
        torch.cuda._sleep(cycles)

    short = timing.event_ms(lambda: spin(1_000_000), 5, warmup=2, windows=3)
    assert len(calls) == 2 + 3 * 5
    long = timing.event_ms(lambda: spin(2_000_000), 5, warmup=0)
    assert len(calls) == 2 + 3 * 5 + 5
    assert 0 < short < long
    assert 1.6 < long / short < 2.4
