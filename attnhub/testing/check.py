"""Running conformance cases against a backend, through :func:`attnhub.attention`.

Every call names the backend (``backend=name``), so dispatch is exercised on the way:
a backend whose declarations admit a case but that dispatch then refuses fails the
case, and a backend is never silently replaced by another.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

import attnhub
from attnhub.backend import Backend
from attnhub.registry import get_registry
from attnhub.validation import make_params

from .cases import Case, Inputs, case_reasons, cases_for, make_inputs
from .tolerance import compare, fully_masked_problems, highest_float32_precision


def _reference(inputs: Inputs, case: Case, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The torch_reference results (out, lse and grads) from the same inputs,
    computed in ``dtype`` (None: the input dtype)."""
    from attnhub.backends.torch_reference import reference_attention

    def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        copy = t.detach()
        if dtype is not None and copy.dtype.is_floating_point:
            copy = copy.to(dtype)
        return copy.requires_grad_(t.requires_grad)

    q, k, v, mask = (leaf(t) for t in (inputs.query, inputs.key, inputs.value, inputs.attn_mask))
    assert q is not None and k is not None and v is not None
    params = make_params(q, **{**case.options(), "scale": _scale(case)}, block_sparse=None)
    with torch.enable_grad():
        out, lse = reference_attention(q, k, v, mask, params)
    result = {"out": out.detach(), "lse": lse.detach()}
    if case.backward:
        assert inputs.grad_out is not None
        grad_out = inputs.grad_out if dtype is None else inputs.grad_out.to(dtype)
        leaves = [("dq", q), ("dk", k), ("dv", v)]
        if mask is not None and mask.requires_grad:
            leaves.append(("dmask", mask))
        grads = torch.autograd.grad(out, [t for _, t in leaves], grad_out)
        result.update({name: g for (name, _), g in zip(leaves, grads, strict=True)})
    return result


def _scale(case: Case) -> float:
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.D)


def _call(name: str, inputs: Inputs, case: Case) -> tuple[torch.Tensor, torch.Tensor | None]:
    result = attnhub.attention(
        inputs.query, inputs.key, inputs.value, inputs.attn_mask, **case.options(), backend=name
    )
    if case.return_lse:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise AssertionError(
                f"return_lse=True must return (out, lse), got {type(result).__name__}"
            )
        return result[0], result[1]
    if not isinstance(result, torch.Tensor):
        raise AssertionError(f"return_lse=False must return a tensor, got {type(result).__name__}")
    return result, None


def case_problems(backend_name: str, case: Case, device: torch.device | str = "cpu") -> list[str]:
    """What differs between ``backend_name`` and the contract on ``case`` (empty: it conforms)."""
    device = torch.device(device)
    inputs = make_inputs(case, device)
    problems: list[str] = []
    with highest_float32_precision():
        out, lse = _call(backend_name, inputs, case)
        got: dict[str, torch.Tensor] = {"out": out}
        if lse is not None:
            got["lse"] = lse
        expected_shape = (case.B, case.Hq, case.Nq, case.Dv)
        if out.dtype != case.dtype or tuple(out.shape) != expected_shape:
            problems.append(
                f"out: expected {expected_shape} {case.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        if lse is not None and (lse.dtype != torch.float32 or lse.shape != out.shape[:3]):
            problems.append(
                f"lse: expected {tuple(out.shape[:3])} torch.float32, "
                f"got {tuple(lse.shape)} {lse.dtype}"
            )
        if case.backward:
            leaves = inputs.differentiable()
            if not out.requires_grad:
                return [*problems, "bwd: the output does not require grad"]
            grads = torch.autograd.grad(
                out, [t for _, t in leaves], inputs.grad_out, allow_unused=True
            )
            for (name, _), g in zip(leaves, grads, strict=True):
                if g is None:
                    problems.append(f"{name}: no gradient flowed")
                else:
                    got[name] = g
        r_lp = _reference(inputs, case, None)
        r64 = _reference(inputs, case, torch.float64)
    if problems:
        return problems
    for name, x in got.items():
        problem = compare(name, x, r_lp[name], r64[name])
        if problem is not None:
            problems.append(problem)
    empty_rows = r64["lse"] == float("-inf")
    problems += fully_masked_problems(empty_rows, out, got.get("dq"))
    return problems


def run_case(backend_name: str, case: Case, device: torch.device | str = "cpu") -> None:
    """Run one case; ``AssertionError`` naming the case and what differed, if it fails."""
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


def _dropout_run(
    name: str, setup: _DropoutSetup, inputs: Inputs, seed: int | None, p: float
) -> list[torch.Tensor]:
    if seed is not None:
        torch.manual_seed(seed)
    out = attnhub.attention(inputs.query, inputs.key, inputs.value, dropout_p=p, backend=name)
    assert isinstance(out, torch.Tensor)
    results = [out.detach()]
    if setup.case.backward:
        leaves = [t for _, t in inputs.differentiable()]
        results += [g.detach() for g in torch.autograd.grad(out, leaves, inputs.grad_out)]
    return results


def dropout_problems(
    backend_name: str, device: torch.device | str = "cpu", p: float = 0.2
) -> list[str]:
    """Dropout as contract.md says: p = 0 exact, seeded, kept fraction 1 - p, kept
    weights scaled by 1 / (1 - p), and the backward using the forward's mask."""
    device = torch.device(device)
    backend = get_registry().get(backend_name)
    setup = _dropout_setup(backend, device, p)
    if setup is None:
        return [
            f"dropout: declared, but no dropout call of the kit's shape is admitted on {device}"
        ]
    inputs = _dropout_inputs(setup, device)
    case = setup.case
    problems = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), highest_float32_precision():
        plain = _dropout_run(backend_name, setup, inputs, None, 0.0)
        no_arg = attnhub.attention(inputs.query, inputs.key, inputs.value, backend=backend_name)
        if not torch.equal(plain[0], no_arg.detach()):
            problems.append("dropout_p=0.0: output differs from the call without dropout_p")
        first = _dropout_run(backend_name, setup, inputs, 1234, p)
        again = _dropout_run(backend_name, setup, inputs, 1234, p)
        other = _dropout_run(backend_name, setup, inputs, 4321, p)
    labels = ["out", "dq", "dk", "dv"]
    for label, a, b in zip(labels[: len(first)], first, again, strict=True):
        if not torch.equal(a, b):
            problems.append(
                f"dropout: {label} differs between two runs after torch.manual_seed(1234)"
            )
    if torch.equal(first[0], other[0]):
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
    return [f"[{case.id}-dropout{p:g}] {message}" for message in problems]


