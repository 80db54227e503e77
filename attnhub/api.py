"""The public calls: :func:`attention`, :func:`explain`, :func:`list_backends`.

The per-call cost matters (attention is called once per layer per step), so a call is
keyed on cheap metadata (shapes, whether each last dimension is contiguous, dtypes,
devices, options and their types, grad state, the backend selection in force) and a
key seen before skips validation and ranking and goes straight to the runner its
backend prepared last time. In front of that dict sits a one-entry memo, the entry
the last call used: a model calls attention with one signature many times in a row,
and PyTorch's C++ tensor guards check all the tensors' metadata in one call for a
third of what reading it from Python costs (see :class:`_Guards`).
benchmarks/overhead.py measures it.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch

from . import autotune, call_stats, dispatch
from .backend import Runner
from .eager import plain_eager
from .errors import BrokenBackendError
from .registry import get_registry, on_invalidate
from .request import OPTION_NAMES, AttentionParams, AttentionRequest, seqlen_bucket
from .tensor_guards import Guards as _Guards
from .validation import (
    RequestFacts,
    build_request,
    check_block_sparse,
    check_tensors,
    complete_request,
    make_params,
    mask_as_4d,
    refuse_jit_trace,
    request_facts,
)

_CallKey = tuple[Any, ...]
# A decided call: (backend name, runner, guards, memo context, deterministic flag,
# counter). Guards, context and flag serve the one-entry memo in front of the dict (see
# _Guards); the counter counts a call for attnhub.stats() (call_stats.counter).
_Entry = tuple[str, Runner, Any, Any, Any, Callable[[], int]]
_call_cache: dict[_CallKey, _Entry] = {}
_call_cache_lock = threading.Lock()
# Bound once: the hot path looks these up on every call.
_call_cache_get = _call_cache.get
_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled
_is_compiling = torch.compiler.is_compiling
_context_get = dispatch.context_selection.get
_env_get = dispatch.environment_get
_ENV_BACKEND, _ENV_STRICT = dispatch.ENVIRONMENT_KEYS
_CALL_CACHE_LIMIT = 4096
# The decided entries again, keyed by _length_free(call key): a call that differs from
# a decided one only in its key length, within that length's bucket (a decoding loop's
# next step: one key more each step), has the same request, so the same decision and
# runner (requests hold lengths as buckets, and runners serve every call of their
# request: torch.compile's graphs reuse them so). It skips validation and the decision
# (on the development CPU, 127 us a call with a new key length, 54 us repeated; the
# first layer of every patched decoding step paid it), and gets guards of its own:
# _LengthFreeGuards, which leave the key length to its bucket, so that the memos in
# front of this dict serve the next step's first call without a key.
_length_free_cache: dict[_CallKey, _Entry] = {}
# Decisions of calls outside plain eager mode, which were not measured (_slow_path).
_outside_eager_cache: dict[_CallKey, _Entry] = {}


class _NoGuards:
    """Stands in for the guards of an entry that has none: never matches."""

    @staticmethod
    def check(*tensors: Any) -> bool:
        return False


_NO_GUARDS = _NoGuards()
_NO_CONTEXT = object()  # equal to no memo context: an entry without it is never memoized


def _no_runner(query: Any, key: Any, value: Any, attn_mask: Any) -> torch.Tensor:
    raise AssertionError("the empty entry never matches")


_NO_ENTRY: _Entry = ("", _no_runner, _NO_GUARDS, _NO_CONTEXT, None, int)
# The entry the last call used; its guards are checked before the dict is consulted.
_last: _Entry = _NO_ENTRY


@on_invalidate  # any registry, policy or cost-table change: decided calls are stale
def clear_call_cache() -> None:
    global _last
    with _call_cache_lock:
        _call_cache.clear()
        _length_free_cache.clear()
        _outside_eager_cache.clear()
        _last = _NO_ENTRY


def _validate(
    query: Any, key: Any, value: Any, attn_mask: Any, options: dict[str, Any]
) -> AttentionParams:
    """Check a call (raising what contract.md says) and resolve its options."""
    check_tensors(query, key, value, attn_mask)
    params = make_params(query, key=key, **options)
    check_block_sparse(params, query, key)
    return params


def _decide(request: AttentionRequest, backend: Any) -> dispatch.Decision:
    """The decision for a request under the selection in force (and ``backend=``)."""
    selection = dispatch.current_selection(backend)
    if request.empty:
        selection = dispatch.empty_input_selection(request.describe())
    return dispatch.decide(request, selection)


def _prepare(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    options: dict[str, Any],
    backend: Any,
) -> tuple[dispatch.Decision, AttentionParams]:
    """Validate a call and decide it (the slow path)."""
    params = _validate(query, key, value, attn_mask, options)
    return _decide(build_request(query, key, value, attn_mask, params), backend), params


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
            broadcastable to (B, Hq, Nq, Nk): of any rank from 0 to 4 (backends are
            handed it as a 4-D view).
        causal: keep keys at or before each query's diagonal position.
        alignment: "top_left" (query row i sits at key position i, as
            ``F.scaled_dot_product_attention(is_causal=True)``) or "bottom_right"
            (at i + Nk - Nq, as FlashAttention and KV-cache decoding).
        window: (left, right): keep keys from position - left to position + right;
            None on a side means unbounded (and so does a side of 2**30 or more that
            covers every key, side >= Nq + Nk).
        softcap: c > 0: scores become c * tanh(scores / c) before masking; c must be
            within float32's normal range (1.2e-38 to 3.4e38), in which it is applied.
        scale: score scale; None means 1 / sqrt(D). ``|scale| <= 3.4e38`` (float32's
            largest; scores are accumulated in float32, and scores that overflow it,
            ``|scale * q.k| > 3.4e38``, give inf or NaN as in any float32 kernel).
        dropout_p: probability of dropping an attention weight (kept weights are
            scaled by 1 / (1 - p)); seeded from PyTorch's generator.
        block_sparse: an :class:`attnhub.BlockSparseLayout`.
        return_lse: also return the float32 (B, Hq, Nq) natural log-sum-exp.
        backend: None, a backend name, or names to choose among (in that order).

    Returns:
        The output (B, Hq, Nq, Dv) in the query's dtype, or ``(output, lse)``.
        A query row with every key masked gives zeros and an lse of -inf.

    Raises:
        TypeError, ValueError: bad input, naming the argument (a head dim D or Dv of 0
            among it; empty B, H, Nq or Nk are served).
        NoBackendError: no backend (or none of those asked for) can serve the call.
    """
    if _is_compiling():
        return _attention_traced(
            query, key, value, attn_mask, causal, alignment, window, softcap, scale,
            dropout_p, block_sparse, return_lse, backend,
        )  # fmt: skip
    # The fast path: the per-call cost (benchmarks/overhead.py). Everything that
    # validation and dispatch read is compared with what a decided call had, and
    # nothing more: first with the entry the last call used (its tensors' metadata
    # checked by _Guards in one C call), then through the dict, keyed on it. Any
    # exception on the way (unhashable options, a non-tensor, an array that will not
    # compare) means no key: the slow path validates and raises what it should.
    try:
        if (
            (causal is False or causal is True)
            and alignment is _TOP_LEFT
            and window is None
            and softcap is None
            # 0.0 by value, as callers pass it (F.sdpa's own default, Hugging Face's
            # dropout=0.0 at inference): another module's 0.0 is another object.
            and (dropout_p is _NO_DROPOUT or (dropout_p.__class__ is float and dropout_p == 0.0))
            and block_sparse is None
            and return_lse is False
            # Hugging Face passes scale=head_dim**-0.5 on every call: a float (exactly
            # that type, so that 1 or True, which validation rejects, never match it).
            and (scale is None or scale.__class__ is float)
        ):
            # The defaults but for causal (a bool) and scale: a bool, or a pair.
            options: Any = causal if scale is None else (causal, scale)
        else:
            options = _options_key(
                causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse
            )
        grad_mode = _grad_enabled()
        context: Any = (
            options, backend, attn_mask is None, grad_mode,
            _context_get(), _env_get(_ENV_BACKEND), _env_get(_ENV_STRICT),
        )  # fmt: skip
        entry: Any = _last  # None after a dict miss
        if not (
            entry[3] == context
            # Never a nested tensor into the C check: it would abort the process
            # (tensor_guards.Guards); the slow path refuses it with a TypeError.
            and not (query.is_nested or key.is_nested or value.is_nested)
            and (
                entry[2].check(query, key, value)
                if attn_mask is None
                else not attn_mask.is_nested and entry[2].check(query, key, value, attn_mask)
            )
            and (entry[4] is None or entry[4] is _deterministic())
        ):
            call_key, entry = _cached(query, key, value, attn_mask, context, grad_mode)
    except Exception:
        call_key, context, entry = (), _NO_CONTEXT, None
    if entry is None:
        entry = _slow_path(
            call_key, context, query, key, value, attn_mask,
            (causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse),
            backend,
        )  # fmt: skip
    entry[5]()  # attnhub.stats()
    try:
        return entry[1](query, key, value, attn_mask)
    except BrokenBackendError as exc:
        if not exc.inputs_intact:
            raise
        # A third-party backend broke the contract and is disabled now (every decided
        # call with it forgotten): the call is decided and served again without it.
        return attention(
            query, key, value, attn_mask, causal=causal, alignment=alignment, window=window,
            softcap=softcap, scale=scale, dropout_p=dropout_p, block_sparse=block_sparse,
            return_lse=return_lse, backend=backend,
        )  # fmt: skip


