"""Which of PyTorch's CUDA kernels keep the contract's gradients for a bool mask.

``attnhub demo``'s patched step (B2 H16 N4096 D128 bf16, causal plus a key-padding
mask whose last row is left-padded by 1024) was served once by the torch_sdpa backend,
and its parameter gradients came out 77x outside the contract's tolerance; so
torch_sdpa declines a bool mask with a backward on CUDA (backends/torch_sdpa.py,
``_bool_mask_on_cuda``), while the same backend passes small calls of that kind
(tests/test_pytorch_checks.py). This probe runs that call as torch_sdpa does (the
mask's key-less rows opened, the output's rows zeroed after) on each of PyTorch's
kernels, and through the torch_sdpa backend's own forward ("attnhub": causal plus the
key mask, as mask recognition hands it the call), with the mask as bool and as float
(0 / -inf), at several lengths, with grouped heads where ``--kv-heads`` is given (every
batch row but the first left-padded, by up to N/4), and prints each gradient's error against float64 as a
multiple of the contract's bound (2 * the error of the reference computed in the
inputs' dtype, + 1e-5). A ratio over 1 fails the contract.

    python benchmarks/sdpa_mask_probe.py [--lengths 256,1024,4096] [--kv-heads 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnhub.backends.torch_reference import reference_attention
from attnhub.backends.torch_sdpa import _open_rows_without_keys
from attnhub.registry import get_registry
from attnhub.validation import make_params

_KERNELS = {
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def _inputs(n: int, b: int, h: int, hkv: int, d: int, pad: int, dtype: torch.dtype, device: str):  # fmt: skip
    torch.manual_seed(0)
    q = torch.randn(b, h, n, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, hkv, n, d, device=device, dtype=dtype) for _ in range(2))
    # Every row but the first padded, the last by `pad`, the others by less.
    lengths = n - (torch.arange(b, device=device) * pad) // max(b - 1, 1)
    # Left padding: the last row's first `pad` positions are padding.
    start = (n - lengths).view(b, 1, 1, 1)
    pos = torch.arange(n, device=device)
    keep = (pos.view(1, 1, 1, n) >= start) & (pos.view(1, 1, n, 1) >= pos.view(1, 1, 1, n))
    return q, k, v, keep  # keep: (B, 1, N, N) bool, causal and key padding


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, leaves, grad))


def _sdpa(q, k, v, mask, kernel):  # type: ignore[no-untyped-def]
    opened, empty = _open_rows_without_keys(mask)
    gqa = q.shape[1] != k.shape[1]
    with sdpa_kernel([kernel]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=opened, enable_gqa=gqa)
    return out.masked_fill(empty, 0.0)


def _params(q: torch.Tensor, k: torch.Tensor, causal: bool):  # type: ignore[no-untyped-def]
    return make_params(q, key=k, causal=causal, alignment="top_left", window=None,
                       softcap=None, scale=None, dropout_p=0.0, block_sparse=None,
                       return_lse=False)  # fmt: skip


def _attnhub_torch_sdpa(q, k, v, mask):  # type: ignore[no-untyped-def]
    """The torch_sdpa backend's own forward (past its declared refusal), on the call as
    the demo made it after mask recognition: causal plus a (B, 1, 1, N) key mask, the
    last query row's keys (every key some query sees)."""
    backend = get_registry().get("torch_sdpa")
    return backend.forward(q, k, v, mask[:, :, -1:, :], _params(q, k, causal=True))


def probe(n: int, args: argparse.Namespace) -> list[dict]:
    device, dtype = args.device, getattr(torch, args.dtype)
    pad = n // 4
    hkv = args.kv_heads or args.heads
    q, k, v, keep = _inputs(n, args.batch, args.heads, hkv, args.head_dim, pad, dtype, device)
    params = _params(q, k, causal=False)
    grad = torch.randn((*q.shape[:-1], v.shape[-1]), device=device, dtype=dtype)

    def reference(cast: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        out, _ = reference_attention(*leaves, keep, params)
        return out, [out.detach(), *_grads(out, leaves, grad.to(cast))]

    _, exact = reference(torch.float64)
    _, low = reference(dtype)
    bounds = [2 * (lo.double() - ex).abs().max().item() + 1e-5 for lo, ex in zip(low, exact)]
    rows = []
    runs = {name: functools.partial(_sdpa, kernel=kernel) for name, kernel in _KERNELS.items()}
    runs["attnhub"] = _attnhub_torch_sdpa
    for kname, run in runs.items():
        for form in ("bool", "float"):
            mask = keep if form == "bool" else torch.zeros(keep.shape, device=device, dtype=dtype).masked_fill(~keep, float("-inf"))  # fmt: skip
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            try:
                out = run(*leaves, mask)
                got = [out.detach(), *_grads(out, leaves, grad)]
            except RuntimeError as exc:
                rows.append(
                    {"n": n, "kernel": kname, "mask": form, "error": str(exc).splitlines()[0]}
                )
                continue
            ratios = {
                name: (g.double() - ex).abs().max().item() / bound
                for name, g, ex, bound in zip(("out", "dq", "dk", "dv"), got, exact, bounds)
            }
            finite = all(bool(torch.isfinite(g).all()) for g in got)
            rows.append({"n": n, "kernel": kname, "mask": form, "finite": finite, **ratios})
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="grouped heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu: only to try the script")
    parser.add_argument("--json")
    args = parser.parse_args()
    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{where}; B{args.batch} H{args.heads}/{args.kv_heads or args.heads} D{args.head_dim} "
          f"{args.dtype}, causal + left key padding of up to N/4 (the last row's)")  # fmt: skip
    print("error / contract bound (> 1 fails):")
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        for row in probe(n, args):
            rows.append(row)
            if "error" in row:
                print(f"  N={n:5d} {row['kernel']:9s} {row['mask']:5s}  raised: {row['error']}")
            else:
                cells = "  ".join(f"{name} {row[name]:7.2f}" for name in ("out", "dq", "dk", "dv"))
                print(f"  N={n:5d} {row['kernel']:9s} {row['mask']:5s}  {cells}  finite={row['finite']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
