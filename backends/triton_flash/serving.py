"""triton_flash's KV-cache calls (layouts "kvcache" and "paged"): attnhub.attention_kvcache
served by the split-KV decode kernel (:mod:`.decode`).

The decode kernel places every query row bottom-right (row i of a sequence with L keys at
key position L - Nq + i), computes softcap and windows, GQA by packing a kv head's query
heads in one tile, return_lse, contiguous caches and paged caches with power-of-two page
sizes. It has no backward. What it cannot serve, :func:`kvcache_reasons` says, for
``TritonFlash.extra_reasons``. Packed sequences ("varlen") are served by the prefill
kernels (packed.py), with every option that call offers.

Dense calls shaped like decoding (:func:`decode_shaped`: a few query rows, no mask or
one per key, no dropout, no gradient) run on the decode kernel too, the keys and values
read as a contiguous cache whose every sequence is full (:func:`forward_dense_decode`).
A key mask (a padded batch's decoding step: (B, 1, 1, Nk), True = kept) goes to the
kernel as it is, read tile by tile beside the keys, and the keys it masks are not
read: nothing of it is read on the host, where finding its padded runs costs a device
synchronization and several small kernels in every step (benchmarks/results/archive/
patched-generate-probe-padded-drain-h100-2026-12-06-*). The
prefill kernel tiles such a call in blocks of 64-128 query rows for one to sixteen real
ones and walks the keys in one program per row block: on the H200 it read a 32K-key
cache at 1.08 TB/s where the split-KV decode kernel reads 4.0-4.4 (issue 17;
benchmarks/results/decode-h200.md). Hugging Face's generate() makes these calls, one
per layer and token, through ``attn_implementation="attnhub"`` or ``patch()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnhub.eager import capturing, keeps_tensors
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


# The most query rows a dense call may have to run on the decode kernel: its tested
# range (tests/test_triton_decode.py; the kernel packs a kv head's GROUP * Nq rows in one
# tile), where the prefill kernel leaves most of its 64-128-row tiles empty.
DENSE_DECODE_MAX_NQ = 16


def decode_shaped(request: AttentionRequest) -> bool:
    """Whether a dense call runs on the decode kernel (module docstring): at most
    DENSE_DECODE_MAX_NQ query rows (the request's bucket bounds them), no mask or one
    that varies along the keys only, no dropout, and nothing :func:`kvcache_reasons`
    refuses a cache call (a gradient, a top-left diagonal that matters)."""
    return (
        request.seqlen_q <= DENSE_DECODE_MAX_NQ
        and (request.mask == "none" or request.mask_per_key)
        and not request.dropout
        and not request.block_sparse
        and not kvcache_reasons(request)
    )


# Lengths tensors for dense decode calls, per (device, B): a table whose row i holds
# first + i in each of its B entries (rows padded to 4 ints, so that each is 16-byte
# aligned, as Triton specializes pointers), read only, never written. A call with Nk
# keys takes row Nk - first, a view: a model's layers at one decoding step, and the
# next _LENGTH_ROWS - 1 steps, share the table instead of filling a tensor each (a
# fill launch and an allocation per step).
_FULL_LENGTHS: dict[tuple[Any, int], tuple[int, torch.Tensor]] = {}
_MAX_FULL_LENGTHS = 8
_LENGTH_ROWS = 256


# The row the last call took, (device index, B, Nk, row): a decoding step's layers all
# take the same one, and indexing the table is a tensor op (a view made each call).
_last_row: tuple[int, int, int, Any] = (-2, -1, -1, None)


def _full_lengths(key: torch.Tensor, eager: bool = False) -> torch.Tensor:
    """(B,) int32 holding Nk on key's device: every sequence of the cache is full.
    ``eager``: the caller found the call in plain eager mode (attnhub.eager)."""
    global _last_row
    b, nk = key.shape[0], key.shape[2]
    # Outside plain eager mode (traced; a FakeTensorMode, whose tensors are fake) or
    # captured in a CUDA graph (whose pool would own a cached tensor, unwritten until
    # replay): filled where the call runs, not shared.
    kept = not capturing(key) if eager else keeps_tensors(key)
    if not kept:
        return torch.full((b,), nk, dtype=torch.int32, device=key.device)
    index = key.get_device()
    last = _last_row
    if last[2] == nk and last[1] == b and last[0] == index:
        return last[3]
    slot = (key.device, b)
    first, table = _FULL_LENGTHS.get(slot, (0, None))
    if table is None or not 0 <= nk - first < _LENGTH_ROWS:
        if len(_FULL_LENGTHS) >= _MAX_FULL_LENGTHS:
            _FULL_LENGTHS.clear()
        first, width = nk, -(-b // 4) * 4
        rows = torch.arange(nk, nk + _LENGTH_ROWS, dtype=torch.int32, device=key.device)
        table = rows[:, None].expand(_LENGTH_ROWS, width).contiguous()
        _FULL_LENGTHS[slot] = (first, table)
    row = table[nk - first]
    row = row if row.shape[0] == b else row[:b]
    _last_row = (index, b, nk, row)
    return row


def forward_dense_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> Any:
    """A decode-shaped dense call (:func:`decode_shaped`) on the decode kernel: key and
    value (B, Hkv, Nk, D) as a contiguous cache of B full sequences; ``attn_mask``
    None or a key mask, (1 or B, 1, 1, Nk), which the kernel takes as it is."""
    return forward_kvcache(query, key, value, _full_lengths(key), None, params, attn_mask)


def dense_decode_runner(params: AttentionParams) -> Callable[..., Any]:
    """:func:`forward_dense_decode` for calls with these ``params``, the steady state
    taken in fewer steps: where the decode kernel's last plan serves the call (a model's
    later layers repeat its first layer's call; the next step's cache is one key longer),
    its launch directly, without the kvcache entry's general path (whose checks that
    call would pass: lengths packed, no table, plain tensors in eager mode)."""
    from . import decode

    options = (params.scale, params.window, params.softcap, params.causal, None)
    return_lse = params.return_lse

    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any) -> Any:
        last = decode._last_plan
        if last is not None and decode.USE_PLANS and decode._direct(query, key, value, attn_mask):
            lengths = _full_lengths(key, eager=True)
            if last.serves(query, key, value, lengths, None, attn_mask, options):
                return last.plan(query, key, value, lengths, None, attn_mask, return_lse)
        return forward_dense_decode(query, key, value, attn_mask, params)

    return run


_decode_attention: Any = None


def forward_kvcache(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    params: AttentionParams,
    key_mask: torch.Tensor | None = None,
) -> Any:
    """``Backend.forward_kvcache`` through :func:`.decode.decode_attention` (``key_mask``:
    its argument, for :func:`forward_dense_decode`)."""
    global _decode_attention
    if _decode_attention is None:  # imports Triton: on the first call, not at import
        from .decode import decode_attention as _decode_attention
    return _decode_attention(
        query, k_cache, v_cache, seqlens_k,
        block_table=block_table, scale=params.scale, window=params.window,
        softcap=params.softcap, return_lse=params.return_lse, causal=params.causal,
        key_mask=key_mask,
    )  # fmt: skip
