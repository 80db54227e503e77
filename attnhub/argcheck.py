"""Checks of plain Python arguments shared by attnhub's helpers (block-sparse layouts,
the paged KV cache, context-parallel shards): each raises a ``TypeError`` or
``ValueError`` naming the argument. The attention calls' own checks are in
:mod:`attnhub.validation`."""

from __future__ import annotations

from typing import Any


def _int(name: str, value: Any) -> int:
    """``value``, an int (not a bool): else a TypeError naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def int_at_least(name: str, value: Any, low: int) -> int:
    """``value``, an int (not a bool) >= ``low``: else a TypeError or ValueError naming
    ``name``."""
    if _int(name, value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def index_below(name: str, value: Any, count: int) -> int:
    """``value``, an int index in [0, ``count``) (a negative one is refused, not taken
    from the end): else a TypeError or ValueError naming ``name``."""
    if not 0 <= _int(name, value) < count:
        raise ValueError(f"{name} must be in [0, {count}), got {value}")
    return value
