"""Sampled calls of F.scaled_dot_product_attention under ``attnhub.patch()``, each checked
against the float64 reference and against PyTorch's own function on the same inputs.

The conformance suite checks attnhub.attention() case by case, and test_patch checks
the patch on chosen calls; this samples the calls a model could make through the
patch (GQA with ``enable_gqa``, masks of rank 2 to 4 that broadcast, bool and float,
random and structured as Hugging Face builds them: causal either way aligned,
sliding windows, left and right padding, fully masked rows; ``is_causal``; scales;
strided queries; gradients) and reports every call where:

- the patch raises where PyTorch returns, or the other way, or raises another type;
- the patched output (or a gradient) is further from the float64 reference than
  PyTorch's own output is, beyond a small floor (PyTorch's error, times 3, or the
  dtype's floor, whichever is larger), or holds a NaN where the reference has none.

Rows with every key masked are the contract's zeros in the reference; PyTorch's own
kernels may give NaN there, which is not counted against the patch unless the patch
gives NaN too. Calls the patch hands to PyTorch's own function give its answer, even
where that is wrong (on the CPU, ``is_causal`` with ``scale <= 0`` is NaN in PyTorch's
kernel): they are sampled without such scales.

    python benchmarks/patch_fuzz.py [--device cuda] [--seed 0] [--cases 500]
    TRITON_INTERPRET=1 python benchmarks/patch_fuzz.py --backend triton_flash --cases 100

``--backend``: the patch's ``backend=`` (calls no named backend can serve go to
PyTorch's own function, as the patch does). On the GPU each new call signature
compiles Triton kernels and is timed by autotune on its first call (a few hundred cases
in 400 s); ``ATTNHUB_AUTOTUNE=0`` skips the timing (then the table and the cost model
rank, as under tracing).
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import torch
import torch.nn.functional as F

import attnhub

ORIGINAL = F.scaled_dot_product_attention
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _structured(rng: random.Random, b: int, nq: int, nk: int) -> torch.Tensor:
    """A bool (b or 1, 1, nq, nk) mask as Hugging Face builds them."""
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    offset = rng.choice([0, nk - nq])  # top-left or bottom-right causal
    kind = rng.choice(["causal", "window", "padding", "padding_causal"])
    if kind == "causal":
        return (j <= i + offset)[None, None]
    if kind == "window":
        width = rng.choice([1, 4, 16, 64])
        return ((j <= i + offset) & (j > i + offset - width))[None, None]
    lengths = torch.tensor([rng.randint(0, nk) for _ in range(b)])[:, None, None]
    keep = j[None] >= nk - lengths if rng.random() < 0.5 else j[None] < lengths  # left / right
    if kind == "padding_causal":
        keep = keep & (j <= i + offset)
    return keep[:, None]


def sample(
    rng: random.Random, device: str
) -> tuple[tuple[torch.Tensor, ...], dict[str, Any], bool]:
    """(query, key, value), F.sdpa's keyword arguments, and whether to take gradients."""
    b, hkv, group = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([1, 2, 4])
    hq = hkv * group
    nq = rng.choice([1, 2, 4, 16, 17, 64, 129, 200])
    nk = rng.choice([1, 3, 16, 31, 64, 70, 128, 257])
    d = rng.choice([16, 32, 64, 128] if device == "cuda" else [8, 16, 32])
    dv = d if rng.random() < 0.8 else rng.choice([16, 64])
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    dtype = rng.choice(
        dtypes + ([torch.bfloat16, torch.float16] if device == "cuda" else [torch.float64])
    )
    q = torch.randn(b, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, nk, dv, dtype=dtype, device=device)
    if rng.random() < 0.2:  # (B, N, H, D) storage, as a model's projection leaves it
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    kwargs: dict[str, Any] = {}
    kind = rng.choice(["none", "none", "random", "structured", "structured", "float", "float_inf"])
    shape = [rng.choice([1, b]), rng.choice([1, hq]), rng.choice([1, nq]), nk]
    shape = shape[4 - rng.choice([2, 3, 4, 4]) :]
    if kind == "random":
        mask = torch.rand(shape) > rng.choice([0.1, 0.5, 0.95])
    elif kind == "structured":
        mask = _structured(rng, b, nq, nk)
    elif kind == "float":
        mask = torch.randn(shape).to(dtype)
    elif kind == "float_inf":
        mask = torch.where(torch.rand(shape) > 0.5, 0.0, float("-inf")).to(dtype)
    if kind != "none":
        kwargs["attn_mask"] = mask.to(device)
    elif rng.random() < 0.5:
        kwargs["is_causal"] = True
    if rng.random() < 0.3:
        scale = rng.choice([0.05, 0.5, 2.0, -0.3, 0.0])
        kwargs["scale"] = scale if scale > 0 or not kwargs.get("is_causal") else 0.5
    if hq != hkv or rng.random() < 0.2:
        kwargs["enable_gqa"] = True
    grad = rng.random() < 0.4
    return (q, k, v), kwargs, grad


