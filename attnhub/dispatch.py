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

``torch_reference`` (O(N^2) memory, the executable contract) is the last resort: where
the caller did not name it first, it ranks after every other eligible backend, whatever
the policy says. Choosing it then is a *fallback*: logged once per request at WARNING,
and strict mode (``use_backend(strict=True)`` or ``ATTNHUB_STRICT=1``) raises
:class:`NoBackendError` instead; so strict mode refuses exactly the calls that only the
reference can serve.

Backend code runs contained: a backend whose ``unavailable_reason``, ``extra_reasons``,
``memory_class`` or ``prepare`` raises or returns the wrong type is disabled for the
process with that reason (``attnhub info`` and ``explain()`` show it) and dispatch goes
on without it, and so is a third-party backend whose forward hands back what the call
did not ask for (:mod:`attnhub.output_check`); a ranking policy that raises or returns something other than the
eligible backends in some order is replaced, for that decision, by the declared
priority. Cached decisions are dropped whenever the registry, a backend's availability
or the policy changes (:func:`attnhub.registry.invalidate_caches`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import env, measured, output_check
from . import registry as registry_module
from .backend import MEMORY_CLASSES, Backend, Runner, declared_reasons, is_finite_number
from .cost_table import default_policy
from .errors import NoBackendError
from .ranking import DeclaredPriority, RankingPolicy
from .registry import BackendRegistry, get_registry
from .request import AttentionParams, AttentionRequest

log = logging.getLogger("attnhub")

REFERENCE = "torch_reference"


@dataclass(frozen=True)
class Selection:
    """Which backends the caller allows, in preference order (None: all), and strictness."""

    names: tuple[str, ...] | None = None
    strict: bool = False
    source: str = "default"


_DEFAULT_SELECTION = Selection()
# The selection use_backend() puts in force (None: none), thread- and task-local. The
# api's and the patch's per-call paths read it (their cache keys hold it), and the patch
# makes it strict around its calls (enter_strict).
context_selection: contextvars.ContextVar[Selection | None] = contextvars.ContextVar(
    "attnhub_selection", default=None
)
_STRICT_PATCH = Selection(None, True, "attnhub.patch")


def enter_strict(keep_reference: bool) -> contextvars.Token[Selection | None]:
    """Make the current context's selection strict (no fallback to the reference),
    unless ``keep_reference`` (the reference was named): the token to reset it with
    (``context_selection.reset``)."""
    outer = context_selection.get()
    if keep_reference:
        return context_selection.set(outer)
    return context_selection.set(
        _STRICT_PATCH if outer is None else dataclasses.replace(outer, strict=True)
    )


# os.environ.get encodes the key and decodes the value on every call (about 0.7 us);
# CPython's posix os.environ keeps its raw bytes in ``_data``, which stays in sync
# with os.environ and monkeypatch.setenv. Read that where it exists: the per-call
# path looks ``ENVIRONMENT_KEYS`` up with ``environment_get`` (a bound dict.get) and
# uses the raw values only as part of its cache key.
_ENV_DATA: Any = getattr(os.environ, "_data", None)
ENVIRONMENT_KEYS: tuple[Any, Any] = (env.BACKEND, env.STRICT)
if isinstance(_ENV_DATA, dict):
    ENVIRONMENT_KEYS = (
        os.environ.encodekey(ENVIRONMENT_KEYS[0]),
        os.environ.encodekey(ENVIRONMENT_KEYS[1]),
    )
    environment_get = _ENV_DATA.get
else:  # pragma: no cover - non-CPython or a platform without _data
    environment_get = os.environ.get


def environment_selection() -> Selection | None:
    """``ATTNHUB_BACKEND=a,b`` and ``ATTNHUB_STRICT=1`` as they are now (None: neither).

    ``ValueError`` naming the variable for a value that does not parse
    (:mod:`attnhub.env`); backend names are checked against the registry when a call
    is decided.
    """
    return _environment_selection(os.environ.get(env.BACKEND), os.environ.get(env.STRICT))


@functools.lru_cache(maxsize=64)
def _environment_selection(names: str | None, strict: str | None) -> Selection | None:
    allowed = env.parse_list(env.BACKEND, names)
    is_strict = env.parse_flag(env.STRICT, strict)
    if not allowed and not is_strict:
        return None
    return Selection(allowed or None, is_strict, env.BACKEND)


def normalize_backend_arg(
    backend: str | Sequence[str] | None, argument: str = "backend"
) -> tuple[str, ...] | None:
    """``backend=`` as a tuple of names (None: no restriction). A set (no order) or an
    empty sequence (which would restrict to nothing) is a ``TypeError`` naming
    ``argument``."""
    if backend is None:
        return None
    if isinstance(backend, str):
        return (backend,)
    if isinstance(backend, Sequence) and all(isinstance(b, str) for b in backend) and backend:
        return tuple(backend)
    raise TypeError(
        f"{argument} must be None, a backend name or a sequence of names, got {backend!r}"
    )


def current_selection(backend: str | Sequence[str] | None = None) -> Selection:
    """The selection in force for one call: the argument, else the context, else the env."""
    context = context_selection.get()
    env = environment_selection()
    strict = any(s is not None and s.strict for s in (context, env))
    names = normalize_backend_arg(backend)
    if names is not None:
        return Selection(names, strict, "backend=")
    for outer in (context, env):
        if outer is not None and outer.names is not None:
            return Selection(outer.names, strict, outer.source)
    return Selection(None, strict, "default") if strict else _DEFAULT_SELECTION


def empty_input_selection(call: str) -> Selection:
    """The selection for a call with empty inputs (``call`` describes it): the
    reference alone, which returns the contract's answer (empty, or zeros with an lse
    of -inf where there are no keys) whatever was asked; no kernel is handed empty
    tensors. ``NoBackendError`` where it is not registered (a plugin removed it)."""
    if REFERENCE not in get_registry():
        raise NoBackendError(
            f"empty inputs are served by {REFERENCE} alone, which is not registered",
            call, [],
        )  # fmt: skip
    return Selection((REFERENCE,), False, "empty input")


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
    if not isinstance(strict, bool):  # "no" or "false" must not mean on
        raise TypeError(f"strict must be a bool, got {strict!r}")
    flat: list[str] = []
    for item in names:
        # Each a name or a non-empty ordered sequence of names, as backend= takes (None,
        # which backend= reads as no restriction, names nothing here).
        if item is None:
            raise TypeError("use_backend's names must be backend names or sequences of them, got None")  # fmt: skip
        flat.extend(normalize_backend_arg(item, "use_backend's names") or ())
    registry = get_registry()
    for name in flat:
        registry.get(name)  # ValueError listing the known names
    outer = context_selection.get()
    selection = Selection(
        tuple(flat) if flat else (outer.names if outer else None),
        strict or bool(outer and outer.strict),
        "use_backend",
    )
    token = context_selection.set(selection)
    try:
        yield
    finally:
        context_selection.reset(token)


# -- ranking -------------------------------------------------------------------


# RankingPolicy and DeclaredPriority live in attnhub.ranking (below this module); they
# are re-exported here, where users have always found them.

_policy: RankingPolicy | None = None  # None: the default, per device class


def set_policy(policy: RankingPolicy | None) -> None:
    """Install a ranking policy and clear decisions.

    None restores the default: the measured cost table of the request's device class
    where one exists (:func:`attnhub.cost_table.default_policy`), else the declared
    priority.
    """
    global _policy
    if policy is not None and not callable(getattr(policy, "rank", None)):
        raise TypeError(
            f"policy must be None or a RankingPolicy (an object with a rank(request, "
            f"eligible) method), got {type(policy).__name__}"
        )
    _policy = policy
    clear_cache()


def _active_policy(request: AttentionRequest) -> RankingPolicy:
    if _policy is not None:
        return _policy
    return measured.over(default_policy(request))


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


# -- backend code, contained ------------------------------------------------------

_BROKEN: Any = object()  # what _contained returns for code that failed


def _contained(
    registry: BackendRegistry,
    backend: Backend,
    method: str,
    call: Callable[[], Any],
    read: Callable[[Any], Any],
    expected: str,
) -> Any:
    """``read(call())``, where ``call`` runs a backend's own code and ``read`` turns its
    result into what dispatch uses (None: the wrong type). On an exception or a wrong
    type the backend is disabled for the process with that reason (``attnhub info``
    and ``explain()`` show it; caches are invalidated) and ``_BROKEN`` comes back: one
    broken backend never fails a call that another backend can serve."""
    try:
        value = call()
    except Exception as exc:
        why = f"{method} raised {type(exc).__name__}: {exc}"
    else:
        result = read(value)
        if result is not None:
            return result
        why = f"{method} returned {value!r:.200}, not {expected}"
    registry.disable(backend.name, why)
    return _BROKEN


def _reason_list(value: Any) -> list[str] | None:
    """A reasons result (a list, tuple or other iterable of str) as a list; None otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    reasons = list(value)
    return reasons if all(isinstance(r, str) for r in reasons) else None


def _memory_ok(value: Any) -> list[str] | None:
    return [] if isinstance(value, str) and value in MEMORY_CLASSES else None


def _priority_ok(value: Any) -> list[str] | None:
    return [] if is_finite_number(value) else None


# What dispatch asks a backend about a request, in order, after its availability; the
# first step with reasons decides. Ranking reads memory_class and priority, so an
# eligible backend's are checked here, once per decision (registration checked the
# priority, but a property can break later). (method, call, read, what the result must be)
_STEPS: tuple[
    tuple[str, Callable[[Backend, AttentionRequest], Any], Callable[[Any], Any], str], ...
] = (
    ("its declarations", declared_reasons, _reason_list, "a list of str"),
    ("extra_reasons", lambda b, r: b.extra_reasons(r), _reason_list, "a list of str"),
    ("memory_class", lambda b, r: b.memory_class(r), _memory_ok, f"one of {MEMORY_CLASSES}"),
    ("priority", lambda b, r: b.priority, _priority_ok, "a finite int or float"),
)


def _reasons(registry: BackendRegistry, backend: Backend, request: AttentionRequest) -> list[str]:
    """Why ``backend`` cannot serve ``request`` (empty: it can)."""
    why = registry.unavailable_reason(backend.name)
    if why is not None:
        return [f"unavailable: {why}"]
    for method, call, read, expected in _STEPS:
        reasons = _contained(
            registry, backend, method, functools.partial(call, backend, request), read, expected
        )
        if reasons is _BROKEN:
            return [f"unavailable: {registry.unavailable_reason(backend.name)}"]
        if reasons:
            return reasons
    return []


_DECLARED = DeclaredPriority()
_policy_warnings: set[str] = set()


def _ranking_problem(ranked: Any, eligible: Sequence[Backend]) -> str | None:
    """What is wrong with a policy's answer (None: a permutation of ``eligible``, with reasons)."""
    if not isinstance(ranked, list) or not all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], str) for pair in ranked
    ):
        return (
            f"returned {type(ranked).__name__} {ranked!r:.200}, not a list of (backend, str) pairs"
        )
    got = [id(b) for b, _ in ranked]
    if sorted(got) != sorted(id(b) for b in eligible):
        ranked_names = [getattr(b, "name", b) for b, _ in ranked]
        return f"ranked {ranked_names}, not each of the eligible {[b.name for b in eligible]} once"
    return None


