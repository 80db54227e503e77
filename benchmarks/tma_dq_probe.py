"""Probe: a FlashAttention backward that computes dQ inside the dK/dV kernel and adds it
into a float32 buffer by TMA reduce-add, timed against attnhub's split backward, SDPA
flash (FA2) and cuDNN on the same inputs.

A self-contained diagnostic, outside the package. The kernel here is dense MHA only:
Hq == Hkv, contiguous (B, H, N, D) q/k/v/dO, Nq == Nk == N with N a multiple of both
tiles, HEAD_D a power of two, no mask, dropout or softcap; causal is top-left aligned
(key j is visible to row i iff j <= i).

The kernel (one program per key block of one head, as attnhub's dK/dV kernel): k, v of
its BLOCK_N keys stay resident with float32 dk, dv; for every query block it can see it
runs five matmuls on transposed tiles,
    qkT = k q^T, pT = exp2(qkT * qk_scale - lse2), dv += pT dO, dpT = v dO^T,
    dsT = pT (dpT - delta), dk += dsT q, dq_part = dsT^T k,
and adds dq_part (BLOCK_M, D) into DQacc (B*H, N, D) float32:
    REDUCE=0: through a host-made tensor descriptor, ``desc.atomic_add`` (tt.descriptor_reduce,
              on sm_90 cp.reduce.async.bulk.tensor: one bulk reduction per box instead of
              one atomic per element); SPLIT_D: two half-width boxes (D/2 columns each)
              from two matmuls against the two halves of k; DESC_3D=False: a 2-D
              descriptor over (B*H*N, D) instead of the 3-D (B*H, N, D) one.
    REDUCE=1: pointer ``tl.atomic_add(..., sem="relaxed")`` of the float32 tile (what
              branch wip/atomic-dq did, there per element; here Triton 3.6 emits
              atom.global.gpu.relaxed.add.v4.f32, 4 floats an instruction; also the
              interpreter's path).
The split backward's dQ kernel recomputes S, P and dP (seven matmuls a tile); this one
does not, at the price of the dQ reduction traffic.

Scale factors: scores in log2 units (qk_scale = sm_scale * log2 e, lse2 = lse * log2 e);
dS = P * (dP - delta) is in natural units, so dQ = dS K * sm_scale and dK = dS^T Q *
sm_scale (DQacc holds dS K unscaled; the final cast multiplies by sm_scale).

    python tma_dq_probe.py OUT.json [--head-dims 256,128] [--seqlen 4096] [--quick]
        on CUDA: per head dim, causal and not, each config checked against SDPA flash's
        backward (max abs error / reference max abs), then timed with do_bench (median,
        warmup 25, rep 100) including the delta preprocess, DQacc zeroing and the final
        dq scale/cast; SDPA flash, cuDNN and attnhub's split backward timed beside it.
    python tma_dq_probe.py --cpu-check
        no GPU: Triton's interpreter (float32 and float16; bfloat16 dots are broken
        there), pointer atomics and (through a small emulation of the descriptor reduce
        that the interpreter lacks) the descriptor path, against a float64 autograd
        reference.
    python tma_dq_probe.py --aot [--head-dims 256,128] [--quick] [AOT.json]
        no GPU: compile the sweep for sm_90 with Triton's ahead-of-time path (ptxas ships
        with Triton): compile errors, registers and spills (ptxas -v), shared memory, the
        TMA box Triton chose, and how many bulk reductions / atomics the PTX holds.
    python tma_dq_probe.py OUT.json --dry-run-cpu --head-dims 32 --seqlen 64
        no GPU: the GPU path's host code end to end on the CPU (interpreter, float16,
        B=1 H=2, tiny tiles; FA2/cuDNN rows fail there, attnhub's split runs).
"""

from __future__ import annotations

import os
import sys

# The interpreter is chosen when a kernel is decorated, so decide before importing Triton.
if "--cpu-check" in sys.argv or "--dry-run-cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
elif "--aot" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

import argparse
import dataclasses
import datetime
import hashlib
import json
import platform
import re
import subprocess
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton older than 3.3
    TensorDescriptor = None  # type: ignore[assignment,misc]

LOG2E = 1.4426950408889634
# The GPU path's device; --dry-run-cpu runs the same path on the CPU (interpreter, tiny
# shapes, single-call timings) to shake out host-side bugs before a GPU call.
DEVICE = "cpu" if "--dry-run-cpu" in sys.argv else "cuda"
SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- kernels


