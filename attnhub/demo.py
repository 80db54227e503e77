"""``attnhub demo``: an existing model, stock and then patched, side by side.

Builds a transformer from a config (a Llama-style Hugging Face model when transformers
is installed, else a built-in one; random weights, nothing is downloaded) and runs one
training step (forward and backward) four ways on the same weights and tokens:

- **stock**: PyTorch's own ``F.scaled_dot_product_attention``;
- **patched**: the same under :func:`attnhub.patch`;
- **r_lp**: attention by ``torch_reference`` (the contract as plain PyTorch
  operations) in the model's dtype;
- **reference**: the same in higher precision (float64; float32 for a half-precision
  model on CUDA, where float64 attention at the GPU size would not fit comfortably).

It prints which backend served each kind of attention call and why, judges stock and
patched by the contract's tolerance rule applied to the whole step
(``max|x - reference| <= 2 * max|r_lp - reference| + 1e-5`` for the logits and each
parameter's gradient), says where stock PyTorch gives NaN and attnhub does not, and
times stock against patched. The exit code is 0 when attnhub's results are finite and
within that tolerance, 1 when they are not (speed does not decide it: the report says
which is faster), 2 when the options cannot be used (a size below 1, a device that is
not here, ``--model hf`` without transformers).

On a CPU the model is small (seconds in all); on a GPU it is large enough that
attention matters: 4 layers, hidden 2048, 16 query / 4 key-value heads of 128, 4096
tokens a row, the last row left-padded so that the model builds a padding mask.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import patching as _patch_module
from .api import explain
from .call_stats import ORIGINAL, reset_stats, stats
from .cli import positive_int, usable_device
from .mask_structure import MaskPlan
from .patching import patch
from .timing import synchronize

REFERENCE = "torch_reference"


@dataclass(frozen=True)
class ModelSize:
    """The model's shape: ``heads`` query heads and ``kv_heads`` key/value heads of
    ``dim // heads`` channels each."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    seq: int  # default tokens per row

    def label(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.dim}, {self.heads} query / {self.kv_heads} "
            f"key-value heads of {self.dim // self.heads}"
        )


# Small: seconds on a CPU. Large: a GPU step where attention is a large share of the
# time (at 4096 tokens, attention is about half of a Llama layer's FLOPs).
SIZES = {
    "small": ModelSize(dim=128, layers=2, heads=4, kv_heads=2, seq=64),
    "large": ModelSize(dim=2048, layers=4, heads=16, kv_heads=4, seq=4096),
}


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

    def __init__(self, size: ModelSize, vocab: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, size.dim)
        self.blocks = torch.nn.ModuleList(
            _Block(size.dim, size.heads, size.kv_heads) for _ in range(size.layers)
        )
        self.head = torch.nn.Linear(size.dim, vocab)

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(kind: str, size: ModelSize, vocab: int) -> tuple[torch.nn.Module, str]:
    if kind in ("auto", "hf"):
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            if kind == "hf":
                raise
        else:
            config = LlamaConfig(
                vocab_size=vocab, hidden_size=size.dim, intermediate_size=2 * size.dim,
                num_hidden_layers=size.layers, num_attention_heads=size.heads,
                num_key_value_heads=size.kv_heads, max_position_embeddings=max(512, size.seq),
            )  # fmt: skip
            model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
            return model, f"transformers LlamaForCausalLM ({size.label()})"
    return TinyGPT(size, vocab), f"built-in TinyGPT ({size.label()})"


@dataclass
class StepResult:
    """One training step's logits (the kept positions) and gradients, by parameter name."""

    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def _step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> StepResult:
    """Forward and backward of the next-token loss over the unpadded positions."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask)
    logits = out.logits if hasattr(out, "logits") else out
    keep = mask.bool()
    loss = F.cross_entropy(logits[:, :-1][keep[:, 1:]].float(), ids[:, 1:][keep[:, 1:]])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return StepResult(logits.detach()[keep], grads)


def _timed_pair(
    stock: Callable[[], Any], patched: Callable[[], Any], steps: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Seconds of each step of each, interleaved so that machine noise hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(steps):
        for fn, out in ((stock, times[0]), (patched, times[1])):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            out.append(time.perf_counter() - start)
    return times


def speed_verdict(stock: list[float], patched: list[float]) -> str:
    """What the paired step times say: faster or slower where the middle half of the
    pairs' ratios (stock's time over patched's, each pair run back to back) lies on one
    side of 1, else no difference beyond the run's noise; with fewer than three pairs,
    that they are too few to tell."""
    ratios = sorted(s / p for s, p in zip(stock, patched))
    if len(ratios) < 3:
        return f"{len(ratios)} step(s): too few to tell a difference from noise"
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    spread = f"the middle half of the paired ratios {low:.2f}-{high:.2f}"
    if low > 1.0:
        return f"faster: {spread}"
    if high < 1.0:
        return f"slower: {spread}"
    return f"no difference beyond this run's noise: {spread}"


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
        if not getattr(_patch_module._inside, "active", False):
            # (Inside a patched call, a backend's own call to PyTorch's function.)
            entry = calls.setdefault(signature, [0, None])
            entry[0] += 1
            entry[1] = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
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
    served_mask, structure = _patch_module.mask_arguments(query, key, mask, is_causal)
    decision = explain(
        query, key, value, served_mask, **structure, scale=scale, dropout_p=dropout_p
    )
    lines = [head]
    if mask is not None and served_mask is not mask:
        read = MaskPlan(served_mask, **structure).describe()
        lines.append(f"    the mask is exactly {read}: it runs as that (attnhub.mask_structure)")
    lines.append(f"    -> {decision.chosen}: {decision.why}")
    for c in decision.candidates:
        if c.name != decision.chosen:
            lines.append(f"       not {c.name}: {'; '.join(c.reasons) or c.note}")
    return "\n".join(lines)


# -- judging a step by the contract's tolerance rule ---------------------------------------


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (NaN if either holds a NaN or an infinity)."""
    if not a.numel():
        return 0.0
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(b).all()):
        return math.nan
    return (a.double() - b.double()).abs().max().item()


