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
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import attnhub
from attnhub.backends.torch_reference import (
    TorchReference,
    contract_attention,
    keep_mask,
    reference_attention,
)
from attnhub.dispatch import clear_cache
from attnhub.request import AttentionParams
from attnhub.testing import (
    Case,
    assert_matches_reference,
    case_problems,
    cases_for,
    check_backend,
    compare,
    make_inputs,
    plain_attention,
    references,
    run_case,
    tolerance_bound,
)
from attnhub.testing.check import BLOCK_SPARSE_CASES, SERVING_CASES, compiled_cases


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
        out, lse = contract_attention(query, key, value, attn_mask, params)
        return (out, lse / math.log(2)) if params.return_lse else out


class DropoutWithoutRescale(Correct):
    """Drops weights but forgets to scale the kept ones by 1 / (1 - p)."""

    name = "kit_dropout_no_rescale"
    dtypes = frozenset({torch.float32})

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = contract_attention(query, key, value, attn_mask, params)
        if params.dropout_p:
            out = out * (1.0 - params.dropout_p)
        return (out, lse) if params.return_lse else out


class IgnoresWindow(Correct):
    """Drops the window: every key (within causal and the mask) is attended."""

    name = "kit_ignores_window"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        return super().forward(
            query, key, value, attn_mask, dataclasses.replace(params, window=None)
        )


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


@pytest.mark.parametrize(
    ("nq", "nk", "alignment", "window"),
    [
        # 11 queries at the bottom right of 36 keys sit at positions 25..35: a left side
        # of 17 is longer than Nq yet excludes keys 0..7 from row 0.
        (11, 36, "bottom_right", (17, None)),
        # 6 top-left queries against 40 keys: a right side of 9 keeps keys 0..9 of
        # row 0 only, though it exceeds Nq.
        (6, 40, "top_left", (None, 9)),
    ],
)
def test_window_that_only_the_key_length_makes_real_is_checked(
    nq: int, nk: int, alignment: str, window: tuple[int | None, int | None]
) -> None:
    """The kit's references normalize a window against the call's Nk, not its Nq: a
    reference that dropped such a window agreed with a backend that ignores it, and its
    bound (twice r_lp's distance from it) let any answer pass."""
    case = Case(torch.float32, 1, 2, 2, nq, nk, 16, 16, alignment=alignment, window=window, seed=3)
    inputs = make_inputs(case, "cpu")
    _, r64 = references(inputs, case)
    # The window as given, not normalized: keep_mask applies it literally.
    params = AttentionParams(alignment=alignment, window=window, scale=1 / 4)
    expected, _ = _naive_softmax_attention(
        inputs.query.double(), inputs.key.double(), inputs.value.double(), None, params
    )
    torch.testing.assert_close(r64["out"], expected, rtol=1e-5, atol=1e-6)  # naive: float32 scores
    assert not case_problems("torch_reference", case)
    with registered(IgnoresWindow) as name:
        assert any(p.startswith("out: max|x - r64|") for p in case_problems(name, case))


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
    # Forced onto a case its declarations admit, dispatch's refusal is the case's
    # failure, reported by the kit with the refusal's text.
    case = Case(torch.float32, 1, 2, 2, 5, 5, 8, 8)
    with (
        registered(Refuses) as name,
        pytest.raises(
            AssertionError, match=r"\[fp32-plain-B1H2N5D8\]: raised NoBackendError: "
        ) as info,
    ):
        run_case(name, case, "cpu")
    assert "refuses everything" in str(info.value)


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
    # (Bottom-right causal with one query row keeps every key: it is no causal call, and
    # a backend without bottom-right alignment serves it.)
    assert not any(
        c.causal and c.alignment == "bottom_right" and c.Nq not in (c.Nk, 1) for c in narrow
    )
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
    assert failed and all(line.startswith("FAILED attnhub[kit_plugin_broken") for line in failed)
    assert any("scale0.3" in line for line in failed)
    # Its block-sparse cases with a scale fail too (ids "<backend>-bs-<seed>-...").
    assert any("kit_plugin_broken-bs-" in line and "-scale" in line for line in failed)
    assert "attnhub[torch_sdpa-" not in "\n".join(failed)
    # Inert without the option: no generated items.
    idle = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "attnhub.testing", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert idle.returncode == 5, idle.stdout  # 5: no tests collected
    # It declares the serving layouts and compile_safe (as torch_reference): serving
    # and compiled items are generated for it, none for torch_sdpa (dense, but
    # compile_safe: its compiled items are there).
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "attnhub.testing", "-q", "--collect-only",
         "-p", "no:cacheprovider", "--attnhub-backend", "kit_plugin_broken",
         "--attnhub-backend", "torch_sdpa"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    ).stdout  # fmt: skip
    assert listed.count("attnhub[kit_plugin_broken-serve-") == SERVING_CASES, listed
    assert listed.count("attnhub[kit_plugin_broken-compiled-") == 2, listed
    assert "attnhub[torch_sdpa-serve-" not in listed
    assert listed.count("attnhub[torch_sdpa-compiled-") == 2, listed


