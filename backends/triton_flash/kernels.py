"""FlashAttention-2 forward and backward in Triton, with the whole attnhub contract.

The kernels here are program-id mappings and walks over the band's segments; what they
compute per tile, and each pass's prologue and epilogue, is the kernel layer both Triton
families share (common.py). The glossary below holds for both.

Glossary
--------
B, H (= Hq), HKV      batch, query heads, key/value heads; GROUP = H // HKV query heads
                      share one key/value head (GQA/MQA): query head h reads kv head
                      h // GROUP. K/V are never repeated in memory.
NQ, NK                query and key lengths (any value >= 1, need not match).
HEAD_D, HEAD_DV       head dims of q/k and of v; BLOCK_D/BLOCK_DV are the next powers of
                      two, and loads mask the padding (no tensor is ever padded by copy).
s                     a score; kernels keep scores in log2 units (s * LOG2E) so that the
                      softmax uses exp2: LOG2E is folded into ``qk_scale``; with a float
                      mask (MASK_KIND 2), in natural units (common._scores). The stored
                      lse is natural-log (float32, (B, H, NQ), contiguous); with a float
                      mask Lse holds row stats instead: int64 (B, H, NQ), each row's max
                      (natural units) and log2 of its sum (common._load_lse2)
offset                where row i sits among the keys: key position i + offset
                      (0 for top_left, NK - NQ for bottom_right alignment).
band                  causal and window in one form: row i keeps keys
                      [i + offset - win_left, i + offset + win_right]; causal clamps
                      win_right to <= 0; an absent side is NQ + NK + 1025 ("unbounded",
                      beyond every padded tile: ops._band).
segments              for one row block, the key blocks it visits split in three:
                      [lo, f_lo) band edge (masked), [f_lo, f_hi) fully inside the band and
                      inside NK (no mask arithmetic at all), [f_hi, hi) band edge / NK tail
                      (masked). Key blocks outside the band are never visited. The
                      backward dK/dV kernel splits its query-block loop the same way.
delta                 rowsum(dO * O) (float32, (B, H, NQ)), from the preprocess kernel.
dropout               keep test ``rand(seed, ((b*H + h)*NQ + i)*NK + j) >= p`` with Triton's
                      Philox; the seed is one int64 drawn from torch's generator and read
                      from device memory; the backward regenerates the same numbers.

Program ids
-----------
forward, dQ, preprocess   axis 0: block of BLOCK_M query rows; axis 1: b * H + h
dK/dV                     axis 0: block of BLOCK_N keys;       axis 1: b * HKV + hkv; the
                          program loops over the GROUP query heads of its kv head, so dK/dV
                          need no atomics and the backward is deterministic.
merged backward           attn_bwd_kernel: the dK/dV and dQ programs above in one launch,
                          each program's role and (tile, b * head) derived from its ids
                          (grids in its docstring). The split launch runs the same programs
                          through attn_bwd_dkdv_kernel and attn_bwd_dq_kernel; all three
                          call _bwd_dkdv_program / _bwd_dq_program, so the two paths give
                          bitwise the same gradients.

Layout: every tensor is (B, heads, N, D) read through its four strides (transposed
(B, N, H, D) views work without a copy). Base offsets are int64.

Packed sequences (VARLEN=1, attnhub.attention_varlen)
    Q/Out/dO/dQ are (Tq, H, D) and K/V/dK/dV (Tk, HKV, D), passed as (B, heads, N, D)
    with batch stride 0; sequence b is rows CuQ[b]:CuQ[b + 1] of the queries and
    CuK[b]:CuK[b + 1] of the keys (:func:`_sequence`), and the kernels shift each base
    to its sequence's first row. b on the grid is the sequence; the grids cover the
    longest sequence (MAXQ, MAXK), and a program past its own sequence's rows (keys)
    visits nothing and stores nothing. NQ and NK are then the totals Tq and Tk: the lse
    and delta are (H, Tq), row (b, h, i) at h * Tq + CuQ[b] + i (``lse_row``). The
    offset argument is 1 for bottom_right and 0 for top_left; each sequence's offset
    is that times Nk_b - Nq_b. No attn_mask and no dropout (the call offers neither).

Key ranges (VARLEN=2, a dense call whose bool mask is a key padding mask)
    Dense tensors and outputs, every query row, and for batch entry b only the keys
    CuK[2b]:CuK[2b + 1] (an int32 (B, 2) tensor): the kernels shift the K/V/dK/dV bases
    to the range's first key and take its length as NK, and the diagonal's offset moves
    by the same amount, so causal and window keep their dense meaning. Key tiles outside
    the range are never visited; dK/dV rows outside it are never stored (the host
    zeroes them). The lse and delta are dense. No attn_mask and no dropout.

Constexpr knobs (each absent feature compiles away)
---------------------------------------------------
BLOCK_M, BLOCK_N      tile sizes (configs.py picks them per device/head dim/dtype)
BLOCK_M1, BLOCK_N1    the merged backward's dK/dV tiles (BLOCK_N1 keys per program, BLOCK_M1
BLOCK_M2, BLOCK_N2    rows per step) and dQ tiles (BLOCK_M2 rows, BLOCK_N2 keys per step);
                      HEAD_MAJOR its program order (attn_bwd_kernel)
EVEN_D                HEAD_D == BLOCK_D and HEAD_DV == BLOCK_DV: no head-dim load masks
HAS_BAND              causal or window: segment split and band masks in edge segments
HAS_SOFTCAP           scores c * tanh(s / c), and the (1 - tanh^2) factor in backward
MASK_KIND             0 none, 1 bool (True = keep), 2 float (added to scores); read
                      tile-wise through four strides (0 for broadcast dims)
HAS_DROPOUT           Philox keep mask per weight, regenerated in the backward
INPUT_PRECISION       "ieee" or "tf32" for float32 inputs (PyTorch's matmul precision)
FOLD_SCALE            forward only: qk_scale > 0, no softcap, no float mask; the scale
                      moves into the exponent's FMA (see _fwd_step)
MASK_HEAD, MASK_TAIL  whether the first / last masked segment can be non-empty (ops
                      decides from the band's sides and the lengths' divisibility by the
                      tiles); a segment that is always empty is not compiled at all:
                      its loop, even when it runs zero times, keeps its pointer tiles
                      live across the main loop (ptxas, sm_90: 20 more registers in the
                      D=64 forward, spills at BLOCK_N=128). The merged backward has one
                      pair per role, KV_MASK_HEAD/KV_MASK_TAIL and Q_MASK_HEAD/Q_MASK_TAIL,
                      each the split kernel's pair for that role's tiles
STRIDE_KN, STRIDE_VN  the row stride of a tensor a kernel streams through its loop (K/V
STRIDE_QM, STRIDE_DOM in the forward and dQ kernels, Q/dO in dK/dV) as a constant where
                      its rows are packed, else 0: the kernel then reads the runtime
                      stride. With a constant, each thread's row addresses are one base
                      plus immediates instead of a 64-bit register per row, live across
                      the loop (ops._row_strides has the measurements)
STORE_LSE             forward only: write Lse (False where the caller wants neither the
                      lse nor gradients: ops.flash_attention(return_lse=False) without grad)
VARLEN                0 dense; 1 packed sequences (above): CuQ, CuK are then the int32/int64
                      (B + 1,) cumulative lengths; 2 key ranges (above): CuK is the int32
                      (B, 2) ranges, CuQ never read (else any pointers, never read)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _DYNAMIC,
    _bwd_kv_inner,
    _bwd_q_inner,
    _compiled,
    _dkdv_finish,
    _dq_finish,
    _dq_operands,
    _fp32_scalars,
    _fwd_finish,
    _fwd_inner,
    _key_ranges,
    _kv_bases,
    _kv_operands,
    _load_rows,
    _query_head_bases,
    _query_ranges,
    _row_block,
    _row_dots,
    _row_streams,
    _row_stride,
    _segment,
    _softmax_init,
)


@triton.jit
def _sequence(CuQ, CuK, b, NQ, NK, offset, VARLEN: tl.constexpr):
    """(q0, k0, nq, nk, offset) of batch entry ``b``: its first query and key rows (int64),
    its lengths and its diagonal's offset. Dense: 0, 0, NQ, NK and ``offset`` as given.
    Packed sequences (VARLEN=1, glossary): read from CuQ/CuK, the offset placed per
    sequence. Key ranges (VARLEN=2, glossary): keys CuK[2b]:CuK[2b + 1] of every row,
    the keys renumbered from CuK[2b] and the dense offset moved with them."""
    if VARLEN == 1:
        q0 = tl.load(CuQ + b).to(tl.int64)
        k0 = tl.load(CuK + b).to(tl.int64)
        nq = (tl.load(CuQ + b + 1) - q0).to(tl.int32)
        nk = (tl.load(CuK + b + 1) - k0).to(tl.int32)
        offset = offset * (nk - nq)
    elif VARLEN == 2:
        q0 = 0
        k0 = tl.load(CuK + 2 * b).to(tl.int64)
        nq = NQ
        nk = (tl.load(CuK + 2 * b + 1) - k0).to(tl.int32)
        offset = offset - k0.to(tl.int32)
    else:
        q0 = 0
        k0 = 0
        nq = NQ
        nk = NK
    return q0, k0, nq, nk, offset


@triton.jit
def _lse_row(bh, h, NQ, q0, VARLEN: tl.constexpr):
    """Where row 0 of (b, h) sits in the lse and delta (``bh`` = b * H + h): bh * NQ in
    (B, H, NQ), h * Tq + q0 in packed sequences' (H, Tq) (NQ is Tq there)."""
    if VARLEN == 1:
        row = h * NQ + q0
    else:
        row = bh * NQ
    return row


