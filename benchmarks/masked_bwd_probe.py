"""triton_flash's backward with a dense attn_mask, under forced launch configurations.

A call with a dense mask (bool or float) takes the backward's non-lean table rows
(configs._BWD_2B_DENSE / _CAUSAL), launched split. This times the backward alone (one
``torch.autograd.grad`` of a kept graph) of a (B, 1, N, N) mask (``--kinds``, as
masked_fwd_probe.py makes them: a random 90% of keys kept, every row keeping one) at the
table's rows and at each forced (dK/dV, dQ) pair of ``--configs``, for each shape of
``--shape``, beside PyTorch's own F.scaled_dot_product_attention with the same mask and
FlexAttention, in one process, and prints each one's largest dQ/dK/dV difference from
F.sdpa's.

    python benchmarks/masked_bwd_probe.py [--shape "B,H,N,D;..."] [--kinds bool,float]
        [--configs "64,128,8,2/128,64,8,2;32,64,4,3/64,32,4,3"]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from masked_fwd_probe import _flex, random_masks  # this folder's, on sys.path as a script

from attnhub.backends.triton_flash import ops, tuning
from attnhub.backends.triton_flash.configs import LaunchConfig
from attnhub.timing import event_ms


def _config(text: str) -> LaunchConfig:
    return LaunchConfig(*(int(x) for x in text.split(",")))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="4,16,2048,128", help="B,H,N,D, ';'-separated")
    parser.add_argument("--configs", default="64,128,8,2/128,64,8,2;32,64,4,3/64,32,4,3",
                        help="dK/dV/dQ configurations KV_M,KV_N,warps,stages/Q_M,Q_N,warps,stages, "
                             "';'-separated")  # fmt: skip
    parser.add_argument("--kinds", default="bool,float", help="mask dtypes, ','-separated")
    args = parser.parse_args()
    pairs = [tuple(_config(c) for c in pair.split("/")) for pair in args.configs.split(";")]
    for shape in args.shape.split(";"):
        b, h, n, d = (int(x) for x in shape.split(","))
        probe(b, h, n, d, pairs, args.kinds.split(","))  # type: ignore[arg-type]


def probe(
    b: int, h: int, n: int, d: int, pairs: list[tuple[LaunchConfig, LaunchConfig]], kinds: list[str]
) -> None:
    """One shape: each mask kind of ``kinds``, each way, printed."""
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    flops = 2.5 * 4 * b * h * n * n * d  # the backward's five matmuls to the forward's two
    print(f"backward, B{b} H{h} N{n} D{d} bf16, (B, 1, N, N) masks; ms and TFLOP/s")
    for kind, mask in random_masks(b, n, kinds, torch.bfloat16).items():
        ways: dict[str, Callable[[], Any]] = {
            "F.sdpa": lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "flex": _flex(q, k, v, mask),
            "triton_flash table": lambda mask=mask: ops.flash_attention(q, k, v, mask)[0],
        }
        for kv, qc in pairs:

            def forced(kv: LaunchConfig = kv, qc: LaunchConfig = qc, mask: Any = mask) -> Any:
                with tuning.override(bwd_kv=kv, bwd_q=qc):
                    return ops.flash_attention(q, k, v, mask)[0]

            name = "/".join(
                f"{c.block_m},{c.block_n},{c.num_warps},{c.num_stages}" for c in (kv, qc)
            )
            ways[f"triton_flash {name}"] = forced
        stock: tuple[torch.Tensor, ...] | None = None
        base = None
        for name, fn in ways.items():
            try:
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
                ms = event_ms(
                    lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                    20,
                    windows=5,
                )  # the fastest of five windows
            except Exception as exc:  # a configuration that does not fit: say so
                print(f"  {kind:5s} {name:36s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            if name == "F.sdpa":
                stock, base = grads, ms
            diff = ""
            if stock is not None:
                worst = max(
                    (g.float() - s.float()).abs().max().item() for g, s in zip(grads, stock)
                )
                diff = f"  max|dgrad diff| {worst:.2e}"
            ratio = f"  {base / ms:5.2f}x F.sdpa" if base else ""
            print(f"  {kind:5s} {name:36s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TF/s{diff}{ratio}")


if __name__ == "__main__":
    main()
