"""triton_flash's forward with a dense attn_mask, under forced launch configurations.

A call with a dense mask takes the forward's non-lean table row, or with a bool mask
the bool-mask row (configs._BOOL_MASK_2B). This times the forward of a (B, 1, N, N)
float and bool mask (``--kinds``) at each configuration given (and the table's), for
each shape of ``--shape``, beside PyTorch's own
F.scaled_dot_product_attention with the same mask and FlexAttention (the mask as a
``mask_mod`` or ``score_mod`` reading it), in one process, and prints each one's
largest difference from F.sdpa's output (rows with no kept key left out: attnhub gives
zeros there, PyTorch's kernels do not).

    python benchmarks/masked_fwd_probe.py [--shape "B,H,N,D;..."] [--configs "128,64,8,3;128,32,8,3"]
        [--kinds bool,float]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnhub.backends.triton_flash import ops, tuning
from attnhub.backends.triton_flash.configs import LaunchConfig
from attnhub.timing import event_ms


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
    """FlexAttention with the dense mask: a block mask from it (bool) or a score_mod
    adding it (float), compiled once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    b, _, n, _ = q.shape
    if mask.dtype == torch.bool:
        dense = mask

        def mask_mod(bi, hi, qi, ki):  # type: ignore[no-untyped-def]
            return dense[bi, 0, qi, ki]

        block = create_block_mask(mask_mod, b, None, n, k.shape[2], device="cuda")
        return lambda: compiled(q, k, v, block_mask=block)
    bias = mask

    def score_mod(score, bi, hi, qi, ki):  # type: ignore[no-untyped-def]
        return score + bias[bi, 0, qi, ki]

    return lambda: compiled(q, k, v, score_mod=score_mod)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="4,16,4096,128", help="B,H,N,D, ';'-separated")
    parser.add_argument("--configs", default="128,64,8,3;128,32,8,3;128,64,8,2;64,64,4,3",
                        help="forward configurations BLOCK_M,BLOCK_N,warps,stages, ';'-separated")  # fmt: skip
    parser.add_argument("--kinds", default="bool,float", help="mask dtypes, ','-separated")
    args = parser.parse_args()
    configs = [LaunchConfig(*(int(x) for x in c.split(","))) for c in args.configs.split(";")]
    for shape in args.shape.split(";"):
        b, h, n, d = (int(x) for x in shape.split(","))
        probe(b, h, n, d, configs, args.kinds.split(","))


def random_masks(b: int, n: int, kinds: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """(B, 1, N, N) CUDA masks by kind ("bool", "float"), one draw of kept keys (a random
    90%, and key 0 in every row, so that every row keeps a key): as bool, or as normal
    scores in ``dtype`` with -inf where a key is not kept."""
    keep = torch.rand(b, 1, n, n, device="cuda") < 0.9
    keep[..., 0] = True
    makers: dict[str, Callable[[], torch.Tensor]] = {
        "bool": lambda: keep,
        "float": lambda: torch.randn(b, 1, n, n, device="cuda", dtype=dtype)
        .masked_fill(~keep, float("-inf")),
    }  # fmt: skip
    return {kind: makers[kind]() for kind in kinds}


def probe(b: int, h: int, n: int, d: int, configs: list[LaunchConfig], kinds: list[str]) -> None:
    """One shape: each mask kind of ``kinds``, each way, printed."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * n * n * d
    print(f"forward, B{b} H{h} N{n} D{d} bf16, (B, 1, N, N) masks; ms and TFLOP/s")
    for kind, mask in random_masks(b, n, kinds, torch.bfloat16).items():
        stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ways: dict[str, Callable[[], Any]] = {
            "F.sdpa": lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "flex": _flex(q, k, v, mask),
            "triton_flash table": lambda mask=mask: ops.flash_attention(q, k, v, mask)[0],
        }
        for cfg in configs:

            def forced(cfg: LaunchConfig = cfg, mask: torch.Tensor = mask) -> Any:
                with tuning.override(fwd=cfg):
                    return ops.flash_attention(q, k, v, mask)[0]

            ways[f"triton_flash {cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}"] = (
                forced
            )
        base = None
        for name, fn in ways.items():
            try:
                ms = event_ms(fn, 30, windows=5)  # the fastest of five windows
                diff = (fn().float() - stock.float()).abs().max().item()
            except Exception as exc:  # a configuration that does not fit: say so
                print(f"  {kind:5s} {name:28s} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            base = ms if name == "F.sdpa" else base
            ratio = f"  {base / ms:5.2f}x F.sdpa" if base else ""
            print(f"  {kind:5s} {name:28s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TF/s"
                  f"  max|diff| {diff:.2e}{ratio}")  # fmt: skip


if __name__ == "__main__":
    main()
