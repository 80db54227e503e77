"""Running conformance cases against a backend, through :func:`attnhub.attention`.

Every call names the backend (``backend=name``), so dispatch is exercised on the way:
a backend whose declarations admit a case but that dispatch then refuses fails the
case, and a backend is never silently replaced by another.

The kit does not trust the backend, and nothing a backend does wrong escapes it as a
raw exception or passes unnoticed. Each of these is a problem of the case, in the
kit's report with the case id:

- The references (:mod:`attnhub.testing.reference`) are computed first, from copies of
  the inputs, so a backend that changes its inputs cannot move them.
- The call and the backward: any exception (``KeyboardInterrupt`` aside) is reported
  with its type, message and where it was raised (:mod:`attnhub.testing.faults`).
- The result: a tensor, or with ``return_lse`` a tuple ``(out, lse)``, each of the
  contract's shape, dtype and device, sharing no memory with an input (a view of an
  input, or a tensor written over it, changes when the caller's tensor does).
- The inputs (query, key, value, attn_mask, and in the backward grad_out and, where the
  lse is returned, grad_lse): neither their values nor their metadata (shape, strides,
  storage offset, dtype, device, requires_grad, storage) change, and no in-place operation touches them (their
  version counter stays put: a bump breaks the caller's autograd graph even when the
  values come back), during the call or during the backward.
- Process-wide settings (grad mode, default dtype, float32 matmul precision,
  deterministic algorithms) are as they were; the kit restores them after reporting.
- Then the numbers: contract.md's tolerance rule (:mod:`attnhub.testing.tolerance`),
  NaN never passing, fully masked rows exactly zero.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

import attnhub
from attnhub.backend import Backend
from attnhub.output_check import unchecked
from attnhub.registry import get_registry

from .block_sparse import block_sparse_problems, sample_block_sparse_cases
from .cases import Case, Inputs, case_reasons, cases_for, make_inputs
from .faults import describe_exception, passes_through
from .reference import references
from .serving import sample_serving_cases, serving_problems
from .tolerance import compare, fully_masked_problems, highest_float32_precision

_INPUT_NAMES = ("query", "key", "value", "attn_mask", "grad_out", "grad_lse")

# What "the tensor the caller passed" is besides its values; a backend may change none of it.
_METADATA: tuple[tuple[str, Callable[[torch.Tensor], object]], ...] = (
    ("shape", lambda t: tuple(t.shape)),
    ("stride", lambda t: t.stride()),
    ("storage offset", lambda t: t.storage_offset()),
    ("dtype", lambda t: t.dtype),
    ("device", lambda t: t.device),
    ("requires_grad", lambda t: t.requires_grad),
    ("storage", lambda t: hex(t.untyped_storage().data_ptr())),
)

# Process-wide settings a backend must leave as it found them: (label, get, set).
_GLOBAL_STATE: tuple[tuple[str, Callable[[], Any], Callable[[Any], Any]], ...] = (
    ("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    ("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    (
        "float32 matmul precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    (
        "deterministic algorithms (enabled, warn_only)",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        lambda state: torch.use_deterministic_algorithms(state[0], warn_only=state[1]),
    ),
)


# -- what a call may not change -----------------------------------------------------


@dataclass(frozen=True)
class _TensorState:
    """One input tensor as it was before the backend ran."""

    metadata: tuple[object, ...]
    values: torch.Tensor
    version: int

    @classmethod
    def of(cls, t: torch.Tensor) -> _TensorState:
        metadata = tuple(get(t) for _, get in _METADATA)
        return cls(metadata, t.detach().clone(), t._version)

    def change(self, t: torch.Tensor) -> str | None:
        """What changed in ``t`` since (None: nothing)."""
        metadata = tuple(get(t) for _, get in _METADATA)
        moved = [
            f"{label} {before} -> {after}"
            for (label, _), before, after in zip(_METADATA, self.metadata, metadata, strict=True)
            if before != after
        ]
        if moved:  # values are compared only where the tensor still has its layout
            return ", ".join(moved)
        now = t.detach()
        same = now == self.values
        if now.is_floating_point():
            same |= now.isnan() & self.values.isnan()
        if not bool(same.all()):
            return f"{int((~same).sum())} of {same.numel()} values changed"
        if t._version != self.version:
            return (
                f"an in-place operation on it (version counter {self.version} -> "
                f"{t._version}), though its values are unchanged"
            )
        return None


class _Watch:
    """The inputs and the process-wide settings before a call, to compare with after it."""

    def __init__(self, inputs: Inputs) -> None:
        self._tensors = {
            name: _TensorState.of(t)
            for name in _INPUT_NAMES
            if (t := getattr(inputs, name)) is not None
        }
        self._settings = [get() for _, get, _ in _GLOBAL_STATE]

    def problems(self, inputs: Inputs, during: str) -> list[str]:
        """What changed during ``during``; changed settings are restored."""
        problems = [
            f"{name} modified in place during {during}: {change}"
            for name, state in self._tensors.items()
            if (change := state.change(getattr(inputs, name))) is not None
        ]
        for (label, get, set_), before in zip(_GLOBAL_STATE, self._settings, strict=True):
            after = get()
            if after != before:
                set_(before)
                problems.append(f"changed {label} during {during}: {before} -> {after} (restored)")
        return problems


# -- one call -----------------------------------------------------------------------


@dataclass
class CallResult:
    """One call of a backend through :func:`attnhub.attention`, and its backward, as seen
    by the kit.

    ``out`` and ``lse``: the results, or None where absent or unusable (not a tensor,
    or of the wrong shape, dtype or device: a problem says which). ``grads``: the
    gradients that flowed, by name (``dq``, ``dk``, ``dv``, ``dmask``). ``problems``:
    everything found wrong without a reference, one line each.
    """

    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


_RAISED = object()  # what _watched returns when the code raised


def _watched(
    result: CallResult,
    inputs: Inputs,
    during: str,
    code: Callable[[], Any],
    prefix: str,
    backend_name: str | None,
) -> Any:
    """Run backend code; what it raises or changes goes into ``result.problems``."""
    watch = _Watch(inputs)
    try:
        value = code()
    except BaseException as exc:
        if passes_through(exc):
            raise
        result.problems.append(f"{prefix}raised {describe_exception(exc, backend_name)}")
        value = _RAISED
    result.problems += watch.problems(inputs, during)
    return value


def _kind(x: object) -> str:
    if isinstance(x, tuple | list):
        return f"{type(x).__name__} of {len(x)}"
    return type(x).__name__


def _storage(t: torch.Tensor) -> tuple[torch.device, int] | None:
    """Identifies the memory ``t`` lives in (None: it holds none)."""
    storage = t.untyped_storage()
    return (t.device, storage.data_ptr()) if storage.nbytes() else None


def _tensor_problems(
    label: str,
    x: object,
    expected: tuple[tuple[int, ...], torch.dtype, torch.device],
    inputs: Inputs,
) -> tuple[bool, list[str]]:
    """(usable, problems) for a returned ``x`` that should be a new tensor of ``expected``
    (shape, dtype, device). Sharing memory with an input is a problem, not unusable."""
    if not isinstance(x, torch.Tensor):
        return False, [f"{label}: expected a tensor, got {_kind(x)}"]
    got = (tuple(x.shape), x.dtype, x.device)
    wrong = [
        f"{what} {g}, expected {e}"
        for what, g, e in zip(("shape", "dtype", "device"), got, expected, strict=True)
        if g != e
    ]
    if wrong:
        return False, [f"{label}: " + ", ".join(wrong)]
    memory = _storage(x)
    shared = [
        name
        for name in _INPUT_NAMES
        if (t := getattr(inputs, name)) is not None and memory is not None and _storage(t) == memory
    ]
    if shared:
        return True, [
            f"{label}: shares memory with {', '.join(shared)} (a view of an input, not a new tensor)"
        ]
    return True, []


def _unpack(
    returned: Any, return_lse: bool, case: Case, inputs: Inputs, problems: list[str]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The usable (out, lse) of what the call returned; what is wrong goes into ``problems``."""
    if return_lse and not (isinstance(returned, tuple) and len(returned) == 2):
        problems.append(f"return_lse=True must return a tuple (out, lse), got {_kind(returned)}")
        return None, None
    out, lse = returned if return_lse else (returned, None)
    device = inputs.query.device
    rows = (case.B, case.Hq, case.Nq)
    out_ok, out_problems = _tensor_problems(
        "out", out, ((*rows, case.Dv), case.dtype, device), inputs
    )
    problems += out_problems
    lse_ok = False
    if return_lse:
        lse_ok, lse_problems = _tensor_problems("lse", lse, (rows, torch.float32, device), inputs)
        problems += lse_problems
    return (out if out_ok else None), (lse if lse_ok else None)