def test_reference_dropout_passes_dropout_checks() -> None:
    # The dropout checks accept a correct implementation (the reference draws from
    # torch's generator and autograd reuses the mask in the backward).
    from attnhub.testing import dropout_problems

    assert dropout_problems("torch_reference", "cpu") == []
    assert dropout_problems("torch_sdpa", "cpu") == []


# -- backends that go wrong other than in their numbers -----------------------------
#
# Each of these once escaped the kit as a raw exception, or passed: the reference was
# computed after the backend ran, from the very tensors the backend had changed. Each
# must now be a line of the kit's report naming the case and what happened.

_PLAIN = Case(torch.float32, 2, 2, 2, 9, 9, 8, 8, seed=1)


def _case(**changes: Any) -> Case:
    return dataclasses.replace(_PLAIN, **changes)


def _failure(name: str, case: Case) -> str:
    """run_case's report for ``case``: the kit's AssertionError, naming backend and case."""
    with pytest.raises(AssertionError) as info:
        run_case(name, case, "cpu")
    text = str(info.value)
    assert text.startswith(f"{name} [{case.id}]: "), text
    return text


def _report(backend: type[attnhub.Backend], cases: list[Case] | None = None) -> str:
    """check_backend's report on ``backend``, which must fail."""
    with registered(backend) as name, pytest.raises(AssertionError) as info:
        check_backend(name, "cpu", cases=cases, max_reported=1000)
    text = str(info.value)
    assert text.startswith(f"{name} failed "), text
    return text


class MutatesInput(Correct):
    """Changes one input in place before computing with it (so a reference computed
    afterwards from the same tensors agrees with the output)."""

    name = "kit_mutates"
    target = "query"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        t = {"query": query, "key": key, "value": value, "attn_mask": attn_mask}[self.target]
        with torch.no_grad():
            t.logical_not_() if t.dtype == torch.bool else t.mul_(1.5)
        return super().forward(query, key, value, attn_mask, params)


@pytest.mark.parametrize(
    ("target", "case"),
    [
        ("query", _case()),
        ("key", _case(causal=True)),
        ("value", _case(return_lse=True)),
        ("attn_mask", _case(mask="bool")),
        ("attn_mask", _case(mask="float")),
        ("query", _case(backward=True)),
        ("value", _case(backward=True, strided=True)),
    ],
    ids=lambda x: x if isinstance(x, str) else x.id,
)
def test_input_changed_in_place_fails(target: str, case: Case) -> None:
    backend = type("Mutates", (MutatesInput,), {"target": target})
    with registered(backend) as name:
        text = _failure(name, case)
    assert re.search(
        rf"{target} modified in place during the call: \d+ of \d+ values changed", text
    )


