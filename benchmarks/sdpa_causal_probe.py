"""PyTorch's SDPA with ``is_causal=True`` where Nq != Nk, on CUDA: output and gradients
against the float64 reference (top-left causal, as F.sdpa defines it), per kernel.

For each shape, dtype and query layout (contiguous, or (B, N, H, D) storage as a
model's projection leaves it): F.sdpa as PyTorch picks, then each of its CUDA kernels
forced (``sdpa_kernel``), then F.sdpa with the same causal mask given as a bool
``attn_mask`` (what Hugging Face passes): the largest difference of the output and of
dQ, dK, dV from the reference, or why the kernel refused. Found by
``benchmarks/patch_fuzz.py`` (a patched call whose causal bool mask was read as
``is_causal``: its gradients 100x further from the reference than stock's).

    python benchmarks/sdpa_causal_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WAYS = {
    "picked": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def _grads(q, k, v, weight, **kwargs):  # type: ignore[no-untyped-def]
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*inputs, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, inputs, weight.to(out.dtype))]


def _differences(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    return " ".join(f"{(g.double() - r).abs().max().item():.3g}" for g, r in zip(got, want))


def main() -> None:
    torch.manual_seed(0)
    print(
        "B, H, Nq, Nk, D, dtype, layout: way: max |diff| from the float64 reference, out dq dk dv"
    )
    for b, h, nq, nk, d in ((3, 2, 16, 64, 64), (2, 4, 1, 64, 64), (2, 4, 100, 257, 128), (2, 4, 64, 64, 64), (2, 4, 128, 64, 64)):  # fmt: skip
        for dtype in (torch.bfloat16, torch.float16):
            for layout in ("contiguous", "bnhd"):
                q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype)
                if layout == "bnhd":
                    q = q.transpose(1, 2).contiguous().transpose(1, 2)
                k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=dtype) for _ in range(2))
                weight = torch.linspace(-1, 1, b * h * nq * d, device="cuda").view(b, h, nq, d)
                keep = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril()
                ref = _grads(q.double(), k.double(), v.double(), weight, attn_mask=keep)
                print(f"{b}, {h}, {nq}, {nk}, {d}, {str(dtype)[6:]}, {layout}:")
                for name, way in WAYS.items():
                    try:
                        if way is None:
                            got = _grads(q, k, v, weight, is_causal=True)
                        else:
                            with sdpa_kernel([way]):
                                got = _grads(q, k, v, weight, is_causal=True)
                        diffs = _differences(got, ref)
                    except RuntimeError as exc:
                        diffs = "refused: " + str(exc).splitlines()[0][:90]
                    print(f"    is_causal {name:10s} {diffs}")
                got = _grads(q, k, v, weight, attn_mask=keep)
                print(f"    bool mask  picked     {_differences(got, ref)}")


if __name__ == "__main__":
    main()
