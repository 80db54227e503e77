"""The public calls: :func:`attention`, :func:`explain`, :func:`list_backends`.

The per-call cost matters (attention is called once per layer per step), so a call is
keyed on cheap metadata (shapes, strides, dtypes, devices, options, grad state, the
backend selection in force) and a key seen before skips validation and ranking and
goes straight to the backend it chose last time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch

from . import dispatch
from .backend import Runner
from .call_stats import record as record_served
from .registry import get_registry
from .request import AttentionParams
from .validation import (
    TensorMeta,
    build_request,
    check_block_sparse,
    check_tensors,
    make_params,
)

_CallKey = tuple[Any, ...]
_call_cache: dict[_CallKey, tuple[str, Runner]] = {}
_call_cache_lock = threading.Lock()
# Bound once: the hot path looks these up on every call.
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_context_selection = dispatch._context_selection
_environment_key = dispatch.environment_key
_CALL_CACHE_LIMIT = 4096


def clear_call_cache() -> None:
    with _call_cache_lock:
        _call_cache.clear()


def _prepare(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    options: dict[str, Any],
    backend: Any,
) -> tuple[dispatch.Decision, AttentionParams]:
    """Validate a call and decide it (the slow path)."""
    check_tensors(query, key, value, attn_mask)
    params = make_params(query, **options)
    check_block_sparse(params, query, key)
    request = build_request(query, key, value, attn_mask, params)
    selection = dispatch.current_selection(backend)
    if query.numel() == 0 or key.numel() == 0:
        # Empty inputs: the reference returns what the contract says (empty, or
        # zeros with a log-sum-exp of -inf when there are no keys), whatever was asked.
        selection = dispatch.Selection((dispatch.REFERENCE,), False, "empty input")
    return dispatch.decide(request, selection), params


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_sparse: Any = None,
    return_lse: Literal[False] = False,
    backend: str | Sequence[str] | None = None,
) -> torch.Tensor: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_sparse: Any = None,
    return_lse: Literal[True],
    backend: str | Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_sparse: Any = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_sparse: Any = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, served by the best eligible backend.

    Args:
        query: (B, Hq, Nq, D).
        key: (B, Hkv, Nk, D); Hq must be a multiple of Hkv (grouped-query attention:
            query head h reads key/value head h // (Hq // Hkv)).
        value: (B, Hkv, Nk, Dv).
        attn_mask: bool (True = may attend) or float (added to the scores),
            broadcastable to (B, Hq, Nq, Nk).
        causal: keep keys at or before each query's diagonal position.
        alignment: "top_left" (query row i sits at key position i, as
            ``F.scaled_dot_product_attention(is_causal=True)``) or "bottom_right"
            (at i + Nk - Nq, as FlashAttention and KV-cache decoding).
        window: (left, right): keep keys from position - left to position + right;
            None on a side means unbounded.
        softcap: c > 0: scores become c * tanh(scores / c) before masking.
        scale: score scale; None means 1 / sqrt(D).
        dropout_p: probability of dropping an attention weight (kept weights are
            scaled by 1 / (1 - p)); seeded from PyTorch's generator.
        block_sparse: an :class:`attnhub.BlockSparseLayout`.
        return_lse: also return the float32 (B, Hq, Nq) natural log-sum-exp.
        backend: None, a backend name, or names to choose among (in that order).

    Returns:
        The output (B, Hq, Nq, Dv) in the query's dtype, or ``(output, lse)``.
        A query row with every key masked gives zeros and an lse of -inf.

    Raises:
        TypeError, ValueError: bad input, naming the argument.
        NoBackendError: no backend (or none of those asked for) can serve the call.
    """
    if _is_compiling():
        return _attention_traced(
            query, key, value, attn_mask, causal, alignment, window, softcap, scale,
            dropout_p, block_sparse, return_lse, backend,
        )  # fmt: skip
    options = (causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse)
    # The key holds everything validation and dispatch read, and nothing more. It is
    # built inline: this is the per-call cost (see benchmarks/overhead.py). Hashing
    # fails (TypeError) for unhashable options, and attribute access for non-tensors:
    # both take the slow path, which validates.
    try:
        grad = _grad_enabled() and (
            query.requires_grad
            or key.requires_grad
            or value.requires_grad
            or (attn_mask is not None and attn_mask.requires_grad)
        )
        call_key: _CallKey | None = (
            query.shape, query.stride(), query.dtype, query.device,
            key.shape, key.stride(), key.dtype, key.device,
            value.shape, value.stride(), value.dtype, value.device,
            None if attn_mask is None
            else (attn_mask.shape, attn_mask.dtype, attn_mask.device, attn_mask.requires_grad),
            options, backend, grad,
            grad and torch.are_deterministic_algorithms_enabled(),
            _context_selection.get(), _environment_key(),
        )  # fmt: skip
        hit = _call_cache.get(call_key)  # type: ignore[arg-type]
    except (TypeError, AttributeError):
        call_key, hit = None, None
    if hit is None:
        decision, params = _prepare(query, key, value, attn_mask, _options_dict(options), backend)
        chosen = dispatch.choose(decision)
        hit = (chosen.name, chosen.prepare(decision.request, params))
        if call_key is not None:
            with _call_cache_lock:
                if len(_call_cache) >= _CALL_CACHE_LIMIT:
                    _call_cache.clear()
                _call_cache[call_key] = hit
    name, runner = hit
    record_served(name)  # attnhub.stats(): per-thread counters, no lock
    return runner(query, key, value, attn_mask)


