"""The kit's block-sparse cases (attnhub.testing.block_sparse) on every backend that
serves block_sparse calls here, and on attnhub's own choice.

test_triton_blocksparse.py checks planned cases, and the sampled suite
(test_sampled_cases.py) draws no block-sparse call. Each case here builds a layout with
one of the public constructors and draws a call around it with every option at once;
the backend's answer must match the same call with the layout's dense mask and no
layout (the kit's module docstring says what is drawn and the rule). The draws come
from each backend's declarations and are seeded: a failing id reproduces from its seed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnhub  # noqa: E402
from attnhub.backends.torch_reference import TorchReference, reference_attention  # noqa: E402
from attnhub.registry import get_registry  # noqa: E402
from attnhub.testing import (  # noqa: E402
    BlockSparseCase,
    block_sparse_problems,
    block_sparse_reasons,
    check_backend,
    draw_block_sparse_case,
    sample_block_sparse_cases,
)
from attnhub.validation import make_params  # noqa: E402


def _claims(name: str, device: str) -> bool:
    registry = get_registry()
    return (
        name in registry.names()
        and registry.unavailable_reason(name) is None
        and (device in registry.get(name).devices)
    )


# (backend or None for attnhub's own choice, device, size, cases). Cases are drawn from
# the backend's declarations (auto: torch_reference's, the whole contract), so Triton's
# interpreter gets float32 and float16 only and FlexAttention on CPU no backward. The
# interpreter runs fewer, shorter cases; CUDA ones reach past a few 128-key tiles.
_TARGETS = [
    (None, "cpu", "small", 30),
    ("torch_reference", "cpu", "small", 30),
    ("triton_blocksparse", "cpu", "tiny", 16),
    ("flex_attention", "cpu", "small", 12),
    (None, "cuda", "large", 30),
    ("triton_blocksparse", "cuda", "large", 40),
    ("flex_attention", "cuda", "large", 20),
]


def _params() -> list[Any]:
    params = []
    for index, (name, device, size, count) in enumerate(_TARGETS):
        source = name or "torch_reference"
        if device == "cuda":
            marks = [pytest.mark.gpu,
                     pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]  # fmt: skip
            if source not in get_registry().names():
                continue
        elif not _claims(source, device) or (HAS_CUDA and "triton" in source):
            continue  # not here, or (with CUDA) a Triton backend that runs there instead
        else:
            marks = []
        for case in sample_block_sparse_cases(source, device, count, seed=index, size=size):
            label = f"{name or 'auto'}-{device}-{case.id}"
            params.append(pytest.param(name, device, case, id=label, marks=marks))
    return params


_PARAMS = _params()


@pytest.mark.parametrize(("backend", "device", "case"), _PARAMS)
def test_block_sparse_case(backend: str | None, device: str, case: BlockSparseCase) -> None:
    problems = block_sparse_problems(backend, case, device)
    assert not problems, f"{case.id}: " + "; ".join(problems)


def test_cpu_cases_are_not_empty() -> None:
    # The suite must never pass by drawing nothing: auto and torch_reference always run.
    drawn = [p.values[0] for p in _PARAMS if p.values[1] == "cpu"]
    assert drawn.count(None) == 30 and drawn.count("torch_reference") == 30


def test_draws_cover_the_layouts_and_options() -> None:
    """The draws reach every layout constructor and option (the suite never passes by
    drawing narrow calls), and the same seed draws the same call."""
    cases = [draw_block_sparse_case(seed) for seed in range(200)]
    ids = " ".join(c.id for c in cases)
    for part in ("blocks", "band", "causal", "window", "strided", "bigbird", "-causalTrue",
                 "bottom_right", "-window(", "-softcap", "-scale-", "boolmask", "floatmask",
                 "-bwd", "N1x", "x1D", "fp16", "bf16", "fp32"):  # fmt: skip
        assert part in ids, part
    assert any(c.hq > c.hkv for c in cases) and any(c.nq != c.nk for c in cases)
    assert max(max(c.nq, c.nk) for c in cases) > 100
    assert draw_block_sparse_case(7).id == draw_block_sparse_case(7).id
    longer = [draw_block_sparse_case(seed, "large") for seed in range(200)]
    assert max(max(c.nq, c.nk) for c in longer) > 200
    with pytest.raises(ValueError, match="size must be one of"):
        draw_block_sparse_case(0, "huge")


def test_cases_stay_inside_the_declarations() -> None:
    """Drawn cases are ones the backend claims: float32 and float16 only where it
    declares no bfloat16, no backward where it declares none; none at all for a
    backend that does not declare block_sparse."""

    class Narrow(attnhub.Backend):
        name = "bs_sampled_narrow"
        devices = frozenset({"cpu"})
        dtypes = frozenset({torch.float16})
        block_sparse = True

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            raise AssertionError("never run")

    registry = get_registry()
    registry.add(Narrow())
    try:
        cases = sample_block_sparse_cases(Narrow.name, "cpu", 10)
        assert cases  # few of the draws are this narrow: 6 of 500 draws here
        for case in cases:
            assert case.dtype == torch.float16 and not case.backward and not case.return_lse
            assert case.mask is None
            assert not case.options.get("softcap") and case.hq == case.hkv
            assert not block_sparse_reasons(registry.get(Narrow.name), case, "cpu")
        assert sample_block_sparse_cases("torch_sdpa", "cpu", 5) == []  # no block_sparse
    finally:
        registry.remove(Narrow.name)


class _IgnoresLayout(attnhub.Backend):
    """Claims block_sparse but computes dense attention with the call's own mask."""

    name = "bs_sampled_ignores_layout"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})
    block_sparse = lse = gqa = True

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        dense = make_params(query, key=key, block_sparse=None, return_lse=True, causal=False,
                            alignment="top_left", window=None, softcap=None, scale=None,
                            dropout_p=0.0)  # fmt: skip
        out, lse = reference_attention(query, key, value, attn_mask, dense)
        return (out, lse) if params.return_lse else out

    def extra_reasons(self, request):  # type: ignore[no-untyped-def]
        return [] if request.block_sparse else ["block_sparse calls only"]