def _backward(
    result: CallResult,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    inputs: Inputs,
    backend_name: str | None,
) -> None:
    leaves = inputs.differentiable()
    if not out.requires_grad:
        result.problems.append("bwd: the output does not require grad")
        return
    outputs, upstream = [out], [inputs.grad_out]
    if inputs.grad_lse is not None and lse is not None:
        if not lse.requires_grad:  # a loss on it would silently treat it as a constant
            result.problems.append("bwd: the lse does not require grad (declared lse_grad)")
            return
        outputs.append(lse)
        upstream.append(inputs.grad_lse)
    grads = _watched(
        result,
        inputs,
        "backward",
        lambda: torch.autograd.grad(outputs, [t for _, t in leaves], upstream, allow_unused=True),
        "backward ",
        backend_name,
    )
    if grads is _RAISED:
        return
    for (name, _), g in zip(leaves, grads, strict=True):
        if g is None:
            result.problems.append(f"{name}: no gradient flowed")
        else:
            result.grads[name] = g


def _compiled(options: dict[str, Any], backend_name: str | None) -> Callable[..., Any]:
    """``attnhub.attention(q, k, v, mask, **options, backend=backend_name)`` through
    ``torch.compile(fullgraph=True)`` with the ``aot_eager`` backend: Dynamo and
    AOTAutograd trace the call (the forward and the backward graph) and run the traced
    graphs as they are, with no code generated, so that any graph break is an error
    and the numbers are those of the backend's own kernels."""

    def attention(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return attnhub.attention(q, k, v, mask, **options, backend=backend_name)

    return torch.compile(attention, backend="aot_eager", fullgraph=True, dynamic=False)


def _unlimited_recompiles() -> dict[str, Any]:
    """Dynamo settings for the kit's compiled calls. Each is one more entry on the same
    code object: past Dynamo's limit (8) it would run the call eagerly, silently. The
    limit was ``cache_size_limit`` before torch 2.7."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    settings: dict[str, Any] = {limit: 1 << 20}
    if hasattr(config, "fail_on_recompile_limit_hit"):
        settings["fail_on_recompile_limit_hit"] = True
    return settings


def run_call(
    backend_name: str | None,
    case: Case,
    inputs: Inputs,
    *,
    options: dict[str, Any] | None = None,
    backward: bool | None = None,
    compiled: bool = False,
) -> CallResult:
    """Call ``backend_name`` on ``inputs`` (and run the backward), recording what went wrong.

    ``options``: keyword arguments of :func:`attnhub.attention` (default: the case's);
    ``backward``: take gradients with ``inputs.grad_out`` (default: ``case.backward``);
    ``compiled``: make the call through :func:`_compiled`. Never raises for what the
    backend does (see the module doc); compares nothing with a reference.
    """
    options = case.options() if options is None else options
    backward = case.backward if backward is None else backward
    result = CallResult()
    attention = _compiled(options, backend_name) if compiled else None

    def call() -> Any:
        q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.attn_mask
        with unchecked():  # the kit judges what the backend returned itself
            if attention is not None:
                with torch._dynamo.config.patch(**_unlimited_recompiles()):
                    return attention(q, k, v, mask)
            return attnhub.attention(q, k, v, mask, **options, backend=backend_name)

    returned = _watched(result, inputs, "the call", call, "", backend_name)
    if returned is _RAISED:
        return result
    result.out, result.lse = _unpack(
        returned, bool(options.get("return_lse", False)), case, inputs, result.problems
    )
    if backward and result.out is not None:
        _backward(result, result.out, result.lse, inputs, backend_name)
    return result


def _guarded(what: str, check: Callable[[], list[str]]) -> list[str]:
    """``check()``, or one problem naming what it raised: the kit reports, never crashes."""
    try:
        return check()
    except BaseException as exc:
        if passes_through(exc):
            raise
        return [f"the kit could not finish {what}: {describe_exception(exc)}"]


# -- one case -----------------------------------------------------------------------


def case_problems(
    backend_name: str | None, case: Case, device: torch.device | str = "cpu"
) -> list[str]:
    """What differs between ``backend_name`` and the contract on ``case`` (empty: it conforms).
    ``None`` holds attnhub's own choice to it: dispatch picks the backend, as a user's
    call without ``backend=`` does.

    Never raises for what the backend does: an exception, a wrong result or a changed
    input is a problem in the list. ``ValueError`` for a case with ``dropout_p > 0``,
    which has no deterministic reference (:func:`dropout_problems` checks dropout).
    """
    if case.dropout_p:
        raise ValueError(
            f"case {case.id}: dropout_p={case.dropout_p} has no deterministic reference; "
            "dropout is checked by attnhub.testing.dropout_problems"
        )
    return _guarded("the case", lambda: _case_problems(backend_name, case, torch.device(device)))


def _case_problems(
    backend_name: str | None, case: Case, device: torch.device, compiled: bool = False
) -> list[str]:
    inputs = make_inputs(case, device)
    with highest_float32_precision():
        r_lp, r64 = references(inputs, case)  # before the backend touches the inputs
        run = run_call(backend_name, case, inputs, compiled=compiled)
    problems = list(run.problems)
    got = {"out": run.out, "lse": run.lse, **run.grads}
    for name, x in got.items():
        if x is not None and (problem := compare(name, x, r_lp[name], r64[name])) is not None:
            problems.append(problem)
    if run.out is not None:
        empty_rows = r64["lse"] == float("-inf")
        problems += fully_masked_problems(empty_rows, run.out, run.grads.get("dq"))
    return problems


def run_case(backend_name: str, case: Case, device: torch.device | str = "cpu") -> None:
    """Run one case; ``AssertionError`` naming the backend, the case and what differed
    (or what the backend raised), if it fails."""
    problems = case_problems(backend_name, case, device)
    if problems:
        raise AssertionError(f"{backend_name} [{case.id}]: " + "; ".join(problems))


# -- dropout ------------------------------------------------------------------------


@dataclass(frozen=True)
class _DropoutSetup:
    case: Case
    p: float


def _dropout_setup(backend: Backend, device: torch.device, p: float) -> _DropoutSetup | None:
    """A call where the dropout mask can be read off the output.

    Keys are zero, so every score is 0 and every attention weight is exactly 1/Nk;
    values are the identity (Dv = Nk), so ``out[..., i, j]`` is the weight of key j
    for query i after dropout: 0 where dropped, 1 / (Nk (1 - p)) where kept.
    """
    dtypes = [
        d
        for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        if d in backend.dtypes
    ]
    for dtype in dtypes:
        for n in (64, 32, 128, 16, 8, 256):
            case = Case(dtype=dtype, B=2, Hq=4, Hkv=4, Nq=64, Nk=n, D=n, Dv=n, dropout_p=p,
                        backward=backend.backward)  # fmt: skip
            if not case_reasons(backend, case, device):
                return _DropoutSetup(case, p)
    return None


def _dropout_inputs(setup: _DropoutSetup, device: torch.device) -> Inputs:
    case = setup.case
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(case.B, case.Hq, case.Nq, case.D, generator=gen).to(device, case.dtype)
    k = torch.zeros(case.B, case.Hkv, case.Nk, case.D, device=device, dtype=case.dtype)
    eye = torch.eye(case.Nk, device=device, dtype=case.dtype)
    v = eye.expand(case.B, case.Hkv, case.Nk, case.Nk).contiguous()
    grad_out = torch.randn(case.B, case.Hq, case.Nq, case.Dv, generator=gen).to(device, case.dtype)
    for t in (q, k, v):
        t.requires_grad_(case.backward)
    return Inputs(q, k, v, None, grad_out if case.backward else None)


@dataclass(frozen=True)
class _DropoutRun:
    label: str
    seed: int | None
    options: dict[str, Any]
    backward: bool


def _dropout_runs(setup: _DropoutSetup) -> tuple[_DropoutRun, ...]:
    """plain (p = 0 passed), no_arg (dropout_p left out), two runs after one seed, one after another."""
    p, backward = setup.p, setup.case.backward
    return (
        _DropoutRun("dropout_p=0.0", None, {"dropout_p": 0.0}, backward),
        _DropoutRun("no dropout_p", None, {}, False),
        _DropoutRun(f"dropout_p={p:g}, seed 1234", 1234, {"dropout_p": p}, backward),
        _DropoutRun(f"dropout_p={p:g}, seed 1234 again", 1234, {"dropout_p": p}, backward),
        _DropoutRun(f"dropout_p={p:g}, seed 4321", 4321, {"dropout_p": p}, backward),
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (a NaN result is reported once, as NaN, not as a difference)."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def dropout_problems(
    backend_name: str, device: torch.device | str = "cpu", p: float = 0.2
) -> list[str]:
    """Dropout as contract.md says: p = 0 exact, seeded, kept fraction 1 - p, kept
    weights scaled by 1 / (1 - p), and the backward using the forward's mask.

    Never raises for what the backend does: it is a problem in the list."""
    device = torch.device(device)
    backend = get_registry().get(backend_name)
    setup = _dropout_setup(backend, device, p)
    if setup is None:
        return [
            f"dropout: declared, but no dropout call of the kit's shape is admitted on {device}"
        ]
    problems = _guarded("the dropout checks", lambda: _dropout_check(backend_name, setup, device))
    return [f"[{setup.case.id}-dropout{p:g}] {message}" for message in problems]


def _dropout_check(backend_name: str, setup: _DropoutSetup, device: torch.device) -> list[str]:
    inputs = _dropout_inputs(setup, device)
    case, p = setup.case, setup.p
    results: list[list[torch.Tensor]] = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), highest_float32_precision():
        for spec in _dropout_runs(setup):
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            run = run_call(backend_name, case, inputs, options=spec.options, backward=spec.backward)
            if run.problems or run.out is None:  # the first run that fails says why
                return [f"{spec.label}: {problem}" for problem in run.problems]
            # Clones: a reused output buffer must not make two runs agree.
            results.append([t.detach().clone() for t in (run.out, *run.grads.values())])
    plain, no_arg, first, again, other = results
    problems = []
    labels = ["out", "dq", "dk", "dv"]
    for label, result in zip(labels, first, strict=False):
        nan = int(result.isnan().sum())
        if nan:
            problems.append(f"dropout: {label} has {nan} NaN values")
    if problems:
        return problems
    if not _same(plain[0], no_arg[0]):
        problems.append("dropout_p=0.0: output differs from the call without dropout_p")
    for label, a, b in zip(labels, first, again, strict=False):
        if not _same(a, b):
            problems.append(
                f"dropout: {label} differs between two runs after torch.manual_seed(1234)"
            )
    if _same(first[0], other[0]):
        problems.append("dropout: torch.manual_seed(1234) and (4321) give the same output")
    out = first[0].double()
    kept = out != 0
    n = kept.numel()
    fraction = float(kept.double().mean())
    sigma = math.sqrt(p * (1 - p) / n)
    if abs(fraction - (1 - p)) > 6 * sigma + 1e-3:
        problems.append(
            f"dropout: kept fraction {fraction:.4f} over {n} weights, expected {1 - p:.4f} "
            f"(+- {6 * sigma:.4f})"
        )
    expected = 1.0 / (case.Nk * (1 - p))
    rtol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(case.dtype, 1e-5)
    worst = float((out[kept] - expected).abs().max()) if kept.any() else 0.0
    if worst > rtol * expected:
        problems.append(
            f"dropout: kept weights must be 1 / (Nk (1 - p)) = {expected:.6g}; off by up to {worst:.3g}"
        )
    if case.backward and len(first) == 4:
        # out = P_dropped (values are the identity), so dv = P_dropped^T @ grad_out: a
        # backward that draws a different mask than the forward cannot match it.
        assert inputs.grad_out is not None
        expected_dv = out.transpose(-2, -1) @ inputs.grad_out.double()
        error = float((first[3].double() - expected_dv).abs().max())
        scale = float(expected_dv.abs().max())
        if error > 10 * rtol * scale + 1e-5:
            problems.append(
                f"dropout: dv = P_dropped^T @ grad_out is off by {error:.3g} (scale {scale:.3g}); "
                "the backward does not reuse the forward's dropout mask"
            )
    return problems


# -- whole backend ------------------------------------------------------------------


def _repeat_problems(backend_name: str, case: Case, device: torch.device) -> list[str]:
    """Why two identical calls (with their backward) are not bitwise equal (empty: they are)."""
    first = run_call(backend_name, case, make_inputs(case, device))
    if first.problems or first.out is None:
        return ["repeatability not checked, the call fails: " + "; ".join(first.problems)]
    kept = [t.detach().clone() for t in (first.out, *first.grads.values())]
    second = run_call(backend_name, case, make_inputs(case, device))
    if second.problems or second.out is None:
        return ["the second of two identical calls fails: " + "; ".join(second.problems)]
    if _storage(first.out) == _storage(second.out) or not _same(first.out, kept[0]):
        return [
            "the second call's output is written into the first's memory: the backend "
            "reuses an output buffer, overwriting a result the caller still holds"
        ]
    again = [t.detach() for t in (second.out, *second.grads.values())]
    if len(again) != len(kept) or not all(_same(a, b) for a, b in zip(kept, again, strict=True)):
        what = "backward (declared deterministic)" if case.backward else "forward"
        return [f"{what} is not bitwise repeatable"]
    return []


def repeatability_problems(
    backend_name: str, cases: Iterable[Case], device: torch.device | str
) -> list[str]:
    """The forward is bitwise repeatable; the backward too where declared deterministic;
    and a second call leaves the first call's output alone."""
    backend = get_registry().get(backend_name)
    device = torch.device(device)
    problems = []
    for case in cases:
        if case.backward and not backend.deterministic:
            continue
        found = _guarded(
            "the repeatability check",
            functools.partial(_repeat_problems, backend_name, case, device),
        )
        problems += [f"[{case.id}] {problem}" for problem in found]
    return problems


def compiled_cases(
    backend: Backend, cases: Iterable[Case], device: torch.device | str
) -> list[Case]:
    """The cases :func:`compiled_problems` runs for a backend that declares
    ``compile_safe`` (none otherwise): among ``cases``, the first without a backward
    and the first with one that the backend admits when the call is traced."""
    if not backend.compile_safe:
        return []
    admitted = [c for c in cases if not case_reasons(backend, c, device, traced=True)]
    return [*[c for c in admitted if not c.backward][:1], *[c for c in admitted if c.backward][:1]]


def compiled_problems(
    backend_name: str, case: Case, device: torch.device | str = "cpu"
) -> list[str]:
    """What differs from the contract when ``case`` is called through
    ``torch.compile(fullgraph=True)`` (``aot_eager``: Dynamo and AOTAutograd trace the
    call, and the traced graphs run as they are): the check of a ``compile_safe``
    declaration. A graph break is a problem (what Dynamo raised), as is any result
    that an eager call would fail on."""
    return _guarded(
        "the compiled case",
        lambda: _case_problems(backend_name, case, torch.device(device), compiled=True),
    )


def default_device(backend: Backend) -> torch.device:
    """CUDA when the backend runs there and a GPU is present, else the CPU, else its first device."""
    if "cuda" in backend.devices and torch.cuda.is_available():
        return torch.device("cuda")
    if "cpu" in backend.devices:
        return torch.device("cpu")
    return torch.device(sorted(backend.devices)[0])


# Block-sparse cases in the planned suite of a backend that declares block_sparse
# (cases_for plans none: its cases carry no layout).
BLOCK_SPARSE_CASES = 12
# Serving cases of a backend that declares the varlen, kvcache or paged layout (the
# other cases are dense calls of attnhub.attention).
SERVING_CASES = 12


def check_backend(
    name: str,
    device: torch.device | str | None = None,
    size: str = "small",
    *,
    cases: Iterable[Case] | None = None,
    max_reported: int = 20,
) -> int:
    """Run the conformance suite against the registered backend ``name``.

    Every case of :func:`cases_for` (or ``cases``), the dropout checks where dropout is
    declared (and a dense case admitted), repeatability, and, where ``block_sparse`` is
    declared and ``cases`` not given, ``BLOCK_SPARSE_CASES`` cases of
    :func:`sample_block_sparse_cases`, and where a serving layout is declared (varlen,
    kvcache, paged) and ``cases`` not given, ``SERVING_CASES`` cases of
    :func:`sample_serving_cases`, and where ``compile_safe`` is declared, the
    :func:`compiled_cases` through ``torch.compile`` (:func:`compiled_problems`).
    Returns the number of cases run; raises
    ``AssertionError`` naming each failing case id and what differed (what the backend
    raised, returned or changed is reported the same way, never raised through).
    """
    registry = get_registry()
    backend = registry.get(name)  # ValueError listing the known names
    why = registry.unavailable_reason(name)
    if why is not None:
        raise AssertionError(f"{name} is unavailable here: {why}")
    device = torch.device(device) if device is not None else default_device(backend)
    sparse, serving = [], []
    if cases is None:
        sparse = sample_block_sparse_cases(backend, device, BLOCK_SPARSE_CASES, size=size)
        serving = sample_serving_cases(backend, device, SERVING_CASES, size=size)
    cases = list(cases) if cases is not None else cases_for(backend, device, size=size)
    if not cases and not sparse and not serving:
        raise AssertionError(
            f"{name}: its declarations admit no conformance case on {device.type} "
            f"(devices: {', '.join(sorted(backend.devices))})"
        )
    compiled = compiled_cases(backend, cases, device)
    # One entry per check: its report lines (empty: it passed).
    results = [
        *_per_case(case_problems, name, cases, device),
        *_per_case(block_sparse_problems, name, sparse, device),
        *_per_case(serving_problems, name, serving, device),
        *_per_case(compiled_problems, name, compiled, device, "compiled: "),
    ]
    # The dropout checks make dense calls: a backend that admits none (one serving only
    # block_sparse or serving calls) checks its dropout in its own tests.
    if backend.dropout and cases:
        results.append(dropout_problems(name, device))
    sample = [*cases[:1], *[c for c in cases if c.backward][:1]]
    results += [repeatability_problems(name, [case], device) for case in sample]
    failures = [line for lines in results for line in lines]
    if failures:
        shown = failures[:max_reported]
        more = (
            f"\n  ... and {len(failures) - len(shown)} more" if len(failures) > len(shown) else ""
        )
        failed = sum(1 for lines in results if lines)
        raise AssertionError(
            f"{name} failed {failed} of {len(results)} conformance checks on {device}:\n  "
            + "\n  ".join(shown)
            + more
        )
    return len(cases) + len(sparse) + len(serving) + len(compiled)


def _per_case(
    check: Callable[[str, Any, torch.device], list[str]],
    name: str,
    cases: Iterable[Any],
    device: torch.device,
    what: str = "",
) -> list[list[str]]:
    """One report entry per case: ``[id] what problems`` on one line, or none."""
    return [
        [f"[{case.id}] {what}" + "; ".join(problems)] if (problems := check(name, case, device))
        else []
        for case in cases
    ]  # fmt: skip
