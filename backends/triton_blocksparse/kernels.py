"""Block-sparse FlashAttention forward and backward: the dense kernels' passes, visiting
only the kept blocks of a :class:`attnhub.BlockSparseLayout`.

Read ``backends/triton_flash/kernels.py`` first: its glossary (band, offset, segments,
delta, dropout stream, program ids, constexpr knobs) holds here unchanged. Both
families are built on one kernel layer, ``backends/triton_flash/common.py``: the score
pipeline (``_scores``: scale, softcap, attn_mask, band and bounds masks), the tile
loads, the band arithmetic (``_key_ranges``/``_query_ranges``), the per-tile steps
(``_fwd_step``, ``_bwd_q_step``, ``_bwd_kv_step``; with HAS_TILE they also apply a
partial block's token mask), the loops over a run of tiles (``_fwd_inner``,
``_bwd_q_inner``, ``_bwd_kv_inner``) and each pass's prologue and epilogue
(``_kv_bases``, ``_row_streams``, ``_softmax_init``, ``_fwd_finish``, ``_dq_operands``,
``_dq_finish``, ``_kv_operands``, ``_query_head_bases``, ``_dkdv_finish``). A kernel
here is a dense kernel whose walk over the band's segments is replaced by a walk over
the layout's compressed block lists: this module adds only that walk, the program
order and the token masks of partial blocks.
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

from attnhub.backends.triton_flash.common import (
    _DYNAMIC,
    _bwd_kv_inner,
    _bwd_kv_step,
    _bwd_q_inner,
    _bwd_q_step,
    _dkdv_finish,
    _dq_finish,
    _dq_operands,
    _fp32_scalars,
    _fwd_finish,
    _fwd_inner,
    _fwd_step,
    _key_ranges,
    _kv_bases,
    _kv_operands,
    _load_rows,
    _query_head_bases,
    _query_ranges,
    _row_streams,
    _row_stride,
    _softmax_init,
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
    stride_kn = _row_stride(stride_kn, PACKED=STRIDE_KN)
    stride_vn = _row_stride(stride_vn, PACKED=STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m, pid_bh = _program_tile(Order, n_heavy, NQ, BLOCK=BQ, TILE=BLOCK_M)
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
    q = _load_rows(q_ptrs, offs_m, NQ, offs_d, HEAD_D, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)
    k_base, v_base = _kv_bases(
        K, V, b, hk, offs_n0, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    )  # fmt: skip
    mask_rows, seed, drop_rows = _row_streams(
        Mask, Seed, b, h, pid_bh, offs_m, stride_mb, stride_mh, stride_mm, NQ, NK,
        HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip

    m_i, l_i, acc = _softmax_init(BLOCK_M=BLOCK_M, BLOCK_DV=BLOCK_DV)
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m,
        NK,
        offset,
        win_left,
        win_right,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        HAS_BAND=HAS_BAND,
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
                acc, l_i, m_i, q, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed, start_n,
                offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset,
                win_left, win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=False,
                EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=False,
                FOLD_SCALE=FOLD_SCALE,
            )  # fmt: skip
            step = _next_tile(FullIdx + idx_off, j, start_n, n_full, BLOCK=BK, TILE=BLOCK_N)
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
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed, start_n,
                    start_n + BK, offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale,
                    softcap, dropout_p, BLOCK_N=BLOCK_N, MASKED=False, EVEN_D=EVEN_D,
                    HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                    HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, FOLD_SCALE=FOLD_SCALE,
                )  # fmt: skip
            elif (start_n < hi) & (start_n + BK > lo):
                acc, l_i, m_i = _fwd_inner(
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed, start_n,
                    start_n + BK, offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale,
                    softcap, dropout_p, BLOCK_N=BLOCK_N, MASKED=True, EVEN_D=EVEN_D,
                    HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                    HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, FOLD_SCALE=FOLD_SCALE,
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
                    acc, l_i, m_i, q, k_ptrs, v_ptrs, t_ptrs, mask_rows, drop_rows, seed, start_n,
                    offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset,
                    win_left, win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=False,
                    EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                    HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=True,
                    FOLD_SCALE=FOLD_SCALE,
                )  # fmt: skip
                step = _next_tile(PartIdx + idx_off, j, start_n, n_part, BLOCK=BK, TILE=BLOCK_N)
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
                            acc, l_i, m_i, q, k_base + start_n.to(tl.int64) * stride_kn,
                            v_base + start_n.to(tl.int64) * stride_vn,
                            Tiles + tile * (BQ * BK) + sub + tile_local, mask_rows, drop_rows, seed,
                            start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D,
                            HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale, softcap,
                            dropout_p, MASKED=True, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                            HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                            INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=True, FOLD_SCALE=FOLD_SCALE,
                        )  # fmt: skip

    _fwd_finish(
        Out, Lse, acc, l_i, m_i, b, h, pid_bh * NQ, offs_m, offs_dv,
        stride_ob, stride_oh, stride_om, stride_od, NQ, HEAD_DV, dropout_p,
        EVEN_D=EVEN_D, HAS_DROPOUT=HAS_DROPOUT, STORE_LSE=True,
        ROW_STATS=MASK_KIND == 2,
    )  # fmt: skip


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
    stride_kn = _row_stride(stride_kn, PACKED=STRIDE_KN)
    stride_vn = _row_stride(stride_vn, PACKED=STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m, pid_bh = _program_tile(Order, n_heavy, NQ, BLOCK=BQ, TILE=BLOCK_M)
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

    q, do, lse2, log2l, delta = _dq_operands(
        Q, DO, Lse, Delta, b, h, pid_bh * NQ, offs_m, offs_d, offs_dv,
        stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
        NQ, HEAD_D, HEAD_DV, EVEN_D=EVEN_D, MASK_KIND=MASK_KIND,
    )  # fmt: skip
    k_base, v_base = _kv_bases(
        K, V, b, hk, offs_n0, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    )  # fmt: skip
    mask_rows, seed, drop_rows = _row_streams(
        Mask, Seed, b, h, pid_bh, offs_m, stride_mb, stride_mh, stride_mm, NQ, NK,
        HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m,
        NK,
        offset,
        win_left,
        win_right,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        HAS_BAND=HAS_BAND,
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
                dq, q, do, lse2, log2l, delta, k_base + start_n.to(tl.int64) * stride_kn,
                v_base + start_n.to(tl.int64) * stride_vn, k_base, mask_rows, drop_rows, seed,
                start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV,
                offset, win_left, win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=False,
                EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=False,
            )  # fmt: skip
    else:
        for i in range(0, n_full):
            start_n = tl.load(FullIdx + idx_off + i) * BK
            k_ptrs = k_base + start_n.to(tl.int64) * stride_kn
            v_ptrs = v_base + start_n.to(tl.int64) * stride_vn
            if (start_n >= f_lo) & (start_n + BK <= f_hi):
                dq = _bwd_q_inner(
                    dq, q, do, lse2, log2l, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed, start_n,
                    start_n + BK, offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale,
                    softcap, dropout_p, BLOCK_N=BLOCK_N, MASKED=False, EVEN_D=EVEN_D,
                    HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                    HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION,
                )  # fmt: skip
            elif (start_n < hi) & (start_n + BK > lo):
                dq = _bwd_q_inner(
                    dq, q, do, lse2, log2l, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed, start_n,
                    start_n + BK, offs_m, offs_n0, offs_d, offs_dv, stride_kn, stride_vn, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale,
                    softcap, dropout_p, BLOCK_N=BLOCK_N, MASKED=True, EVEN_D=EVEN_D,
                    HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
                    HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION,
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
                    dq, q, do, lse2, log2l, delta, k_base + start_n.to(tl.int64) * stride_kn,
                    v_base + start_n.to(tl.int64) * stride_vn,
                    Tiles + tile * (BQ * BK) + sub + tile_local, mask_rows, drop_rows, seed,
                    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV,
                    offset, win_left, win_right, qk_scale, sm_scale, softcap, dropout_p,
                    MASKED=False, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
                    MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION,
                    HAS_TILE=True,
                )  # fmt: skip
        else:
            for i in range(0, n_part):
                block_n = tl.load(PartIdx + idx_off + i) * BK
                tile = tl.load(PartTile + idx_off + i).to(tl.int64)
                for sub in range(0, BK, BLOCK_N):
                    start_n = block_n + sub
                    if (start_n < hi) & (start_n + BLOCK_N > lo):
                        dq = _bwd_q_step(
                            dq, q, do, lse2, log2l, delta, k_base + start_n.to(tl.int64) * stride_kn,
                            v_base + start_n.to(tl.int64) * stride_vn,
                            Tiles + tile * (BQ * BK) + sub + tile_local, mask_rows, drop_rows, seed,
                            start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D,
                            HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale, softcap,
                            dropout_p, MASKED=True, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                            HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                            INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=True,
                        )  # fmt: skip

    _dq_finish(
        DQ, dq, b, h, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        NQ, HEAD_D, sm_scale,
    )  # fmt: skip


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
    stride_qm = _row_stride(stride_qm, PACKED=STRIDE_QM)
    stride_dom = _row_stride(stride_dom, PACKED=STRIDE_DOM)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_n, pid_bh = _program_tile(Order, n_heavy, NK, BLOCK=BK, TILE=BLOCK_N)
    if start_n >= NK:  # a tile of the ragged last block that lies past NK
        return
    kb = start_n // BK  # the layout's column block
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k, v, dk, dv, seed = _kv_operands(
        K, V, Seed, b, hk, offs_n, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
        NK, HEAD_D, HEAD_DV, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        EVEN_D=EVEN_D, HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip
    lo, f_lo, f_hi, hi = _query_ranges(
        start_n,
        NQ,
        NK,
        offset,
        win_left,
        win_right,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        HAS_BAND=HAS_BAND,
    )
    # This program's keys of a (BQ, BK) token mask, transposed to (keys, rows) like this
    # kernel's tiles; query tiles step down it.
    tile_local = offs_m0[None, :] * BK + (offs_n - kb * BK)[:, None]
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base, do_base, lse_base, delta_base, mask_base, drop_base = _query_head_bases(
            Q, DO, Lse, Delta, Mask, b, h, bh * NQ, offs_m0, offs_d, offs_dv,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom,
            stride_dod, stride_mb, stride_mh, NQ, NK,
        )  # fmt: skip
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
                    lse_base + s64, delta_base + s64, q_base, mask_base, drop_base, seed, start_m,
                    offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn, NQ, NK, HEAD_D, HEAD_DV,
                    offset, win_left, win_right, qk_scale, sm_scale, softcap, dropout_p,
                    MASKED=False, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
                    MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION,
                    HAS_TILE=False,
                )  # fmt: skip
        else:
            for i in range(0, n_full):
                start_m = tl.load(FullIdx + idx_off + i) * BQ
                s64 = start_m.to(tl.int64)
                if (start_m >= f_lo) & (start_m + BQ <= f_hi):
                    dk, dv = _bwd_kv_inner(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64, mask_base, drop_base, seed, start_m,
                        start_m + BQ, offs_n, offs_m0, offs_d, offs_dv, stride_qm, stride_dom,
                        stride_mm, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p, BLOCK_M=BLOCK_M, MASKED=False,
                        EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
                        MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                        INPUT_PRECISION=INPUT_PRECISION,
                    )  # fmt: skip
                elif (start_m < hi) & (start_m + BQ > lo):
                    dk, dv = _bwd_kv_inner(
                        dk, dv, k, v, q_base + s64 * stride_qm, do_base + s64 * stride_dom,
                        lse_base + s64, delta_base + s64, mask_base, drop_base, seed, start_m,
                        start_m + BQ, offs_n, offs_m0, offs_d, offs_dv, stride_qm, stride_dom,
                        stride_mm, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                        qk_scale, sm_scale, softcap, dropout_p, BLOCK_M=BLOCK_M, MASKED=True,
                        EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
                        MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                        INPUT_PRECISION=INPUT_PRECISION,
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
                        lse_base + s64, delta_base + s64,
                        Tiles + tile * (BQ * BK) + sub * BK + tile_local, mask_base, drop_base,
                        seed, start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn, NQ,
                        NK, HEAD_D, HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale,
                        softcap, dropout_p, MASKED=False, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                        HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                        INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=True,
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
                                Tiles + tile * (BQ * BK) + sub * BK + tile_local, mask_base,
                                drop_base, seed, start_m, offs_n, offs_m0, offs_d, offs_dv,
                                stride_mm, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left,
                                win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=True,
                                EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
                                MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                                INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=True,
                            )  # fmt: skip

    _dkdv_finish(
        DK, DV, dk, dv, b, hk, offs_n, offs_d, offs_dv,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
        stride_dvd, NK, HEAD_D, HEAD_DV, sm_scale,
    )  # fmt: skip
