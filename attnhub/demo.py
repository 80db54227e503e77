"""``attnhub demo``: an existing model, stock and then patched, side by side.

Builds a small transformer from a config (a Llama-style Hugging Face model when
transformers is installed, else a small built-in one; nothing is downloaded), runs
forward and backward with PyTorch's own attention, then again under
:func:`attnhub.patch`, and prints which backend served each kind of attention call and
why, the largest deviation from stock, and the time per step. On a GPU the Triton
kernels compete; on a CPU the PyTorch backends do.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from . import patching as _patch_module
from .api import explain
from .call_stats import ORIGINAL, reset_stats, stats
from .patching import patch


class _Block(torch.nn.Module):
    """Pre-norm decoder block: grouped-query causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim)
        self.out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.transpose(1, 2).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    """The built-in model, used when transformers is not installed."""

    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4,
                 kv_heads: int = 2) -> None:  # fmt: skip
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(kind: str, vocab: int) -> tuple[torch.nn.Module, str]:
    if kind in ("auto", "hf"):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            if kind == "hf":
                raise
        else:
            config = LlamaConfig(
                vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            )  # fmt: skip
            model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
            return (
                model,
                "transformers LlamaForCausalLM (2 layers, hidden 128, 4 query / 2 key-value heads)",
            )
    return TinyGPT(vocab), "built-in TinyGPT (2 layers, hidden 128, 4 query / 2 key-value heads)"


def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out


def _step(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = _logits(model, ids, mask)
    keep = mask.bool()
    loss = F.cross_entropy(logits[:, :-1][keep[:, 1:]].float(), ids[:, 1:][keep[:, 1:]])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[keep], grads


def _timed_pair(
    stock: Callable[[], Any], patched: Callable[[], Any], steps: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds per step of each, interleaved so that machine noise hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for fn, out in ((stock, times[0]), (patched, times[1])):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _patched_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    with patch(aliases=False):
        _step(model, ids, mask)


@contextlib.contextmanager
def _recording(calls: dict[tuple[Any, ...], list[Any]]) -> Iterator[None]:
    """Note each kind of F.scaled_dot_product_attention call (inside a patch)."""
    patched = F.scaled_dot_product_attention

    def record(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
               scale=None, enable_gqa=False):  # fmt: skip
        meta = tuple(
            None if t is None else (tuple(t.shape), t.dtype, t.requires_grad)
            for t in (query, key, attn_mask)
        )
        signature = (meta, dropout_p, is_causal, scale, enable_gqa, torch.is_grad_enabled())
        if getattr(_patch_module._inside, "active", False):
            # A backend's own call to PyTorch's function, inside a patched call.
            return patched(query, key, value, attn_mask, dropout_p, is_causal,
                           scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        entry = calls.get(signature)
        if entry is None:
            calls[signature] = [
                1,
                (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa),
            ]
        else:
            entry[0] += 1
        return patched(query, key, value, attn_mask, dropout_p, is_causal,
                       scale=scale, enable_gqa=enable_gqa)  # fmt: skip

    F.scaled_dot_product_attention = record  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = patched


def _describe_call(count: int, args: tuple[Any, ...]) -> str:
    query, key, value, mask, dropout_p, is_causal, scale, enable_gqa = args
    mask_text = (
        "no mask"
        if mask is None
        else f"{'bool' if mask.dtype == torch.bool else 'float'} mask {tuple(mask.shape)}"
    )
    head = (
        f"{count} call(s): q {tuple(query.shape)} k/v {tuple(key.shape)} {str(query.dtype).removeprefix('torch.')}, "
        f"{mask_text}, is_causal={is_causal}, enable_gqa={enable_gqa}"
    )
    why = _patch_module._outside_domain(query, key, value, mask, is_causal, enable_gqa)
    if why is not None:
        return f"{head}\n    -> PyTorch's own function ({why})"
    decision = explain(query, key, value, mask, causal=is_causal, scale=scale, dropout_p=dropout_p)
    lines = [f"{head}\n    -> {decision.chosen}: {decision.why}"]
    for c in decision.candidates:
        if c.name != decision.chosen:
            lines.append(f"       not {c.name}: {'; '.join(c.reasons) or c.note}")
    return "\n".join(lines)


def _max_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``attnhub demo`` and :func:`main`)."""
    parser.add_argument(
        "--model",
        choices=("auto", "hf", "builtin"),
        default="auto",
        help="auto: transformers' Llama when installed, else the built-in model",
    )
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each (interleaved)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``attnhub demo [options]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="attnhub demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options (see :func:`add_arguments`)."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    vocab = 256
    model, label = _build(args.model, vocab)
    model = model.to(device=device, dtype=dtype)
    ids = torch.randint(1, vocab, (args.batch, args.seq), device=device)
    mask = torch.ones_like(ids)
    if args.batch > 1 and label.startswith("transformers"):
        mask[-1, : args.seq // 4] = 0  # a left-padded row: transformers builds a mask
    print(f"attnhub demo: {label}")
    print(f"device {device}, {str(dtype).removeprefix('torch.')}, batch {args.batch} x {args.seq} tokens"
          f"{' (last row left-padded)' if not bool(mask.all()) else ''}; forward + backward\n")  # fmt: skip

    stock_logits, stock_grads = _step(model, ids, mask)  # also the warm-up

    calls: dict[tuple[Any, ...], list[Any]] = {}
    reset_stats()
    with patch(), _recording(calls):
        patched_logits, patched_grads = _step(model, ids, mask)
    served = stats()
    stock_time, patched_time = _timed_pair(
        lambda: _step(model, ids, mask), lambda: _patched_step(model, ids, mask), args.steps, device
    )

    print("attention calls in one patched step, by kind:")
    for count, call_args in calls.values():
        print("  " + _describe_call(count, call_args).replace("\n", "\n  "))
    print("\ncalls served per backend (attnhub.stats()):")
    for name, n in served.items():
        print(f"  {name if name != ORIGINAL else name + ' (handed back to PyTorch)'}: {n}")

    logit_dev = _max_dev(patched_logits, stock_logits)
    grad_dev = max((_max_dev(patched_grads[n], g) for n, g in stock_grads.items()), default=0.0)
    grad_scale = max((g.float().abs().max().item() for g in stock_grads.values()), default=1.0)
    print("\nlargest deviation from stock:")
    print(f"  logits    max |patched - stock| = {logit_dev:.3g}")
    print(f"  gradients max |patched - stock| = {grad_dev:.3g} (largest gradient {grad_scale:.3g})")
    print(f"\ntime per step (forward + backward, median of {args.steps}, interleaved): "
          f"stock {stock_time * 1e3:.1f} ms, patched {patched_time * 1e3:.1f} ms")  # fmt: skip
    finite = math.isfinite(logit_dev) and math.isfinite(grad_dev)
    if not finite:
        print("\nERROR: non-finite deviation")
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
