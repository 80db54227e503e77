"""Autotune: time what no table knows, the first time a call signature runs.

On CUDA, the first time :func:`attnhub.attention` runs a call signature (an
:class:`~attnhub.request.AttentionRequest`: lengths bucketed to powers of two) with
the default selection, every eligible backend is timed on the call's own tensors as
the model pays for it: the prepared runner, wall clock per call with host time
included, after a warm-up call (which also compiles what needs compiling), forward
and, for calls that need gradients, backward. The backends are timed in
:data:`ROUNDS` interleaved rounds, in rotating order, and each keeps its best round:
a slow spell of the host or the GPU (clocks, another process) then hits every
backend alike instead of the one that happened to run in it. A round is at least
:data:`MIN_CALLS` calls and, for short calls, as many more as fill about
:data:`ROUND_MS` (a decode call of 25 us timed five times is a 0.1 ms sample, inside
the host's jitter), so a first call spends about ``ROUNDS * ROUND_MS`` (3 ms) per
backend on small calls and ``1 + ROUNDS * MIN_CALLS`` calls' time on large ones; small
calls whose rounds disagree take up to :data:`EXTRA_ROUNDS` more. Each
backend's best round and the spread of its rounds (the measurement's own noise) are
kept in :mod:`attnhub.measured` (persisted per device, PyTorch and attnhub version),
which ranks by them (a difference within the noise is a tie, and goes to the stock
backend); the call runs on the first, as does every later call of that signature, in
this process and the next. ``explain()`` says what was measured, when, and in which
file. A measurement that neither timed nor excused a backend now eligible (one a newer
attnhub or a plugin installed since made eligible) is taken again, once, with it.

It does not measure (and the shipped cost table or the declared priority ranks) where
it cannot or must not:

- ``ATTNHUB_AUTOTUNE=0``; a device type not in :data:`attnhub.measured.DEVICES` (CUDA);
- while ``torch.compile`` traces or a CUDA graph is being captured, and wherever else
  the call is not in plain eager mode (:mod:`attnhub.eager`): under a dispatch or
  function mode (FakeTensorMode, whose calls run no kernel: host time would be
  persisted as a backend's; FlopCounterMode or a profiler's mode, which would count
  the timing calls as the caller's), inside a functorch transform, or on tensor
  subclasses;
- calls with dropout (timing would draw from the caller's random stream);
- in a ``torch.distributed`` job of more than one process: every rank must pick the
  same backend for the same call, and timings differ between ranks, so ranks rank by
  the one measurement file ``ATTNHUB_MEASUREMENTS`` names for all of them (written
  beforehand by ``attnhub tune``), or else by the (deterministic) table or priority;
- where fewer than two backends are eligible, or none of them can be timed (below).

A backend that declares ``compiles_per_shape`` (FlexAttention compiled with static
shapes) is not timed: its warm-up call would compile, for seconds, in the user's first
call of every signature; it is ranked after the timed backends by the policies beneath.
Nor is a backend that no timing could rank first: the reference (it serves only where
nothing else can) and, where a linear-memory backend is eligible, every quadratic-memory
one (every policy ranks linear memory first). Timing those would only spend the
caller's memory: the reference materializes the float32 scores, 64 GiB for a causal
call of B=1, H=16, N=32K (seen on the H200: a 130 GiB peak in the first call). One timed
backend beside untimed ones is still measured: the measurement is what ranks it above
them. Left to the cost model, the order of a timed and an untimed backend would rest on
fitted constants that may predate either kernel (seen on the H200: Gemma 2's decode
calls through ``attn_implementation="attnhub"`` went to FlexAttention, untimed, over
triton_flash, and generation ran at 0.78x stock;
benchmarks/results/archive/models-h200-2026-12-01-8c59a60.md).

Timing never touches the caller's tensors (they are read, never written; gradients go
to detached leaves), nor the caller's random state; the outputs of the timed calls are
discarded. A backend that raises or runs out of memory while timed is recorded as
failed, with the reason, and left out.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import env, measured
from .dispatch import REFERENCE, Decision, prepare_candidate
from .errors import error_line
from .registry import get_registry
from .request import AttentionParams
from .timing import loop_ms, rotated, synchronize

log = logging.getLogger("attnhub")

ROUNDS = 3  # interleaved timed rounds per backend, after one warm-up call each
MIN_CALLS = 2  # calls per round, at least
MAX_CALLS = 64  # and at most (a 3 us call: 0.2 ms a round)
# A round of short calls repeats them to about this long. 0.2-0.3 ms rounds left the
# H200's host-bound decodes ranked by noise (a 32K decode's cuDNN read 8% faster than
# triton_flash, 8% slower in steady loops): 1 ms costs ROUNDS ms a backend, once per
# signature and machine (the measurement persists).
ROUND_MS = 1.0
# While a backend's rounds disagree (the median round more than SETTLED over the best)
# and every backend's rounds are short (at most CHEAP_ROUND_MS), up to EXTRA_ROUNDS more
# rounds of every backend. The first rounds of a first call are the ones a cold device
# slows (clocks ramping up, work the model queued before the call), and on an H100 three
# rounds of 0.1-0.2 ms decoding calls spread by 0.18-0.48 (measured-*.json, 2026-12-06);
# a spread that wide makes a difference up to that size a tie, which goes to the stock
# backend (measured._stock_at_a_tie). One H100 run served patched padded decoding steps
# by torch_sdpa, 0.78-1.00x stock end to end (its measurement was not kept: a tie by
# spread is the likely cause), where the next run's measurement read 0.19 ms for it
# against triton_flash's 0.10. Extra rounds cost at most a few milliseconds, once
# per signature and machine; long calls, whose rounds the host's noise hardly moves,
# take none.
SETTLED = 0.10
EXTRA_ROUNDS = 6
CHEAP_ROUND_MS = 2 * ROUND_MS
_lock = threading.Lock()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _untimed(decision: Decision) -> dict[str, str]:
    """The eligible candidates left untimed, each with the reason (module docstring)."""
    registry = get_registry()
    eligible = [registry.get(c.name) for c in decision.candidates if c.eligible]
    linear = any(
        b.name != REFERENCE and b.memory_class(decision.request) == "linear" for b in eligible
    )
    why: dict[str, str] = {}
    for b in eligible:
        if b.name == REFERENCE:
            why[b.name] = "the reference: serves only where no other backend can"
        elif getattr(b, "compiles_per_shape", False):
            why[b.name] = "compiles per shape: not timed at a first call"
        elif linear and b.memory_class(decision.request) != "linear":
            why[b.name] = "quadratic memory, ranked after the linear-memory backends"
    return why


def _covers(found: measured.Measurement, decision: Decision) -> bool:
    """Whether ``found`` timed, or says why it did not time, every eligible candidate of
    ``decision``. One that it does not name (a backend a newer attnhub or a plugin
    installed since made eligible) was never compared: the signature is measured again,
    with it, and the new measurement replaces the old one."""
    return all(
        c.name in found.ms or c.name in found.failed for c in decision.candidates if c.eligible
    )


def wanted(decision: Decision, params: AttentionParams, device: torch.device, eager: bool) -> bool:
    """Whether this call's signature should be measured now (see the module docstring);
    ``eager``: the call runs in plain eager mode (:func:`attnhub.eager.plain_eager` of its
    tensors, which the caller has at hand)."""
    if device.type not in measured.DEVICES or not env.flag(env.AUTOTUNE, default=True):
        return False
    if decision.selection.names is not None or params.dropout_p > 0:
        return False
    if not eager or _capturing(device) or measured.distributed_job():
        return False
    found = measured.store_for(device).get(decision.request)
    if found is not None and _covers(found, decision):
        return False  # measured already (the common answer): decided before the count
    eligible = sum(c.eligible for c in decision.candidates)
    return eligible >= 2 and eligible - len(_untimed(decision)) >= 1


def _call(runner: Callable[..., Any], tensors: tuple[Any, ...], backward: bool) -> None:
    query, key, value, attn_mask = tensors
    if not backward:
        with torch.no_grad():
            runner(query, key, value, attn_mask)
        return
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (query, key, value)]
    out = runner(*leaves, attn_mask)
    out = out[0] if isinstance(out, tuple) else out
    inputs = [t for t in leaves if t.requires_grad]
    torch.autograd.grad(out, inputs, out.detach())


def _calls_per_round(first_ms: float) -> int:
    """Calls in a round after the first, from the first round's time per call."""
    wanted = int(ROUND_MS / first_ms) if first_ms > 0 else MAX_CALLS
    return max(MIN_CALLS, min(MAX_CALLS, wanted))


