"""triton_flash's KV-cache calls (layouts "kvcache" and "paged"): attnhub.attention_kvcache
served by the split-KV decode kernel (:mod:`.decode`).

The decode kernel places every query row bottom-right (row i of a sequence with L keys at
key position L - Nq + i), computes softcap and windows, GQA by packing a kv head's query
heads in one tile, return_lse, contiguous caches and paged caches with power-of-two page
sizes. It has no backward. What it cannot serve, :func:`kvcache_reasons` says, for
``TritonFlash.extra_reasons``. Packed sequences ("varlen") are served by the prefill
kernels (packed.py), with every option that call offers.
"""

from __future__ import annotations

from typing import Any

import torch

from attnhub.request import AttentionParams, AttentionRequest


def kvcache_reasons(request: AttentionRequest) -> list[str]:
    """Why the decode kernel cannot serve a KV-cache request (empty: it can)."""
    reasons = []
    if request.needs_grad:
        reasons.append("KV-cache calls have no backward in triton_flash (the decode kernel)")
    # A request keeps "top_left" only where it matters: a diagonal (causal or window)
    # and some sequence whose key count differs from Nq (attnhub's request normalizes
    # the alignment away otherwise, and then the kernel's bottom-right is the same).
    if (
        request.alignment == "top_left"
        and (request.causal or request.window)
        and not request.same_seqlen
    ):
        reasons.append("causal or window with top_left alignment on a KV cache (bottom_right only)")
    page_size = getattr(request, "page_size", None)
    if page_size is not None and page_size & (page_size - 1):
        reasons.append(f"page_size {page_size} is not a power of two")
    return reasons


_decode_attention: Any = None


def forward_kvcache(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    params: AttentionParams,
) -> Any:
    """``Backend.forward_kvcache`` through :func:`.decode.decode_attention`."""
    global _decode_attention
    if _decode_attention is None:  # imports Triton: on the first call, not at import
        from .decode import decode_attention as _decode_attention
    return _decode_attention(
        query, k_cache, v_cache, seqlens_k,
        block_table=block_table, scale=params.scale, window=params.window,
        softcap=params.softcap, return_lse=params.return_lse, causal=params.causal,
    )  # fmt: skip