def _cached(
    query: Any, key: Any, value: Any, attn_mask: Any, context: Any, grad_mode: bool
) -> tuple[_CallKey, _Entry | None]:
    """A call's key, and its entry where one was decided (it becomes the memo's)."""
    global _last
    grad = grad_mode and (
        query.requires_grad
        or key.requires_grad
        or value.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad)
    )
    # Of the strides, the request reads only stride(-1) == 1 or shape[-1] <= 1;
    # with the shape, "contiguous or stride(-1) == 1" determines that for a
    # non-empty tensor (calls with an empty one are not cached), and
    # is_contiguous() costs half of stride().
    call_key: _CallKey = (
        query.shape, key.shape, value.shape,
        query.dtype, key.dtype, value.dtype,
        query.device, key.device, value.device,
        query.is_contiguous() or query.stride(-1) == 1,
        key.is_contiguous() or key.stride(-1) == 1,
        value.is_contiguous() or value.stride(-1) == 1,
        None if attn_mask is None
        else (attn_mask.shape, attn_mask.dtype, attn_mask.device, attn_mask.requires_grad),
        context, grad, grad and _deterministic(),
    )  # fmt: skip
    entry = _call_cache_get(call_key)
    if entry is not None:
        _last = entry
    return call_key, entry


# The default objects themselves: the fast path compares options to them with ``is``.
_DEFAULTS: dict[str, Any] = attention.__kwdefaults__ or {}
_NO_DROPOUT = _DEFAULTS["dropout_p"]
_TOP_LEFT = _DEFAULTS["alignment"]


