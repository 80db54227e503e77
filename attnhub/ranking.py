"""Ranking eligible backends: the policy interface and the declared-priority order.

A :class:`RankingPolicy` orders the backends that can serve a request, best first,
each with a sentence saying why it is placed there. :class:`DeclaredPriority` is the
order that needs no measurement; :mod:`attnhub.cost_table` ranks by measured time on
top of it, and :mod:`attnhub.dispatch` asks the active policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .backend import Backend
from .request import AttentionRequest

__all__ = ["DeclaredPriority", "RankingPolicy"]


class RankingPolicy(Protocol):
    """Orders eligible backends; returns (backend, why it is placed there) pairs, best first.

    ``rank`` must return every backend of ``eligible`` exactly once (a list of pairs);
    anything else, or an exception, makes dispatch rank that decision by the declared
    priority instead, with a warning. ``torch_reference`` is not passed where the
    caller did not name it: dispatch ranks it last itself (see the module docstring).
    """

    name: str

    def rank(
        self, request: AttentionRequest, eligible: Sequence[Backend]
    ) -> list[tuple[Backend, str]]: ...


class DeclaredPriority:
    """Linear memory before quadratic, then higher ``priority``, then name: deterministic."""

    name = "declared priority"

    def rank(
        self, request: AttentionRequest, eligible: Sequence[Backend]
    ) -> list[tuple[Backend, str]]:
        ordered = sorted(
            eligible,
            key=lambda b: (b.memory_class(request) != "linear", -b.priority, b.name),
        )
        return [(b, f"{b.memory_class(request)} memory, priority {b.priority}") for b in ordered]