def _rank(
    policy: RankingPolicy, request: AttentionRequest, eligible: Sequence[Backend]
) -> tuple[list[tuple[Backend, str]], str]:
    """The policy's ranking of ``eligible`` and its name; the declared priority, and a
    name that says why, where the policy raises or answers something else."""
    policy_name = str(getattr(policy, "name", type(policy).__name__))
    try:
        ranked = policy.rank(request, eligible)
        problem = _ranking_problem(ranked, eligible)
    except Exception as exc:
        problem = f"raised {type(exc).__name__}: {exc}"
    if problem is None:
        return ranked, policy_name
    note = f"ranking policy {policy_name!r} {problem}"
    if note not in _policy_warnings:
        _policy_warnings.add(note)
        log.warning("attnhub: %s; ranking by declared priority instead", note)
    return _DECLARED.rank(request, eligible), f"{_DECLARED.name} ({note})"


def _check_names(registry: BackendRegistry, selection: Selection) -> None:
    """``ValueError`` for a name in the selection that no backend has."""
    for name in selection.names or ():
        if name in registry:
            continue
        known = ", ".join(registry.names())
        if selection.source == env.BACKEND:
            raise ValueError(
                f"{env.BACKEND}={','.join(selection.names or ())!r} names unknown backend "
                f"{name!r}; known backends: {known}"
            )
        registry.get(name)  # ValueError: unknown backend 'x'; known backends: ...


