"""The D=128 dK/dV backward for Hopper in Gluon: a TMA loader warp and two consumer
warpgroups that split the program's keys.

:func:`attn_bwd_dkdv_gluon_kernel` computes what ``kernels.attn_bwd_dkdv_kernel``
computes, for the calls that the Gluon forward takes (ops._gluon_eligible: dense, no
attn_mask, no dropout, no softcap, bf16/fp16, D = Dv = 128, sm_90, TMA's layout rules)
and whose launch row asks for it. Causal (either alignment), sliding windows, GQA, any
lengths and rows without keys are kept. dQ stays with ``kernels.attn_bwd_dq_kernel``:
the backward then runs split.

The program owns BLOCK_N = 128 keys of one kv head, K and V resident in shared memory,
and walks the query tiles of each of the GROUP query heads that read them (the band's
segments, as the pointer kernel). FlashAttention-3's backward structure, written for
this project:

* a loader partition (one warp) copies K and V once, then streams each query tile's Q
  and dO into ``STAGES`` shared buffers through TMA, reusing a buffer once both
  consumers released it;
* two consumer partitions (four warps each) own 64 keys apiece, with their dK and dV
  accumulators in registers. Per query tile of BLOCK_M rows each issues S^T = K Q^T and
  dP^T = V dO^T, takes P^T from S^T (the lse), issues dV += P^T dO while dP^T finishes,
  then dS^T = P^T (dP^T - delta) and dK += dS^T Q, and releases the tile's buffers.
  The two consumers never synchronize with each other.

Arguments are attn_bwd_dkdv_kernel's plus ``STAGES`` (so the split backward's argument
list and its cached plan serve either kernel); what this kernel does not support it
rejects at compile time. Descriptors are built in the kernel (global scratch, which the
launch allocates: ops._scratch_allocator). Gluon has no interpreter: the CPU suite
compiles this kernel for sm_90; its numbers are checked on the GPU
(tests/test_triton_gluon.py).
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

from .common import _DYNAMIC, _compiled, _query_ranges, _segment

LOG2E = gl.constexpr(1.4426950408889634)
_KEYS = gl.constexpr(64)  # keys per consumer warpgroup (one wgmma M tile of 4 warps)
_CONSUMER_REGS = gl.constexpr(240)  # registers per thread: consumers, then the loader
_LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _kv_tile(
    t, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
    q_empty, do_empty, start_m, keys, NQ, NK, offset, win_left, win_right, qk_scale,
    s_layout: gl.constexpr, a_layout: gl.constexpr, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, MASKED: gl.constexpr, HAS_BAND: gl.constexpr,
):  # fmt: skip
    """Query tile ``t`` of the walk (rows start_m .. start_m + BLOCK_M - 1 of one query
    head: its Q, dO, lse and delta in buffer t % STAGES) added to this consumer's dK and
    dV.

    Scores are (keys, rows), as the pointer kernel's. The unmasked bulk never reaches
    rows past NQ (TMA reads them as zeros elsewhere). MASKED drops rows past NQ, keys past NK and what
    lies outside the band, after the scale (a negative scale keeps -inf)."""
    rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    slot = t % STAGES
    phase = (t // STAGES) & 1
    mbarrier.wait(q_ready.index(slot), phase)
    lse = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
    # A row with no kept key (lse -inf) is shifted by 0: every score of it is masked.
    lse2 = gl.where(lse == float("-inf"), 0.0, lse * LOG2E)
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
    s = s * qk_scale
    if MASKED:
        keep = (rows[None, :] < NQ) & (keys[:, None] < NK)
        if HAS_BAND:
            diag = keys[:, None] - rows[None, :] - offset
            keep = keep & (diag >= -win_left) & (diag <= win_right)
        s = gl.where(keep, s, float("-inf"))
    p = gl.exp2(s - lse2[None, :])
    dtype: gl.constexpr = q_smem.dtype
    dv = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do_smem.index(slot), dv,
                       is_async=True)  # fmt: skip
    dp = warpgroup_mma_wait(1, deps=(dp,))  # dP^T done; dV may still run
    ds = p * (dp - delta[None, :])
    dk = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), q_smem.index(slot), dk,
                       is_async=True)  # fmt: skip
    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    mbarrier.arrive(q_empty.index(slot))
    mbarrier.arrive(do_empty.index(slot))
    return dk, dv


@gluon.jit
def _kv_consumer(
    k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty,
    do_empty, DK, DV, dk_base, dv_base, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
    start_n, lo, n_head, n_bulk, n, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
    sm_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
    HAS_BAND: gl.constexpr, MASK_HEAD: gl.constexpr, MASK_TAIL: gl.constexpr,
):  # fmt: skip
    """Keys start_n + 64 WG .. + 63: every query tile of every query head of kv head
    ``hk``, then dK (times the scale) and dV stored for the keys below NK."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    KEY0: gl.constexpr = WG * _KEYS
    k_smem = k_all.slice(KEY0, _KEYS, dim=0)
    v_smem = v_all.slice(KEY0, _KEYS, dim=0)
    keys = start_n + KEY0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([_KEYS, HEAD_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([_KEYS, HEAD_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0, pred=n > 0)
    for g in range(0, GROUP):
        base = g * n  # this head's first tile in the walk
        for seg in gl.static_range(3):
            s0, s1 = _segment(seg, 0, n_head, n_bulk, n)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                for i in range(s0, s1):
                    dk, dv = _kv_tile(
                        base + i, dk, dv, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                        q_ready, do_ready, q_empty, do_empty, lo + i * BLOCK_M, keys, NQ, NK,
                        offset, win_left, win_right, qk_scale, s_layout, a_layout, BLOCK_M,
                        STAGES, seg != 1, HAS_BAND,
                    )  # fmt: skip
    okeys = start_n + KEY0 + gl.arange(0, _KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
    rows64 = okeys.to(gl.int64)[:, None]
    inb = okeys[:, None] < NK
    dk = dk * sm_scale  # d(scale * qk) / d(qk)
    gl.store(DK + dk_base + rows64 * stride_dkn + cols[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=inb)  # fmt: skip
    gl.store(DV + dv_base + rows64 * stride_dvn + cols[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb)  # fmt: skip


@gluon.jit
def _kv_loader(
    Q, DO, Lse, Delta, k_desc, v_desc, k_all, v_all, q_smem, do_smem, lse_smem, delta_smem,
    kv_bar, q_ready, do_ready, q_empty, do_empty, start_n, lo, n, b, hk, H, GROUP, NQ,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """K and V of the program's keys once, then Q, dO, lse and delta of tiles 0 .. n - 1
    of each query head in turn (walk position g * n + i into buffer (g * n + i) % STAGES),
    each after both consumers released that buffer's previous tile. Query tile i holds
    rows lo + i * BLOCK_M on.

    The lse and delta rows are copied by TMA too: a consumer's own load of them into a
    slice of the wgmma layout does not lower (triton 3.6, sm_90, in a warp-specialized
    partition), while a shared-memory read does. Their descriptor is 1-D from the
    tensor's start (16-byte aligned, unlike a head's row) and ends with the head's last
    row, so that rows past NQ read as zeros, as Q's and dO's do."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=n > 0)
    tma.async_copy_global_to_shared(k_desc, [start_n, 0], kv_bar, k_all, pred=n > 0)
    tma.async_copy_global_to_shared(v_desc, [start_n, 0], kv_bar, v_all, pred=n > 0)
    dtype: gl.constexpr = Q.dtype.element_ty
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_D], dtype)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    for g in range(0, GROUP):
        # The descriptors below are rewritten in place for each head (one global scratch
        # slot each): first every copy through the previous head's must have landed,
        # i.e. both consumers released its last STAGES tiles. (The tile waits below then
        # find those phases complete.)
        for j in range(gl.maximum(g * n - STAGES, 0), g * n):
            mbarrier.wait(q_empty.index(j % STAGES), (j // STAGES) & 1)
            mbarrier.wait(do_empty.index(j % STAGES), (j // STAGES) & 1)
        h = hk * GROUP + g
        lse_row = ((b * H + h) * NQ).to(gl.int32)
        lse_desc = tma.make_tensor_descriptor(
            Lse, shape=[lse_row + NQ], strides=[1], block_shape=[BLOCK_M], layout=vec_layout
        )
        delta_desc = tma.make_tensor_descriptor(
            Delta, shape=[lse_row + NQ], strides=[1], block_shape=[BLOCK_M], layout=vec_layout
        )
        q_desc = tma.make_tensor_descriptor(
            Q + b * stride_qb + h * stride_qh, shape=[NQ, HEAD_D], strides=[stride_qm, 1],
            block_shape=[BLOCK_M, HEAD_D], layout=row_layout,
        )  # fmt: skip
        do_desc = tma.make_tensor_descriptor(
            DO + b * stride_dob + h * stride_doh, shape=[NQ, HEAD_D], strides=[stride_dom, 1],
            block_shape=[BLOCK_M, HEAD_D], layout=row_layout,
        )  # fmt: skip
        for i in range(n):
            t = g * n + i
            slot = t % STAGES
            reuse = ((t // STAGES) & 1) ^ 1  # the parity of the buffer's previous phase
            row = lo + i * BLOCK_M
            mbarrier.wait(q_empty.index(slot), reuse, pred=t >= STAGES)
            ready = q_ready.index(slot)
            mbarrier.expect(ready, q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, 0], ready, q_smem.index(slot))
            tma.async_copy_global_to_shared(lse_desc, [lse_row + row], ready, lse_smem.index(slot))
            tma.async_copy_global_to_shared(delta_desc, [lse_row + row], ready,
                                            delta_smem.index(slot))  # fmt: skip
            mbarrier.wait(do_empty.index(slot), reuse, pred=t >= STAGES)
            mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [row, 0], do_ready.index(slot),
                                            do_smem.index(slot))  # fmt: skip


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
    """dK (B, HKV, NK, 128) and dV for BLOCK_N = 128 keys of b * HKV + hkv (grid axes 0
    and 1), as kernels.attn_bwd_dkdv_kernel."""
    gl.static_assert(EVEN_D and BLOCK_D == BLOCK_DV and MASK_KIND == 0 and not HAS_DROPOUT)
    gl.static_assert(VARLEN == 0 and not HAS_SOFTCAP)
    gl.static_assert(BLOCK_N == 2 * _KEYS and gl.num_warps() == 4)
    start_n = gl.program_id(0) * BLOCK_N
    pid_bh = gl.program_id(1).to(gl.int64)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    lo, f_lo, f_hi, hi = _query_ranges(
        start_n, NQ, NK, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    n_head = (f_lo - lo) // BLOCK_M
    n_bulk = (f_hi - lo) // BLOCK_M
    n = (hi - lo + BLOCK_M - 1) // BLOCK_M
    dtype: gl.constexpr = Q.dtype.element_ty
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    row_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    k_desc = tma.make_tensor_descriptor(
        K + b * stride_kb + hk * stride_kh, shape=[NK, BLOCK_D], strides=[stride_kn, 1],
        block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout,
    )  # fmt: skip
    v_desc = tma.make_tensor_descriptor(
        V + b * stride_vb + hk * stride_vh, shape=[NK, BLOCK_D], strides=[stride_vn, 1],
        block_shape=[BLOCK_N, BLOCK_D], layout=kv_layout,
    )  # fmt: skip
    k_all = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_all = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], row_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], row_layout)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M], gl.float32)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(do_empty.index(i), count=2)
    dk_base = b * stride_dkb + hk * stride_dkh
    dv_base = b * stride_dvb + hk * stride_dvh
    # The partitions' arguments are written out in each tuple (constexprs kept in a
    # variable first would reach the partitions as tensors); the consumers are one
    # function, specialized by its constexpr WG (its keys).
    gl.warp_specialize(
        [
            (_kv_consumer, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar,
                            q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                            stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo, n_head,
                            n_bulk, n, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
                            sm_scale, 0, BLOCK_M, BLOCK_D, STAGES, HAS_BAND, MASK_HEAD,
                            MASK_TAIL)),
            (_kv_consumer, (k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, kv_bar,
                            q_ready, do_ready, q_empty, do_empty, DK, DV, dk_base, dv_base,
                            stride_dkn, stride_dkd, stride_dvn, stride_dvd, start_n, lo, n_head,
                            n_bulk, n, GROUP, NQ, NK, offset, win_left, win_right, qk_scale,
                            sm_scale, 1, BLOCK_M, BLOCK_D, STAGES, HAS_BAND, MASK_HEAD,
                            MASK_TAIL)),
            (_kv_loader, (Q, DO, Lse, Delta, k_desc, v_desc, k_all, v_all, q_smem, do_smem,
                          lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, do_empty,
                          start_n, lo, n, b, hk, H, GROUP, NQ,
                          stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                          BLOCK_M, BLOCK_D, STAGES)),
        ],
        [4, 1],
        [_CONSUMER_REGS, _LOADER_REGS],
    )  # fmt: skip
