"""Block-sparse FlashAttention forward and backward: triton_flash's kernels, visiting
only the kept blocks of a :class:`attnhub.BlockSparseLayout`.

Read ``backends/triton_flash/kernels.py`` first: its glossary (band, offset, segments,
delta, dropout stream, program ids, constexpr knobs) holds here unchanged. This module
adds only the walk over the layout's compressed block lists and the token masks of
partial blocks; the score pipeline (``_scores``: scale, softcap, attn_mask, band and
bounds masks), the tile loads, the band arithmetic (``_key_ranges``/``_query_ranges``),
the per-tile steps (``_fwd_step``, ``_bwd_q_step``, ``_bwd_kv_step``; with HAS_TILE
they also apply a partial block's token mask) and the loops over one block's tiles
(``_fwd_inner``, ``_bwd_q_inner``, ``_bwd_kv_inner``) are triton_flash's own.

Tiles
-----
BQ, BK                the layout's block size (bq, bk).
BLOCK_M, BLOCK_N      the kernel's tile, dividing BQ and BK: triton_flash's launch
                      configuration for the call, capped at the block. One program owns
                      BLOCK_M query rows (forward, dQ) or BLOCK_N keys (dK/dV), a slice of
                      one layout block, and walks each kept block of its row (column) in
                      tiles, so a 128 x 128 layout runs with the dense kernel's tile shapes
                      and register budget instead of one 128 x 128 tile per step.

Block lists (int32, from ``layout.index``; read through (batch, head) strides that are
0 where the layout broadcasts)
FullNum, FullIdx      per row block the full column blocks: no token mask. Inside the
                      call's band and inside NQ/NK they run with MASKED=False (no mask
                      arithmetic at all); on a band edge or the ragged tail, MASKED=True.
PartNum, PartIdx      per row block the partial column blocks: the block's token mask,
                      plus MASKED=True unless EVEN_BLOCKS.
PartTile              for each entry of PartIdx, the tile number in Tiles.
Tiles                 uint8 (P, BQ, BK): the token masks of the P partial blocks
                      (1 = keep), local coordinates (query row, key) within the block.
Order, n_heavy         the program order (``_program_tile``): a 1-D grid over every tile
                      of every row block (column block for dK/dV) and batch x head,
                      heaviest blocks first; the n_heavy heaviest of every head run
                      first with heads interleaved, so that a few long rows cannot start
                      last and set the kernel's tail.
Blocks wholly outside the call's band (causal/window) are skipped without a load.
EVEN_BLOCKS           no causal/window band and NQ, NK multiples of BQ, BK: every full
                      block is unmasked and a partial one needs only its token mask, so
                      the full blocks' tiles, then the partial blocks', run in one flat
                      loop each (what lets Triton pipeline across blocks; the forward
                      steps its pointers, the backward reads each tile's block from the
                      list); otherwise a loop per block decides masked or not.
STRIDE_KN, STRIDE_VN  as in triton_flash: the row stride of what a kernel streams (K/V in
STRIDE_QM, STRIDE_DOM the forward and dQ kernels, Q/dO in dK/dV) as a constant where its
                      rows are packed, else 0 (the runtime stride): fewer 64-bit address
                      registers live across the block loops (triton_flash.ops._row_strides)
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnhub.backends.triton_flash.kernels import (
    _DYNAMIC,
    _bwd_kv_inner,
    _bwd_kv_step,
    _bwd_q_inner,
    _bwd_q_step,
    _fp32_scalars,
    _fwd_inner,
    _fwd_step,
    _key_ranges,
    _load_lse2,
    _load_rows,
    _query_ranges,
    _row_stride,
)


@triton.jit
def _next_tile(block_idx, j, start, n_blocks, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """How far the tile after flat tile j lies from this one (which starts at ``start``):
    TILE within a block, or the jump to the next kept block's first tile. ``block_idx``
    points at the row's list of kept blocks (n_blocks of them)."""
    nxt = j + 1
    at_edge = nxt % (BLOCK // TILE) == 0
    # The next block's index; past the last block nothing is loaded (the loop ends).
    nxt_block = tl.load(
        block_idx + nxt // (BLOCK // TILE),
        mask=at_edge & (nxt // (BLOCK // TILE) < n_blocks),
        other=0,
    )
    return tl.where(at_edge, nxt_block * BLOCK - start, TILE)


@triton.jit
def _program_tile(Order, n_heavy, N, BLOCK: tl.constexpr, TILE: tl.constexpr):
    """(first row of this program's tile, batch * head) for the 1-D grid, which walks
    the layout's row blocks heaviest first (``Order``: block numbers by descending count
    of kept blocks): the ``n_heavy`` heaviest blocks of every head first, heads
    interleaved, so that a few long rows (BigBird's global rows) do not start last and
    set the tail; then each head's remaining blocks together, so concurrent programs
    share one head's K/V in L2. The grid covers whole blocks; a tile past N (in a
    ragged last block) gets a row start >= N and its program returns."""
    pid = tl.program_id(0)
    tiles = BLOCK // TILE
    blocks = tl.cdiv(N, BLOCK)
    heads = tl.num_programs(0) // (blocks * tiles)  # the grid covers batch x heads
    heavy = n_heavy * tiles * heads  # programs in the interleaved region
    per_head = (blocks - n_heavy) * tiles  # each head's rest
    rest = tl.maximum(pid - heavy, 0)
    rank = tl.where(pid < heavy, pid // heads, n_heavy * tiles + rest % tl.maximum(per_head, 1))
    bh = tl.where(pid < heavy, pid % heads, rest // tl.maximum(per_head, 1))
    block = tl.load(Order + rank // tiles)
    return block * BLOCK + (rank % tiles) * TILE, bh.to(tl.int64)


@triton.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_fwd_kernel(
    Q, K, V, Mask, Seed, Out, Lse,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles, Order, n_heavy,
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
    BQ: tl.constexpr, BK: tl.constexpr, EVEN_BLOCKS: tl.constexpr, FOLD_SCALE: tl.constexpr,
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0,
):  # fmt: skip
    """Out and Lse for BLOCK_M rows of one query block, visiting only its kept key blocks."""
    stride_kn = _row_stride(stride_kn, STRIDE_KN)
    stride_vn = _row_stride(stride_vn, STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m, pid_bh = _program_tile(Order, n_heavy, NQ, BQ, BLOCK_M)
    if start_m >= NQ:  # a tile of the ragged last block that lies past NQ
        return
    qb = start_m // BQ  # the layout's row block
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
    if EVEN_BLOCKS:
        # No band and no ragged block: every full block is unmasked. One flat loop over
        # all their key tiles (BK // BLOCK_N per block) whose pointers advance by a
        # loop-carried step (the next tile, or a jump to the next kept block), so that
        # Triton pipelines the loads across blocks as in the dense kernel.
        start_n = tl.load(FullIdx + idx_off) * BK
        k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
        v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
        for j in range(0, n_full * (BK // BLOCK_N)):
            acc, l_i, m_i = _fwd_step(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed,
                start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
                NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, False,
                FOLD_SCALE,
            )  # fmt: skip
            step = _next_tile(FullIdx + idx_off, j, start_n, n_full, BK, BLOCK_N)
            k_ptrs += step.to(tl.int64) * stride_kn
            v_ptrs += step.to(tl.int64) * stride_vn
            start_n += step
    else:
        for i in range(0, n_full):
            start_n = tl.load(FullIdx + idx_off + i) * BK
            k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
            if (start_n >= f_lo) & (start_n + BK <= f_hi):
                acc, l_i, m_i = _fwd_inner(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                    start_n, start_n + BK, offs_m, offs_n0, offs_d, offs_dv,
                    stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_N, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                    FOLD_SCALE,
                )  # fmt: skip
            elif (start_n < hi) & (start_n + BK > lo):
                acc, l_i, m_i = _fwd_inner(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                    start_n, start_n + BK, offs_m, offs_n0, offs_d, offs_dv,
                    stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_N, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                    FOLD_SCALE,
                )  # fmt: skip
    if HAS_PARTIAL:
        # This program's rows of a (BQ, BK) token mask; key tiles step along it.
        tile_local = (offs_m - qb * BQ)[:, None] * BK + offs_n0[None, :]
        n_part = tl.load(PartNum + num_off)
        if EVEN_BLOCKS:
            # As the full blocks: one flat loop with stepped K/V pointers. The token mask
            # pointer steps too, with no load in its address: a row's partial blocks
            # have consecutive tile numbers (ops.layout_tensors numbers tiles in
            # row-major block order and PartIdx lists a row's blocks in ascending
            # order), so it moves BLOCK_N keys along a tile, then on to the next tile.
            start_n = tl.load(PartIdx + idx_off) * BK
            k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
            t_ptrs = Tiles + tl.load(PartTile + idx_off).to(tl.int64) * (BQ * BK) + tile_local
            for j in range(0, n_part * (BK // BLOCK_N)):
                acc, l_i, m_i = _fwd_step(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, t_ptrs,
                    mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv,
                    stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                    INPUT_PRECISION, True, FOLD_SCALE,
                )  # fmt: skip
                step = _next_tile(PartIdx + idx_off, j, start_n, n_part, BK, BLOCK_N)
                k_ptrs += step.to(tl.int64) * stride_kn
                v_ptrs += step.to(tl.int64) * stride_vn
                start_n += step
                at_edge = (j + 1) % (BK // BLOCK_N) == 0
                t_ptrs += tl.where(at_edge, BQ * BK - (BK - BLOCK_N), BLOCK_N)
        else:
            for i in range(0, n_part):
                block_n = tl.load(PartIdx + idx_off + i) * BK
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                for sub in range(0, BK, BLOCK_N):
                    start_n = block_n + sub
                    if (start_n < hi) & (start_n + BLOCK_N > lo):
                        acc, l_i, m_i = _fwd_step(
                            acc, l_i, m_i, q,
                            k_base + start_n.to(tl.int64) * stride_kn,
                            v_base + start_n.to(tl.int64) * stride_vn,
                            Tiles + tile * (BQ * BK) + sub + tile_local,
                            mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv,
                            stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                            qk_scale, sm_scale, softcap, dropout_p,
                            True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                            INPUT_PRECISION, True, FOLD_SCALE,
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


@triton.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_bwd_dq_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles, Order, n_heavy,
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
    BQ: tl.constexpr, BK: tl.constexpr, EVEN_BLOCKS: tl.constexpr,
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0,
):  # fmt: skip
    """dQ for BLOCK_M rows of one query block over its kept key blocks."""
    stride_kn = _row_stride(stride_kn, STRIDE_KN)
    stride_vn = _row_stride(stride_vn, STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m, pid_bh = _program_tile(Order, n_heavy, NQ, BQ, BLOCK_M)
    if start_m >= NQ:  # a tile of the ragged last block that lies past NQ
        return
    qb = start_m // BQ  # the layout's row block
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
    if EVEN_BLOCKS:
        # As in the forward: one flat loop over the full blocks' key tiles, but each
        # tile's address from the block list (measured on the H200: the loop-carried
        # pointer step of the forward made the backward kernels 1.6x slower).
        for j in range(0, n_full * (BK // BLOCK_N)):
            start_n = tl.load(FullIdx + idx_off + j // (BK // BLOCK_N)) * BK
            start_n += (j % (BK // BLOCK_N)) * BLOCK_N
            dq = _bwd_q_step(
                dq, q, do, lse2, delta, k_base + start_n.to(tl.int64) * stride_kn,
                v_base + start_n.to(tl.int64) * stride_vn, k_base, mask_rows, drop_rows, seed,
                start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
                NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, False,
            )  # fmt: skip
    else:
        for i in range(0, n_full):
            start_n = tl.load(FullIdx + idx_off + i) * BK
            k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
            if (start_n >= f_lo) & (start_n + BK <= f_hi):
                dq = _bwd_q_inner(
                    dq, q, do, lse2, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                    start_n, start_n + BK, offs_m, offs_n0, offs_d, offs_dv,
                    stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_N, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip
            elif (start_n < hi) & (start_n + BK > lo):
                dq = _bwd_q_inner(
                    dq, q, do, lse2, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
                    start_n, start_n + BK, offs_m, offs_n0, offs_d, offs_dv,
                    stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_N, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip
    if HAS_PARTIAL:
        # This program's rows of a (BQ, BK) token mask; key tiles step along it.
        tile_local = (offs_m - qb * BQ)[:, None] * BK + offs_n0[None, :]
        n_part = tl.load(PartNum + num_off)
        if EVEN_BLOCKS:
            # As the full blocks: one flat loop, each tile's address from the block list
            # (the pointer step was measured 1.6x slower there), the token mask's address
            # from the block's tile number. No band and no ragged block: the token mask is
            # the only mask (MASKED=False), as in the forward. With the dK/dV twin below,
            # measured on the H200: sliding-window backward 1.51 -> 1.21 ms (NOTES.md).
            for j in range(0, n_part * (BK // BLOCK_N)):
                i = j // (BK // BLOCK_N)
                sub = (j % (BK // BLOCK_N)) * BLOCK_N
                start_n = tl.load(PartIdx + idx_off + i) * BK + sub
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                dq = _bwd_q_step(
                    dq, q, do, lse2, delta, k_base + start_n.to(tl.int64) * stride_kn,
                    v_base + start_n.to(tl.int64) * stride_vn, Tiles + tile * (BQ * BK) + sub + tile_local,
                    mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, True,
                )  # fmt: skip
        else:
            for i in range(0, n_part):
                block_n = tl.load(PartIdx + idx_off + i) * BK
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                for sub in range(0, BK, BLOCK_N):
                    start_n = block_n + sub
                    if (start_n < hi) & (start_n + BLOCK_N > lo):
                        dq = _bwd_q_step(
                            dq, q, do, lse2, delta,
                            k_base + start_n.to(tl.int64) * stride_kn,
                            v_base + start_n.to(tl.int64) * stride_vn,
                            Tiles + tile * (BQ * BK) + sub + tile_local,
                            mask_rows, drop_rows, seed, start_n, offs_m, offs_n0, offs_d, offs_dv,
                            stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                            qk_scale, sm_scale, softcap, dropout_p,
                            True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                            INPUT_PRECISION, True,
                        )  # fmt: skip

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_D))  # fmt: skip


@triton.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_bwd_dkdv_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles, Order, n_heavy,
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
    BQ: tl.constexpr, BK: tl.constexpr, EVEN_BLOCKS: tl.constexpr,
    STRIDE_QM: tl.constexpr = 0, STRIDE_DOM: tl.constexpr = 0,
):  # fmt: skip
    """dK and dV for BLOCK_N keys of one key block, over the kept query blocks of each of the GROUP query
    heads that read it (the block lists here are the per-key-block "q" direction)."""
    stride_qm = _row_stride(stride_qm, STRIDE_QM)
    stride_dom = _row_stride(stride_dom, STRIDE_DOM)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_n, pid_bh = _program_tile(Order, n_heavy, NK, BK, BLOCK_N)
    if start_n >= NK:  # a tile of the ragged last block that lies past NK
        return
    kb = start_n // BK  # the layout's column block
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
    # This program's keys of a (BQ, BK) token mask, transposed to (keys, rows) like this
    # kernel's tiles; query tiles step down it.
    tile_local = offs_m0[None, :] * BK + (offs_n - kb * BK)[:, None]
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
        if EVEN_BLOCKS:
            # One flat loop over the full blocks' query tiles (addresses as in dQ).
            for j in range(0, n_full * (BQ // BLOCK_M)):
                start_m = tl.load(FullIdx + idx_off + j // (BQ // BLOCK_M)) * BQ
                start_m += (j % (BQ // BLOCK_M)) * BLOCK_M
                s64 = start_m.to(tl.int64)
                dk, dv = _bwd_kv_step(
                    dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                    lse_base + s64, delta_base + s64, q_base, mask_base, drop_base, seed,
                    start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                    INPUT_PRECISION, False,
                )  # fmt: skip
        else:
            for i in range(0, n_full):
                start_m = tl.load(FullIdx + idx_off + i) * BQ
                s64 = start_m.to(tl.int64)
                if (start_m >= f_lo) & (start_m + BQ <= f_hi):
                    dk, dv = _bwd_kv_inner(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64, mask_base, drop_base, seed,
                        start_m, start_m + BQ, offs_n, offs_m0, offs_d, offs_dv,
                        stride_qm, stride_dom, stride_mm, stride_mn,
                        NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p,
                        BLOCK_M, False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
                        HAS_DROPOUT, INPUT_PRECISION,
                    )  # fmt: skip
                elif (start_m < hi) & (start_m + BQ > lo):
                    dk, dv = _bwd_kv_inner(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64, mask_base, drop_base, seed,
                        start_m, start_m + BQ, offs_n, offs_m0, offs_d, offs_dv,
                        stride_qm, stride_dom, stride_mm, stride_mn,
                        NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p,
                        BLOCK_M, True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
                        HAS_DROPOUT, INPUT_PRECISION,
                    )  # fmt: skip
        if HAS_PARTIAL:
            n_part = tl.load(PartNum + num_off)
            if EVEN_BLOCKS:
                # One flat loop over the partial blocks' query tiles (addresses as in dQ).
                for j in range(0, n_part * (BQ // BLOCK_M)):
                    i = j // (BQ // BLOCK_M)
                    sub = (j % (BQ // BLOCK_M)) * BLOCK_M
                    start_m = tl.load(PartIdx + idx_off + i) * BQ + sub
                    tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                    s64 = start_m.to(tl.int64)
                    dk, dv = _bwd_kv_step(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64, Tiles + tile * (BQ * BK) + sub * BK + tile_local,
                        mask_base, drop_base, seed,
                        start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
                        NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p,
                        False, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                        INPUT_PRECISION, True,
                    )  # fmt: skip
            else:
                for i in range(0, n_part):
                    block_m = tl.load(PartIdx + idx_off + i) * BQ
                    tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                    for sub in range(0, BQ, BLOCK_M):
                        start_m = block_m + sub
                        if (start_m < hi) & (start_m + BLOCK_M > lo):
                            s64 = start_m.to(tl.int64)
                            dk, dv = _bwd_kv_step(
                                dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                                lse_base + s64, delta_base + s64,
                                Tiles + tile * (BQ * BK) + sub * BK + tile_local,
                                mask_base, drop_base, seed,
                                start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
                                NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                                qk_scale, sm_scale, softcap, dropout_p,
                                True, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                                INPUT_PRECISION, True,
                            )  # fmt: skip

    dk = dk * sm_scale
    inb_n = offs_n[:, None] < NK
    tl.store(DK + b * stride_dkb + hk * stride_dkh + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=inb_n & (offs_d[None, :] < HEAD_D))  # fmt: skip
    tl.store(DV + b * stride_dvb + hk * stride_dvh + rows_n * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb_n & (offs_dv[None, :] < HEAD_DV))  # fmt: skip
