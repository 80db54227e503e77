"""The kernel layer both Triton families build on: the jitted helpers that
triton_flash's kernels (kernels.py) and triton_blocksparse's kernels call.

Everything a kernel does besides choosing which tiles to visit lives here: the score
pipeline (``_scores``), the tile loads, the band arithmetic (``_key_ranges``,
``_query_ranges``), the per-tile steps and loops of the forward, dQ and dK/dV passes,
and each pass's prologue (operands, stream pointers, accumulators) and epilogue
(normalize, lse, store). A kernel of either family is then a program-id mapping, a
prologue, a walk over key (query) tiles, and an epilogue: the dense kernels walk the
band's three segments, the block-sparse ones the layout's block lists, with the same
steps. Compile-time switches are passed by keyword at the call sites
(``MASKED=True, EVEN_D=EVEN_D``), so a call says which variant it compiles.

The glossary of names (band, offset, segments, delta, dropout stream, program ids,
constexpr knobs) is kernels.py's. Moving the code here cost no instructions: on the
ahead-of-time check's quick variants (sm_90, 12 dense and 11 block-sparse launches),
15 kernels compiled to identical SASS, the others to the same or fewer instructions
(the fp32 forward 24 fewer; the block-sparse forward, whose output store now skips the
head-dim mask where EVEN_D as the dense one does, 8 fewer) with the same highest
register, in a different order. ``python benchmarks/aot_check.py --sass-dir DIR``
(and ``--blocksparse``) writes each launch's SASS, to diff two trees.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) == exp2(x * LOG2E)


LN2 = tl.constexpr(0.6931471805599453)  # ln(2): natural lse = log2-domain lse * LN2


FP32_MAX = tl.constexpr(3.4028234663852886e38)  # float32's largest finite value


# Triton's interpreter runs these kernels (TRITON_INTERPRET=1 when this module is
# imported, which is when Triton reads it to decorate them): see _row_dots.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def interpreting() -> bool:
    """Triton's interpreter is on (read when the kernels are decorated, at import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Lengths and band edges are not specialized: a value of 1 would become a constexpr
