"""FlexAttention for attnhub.attention_varlen and attnhub.attention_kvcache.

Both become one FlexAttention call whose ``mask_mod`` reads small index tensors:

- varlen (document masking): the packed (Tq, Hq, D) / (Tk, Hkv, D) tensors are one
  batch row of Tq queries and Tk keys, viewed as (1, H, T, D) without a copy; each token's
  sequence number and offset within it come from the cu_seqlens, and a query keeps a key
  only within its own sequence (then causal / window about its per-sequence diagonal);
- a contiguous KV cache (B, Hkv, Nmax, D) is the key and value as they are; a query of
  sequence b keeps keys below ``seqlens_k[b]`` (and causal / window about
  ``seqlens_k[b] - Nq + i``, bottom-right, or ``i``, top-left);
- a paged cache (num_pages, page_size, Hkv, D) is the whole page pool as one key
  sequence of num_pages * page_size keys, viewed (no copy) as (1, Hkv, pool, D): a key
  batch of 1 for the B query rows (FlexAttention's own paged attention does so). An
  inverse block table (B, num_pages), the logical page of each physical page in
  sequence b or -1, turns a pool index into the sequence's key position, and keys of
  pages the sequence does not use are masked. The BlockMask built
  from that mask_mod lets the kernel skip every block of pages a sequence does not own
  (as FlexAttention's own paged-attention helper does).

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
    """attention_kvcache through ``run``: a contiguous cache as it is, a paged one as the
    page pool with an inverse block table (see the module docstring)."""
    b, hq, nq, _ = query.shape
    lengths = seqlens_k.to(torch.int64)
    diagonal = _diagonal(params)
    if block_table is None:
        key, value = k_cache, v_cache
        nk = k_cache.shape[2]

        def position(batch: Any, k: Any) -> Any:
            return k

    else:
        pages, page_size = k_cache.shape[:2]
        nk = pages * page_size
        # (1, Hkv, pool, D) views of the pool (flatten copies only a pool whose pages
        # are not evenly strided), one key batch row for every query row: FlexAttention
        # takes a key batch of 1 with a BlockMask of the query's batch (the way its own
        # paged attention runs), so the pool is never repeated.
        key = k_cache.flatten(0, 1).transpose(0, 1).unsqueeze(0)
        value = v_cache.flatten(0, 1).transpose(0, 1).unsqueeze(0)
        inverse = _inverse_table(block_table, lengths, page_size, pages)

        def position(batch: Any, k: Any) -> Any:
            logical = inverse[batch, k // page_size]
            return torch.where(logical >= 0, logical * page_size + k % page_size, -1)

    def mask_mod(batch: Any, h: Any, q: Any, k: Any) -> Any:
        length = lengths[batch]
        k_pos = position(batch, k)
        keep = (k_pos >= 0) & (k_pos < length)
        if diagonal is None:
            return keep
        return keep & diagonal(q, k_pos, nq, length)

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


def _inverse_table(
    block_table: torch.Tensor, lengths: torch.Tensor, page_size: int, pages: int
) -> torch.Tensor:
    """(B, num_pages) int64: the logical page index of physical page p in sequence b's
    table, among the pages it uses (``ceil(L_b / page_size)``), or -1."""
    b, per_seq = block_table.shape
    used = (lengths + page_size - 1) // page_size
    logical = torch.arange(per_seq, device=block_table.device).expand(b, per_seq)
    in_use = logical < used.unsqueeze(1)
    inverse = torch.full((b, pages + 1), -1, device=block_table.device, dtype=torch.int64)
    # Entries not in use go to the extra column (dropped), whatever their value (-1 too).
    target = torch.where(in_use, block_table.to(torch.int64), pages)
    inverse.scatter_(1, target, torch.where(in_use, logical, -1))
    return inverse[:, :pages]
