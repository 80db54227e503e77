"""Input checks and requests for :func:`attnhub.attention_varlen` and
:func:`attnhub.attention_kvcache` (contract.md, "Packed sequences and KV caches").

Every message names the argument, what was expected and what came; bad input raises
``ValueError`` or ``TypeError`` here, before any kernel runs. Unlike
:mod:`attnhub.validation`, which reads metadata only, these checks read the *values*
of the index tensors (``cu_seqlens_*``, ``cache_seqlens``, the pages of
``block_table`` in use): a decreasing ``cu_seqlens`` or a page number beyond the pool
would otherwise be an illegal memory access or a silently wrong answer in a kernel.
All the values are brought to the host in one transfer per call (one synchronization
on CUDA), computed from the tensors on their device first.

The requests are :class:`ServingRequest`: an :class:`AttentionRequest` with the call's
``layout`` (and the page size of a paged cache), so that dispatch, which reads only the
request, keeps these calls apart from dense ones and from each other, and backends
that do not declare the layout are not eligible (:func:`attnhub.backend.declared_reasons`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .argcheck import int_at_least
from .request import (
    LOG2_SCALE_LIMIT,
    AttentionParams,
    AttentionRequest,
    device_capability,
    seqlen_bucket,
    softcap_log2,
)
from .validation import _shape, _type_name, check_strided, make_params, refuse_jit_trace

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ServingRequest(AttentionRequest):
    """The request of a varlen or KV-cache call.

    ``layout`` is "varlen", "kvcache" (contiguous cache) or "paged"; ``page_size`` is
    the paged cache's page size (None otherwise). For these calls ``batch`` is the
    number of sequences, ``seqlen_q`` and ``seqlen_k`` are the buckets of the longest
    query and key sequence (for a cache, of its capacity), ``same_seqlen`` says that
    every sequence has as many queries as keys and ``q_longer`` that some sequence has
    more queries than keys.
    """

    layout: str = "varlen"
    page_size: int | None = None

    def describe(self) -> str:
        text = super().describe()
        layout = self.layout
        if self.page_size is not None:
            layout += f" (page_size {self.page_size})"
        return f"{layout}: {text}"


@dataclass(frozen=True)
class VarlenCall:
    """A validated varlen call: the request, the options, the per-sequence lengths
    (host ints) and the maximum lengths handed to backends."""

    request: ServingRequest
    params: AttentionParams
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class KVCacheCall:
    """A validated KV-cache call: the request, the options, ``cache_seqlens`` as host
    ints, the number of keys appended (``Nnew``, 0 without ``k_new``) and the cache's
    capacity per sequence (Nmax, or pages_per_seq * page_size)."""

    request: ServingRequest
    params: AttentionParams
    cache_seqlens: tuple[int, ...]
    new: int
    capacity: int


# -- shared pieces -----------------------------------------------------------------------


def _check_float_tensor(name: str, t: Any, dims: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
    check_strided(name, t)
    if t.dim() != dims:
        raise ValueError(
            f"{name} must be {dims}-D {layout}, got a {t.dim()}-D tensor of shape {_shape(t)}"
        )
    if not t.dtype.is_floating_point:
        raise TypeError(
            f"{name} must have a floating-point dtype (float16, bfloat16, float32, float64), "
            f"got {t.dtype}"
        )


def _check_same(name: str, t: torch.Tensor, query: torch.Tensor) -> None:
    if t.dtype != query.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but query has {query.dtype}; they must match")
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}; they must match")


def _check_index_tensor(
    name: str, t: Any, query: torch.Tensor, dims: int, what: str, dtypes: tuple[torch.dtype, ...]
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {_type_name(t)}")
    check_strided(name, t)
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {what}, got shape {_shape(t)}")
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device} but query is on {query.device}; they must match")
    if t.requires_grad:  # integer tensors cannot, but say so rather than assume
        raise ValueError(f"{name} must not require grad")


def _check_heads(hq: int, hkv: int, d: int, dk: int, dv: int, key: str, value: str) -> None:
    if dk != d:
        raise ValueError(f"query and {key} must have the same head dim D, got {d} and {dk}")
    if d == 0:
        raise ValueError("query and key head dim D must be >= 1, got 0")
    if dv == 0:
        raise ValueError(f"{value} head dim Dv must be >= 1, got 0")
    if (hq != 0) if hkv == 0 else (hq % hkv != 0):
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
            "(grouped-query attention)"
        )


def _meta(b: int, h: int, n: int, d: int) -> torch.Tensor:
    """A (b, h, n, d) tensor with no storage, for :func:`make_params` (which reads the
    head dim, Nq and Nk from dense-layout shapes)."""
    return torch.empty((b, h, n, d), device="meta")


def _options(nq: int, nk: int, d: int, options: dict[str, Any]) -> AttentionParams:
    """The options checked and resolved as :func:`attnhub.attention` does them, for
    sequences of at most ``nq`` queries and ``nk`` keys (the window's "covers every
    key" bound and the decoding simplification read those)."""
    return make_params(
        _meta(1, 1, nq, d),
        key=_meta(1, 1, nk, d),
        dropout_p=0.0,
        block_sparse=None,
        **options,
    )


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _request(
    query: torch.Tensor,
    params: AttentionParams,
    *,
    layout: str,
    page_size: int | None,
    batch: int,
    heads_q: int,
    heads_kv: int,
    max_q: int,
    max_k: int,
    same_seqlen: bool,
    q_longer: bool,
    head_dim: int,
    head_dim_v: int,
    needs_grad: bool,
    contiguous: bool,
) -> ServingRequest:
    return ServingRequest(
        device_type=query.device.type,
        capability=device_capability(query.device),
        dtype=query.dtype,
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        seqlen_q=seqlen_bucket(max_q),
        seqlen_k=seqlen_bucket(max_k),
        same_seqlen=same_seqlen,
        q_longer=q_longer,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        causal=params.causal,
        # As for dense calls: the alignment only matters where a diagonal does and
        # some sequence's lengths differ.
        alignment=params.alignment
        if (params.causal or params.window is not None) and not same_seqlen
        else "top_left",
        window=params.window is not None,
        softcap=params.softcap is not None,
        softcap_log2=softcap_log2(params.softcap),
        needs_grad=needs_grad,
        deterministic=needs_grad and torch.are_deterministic_algorithms_enabled(),
        last_dim_contiguous=contiguous,
        return_lse=params.return_lse,
        scale_positive=params.scale > 2.0**-150,
        scale_in_log2_range=abs(params.scale) <= LOG2_SCALE_LIMIT,
        layout=layout,
        page_size=page_size,
    )


def _last_dim_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.stride(-1) == 1 or t.shape[-1] <= 1 for t in tensors)