@dataclass
class Verdict:
    """How one way of running the step compares with the reference, tensor by tensor.

    ``worst`` is the largest error / bound over the tensors with finite values
    (<= 1 passes); ``non_finite`` names the tensors holding a NaN or an infinity.
    """

    worst: float
    worst_name: str
    non_finite: list[str]
    tensors: int

    @property
    def ok(self) -> bool:
        return not self.non_finite and self.worst <= 1.0


def _judge(result: StepResult, r_lp: StepResult, ref: StepResult) -> Verdict:
    """The contract's rule, per tensor: max|x - ref| <= 2 * max|r_lp - ref| + 1e-5."""
    pairs = [("logits", result.logits, r_lp.logits, ref.logits)]
    pairs += [(n, g, r_lp.grads[n], ref.grads[n]) for n, g in result.grads.items()]
    worst, worst_name, non_finite = 0.0, "-", []
    for name, x, low, high in pairs:
        error = _max_abs_diff(x, high)
        if math.isnan(error):
            non_finite.append(name)
            continue
        ratio = error / (2 * _max_abs_diff(low, high) + 1e-5)
        if ratio > worst:
            worst, worst_name = ratio, name
    return Verdict(worst, worst_name, non_finite, len(pairs))


def _verdict_line(label: str, verdict: Verdict) -> str:
    parts = []
    if len(verdict.non_finite) < verdict.tensors:
        parts.append(f"worst error {verdict.worst:.2f}x the bound ({verdict.worst_name})")
    if verdict.non_finite:
        shown = ", ".join(verdict.non_finite[:3]) + (", ..." if len(verdict.non_finite) > 3 else "")
        parts.append(
            f"NaN or inf in {len(verdict.non_finite)} of {verdict.tensors} tensors ({shown})"
        )
    return f"  {label:<8} {'PASS' if verdict.ok else 'FAIL'}: " + "; ".join(parts)


# -- the command ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``attnhub demo`` and :func:`main`)."""
    parser.add_argument(
        "--model",
        choices=("auto", "hf", "builtin"),
        default="auto",
        help="auto: transformers' Llama when installed, else the built-in model",
    )
    # Sizes and the device are checked here (argparse: exit 2 naming the option), so that
    # exit 1 means only what the docstring says: attnhub's results are wrong.
    parser.add_argument("--device", type=usable_device, default=None, help="default: cuda if available, else cpu")  # fmt: skip
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--size",
        choices=tuple(SIZES),
        default=None,
        help="default: large on cuda (4 layers, hidden 2048, 4096 tokens), small on cpu",
    )
    parser.add_argument("--batch", type=positive_int, default=2, help="rows (default: 2)")
    parser.add_argument("--seq", type=positive_int, default=None, help="tokens per row (default: the size's)")  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=None, help="timed steps of each, interleaved (default: 10)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``attnhub demo [options]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="attnhub demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm{major}{minor})"


