"""Per-call overhead of attnhub's dispatch over calling PyTorch's SDPA directly.

Times, on a tiny input (B=1, H=1, N=16, D=64 by default) where the kernel itself is
cheap, ``F.scaled_dot_product_attention`` against ``attnhub.attention(...,
backend="torch_sdpa")`` and ``attnhub.attention(...)`` with no backend named, and
prints each and the difference. The budget (issue 2) is 5 us, the goal 2 us.

    python benchmarks/overhead.py [--device cuda] [--repeat 20000]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import attnhub


def _per_call_us(fn, repeat: int, sync) -> float:  # type: ignore[no-untyped-def]
    """The best of 15 rounds of the mean time per call, in microseconds.

    The minimum, not the median: other processes only ever add time, and on a shared
    2-core machine the least-disturbed round is the closest to the real cost.
    """
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(15):
        sync()
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / repeat * 1e6)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=20000)
    parser.add_argument("--shape", default="1,1,16,64")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.shape.split(","))
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(1)

    direct = _per_call_us(lambda: F.scaled_dot_product_attention(q, k, v), args.repeat, sync)
    named = _per_call_us(
        lambda: attnhub.attention(q, k, v, backend="torch_sdpa"), args.repeat, sync
    )
    chosen = attnhub.explain(q, k, v).chosen
    auto = _per_call_us(lambda: attnhub.attention(q, k, v), args.repeat, sync)
    print(f"input {shape} {dtype} on {device}; attnhub's own choice: {chosen}")
    print(f"F.scaled_dot_product_attention          {direct:7.2f} us")
    print(f"attnhub.attention(backend='torch_sdpa') {named:7.2f} us  (+{named - direct:.2f} us)")
    print(f"attnhub.attention()                     {auto:7.2f} us  (+{auto - direct:.2f} us)")


if __name__ == "__main__":
    main()
