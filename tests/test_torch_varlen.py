"""torch_varlen (PyTorch's varlen_attn): its declarations, feature detection and argument
mapping, on CPU.

varlen_attn runs on CUDA only, so here it is replaced by a stand-in that computes what
FlashAttention-2's varlen kernels compute by their own conventions (bottom-right
diagonal per sequence, ``window_size`` with -1 for unbounded, lse (H, T) with +inf on
rows without a key, a paged cache through ``block_table`` and ``seqused_k``); the
backend's output is then held to the contract's reference. The real kernel is checked on
the GPU by tests/test_varlen.py and tests/test_kvcache.py (``-m gpu``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

import attnhub
from attnhub.backends import torch_varlen
from attnhub.backends.torch_reference import kvcache_reference, varlen_reference
from attnhub.request import AttentionParams
from attnhub.serving_validation import ServingRequest


def _fake_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """FlashAttention-2's varlen semantics, in float64, sequence by sequence."""
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32
    hq = query.shape[1]
    out = torch.zeros(query.shape[0], hq, value.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, query.shape[0]), float("inf"))
    cq = cu_seq_q.tolist()
    for b in range(len(cq) - 1):
        if block_table is None:
            start, end = cu_seq_k[b].item(), cu_seq_k[b + 1].item()
            k, v = key[start:end], value[start:end]
        else:
            pages = block_table[b].long()
            n = seqused_k[b].item()
            k = key[pages].flatten(0, 1)[:n]
            v = value[pages].flatten(0, 1)[:n]
        if k.shape[1] != hq:
            assert enable_gqa
            k = k.repeat_interleave(hq // k.shape[1], 1)
            v = v.repeat_interleave(hq // v.shape[1], 1)
        q = query[cq[b] : cq[b + 1]]
        nq, nk = q.shape[0], k.shape[0]
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
        pos = torch.arange(nq).view(-1, 1) + nk - nq
        j = torch.arange(nk).view(1, -1)
        keep = torch.ones(nq, nk, dtype=torch.bool)
        if window_size[0] >= 0:
            keep &= j >= pos - window_size[0]
        if window_size[1] >= 0:
            keep &= j <= pos + window_size[1]
        s = s.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(s, -1)  # -inf where nothing is kept
        p = torch.exp(s - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[cq[b] : cq[b + 1]] = torch.einsum("hqk,khd->qhd", p, v.double())
        lse[:, cq[b] : cq[b + 1]] = row_lse.float().masked_fill(
            row_lse == float("-inf"), float("inf")
        )
    out = out.to(query.dtype)
    return (out, lse) if return_aux is not None and return_aux.lse else out


@pytest.fixture
def fake_varlen(monkeypatch):
    names = frozenset(inspect.signature(_fake_varlen_attn).parameters)
    monkeypatch.setattr(torch_varlen, "_varlen", lambda: (_fake_varlen_attn, names))


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _params(**options: Any) -> AttentionParams:
    return AttentionParams(scale=0.3, return_lse=True, **options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True, "alignment": "bottom_right"},
        {"window": (3, 1), "alignment": "bottom_right"},
        {"causal": True, "window": (2, None), "alignment": "bottom_right"},
        {"window": (None, 0), "alignment": "bottom_right"},
    ],
)
def test_varlen_arguments_map_to_the_contract(fake_varlen, options):
    lq, lk = [3, 0, 5, 2], [6, 2, 5, 0]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), 4, 8, generator=g, dtype=torch.float16)
    k = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float16)
    v = torch.randn(sum(lk), 2, 8, generator=g, dtype=torch.float16)
    params = _params(**options)
    out, lse = torch_varlen.TorchVarlen().forward_varlen(
        q, k, v, _cu(lq).long(), _cu(lk).long(), 5, 6, params
    )
    ref, ref_lse = varlen_reference(q.double(), k.double(), v.double(), _cu(lq), _cu(lk), params)
    assert lse.shape == (sum(lq), 4)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)  # -inf on sequence 3 too
    assert torch.equal(lse[-2:], torch.full_like(lse[-2:], float("-inf")))


