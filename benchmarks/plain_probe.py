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

    python3 benchmarks/plain_probe.py OUT.json [--seqlen N]   (default 4096; B = 16384 / N)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from attnhub.backends.triton_flash import configs
from attnhub.backends.triton_flash.ops import flash_attention


@triton.jit
def _plain_fwd(Q, K, V, Out, N, qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               KT: tl.constexpr):  # fmt: skip
    start_m = tl.program_id(0) * BM
    base = tl.program_id(1).to(tl.int64) * N * D
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
    for _ in range(0, N, BN):
        if KT:
            qk = tl.dot(q, tl.load(k_ptrs))
        else:
            qk = tl.dot(q, tl.trans(tl.load(k_ptrs)))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        k_ptrs += BN * D
        v_ptrs += BN * D
    tl.store(
        Out + base + offs_m[:, None] * D + offs_d[None, :],
        (acc / l_i[:, None]).to(Out.dtype.element_ty),
    )


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: tuple, kt: bool) -> torch.Tensor:
    b, h, n, d = q.shape
    out = torch.empty_like(q)
    bm, bn, warps, stages = cfg
    _plain_fwd[(n // bm, b * h)](q, k, v, out, n, d**-0.5 * 1.4426950408889634, BM=bm, BN=bn, D=d,
                                 KT=kt, num_warps=warps, num_stages=stages)  # fmt: skip
    return out


CONFIGS = {64: [(128, 64, 4, 4), (128, 128, 4, 3)], 128: [(128, 64, 8, 3), (128, 128, 8, 3)]}


def _sdpa(backend):  # type: ignore[no-untyped-def]
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):  # type: ignore[no-untyped-def]
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return run


def main() -> None:
    from torch.nn.attention import SDPBackend

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    rows = []
    flash, cudnn = _sdpa(SDPBackend.FLASH_ATTENTION), _sdpa(SDPBackend.CUDNN_ATTENTION)
    for d in (64, 128):
        n = args.seqlen
        b, h = 16384 // n, 2048 // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        flops = 4 * b * h * n * n * d
        for cfg in CONFIGS[d]:
            configs.OVERRIDE["fwd"] = configs.LaunchConfig(*cfg)
            trials = {
                "triton_flash": lambda q=q, k=k, v=v: flash_attention(q, k, v)[0],
                "plain": lambda q=q, k=k, v=v, cfg=cfg: plain(q, k, v, cfg, False),
                "plain_kt": lambda q=q, k=k, v=v, cfg=cfg: plain(q, k, v, cfg, True),
                "torch_sdpa_flash": lambda q=q, k=k, v=v: flash(q, k, v),
                "torch_sdpa_cudnn": lambda q=q, k=k, v=v: cudnn(q, k, v),
            }
            for name, fn in trials.items():
                err = (fn().float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row = {"kernel": name, "D": d, "N": n, "B": b, "H": h, "config": cfg,
                       "max_abs_diff_vs_sdpa": err, "ms": round(ms, 4),
                       "tflops": round(flops / ms / 1e9, 1)}  # fmt: skip
                print(row, flush=True)
                rows.append(row)
            configs.OVERRIDE.clear()
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