def _decide(registry: BackendRegistry, request: AttentionRequest, selection: Selection) -> Decision:
    _check_names(registry, selection)
    backends = registry.backends()
    reasons = {b.name: _reasons(registry, b, request) for b in backends}
    allowed = selection.names
    if allowed is not None:
        for name in reasons:
            if name not in allowed and not reasons[name]:
                reasons[name] = [f"not selected ({selection.source} allows {', '.join(allowed)})"]
        eligible = [registry.get(n) for n in allowed if not reasons[n]]
        ranked = [(b, f"first eligible in the order given by {selection.source}") for b in eligible]
        policy_name = selection.source
        # A choice where the caller put the reference first; a fallback where it
        # serves because the backends named before it cannot.
        fallback_if_reference = allowed[0] != REFERENCE
    else:
        eligible = [b for b in backends if not reasons[b.name]]
        others = [b for b in eligible if b.name != REFERENCE]
        last_resort = [b for b in eligible if b.name == REFERENCE]
        # (_active_policy reads ATTNHUB_RANKING: a bad value raises, naming it, even
        # where only the reference is eligible, as every bad variable does.)
        ranked, policy_name = _rank(_active_policy(request), request, others)
        ranked += _DECLARED.rank(request, last_resort)
        fallback_if_reference = True
    rank_of = {b.name: (i + 1, why) for i, (b, why) in enumerate(ranked)}
    candidates = tuple(
        Candidate(
            name=b.name,
            origin=registry.origin(b.name),
            reasons=tuple(reasons[b.name]),
            rank=rank_of[b.name][0] if b.name in rank_of else None,
            note=rank_of[b.name][1] if b.name in rank_of else "",
        )
        for b in backends
    )
    if not ranked:
        return Decision(
            request, selection, None, candidates, "nothing eligible", policy=policy_name
        )
    chosen, why = ranked[0]
    fallback = chosen.name == REFERENCE and fallback_if_reference
    if len(ranked) > 1:
        why = f"{why}; ranked above {', '.join(b.name for b, _ in ranked[1:])} by {policy_name}"
    else:
        why = f"{why}; the only eligible backend"
    return Decision(request, selection, chosen.name, candidates, why, fallback, policy_name)


