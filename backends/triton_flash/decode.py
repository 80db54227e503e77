"""Split-KV attention for KV-cache decoding ("flash-decoding"), in Triton.

:func:`decode_attention` computes, for every sequence b of a batch, attention of a few
new query tokens (Nq = 1..16; 4 for speculative decoding) against the first
``cache_seqlens[b]`` keys of a KV cache, contiguous (B, Hkv, Nmax, D) or paged
(num_pages, page_size, Hkv, D) with a (B, max_pages) int32 block table.

Semantics (docs/contract.md, with per-sequence lengths): query row i of sequence b,
whose cache holds L = cache_seqlens[b] keys, sits at key position ``L - Nq + i``
(bottom-right alignment); causal keeps keys up to that position, ``window=(left,
right)`` keeps ``position - left .. position + right``; keys >= L are never read. Scores
are ``scale * q.k``, then ``softcap * tanh(s / softcap)``, then a float key mask added
(if one is given), then masked to -inf (causal, window, a bool key mask), then softmax.
A key mask ((1 or B, Nk), shared by every head and query row of a sequence: a padded
batch's decoding step) is read beside the keys, and the K and V rows of the keys it
masks are never loaded. A row with no key (L = 0, L < Nq - i under causal, or every key
masked) gives zeros and an lse of -inf. lse is natural-log float32 (B, Hq, Nq). GQA:
query head h reads kv head h // (Hq // Hkv).

Structure (two launches, or one):

``decode_split_kernel``   grid (S, B * Hkv, row blocks). One program owns one kv head of
                          one sequence and the GROUP * Nq query rows that read it (GQA
                          heads and query tokens packed into one (BLOCK_M, D) tile, row
                          r = g * Nq + i), so each K/V byte is read once per row block
                          (one row block unless GROUP * Nq > 64). The sequence's visible
                          key blocks are divided into S near-equal runs (S chosen on the
                          host from B * Hkv against the SM count and the cache capacity;
                          the run lengths from the true length L, in the kernel, so that
                          short sequences are shared out as evenly as long ones). Each
                          program walks its run with FlashAttention's online softmax in
                          three segments: a masked head (window edge), an unmasked middle
                          (no mask arithmetic), a masked tail (causal diagonal, ragged
                          end). With S > 1 it writes its partial result (out normalized,
                          lse in log2 units, float32) to a scratch buffer; with S = 1 it
                          writes the final output and lse itself.
``decode_merge_kernel``   grid (blocks of <= 16 rows, B * Hkv): merges the S partials of each row by
                          their log-sum-exp: out = sum_s exp(lse_s - lse) out_s,
                          lse = log sum_s exp(lse_s). Splits that saw no key carry
                          lse = -inf and weigh nothing.

Paged caches: the key tile of BLOCK_N keys starting at key n reads page
``block_table[b, n // page_size]``; where page_size >= BLOCK_N that is one scalar load
per tile (a tile never straddles pages: both are powers of two), else one gathered load
per key (PAGE_SIZE < BLOCK_N, e.g. 16-key pages under 64-key tiles).

Host path: a repeated eager call on CUDA finds its launch plan by its signature
(``_PLANS``: shapes, strides, dtypes, alignment, options; the cache's length only by its
bucket, so that a model's next decoding step, one key longer, finds the plan too) and
launches the compiled kernels directly (launch.CachedLaunch, without Triton's per-call
binder, the cache's and mask's strides filled in per call), after three
allocations: out, lse and one flat float32 scratch buffer for the partials (none when
S = 1). The first call of a signature takes the full path (:func:`_plan` picks the
launch, Triton compiles or finds the kernels). The scratch is allocated per call, not
cached: a cached buffer would be shared by calls on different streams (a silent race),
and the caching allocator serves a same-sized block in a few microseconds. The
launches use no host-side value of the lengths, so a call captures into a CUDA graph
and replays with new lengths.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from attnhub.eager import plain_eager
from attnhub.tensor_guards import Guards

from .common import FP32_MAX, INTERPRETED, LN2, LOG2E, _tanh, interpreting

# A window side this large keeps every key (contract.md: sides >= 2**30 are unbounded);
# positions and keys stay below 2**31 - 2**30, so pos +- UNBOUNDED fits int32.
UNBOUNDED = 1 << 30


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@triton.jit
def _decode_step(
    acc, l_i, m_i, q, K, V, BT, start, b, hkv, L, pos, key_mask,
    offs_n0, offs_d, offs_dv,
    stride_kp, stride_kh, stride_kn, stride_kd,
    stride_vp, stride_vh, stride_vn, stride_vd,
    HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):  # fmt: skip
    """Keys start .. start + BLOCK_N - 1 folded into the running softmax (scores in log2
    units). Contiguous caches: ``stride_kp`` is the batch stride (the kernel passes
    ``b`` as the "page"). MASKED: the tile may hold keys >= L or outside some row's band
    (``pos`` (BLOCK_M,): each row's key position). ``key_mask``: the tile's
    :func:`_key_mask_tile` (MASK_KIND 1: which keys are kept; 2: the bias in log2
    units), any value without a key mask."""
    offs_n = start + offs_n0
    if PAGED:
        if PAGE_SIZE >= BLOCK_N:
            # The whole tile lies in one page (powers of two, start % BLOCK_N == 0).
            page = tl.load(BT + start // PAGE_SIZE).to(tl.int64)
            rows = (start % PAGE_SIZE + offs_n0).to(tl.int64)
            k_rows = page * stride_kp + rows * stride_kn
            v_rows = page * stride_vp + rows * stride_vn
        else:
            if MASKED:
                # Entries past the table's last used page may not exist: keys >= L.
                pages = tl.load(BT + offs_n // PAGE_SIZE, mask=offs_n < L, other=0)
            else:
                pages = tl.load(BT + offs_n // PAGE_SIZE)
            pages = pages.to(tl.int64)
            rows = (offs_n % PAGE_SIZE).to(tl.int64)
            k_rows = pages * stride_kp + rows * stride_kn
            v_rows = pages * stride_vp + rows * stride_vn
    else:
        rows = offs_n.to(tl.int64)
        k_rows = b * stride_kp + rows * stride_kn
        v_rows = b * stride_vp + rows * stride_vn
    k_ptrs = K + hkv * stride_kh + k_rows[:, None] + offs_d[None, :] * stride_kd
    v_ptrs = V + hkv * stride_vh + v_rows[:, None] + offs_dv[None, :] * stride_vd
    if MASKED or MASK_KIND != 0:
        # The rows to read: keys < L, and those the key mask keeps (a masked key's K and
        # V rows are never fetched: the padding of a padded batch costs no bandwidth).
        if MASK_KIND == 0:
            read = offs_n < L
        elif MASKED:
            read = (offs_n < L) & _kept(key_mask, MASK_KIND)
        else:
            read = _kept(key_mask, MASK_KIND)
        if EVEN_D:
            k = tl.load(k_ptrs, mask=read[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=read[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=read[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
            v = tl.load(v_ptrs, mask=read[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DV, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    if HAS_SOFTCAP:
        # Both scalar factors clamped to float32's range (per program, not per score),
        # as common._scores does and for the same reasons: an overflowed ratio made
        # 0 * inf = NaN, an overflowed softcap * LOG2E inf - inf in the running max.
        ratio = tl.minimum(tl.maximum(sm_scale / softcap, -FP32_MAX), FP32_MAX)
        s = _tanh(qk * ratio, k.dtype != tl.float32) * tl.minimum(softcap * LOG2E, FP32_MAX)
    else:
        s = qk * qk_scale
    if MASK_KIND == 1:
        s = tl.where(key_mask[None, :], s, float("-inf"))
    elif MASK_KIND == 2:
        s = s + key_mask[None, :]
    if MASKED:
        cols = offs_n[None, :]
        keep = (cols < L) & (cols <= pos[:, None] + win_right)
        if HAS_LEFT:
            keep = keep & (cols >= pos[:, None] - win_left)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no kept key so far has m_new = -inf: shift by 0 instead (its weights
    # are exp2(-inf) = 0, and -inf - -inf would be NaN).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _decode_segment(
    acc, l_i, m_i, q, K, V, BT, KM, s0, s1, b, hkv, L, pos,
    offs_n0, offs_d, offs_dv,
    stride_kp, stride_kh, stride_kn, stride_kd,
    stride_vp, stride_vh, stride_vn, stride_vd, stride_mn,
    HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, MASK_KIND: tl.constexpr,
):  # fmt: skip
    """Key blocks s0 .. s1 - 1 (block indices) through :func:`_decode_step`, each with
    its tile of the key mask (MASK_KIND != 0)."""
    for blk in range(s0, s1):
        key_mask = 0
        if MASK_KIND != 0:
            key_mask = _key_mask_tile(KM, blk * BLOCK_N + offs_n0, L, stride_mn, MASK_KIND)
        acc, l_i, m_i = _decode_step(
            acc, l_i, m_i, q, K, V, BT, blk * BLOCK_N, b, hkv, L, pos, key_mask,
            offs_n0, offs_d, offs_dv,
            stride_kp, stride_kh, stride_kn, stride_kd,
            stride_vp, stride_vh, stride_vn, stride_vd,
            HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
            MASKED, EVEN_D, HAS_LEFT, HAS_SOFTCAP, PAGED, PAGE_SIZE, BLOCK_N, INPUT_PRECISION,
            MASK_KIND,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _bias_log2(bias):
    """A float key mask's entries as float32 score terms in log2 units (``bias * log2 e``).

    In log2 units a finite float mask beyond FP32_MAX / LOG2E (2.36e38 either way:
    finfo.min padding masks of float32 and bfloat16) overflowed to +-inf: a row whose
    every key carried -finfo.min read as fully masked (zeros) where the contract's
    softmax of equal scores is the mean of the values, and one past +2.36e38 made its
    row NaN. Such entries are clamped to +-FP32_MAX; +-inf and NaN stay what they are
    (|NaN| < inf is false). One key tile a step, so the clamp costs little here; the
    dense kernels take a float mask's scores in natural units instead (common._scores)."""
    bias = bias.to(tl.float32)
    bias2 = bias * LOG2E
    clamp = (tl.abs(bias2) > FP32_MAX) & (tl.abs(bias) < float("inf"))
    return tl.where(clamp, tl.where(bias2 > 0, FP32_MAX, -FP32_MAX), bias2)


@triton.jit
def _key_mask_tile(KM, offs_n, L, stride_mn, MASK_KIND: tl.constexpr):
    """Keys ``offs_n`` of one sequence's key mask (``KM`` at its row; keys >= L are not
    read): MASK_KIND 1, bool, as int1 (True = kept); 2, a float bias in log2 units
    (:func:`_bias_log2`)."""
    inside = offs_n < L
    ptrs = KM + offs_n.to(tl.int64) * stride_mn
    if MASK_KIND == 1:
        tile = tl.load(ptrs, mask=inside, other=0) != 0
    else:
        tile = _bias_log2(tl.load(ptrs, mask=inside, other=0.0))
    return tile


@triton.jit
def _kept(key_mask, MASK_KIND: tl.constexpr):
    """Which keys of a :func:`_key_mask_tile` the mask keeps: True, or a bias other than
    -inf (NaN included: it must reach its row)."""
    if MASK_KIND == 1:
        kept = key_mask
    else:
        kept = key_mask != float("-inf")
    return kept


@triton.jit
def _fence(x):
    """``fence.acq_rel.gpu`` in every thread (``x``: any int32 scalar, returned): makes
    this thread's earlier stores visible GPU-wide before its later ones, and its later
    loads see what the releases it acquired published. The interpreter runs programs
    one after another and needs none (nor can it run PTX)."""
    if not INTERPRETED:
        x = tl.inline_asm_elementwise(
            # One line, no escape sequences: Inductor pastes a kernel's source into a
            # triple-quoted string of its generated module, where a newline escape here
            # became a line break inside this literal (a SyntaxError when compiled).
            # PTX ends each statement at its semicolon.
            "fence.acq_rel.gpu; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    return x


@triton.jit
def _merge_partials(
    Part, bh, num_bh, num_splits, R, offs_r, offs_dv, row_ok, tile_ok, HEAD_DV,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """(out, lse2) of rows ``offs_r`` of ``bh`` from its ``num_splits`` partials (layout
    in :func:`decode_split_kernel`), merged by log-sum-exp; lse2 in log2 units. Loads
    bypass L1 (``.cg``): in the fused merge the partials were written by other SMs."""
    lse_base = Part + num_bh.to(tl.int64) * num_splits * R * HEAD_DV
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for split in range(0, num_splits):
        prow = (bh.to(tl.int64) * num_splits + split) * R + offs_r
        lse_s = tl.load(lse_base + prow, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(Part + prow[:, None] * HEAD_DV + offs_dv[None, :], mask=tile_ok,
                      other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_s - m_safe)
        l_sum = l_sum * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o_s
        m = m_new
    has_key = l_sum != 0.0  # a NaN sum stays NaN (decode_split_kernel's epilogue)
    out = acc / tl.where(has_key, l_sum, 1.0)[:, None]
    lse2 = tl.where(has_key, m + tl.log2(tl.where(has_key, l_sum, 1.0)), float("-inf"))
    return out, lse2


@triton.jit
def _store_final(
    Out, Lse, out, lse2, bh, HKV, GROUP, NQ, R, offs_r, offs_dv, row_ok, tile_ok,
    stride_ob, stride_oh, stride_om, stride_od,
):  # fmt: skip
    """Rows ``offs_r`` of ``bh`` into Out (four strides, its dtype) and Lse (natural)."""
    b = bh // HKV
    hkv = bh % HKV
    g = offs_r // NQ
    i = offs_r % NQ
    o_ptrs = (
        Out
        + b.to(tl.int64) * stride_ob
        + (hkv * GROUP + g).to(tl.int64)[:, None] * stride_oh
        + i.to(tl.int64)[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=tile_ok)
    tl.store(Lse + bh.to(tl.int64) * R + offs_r, lse2 * LN2, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def decode_split_kernel(
    Q, K, V, SeqLens, BT, Part, Out, Lse, Counter, KeyMask,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kp, stride_kh, stride_kn, stride_kd,
    stride_vp, stride_vh, stride_vn, stride_vd,
    stride_btb, stride_mb, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    HKV, GROUP, NQ, HEAD_D, HEAD_DV, num_splits,
    win_left, win_right, qk_scale, sm_scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MASK_KIND: tl.constexpr = 0,
):  # fmt: skip
    """One (split, b * HKV + hkv, row block) program (module docstring).

    Rows r = g * NQ + i (R = GROUP * NQ of them) are query head hkv * GROUP + g, token i.
    ``win_right`` already holds the causal clamp; absent sides are UNBOUNDED.
    SPLIT: write the partial (out / l, m + log2 l) at
    ``Part[((bh * num_splits + split) * R + r) * HEAD_DV + d]`` and the lse part after
    all B * HKV * num_splits * R * HEAD_DV outputs; else the final Out (q's dtype,
    four strides) and Lse (float32, (B, HQ, NQ) contiguous: index bh * R + r).

    MASK_KIND (0 none): a key mask shared by every head and row of a sequence, key n of
    sequence b at ``KeyMask + b * stride_mb + n * stride_mn`` (stride_mb 0: one for all),
    1 bool (True = kept), 2 float (added to the scores after the softcap).

    FUSED_MERGE (with SPLIT): no merge launch. Each program, after storing its partial,
    counts itself in ``Counter[bh * row blocks + row block]`` (int32, zero before the
    launch); the last of the num_splits programs to arrive merges the partials and
    stores the final rows, then puts the counter back to zero for the next launch.
    The pattern of CUDA's threadFenceReduction sample: every thread fences its stores,
    the program synchronizes, one atomic (acq_rel, GPU scope) counts it in; the last
    program fences again and reads the partials past L1.
    """
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    R = GROUP * NQ
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < R
    g = offs_m // NQ
    i = offs_m % NQ

    L = tl.load(SeqLens + b).to(tl.int32)
    pos = L - NQ + i  # each row's key position (bottom-right alignment)
    b64 = b.to(tl.int64)
    q_ptrs = (
        Q
        + b64 * stride_qb
        + (hkv * GROUP + g).to(tl.int64)[:, None] * stride_qh
        + i.to(tl.int64)[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)

    # Key blocks the rows can keep: [lo, hi); blocks every row keeps whole: [f_lo, f_hi).
    if HAS_LEFT:
        lo_key = tl.maximum(L - NQ - win_left, 0)  # row 0 has the smallest position
        f_lo_key = tl.maximum(L - 1 - win_left, 0)  # row NQ - 1 the largest
    else:
        lo_key = L * 0
        f_lo_key = L * 0
    lo = lo_key // BLOCK_N
    hi = tl.cdiv(L, BLOCK_N)
    f_lo = tl.minimum(tl.maximum(tl.cdiv(f_lo_key, BLOCK_N), lo), hi)
    f_hi_key = tl.maximum(tl.minimum(L - NQ + win_right + 1, L), 0)
    f_hi = tl.minimum(tl.maximum(f_hi_key // BLOCK_N, f_lo), hi)
    # This split's run of blocks, [s0, s1), and its three segments.
    per = tl.cdiv(tl.maximum(hi - lo, 0), num_splits)
    s0 = tl.minimum(lo + split * per, hi)
    s1 = tl.minimum(s0 + per, hi)
    a1 = tl.minimum(tl.maximum(f_lo, s0), s1)
    a2 = tl.minimum(tl.maximum(f_hi, a1), s1)

    if PAGED:
        BT = BT + b64 * stride_btb
    KM = KeyMask + b64 * stride_mb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_LEFT:
        acc, l_i, m_i = _decode_segment(
            acc, l_i, m_i, q, K, V, BT, KM, s0, a1, b64, hkv, L, pos, offs_n0, offs_d, offs_dv,
            stride_kp, stride_kh, stride_kn, stride_kd, stride_vp, stride_vh, stride_vn, stride_vd,
            stride_mn, HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
            True, EVEN_D, HAS_LEFT, HAS_SOFTCAP, PAGED, PAGE_SIZE, BLOCK_N, INPUT_PRECISION,
            MASK_KIND,
        )  # fmt: skip
    acc, l_i, m_i = _decode_segment(
        acc, l_i, m_i, q, K, V, BT, KM, a1, a2, b64, hkv, L, pos, offs_n0, offs_d, offs_dv,
        stride_kp, stride_kh, stride_kn, stride_kd, stride_vp, stride_vh, stride_vn, stride_vd,
        stride_mn, HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
        False, EVEN_D, HAS_LEFT, HAS_SOFTCAP, PAGED, PAGE_SIZE, BLOCK_N, INPUT_PRECISION,
        MASK_KIND,
    )  # fmt: skip
    acc, l_i, m_i = _decode_segment(
        acc, l_i, m_i, q, K, V, BT, KM, a2, s1, b64, hkv, L, pos, offs_n0, offs_d, offs_dv,
        stride_kp, stride_kh, stride_kn, stride_kd, stride_vp, stride_vh, stride_vn, stride_vd,
        stride_mn, HEAD_D, HEAD_DV, win_left, win_right, qk_scale, sm_scale, softcap,
        True, EVEN_D, HAS_LEFT, HAS_SOFTCAP, PAGED, PAGE_SIZE, BLOCK_N, INPUT_PRECISION,
        MASK_KIND,
    )  # fmt: skip

    # "!= 0", not "> 0": a NaN sum (a NaN query or key) must give a NaN lse, as the
    # contract's NaN-in, NaN-out asks; only a row without keys sums to exactly 0.
    has_key = l_i != 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]  # rows without a key: acc is 0
    lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    dv_ok = offs_dv[None, :] < HEAD_DV
    tile_ok = row_ok[:, None] & dv_ok
    if SPLIT:
        prow = (bh.to(tl.int64) * num_splits + split) * R + offs_m
        tl.store(Part + prow[:, None] * HEAD_DV + offs_dv[None, :], out, mask=tile_ok)
        lse_base = Part + tl.num_programs(1).to(tl.int64) * num_splits * R * HEAD_DV
        tl.store(lse_base + prow, lse2, mask=row_ok)
        if FUSED_MERGE:
            num_splits = _fence(num_splits)
            tl.debug_barrier()
            count = Counter + bh.to(tl.int64) * tl.num_programs(2) + tl.program_id(2)
            arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                num_splits = _fence(num_splits)
                out, lse2 = _merge_partials(
                    Part, bh, tl.num_programs(1), num_splits, R, offs_m, offs_dv, row_ok,
                    tile_ok, HEAD_DV, BLOCK_M, BLOCK_DV,
                )  # fmt: skip
                _store_final(
                    Out, Lse, out, lse2, bh, HKV, GROUP, NQ, R, offs_m, offs_dv, row_ok,
                    tile_ok, stride_ob, stride_oh, stride_om, stride_od,
                )  # fmt: skip
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
    else:
        _store_final(
            Out, Lse, out, lse2, bh, HKV, GROUP, NQ, R, offs_m, offs_dv, row_ok, tile_ok,
            stride_ob, stride_oh, stride_om, stride_od,
        )  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge_kernel(
    Part, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_od,
    HKV, GROUP, NQ, HEAD_DV, num_splits,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Merge the partials of rows pid0 * BLOCK_R .. + BLOCK_R - 1 of ``bh`` = pid1 by
    log-sum-exp (layout in :func:`decode_split_kernel`), into Out and Lse (natural)."""
    bh = tl.program_id(1)
    R = GROUP * NQ
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_r < R
    tile_ok = row_ok[:, None] & (offs_dv[None, :] < HEAD_DV)
    out, lse2 = _merge_partials(
        Part, bh, tl.num_programs(1), num_splits, R, offs_r, offs_dv, row_ok, tile_ok,
        HEAD_DV, BLOCK_R, BLOCK_DV,
    )  # fmt: skip
    _store_final(
        Out, Lse, out, lse2, bh, HKV, GROUP, NQ, R, offs_r, offs_dv, row_ok, tile_ok,
        stride_ob, stride_oh, stride_om, stride_od,
    )  # fmt: skip


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of one decode call. ``num_splits`` None: the heuristic
    (:func:`num_splits_for`). ``fused_merge``: with more than one split, the last
    program of each row block merges (FUSED_MERGE in :func:`decode_split_kernel`)
    instead of a second launch (default_config says where it is the default)."""

    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int | None = None
    fused_merge: bool = False


# Interpreter: 16-key tiles, so CPU tests with caches of a few dozen keys cross several
# tiles, splits and (16- and 32-key) pages. num_warps/stages mean nothing there.
INTERPRETER_CONFIG = DecodeConfig(16, 4, 1)


def default_config(head_dim: int, element_size: int, page_size: int | None) -> DecodeConfig:
    """First choices for sm_90, from compiling for it without a GPU (Triton's AOT path:
    registers, spills, shared memory, the pipeliner's buffers); not yet timed
    (`attnhub bench --decode`'s sweep times the alternatives on the H200).

    The split kernel is bandwidth-bound: per step a (BLOCK_N, D) K tile and V tile,
    loaded through cp.async into num_stages - 1 shared buffers on a contiguous cache
    (bf16 D=128, (64, 4 warps, 3 stages): two 32 KiB buffers, 70 KiB of shared memory,
    94 registers, three programs per SM). On a paged cache the tile's page number is a
    load the K/V addresses depend on; the pipeliner gives it a stage of its own and
    keeps one K/V buffer fewer per stage than the stages left: 3 stages gave one buffer
    (38 KiB), 5 give two, so paged launches take two stages more for the same depth.
    float32 products run on FMA units with whole operand tiles in registers: at 4 warps
    D=128 (32-key tiles) spilled (255 registers, spills in the loop); 8 warps take 56."""
    if interpreting():
        return INTERPRETER_CONFIG
    if element_size >= 4:
        cfg = DecodeConfig(64 if head_dim <= 64 else 32, 8, 2)
    elif head_dim <= 64:
        cfg = DecodeConfig(128, 4, 3)
    elif head_dim <= 128:
        cfg = DecodeConfig(64, 4, 3)
    else:  # D=256: (32, 4, 2) takes 146 registers, 42 KiB, no spills
        cfg = DecodeConfig(32, 4, 2)
    if page_size:
        cfg = DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages + 2)
    if element_size < 4 and head_dim <= 128:
        # The merge fused into the split kernel: one launch a call instead of two, which
        # a model's decoding step pays on the host (a few microseconds of a call's
        # 20-30, where decoding is host-bound); on the GPU 1.00-1.02x the two launches
        # on the H200 (decode-h200.md, its _fused rows), bitwise their answer
        # (test_gpu_fused_merge). Half precision up to D=128 only: there it takes
        # 147-160 registers, and shared memory keeps three programs per SM either way.
        cfg = DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages, None, True)
    return cfg


# Split heuristic (FlashAttention-2's num_splits_heuristic, with programs per SM): the
# programs of one launch do near-equal work, so they finish in waves of
# SMs * PROGRAMS_PER_SM (the default configurations fit three per SM on sm_90: at most
# 75 KiB of shared memory and 170 registers at 4 warps, from the AOT compile in
# default_config's docstring); a last wave that fills a third of the slots leaves two
# thirds of the SMs' load slots idle. The heuristic takes the fewest splits whose wave
# efficiency (waves / whole waves) is within 15% of the best, each split walking at
# least MIN_BLOCKS_PER_SPLIT tiles (fewer makes the merge and each program's start a
# large share), at most MAX_SPLITS (the merge reads S partials per row).
PROGRAMS_PER_SM = 3
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 64


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that CPU tests exercise the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_for(programs: int, capacity_blocks: int, sms: int) -> int:
    """Splits per (sequence, kv head, row block): ``programs`` = B * Hkv * row blocks,
    ``capacity_blocks`` = key tiles in the cache's capacity (the host cannot read the
    lengths without a device sync; the kernel shares each sequence's true length out
    over the splits, so a cache longer than its sequences costs nothing but shorter
    runs per split)."""
    if interpreting():
        # No waves on a CPU: up to 4 splits of a tile or more, so that CPU tests with
        # caches of a few tiles run the merge (and splits with no keys).
        return max(1, min(4, capacity_blocks))
    most = max(1, min(MAX_SPLITS, capacity_blocks // MIN_BLOCKS_PER_SPLIT))
    slots = sms * PROGRAMS_PER_SM
    programs = max(programs, 1)
    efficiency = []
    for splits in range(1, most + 1):
        waves = programs * splits / slots
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, 1) if e >= 0.85 * best)


def _input_precision(dtype: torch.dtype) -> str:
    # float32 follows PyTorch's matmul precision ("highest": IEEE products), as
    # triton_flash's other kernels do; half precision multiplies exactly either way.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


@dataclass(frozen=True)
class _Plan:
    grid: tuple[int, int, int]
    merge_grid: tuple[int, int]
    num_splits: int
    split_meta: dict
    merge_meta: dict
    part_numel: int
    counters: int  # FUSED_MERGE's arrival counters (0: no fused merge)


@functools.lru_cache(maxsize=256)
def _plan(
    device: torch.device,
    b: int,
    hkv: int,
    group: int,
    nq: int,
    d: int,
    dv: int,
    capacity: int,
    page_size: int,
    has_left: bool,
    has_softcap: bool,
    element_size: int,
    precision: str,
    config: DecodeConfig | None,
    mask_kind: int = 0,
) -> _Plan:
    """Everything of a launch but its tensors and scalars, per call signature (the host
    path pays one cache lookup). ``page_size`` 0: contiguous cache."""
    cfg = config or default_config(max(d, dv), element_size, page_size or None)
    rows = group * nq
    block_m = max(16, min(_next_power_of_2(rows), 64))  # tl.dot needs M >= 16
    row_blocks = _cdiv(rows, block_m)
    splits = cfg.num_splits or num_splits_for(
        b * hkv * row_blocks, _cdiv(capacity, cfg.block_n), _sm_count(device)
    )
    block_d = _next_power_of_2(max(d, 16))
    block_dv = _next_power_of_2(max(dv, 16))
    split_meta = {
        "BLOCK_M": block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
        "EVEN_D": d == block_d and dv == block_dv,
        "HAS_LEFT": has_left,
        "HAS_SOFTCAP": has_softcap,
        "PAGED": page_size > 0,
        "PAGE_SIZE": max(page_size, 1),
        "SPLIT": splits > 1,
        "INPUT_PRECISION": precision,
        "FUSED_MERGE": splits > 1 and cfg.fused_merge,
        "MASK_KIND": mask_kind,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    block_r = min(_next_power_of_2(rows), 16)
    merge_meta = {"BLOCK_R": block_r, "BLOCK_DV": block_dv, "num_warps": 4, "num_stages": 1}
    return _Plan(
        grid=(splits, b * hkv, row_blocks),
        merge_grid=(_cdiv(rows, block_r), b * hkv),
        num_splits=splits,
        split_meta=split_meta,
        merge_meta=merge_meta,
        part_numel=b * hkv * splits * rows * (dv + 1) if splits > 1 else 0,
        counters=b * hkv * row_blocks if splits > 1 and cfg.fused_merge else 0,
    )


# Triton's interpreter patches triton.language while a kernel runs: two threads
# interpreting at once break each other (ops._INTERPRETER_LOCK has the story). Interpreted
# launches here take turns too (_Serialized); GPU launches do not lock.
_INTERPRETER_LOCK = threading.Lock()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    scale: float | None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    causal: bool = True,
    key_mask: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache, each sequence against its own length.

    q             (B, Hq, Nq, D), Nq small (1..16); any strides.
    k_cache       contiguous (B, Hkv, Nmax, Dk) or, with ``block_table``, paged
    v_cache       (num_pages, page_size, Hkv, D); any strides, last one need not be 1.
                  v may have its own head dim Dv.
    cache_seqlens (B,) int32 or int64 on q's device: L_b keys of sequence b are valid
                  (0 <= L_b <= Nmax, or <= max_pages * page_size; not checked here:
                  the API layer validates).
    block_table   None, or (B, max_pages) int32: page ``block_table[b, j // page_size]``
                  holds key j of sequence b. page_size a power of two.
    scale         the score scale (None: 1 / sqrt(D)).
    window        None or (left, right), None sides unbounded; right only matters
                  without ``causal``.
    softcap       None or c > 0: scores c * tanh(s / c).
    causal        (keyword, default True) bottom-right causal: row i of sequence b
                  keeps keys j <= L_b - Nq + i. False: every row keeps keys < L_b
                  (within the window about position L_b - Nq + i, if any).
    key_mask      None, or (1 or B, Nk or 1), or the same as (1 or B, 1, 1, Nk or 1):
                  bool (True = kept) or float (added to the scores after the softcap)
                  on q's device, any strides: key j of sequence b is masked by
                  ``key_mask[b, j]`` (``key_mask[b, 0, 0, j]``) for every head and row
                  (a padded batch's key padding), besides the lengths, causal and
                  window; Nk covers the keys the lengths reach (not checked here).
                  The keys it masks are not read (their K and V rows).
    config        launch choices (benchmarks and tests); None: the defaults.

    Returns out (B, Hq, Nq, Dv) in q's dtype, and with ``return_lse`` also lse
    (B, Hq, Nq) float32, natural log. A row with no key: zeros and lse -inf.
    """
    # The kernel reads the lengths and each table row as packed int vectors: strided
    # ones (a column slice of a larger table) are packed first (B or B * pages ints).
    if cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    if block_table is not None and block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if not _direct(q, k_cache, v_cache, cache_seqlens, block_table, key_mask):
        # Traced (torch.compile, export, fake tensors, dispatch/function modes): the
        # registered op, whose kernels Inductor sees through wrap_triton.
        out, lse = triton_decode(
            q, k_cache, v_cache, cache_seqlens, block_table, key_mask,
            *_op_options(q, scale, window, softcap, causal, config),
        )  # fmt: skip
        return (out, lse) if return_lse else out
    key = None
    if USE_PLANS and q.is_cuda:
        tensors = (q, k_cache, v_cache, cache_seqlens, block_table, key_mask)
        options = (scale, window, softcap, causal, config)
        last = _last_plan
        if last is not None and last.serves(*tensors, options):
            return last.plan(*tensors, return_lse)
        key = _plan_key(*tensors, *options)
        cached = _PLANS.get(key)
        if cached is not None:
            _remember_last(*tensors, options, cached)
            return cached(*tensors, return_lse)
    out, lse = _run(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, scale, window,
                    softcap, causal, config, key, False)  # fmt: skip
    return (out, lse) if return_lse else out


def _run(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    causal: bool,
    config: DecodeConfig | None,
    key: tuple | None,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of :func:`decode_attention` by the full path: choose the launch,
    allocate, launch (``traced``: through :func:`_launcher`, as the registered op does;
    else the kernels themselves), and record the plan under ``key`` if one is given."""
    b, hq, nq, d = q.shape
    paged = block_table is not None
    if paged:
        _, page_size, hkv, dk = k_cache.shape
        capacity = block_table.shape[1] * page_size  # type: ignore[union-attr]
        assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
        assert block_table.dtype == torch.int32, "block_table must be int32"  # type: ignore[union-attr]
        assert block_table.shape[0] == b, "block_table must have B rows"  # type: ignore[union-attr]
    else:
        page_size = 0
        _, hkv, capacity, dk = k_cache.shape
        assert k_cache.shape[0] == b, "k_cache must have B sequences"
    dv = v_cache.shape[-1]
    assert dk == d and hq % hkv == 0 and cache_seqlens.shape == (b,), "shapes"
    assert q.device == k_cache.device == v_cache.device == cache_seqlens.device, "devices"
    out = torch.empty((b, hq, nq, dv), device=q.device, dtype=q.dtype)
    lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    if b * hq * nq == 0 or capacity == 0 or d == 0:
        if out.numel():
            out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    if scale is None:
        scale = 1.0 / math.sqrt(d)
    left, right = window if window is not None else (None, None)
    has_left = left is not None and left < UNBOUNDED
    win_left = min(left, UNBOUNDED) if left is not None else UNBOUNDED
    win_right = min(right, UNBOUNDED) if right is not None else UNBOUNDED
    if causal:
        win_right = min(win_right, 0)
    has_softcap = softcap is not None
    km, km_strides, mask_kind = _key_mask_view(key_mask, q)
    plan = _plan(
        q.device, b, hkv, hq // hkv, nq, d, dv, capacity, page_size, has_left, has_softcap,
        q.element_size(), _input_precision(q.dtype), config, mask_kind,
    )  # fmt: skip
    splits = plan.num_splits
    part = torch.empty(plan.part_numel, device=q.device, dtype=torch.float32) if splits > 1 else out
    bt = block_table if paged else cache_seqlens
    counter = lse
    if plan.counters:
        # A traced call's counters are its own (never a kept buffer of fake tensors).
        counter = _counters(None if traced else _scratch(q.device), q.device, plan.counters)
    args = (
        q, k_cache, v_cache, cache_seqlens, bt, part, out, lse, counter, km,
        *_input_strides(q, k_cache, v_cache, block_table, km_strides), *out.stride(),
        hkv, hq // hkv, nq, d, dv, splits, win_left, win_right,
        scale * 1.4426950408889634, scale, softcap if has_softcap else 1.0,
    )  # fmt: skip
    merge_args = (part, out, lse, *out.stride(), hkv, hq // hkv, nq, dv, splits)
    merge = splits > 1 and not plan.counters
    if traced or interpreting():
        _launcher(decode_split_kernel, q)[plan.grid](*args, **plan.split_meta)
        if merge:
            _launcher(decode_merge_kernel, q)[plan.merge_grid](*merge_args, **plan.merge_meta)
        return out, lse
    compiled = decode_split_kernel[plan.grid](*args, **plan.split_meta)
    launches: list[tuple] = [(decode_split_kernel, compiled, plan.grid, args, plan.split_meta, 10)]
    if merge:
        compiled = decode_merge_kernel[plan.merge_grid](*merge_args, **plan.merge_meta)
        launches.append((decode_merge_kernel, compiled, plan.merge_grid, merge_args,
                         plan.merge_meta, 3))  # fmt: skip
    if key is not None:
        _remember(key, _CallPlan(out, lse, plan.part_numel, plan.counters, launches))
    return out, lse


def _input_strides(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor | None,
    mask_strides: tuple[int, int],
) -> tuple[int, ...]:
    """The split kernel's stride arguments before the output's, in its order: q's four,
    the cache's (stride_kp, stride_kh, stride_kn, stride_kd) and the values', the table's
    row stride (0 without one) and the key mask's two."""
    if table is None:  # (B, Hkv, Nmax, D)
        kp, kh, kn, kd = k.stride()
        vp, vh, vn, vd = v.stride()
        bt_stride = 0
    else:  # (num_pages, page_size, Hkv, D)
        kp, kn, kh, kd = k.stride()
        vp, vn, vh, vd = v.stride()
        bt_stride = table.stride(0)
    return (*q.stride(), kp, kh, kn, kd, vp, vh, vn, vd, bt_stride, *mask_strides)


def _key_mask_view(key_mask: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int], int]:  # fmt: skip
    """(the tensor the kernel reads as KeyMask, (stride_mb, stride_mn), MASK_KIND); q
    stands in, never read, without a mask."""
    if key_mask is None:
        return q, (0, 0), 0
    # A dim of one broadcasts (a mask shared by the batch, or by every key). A 4-D mask
    # (1 or B, 1, 1, Nk) is read through its first and last dims (no view is made).
    shape, stride = key_mask.shape, key_mask.stride()
    if len(shape) == 4 and (shape[1] != 1 or shape[2] != 1):
        raise ValueError(f"key_mask: a 4-D key mask is (1 or B, 1, 1, Nk), got {tuple(shape)}")
    strides = tuple(0 if shape[d] == 1 else stride[d] for d in (0, -1))
    # A bool mask goes as it is (Triton reads it as int1): a uint8 view of it is an
    # op that Inductor cannot lower (aten.view.dtype of bool) in a compiled call.
    return key_mask, strides, 1 if key_mask.dtype == torch.bool else 2


# Whether a call on these tensors runs the kernels itself (plain tensors in plain eager
# mode) rather than through the registered op (ops.direct's rule).
_direct = plain_eager


def _noop_launch(*args: Any, **kwargs: Any) -> None:
    return None


class _NoLaunch:
    def __getitem__(self, grid: Any) -> Any:
        return _noop_launch


class _Serialized:
    """An interpreted kernel whose launches take _INTERPRETER_LOCK."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def locked(*args: Any, **kwargs: Any) -> Any:
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)

        return locked


def _launcher(kernel: Any, like: torch.Tensor) -> Any:
    """``kernel[grid]`` as the registered op launches it (ops._launcher's rule): on the
    GPU through wrap_triton (traceable, a no-op on fake tensors); interpreted kernels
    cannot be traced, so there they run directly, one launch at a time, and not at all
    on fake tensors (a fake implementation only allocates the outputs)."""
    if interpreting():
        from torch._subclasses.fake_tensor import is_fake

        return _NoLaunch() if is_fake(like) else _Serialized(kernel)
    from torch.library import wrap_triton

    return wrap_triton(kernel)


def _op_options(
    q: torch.Tensor,
    scale: float | None,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    causal: bool,
    config: DecodeConfig | None,
) -> tuple:
    """The options as the op's schema takes them: window sides -1 = absent, softcap 0 =
    none, config fields (block_n 0 = the default launch, num_splits 0 = the heuristic)."""
    left, right = window if window is not None else (None, None)
    cfg = config or DecodeConfig(0, 0, 0)
    return (
        float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])),
        -1 if left is None else int(left), -1 if right is None else int(right),
        float(softcap or 0.0), bool(causal), cfg.block_n, cfg.num_warps, cfg.num_stages,
        cfg.num_splits or 0, cfg.fused_merge,
    )  # fmt: skip


def _op_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    causal: bool,
    block_n: int,
    num_warps: int,
    num_stages: int,
    num_splits: int,
    fused_merge: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attnhub::triton_decode``: (out, lse) of :func:`decode_attention`, options
    encoded as :func:`_op_options` does."""
    window = None
    if window_left != -1 or window_right != -1:
        window = (None if window_left == -1 else window_left,
                  None if window_right == -1 else window_right)  # fmt: skip
    config = None
    if block_n:
        config = DecodeConfig(block_n, num_warps, num_stages, num_splits or None, fused_merge)
    return _run(q, k_cache, v_cache, cache_seqlens, block_table, key_mask, scale, window,
                softcap or None, causal, config, None, True)  # fmt: skip


def _define(name: str, impl: Any) -> Any:
    """``impl`` as the op ``name`` (ops._define's rule): a ``triton_op`` on the GPU, which
    torch.compile traces through to the wrapped kernels; under the interpreter an opaque
    ``custom_op`` whose fake implementation is ``impl`` (launches skipped on fakes)."""
    if interpreting():
        op = torch.library.custom_op(name, mutates_args=())(impl)
        op.register_fake(impl)
        return op
    from torch.library import triton_op

    return triton_op(name, mutates_args={})(impl)


triton_decode = _define("attnhub::triton_decode", _op_impl)


# Buffers a launch writes and reads within itself, or with the merge launch right after
# it, kept per (device, stream) so that launches on two streams at once never share one
# (stream order keeps the next launch on a stream from touching them before the last is
# done): FUSED_MERGE's arrival counters (int32 zeros that each launch leaves at zero: the
# merging program resets its counter), and for cached plans the splits' partials and
# the lse of a call that does not return it (two allocations a call fewer: each is
# several microseconds of a decoding step's host time). Partials larger than
# _MAX_SCRATCH floats are allocated per call (a persistent buffer is memory that
# empty_cache cannot give back). Inside CUDA-graph capture every buffer is the call's
# own (a fresh zeroed counter buffer's memset is captured with the kernel): a buffer
# kept for the capture stream would be zeroed only when the graph first replays, and a
# graph may replay on another stream beside eager calls.
_MAX_SCRATCH = 1 << 22


class _Scratch:
    __slots__ = ("counters", "lse", "partials")

    def __init__(self, device: torch.device) -> None:
        self.counters = torch.zeros(1024, dtype=torch.int32, device=device)
        self.partials = self.lse = torch.empty(0, dtype=torch.float32, device=device)

    def take_counters(self, n: int) -> torch.Tensor:
        if self.counters.numel() < n:
            self.counters = torch.zeros(n, dtype=torch.int32, device=self.counters.device)
        return self.counters

    def take_partials(self, n: int) -> torch.Tensor:
        if self.partials.numel() < n:
            self.partials = torch.empty(n, dtype=torch.float32, device=self.partials.device)
        return self.partials

    def take_lse(self, n: int) -> torch.Tensor:
        if self.lse.numel() < n:
            self.lse = torch.empty(n, dtype=torch.float32, device=self.lse.device)
        return self.lse


_SCRATCH: dict[tuple, _Scratch] = {}


def _scratch(device: torch.device) -> _Scratch | None:
    """The device's current stream's buffers; None while a CUDA graph is captured."""
    if device.type == "cuda":
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        key: tuple = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    else:
        key = (device.type, 0)
    scratch = _SCRATCH.get(key)
    if scratch is None:
        scratch = _SCRATCH[key] = _Scratch(device)
    return scratch


def _counters(scratch: _Scratch | None, device: torch.device, n: int) -> torch.Tensor:
    """n arrival counters at zero: ``scratch``'s, or the call's own without one."""
    if scratch is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    return scratch.take_counters(n)


# Cached launch plans (issue 17, item 3: decode runs once per layer and token, so the
# host path is most of a small call). An eager call on CUDA tensors is keyed by
# everything that decides its launches except the tensors' addresses and the values
# the plan takes per call: shapes, dtypes, each tensor's 16-byte alignment (Triton
# specializes pointers on it), q's strides, the options, the devices and fp32's matmul
# precision. A contiguous cache's length enters only by its bucket (_length_bucket): it
# decides the split count and nothing else of the launch, so a model's next decoding
# step, whose cache is one key longer (new strides too), takes the plan instead of
# Triton's binder. The cache's, the values' and the key mask's strides go to the kernel
# per call (CachedLaunch.with_leading); the key holds how Triton specialized each (is
# it 1, a multiple of 16, 64-bit: _specialized), which a new value must match. The first
# call of a key takes the full path (Triton's binder, which compiles or finds the
# kernels) and records the compiled kernels with their grids and other arguments
# (launch.CachedLaunch, as ops._PLANS does for the other kernels); later calls allocate
# the outputs and launch those. The table is cleared when it reaches _MAX_PLANS keys.
# USE_PLANS = False: every call takes the full path (A/B runs: `attnhub bench
# --decode`'s host section).
USE_PLANS = True
_PLANS: dict[tuple, Any] = {}
_MAX_PLANS = 1024


def _specialized(value: int) -> tuple[bool, bool, bool]:
    """How Triton 3.6 specializes an int argument: whether it is 1 (a constant), a
    multiple of 16 (a divisibility hint) and outside int32 (an i64 parameter)."""
    return value == 1, value % 16 == 0, not -(2**31) <= value < 2**31


def _stride_classes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple:
    """How Triton specializes the cache's, the values' and the key mask's strides (the
    plan launches with the call's own: CachedLaunch.with_leading), and whether the mask
    has one key: what a plan key holds of the values that change with a contiguous
    cache's length, besides its bucket."""
    classes = (*map(_specialized, k.stride()), *map(_specialized, v.stride()))
    if key_mask is None:
        return classes
    _, mask_strides, _ = _key_mask_view(key_mask, q)
    return (*classes, *map(_specialized, mask_strides), key_mask.shape[-1] == 1)


def _length_bucket(n: int) -> tuple[int, int]:
    """A cache length's bucket: its power of two and the eighth of it (lengths 16 and
    up; exact below): the split count chosen for one length serves the bucket, at most
    an eighth off the length it was chosen for (any split count is exact: the kernel
    shares each sequence's own length out over the splits)."""
    top = n.bit_length()
    return top, n >> max(top - 4, 0)


def _plan_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor,
    table: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    *options: Any,
) -> tuple:
    if table is None:  # (B, Hkv, Nmax, D): Nmax by its bucket; v's Nmax is never read
        b, hkv, capacity, d = k.shape
        k_shape: tuple = (b, hkv, _length_bucket(capacity), d)
        v_shape: tuple = (v.shape[0], v.shape[1], v.shape[3])
        table_key = None
    else:
        k_shape, v_shape = k.shape, v.shape
        table_key = (table.shape, table.stride(), table.dtype, table.data_ptr() % 16 == 0,
                     table.get_device())  # fmt: skip
    mask_key = None
    if key_mask is not None:
        mask_key = (key_mask.dim(), key_mask.shape[0], key_mask.dtype,
                    key_mask.data_ptr() % 16 == 0, key_mask.get_device())  # fmt: skip
    return (
        q.shape, q.stride(), k_shape, v_shape, _stride_classes(q, k, v, key_mask),
        seqlens.shape, table_key, mask_key,
        q.dtype, k.dtype, v.dtype, seqlens.dtype, q.data_ptr() % 16 == 0,
        k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0, seqlens.data_ptr() % 16 == 0,
        options, torch._C._cuda_getDevice(), q.get_device(), k.get_device(),
        v.get_device(), seqlens.get_device(),
        q.dtype == torch.float32 and torch.get_float32_matmul_precision(),
    )  # fmt: skip


class _LastPlan:
    """The plan the last call found under its key, with what decided that key: its
    tensors' metadata (tensor_guards.Guards, one C call), the options, the current
    device and fp32's matmul precision; kept only for calls whose tensors are all
    16-byte aligned (one test of their addresses ORed together). A call that matches
    all of it has that key, and skips _plan_key and its dict: a decoding step's later
    layers repeat its first layer's call, and the next step's first layer has a cache
    one key longer.

    For a contiguous cache the guards leave out its length and the strides of the
    cache, the values and the key mask (which change with the length), and check the
    rest exactly; what the key holds of those (the length's bucket, the strides'
    classes: _stride_classes) is compared here, only when they differ from the last
    call's (``seen``). A paged call's guards check everything exactly."""

    __slots__ = (
        "current", "free", "guards", "no_mask", "no_table", "options", "plan", "precision",
        "seen",
    )  # fmt: skip

    def __init__(self, guards: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 table: Any, key_mask: Any, options: tuple, plan: Any) -> None:  # fmt: skip
        self.guards, self.options, self.plan = guards, options, plan
        self.no_table, self.no_mask = table is None, key_mask is None
        self.current = torch._C._cuda_getDevice()
        self.precision = _fp32_precision(q)
        self.free = _length_classes(q, k, v, key_mask) if table is None else None
        self.seen = _length_values(k, v, key_mask)

    def serves(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens: torch.Tensor,
        table: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        options: tuple,
    ) -> bool:
        if (table is None) is not self.no_table or (key_mask is None) is not self.no_mask:
            return False
        extra = [t for t in (table, key_mask) if t is not None]
        if not (
            self.options == options
            and self.guards.check(q, k, v, seqlens, *extra)
            and _all_aligned(q, k, v, seqlens, *extra)
            and self.current == torch._C._cuda_getDevice()
            and self.precision == _fp32_precision(q)
        ):
            return False
        if self.free is not None:
            seen = _length_values(k, v, key_mask)
            if seen != self.seen:
                if _length_classes(q, k, v, key_mask) != self.free:
                    return False
                self.seen = seen
        return True


def _length_values(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> tuple:
    """What a contiguous cache's length changes: its length, the key mask's, and the
    strides of the cache, the values and the key mask (_LastPlan's guards leave them out)."""
    if key_mask is None:
        return (k.shape[2], k.stride(), v.stride())
    return (k.shape[2], k.stride(), v.stride(), key_mask.shape[-1], key_mask.stride())


def _length_classes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple:
    """What _plan_key holds of _length_values: the length's bucket, the strides' classes."""
    return (_length_bucket(k.shape[2]), _stride_classes(q, k, v, key_mask))


# Of a contiguous-cache call's tensors (q, k, v, seqlens, key_mask), the dims _LastPlan's
# guards leave out: the cache's and the values' length and strides, the key mask's key
# dim and strides (Guards.make's ``free``).
_CONTIGUOUS_FREE = (None, ((2,), (0, 1, 2, 3)), ((2,), (0, 1, 2, 3)), None)


def _all_aligned(*tensors: torch.Tensor) -> bool:
    address = 0
    for t in tensors:
        address |= t.data_ptr()
    return address % 16 == 0


def _fp32_precision(q: torch.Tensor) -> Any:
    return q.dtype == torch.float32 and torch.get_float32_matmul_precision()


_last_plan: _LastPlan | None = None


def _remember_last(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: torch.Tensor,
    table: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    options: tuple,
    plan: Any,
) -> None:
    """Make ``plan`` the one _LastPlan serves, where the call's tensors are all 16-byte
    aligned and can be guarded (plain tensors, none passed twice: Guards.make)."""
    global _last_plan
    tensors = tuple(t for t in (q, k, v, seqlens, table, key_mask) if t is not None)
    free = None
    if table is None:
        mask_free = (
            None if key_mask is None else ((key_mask.dim() - 1,), tuple(range(key_mask.dim())))
        )
        free = (*_CONTIGUOUS_FREE, mask_free)
    guards = Guards.make(tensors, free) if _all_aligned(*tensors) else None
    _last_plan = (
        None if guards is None else _LastPlan(guards, q, k, v, table, key_mask, options, plan)
    )


def _remember(key: tuple, plan: Any) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


class _CallPlan:
    """One call signature's outputs and cached launches (see _PLANS)."""

    __slots__ = (
        "counters", "device", "dtype", "lse_numel", "lse_shape", "merge", "out_shape",
        "part_numel", "split",
    )  # fmt: skip

    def __init__(
        self, out: torch.Tensor, lse: torch.Tensor, part_numel: int, counters: int, launches: list
    ):
        from triton.compiler import CompiledKernel

        from .launch import CachedLaunch

        self.out_shape, self.lse_shape, self.dtype, self.device = (
            out.shape, lse.shape, out.dtype, out.device,
        )  # fmt: skip
        self.lse_numel = lse.numel()
        self.part_numel, self.counters = part_numel, counters
        cached: list[Any] = [
            CachedLaunch(kernel, compiled, grid, args, meta, tensors)
            if isinstance(compiled, CompiledKernel)
            else None
            for kernel, compiled, grid, args, meta, tensors in launches
        ]
        if any(c is None for c in cached):
            raise RuntimeError("no compiled kernel came back from the launch")
        self.split: Any = cached[0]
        self.merge: Any = cached[1] if len(cached) > 1 else None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seqlens: torch.Tensor,
        table: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(self.out_shape, device=self.device, dtype=self.dtype)
        scratch = _scratch(self.device)
        if return_lse or scratch is None:
            lse = torch.empty(self.lse_shape, device=self.device, dtype=torch.float32)
        else:  # written, never read: the kernel takes it flat
            lse = scratch.take_lse(self.lse_numel)
        bt = seqlens if table is None else table
        km, mask_strides, _ = _key_mask_view(key_mask, q)
        strides = _input_strides(q, k, v, table, mask_strides)
        split = self.split.with_leading
        if not self.part_numel:
            split(strides, q, k, v, seqlens, bt, out, out, lse, lse, km)
            return (out, lse) if return_lse else out
        if scratch is None or self.part_numel > _MAX_SCRATCH:
            part = torch.empty(self.part_numel, device=self.device, dtype=torch.float32)
        else:
            part = scratch.take_partials(self.part_numel)
        if self.counters:
            counter = _counters(scratch, self.device, self.counters)
            split(strides, q, k, v, seqlens, bt, part, out, lse, counter, km)
        else:
            split(strides, q, k, v, seqlens, bt, part, out, lse, lse, km)
            self.merge(part, out, lse)
        return (out, lse) if return_lse else out
