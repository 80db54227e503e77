"""What the attention-logit softcap costs triton_flash, at Gemma 2's training calls.

``attnhub bench --models``' Gemma 2 (B1 x 8192, GQA 16/4, D=128, softcap 50, window
1024 on every other layer) trains 1.14x stock through ``attn_implementation="attnhub"``
and 1.22x patched: stock's ``sdpa`` path drops the softcap and runs its global layers
on PyTorch's flash/cuDNN kernels, attn_implementation computes it in triton_flash.
This times, in one process on the same inputs (bf16, forward and forward+backward,
CUDA events, the fastest of a few windows), each of Gemma 2's two calls (causal; causal
+ window 1024):

- ``sdpa``: F.scaled_dot_product_attention without the softcap (what stock runs:
  the global call ``is_causal`` on PyTorch's flash/cuDNN; the windowed call with the
  dense bool mask a model builds);
- ``triton_flash`` with and without the softcap;
- ``flex``: compiled FlexAttention with the softcap as a ``score_mod`` (and the band as a
  block mask).

and prints triton_flash's largest output difference from the float64 reference at a
smaller N (``--check-n``) beside the bf16 reference's own (the contract's tolerance is
twice that, plus 1e-5). ``--tanh exact`` swaps the kernels' tanh (``common._tanh``,
PTX ``tanh.approx.f32`` for half precision) for its float32 formula (one exp2 and a
division) before anything compiles: the A/B of the one-instruction tanh. Run the two in
separate processes::

    python benchmarks/softcap_probe.py [--tanh exact|approx] [--n 8192] [--check-n 1024] [--no-flex]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from attnhub.backends.torch_reference import reference_attention
from attnhub.backends.triton_flash import common, ops
from attnhub.backends.triton_flash.common import LOG2E
from attnhub.request import AttentionParams
from attnhub.timing import event_ms

SOFTCAP = 50.0


@triton.jit
def _tanh_exact(x, FAST: tl.constexpr):
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


def _flex(q: Any, k: Any, v: Any, window: int | None) -> Callable[[], Any]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)

    def mask_mod(b, h, qi, ki):  # type: ignore[no-untyped-def]
        keep = qi >= ki
        return keep & (qi - ki < window) if window is not None else keep

    def score_mod(score, b, h, qi, ki):  # type: ignore[no-untyped-def]
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    n = q.shape[2]
    block = create_block_mask(mask_mod, None, None, n, n, device="cuda")
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block, enable_gqa=True)


def _band(n: int, window: int | None) -> torch.Tensor | None:
    if window is None:
        return None
    i = torch.arange(n, device="cuda")
    d = i[:, None] - i[None, :]
    return ((d >= 0) & (d < window))[None, None]


def _ways(q: Any, k: Any, v: Any, window: int | None, flex: bool) -> dict[str, Callable[[], Any]]:
    band = _band(q.shape[2], window)
    tf_window = None if window is None else (window - 1, 0)

    def sdpa() -> Any:
        if band is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True)

    def tf(softcap: float | None) -> Callable[[], Any]:
        return lambda: ops.flash_attention(
            q, k, v, causal=True, window=tf_window, softcap=softcap, return_lse=False
        )[0]

    ways = {
        "sdpa (no softcap)": sdpa,
        "triton_flash (no softcap)": tf(None),
        "triton_flash softcap": tf(SOFTCAP),
    }
    if flex:
        ways["flex softcap"] = _flex(q, k, v, window)
    return ways


def _inputs(n: int, grad: bool) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    shape = {"q": (1, 16, n, 128), "k": (1, 4, n, 128), "v": (1, 4, n, 128)}
    return tuple(  # type: ignore[return-value]
        torch.randn(s, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)
        for s in shape.values()
    )


def _check(n: int, window: int | None) -> tuple[float, float]:
    """triton_flash softcap's largest output difference from the float64 reference, and
    the bf16 reference's own (plain PyTorch operations in bf16)."""
    q, k, v = _inputs(n, False)
    params = AttentionParams(
        causal=True,
        window=None if window is None else (window - 1, 0),
        softcap=SOFTCAP,
        scale=q.shape[-1] ** -0.5,
    )
    ref = reference_attention(*(t.double() for t in (q, k, v)), None, params)[0]
    ref_lp = reference_attention(q, k, v, None, params)[0]
    out = ops.flash_attention(
        q, k, v, causal=True, window=params.window, softcap=SOFTCAP, return_lse=False
    )[0]
    return float((out.double() - ref).abs().max()), float((ref_lp.double() - ref).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tanh", choices=("exact", "approx"), default="approx")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--check-n", type=int, default=1024)
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    args = parser.parse_args()
    if args.tanh == "exact":
        common._tanh = _tanh_exact  # before any kernel compiles: they look it up then
    print(f"# softcap probe, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, tanh {args.tanh}; B1 Hq16/Hkv4 N{args.n} D128 bf16")  # fmt: skip
    for window in (None, 1024):
        label = "causal" if window is None else f"causal + window {window}"
        err, err_lp = _check(args.check_n, window)
        print(
            f"\n## {label}: triton_flash softcap max |out - fp64 ref| at N{args.check_n}: {err:.3e} "
            f"(bf16 reference's own {err_lp:.3e}: bound {2 * err_lp + 1e-5:.3e})"
        )
        for mode in ("fwd", "fwd_bwd"):
            q, k, v = _inputs(args.n, mode == "fwd_bwd")
            ways = _ways(q, k, v, window, not args.no_flex)
            times = {}
            for name, fn in ways.items():
                if mode == "fwd":
                    call = fn
                else:
                    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)

                    def call(fn: Callable[[], Any] = fn, g: Any = g, qkv: Any = (q, k, v)) -> Any:
                        return torch.autograd.grad(fn(), qkv, g)

                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    times[name] = event_ms(call, 10, warmup=3, windows=3)
            base = times["sdpa (no softcap)"]
            for name, ms in times.items():
                print(f"{mode:8s} {name:28s} {ms:8.3f} ms  {base / ms:5.2f}x sdpa")


if __name__ == "__main__":
    main()