_decisions: dict[tuple[AttentionRequest, Selection], Decision] = {}
_decisions_lock = threading.Lock()


def decide(request: AttentionRequest, selection: Selection = _DEFAULT_SELECTION) -> Decision:
    """The (cached) decision for a request.

    Stored only where no cache invalidation happened while it was made (a backend
    disabled on the way, a registry change in another thread): the next call decides
    again against what changed.
    """
    key = (request, selection)
    decision = _decisions.get(key)
    if decision is None:
        registry = get_registry()
        generation = registry_module.generation()
        decision = _decide(registry, request, selection)
        with _decisions_lock:
            if generation == registry_module.generation():
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
        # A fallback means no other backend could serve: say why each could not
        # (leaving out those that cannot run here at all).
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


def prepare(decision: Decision, params: AttentionParams) -> tuple[Backend, Runner]:
    """The backend for a decision and the runner its ``prepare`` made for such calls.

    A ``prepare`` that raises or returns something not callable disables its backend
    (contained, as every backend method dispatch calls) and the request is decided
    again without it: the next eligible backend serves, or :class:`NoBackendError`
    says why none can (a backend asked for by name is never replaced silently).
    """
    registry = get_registry()
    while True:
        backend = choose(decision)
        runner = _prepared(registry, backend, decision.request, params)
        if runner is not _BROKEN:
            if not built_in(backend):
                runner = output_check.checked(runner, backend.name, params.return_lse,
                                              registry.disable)  # fmt: skip
            return backend, runner
        decision = decide(decision.request, decision.selection)


def built_in(backend: Backend) -> bool:
    """Shipped with attnhub (``attnhub.backends``), so held to the contract by its
    conformance suite: its results are not checked call by call (:mod:`.output_check`)."""
    cls: Any = type(backend)  # (mypy reads Backend's __hash__ as the instances')
    return _built_in_class(cls)


@functools.lru_cache(maxsize=256)
def _built_in_class(cls: type) -> bool:
    return cls.__module__.startswith(registry_module.BUILTIN_PLUGIN + ".")


def _prepared(
    registry: BackendRegistry, backend: Backend, request: AttentionRequest, params: AttentionParams
) -> Any:
    """``backend.prepare(request, params)``, contained: the runner, or ``_BROKEN``."""
    return _contained(
        registry, backend, "prepare", functools.partial(backend.prepare, request, params),
        lambda r: r if callable(r) else None, "a callable",
    )  # fmt: skip


def prepare_candidate(name: str, request: AttentionRequest, params: AttentionParams) -> Runner:
    """The runner backend ``name`` prepares for ``request`` (for timing it).

    Contained as :func:`prepare` is: a ``prepare`` that fails disables its backend, and
    ``RuntimeError`` says why.
    """
    registry = get_registry()
    runner = _prepared(registry, registry.get(name), request, params)
    if runner is _BROKEN:
        raise RuntimeError(f"{name} is unavailable: {registry.unavailable_reason(name)}")
    return runner


@registry_module.on_invalidate
def _forget_decisions() -> None:
    with _decisions_lock:
        _decisions.clear()
        _announced.clear()


def clear_cache() -> None:
    """Forget every cached decision, and everything cached from them (the api's
    per-call fast path subscribes to the same hook: :func:`attnhub.registry.on_invalidate`)."""
    registry_module.invalidate_caches()