# (breaking scalar arithmetic such as NK * 0), and every new length would recompile.
_DYNAMIC = ["NQ", "NK", "offset", "win_left", "win_right"]


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh in float32. FAST (half-precision inputs, compiled): PTX ``tanh.approx.f32``,
    one special-function instruction, relative error about 2**-11 (float16's own
    rounding): the softcap's forward 1.34x and forward+backward 1.14x faster at Gemma 2's
    global call on the H100 (results/archive/softcap-probe-h100-2026-12-06-*).

    Otherwise (float32, and the interpreter, which has no inline assembly): below
    |x| = 1/4 the odd series to x**9 (truncation under 1e-8 of tanh there), above it
    1 - 2 / (exp(2x) + 1) (one exp2 and a division; exact saturation at +-inf). The
    formula alone cancels near 0, off by about 6e-8 absolute, which the softcap c
    scales: float32 scores c * tanh(s / c) broke the contract's tolerance from c = 64
    on; with the series, 0.2x the bound up to c = 2048 in the interpreter."""
    if FAST and not INTERPRETED:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    x2 = x * x
    series = x2 * (62.0 / 2835.0) - 17.0 / 315.0
    series = series * x2 + 2.0 / 15.0
    series = series * x2 - 1.0 / 3.0
    formula = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    return tl.where(tl.abs(x) < 0.25, x + x * (x2 * series), formula)


@triton.jit
def _row_block(HEAVY_FIRST: tl.constexpr):
    """This program's row block (grid axis 0) for the forward and dQ kernels. With
    HEAVY_FIRST the blocks run last first: under a causal band the last rows walk the
    most keys, and the GPU starts programs in grid order (axis 0 fastest), so each
    head's heaviest block starts first and the grid ends on light blocks instead of a
    heavy one started late (ops._heavy_first decides where)."""
    pid_m = tl.program_id(0)
    if HEAVY_FIRST:
        pid_m = tl.num_programs(0) - 1 - pid_m
    return pid_m


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
    FAST_TANH: tl.constexpr,
):  # fmt: skip
    """Final scores from raw q.k products, in the contract's order: scale, softcap,
    + float mask, masked -> -inf. Returns (s, tanh) (tanh for backward).

    Units: log2 (``s * log2 e``), but natural with a float mask (MASK_KIND 2), where
    the softmax steps take them so (``NATURAL`` in :func:`_softmax_update` and
    :func:`_weights`). A float mask's finite entries reach +-FP32_MAX (finfo.min
    padding masks: -3.4e38), beyond what log2 units hold (FP32_MAX / log2 e): each
    entry would need a clamp in the key loop (sm_90 SASS of the D=64 forward: 1,337
    instructions a tile with it, 808 in natural units, 991 with a bool mask).
    In natural units the mask adds in as it is, and the exponent's difference s - m is
    taken before it is scaled by log2 e: a difference that overflows is -inf, a weight
    of 0, as the exact one rounds to.

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
        # Both scalar factors are clamped to float32's range: scalar work that the
        # compiler hoists out of the key loop (sm_90 SASS: 3 FMNMX per pass, in the
        # prologue; the loop is unchanged), where a per-score guard would cost every
        # score. sm_scale / softcap overflows to inf for a huge scale over a small cap
        # (1e30 / 1e-10), and a q.k of exactly 0 then gave 0 * inf = NaN where the
        # contract's tanh(0) is 0; clamped, tanh still saturates (+-1) wherever the
        # true ratio does, but for |q.k| < 3e-38. softcap * LOG2E overflows for a
        # softcap above FP32_MAX / LOG2E (2.36e38), and t * inf gave NaN (t = 0) or an
        # inf row max (then inf - inf); clamped, the log2-unit scores are scaled by
        # FP32_MAX / (softcap * LOG2E), between 1 / LOG2E and 1, which leaves every
        # weight as it was (_tanh's t = 1 - y is a multiple of 2**-24, so scores with
        # distinct t differ by 2e31 or more in the exponent: one-hot either way), but
        # such a call's lse is finite and about that factor short of the contract's:
        # its scores near +-softcap have no float32 value in log2 units.
        ratio = tl.minimum(tl.maximum(sm_scale / softcap, -FP32_MAX), FP32_MAX)
        t = _tanh(qk * ratio, FAST_TANH)
        if MASK_KIND == 2:
            s = t * softcap
        else:
            s = t * tl.minimum(softcap * LOG2E, FP32_MAX)
    else:
        t = qk  # unused
        if UNSCALED:
            s = qk
        elif MASK_KIND == 2:
            s = qk * sm_scale
        else:
            s = qk * qk_scale
    if MASK_KIND != 0:
        if ROWS_FIRST:
            mptrs = mask_rows[:, None] + cols.to(tl.int64) * stride_mn
        else:
            mptrs = mask_rows[None, :] + cols.to(tl.int64) * stride_mn
        # Only a tile that may pass the keys' end (MASKED) bounds the mask's columns: a
        # load mask that varies along the keys, its contiguous axis, makes each entry
        # its own scalar load (sm_90 SASS: 32 LDG.E.U8 a tile at D=128 bf16 instead of
        # vectors). Rows past the queries' end are cut in every tile (the last query
        # block's rows would read past the mask).
        if MASKED:
            inb = (rows < NQ) & (cols < NK)
        else:
            inb = rows < NQ
        if MASK_KIND == 1:
            allowed = tl.load(mptrs, mask=inb, other=0) != 0
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = s + tl.load(mptrs, mask=inb, other=0.0).to(tl.float32)
    if MASKED:
        keep = (cols < NK) & (rows < NQ)
        if HAS_BAND:
            pos = rows + offset
            keep = keep & (cols >= pos - win_left) & (cols <= pos + win_right)
        s = tl.where(keep, s, float("-inf"))
    return s, t


