"""Launch configurations for triton_blocksparse's backward, swept per layout.

The block-sparse kernels take their tiles from triton_flash's table, measured for the
dense kernels, except where they have rows of their own (``ops._OWN_CONFIGS``); "the
table's" below is whichever ``ops._tiles_meta`` picks. This times each candidate dK/dV
and dQ configuration (``tuning.override(bwd_kv=..., bwd_q=...)``) on the block-sparse
bench's shape (B2 H16 N8192 D128 bf16, block 128) for each layout, reading each
kernel's CUDA time from the profiler (the two kernels are independent, so the i-th
dK/dV and dQ candidates run together), and checks every candidate's gradients against
the table's (max abs difference over max abs value). JSON with ``--json``::

    python benchmarks/block_sparse_sweep.py [--layouts random:1,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from block_sparse_probe import kernel_us  # this folder's: scripts run with it on sys.path

import attnhub
from attnhub.backends.triton_flash import tuning
from attnhub.bench import build_layout

# (BLOCK_M, BLOCK_N, num_warps, num_stages): dK/dV walks BLOCK_M query rows per step
# over a BLOCK_N-key tile; dQ walks BLOCK_N keys per step over BLOCK_M rows.
KV = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3),
      (64, 128, 4, 3), (128, 128, 8, 2), (32, 128, 4, 3), (128, 64, 8, 2), (64, 64, 8, 3),
      (64, 128, 8, 4), (64, 64, 4, 2)]  # fmt: skip
Q = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 3),
     (128, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 8, 3),
     (64, 128, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3), (64, 32, 4, 2)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="2,16,8192,128")
    parser.add_argument("--layouts", default="random:1,random:0.25,random:0.05,sliding_window:1024")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    g = torch.randn_like(q)
    rows = []
    for text in args.layouts.split(","):
        kind, param = text.split(":")
        layout = build_layout((kind, float(param)), n, 128, device=device)

        def grads(kv=None, qc=None, layout=layout):  # type: ignore[no-untyped-def]
            with tuning.override(bwd_kv=kv, bwd_q=qc):
                out = attnhub.attention(q, k, v, block_sparse=layout, backend="triton_blocksparse")
            return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

        table = grads()
        want = table()
        base = kernel_us(table, args.iters)
        print(f"{text}: the table's dK/dV {base['bs_bwd_dkdv_kernel']:.1f} us, "
              f"dQ {base['bs_bwd_dq_kernel']:.1f} us")  # fmt: skip
        for kv, qc in itertools.zip_longest(KV, Q):
            step = grads(kv, qc)
            try:
                got = step()
                step()
                times = kernel_us(step, args.iters)
            except Exception as exc:  # a candidate that does not compile (shared memory)
                print(f"  kv {kv} q {qc}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            errors = [float((a - b_).abs().max() / b_.abs().max()) for a, b_ in zip(got, want)]
            for role, cfg, name in (
                ("kv", kv, "bs_bwd_dkdv_kernel"),
                ("q", qc, "bs_bwd_dq_kernel"),
            ):
                if cfg is None:
                    continue
                row = {"layout": text, "role": role, "config": cfg, "us": times[name],
                       "table_us": base[name], "rel_error": errors}  # fmt: skip
                rows.append(row)
                print(f"  {role:2s} {cfg}: {times[name]:8.1f} us ({base[name] / times[name]:.2f}x "
                      f"the table's), rel. diff {max(errors):.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [b, h, n, d], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