def test_paged_kvcache_arguments_map_to_the_contract(fake_varlen):
    g = torch.Generator().manual_seed(1)
    b, hq, hkv, nq, d, page, per_seq = 3, 4, 2, 2, 8, 4, 3
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float16)
    k_pages = torch.randn(b * per_seq + 1, page, hkv, d, generator=g, dtype=torch.float16)
    v_pages = torch.randn(b * per_seq + 1, page, hkv, d, generator=g, dtype=torch.float16)
    table = torch.randperm(b * per_seq + 1, generator=g)[: b * per_seq].view(b, per_seq).int()
    seqlens = torch.tensor([0, 7, 12], dtype=torch.int32)
    params = _params(causal=True, alignment="bottom_right", window=(4, None))
    out, lse = torch_varlen.TorchVarlen().forward_kvcache(
        q, k_pages, v_pages, seqlens, table, params
    )
    ref, ref_lse = kvcache_reference(q.double(), k_pages.double(), v_pages.double(), seqlens, table, params)  # fmt: skip
    assert out.shape == (b, hq, nq, d) and lse.shape == (b, hq, nq)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def _request(**changes: Any) -> ServingRequest:
    base = ServingRequest(
        device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=4, heads_q=8,
        heads_kv=2, seqlen_q=1024, seqlen_k=1024, same_seqlen=False, q_longer=False,
        head_dim=128, head_dim_v=128, layout="varlen",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_reasons_say_what_flash_attention_cannot_serve(fake_varlen):
    backend = torch_varlen.TorchVarlen()
    assert backend.extra_reasons(_request(causal=True, alignment="bottom_right")) == []
    assert backend.extra_reasons(_request(causal=True, alignment="top_left")) == [
        "causal or window with top_left alignment on sequences of unequal lengths "
        "(FlashAttention's diagonal is bottom_right)"
    ]
    assert backend.extra_reasons(_request(scale_positive=False)) == [
        "scale <= 0 (PyTorch's flash kernels give NaN for it)"
    ]
    paged = _request(layout="paged", page_size=16, needs_grad=True)
    assert backend.extra_reasons(paged) == [
        "KV-cache calls are inference only in varlen_attn (no backward)",
        "page_size 16 is not a multiple of 256",
    ]
    assert backend.extra_reasons(_request(layout="paged", page_size=512)) == []
    decision_reasons = attnhub.backend.declared_reasons(backend, _request(layout="kvcache"))
    assert decision_reasons == ["kvcache layout is not supported (layouts: paged, varlen)"]


def test_features_are_read_from_the_installed_function(monkeypatch):
    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None, scale=None):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("not called")

    def oldest(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("not called")

    backend = torch_varlen.TorchVarlen()
    names = frozenset(inspect.signature(old).parameters)
    monkeypatch.setattr(torch_varlen, "_varlen", lambda: (old, names))
    assert backend.extra_reasons(_request(causal=True, alignment="bottom_right", heads_kv=8)) == []
    assert backend.extra_reasons(_request(window=True, alignment="bottom_right", heads_kv=8)) == [
        "the installed PyTorch's varlen_attn has no window_size"
    ]
    assert backend.extra_reasons(_request(layout="paged", page_size=256, heads_kv=8)) == [
        "the installed PyTorch's varlen_attn has no block_table/seqused_k"
    ]
    assert backend.extra_reasons(_request()) == [
        "the installed PyTorch's varlen_attn has no enable_gqa"
    ]
    names = frozenset(inspect.signature(oldest).parameters)
    monkeypatch.setattr(torch_varlen, "_varlen", lambda: (oldest, names))
    assert backend.unavailable_reason() == (
        "the installed PyTorch's varlen_attn has no scale, return_aux argument"
    )


def test_unavailable_here_says_why():
    why = attnhub.get_registry().unavailable_reason("torch_varlen")
    if torch.cuda.is_available():
        pytest.skip("CUDA machine")
    assert why is not None
    decision = attnhub.explain_varlen(
        torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), _cu([4]), _cu([4])
    )
    assert decision.reasons()["torch_varlen"] == [f"unavailable: {why}"]