class ContiguousInPlace(Correct):
    """Makes its inputs contiguous by rebinding their data: the same values, but the
    caller's tensors now have other strides and another storage."""

    name = "kit_contiguous_in_place"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        for t in (query, key, value):
            t.data = t.data.contiguous()
        return super().forward(query, key, value, attn_mask, params)


class InPlaceNoOp(Correct):
    """Multiplies the query by 1 in place: values intact, but its version counter moves,
    which breaks any autograd graph of the caller's that saved it."""

    name = "kit_in_place_no_op"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            query.mul_(1.0)
        return super().forward(query, key, value, attn_mask, params)


def test_input_metadata_changed_fails() -> None:
    with registered(ContiguousInPlace) as name:
        text = _failure(name, _case(strided=True))
        assert re.search(r"query modified in place during the call: stride \([^)]*\) -> ", text)
        assert "storage 0x" in text and "key modified" in text and "value modified" in text
        run_case(name, _case(), "cpu")  # contiguous inputs: .contiguous() is the tensor itself
    with registered(InPlaceNoOp) as name:
        text = _failure(name, _case())
    assert "query modified in place during the call: an in-place operation on it" in text


class _HookedBackward(torch.autograd.Function):
    """The reference, with the backend's ``on_backward(q, k, v, grad_out)`` run at the
    start of the backward, on the saved inputs and the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, query, key, value, params, backend):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(query, key, value)
        ctx.params, ctx.backend = params, backend
        return reference_attention(query, key, value, None, params)[0]

    @staticmethod
    def backward(ctx: Any, grad_out):  # type: ignore[no-untyped-def]
        saved = ctx.saved_tensors
        ctx.backend.on_backward(*saved, grad_out)
        leaves = [t.detach().requires_grad_() for t in saved]
        with torch.enable_grad():
            out = reference_attention(*leaves, None, ctx.params)[0]
        return (*torch.autograd.grad(out, leaves, grad_out), None, None)


class HookedBackward(Correct):
    name = "kit_hooked_backward"
    mask_kinds = frozenset({"none"})
    lse = False

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        return _HookedBackward.apply(query, key, value, params, self)

    def on_backward(self, query, key, value, grad_out):  # type: ignore[no-untyped-def]
        pass


class ScalesGradOut(HookedBackward):
    """Doubles grad_out in place and differentiates with it (a reference computed
    afterwards with the same grad_out agrees)."""

    def on_backward(self, query, key, value, grad_out):  # type: ignore[no-untyped-def]
        grad_out.mul_(2.0)


class ScalesSavedKey(HookedBackward):
    """Scales the key it saved for the backward, in place: the caller's key."""

    def on_backward(self, query, key, value, grad_out):  # type: ignore[no-untyped-def]
        key.mul_(1.5)


@pytest.mark.parametrize(
    ("backend", "target"),
    [(ScalesGradOut, "grad_out"), (ScalesSavedKey, "key")],
    ids=["grad_out", "key"],
)
def test_changed_during_backward_fails(backend: type[attnhub.Backend], target: str) -> None:
    case = _case(backward=True)
    with registered(HookedBackward) as name:
        run_case(name, case, "cpu")  # the hook alone changes nothing
    with registered(backend) as name:
        text = _failure(name, case)
    assert re.search(
        rf"{target} modified in place during backward: \d+ of \d+ values changed", text
    )
    assert "during the call" not in text


class _NotAnException(BaseException):
    """Derives from BaseException only."""


def _boom() -> BaseException:
    return RuntimeError("boom")


class RaisesInForward(Correct):
    """Raises ``error()``: a fresh exception each call, as real code does."""

    name = "kit_raises_forward"
    error = staticmethod(_boom)

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        raise self.error()

    def forward_varlen(self, *args):  # type: ignore[no-untyped-def]
        raise self.error()

    def forward_kvcache(self, *args):  # type: ignore[no-untyped-def]
        raise self.error()


