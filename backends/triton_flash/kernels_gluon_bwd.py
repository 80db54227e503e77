"""The D=128 and D=256 backward for Hopper in Gluon: dK/dV and dQ kernels, each a TMA
loader warp and two consumer warpgroups.

:func:`attn_bwd_dkdv_gluon_kernel` and :func:`attn_bwd_dq_gluon_kernel` compute what
``kernels.attn_bwd_dkdv_kernel`` and ``kernels.attn_bwd_dq_kernel`` compute, for the
calls that ops._gluon_bwd_eligible admits (dense, no attn_mask, no dropout, no softcap,
bf16/fp16, D = Dv = 128 or 256, sm_90, TMA's layout rules) and whose launch row for that role
asks for it (LaunchConfig.gluon); either may run beside the other role's pointer
kernel, and the backward then runs split. Causal (either alignment), sliding windows,
GQA, any lengths, rows without keys and negative scales are kept. FlashAttention-3's
roles, written for this project; a loader reuses a buffer once both consumers released
it, and at D = 128 the consumers of a program never synchronize with each other.

dK/dV: a program owns BLOCK_N = 128 keys of one kv head, K and V resident in shared
memory, and walks the query tiles of each of the GROUP query heads that read them (the
band's segments, as the pointer kernel). The loader copies K and V once, then streams
each query tile's Q, dO, lse and delta into ``STAGES`` buffers. Each consumer owns 64
of the keys, its dK and dV accumulators in registers; per query tile it issues
S^T = K Q^T and dP^T = V dO^T, takes P^T from S^T (the lse), issues dV += P^T dO while
dP^T finishes, then dS^T = P^T (dP^T - delta) and dK += dS^T Q.

At D = 256 those accumulators would take 256 registers a thread, so a program owns 64
keys and the consumers split the work differently (:func:`_kv_tile_d256`): each computes
S^T and dP^T for half of a query tile's rows, the two hand each other their halves of
P^T and dS^T through shared memory, and each adds 128 columns of the head dim to dK and
dV over the whole tile.

dQ: a program owns BLOCK_M = 128 query rows, Q, dO, lse and delta resident, and walks
the band's key tiles, which the loader streams (K and V) into ``STAGES`` buffers. Each
consumer owns 64 of the rows, its dQ accumulator in registers; per key tile it issues
S = Q K^T and dP = dO V^T, takes P from S, then dS = P (dP - delta) and dQ += dS K.

Arguments are the pointer kernels' plus ``STAGES`` (so the split backward's argument
lists and its cached plan serve either kernel); what a kernel does not support it
rejects at compile time. Descriptors are built in the kernel (global scratch, which
the launch allocates: ops._scratch_allocator). Gluon has no interpreter: the CPU
suite compiles these kernels for sm_90; their numbers are checked on the GPU
(tests/test_triton_gluon.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import _DYNAMIC, _compiled, _key_ranges, _query_ranges, _row_block, _segment
from .kernels_gluon import _tile_tokens

LOG2E = gl.constexpr(1.4426950408889634)
_KEYS = gl.constexpr(64)  # dK/dV: keys per consumer warpgroup (one wgmma M tile of 4 warps)
_ROWS = gl.constexpr(64)  # dQ: query rows per consumer warpgroup
_HALF_D = gl.constexpr(128)  # D=256 dK/dV: head-dim columns per consumer warpgroup
_CONSUMER_REGS = gl.constexpr(240)  # registers per thread: consumers, then the loader
_LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _rows_desc(base, n_rows, row_stride, BLOCK_ROWS: gl.constexpr, BLOCK_D: gl.constexpr):
    """A TMA descriptor over one head's (n_rows, BLOCK_D) rows at ``base`` (unit stride
    along D), in tiles of BLOCK_ROWS rows; rows past n_rows read as zeros."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
        [BLOCK_ROWS, BLOCK_D], base.dtype.element_ty
    )
    return tma.make_tensor_descriptor(
        base, shape=[n_rows, BLOCK_D], strides=[row_stride, 1],
        block_shape=[BLOCK_ROWS, BLOCK_D], layout=layout,
    )  # fmt: skip


