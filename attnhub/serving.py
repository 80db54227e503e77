"""The serving and packed-training calls: :func:`attention_varlen` and
:func:`attention_kvcache`, with :func:`explain_varlen` and :func:`explain_kvcache`.

Their meaning is contract.md's "Packed sequences and KV caches"; they dispatch through
the same registry, policy and selection (``backend=``, ``use_backend``,
``ATTNHUB_BACKEND``, strict mode) as :func:`attnhub.attention`, among the backends
whose ``layouts`` declare "varlen", "kvcache" (contiguous cache) or "paged".

Per-call cost: each call validates its index tensors' values on the host (one
transfer, see :mod:`attnhub.serving_validation`) and looks its decision up in
dispatch's cache; there is no per-signature fast path as for :func:`attnhub.attention`
yet. The transfer synchronizes, so such calls are not capturable in a CUDA graph and
run eagerly under ``torch.compile`` (a graph break); ``check_indices=False`` reads
nothing from the device (the caller vouches for the values), and an unchecked KV-cache
call whose metadata, options and selection were decided before skips validation and
dispatch (``_decided_kvcache``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import call_stats, dispatch, output_check
from .backend import Backend
from .errors import BrokenBackendError
from .registry import generation as registry_generation
from .registry import get_registry, on_invalidate
from .serving_validation import KVCacheCall, ServingRequest, VarlenCall, check_kvcache, check_varlen

__all__ = ["attention_kvcache", "attention_varlen", "explain_kvcache", "explain_varlen"]

_Output = Any  # torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def _decide(request: ServingRequest, backend: str | Sequence[str] | None) -> dispatch.Decision:
    """The decision for a request under the selection in force (as attnhub.attention's)."""
    selection = dispatch.current_selection(backend)
    if request.empty:  # no query rows or no keys anywhere
        selection = dispatch.empty_input_selection(request.describe())
    return dispatch.decide(request, selection)


def _choose(request: ServingRequest, backend: str | Sequence[str] | None) -> Backend:
    chosen = dispatch.choose(_decide(request, backend))
    call_stats.record(chosen.name)
    return chosen


def _served(
    request: ServingRequest,
    backend: str | Sequence[str] | None,
    chosen: Backend,
    forward: Callable[[Backend], Any],
    inputs: Sequence[Any],
    query: torch.Tensor,
    value: torch.Tensor,
    return_lse: bool,
) -> Any:
    """``forward(chosen)``. A third-party backend's result is checked
    (:func:`attnhub.output_check.call_checked`, ``value`` the tensor whose last dim the
    output has): one that breaks the contract is disabled, and the call is decided
    again and served by the next eligible backend (nothing is appended twice: the
    caches were written before)."""
    while not dispatch.built_in(chosen):
        try:
            return output_check.call_checked(
                chosen.name, functools.partial(forward, chosen), inputs, query, value, return_lse,
                get_registry().disable,
            )  # fmt: skip
        except BrokenBackendError as exc:
            if not exc.inputs_intact:
                raise
        chosen = _choose(request, backend)
    return forward(chosen)


def _varlen_call(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    causal: Any,
    alignment: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    return_lse: Any,
    check_indices: Any,
) -> VarlenCall:
    options = dict(
        causal=causal, alignment=alignment, window=window, softcap=softcap, scale=scale,
        return_lse=return_lse,
    )  # fmt: skip
    return check_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
        check_indices,
    )  # fmt: skip


def attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
    check_indices: bool = True,
) -> _Output:
    """Attention over B packed sequences of different lengths, without padding.

    Sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` attending to key
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; each is :func:`attnhub.attention` of
    that sequence alone (contract.md, "Packed sequences and KV caches").

    Args:
        query: (Tq, Hq, D), Tq the total query tokens.
        key: (Tk, Hkv, D); Hq must be a multiple of Hkv (grouped-query attention).
        value: (Tk, Hkv, Dv).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 (B + 1,) on the query's device,
            starting at 0, non-decreasing, ending at Tq and Tk.
        max_seqlen_q, max_seqlen_k: None (computed from the cu_seqlens) or at least
            the longest query / key sequence (flash-attn's arguments of that name).
        causal, alignment, window, softcap, scale: as :func:`attnhub.attention`, with
            the diagonal placed per sequence: query row i of a sequence with Nq_b
            queries and Nk_b keys sits at key position i ("top_left") or
            i + Nk_b - Nq_b ("bottom_right").
        return_lse: also return the float32 (Tq, Hq) natural log-sum-exp.
        backend: None, a backend name, or names to choose among (in that order).
        check_indices: True (the default) reads the cu_seqlens' values to check them
            (one host transfer, a synchronization on CUDA). False reads nothing (CUDA
            graphs can capture the call) and needs ``max_seqlen_q`` and
            ``max_seqlen_k``; bad values are then the caller's error, with unspecified
            results, as in flash-attn.

    Returns:
        The output (Tq, Hq, Dv) in the query's dtype, or ``(output, lse)``. Gradients
        flow to query, key and value.

    Raises:
        TypeError, ValueError: bad input, naming the argument, before any kernel runs.
        NoBackendError: no backend (or none of those asked for) can serve the call.
    """
    call = _varlen_call(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal, alignment, window, softcap, scale, return_lse, check_indices,
    )  # fmt: skip
    chosen = _choose(call.request, backend)
    return _served(
        call.request, backend, chosen,
        lambda b: b.forward_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k,
                                   call.max_seqlen_q, call.max_seqlen_k, call.params),
        (query, key, value, cu_seqlens_q, cu_seqlens_k), query, value, call.params.return_lse,
    )  # fmt: skip


