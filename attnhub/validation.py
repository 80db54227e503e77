"""Input checks for :func:`attnhub.attention`.

Every message names the argument, what was expected and what came, so that bad input
fails here with a ``ValueError`` or ``TypeError`` and never reaches a kernel. The
checks read only metadata (shapes, dtypes, devices, option values), which is why the
dispatch cache may skip them for a call whose metadata it has seen before.

Symbolic sizes. Under ``torch.compile`` with dynamic shapes and under ``torch.export``
the sizes are SymInts, and every check here works on them too, through
helpers that say how a condition on sizes becomes a Python bool:

- :func:`_checked` (a condition the call must satisfy): decided where the sizes have
  hints, with a guard (the compiled graph is reused only where it holds again); where
  they are data-dependent (unbacked, in ``torch.export``), assumed and asserted when
  the graph runs (``torch._check``), as PyTorch's own shape checks do.
- :func:`_known` (true only where known): a data-dependent size is taken to differ,
  as PyTorch's broadcasting takes an unbacked size not to be 1.
- :func:`_fact` (what dispatch decides on): decided with a guard; a data-dependent
  one is a ``ValueError``, since no decision could hold for every value.
- :func:`_exact`: a size specialized to an int (a guard on its value).

Dynamo shows traced code a ``SymInt`` as an ``int`` (and a ``SymBool`` as a ``bool``,
a ``SymFloat`` as a ``float``: ``isinstance`` cannot tell them apart), so under Dynamo
every condition goes through ``torch.fx.experimental.symbolic_shapes``' helpers
(``guard_or_false``, ...), and sizes through ``operator.index()``, which Dynamo
decides with a guard. Outside Dynamo (eager calls; ``torch.export``'s default
non-strict tracing) a ``SymBool`` is what it is; plain ints and bools never import
that module (a second's import), so eager calls pay nothing for this.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

from .request import (
    ALIGNMENTS,
    AttentionParams,
    AttentionRequest,
    device_capability,
    seqlen_bucket,
    softcap_log2,
)

_TENSOR_NAMES = ("query", "key", "value")

# Scores (scale * q @ k^T, softcap) are computed in float32 by every kernel: option
# values outside float32's range would turn every score into inf or NaN.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest positive normal
# A window side at least this large, that also covers every key of the call
# (side >= Nq + Nk), is unbounded: the same keys, and no overflow of the int32 and
# int64 position arithmetic of the kernels (10**20 does not fit either). Below it, a
# side is kept as given: 2**30 + a position of < 2**30 still fits int32.
_WINDOW_CLAMP = 1 << 30


def _decide(cond: Any, undecided: bool | None, what: str = "") -> bool:
    """``cond`` as a bool; where it is data-dependent, ``undecided`` (None: a
    ``ValueError`` saying that ``what`` is data-dependent)."""
    if not _maybe_symbolic(cond):
        return cond
    # guard_or_false / guard_or_true return Python bools (Dynamo traces them too; a
    # plain bool() would not: Dynamo gives it back symbolic) and never raise on
    # data-dependent sizes.
    guard_or_false, guard_or_true = _guard_helpers()
    if guard_or_false(cond):  # backed sizes: evaluated from their hints, with a guard
        return True
    if not guard_or_true(cond):
        return False
    if undecided is None:
        raise _data_dependent(what)
    return undecided


def _guard_helpers() -> tuple[Any, Any]:
    """torch's ``guard_or_false`` and ``guard_or_true`` (torch >= 2.8); before them, a
    branch, which guards on backed sizes and fails on data-dependent ones."""
    try:
        from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true
    except ImportError:  # pragma: no cover - torch < 2.8
        return _branch, _branch
    return guard_or_false, guard_or_true


def _branch(cond: Any) -> bool:
    return True if cond else False  # noqa: SIM210 (a branch: see _decide)


def _maybe_symbolic(cond: Any) -> bool:
    """Whether ``cond`` may be a SymBool: anything but a bool, and anything in Dynamo
    (where a SymBool passes for a bool)."""
    return not isinstance(cond, bool) or torch.compiler.is_dynamo_compiling()


def _checked(cond: Any) -> bool:
    """Whether a condition the call must satisfy holds (see the module docstring).

    A data-dependent condition is assumed to hold and asserted at run time.
    """
    if not _decide(cond, True):
        return False
    if _maybe_symbolic(cond):
        torch._check(cond)  # a run-time assertion where data-dependent (else a no-op)
    return True


def _known(cond: Any) -> bool:
    """True only where ``cond`` is known to hold (decided with a guard where it can be)."""
    return _decide(cond, False)


def _fact(cond: Any, what: str) -> bool:
    """A fact about the sizes that a decision rests on, as a bool (with a guard)."""
    return _decide(cond, None, what)


def _data_dependent(what: str) -> ValueError:
    return ValueError(
        f"{what} is data-dependent (an unbacked size): attnhub decides per length bucket "
        "and head shape, and needs such sizes with a hint (torch.export's Dim, dynamic "
        "shapes in torch.compile) or concrete"
    )


def _exact(n: Any, what: str) -> int:
    """A size as an int. A symbolic one is specialized (guarded equal to its value):
    ``SymInt.__index__`` does that, in Dynamo and outside it."""
    if not isinstance(n, int) and not torch.compiler.is_dynamo_compiling():
        # torch.export's non-strict tracing: an unbacked size cannot be specialized
        # (PyTorch would raise an internal error); say which size it is instead.
        from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

        if has_free_unbacked_symbols(n):
            raise _data_dependent(what)
    return operator.index(n)


def _traced_batch(b: Any) -> int | None:
    """The request's batch while tracing: 0 where the batch is known to be 0 (an empty
    call, which the reference serves), else None, with no guard on its value.

    A symbolic batch is never 0 under ``torch.compile`` (sizes 0 and 1 are
    specialized). A data-dependent (unbacked) one in ``torch.export`` that turns out to
    be 0 runs the chosen backend on an empty batch, whose empty output is the
    contract's answer.
    """
    return 0 if _known(b == 0) else None


def _bucket(n: Any, what: str) -> int:
    """:func:`seqlen_bucket` of a size. While tracing, the size is compared with powers
    of two, each comparison a guard where it is symbolic, so that the graph serves
    exactly the lengths of its bucket."""
    if isinstance(n, int) and not torch.compiler.is_compiling():
        return seqlen_bucket(n)
    if not _fact(n > 0, what):
        return 0
    bucket = 1
    while _fact(n > bucket, what):
        bucket <<= 1
    return bucket


def _type_name(value: Any) -> str:
    """A value's type for a message: ``list``, or ``numpy.bool`` (whose own name, bool,
    would read as if a bool had been refused)."""
    kind = type(value)
    return (
        kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    )


def _shape(t: Any) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_strided(name: str, t: torch.Tensor) -> None:
    """A dense tensor: not nested (whose sizes PyTorch will not even report) or sparse."""
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested" if t.is_nested else f"a {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got {kind} tensor")


def refuse_jit_trace(function: str) -> None:
    """Raise RuntimeError while ``torch.jit.trace`` records: it keeps the ops of one call
    and turns Python's decisions into constants (the backend, and the masks and lengths
    built for the traced shapes), and its sizes are tensors, which validation cannot
    read. Each entry point asks first (attention's slow path, explain, the serving
    calls' validation): the memos never serve a recorded call (the tracer's dispatch key
    fails their guards), so every such call reaches one of them."""
    if _tracing_state() is not None:
        raise RuntimeError(
            f"{function} cannot be recorded by torch.jit.trace (it would keep one call's "
            "decisions as constants); use torch.compile or torch.export, which trace "
            "attnhub, or attnhub.patch(), which hands F.scaled_dot_product_attention "
            "calls that torch.jit.trace records to PyTorch's own function"
        )


_tracing_state = torch._C._get_tracing_state


def check_tensors(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    """Types, ranks, dtypes, devices and shapes of the tensors (see contract.md, Errors)."""
    tensors = (query, key, value)
    for name, t in zip(_TENSOR_NAMES, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {_type_name(t)}")
        check_strided(name, t)
        if t.dim() != 4:
            layout = "(B, Hq, Nq, D)" if name == "query" else "(B, Hkv, Nk, D)"
            raise ValueError(
                f"{name} must be 4-D {layout}, got a {t.dim()}-D tensor of shape {_shape(t)}"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(
                f"{name} must have a floating-point dtype (float16, bfloat16, float32, float64), "
                f"got {t.dtype}"
            )
    for name, t in zip(_TENSOR_NAMES[1:], tensors[1:]):
        if t.dtype != query.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but query has {query.dtype}; they must match"
            )
        if t.device != query.device:
            raise ValueError(
                f"{name} is on {t.device} but query is on {query.device}; they must match"
            )
    b, hq, _, d = query.shape
    bk, hkv, nk, dk = key.shape
    bv, hv, nv, dv = value.shape
    if not (_checked(bk == b) and _checked(bv == b)):
        raise ValueError(
            f"batch sizes differ: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )
    if not _checked(hv == hkv):
        raise ValueError(f"key and value must have the same number of heads, got {hkv} and {hv}")
    if not _checked(nv == nk):
        raise ValueError(f"key and value must have the same sequence length, got {nk} and {nv}")
    if not _checked(dk == d):
        raise ValueError(f"query and key must have the same head dim D, got {d} and {dk}")
    # Empty tensors are served (contract.md, Errors), but not an empty head dim: the
    # contract lists B, H, Nq and Nk of zero, and no backend declares D or Dv of 0.
    if _known(d == 0):
        raise ValueError(f"query and key head dim D must be >= 1, got query {_shape(query)}")
    if _known(dv == 0):
        raise ValueError(f"value head dim Dv must be >= 1, got value {_shape(value)}")
    if not (_checked(hq == 0) if _known(hkv == 0) else _checked(hq % hkv == 0)):
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
            "(grouped-query attention)"
        )
    if attn_mask is not None:
        check_mask(attn_mask, query, key)


def check_mask(attn_mask: Any, query: torch.Tensor, key: torch.Tensor) -> None:
    """The mask's type, dtype, device, and that it broadcasts to (B, Hq, Nq, Nk).

    Any rank from 0 to 4 broadcasts (PyTorch's rule: sizes align from the right, and
    each is 1 or the target's); backends see it as 4-D (:func:`mask_as_4d`).
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {_type_name(attn_mask)}")
    check_strided("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = may attend) or floating, got {attn_mask.dtype}"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    # A symbolic size not known to be 1 must equal the target's (see _known).
    ok = attn_mask.dim() <= 4 and all(
        _known(m == 1) or _checked(m == t)
        for m, t in zip(reversed(attn_mask.shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to (B, Hq, Nq, Nk) = "
            f"({', '.join(map(str, target))})"
        )


def mask_as_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    """A validated mask as the 4-D view every backend is handed (leading sizes of 1)."""
    missing = 4 - attn_mask.dim()
    return attn_mask.view((1,) * missing + tuple(attn_mask.shape)) if missing else attn_mask


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_type_name(value)}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float64's range
        raise ValueError(f"{name} must be finite, got {value}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_window(window: Any, covering: Any) -> tuple[int | None, int | None] | None:
    """The window's sides, each an int >= 0 or None (unbounded).

    ``covering`` is Nq + Nk: a side that large keeps every key the other bounds keep,
    so a side of at least ``_WINDOW_CLAMP`` and ``covering`` becomes None.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a (left, right) pair, got {window!r}")
    sides: list[int | None] = []
    for side, value in zip(("left", "right"), window):
        if value is None:
            sides.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} side must be an int >= 0 or None, got {value!r}")
        if value < 0:
            raise ValueError(
                f"window sides must be >= 0 (or None for unbounded), got {side}={value}"
            )
        value = int(value)
        unbounded = value >= _WINDOW_CLAMP and _fact(covering <= value, "Nq + Nk")
        sides.append(None if unbounded else value)
    if sides == [None, None]:
        return None  # unbounded both ways: no window at all
    return (sides[0], sides[1])


def _without_covering_sides(
    window: tuple[int | None, int | None], nq: int, nk: int, causal: bool, alignment: str
) -> tuple[int | None, int | None] | None:
    """The window without the sides that exclude no key of an (Nq, Nk) call.

    Query row i sits at key position p = i (top-left) or i + Nk - Nq (bottom-right).
    The left side keeps keys j >= p - left: all of them where left >= the largest p. The
    right side keeps j <= p + right: all where right >= Nk - 1 - the smallest p, and
    always beside causal (which keeps j <= p). Such a side is None, and a window
    without sides is no window: the same keys, so the same answer, and the call stays
    eligible for kernels without windows (a decoding step of a sliding-window model
    whose cache is shorter than its window, a causal window whose right side is 0).
    """
    first, last = (nk - nq, nk - 1) if alignment == "bottom_right" else (0, nq - 1)
    left, right = window
    if left is not None and left >= last:
        left = None
    if right is not None and (causal or right >= nk - 1 - first):
        right = None
    return None if left is None and right is None else (left, right)


def make_params(
    query: torch.Tensor,
    *,
    key: Any,
    causal: Any,
    alignment: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    dropout_p: Any,
    block_sparse: Any,
    return_lse: Any,
) -> AttentionParams:
    """Check the options and resolve them into :class:`AttentionParams`.

    ``key`` gives Nk, which bounds the window. It has no default: a default of
    ``query`` made every caller that forgot it normalize a cross-attention window
    against Nq, dropping sides that exclude keys.

    Rules beyond the types: ``dropout_p`` in [0, 1); ``softcap`` None or in
    [1.18e-38, 3.4e38] (float32's positive normal range: the kernels divide by it in
    float32); ``scale`` finite with ``|scale| <= 3.4e38`` (float32's largest: scores
    are accumulated in float32, and a larger scale made every one inf, then NaN);
    scores ``scale * q.k`` beyond float32's range overflow as in any float32 kernel.
    A window side of 2**30 or more that covers every key (side >= Nq + Nk) is
    unbounded (None), which keeps the same keys; so is any side that excludes no key of
    the call (see :func:`_without_covering_sides`). Bottom-right causal with Nq == 1 (a
    decoding step) is no causal at all: it keeps every key.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {_type_name(causal)}")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {_type_name(return_lse)}")
    dropout = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout}")
    if softcap is not None:
        softcap = _check_real("softcap", softcap)
        if softcap <= 0:
            raise ValueError(f"softcap must be None or > 0, got {softcap}")
        if not _FLOAT32_TINY <= softcap <= _FLOAT32_MAX:
            raise ValueError(
                f"softcap must be within float32's normal range [{_FLOAT32_TINY}, "
                f"{_FLOAT32_MAX}] (scores are capped in float32), got {softcap}"
            )
    if scale is None:
        d = _exact(query.shape[-1], "the head dim D")
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    else:
        scale = _check_real("scale", scale)
        if abs(scale) > _FLOAT32_MAX:
            raise ValueError(
                f"scale must be at most {_FLOAT32_MAX} in magnitude (float32's largest: "
                f"scores are accumulated in float32), got {scale}"
            )
    if block_sparse is not None:
        from .block_sparse import BlockSparseLayout

        if not isinstance(block_sparse, BlockSparseLayout):
            raise TypeError(
                f"block_sparse must be None or an attnhub.BlockSparseLayout, "
                f"got {_type_name(block_sparse)}"
            )
    nq = query.shape[2]
    if causal and alignment == "bottom_right" and type(nq) is int and nq == 1:
        # Decoding: the one query row sits at the last key, so causal keeps every key
        # and the call is the same without it; said so, backends without bottom-right
        # alignment serve it, and none builds a mask for it. (A symbolic Nq under
        # torch.compile keeps causal: the same answer, only not simplified.)
        causal = False
    nk = (query if key is None else key).shape[2]
    window = _check_window(window, nq + nk)
    if window is not None and type(nq) is int and type(nk) is int:
        window = _without_covering_sides(window, nq, nk, causal, alignment)
    return AttentionParams(
        causal=causal,
        alignment=alignment,
        window=window,
        softcap=softcap,
        scale=scale,
        dropout_p=dropout,
        block_sparse=block_sparse,
        return_lse=return_lse,
    )


def check_block_sparse(params: AttentionParams, query: torch.Tensor, key: torch.Tensor) -> None:
    if params.block_sparse is not None:
        params.block_sparse.check_compatible(query, key)


def build_request(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> AttentionRequest:
    """Summarize a validated call for dispatch."""
    return complete_request(request_facts(query, key, value, attn_mask, params))


RequestFacts = tuple[tuple[str, Any], ...]


def request_facts(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> RequestFacts:
    """What a validated call's request says about it, as (field, Python constant) pairs.

    Everything but what reads the process's state (the device's capability, the
    deterministic flag: :func:`complete_request` adds them), so that ``torch.compile``
    can trace this and pass the result to a constant function. A symbolic size becomes
    a constant only as precisely as the request keeps it, each through a guard: the
    sequence lengths' buckets and Nq == Nk, Nq > Nk; the head counts and head dims
    exactly (they are specialized); and, while tracing (``torch.compile``,
    ``torch.export``), the batch not at all: None (0 for a batch known to be empty),
    with no guard, which is why no decision may depend on it.
    """
    b, hq, nq, d = query.shape
    _, hkv, nk, _ = key.shape
    same_seqlen = _fact(nq == nk, "Nq == Nk")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask)
    )
    if attn_mask is None:
        mask = "none"
    else:
        mask = "bool" if attn_mask.dtype == torch.bool else "float"
    layout = params.block_sparse
    return (
        ("device", str(query.device)),
        ("dtype", query.dtype),
        ("batch", _traced_batch(b) if torch.compiler.is_compiling() else b),
        ("heads_q", _exact(hq, "the query heads Hq")),
        ("heads_kv", _exact(hkv, "the key/value heads Hkv")),
        ("seqlen_q", _bucket(nq, "the query length Nq")),
        ("seqlen_k", _bucket(nk, "the key length Nk")),
        ("same_seqlen", same_seqlen),
        ("q_longer", not same_seqlen and _fact(nq > nk, "Nq > Nk")),
        ("head_dim", _exact(d, "the head dim D")),
        ("head_dim_v", _exact(value.shape[-1], "the value head dim Dv")),
        ("mask", mask),
        ("mask_needs_grad", needs_grad and attn_mask is not None and attn_mask.requires_grad),
        (
            "mask_per_key",
            attn_mask is not None
            and all(_fact(n == 1, "the mask's head and row dims") for n in attn_mask.shape[-3:-1]),
        ),
        (
            "mask_rounded",
            attn_mask is not None
            and mask == "float"
            and attn_mask.dtype != query.dtype
            and query.dtype in (torch.float16, torch.bfloat16),
        ),
        ("causal", params.causal),
        # The alignment only matters where a diagonal does and the lengths differ;
        # normalizing it keeps backends that lack one alignment eligible elsewhere.
        (
            "alignment",
            params.alignment
            if (params.causal or params.window is not None) and not same_seqlen
            else "top_left",
        ),
        ("window", params.window is not None),
        ("softcap", params.softcap is not None),
        ("softcap_log2", softcap_log2(params.softcap)),
        ("dropout", params.dropout_p > 0.0),
        ("needs_grad", needs_grad),
        (
            "last_dim_contiguous",
            all(
                _fact(t.stride(-1) == 1, "the last stride") or _fact(t.shape[-1] <= 1, "Dv")
                for t in (query, key, value)
            ),
        ),
        ("block_sparse", layout is not None),
        ("block_size", layout.block_size if layout is not None else None),
        ("return_lse", params.return_lse),
        ("scale_positive", params.scale > 2.0**-150),
        # request.LOG2_SCALE_LIMIT written out: Dynamo folds a literal to a constant,
        # not a global imported from another module (a test checks they agree).
        ("scale_in_log2_range", -2.3586574916681825e38 <= params.scale <= 2.3586574916681825e38),
        ("traced", torch.compiler.is_compiling()),
    )


def complete_request(facts: RequestFacts) -> AttentionRequest:
    """The request of :func:`request_facts`, with the device's capability and whether
    deterministic algorithms are asked for (for a call that needs gradients)."""
    fields = dict(facts)
    device = torch.device(fields.pop("device"))
    return AttentionRequest(
        device_type=device.type,
        capability=device_capability(device),
        deterministic=fields["needs_grad"] and torch.are_deterministic_algorithms_enabled(),
        **fields,
    )