def test_a_backend_that_ignores_the_layout_fails_the_kit() -> None:
    """The check can fail: a backend that ignores the layout fails its cases, and
    check_backend, which now runs block-sparse cases for a backend declaring
    block_sparse (it admits no dense case: cases_for plans none), names them."""
    registry = get_registry()
    registry.add(_IgnoresLayout())
    try:
        cases = sample_block_sparse_cases(_IgnoresLayout.name, "cpu", 12)
        assert any(block_sparse_problems(_IgnoresLayout.name, c, "cpu") for c in cases)
        with pytest.raises(AssertionError, match=r"bs_sampled_ignores_layout failed \d+ of 12 "):
            check_backend(_IgnoresLayout.name, "cpu")
    finally:
        registry.remove(_IgnoresLayout.name)


def test_what_a_backend_raises_is_a_problem_not_an_exception() -> None:
    class Raises(_IgnoresLayout):
        name = "bs_sampled_raises"

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    registry = get_registry()
    registry.add(Raises())
    try:
        case = sample_block_sparse_cases(Raises.name, "cpu", 12)[0]
        problems = block_sparse_problems(Raises.name, case, "cpu")
        assert len(problems) == 1 and "RuntimeError: boom" in problems[0], problems
    finally:
        registry.remove(Raises.name)


def test_a_wrong_dtype_or_shape_is_reported_and_the_backend_stays_enabled() -> None:
    """The kit judges what the backend returns itself (dispatch's output check, which
    would disable the backend, is off inside it): an output in float32 for a float16
    call, or one row short, is a problem of its case and the next case still runs."""

    class Float32Out(TorchReference):
        name = "bs_sampled_float32_out"
        dtypes = frozenset({torch.float16})

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            got = super().forward(query, key, value, attn_mask, params)
            return (got[0].float(), got[1]) if isinstance(got, tuple) else got.float()

    class RowShort(Float32Out):
        name = "bs_sampled_row_short"

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            got = TorchReference.forward(self, query, key, value, attn_mask, params)
            return (got[0][:, :, 1:], got[1]) if isinstance(got, tuple) else got[:, :, 1:]

    registry = get_registry()
    registry.add(Float32Out())
    registry.add(RowShort())
    try:
        # Forward-only cases: a backward of a short output stops at autograd's own
        # shape check (reported as what the call raised).
        cases = [c for c in sample_block_sparse_cases(Float32Out.name, "cpu", 20) if not c.backward]
        assert len(cases) >= 2
        for case in cases[:2]:
            problems = block_sparse_problems(Float32Out.name, case, "cpu")
            assert problems == ["out: torch.float32 on cpu, expected torch.float16 on cpu"], (
                problems
            )
            problems = block_sparse_problems(RowShort.name, case, "cpu")
            assert len(problems) == 1 and problems[0].startswith("out: shape "), problems
        assert registry.unavailable_reason(Float32Out.name) is None
        assert registry.unavailable_reason(RowShort.name) is None
    finally:
        registry.remove(Float32Out.name)
        registry.remove(RowShort.name)
