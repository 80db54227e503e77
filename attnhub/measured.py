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

A signature is an :class:`~attnhub.request.AttentionRequest` (its sequence lengths
bucketed to powers of two). :class:`MeasuredPolicy` ranks a request's eligible backends
by its measurement, fastest first within each memory class, and hands requests it has
no measurement for to the policy beneath it (the shipped cost table, or the declared
priority).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import env
from .backend import Backend
from .cost_table import cache_dir
from .jsonfile import write_json
from .ranking import RankingPolicy
from .registry import invalidate_caches
from .request import AttentionRequest, dtype_name, seqlen_bucket

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


def request_key(request: AttentionRequest) -> str:
    """A stable text key for a request, the same in every process; the batch bucketed to
    a power of two like the lengths (a server's batch varies call by call)."""
    fields = dataclasses.asdict(request)
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


class MeasurementStore:
    """What was measured on one device, read from and written to its file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, Measurement] = {}
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> None:
        if not self.path.is_file():
            return
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r} is not {FORMAT!r}")
            for key, entry in data["entries"].items():
                ms = {str(b): float(t) for b, t in entry["ms"].items()}
                if not all(t > 0 and t == t and t != float("inf") for t in ms.values()):
                    raise ValueError(f"entry {key}: times must be finite and > 0")
                spread = {str(b): float(x) for b, x in entry.get("spread", {}).items()}
                if not all(0 <= x < float("inf") for x in spread.values()):
                    raise ValueError(f"entry {key}: spreads must be finite and >= 0")
                self._entries[key] = Measurement(
                    ms, str(entry["when"]), dict(entry.get("failed", {})), spread
                )
        except Exception as exc:  # a broken file must not break dispatch: measure again
            log.warning(
                "attnhub: ignoring measurements in %s: %s: %s", self.path, type(exc).__name__, exc
            )
            self._entries.clear()

    def get(self, request: AttentionRequest) -> Measurement | None:
        return self._entries.get(request_key(request))

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request: AttentionRequest, measurement: Measurement) -> None:
        """Keep a measurement, write the file, and forget every decision made without it."""
        with self._lock:
            self._entries[request_key(request)] = measurement
            data = {
                "format": FORMAT,
                "entries": {
                    key: {
                        "ms": dict(m.ms),
                        "when": m.when,
                        "failed": dict(m.failed),
                        "spread": dict(m.spread),
                    }
                    for key, m in sorted(self._entries.items())
                },
            }
            try:
                write_json(data, self.path)
            except OSError as exc:  # a read-only cache: keep it in memory only
                log.warning("attnhub: could not write measurements to %s: %s", self.path, exc)
        invalidate_caches()


_stores: dict[str, MeasurementStore] = {}
_stores_lock = threading.Lock()


def store_for(device: torch.device) -> MeasurementStore:
    """The store of ``device``'s kind (read from disk on first use).

    Keyed by its file, so that every spelling of one device (``cuda``, ``cuda:0``)
    shares one store: the tensors' device says ``cuda:0`` where the request, which
    keeps only the device type, says ``cuda``.
    """
    key = str(store_path(device))
    store = _stores.get(key)
    if store is None:
        with _stores_lock:
            store = _stores.get(key)
            if store is None:
                store = _stores[key] = MeasurementStore(store_path(device))
    return store


def forget_stores() -> None:
    """Forget the measurements read (and every decision): the next use reads again."""
    with _stores_lock:
        _stores.clear()
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