@triton.jit
def _walked(length, start, own, VARLEN: tl.constexpr):
    """The length a program walks: ``length``, or for packed sequences and key ranges 0
    where the program's tile (from ``start``) lies past its sequence's ``own`` rows or
    keys (its segments are then empty and its masked stores write nothing)."""
    if VARLEN:
        length = tl.where(start < own, length, 0)
    return length


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_fwd_kernel(
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
    """Out (B, H, NQ, DV) and Lse (B, H, NQ) float32 natural log, for one row block
    (common._row_block's order). STORE_LSE=False: Lse is not written (a call whose caller
    neither returns the lse nor differentiates; Lse may then be any pointer)."""
    stride_kn = _row_stride(stride_kn, PACKED=STRIDE_KN)
    stride_vn = _row_stride(stride_vn, PACKED=STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m = _row_block(HEAVY_FIRST=HEAVY_FIRST) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    q0, k0, nq, nk, offset = _sequence(CuQ, CuK, b, NQ, NK, offset, VARLEN=VARLEN)
    lse_row = _lse_row(pid_bh, h, NQ, q0, VARLEN=VARLEN)
    if VARLEN:
        Q += q0 * stride_qm
        Out += q0 * stride_om
        K += k0 * stride_kn
        V += k0 * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = (
        Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qm
        + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :] * stride_qd
    )  # fmt: skip
    q = _load_rows(q_ptrs, offs_m, nq, offs_d, HEAD_D, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)
    k_base, v_base = _kv_bases(
        K, V, b, hk, offs_n0, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    )  # fmt: skip
    mask_rows, seed, drop_rows = _row_streams(
        Mask, Seed, b, h, pid_bh, offs_m, stride_mb, stride_mh, stride_mm, nq, nk,
        HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip
    m_i, l_i, acc = _softmax_init(BLOCK_M=BLOCK_M, BLOCK_DV=BLOCK_DV)

    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, _walked(nk, start_m, nq, VARLEN=VARLEN), offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    for seg in tl.static_range(3):
        s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
        if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
            s0_64 = s0.to(tl.int64)
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_base + s0_64 * stride_kn, v_base + s0_64 * stride_vn,
                mask_rows, drop_rows, seed, s0, s1, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, nq, nk, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N=BLOCK_N, MASKED=seg != 1, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                INPUT_PRECISION=INPUT_PRECISION, FOLD_SCALE=FOLD_SCALE,
            )  # fmt: skip

    _fwd_finish(
        Out, Lse, acc, l_i, m_i, b, h, lse_row, offs_m, offs_dv,
        stride_ob, stride_oh, stride_om, stride_od, nq, HEAD_DV, dropout_p,
        EVEN_D=EVEN_D, HAS_DROPOUT=HAS_DROPOUT, STORE_LSE=STORE_LSE,
        ROW_STATS=MASK_KIND == 2,
    )  # fmt: skip


@triton.jit(do_not_specialize=["NQ"])
def attn_bwd_preprocess_kernel(
    Out, DO, Delta, CuQ,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, NQ, HEAD_DV,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    VARLEN: tl.constexpr = False,
):  # fmt: skip
    """Delta (B, H, NQ) float32 = rowsum(dO * O), summed as the backward sums dP.

    dS = P * (dP - delta) cancels two sums of a row's products: dP_ij = dO_i . V_j
    (the dQ and dK/dV steps) and delta_i = dO_i . O_i. Where a row keeps one key, O_i is
    V_j bit for bit and the true dS is exactly 0; with delta a row sum here and dP a
    tl.dot there, the two sums differed in their last float32 bits, and dQ and dK came
    out as noise of 1e-5 and more instead of 0 (fp16, window (0, 0)). So delta is the
    diagonal of the dot products of dO's rows with O's, by :func:`_row_dots`, which also
    gives dP: the same products summed the same way. The (BLOCK_M, BLOCK_M) product
    costs BLOCK_M times the multiply-adds of the row sums, in a kernel bound by reading
    O and dO once."""
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    q0, _, nq, _, _ = _sequence(CuQ, CuQ, b, NQ, NQ, 0, VARLEN=VARLEN)
    lse_row = _lse_row(pid_bh, h, NQ, q0, VARLEN=VARLEN)
    if VARLEN:
        Out += q0 * stride_om
        DO += q0 * stride_dom
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m.to(tl.int64)[:, None]
    inb = (offs_m[:, None] < nq) & (offs_dv[None, :] < HEAD_DV)
    o = tl.load(
        Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_dv[None, :] * stride_od,
        mask=inb,
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_dv[None, :] * stride_dod,
        mask=inb,
        other=0.0,
    )
    dots = _row_dots(do, o.to(do.dtype), INPUT_PRECISION=INPUT_PRECISION)
    diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
    # One term per row: the sum is that term exactly, and a NaN in another row's dO or
    # O stays out of this row's delta.
    delta = tl.sum(tl.where(diagonal, dots, 0.0), 1)
    tl.store(Delta + lse_row + offs_m, delta, mask=offs_m < nq)


@triton.jit
def _bwd_dkdv_program(
    pid_n, pid_bh,
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MASK_HEAD: tl.constexpr, MASK_TAIL: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """One dK/dV program: dK (B, HKV, NK, D) and dV (B, HKV, NK, DV) for key block
    ``pid_n`` (keys pid_n * BLOCK_N .. + BLOCK_N - 1) of ``pid_bh`` = b * HKV + hkv, summed
    over the GROUP query heads that read it (in a fixed order: deterministic). Whichever
    launch runs it (:func:`attn_bwd_dkdv_kernel`, or the dK/dV role of
    :func:`attn_bwd_kernel`), a program computes the same values in the same order."""
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_n = pid_n * BLOCK_N
    pid_bh = pid_bh.to(tl.int64)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    q0, k0, nq, nk, offset = _sequence(CuQ, CuK, b, NQ, NK, offset, VARLEN=VARLEN)
    if VARLEN:
        Q += q0 * stride_qm
        DO += q0 * stride_dom
        K += k0 * stride_kn
        V += k0 * stride_vn
        DK += k0 * stride_dkn
        DV += k0 * stride_dvn
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k, v, dk, dv, seed = _kv_operands(
        K, V, Seed, b, hk, offs_n, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
        nk, HEAD_D, HEAD_DV, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        EVEN_D=EVEN_D, HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip
    lo, f_lo, f_hi, hi = _query_ranges(
        start_n, _walked(nq, start_n, nk, VARLEN=VARLEN), nk, offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base, do_base, lse_base, delta_base, mask_base, drop_base = _query_head_bases(
            Q, DO, Lse, Delta, Mask, b, h, _lse_row(bh, h, NQ, q0, VARLEN=VARLEN), offs_m0,
            offs_d, offs_dv, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh,
            stride_dom, stride_dod, stride_mb, stride_mh, nq, nk,
        )  # fmt: skip
        for seg in tl.static_range(3):
            s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
            if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
                s0_64 = s0.to(tl.int64)
                dk, dv = _bwd_kv_inner(
                    dk, dv, k, v, q_base + s0_64 * stride_qm, do_base + s0_64 * stride_dom,
                    lse_base + s0_64, delta_base + s0_64, mask_base, drop_base, seed,
                    s0, s1, offs_n, offs_m0, offs_d, offs_dv,
                    stride_qm, stride_dom, stride_mm, stride_mn,
                    nq, nk, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_M=BLOCK_M, MASKED=seg != 1, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                    HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                    INPUT_PRECISION=INPUT_PRECISION,
                )  # fmt: skip

    _dkdv_finish(
        DK, DV, dk, dv, b, hk, offs_n, offs_d, offs_dv,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
        stride_dvd, nk, HEAD_D, HEAD_DV, sm_scale,
    )  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dkdv_kernel(
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MASK_HEAD: tl.constexpr, MASK_TAIL: tl.constexpr,
    STRIDE_QM: tl.constexpr = 0, STRIDE_DOM: tl.constexpr = 0, VARLEN: tl.constexpr = False,
):  # fmt: skip
    """dK and dV, one program per (key block, b * HKV + hkv) on grid axes (0, 1): the split
    backward's first launch (see :func:`_bwd_dkdv_program`)."""
    stride_qm = _row_stride(stride_qm, PACKED=STRIDE_QM)
    stride_dom = _row_stride(stride_dom, PACKED=STRIDE_DOM)
    _bwd_dkdv_program(
        tl.program_id(0), tl.program_id(1),
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
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, EVEN_D=EVEN_D,
        HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
        INPUT_PRECISION=INPUT_PRECISION, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL, VARLEN=VARLEN,
    )  # fmt: skip


@triton.jit
def _bwd_dq_program(
    pid_m, pid_bh,
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MASK_HEAD: tl.constexpr, MASK_TAIL: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """One dQ program: dQ (B, H, NQ, D) for row block ``pid_m`` (rows pid_m * BLOCK_M ..
    + BLOCK_M - 1) of ``pid_bh`` = b * H + h (its own pass over the keys: no atomics).
    Whichever launch runs it (:func:`attn_bwd_dq_kernel`, or the dQ role of
    :func:`attn_bwd_kernel`), a program computes the same values in the same order."""
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m = pid_m * BLOCK_M
    pid_bh = pid_bh.to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    q0, k0, nq, nk, offset = _sequence(CuQ, CuK, b, NQ, NK, offset, VARLEN=VARLEN)
    if VARLEN:
        Q += q0 * stride_qm
        DO += q0 * stride_dom
        DQ += q0 * stride_dqm
        K += k0 * stride_kn
        V += k0 * stride_vn
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q, do, lse2, log2l, delta = _dq_operands(
        Q, DO, Lse, Delta, b, h, _lse_row(pid_bh, h, NQ, q0, VARLEN=VARLEN), offs_m, offs_d,
        offs_dv, stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom,
        stride_dod, nq, HEAD_D, HEAD_DV, EVEN_D=EVEN_D, MASK_KIND=MASK_KIND,
    )  # fmt: skip
    k_base, v_base = _kv_bases(
        K, V, b, hk, offs_n0, offs_d, offs_dv,
        stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    )  # fmt: skip
    mask_rows, seed, drop_rows = _row_streams(
        Mask, Seed, b, h, pid_bh, offs_m, stride_mb, stride_mh, stride_mm, nq, nk,
        HAS_DROPOUT=HAS_DROPOUT,
    )  # fmt: skip
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, _walked(nk, start_m, nq, VARLEN=VARLEN), offset, win_left, win_right,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HAS_BAND=HAS_BAND,
    )  # fmt: skip
    for seg in tl.static_range(3):
        s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
        if _compiled(seg=seg, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL):
            s0_64 = s0.to(tl.int64)
            dq = _bwd_q_inner(
                dq, q, do, lse2, log2l, delta, k_base + s0_64 * stride_kn, v_base + s0_64 * stride_vn,
                mask_rows, drop_rows, seed, s0, s1, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, nq, nk, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N=BLOCK_N, MASKED=seg != 1, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND,
                HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
                INPUT_PRECISION=INPUT_PRECISION,
            )  # fmt: skip

    _dq_finish(
        DQ, dq, b, h, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        nq, HEAD_D, sm_scale,
    )  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dq_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MASK_HEAD: tl.constexpr, MASK_TAIL: tl.constexpr,
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0, VARLEN: tl.constexpr = False,
    HEAVY_FIRST: tl.constexpr = False,
):  # fmt: skip
    """dQ, one program per (row block, b * H + h) on grid axes (0, 1; row blocks in
    common._row_block's order): the split backward's second launch (see
    :func:`_bwd_dq_program`)."""
    stride_kn = _row_stride(stride_kn, PACKED=STRIDE_KN)
    stride_vn = _row_stride(stride_vn, PACKED=STRIDE_VN)
    _bwd_dq_program(
        _row_block(HEAVY_FIRST=HEAVY_FIRST), tl.program_id(1),
        Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, CuQ, CuK,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
        qk_scale, sm_scale, softcap, dropout_p,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, EVEN_D=EVEN_D,
        HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
        INPUT_PRECISION=INPUT_PRECISION, MASK_HEAD=MASK_HEAD, MASK_TAIL=MASK_TAIL, VARLEN=VARLEN,
    )  # fmt: skip


@triton.jit(do_not_specialize=[*_DYNAMIC, "MAXQ", "MAXK"])
def attn_bwd_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, DK, DV, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    B, H, HKV, GROUP, NQ, NK, MAXQ, MAXK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    KV_MASK_HEAD: tl.constexpr, KV_MASK_TAIL: tl.constexpr,
    Q_MASK_HEAD: tl.constexpr, Q_MASK_TAIL: tl.constexpr,
    STRIDE_QM: tl.constexpr = 0, STRIDE_DOM: tl.constexpr = 0,
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0, VARLEN: tl.constexpr = False,
):  # fmt: skip
    """dQ, dK and dV in one launch (FlexAttention's backward structure): cdiv(MAXK, BLOCK_N1)
    dK/dV programs per b * HKV + hkv and cdiv(MAXQ, BLOCK_M2) dQ programs per b * H + h
    (MAXQ, MAXK: NQ and NK, or the longest packed sequence's lengths).
    Each program runs exactly one role, :func:`_bwd_dkdv_program` with tiles of BLOCK_N1
    keys (BLOCK_M1 query rows per step) or :func:`_bwd_dq_program` with tiles of BLOCK_M2
    rows (BLOCK_N2 keys per step), so the gradients are bitwise those of the split
    launches (the same programs summing in the same order; still no atomics). Each role
    has its own edge-segment flags (KV_MASK_*, Q_MASK_*: ops._edge_segments with that
    role's tiles), as the split kernels have. Both roles share the launch's options
    (num_warps, num_stages, maxnreg), and its registers: ptxas allocates the hungrier
    role's count (or more) to every program.

    Grid and program order (the hardware starts blocks in order, axis 0 fastest):
    HEAD_MAJOR=False  1-D: all dK/dV programs (key block fastest, then b * HKV + hkv),
                      then all dQ programs (row block fastest, then b * H + h): the
                      split launches' orders back to back, so the dQ programs fill the
                      tail of the dK/dV programs instead of waiting for it.
    HEAD_MAJOR=True   (cdiv(MAXK, BLOCK_N1) + GROUP * cdiv(MAXQ, BLOCK_M2), B * HKV):
                      FlexAttention's grid. Per kv head, its key blocks' dK/dV programs,
                      then the dQ programs of its GROUP query heads, so both roles run
                      side by side throughout and read one head's Q/K/V/dO at about the
                      same time (L2 reuse).
    """
    stride_qm = _row_stride(stride_qm, PACKED=STRIDE_QM)
    stride_dom = _row_stride(stride_dom, PACKED=STRIDE_DOM)
    stride_kn = _row_stride(stride_kn, PACKED=STRIDE_KN)
    stride_vn = _row_stride(stride_vn, PACKED=STRIDE_VN)
    # Each role's (tile, batch*head) is computed apart, not selected with tl.where: a
    # shared pair made both roles' index arithmetic identical, LLVM hoisted it above
    # the branch, and ptxas spilled 6x more in the dK/dV loop (bf16 D=128, (64,128,8,2):
    # 1656 spill bytes against 392; 264 for attn_bwd_dkdv_kernel alone).
    pid = tl.program_id(0)
    kv_tiles = tl.cdiv(MAXK, BLOCK_N1)
    q_tiles = tl.cdiv(MAXQ, BLOCK_M2)
    if HEAD_MAJOR:
        is_kv = pid < kv_tiles
        kv_tile = pid
        kv_bh = tl.program_id(1)
        # b * H + h for query head h = hkv * GROUP + g is (b * HKV + hkv) * GROUP + g.
        q_tile = (pid - kv_tiles) % q_tiles
        q_bh = tl.program_id(1) * GROUP + (pid - kv_tiles) // q_tiles
    else:
        n_kv = kv_tiles * B * HKV
        is_kv = pid < n_kv
        kv_tile = pid % kv_tiles
        kv_bh = pid // kv_tiles
        q_tile = (pid - n_kv) % q_tiles
        q_bh = (pid - n_kv) // q_tiles
    if is_kv:
        _bwd_dkdv_program(
            kv_tile, kv_bh,
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
            BLOCK_M=BLOCK_M1, BLOCK_N=BLOCK_N1, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, EVEN_D=EVEN_D,
            HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
            INPUT_PRECISION=INPUT_PRECISION, MASK_HEAD=KV_MASK_HEAD, MASK_TAIL=KV_MASK_TAIL,
            VARLEN=VARLEN,
        )  # fmt: skip
    else:
        _bwd_dq_program(
            q_tile, q_bh,
            Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, CuQ, CuK,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_mb, stride_mh, stride_mm, stride_mn,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            BLOCK_M=BLOCK_M2, BLOCK_N=BLOCK_N2, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, EVEN_D=EVEN_D,
            HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT,
            INPUT_PRECISION=INPUT_PRECISION, MASK_HEAD=Q_MASK_HEAD, MASK_TAIL=Q_MASK_TAIL,
            VARLEN=VARLEN,
        )  # fmt: skip
