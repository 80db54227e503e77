"""Block-sparse FlashAttention forward and backward: triton_flash's kernels, visiting
only the kept blocks of a :class:`attnhub.BlockSparseLayout`.

Read ``backends/triton_flash/kernels.py`` first: its glossary (band, offset, segments,
delta, dropout stream, program ids, constexpr knobs) holds here unchanged. This module
adds only the walk over the layout's compressed block lists and the token masks of
partial blocks; the score pipeline (``_scores``: scale, softcap, attn_mask, band and
bounds masks), the tile loads, the band arithmetic (``_key_ranges``/``_query_ranges``)
and the inner loops for full blocks (``_fwd_inner``, ``_bwd_q_inner``,
``_bwd_kv_inner``, run over exactly one block) are triton_flash's own.

Tiles
-----
BLOCK_M == bq and BLOCK_N == bk, the layout's block size: one program owns one query
block (forward, dQ) or one key block (dK/dV) of the layout.

Block lists (int32, from ``layout.index``; read through (batch, head) strides that are
0 where the layout broadcasts)
FullNum, FullIdx      per row block the full column blocks: no token mask. Inside the
                      call's band and inside NQ/NK they run with MASKED=False (no mask
                      arithmetic at all); on a band edge or the ragged tail, MASKED=True.
PartNum, PartIdx      per row block the partial column blocks, always MASKED=True plus
                      the block's token mask.
PartTile              for each entry of PartIdx, the tile number in Tiles.
Tiles                 uint8 (P, BLOCK_M, BLOCK_N): the token masks of the P partial blocks
                      (1 = keep), local coordinates (query row, key) within the block.
Blocks wholly outside the call's band (causal/window) are skipped without a load.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnhub.backends.triton_flash.kernels import (
    _DYNAMIC,
    _bwd_kv_inner,
    _bwd_q_inner,
    _fwd_inner,
    _key_ranges,
    _load_lse2,
    _load_rows,
    _query_ranges,
    _scores,
)


@triton.jit
def _fwd_partial(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, tile_ptrs, mask_rows, drop_rows, seed,
    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One partial key block: ``_fwd_inner``'s step with the block's token mask."""
    offs_n = start_n + offs_n0
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, True, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, _t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_rows, stride_mn, qk_scale, sm_scale, softcap,
        True, HAS_BAND, HAS_SOFTCAP, MASK_KIND, True,
    )  # fmt: skip
    s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        rnd = tl.rand(seed, drop_rows[:, None] + offs_n[None, :])
        p = tl.where(rnd >= dropout_p, p, 0.0)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, True, not EVEN_D)
    acc += tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_DYNAMIC)
