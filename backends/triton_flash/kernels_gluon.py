"""The D=128 forward for Hopper in Gluon: a TMA loader warp and two consumer warpgroups.

:func:`attn_fwd_gluon_kernel` computes what ``kernels.attn_fwd_kernel`` computes for the
calls that ops._gluon_eligible admits and the launch table sends here
(configs._GLUON_2B): dense (no attn_mask, no dropout, no packed sequences or key
ranges), bf16/fp16, D = Dv = 128, no softcap, on sm_90 (warpgroup MMA is Hopper's), with
TMA's layout rules (ops._tma_eligible). Causal (either alignment), sliding windows, GQA,
any lengths, the lse and fully masked rows are kept. Its program (:func:`_forward_block`)
also serves triton_blocksparse's Gluon forward, whose loader takes the key tiles from a
layout's block lists and whose consumers apply partial blocks' token masks.

Why Gluon: Triton's pipeliner waits for each tile's score matrix before its softmax and
for P @ V before the next tile, so in one program the tensor cores idle while the
softmax runs; its automatic warp specialization made this loop's results wrong on sm_90
(benchmarks/NOTES.md, 2026-12-04). Here the roles are explicit (FlashAttention-3's
structure, written for this project):

* a loader partition (one warp) streams K and V tiles into ``STAGES`` shared buffers
  through TMA, waiting on "empty" barriers before reusing a buffer;
* two consumer partitions (four warps each) own 64 query rows apiece of the 128-row
  block. Each issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1} asynchronously, waits
  for S_j only, runs the softmax of S_j while P_{j-1} V_{j-1} may still run, then waits
  for it, rescales O and releases both buffers. The two consumers never synchronize
  with each other, so one's softmax overlaps the other's matrix products.

The arguments are attn_fwd_kernel's (so ops._ForwardPlan and its cached launch serve
this kernel too) plus ``STAGES``; what the kernel does not support it rejects at compile
time. Building tensor descriptors in the kernel needs global scratch, which the launch
allocates (ops._scratch_allocator, launch.CachedLaunch). Gluon has no interpreter: the
CPU suite compiles this kernel for sm_90 (benchmarks/aot_check.py, tests/test_sm90_compile.py);
its numbers are checked on the GPU (tests/test_triton_gluon.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import _DYNAMIC, _compiled, _key_ranges, _row_block, _segment

LN2 = gl.constexpr(0.6931471805599453)
_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M tile of 4 warps)
_CONSUMER_REGS = gl.constexpr(232)  # registers per thread: consumers, then the loader
_LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _softmax(
    s, m_i, l_i, cols, rows, NK, offset, win_left, win_right, qk_scale,
    MASKED: gl.constexpr, HAS_BAND: gl.constexpr,
):  # fmt: skip
    """The online softmax's step for raw scores ``s`` (the scale folded into the
    exponent, as kernels' FOLD_SCALE): (p, alpha, new row max, new row sum). MASKED: drop
    keys past NK and outside the band; a row with no kept key so far keeps max -inf and
    is shifted by 0, so that no NaN appears."""
    if MASKED:
        keep = cols[None, :] < NK
        if HAS_BAND:
            diag = cols[None, :] - rows[:, None] - offset
            keep = keep & (diag >= -win_left) & (diag <= win_right)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consume(
    i, acc, m_i, l_i, p_prev, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
    lo, cols0, rows, NK, offset, win_left, win_right, qk_scale, tokens,
    s_layout: gl.constexpr, o_row: gl.constexpr, p_layout: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, HAS_BAND: gl.constexpr,
    TOKEN: gl.constexpr,
):  # fmt: skip
    """Key tile ``i`` (i >= 1) of one consumer: S_i, then P_{i-1} V_{i-1} into ``acc``
    while S_i's softmax runs; returns (acc, m, l, P_i). TOKEN: ``tokens`` points at the
    tile's token mask (:func:`_tile_tokens`), applied to S_i."""
    if TOKEN:
        keep = gl.load(tokens) != 0  # issued before the waits: its latency hides behind them
    ks = i % STAGES
    mbarrier.wait(k_ready.index(ks), (i // STAGES) & 1)
    s = warpgroup_mma(
        q_smem, k_smem.index(ks).permute((1, 0)),
        gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    vs = (i - 1) % STAGES
    mbarrier.wait(v_ready.index(vs), ((i - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_prev, v_smem.index(vs), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))  # S_i done (groups retire in order)
    mbarrier.arrive(k_empty.index(ks))
    if TOKEN:
        s = gl.where(keep, s, float("-inf"))
    p, alpha, m_i, l_i = _softmax(
        s, m_i, l_i, cols0 + lo + i * BLOCK_N, rows, NK, offset, win_left, win_right,
        qk_scale, MASKED=MASKED, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(vs))
    acc = acc * gl.convert_layout(alpha, o_row)[:, None]
    return acc, m_i, l_i, gl.convert_layout(p.to(q_smem.dtype), p_layout)


@gluon.jit
def _tile_tokens(Tiles, PartTile, idx_off, j, rows, cols0, pred, BQ: gl.constexpr,
                 BK: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """Pointers at rows ``rows`` of step ``j`` of a block-sparse row's partial blocks
    (BK // BLOCK_N steps a block): its block's (BQ, BK) token mask (``Tiles``, numbered
    by ``PartTile``, the row's list from ``idx_off``), keys ``cols0`` of the BLOCK_N
    along it. ``pred`` false: the list is not read (step ``j`` may not exist) and the
    pointers are the first token mask's. (The rows' offsets are recomputed each step: a
    (64, BLOCK_N) int32 tensor kept across the loop would hold 64 registers a thread.)"""
    tile = gl.load(PartTile + idx_off + j // (BK // BLOCK_N), mask=pred, other=0).to(gl.int64)
    local = (rows % BQ)[:, None] * BK + ((j % (BK // BLOCK_N)) * BLOCK_N + cols0)[None, :]
    return Tiles + tile * (BQ * BK) + local


@gluon.jit
def _consumer(
    q_all, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
    Out, Lse, out_base, lse_base, stride_om, stride_od, start_m, lo, n_head, n_bulk, n,
    NQ, NK, offset, win_left, win_right, qk_scale, Tiles, PartTile, idx_off,
    WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
    STORE_LSE: gl.constexpr, TOKEN: gl.constexpr, BQ: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """Rows start_m + 64 WG .. + 63 of the block: the key tiles, then the epilogue
    (out = acc / l, lse in natural log; rows with no kept key: 0 and -inf).

    TOKEN (the block-sparse forward of a layout with partial blocks,
    triton_blocksparse's kernels_gluon): the tiles are a layout row's full blocks'
    (tiles 0 .. n_bulk - 1, unmasked), then its partial blocks' (n_bulk .. n - 1, the
    masked tail), each of which applies its block's token
    mask (``Tiles``, ``PartTile``, ``idx_off``: :func:`_tile_tokens`); ``lo`` is 0 and
    the band is off, so that the positional masks keep every key. Otherwise those three
    arguments are not read."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_row: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    ROW0: gl.constexpr = WG * _ROWS
    q_smem = q_all.slice(ROW0, _ROWS, dim=0)
    rows = start_m + ROW0 + gl.arange(0, _ROWS, layout=s_row)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([_ROWS], float("-inf"), gl.float32, layout=s_row)
    l_i = gl.zeros([_ROWS], gl.float32, layout=s_row)
    acc = gl.zeros([_ROWS, HEAD_D], gl.float32, layout=o_layout)
    if n > 0:
        # Tile 0 alone (no product in flight yet), masked: it may be an edge (or, with
        # TOKEN, a partial block's first step).
        if TOKEN:
            first = n_bulk == 0
            tokens0 = _tile_tokens(Tiles, PartTile, idx_off, 0, rows, cols0, first, BQ, BK, BLOCK_N)
            keep0 = gl.load(tokens0, mask=first, other=1) != 0
        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(
            q_smem, k_smem.index(0).permute((1, 0)),
            gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True,
        )  # fmt: skip
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0))
        if TOKEN:
            s = gl.where(keep0, s, float("-inf"))
        p, _, m_i, l_i = _softmax(
            s, m_i, l_i, cols0 + lo, rows, NK, offset, win_left, win_right, qk_scale,
            MASKED=True, HAS_BAND=HAS_BAND,
        )  # fmt: skip
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        # The band's segments in tiles, tile 0 done: masked head, unmasked bulk, masked
        # tail (common._segment, _compiled).
        for seg in gl.static_range(3):
            s0, s1 = _segment(seg, 0, n_head, n_bulk, n)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                for i in range(gl.maximum(s0, 1), s1):
                    tokens = Tiles  # read only where TOKEN and seg == 2
                    if TOKEN and seg == 2:
                        tokens = _tile_tokens(Tiles, PartTile, idx_off, i - n_bulk, rows, cols0,
                                              True, BQ, BK, BLOCK_N)  # fmt: skip
                    acc, m_i, l_i, p = _consume(
                        i, acc, m_i, l_i, p, q_smem, k_smem, v_smem, k_ready, v_ready,
                        k_empty, v_empty, lo, cols0, rows, NK, offset, win_left, win_right,
                        qk_scale, tokens, s_layout, o_row, p_layout, BLOCK_N, STAGES, seg != 1,
                        HAS_BAND, TOKEN and seg == 2,
                    )  # fmt: skip
        last = n - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, o_row)[:, None]
    orows = start_m + ROW0 + gl.arange(0, _ROWS, layout=o_row)
    ocols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (
        Out + out_base + orows.to(gl.int64)[:, None] * stride_om + ocols[None, :] * stride_od
    )  # fmt: skip
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=orows[:, None] < NQ)
    if STORE_LSE:
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * LN2)
        gl.store(Lse + lse_base + rows, lse, mask=rows < NQ)


@gluon.jit
def _loader(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
    start_m, lo, n, FullIdx, PartIdx, idx_off, n_full,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """Q once, then K and V of tiles 0 .. n-1 into buffer i % STAGES, each after both
    consumers released that buffer's previous tile. Tile i holds keys lo + i * BLOCK_N
    on; SPARSE: step i of a layout row's kept blocks, its n_full full blocks
    (``FullIdx``) then its partial ones (``PartIdx``), both lists from ``idx_off``,
    BK // BLOCK_N steps a block (else those four arguments are not read)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes, pred=n > 0)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem, pred=n > 0)
    for i in range(n):
        if SPARSE:
            steps: gl.constexpr = BK // BLOCK_N
            nf = n_full * steps
            if i < nf:
                key = gl.load(FullIdx + idx_off + i // steps) * BK + (i % steps) * BLOCK_N
            else:
                j = i - nf
                key = gl.load(PartIdx + idx_off + j // steps) * BK + (j % steps) * BLOCK_N
        else:
            key = lo + i * BLOCK_N
        slot = i % STAGES
        reuse = ((i // STAGES) & 1) ^ 1  # the parity of the buffer's previous phase
        mbarrier.wait(k_empty.index(slot), reuse, pred=i >= STAGES)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [key, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), reuse, pred=i >= STAGES)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [key, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _forward_block(
    Q, K, V, Out, Lse, pid_bh, b, h, hk, start_m, lo, n_head, n_bulk, n,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_od,
    H, NQ, NK, offset, win_left, win_right, qk_scale,
    FullIdx, PartIdx, PartTile, Tiles, idx_off, n_full,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr,
    MASK_TAIL: gl.constexpr, STORE_LSE: gl.constexpr, SPARSE: gl.constexpr,
    TOKEN: gl.constexpr, BQ: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """One program of either kernel (this module's, and triton_blocksparse's
    bs_fwd_gluon_kernel): rows start_m .. start_m + 127 of query head ``h`` of batch
    ``b`` (``pid_bh`` = b * H + h; kv head ``hk``) over its key tiles 0 .. n - 1
    (masked head, unmasked bulk, masked tail: n_head, n_bulk; see :func:`_loader`
    (SPARSE) and :func:`_consumer` (TOKEN) for the tiles' keys, masks and the
    block-list arguments). Builds the descriptors, the K/V ring and its barriers, then
    runs the partitions."""
    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    q_desc = tma.make_tensor_descriptor(
        Q + b * stride_qb + h * stride_qh, shape=[NQ, BLOCK_D], strides=[stride_qm, 1],
        block_shape=[BLOCK_M, BLOCK_D], layout=q_layout,
    )  # fmt: skip
    k_desc = tma.make_tensor_descriptor(
        K + b * stride_kb + hk * stride_kh, shape=[NK, BLOCK_D], strides=[stride_kn, 1],
        block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout,
    )  # fmt: skip
    v_desc = tma.make_tensor_descriptor(
        V + b * stride_vb + hk * stride_vh, shape=[NK, BLOCK_D], strides=[stride_vn, 1],
        block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout,
    )  # fmt: skip
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    out_base = b * stride_ob + h * stride_oh
    lse_base = pid_bh * NQ
    # The partitions' arguments are written out in each tuple: constexprs kept in a
    # variable first would reach the partitions as tensors. The consumers are one
    # function, specialized by its constexpr WG (its rows).
    gl.warp_specialize(
        [
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                         Out, Lse, out_base, lse_base, stride_om, stride_od, start_m, lo,
                         n_head, n_bulk, n, NQ, NK, offset, win_left, win_right, qk_scale,
                         Tiles, PartTile, idx_off, 0, BLOCK_N, BLOCK_D, STAGES, HAS_BAND,
                         MASK_HEAD, MASK_TAIL, STORE_LSE, TOKEN, BQ, BK)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                         Out, Lse, out_base, lse_base, stride_om, stride_od, start_m, lo,
                         n_head, n_bulk, n, NQ, NK, offset, win_left, win_right, qk_scale,
                         Tiles, PartTile, idx_off, 1, BLOCK_N, BLOCK_D, STAGES, HAS_BAND,
                         MASK_HEAD, MASK_TAIL, STORE_LSE, TOKEN, BQ, BK)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                       v_ready, k_empty, v_empty, start_m, lo, n, FullIdx, PartIdx, idx_off,
                       n_full, BLOCK_N, STAGES, SPARSE, BK)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )  # fmt: skip


@gluon.jit(do_not_specialize=_DYNAMIC)
def attn_fwd_gluon_kernel(
    Q, K, V, Mask, Seed, Out, Lse, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, FOLD_SCALE: gl.constexpr, MASK_HEAD: gl.constexpr,
    MASK_TAIL: gl.constexpr, STRIDE_KN: gl.constexpr = 0, STRIDE_VN: gl.constexpr = 0,
    STORE_LSE: gl.constexpr = True, VARLEN: gl.constexpr = False, STAGES: gl.constexpr = 2,
    HEAVY_FIRST: gl.constexpr = False,
):  # fmt: skip
    """Out (B, H, NQ, 128) and Lse (B, H, NQ) float32 natural log, for one block of
    BLOCK_M = 128 query rows, as kernels.attn_fwd_kernel (scale folded: FOLD_SCALE; row
    blocks in common._row_block's order)."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(VARLEN == 0 and not HAS_SOFTCAP and FOLD_SCALE)
    gl.static_assert(BLOCK_M == 2 * _ROWS and gl.num_warps() == 4)
    start_m = _row_block(HEAVY_FIRST=HEAVY_FIRST) * BLOCK_M
    pid_bh = gl.program_id(1).to(gl.int64)
    b = pid_bh // H
    h = pid_bh % H
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    _forward_block(
        Q, K, V, Out, Lse, pid_bh, b, h, h // GROUP, start_m, lo, (f_lo - lo) // BLOCK_N,
        (f_hi - lo) // BLOCK_N, (hi - lo + BLOCK_N - 1) // BLOCK_N,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_od,
        H, NQ, NK, offset, win_left, win_right, qk_scale,
        None, None, None, None, 0, 0,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL, STORE_LSE,
        False, False, BLOCK_M, BLOCK_N,
    )  # fmt: skip
