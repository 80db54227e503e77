"""Ranking what was never measured: a cost model of each backend that generalizes.

Where no measurement of a call exists and none can be taken (while ``torch.compile``
traces, while a CUDA graph is captured, in a distributed job without a shared
measurement file, with ``ATTNHUB_AUTOTUNE=0``) and the shipped cost table does not
cover the call (it measures plain attention on a grid), backends are ranked by an
estimate of what the call costs on each, instead of a flat priority::

    time = host + max(FLOPs / throughput, bytes / bandwidth)

- FLOPs: 2 (D + Dv) for each kept (query, key) pair (causal keeps about half of a
  square call); forward and backward together count 3.5 times the forward.
- bytes: q, k, v and the output once (a decoding step reads its whole KV cache), and
  a mask where the call has one, one byte per element.
- host, throughput and bandwidth are each backend's own, fitted per device class from
  the H200 workload runs (``benchmarks/fit_cost_model.py`` writes
  ``attnhub/data/cost_model_<class>.json``): the host time of a call, the forward and
  forward+backward FLOP rates of prefill calls, the bandwidth of decoding steps.

A backend the file does not know (a plugin) is estimated with the file's ``default``
constants, the median backend; the model ranks within one memory class only (linear
before quadratic, as every policy does). Within a class, a backend that declares
``compiles_per_shape`` ranks after those that do not: the model ranks calls nobody
measured, whose first call on such a backend compiles (seconds), a cost no constant
of the fit holds; its throughput was fitted on shapes already compiled. (Seen on the
H200: with triton_flash's host constant fitted before its host-path plans, the paged
decode steps of ``examples/paged_generate.py`` went to FlexAttention, 35 tokens/s.)
The model is a ranking, not a prediction: its numbers are stated in ``explain()`` as
estimates.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .backend import MEMORY_CLASSES, Backend, is_finite_number
from .ranking import DeclaredPriority
from .request import AttentionRequest

FORMAT = "attnhub-cost-model/1"
BACKWARD_FACTOR = 3.5  # forward + backward FLOPs over forward FLOPs
_DATA = Path(__file__).resolve().parent / "data"

__all__ = ["BACKWARD_FACTOR", "CostModel", "CostModelPolicy", "KernelCost", "Work", "work"]


@dataclass(frozen=True)
class KernelCost:
    """One backend's constants: host microseconds per call, forward and forward+backward
    TFLOP/s, and TB/s of the bytes a call moves."""

    host_us: float
    fwd_tflops: float
    fwd_bwd_tflops: float
    tbps: float

    def __post_init__(self) -> None:
        for name in ("host_us", "fwd_tflops", "fwd_bwd_tflops", "tbps"):
            value = getattr(self, name)
            if not (is_finite_number(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
            if name != "host_us" and value == 0:
                raise ValueError(f"{name} must be > 0")

    def ms(self, w: Work) -> float:
        """Estimated milliseconds for a call of work ``w``."""
        tflops = self.fwd_bwd_tflops if w.backward else self.fwd_tflops
        return self.host_us / 1e3 + max(w.flops / (tflops * 1e9), w.bytes / (self.tbps * 1e9))


@dataclass(frozen=True)
class Work:
    """What a call computes and moves: FLOPs (forward, or forward and backward) and bytes."""

    flops: float
    bytes: float
    backward: bool


def _kept_fraction(request: AttentionRequest) -> float:
    """The share of (query, key) pairs causal keeps (1 without causal); lengths are the
    request's buckets. A window's size is not in the request: counted as no window."""
    if not request.causal:
        return 1.0
    nq, nk = request.seqlen_q, request.seqlen_k
    if request.alignment == "bottom_right" and nq <= nk:
        return 1.0 - nq / (2.0 * nk)
    return min(1.0, (nk + 1) / (2.0 * max(nq, 1)))


def work(request: AttentionRequest) -> Work:
    """The FLOPs and bytes of a request (its lengths are buckets: upper bounds)."""
    batch = request.batch if request.batch is not None else 1
    nq, nk = request.seqlen_q, request.seqlen_k
    d, dv = request.head_dim, request.head_dim_v
    pairs = batch * request.heads_q * nq * nk * _kept_fraction(request)
    flops = 2.0 * (d + dv) * pairs
    element = torch.empty((), dtype=request.dtype).element_size()
    moved = element * batch * (request.heads_q * nq * (d + dv) + request.heads_kv * nk * (d + dv))
    if request.mask != "none":
        moved += batch * nq * nk
    if request.needs_grad:
        return Work(flops * BACKWARD_FACTOR, 2.5 * moved, True)
    return Work(flops, float(moved), False)


@dataclass(frozen=True)
class CostModel:
    """The constants of one device class: per backend, and the default for the others."""

    device: str
    source: str
    backends: Mapping[str, KernelCost]
    default: KernelCost

    def cost(self, name: str) -> tuple[KernelCost, bool]:
        """(the constants for backend ``name``, whether they are its own)."""
        own = self.backends.get(name)
        return (own, True) if own is not None else (self.default, False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str) -> CostModel:
        if data.get("format") != FORMAT:
            raise ValueError(f"{source}: format {data.get('format')!r} is not {FORMAT!r}")
        backends = {str(n): KernelCost(**c) for n, c in dict(data["backends"]).items()}
        return cls(str(data["device"]), source, backends, KernelCost(**data["default"]))

    @classmethod
    def shipped(cls, device: str) -> CostModel | None:
        """The model shipped for a device class, or None."""
        path = _DATA / f"cost_model_{device}.json"
        if not path.is_file():
            return None
        return cls.from_json(json.loads(path.read_text()), path.name)


class CostModelPolicy:
    """Rank eligible backends by the cost model's estimate, within each memory class."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.name = f"cost model ({model.source})"
        self._declared = DeclaredPriority()

    def rank(
        self, request: AttentionRequest, eligible: Sequence[Backend]
    ) -> list[tuple[Backend, str]]:
        w = work(request)
        estimates = {b.name: self.model.cost(b.name) for b in eligible}
        ranked: list[tuple[Backend, str]] = []
        for memory in MEMORY_CLASSES:
            group = sorted(
                (b for b in eligible if b.memory_class(request) == memory),
                key=lambda b: (
                    b.compiles_per_shape,
                    estimates[b.name][0].ms(w),
                    -b.priority,
                    b.name,
                ),
            )
            others_compile_once = any(not b.compiles_per_shape for b in group)
            for b in group:
                cost, own = estimates[b.name]
                basis = "its constants" if own else "the default constants (none of its own)"
                note = f"estimated {cost.ms(w):.3g} ms by {self.name}, {basis}, {memory} memory"
                if b.compiles_per_shape and others_compile_once:
                    note += ", after those that do not compile per shape"
                ranked.append((b, note))
        return ranked
