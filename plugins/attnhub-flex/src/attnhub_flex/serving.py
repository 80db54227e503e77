"""FlexAttention for attnhub.attention_varlen and attnhub.attention_kvcache.

Both become one FlexAttention call whose ``mask_mod`` reads small index tensors:

- varlen (document masking): the packed (Tq, Hq, D) / (Tk, Hkv, D) tensors are one
  batch row of Tq queries and Tk keys, viewed as (1, H, T, D) without a copy; each token's
  sequence number and offset within it come from the cu_seqlens, and a query keeps a key
  only within its own sequence (then causal / window about its per-sequence diagonal);
- a KV cache: a query of sequence b keeps keys below ``seqlens_k[b]`` (and causal /
  window about ``seqlens_k[b] - Nq + i``, bottom-right, or ``i``, top-left). A
  contiguous cache (B, Hkv, Nmax, D) is the key as it is; a paged one (num_pages,
  page_size, Hkv, D) is first gathered through the block table into that layout (B,
  Hkv, pages_per_seq * page_size, D): a copy of the table's pages, which also serves a
  table that names one page twice. The value is a copy with every slot at or beyond
  ``seqlens_k[b]`` zeroed: FlexAttention multiplies a block's masked (zero) weights by
  its values, so a NaN or Inf left in a slot no key of the call occupies (an unused
  tail, a page freed by an earlier sequence) would make the row NaN, where the contract
  says such slots may hold anything. (Masked scores are -inf whatever the keys hold.)

Varlen calls keep one limitation of computing packed blocks: a NaN or Inf in one
sequence's values can reach the rows of a sequence packed beside it in the same block
(on the CPU, where FlexAttention runs eagerly over the whole batch, any sequence's);
torch_reference and triton_flash compute each sequence alone.

The softcap is the same ``score_mod`` as dense calls. One BlockMask is built per call
(``create_block_mask``; not cached: its inputs are the index tensors' values).
"""

from __future__ import annotations

from typing import Any

import torch

from attnhub import AttentionParams


def _diagonal(
    params: AttentionParams,
) -> Any:
    """``keep(q_pos, k_pos, nq, nk)`` for causal and window within one sequence of nq
    queries and nk keys (tensors), or None when they keep every key."""
    if not params.causal and params.window is None:
        return None
    bottom_right = params.bottom_right
    left, right = params.window if params.window is not None else (None, None)
    causal = params.causal

    def keep(q_pos: Any, k_pos: Any, nq: Any, nk: Any) -> Any:
        position = q_pos + (nk - nq) if bottom_right else q_pos
        ok = k_pos >= 0
        if causal:
            ok = ok & (k_pos <= position)
        if left is not None:
            ok = ok & (k_pos >= position - left)
        if right is not None:
            ok = ok & (k_pos <= position + right)
        return ok

    return keep


def _score_mod(params: AttentionParams) -> Any:
    if params.softcap is None:
        return None
    cap = params.softcap

    def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        return cap * torch.tanh(score / cap)

    return score_mod


def _token_index(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence number, offset within it) of each of ``total`` packed tokens."""
    cu = cu.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
    offset = torch.arange(total, device=cu.device) - cu[seq]
    return seq, offset


def varlen(
    run: Any,
    flex: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    params: AttentionParams,
) -> Any:
    """attention_varlen through ``run`` (flex_attention, compiled or eager)."""
    tq, hq, _ = query.shape
    tk, hkv, _ = key.shape
    seq_q, off_q = _token_index(cu_seqlens_q, tq)
    seq_k, off_k = _token_index(cu_seqlens_k, tk)
    len_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    len_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    diagonal = _diagonal(params)

    def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
        sq = seq_q[q]
        same = sq == seq_k[k]
        if diagonal is None:
            return same
        return same & diagonal(off_q[q], off_k[k], len_q[sq], len_k[sq])

    block_mask = flex.create_block_mask(mask_mod, 1, 1, tq, tk, device=query.device)
    result = run(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        score_mod=_score_mod(params), block_mask=block_mask, scale=params.scale,
        enable_gqa=hq != hkv,
        **({"return_aux": flex.AuxRequest(lse=True)} if params.return_lse else {}),
    )  # fmt: skip
    if params.return_lse:
        out, aux = result
        return out[0].transpose(0, 1), aux.lse[0].float().transpose(0, 1)
    return result[0].transpose(0, 1)


def kvcache(
    run: Any,
    flex: Any,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    params: AttentionParams,
) -> Any:
    """attention_kvcache through ``run``: a contiguous cache as it is, a paged one
    gathered through its block table, the value with unused slots zeroed (see the module
    docstring)."""
    b, hq, nq, _ = query.shape
    lengths = seqlens_k.to(torch.int64)
    diagonal = _diagonal(params)
    if block_table is None:
        key, value = k_cache, v_cache
    else:
        key, value = _logical(k_cache, block_table), _logical(v_cache, block_table)
    nk = key.shape[2]
    unused = torch.arange(nk, device=key.device) >= lengths[:, None]  # (B, nk)
    value = value.masked_fill(unused[:, None, :, None], 0.0)

    def mask_mod(batch: Any, h: Any, q: Any, k: Any) -> Any:
        length = lengths[batch]
        keep = k < length
        if diagonal is None:
            return keep
        return keep & diagonal(q, k, nq, length)

    block_mask = flex.create_block_mask(mask_mod, b, 1, nq, nk, device=query.device)
    result = run(
        query, key, value,
        score_mod=_score_mod(params), block_mask=block_mask, scale=params.scale,
        enable_gqa=hq != key.shape[1],
        **({"return_aux": flex.AuxRequest(lse=True)} if params.return_lse else {}),
    )  # fmt: skip
    if params.return_lse:
        out, aux = result
        return out, aux.lse.float()
    return result


def _logical(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, pages_per_seq * page_size, D): the pages ``block_table`` names, in order.
    Entries beyond a sequence's pages may hold anything (-1): they are clamped into the
    pool, and the keys they bring are masked and their values zeroed by the caller."""
    pages, page_size, hkv, d = pool.shape
    b, per_seq = block_table.shape
    index = block_table.to(torch.int64).clamp(0, pages - 1)
    gathered = pool[index]  # (B, per_seq, page_size, Hkv, D)
    return gathered.reshape(b, per_seq * page_size, hkv, d).transpose(1, 2)