def _max_seqlen(name: str, given: Any, actual: int) -> int:
    """``max_seqlen_*``: None (computed) or an int at least the longest sequence."""
    if given is None:
        return actual
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name} must be None or an int, got {_type_name(given)}")
    if given < actual:
        raise ValueError(
            f"{name}={given} is shorter than the longest sequence ({actual}); it must be "
            "at least every sequence's length (or None, computed from the cu_seqlens)"
        )
    return given


# -- varlen ------------------------------------------------------------------------------


def check_varlen(
    query: Any,
    key: Any,
    value: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    options: dict[str, Any],
    check_indices: Any = True,
) -> VarlenCall:
    """Validate an :func:`attnhub.attention_varlen` call and summarize it.

    ``options``: causal, alignment, window, softcap, scale, return_lse (checked as
    :func:`attnhub.attention` checks them). Reads ``cu_seqlens_q`` and
    ``cu_seqlens_k`` on the host (one transfer), unless ``check_indices`` is False
    (then ``max_seqlen_q`` and ``max_seqlen_k`` must be given, and the values are the
    caller's responsibility; see :func:`_unchecked_varlen`).
    """
    refuse_jit_trace("attnhub.attention_varlen")
    _check_flag(check_indices)
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_float_tensor(name, t, 3, "(total_tokens, heads, head_dim)")
    _check_same("key", key, query)
    _check_same("value", value, query)
    tq, hq, d = query.shape
    tk, hkv, dk = key.shape
    tv, hv, dv = value.shape
    if hv != hkv:
        raise ValueError(f"key and value must have the same number of heads, got {hkv} and {hv}")
    if tv != tk:
        raise ValueError(f"key and value must have the same number of tokens, got {tk} and {tv}")
    _check_heads(hq, hkv, d, dk, dv, "key", "value")
    what = "(B + 1,) cumulative sequence lengths"
    _check_index_tensor("cu_seqlens_q", cu_seqlens_q, query, 1, what, _INDEX_DTYPES)
    _check_index_tensor("cu_seqlens_k", cu_seqlens_k, query, 1, what, _INDEX_DTYPES)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length B + 1 (one batch of "
            f"sequences), got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if cu_seqlens_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q must have B + 1 >= 1 entries (starting at 0), got 0")
    if not check_indices:
        return _unchecked_varlen(
            query, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
            hq=hq, hkv=hkv, d=d, dv=dv, tq=tq, tk=tk, needs_grad=_needs_grad(query, key, value),
            contiguous=_last_dim_contiguous(query, key, value),
        )  # fmt: skip
    # One transfer: both tensors' values (int64 on the host).
    values = torch.cat([cu_seqlens_q.to(torch.int64), cu_seqlens_k.to(torch.int64)]).tolist()
    n = cu_seqlens_q.shape[0]
    lengths_q = _lengths("cu_seqlens_q", values[:n], tq, "query")
    lengths_k = _lengths("cu_seqlens_k", values[n:], tk, "key")
    max_q = max(lengths_q, default=0)
    max_k = max(lengths_k, default=0)
    given_q = _max_seqlen("max_seqlen_q", max_seqlen_q, max_q)
    given_k = _max_seqlen("max_seqlen_k", max_seqlen_k, max_k)
    params = _options(max_q, max_k, d, options)
    request = _request(
        query,
        params,
        layout="varlen",
        page_size=None,
        batch=n - 1,
        heads_q=hq,
        heads_kv=hkv,
        max_q=max_q,
        max_k=max_k,
        same_seqlen=lengths_q == lengths_k,
        q_longer=any(a > b for a, b in zip(lengths_q, lengths_k)),
        head_dim=d,
        head_dim_v=dv,
        needs_grad=_needs_grad(query, key, value),
        contiguous=_last_dim_contiguous(query, key, value),
    )
    return VarlenCall(request, params, lengths_q, lengths_k, given_q, given_k)