def sdpa_entry(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    dropout_p: Any,
    backend: Any,
    alignment: Any = _TOP_LEFT,
    window: Any = None,
) -> _Entry:
    """The decided entry of ``attention(query, key, value, attn_mask, causal=is_causal,
    alignment=alignment, window=window, scale=scale, dropout_p=dropout_p,
    backend=backend)``, not run (not while tracing).

    :func:`attnhub.patch`'s call: its replacement keeps the entry to reuse for calls
    that match it (``entry[2].check``, ``entry[4]``; see :class:`_Guards`), so this
    runs only where that fails, and goes to the dict directly. An entry that must not
    be reused has guards that never match.
    """
    options = (is_causal, alignment, window, None, scale, dropout_p, None, False)
    try:
        grad_mode = _grad_enabled()
        context: Any = (
            _options_key(*options), backend, attn_mask is None, grad_mode,
            _context_get(), _env_get(_ENV_BACKEND), _env_get(_ENV_STRICT),
        )  # fmt: skip
        call_key, entry = _cached(query, key, value, attn_mask, context, grad_mode)
    except Exception:  # as in attention(): the slow path raises what it should
        call_key, context, entry = (), _NO_CONTEXT, None
    if entry is None:
        entry = _slow_path(call_key, context, query, key, value, attn_mask, options, backend)
    return entry


