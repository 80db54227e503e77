"""Choosing a backend: filter by reasons, rank the eligible, explain the result.

``decide(request, selection)`` returns a :class:`Decision` holding every registered
backend with its reasons and the chosen one with why it ranked first. Decisions are
cached per (request, selection); the request is the only thing dispatch reads about a
call.

Ranking is explicit and deterministic, independent of registration order:

1. where the caller named backends (``backend=``, :func:`use_backend`,
   ``ATTNHUB_BACKEND``), their order;
2. otherwise the active :class:`RankingPolicy`. The default ranks linear-memory
   backends before quadratic ones, then by declared ``priority``, then by name. A
   measured cost table for the request's device class replaces it where one exists
   (:mod:`attnhub.cost_table`; ``ATTNHUB_RANKING=priority`` turns that off), and any
   policy plugs in through :func:`set_policy`.

Choosing ``torch_reference`` when it was not asked for by name is a *fallback*: it is
logged once per request at WARNING, and strict mode (``use_backend(strict=True)`` or
``ATTNHUB_STRICT=1``) raises :class:`NoBackendError` instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .backend import Backend, declared_reasons
from .errors import NoBackendError
from .registry import BackendRegistry, get_registry
from .request import AttentionRequest

log = logging.getLogger("attnhub")

REFERENCE = "torch_reference"


@dataclass(frozen=True)
class Selection:
    """Which backends the caller allows, in preference order (None: all), and strictness."""

    names: tuple[str, ...] | None = None
    strict: bool = False
    source: str = "default"


_DEFAULT_SELECTION = Selection()
_context_selection: contextvars.ContextVar[Selection | None] = contextvars.ContextVar(
    "attnhub_selection", default=None
)


def _parse_names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


# os.environ.get encodes the key and decodes the value on every call (about 0.7 us);
# CPython's posix os.environ keeps its raw bytes in ``_data``, which stays in sync
# with os.environ and monkeypatch.setenv. Read that where it exists: the per-call
# path looks ``ENVIRONMENT_KEYS`` up with ``environment_get`` (a bound dict.get).
_ENV_DATA: Any = getattr(os.environ, "_data", None)
ENVIRONMENT_KEYS: tuple[Any, Any] = ("ATTNHUB_BACKEND", "ATTNHUB_STRICT")
if isinstance(_ENV_DATA, dict):
    ENVIRONMENT_KEYS = (
        os.environ.encodekey(ENVIRONMENT_KEYS[0]),
        os.environ.encodekey(ENVIRONMENT_KEYS[1]),
    )
    environment_get = _ENV_DATA.get
else:  # pragma: no cover - non-CPython or a platform without _data
    environment_get = os.environ.get


def environment_selection() -> Selection | None:
    """``ATTNHUB_BACKEND=a,b`` and ``ATTNHUB_STRICT=1``, read on every call."""
    names = os.environ.get("ATTNHUB_BACKEND")
    strict = os.environ.get("ATTNHUB_STRICT", "") not in ("", "0")
    if not names and not strict:
        return None
    return Selection(_parse_names(names) if names else None, strict, "ATTNHUB_BACKEND")


def normalize_backend_arg(backend: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``backend=`` as a tuple of names (None: no restriction)."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return (backend,)
    if isinstance(backend, Sequence) and all(isinstance(b, str) for b in backend) and backend:
        return tuple(backend)
    raise TypeError(f"backend must be None, a backend name or a sequence of names, got {backend!r}")


def current_selection(backend: str | Sequence[str] | None = None) -> Selection:
    """The selection in force for one call: the argument, else the context, else the env."""
    context = _context_selection.get()
    env = environment_selection()
    strict = any(s is not None and s.strict for s in (context, env))
    names = normalize_backend_arg(backend)
    if names is not None:
        return Selection(names, strict, "backend=")
    for outer in (context, env):
        if outer is not None and outer.names is not None:
            return Selection(outer.names, strict, outer.source)
    return Selection(None, strict, "default") if strict else _DEFAULT_SELECTION


@contextlib.contextmanager
def use_backend(*names: str | Sequence[str], strict: bool = False) -> Iterator[None]:
    """Restrict and order the backends for the calls inside the block.

    ``use_backend("triton_flash", "torch_sdpa")`` lets only those two serve, the first
    eligible one winning. ``use_backend(strict=True)`` changes no choice but raises
    instead of falling back to ``torch_reference``. Thread- and task-local
    (a ``contextvars.ContextVar``); an explicit ``backend=`` argument overrides it.

    Under ``torch.compile`` the selection in force while the function is *traced* is
    the one that counts: it is baked into the compiled graph.
    """
    flat: list[str] = []
    for item in names:
        flat.extend([item] if isinstance(item, str) else list(item))
    registry = get_registry()
    for name in flat:
        registry.get(name)  # ValueError listing the known names
    outer = _context_selection.get()
    selection = Selection(
        tuple(flat) if flat else (outer.names if outer else None),
        strict or bool(outer and outer.strict),
        "use_backend",
    )
    token = _context_selection.set(selection)
    try:
        yield
    finally:
        _context_selection.reset(token)


# -- ranking -------------------------------------------------------------------


class RankingPolicy(Protocol):
    """Orders eligible backends; returns (backend, why it is placed there) pairs, best first."""

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


_policy: RankingPolicy | None = None  # None: the default, per device class


def set_policy(policy: RankingPolicy | None) -> None:
    """Install a ranking policy and clear decisions.

    None restores the default: the measured cost table of the request's device class
    where one exists (:func:`attnhub.cost_table.default_policy`), else the declared
    priority.
    """
    global _policy
    _policy = policy
    clear_cache()


def _active_policy(request: AttentionRequest) -> RankingPolicy:
    if _policy is not None:
        return _policy
    from .cost_table import default_policy  # imported at the first decision, not at import

    return default_policy(request)


# -- decisions -----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    name: str
    origin: str
    reasons: tuple[str, ...]
    rank: int | None = None  # 1 = chosen, among eligible backends
    note: str = ""

    @property
    def eligible(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Decision:
    """The outcome of dispatch for one request: printable as a table."""

    request: AttentionRequest
    selection: Selection
    chosen: str | None
    candidates: tuple[Candidate, ...]
    why: str
    fallback: bool = False
    policy: str = field(default="declared priority")

    @property
    def signature(self) -> str:
        return "attention(" + self.request.describe() + ")"

    def reasons(self) -> dict[str, list[str]]:
        return {c.name: list(c.reasons) for c in self.candidates}

    def __str__(self) -> str:
        rows = [("backend", "origin", "status", "reasons / rank")]
        for c in sorted(self.candidates, key=lambda c: (c.rank is None, c.rank or 0, c.name)):
            if c.name == self.chosen:
                status = "CHOSEN"
            elif c.eligible:
                status = f"eligible #{c.rank}" if c.rank else "eligible"
            else:
                status = "rejected"
            rows.append((c.name, c.origin, status, "; ".join(c.reasons) or c.note))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [self.signature]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[3])
        lines.append(f"chosen: {self.chosen} ({self.why})" if self.chosen else "chosen: none")
        return "\n".join(lines)

    __repr__ = __str__

    def error(self) -> NoBackendError:
        if self.selection.names is not None:
            asked = ", ".join(self.selection.names)
            headline = f"no backend among those asked for ({asked}, via {self.selection.source}) can serve this call"
        else:
            headline = "no registered backend can serve this call"
        if self.fallback:
            headline = f"strict mode: only {REFERENCE} (the slow reference) can serve this call"
        reasons = [(c.name, c.reasons) for c in sorted(self.candidates, key=lambda c: c.name)]
        return NoBackendError(headline, self.signature, reasons)


def _reasons(registry: BackendRegistry, backend: Backend, request: AttentionRequest) -> list[str]:
    why = registry.unavailable_reason(backend.name)
    if why is not None:
        return [f"unavailable: {why}"]
    reasons = declared_reasons(backend, request)
    if not reasons:
        reasons = list(backend.extra_reasons(request))
    return reasons


def _decide(registry: BackendRegistry, request: AttentionRequest, selection: Selection) -> Decision:
    reasons = {b.name: _reasons(registry, b, request) for b in registry.backends()}
    allowed = selection.names
    if allowed is not None:
        for name in allowed:
            registry.get(name)  # unknown name: ValueError listing the known ones
        for name in reasons:
            if name not in allowed and not reasons[name]:
                reasons[name] = [f"not selected ({selection.source} allows {', '.join(allowed)})"]
        eligible = [registry.get(n) for n in allowed if not reasons[n]]
        ranked = [(b, f"first eligible in the order given by {selection.source}") for b in eligible]
        policy_name = selection.source
    else:
        eligible = [b for b in registry.backends() if not reasons[b.name]]
        policy = _active_policy(request)
        ranked = policy.rank(request, eligible)
        policy_name = policy.name
    rank_of = {b.name: (i + 1, why) for i, (b, why) in enumerate(ranked)}
    candidates = tuple(
        Candidate(
            name=b.name,
            origin=registry.origin(b.name),
            reasons=tuple(reasons[b.name]),
            rank=rank_of[b.name][0] if b.name in rank_of else None,
            note=rank_of[b.name][1] if b.name in rank_of else "",
        )
        for b in registry.backends()
    )
    if not ranked:
        return Decision(
            request, selection, None, candidates, "nothing eligible", policy=policy_name
        )
    chosen, why = ranked[0]
    fallback = chosen.name == REFERENCE and (allowed is None or len(allowed) > 1)
    if len(ranked) > 1:
        why = f"{why}; ranked above {', '.join(b.name for b, _ in ranked[1:])} by {policy_name}"
    else:
        why = f"{why}; the only eligible backend"
    return Decision(request, selection, chosen.name, candidates, why, fallback, policy_name)


_decisions: dict[tuple[AttentionRequest, Selection], Decision] = {}
_decisions_lock = threading.Lock()


def decide(request: AttentionRequest, selection: Selection = _DEFAULT_SELECTION) -> Decision:
    """The (cached) decision for a request."""
    key = (request, selection)
    decision = _decisions.get(key)
    if decision is None:
        decision = _decide(get_registry(), request, selection)
        with _decisions_lock:
            _decisions[key] = decision
    return decision


_announced: set[tuple[AttentionRequest, Selection]] = set()


def announce(decision: Decision) -> None:
    """Log a decision the first time a call runs on it: INFO, or WARNING for a fallback."""
    key = (decision.request, decision.selection)
    if key in _announced:
        return
    with _decisions_lock:
        _announced.add(key)
    log.info("attnhub: %s serves %s", decision.chosen, decision.signature)
    if decision.fallback:
        # The reasons of the backends that can run here: why none of them could.
        reasons = "; ".join(
            f"{c.name}: {', '.join(c.reasons)}"
            for c in decision.candidates
            if c.reasons and not c.reasons[0].startswith("unavailable:")
        )
        log.warning(
            "attnhub: falling back to %s (slow, memory O(N^2)) for %s; %s",
            REFERENCE,
            decision.signature,
            reasons or "no other backend is available here",
        )


def choose(decision: Decision) -> Backend:
    """The backend to run for a decision, or :class:`NoBackendError`.

    Strict mode turns a fallback to the reference into the same error.
    """
    if decision.chosen is None or (decision.fallback and decision.selection.strict):
        raise decision.error()
    announce(decision)
    return get_registry().get(decision.chosen)


def clear_cache() -> None:
    """Forget every cached decision (and the per-call fast path built on them)."""
    from . import api

    with _decisions_lock:
        _decisions.clear()
        _announced.clear()
    api.clear_call_cache()
