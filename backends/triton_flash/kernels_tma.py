"""The forward with Q/K/V tiles loaded by the Tensor Memory Accelerator (sm_90+).

:func:`attn_fwd_tma_kernel` computes what ``kernels.attn_fwd_kernel`` computes, for the
calls the launch table sends here and ops._tma_eligible admits: dense (no attn_mask, no
dropout, no packed sequences or key ranges), 2-byte dtypes, head dims that are powers
of two up to 128, and tensors whose base, batch, head and row strides are multiples of
16 bytes with unit stride along the head dim (TMA's rules). Causal, sliding windows,
softcap, GQA and any lengths are kept, as in the pointer kernel.

Why a second kernel: TMA copies whole tiles from global to shared memory with one
instruction issued by one thread, where pointer loads spend every thread's registers
and instructions on addresses. Where it pays was measured, not assumed: the launch table
(configs._LEAN_2B) sends the causal D=128 forward here, 4-11% faster than the pointer
kernel on the H200, and keeps the other shapes on the pointer kernel. The band's
segments (kernels' glossary, "segments") are walked as there; the descriptors are built
per (batch, head) from the tensors' strides, with the sequence's own length as their
row extent, so TMA fills rows past the end with zeros and the masked segments turn
those scores into -inf. Triton's warp specialization (``tl.range(...,
warp_specialize=True)``) compiles for this loop on sm_90 but made its results wrong
(benchmarks/NOTES.md, 2026-12-04): it is not used.

The arguments are attn_fwd_kernel's, so that one argument list and one cached launch
plan (ops._ForwardPlan) serve either kernel; what this kernel does not support it
rejects at compile time. Building a descriptor in the kernel needs global scratch (128
bytes a descriptor and program), which the launch allocates (ops._scratch_allocator,
launch.CachedLaunch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _DYNAMIC,
    _compiled,
    _fp32_scalars,
    _fwd_finish,
    _key_ranges,
    _row_block,
    _scores,
    _segment,
    _softmax_init,
    _softmax_update,
)


@triton.jit
def _tma_step(
    acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n0,
    NQ, NK, offset, win_left, win_right, qk_scale, sm_scale, softcap,
    MASKED: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """One key tile (keys start_n .. start_n + BLOCK_N - 1) folded into the running
    softmax, K and V read through their descriptors (kernels' _fwd_step, dense)."""
    k = k_desc.load([start_n, 0])
    qk = tl.dot(q, tl.trans(k))
    s, _t = _scores(
        qk, offs_m, start_n + offs_n0, NQ, NK, offset, win_left, win_right, offs_m, 0,
        qk_scale, sm_scale, softcap, MASKED=MASKED, HAS_BAND=HAS_BAND,
        HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=0, ROWS_FIRST=True, UNSCALED=FOLD_SCALE,
        FAST_TANH=k.dtype != tl.float32,
    )  # fmt: skip
    p, l_i, acc, m_new = _softmax_update(
        s, l_i, m_i, acc, qk_scale, MAY_BE_EMPTY=MASKED, FOLD_SCALE=FOLD_SCALE
    )
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_fwd_tma_kernel(
    Q, K, V, Mask, Seed, Out, Lse, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr, MASK_HEAD: tl.constexpr,
    MASK_TAIL: tl.constexpr, STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0,
    STORE_LSE: tl.constexpr = True, VARLEN: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,
):  # fmt: skip
    """Out (B, H, NQ, DV) and Lse (B, H, NQ) float32 natural log, for one row block, as
    kernels.attn_fwd_kernel."""
    tl.static_assert(EVEN_D and MASK_KIND == 0 and not HAS_DROPOUT and VARLEN == 0)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m = _row_block(HEAVY_FIRST=HEAVY_FIRST) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_desc = tl.make_tensor_descriptor(
        Q + b * stride_qb + h * stride_qh, shape=[NQ, BLOCK_D], strides=[stride_qm, 1],
        block_shape=[BLOCK_M, BLOCK_D],
    )  # fmt: skip
    k_desc = tl.make_tensor_descriptor(
        K + b * stride_kb + hk * stride_kh, shape=[NK, BLOCK_D], strides=[stride_kn, 1],
        block_shape=[BLOCK_N, BLOCK_D],
    )  # fmt: skip
    v_desc = tl.make_tensor_descriptor(
        V + b * stride_vb + hk * stride_vh, shape=[NK, BLOCK_DV], strides=[stride_vn, 1],
        block_shape=[BLOCK_N, BLOCK_DV],
    )  # fmt: skip
    q = q_desc.load([start_m, 0])
    m_i, l_i, acc = _softmax_init(BLOCK_M=BLOCK_M, BLOCK_DV=BLOCK_DV)
    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    for seg in tl.static_range(3):
        s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
        if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
            for start_n in range(s0, s1, BLOCK_N):
                acc, l_i, m_i = _tma_step(
                    acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, offs_n0, NQ, NK, offset,
                    win_left, win_right, qk_scale, sm_scale, softcap, MASKED=seg != 1,
                    HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, FOLD_SCALE=FOLD_SCALE,
                )  # fmt: skip
    _fwd_finish(
        Out, Lse, acc, l_i, m_i, b, h, pid_bh * NQ, offs_m, offs_dv,
        stride_ob, stride_oh, stride_om, stride_od, NQ, HEAD_DV, dropout_p,
        EVEN_D=True, HAS_DROPOUT=False, STORE_LSE=STORE_LSE,
    )  # fmt: skip