def _check_flag(check_indices: Any) -> None:
    if not isinstance(check_indices, bool):
        raise TypeError(f"check_indices must be a bool, got {_type_name(check_indices)}")


def _unchecked_varlen(
    query: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    options: dict[str, Any],
    **shape: Any,
) -> VarlenCall:
    """A varlen call with ``check_indices=False``: nothing is read from the device (no
    synchronization; CUDA-graph capturable). The request cannot know the lengths:
    its buckets are those of the given maxima, ``same_seqlen`` holds only where
    ``cu_seqlens_q is cu_seqlens_k``, and ``q_longer`` is assumed otherwise."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is None:
            raise ValueError(
                f"check_indices=False needs {name} (the cu_seqlens are not read), got None"
            )
        int_at_least(name, value, 0)
    # No sequence is longer than the packed tokens: with none on a side (Tq or Tk of 0),
    # the request is empty, as the checked path finds, and the reference answers.
    max_q, max_k = min(max_seqlen_q, shape["tq"]), min(max_seqlen_k, shape["tk"])
    params = _options(max_q, max_k, shape["d"], options)
    same = cu_seqlens_q is cu_seqlens_k
    request = _request(
        query, params, layout="varlen", page_size=None, batch=cu_seqlens_q.shape[0] - 1,
        heads_q=shape["hq"], heads_kv=shape["hkv"], max_q=max_q, max_k=max_k,
        same_seqlen=same, q_longer=not same, head_dim=shape["d"], head_dim_v=shape["dv"],
        needs_grad=shape["needs_grad"], contiguous=shape["contiguous"],
    )  # fmt: skip
    return VarlenCall(request, params, (), (), max_q, max_k)


def _lengths(name: str, cu: list[int], total: int, tensor: str) -> tuple[int, ...]:
    """The sequence lengths of a validated cumulative list."""
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {cu[0]}")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, got {name}[{i - 1}] = {cu[i - 1]} > "
                f"{name}[{i}] = {cu[i]}"
            )
    if cu[-1] != total:
        raise ValueError(
            f"{name}[-1] = {cu[-1]} must equal the {tensor}'s total tokens "
            f"({tensor}.shape[0] = {total})"
        )
    return tuple(cu[i + 1] - cu[i] for i in range(len(cu) - 1))


# -- KV cache ----------------------------------------------------------------------------


def check_kvcache(
    query: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    block_table: Any,
    k_new: Any,
    v_new: Any,
    options: dict[str, Any],
    check_indices: Any = True,
) -> KVCacheCall:
    """Validate an :func:`attnhub.attention_kvcache` call and summarize it.

    ``options``: causal, alignment, window, softcap, scale, return_lse. Reads
    ``cache_seqlens`` and whether the pages of ``block_table`` in use are in range on
    the host (one transfer), unless ``check_indices`` is False: then nothing is read
    (the values are the caller's responsibility), the request's ``same_seqlen`` is
    False and ``q_longer`` is assumed where Nq > 1.
    """
    refuse_jit_trace("attnhub.attention_kvcache")
    _check_flag(check_indices)
    _check_float_tensor("query", query, 4, "(B, Hq, Nq, D)")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, Hkv, D)" if paged else "(B, Hkv, Nmax, D)"
    _check_float_tensor("k_cache", k_cache, 4, cache_layout)
    _check_float_tensor("v_cache", v_cache, 4, cache_layout)
    _check_same("k_cache", k_cache, query)
    _check_same("v_cache", v_cache, query)
    b, hq, nq, d = query.shape
    if paged:
        pages, page_size, hkv, dk = k_cache.shape
        if v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(
                "k_cache and v_cache must have the same (num_pages, page_size, Hkv), got "
                f"{_shape(k_cache)} and {_shape(v_cache)}"
            )
        if page_size == 0:
            raise ValueError(f"k_cache page_size must be >= 1, got k_cache {_shape(k_cache)}")
    else:
        bk, hkv, capacity, dk = k_cache.shape
        if v_cache.shape[:3] != k_cache.shape[:3]:
            raise ValueError(
                "k_cache and v_cache must have the same (B, Hkv, Nmax), got "
                f"{_shape(k_cache)} and {_shape(v_cache)}"
            )
        if bk != b:
            raise ValueError(
                f"batch sizes differ: query {_shape(query)}, k_cache {_shape(k_cache)}"
            )
    dv = v_cache.shape[3]
    _check_heads(hq, hkv, d, dk, dv, "k_cache", "v_cache")
    _check_index_tensor(
        "cache_seqlens", cache_seqlens, query, 1, "(B,) keys per sequence", _INDEX_DTYPES
    )
    if cache_seqlens.shape[0] != b:
        raise ValueError(
            f"cache_seqlens must have shape (B,) = ({b},), got {_shape(cache_seqlens)}"
        )
    if paged:
        _check_index_tensor(
            "block_table", block_table, query, 2, "(B, pages_per_seq) page numbers",
            (torch.int32,),
        )  # fmt: skip
        if block_table.shape[0] != b:
            raise ValueError(
                f"block_table must have shape (B, pages_per_seq) with B = {b}, got "
                f"{_shape(block_table)}"
            )
        capacity = block_table.shape[1] * page_size
    new = _check_new(query, k_cache, v_cache, k_new, v_new, b, hkv, d, dv)
    if not check_indices:
        params = _options(nq, capacity, d, options)
        request = _request(
            query, params, layout="paged" if paged else "kvcache",
            page_size=page_size if paged else None, batch=b, heads_q=hq, heads_kv=hkv,
            max_q=nq, max_k=capacity, same_seqlen=False, q_longer=nq > 1, head_dim=d,
            head_dim_v=dv, needs_grad=_needs_grad(query, k_cache, v_cache, k_new, v_new),
            contiguous=_last_dim_contiguous(query, k_cache, v_cache),
        )  # fmt: skip
        return KVCacheCall(request, params, (), new, capacity)
    cache_seqlens_list, pages_out_of_range = _kvcache_values(
        cache_seqlens, block_table, new, page_size if paged else 0, pages if paged else 0
    )
    for i, s in enumerate(cache_seqlens_list):
        if s < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got cache_seqlens[{i}] = {s}")
        if s + new > capacity:
            where = (
                f"pages_per_seq * page_size = {block_table.shape[1]} * {page_size}"
                if paged
                else f"k_cache's Nmax = {capacity}"
            )
            appended = f" + {new} new keys" if new else ""
            raise ValueError(
                f"cache_seqlens[{i}] = {s}{appended} is beyond the cache: sequence {i} "
                f"may hold at most {where} keys"
            )
    if pages_out_of_range:
        row, col, page = pages_out_of_range
        raise ValueError(
            f"block_table[{row}, {col}] = {page} is not a page of k_cache (0 <= page < "
            f"num_pages = {pages}); sequence {row} uses that entry"
        )
    lengths_k = [s + new for s in cache_seqlens_list]
    params = _options(nq, capacity, d, options)
    request = _request(
        query,
        params,
        layout="paged" if paged else "kvcache",
        page_size=page_size if paged else None,
        batch=b,
        heads_q=hq,
        heads_kv=hkv,
        max_q=nq,
        max_k=capacity,
        same_seqlen=all(n == nq for n in lengths_k),
        q_longer=any(n < nq for n in lengths_k),
        head_dim=d,
        head_dim_v=dv,
        needs_grad=_needs_grad(query, k_cache, v_cache, k_new, v_new),
        contiguous=_last_dim_contiguous(query, k_cache, v_cache),
    )
    return KVCacheCall(request, params, tuple(cache_seqlens_list), new, capacity)


def _check_new(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: Any,
    v_new: Any,
    b: int,
    hkv: int,
    d: int,
    dv: int,
) -> int:
    """``k_new`` and ``v_new``: both or neither, (B, Hkv, Nnew, D) and (B, Hkv, Nnew, Dv);
    the number of new keys (0 for neither)."""
    if (k_new is None) != (v_new is None):
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} was given without {missing}: append both or neither")
    if k_new is None:
        return 0
    _check_float_tensor("k_new", k_new, 4, "(B, Hkv, Nnew, D)")
    _check_float_tensor("v_new", v_new, 4, "(B, Hkv, Nnew, Dv)")
    _check_same("k_new", k_new, query)
    _check_same("v_new", v_new, query)
    for name, t, last in (("k_new", k_new, d), ("v_new", v_new, dv)):
        if t.shape[0] != b or t.shape[1] != hkv or t.shape[3] != last:
            dim = "D" if name == "k_new" else "Dv"
            raise ValueError(
                f"{name} must have shape (B, Hkv, Nnew, {dim}) = ({b}, {hkv}, Nnew, {last}), "
                f"got {_shape(t)}"
            )
    if v_new.shape[2] != k_new.shape[2]:
        raise ValueError(
            f"k_new and v_new must have the same Nnew, got {k_new.shape[2]} and {v_new.shape[2]}"
        )
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if torch.is_grad_enabled() and cache.requires_grad and cache.is_leaf:
            raise ValueError(
                f"{name} is a leaf tensor that requires grad: the new keys and values are "
                "written into it in place, which autograd forbids (detach it, or call "
                "under torch.no_grad())"
            )
    return int(k_new.shape[2])


def _kvcache_values(
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    new: int,
    page_size: int,
    num_pages: int,
) -> tuple[list[int], tuple[int, int, int] | None]:
    """``cache_seqlens`` as ints and the first block-table entry in use that is not a
    page of the cache ((row, column, value), or None), in one transfer.

    An entry is in use where its pages hold keys of the call: columns below
    ``ceil((cache_seqlens[b] + Nnew) / page_size)``. Entries past those may be anything
    (a padding value such as -1), as in flash-attn and PyTorch's ``varlen_attn``.
    """
    seqlens = cache_seqlens.to(torch.int64)
    if block_table is None or block_table.numel() == 0:
        return seqlens.tolist(), None
    used = (seqlens.clamp(min=0) + new + page_size - 1) // page_size  # pages per row
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    in_use = columns.unsqueeze(0) < used.unsqueeze(1)
    bad = in_use & ((block_table < 0) | (block_table >= num_pages))
    # The first bad entry in row-major order: its flat index, or numel for none.
    flat = torch.arange(bad.numel(), device=bad.device).view(bad.shape)
    first = torch.where(bad, flat, torch.full_like(flat, bad.numel())).amin()
    entry = block_table.reshape(-1)[first.clamp(max=bad.numel() - 1)].to(torch.int64)
    host = torch.cat([seqlens, first.view(1), entry.view(1)]).tolist()
    n = seqlens.shape[0]
    index = host[n]
    if index == bad.numel():
        return host[:n], None
    row, col = divmod(index, block_table.shape[1])
    return host[:n], (row, col, host[n + 1])
