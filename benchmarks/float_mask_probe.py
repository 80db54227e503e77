"""A float attn_mask with padding rows, forward and backward, against PyTorch and Flex.

Each shape (B, H, N, D) gets an additive mask (B, 1, N, N) in the inputs' dtype: random
scores, and for batch entry b the keys and the query rows past its length hidden with
``--hide`` (default ``torch.finfo(dtype).min``, as a model's padding mask hides them;
or a number such as -1e9), so those rows are fully hidden. Ways: triton_flash,
torch_sdpa and flex_attention through attnhub (the last two decline a float mask with a
backward on CUDA: forward only), stock F.scaled_dot_product_attention (PyTorch picks),
and FlexAttention compiled with a score_mod that adds the mask. For each: the largest
error of the output and of dQ, dK, dV against the float64 reference (the output
gradient is random on every row, padding rows included), then the forward's and the
forward + backward's time in ms (CUDA events), each also as a multiple of triton_flash's;
with ``--kernels``, also the CUDA kernels each way's forward launches and their time.
Usage: python benchmarks/float_mask_probe.py [--shapes "B,H,N,D;..."] [--dtype bf16]
[--hide=-1e9] [--kernels]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from block_sparse_probe import kernel_us  # this folder's: scripts run with it on sys.path

import attnhub
from attnhub.timing import event_ms

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def padded_float_mask(
    b: int, n: int, dtype: torch.dtype, gen: torch.Generator, low: float
) -> torch.Tensor:
    """(B, 1, N, N) on CUDA: normal scores, with entry i's keys and query rows from its
    length on (N down to N / 4 across the batch) at ``low``."""
    mask = torch.randn(b, 1, n, n, generator=gen).to("cuda", dtype)
    for i, length in enumerate(torch.linspace(n, n // 4, b).long().tolist()):
        mask[i, :, :, length:] = low
        mask[i, :, length:, :] = low
    return mask


def _ways(mask: torch.Tensor) -> dict[str, Callable]:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def add_mask(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + mask[b, 0, q_idx, kv_idx]

    def through(name: str) -> Callable:
        return lambda q, k, v: attnhub.attention(q, k, v, mask, backend=name)

    return {
        "triton_flash": through("triton_flash"),
        "torch_sdpa": through("torch_sdpa"),
        "flex_attention": through("flex_attention"),
        "F.sdpa (stock)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask),
        "Flex (stock)": lambda q, k, v: flex(q, k, v, score_mod=add_mask),
    }


def _errors(fn: Callable, q, k, v, g, want) -> tuple[str, bool]:  # type: ignore[no-untyped-def]
    """(the errors against ``want``, whether the backward ran: a way that declines a
    backward gives the output's error only)."""
    with torch.no_grad():
        out = fn(q, k, v)
    text = f"out {float((out.double() - want[0]).abs().max()):.2e}"
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        grads = torch.autograd.grad(fn(*leaves), leaves, g)
    except attnhub.NoBackendError:
        return text + "  (declines the backward)", False
    return text + "".join(
        f"  {name} {float((x.double() - r).abs().max()):.2e}"
        for name, x, r in zip(("dq", "dk", "dv"), grads, want[1:])
    ), True


def probe(b: int, h: int, n: int, d: int, dtype: torch.dtype, hide: str, kernels: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, h, n, d, generator=gen).to("cuda", dtype) for _ in range(4))
    low = torch.finfo(dtype).min if hide == "min" else float(hide)
    mask = padded_float_mask(b, n, dtype, gen, low)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = attnhub.attention(*leaves, mask.double(), backend="torch_reference")
    want = [out.detach(), *torch.autograd.grad(out, leaves, g.double())]
    del leaves, out
    print(f"B{b} H{h} N{n} D{d} {dtype}, hidden with {low:.3g}: errors against float64, "
          "then ms (x triton_flash's)")  # fmt: skip
    times: dict[str, tuple[float, float | None]] = {}
    for name, fn in _ways(mask).items():
        try:
            errors, backward = _errors(fn, q, k, v, g, want)
        except Exception as exc:  # a way that cannot run says why, and the rest go on
            print(f"  {name:22s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        x = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.no_grad():
            fwd = event_ms(lambda fn=fn, x=x: fn(*x), 30, warmup=5)
        step = None
        if backward:
            step = event_ms(lambda fn=fn, x=x: torch.autograd.grad(fn(*x), x, g), 30, warmup=5)
        times[name] = (fwd, step)
        print(f"  {name:22s} {errors}")
        if kernels:
            with torch.no_grad():
                launched = kernel_us(lambda fn=fn, x=x: fn(*x))
            for kernel, us in launched.items():
                print(f"      {us:9.1f} us  {kernel[:100]}")
    base = times.get("triton_flash")
    for name, (fwd, step) in times.items():
        text = f"  {name:22s} fwd {fwd:8.3f}"
        if base is not None:
            text += f" ({fwd / base[0]:.2f}x)"
        if step is not None:
            text += f"  fwd+bwd {step:8.3f}"
            if base is not None and base[1] is not None:
                text += f" ({step / base[1]:.2f}x)"
        print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="4,16,2048,128;8,12,1024,64")
    parser.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    parser.add_argument(
        "--hide", default="min", help="the hiding value: min (finfo.min) or a number"
    )
    parser.add_argument(
        "--kernels", action="store_true", help="list each way's forward kernels (profiler)"
    )
    args = parser.parse_args()
    for shape in args.shapes.split(";"):
        b, h, n, d = (int(x) for x in shape.split(","))
        for hide in args.hide.split(","):
            probe(b, h, n, d, _DTYPES[args.dtype], hide, args.kernels)


if __name__ == "__main__":
    main()