class RaisesInPrepare(Correct):
    name = "kit_raises_prepare"
    error = staticmethod(_boom)

    def prepare(self, request, params):  # type: ignore[no-untyped-def]
        raise self.error()


class RaisesInBackward(HookedBackward):
    name = "kit_raises_backward"
    error = staticmethod(_boom)

    def on_backward(self, query, key, value, grad_out):  # type: ignore[no-untyped-def]
        raise self.error()


_ERRORS = [
    pytest.param(lambda: RuntimeError("boom"), "RuntimeError: boom", id="RuntimeError"),
    pytest.param(lambda: ValueError("bad head dim"), "ValueError: bad head dim", id="ValueError"),
    pytest.param(lambda: KeyError("missing"), "KeyError: 'missing'", id="KeyError"),
    pytest.param(NotImplementedError, "NotImplementedError (no message)", id="NotImplemented"),
    pytest.param(lambda: AssertionError("assert"), "AssertionError: assert", id="AssertionError"),
    pytest.param(lambda: torch.cuda.OutOfMemoryError("out of memory"),
                 "OutOfMemoryError: out of memory", id="OutOfMemoryError"),
    pytest.param(lambda: SystemExit(3), "SystemExit: 3", id="SystemExit"),
    pytest.param(lambda: _NotAnException("odd"), "_NotAnException: odd", id="BaseException"),
]  # fmt: skip


@pytest.mark.parametrize(("error", "text"), _ERRORS)
@pytest.mark.parametrize(
    ("backend", "prefix", "where", "case"),
    [
        (RaisesInForward, "", "forward", _case(mask="bool", return_lse=True)),
        (RaisesInBackward, "backward ", "on_backward", _case(backward=True)),
    ],
    ids=["forward", "backward"],
)
def test_exception_becomes_the_case_failure(
    backend: type[RaisesInForward], prefix: str, where: str, case: Case, error: Any, text: str
) -> None:
    raising = type(backend.__name__, (backend,), {"error": staticmethod(error)})
    with registered(raising) as name:
        report = _failure(name, case)
    where_raised = rf"\(at test_testing_kit\.py:\d+ in {where}\)"
    assert re.search(rf"\]: {prefix}raised {re.escape(text)} {where_raised}$", report), report


@pytest.mark.parametrize(("error", "text"), _ERRORS)
def test_exception_in_prepare_becomes_the_case_failure(error: Any, text: str) -> None:
    # Dispatch may contain a raising prepare (it disables the backend, with a reason
    # quoting the exception) or let it through: either way the kit reports it against
    # the case, with the exception's type and message.
    raising = type("RaisesInPrepare", (RaisesInPrepare,), {"error": staticmethod(error)})
    with registered(raising) as name:
        report = _failure(name, _case())
    message = re.escape(text).replace(r"\ \(no\ message\)", "(: | \\(no message\\))")
    assert re.search(rf"\]: raised (NoBackendError: .*)?{message}", report), report


def test_exception_reported_by_check_backend_for_every_check() -> None:
    report = _report(RaisesInForward)
    cases = cases_for(RaisesInForward(), "cpu")
    # The cases, the block-sparse and serving cases, two compiled cases (it declares
    # compile_safe), dropout, repeatability of two cases.
    checks = len(cases) + BLOCK_SPARSE_CASES + SERVING_CASES + 2 + 1 + 2
    assert f"failed {checks} of {checks} conformance checks on cpu:" in report
    lines = report.splitlines()[1:]
    assert len(lines) == checks
    # Traced, Dynamo reports the exception it observed, and where.
    raised = ("raised RuntimeError: boom (at test_testing_kit.py:",
              "raised exception RuntimeError('boom') (traced at test_testing_kit.py:")  # fmt: skip
    assert all(any(text in line for text in raised) for line in lines), report
    assert sum("] compiled: raised Unsupported: " in line for line in lines) == 2
    assert sum("dropout0.2] dropout_p=0.0: raised" in line for line in lines) == 1
    assert sum("repeatability not checked, the call fails: raised" in line for line in lines) == 2