@gluon.jit
def _vec_desc(base, n, BLOCK: gl.constexpr):
    """A TMA descriptor over the n float32 entries at ``base`` (a head's lse or delta
    row; 16-byte aligned: ops._gluon_bwd_eligible), in tiles of BLOCK; entries past n
    read as zeros."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK], gl.float32)
    return tma.make_tensor_descriptor(base, shape=[n], strides=[1], block_shape=[BLOCK],
                                      layout=layout)  # fmt: skip


@gluon.jit
def _ring(STAGES: gl.constexpr):
    """(ready, empty): the barriers of a ring of STAGES shared buffers. A buffer's
    ready barrier completes when the loader's copies into it land (one arrival: the
    loader's expect), its empty barrier when both consumer warpgroups released it.
    (kernels_gluon's forward, measured on the GPU, keeps its own inline setup.)"""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    return ready, empty


@gluon.jit
def _lse2(lse):
    """A query tile's lse in base 2; a row with no kept key (lse -inf) is shifted by 0:
    every score of it is masked."""
    return gl.where(lse == float("-inf"), 0.0, lse * LOG2E)


@gluon.jit
def _scores_t(
    s, keys, rows, NQ, NK, offset, win_left, win_right, qk_scale,
    MASKED: gl.constexpr, HAS_BAND: gl.constexpr,
):  # fmt: skip
    """Scores (keys, rows) times the scale; MASKED: -inf for rows past NQ, keys past NK
    and what lies outside the band (after the scale: a negative scale keeps -inf)."""
    s = s * qk_scale
    if MASKED:
        keep = (rows[None, :] < NQ) & (keys[:, None] < NK)
        if HAS_BAND:
            diag = keys[:, None] - rows[None, :] - offset
            keep = keep & (diag >= -win_left) & (diag <= win_right)
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _kv_tile(
    t, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
    q_empty, do_empty, start_m, keys, NQ, NK, offset, win_left, win_right, qk_scale, tokens,
    s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, MASKED: gl.constexpr, HAS_BAND: gl.constexpr, TOKEN: gl.constexpr,
):  # fmt: skip
    """Query tile ``t`` of the walk (rows start_m .. start_m + BLOCK_M - 1 of one query
    head: its Q, dO, lse and delta in buffer t % STAGES) added to this consumer's dK and
    dV.

    Scores are (keys, rows), as the pointer kernel's. The unmasked bulk never reaches
    rows past NQ (TMA reads them as zeros elsewhere). MASKED drops rows past NQ, keys
    past NK and what lies outside the band, after the scale (a negative scale keeps
    -inf); TOKEN drops what the (keys, rows) token mask at ``tokens`` drops."""
    if TOKEN:
        keep_tokens = gl.load(tokens) != 0  # issued before the waits: its latency hides
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    slot = t % STAGES
    phase = (t // STAGES) & 1
    mbarrier.wait(q_ready.index(slot), phase)
    s = warpgroup_mma(
        k_smem, q_smem.index(slot).permute((1, 0)),
        gl.zeros([_KEYS, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    mbarrier.wait(do_ready.index(slot), phase)
    dp = warpgroup_mma(
        v_smem, do_smem.index(slot).permute((1, 0)),
        gl.zeros([_KEYS, BLOCK_M], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    s = warpgroup_mma_wait(1, deps=(s,))  # S^T done (groups retire in order)
    # The lse and delta are read from shared memory where each is first needed: read
    # before the products, they stay live across them, and the masked loops spilled
    # (sm_90: 23 stores and 35 loads in the causal loop; none now).
    lse2 = _lse2(lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)))
    s = _scores_t(s, keys, rows, NQ, NK, offset, win_left, win_right, qk_scale, MASKED, HAS_BAND)
    if TOKEN:
        s = gl.where(keep_tokens, s, float("-inf"))
    p = gl.exp2(s - lse2[None, :])
    dtype: gl.constexpr = q_smem.dtype
    dv = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do_smem.index(slot), dv,
                       is_async=True)  # fmt: skip
    dp = warpgroup_mma_wait(1, deps=(dp,))  # dP^T done; dV may still run
    delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    ds = p * (dp - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), q_smem.index(slot), dk,
                       is_async=True)  # fmt: skip
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    mbarrier.arrive(q_empty.index(slot))
    mbarrier.arrive(do_empty.index(slot))
    return dk, dv


@gluon.jit
def _head_walk(
    g, hk, GROUP, n, FullNum, PartNum, num_base, stride_nh, idx_base, stride_ih,
    SPARSE: gl.constexpr, HAS_PARTIAL: gl.constexpr, STEPS: gl.constexpr,
):  # fmt: skip
    """(tiles, full tiles, block-list offset) of the walk over query head hk * GROUP + g:
    ``n`` (dense; the other two 0), or (SPARSE) the layout column's kept query blocks in
    STEPS tiles each, its full blocks' first, its lists at the offset returned."""
    if SPARSE:
        h = hk * GROUP + g
        num_off = num_base + h * stride_nh
        n_full = gl.load(FullNum + num_off) * STEPS
        n_all = n_full
        if HAS_PARTIAL:
            n_all = n_full + gl.load(PartNum + num_off) * STEPS
        idx_off = idx_base + h * stride_ih
    else:
        n_all = n
        n_full = n * 0
        idx_off = idx_base * 0
    return n_all, n_full, idx_off


@gluon.jit
def _store_dkdv(
    dk, dv, DK, DV, dk_base, dv_base, stride_dkn, stride_dkd, stride_dvn, stride_dvd, key0,
    col0, NK, sm_scale, acc_layout: gl.constexpr,
):  # fmt: skip
    """A consumer's dK (times the scale: d(scale * qk) / d(qk)) and dV, (_KEYS, C) float32
    in ``acc_layout``, stored at keys key0 .. key0 + _KEYS - 1 below NK and head-dim
    columns col0 .. col0 + C - 1."""
    okeys = key0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols = col0 + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, acc_layout))
    rows64 = okeys.to(gl.int64)[:, None]
    inb = okeys[:, None] < NK
    gl.store(DK + dk_base + rows64 * stride_dkn + cols[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=inb)  # fmt: skip
    gl.store(DV + dv_base + rows64 * stride_dvn + cols[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb)  # fmt: skip


@gluon.jit
def _kv_consumer(
    k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty,
    do_empty, DK, DV, dk_base, dv_base, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
    start_n, lo, n_head, n_bulk, n, hk, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
    sm_scale, FullNum, PartNum, PartTile, Tiles, num_base, stride_nh, idx_base, stride_ih,
    WG: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
    SPARSE: gl.constexpr, TOKEN: gl.constexpr, BQ: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """Keys start_n + 64 WG .. + 63: every query tile of each of the GROUP query heads
    of the program's kv head, then dK (times the scale) and dV stored for the keys
    below NK. SPARSE: a head's tiles are its layout column's (:func:`_head_walk`), full
    blocks' unmasked, partial blocks' (TOKEN) with their token masks."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    STEPS: gl.constexpr = BQ // BLOCK_M
    KEY0: gl.constexpr = WG * _KEYS
    k_smem = k_all.slice(KEY0, _KEYS, dim=0)
    v_smem = v_all.slice(KEY0, _KEYS, dim=0)
    keys = start_n + KEY0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, s_layout))
    rows0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([_KEYS, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([_KEYS, HEAD_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    base = start_n * 0  # the head's first tile in the walk (a tensor: it is carried)
    for g in range(0, GROUP):
        n_g, n_full, idx_off = _head_walk(
            g, hk, GROUP, n, FullNum, PartNum, num_base, stride_nh, idx_base, stride_ih,
            SPARSE, TOKEN, STEPS,
        )  # fmt: skip
        if SPARSE:
            s_head, s_bulk = n_full * 0, n_full
        else:
            s_head, s_bulk = n_head, n_bulk
        for seg in gl.static_range(3):
            s0, s1 = _segment(seg, 0, s_head, s_bulk, n_g)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                for i in range(s0, s1):
                    tokens = Tiles  # read only where TOKEN and seg == 2
                    if TOKEN and seg == 2:
                        j = i - n_full
                        tile = gl.load(PartTile + idx_off + j // STEPS).to(gl.int64)
                        local = ((j % STEPS) * BLOCK_M + rows0)[None, :] * BK + (keys % BK)[:, None]
                        tokens = Tiles + tile * (BQ * BK) + local
                    dk, dv = _kv_tile(
                        base + i, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                        q_ready, do_ready, q_empty, do_empty, lo + i * BLOCK_M, keys, NQ, NK,
                        offset, win_left, win_right, qk_scale, tokens, s_layout, a_layout,
                        BLOCK_M, STAGES, seg != 1 and not SPARSE, HAS_BAND, TOKEN and seg == 2,
                    )  # fmt: skip
        base += n_g
    _store_dkdv(dk, dv, DK, DV, dk_base, dv_base, stride_dkn, stride_dkd, stride_dvn,
                stride_dvd, start_n + KEY0, 0, NK, sm_scale, acc_layout)  # fmt: skip


@gluon.jit
def _kv_loader(
    Q, DO, Lse, Delta, k_desc, v_desc, k_all, v_all, q_smem, do_smem, lse_smem, delta_smem,
    kv_bar, q_ready, do_ready, q_empty, do_empty, start_n, lo, n, b, hk, H, GROUP, NQ,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    FullNum, FullIdx, PartNum, PartIdx, num_base, stride_nh, idx_base, stride_ih,
    BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    SPARSE: gl.constexpr, HAS_PARTIAL: gl.constexpr, BQ: gl.constexpr,
):  # fmt: skip
    """K and V of the program's keys once, then Q, dO, lse and delta of each query
    head's tiles in turn (walk position t into buffer t % STAGES), each after both
    consumers released that buffer's previous tile. Query tile i of a head holds rows
    lo + i * BLOCK_M on, or (SPARSE) step i of the head's layout column
    (:func:`_head_walk`: its full blocks, then its partial ones).

    The lse and delta rows are copied by TMA too: a consumer's own load of them into a
    slice of the wgmma layout does not lower (triton 3.6, sm_90, in a warp-specialized
    partition), while a shared-memory read does. Their descriptors are a head's row of
    NQ entries (16-byte aligned: ops admits NQ % 4 == 0), so that rows past NQ read as
    zeros, as Q's and dO's do."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_all)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_all)
    STEPS: gl.constexpr = BQ // BLOCK_M
    base = start_n * 0  # the head's first tile in the walk (a tensor: it is carried)
    for g in range(0, GROUP):
        n_g, n_full, idx_off = _head_walk(
            g, hk, GROUP, n, FullNum, PartNum, num_base, stride_nh, idx_base, stride_ih,
            SPARSE, HAS_PARTIAL, STEPS,
        )  # fmt: skip
        # The descriptors below are rewritten in place for each head (one global scratch
        # slot each): first every copy through the previous head's must have landed,
        # i.e. both consumers released its last STAGES tiles. (The tile waits below then
        # find those phases complete.)
        for j in range(gl.maximum(base - STAGES, 0), base):
            mbarrier.wait(q_empty.index(j % STAGES), (j // STAGES) & 1)
            mbarrier.wait(do_empty.index(j % STAGES), (j // STAGES) & 1)
        h = hk * GROUP + g
        lse_row = (b * H + h) * NQ
        lse_desc = _vec_desc(Lse + lse_row, NQ, BLOCK_M)
        delta_desc = _vec_desc(Delta + lse_row, NQ, BLOCK_M)
        q_desc = _rows_desc(Q + b * stride_qb + h * stride_qh, NQ, stride_qm, BLOCK_M, HEAD_D)
        do_desc = _rows_desc(DO + b * stride_dob + h * stride_doh, NQ, stride_dom, BLOCK_M,
                             HEAD_D)  # fmt: skip
        for i in range(n_g):
            t = base + i
            slot = t % STAGES
            reuse = ((t // STAGES) & 1) ^ 1  # the parity of the buffer's previous phase
            if SPARSE:
                if i < n_full:
                    row = gl.load(FullIdx + idx_off + i // STEPS) * BQ + (i % STEPS) * BLOCK_M
                else:
                    j = i - n_full
                    row = gl.load(PartIdx + idx_off + j // STEPS) * BQ + (j % STEPS) * BLOCK_M
            else:
                row = lo + i * BLOCK_M
            mbarrier.wait(q_empty.index(slot), reuse, pred=t >= STAGES)
            ready = q_ready.index(slot)
            mbarrier.expect(ready, q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, 0], ready, q_smem.index(slot))
            tma.async_copy_global_to_shared(lse_desc, [row], ready, lse_smem.index(slot))
            tma.async_copy_global_to_shared(delta_desc, [row], ready, delta_smem.index(slot))
            mbarrier.wait(do_empty.index(slot), reuse, pred=t >= STAGES)
            mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [row, 0], do_ready.index(slot),
                                            do_smem.index(slot))  # fmt: skip
        base += n_g


@gluon.jit
def _kv_block(
    Q, K, V, DO, Lse, Delta, DK, DV, b, hk, start_n, lo, n_head, n_bulk, n,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
    stride_dvd, H, GROUP, NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
    FullNum, FullIdx, PartNum, PartIdx, PartTile, Tiles, num_base, stride_nh, idx_base,
    stride_ih,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr,
    MASK_TAIL: gl.constexpr, SPARSE: gl.constexpr, TOKEN: gl.constexpr, BQ: gl.constexpr,
    BK: gl.constexpr,
):  # fmt: skip
    """One program of either dK/dV kernel (this module's, and triton_blocksparse's
    bs_bwd_dkdv_gluon_kernel): dK and dV for keys start_n .. start_n + 127 of kv head
    ``hk`` of batch ``b`` over the query tiles of its GROUP query heads (dense: tiles 0
    .. n - 1 from row ``lo``, masked head, unmasked bulk, masked tail: n_head, n_bulk;
    SPARSE and TOKEN: each head's layout column, see :func:`_head_walk`). Builds the
    descriptors, the buffers and their barriers, then runs the partitions."""
    dtype: gl.constexpr = Q.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    k_desc = _rows_desc(K + b * stride_kb + hk * stride_kh, NK, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _rows_desc(V + b * stride_vb + hk * stride_vh, NK, stride_vn, BLOCK_N, BLOCK_D)
    k_all = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_all = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], row_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    q_ready, q_empty = _ring(STAGES)
    do_ready, do_empty = _ring(STAGES)
    dk_base = b * stride_dkb + hk * stride_dkh
    dv_base = b * stride_dvb + hk * stride_dvh
    # The partitions' arguments are written out in each tuple (constexprs kept in a
    # variable first would reach the partitions as tensors); the consumers are one
    # function, specialized by its constexpr WG (its keys). K and V are copied even
    # where no query tile is walked (n = 0, or a column without blocks): both
    # consumers wait for them before their walk.
    gl.warp_specialize(
        [
            (_kv_consumer, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar,
                            q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                            stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo, n_head,
                            n_bulk, n, hk, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
                            sm_scale, FullNum, PartNum, PartTile, Tiles, num_base, stride_nh,
                            idx_base, stride_ih, 0, BLOCK_M, BLOCK_D, STAGES, HAS_BAND,
                            MASK_HEAD, MASK_TAIL, SPARSE, TOKEN, BQ, BK)),
            (_kv_consumer, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar,
                            q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                            stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo, n_head,
                            n_bulk, n, hk, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
                            sm_scale, FullNum, PartNum, PartTile, Tiles, num_base, stride_nh,
                            idx_base, stride_ih, 1, BLOCK_M, BLOCK_D, STAGES, HAS_BAND,
                            MASK_HEAD, MASK_TAIL, SPARSE, TOKEN, BQ, BK)),
            (_kv_loader, (Q, DO, Lse, Delta, k_desc, v_desc, k_all, v_all, q_smem, do_smem,
                          lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                          start_n, lo, n, b, hk, H, GROUP, NQ,
                          stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                          FullNum, FullIdx, PartNum, PartIdx, num_base, stride_nh, idx_base,
                          stride_ih, BLOCK_M, BLOCK_D, STAGES, SPARSE, TOKEN, BQ)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )  # fmt: skip


@gluon.jit
def _hand_over(buffers, bar, value, WG: gl.constexpr):
    """This consumer's half of a tile (``value``) into buffer WG of ``buffers``, then
    one arrival on ``bar``: once both consumers arrived, either may read both halves
    with wgmma (the stores fenced for the async proxy, the warpgroup's threads joined
    before its one arrival)."""
    buffers.index(WG).store(value)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _kv_tile_d256(
    t, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem,
    p_bar, ds_bar, free_bar, q_ready, do_ready, q_empty, do_empty, start_m, keys, NQ, NK,
    offset, win_left, win_right, qk_scale, s_layout: gl.constexpr, WG: gl.constexpr,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, HAS_BAND: gl.constexpr,
):  # fmt: skip
    """Query tile ``t`` of the walk (rows start_m .. start_m + BLOCK_M - 1, buffer t %
    STAGES) added to this consumer's half of the head dim of dK and dV (D = 256).

    Both consumers hold all 64 keys; consumer WG takes query rows WG * BLOCK_M / 2 on of
    the tile: S^T = K Q^T and dP^T = V dO^T for its rows (the full head dim), P^T and
    dS^T = P^T (dP^T - delta) from them in float32, as the pointer kernel does, and
    hands both to the other consumer through shared memory (bf16/fp16, the operands'
    dtype, as the pointer kernel's products take them). Then each adds its 128 columns:
    dV += P^T dO and dK += dS^T Q over the tile's rows, both halves. The tile's
    exchange buffers are rewritten only after both consumers' products of the last tile
    are done (``free_bar``). dV's products run while dP^T finishes and dS^T is formed."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    ROW0: gl.constexpr = WG * HALF_M
    COL0: gl.constexpr = WG * _HALF_D
    rows = start_m + ROW0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(0, s_layout))
    slot = t % STAGES
    phase = (t // STAGES) & 1
    q_tile = q_smem.index(slot)
    do_tile = do_smem.index(slot)
    mbarrier.wait(q_ready.index(slot), phase)
    s = warpgroup_mma(
        k_smem, q_tile.slice(ROW0, HALF_M, dim=0).permute((1, 0)),
        gl.zeros([_KEYS, HALF_M], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    mbarrier.wait(do_ready.index(slot), phase)
    dp = warpgroup_mma(
        v_smem, do_tile.slice(ROW0, HALF_M, dim=0).permute((1, 0)),
        gl.zeros([_KEYS, HALF_M], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    s = warpgroup_mma_wait(1, deps=(s,))
    lse2 = _lse2(lse_smem.index(slot).slice(ROW0, HALF_M).load(gl.SliceLayout(0, s_layout)))
    s = _scores_t(s, keys, rows, NQ, NK, offset, win_left, win_right, qk_scale, MASKED, HAS_BAND)
    p = gl.exp2(s - lse2[None, :])
    dtype: gl.constexpr = q_smem.dtype
    mbarrier.wait(free_bar, (t & 1) ^ 1, pred=t > 0)
    _hand_over(pt_smem, p_bar, p.to(dtype), WG)
    do_cols = do_tile.slice(COL0, _HALF_D, dim=1)
    q_cols = q_tile.slice(COL0, _HALF_D, dim=1)
    mbarrier.wait(p_bar, t & 1)
    dv = warpgroup_mma(pt_smem.index(0), do_cols.slice(0, HALF_M, dim=0), dv, is_async=True)
    dv = warpgroup_mma(pt_smem.index(1), do_cols.slice(HALF_M, HALF_M, dim=0), dv, is_async=True)
    dp = warpgroup_mma_wait(2, deps=(dp,))  # dP^T done; dV's two products may still run
    delta = delta_smem.index(slot).slice(ROW0, HALF_M).load(gl.SliceLayout(0, s_layout))
    _hand_over(dst_smem, ds_bar, (p * (dp - delta[None, :])).to(dtype), WG)
    mbarrier.wait(ds_bar, t & 1)
    dk = warpgroup_mma(dst_smem.index(0), q_cols.slice(0, HALF_M, dim=0), dk, is_async=True)
    dk = warpgroup_mma(dst_smem.index(1), q_cols.slice(HALF_M, HALF_M, dim=0), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    mbarrier.arrive(free_bar)
    mbarrier.arrive(q_empty.index(slot))
    mbarrier.arrive(do_empty.index(slot))
    return dk, dv


@gluon.jit
def _kv_consumer_d256(
    k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem, p_bar, ds_bar,
    free_bar, kv_bar, q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
    stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo, n_head, n_bulk, n, GROUP,
    NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
    WG: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_BAND: gl.constexpr,
    MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
):  # fmt: skip
    """Columns 128 WG .. 128 WG + 127 of dK and dV for the program's 64 keys (D = 256):
    every query tile of each of the GROUP query heads, in the loader's order (see
    :func:`_kv_tile_d256`), then dK (times the scale) and dV stored for keys below NK."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M // 2, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _HALF_D, 16]
    )
    keys = start_n + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([_KEYS, _HALF_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([_KEYS, _HALF_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    base = start_n * 0  # the head's first tile in the walk (a tensor: it is carried)
    for _ in range(0, GROUP):
        for seg in gl.static_range(3):
            s0, s1 = _segment(seg, 0, n_head, n_bulk, n)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                for i in range(s0, s1):
                    dk, dv = _kv_tile_d256(
                        base + i, dk, dv, k_all, v_all, q_smem, do_smem, lse_smem, delta_smem,
                        pt_smem, dst_smem, p_bar, ds_bar, free_bar, q_ready, do_ready, q_empty,
                        do_empty, lo + i * BLOCK_M, keys, NQ, NK, offset, win_left, win_right,
                        qk_scale, s_layout, WG, BLOCK_M, STAGES, seg != 1, HAS_BAND,
                    )  # fmt: skip
        base += n
    _store_dkdv(dk, dv, DK, DV, dk_base, dv_base, stride_dkn, stride_dkd, stride_dvn,
                stride_dvd, start_n, WG * _HALF_D, NK, sm_scale, acc_layout)  # fmt: skip


@gluon.jit
def _kv_block_d256(
    Q, K, V, DO, Lse, Delta, DK, DV, b, hk, start_n, lo, n_head, n_bulk, n,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
    stride_dvd, H, GROUP, NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, HAS_BAND: gl.constexpr,
    MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
):  # fmt: skip
    """One program of the D=256 dK/dV kernel: dK and dV for keys start_n .. start_n +
    63 of kv head ``hk`` of batch ``b``, the query tiles as :func:`_kv_block`'s dense
    walk. Two consumers would each need 256 registers a thread for dK and dV of 64 keys
    at D = 256, so they split the head dim instead and exchange P^T and dS^T
    (:func:`_kv_tile_d256`); the loader is :func:`_kv_loader`. Shared memory: K and V
    (64 KiB), STAGES Q and dO tiles (64 KiB each at BLOCK_M = 64), the exchange (16 KiB)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    HALF_M: gl.constexpr = BLOCK_M // 2
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, 256], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 256], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    half_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_KEYS, HALF_M], dtype)
    k_desc = _rows_desc(K + b * stride_kb + hk * stride_kh, NK, stride_kn, _KEYS, 256)
    v_desc = _rows_desc(V + b * stride_vb + hk * stride_vh, NK, stride_vn, _KEYS, 256)
    k_all = gl.allocate_shared_memory(dtype, [_KEYS, 256], kv_layout)
    v_all = gl.allocate_shared_memory(dtype, [_KEYS, 256], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 256], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 256], row_layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    pt_smem = gl.allocate_shared_memory(dtype, [2, _KEYS, HALF_M], half_layout)
    dst_smem = gl.allocate_shared_memory(dtype, [2, _KEYS, HALF_M], half_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    # The exchange's barriers: P^T and dS^T of a tile written (both halves), and the
    # last tile's products with them done (one arrival per consumer each).
    swap = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(swap.index(i), count=2)
    q_ready, q_empty = _ring(STAGES)
    do_ready, do_empty = _ring(STAGES)
    dk_base = b * stride_dkb + hk * stride_dkh
    dv_base = b * stride_dvb + hk * stride_dvh
    gl.warp_specialize(
        [
            (_kv_consumer_d256, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                 dst_smem, swap.index(0), swap.index(1), swap.index(2), kv_bar,
                                 q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                                 stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo,
                                 n_head, n_bulk, n, GROUP, NQ, NK, offset, win_left, win_right,
                                 qk_scale, sm_scale, 0, BLOCK_M, STAGES, HAS_BAND, MASK_HEAD,
                                 MASK_TAIL)),
            (_kv_consumer_d256, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pt_smem,
                                 dst_smem, swap.index(0), swap.index(1), swap.index(2), kv_bar,
                                 q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                                 stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo,
                                 n_head, n_bulk, n, GROUP, NQ, NK, offset, win_left, win_right,
                                 qk_scale, sm_scale, 1, BLOCK_M, STAGES, HAS_BAND, MASK_HEAD,
                                 MASK_TAIL)),
            (_kv_loader, (Q, DO, Lse, Delta, k_desc, v_desc, k_all, v_all, q_smem, do_smem,
                          lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                          start_n, lo, n, b, hk, H, GROUP, NQ,
                          stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                          None, None, None, None, 0, 0, 0, 0, BLOCK_M, 256, STAGES, False,
                          False, BLOCK_M)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )  # fmt: skip


@gluon.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dkdv_gluon_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, HKV, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
    STRIDE_QM: gl.constexpr = 0, STRIDE_DOM: gl.constexpr = 0, VARLEN: gl.constexpr = False,
    STAGES: gl.constexpr = 2,
):  # fmt: skip
    """dK (B, HKV, NK, D) and dV for BLOCK_N keys of b * HKV + hkv (grid axes 0 and 1),
    as kernels.attn_bwd_dkdv_kernel: D = 128 over 128 keys a program, D = 256 over 64."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(VARLEN == 0 and not HAS_SOFTCAP)
    gl.static_assert(gl.num_warps() == 4)
    # D = 256: 64 keys a program, the consumers split the head dim (_kv_block_d256).
    gl.static_assert((_KEYS if BLOCK_D == 256 else 2 * _KEYS) == BLOCK_N)
    start_n = gl.program_id(0) * BLOCK_N
    pid_bh = gl.program_id(1).to(gl.int64)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    lo, f_lo, f_hi, hi = _query_ranges(
        start_n, NQ, NK, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    if BLOCK_D == 256:
        _kv_block_d256(
            Q, K, V, DO, Lse, Delta, DK, DV, b, hk, start_n, lo, (f_lo - lo) // BLOCK_M,
            (f_hi - lo) // BLOCK_M, (hi - lo + BLOCK_M - 1) // BLOCK_M,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
            stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
            stride_dvd, H, GROUP, NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
            BLOCK_M, STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL,
        )  # fmt: skip
        return
    _kv_block(
        Q, K, V, DO, Lse, Delta, DK, DV, b, hk, start_n, lo, (f_lo - lo) // BLOCK_M,
        (f_hi - lo) // BLOCK_M, (hi - lo + BLOCK_M - 1) // BLOCK_M,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
        stride_dvd, H, GROUP, NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
        None, None, None, None, None, None, 0, 0, 0, 0,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL, False, False,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip


@gluon.jit
def _q_tile(
    i, dq, q_smem, do_smem, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, lse2, delta,
    rows, start_n, NQ, NK, offset, win_left, win_right, qk_scale, tokens,
    s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, MASKED: gl.constexpr, HAS_BAND: gl.constexpr, TOKEN: gl.constexpr,
):  # fmt: skip
    """Key tile ``i`` of the walk (keys start_n .. start_n + BLOCK_N - 1, K and V in
    buffer i % STAGES) added to this consumer's dQ: S = Q K^T and dP = dO V^T issued
    together, P from S (the lse), dS = P (dP - delta), dQ += dS K. V's buffer is
    released once dP is done, K's once dQ's product is. MASKED drops rows past NQ, keys
    past NK and what lies outside the band, after the scale; TOKEN also the keys that
    the token mask at ``tokens`` drops (kernels_gluon._tile_tokens)."""
    if TOKEN:
        keep_tokens = gl.load(tokens) != 0  # issued before the waits: its latency hides
    slot = i % STAGES
    phase = (i // STAGES) & 1
    mbarrier.wait(k_ready.index(slot), phase)
    s = warpgroup_mma(
        q_smem, k_smem.index(slot).permute((1, 0)),
        gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    mbarrier.wait(v_ready.index(slot), phase)
    dp = warpgroup_mma(
        do_smem, v_smem.index(slot).permute((1, 0)),
        gl.zeros([_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True,
    )  # fmt: skip
    s = warpgroup_mma_wait(1, deps=(s,))
    s = s * qk_scale
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (rows[:, None] < NQ) & (cols[None, :] < NK)
        if HAS_BAND:
            diag = cols[None, :] - rows[:, None] - offset
            keep = keep & (diag >= -win_left) & (diag <= win_right)
        if TOKEN:
            keep = keep & keep_tokens
        s = gl.where(keep, s, float("-inf"))
    p = gl.exp2(s - lse2[:, None])
    dp = warpgroup_mma_wait(0, deps=(dp,))
    mbarrier.arrive(v_empty.index(slot))
    ds = p * (dp - delta[:, None])
    dq = warpgroup_mma(gl.convert_layout(ds.to(q_smem.dtype), a_layout), k_smem.index(slot), dq,
                       is_async=True)  # fmt: skip
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.arrive(k_empty.index(slot))
    return dq


@gluon.jit
def _q_consumer(
    q_all, do_all, lse_all, delta_all, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
    v_empty, DQ, dq_base, stride_dqm, stride_dqd, start_m, lo, n_head, n_bulk, n,
    NQ, NK, offset, win_left, win_right, qk_scale, sm_scale, Tiles, PartTile, idx_off,
    WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
    TOKEN: gl.constexpr, BQ: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """Rows start_m + 64 WG .. + 63: every key tile of the band, then dQ (times the
    scale) stored for the rows below NQ. TOKEN (a block-sparse layout's partial blocks,
    as kernels_gluon._consumer's): tiles n_bulk .. n - 1 are partial blocks' and apply
    their token masks (``Tiles``, ``PartTile``, ``idx_off``)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_slice: gl.constexpr = gl.SliceLayout(1, s_layout)
    ROW0: gl.constexpr = WG * _ROWS
    q_smem = q_all.slice(ROW0, _ROWS, dim=0)
    do_smem = do_all.slice(ROW0, _ROWS, dim=0)
    rows = start_m + ROW0 + gl.arange(0, _ROWS, layout=row_slice)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    dq = gl.zeros([_ROWS, HEAD_D], gl.float32, layout=acc_layout)
    if n > 0:
        mbarrier.wait(q_bar, 0)
        lse2 = _lse2(lse_all.slice(ROW0, _ROWS, dim=0).load(row_slice))
        delta = delta_all.slice(ROW0, _ROWS, dim=0).load(row_slice)
        for seg in gl.static_range(3):
            s0, s1 = _segment(seg, 0, n_head, n_bulk, n)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                for i in range(s0, s1):
                    tokens = Tiles  # read only where TOKEN and seg == 2
                    if TOKEN and seg == 2:
                        tokens = _tile_tokens(Tiles, PartTile, idx_off, i - n_bulk, rows, cols0,
                                              True, BQ, BK, BLOCK_N)  # fmt: skip
                    dq = _q_tile(
                        i, dq, q_smem, do_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                        v_empty, lse2, delta, rows, lo + i * BLOCK_N, NQ, NK, offset, win_left,
                        win_right, qk_scale, tokens, s_layout, a_layout, BLOCK_N, STAGES,
                        seg != 1, HAS_BAND, TOKEN and seg == 2,
                    )  # fmt: skip
    orows = start_m + ROW0 + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    dq = dq * sm_scale  # d(scale * qk) / d(qk)
    gl.store(DQ + dq_base + orows.to(gl.int64)[:, None] * stride_dqm + cols[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=orows[:, None] < NQ)  # fmt: skip


@gluon.jit
def _q_loader(
    q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_all, do_all, lse_all, delta_all,
    k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, start_m, lo, n,
    FullIdx, PartIdx, idx_off, n_full,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SPARSE: gl.constexpr, BK: gl.constexpr,
):  # fmt: skip
    """Q, dO, lse and delta of the program's rows once, then K and V of key tiles 0 ..
    n - 1 (keys lo + i * BLOCK_N on; SPARSE: step i of a layout row's kept blocks, as
    kernels_gluon._loader's) into buffer i % STAGES, each after both consumers released
    that buffer's previous tile."""
    mbarrier.expect(
        q_bar,
        q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes,
        pred=n > 0,
    )
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_all, pred=n > 0)
    tma.async_copy_global_to_shared(do_desc, [start_m, 0], q_bar, do_all, pred=n > 0)
    tma.async_copy_global_to_shared(lse_desc, [start_m], q_bar, lse_all, pred=n > 0)
    tma.async_copy_global_to_shared(delta_desc, [start_m], q_bar, delta_all, pred=n > 0)
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
def _dq_block(
    Q, K, V, DO, Lse, Delta, DQ, pid_bh, b, h, hk, start_m, lo, n_head, n_bulk, n,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
    FullIdx, PartIdx, PartTile, Tiles, idx_off, n_full,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    STAGES: gl.constexpr, HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr,
    MASK_TAIL: gl.constexpr, SPARSE: gl.constexpr, TOKEN: gl.constexpr, BQ: gl.constexpr,
    BK: gl.constexpr,
):  # fmt: skip
    """One program of either dQ kernel (this module's, and triton_blocksparse's
    bs_bwd_dq_gluon_kernel): dQ for rows start_m .. start_m + 127 of query head ``h``
    of batch ``b`` (``pid_bh`` = b * H + h; kv head ``hk``) over its key tiles 0 .. n -
    1 (masked head, unmasked bulk, masked tail: n_head, n_bulk; SPARSE and TOKEN: the
    tiles of a layout row's kept blocks, see :func:`_q_loader` and :func:`_q_consumer`).
    Builds the descriptors, the buffers and their barriers, then runs the partitions."""
    dtype: gl.constexpr = Q.dtype.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    # The lse and delta rows through TMA too (see _kv_loader): this head's row.
    lse_row = pid_bh * NQ
    q_desc = _rows_desc(Q + b * stride_qb + h * stride_qh, NQ, stride_qm, BLOCK_M, BLOCK_D)
    do_desc = _rows_desc(DO + b * stride_dob + h * stride_doh, NQ, stride_dom, BLOCK_M, BLOCK_D)
    lse_desc = _vec_desc(Lse + lse_row, NQ, BLOCK_M)
    delta_desc = _vec_desc(Delta + lse_row, NQ, BLOCK_M)
    k_desc = _rows_desc(K + b * stride_kb + hk * stride_kh, NK, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _rows_desc(V + b * stride_vb + hk * stride_vh, NK, stride_vn, BLOCK_N, BLOCK_D)
    q_all = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], row_layout)
    do_all = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_D], row_layout)
    lse_all = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_layout)
    delta_all = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_ready, k_empty = _ring(STAGES)
    v_ready, v_empty = _ring(STAGES)
    dq_base = b * stride_dqb + h * stride_dqh
    gl.warp_specialize(
        [
            (_q_consumer, (q_all, do_all, lse_all, delta_all, k_smem, v_smem, q_bar, k_ready,
                           v_ready, k_empty, v_empty, DQ, dq_base, stride_dqm, stride_dqd,
                           start_m, lo, n_head, n_bulk, n, NQ, NK, offset, win_left, win_right,
                           qk_scale, sm_scale, Tiles, PartTile, idx_off, 0, BLOCK_N, BLOCK_D,
                           STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL, TOKEN, BQ, BK)),
            (_q_consumer, (q_all, do_all, lse_all, delta_all, k_smem, v_smem, q_bar, k_ready,
                           v_ready, k_empty, v_empty, DQ, dq_base, stride_dqm, stride_dqd,
                           start_m, lo, n_head, n_bulk, n, NQ, NK, offset, win_left, win_right,
                           qk_scale, sm_scale, Tiles, PartTile, idx_off, 1, BLOCK_N, BLOCK_D,
                           STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL, TOKEN, BQ, BK)),
            (_q_loader, (q_desc, do_desc, lse_desc, delta_desc, k_desc, v_desc, q_all, do_all,
                         lse_all, delta_all, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
                         v_empty, start_m, lo, n, FullIdx, PartIdx, idx_off, n_full, BLOCK_N,
                         STAGES, SPARSE, BK)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )  # fmt: skip


@gluon.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dq_gluon_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, EVEN_D: gl.constexpr, HAS_BAND: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    INPUT_PRECISION: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
    STRIDE_KN: gl.constexpr = 0, STRIDE_VN: gl.constexpr = 0, VARLEN: gl.constexpr = False,
    STAGES: gl.constexpr = 2, HEAVY_FIRST: gl.constexpr = False,
):  # fmt: skip
    """dQ (B, H, NQ, D), D = 128 or 256, for BLOCK_M = 128 rows of b * H + h (grid axes 0
    and 1; row blocks in common._row_block's order), as kernels.attn_bwd_dq_kernel."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(VARLEN == 0 and not HAS_SOFTCAP)
    gl.static_assert(BLOCK_M == 2 * _ROWS and gl.num_warps() == 4)
    start_m = _row_block(HEAVY_FIRST=HEAVY_FIRST) * BLOCK_M
    pid_bh = gl.program_id(1).to(gl.int64)
    b = pid_bh // H
    h = pid_bh % H
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    _dq_block(
        Q, K, V, DO, Lse, Delta, DQ, pid_bh, b, h, h // GROUP, start_m, lo,
        (f_lo - lo) // BLOCK_N, (f_hi - lo) // BLOCK_N, (hi - lo + BLOCK_N - 1) // BLOCK_N,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        NQ, NK, offset, win_left, win_right, qk_scale, sm_scale,
        None, None, None, None, 0, 0,
        BLOCK_M, BLOCK_N, BLOCK_D, STAGES, HAS_BAND, MASK_HEAD, MASK_TAIL,
        False, False, BLOCK_M, BLOCK_N,
    )  # fmt: skip
