"""Random F.scaled_dot_product_attention calls under attnhub.patch(), held to the float64
reference and to PyTorch's own error on the same call (attnhub.testing.patched).

test_patch.py checks chosen calls; here the calls a patched model could make are drawn
with every argument at once (GQA, masks of rank 2 to 4, random and structured as
Hugging Face builds them, is_causal, scales, strided queries, gradients). CPU calls run
on the dev machine's backends; ``interpreter``: triton_flash's patched path in Triton's
interpreter; ``gpu``: CUDA calls, where the patch reads masks' structure and the
kernels that skip masked blocks serve (a GPU draw found torch_sdpa's top-left causal
gradients off the square: test_pytorch_checks). A failing id reproduces with
``sample_sdpa_calls(device, count, seed)``; ``benchmarks/patch_fuzz.py`` draws more.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import pytest
import torch

import attnhub
from attnhub.backends.torch_reference import TorchReference
from attnhub.dispatch import clear_cache
from attnhub.testing.patched import SdpaCall, patched_call_problems, sample_sdpa_calls

_CPU = sample_sdpa_calls("cpu", 150, seed=0)
_INTERPRETED = sample_sdpa_calls("cpu", 24, seed=1)
_GPU = sample_sdpa_calls("cuda", 40, seed=2)


@pytest.mark.parametrize("call", _CPU, ids=lambda c: c.id)
def test_sampled_patched_call(call: SdpaCall) -> None:
    problems, served = patched_call_problems(call, "cpu")
    assert not problems, (served, problems)


@pytest.mark.interpreter
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("call", _INTERPRETED, ids=lambda c: c.id)
def test_sampled_patched_call_on_triton_flash(call: SdpaCall) -> None:
    problems, served = patched_call_problems(call, "cpu", backend="triton_flash")
    assert not problems, (served, problems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("call", _GPU, ids=lambda c: c.id)
def test_gpu_sampled_patched_call(call: SdpaCall) -> None:
    problems, served = patched_call_problems(call, "cuda")
    assert not problems, (served, problems)


def test_the_draws_cover_every_kind_of_call_and_repeat() -> None:
    kinds = collections.Counter(c.mask for c in _CPU)
    assert set(kinds) == {"none", "random", "float", "float_inf", "float_min", "causal", "window", "padding", "padding_causal"}  # fmt: skip
    for flag in ("is_causal", "enable_gqa", "strided", "grad"):
        assert any(getattr(c, flag) for c in _CPU), flag
    assert {len(c.mask_shape) for c in _CPU if c.mask != "none"} == {2, 3, 4}
    assert {c.offset != 0 for c in _CPU if c.mask == "causal"} == {False, True}
    assert [c.id for c in sample_sdpa_calls("cpu", 150, seed=0)] == [c.id for c in _CPU]
    first = _CPU[0].make("cpu")
    again = _CPU[0].make("cpu")
    assert all(torch.equal(a, b) for a, b in zip(first[0], again[0], strict=True))


class _OffByOnePercent(TorchReference):
    """The reference, its output 1% too large: a patch serving it must be caught."""

    name = "sampled_off_by_one_percent"
    priority = -1000

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out = super().forward(query, key, value, attn_mask, params)
        return (out[0] * 1.01, out[1]) if params.return_lse else out * 1.01


def test_a_wrong_patched_answer_is_reported() -> None:
    registry = attnhub.get_registry()
    registry.add(_OffByOnePercent())
    clear_cache()
    try:
        call = SdpaCall(dtype=torch.float32, B=1, Hq=2, Hkv=2, Nq=8, Nk=8, D=16, Dv=16, grad=True)
        problems, served = patched_call_problems(call, "cpu", backend=_OffByOnePercent.name)
        assert served == {_OffByOnePercent.name: 1}
        assert problems and problems[0].startswith("out: ") and "PyTorch's" in problems[0]
        assert patched_call_problems(dataclasses.replace(call, grad=False), "cpu")[0] == []
    finally:
        registry.remove(_OffByOnePercent.name)
        clear_cache()
