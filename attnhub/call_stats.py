"""Which backends ran: :func:`stats` counts the calls each backend served.

Counting is on the hot path (once per attention call), so a call costs one C call:
each backend name has an ``itertools.count``, and a decided call keeps its backend's
bound ``__next__`` (:func:`counter`) and calls it. Advancing a count is a single C
function, atomic under the GIL (the way ``threading`` numbers its threads), so no lock
is taken and no thread's count is lost. It replaced a per-thread dict updated from
Python: the repeated tiny ``attention()`` call's overhead over F.sdpa went from 12,313
to 11,519 instructions (callgrind, dev CPU).
:func:`reset_stats` records the current totals as a baseline that later :func:`stats`
calls subtract.

Calls inside a ``torch.compile``-d graph are not counted: the choice is made once, at
trace time, and the compiled graph runs the chosen kernel without passing through
attnhub's Python code. Calls that :func:`attnhub.patch` hands to PyTorch's original
function are counted under :data:`ORIGINAL`.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

ORIGINAL = "pytorch_original"
"""The name under which patched calls that went to PyTorch's own function are counted."""

_counters: dict[str, Callable[[], int]] = {}  # name -> its itertools.count().__next__
_baseline: dict[str, int] = {}
_lock = threading.Lock()
_is_compiling = torch.compiler.is_compiling


def counter(name: str) -> Callable[[], int]:
    """The function that counts one call served by backend ``name`` (no arguments):
    what a decided call keeps and calls on each use."""
    count = _counters.get(name)
    if count is None:
        with _lock:
            count = _counters.setdefault(name, itertools.count().__next__)
    return count


def record(name: str) -> None:
    """Count one call served by backend ``name`` (none while torch.compile traces: the
    module docstring; Dynamo cannot trace the count either, it raised an internal error
    in a compiled serving call, whose decision ran eagerly at a graph break)."""
    if _is_compiling():
        return
    counter(name)()


def _value(count: Callable[[], int]) -> int:
    # An itertools.count tells its next value only through its repr, "count(N)"
    # (reading it with next() would advance it).
    text = repr(count.__self__)  # type: ignore[attr-defined]
    return int(text[text.index("(") + 1 : -1])


def _totals() -> dict[str, int]:
    with _lock:
        counters = dict(_counters)
    return {name: _value(count) for name, count in counters.items()}


def stats() -> dict[str, int]:
    """Calls served per backend name since the last :func:`reset_stats`, sorted by name.

    A fresh dict; names that served nothing since the reset are left out. Patched calls
    that went to PyTorch's own function appear under ``"pytorch_original"``.
    """
    totals = _totals()
    with _lock:
        baseline = dict(_baseline)
    counts = {name: n - baseline.get(name, 0) for name, n in totals.items()}
    return {name: counts[name] for name in sorted(counts) if counts[name] > 0}


def reset_stats() -> None:
    """Start counting from zero (for every thread)."""
    totals = _totals()
    with _lock:
        _baseline.clear()
        _baseline.update(totals)