def _time_all(
    runners: dict[str, Callable[..., Any]],
    tensors: tuple[Any, ...],
    backward: bool,
    device: torch.device,
    failed: dict[str, str],
) -> dict[str, tuple[float, float]]:
    """Each runner's best round, in milliseconds per call (module docstring), and the
    spread of its rounds (:func:`_best_and_spread`). A runner that raises (out of
    memory, a failing kernel) is not a candidate: it goes into ``failed`` with the
    reason, and out of the times."""
    rounds: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    round_index = 0  # round 0: the warm-up call
    while round_index <= ROUNDS or (
        round_index <= ROUNDS + EXTRA_ROUNDS and _unsettled(rounds, calls)
    ):
        for name in rotated(list(runners), round_index):
            if name in failed:
                continue
            try:
                if round_index == 0:
                    _call(runners[name], tensors, backward)
                    continue
                call = functools.partial(_call, runners[name], tensors, backward)
                ms = loop_ms(call, device, calls.get(name, MIN_CALLS))
            except Exception as exc:
                synchronize(device)
                failed[name] = error_line(exc)
                rounds.pop(name, None)
                continue
            calls.setdefault(name, _calls_per_round(ms))
            rounds.setdefault(name, []).append(ms)
        round_index += 1
    return {name: _best_and_spread(times) for name, times in rounds.items()}


