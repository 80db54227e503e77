"""The conformance kit catches real bugs.

Each backend below is correct except for one deliberate defect of a kind that real
kernels have shipped with; ``check_backend`` must fail it, naming the cases that show
the defect. A correct backend with the same declarations passes, so each failure is
the defect's doing and not the kit's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub.backends.torch_reference import TorchReference, keep_mask, reference_attention
from attnhub.dispatch import clear_cache
from attnhub.testing import (
    Case,
    assert_matches_reference,
    cases_for,
    check_backend,
    compare,
    run_case,
    tolerance_bound,
)


class Correct(TorchReference):
    """The reference under another name, declared for float32 and float16 only (fast)."""

    name = "kit_correct"
    dtypes = frozenset({torch.float32, torch.float16})
    priority = -1000


class WrongScale(Correct):
    """Ignores ``scale`` and always uses 1/sqrt(D)."""

    name = "kit_wrong_scale"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        params = dataclasses.replace(params, scale=1 / math.sqrt(query.shape[-1]))
        return super().forward(query, key, value, attn_mask, params)


def _naive_softmax_attention(query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = (query @ key.transpose(-2, -1)).float() * params.scale
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    keep = keep_mask(query.shape[2], key.shape[2], params, query.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).to(value.dtype) @ value  # 0/0 on empty rows
    return out.to(query.dtype), lse


class NaNOnMaskedRows(Correct):
    """Plain ``torch.softmax``: a row with every key masked becomes NaN."""

    name = "kit_nan_rows"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = _naive_softmax_attention(query, key, value, attn_mask, params)
        return (out, lse) if params.return_lse else out


class WrongAlignment(Correct):
    """Treats bottom-right causal as top-left."""

    name = "kit_wrong_alignment"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        params = dataclasses.replace(params, alignment="top_left")
        return super().forward(query, key, value, attn_mask, params)


class WrongGQA(Correct):
    """Query head h reads key/value head h % Hkv instead of h // (Hq // Hkv)."""

    name = "kit_wrong_gqa"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat(1, group, 1, 1), value.repeat(1, group, 1, 1)
        return super().forward(query, key, value, attn_mask, params)


class _ForgetsScaleInDq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query, key, value, params):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(query, key, value)
        ctx.params = params
        return reference_attention(query, key, value, None, params)[0]

    @staticmethod
    def backward(ctx: Any, grad_out):  # type: ignore[no-untyped-def]
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = reference_attention(*leaves, None, ctx.params)[0]
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_out)
        return dq / ctx.params.scale, dk, dv, None  # the bug: dq not multiplied by scale


class WrongGradient(Correct):
    """A hand-written backward whose dq misses the softmax scale."""

    name = "kit_wrong_gradient"
    mask_kinds = frozenset({"none"})
    lse = False

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        return _ForgetsScaleInDq.apply(query, key, value, params)


class WrongLseBase(Correct):
    """Returns the log-sum-exp in base 2 (a Triton habit) instead of the natural log."""

    name = "kit_lse_base2"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = reference_attention(query, key, value, attn_mask, params)
        return (out, lse / math.log(2)) if params.return_lse else out


class DropoutWithoutRescale(Correct):
    """Drops weights but forgets to scale the kept ones by 1 / (1 - p)."""

    name = "kit_dropout_no_rescale"
    dtypes = frozenset({torch.float32})

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = reference_attention(query, key, value, attn_mask, params)
        if params.dropout_p:
            out = out * (1.0 - params.dropout_p)
        return (out, lse) if params.return_lse else out


@contextlib.contextmanager
def registered(backend: type[attnhub.Backend]) -> Iterator[str]:
    registry = attnhub.get_registry()
    registry.add(backend())
    clear_cache()
    try:
        yield backend.name
    finally:
        registry.remove(backend.name)
        clear_cache()


def test_correct_backend_passes() -> None:
    with registered(Correct) as name:
        assert check_backend(name, "cpu") >= 40


