"""``torch_reference``: the contract as plain PyTorch operations.

This is the executable form of contract.md: every feature, any device, every float
dtype, gradients by autograd. It materializes the (B, Hq, Nq, Nk) score matrix, so it
is declared memory-quadratic and dispatch chooses it only when nothing else can serve
a call (and says so). Tests compare every other backend against it, in float64.

Two functions: :func:`reference_attention` is the contract's arithmetic in whatever
dtype it is given (float64 for the tests' oracle, the input dtype for the "plain
PyTorch operations" of a tolerance estimate); :func:`contract_attention`, what the
backend runs, gives it float32 copies of half-precision inputs, because the contract
accumulates in float32 or better: in float16, ``q @ k^T`` alone overflows (65504) on
inputs as ordinary as 80 channels of 256, where every kernel stays finite.

:func:`varlen_reference` and :func:`kvcache_reference` define the packed and KV-cache
calls the same way, one dense call per sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnhub.backend import FLOAT_DTYPES, Backend
from attnhub.request import AttentionParams


def keep_mask(
    nq: int,
    nk: int,
    params: AttentionParams,
    device: torch.device,
) -> torch.Tensor | None:
    """The (Nq, Nk) bool mask of positions kept by ``causal`` and ``window`` (None: all).

    Query row i sits at key position ``i`` (top_left) or ``i + Nk - Nq`` (bottom_right).
    """
    if not params.causal and params.window is None:
        return None
    offset = nk - nq if params.bottom_right else 0
    position = torch.arange(nq, device=device).unsqueeze(1) + offset
    key_pos = torch.arange(nk, device=device).unsqueeze(0)
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if params.causal:
        keep &= key_pos <= position
    if params.window is not None:
        left, right = params.window
        if left is not None:
            keep &= key_pos >= position - left
        if right is not None:
            keep &= key_pos <= position + right
    return keep


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by the contract, every operation in the inputs' dtype (the backend
    runs it through :func:`contract_attention`, which upcasts half precision first).

    Shapes: query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv).
    Returns ``(out, lse)``: out (B, Hq, Nq, Dv) in the query's dtype, lse float32
    (B, Hq, Nq). Rows with every key masked give zeros and lse = -inf, with zero
    gradients and no NaN anywhere.
    """
    b, hq, nq, _ = query.shape
    hkv, nk = key.shape[1], key.shape[2]
    if hkv != hq:  # grouped-query attention: query head h reads key/value head h // group
        group = hq // hkv
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-2, -1)) * params.scale
    if params.softcap is not None:
        scores = params.softcap * torch.tanh(scores / params.softcap)
    keep = keep_mask(nq, nk, params, query.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            scores = scores + attn_mask.to(scores.dtype)
    if params.block_sparse is not None:
        layout_mask = params.block_sparse.to_dense_mask(nq, nk).to(query.device)
        keep = layout_mask if keep is None else keep & layout_mask
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    scores = scores.expand(b, hq, nq, nk)
    # A safe softmax: shift by the (detached) row maximum, and give rows whose
    # every score is -inf zero weights and lse = -inf instead of 0/0.
    if nk:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    else:  # no keys at all (amax of an empty dim raises): every row is fully masked
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    probs = weights / safe_total
    lse = torch.where(empty, torch.full_like(total, float("-inf")), torch.log(safe_total) + row_max)
    if params.dropout_p > 0.0:
        keep_drop = torch.rand(probs.shape, device=probs.device) >= params.dropout_p
        probs = probs * keep_drop.to(probs.dtype) / (1.0 - params.dropout_p)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.to(query.dtype), lse.squeeze(-1).float()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the contract computes ``dtype`` inputs in: float64 stays, anything
    narrower (float16, bfloat16, float32) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def contract_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_attention` with the contract's accumulation: scores, softmax and
    the weighted sum in :func:`compute_dtype` of the inputs, the output rounded once to
    the query's dtype. Differentiable: the casts pass gradients back in the inputs'
    dtypes (a float mask's too; it is added in the compute dtype). Shapes and returns as
    :func:`reference_attention`."""
    compute = compute_dtype(query.dtype)
    out, lse = reference_attention(
        query.to(compute), key.to(compute), value.to(compute), attn_mask, params
    )
    return out.to(query.dtype), lse


class TorchReference(Backend):
    name = "torch_reference"
    description = "plain PyTorch, the executable contract (materializes Nq x Nk scores)"
    priority = -100
    devices = frozenset({"cpu", "cuda", "mps", "xpu", "meta"})
    dtypes = FLOAT_DTYPES
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    mask_grad = True
    causal_alignments = frozenset({"top_left", "bottom_right"})
    window = softcap = dropout = gqa = block_sparse = lse = True
    backward = lse_grad = True
    deterministic = True
    memory = "quadratic"
    compile_safe = True
    copies_strided = False
    layouts = frozenset({"dense", "varlen", "kvcache", "paged"})

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = contract_attention(query, key, value, attn_mask, params)
        return (out, lse) if params.return_lse else out

    def forward_varlen(  # type: ignore[no-untyped-def]
        self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params
    ):
        out, lse = varlen_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, params)
        return (out, lse) if params.return_lse else out

    def forward_kvcache(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, seqlens_k, block_table, params
    ):
        out, lse = kvcache_reference(query, k_cache, v_cache, seqlens_k, block_table, params)
        return (out, lse) if params.return_lse else out


def varlen_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    params: AttentionParams,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = contract_attention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention, sequence by sequence: the contract's definition of
    :func:`attnhub.attention_varlen`.

    query (Tq, Hq, D), key (Tk, Hkv, D), value (Tk, Hkv, Dv); sequence b is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of the query against rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of key and value, computed as one dense
    call by ``attend`` (:func:`contract_attention`; the tests pass
    :func:`reference_attention` on float64 copies). Returns ``(out, lse)``: out
    (Tq, Hq, Dv) in the query's dtype, lse float32 (Tq, Hq). Differentiable.
    """
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    hq, dv = query.shape[1], value.shape[2]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q = query[cu_q[b] : cu_q[b + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        k = key[cu_k[b] : cu_k[b + 1]].transpose(0, 1).unsqueeze(0)
        v = value[cu_k[b] : cu_k[b + 1]].transpose(0, 1).unsqueeze(0)
        out, lse = attend(q, k, v, None, params)
        outs.append(out[0].transpose(0, 1))  # (n, Hq, Dv)
        lses.append(lse[0].transpose(0, 1))
    if not outs:  # no sequences (then Tq == 0)
        return query.new_zeros((0, hq, dv)), query.new_zeros((0, hq), dtype=torch.float32)
    return torch.cat(outs), torch.cat(lses)


def gather_cache(
    cache: torch.Tensor, b: int, length: int, block_table: torch.Tensor | None
) -> torch.Tensor:
    """Sequence b's first ``length`` positions of a cache as (Hkv, length, D).

    Contiguous cache (B, Hkv, Nmax, D): row b. Paged cache (num_pages, page_size,
    Hkv, D): position p is slot ``p % page_size`` of page ``block_table[b, p //
    page_size]``.
    """
    if block_table is None:
        return cache[b, :, :length]
    page_size = cache.shape[1]
    used = -(-length // page_size)
    pages = block_table[b, :used].to(torch.int64)
    tokens = cache[pages].reshape(used * page_size, *cache.shape[2:])[:length]
    return tokens.transpose(0, 1)


def kvcache_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    params: AttentionParams,
    attend: Callable[..., tuple[torch.Tensor, torch.Tensor]] = contract_attention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention against a KV cache, sequence by sequence: the contract's definition of
    :func:`attnhub.attention_kvcache` (after any append).

    query (B, Hq, Nq, D); sequence b has ``seqlens_k[b]`` keys, gathered by
    :func:`gather_cache`, and is one dense call by ``attend`` with the params'
    alignment. Returns ``(out, lse)``: out (B, Hq, Nq, Dv), lse float32 (B, Hq, Nq).
    """
    lengths = seqlens_k.tolist()
    _, hq, nq, _ = query.shape
    dv = v_cache.shape[-1]
    outs, lses = [], []
    for i, length in enumerate(lengths):
        k = gather_cache(k_cache, i, length, block_table).unsqueeze(0)
        v = gather_cache(v_cache, i, length, block_table).unsqueeze(0)
        out, lse = attend(query[i : i + 1], k, v, None, params)
        outs.append(out)
        lses.append(lse)
    if not outs:
        return (
            query.new_zeros((0, hq, nq, dv)),
            query.new_zeros((0, hq, nq), dtype=torch.float32),
        )
    return torch.cat(outs), torch.cat(lses)
