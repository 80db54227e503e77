"""The block-sparse forward and backward for Hopper in Gluon: triton_flash's
warp-specialized forward (``backends/triton_flash/kernels_gluon.py``, read it first),
dQ and dK/dV programs (``kernels_gluon_bwd._dq_block``, ``_kv_block``) walking a
layout's kept blocks.

:func:`bs_fwd_gluon_kernel` computes what ``kernels.bs_fwd_kernel`` computes, for the
calls that ops._gluon_ok admits, where the layout's rows are long enough for it to pay
(ops._GLUON_MIN_KEYS) or a forced Gluon launch row asks for it: EVEN_BLOCKS (no band, Nq
and Nk multiples of the block), 128-row query blocks, key blocks of 64 or 128, and what
triton_flash's Gluon forward takes (no attn_mask, no dropout, no softcap, bf16/fp16, D =
Dv = 128, sm_90, TMA's layout rules). Its program is one 128-row query block (two
consumer warpgroups of 64 rows); the loader streams the row's full blocks' key tiles,
then its partial blocks', each from the block lists (no mask for the full ones, each
partial block's token mask for the others). Programs run in ``kernels._program_tile``'s
order.

Why: at density 1 the pointer kernel's forward took 1.46x the time of dense
triton_flash's (the Gluon forward) on the same work (results/block-sparse-h200.md,
2.321 against 1.590 ms), while the backward's kernels are within 10% of the dense ones.

:func:`bs_bwd_dq_gluon_kernel` and :func:`bs_bwd_dkdv_gluon_kernel` (the table's
Gluon rows send calls there for the layouts the forward takes, where rows keep
ops._GLUON_MIN_KEYS keys (dQ) or columns ops._GLUON_KV_MIN_QUERIES queries (dK/dV) or
more and calls have 4096 keys or more; forced ``bwd_q`` /
``bwd_kv`` Gluon rows send any such layout; dK/dV for 128-key blocks) compute what
``kernels.bs_bwd_dq_kernel`` and ``kernels.bs_bwd_dkdv_kernel`` compute: a program is
one 128-row query block (dQ: the loader streams the row's kept key tiles) or one
128-key column block (dK/dV: the loader streams the column's kept query tiles for each
query head of the group); partial blocks apply their token masks.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from attnhub.backends.triton_flash.common import _DYNAMIC
from attnhub.backends.triton_flash.kernels_gluon import _ROWS, _forward_block
from attnhub.backends.triton_flash.kernels_gluon_bwd import _KEYS, _dq_block, _kv_block

from .kernels import _program_tile


@gluon.jit
def _row_walk(
    FullNum, PartNum, Order, n_heavy, stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
    H, NQ, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_PARTIAL: gl.constexpr,
    BQ: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """The program's layout row, as the forward and dQ kernels walk it: (first row,
    b * H + h, b, h, the row's block-list offset, its full blocks, its full blocks' key
    tiles, all its key tiles), in ``kernels._program_tile``'s order, BK // BLOCK_N tiles
    a block."""
    start_m, pid_bh = _program_tile(Order, n_heavy, NQ, BQ, BLOCK_M)
    qb = start_m // BQ  # the layout's row block
    b = pid_bh // H
    h = pid_bh % H
    num_off = b * stride_nb + h * stride_nh + qb
    idx_off = b * stride_ib + h * stride_ih + qb * NCOLS
    n_full = gl.load(FullNum + num_off)
    n_part = 0
    if HAS_PARTIAL:
        n_part = gl.load(PartNum + num_off)
    n_bulk = n_full * (BK // BLOCK_N)
    return start_m, pid_bh, b, h, idx_off, n_full, n_bulk, n_bulk + n_part * (BK // BLOCK_N)


@gluon.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_fwd_gluon_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, HAS_PARTIAL: gl.constexpr,
    BQ: gl.constexpr, BK: gl.constexpr, EVEN_BLOCKS: gl.constexpr, FOLD_SCALE: gl.constexpr,
    STRIDE_KN: gl.constexpr = 0, STRIDE_VN: gl.constexpr = 0, STAGES: gl.constexpr = 2,
):  # fmt: skip
    """Out and Lse (natural log) for one 128-row query block, visiting only its kept
    key blocks; the arguments are kernels.bs_fwd_kernel's, plus STAGES (K/V buffers)."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(EVEN_BLOCKS and not HAS_BAND and not HAS_SOFTCAP and FOLD_SCALE)
    gl.static_assert(BLOCK_M == 2 * _ROWS and BQ == BLOCK_M and BK % BLOCK_N == 0)
    gl.static_assert(gl.num_warps() == 4)
    start_m, pid_bh, b, h, idx_off, n_full, n_bulk, n = _row_walk(
        FullNum, PartNum, Order, n_heavy, stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
        H, NQ, BLOCK_M, BLOCK_N, HAS_PARTIAL, BQ, BK,
    )  # fmt: skip
    _forward_block(
        Q, K, V, Out, Lse, pid_bh, b, h, h // GROUP, start_m, 0, 0, n_bulk, n,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_od,
        H, NQ, NK, offset, win_left, win_right, qk_scale,
        FullIdx, PartIdx, PartTile, Tiles, idx_off, n_full,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, False, False, HAS_PARTIAL, True, True, HAS_PARTIAL,
        BQ, BK,
    )  # fmt: skip