@pytest.mark.parametrize(
    ("backend", "caught"),
    [
        pytest.param(WrongScale, r"\[fp(16|32)-scale0\.3-[^\]]*\] out: max\|x - r64\|", id="scale"),
        pytest.param(WrongScale, r"\[fp(16|32)-softcap3-scale0\.5-", id="scale-softcap"),
        pytest.param(
            NaNOnMaskedRows, r"\[fp(16|32)-boolmask-[^\]]*\] out: \d+ NaN values", id="nan-bool"
        ),
        pytest.param(
            NaNOnMaskedRows,
            r"\[fp(16|32)-causal_br-[^\]]*N77x33[^\]]*\] out: \d+ NaN",
            id="nan-causal",
        ),
        pytest.param(
            WrongAlignment, r"\[fp(16|32)-causal_br-[^\]]*\] out: max\|x - r64\|", id="alignment"
        ),
        pytest.param(WrongAlignment, r"\[fp(16|32)-window5_3_br-", id="alignment-window"),
        pytest.param(WrongGQA, r"\[fp(16|32)-[^\]]*H4kv2[^\]]*\] out: max\|x - r64\|", id="gqa"),
        pytest.param(WrongGradient, r"\[fp(16|32)-bwd-[^\]]*\] dq: max\|x - r64\|", id="gradient"),
        pytest.param(
            WrongLseBase, r"\[fp(16|32)-[^\]]*lse-[^\]]*\] lse: max\|x - r64\|", id="lse-base"
        ),
        pytest.param(
            DropoutWithoutRescale, r"dropout0\.2\] dropout: kept weights must be", id="dropout"
        ),
    ],
)
def test_defect_is_caught(backend: type[attnhub.Backend], caught: str) -> None:
    with registered(backend) as name, pytest.raises(AssertionError, match=caught) as info:
        check_backend(name, "cpu")
    assert str(info.value).startswith(f"{name} failed ")


def test_only_the_defective_feature_fails() -> None:
    # The wrong-GQA backend is right whenever Hq == Hkv, and for MQA (Hkv = 1, where
    # h % 1 == h // Hq == 0): the kit must blame exactly the other cases.
    with registered(WrongGQA) as name:
        for case in cases_for(name, "cpu"):
            if case.Hq == case.Hkv or case.Hkv == 1:
                run_case(name, case, "cpu")
            else:
                with pytest.raises(AssertionError, match=rf"\[{case.id}\]"):
                    run_case(name, case, "cpu")


def test_forced_backend_that_refuses_a_declared_case_fails() -> None:
    class Refuses(Correct):
        name = "kit_refuses"

        def extra_reasons(self, request):  # type: ignore[no-untyped-def]
            return ["refuses everything"]

    with (
        registered(Refuses) as name,
        pytest.raises(AssertionError, match="admit no conformance case"),
    ):
        check_backend(name, "cpu")
    case = Case(torch.float32, 1, 2, 2, 5, 5, 8, 8)
    with (
        registered(Refuses) as name,
        pytest.raises(attnhub.NoBackendError, match="refuses everything"),
    ):
        run_case(name, case, "cpu")


def test_unknown_and_undeclared_device() -> None:
    with pytest.raises(ValueError, match="unknown backend 'kit_missing'"):
        check_backend("kit_missing")

    class CpuOnly(Correct):
        name = "kit_cpu_only"
        devices = frozenset({"cpu"})

    with (
        registered(CpuOnly) as name,
        pytest.raises(AssertionError, match="admit no conformance case on cuda"),
    ):
        check_backend(name, "cuda")


# -- the tolerance rule itself ------------------------------------------------------