def _reference_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """float64, except for a half-precision model on CUDA: float32 (2^16 times finer than
    bf16 already, and float64 matmuls of the GPU size would dominate the demo)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return torch.float64


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options (see :func:`add_arguments`)."""
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device if args.device is not None else default_device)
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    size = SIZES[args.size or ("large" if on_gpu else "small")]
    # None is "not given"; a value is honoured as given (add_arguments admits only >= 1).
    seq = args.seq if args.seq is not None else size.seq
    steps = args.steps if args.steps is not None else 10
    torch.manual_seed(0)
    vocab = 256
    try:
        with torch.device(device):  # initialize on the device: fast for the large model
            model, label = _build(args.model, size, vocab)
    except ImportError as exc:
        if args.model != "hf":  # (auto falls back to the built-in model without it)
            raise
        print(f"attnhub demo: --model hf needs transformers ({exc})", file=sys.stderr)
        return 2
    model = model.to(dtype=dtype)
    ids = torch.randint(1, vocab, (args.batch, seq), device=device)
    mask = torch.ones_like(ids)
    padded = args.batch > 1 and label.startswith("transformers")
    if padded:
        mask[-1, : seq // 4] = 0  # a left-padded row: transformers builds a padding mask
    print(f"attnhub demo: {label}")
    print(f"device {_device_label(device)}, {str(dtype).removeprefix('torch.')}, "
          f"batch {args.batch} x {seq} tokens"
          f"{f' (last row left-padded by {seq // 4})' if padded else ''}; "
          "one training step = forward + backward\n")  # fmt: skip

    stock = _step(model, ids, mask)  # also the warm-up
    calls: dict[tuple[Any, ...], list[Any]] = {}
    reset_stats()
    with patch(aliases=False), _recording(calls):
        patched = _step(model, ids, mask)
    served = stats()

    print("attention calls in one patched step, by kind:")
    for count, call_args in calls.values():
        print("  " + _describe_call(count, call_args).replace("\n", "\n  "))
    print("\ncalls served per backend (attnhub.stats()):")
    for name, n in served.items():
        print(f"  {name if name != ORIGINAL else name + ' (handed back to PyTorch)'}: {n}")

    with patch(REFERENCE, aliases=False):
        r_lp = _step(model, ids, mask)
        ref_dtype = _reference_dtype(device, dtype)
        reference = _step(copy.deepcopy(model).to(dtype=ref_dtype), ids, mask)
    verdicts = {
        "stock": _judge(stock, r_lp, reference),
        "patched": _judge(patched, r_lp, reference),
    }
    del r_lp, reference
    low = str(dtype).removeprefix("torch.")
    print(
        f"\ncorrectness of the logits and of all {verdicts['patched'].tensors - 1} parameter "
        f"gradients, each against the reference ({str(ref_dtype).removeprefix('torch.')}, "
        f"attention by {REFERENCE}), by the contract's rule "
        f"max|x - ref| <= 2 * max|r_lp - ref| + 1e-5 (r_lp: the same in {low}):"
    )
    for name, verdict in verdicts.items():
        print(_verdict_line(name, verdict))

    stock_times, patched_times = _timed_pair(
        lambda: _step(model, ids, mask),
        lambda: _patched_step(model, ids, mask),
        steps,
        device,
    )
    tokens = int(mask.sum())
    stock_time, patched_time = statistics.median(stock_times), statistics.median(patched_times)
    print(
        f"\ntime per training step (median of {steps}, interleaved): "
        f"stock {stock_time * 1e3:.1f} ms ({tokens / stock_time:,.0f} tokens/s), "
        f"patched {patched_time * 1e3:.1f} ms ({tokens / patched_time:,.0f} tokens/s): "
        f"patched runs at {stock_time / patched_time:.2f}x stock's speed"
        f" ({speed_verdict(stock_times, patched_times)})"
    )
    return _conclude(verdicts["stock"], verdicts["patched"], _rows_without_keys(calls))


def _patched_step(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    with patch(aliases=False):
        _step(model, ids, mask)


def _rows_without_keys(calls: dict[tuple[Any, ...], list[Any]]) -> int:
    """How many query positions (over the batch, any head) of the recorded calls see no key."""
    rows = 0
    for _, (query, key, _, mask, *_) in calls.values():
        if mask is not None:
            visible = mask if mask.dtype == torch.bool else mask > float("-inf")
            shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            empty = ~visible.expand(shape).any(dim=-1)  # (B, Hq, Nq)
            rows += int(empty.any(dim=1).sum())
    return rows


def _conclude(stock: Verdict, patched: Verdict, empty_rows: int) -> int:
    print()
    if not stock.ok and patched.ok:
        what = (
            f"NaN or inf in {len(stock.non_finite)} of {stock.tensors} tensors"
            if stock.non_finite
            else f"an error {stock.worst:.2f}x the contract's tolerance ({stock.worst_name})"
        )
        cause = (
            f" In {empty_rows} query positions of the attention calls every key is masked "
            "(the left padding): attnhub's contract gives zeros there, where PyTorch's "
            "fused kernels may give NaN or arbitrary values."
            if empty_rows
            else ""
        )
        print(
            f"NOTE: stock PyTorch's step has {what}, attnhub's is within the tolerance; "
            f"the two runs differ only in the attention function.{cause} This is a "
            "difference in attnhub's favour, not an error."
        )
    if patched.ok:
        print("OK: attnhub's results are finite and within the contract's tolerance.")
        return 0
    if patched.non_finite:
        print(f"ERROR: attnhub's results hold NaN or inf in {', '.join(patched.non_finite)}.")
    if patched.worst > 1.0:
        print(
            f"ERROR: attnhub's {patched.worst_name} deviates {patched.worst:.2f}x the "
            "contract's tolerance from the reference."
        )
    return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
