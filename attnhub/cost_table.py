"""Ranking by measured speed: a cost table per device class, and the policy that reads it.

A cost table holds, per device class (``"sm90"``, or ``"cpu"``), the milliseconds each
backend took in an ``attnhub bench`` run, keyed by (dtype, head dim, N bucket, causal,
mode); ``mode`` is ``fwd`` for calls without gradients and ``fwd_bwd`` for calls that
need a backward. :class:`CostTablePolicy` ranks the *eligible* backends of a request by
those times, fastest first, and says which entry decided::

    measured 1.23 ms vs 1.51 ms for torch_sdpa_flash in cost_table_sm90.json
    [bf16 D128 N~4096 causal fwd]

Where the table does not cover a request (masks, windows, softcap, dropout,
block-sparse, GQA, Nq != Nk, a head dim or dtype not measured, N more than two octaves
from a measured one), the device class's cost model ranks it (:mod:`attnhub.cost_model`;
the declared priority where there is none); a backend the table did not time comes
after the timed ones, by declared priority.

A table never ranks against the memory class: linear-memory backends come before
quadratic ones whatever their times (a quadratic backend is fast until it runs out of
memory, and the table was timed at lengths where it did not). Tables are validated
when they are built or read: a dtype, head dim, N, mode or time that cannot be right
(N <= 0, a time that is NaN, infinite, zero or negative, ...) rejects the whole table
with a ``ValueError`` naming the entry, and dispatch then ignores the file with a
warning and ranks by declared priority.

Where tables come from, first found wins:

1. ``$XDG_CACHE_HOME/attnhub/cost_table_<class>.json`` (``~/.cache`` without
   ``XDG_CACHE_HOME``), written by ``attnhub tune`` on this machine;
2. ``attnhub/data/cost_table_<class>.json``, shipped (sm_90, from the H200 runs).

Dispatch uses the table for a request's device class by default (see
:func:`default_policy`, called from :mod:`attnhub.dispatch` when no policy was set);
``ATTNHUB_RANKING=priority`` turns it off, and ``attnhub.set_policy`` overrides it.
Nothing is read at ``import attnhub``: a table is read at the first decision for its
device class.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import env
from .backend import FLOAT_DTYPES, MEMORY_CLASSES, Backend, is_finite_number
from .cost_model import CostModel, CostModelPolicy
from .jsonfile import write_json
from .ranking import DeclaredPriority, RankingPolicy
from .registry import invalidate_caches
from .request import AttentionRequest, dtype_name, dtype_tag

log = logging.getLogger("attnhub")

FORMAT = "attnhub-cost-table/1"
TABLE_MODES = ("fwd", "fwd_bwd")
MAX_OCTAVES = 2  # a request's N may be this many powers of two from a measured N
RANKING_ENV = env.RANKING
# ATTNHUB_RANKING's words: the cost table where one exists, or the declared priority.
RANKING_WORDS = (
    ("measured", "measured"),
    ("priority", "priority"),
    ("declared", "priority"),
    ("off", "priority"),
)
DTYPE_NAMES = frozenset(dtype_name(d) for d in FLOAT_DTYPES)

Key = tuple[str, int, int, bool, str]  # (dtype, head_dim, N, causal, mode)


def device_class(device_type: str, capability: tuple[int, int] | None) -> str:
    """``"sm90"`` for a CUDA device of compute capability 9.0; the device type otherwise."""
    if device_type == "cuda" and capability is not None:
        return f"sm{capability[0]}{capability[1]}"
    return device_type


def request_device_class(request: AttentionRequest) -> str:
    return device_class(request.device_type, request.capability)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnhub"


def table_filename(device: str) -> str:
    return f"cost_table_{device}.json"


def cache_path(device: str) -> Path:
    return cache_dir() / table_filename(device)


def shipped_path(device: str) -> Path:
    return Path(__file__).resolve().parent / "data" / table_filename(device)


def find_table(device: str) -> Path | None:
    """The table file for a device class: the user's cache first, then the shipped one."""
    for path in (cache_path(device), shipped_path(device)):
        if path.is_file():
            return path
    return None