def test_tolerance_rule() -> None:
    r64 = torch.tensor([1.0, 2.0, float("-inf")], dtype=torch.float64)
    r_lp = torch.tensor([1.001, 2.0, float("-inf")])
    assert tolerance_bound(r_lp, r64) == pytest.approx(2 * 0.001 + 1e-5, rel=1e-3)
    assert compare("x", torch.tensor([1.0015, 1.999, float("-inf")]), r_lp, r64) is None
    assert "> bound" in compare("x", torch.tensor([1.003, 2.0, float("-inf")]), r_lp, r64)
    assert "NaN" in compare("x", torch.tensor([1.0, float("nan"), float("-inf")]), r_lp, r64)
    assert "infinite" in compare("x", torch.tensor([1.0, 2.0, 0.0]), r_lp, r64)
    assert "infinite" in compare("x", torch.tensor([float("inf"), 2.0, float("-inf")]), r_lp, r64)
    assert "shape" in compare("x", torch.zeros(2), r_lp, r64)
    # Exact in float64: only the 1e-5 floor is left.
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with pytest.raises(AssertionError, match="bound 1e-05"):
        assert_matches_reference(exact + 2e-5, exact, exact)


def test_case_ids_are_readable_and_unique() -> None:
    cases = cases_for("torch_reference", "cpu")
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids)
    assert "fp16-causal_br-B2H3N77x33D96" in ids
    assert any("-boolmask-bwd-" in i for i in ids)
    assert 30 <= len(cases) <= 120
    case = Case(torch.bfloat16, 2, 8, 2, 1, 65, 128, 64, mask="float", mask_grad=True,
                causal=True, alignment="bottom_right", window=(4, None), softcap=30.0,
                return_lse=True, backward=True, strided=True)  # fmt: skip
    assert case.id == (
        "bf16-causal_br-window4_inf-floatmask_grad-softcap30-lse-strided-bwd-B2H8kv2N1x65D128v64"
    )


def test_cases_follow_declarations() -> None:
    # torch_sdpa declares no window, softcap or lse: none of its cases use them; every
    # declared dtype appears; and a restricted head-dim range is respected.
    sdpa = cases_for("torch_sdpa", "cpu")
    assert not any(c.window or c.softcap or c.return_lse for c in sdpa)
    assert {c.dtype for c in sdpa} == {torch.float16, torch.bfloat16, torch.float32, torch.float64}

    class Narrow(Correct):
        name = "kit_narrow"
        head_dims = (16, 64)
        head_dim_multiple = 16
        gqa = False
        causal_alignments = frozenset({"top_left"})
        devices = frozenset({"cpu"})

    narrow = cases_for(Narrow(), "cpu")
    assert narrow and all(c.D in (16, 32, 48, 64) and c.D % 16 == 0 for c in narrow)
    assert all(c.Hq == c.Hkv for c in narrow)
    assert not any(c.causal and c.alignment == "bottom_right" and c.Nq != c.Nk for c in narrow)
    assert not cases_for(Narrow(), "cuda")


def test_pytest_plugin_reports_failing_cases(tmp_path: Path) -> None:
    """``pytest -p attnhub.testing --attnhub-backend NAME`` fails a broken backend per case."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import dataclasses, math
            import attnhub, torch
            from attnhub.backends.torch_reference import TorchReference

            class Broken(TorchReference):
                name = "kit_plugin_broken"
                dtypes = frozenset({torch.float32})

                def forward(self, query, key, value, attn_mask, params):
                    params = dataclasses.replace(params, scale=1 / math.sqrt(query.shape[-1]))
                    return super().forward(query, key, value, attn_mask, params)

            def pytest_configure(config):
                attnhub.get_registry().add(Broken())
            """
        )
    )
    env = {**os.environ, "ATTNHUB_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "attnhub.testing", "-q", "-rf", "-p", "no:cacheprovider",
         "--attnhub-backend", "kit_plugin_broken", "--attnhub-backend", "torch_sdpa"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    assert failed and all("kit_plugin_broken-fp32-" in line for line in failed)
    assert any("scale0.3" in line for line in failed)
    assert "attnhub[torch_sdpa-" not in "\n".join(failed)
    # Inert without the option: no generated items.
    idle = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "attnhub.testing", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert idle.returncode == 5, idle.stdout  # 5: no tests collected


def test_reference_dropout_passes_dropout_checks() -> None:
    # The dropout checks accept a correct implementation (the reference draws from
    # torch's generator and autograd reuses the mask in the backward).
    from attnhub.testing import dropout_problems

    assert dropout_problems("torch_reference", "cpu") == []
    assert dropout_problems("torch_sdpa", "cpu") == []
