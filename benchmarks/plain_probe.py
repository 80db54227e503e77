"""The forward's main loop alone, beside triton_flash at the same launch configuration.

A diagnostic for benchmarks/NOTES.md (issue 4): anchors-h200.md reports a plain FA2-style
Triton forward, with none of the contract's features, 5-15% faster than triton_flash's
forward on the same chip. This is our own plain kernel (no masks, N a multiple of the
tiles, contiguous (B, H, N, D) inputs, scale folded into the exponent), timed in the same
process and on the same inputs as triton_flash with the same (BLOCK_M, BLOCK_N, warps,
stages), so that a gap between the two is the cost of the contract's structure and not
of tiles or machine. KT=1 loads K as a (D, BLOCK_N) tile instead of transposing a
(BLOCK_N, D) tile. SDPA's flash and cuDNN kernels are timed on the same inputs, for the
ratios the issue's bars use. Prints one line per trial and writes JSON.

Variants beside the plain loop: causal (two loops, the diagonal masked), a persistent
grid (with and without ``tl.range(flatten=True)``), K/V through tensor descriptors
(TMA), and two programs per SM (two stages, registers capped at 128).

    python3 benchmarks/plain_probe.py OUT.json [--seqlen N] [--causal]   (N default 4096;
        B = 16384 / N)
    python3 benchmarks/plain_probe.py --registers   (no GPU: ptxas registers and spills of
        the plain loop at D=128, (128, 64, 8, stages), capped or not; run it without
        TRITON_INTERPRET)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from attnhub.backends.triton_flash import tuning
from attnhub.backends.triton_flash.ops import flash_attention


@triton.jit
def _plain_step(q, kt, v_src, row, start_n, offs_m, offs_n, m_i, l_i, acc, qk_scale,
                MASK: tl.constexpr, DESC: tl.constexpr):  # fmt: skip
    """One key tile into the running softmax: kt is the (D, BN) K tile, V comes from
    pointers (v_src) or a tensor descriptor at row ``row`` (DESC); MASK: causal mask."""
    qk = tl.dot(q, kt)
    if MASK:
        qk = tl.where(start_n + offs_n[None, :] > offs_m[:, None], float("-inf"), qk)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DESC:
        v = v_src.load([row, 0])
    else:
        v = tl.load(v_src)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _plain_kt(k_ptrs, KT: tl.constexpr):
    """The (D, BN) K tile: loaded as laid out by the pointers (KT) or transposed."""
    if KT:
        kt = tl.load(k_ptrs)
    else:
        kt = tl.trans(tl.load(k_ptrs))
    return kt


@triton.jit
def _plain_tile(Q, K, V, Out, N, qk_scale, start_m, base, BM: tl.constexpr, BN: tl.constexpr,
                D: tl.constexpr, KT: tl.constexpr, CAUSAL: tl.constexpr, FLATTEN: tl.constexpr):  # fmt: skip
    """One row block. CAUSAL=1: unmasked keys [0, start_m) in one loop, then the diagonal
    keys masked in a second (BM a multiple of BN); CAUSAL=2: one loop over [0, start_m +
    BM) masking every tile (what a single flattenable inner loop costs)."""
    offs_m = start_m + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    if KT:
        k_ptrs = K + base + offs_n[None, :] * D + offs_d[:, None]
    else:
        k_ptrs = K + base + offs_n[:, None] * D + offs_d[None, :]
    v_ptrs = V + base + offs_n[:, None] * D + offs_d[None, :]
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if CAUSAL == 1:
        hi = start_m
    elif CAUSAL == 2:
        hi = start_m + BM
    else:
        hi = N
    for start_n in tl.range(0, hi, BN, flatten=FLATTEN):
        m_i, l_i, acc = _plain_step(q, _plain_kt(k_ptrs, KT), v_ptrs, 0, start_n, offs_m, offs_n,
                                    m_i, l_i, acc, qk_scale, CAUSAL == 2, False)  # fmt: skip
        k_ptrs += BN * D
        v_ptrs += BN * D
    if CAUSAL == 1:
        for start_n in range(start_m, start_m + BM, BN):
            m_i, l_i, acc = _plain_step(q, _plain_kt(k_ptrs, KT), v_ptrs, 0, start_n, offs_m,
                                        offs_n, m_i, l_i, acc, qk_scale, True, False)  # fmt: skip
            k_ptrs += BN * D
            v_ptrs += BN * D
    tl.store(
        Out + base + offs_m[:, None] * D + offs_d[None, :],
        (acc / l_i[:, None]).to(Out.dtype.element_ty),
    )


@triton.jit
def _plain_fwd(Q, K, V, Out, N, qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               KT: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    start_m = tl.program_id(0) * BM
    if CAUSAL:  # heaviest row blocks first
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
    base = tl.program_id(1).to(tl.int64) * N * D
    _plain_tile(Q, K, V, Out, N, qk_scale, start_m, base, BM, BN, D, KT, CAUSAL, False)


@triton.jit
def _plain_persistent(Q, K, V, Out, N, BH, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
                      D: tl.constexpr, CAUSAL: tl.constexpr, FLATTEN: tl.constexpr):  # fmt: skip
    """A persistent grid: program p takes tiles p, p + P, ... (P programs), heads-major
    (one head's row blocks in a row) without causal, heaviest row blocks first (all
    heads' last row block, then the one before) with it. FLATTEN: one flattened,
    software-pipelined loop over all of a program's tiles and key steps (tl.range's
    flatten), so the next tile's first loads can overlap this tile's epilogue."""
    n_m = N // BM
    for tile in tl.range(tl.program_id(0), n_m * BH, tl.num_programs(0), flatten=FLATTEN):
        if CAUSAL:
            start_m = (n_m - 1 - tile // BH) * BM
            bh = tile % BH
        else:
            start_m = (tile % n_m) * BM
            bh = tile // n_m
        _plain_tile(Q, K, V, Out, N, qk_scale, start_m, bh.to(tl.int64) * N * D, BM, BN, D,
                    False, CAUSAL, FLATTEN)  # fmt: skip


LOG2E = 1.4426950408889634


@triton.jit
def _plain_tma_fwd(Q, k_desc, v_desc, Out, N, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
                   D: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """The plain loop with K/V read through host-made tensor descriptors (TMA) over the
    (B * H * N, D) rows: no per-thread addresses for the streamed tiles."""
    start_m = tl.program_id(0) * BM
    if CAUSAL:
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
    bh = tl.program_id(1)
    base = bh.to(tl.int64) * N * D
    offs_m = start_m + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    row0 = bh * N
    hi = start_m if CAUSAL else N
    for start_n in range(0, hi, BN):
        row = row0 + start_n
        m_i, l_i, acc = _plain_step(q, tl.trans(k_desc.load([row, 0])), v_desc, row, start_n,
                                    offs_m, offs_n, m_i, l_i, acc, qk_scale, False, True)  # fmt: skip
    if CAUSAL:
        for start_n in range(start_m, start_m + BM, BN):
            row = row0 + start_n
            m_i, l_i, acc = _plain_step(q, tl.trans(k_desc.load([row, 0])), v_desc, row,
                                        start_n, offs_m, offs_n, m_i, l_i, acc, qk_scale, True,
                                        True)  # fmt: skip
    tl.store(
        Out + base + offs_m[:, None] * D + offs_d[None, :],
        (acc / l_i[:, None]).to(Out.dtype.element_ty),
    )


def plain_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple,
              causal: int = 0) -> torch.Tensor:  # fmt: skip
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, h, n, d = q.shape
    out = torch.empty_like(q)
    bm, bn, warps, stages = cfg[:4]
    k_desc = TensorDescriptor.from_tensor(k.view(b * h * n, d), [bn, d])
    v_desc = TensorDescriptor.from_tensor(v.view(b * h * n, d), [bn, d])
    _plain_tma_fwd[(n // bm, b * h)](q, k_desc, v_desc, out, n, d**-0.5 * LOG2E, BM=bm, BN=bn,
                                     D=d, CAUSAL=causal, num_warps=warps, num_stages=stages)  # fmt: skip
    return out


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple, kt: bool,
          causal: int = 0) -> torch.Tensor:  # fmt: skip
    b, h, n, d = q.shape
    out = torch.empty_like(q)
    bm, bn, warps, stages = cfg[:4]
    extra = {"maxnreg": cfg[4]} if len(cfg) > 4 else {}
    _plain_fwd[(n // bm, b * h)](q, k, v, out, n, d**-0.5 * LOG2E, BM=bm, BN=bn, D=d, KT=kt,
                                 CAUSAL=causal, num_warps=warps, num_stages=stages, **extra)  # fmt: skip
    return out


def persistent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple, programs: int,
               causal: int, flatten: bool) -> torch.Tensor:  # fmt: skip
    b, h, n, d = q.shape
    out = torch.empty_like(q)
    bm, bn, warps, stages = cfg[:4]
    _plain_persistent[(min(programs, n // bm * b * h),)](
        q, k, v, out, n, b * h, d**-0.5 * LOG2E, BM=bm, BN=bn, D=d, CAUSAL=causal,
        FLATTEN=flatten, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


CONFIGS = {64: [(128, 64, 4, 4), (128, 128, 4, 3)], 128: [(128, 64, 8, 3), (128, 128, 8, 3)]}


def _sdpa(backend, causal):  # type: ignore[no-untyped-def]
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def registers() -> None:
    """ptxas registers, spills and spills inside loops of the plain loop compiled for
    sm_90 without a GPU (aot_check's ahead-of-time path), at the launches the probe times
    and the two-programs-per-SM cap."""
    import importlib.util
    from pathlib import Path

    # The ahead-of-time checker is a developer script beside this one (not in the package).
    spec = importlib.util.spec_from_file_location(
        "aot_check", Path(__file__).with_name("aot_check.py")
    )
    assert spec is not None and spec.loader is not None
    aot_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot_check)

    x = torch.empty(16, 16, 1024, 128, dtype=torch.bfloat16)
    for causal, stages, cap in ((0, 3, None), (0, 2, 128), (1, 3, None), (1, 2, 128)):
        kw = dict(BM=128, BN=64, D=128, KT=False, CAUSAL=causal, num_warps=8, num_stages=stages)
        if cap:
            kw["maxnreg"] = cap
        compiled = aot_check.compile_launch(_plain_fwd, (x, x, x, x, 1024, 0.1), kw, 90)
        in_loops = aot_check.loop_spills(compiled.asm["cubin"])
        print(f"causal={causal} stages={stages} maxnreg={cap}: "
              f"{aot_check.ptxas_usage(compiled.asm['ptx'], 90)} loop STL/LDL={in_loops}")  # fmt: skip


def main() -> None:
    from torch.nn.attention import SDPBackend

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--registers", action="store_true", help="ptxas registers, no GPU")
    args = parser.parse_args()
    if args.registers:
        registers()
        return
    if args.output is None:
        parser.error("OUT.json is required unless --registers")
    rows = []
    causal = args.causal
    flash, cudnn = (
        _sdpa(SDPBackend.FLASH_ATTENTION, causal),
        _sdpa(SDPBackend.CUDNN_ATTENTION, causal),
    )
    for d in (64, 128):
        n = args.seqlen
        b, h = 16384 // n, 2048 // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        flops = 4 * b * h * n * n * d // (2 if causal else 1)
        # Resident programs per SM at these tiles: D=64 (4 warps) fits two, D=128 one.
        programs = _sms() * (2 if d == 64 else 1)
        for i, cfg in enumerate(CONFIGS[d]):
            with tuning.override(fwd=cfg):
                trials = {
                    "triton_flash": lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=causal)[0],
                    "plain": lambda q=q, k=k, v=v, cfg=cfg: plain(q, k, v, cfg, False, int(causal)),
                    "persistent": lambda q=q, k=k, v=v, cfg=cfg, p=programs: persistent(
                        q, k, v, cfg, p, int(causal), False),
                    "persistent_flat": lambda q=q, k=k, v=v, cfg=cfg, p=programs: persistent(
                        q, k, v, cfg, p, 2 * int(causal), True),
                }  # fmt: skip
                trials["plain_tma"] = lambda q=q, k=k, v=v, cfg=cfg: plain_tma(
                    q, k, v, cfg, int(causal)
                )
                if d == 128 and cfg[1] == 64:
                    # Two resident programs per SM: two stages (96 KiB of shared memory each)
                    # and at most 128 registers a thread.
                    two = (*cfg[:3], 2, 128)
                    trials["plain_2cta"] = lambda q=q, k=k, v=v, c=two: plain(q, k, v, c, False,
                                                                              int(causal))  # fmt: skip
                if i == 0:
                    trials["torch_sdpa_flash"] = lambda q=q, k=k, v=v: flash(q, k, v)
                    trials["torch_sdpa_cudnn"] = lambda q=q, k=k, v=v: cudnn(q, k, v)
                for name, fn in trials.items():
                    row = {"kernel": name, "D": d, "N": n, "B": b, "H": h, "causal": causal,
                           "config": cfg}  # fmt: skip
                    try:
                        err = (fn().float() - ref.float()).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                        row.update(max_abs_diff_vs_sdpa=err, ms=round(ms, 4),
                                   tflops=round(flops / ms / 1e9, 1))  # fmt: skip
                    except Exception as exc:  # a variant that does not compile is a result too
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(row, flush=True)
                    rows.append(row)
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
