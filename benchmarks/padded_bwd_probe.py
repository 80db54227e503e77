"""Where the time of a padded encoder's attention step goes (BERT-base shape by default).

One training step's attention call (B, H, N, D) with per-row key lengths, forward and
backward, through triton_flash (key ranges), torch_sdpa with the mask as 0 / -inf (it
declines the bool form with a backward on CUDA) and stock
F.scaled_dot_product_attention with the dense bool mask, plus triton_flash with no
mask at all (the padding's cost); then the CUDA kernels of triton_flash's step from the
profiler, and with ``--host-top N`` the N Python functions that take the most host time
in its step (cProfile, cumulative). Usage: python benchmarks/padded_bwd_probe.py
[--shape B,H,N,D] [--host-top N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
import torch.nn.functional as F

import attnhub
from attnhub.timing import event_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="32,12,512,64")
    parser.add_argument("--host-top", type=int, default=0)
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    g = torch.randn_like(q)
    lengths = torch.linspace(n // 4, n, b).long().cuda()
    keys = torch.arange(n, device="cuda")[None, :] < lengths[:, None]  # (B, N)
    key_mask = keys[:, None, None, :]
    dense = key_mask.expand(b, 1, n, n).contiguous()
    additive = torch.zeros(dense.shape, device="cuda", dtype=q.dtype).masked_fill(
        ~dense, float("-inf")
    )
    ways = {
        "triton_flash keys": lambda q, k, v: attnhub.attention(q, k, v, key_mask, backend="triton_flash"),
        "triton_flash dense mask": lambda q, k, v: attnhub.attention(q, k, v, dense, backend="triton_flash"),
        "triton_flash no mask": lambda q, k, v: attnhub.attention(q, k, v, backend="triton_flash"),
        "torch_sdpa 0/-inf mask": lambda q, k, v: attnhub.attention(q, k, v, additive, backend="torch_sdpa"),
        "F.sdpa dense mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dense),
        "F.sdpa no mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
    }  # fmt: skip
    print(f"shape B{b} H{h} N{n} D{d} bf16, lengths {n // 4}..{n}; fwd+bwd ms per step")
    for name, fn in ways.items():
        step = lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), g)  # noqa: E731
        print(f"  {name:26s} {event_ms(step, 50, warmup=5):.3f}")
    fn = ways["triton_flash keys"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(fn(q, k, v), (q, k, v), g)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    if args.host_top:
        # The backward on this thread (autograd runs CUDA backwards on a worker thread,
        # which cProfile does not see).
        with torch.autograd.set_multithreading_enabled(False), cProfile.Profile() as host:
            for _ in range(100):
                torch.autograd.grad(fn(q, k, v), (q, k, v), g)
            torch.cuda.synchronize()
        pstats.Stats(host).sort_stats("cumulative").print_stats(args.host_top)


if __name__ == "__main__":
    main()
