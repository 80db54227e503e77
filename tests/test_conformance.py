"""The conformance suite: every backend available here, every case its declarations admit.

Cases come from :func:`attnhub.testing.cases_for` (readable ids such as
``torch_sdpa-fp16-causal_br-B2H3N77x33D96``) and are checked against the float64
reference with contract.md's tolerance rule. CPU backends run small cases; backends
running Triton kernels in the interpreter (``TRITON_INTERPRET=1``) run tiny ones; CUDA
runs carry the ``gpu`` marker and run large cases.

The reference itself is checked first, against an independent loop-by-loop
implementation of contract.md, so that the oracle of every other test is not trusted
on its own word.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnhub.registry import get_registry
from attnhub.testing import (
    Case,
    case_problems,
    cases_for,
    dropout_problems,
    make_inputs,
    repeatability_problems,
)


def _uses_triton(name: str) -> bool:
    backend = get_registry().get(name)
    return "triton" in name or "triton" in type(backend).__module__


def _targets() -> list[tuple[str, str, str, list[pytest.MarkDecorator]]]:
    """(backend, device, size, marks) for every backend available on this machine."""
    registry = get_registry()
    targets = []
    for name in registry.names():
        backend = registry.get(name)
        if registry.unavailable_reason(name) is not None:
            continue
        if "cpu" in backend.devices:
            if _uses_triton(name):
                targets.append((name, "cpu", "tiny", [pytest.mark.interpreter]))
            else:
                targets.append((name, "cpu", "small", []))
        if "cuda" in backend.devices and torch.cuda.is_available():
            targets.append((name, "cuda", "large", [pytest.mark.gpu]))
    return targets


_TARGETS = _targets()
_CASES = [
    pytest.param(name, device, case, id=f"{name}-{device}-{case.id}", marks=marks)
    for name, device, size, marks in _TARGETS
    for case in cases_for(name, device, size=size)
]


_WITH_DENSE_CASES = {(p.values[0], p.values[1]) for p in _CASES}


def test_cpu_backends_present() -> None:
    # The suite must never pass by generating nothing: the two pure-PyTorch backends
    # always run on the CPU.
    names = {name for name, device, _, _ in _TARGETS if device == "cpu"}
    assert {"torch_reference", "torch_sdpa"} <= names
    assert sum(1 for p in _CASES if p.values[0] == "torch_sdpa") >= 30


@pytest.mark.parametrize(("backend", "device", "case"), _CASES)
def test_case(backend: str, device: str, case: Case) -> None:
    problems = case_problems(backend, case, device)
    assert not problems, f"{backend} [{case.id}]: " + "; ".join(problems)


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        pytest.param(name, device, id=f"{name}-{device}", marks=marks)
        for name, device, _, marks in _TARGETS
        # The kit probes dropout with dense calls: a backend that admits none (such as
        # triton_blocksparse, which serves only block_sparse calls) tests its dropout
        # in its own suite.
        if get_registry().get(name).dropout and (name, device) in _WITH_DENSE_CASES
    ],
)
def test_dropout(backend: str, device: str) -> None:
    problems = dropout_problems(backend, device)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize(
    ("backend", "device", "size"),
    [
        pytest.param(n, d, s, id=f"{n}-{d}", marks=m)
        for n, d, s, m in _TARGETS
        if (n, d) in _WITH_DENSE_CASES
    ],
)
def test_repeatable(backend: str, device: str, size: str) -> None:
    cases = cases_for(backend, device, size=size)
    sample = cases[:1] + [c for c in cases if c.backward][:1]
    problems = repeatability_problems(backend, sample, device)
    assert not problems, "; ".join(problems)


# -- the oracle, checked independently ------------------------------------------------


def _naive(case: Case, q, k, v, mask):  # type: ignore[no-untyped-def]
    """contract.md read literally, one (batch, head, query) at a time, in float64."""
    b_, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = case.scale if case.scale is not None else 1 / math.sqrt(case.D)
    out = torch.zeros(b_, hq, nq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b_, hq, nq), float("-inf"), dtype=torch.float64)
    full_mask = None if mask is None else mask.expand(b_, hq, nq, nk)
    for b in range(b_):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(nq):
                position = i + (nk - nq if case.alignment == "bottom_right" else 0)
                scores = []
                for j in range(nk):
                    s = float(q[b, h, i] @ k[b, kv, j]) * scale
                    if case.softcap is not None:
                        s = case.softcap * math.tanh(s / case.softcap)
                    if full_mask is not None and full_mask.dtype != torch.bool:
                        s += float(full_mask[b, h, i, j])
                    masked = (case.causal and j > position) or (
                        full_mask is not None
                        and full_mask.dtype == torch.bool
                        and not bool(full_mask[b, h, i, j])
                    )
                    if case.window is not None:
                        left, right = case.window
                        masked |= left is not None and j < position - left
                        masked |= right is not None and j > position + right
                    scores.append(float("-inf") if masked else s)
                top = max(scores, default=float("-inf"))
                if top == float("-inf"):
                    continue  # fully masked: zeros and lse = -inf
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = math.log(total) + top
                for j, w in enumerate(weights):
                    out[b, h, i] += (w / total) * v[b, kv, j].double()
    return out, lse


_ORACLE_CASES = [
    Case(torch.float64, 1, 4, 2, 7, 11, 8, 8, causal=True, alignment="bottom_right", seed=1),
    Case(torch.float64, 1, 2, 2, 11, 7, 8, 8, causal=True, alignment="bottom_right", seed=2),
    Case(torch.float64, 2, 2, 1, 9, 9, 8, 4, causal=True, seed=3),
    Case(torch.float64, 1, 2, 2, 6, 13, 8, 8, window=(2, 1), alignment="bottom_right", seed=4),
    Case(torch.float64, 2, 3, 3, 9, 5, 8, 8, mask="bool", causal=True, seed=5),
    Case(torch.float64, 1, 3, 1, 5, 9, 8, 8, mask="float", softcap=2.0, scale=0.7, seed=6),
]


@pytest.mark.parametrize("case", _ORACLE_CASES, ids=lambda c: c.id)
def test_reference_matches_naive_contract(case: Case) -> None:
    from attnhub.backends.torch_reference import reference_attention
    from attnhub.validation import make_params

    inputs = make_inputs(case, "cpu")
    q, k, v, mask = inputs.query, inputs.key, inputs.value, inputs.attn_mask
    params = make_params(q, key=k, **case.options(), block_sparse=None)
    out, lse = reference_attention(q, k, v, mask, params)
    expected_out, expected_lse = _naive(case, q, k, v, mask)
    torch.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=1e-6)


def test_reference_gradcheck() -> None:
    """The reference's autograd gradients are the true derivatives (fp64 gradcheck),
    including through a float mask and across a fully masked row."""
    from attnhub.backends.torch_reference import reference_attention
    from attnhub.request import AttentionParams

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64) for n in (5, 6, 6))
    mask = torch.randn(2, 5, 6, generator=gen, dtype=torch.float64)
    mask[:, 1, :] = float("-inf")  # a fully masked row, through the float mask
    params = AttentionParams(causal=True, alignment="bottom_right", softcap=3.0, scale=0.4)
    leaves = [t.requires_grad_() for t in (q, k, v, mask)]

    def fn(*args: torch.Tensor) -> torch.Tensor:
        return reference_attention(*args, params)[0]

    assert torch.autograd.gradcheck(fn, leaves)
    out = fn(*leaves)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))


# -- NaN in, NaN out (contract.md, "NaN inputs") --------------------------------------

# (label, Nq, Nk, options, mask kind). Rows of fewer keys than one SIMD vector are where
# PyTorch's CPU kernel, without a mask, turned a NaN row into zeros (issue 18.5).
_NAN_CALLS = [
    ("plain_short", 5, 6, {}, None),
    ("causal_short", 6, 6, {"causal": True}, None),
    ("plain", 19, 23, {}, None),
    ("causal_br", 23, 19, {"causal": True, "alignment": "bottom_right"}, None),
    ("bool", 9, 13, {}, "bool"),
    ("float", 9, 13, {}, "float"),
    ("window", 17, 17, {"window": (3, 2)}, None),
]


def _kept(nq: int, nk: int, options: dict, mask: torch.Tensor | None) -> torch.Tensor:
    """(Nq, Nk) bool: which keys each row keeps (causal, window, bool mask)."""
    offset = nk - nq if options.get("alignment") == "bottom_right" else 0
    position = torch.arange(nq).unsqueeze(1) + offset
    key = torch.arange(nk).unsqueeze(0)
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if options.get("causal"):
        keep &= key <= position
    if options.get("window") is not None:
        left, right = options["window"]
        keep &= (key >= position - left) & (key <= position + right)
    if mask is not None and mask.dtype == torch.bool:
        keep &= mask
    return keep


def _nan_targets() -> list:
    return [
        pytest.param(name, label, id=f"{name}-{label}", marks=marks)
        for name, device, _, marks in _TARGETS
        if device == "cpu" and (name, device) in _WITH_DENSE_CASES
        for label, *_ in _NAN_CALLS
    ]


@pytest.mark.parametrize(("backend", "label"), _nan_targets())
def test_nan_in_nan_out(backend: str, label: str) -> None:
    """A NaN in query row i makes output row i (and its lse, dq row, and the dk/dv rows
    of the keys it keeps) NaN, and changes no other row; a NaN in key row j makes every
    row that keeps key j NaN; a NaN in value j's column c, column c of those rows; a NaN
    float mask entry, its row. On every backend the suite runs on the CPU: dispatch never
    turns a NaN into a number."""
    import attnhub

    _, nq, nk, options, mask_kind = next(c for c in _NAN_CALLS if c[0] == label)
    gen = torch.Generator().manual_seed(nq * 100 + nk)
    declared = get_registry().get(backend).dtypes
    for dtype in (d for d in (torch.float32, torch.float16) if d in declared):
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(nq, nk, generator=gen) < 0.7
            mask[:, 0] = True  # every row keeps a key
        elif mask_kind == "float":
            mask = torch.randn(nq, nk, generator=gen).to(dtype)
        keep = _kept(nq, nk, options, mask)
        row = int(keep.any(1).nonzero()[-1])  # a row that keeps keys
        col = int(keep[row].nonzero()[0])  # a key it keeps
        clean = [torch.randn(1, 2, n, 16, generator=gen).to(dtype) for n in (nq, nk, nk)]
        call = {**options, "return_lse": get_registry().get(backend).lse}
        if attnhub.explain(*clean, mask, **call, backend=backend).chosen is None:
            continue
        reference = attnhub.attention(*clean, mask, **call, backend=backend)
        ref_out = reference[0] if isinstance(reference, tuple) else reference
        if mask_kind == "float":  # a NaN in the float mask is a NaN score
            nan_mask = mask.clone()
            nan_mask[row, col] = float("nan")
            result = attnhub.attention(*clean, nan_mask, **call, backend=backend)
            out = result[0] if isinstance(result, tuple) else result
            assert out[0, :, row].isnan().all(), f"{dtype} NaN in attn_mask[{row}, {col}]"
        for where in range(3):
            tensors = [t.clone() for t in clean]
            index = row if where == 0 else col
            tensors[where][0, :, index, 5] = float("nan")
            result = attnhub.attention(*tensors, mask, **call, backend=backend)
            out = result[0] if isinstance(result, tuple) else result
            what = f"{dtype} NaN in {'qkv'[where]}[{index}]"
            if where == 0:
                assert out[0, :, row].isnan().all(), what
                others = torch.arange(nq) != row
                torch.testing.assert_close(out[:, :, others], ref_out[:, :, others], msg=what)
                if isinstance(result, tuple):
                    assert result[1][0, :, row].isnan().all(), what + ": lse"
            else:
                rows = keep[:, col]
                cells = out[0, :, rows] if where == 1 else out[0, :, rows, 5]
                assert cells.isnan().all(), what

        # Gradients of a NaN query row: its dq row, and the dk, dv rows of its keys.
        if not get_registry().get(backend).backward:
            continue
        leaves = [t.clone().requires_grad_() for t in clean]
        with torch.no_grad():
            leaves[0][0, :, row, 5] = float("nan")
        # A declared backward can still be declined on this device (flex_attention's
        # has none on the CPU): what the backend's own reasons exclude is not its call.
        if attnhub.explain(*leaves, mask, **options, backend=backend).chosen is None:
            continue
        out = attnhub.attention(*leaves, mask, **options, backend=backend)
        dq, dk, dv = torch.autograd.grad(
            out, leaves, torch.randn(out.shape, generator=gen).to(dtype)
        )
        kept = keep[row]
        assert dq[0, :, row].isnan().all(), f"{dtype}: dq"
        assert dk[0, :, kept].isnan().any(-1).all() and dv[0, :, kept].isnan().any(-1).all(), (
            f"{dtype}: dk/dv of the keys row {row} keeps"
        )