# -- whole backend ------------------------------------------------------------------


def repeatability_problems(
    backend_name: str, cases: Iterable[Case], device: torch.device | str
) -> list[str]:
    """The forward is bitwise repeatable; the backward too where declared deterministic."""
    backend = get_registry().get(backend_name)
    problems = []
    for case in cases:
        if case.backward and not backend.deterministic:
            continue
        runs = []
        for _ in range(2):
            inputs = make_inputs(case, device)
            out, _ = _call(backend_name, inputs, case)
            results = [out.detach()]
            if case.backward:
                leaves = [t for _, t in inputs.differentiable()]
                results += [g.detach() for g in torch.autograd.grad(out, leaves, inputs.grad_out)]
            runs.append(results)
        if not all(torch.equal(a, b) for a, b in zip(*runs, strict=True)):
            what = "backward (declared deterministic)" if case.backward else "forward"
            problems.append(f"[{case.id}] {what} is not bitwise repeatable")
    return problems


def default_device(backend: Backend) -> torch.device:
    """CUDA when the backend runs there and a GPU is present, else the CPU, else its first device."""
    if "cuda" in backend.devices and torch.cuda.is_available():
        return torch.device("cuda")
    if "cpu" in backend.devices:
        return torch.device("cpu")
    return torch.device(sorted(backend.devices)[0])


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
    declared, and repeatability. Returns the number of cases run; raises
    ``AssertionError`` naming each failing case id and what differed.
    """
    registry = get_registry()
    backend = registry.get(name)  # ValueError listing the known names
    why = registry.unavailable_reason(name)
    if why is not None:
        raise AssertionError(f"{name} is unavailable here: {why}")
    device = torch.device(device) if device is not None else default_device(backend)
    cases = list(cases) if cases is not None else cases_for(backend, device, size=size)
    if not cases:
        raise AssertionError(
            f"{name}: its declarations admit no conformance case on {device.type} "
            f"(devices: {', '.join(sorted(backend.devices))})"
        )
    failures = []
    for case in cases:
        try:
            problems = case_problems(name, case, device)
        except Exception as exc:  # a crash is a failure of the case, not of the kit
            problems = [f"raised {type(exc).__name__}: {exc}"]
        if problems:
            failures.append(f"[{case.id}] " + "; ".join(problems))
    checks = len(cases)
    if backend.dropout:
        failures += dropout_problems(name, device)
        checks += 1
    sample = [cases[0], *[c for c in cases if c.backward][:1]]
    failures += repeatability_problems(name, sample, device)
    if failures:
        shown = failures[:max_reported]
        more = (
            f"\n  ... and {len(failures) - len(shown)} more" if len(failures) > len(shown) else ""
        )
        raise AssertionError(
            f"{name} failed {len(failures)} of {checks} conformance checks on {device}:\n  "
            + "\n  ".join(shown)
            + more
        )
    return len(cases)