def _options_key(
    causal: Any,
    alignment: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    dropout_p: Any,
    block_sparse: Any,
    return_lse: Any,
) -> tuple[Any, ...]:
    """The options' part of the call key, where they are not all the defaults.

    Values alone would not do: ``True == 1 == 1.0`` and ``False == 0 == 0.0`` (with
    equal hashes), so ``causal=1`` or ``dropout_p=False``, which validation rejects,
    would find the entry of ``causal=True`` or ``dropout_p=0.0``. The types of the
    values that validation checks the type of go into the key with them. (A
    non-iterable ``window`` raises TypeError here: the slow path reports it.)
    """
    return (
        causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse,
        type(causal), type(softcap), type(scale), type(dropout_p), type(block_sparse),
        type(return_lse),
        None if window is None else (type(window), tuple(map(type, window))),
    )  # fmt: skip


def _slow_path(
    call_key: _CallKey,
    context: Any,
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    options: tuple[Any, ...],
    backend: Any,
) -> _Entry:
    """Validate, decide and prepare a call (or take the decision of a call that differs
    only in its key length: _length_free_cache); remember the result under its key."""
    global _last
    refuse_jit_trace("attnhub.attention")  # before the key's sizes are read as ints
    # A call outside plain eager mode (FakeTensorMode, a dispatch mode as selective
    # activation checkpointing or a profiler installs, vmap) is not measured
    # (autotune.wanted): its decision is kept apart, for such calls only, so that the
    # signature's next eager call measures. (The memos' C guards never match across
    # that line: a mode's dispatch keys are part of what they compare.)
    eager = plain_eager(query, key, value, attn_mask)
    if not eager and call_key:
        kept = _outside_eager_cache.get(call_key)
        if kept is not None:
            return kept
    length_free = _length_free(call_key)
    decided = _length_free_cache.get(length_free) if length_free is not None else None
    if decided is not None:
        name, runner, deterministic, count = decided[0], decided[1], decided[4], decided[5]
    else:
        decision, params = _prepare(query, key, value, attn_mask, _options_dict(options), backend)
        if autotune.wanted(decision, params, query.device, eager):
            # A signature this machine has not measured: time the eligible backends on
            # this call, then decide again (the measurement now ranks).
            mask = (
                attn_mask
                if attn_mask is None
                else attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
            )
            autotune.measure(decision, params, query, key, value, mask)
            decision = _decide(decision.request, backend)
        chosen, runner = dispatch.prepare(decision, params)  # a failing prepare is contained
        if attn_mask is not None and attn_mask.dim() < 4:
            runner = _with_4d_mask(runner, attn_mask.shape)
        name = chosen.name
        deterministic = _deterministic() if decision.request.needs_grad else None
        count = call_stats.counter(name)
    # An empty tensor's key does not pin its layout (is_contiguous() is True whatever
    # the strides), and empty calls are rare: they are decided every time.
    if not (call_key and query.numel() and key.numel() and value.numel()):
        return (name, runner, _NO_GUARDS, _NO_CONTEXT, None, count)
    if not eager:
        unguarded: _Entry = (name, runner, _NO_GUARDS, _NO_CONTEXT, None, count)
        with _call_cache_lock:
            if len(_outside_eager_cache) >= _CALL_CACHE_LIMIT:
                _outside_eager_cache.clear()
            _outside_eager_cache[call_key] = unguarded
        return unguarded
    tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    # Only a cache's calls (Nq < Nk) change key length from one call of an entry to the
    # next in a loop (a decoding step's first layer); every other call keeps the C
    # check alone, which costs less than the length-free check's Python (dev CPU: the
    # repeated tiny call 4.6 us over F.sdpa against 5.0).
    guards = (
        _LengthFreeGuards.make(tensors)
        if length_free is not None and query.shape[2] < key.shape[2]
        else None
    )
    if guards is None:
        guards = _Guards.make(tensors)
    entry: _Entry = (
        name,
        runner,
        _NO_GUARDS if guards is None else guards,
        _NO_CONTEXT if guards is None else context,
        deterministic,
        count,
    )
    with _call_cache_lock:
        if len(_call_cache) >= _CALL_CACHE_LIMIT:
            _call_cache.clear()
            _length_free_cache.clear()
        _call_cache[call_key] = entry
        if length_free is not None:
            _length_free_cache[length_free] = entry
        _last = entry
    return entry