def _unsettled(rounds: dict[str, list[float]], calls: dict[str, int]) -> bool:
    """Whether more rounds are wanted (SETTLED, EXTRA_ROUNDS): some backend's rounds
    disagree, and every backend's round is short."""
    spreads = [_best_and_spread(times) for times in rounds.values()]
    cheap = all(best * calls[name] <= CHEAP_ROUND_MS
                for name, (best, _) in zip(rounds, spreads))  # fmt: skip
    return cheap and any(spread > SETTLED for _, spread in spreads)


def _best_and_spread(times: list[float]) -> tuple[float, float]:
    """The best round, and the median round's excess over it: how far the measurement
    moves between rounds, without the one outlier round (a slow spell, a first round
    still paying for a cold cache) that the slowest would make the noise of."""
    ordered = sorted(times)
    best = ordered[0]
    return best, ordered[len(ordered) // 2] / best - 1.0


def measure(
    decision: Decision,
    params: AttentionParams,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> measured.Measurement:
    """Time every eligible backend of ``decision`` on these tensors; keep and return it."""
    device = query.device
    tensors = (query, key, value, attn_mask)
    backward = decision.request.needs_grad
    with _lock:
        store = measured.store_for(device)
        found = store.get(decision.request)
        if found is not None and _covers(found, decision):  # another thread measured it
            return found
        failed = _untimed(decision)
        runners: dict[str, Callable[..., Any]] = {}
        for candidate in decision.candidates:
            if not candidate.eligible or candidate.name in failed:
                continue
            try:
                runners[candidate.name] = prepare_candidate(
                    candidate.name, decision.request, params
                )
            except Exception as exc:  # a backend whose prepare fails is not a candidate
                failed[candidate.name] = error_line(exc)
        timed = _time_all(runners, tensors, backward, device, failed)
        ms = {name: best for name, (best, _) in timed.items()}
        spread = {name: spread for name, (_, spread) in timed.items()}
        result = measured.Measurement(ms, measured.now(), failed, spread)
        store.put(decision.request, result)
    times = ", ".join(f"{name} {t:.4g} ms" for name, t in sorted(ms.items(), key=lambda x: x[1]))
    failures = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
    log.info(
        "attnhub: measured %s: %s", decision.signature,
        times or f"nothing could be timed ({failures}); measured again by the next process",
    )  # fmt: skip
    return result