def _options_dict(options: tuple[Any, ...]) -> dict[str, Any]:
    names = ("causal", "alignment", "window", "softcap", "scale", "dropout_p",
             "block_sparse", "return_lse")  # fmt: skip
    return dict(zip(names, options))


def _meta(t: Any) -> Any:
    """A tensor's metadata as Python constants (what Dynamo can hand to a constant function)."""
    if not isinstance(t, torch.Tensor):
        return t
    return (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t.requires_grad)


def _traced_choice(
    metas: tuple[Any, ...], options: tuple[Any, ...], backend: Any, grad: bool
) -> str:
    """Validate and decide from metadata alone; Dynamo runs this once, at trace time.

    Its result (a backend name) is baked into the graph: the ``use_backend`` context
    and ``ATTNHUB_BACKEND`` in force while tracing decide, as the docs say.
    """
    query, key, value, attn_mask = (None if m is None else TensorMeta(*m) for m in metas)
    with torch.set_grad_enabled(grad):
        decision, _ = _prepare(query, key, value, attn_mask, _options_dict(options), backend)
    return dispatch.choose(decision).name


# What torch.compiler.assume_constant_result(_traced_choice) does (it only sets this
# attribute, torch/_dynamo/decorators.py), without importing torch._dynamo and Triton
# at `import attnhub`, which takes seconds. test_dispatch's compile test checks it.
_traced_choice._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _attention_traced(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *options: Any,
) -> Any:
    """The same call while ``torch.compile`` traces it.

    Dynamo cannot trace the decision machinery (context variables, caches, logging),
    so the choice is made by :func:`_traced_choice` from constant metadata, and the
    chosen backend's ``forward`` is traced into the graph.
    """
    *option_values, backend = options
    metas = tuple(_meta(t) for t in (query, key, value, attn_mask))
    name = _traced_choice(metas, tuple(option_values), backend, torch.is_grad_enabled())
    params = make_params(query, **_options_dict(tuple(option_values)))
    return get_registry().get(name).forward(query, key, value, attn_mask, params)


def explain(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    block_sparse: Any = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
) -> dispatch.Decision:
    """The decision :func:`attention` would make for these arguments, without running it.

    ``str(decision)`` is a table of every registered backend (eligible or not, with
    its reasons) and the chosen one with why it ranked first. Bad input raises as
    :func:`attention` would; a call nothing can serve returns a decision whose
    ``chosen`` is None.
    """
    options = (causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse)
    decision, _ = _prepare(query, key, value, attn_mask, _options_dict(options), backend)
    return decision


def list_backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return get_registry().names()
