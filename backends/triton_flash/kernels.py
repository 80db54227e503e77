"""FlashAttention-2 forward and backward in Triton, with the whole attnhub contract.

Glossary
--------
B, H (= Hq), HKV      batch, query heads, key/value heads; GROUP = H // HKV query heads
                      share one key/value head (GQA/MQA): query head h reads kv head
                      h // GROUP. K/V are never repeated in memory.
NQ, NK                query and key lengths (any value >= 1, need not match).
HEAD_D, HEAD_DV       head dims of q/k and of v; BLOCK_D/BLOCK_DV are the next powers of
                      two, and loads mask the padding (no tensor is ever padded by copy).
s                     a score; kernels keep scores in log2 units (s * LOG2E) so that the
                      softmax uses exp2: LOG2E is folded into ``qk_scale``. The stored lse
                      is natural-log (float32, (B, H, NQ), contiguous).
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
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural lse = log2-domain lse * LN2
# Triton's interpreter runs these kernels (TRITON_INTERPRET=1 when this module is
# imported, which is when Triton reads it to decorate them): see _row_dots.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): exact saturation at +-inf, one exp2, and it
    # runs in the interpreter (no libdevice there).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p):
    """The float arguments as float32. A plain launch types Python floats as fp32, but
    Inductor (torch.compile through wrap_triton) passes them as fp64, which would turn
    the scores, and so the loop-carried accumulators, into fp64."""
    return (
        tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32),
        tl.cast(softcap, tl.float32), tl.cast(dropout_p, tl.float32),
    )  # fmt: skip


@triton.jit
def _row_dots(a, b, INPUT_PRECISION: tl.constexpr):
    """(M, N) float32: the dot product of every row of ``a`` (M, K) with every row of
    ``b`` (N, K), as ``tl.dot(a, trans(b))``.

    The backward's dP_ij = dO_i . V_j and the preprocess's delta_i = dO_i . O_i go
    through here, so that where O_i is V_j bit for bit (a row that keeps one key, or
    whose other weights underflow), dP_ij - delta_i is exactly 0, as the true dS is: the
    same products, summed in the same order (attn_bwd_preprocess_kernel). tl.dot gives
    that on the GPU: an entry's sum does not depend on where it sits in which tile (seen
    on the H200: dQ and dK of a one-key-per-row window exactly 0 in fp16 at D = 32, 64,
    128, 1.4e-5 to 3.8e-5 with delta from a row sum). Triton's interpreter runs tl.dot
    as numpy's matmul, whose sums do depend on the matrix shapes; there the products
    are summed entry by entry (a numpy sum over K, the same for every entry), which
    the interpreter can afford."""
    if INTERPRETED:
        dots = tl.sum(a[:, None, :].to(tl.float32) * b[None, :, :].to(tl.float32), 2)
    else:
        dots = tl.dot(a, tl.trans(b), input_precision=INPUT_PRECISION)
    return dots


@triton.jit
def _load_rows(ptrs, rows, nrows, cols, ncols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a (rows, cols) tile, masking only the dimensions that can run out of bounds."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < nrows) & (cols[None, :] < ncols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < nrows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < ncols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _key_ranges(
    start_m, NK, offset, win_left, win_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BAND: tl.constexpr,
):  # fmt: skip
    """Key segments [lo, f_lo) masked, [f_lo, f_hi) unmasked, [f_hi, hi) masked for rows
    start_m .. start_m + BLOCK_M - 1. Block starts are multiples of BLOCK_N."""
    if HAS_BAND:
        last = start_m + BLOCK_M - 1
        lo = tl.maximum(start_m + offset - win_left, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(last + offset + win_right + 1, NK)
        hi = tl.maximum(hi, lo)
        # A key block is unmasked when every row of this block keeps all its keys.
        f_lo = (tl.maximum(last + offset - win_left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        f_hi = tl.maximum(start_m + offset + win_right + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = NK * 0
        hi = NK
        f_lo = NK * 0
        f_hi = NK
    f_hi = tl.minimum(f_hi, NK // BLOCK_N * BLOCK_N)
    f_lo = tl.minimum(tl.maximum(f_lo, lo), hi)
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), hi)
    return lo, f_lo, f_hi, hi


@triton.jit
def _query_ranges(
    start_n, NQ, NK, offset, win_left, win_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BAND: tl.constexpr,
):  # fmt: skip
    """Query segments (masked, unmasked, masked) for keys start_n .. start_n + BLOCK_N - 1:
    the transpose of :func:`_key_ranges`. Block starts are multiples of BLOCK_M."""
    if HAS_BAND:
        # row i keeps key k iff i + offset - win_left <= k <= i + offset + win_right
        lo = tl.maximum(start_n - offset - win_right, 0) // BLOCK_M * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N - offset + win_left, NQ)
        hi = tl.maximum(hi, lo)
        f_lo = tl.maximum(start_n + BLOCK_N - 1 - offset - win_right, 0)
        f_lo = (f_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        f_hi = tl.maximum(start_n - offset + win_left + 1, 0) // BLOCK_M * BLOCK_M
    else:
        lo = NQ * 0
        hi = NQ
        f_lo = NQ * 0
        f_hi = NQ
    f_hi = tl.minimum(f_hi, NQ // BLOCK_M * BLOCK_M)
    # The last key block runs past NK: every query block needs the key bound mask.
    f_hi = tl.where(start_n + BLOCK_N > NK, 0, f_hi)
    f_lo = tl.minimum(tl.maximum(f_lo, lo), hi)
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), hi)
    return lo, f_lo, f_hi, hi


@triton.jit
def _segment(seg: tl.constexpr, lo, f_lo, f_hi, hi):
    """(start, end) of segment ``seg``: 0 the masked head [lo, f_lo), 1 the unmasked
    middle [f_lo, f_hi), 2 the masked tail [f_hi, hi) (glossary, "segments")."""
    if seg == 0:
        s0 = lo
        s1 = f_lo
    elif seg == 1:
        s0 = f_lo
        s1 = f_hi
    else:
        s0 = f_hi
        s1 = hi
    return s0, s1


@triton.jit
def _compiled(seg: tl.constexpr, MASK_HEAD: tl.constexpr, MASK_TAIL: tl.constexpr):
    """Whether segment ``seg`` is compiled at all (MASK_HEAD / MASK_TAIL, glossary)."""
    return (seg == 0 and MASK_HEAD) or seg == 1 or (seg == 2 and MASK_TAIL)


@triton.jit
def _row_stride(runtime, PACKED: tl.constexpr):
    """A streamed tensor's row stride: the compile-time PACKED where ops set it (the
    STRIDE_* knobs, glossary), else the runtime argument."""
    if PACKED != 0:
        stride = PACKED
    else:
        stride = runtime
    return stride


@triton.jit
def _scores(
    qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
    mask_rows, stride_mn, qk_scale, sm_scale, softcap,
    MASKED: tl.constexpr, HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr, ROWS_FIRST: tl.constexpr, UNSCALED: tl.constexpr,
):  # fmt: skip
    """Final scores in log2 units from raw q.k products, in the contract's order:
    scale, softcap, + float mask, masked -> -inf. Returns (s, tanh) (tanh for backward).

    ROWS_FIRST: qk is (rows, keys); otherwise (keys, rows) as in the dK/dV kernel.
    UNSCALED (only without softcap and float mask): s is the masked raw product, and the
    caller applies ``qk_scale`` (see FOLD_SCALE in :func:`_fwd_step`).
    ``mask_rows`` points at the attn_mask rows of offs_m (int64 row offsets applied).
    """
    if ROWS_FIRST:
        rows = offs_m[:, None]
        cols = offs_n[None, :]
    else:
        rows = offs_m[None, :]
        cols = offs_n[:, None]
    if HAS_SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        s = t * (softcap * LOG2E)
    else:
        t = qk  # unused
        if UNSCALED:
            s = qk
        else:
            s = qk * qk_scale
    if MASK_KIND != 0:
        if ROWS_FIRST:
            mptrs = mask_rows[:, None] + cols.to(tl.int64) * stride_mn
        else:
            mptrs = mask_rows[None, :] + cols.to(tl.int64) * stride_mn
        inb = (rows < NQ) & (cols < NK)
        if MASK_KIND == 1:
            allowed = tl.load(mptrs, mask=inb, other=0) != 0
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = s + tl.load(mptrs, mask=inb, other=0.0).to(tl.float32) * LOG2E
    if MASKED:
        keep = (cols < NK) & (rows < NQ)
        if HAS_BAND:
            pos = rows + offset
            keep = keep & (cols >= pos - win_left) & (cols <= pos + win_right)
        s = tl.where(keep, s, float("-inf"))
    return s, t


@triton.jit
def _fwd_step(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, tile_ptrs, mask_rows, drop_rows, seed,
    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_TILE: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    """One key tile (keys start_n .. start_n + BLOCK_N - 1; k_ptrs/v_ptrs point at its
    first row) folded into the running softmax. HAS_TILE: also apply a (rows, keys)
    uint8 token mask read at tile_ptrs (block-sparse partial blocks).

    FOLD_SCALE (no softcap, no float mask, qk_scale > 0): the row max is taken over the
    raw products and scaled once per row (a positive scale commutes with max), and the
    scale enters the exponent as one FMA per score, s * qk_scale - m, instead of a
    multiply and a subtract: about a tenth of the main loop's instructions at D=64
    (SASS, sm_90), in a loop that issues about as many instructions as its matrix
    products take cycles."""
    offs_n = start_n + offs_n0
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, MASKED, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, _t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_rows, stride_mn, qk_scale, sm_scale, softcap,
        MASKED, HAS_BAND, HAS_SOFTCAP, MASK_KIND, True, FOLD_SCALE,
    )  # fmt: skip
    if HAS_TILE:
        s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED or MASK_KIND != 0 or HAS_TILE:
        # A row with no kept key so far has m_new = -inf: shift by 0 instead, so
        # that exp2(-inf - -inf) never makes a NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    if FOLD_SCALE:
        p = tl.exp2(s * qk_scale - m_use[:, None])
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        # The softmax sum uses every weight; only the output sees the dropped ones.
        rnd = tl.rand(seed, drop_rows[:, None] + offs_n[None, :])
        p = tl.where(rnd >= dropout_p, p, 0.0)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, MASKED, not EVEN_D)
    acc += tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
    start, end, offs_m, offs_n0, offs_d, offs_dv,
    stride_kn, stride_vn, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr, FOLD_SCALE: tl.constexpr,
):  # fmt: skip
    # k_ptrs/v_ptrs point at key row `start`; advanced by BLOCK_N rows per step.
    for start_n in range(start, end, BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed,
            start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
            NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            MASKED, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, False,
            FOLD_SCALE,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# Lengths and band edges are not specialized: a value of 1 would become a constexpr
# (breaking scalar arithmetic such as NK * 0), and every new length would recompile.
_DYNAMIC = ["NQ", "NK", "offset", "win_left", "win_right"]


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_fwd_kernel(
    Q, K, V, Mask, Seed, Out, Lse,
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
    STORE_LSE: tl.constexpr = True,
):  # fmt: skip
    """Out (B, H, NQ, DV) and Lse (B, H, NQ) float32 natural log, for one row block.
    STORE_LSE=False: Lse is not written (a call whose caller neither returns the lse nor
    differentiates; Lse may then be any pointer)."""
    stride_kn = _row_stride(stride_kn, STRIDE_KN)
    stride_vn = _row_stride(stride_vn, STRIDE_VN)
    qk_scale, sm_scale, softcap, dropout_p = _fp32_scalars(qk_scale, sm_scale, softcap, dropout_p)
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_ptrs = (
        Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qm
        + tl.arange(0, BLOCK_M)[:, None] * stride_qm + offs_d[None, :] * stride_qd
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
        drop_rows = (pid_bh * NQ + offs_m) * NK  # int64: unique Philox offset per (b, h, i, j)
    else:
        seed = 0
        drop_rows = offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, f_lo, f_hi, hi = _key_ranges(
        start_m, NK, offset, win_left, win_right, BLOCK_M, BLOCK_N, HAS_BAND
    )
    for seg in tl.static_range(3):
        s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
        if _compiled(seg, MASK_HEAD, MASK_TAIL):
            s0_64 = s0.to(tl.int64)
            acc, l_i, m_i = _fwd_inner(
                acc, l_i, m_i, q, k_base + s0_64 * stride_kn, v_base + s0_64 * stride_vn,
                mask_rows, drop_rows, seed, s0, s1, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, seg != 1, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                INPUT_PRECISION, FOLD_SCALE,
            )  # fmt: skip

    # Rows with no kept key: l_i == 0 -> output 0 and lse -inf (never 0/0).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    if HAS_DROPOUT:
        l_safe = l_safe * (1.0 - dropout_p)  # kept weights are scaled by 1 / (1 - p)
    out = acc / l_safe[:, None]
    o_ptrs = (
        Out + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )  # fmt: skip
    if EVEN_D:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < NQ)
    else:
        tl.store(
            o_ptrs, out.to(Out.dtype.element_ty),
            mask=(offs_m[:, None] < NQ) & (offs_dv[None, :] < HEAD_DV),
        )  # fmt: skip
    if STORE_LSE:
        tl.store(Lse + pid_bh * NQ + offs_m, lse, mask=offs_m < NQ)


@triton.jit(do_not_specialize=["NQ"])
def attn_bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, NQ, HEAD_DV,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr,
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
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = offs_m.to(tl.int64)[:, None]
    inb = (offs_m[:, None] < NQ) & (offs_dv[None, :] < HEAD_DV)
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
    dots = _row_dots(do, o.to(do.dtype), INPUT_PRECISION)
    diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
    # One term per row: the sum is that term exactly, and a NaN in another row's dO or
    # O stays out of this row's delta.
    delta = tl.sum(tl.where(diagonal, dots, 0.0), 1)
    tl.store(Delta + pid_bh * NQ + offs_m, delta, mask=offs_m < NQ)


@triton.jit
def _load_lse2(lse_ptrs, rows, NQ, CHECK: tl.constexpr):
    """lse in log2 units; rows with no kept key (lse = -inf) get 0, so that
    exp2(-inf - 0) = 0 gives them zero weights and zero gradients instead of NaN."""
    if CHECK:
        lse = tl.load(lse_ptrs, mask=rows < NQ, other=0.0)
    else:
        lse = tl.load(lse_ptrs)
    return tl.where(lse == float("-inf"), 0.0, lse * LOG2E)


@triton.jit
def _bwd_kv_step(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, tile_ptrs, mask_base, drop_base, seed,
    start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_TILE: tl.constexpr,
):  # fmt: skip
    """One query tile (rows start_m .. start_m + BLOCK_M - 1, pointers at its first row)
    added to dK/dV. Works on transposed tiles (keys, rows), as Triton's fused-attention
    tutorial. HAS_TILE: also apply a (keys, rows) token mask read at tile_ptrs."""
    offs_m = start_m + offs_m0
    q = _load_rows(q_ptrs, offs_m, NQ, offs_d, HEAD_D, MASKED, not EVEN_D)
    do = _load_rows(do_ptrs, offs_m, NQ, offs_dv, HEAD_DV, MASKED, not EVEN_D)
    lse2 = _load_lse2(lse_ptrs, offs_m, NQ, MASKED)
    if MASKED:
        delta = tl.load(delta_ptrs, mask=offs_m < NQ, other=0.0)
    else:
        delta = tl.load(delta_ptrs)
    qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    sT, tT = _scores(
        qkT, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_base + offs_m.to(tl.int64) * stride_mm, stride_mn, qk_scale, sm_scale, softcap,
        MASKED, HAS_BAND, HAS_SOFTCAP, MASK_KIND, False, False,
    )  # fmt: skip
    if HAS_TILE:
        sT = tl.where(tl.load(tile_ptrs) != 0, sT, float("-inf"))
    pT = tl.exp2(sT - lse2[None, :])
    dpT = _row_dots(v, do, INPUT_PRECISION)
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


@triton.jit
def _bwd_kv_inner(
    dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mask_base, drop_base, seed,
    start, end, offs_n, offs_m0, offs_d, offs_dv,
    stride_qm, stride_dom, stride_mm, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # The row pointers point at query row `start`; advanced by BLOCK_M rows per step.
    for start_m in range(start, end, BLOCK_M):
        dk, dv = _bwd_kv_step(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, q_ptrs, mask_base, drop_base,
            seed, start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn,
            NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            MASKED, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, False,
        )  # fmt: skip
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _bwd_dkdv_program(
    pid_n, pid_bh,
    Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
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
            DO
            + b * stride_dob
            + h * stride_doh
            + offs_m0[:, None] * stride_dom
            + offs_dv[None, :] * stride_dod
        )
        lse_base = Lse + bh * NQ + offs_m0
        delta_base = Delta + bh * NQ + offs_m0
        mask_base = Mask + b * stride_mb + h * stride_mh
        drop_base = bh * NQ * NK
        for seg in tl.static_range(3):
            s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
            if _compiled(seg, MASK_HEAD, MASK_TAIL):
                s0_64 = s0.to(tl.int64)
                dk, dv = _bwd_kv_inner(
                    dk, dv, k, v, q_base + s0_64 * stride_qm, do_base + s0_64 * stride_dom,
                    lse_base + s0_64, delta_base + s0_64, mask_base, drop_base, seed,
                    s0, s1, offs_n, offs_m0, offs_d, offs_dv,
                    stride_qm, stride_dom, stride_mm, stride_mn,
                    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                    qk_scale, sm_scale, softcap, dropout_p,
                    BLOCK_M, seg != 1, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
                    HAS_DROPOUT, INPUT_PRECISION,
                )  # fmt: skip

    dk = dk * sm_scale  # d(scale * qk)/d(qk)
    inb_n = offs_n[:, None] < NK
    tl.store(DK + b * stride_dkb + hk * stride_dkh + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=inb_n & (offs_d[None, :] < HEAD_D))  # fmt: skip
    tl.store(DV + b * stride_dvb + hk * stride_dvh + rows_n * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb_n & (offs_dv[None, :] < HEAD_DV))  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dkdv_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
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
    STRIDE_QM: tl.constexpr = 0, STRIDE_DOM: tl.constexpr = 0,
):  # fmt: skip
    """dK and dV, one program per (key block, b * HKV + hkv) on grid axes (0, 1): the split
    backward's first launch (see :func:`_bwd_dkdv_program`)."""
    stride_qm = _row_stride(stride_qm, STRIDE_QM)
    stride_dom = _row_stride(stride_dom, STRIDE_DOM)
    _bwd_dkdv_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dkb, stride_dkh, stride_dkn, stride_dkd,
        stride_dvb, stride_dvh, stride_dvn, stride_dvd,
        H, HKV, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
        qk_scale, sm_scale, softcap, dropout_p,
        BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
        HAS_DROPOUT, INPUT_PRECISION, MASK_HEAD, MASK_TAIL,
    )  # fmt: skip