def explain_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
    check_indices: bool = True,
) -> dispatch.Decision:
    """The decision :func:`attention_varlen` would make, without running it.

    As :func:`attnhub.explain`: ``str(decision)`` tables every backend with its
    reasons (a backend without the "varlen" layout says so); bad input raises.
    """
    call = _varlen_call(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal, alignment, window, softcap, scale, return_lse, check_indices,
    )  # fmt: skip
    return _decide(call.request, backend)


def _kvcache_call(
    query: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    block_table: Any,
    k_new: Any,
    v_new: Any,
    causal: Any,
    alignment: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    return_lse: Any,
    check_indices: Any,
) -> KVCacheCall:
    options = dict(
        causal=causal, alignment=alignment, window=window, softcap=softcap, scale=scale,
        return_lse=return_lse,
    )  # fmt: skip
    return check_kvcache(
        query, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, options, check_indices
    )


def attention_kvcache(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    causal: bool = False,
    alignment: str = "bottom_right",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
    check_indices: bool = True,
) -> _Output:
    """Attention of new queries against a KV cache (decoding, speculative decoding,
    chunked prefill), optionally appending new keys and values to it first.

    Sequence b has ``L_b = cache_seqlens[b] + Nnew`` keys: the first
    ``cache_seqlens[b]`` already in the cache, then ``k_new[b]``/``v_new[b]``, which
    are written into the cache in place (positions ``cache_seqlens[b]`` to
    ``L_b - 1``) before attention, as flash-attn's ``flash_attn_with_kvcache`` does.
    ``cache_seqlens`` itself is not changed. Each sequence is
    :func:`attnhub.attention` of ``query[b]`` against its ``L_b`` keys with the given
    alignment, bottom-right by default: query i sees, with ``causal``, keys
    ``<= L_b - Nq + i``.

    Args:
        query: (B, Hq, Nq, D), the layout of :func:`attnhub.attention`.
        k_cache, v_cache: a contiguous cache (B, Hkv, Nmax, D) and (B, Hkv, Nmax, Dv)
            (the layout of :func:`attnhub.attention`'s key and value), or with
            ``block_table`` a paged cache (num_pages, page_size, Hkv, D) and
            (num_pages, page_size, Hkv, Dv).
        cache_seqlens: int32 or int64 (B,): keys already in the cache per sequence.
        block_table: None, or int32 (B, pages_per_seq): key position p of sequence b
            is slot ``p % page_size`` of page ``block_table[b, p // page_size]``.
            Entries past the pages a sequence uses are not read (any value).
        k_new, v_new: None, or (B, Hkv, Nnew, D) and (B, Hkv, Nnew, Dv): appended.
            ``cache_seqlens[b] + Nnew`` must fit in the cache (Nmax, or
            pages_per_seq * page_size). Two sequences appending to one shared page
            slot write it in an unspecified order.
        causal, alignment, window, softcap, scale: as :func:`attnhub.attention`;
            ``alignment`` defaults to "bottom_right" here.
        return_lse: also return the float32 (B, Hq, Nq) natural log-sum-exp.
        backend: None, a backend name, or names to choose among (in that order).
        check_indices: True (the default) reads ``cache_seqlens`` and the block table's
            pages in use to check them (one host transfer, a synchronization on CUDA).
            False reads nothing (CUDA graphs can capture the call; a decoding loop
            does not wait for the GPU at every layer); bad values are then the
            caller's error, with unspecified results (an out-of-range page may be an
            illegal memory access), as in flash-attn.

    Returns:
        The output (B, Hq, Nq, Dv) in the query's dtype, or ``(output, lse)``. A query
        row that keeps no key (``L_b == 0``, or causal with ``L_b - Nq + i < 0``)
        gives zeros and an lse of -inf.

    Raises:
        TypeError, ValueError: bad input, naming the argument, before any kernel runs
            or anything is written.
        NoBackendError: no backend (or none of those asked for) can serve the call.
    """
    options = (causal, alignment, window, softcap, scale, return_lse)
    key = (
        _unchecked_key(query, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                       options, backend)
        if check_indices is False
        else None
    )  # fmt: skip
    entry = _decided_kvcache.get(key) if key is not None else None
    if entry is None:
        generation = registry_generation()
        call = _kvcache_call(
            query, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
            *options, check_indices,
        )  # fmt: skip
        # Decided (and so refused, if nothing serves it) before anything is written.
        chosen = dispatch.choose(_decide(call.request, backend))
        entry = (chosen, call.params, call.new, call.request)
        if key is not None:
            with _decided_lock:
                if len(_decided_kvcache) >= _DECIDED_LIMIT:
                    _decided_kvcache.clear()
                # Not where the registry or policy changed meanwhile (a stale decision).
                if generation == registry_generation():
                    _decided_kvcache[key] = entry
    chosen, params, new, request = entry
    call_stats.record(chosen.name)
    seqlens_k = cache_seqlens
    if new:
        append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)  # type: ignore[arg-type]
        seqlens_k = cache_seqlens + new
    if dispatch.built_in(chosen):  # the decode loop's path: nothing more
        return chosen.forward_kvcache(query, k_cache, v_cache, seqlens_k, block_table, params)
    return _served(
        request, backend, chosen,
        lambda b: b.forward_kvcache(query, k_cache, v_cache, seqlens_k, block_table, params),
        (query, k_cache, v_cache, seqlens_k, block_table), query, v_cache, params.return_lse,
    )  # fmt: skip