def _length_free(call_key: _CallKey) -> _CallKey | None:
    """``call_key`` (:func:`_cached`'s) with the key length Nk replaced by what a request
    reads of it: its bucket, Nq == Nk, Nq > Nk; the mask's key dim by whether it is 1.
    None where the request reads more (a window: a side at or beyond Nq + Nk is
    unbounded; the attention() keyword options' key holds it at index 2), where the
    runner holds the key length (a mask of rank < 4), or where validation would refuse
    the call (value or mask keys that are not Nk): those take the slow path."""
    if not call_key:
        return None
    query_shape, key_shape, value_shape = call_key[:3]
    mask = call_key[12]
    options = call_key[13][0]
    nq, nk = query_shape[2], key_shape[2]
    if value_shape[2] != nk or (options.__class__ is tuple and len(options) > 2 and options[2] is not None):  # fmt: skip
        return None
    if mask is not None:
        mask_shape = mask[0]
        # A mask of rank < 4 reaches the backend through _with_4d_mask, whose view has
        # the decided call's shape (its key dim among it) fixed in the runner.
        if len(mask_shape) < 4 or mask_shape[-1] not in (1, nk):
            return None
        mask = (mask_shape[:-1], mask_shape[-1] == 1, *mask[1:])
    return (
        query_shape, key_shape[:2] + key_shape[3:], value_shape[:2] + value_shape[3:],
        seqlen_bucket(nk), nq == nk, nq > nk, *call_key[3:12], mask, *call_key[13:],
    )  # fmt: skip


class _LengthFreeGuards:
    """The guards of an entry that serves its key length's bucket (a call with a
    _length_free key): the memos in front of the call cache (``_last``, the patch's)
    then serve a decoding step's first call, whose cache is one key longer, as they
    serve the step's other layers.

    Everything the call key holds is checked, as _Guards checks it, in one C call but
    for the key length and the strides that change with it, and here what the call key
    holds of those: the key length's bucket, Nq == Nk and Nq > Nk (compared only when
    the key length differs from the last call's), the value's and the mask's key dims
    (Nk, or 1 for a mask that broadcasts over the keys). Left out of the C call: dim 2
    of the key and the value and the strides of their other dims, and the mask's last
    dim and its strides (the call key holds no strides: "stride(-1) == 1 or
    contiguous", which a tensor whose stride(-1) stays 1 keeps).
    """

    __slots__ = ("bucket", "check_exact", "mask_full", "nk", "nq")
    bucket: int
    check_exact: Any  # the C check's bound method (it keeps the guards alive)
    mask_full: bool
    nk: int
    nq: int

    # Of (query, key, value, mask): the size and stride dims the C check leaves out.
    _FREE = (None, ((2,), (0, 1, 2)), ((2,), (0, 1, 2)), ((3,), (0, 1, 2, 3)))

    @classmethod
    def make(cls, tensors: tuple[torch.Tensor, ...]) -> _LengthFreeGuards | None:
        """Guards for ``tensors`` (query, key, value[, a 4-D mask]) of a call with a
        length-free key, where their key and value have stride(-1) == 1; else None."""
        query, key, value = tensors[:3]
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            return None
        guards = _Guards.make(tensors, cls._FREE[: len(tensors)])
        if guards is None:
            return None
        self = cls.__new__(cls)
        self.check_exact = guards.check
        self.nq, self.nk = query.shape[2], key.shape[2]
        self.bucket = seqlen_bucket(self.nk)
        # The mask's key dim: Nk (full), or 1 (it broadcasts over the keys). A flag, not
        # a count: nk, the one field a check writes, is written only after its own
        # comparisons, so threads sharing the entry never pass a mask that another
        # thread's key length made look right.
        self.mask_full = len(tensors) == 4 and tensors[3].shape[3] != 1
        return self

    def check(self, query: Any, key: Any, value: Any, mask: Any = None) -> bool:
        if not (
            self.check_exact(query, key, value)
            if mask is None
            else self.check_exact(query, key, value, mask)
        ):
            return False
        nk = key.shape[2]
        if nk != self.nk and not self._takes(nk):
            return False
        return value.shape[2] == nk and (
            mask is None or mask.shape[3] == (nk if self.mask_full else 1)
        )

    def _takes(self, nk: int) -> bool:
        """Whether key length ``nk`` has the call key of the last one (then it becomes
        the last one: its calls compare nothing more)."""
        nq, last = self.nq, self.nk
        if not (
            nk > 0
            and seqlen_bucket(nk) == self.bucket
            and (nq == nk) is (nq == last)
            and (nq > nk) is (nq > last)
        ):
            return False
        self.nk = nk
        return True


