"""Which backends ran: :func:`stats` counts the calls each backend served.

Counting is on the hot path (once per attention call), so it costs one thread-local
lookup and one dict update, with no lock: every thread counts into its own dict, and
:func:`stats` adds the dicts up. :func:`reset_stats` does not touch other threads'
dicts (that would race with their updates); it records the current totals as a
baseline that later :func:`stats` calls subtract.

Calls inside a ``torch.compile``-d graph are not counted: the choice is made once, at
trace time, and the compiled graph runs the chosen kernel without passing through
attnhub's Python code. Calls that :func:`attnhub.patch` hands to PyTorch's original
function are counted under :data:`ORIGINAL`.
"""

from __future__ import annotations

import threading

ORIGINAL = "pytorch_original"
"""The name under which patched calls that went to PyTorch's own function are counted."""

local = threading.local()  # .counts: this thread's dict (api's per-call path reads it)
_thread_counts: list[dict[str, int]] = []
_baseline: dict[str, int] = {}
_lock = threading.Lock()


def new_thread_counts() -> dict[str, int]:
    """A new, empty counts dict for the calling thread (``local.counts``), the one
    :func:`attnhub.stats` sums with the others; the api's per-call path makes its
    thread's first with it (it reads ``local.counts`` itself, inlined)."""
    counts: dict[str, int] = {}
    with _lock:
        _thread_counts.append(counts)
    local.counts = counts
    return counts


def record(name: str) -> None:
    """Count one call served by backend ``name`` (in the calling thread's own dict)."""
    counts = getattr(local, "counts", None)
    if counts is None:
        counts = new_thread_counts()
    counts[name] = counts.get(name, 0) + 1


def _totals() -> dict[str, int]:
    totals: dict[str, int] = {}
    with _lock:
        per_thread = list(_thread_counts)
    for counts in per_thread:
        # dict(counts) copies under the GIL in one C call, so a concurrent update in
        # the owning thread cannot break the iteration.
        for name, n in dict(counts).items():
            totals[name] = totals.get(name, 0) + n
    return totals


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