@triton.jit
def _softmax_update(
    s, l_i, m_i, acc, qk_scale, MAY_BE_EMPTY: tl.constexpr, FOLD_SCALE: tl.constexpr,
    NATURAL: tl.constexpr = False,
):  # fmt: skip
    """The online softmax's step for one tile of scores ``s`` (log2 units; raw products
    where FOLD_SCALE, see :func:`_fwd_step`; natural units where NATURAL, a float
    mask's, see :func:`_scores`): the tile's weights p, the rescaled row sums and
    accumulator, and the new row max (in the scores' units). MAY_BE_EMPTY: a row may
    have no kept key so far (masked scores)."""
    if FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        # A row with no kept key so far has m_new = -inf: shift by 0 instead, so
        # that exp2(-inf - -inf) never makes a NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if NATURAL:
        alpha = tl.exp2((m_i - m_use) * LOG2E)
        p = tl.exp2((s - m_use[:, None]) * LOG2E)
    elif FOLD_SCALE:
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * qk_scale - m_use[:, None])
    else:
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, l_i, acc, m_new


@triton.jit
def _tile_keys(start_n, offs_n0):
    """The keys of the tile that starts at ``start_n``: ``start_n + offs_n0``. Every tile
    starts on a multiple of its width (the segments of :func:`_key_ranges`, block-sparse
    blocks and their sub-tiles), and the compiler is told so: an attn_mask row's entries
    for the tile are then aligned vectors, not one load each."""
    # (A hint on the scalar start is lost where it is a loop's induction variable: it
    # has no defining op to carry the attribute. The tensor's addition has one.)
    return tl.multiple_of(start_n + offs_n0, offs_n0.shape[0])


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
    offs_n = _tile_keys(start_n, offs_n0)
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, _t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right, mask_rows, stride_mn, qk_scale,
        sm_scale, softcap, MASKED=MASKED, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
        MASK_KIND=MASK_KIND, ROWS_FIRST=True, UNSCALED=FOLD_SCALE, FAST_TANH=k.dtype != tl.float32,
    )  # fmt: skip
    if HAS_TILE:
        s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    p, l_i, acc, m_new = _softmax_update(
        s, l_i, m_i, acc, qk_scale, MAY_BE_EMPTY=MASKED or MASK_KIND != 0 or HAS_TILE,
        FOLD_SCALE=FOLD_SCALE, NATURAL=MASK_KIND == 2,
    )  # fmt: skip
    if HAS_DROPOUT:
        # The softmax sum uses every weight; only the output sees the dropped ones.
        rnd = tl.rand(seed, drop_rows[:, None] + offs_n[None, :])
        p = tl.where(rnd >= dropout_p, p, 0.0)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
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
            acc, l_i, m_i, q, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed, start_n, offs_m,
            offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left,
            win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=MASKED, EVEN_D=EVEN_D,
            HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
            HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=False,
            FOLD_SCALE=FOLD_SCALE,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _load_lse2(lse_ptrs, rows, NQ, CHECK: tl.constexpr, ROW_STATS: tl.constexpr):
    """(lse2, log2l) of rows ``rows``, whose weights :func:`_weights` computes. Without
    ROW_STATS, lse2 is the stored lse in log2 units (log2l is 0 and unused). ROW_STATS
    (a float mask's call; ops._keeps_row_stats): the stored int64 holds the row's max m
    (natural units, as a float mask's scores: :func:`_scores`; low 32 bits) and log2 of
    its sum l (high 32 bits); lse2 is m, exact where m + ln(l) in one float32 would lose
    ln(l)'s bits. Rows with no kept key (lse, or m, -inf) get lse2 = 0, so that a score
    of -inf less 0 gives them zero weights and zero gradients instead of NaN."""
    if CHECK:
        stored = tl.load(lse_ptrs, mask=rows < NQ, other=0)
    else:
        stored = tl.load(lse_ptrs)
    if ROW_STATS:
        lse2 = stored.to(tl.int32).to(tl.float32, bitcast=True)
        log2l = (stored >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        lse2 = stored * LOG2E
        log2l = lse2  # unused
    return tl.where(lse2 == float("-inf"), 0.0, lse2), log2l


@triton.jit
def _weights(s, lse2, log2l, ROWS_FIRST: tl.constexpr, ROW_STATS: tl.constexpr):
    """The backward's softmax weights exp2(s - lse2) of a (rows, keys) tile (ROWS_FIRST)
    or a (keys, rows) one; ROW_STATS (a float mask's call, natural-unit scores):
    exp2((s - m) * log2 e - log2l), lse2 being the rows' max m (see :func:`_load_lse2`):
    s - m is exact near the max, and taken before the scaling, as in the forward."""
    if ROWS_FIRST:
        x = s - lse2[:, None]
        if ROW_STATS:
            x = x * LOG2E - log2l[:, None]
    else:
        x = s - lse2[None, :]
        if ROW_STATS:
            x = x * LOG2E - log2l[None, :]
    return tl.exp2(x)


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
    q = _load_rows(q_ptrs, offs_m, NQ, offs_d, HEAD_D, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
    do = _load_rows(do_ptrs, offs_m, NQ, offs_dv, HEAD_DV, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
    lse2, log2l = _load_lse2(lse_ptrs, offs_m, NQ, CHECK=MASKED, ROW_STATS=MASK_KIND == 2)
    if MASKED:
        delta = tl.load(delta_ptrs, mask=offs_m < NQ, other=0.0)
    else:
        delta = tl.load(delta_ptrs)
    qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    sT, tT = _scores(
        qkT, offs_m, offs_n, NQ, NK, offset, win_left, win_right,
        mask_base + offs_m.to(tl.int64) * stride_mm, stride_mn, qk_scale, sm_scale, softcap,
        MASKED=MASKED, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
        ROWS_FIRST=False, UNSCALED=False, FAST_TANH=q.dtype != tl.float32,
    )  # fmt: skip
    if HAS_TILE:
        sT = tl.where(tl.load(tile_ptrs) != 0, sT, float("-inf"))
    pT = _weights(sT, lse2, log2l, ROWS_FIRST=False, ROW_STATS=MASK_KIND == 2)
    dpT = _row_dots(v, do, INPUT_PRECISION=INPUT_PRECISION)
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
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, q_ptrs, mask_base, drop_base, seed,
            start_m, offs_n, offs_m0, offs_d, offs_dv, stride_mm, stride_mn, NQ, NK, HEAD_D,
            HEAD_DV, offset, win_left, win_right, qk_scale, sm_scale, softcap, dropout_p,
            MASKED=MASKED, EVEN_D=EVEN_D, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
            MASK_KIND=MASK_KIND, HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION,
            HAS_TILE=False,
        )  # fmt: skip
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv


@triton.jit
def _bwd_q_step(
    dq, q, do, lse2, log2l, delta, k_ptrs, v_ptrs, tile_ptrs, mask_rows, drop_rows, seed,
    start_n, offs_m, offs_n0, offs_d, offs_dv, stride_mn,
    NQ, NK, HEAD_D, HEAD_DV, offset, win_left, win_right,
    qk_scale, sm_scale, softcap, dropout_p,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_BAND: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_TILE: tl.constexpr,
):  # fmt: skip
    """One key tile (pointers at its first row) added to dQ. HAS_TILE: also apply a
    (rows, keys) token mask read at tile_ptrs."""
    offs_n = _tile_keys(start_n, offs_n0)
    k = _load_rows(k_ptrs, offs_n, NK, offs_d, HEAD_D, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
    v = _load_rows(v_ptrs, offs_n, NK, offs_dv, HEAD_DV, CHECK_ROWS=MASKED, CHECK_COLS=not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, t = _scores(
        qk, offs_m, offs_n, NQ, NK, offset, win_left, win_right, mask_rows, stride_mn, qk_scale,
        sm_scale, softcap, MASKED=MASKED, HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP,
        MASK_KIND=MASK_KIND, ROWS_FIRST=True, UNSCALED=False, FAST_TANH=k.dtype != tl.float32,
    )  # fmt: skip
    if HAS_TILE:
        s = tl.where(tl.load(tile_ptrs) != 0, s, float("-inf"))
    p = _weights(s, lse2, log2l, ROWS_FIRST=True, ROW_STATS=MASK_KIND == 2)
    dp = _row_dots(do, v, INPUT_PRECISION=INPUT_PRECISION)
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
    dq, q, do, lse2, log2l, delta, k_ptrs, v_ptrs, mask_rows, drop_rows, seed,
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
            dq, q, do, lse2, log2l, delta, k_ptrs, v_ptrs, k_ptrs, mask_rows, drop_rows, seed, start_n,
            offs_m, offs_n0, offs_d, offs_dv, stride_mn, NQ, NK, HEAD_D, HEAD_DV, offset, win_left,
            win_right, qk_scale, sm_scale, softcap, dropout_p, MASKED=MASKED, EVEN_D=EVEN_D,
            HAS_BAND=HAS_BAND, HAS_SOFTCAP=HAS_SOFTCAP, MASK_KIND=MASK_KIND,
            HAS_DROPOUT=HAS_DROPOUT, INPUT_PRECISION=INPUT_PRECISION, HAS_TILE=False,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


# ---------------------------------------------------------------- prologues / epilogues
# Query-row programs (forward, dQ) stream K/V; key programs (dK/dV) stream Q/dO. The
# helpers below are the per-program setup and the final stores of each pass, shared by
# the dense and the block-sparse kernels.


@triton.jit
def _kv_bases(
    K, V, b, hk, offs_n0, offs_d, offs_dv,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
):  # fmt: skip
    """Pointer tiles (BLOCK_N, BLOCK_D) into K and (BLOCK_N, BLOCK_DV) into V at key 0 of
    batch ``b``, kv head ``hk``; a step moves them by ``start_n * stride_kn``."""
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
    return k_base, v_base


@triton.jit
def _row_streams(
    Mask, Seed, b, h, pid_bh, offs_m, stride_mb, stride_mh, stride_mm, NQ, NK,
    HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """(mask_rows, seed, drop_rows) of query rows ``offs_m`` of (b, h): the attn_mask row
    pointers (int64 row offsets applied), the dropout seed (0 without dropout) and each
    row's Philox offset ((b*H + h)*NQ + i)*NK (glossary, "dropout")."""
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m.to(tl.int64) * stride_mm
    if HAS_DROPOUT:
        seed = tl.load(Seed)
        drop_rows = (pid_bh * NQ + offs_m) * NK  # int64: unique Philox offset per (b, h, i, j)
    else:
        seed = 0
        drop_rows = offs_m
    return mask_rows, seed, drop_rows


@triton.jit
def _softmax_init(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(m_i, l_i, acc): the running row max (-inf), row sum and output accumulator."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def _fwd_finish(
    Out, Lse, acc, l_i, m_i, b, h, lse_row, offs_m, offs_dv,
    stride_ob, stride_oh, stride_om, stride_od, NQ, HEAD_DV, dropout_p,
    EVEN_D: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_LSE: tl.constexpr,
    ROW_STATS: tl.constexpr = False,
):  # fmt: skip
    """The forward's epilogue: Out = acc / l and the natural-log lse of rows ``offs_m``
    (at ``Lse + lse_row + offs_m``: ``lse_row`` is where (b, h)'s row 0 sits in the lse,
    glossary); rows with no kept key (l_i == 0) get output 0 and lse -inf, never 0/0.
    ROW_STATS (a float mask's call): the row stats instead, int64 (see _load_lse2):
    m_i (-inf for a row with no kept key) and log2(l) (0 there)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if ROW_STATS:
        low = m_i.to(tl.uint32, bitcast=True).to(tl.int64)  # zero-extended
        high = tl.log2(l_safe).to(tl.int32, bitcast=True).to(tl.int64) << 32
        lse = high | low
    else:
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
        tl.store(Lse + lse_row + offs_m, lse, mask=offs_m < NQ)


@triton.jit
def _dq_operands(
    Q, DO, Lse, Delta, b, h, lse_row, offs_m, offs_d, offs_dv,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
    NQ, HEAD_D, HEAD_DV, EVEN_D: tl.constexpr, MASK_KIND: tl.constexpr,
):  # fmt: skip
    """(q, do, lse2, log2l, delta) of rows ``offs_m`` of (b, h), resident in a dQ program
    (lse and delta at ``lse_row + offs_m``; lse2 and log2l as :func:`_load_lse2`'s)."""
    rows = offs_m.to(tl.int64)[:, None]
    q = _load_rows(Q + b * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, NQ, offs_d, HEAD_D, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)  # fmt: skip
    do = _load_rows(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_dv[None, :] * stride_dod,
                    offs_m, NQ, offs_dv, HEAD_DV, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)  # fmt: skip
    lse2, log2l = _load_lse2(Lse + lse_row + offs_m, offs_m, NQ, CHECK=True,
                             ROW_STATS=MASK_KIND == 2)  # fmt: skip
    delta = tl.load(Delta + lse_row + offs_m, mask=offs_m < NQ, other=0.0)
    return q, do, lse2, log2l, delta


@triton.jit
def _dq_finish(
    DQ, dq, b, h, offs_m, offs_d, stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    NQ, HEAD_D, sm_scale,
):  # fmt: skip
    """The dQ epilogue: dq * scale (d(scale * qk)/d(qk)) stored for rows ``offs_m``."""
    rows = offs_m.to(tl.int64)[:, None]
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=(offs_m[:, None] < NQ) & (offs_d[None, :] < HEAD_D))  # fmt: skip


@triton.jit
def _kv_operands(
    K, V, Seed, b, hk, offs_n, offs_d, offs_dv,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    NK, HEAD_D, HEAD_DV, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """(k, v, dk, dv, seed) of a dK/dV program: its keys ``offs_n`` of (b, hk), resident,
    zeroed accumulators, and the dropout seed (0 without dropout)."""
    rows_n = offs_n.to(tl.int64)[:, None]
    k = _load_rows(K + b * stride_kb + hk * stride_kh + rows_n * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, NK, offs_d, HEAD_D, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)  # fmt: skip
    v = _load_rows(V + b * stride_vb + hk * stride_vh + rows_n * stride_vn + offs_dv[None, :] * stride_vd,
                   offs_n, NK, offs_dv, HEAD_DV, CHECK_ROWS=True, CHECK_COLS=not EVEN_D)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    else:
        seed = 0
    return k, v, dk, dv, seed


@triton.jit
def _query_head_bases(
    Q, DO, Lse, Delta, Mask, b, h, lse_row, offs_m0, offs_d, offs_dv,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_mb, stride_mh, NQ, NK,
):  # fmt: skip
    """What a dK/dV program streams for query head ``h`` of batch ``b``, at row 0: Q and
    dO row tiles, lse and delta rows (from ``lse_row``), the attn_mask base and the
    dropout base."""
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
    lse_base = Lse + lse_row + offs_m0
    delta_base = Delta + lse_row + offs_m0
    mask_base = Mask + b * stride_mb + h * stride_mh
    drop_base = lse_row * NK
    return q_base, do_base, lse_base, delta_base, mask_base, drop_base


@triton.jit
def _dkdv_finish(
    DK, DV, dk, dv, b, hk, offs_n, offs_d, offs_dv,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    NK, HEAD_D, HEAD_DV, sm_scale,
):  # fmt: skip
    """The dK/dV epilogue: dk * scale and dv stored for keys ``offs_n``."""
    rows_n = offs_n.to(tl.int64)[:, None]
    dk = dk * sm_scale  # d(scale * qk)/d(qk)
    inb_n = offs_n[:, None] < NK
    tl.store(DK + b * stride_dkb + hk * stride_dkh + rows_n * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=inb_n & (offs_d[None, :] < HEAD_D))  # fmt: skip
    tl.store(DV + b * stride_dvb + hk * stride_dvh + rows_n * stride_dvn + offs_dv[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=inb_n & (offs_dv[None, :] < HEAD_DV))  # fmt: skip