@triton.jit
def _bwd_q_step(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, tile_ptrs, mask_rows, drop_rows, seed,
    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_TILE: tl.constexpr,
):  # fmt: skip
    """One key tile (pointers at its first row) added to dQ. HAS_TILE: also apply a
    (rows, keys) token mask read at tile_ptrs."""
    offs_n = start_n + offs_n0
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, MASKED, not EVEN_D)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, MASKED, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_rows, stride_mn, qk_scale, sm_scale, softcap,
        MASKED, HAS_BAND, HAS_SOFTCAP, MASK_KIND, True, False,
    )  # fmt: skip
    if HAS_TILE:
        s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    dp = _row_dots(do, v, INPUT_PRECISION)
    if HAS_DROPOUT:
        rnd = tl.rand(seed, drop_rows[:, None] + offs_n[None, :])
        dp = tl.where(rnd >= dropout_p, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _bwd_q_inner(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
    start, end, offs_m, offs_n0, offs_d, offs_dv,
    stride_kn, stride_vn, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    HAS_BAND: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # k_ptrs/v_ptrs point at key row `start`; advanced by BLOCK_N rows per step.
    for start_n in range(start, end, BLOCK_N):
        dq = _bwd_q_step(
            dq, q, do, lse2, delta, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed,
            start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
            NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            MASKED, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT, INPUT_PRECISION, False,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit
def _bwd_dq_program(
    pid_m, pid_bh,
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
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
    for seg in tl.static_range(3):
        s0, s1 = _segment(seg, lo, f_lo, f_hi, hi)
        if _compiled(seg, MASK_HEAD, MASK_TAIL):
            s0_64 = s0.to(tl.int64)
            dq = _bwd_q_inner(
                dq, q, do, lse2, delta, k_base + s0_64 * stride_kn, v_base + s0_64 * stride_vn,
                mask_rows, drop_rows, seed, s0, s1, offs_m, offs_n0, offs_d, offs_dv,
                stride_kn, stride_vn, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
                qk_scale, sm_scale, softcap, dropout_p,
                BLOCK_N, seg != 1, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND, HAS_DROPOUT,
                INPUT_PRECISION,
            )  # fmt: skip

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_D))  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_dq_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
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
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0,
):  # fmt: skip
    """dQ, one program per (row block, b * H + h) on grid axes (0, 1): the split
    backward's second launch (see :func:`_bwd_dq_program`)."""
    stride_kn = _row_stride(stride_kn, STRIDE_KN)
    stride_vn = _row_stride(stride_vn, STRIDE_VN)
    _bwd_dq_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_mb, stride_mh, stride_mm, stride_mn,
        stride_dob, stride_doh, stride_dom, stride_dod,
        stride_dqb, stride_dqh, stride_dqm, stride_dqd,
        H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
        qk_scale, sm_scale, softcap, dropout_p,
        BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
        HAS_DROPOUT, INPUT_PRECISION, MASK_HEAD, MASK_TAIL,
    )  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def attn_bwd_kernel(
    Q, K, V, Mask, Seed, DO, Lse, Delta, DQ, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    B, H, HKV, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr,
    BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HEAD_MAJOR: tl.constexpr,
    KV_MASK_HEAD: tl.constexpr, KV_MASK_TAIL: tl.constexpr,
    Q_MASK_HEAD: tl.constexpr, Q_MASK_TAIL: tl.constexpr,
    STRIDE_QM: tl.constexpr = 0, STRIDE_DOM: tl.constexpr = 0,
    STRIDE_KN: tl.constexpr = 0, STRIDE_VN: tl.constexpr = 0,
):  # fmt: skip
    """dQ, dK and dV in one launch (FlexAttention's backward structure): cdiv(NK, BLOCK_N1)
    dK/dV programs per b * HKV + hkv and cdiv(NQ, BLOCK_M2) dQ programs per b * H + h.
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
    HEAD_MAJOR=True   (cdiv(NK, BLOCK_N1) + GROUP * cdiv(NQ, BLOCK_M2), B * HKV):
                      FlexAttention's grid. Per kv head, its key blocks' dK/dV programs,
                      then the dQ programs of its GROUP query heads, so both roles run
                      side by side throughout and read one head's Q/K/V/dO at about the
                      same time (L2 reuse).
    """
    stride_qm = _row_stride(stride_qm, STRIDE_QM)
    stride_dom = _row_stride(stride_dom, STRIDE_DOM)
    stride_kn = _row_stride(stride_kn, STRIDE_KN)
    stride_vn = _row_stride(stride_vn, STRIDE_VN)
    # Each role's (tile, batch*head) is computed apart, not selected with tl.where: a
    # shared pair made both roles' index arithmetic identical, LLVM hoisted it above
    # the branch, and ptxas spilled 6x more in the dK/dV loop (bf16 D=128, (64,128,8,2):
    # 1656 spill bytes against 392; 264 for attn_bwd_dkdv_kernel alone).
    pid = tl.program_id(0)
    kv_tiles = tl.cdiv(NK, BLOCK_N1)
    q_tiles = tl.cdiv(NQ, BLOCK_M2)
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
            Q, K, V, Mask, Seed, DO, Lse, Delta, DK, DV,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_mb, stride_mh, stride_mm, stride_mn,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dkb, stride_dkh, stride_dkn, stride_dkd,
            stride_dvb, stride_dvh, stride_dvn, stride_dvd,
            H, HKV, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            BLOCK_M1, BLOCK_N1, BLOCK_D, BLOCK_DV, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
            HAS_DROPOUT, INPUT_PRECISION, KV_MASK_HEAD, KV_MASK_TAIL,
        )  # fmt: skip
    else:
        _bwd_dq_program(
            q_tile, q_bh,
            Q, K, V, Mask, Seed, DO, Lse, Delta, DQ,
            stride_qb, stride_qh, stride_qm, stride_qd,
            stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd,
            stride_mb, stride_mh, stride_mm, stride_mn,
            stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            H, GROUP, NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
            qk_scale, sm_scale, softcap, dropout_p,
            BLOCK_M2, BLOCK_N2, BLOCK_D, BLOCK_DV, EVEN_D, HAS_BAND, HAS_SOFTCAP, MASK_KIND,
            HAS_DROPOUT, INPUT_PRECISION, Q_MASK_HEAD, Q_MASK_TAIL,
        )  # fmt: skip