@gluon.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_bwd_dq_gluon_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, HAS_PARTIAL: gl.constexpr,
    BQ: gl.constexpr, BK: gl.constexpr, EVEN_BLOCKS: gl.constexpr,
    STRIDE_KN: gl.constexpr = 0, STRIDE_VN: gl.constexpr = 0, STAGES: gl.constexpr = 2,
):  # fmt: skip
    """dQ for one 128-row query block over its kept key blocks (triton_flash's Gluon dQ
    program, ``kernels_gluon_bwd._dq_block``, walking the layout row as the forward
    above does); the arguments are kernels.bs_bwd_dq_kernel's, plus STAGES (K/V
    buffers). Admitted as the forward is (ops._gluon_ok), where its launch row asks
    for it (ops._bwd_impl)."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(EVEN_BLOCKS and not HAS_BAND and not HAS_SOFTCAP)
    gl.static_assert(BLOCK_M == 2 * _ROWS and BQ == BLOCK_M and BK % BLOCK_N == 0)
    gl.static_assert(gl.num_warps() == 4)
    start_m, pid_bh, b, h, idx_off, n_full, n_bulk, n = _row_walk(
        FullNum, PartNum, Order, n_heavy, stride_nb, stride_nh, stride_ib, stride_ih, NCOLS,
        H, NQ, BLOCK_M, BLOCK_N, HAS_PARTIAL, BQ, BK,
    )  # fmt: skip
    _dq_block(
        Q, K, V, DO, Lse, Delta, DQ, pid_bh, b, h, h // GROUP, start_m, 0, 0, n_bulk, n,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
        FullIdx, PartIdx, PartTile, Tiles, idx_off, n_full,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, False, False, HAS_PARTIAL, True, HAS_PARTIAL,
        BQ, BK,
    )  # fmt: skip


@gluon.jit(do_not_specialize=[*_DYNAMIC, "n_heavy"])
def bs_bwd_dkdv_gluon_kernel(
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
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, HAS_PARTIAL: gl.constexpr,
    BQ: gl.constexpr, BK: gl.constexpr, EVEN_BLOCKS: gl.constexpr,
    STRIDE_QM: gl.constexpr = 0, STRIDE_DOM: gl.constexpr = 0, STAGES: gl.constexpr = 2,
):  # fmt: skip
    """dK and dV for one 128-key column block over the kept query blocks of each of the
    GROUP query heads that read it (triton_flash's Gluon dK/dV program,
    ``kernels_gluon_bwd._kv_block``, walking the layout's columns); the arguments are
    kernels.bs_bwd_dkdv_kernel's, plus STAGES (Q/dO buffers). Where its launch row asks
    for it (ops._bwd_impl), for 128-key blocks on the layouts the forward takes."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(EVEN_BLOCKS and not HAS_BAND and not HAS_SOFTCAP)
    gl.static_assert(BLOCK_N == 2 * _KEYS and BK == BLOCK_N and BQ % BLOCK_M == 0)
    gl.static_assert(gl.num_warps() == 4)
    start_n, pid_bh = _program_tile(Order, n_heavy, NK, BK, BLOCK_N)
    kb = start_n // BK  # the layout's column block
    b = pid_bh // HKV
    hk = pid_bh % HKV
    _kv_block(
        Q, K, V, DO, Lse, Delta, DK, DV, b, hk, start_n, 0, 0, 0, 0,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
        stride_dvd, H, GROUP, NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
        FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles, b * stride_nb + kb, stride_nh,
        b * stride_ib + kb * NCOLS, stride_ih,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, False, False, HAS_PARTIAL, True, HAS_PARTIAL, BQ, BK,
    )  # fmt: skip