def describe_key(key: Key) -> str:
    dtype, d, n, causal, mode = key
    return f"{dtype_tag(dtype)} D{d} N~{n} {'causal' if causal else 'non-causal'} {mode}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_time(value: Any) -> bool:
    return is_finite_number(value) and value > 0


# What each part of an entry must be: (field, check, what it must be).
_ENTRY_FIELDS: tuple[tuple[str, Any, str], ...] = (
    (
        "dtype",
        lambda v: isinstance(v, str) and v in DTYPE_NAMES,
        f"one of {', '.join(sorted(DTYPE_NAMES))}",
    ),
    ("head_dim", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("n", lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    ("causal", lambda v: isinstance(v, bool), "a bool"),
    ("mode", lambda v: isinstance(v, str) and v in TABLE_MODES, f"one of {', '.join(TABLE_MODES)}"),
)


def entry_problems(key: Any, timings: Any) -> list[str]:
    """What is wrong with one entry (empty: nothing): its key (dtype, head_dim, n,
    causal, mode) and its timings, backend name -> milliseconds (finite, > 0)."""
    if not isinstance(key, tuple) or len(key) != len(_ENTRY_FIELDS):
        return [f"key {key!r} is not a (dtype, head_dim, n, causal, mode) tuple"]
    problems = [
        f"{name} {value!r} must be {what}"
        for (name, ok, what), value in zip(_ENTRY_FIELDS, key)
        if not ok(value)
    ]
    if not isinstance(timings, Mapping):
        return [*problems, f"ms {timings!r} must be a mapping of backend name to milliseconds"]
    problems += [
        f"ms[{backend!r}] = {ms!r} must be a finite number of milliseconds > 0"
        for backend, ms in timings.items()
        if not (isinstance(backend, str) and backend and is_time(ms))
    ]
    return problems


@dataclass(frozen=True)
class CostTable:
    """Milliseconds per backend, per (dtype, head dim, N, causal, mode), for one device class.

    Validated when built: ``ValueError`` naming the first bad entry (see
    :func:`entry_problems`), so that no lookup or ranking ever meets a time it cannot
    compare or an N it cannot take the logarithm of.
    """

    device: str
    entries: Mapping[Key, Mapping[str, float]]
    source: str = "(in memory)"  # the file name, quoted in explanations
    meta: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"{self.source}: device {self.device!r} must be a device class name")
        for key, timings in self.entries.items():
            problems = entry_problems(key, timings)
            if problems:
                raise ValueError(f"{self.source}: entry {key!r}: " + "; ".join(problems))

    def lookup(
        self, dtype: str, head_dim: int, n: int, causal: bool, mode: str
    ) -> tuple[Key, Mapping[str, float]] | None:
        """The entry for these, or the nearest measured N within ``MAX_OCTAVES``."""
        key: Key = (dtype, head_dim, n, causal, mode)
        if key in self.entries:
            return key, self.entries[key]
        if n <= 0:
            return None
        near = [
            k for k in self.entries if k[0] == dtype and k[1] == head_dim and k[3] == causal and k[4] == mode
        ]  # fmt: skip
        if not near:
            return None
        # Nearest in octaves; a tie goes to the longer N (kernel-bound, like longer calls).
        best = min(near, key=lambda k: (abs(math.log2(k[2] / n)), -k[2]))
        if abs(math.log2(best[2] / n)) > MAX_OCTAVES:
            return None
        return best, self.entries[best]

    def to_json(self) -> dict[str, Any]:
        entries = [
            {"dtype": k[0], "head_dim": k[1], "n": k[2], "causal": k[3], "mode": k[4], "ms": dict(sorted(v.items()))}
            for k, v in sorted(self.entries.items())
        ]  # fmt: skip
        return {
            "format": FORMAT,
            "device": self.device,
            **dict(self.meta or {}),
            "entries": entries,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> CostTable:
        """A table from its JSON form; ``ValueError`` naming the entry for anything
        that is not exactly a valid table (values are not coerced: ``"n": "4096"``
        or ``"causal": "false"`` are errors, not guesses)."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"{source}: not an attnhub cost table (format {found!r})")
        raw_entries = data.get("entries")
        if not isinstance(raw_entries, list):
            raise ValueError(f"{source}: 'entries' must be a list, got {raw_entries!r:.100}")
        entries: dict[Key, Mapping[str, float]] = {}
        for i, e in enumerate(raw_entries):
            fields = ("dtype", "head_dim", "n", "causal", "mode", "ms")
            if not isinstance(e, Mapping) or set(fields) - set(e):
                raise ValueError(f"{source}: entry #{i} must be an object with keys {fields}")
            key = tuple(e[f] for f in fields[:-1])
            problems = entry_problems(key, e["ms"])
            if problems:
                raise ValueError(f"{source}: entry #{i}: " + "; ".join(problems))
            if key in entries:
                raise ValueError(f"{source}: entry #{i} repeats the key {key!r}")
            entries[key] = dict(e["ms"])
        meta = {k: v for k, v in data.items() if k not in ("format", "device", "entries")}
        return cls(data.get("device"), entries, source, meta)  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostTable:
        path = Path(path)
        return cls.from_json(json.loads(path.read_text()), path.name)

    def write(self, path: str | os.PathLike[str]) -> Path:
        return write_json(self.to_json(), path)


# -- the policy --------------------------------------------------------------------


def _uncovered(request: AttentionRequest) -> str | None:
    """What about a request the table (plain attention) does not measure, or None."""
    features = [
        (request.mask != "none", f"a {request.mask} mask"),
        (request.window, "a window"),
        (request.softcap, "softcap"),
        (request.dropout, "dropout"),
        (request.block_sparse, "block_sparse"),
        (request.heads_q != request.heads_kv, "grouped-query heads"),
        (not request.same_seqlen, "Nq != Nk"),
        (request.head_dim != request.head_dim_v, "a value head dim unlike the key's"),
        (not request.last_dim_contiguous, "a strided last dim"),
        # A varlen or KV-cache call (attnhub.serving) has its own kernels and lengths.
        (
            getattr(request, "layout", "dense") != "dense",
            f"the {getattr(request, 'layout', '')} layout",
        ),
    ]
    found = [text for present, text in features if present]
    return ", ".join(found) if found else None


def _ms(value: float) -> str:
    return f"{value:.4g} ms"


class CostTablePolicy:
    """Rank eligible backends by measured time in a :class:`CostTable`; deterministic."""

    def __init__(self, table: CostTable, fallback: RankingPolicy | None = None) -> None:
        self.table = table
        self.name = f"measured cost ({table.source})"
        self._declared = DeclaredPriority()
        # What ranks the calls the table does not cover: the cost model where the
        # device class has one, else the declared priority.
        self._fallback: RankingPolicy = fallback or self._declared

    def entry_for(self, request: AttentionRequest) -> tuple[Key, Mapping[str, float]] | str:
        """The table entry for a request, or why there is none."""
        mode = "fwd_bwd" if request.needs_grad else "fwd"
        key: Key = (
            dtype_name(request.dtype),
            request.head_dim,
            request.seqlen_q,
            request.causal,
            mode,
        )
        if request_device_class(request) != self.table.device:
            return f"{self.table.source} is for {self.table.device}, not {request.device_label}"
        uncovered = _uncovered(request)
        if uncovered is not None:
            return f"{self.table.source} measures plain attention; this call has {uncovered}"
        found = self.table.lookup(*key)
        if found is None:
            return f"no entry in {self.table.source} for [{describe_key(key)}]"
        return found

    def rank(
        self, request: AttentionRequest, eligible: Sequence[Backend]
    ) -> list[tuple[Backend, str]]:
        found = self.entry_for(request)
        if isinstance(found, str):
            return [(b, f"{why} ({found})") for b, why in self._fallback.rank(request, eligible)]
        key, timings = found
        where = f"in {self.table.source} [{describe_key(key)}]"
        if key[2] != request.seqlen_q:
            where = where[:-1] + f", nearest to N~{request.seqlen_q}]"
        ranked: list[tuple[Backend, str]] = []
        # Memory class first, times only within one: a table never promotes a
        # quadratic backend (the reference, torch_sdpa materializing a mask) above a
        # linear one.
        for memory in MEMORY_CLASSES:
            group = [b for b in eligible if b.memory_class(request) == memory]
            ranked += self._rank_by_time(request, group, timings, where)
        return ranked

    def _rank_by_time(
        self,
        request: AttentionRequest,
        group: Sequence[Backend],
        timings: Mapping[str, float],
        where: str,
    ) -> list[tuple[Backend, str]]:
        """Backends of one memory class: timed ones by time, then the others by priority."""
        measured = sorted(
            (b for b in group if b.name in timings), key=lambda b: (timings[b.name], b.name)
        )
        others = [b for b in group if b.name not in timings]
        ranked: list[tuple[Backend, str]] = []
        for i, b in enumerate(measured):
            ms = timings[b.name]
            if i == 0 and len(measured) > 1:
                runner_up = measured[1]
                why = f"measured {_ms(ms)} vs {_ms(timings[runner_up.name])} for {runner_up.name} {where}"
            elif i == 0:
                why = f"measured {_ms(ms)} {where}, the only eligible backend timed there"
            else:
                why = f"measured {_ms(ms)} {where}"
            ranked.append((b, why))
        for b, why in self._declared.rank(request, others):
            ranked.append((b, f"{why} (not timed {where})"))
        return ranked


# -- the default, per device class ------------------------------------------------------

_DECLARED = DeclaredPriority()
_policies: dict[str, RankingPolicy] = {}


def ranking_disabled() -> bool:
    """``ATTNHUB_RANKING=priority`` (or ``declared``, ``off``): no cost tables.

    ``ValueError`` naming the variable for a word that is none of :data:`RANKING_WORDS`.
    """
    return env.choice(RANKING_ENV, RANKING_WORDS, "measured") == "priority"


def _model_policy(device: str) -> RankingPolicy:
    """The cost model's policy for a device class if one is shipped, else the declared
    priority (a broken model file is ignored, with a warning)."""
    try:
        model = CostModel.shipped(device)
    except Exception as exc:
        log.warning("attnhub: ignoring the cost model for %s: %s: %s", device, type(exc).__name__, exc)  # fmt: skip
        return _DECLARED
    return _DECLARED if model is None else CostModelPolicy(model)


def policy_for_device(device: str) -> RankingPolicy:
    """The cost-table policy for a device class if a table exists (the cost model, or
    the declared priority, ranking what it does not cover), else the cost model or the
    declared priority alone.

    Read from disk once per device class; :func:`forget_tables` forgets what was read.
    """
    policy = _policies.get(device)
    if policy is None:
        path = find_table(device)
        policy = fallback = _model_policy(device)
        if path is not None:
            try:
                policy = CostTablePolicy(CostTable.load(path), fallback)
            except Exception as exc:  # a broken table must not break dispatch
                log.warning(
                    "attnhub: ignoring cost table %s: %s: %s", path, type(exc).__name__, exc
                )
        _policies[device] = policy
    return policy


def default_policy(request: AttentionRequest) -> RankingPolicy:
    """What dispatch ranks with when no policy was set: see the module docstring."""
    if ranking_disabled():
        return _DECLARED
    return policy_for_device(request_device_class(request))


def forget_tables() -> None:
    """Forget the tables read (and every cached decision): the next decision reads again."""
    _policies.clear()
    invalidate_caches()