def bs_fwd_kernel(
    Q, K, V, Mask, Seed, Out, Lse,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_PARTIAL: tl.constexpr,
):  # fmt: skip
    """Out and Lse for one query block, visiting only its kept key blocks."""
    qb = tl.program_id(0)
    start_m = qb * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = (
        Q + b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )  # fmt: skip
    q = _load_rows(q_ptrs, offs_m, NQ, offs_d, HEAD_D, True, not EVEN_D)
    k_base = (
        K
        + b * stride_kb
        + hk * stride_kh
        + offs_n0[:, None] * stride_kn
        + offs_d[None, :] * stride_kd
    )
    v_base = (
        V
        + b * stride_vb
        + hk * stride_vh
        + offs_n0[:, None] * stride_vn
        + offs_dv[None, :] * stride_vd
    )
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m.to(tl.int64) * stride_mm
    if HAS_DROPOUT:
        seed = tl.load(Seed)
        drop_rows = (pid_bh * NQ + offs_m) * NK
    else:
        seed = 0
        drop_rows = offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, HAS_BAND
    )
    num_off = b * stride_nb + h * stride_nh + qb
    idx_off = b * stride_ib + h * stride_ih + qb * NCOLS

    n_full = tl.load(FullNum + num_off)
    for i in range(0, n_full):
        start_n = tl.load(FullIdx + idx_off + i) * BLOCK_N
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
        v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
        if (start_n >= f_lo) & (start_n + BLOCK_N <= f_hi):
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                start_n, start_n + BLOCK_N, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
            )  # fmt: skip
        elif (start_n < hi) & (start_n + BLOCK_N > lo):
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                start_n, start_n + BLOCK_N, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
            )  # fmt: skip
    if HAS_PARTIAL:
        tile_local = (offs_m - start_m)[:, None] * BLOCK_N + offs_n0[None, :]
        n_part = tl.load(PartNum + num_off)
        for i in range(0, n_part):
            start_n = tl.load(PartIdx + idx_off + i) * BLOCK_N
            if (start_n < hi) & (start_n + BLOCK_N > lo):
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                acc, l_i, m_i = _fwd_partial(
                    acc, l_i, m_i, q,
                    k_base + start_n.to(tl.int64) * stride_kn,
                    v_base + start_n.to(tl.int64) * stride_vn,
                    Tiles + tile * (BLOCK_M * BLOCK_N) + tile_local,
                    mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv,
                    stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if HAS_DROPOUT:
        l_safe = l_safe * (1.0 - dropout_p)
    out = acc / l_safe[:, None]
    o_ptrs = (
        Out + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )  # fmt: skip
    tl.store(
        o_ptrs, out.to(Out.dtype.element_ty),
        mask=(offs_m[:, None] < NQ) & (offs_dv[None, :] < HEAD_DV),
    )  # fmt: skip
    tl.store(Lse + pid_bh * NQ + offs_m, lse, mask=offs_m < NQ)


@triton.jit
def _bwd_q_partial(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, tile_ptrs, mask_rows, drop_rows, seed,
    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One partial key block: ``_bwd_q_inner``'s step with the block's token mask."""
    offs_n = start_n + offs_n0
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, True, not EVEN_D)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, True, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_rows, stride_mn, qk_scale, sm_scale, softcap,
        True, HAS_BAND, HAS_SOFTCAP, MASK_KIND, True,
    )  # fmt: skip
    s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    if HAS_DROPOUT:
        rnd = tl.rand(seed, drop_rows[:, None] + offs_n[None, :])
        dp = tl.where(rnd >= dropout_p, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=_DYNAMIC)
def bs_bwd_dq_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_PARTIAL: tl.constexpr,
):  # fmt: skip
    """dQ for one query block over its kept key blocks."""
    qb = tl.program_id(0)
    start_m = qb * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m.to(tl.int64)[:, None]

    q = _load_rows(Q + b * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, NQ, offs_d, HEAD_D, True, not EVEN_D)  # fmt: skip
    do = _load_rows(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_dv[None, :] * stride_dod,
                    offs_m, NQ, offs_dv, HEAD_DV, True, not EVEN_D)  # fmt: skip
    lse2 = _load_lse2(Lse + pid_bh * NQ + offs_m, offs_m, NQ, True)
    delta = tl.load(Delta + pid_bh * NQ + offs_m, mask=offs_m < NQ, other=0.0)
    k_base = (
        K
        + b * stride_kb
        + hk * stride_kh
        + offs_n0[:, None] * stride_kn
        + offs_d[None, :] * stride_kd
    )
    v_base = (
        V
        + b * stride_vb
        + hk * stride_vh
        + offs_n0[:, None] * stride_vn
        + offs_dv[None, :] * stride_vd
    )
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m.to(tl.int64) * stride_mm
    if HAS_DROPOUT:
        seed = tl.load(Seed)
        drop_rows = (pid_bh * NQ + offs_m) * NK
    else:
        seed = 0
        drop_rows = offs_m
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, HAS_BAND
    )
    num_off = b * stride_nb + h * stride_nh + qb
    idx_off = b * stride_ib + h * stride_ih + qb * NCOLS

    n_full = tl.load(FullNum + num_off)
    for i in range(0, n_full):
        start_n = tl.load(FullIdx + idx_off + i) * BLOCK_N
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
        v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
        if (start_n >= f_lo) & (start_n + BLOCK_N <= f_hi):
            dq = _bwd_q_inner(
                dq, q, do, lse2, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                start_n, start_n + BLOCK_N, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
            )  # fmt: skip
        elif (start_n < hi) & (start_n + BLOCK_N > lo):
            dq = _bwd_q_inner(
                dq, q, do, lse2, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                start_n, start_n + BLOCK_N, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
            )  # fmt: skip
    if HAS_PARTIAL:
        tile_local = (offs_m - start_m)[:, None] * BLOCK_N + offs_n0[None, :]
        n_part = tl.load(PartNum + num_off)
        for i in range(0, n_part):
            start_n = tl.load(PartIdx + idx_off + i) * BLOCK_N
            if (start_n < hi) & (start_n + BLOCK_N > lo):
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                dq = _bwd_q_partial(
                    dq, q, do, lse2, delta,
                    k_base + start_n.to(tl.int64) * stride_kn,
                    v_base + start_n.to(tl.int64) * stride_vn,
                    Tiles + tile * (BLOCK_M * BLOCK_N) + tile_local,
                    mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv,
                    stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_D))  # fmt: skip


@triton.jit
def _bwd_kv_partial(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, tile_ptrs, mask_base, drop_base, seed,
    start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One partial query block: ``_bwd_kv_inner``'s step (transposed tiles) with the
    block's token mask."""
    offs_m = start_m + offs_m0
    q = _load_rows(q_ptrs, offs_m, NQ, offs_d, HEAD_D, True, not EVEN_D)
    do = _load_rows(do_ptrs, offs_m, NQ, offs_dv, HEAD_DV, True, not EVEN_D)
    lse2 = _load_lse2(lse_ptrs, offs_m, NQ, True)
    delta = tl.load(delta_ptrs, mask=offs_m < NQ, other=0.0)
    qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    sT, tT = _scores(
        qkT, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_base + offs_m.to(tl.int64) * stride_mm, stride_mn, qk_scale, sm_scale, softcap,
        True, HAS_BAND, HAS_SOFTCAP, MASK_KIND, False,
    )  # fmt: skip
    sT = tl.where(tl.load(tile_ptrs) != 0, sT, float("-inf"))
    pT = tl.exp2(sT - lse2[None, :])
    dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    if HAS_DROPOUT:
        rnd = tl.rand(seed, drop_base + offs_m[None, :].to(tl.int64) * NK + offs_n[:, None])
        kept = rnd >= dropout_p
        inv_keep = 1.0 / (1.0 - dropout_p)
        pdT = tl.where(kept, pT * inv_keep, 0.0)
        dpT = tl.where(kept, dpT * inv_keep, 0.0)
    else:
        pdT = pT
    dv += tl.dot(pdT.to(do.dtype), do, input_precision=INPUT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    if HAS_SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk += tl.dot(dsT.to(q.dtype), q, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=_DYNAMIC)
def bs_bwd_dkdv_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
    H, HKV, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_PARTIAL: tl.constexpr,
):  # fmt: skip
    """dK and dV for one key block, over the kept query blocks of each of the GROUP query
    heads that read it (the block lists here are the per-key-block "q" direction)."""
    kb = tl.program_id(0)
    start_n = kb * BLOCK_N
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows_n = offs_n.to(tl.int64)[:, None]

    k = _load_rows(K + b * stride_kb + hk * stride_kh + rows_n * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, NK, offs_d, HEAD_D, True, not EVEN_D)  # fmt: skip
    v = _load_rows(V + b * stride_vb + hk * stride_vh + rows_n * stride_vn + offs_dv[None, :] * stride_vd,
                   offs_n, NK, offs_dv, HEAD_DV, True, not EVEN_D)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    lo, f_lo, f_hi, hi = _query_ranges(
        start_n, NQ, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, HAS_BAND
    )
    # Token mask of a partial block, transposed: (keys, rows) like this kernel's tiles.
    tile_local = offs_m0[None, :] * BLOCK_N + (offs_n - start_n)[:, None]
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = (
            Q
            + b * stride_qb
            + h * stride_qh
            + offs_m0[:, None] * stride_qm
            + offs_d[None, :] * stride_qd
        )
        do_base = (
            DO + b * stride_dob + h * stride_doh + offs_m0[:, None] * stride_dom
            + offs_dv[None, :] * stride_dod
        )  # fmt: skip
        lse_base = Lse + bh * NQ + offs_m0
        delta_base = Delta + bh * NQ + offs_m0
        mask_base = Mask + b * stride_mb + h * stride_mh
        drop_base = bh * NQ * NK
        num_off = b * stride_nb + h * stride_nh + kb
        idx_off = b * stride_ib + h * stride_ih + kb * NCOLS

        n_full = tl.load(FullNum + num_off)
        for i in range(0, n_full):
            start_m = tl.load(FullIdx + idx_off + i) * BLOCK_M
            s64 = start_m.to(tl.int64)
            if (start_m >= f_lo) & (start_m + BLOCK_M <= f_hi):
                dk, dv = _bwd_kv_inner(
                    dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                    lse_base + s64, delta_base + s64, mask_base, drop_base, seed,
                    start_m, start_m + BLOCK_M, offs_n, offs_m0, offs_d, offs_dv,
                    stride_qm, stride_dom, stride_mm, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_M, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
                    HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip
            elif (start_m < hi) & (start_m + BLOCK_M > lo):
                dk, dv = _bwd_kv_inner(
                    dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                    lse_base + s64, delta_base + s64, mask_base, drop_base, seed,
                    start_m, start_m + BLOCK_M, offs_n, offs_m0, offs_d, offs_dv,
                    stride_qm, stride_dom, stride_mm, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_M, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
                    HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip
        if HAS_PARTIAL:
            n_part = tl.load(PartNum + num_off)
            for i in range(0, n_part):
                start_m = tl.load(PartIdx + idx_off + i) * BLOCK_M
                if (start_m < hi) & (start_m + BLOCK_M > lo):
                    s64 = start_m.to(tl.int64)
                    tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                    dk, dv = _bwd_kv_partial(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64,
                        Tiles + tile * (BLOCK_M * BLOCK_N) + tile_local,
                        mask_base, drop_base, seed,
                        start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
                        NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p,
                        EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                    )  # fmt: skip

    dk = dk * sm_scale
    inb_n = offs_n[:, None] < NK
    tl.store(DK + b * stride_dkb + hk * stride_dkh + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=inb_n & (offs_d[None, :] < HEAD_D))  # fmt: skip
    tl.store(DV + b * stride_dvb + hk * stride_dvh + rows_n * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb_n & (offs_dv[None, :] < HEAD_DV))  # fmt: skip
