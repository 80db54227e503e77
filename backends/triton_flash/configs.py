"""Launch configurations for the triton_flash kernels, apart from the kernels.

Keyed by what changes the best choice: compute capability, head dim (padded to a power
of two), element size, causal, and direction ("fwd", "bwd_kv" for the dK/dV kernel,
"bwd_q" for the dQ kernel). Under the Triton interpreter there is one small
configuration: blocks small enough that the CPU tests cross several blocks (and so
exercise every masked/unmasked segment) with sequences of a few dozen tokens.

Provenance of the GPU entries: the half-precision D <= 128 entries were chosen by a
measured sweep on the H200 (cited beside each); the rest are first choices from the FA2
structure (Triton's fused-attention tutorial; the plain-Triton probe in
shared/perf/anchors-h200.md), sized so that shared memory fits the H200's 227 KiB with
the stated pipelining depth (``python benchmarks/aot_check.py``, a developer tool
outside the package, reports each kernel's shared memory without a GPU). Issue 4 tunes
further. Tuning runs force other configurations with ``tuning.override`` (tuning.py).

The backward runs as one launch or two (:func:`backward_launch`): the "bwd_kv" and
"bwd_q" entries (:func:`backward_configs`) then configure the two roles of the merged
kernel, or the two kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import tuning


@dataclass(frozen=True)
class LaunchConfig:
    """Tiles and launch options of one kernel launch. ``maxnreg``: a cap on registers
    per thread (ptxas' .maxnreg), or None for the compiler's choice; a cap of 128 with
    8 warps lets two programs share an SM where shared memory allows it.

    ``tma`` (forward only): the forward loads its tiles through tensor descriptors
    (kernels_tma.attn_fwd_tma_kernel) where the call allows it (ops._tma_eligible),
    else it runs the pointer kernel on the same tiles. ``gluon``: the warp-specialized
    Gluon kernel of its direction, with ``num_stages`` buffers: the forward
    (kernels_gluon.attn_fwd_gluon_kernel, K/V tiles; only calls that ops._gluon_eligible
    admits get such a row), dK/dV (kernels_gluon_bwd.attn_bwd_dkdv_gluon_kernel, Q/dO
    tiles; tiles (64, 128) on 4 warps, (64, 64) at D = 256) or dQ
    (attn_bwd_dq_gluon_kernel, K/V tiles; tiles (128, 64) on 4 warps, (128, 32) at D =
    256; also triton_blocksparse's): the backward's for calls that
    ops._gluon_bwd_eligible admits (only such calls get a table row; a forced row on
    another call runs the pointer kernel on the same tiles); such a backward runs
    split."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None
    tma: bool = False
    gluon: bool = False

    def options(self) -> dict[str, int]:
        """The launch options (num_warps, num_stages, and maxnreg where set)."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def meta(self) -> dict[str, int]:
        """Tiles (BLOCK_M, BLOCK_N) and launch options, as one launch takes them."""
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, **self.options()}


# Interpreter: tiles of 32 query rows x 16 keys (BLOCK_M != BLOCK_N also tests that the
# causal diagonal does not assume square blocks). num_warps/stages mean nothing there.
INTERPRETER_FWD = LaunchConfig(32, 16, 4, 1)
INTERPRETER_BWD_KV = LaunchConfig(16, 32, 4, 1)  # BLOCK_M rows per step, BLOCK_N keys
INTERPRETER_BWD_Q = LaunchConfig(32, 16, 4, 1)

# Measured entries cite a sweep: "sweep-1", the sweep section of
# benchmarks/results/archive/triton_flash-gpu-check-2026-11-30.json (H200, bf16, B=4,
# N=4096, H=2048/D, each candidate checked against SDPA flash, then timed with do_bench),
# or "sweep-3", benchmarks/results/archive/triton_flash-sweep-n1k-n4k-n16k-2026-11-30-r3.json
# (the same at N = 1024, 4096 and 16384, B = 16384/N, after the scale fold and the
# edge-segment flags lowered the kernels' registers; TFLOP/s quoted as N = 1024 / 4096 /
# 16384). The fp32 and D=256 rows are first choices sized for shared memory, not yet
# measured.
_Rows = tuple[tuple[int, LaunchConfig], ...]

# Forward, 2-byte dtypes: Q stays resident, K/V tiles stream through num_stages buffers.
_FWD_2B: _Rows = (
    # D<=64: three stages. With a float mask tile beside K/V: 0.106 ms against 0.139
    # for four stages (archive/masked-fwd-probe-h100-2026-12-07-4a44a5e-2b075cc.txt,
    # B8 H12 N1024, (B, 1, N, N) masks); bool masks take _BOOL_MASK_2B's row. Calls
    # without a mask take the lean rows (the same tiles) but non-causal ones at N <=
    # 1024: 372 TFLOP/s against 371 for four stages there (sweep-3; sweep-1 had four
    # stages ahead at N = 4096, 384 vs 375). Block-sparse D=64 forwards take this row
    # too (not timed).
    (64, LaunchConfig(128, 64, 4, 3)),
    # D=128: best of five in the sweep: 458 dense, 403 causal (BLOCK_N=128: 452/372;
    # 4 warps: 141, register spills) (sweep-1).
    (128, LaunchConfig(128, 64, 8, 3)),
    (256, LaunchConfig(64, 64, 8, 2)),
)
# fp32 forward (IEEE products), every row: ptxas gives 32 registers and ~30-54 KB of
# spill stores (aot_check --registers); on the H200 the D=256 causal forward of
# B1 H16 2049x1000 took 14 ms against 4 ms for each backward kernel. Not yet tuned.
_FWD_4B: _Rows = (
    (64, LaunchConfig(64, 64, 4, 2)),
    (128, LaunchConfig(64, 32, 4, 2)),
    (256, LaunchConfig(32, 32, 4, 1)),
)
# Backward, as (dK/dV kernel rows, dQ kernel rows). dK/dV keeps K, V and both
# accumulators resident (BLOCK_N keys) and streams Q/dO in BLOCK_M rows; dQ keeps Q, dO
# and its accumulator resident (BLOCK_M rows) and streams K/V.
_BWD_2B_DENSE: tuple[_Rows, _Rows] = (
    (
        (64, LaunchConfig(32, 128, 4, 3)),  # 350 TFLOP/s; (64,128,8,3) 304, (32,64,4,3) 322
        (128, LaunchConfig(64, 128, 8, 2)),  # 352; (32,128,8,2) 276, (32,64,4,3) 341
        (256, LaunchConfig(32, 32, 4, 1)),
    ),
    (
        (64, LaunchConfig(128, 32, 4, 3)),
        (128, LaunchConfig(128, 64, 8, 2)),
        (256, LaunchConfig(64, 32, 8, 1)),
    ),
)
_BWD_2B_CAUSAL: tuple[_Rows, _Rows] = (
    (
        (64, LaunchConfig(32, 64, 4, 3)),  # 287; (32,128,4,3) 245, (64,128,8,3) 272
        (128, LaunchConfig(32, 64, 4, 3)),  # 330; (32,128,8,2) 250, (64,128,8,2) 299
        (256, LaunchConfig(32, 32, 4, 1)),
    ),
    (
        (64, LaunchConfig(64, 32, 4, 3)),
        (128, LaunchConfig(64, 32, 4, 3)),
        (256, LaunchConfig(64, 32, 8, 1)),
    ),
)
# fp32 D=256 (IEEE), measured with aot_check --registers on the GPU test's launch
# (B1 H16 2049x1000 causal bottom-right): dK/dV (16, 32, 4, 1) compiles in ~9 s, 255
# registers, 552 B spilled; dQ (32, 16, 4, 1) ~7-11 s, 238 registers; the same tiles with
# 8 warps compile as fast without spills (171 and 140 registers), not yet timed on a GPU.
# On the H200 the whole causal backward ran in 2 x 4 ms after ~15 s of compiling.
_BWD_4B: tuple[_Rows, _Rows] = (
    (
        (64, LaunchConfig(32, 64, 4, 2)),
        (128, LaunchConfig(32, 32, 4, 2)),
        (256, LaunchConfig(16, 32, 4, 1)),
    ),
    (
        (64, LaunchConfig(64, 32, 4, 2)),
        (128, LaunchConfig(32, 32, 4, 2)),
        (256, LaunchConfig(32, 16, 4, 1)),
    ),
)


# Short sequences (at most SHORT_N keys and queries), 2-byte dtypes: where the sweep at
# N=1024 (B=16, H=2048/D; benchmarks/results/archive/triton_flash-sweep-n1k-n16k-2026-11-30.json)
# found a configuration more than 5% faster than the table's row. Each program walks only 8-16
# key tiles there, so smaller tiles (more programs in flight) win.
SHORT_N = 1024
_SHORT_2B: dict[tuple[str, int, bool], LaunchConfig] = {
    # D=64 causal forward: 261 TFLOP/s against 233 for (128, 64, 4, 4).
    ("fwd", 64, True): LaunchConfig(64, 64, 4, 3),
    # D=128 non-causal backward: 305 against 279 for (64,128,8,2)/(128,64,8,2).
    ("bwd_kv", 128, False): LaunchConfig(32, 64, 4, 3),
    ("bwd_q", 128, False): LaunchConfig(64, 32, 4, 3),
}

# Narrow calls: rows that visit at most NARROW_N keys (ops._Setup.walk: a sliding window
# of at most 256 keys, or a sequence as short), 2-byte dtypes, with or without a mask.
# Measured at the window shape (bf16, B=2, H=16, N=16384, D=128, causal, window
# (W-1, 0); benchmarks/results/archive/triton_flash-window-sweep-2026-11-30.json): each
# row block then walks a few
# key tiles, most of them on one of the band's two masked edges, and 64-row blocks waste
# half as many masked rows as 128-row ones.
NARROW_N = 256
_NARROW_2B: dict[tuple[str, int, bool], LaunchConfig] = {
    # D=128 causal forward, W=256: 0.366 ms against 0.438 for (128, 64, 8, 3); at
    # W=1024 (not narrow) that row stays best: 0.791 against 0.850 for this one.
    ("fwd", 128, True): LaunchConfig(64, 64, 4, 3),
}

# Bool-mask forwards, 2-byte dtypes: a dense call whose attn_mask is bool (one byte a
# score beside K/V), keyed by (direction, padded head dim); a key not listed falls
# through to the tables below. H100, bf16, a random 90% bool mask, F.sdpa's time over
# ours (benchmarks/results/masked-fwd-probe-h100.txt): D=64, 64-row tiles 1.37x /
# 1.20x / 1.52x at B8 H12 N1024 / B4 H16 N4096 / B16 H12 N512 against 1.17x / 1.01x /
# 1.31x for the _FWD_2B row; D=128, 32-key tiles 1.17x / 1.17x at B4 H16 N4096 /
# B8 H16 N1024 against 1.08x / 1.05x: two programs an SM (sm_90, aot_check
# --registers: 90 KiB of shared memory and 128 registers against 144 KiB and 178 for
# (128, 64, 8, 3); neither spills). A float mask keeps the _FWD_2B rows (D=64:
# 64-row tiles read 1.01x / 1.24x against 1.10x / 1.19x; D=128 with 32-key tiles not
# timed).
_BOOL_MASK_2B: dict[tuple[str, int], LaunchConfig] = {
    ("fwd", 64): LaunchConfig(64, 64, 4, 3),
    ("fwd", 128): LaunchConfig(128, 32, 8, 3),
}

# Lean calls: dense triton_flash with no attn_mask, so no mask tile streams beside K/V
# (or Q/dO) and a third pipeline stage, or BLOCK_N=128, fits in shared memory. Keyed by
# (direction, padded head dim, causal, N <= SHORT_N); a key not listed falls through to
# the tables above. Block-sparse calls and calls with a mask never use these: with a
# mask tile the D=128 forward below needs 256 KiB (the H200 has 227), seen on the GPU.
_LEAN_2B: dict[tuple[str, int, bool, bool], LaunchConfig] = {
    # D=64 forward: 372 / 407 / 411 against 371 / 391 / 413 for (128, 64, 4, 4), causal
    # 344 / 384 at N > 1024 against 342 / 384 (sweep-3).
    ("fwd", 64, False, False): LaunchConfig(128, 64, 4, 3),
    ("fwd", 64, True, False): LaunchConfig(128, 64, 4, 3),
    # D=128 non-causal forward: 404 / 470 / 493 against 394 / 450 / 473 for (128,64,8,3)
    # (sweep-3); causal keeps (128,64,8,3): 281 / 410 / 460 against 257 / 395 / 446.
    ("fwd", 128, False, False): LaunchConfig(128, 128, 8, 3),
    # At N <= 1024, two programs per SM (96 KiB of shared memory each, registers capped
    # at 128; aot_check: 2/3 spill stores/loads in the loop): 0.3142 ms against 0.3249
    # for (128,128,8,3), +3.4% in both runs of
    # benchmarks/results/archive/triton_flash-strides-ab-2026-11-30.json
    # (at N=4096 1.133 against 1.161, inside the table's own two runs, 1.110 and 1.211;
    # at N=16384 2.8% slower). Each program walks eight key tiles at N=1024, so one
    # program's prologue loads wait while the other computes.
    ("fwd", 128, False, True): LaunchConfig(128, 64, 8, 2, maxnreg=128),
    # D=128 causal forward through TMA loads (kernels_tma; calls it cannot serve fall
    # through to the rows below): (128, 64, 4, 2) read 442 / 504 / 293 TFLOP/s at N =
    # 4096 / 16384 / 1024 against 413 / 455 / 282 for the pointer kernel's row in the same
    # process, the best of ten candidates at 4096 and 16384 and within 1% of the best at
    # 1024 (benchmarks/results/archive/tma-fwd-sweep-h200-2026-12-04.json, bf16, B =
    # 16384 / N, H = 16). Not taken: non-causal D=128 (0.98 / 1.04 / 1.02 of the pointer
    # rows) and D=64 (0.89-1.01). Warp specialization made these loops wrong, not faster
    # (archive/tma-fwd-sweep-ws-h200-2026-12-04.json: errors of 0.1-0.6 and NaN at 4
    # warps, no change at 8): not offered.
    ("fwd", 128, True, False): LaunchConfig(128, 64, 4, 2, tma=True),
    ("fwd", 128, True, True): LaunchConfig(128, 64, 4, 2, tma=True),
    # Not taken: D=128 causal at N <= 1024 with (128,32,8,3) capped at 128 registers,
    # 0.2317 ms against 0.2390 (same file): +3% does not reach the 1.3x bar there, and
    # the row would also take 1024-key sliding windows, where (128,64,8,3) is best.
    # D=128 backward with three stages: non-causal 335 / 380 / 411 against 317 (the short
    # entry) / 350 / 359; causal 331 / 369 at N > 1024 against 310 / 340 for (32,64,4,3),
    # which stays best at N=1024 (252 against 203) (sweep-3).
    ("bwd_kv", 128, False, False): LaunchConfig(64, 128, 8, 3),
    ("bwd_q", 128, False, False): LaunchConfig(128, 64, 8, 3),
    ("bwd_kv", 128, False, True): LaunchConfig(64, 128, 8, 3),
    ("bwd_q", 128, False, True): LaunchConfig(128, 64, 8, 3),
    ("bwd_kv", 128, True, False): LaunchConfig(64, 128, 8, 3),
    ("bwd_q", 128, True, False): LaunchConfig(128, 64, 8, 3),
    # D=256, bf16, B4 H8 (benchmarks/results/archive/sweep-d256-h200-2026-12-02-*.json,
    # each candidate checked against SDPA flash, then timed). Forward: 128-row tiles on
    # 2 stages (192 KiB of shared memory): 491 / 429 TFLOP/s non-causal / causal at
    # N=4096, against 261 / 235 for the table's (64, 64, 8, 2) and SDPA flash's 325 /
    # 286; at N=1024 382 / 204 against 204 / 139. Backward (split): dK/dV on 64 resident
    # keys with 3 stages, dQ on 128 rows: 210 / 195 at N=4096 (-4c14567), against 120 /
    # 112 for the table's pair and SDPA flash's 242 / 220; at N=1024 each half was the
    # best of its kind too (-9b87448: 169 / 116 with dK/dV on 2 stages). Both kernels
    # near 255 registers; with 16 warps registers cap at 128 and spill in the loops
    # (aot_check).
    # Not timed with a mask tile beside them (the forward's would take 208 of the
    # 227 KiB): masked calls keep the table's rows.
    **{
        (direction, 256, causal, short): config
        for direction, config in (
            ("fwd", LaunchConfig(128, 64, 8, 2)),
            ("bwd_kv", LaunchConfig(32, 64, 8, 3)),
            ("bwd_q", LaunchConfig(128, 32, 8, 2)),
        )
        for causal in (False, True)
        for short in (False, True)
    },
}


# The Gluon backward kernels' rows (kernels_gluon_bwd: tiles their programs are written
# for, 2 buffers), by role; the table's Gluon rows below take them, and
# tuning.override(bwd_kv=..., bwd_q=...) forces them (probes, tests).
GLUON_BWD: dict[str, LaunchConfig] = {
    "bwd_kv": LaunchConfig(64, 128, 4, 2, gluon=True),
    "bwd_q": LaunchConfig(128, 64, 4, 2, gluon=True),
}
# D = 256: dK/dV programs of 64 keys whose consumers split the head dim (K, V, two
# 64-row Q/dO buffers and the P^T/dS^T exchange fill 210 KiB of shared memory); dQ
# programs of 128 rows over 32-key K/V tiles (two 64-row consumers, 128 registers a
# thread of dQ each; 64-key tiles would need 256 KiB).
GLUON_BWD_256: dict[str, LaunchConfig] = {
    "bwd_kv": LaunchConfig(64, 64, 4, 2, gluon=True),
    "bwd_q": LaunchConfig(128, 32, 4, 2, gluon=True),
}


# The Gluon kernels' rows, for the calls ops._gluon_eligible (forward) and
# ops._gluon_bwd_eligible (backward) admit: D = Dv = 128 (the backward also 256), 2-byte
# dtypes, dense, no softcap, sm_90. Keyed by (direction, padded head dim, causal); calls
# of fewer than _GLUON_MIN_N[direction, head dim] keys keep the rows below.
#
# Forward (kernels_gluon: a TMA loader warp, two consumer warpgroups of 64 rows each).
# bf16, B = 16384 / N, H = 16, TFLOP/s at N = 4096 / 16384 / 1024
# (benchmarks/results/archive/gluon-fwd-probe-h200-2026-12-04.jsonl, one process):
# non-causal (128, 128, 4, 2) 579 / 606 / 425 against the pointer kernel's 518 / 521 /
# 427 and cuDNN's 611 / 618 / 568; causal 494 / 577 / 269 against the TMA kernel's
# 446 / 512 / 286 and cuDNN's 532 / 575 / 418. Three buffers read 590 / 553 and 506 /
# 575: within the run's spread at three of the four points, 9% slower at the fourth. The
# landed kernel's sweep (archive/gluon-fwd-sweep-h200-2026-12-04.json) agrees: (128, 128,
# 4, 2/3) lead, 64-key tiles trail by 5-10%, and at N=1024 every candidate is below the
# rows kept there; the grid's D=128 points with this row:
# archive/grid-d128-gluon-h200-2026-12-04-e7f5b7f.md.
#
# Backward (kernels_gluon_bwd, both roles: the backward then runs split). bf16 on an
# H200, the Gluon dK/dV and dQ against the pointer kernels' merged backward, time
# ratios over two runs (benchmarks/results/archive/gluon-bwd-probe-h200-2026-12-05-
# *.txt), non-causal / causal: B4 H16 N4096 1.04-1.06 / 0.98-0.99, B1 H16 N16384
# 1.10-1.11 / 1.12, GQA B4 Hq32 Hkv8 N4096 1.08 / 1.24-1.26, B2 Hq32 Hkv8 N8192
# 1.11-1.12 / 1.26; at N = 2048 (B8 H16) 0.97 / 0.94 and at N = 1024 (B16 H16) 0.91 /
# 0.80, so calls of fewer than 4096 keys keep the pointer rows. dK/dV's Gluon kernel
# alone reads 1.00-1.07 where both read 0.98-1.06 (B4 H16 N4096): within the runs'
# spread, so one rule for both.
# D = 256 (GLUON_BWD_256), bf16 on an H200, both Gluon kernels against the pointer
# backward (benchmarks/results/archive/gluon-bwd-probe-h200-2026-12-07-*.txt),
# non-causal / causal: B4 H8 N4096 1.80 / 1.69, B1 H8 N16384 1.84 / 1.70, GQA B8 16/4
# N2048 1.73 / 1.65, B16 H8 N1024 1.59 / 1.38, B32 H8 N512 1.37 / 1.17 (each also
# faster than SDPA flash, 1.29-1.67x): the rows take calls from 512 keys
# (_GLUON_MIN_N). The grid: results/grid-d256-h200.md.
_GLUON_2B: dict[tuple[str, int, bool], LaunchConfig] = {
    **{("fwd", 128, causal): LaunchConfig(128, 128, 4, 2, gluon=True) for causal in (False, True)},
    **{(role, 128, causal): row for role, row in GLUON_BWD.items() for causal in (False, True)},
    **{(role, 256, causal): row for role, row in GLUON_BWD_256.items() for causal in (False, True)},
}
# The fewest keys a row of _GLUON_2B takes, by (direction, padded head dim); D = 256's
# backward pays from the shortest calls measured (512 keys).
_GLUON_MIN_N = {
    ("fwd", 128): SHORT_N + 1,
    **{(role, 128): 4096 for role in GLUON_BWD},
    **{(role, 256): 512 for role in GLUON_BWD_256},
}


def _rows(direction: str, element_size: int, causal: bool) -> _Rows:
    wide = element_size >= 4
    if direction == "fwd":
        return _FWD_4B if wide else _FWD_2B
    pair = _BWD_4B if wide else (_BWD_2B_CAUSAL if causal else _BWD_2B_DENSE)
    return pair[0] if direction == "bwd_kv" else pair[1]


def launch_config(
    direction: str,
    block_d: int,
    element_size: int,
    causal: bool,
    capability: tuple[int, int] | None,
    interpret: bool,
    seqlen: int | None = None,
    lean: bool = False,
    tma: bool = False,
    gluon: bool = False,
    bool_mask: bool = False,
) -> LaunchConfig:
    """The launch configuration for one kernel launch.

    ``block_d`` is the larger of the padded head dims of q/k and v. ``capability``
    is part of the key so that entries for other GPUs can be added; today's entries
    were measured on sm_90 only. ``seqlen`` selects the short-sequence entries
    (``SHORT_N``) and the narrow ones (``NARROW_N``) where it is given: the most keys
    one row visits (ops passes the longer of Nq and Nk, or a sliding window's width
    where that is narrower). ``lean``: a dense call that streams no mask tile, which
    may take the larger ``_LEAN_2B`` entries; ``tma``: a forward that the TMA kernel may
    serve (ops._tma_eligible), which may take the entries that ask for it (the others
    skip them); ``gluon``: a call that ``direction``'s Gluon kernel may serve
    (ops._gluon_eligible, ops._gluon_bwd_eligible), which takes the ``_GLUON_2B`` row
    where one is keyed and ``seqlen`` reaches ``_GLUON_MIN_N``; ``bool_mask``: a call
    whose dense attn_mask is bool, which takes the ``_BOOL_MASK_2B`` entry where one is
    keyed (after the narrow and short entries). Inside a
    ``tuning.override`` block that forces ``direction``, the forced configuration (the
    interpreter's included).
    """
    tuned = tuning.current()
    if tuned is not None:
        forced = tuned.config(direction)
        if forced is not None:
            return forced
    if interpret:
        return {
            "fwd": INTERPRETER_FWD,
            "bwd_kv": INTERPRETER_BWD_KV,
            "bwd_q": INTERPRETER_BWD_Q,
        }[direction]
    if seqlen is not None and seqlen <= NARROW_N and element_size == 2:
        narrow = _NARROW_2B.get((direction, block_d, causal))
        if narrow is not None:
            return narrow
    short_call = seqlen is not None and seqlen <= SHORT_N
    if gluon:
        row = _GLUON_2B.get((direction, block_d, causal))
        if row is not None and (seqlen is None or seqlen >= _GLUON_MIN_N[direction, block_d]):
            return row
    if lean and element_size == 2:
        entry = _LEAN_2B.get((direction, block_d, causal, short_call))
        if entry is not None and (tma or not entry.tma):
            return entry
    if short_call and element_size == 2:
        short = _SHORT_2B.get((direction, block_d, causal))
        if short is not None:
            return short
    if bool_mask and element_size == 2:
        entry = _BOOL_MASK_2B.get((direction, block_d))
        if entry is not None:
            return entry
    rows = _rows(direction, element_size, causal)
    for bound, config in rows:
        if block_d <= bound:
            return config
    return rows[-1][1]


def backward_configs(*key: Any, **options: Any) -> tuple[LaunchConfig, LaunchConfig]:
    """(dK/dV, dQ) configurations of one backward: :func:`launch_config` for "bwd_kv" and
    for "bwd_q" with the same ``key`` and ``options`` (its arguments after
    ``direction``), whether the backward then runs split or merged."""
    return launch_config("bwd_kv", *key, **options), launch_config("bwd_q", *key, **options)


def backward_rows(*key: Any, **options: Any) -> dict[str, LaunchConfig]:
    """:func:`backward_configs` by role ("bwd_kv", "bwd_q"): what
    ``tuning.override(**rows)`` takes to force one backward's rows (probes, tests)."""
    return dict(zip(("bwd_kv", "bwd_q"), backward_configs(*key, **options)))


# The backward as one launch ("merged": kernels.attn_bwd_kernel, whose programs split
# into a dK/dV role and a dQ role, as FlexAttention's backward) or two ("split":
# attn_bwd_dkdv_kernel, then attn_bwd_dq_kernel). tuning.override(backward_launch=...)
# forces a mode over the table below (tuning runs).
BWD_MODES = tuning.BACKWARD_LAUNCHES
BWD_DEFAULT = "split"

# Lean calls with 2-byte dtypes, by padded head dim: the launch measured fastest on the
# H200 with the lean tiles, backward alone, ratios split / merged_heads at N = 1024 /
# 4096 / 16384 (benchmarks/results/archive/triton_flash-order-bwd-ab-2026-11-30-r2.json:
# each mode timed twice in A B C C B A order; its first run in A B C order,
# archive/triton_flash-order-bwd-ab-2026-11-30.json, in brackets):
# D=128 non-causal 1.03 / 1.04 / 1.01 (1.01 / 1.01 / 1.01), causal 1.05 / 1.11 / 1.03
# (1.03 / 1.07 / 1.02). D=64 stays split: 0.95-1.03 across the two runs, and -3 to -5%
# causal in the first (every program gets the hungrier role's registers).
_LEAN_LAUNCH_2B: dict[int, str] = {128: "merged_heads"}


def backward_launch(
    kv: LaunchConfig, q: LaunchConfig, block_d: int = 0, element_size: int = 0, lean: bool = False
) -> str:
    """How to launch one backward whose dK/dV and dQ configurations are ``kv`` and ``q``:
    ``"split"`` (two launches), ``"merged"`` (one launch: all dK/dV programs, then all
    dQ programs) or ``"merged_heads"`` (one launch in FlexAttention's order: per kv
    head, its dK/dV programs, then its query heads' dQ programs). Every mode gives
    bitwise the same gradients: each program computes the same sums in the same order.

    The choice: the active ``tuning.override(backward_launch=...)``, else
    ``_LEAN_LAUNCH_2B`` for a lean call (:func:`launch_config`) with a 2-byte dtype and
    padded head dim ``block_d``, else ``BWD_DEFAULT``. A merged launch is used only
    where ``kv`` and ``q`` have the same launch options (num_warps, num_stages, maxnreg:
    a launch has one of each; the 2-byte D=256 rows have 4 vs 8 warps) and neither is a
    Gluon row (``LaunchConfig.gluon``: its own kernel); elsewhere the backward is split
    whatever was asked.
    """
    if kv.gluon or q.gluon:  # a Gluon kernel is its own launch
        return "split"
    tuned = tuning.current()
    mode = tuned.backward_launch if tuned is not None else None
    if mode is None:
        table = _LEAN_LAUNCH_2B.get(block_d) if lean and element_size == 2 else None
        mode = table or BWD_DEFAULT
    if mode != "split" and kv.options() != q.options():
        return "split"
    return mode


def merged_meta(kv: LaunchConfig, q: LaunchConfig, mode: str) -> dict[str, int | bool]:
    """The merged kernel's tile constexprs and launch options for ``mode`` ("merged" or
    "merged_heads"): dK/dV tiles as BLOCK_M1/BLOCK_N1, dQ tiles as BLOCK_M2/BLOCK_N2
    (FlexAttention's names), the program order, and the shared launch options (equal
    in ``kv`` and ``q``, see :func:`backward_launch`)."""
    return {
        "BLOCK_M1": kv.block_m,
        "BLOCK_N1": kv.block_n,
        "BLOCK_M2": q.block_m,
        "BLOCK_N2": q.block_n,
        "HEAD_MAJOR": mode == "merged_heads",
        **kv.options(),
    }
