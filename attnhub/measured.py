"""Measurements of this machine: per call signature, the time each eligible backend took.

:mod:`attnhub.autotune` times the eligible backends the first time a call signature
runs on a device where it may (CUDA, outside tracing and graph capture); this module
keeps what it measured and ranks by it. Measurements are persisted per device, PyTorch
and attnhub version in the user's cache directory (as ``torch.backends.cudnn.benchmark``
and Triton's autotuner keep theirs), so a second process reuses them without timing
again::

    ~/.cache/attnhub/measured-<device>-torch<version>-attnhub<version>.json

``ATTNHUB_MEASUREMENTS`` names another file instead: the one file every rank of a
``torch.distributed`` job reads (see :func:`distributed_job`).

Processes sharing a file keep each other's entries: each write re-reads the file and
merges this process's measurements into it (they win for the same signature) before
replacing it atomically, under a lock on ``<file>.lock`` where the platform has
``fcntl``. A file there that is not an attnhub measurement file of this format (a newer
attnhub's, another program's) is never overwritten: it is ignored, the log says so
once, and measurements are kept in memory only. A measurement with no times (nothing
could be timed) is kept in memory only, so the next process measures that call again.

A signature is an :class:`~attnhub.request.AttentionRequest` (its sequence lengths
bucketed to powers of two). :class:`MeasuredPolicy` ranks a request's eligible backends
by its measurement, fastest first within each memory class, and hands requests it has
no measurement for to the policy beneath it (the shipped cost table, or the declared
priority).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch

from . import env
from .backend import Backend, is_finite_number
from .cost_table import cache_dir, is_time
from .jsonfile import write_json
from .ranking import RankingPolicy
from .registry import invalidate_caches
from .request import AttentionRequest, dtype_name, seqlen_bucket

try:
    import fcntl
except ImportError:  # Windows: writers merge without the lock (see _locked)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("attnhub")

FORMAT = "attnhub-measured/1"
# Two measured times closer than this fraction, or than the spread of either one's
# rounds, are a tie: a first call's wall clock, best of autotune's rounds, moves by a few
# per cent from process to process, and far more for calls of a few tens of us that the
# host bounds (seen on the H200, 4K decodes: torch_sdpa 0.0233 and 0.0301 ms, and cuDNN's
# op measured faster than torch_sdpa in the process whose steady loops read it 7% slower).
# A tie goes to the stock backend (Backend.stock, F.sdpa's own path): the measurement
# cannot tell the two apart, and stock is what the user would have had.
TIE = 0.03


# Kept per request: autotune asks for a request's measurement at every new call key (a
# decoding step's first layer, its key length new), and the text costs about 27 us
# (dataclasses.asdict and json.dumps, dev CPU) where the lookup costs under 1.
@functools.lru_cache(maxsize=4096)
def request_key(request: AttentionRequest) -> str:
    """A stable text key for a request, the same in every process; the batch bucketed to
    a power of two like the lengths (a server's batch varies call by call)."""
    fields = dataclasses.asdict(request)
    del fields["traced"]  # measured eagerly; the same call traced is ranked by it too
    fields["dtype"] = dtype_name(request.dtype)
    if request.batch is not None:
        fields["batch"] = seqlen_bucket(request.batch)
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Milliseconds per backend (wall clock per call, host time included) for one
    request, when they were taken, and the backends that could not be timed, with why."""

    ms: Mapping[str, float]
    when: str
    failed: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Per backend, (median round - best round) / best round: the measurement's own noise.
    spread: Mapping[str, float] = dataclasses.field(default_factory=dict)


@functools.cache
def _file_name(device_type: str, index: int | None) -> str:
    """``measured-<device>-torch<v>-attnhub<v>.json`` (asked of the driver and the
    installed metadata once per device: dispatch asks for it at every new decision)."""
    from importlib import metadata

    label = device_type
    if device_type == "cuda":
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        label = f"{name}-sm{major}{minor}"
    try:
        version = metadata.version("attnhub")
    except metadata.PackageNotFoundError:
        version = "unknown"
    name = f"measured-{label}-torch{torch.__version__}-attnhub{version}"
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name) + ".json"


def store_path(device: torch.device) -> Path:
    """The measurement file of ``device``: ``ATTNHUB_MEASUREMENTS`` where it names one,
    else the device's file in the user's cache directory."""
    shared = env.path(env.MEASUREMENTS)
    if shared is not None:
        return shared
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return cache_dir() / _file_name(device.type, index if device.type == "cuda" else None)


class _NotOurs(ValueError):
    """The file exists and is not an attnhub measurement file of :data:`FORMAT` (or
    cannot be read): another attnhub version's, another program's, a mistyped path."""


def _is_map(value: Any, ok: Callable[[Any], bool]) -> TypeGuard[Mapping[str, Any]]:
    """``value`` maps non-empty names to values that are ``ok``."""
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and k and ok(v) for k, v in value.items()
    )


def _is_spread(value: Any) -> bool:
    return is_finite_number(value) and value >= 0


def _entry(entry: Any) -> Measurement:
    """One entry of the file, exactly as written: ``ValueError`` saying what is wrong.

    Values are not coerced, as the cost table's loader does not coerce them: a time of
    ``"1.5"`` or ``true`` is an error, not a guess (a bool is not a number here).
    """
    if not isinstance(entry, Mapping):
        raise ValueError(f"must be an object, got {type(entry).__name__}")
    ms, when = entry.get("ms"), entry.get("when")
    failed, spread = entry.get("failed", {}), entry.get("spread", {})
    if not _is_map(ms, is_time):
        raise ValueError(f"ms {ms!r:.100} must map backends to finite milliseconds > 0")
    if not isinstance(when, str):
        raise ValueError(f"when {when!r:.100} must be a string")
    if not _is_map(failed, lambda v: isinstance(v, str)):
        raise ValueError(f"failed {failed!r:.100} must map backends to strings")
    if not _is_map(spread, _is_spread):
        raise ValueError(f"spread {spread!r:.100} must map backends to finite numbers >= 0")
    return Measurement(dict(ms), when, dict(failed), dict(spread))


def _load(path: Path) -> tuple[dict[str, Measurement], list[str]]:
    """The measurements in ``path`` (none where it is absent or blank: a file created
    empty is ours to fill), and what is wrong with each entry left out.

    An entry with no times (autotune's record of a signature where nothing could be
    timed) is no measurement: left out without a word, so it is measured again. Raises
    :class:`_NotOurs` where the file exists and does not say it is :data:`FORMAT`.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, []
    except (OSError, ValueError) as exc:  # unreadable, a directory, not text
        raise _NotOurs(f"{type(exc).__name__}: {exc}") from exc
    if not text.strip():
        return {}, []
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _NotOurs(f"not JSON: {exc}") from exc
    found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
    if found != FORMAT:
        raise _NotOurs(f"format {found!r} is not {FORMAT!r}")
    raw = data.get("entries")
    if not isinstance(raw, Mapping):
        return {}, [f"'entries' {raw!r:.100} must be an object"]
    entries: dict[str, Measurement] = {}
    problems: list[str] = []
    for key, entry in raw.items():
        try:
            measurement = _entry(entry)
        except ValueError as exc:
            problems.append(f"entry {key}: {exc}")
            continue
        if measurement.ms:
            entries[key] = measurement
    return entries, problems


def _to_json(entries: Mapping[str, Measurement]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "entries": {
            key: {
                "ms": dict(m.ms),
                "when": m.when,
                "failed": dict(m.failed),
                "spread": dict(m.spread),
            }
            for key, m in sorted(entries.items())
        },
    }


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` exclusively (``fcntl.flock``) for one read-merge-replace of
    ``path``, so that the processes writing one file take turns.

    Where there is no ``fcntl`` (Windows) or the lock cannot be had (a directory that
    cannot be written, a file system without locks), it goes on without: every write
    still merges what the file holds, so writers that overlap can at worst lose a race
    (an entry written between another's read and its replace, written again at its
    writer's next measurement), never wipe what was written before them.
    """
    fd = None
    if fcntl is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


class MeasurementStore:
    """What was measured on one device, read from and written to its file.

    The file is read once, when the store is made; each measurement that :meth:`put`
    keeps is merged into it (the file re-read, then replaced, under a lock where the
    platform has one), so that processes sharing the file keep each other's entries.
    A file that exists and is not an attnhub measurement file (another attnhub
    version's format, another program's, a mistyped ``ATTNHUB_MEASUREMENTS``) is never
    overwritten: it is ignored, said once in the log, and the measurements are kept in
    this process's memory only.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, Measurement] = {}
        # What this process measured and persists: these win over the file's entries
        # for the same key, the ones read from it do not (another process may have
        # measured that signature again since).
        self._mine: dict[str, Measurement] = {}
        self._said_not_ours = False
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> None:
        # A broken file must not break dispatch: what cannot be read is measured again.
        try:
            entries, problems = _load(self.path)
        except _NotOurs as exc:
            self._not_ours(exc)
            return
        for problem in problems:
            log.warning("attnhub: ignoring measurements in %s: %s", self.path, problem)
        self._entries.update(entries)

    def _not_ours(self, exc: _NotOurs) -> None:
        """Say (once per store) that the file is left alone."""
        if self._said_not_ours:
            return
        self._said_not_ours = True
        log.warning(
            "attnhub: ignoring %s, which is not an attnhub measurement file (%s): it is "
            "left as it is, and measurements are kept in memory only, for this process",
            self.path,
            exc,
        )

    def get(self, request: AttentionRequest) -> Measurement | None:
        return self._entries.get(request_key(request))

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request: AttentionRequest, measurement: Measurement) -> None:
        """Keep a measurement, merge it into the file, and forget every decision made
        without it.

        An empty measurement (nothing could be timed: every candidate failed, say out of
        memory) is kept for this process only, which then does not retry at every call,
        and not written: the next process measures that signature again.
        """
        key = request_key(request)
        with self._lock:
            self._entries[key] = measurement
            if measurement.ms:
                self._mine[key] = measurement
                self._write()
        invalidate_caches()

    def _write(self) -> None:
        """Replace the file with its current entries and this process's measurements
        (ours win for the same key), read and replaced under :func:`_locked`."""
        try:
            with _locked(self.path):
                try:
                    on_disk, _ = _load(self.path)  # bad entries dropped: readers say so
                except _NotOurs as exc:
                    self._not_ours(exc)
                    return
                write_json(_to_json({**on_disk, **self._mine}), self.path)
        except OSError as exc:  # a read-only cache: keep it in memory only
            log.warning("attnhub: could not write measurements to %s: %s", self.path, exc)


_stores: dict[str, MeasurementStore] = {}
# The store found for a device and the variables store_path reads: found again with a
# dict lookup, where store_path builds its Path from the environment (8 us, dev CPU) at
# every new call key. A CUDA device without an index is not kept (its file follows the
# current device).
_stores_by_device: dict[tuple[Any, ...], MeasurementStore] = {}
_stores_lock = threading.Lock()
_getenv = os.environ.get


def store_for(device: torch.device) -> MeasurementStore:
    """The store of ``device``'s kind (read from disk on first use).

    Keyed by its file, so that every spelling of one device (``cuda``, ``cuda:0``)
    shares one store: the tensors' device says ``cuda:0`` where the request, which
    keeps only the device type, says ``cuda``.
    """
    found = (device, _getenv(env.MEASUREMENTS), _getenv("XDG_CACHE_HOME"), _getenv("HOME"))
    store = _stores_by_device.get(found)
    if store is not None:
        return store
    path = store_path(device)
    key = str(path)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = MeasurementStore(path)
        if device.type != "cuda" or device.index is not None:
            _stores_by_device[found] = store
    return store


def forget_stores() -> None:
    """Forget the measurements read (and every decision): the next use reads again."""
    with _stores_lock:
        _stores.clear()
        _stores_by_device.clear()
    invalidate_caches()


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# Device types whose calls are measured (by attnhub.autotune) and ranked by it. CPUs are
# not: there PyTorch's own kernel is the one real candidate.
DEVICES = frozenset({"cuda"})


def distributed_job() -> bool:
    """This process is one of several ranks of an initialized ``torch.distributed`` job."""
    distributed: Any = getattr(torch, "distributed", None)
    return bool(
        distributed is not None
        and distributed.is_available()
        and distributed.is_initialized()
        and distributed.get_world_size() > 1
    )


def _request_device(request: AttentionRequest) -> torch.device | None:
    """The device whose measurements rank ``request``, or None (not measured there, a
    request described for a device this process does not have, or a rank of a
    distributed job without a shared measurement file).

    Every rank of a ``torch.distributed`` job must pick the same backend for the same
    call (the ranks' collectives and numerics must agree), and each machine's own file
    holds its own timings, or none: so ranks read measurements only from the one file
    that ``ATTNHUB_MEASUREMENTS`` names for all of them (``attnhub tune`` writes it), and
    otherwise rank by the deterministic policies beneath.
    """
    if request.device_type not in DEVICES:
        return None
    if distributed_job() and env.path(env.MEASUREMENTS) is None:
        return None
    if request.device_type == "cuda" and not torch.cuda.is_available():
        return None
    return torch.device(request.device_type)


class MeasuredPolicy:
    """Rank by this machine's measurement of the request where one exists, else by ``inner``."""

    def __init__(self, inner: RankingPolicy) -> None:
        self.inner = inner
        self.name = inner.name

    def measurement(self, request: AttentionRequest) -> tuple[Measurement, Path] | None:
        device = _request_device(request)
        if device is None:
            return None
        store = store_for(device)
        found = store.get(request)
        return None if found is None else (found, store.path)

    def rank(
        self, request: AttentionRequest, eligible: Sequence[Backend]
    ) -> list[tuple[Backend, str]]:
        found = self.measurement(request)
        if found is None:
            return self.inner.rank(request, eligible)
        measurement, path = found
        where = f"measured here on first use ({path.name}, {measurement.when})"
        timed = sorted(
            (b for b in eligible if b.name in measurement.ms),
            key=lambda b: (b.memory_class(request) != "linear", measurement.ms[b.name], b.name),
        )
        tie = _stock_at_a_tie(request, timed, measurement)
        if tie is not None:
            timed.remove(tie)
            timed.insert(0, tie)
        ranked: list[tuple[Backend, str]] = []
        for i, b in enumerate(timed):
            ms = measurement.ms[b.name]
            if i == 0 and len(timed) > 1:
                other = timed[1]
                why = (
                    f"{ms:.4g} ms vs {measurement.ms[other.name]:.4g} ms for {other.name}, {where}"
                )
                if b is tie:
                    why += (
                        "; within the measurement's noise, a tie, which goes to the stock "
                        "path (what F.scaled_dot_product_attention runs)"
                    )
            else:
                why = f"{ms:.4g} ms, {where}"
            ranked.append((b, why))
        rest = [b for b in eligible if b.name not in measurement.ms]
        for b, why in self.inner.rank(request, rest):
            reason = measurement.failed.get(b.name, "not timed")
            ranked.append((b, f"{why} ({reason} when measured)"))
        return ranked


def _stock_at_a_tie(
    request: AttentionRequest, timed: Sequence[Backend], measurement: Measurement
) -> Backend | None:
    """The stock backend, where it is timed, in the fastest one's memory class, and
    within :data:`TIE` of it, or within the spread of either one's rounds, but not
    already first; else None."""
    if len(timed) < 2 or timed[0].stock:
        return None
    first = timed[0]
    fastest = measurement.ms[first.name]
    memory = first.memory_class(request)
    for b in timed[1:]:
        if not b.stock or b.memory_class(request) != memory:
            continue
        noise = max(
            TIE, measurement.spread.get(first.name, 0.0), measurement.spread.get(b.name, 0.0)
        )
        if measurement.ms[b.name] <= fastest * (1 + noise):
            return b
    return None


def over(inner: RankingPolicy) -> RankingPolicy:
    """``inner`` with this machine's measurements on top."""
    return MeasuredPolicy(inner)


__all__ = [
    "TIE",
    "MeasuredPolicy",
    "Measurement",
    "MeasurementStore",
    "distributed_job",
    "forget_stores",
    "over",
    "request_key",
    "store_for",
    "store_path",
]