# Decided unchecked KV-cache calls (check_indices=False), keyed on everything their
# validation and decision read: a decoding loop calls with one signature per layer and
# step. Host time of a call (this machine's CPU, the backend's forward stubbed out):
# 21 us checked (validation, one transfer, a decision), 5 us unchecked and seen before.
# A checked call reads the index values anyway and is decided every time. Cleared on
# any registry, policy or cost-table change.
_decided_kvcache: dict[tuple[Any, ...], tuple[Backend, Any, int, ServingRequest]] = {}
_decided_lock = threading.Lock()
_DECIDED_LIMIT = 1024


@on_invalidate
def _forget_decided() -> None:
    with _decided_lock:
        _decided_kvcache.clear()


def _tensor_key(t: Any) -> Any:
    """What unchecked validation and the request read of a tensor (None stays None)."""
    if t is None:
        return None
    return (
        type(t), t.shape, t.dtype, t.device, t.requires_grad, t.is_leaf,
        t.shape[-1] <= 1 or t.stride(-1) == 1 if t.dim() else True,
    )  # fmt: skip


def _unchecked_key(*args: Any) -> tuple[Any, ...] | None:
    """The call's key, or None where it cannot have one (a non-tensor argument, an
    unhashable option, tracing): such calls are validated and decided every time."""
    *tensors, options, backend = args
    if torch.compiler.is_compiling():
        return None
    try:
        key = (
            tuple(_tensor_key(t) for t in tensors),
            options,
            # Types too: True == 1 == 1.0 hash alike, and validation refuses causal=1.
            tuple(type(o) for o in options),
            None if options[2] is None else tuple(type(side) for side in options[2]),
            backend if backend is None or isinstance(backend, str) else tuple(backend),
            torch.is_grad_enabled(),
            torch.are_deterministic_algorithms_enabled(),
            dispatch.context_selection.get(),
            dispatch.environment_get(dispatch.ENVIRONMENT_KEYS[0]),
            dispatch.environment_get(dispatch.ENVIRONMENT_KEYS[1]),
        )
        hash(key)
    except Exception:
        return None
    return key


def explain_kvcache(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    causal: bool = False,
    alignment: str = "bottom_right",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | Sequence[str] | None = None,
    check_indices: bool = True,
) -> dispatch.Decision:
    """The decision :func:`attention_kvcache` would make, without running it or
    writing to the cache; bad input raises as the call would."""
    call = _kvcache_call(
        query, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
        causal, alignment, window, softcap, scale, return_lse, check_indices,
    )  # fmt: skip
    return _decide(call.request, backend)


def append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Write ``k_new``/``v_new`` (B, Hkv, Nnew, D|Dv) into the cache in place at
    positions ``cache_seqlens[b] ...`` of each sequence (validated: they fit).

    One indexed write per tensor on the device (no host loop). Autograd records it
    as any in-place write, so gradients flow to ``k_new``/``v_new`` through a cache
    that is not a leaf.
    """
    b, _, new, _ = k_new.shape
    if b == 0 or new == 0:
        return
    device = k_cache.device
    positions = cache_seqlens.to(torch.int64).unsqueeze(1) + torch.arange(new, device=device)
    rows = torch.arange(b, device=device).unsqueeze(1).expand(b, new)
    # Advanced indices around a slice put their (B, Nnew) dims first: the values go
    # in as (B, Nnew, Hkv, D).
    if block_table is None:
        k_cache[rows, :, positions] = k_new.transpose(1, 2)
        v_cache[rows, :, positions] = v_new.transpose(1, 2)
    else:
        page_size = k_cache.shape[1]
        pages = block_table.to(torch.int64)[rows, positions // page_size]
        slots = positions % page_size
        k_cache[pages, slots] = k_new.transpose(1, 2)
        v_cache[pages, slots] = v_new.transpose(1, 2)