def _run(fn: Any, tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any], grad: bool) -> Any:
    """("raise", type name, text) or ("ok", output, gradients or None)."""
    inputs = tuple(t.detach().clone().requires_grad_(grad) for t in tensors)
    try:
        out = fn(*inputs, **kwargs)
        grads = None
        if grad:
            weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
            grads = torch.autograd.grad(out, inputs, weight.to(out.dtype))
    except Exception as exc:
        return ("raise", type(exc).__name__, str(exc).splitlines()[0][:160])
    return ("ok", out.detach(), grads)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
               is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
    mask = (
        attn_mask.double() if attn_mask is not None and attn_mask.dtype != torch.bool else attn_mask
    )
    return attnhub.attention(
        q, k, v, mask, causal=is_causal, scale=scale, backend="torch_reference"
    )


def _error(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> float:
    diff = (got.double() - want)[rows]
    return float(diff.abs().max()) if diff.numel() else 0.0


def problems(
    tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any], grad: bool, backend: Any = None
) -> tuple[list[str], dict[str, int]]:
    """What the patched call got wrong (empty: nothing), and what served it."""
    stock = _run(ORIGINAL, tensors, kwargs, grad)
    attnhub.reset_stats()
    with attnhub.patch(backend=backend):
        patched = _run(F.scaled_dot_product_attention, tensors, kwargs, grad)
    served = attnhub.stats()
    return _compare(tensors, kwargs, grad, stock, patched), served


def _compare(
    tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any], grad: bool, stock: Any, patched: Any
) -> list[str]:
    if stock[0] != patched[0] or (stock[0] == "raise" and stock[1] != patched[1]):
        return [f"PyTorch: {stock[0]} {stock[1:] if stock[0] == 'raise' else ''}; "
                f"patched: {patched[0]} {patched[1:] if patched[0] == 'raise' else ''}"]  # fmt: skip
    if stock[0] == "raise":
        return []
    reference = _run(_reference, tuple(t.double() for t in tensors), kwargs, grad)
    if reference[0] == "raise":
        return [f"the reference raised {reference[1:]}"]
    floor = FLOOR[tensors[0].dtype]
    found = []
    named = [("out", stock[1], patched[1], reference[1])]
    if grad:
        named += zip(("dq", "dk", "dv"), stock[2], patched[2], reference[2], strict=True)
    for name, s, p, r in named:
        rows = torch.ones(r.shape[:-1], dtype=torch.bool, device=r.device)
        if p.isnan().any() and not r.isnan().any():
            found.append(f"{name}: NaN where the reference has none")
            continue
        finite = ~s.isnan().any(-1)  # PyTorch's NaN rows (fully masked) say nothing of its error
        scale = 1.0 + float(r.abs().max()) if r.numel() else 1.0
        stock_error, error = _error(s, r, rows & finite), _error(p, r, rows)
        allowed = max(3 * stock_error, floor * scale)
        if error > allowed:
            found.append(f"{name}: {error:.3g} from the reference, PyTorch's {stock_error:.3g}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--backend", default=None, help="the patch's backend= (default: any)")
    args = parser.parse_args()
    failures = 0
    served: dict[str, int] = {}
    for i in range(args.cases):
        rng = random.Random(args.seed * 1_000_003 + i)
        tensors, kwargs, grad = sample(rng, args.device)
        torch.manual_seed(i)
        found, by = problems(tensors, kwargs, grad, args.backend)
        for name, n in by.items():
            served[name] = served.get(name, 0) + n
        if (i + 1) % 50 == 0:
            print(f"{i + 1} cases, {failures} failing", flush=True)
        if found:
            failures += 1
            q, k, v = tensors
            described = ", ".join(
                f"{key}={(tuple(val.shape), val.dtype) if torch.is_tensor(val) else val}"
                for key, val in kwargs.items()
            )
            print(f"case {args.seed}:{i} q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
                  f"{q.dtype} stride {q.stride()} grad={grad} {described} "
                  f"served {by}: {'; '.join(found)}", flush=True)  # fmt: skip
    print(f"seed {args.seed}, {args.device}: {args.cases} cases, {failures} failing; "
          f"patched calls served by {dict(sorted(served.items()))}")  # fmt: skip
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