def test_keyboard_interrupt_stops_the_run() -> None:
    interrupted = type(
        "Interrupted", (RaisesInForward,), {"error": staticmethod(KeyboardInterrupt)}
    )
    with registered(interrupted) as name, pytest.raises(KeyboardInterrupt):
        check_backend(name, "cpu")


class RaisesInExtraReasons(Correct):
    name = "kit_raises_reasons"

    def extra_reasons(self, request):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("no reasons")


def test_raising_extra_reasons_is_reported_per_case() -> None:
    # Case generation does not stop at it; each call reports it, directly or through
    # dispatch's refusal of the backend, which quotes it.
    report = _report(RaisesInExtraReasons)
    lines = report.splitlines()[1:]
    # No serving case is drawn (dispatch's reasons, which it quotes, refuse them all);
    # the two compiled cases are.
    assert len(lines) == len(cases_for(Correct(), "cpu")) + BLOCK_SPARSE_CASES + 2 + 1 + 2
    assert all("ZeroDivisionError: no reasons" in line for line in lines)
    assert re.search(r"^  \[fp16-plain-[^\]]*\] raised ", report, re.MULTILINE)


class ExtraReasonsAsString(Correct):
    """Returns its one reason as a bare str: not a list of reasons (read as one, its
    characters would refuse every call)."""

    name = "kit_reasons_str"

    def extra_reasons(self, request):  # type: ignore[no-untyped-def]
        return "nope" if request.causal else []


def test_wrongly_typed_extra_reasons_is_reported_per_case() -> None:
    # The causal cases are generated (a str is no list of reasons), and their calls
    # report dispatch's refusal, which names the bad return.
    cases = cases_for(ExtraReasonsAsString(), "cpu")
    causal = [c for c in cases if c.causal]
    assert causal
    with registered(ExtraReasonsAsString) as name:
        for case in causal[:3]:
            assert "'nope'" in _failure(name, case)


class BadReturn(Correct):
    """Computes the right (out, lse), then returns ``mangle(out, lse, query, key, value)``."""

    name = "kit_bad_return"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = contract_attention(query, key, value, attn_mask, params)
        return self.mangle(out, lse, query, key, value)

    @staticmethod
    def mangle(out, lse, query, key, value):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def _first_nan(t: torch.Tensor) -> torch.Tensor:
    flat = t.flatten().clone()
    flat[0] = float("nan")
    return flat.view_as(t)


def _written_into_query(out, lse, query, key, value):  # type: ignore[no-untyped-def]
    return query.copy_(out)