@triton.jit
def _delta_kernel(Out, DO, DELTA, ROWS, HEAD_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """delta[r] = sum_d O[r, d] * dO[r, d] (float32) over the (ROWS, HEAD_D) rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HEAD_D)
    inb = rows < ROWS
    offs = rows[:, None] * HEAD_D + cols[None, :]
    o = tl.load(Out + offs, mask=inb[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=inb[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=inb)


@triton.jit
def _dq_cast_kernel(ACC, DQ, NUMEL, sm_scale, BLOCK: tl.constexpr):
    """DQ = (ACC * sm_scale) in DQ's dtype, elementwise."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < NUMEL
    acc = tl.load(ACC + offs, mask=inb, other=0.0)
    tl.store(DQ + offs, (acc * sm_scale).to(DQ.dtype.element_ty), mask=inb)


@triton.jit
def _reduce_dq(
    part, DQ_ACC, DQ_DESC, bh, start_m, rows, offs_c, N,
    COL: tl.constexpr, HEAD_D: tl.constexpr, REDUCE: tl.constexpr, DESC_3D: tl.constexpr,
):  # fmt: skip
    """Add the float32 tile ``part`` (BLOCK_M, C) into DQacc at rows ``start_m ..`` of
    head ``bh``, columns COL .. COL + C - 1 (``rows``: the same rows as flat (B*H*N) row
    indices, int64; ``offs_c``: arange(C))."""
    if REDUCE == 0:
        if DESC_3D:
            DQ_DESC.atomic_add([bh, start_m, COL], tl.expand_dims(part, 0))
        else:
            DQ_DESC.atomic_add([bh * N + start_m, COL], part)
    else:
        ptrs = DQ_ACC + rows[:, None] * HEAD_D + COL + offs_c[None, :]
        tl.atomic_add(ptrs, part, sem="relaxed")


@triton.jit
def _fused_bwd_tile(
    dk, dv, k, v, k_lo, k_hi, Q, DO, LSE, DELTA, DQ_ACC, DQ_DESC,
    bh, row0, start_m, offs_n, offs_d, offs_h, N, qk_scale,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, REDUCE: tl.constexpr,
    SPLIT_D: tl.constexpr, DESC_3D: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One query block (rows start_m .. start_m + BLOCK_M - 1) against the program's keys:
    dk, dv updated and returned, dq_part reduced into DQacc. MASK: the block crosses the
    causal diagonal (keys j > row i get no weight)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = row0 + offs_m  # int64 rows of the flat (B*H*N, D) view
    q = tl.load(Q + rows[:, None] * HEAD_D + offs_d[None, :])
    do = tl.load(DO + rows[:, None] * HEAD_D + offs_d[None, :])
    lse2 = tl.load(LSE + rows) * 1.4426950408889634
    delta = tl.load(DELTA + rows)
    # (BLOCK_N, BLOCK_M) tiles: keys down, query rows across.
    qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)
    sT = qkT * qk_scale
    if MASK:
        sT = tl.where(offs_n[:, None] <= offs_m[None, :], sT, float("-inf"))
    pT = tl.exp2(sT - lse2[None, :])
    dv += tl.dot(pT.to(do.dtype), do, input_precision=INPUT_PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    ds16 = dsT.to(q.dtype)
    dk += tl.dot(ds16, q, input_precision=INPUT_PRECISION)
    ds_rows = tl.trans(ds16)  # (BLOCK_M, BLOCK_N)
    if SPLIT_D:
        dq_lo = tl.dot(ds_rows, k_lo, input_precision=INPUT_PRECISION)
        _reduce_dq(dq_lo, DQ_ACC, DQ_DESC, bh, start_m, rows, offs_h, N,
                   COL=0, HEAD_D=HEAD_D, REDUCE=REDUCE, DESC_3D=DESC_3D)  # fmt: skip
        dq_hi = tl.dot(ds_rows, k_hi, input_precision=INPUT_PRECISION)
        _reduce_dq(dq_hi, DQ_ACC, DQ_DESC, bh, start_m, rows, offs_h, N,
                   COL=HEAD_D // 2, HEAD_D=HEAD_D, REDUCE=REDUCE, DESC_3D=DESC_3D)  # fmt: skip
    else:
        dq_part = tl.dot(ds_rows, k, input_precision=INPUT_PRECISION)
        _reduce_dq(dq_part, DQ_ACC, DQ_DESC, bh, start_m, rows, offs_d, N,
                   COL=0, HEAD_D=HEAD_D, REDUCE=REDUCE, DESC_3D=DESC_3D)  # fmt: skip
    return dk, dv


@triton.jit
def _fused_bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, DQ_DESC, N, sm_scale, qk_scale,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    REDUCE: tl.constexpr, SPLIT_D: tl.constexpr, DESC_3D: tl.constexpr, STAGGER: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """grid (N // BLOCK_N, B * H): program (n, bh) owns keys [n * BLOCK_N, (n + 1) * BLOCK_N)
    of head bh. Q, K, V, DO, DK, DV: contiguous (B*H, N, HEAD_D); LSE (natural log) and
    DELTA: float32 (B*H, N); DQ_ACC: float32 (B*H, N, HEAD_D), zeroed by the caller.
    STAGGER (non-causal only): each program starts its query walk at its own key offset,
    so that the programs of one head do not all reduce into the same dQ rows at once."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    row0 = bh.to(tl.int64) * N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    offs_h = tl.arange(0, HEAD_D // 2)
    kv_rows = row0 + offs_n
    k = tl.load(K + kv_rows[:, None] * HEAD_D + offs_d[None, :])
    v = tl.load(V + kv_rows[:, None] * HEAD_D + offs_d[None, :])
    if SPLIT_D:
        k_lo = tl.load(K + kv_rows[:, None] * HEAD_D + offs_h[None, :])
        k_hi = tl.load(K + kv_rows[:, None] * HEAD_D + HEAD_D // 2 + offs_h[None, :])
    else:
        k_lo = k
        k_hi = k
    dk = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_D], dtype=tl.float32)
    # Two segments of query blocks: causal, the blocks that cross the diagonal (masked:
    # those before the key block's first key see none of it and are not visited), then
    # the ones below it; otherwise no first segment. STAGGER rotates the walk.
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, N)
    else:
        lo = 0
        mid = 0
    rot = start_n // BLOCK_M * BLOCK_M if STAGGER else 0
    for seg in tl.static_range(2):
        s0 = lo if seg == 0 else mid
        s1 = mid if seg == 0 else N
        for i in range(s0, s1, BLOCK_M):
            start_m = (i + rot) % N if STAGGER else i
            dk, dv = _fused_bwd_tile(
                dk, dv, k, v, k_lo, k_hi, Q, DO, LSE, DELTA, DQ_ACC, DQ_DESC,
                bh, row0, start_m, offs_n, offs_d, offs_h, N, qk_scale,
                HEAD_D=HEAD_D, BLOCK_M=BLOCK_M, MASK=CAUSAL and seg == 0, REDUCE=REDUCE,
                SPLIT_D=SPLIT_D, DESC_3D=DESC_3D, INPUT_PRECISION=INPUT_PRECISION,
            )  # fmt: skip
    out_offs = kv_rows[:, None] * HEAD_D + offs_d[None, :]
    tl.store(DK + out_offs, (dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(DV + out_offs, dv.to(DV.dtype.element_ty))


# ---------------------------------------------------------------- host side


@dataclass(frozen=True)
class Cfg:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    reduce: int = 0  # 0: TMA reduce through a tensor descriptor, 1: pointer atomics
    split_d: bool = False
    desc_3d: bool = True
    stagger: bool = False

    @property
    def name(self) -> str:
        s = f"{'tma' if self.reduce == 0 else 'ptr'}_m{self.block_m}_n{self.block_n}"
        s += f"_w{self.num_warps}_s{self.num_stages}"
        if self.split_d:
            s += "_splitd"
        if self.reduce == 0 and not self.desc_3d:
            s += "_desc2d"
        if self.stagger:
            s += "_stagger"
        return s


def _input_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def compute_delta(out: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) as float32 (B, H, N), by the small Triton kernel."""
    b, h, n, d = out.shape
    delta = torch.empty((b, h, n), device=out.device, dtype=torch.float32)
    rows = b * h * n
    block_r = max(1, min(128, 16384 // d))
    _delta_kernel[(triton.cdiv(rows, block_r),)](out, do, delta, rows, HEAD_D=d, BLOCK_R=block_r)
    return delta


def dq_descriptor(dq_acc: torch.Tensor, cfg: Cfg) -> Any:
    """The host-side tensor descriptor over DQacc (B*H, N, D) float32 whose box is one
    query block's dq tile: [1, BLOCK_M, C] (3-D) or [BLOCK_M, C] over the (B*H*N, D)
    view (2-D), C = D or D/2 (SPLIT_D)."""
    if TensorDescriptor is None:
        raise RuntimeError("triton.tools.tensor_descriptor is missing (Triton < 3.3)")
    bh, n, d = dq_acc.shape
    c = d // 2 if cfg.split_d else d
    if cfg.desc_3d:
        return TensorDescriptor(dq_acc, [bh, n, d], [n * d, d, 1], [1, cfg.block_m, c])
    return TensorDescriptor(dq_acc, [bh * n, d], [d, 1], [cfg.block_m, c])


def _check_inputs(q, k, v, out, lse, do, cfg: Cfg) -> None:  # type: ignore[no-untyped-def]
    b, h, n, d = q.shape
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("do", do)):
        assert t.shape == (b, h, n, d), f"{name} {tuple(t.shape)}"
        assert t.is_contiguous(), f"{name} must be contiguous"
    assert lse.shape == (b, h, n) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert d & (d - 1) == 0 and d >= 16, "HEAD_D must be a power of two"
    assert n % cfg.block_m == 0 and n % cfg.block_n == 0, "N must be a multiple of the tiles"


def fused_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    do: torch.Tensor, causal: bool, sm_scale: float, cfg: Cfg,
    delta: torch.Tensor | None = None, warmup: bool = False,
) -> Any:  # fmt: skip
    """(dq, dk, dv) from the fused kernel: delta (unless given), DQacc zeroed, the kernel,
    dq = (DQacc * sm_scale) cast. ``warmup``: compile the main kernel only (Triton's
    ``warmup``, no launch) and return what it returns."""
    _check_inputs(q, k, v, out, lse, do, cfg)
    b, h, n, d = q.shape
    if delta is None and not warmup:
        delta = compute_delta(out, do)
    elif delta is None:
        delta = lse  # only its type matters for a warmup
    dq_acc = torch.zeros((b * h, n, d), device=q.device, dtype=torch.float32)
    desc = dq_descriptor(dq_acc, cfg) if cfg.reduce == 0 else None
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    grid = (n // cfg.block_n, b * h)
    args = (
        q,
        k,
        v,
        do,
        lse,
        delta,
        dk,
        dv,
        dq_acc,
        desc,
        n,
        float(sm_scale),
        float(sm_scale * LOG2E),
    )
    meta = dict(
        HEAD_D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
        REDUCE=cfg.reduce, SPLIT_D=cfg.split_d, DESC_3D=cfg.desc_3d,
        STAGGER=bool(cfg.stagger and not causal), INPUT_PRECISION=_input_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if warmup:
        return _fused_bwd_kernel.warmup(*args, grid=grid, **meta)
    _fused_bwd_kernel[grid](*args, **meta)
    dq = torch.empty_like(q)
    numel = dq.numel()
    block = 4096
    _dq_cast_kernel[(triton.cdiv(numel, block),)](dq_acc, dq, numel, float(sm_scale), BLOCK=block)
    return dq, dk, dv


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (NaN anywhere gives NaN)."""
    x32, r32 = x.float(), ref.float()
    diff = (x32 - r32).abs().max().item()
    if not (torch.isfinite(x32).all().item()):
        return float("nan")
    scale = r32.abs().max().item()
    return diff / scale if scale > 0 else diff


def error_line(exc: BaseException) -> str:
    """The exception's type and its most telling line (compile errors are long)."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pick = next((ln for ln in lines if re.search(r"error|Error|out of resource|exceed|assert", ln)),
                lines[0] if lines else "")  # fmt: skip
    return f"{type(exc).__name__}: {pick[:400]}"


# ---------------------------------------------------------------- sweep


def sweep_configs(d: int, causal: bool, quick: bool) -> list[Cfg]:
    """The configs of one (head dim, causal) group, most promising first (a budget cut
    drops the tail). Pruned by ``--aot`` on the CPU (sm_90, Triton 3.6): every config
    here needs at most 227 KiB of shared memory; those left out needed more (D=256:
    (32, 64, 8, 3) full-D 241 KiB, (64, 64, 8, 2) 321 KiB, (64, 32, 8, 2) 241 KiB,
    (32, 128, 8, 2) 304 KiB; D=128: (128, 128, 8, 2) 321 KiB, (128, 64, 8, 2) 289 KiB)
    or spilled thousands of bytes ((32, 64, 4, 2) at D=256, (64, 128, 4, 3) at D=128).
    The full-D TMA box is accepted: Triton splits it into boxes of 32 float32 columns
    (128-byte swizzle), one bulk reduction each."""
    if DEVICE != "cuda":  # dry run: interpreter-sized tiles, every variant once
        return [Cfg(16, 32, 4, 1), Cfg(32, 16, 4, 1, split_d=True), Cfg(16, 16, 4, 1, desc_3d=False),
                Cfg(16, 32, 4, 1, stagger=True), Cfg(16, 16, 4, 1, reduce=1)]  # fmt: skip
    if d >= 256:
        tma = [
            Cfg(32, 64, 8, 3, split_d=True),  # the split backward's dK/dV tile; 0 spills non-causal
            Cfg(32, 64, 8, 2),
            Cfg(32, 64, 8, 2, split_d=True),
            Cfg(32, 32, 8, 2),  # 0 spills, 112 KiB
            Cfg(32, 32, 8, 3),
            Cfg(32, 32, 4, 3),
            Cfg(32, 32, 8, 3, split_d=True),
            Cfg(32, 64, 8, 1),
            Cfg(64, 64, 8, 1),
            Cfg(64, 64, 8, 1, split_d=True),
            Cfg(64, 32, 8, 1),
            Cfg(32, 32, 4, 2),
            Cfg(32, 64, 8, 3, split_d=True, desc_3d=False),
            Cfg(32, 64, 8, 3, split_d=True, stagger=True) if not causal else Cfg(64, 32, 4, 1),
        ]
        ptr = [Cfg(32, 64, 8, 3, reduce=1), Cfg(32, 32, 4, 2, reduce=1)]
        quick_set = [tma[0], tma[1], tma[3], ptr[0]]
    else:
        tma = [
            Cfg(64, 128, 8, 3),  # the split backward's dK/dV tile (lean table); 225 KiB
            Cfg(64, 128, 8, 2),
            Cfg(64, 64, 8, 3),  # 0 spills
            Cfg(32, 128, 8, 3),  # 0 spills
            Cfg(64, 128, 8, 3, split_d=True),
            Cfg(64, 64, 8, 2),
            Cfg(32, 128, 8, 2),
            Cfg(32, 64, 4, 3),
            Cfg(32, 64, 8, 3),
            Cfg(64, 64, 4, 3),
            Cfg(128, 32, 8, 2),
            Cfg(128, 64, 8, 1),
            Cfg(64, 128, 8, 3, desc_3d=False),
            Cfg(64, 128, 8, 3, stagger=True) if not causal else Cfg(64, 64, 8, 3, split_d=True),
        ]
        ptr = [Cfg(64, 128, 8, 3, reduce=1), Cfg(32, 64, 4, 3, reduce=1)]
        quick_set = [tma[0], tma[2], tma[3], ptr[0]]
    return quick_set if quick else tma + ptr


def _shape(d: int) -> tuple[int, int]:
    """(B, H) of the probe at head dim d: B=4, H=8 at D=256, B=4, H=16 at D=128 (and
    H = 2048 / D elsewhere); the dry run's B=1, H=2."""
    if DEVICE != "cuda":
        return 1, 2
    if d >= 256:
        return 4, 8
    return 4, max(1, 2048 // d)


def _git_head(path: str | None = None) -> str | None:
    try:
        cmd = (
            ["git", "rev-parse", "HEAD"]
            if path is None
            else ["git", "-C", path, "rev-parse", "HEAD"]
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = proc.stdout.strip() if proc.returncode == 0 else ""
    return commit if len(commit) == 40 else None


def env_block(attnhub_root: str | None) -> dict:
    here = Path(__file__).resolve()
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "script": str(here),
        "script_sha256": hashlib.sha256(here.read_bytes()).hexdigest(),
        "git_commit_cwd": _git_head(),
        "git_commit_script_dir": _git_head(str(here.parent)),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    if attnhub_root:
        env["attnhub_root"] = attnhub_root
        env["attnhub_commit"] = _git_head(attnhub_root)
    return env


def import_attnhub_ops(root: str | None) -> tuple[Any, str | None]:
    """attnhub's triton_flash ops module (for the split backward), or (None, reason).
    ``root``: a source checkout to put first on ``sys.path`` where attnhub is not
    installed (the installed package is what gpu_session.sh gives; a bare checkout
    imports ``attnhub`` but not ``attnhub.backends``, which pyproject maps from
    ``backends/``, so the row is then skipped with the reason)."""
    if root:
        sys.path.insert(0, root)
    try:
        from attnhub.backends.triton_flash import ops

        return ops, None
    except Exception as exc:
        return None, error_line(exc)


def sdpa_forward(q, k, v, causal: bool, sm_scale: float):  # type: ignore[no-untyped-def]
    """SDPA flash's forward: (fwd tuple, out, lse (B, H, N) float32 natural log, how)."""
    try:
        fwd = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=sm_scale
        )
        out, lse = fwd[0], fwd[1]
        n = q.shape[2]
        if lse.dim() == 4:
            lse = lse[..., 0]
        lse = lse[..., :n].float().contiguous()
        return fwd, out.contiguous(), lse, "aten._scaled_dot_product_flash_attention"
    except Exception as exc:
        log(f"  flash forward failed ({error_line(exc)}); lse by float32 matmuls")
    b, h, n, d = q.shape
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    qf, kf, vf = (t.reshape(b * h, n, d) for t in (q, k, v))
    keep = torch.ones(n, n, device=q.device, dtype=torch.bool).tril() if causal else None
    for i in range(b * h):
        s = (qf[i].float() @ kf[i].float().T) * sm_scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        lse.view(b * h, n)[i] = torch.logsumexp(s, -1)
        out.view(b * h, n, d)[i] = (torch.softmax(s, -1) @ vf[i].float()).to(q.dtype)
    return None, out, lse, "float32 matmuls"


def _lse_sanity(q, k, lse, causal: bool, sm_scale: float) -> float:  # type: ignore[no-untyped-def]
    """max |lse - float32 logsumexp| over head 0 of batch 0."""
    s = (q[0, 0].float() @ k[0, 0].float().T) * sm_scale
    if causal:
        n = s.shape[0]
        s = s.masked_fill(
            ~torch.ones(n, n, device=s.device, dtype=torch.bool).tril(), float("-inf")
        )
    return (torch.logsumexp(s, -1) - lse[0, 0]).abs().max().item()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench(fn) -> float:  # type: ignore[no-untyped-def]
    if DEVICE != "cuda":  # dry run: one call, wall clock
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_backward(
    rows: dict, name: str, fn: Any, how: str, ref: tuple | None, flops: float
) -> None:
    """Run ``fn`` (returns (dq, dk, dv)) once, record its errors against ``ref``, then
    its do_bench median, into ``rows[name]``."""
    row: dict[str, Any] = {"method": how}
    try:
        grads = fn()
        sync()
        if ref is not None:
            row["rel_err"] = {n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref)}
        del grads
        ms = bench(fn)
        row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
    except Exception as exc:
        row["error"] = error_line(exc)
    rows[name] = row
    errs_txt = ", ".join(f"{nm} {e:.1e}" for nm, e in row.get("rel_err", {}).items())
    log(f"  {name:7s} {row.get('tflops', '-'):>7} TFLOP/s  {row.get('ms', '-')} ms  "
        f"err[{errs_txt}] {row.get('error', '')} [{how}]")  # fmt: skip


def baselines(
    q, k, v, do, fwd, causal: bool, sm_scale: float, flops: float, ref: tuple | None
) -> dict:  # type: ignore[no-untyped-def]
    """SDPA flash (FA2) and cuDNN backward: errors against ``ref`` and do_bench medians
    of the backward alone (their aten backward ops on their own forward's outputs)."""
    aten = torch.ops.aten
    rows: dict[str, dict] = {}
    if fwd is not None:
        o, l_, cq, ck, mq, mk, rng, unused = fwd[:8]
        time_backward(rows, "fa2", lambda: aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, l_, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=sm_scale),
            "aten._scaled_dot_product_flash_attention_backward", ref, flops)  # fmt: skip
    else:
        rows["fa2"] = {"error": "no flash forward"}

    # cuDNN: its own forward, then its aten backward directly; where that op does not
    # take attn_bias=None, the backward through autograd (retain_graph) instead.
    try:
        cfwd = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=sm_scale
        )
        co, cl, cq, ck, mq, mk, seed, offset = cfwd[:8]
        # cuDNN may lay its output out as (B, N, H, D) in memory; a dO with other strides
        # would be copied (or refused) inside its backward: give it dO in out's layout.
        do_c = torch.empty_like(co)
        do_c.copy_(do)

        def cudnn_direct():  # type: ignore[no-untyped-def]
            return aten._scaled_dot_product_cudnn_attention_backward(
                do_c,
                q,
                k,
                v,
                co,
                cl,
                seed,
                offset,
                None,
                cq,
                ck,
                mq,
                mk,
                0.0,
                causal,
                scale=sm_scale,
            )

        try:
            cudnn_direct()
            sync()
            time_backward(rows, "cudnn", cudnn_direct, "aten._scaled_dot_product_cudnn_attention_backward",
                          ref, flops)  # fmt: skip
        except Exception as exc:
            log(f"  cudnn direct backward failed ({error_line(exc)}); timing autograd.grad")
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            og = aten._scaled_dot_product_cudnn_attention(qg, kg, vg, None, True, 0.0, causal, False,
                                                          scale=sm_scale)[0]  # fmt: skip
            do_g = torch.empty_like(og)
            do_g.copy_(do)
            time_backward(rows, "cudnn", lambda: torch.autograd.grad(og, (qg, kg, vg), do_g, retain_graph=True),
                          "autograd.grad through aten._scaled_dot_product_cudnn_attention", ref, flops)  # fmt: skip
    except Exception as exc:
        rows["cudnn"] = {"error": error_line(exc)}
        log(f"  cudnn   error {rows['cudnn']['error']}")
    return rows


def split_backward(ops_mod: Any, q, k, v, do, out, lse, causal: bool, sm_scale: float) -> Any:  # type: ignore[no-untyped-def]
    """attnhub's split backward (delta preprocess, dK/dV kernel, dQ kernel with the
    table's configs), raw op implementation on the given forward outputs, as a callable;
    None without attnhub."""
    if ops_mod is None:
        return None
    from torch._library.triton import set_wrap_triton_enabled

    def split() -> Any:
        with set_wrap_triton_enabled(False):
            return ops_mod._bwd_impl(do, q, k, v, None, None, out, lse, None, causal, False,
                                     ops_mod.NO_WINDOW, ops_mod.NO_WINDOW, 0.0, sm_scale, 0.0)  # fmt: skip

    return split


def _warm_in_thread(fn: Any) -> tuple[threading.Thread, list]:
    """Call ``fn`` once in a thread (its Triton kernels compile there, beside the
    sweep's parallel compiles); returns the thread and a list that gets its error."""
    errors: list = []

    def target() -> None:
        try:
            fn()
            sync()
        except Exception as exc:
            errors.append(error_line(exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def precompile(cfgs: list[Cfg], q, k, v, out, lse, do, causal, sm_scale, jobs: int) -> dict:  # type: ignore[no-untyped-def]
    """Compile the group's kernels in parallel (Triton's AsyncCompileMode with a thread
    pool; ``warmup`` compiles without launching). Returns {cfg name: compile error} for
    the ones that failed; on any trouble with the mechanism itself, compiles are left to
    the first launch (serial)."""
    errors: dict[str, str] = {}
    if jobs <= 1:
        return errors
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return errors
    t0 = time.time()
    futures: dict[str, Any] = {}
    try:
        with (
            ThreadPoolExecutor(max_workers=jobs) as pool,
            AsyncCompileMode(pool, ignore_errors=True),
        ):
            for cfg in cfgs:
                try:
                    futures[cfg.name] = fused_backward(
                        q, k, v, out, lse, do, causal, sm_scale, cfg, warmup=True
                    )
                except Exception as exc:
                    errors[cfg.name] = error_line(exc)
        for name, fk in futures.items():
            fut = getattr(fk, "future", None)
            if fut is not None and fut.exception() is not None:
                errors[name] = error_line(fut.exception())
    except Exception as exc:
        log(f"  async precompile failed ({error_line(exc)}); compiling at first launch")
        return {}
    log(f"  precompiled {len(cfgs)} configs in {time.time() - t0:.1f} s with {jobs} threads "
        f"({len(errors)} failed)")  # fmt: skip
    return errors


def run_group(group: dict, inputs: tuple, causal: bool, args: argparse.Namespace, ops_mod: Any,
              ops_err: str | None, save: Any, t_start: float) -> None:  # fmt: skip
    """One (head dim, causal) group: forward, reference, baselines, extras, the sweep;
    rows are written into ``group`` as they come (``save`` writes the JSON)."""
    q, k, v, do = inputs
    b, h, n, d = q.shape
    sm_scale = d**-0.5
    flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    group["flops"] = flops
    fwd, out, lse, how = sdpa_forward(q, k, v, causal, sm_scale)
    group["forward"] = how
    group["lse_check_max_abs_head0"] = _lse_sanity(q, k, lse, causal, sm_scale)
    if fwd is not None:
        o, l_, cq, ck, mq, mk, rng, unused = fwd[:8]
        ref = tuple(torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, l_, cq, ck, mq, mk, 0.0, causal, rng, unused, scale=sm_scale))  # fmt: skip
        group["reference"] = "SDPA flash backward (bf16)"
    else:
        log("  no flash backward: checking against autograd through SDPA math in float32 (slow)")
        qg, kg, vg = (t.detach().float().requires_grad_(True) for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            o32 = torch.nn.functional.scaled_dot_product_attention(
                qg, kg, vg, is_causal=causal, scale=sm_scale
            )
        ref = torch.autograd.grad(o32, (qg, kg, vg), do.float())
        del o32, qg, kg, vg
        group["reference"] = "SDPA math backward (float32)"
    group["baselines"] = baselines(q, k, v, do, fwd, causal, sm_scale, flops, ref)
    save()
    # attnhub's split backward compiles in a thread while the sweep's configs compile
    # (nothing is timed meanwhile), then is timed like the others.
    split = split_backward(ops_mod, q, k, v, do, out, lse, causal, sm_scale)
    warm = _warm_in_thread(split) if (split is not None and args.jobs > 1) else None
    cfgs = sweep_configs(d, causal, args.quick)
    compile_errors = precompile(cfgs, q, k, v, out, lse, do, causal, sm_scale, args.jobs)
    if warm is not None:
        warm[0].join()
        if warm[1]:
            log(f"  split warm-up failed: {warm[1][0]}")
    if split is not None:
        time_backward(
            group["baselines"], "split", split, "attnhub ops._bwd_impl (table configs)", ref, flops
        )
    else:
        group["baselines"]["split"] = {"error": f"attnhub not importable: {ops_err}"}
        log(f"  split   skipped: {ops_err}")
    save()
    # The extras a user pays beside the kernel, timed alone once per group.
    try:
        dq_acc = torch.zeros((b * h, n, d), device=DEVICE, dtype=torch.float32)
        dq_tmp = torch.empty_like(q)
        numel = dq_tmp.numel()

        def cast() -> None:
            _dq_cast_kernel[(triton.cdiv(numel, 4096),)](
                dq_acc, dq_tmp, numel, float(sm_scale), BLOCK=4096
            )

        group["extras_ms"] = {
            "delta": round(bench(lambda: compute_delta(out, do)), 4),
            "zero_dqacc": round(
                bench(lambda: torch.zeros((b * h, n, d), device=DEVICE, dtype=torch.float32)), 4
            ),
            "dq_scale_cast": round(bench(cast), 4),
        }
        log(f"  extras {group['extras_ms']} ms")
    except Exception as exc:
        group["extras_ms"] = {"error": error_line(exc)}
    delta = compute_delta(out, do)
    for cfg in cfgs:
        row: dict[str, Any] = {"name": cfg.name, **dataclasses.asdict(cfg)}
        group["configs"].append(row)
        if args.budget_s and time.time() - t_start > args.budget_s:
            row["skipped"] = f"budget {args.budget_s} s passed"
            log(f"  {cfg.name:34s} skipped (budget)")
            continue
        if cfg.name in compile_errors:
            row["error"] = compile_errors[cfg.name]
            row["stage"] = "compile"
            log(f"  {cfg.name:34s} COMPILE {row['error']}")
            continue
        try:
            t0 = time.time()
            dq, dk, dv = fused_backward(q, k, v, out, lse, do, causal, sm_scale, cfg, delta=delta)
            sync()
            row["first_call_s"] = round(time.time() - t0, 2)
            errs = {nm: rel_err(g, r) for nm, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)}
            row["rel_err"] = errs
            row["ok"] = all(e <= args.tol for e in errs.values())  # NaN fails
            del dq, dk, dv
            if row["ok"]:
                ms = bench(
                    lambda cfg=cfg: fused_backward(q, k, v, out, lse, do, causal, sm_scale, cfg)
                )
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
        except Exception as exc:
            row["error"] = error_line(exc)
            row["stage"] = "run"
            row["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
        errs_txt = ", ".join(f"{nm} {e:.1e}" for nm, e in row.get("rel_err", {}).items())
        status = row.get("error") or ("" if row.get("ok") else "WRONG")
        log(f"  {cfg.name:34s} {row.get('tflops', '-'):>7} TFLOP/s  {row.get('ms', '-')} ms  "
            f"err[{errs_txt}] {status}")  # fmt: skip
        save()


def run_gpu(args: argparse.Namespace) -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        log(
            "no CUDA device: run with --cpu-check, --aot or --dry-run-cpu on a machine without a GPU"
        )
        return 2
    if DEVICE != "cuda":
        _install_interpreter_descriptor_reduce()
        args.jobs = 1  # the interpreter compiles nothing
    t_start = time.time()
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    n = args.seqlen
    # bfloat16 on the GPU; the dry run's interpreter cannot multiply bfloat16 (raw bits).
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    ops_mod, ops_err = import_attnhub_ops(args.attnhub_root)
    env = env_block(args.attnhub_root)
    if ops_mod is not None:
        env["attnhub_ops_file"] = ops_mod.__file__
        env["attnhub_ops_commit"] = _git_head(str(Path(ops_mod.__file__).parent))
    else:
        env["attnhub_import_error"] = ops_err
    result: dict[str, Any] = {
        "env": env,
        "args": vars(args),
        "notes": {
            "flops": "backward = 2.5 * 4 * B * H * N^2 * D, halved for causal",
            "timed": (
                "ours: delta preprocess + DQacc zeroing + kernel + dq scale/cast, "
                "do_bench median (warmup 25, rep 100); fa2/cudnn/split: their backward ops alone"
            ),
            "rel_err": "max |x - ref| / max |ref|, ref = SDPA flash backward (bf16)",
            "tolerance": args.tol,
        },
        "groups": [],
    }
    out_path = Path(args.out)

    def save() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1, default=str))

    for d in head_dims:
        b, h = _shape(d)
        torch.manual_seed(0)
        inputs = tuple(torch.randn(b, h, n, d, device=DEVICE, dtype=dtype) for _ in range(4))
        for causal in (False, True):
            log(f"== D={d} B={b} H={h} N={n} causal={causal} (t={time.time() - t_start:.0f} s)")
            group: dict[str, Any] = {"D": d, "B": b, "H": h, "N": n, "causal": causal,
                                     "dtype": str(dtype).replace("torch.", ""), "configs": []}  # fmt: skip
            result["groups"].append(group)
            run_group(group, inputs, causal, args, ops_mod, ops_err, save, t_start)
            group["summary"] = summarize(group)
            save()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        del inputs
    result["wall_s"] = round(time.time() - t_start, 1)
    result["summary"] = [g.get("summary") for g in result["groups"]]
    save()
    print_table(result["groups"])
    log(f"wrote {out_path} ({result['wall_s']} s)")
    return 0


def summarize(group: dict) -> dict:
    def best(kind: int) -> dict | None:
        rows = [
            r for r in group["configs"] if r.get("reduce") == kind and r.get("ok") and "tflops" in r
        ]
        return max(rows, key=lambda r: r["tflops"]) if rows else None

    tma, ptr = best(0), best(1)
    base = group.get("baselines", {})
    s: dict[str, Any] = {
        "D": group["D"], "causal": group["causal"],
        "tma_best": tma and {"name": tma["name"], "tflops": tma["tflops"], "ms": tma["ms"]},
        "ptr_best": ptr and {"name": ptr["name"], "tflops": ptr["tflops"], "ms": ptr["ms"]},
    }  # fmt: skip
    for key in ("split", "fa2", "cudnn"):
        s[key] = base.get(key, {}).get("tflops")
    if tma:
        for key in ("fa2", "split", "cudnn"):
            if s[key]:
                s[f"tma/{key}"] = round(tma["tflops"] / s[key], 3)
        if ptr and ptr["tflops"]:
            s["tma/ptr"] = round(tma["tflops"] / ptr["tflops"], 3)
    return s


def print_table(groups: list[dict]) -> None:
    head = (f"{'D':>4} {'causal':>6} | {'best TMA config':30s} {'TMA':>6} | {'best ptr config':26s} "
            f"{'ptr':>6} | {'split':>6} {'FA2':>6} {'cuDNN':>6} | {'tma/FA2':>7} {'tma/split':>9} {'tma/cuDNN':>9}")  # fmt: skip
    log("")
    log("backward TFLOP/s (bf16)")
    log(head)
    log("-" * len(head))

    def f(x: Any, w: int = 6) -> str:
        return f"{x:>{w}}" if x is not None else f"{'-':>{w}}"

    for g in groups:
        s = g.get("summary") or summarize(g)
        tma, ptr = s.get("tma_best") or {}, s.get("ptr_best") or {}
        log(f"{g['D']:>4} {g['causal']!s:>6} | {tma.get('name', '-'):30s} {f(tma.get('tflops'))} | "
            f"{ptr.get('name', '-'):26s} {f(ptr.get('tflops'))} | {f(s.get('split'))} {f(s.get('fa2'))} "
            f"{f(s.get('cudnn'))} | {f(s.get('tma/fa2'), 7)} {f(s.get('tma/split'), 9)} "
            f"{f(s.get('tma/cudnn'), 9)}")  # fmt: skip


# ---------------------------------------------------------------- CPU check


def _install_interpreter_descriptor_reduce() -> None:
    """Triton 3.6's interpreter has descriptor load/store but no descriptor reduce: add
    one (the box's pointers and bounds mask as for a descriptor store, then an fp32
    atomic add), so that the REDUCE=0 path's offsets, box and split columns run on the
    CPU. An emulation, not the TMA instruction: the GPU run is what tests that."""
    from triton._C.libtriton import interpreter as _interp
    from triton._C.libtriton import ir as _ir
    from triton.runtime.interpreter import InterpreterBuilder

    if hasattr(InterpreterBuilder, "create_descriptor_reduce"):
        return

    def create_descriptor_reduce(self, kind, desc, value, indices):  # type: ignore[no-untyped-def]
        assert kind == _ir.DESCRIPTOR_REDUCE_KIND.ADD, kind
        ptrs, mask = desc.materialize_pointers(indices)
        assert value.data.shape == ptrs.data.shape, (value.data.shape, ptrs.data.shape)
        _interp.atomic_rmw(
            _interp.RMW_OP.FADD, ptrs.data, value.data, mask, _interp.MEM_SEMANTIC.RELAXED
        )
        return None  # as create_masked_store: a void op has no value

    InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce  # type: ignore[attr-defined]


def _reference64(q, k, v, do, causal: bool, sm_scale: float):  # type: ignore[no-untyped-def]
    """(out, lse, dq, dk, dv) in float64 by autograd through plain softmax attention."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * sm_scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v64
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), do.double())
    return out.detach(), lse.detach(), dq, dk, dv


def cpu_check(args: argparse.Namespace) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _install_interpreter_descriptor_reduce()
    torch.manual_seed(0)
    b, h, n = 1, 2, 64
    cases = []
    # float16 is the half-precision case: Triton's interpreter keeps bfloat16 as raw
    # uint16 bits and its tl.dot multiplies those (attnhub's interpreter tests skip
    # bfloat16 for the same reason); the kernel's casts are the same for both.
    for dtype in (torch.float32, torch.float16):
        for d in (32, 64):
            for causal in (False, True):
                cfgs = [
                    Cfg(16, 16, 4, 1, reduce=1),
                    Cfg(32, 16, 4, 1, reduce=1),
                    Cfg(16, 32, 4, 1, reduce=1, split_d=True),
                    Cfg(16, 32, 4, 1, reduce=0),  # descriptor path, emulated reduce
                    Cfg(32, 16, 4, 1, reduce=0, split_d=True),
                    Cfg(16, 16, 4, 1, reduce=0, desc_3d=False),
                ]
                if not causal:
                    cfgs.append(Cfg(16, 32, 4, 1, reduce=1, stagger=True))
                cases += [(dtype, d, causal, c) for c in cfgs]
    tol = {torch.float32: 1e-4, torch.float16: 1e-2}
    failures = 0
    t0 = time.time()
    inputs: dict = {}
    for dtype, d, causal, cfg in cases:
        key = (dtype, d, causal)
        if key not in inputs:
            q, k, v, do = (torch.randn(b, h, n, d).to(dtype) for _ in range(4))
            sm_scale = d**-0.5
            out64, lse64, dq64, dk64, dv64 = _reference64(q, k, v, do, causal, sm_scale)
            out = out64.to(dtype).contiguous()
            lse = lse64.float().contiguous()
            delta = compute_delta(out, do)
            delta_ref = (out.double() * do.double()).sum(-1)
            derr = ((delta.double() - delta_ref).abs().max() / delta_ref.abs().max()).item()
            if derr > 1e-5:
                failures += 1
                log(f"FAIL delta kernel {dtype} D={d}: rel err {derr:.2e}")
            inputs[key] = (q, k, v, do, out, lse, sm_scale, (dq64, dk64, dv64))
        q, k, v, do, out, lse, sm_scale, ref = inputs[key]
        dq, dk, dv = fused_backward(q, k, v, out, lse, do, causal, sm_scale, cfg)
        errs = [rel_err(g.double(), r) for g, r in zip((dq, dk, dv), ref)]
        ok = all(e <= tol[dtype] for e in errs)
        failures += not ok
        dname = str(dtype).replace("torch.", "")
        log(f"{'ok  ' if ok else 'FAIL'} {dname:8s} D={d:<3} causal={causal!s:5} {cfg.name:28s} "
            f"rel err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} (tol {tol[dtype]:.0e})")  # fmt: skip
    log(f"{len(cases) - failures}/{len(cases)} cases passed in {time.time() - t0:.1f} s "
        f"(B={b} H={h} N={n}; float64 autograd reference)")  # fmt: skip
    return 1 if failures else 0


# ---------------------------------------------------------------- AOT (no GPU)


def _ptxas_numbers(ptx: str, capability: int) -> tuple[int, int, int] | None:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        res = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
             src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", res.stderr)
    if not (regs and spills):
        return None
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def aot_compile(cfg: Cfg, d: int, causal: bool, capability: int = 90) -> dict:
    """Compile the fused kernel for ``cfg`` (bf16, head dim ``d``) for sm_``capability``
    as the JIT would specialize it on the GPU (16-byte aligned pointers, N % 16 == 0)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    c = d // 2 if cfg.split_d else d
    box = [1, cfg.block_m, c] if cfg.desc_3d else [cfg.block_m, c]
    desc_sig = "tensordesc<fp32[" + ",".join(map(str, box)) + "]>"
    ptr_names = ["Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV", "DQ_ACC"]
    types = {"LSE": "*fp32", "DELTA": "*fp32", "DQ_ACC": "*fp32"}
    signature: dict[str, str] = {nm: types.get(nm, "*bf16") for nm in ptr_names}
    constexprs: dict[str, Any] = {
        "HEAD_D": d, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "CAUSAL": causal,
        "REDUCE": cfg.reduce, "SPLIT_D": cfg.split_d, "DESC_3D": cfg.desc_3d,
        "STAGGER": bool(cfg.stagger and not causal), "INPUT_PRECISION": "tf32",
    }  # fmt: skip
    if cfg.reduce == 0:
        signature["DQ_DESC"] = desc_sig
    else:
        signature["DQ_DESC"] = "constexpr"
        constexprs["DQ_DESC"] = None
    signature.update(N="i32", sm_scale="fp32", qk_scale="fp32")
    for nm in constexprs:
        signature[nm] = "constexpr"
    params = [p.name for p in _fused_bwd_kernel.params]
    signature = {nm: signature[nm] for nm in params}
    attrs = {(params.index(nm),): [["tt.divisibility", 16]] for nm in [*ptr_names, "N"]}
    src = ASTSource(fn=_fused_bwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    row: dict[str, Any] = {"name": cfg.name, "D": d, "causal": causal}
    t0 = time.time()
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", capability, 64),
                                  options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})  # fmt: skip
    except Exception as exc:
        row.update(error=error_line(exc), compile_s=round(time.time() - t0, 1))
        return row
    row["compile_s"] = round(time.time() - t0, 1)
    md = compiled.metadata
    shared = getattr(md, "shared", None)
    row["shared"] = shared
    row["shared_ok"] = shared is not None and shared <= SHARED_LIMIT
    tmeta = getattr(md, "tensordesc_meta", None)
    if tmeta:
        row["tensordesc_meta"] = [{k: v for k, v in m.items() if k in ("block_size", "swizzle", "elem_size", "elem_type")}
                                  for m in tmeta]  # fmt: skip
    ptx = compiled.asm["ptx"]
    row["ptx_bulk_reduce"] = len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx))
    row["ptx_atom_red"] = len(
        re.findall(r"\b(?:red|atom)\.(?:global|gpu|relaxed|release|acq_rel)[\w.]*", ptx)
    )
    numbers = _ptxas_numbers(ptx, capability)
    if numbers:
        row["registers"], row["stack"], row["spill_stores"] = numbers
    return row


