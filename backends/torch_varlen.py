"""``torch_varlen``: PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2's
varlen kernels) behind attnhub.attention_varlen and attnhub.attention_kvcache.

Which features the installed PyTorch's function has is read from the function itself
(its parameters), never from the version string: ``scale`` and ``return_aux`` (the lse)
are required; ``window_size`` gives causal (``(left, 0)``) and windows, an older
``is_causal`` causal only; ``enable_gqa`` grouped-query heads; ``seqused_k`` and
``block_table`` KV caches. What is missing is said per call in ``explain()``.

Semantics, mapped to contract.md:

- FlashAttention's diagonal is bottom-right per sequence (query row i of a sequence with
  Nq_b queries and Nk_b keys sits at key position i + Nk_b - Nq_b), so top-left
  diagonals are served only where every sequence has as many queries as keys (the
  request then normalizes the alignment away).
- ``window=(left, right)`` becomes ``window_size=(left, right)`` with -1 for an
  unbounded side; causal is a right side of 0.
- A row that keeps no key gets lse +inf from FlashAttention (its "no key" marker); the
  contract's -inf is written over it. Its output is zeros already.
- The lse comes as (H, T); it is handed back as the contract's (T, H) (a transposed view).
- Paged KV caches: the query (B, Hq, Nq, D) is viewed as packed (B * Nq, Hq, D) sequences
  of Nq queries; the cache goes to ``block_table`` and ``seqused_k`` as it is.
  FlashAttention-2 takes pages of a multiple of 256 keys only; other page sizes are
  declined. KV-cache calls are inference only (PyTorch: "seqused_k is an
  inference-only parameter"). Contiguous caches are not served (see ``layouts``).
- Not served: softcap, dropout, masks, float32/float64, Dv != D, scale <= 0 (PyTorch's
  flash kernels give NaN for it, see torch_sdpa.py), compute capability below 8.0.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from attnhub.backend import Backend
from attnhub.request import AttentionParams, AttentionRequest

# FlashAttention-2's paged KV cache: "Paged KV cache block size must be divisible by 256".
_PAGE_MULTIPLE = 256


@functools.cache
def _varlen() -> tuple[Any, frozenset[str]]:
    """(varlen_attn, the names of its parameters), or (None, why) where it is missing."""
    try:
        from torch.nn.attention import varlen
    except Exception as exc:
        return None, frozenset({f"torch.nn.attention.varlen does not import: {exc}"})
    function = getattr(varlen, "varlen_attn", None)
    if function is None or not hasattr(varlen, "AuxRequest"):
        return None, frozenset({"torch.nn.attention.varlen has no varlen_attn / AuxRequest"})
    return function, frozenset(inspect.signature(function).parameters)


def _has(name: str) -> bool:
    function, names = _varlen()
    return function is not None and name in names


class TorchVarlen(Backend):
    name = "torch_varlen"
    description = "PyTorch's varlen_attn (FlashAttention-2 varlen and paged-KV kernels)"
    priority = 40
    devices = frozenset({"cuda"})
    min_capability = (8, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16})
    head_dims = (8, 256)
    head_dim_multiple = 8
    causal_alignments = frozenset({"top_left", "bottom_right"})  # see extra_reasons
    window = gqa = lse = True
    backward = True  # varlen only: KV-cache calls are declined with a reason
    deterministic = False
    memory = "linear"
    copies_strided = False
    # Not "kvcache": varlen_attn reads a cache as (pages, page_size, Hkv, D); a contiguous
    # (B, Hkv, Nmax, D) cache would need a copy (or a strided view of B pages of Nmax
    # keys, not yet run on a GPU).
    layouts = frozenset({"varlen", "paged"})

    def unavailable_reason(self) -> str | None:
        function, names = _varlen()
        if function is None:
            return next(iter(names))
        missing = [n for n in ("scale", "return_aux") if n not in names]
        if missing:
            return f"the installed PyTorch's varlen_attn has no {', '.join(missing)} argument"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        reasons = []
        layout = getattr(request, "layout", "dense")
        if (request.causal or request.window) and request.alignment == "top_left":
            # Kept only where some sequence's lengths differ (the request's rule).
            reasons.append(
                "causal or window with top_left alignment on sequences of unequal lengths "
                "(FlashAttention's diagonal is bottom_right)"
            )
        if request.window and not _has("window_size"):
            reasons.append("the installed PyTorch's varlen_attn has no window_size")
        if request.causal and not (_has("window_size") or _has("is_causal")):
            reasons.append("the installed PyTorch's varlen_attn has no causal argument")
        if request.heads_q != request.heads_kv and not _has("enable_gqa"):
            reasons.append("the installed PyTorch's varlen_attn has no enable_gqa")
        if not request.last_dim_contiguous:
            reasons.append("a strided last dim (FlashAttention needs stride 1 there)")
        if not request.scale_positive:
            reasons.append("scale <= 0 (PyTorch's flash kernels give NaN for it)")
        if layout in ("kvcache", "paged"):
            if not (_has("block_table") and _has("seqused_k")):
                reasons.append("the installed PyTorch's varlen_attn has no block_table/seqused_k")
            if request.needs_grad:
                reasons.append("KV-cache calls are inference only in varlen_attn (no backward)")
            page = getattr(request, "page_size", None)
            if page is not None and page % _PAGE_MULTIPLE:
                reasons.append(f"page_size {page} is not a multiple of {_PAGE_MULTIPLE}")
        return reasons

    def forward_varlen(  # type: ignore[no-untyped-def]
        self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params
    ):
        return _call(
            query, key, value, cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32),
            max_seqlen_q, max_seqlen_k, params, hkv=key.shape[1],
        )  # fmt: skip

    def forward_kvcache(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, seqlens_k, block_table, params
    ):
        b, hq, nq, d = query.shape
        capacity = block_table.shape[1] * k_cache.shape[1]
        seqused = seqlens_k.to(torch.int32)
        cu_k = torch.zeros(b + 1, device=query.device, dtype=torch.int32)
        torch.cumsum(seqused, 0, out=cu_k[1:])
        cu_q = torch.arange(0, (b + 1) * nq, nq, device=query.device, dtype=torch.int32)
        packed = query.transpose(1, 2).reshape(b * nq, hq, d)
        result = _call(
            packed, k_cache, v_cache, cu_q, cu_k, nq, capacity, params,
            hkv=k_cache.shape[2], seqused_k=seqused, block_table=block_table,
        )  # fmt: skip
        if params.return_lse:
            out, lse = result
            return (
                out.reshape(b, nq, hq, -1).transpose(1, 2),
                lse.reshape(b, nq, hq).transpose(1, 2),
            )
        return result.reshape(b, nq, hq, -1).transpose(1, 2)


def _call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    params: AttentionParams,
    *,
    hkv: int,
    **extra: Any,
) -> Any:
    """varlen_attn on packed (T, H, D) queries; returns out (T, Hq, D) and, with
    ``params.return_lse``, the lse as (T, Hq) with -inf on rows without a key."""
    function, _ = _varlen()
    from torch.nn.attention.varlen import AuxRequest

    kwargs: dict[str, Any] = dict(extra, scale=params.scale)
    if params.window is not None or params.causal:
        left, right = params.window if params.window is not None else (None, None)
        if params.causal:
            right = 0 if right is None else min(right, 0)
        if _has("window_size"):
            kwargs["window_size"] = (-1 if left is None else left, -1 if right is None else right)
        else:  # causal only (extra_reasons declined windows)
            kwargs["is_causal"] = True
    if query.shape[1] != hkv:
        kwargs["enable_gqa"] = True
    if params.return_lse:
        kwargs["return_aux"] = AuxRequest(lse=True)
    result = function(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)
    if not params.return_lse:
        return result
    out, lse = result
    lse = lse.transpose(0, 1)  # FlashAttention's (H, T) as the contract's (T, H)
    # FlashAttention marks a row without a key with lse = +inf; the contract says -inf.
    lse = lse.masked_fill(lse == float("inf"), float("-inf"))
    return out, lse