_LSE = _case(return_lse=True)
_BAD_RETURNS = [
    ("shape", lambda o, s, q, k, v: o[..., :-1], _case(backward=True),
     r"out: shape \(2, 2, 9, 7\), expected \(2, 2, 9, 8\)"),
    ("dtype", lambda o, s, q, k, v: o.double(), _case(backward=True),
     r"out: dtype torch.float64, expected torch.float32"),
    ("device", lambda o, s, q, k, v: o.to("meta"), _case(), r"out: device meta, expected cpu"),
    ("list", lambda o, s, q, k, v: o.tolist(), _case(), r"out: expected a tensor, got list of 2"),
    ("none", lambda o, s, q, k, v: None, _case(), r"out: expected a tensor, got NoneType"),
    ("ndarray", lambda o, s, q, k, v: o.numpy(), _case(), r"out: expected a tensor, got ndarray"),
    ("tuple", lambda o, s, q, k, v: (o, s), _case(), r"out: expected a tensor, got tuple of 2"),
    ("no-lse", lambda o, s, q, k, v: o, _LSE,
     r"return_lse=True must return a tuple \(out, lse\), got Tensor"),
    ("lse-shape", lambda o, s, q, k, v: (o, s.unsqueeze(-1)), _LSE,
     r"lse: shape \(2, 2, 9, 1\), expected \(2, 2, 9\)"),
    ("lse-dtype", lambda o, s, q, k, v: (o, s.half()), _LSE,
     r"lse: dtype torch.float16, expected torch.float32"),
    ("lse-none", lambda o, s, q, k, v: (o, None), _LSE, r"lse: expected a tensor, got NoneType"),
    ("nan-out", lambda o, s, q, k, v: _first_nan(o), _case(), r"out: 1 NaN values"),
    ("nan-lse", lambda o, s, q, k, v: (o, _first_nan(s)), _LSE, r"lse: 1 NaN values"),
    ("value-itself", lambda o, s, q, k, v: v, _case(),
     r"out: shares memory with value \(a view of an input"),
    ("into-query", _written_into_query, _case(),
     r"query modified in place during the call: \d+ of \d+ values changed; "
     r"out: shares memory with query"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mangle", "case", "expected"),
    [pytest.param(m, c, e, id=i) for i, m, c, e in _BAD_RETURNS],
)
def test_bad_return_is_reported(mangle: Any, case: Case, expected: str) -> None:
    backend = type("Bad", (BadReturn,), {"mangle": staticmethod(mangle)})
    with registered(backend) as name:
        text = _failure(name, case)
    assert re.search(expected, text), text


class ValueViewShortcut(Correct):
    """With a single key every weight is 1 and the output is the value: returned as a
    view of it instead of a new tensor. Right numbers, aliased memory."""

    name = "kit_value_view"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        b, hq, nq, _ = query.shape
        if key.shape[2] == 1 and key.shape[1] == hq and attn_mask is None and not params.return_lse:
            return value.expand(b, hq, nq, value.shape[-1])
        return super().forward(query, key, value, attn_mask, params)


def test_output_that_is_a_view_of_an_input_fails() -> None:
    report = _report(ValueViewShortcut)
    assert re.search(r"\[fp32-plain-B1H2N1D8\] out: shares memory with value", report)
    assert "failed 2 of" in report  # fp16 and fp32: nothing else


class ReusesOutputBuffer(Correct):
    """Allocates the output once per call signature, in ``prepare``, and writes every
    call's result into it: the caller's earlier result changes under it."""

    name = "kit_reuses_buffer"
    backward = False

    def prepare(self, request, params):  # type: ignore[no-untyped-def]
        buffers: list[torch.Tensor] = []

        def run(query, key, value, attn_mask):  # type: ignore[no-untyped-def]
            out, lse = contract_attention(query, key, value, attn_mask, params)
            if not buffers:
                buffers.append(torch.empty_like(out))
            buffers[0].copy_(out)
            return (buffers[0], lse) if params.return_lse else buffers[0]

        return run


def test_reused_output_buffer_fails() -> None:
    report = _report(ReusesOutputBuffer)
    assert re.search(r"\[fp16-plain-[^\]]*\] the second call's output is written into", report)
    assert "failed 1 of" in report


class LeavesGlobalState(Correct):
    """Turns grad mode off and float64 on as the default dtype, and leaves them so."""

    name = "kit_leaves_state"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        result = super().forward(query, key, value, attn_mask, params)
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        return result


def test_changed_global_state_is_reported_and_restored() -> None:
    with registered(LeavesGlobalState) as name:
        text = _failure(name, _case())
    assert "changed grad mode during the call: True -> False (restored)" in text
    assert (
        "changed default dtype during the call: torch.float32 -> torch.float64 (restored)" in text
    )
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32


class DropoutNaN(Correct):
    """Dropped weights come out as NaN instead of 0."""

    name = "kit_dropout_nan"
    dtypes = frozenset({torch.float32})

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out = super().forward(query, key, value, attn_mask, params)
        return out.masked_fill(out == 0, float("nan")) if params.dropout_p else out


def test_dropout_nan_is_reported_as_nan() -> None:
    from attnhub.testing import dropout_problems

    with registered(DropoutNaN) as name:
        problems = dropout_problems(name, "cpu")
    assert problems and all("dropout: out has" in p and "NaN values" in p for p in problems[:1])


def test_case_with_dropout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dropout_p=0\.2 has no deterministic reference"):
        case_problems("torch_reference", _case(dropout_p=0.2), "cpu")


# -- the references -----------------------------------------------------------------


def test_r_lp_is_the_kits_own_plain_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    """r_lp does not follow torch_reference: a reference that accumulates half precision
    in float32 (as it may) leaves r_lp, and so every bound, as it was."""
    import attnhub.backends.torch_reference as torch_reference

    case = Case(torch.float16, 1, 4, 2, 33, 77, 64, 64, mask="float", mask_grad=True,
                causal=True, alignment="bottom_right", backward=True, seed=3)  # fmt: skip
    inputs = make_inputs(case, "cpu")
    r_lp, r64 = references(inputs, case)
    original = torch_reference.reference_attention

    def accumulates_in_float32(query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        if query.dtype != torch.float16:
            return original(query, key, value, attn_mask, params)
        up = [None if t is None else t.float() for t in (query, key, value, attn_mask)]
        out, lse = original(*up, params)
        return out.half(), lse

    monkeypatch.setattr(torch_reference, "reference_attention", accumulates_in_float32)
    again_lp, again_64 = references(inputs, case)
    assert set(r_lp) == {"out", "lse", "dq", "dk", "dv", "dmask"}
    for name in r_lp:
        assert torch.equal(r_lp[name], again_lp[name]), name
        assert torch.equal(r64[name], again_64[name]), name
        assert r_lp[name].dtype == (torch.float32 if name == "lse" else torch.float16)
        assert r64[name].dtype == (torch.float32 if name == "lse" else torch.float64)


def test_plain_attention_in_float64_is_the_contract() -> None:
    """The kit's plain computation, run in float64, agrees with torch_reference on every
    feature of the kit's cases, fully masked rows included."""
    from attnhub.testing.reference import _reference_attention_64

    for case in cases_for("torch_reference", "cpu", size="tiny"):
        if case.dropout_p or case.dtype != torch.float32:
            continue
        inputs = make_inputs(case, "cpu")
        tensors = [None if t is None else t.detach().double() if t.is_floating_point() else t
                   for t in (inputs.query, inputs.key, inputs.value, inputs.attn_mask)]  # fmt: skip
        out, lse = plain_attention(*tensors, case)
        expected_out, expected_lse = _reference_attention_64(*tensors, case)
        torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12, msg=case.id)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-6, atol=1e-6, msg=case.id)