def _with_4d_mask(runner: Runner, mask_shape: Sequence[int]) -> Runner:
    """``runner`` handed the mask as 4-D (a free view), for masks of rank 0 to 3.

    Every backend is handed a 4-D mask: PyTorch's kernels reject 0-d and 1-D ones. The
    view's shape is fixed here, once: an entry is used only for masks of this shape
    (the call key holds it, and _Guards checks it). 4-D masks pay nothing.
    """
    shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)

    def run(query: Any, key: Any, value: Any, attn_mask: Any) -> Any:
        return runner(query, key, value, attn_mask.view(shape))

    return run


def _options_dict(options: tuple[Any, ...]) -> dict[str, Any]:
    """The options tuple (in ``OPTION_NAMES``' order) as keyword arguments."""
    return dict(zip(OPTION_NAMES, options, strict=True))


def _traced_choice(facts: RequestFacts, backend: Any) -> str:
    """Decide from a request's facts alone; Dynamo runs this once, at trace time.

    Its arguments are Python constants (:func:`attnhub.validation.request_facts` made
    them so, installing the guards that keep them true), and its result, a backend
    name, is baked into the graph: the ``use_backend`` context and ``ATTNHUB_BACKEND``
    in force while tracing decide, as the docs say.
    """
    return dispatch.choose(_decide(complete_request(facts), backend)).name


# What torch.compiler.assume_constant_result(_traced_choice) does (it only sets this
# attribute, torch/_dynamo/decorators.py), without importing torch._dynamo and Triton
# at `import attnhub`, which takes seconds. test_dispatch's compile test checks it.
_traced_choice._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _constant_option(value: Any) -> Any:
    """An option as a Python constant, while tracing.

    With ``dynamic=True`` Dynamo hands number options over (those left at their
    defaults among them) as SymFloat and SymInt, which traced code sees as float and
    int; decisions and kernels need their values. They are specialized, as automatic
    dynamic shapes would leave them: ``SymFloat.hex()`` and ``SymInt.__index__``
    guard on the value (torch's ``guard_float``/``guard_int``, which Dynamo will not
    call directly). A plain number comes back equal; a window's sides are each done.
    """
    if isinstance(value, float):
        return float.fromhex(value.hex())
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)
    if isinstance(value, (tuple, list)):
        sides = [_constant_option(v) for v in value]
        return sides if isinstance(value, list) else tuple(sides)
    return value


def _attention_traced(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *options: Any,
) -> Any:
    """The same call while ``torch.compile`` or ``torch.export`` traces it.

    Dynamo cannot trace the decision machinery (context variables, caches, logging),
    so validation and the request's facts are traced here, on possibly symbolic
    sizes, and the choice is made by :func:`_traced_choice` from those facts; the
    chosen backend's ``forward`` is traced into the graph. The graph's guards are
    those the facts installed (the length buckets, Nq == Nk, Nq > Nk, head counts and
    dims; none on the batch), so it is reused only for calls whose request, and so
    whose choice, is the same.

    Head counts and head dims are specialized. With ``dynamic=True``, Dynamo gives
    sizes equal in the first call one symbol (duck sizing), so a batch or length that
    equals a head count or head dim there is specialized with it: the next call with
    another value recompiles once, with its own symbol.
    """
    *option_values, backend = options
    option_values = [_constant_option(v) for v in option_values]
    params = _validate(query, key, value, attn_mask, _options_dict(tuple(option_values)))
    name = _traced_choice(request_facts(query, key, value, attn_mask, params), backend)
    mask = None if attn_mask is None else mask_as_4d(attn_mask)
    return get_registry().get(name).forward(query, key, value, mask, params)


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

    Nothing of the chosen backend runs, its ``prepare`` included: a backend whose
    ``prepare`` (or, for a third-party backend, whose result) fails at the call is
    passed over then and disabled, and explain() says so from then on.

    ``str(decision)`` is a table of every registered backend (eligible or not, with
    its reasons) and the chosen one with why it ranked first. Bad input raises as
    :func:`attention` would; a call nothing can serve returns a decision whose
    ``chosen`` is None.
    """
    refuse_jit_trace("attnhub.explain")
    options = (causal, alignment, window, softcap, scale, dropout_p, block_sparse, return_lse)
    decision, _ = _prepare(query, key, value, attn_mask, _options_dict(options), backend)
    return decision


def list_backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return get_registry().names()