def run_aot(args: argparse.Namespace) -> int:
    head_dims = [int(x) for x in args.head_dims.split(",") if x]
    jobs = max(1, args.jobs)
    tasks = [(cfg, d, causal) for d in head_dims for causal in (False, True)
             for cfg in sweep_configs(d, causal, args.quick)]  # fmt: skip
    log(f"compiling {len(tasks)} kernels for sm_90 with {jobs} threads")
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(lambda t: aot_compile(*t), tasks))
    wall = time.time() - t0
    bad = 0
    for r in rows:
        if "error" in r:
            bad += 1
            log(f"D={r['D']:<3} causal={r['causal']!s:5} {r['name']:32s} ERROR {r['error']}")
            continue
        log(f"D={r['D']:<3} causal={r['causal']!s:5} {r['name']:32s} regs={r.get('registers', '?')} "
            f"spill={r.get('spill_stores', '?')} shared={r['shared']}{'' if r['shared_ok'] else ' (OVER)'} "
            f"bulk_reduce={r['ptx_bulk_reduce']} atom/red={r['ptx_atom_red']} "
            f"box={[m.get('block_size') for m in r.get('tensordesc_meta', [])]} {r['compile_s']} s")  # fmt: skip
    log(f"{len(rows) - bad}/{len(rows)} compiled; wall {wall:.1f} s, sum of compile times "
        f"{sum(r.get('compile_s', 0) for r in rows):.1f} s")  # fmt: skip
    if args.out:
        Path(args.out).write_text(
            json.dumps({"env": env_block(None), "rows": rows, "wall_s": wall}, indent=1)
        )
    return 1 if bad else 0


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="output JSON (required on the GPU)")
    p.add_argument("--head-dims", default="256,128", help="comma list, run in this order")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--quick", action="store_true", help="about 4 configs per (head dim, causal)")
    p.add_argument("--tol", type=float, default=2e-2,
                   help="max abs error / reference max abs, per gradient (default 2e-2)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="parallel compile threads (1: compile at first launch)")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip the remaining configs once the run is this old, so that the table "
                        "prints inside a 600 s limit (default 480; 0: no limit)")  # fmt: skip
    p.add_argument("--attnhub-root", default=None,
                   help="a source checkout to put first on sys.path (attnhub.backends needs the installed package)")  # fmt: skip
    p.add_argument("--cpu-check", action="store_true", help="interpreter check on the CPU")
    p.add_argument("--aot", action="store_true", help="compile the sweep for sm_90 without a GPU")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="the GPU path on the CPU (interpreter; use --head-dims 32 --seqlen 64)")  # fmt: skip
    args = p.parse_args()
    if args.cpu_check:
        return cpu_check(args)
    if args.aot:
        return run_aot(args)
    if not args.out:
        p.error("OUT.json is required")
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