def test_pytest_plugin_reports_misbehaving_backends(tmp_path: Path) -> None:
    """Under ``pytest -p attnhub.testing``, a backend that raises, returns the wrong
    thing or changes its inputs fails its cases with the kit's report: no traceback
    of the backend's exception, no internal error, and other backends unaffected."""
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import attnhub, torch
            from attnhub.backends.torch_reference import TorchReference

            class Base(TorchReference):
                dtypes = frozenset({torch.float32})
                dropout = False

            class Raises(Base):
                name = "kit_p_raises"
                def forward(self, query, key, value, attn_mask, params):
                    raise RuntimeError("boom")

            class Mutates(Base):
                name = "kit_p_mutates"
                def forward(self, query, key, value, attn_mask, params):
                    with torch.no_grad():
                        value.mul_(2.0)
                    return super().forward(query, key, value, attn_mask, params)

            class Shape(Base):
                name = "kit_p_shape"
                def forward(self, query, key, value, attn_mask, params):
                    out = super().forward(query, key, value, attn_mask, params)
                    return out[:, :, :1] if not params.return_lse else out

            class Listed(Base):
                name = "kit_p_list"
                def forward(self, query, key, value, attn_mask, params):
                    return [super().forward(query, key, value, attn_mask, params)]

            def pytest_configure(config):
                for backend in (Raises, Mutates, Shape, Listed):
                    attnhub.get_registry().add(backend())
            """
        )
    )
    env = {**os.environ, "ATTNHUB_DISABLE_PLUGIN_AUTOLOAD": "1", "COLUMNS": "1000"}
    names = ("kit_p_raises", "kit_p_mutates", "kit_p_shape", "kit_p_list")
    options = [arg for name in (*names, "torch_sdpa") for arg in ("--attnhub-backend", name)]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "attnhub.testing", "-q", "-rf", "-p", "no:cacheprovider",
         "-k", "plain or bwd or lse", *options],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "Traceback" not in output and "INTERNALERROR" not in output, output
    failed = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
    expected = {
        "kit_p_raises": "raised RuntimeError: boom (at conftest.py:",
        "kit_p_mutates": "value modified in place during the call:",
        "kit_p_shape": "out: shape (",
        "kit_p_list": "out: expected a tensor, got list of 1",
    }
    for name, text in expected.items():
        mine = [line for line in failed if f"attnhub[{name}-" in line]
        assert mine and any(text in line for line in mine), (name, output)
    assert sum(f"attnhub[{n}-fp32-plain-" in line for line in failed for n in names) >= 4
    assert "attnhub[torch_sdpa-" not in "\n".join(failed)


class BreaksTheGraph(Correct):
    """Declares compile_safe, but reads a value off the device in its forward: Dynamo
    cannot trace it without a break."""

    name = "kit_breaks_the_graph"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        if float(query.sum()) > 1e30:
            raise AssertionError("never")
        return super().forward(query, key, value, attn_mask, params)


class WrongWhenCompiled(Correct):
    """Declares compile_safe and traces, but its traced form ignores the scale."""

    name = "kit_wrong_when_compiled"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        if torch.compiler.is_compiling():
            params = dataclasses.replace(params, scale=2 * params.scale)
        return super().forward(query, key, value, attn_mask, params)


@pytest.mark.parametrize(
    ("backend", "caught"),
    [
        (
            BreaksTheGraph,
            r"compiled: raised \w+: .*\(traced at test_testing_kit\.py:\d+ in forward\)",
        ),
        (WrongWhenCompiled, r"compiled: out: max\|x - r64\|"),
    ],
    ids=["graph-break", "wrong"],
)
def test_compile_safe_is_checked_through_torch_compile(
    backend: type[attnhub.Backend], caught: str
) -> None:
    """A compile_safe declaration is held to torch.compile(fullgraph=True): a backend
    that breaks the graph, or whose traced form answers wrongly, fails exactly its two
    compiled cases (the first forward and the first backward case), named; eager, it
    passes."""
    with registered(backend) as name:
        compiled = compiled_cases(backend(), cases_for(backend(), "cpu"), "cpu")
        assert [c.backward for c in compiled] == [False, True]
        with pytest.raises(AssertionError) as info:
            check_backend(name, "cpu")
    report = str(info.value)
    assert re.search(r"failed 2 of \d+ conformance checks", report), report
    lines = report.splitlines()[1:]
    assert [line.split("]")[0].strip() for line in lines] == [f"[{c.id}" for c in compiled]
    assert all(re.search(caught, line) for line in lines), report


def test_no_compiled_case_without_compile_safe() -> None:
    class NotCompileSafe(BreaksTheGraph):
        name = "kit_not_compile_safe"
        compile_safe = False

    assert compiled_cases(NotCompileSafe(), cases_for(NotCompileSafe(), "cpu"), "cpu") == []
    with registered(NotCompileSafe) as name:
        check_backend(name, "cpu")  # passes: its eager calls conform
