"""Put attnhub under an existing model: :func:`patch` replaces
``torch.nn.functional.scaled_dot_product_attention``.

Usage::

    handle = attnhub.patch()               # every F.scaled_dot_product_attention call
    model(x)                               # now goes through attnhub's dispatch
    handle.undo()                          # and back

    with attnhub.patch(backend=["triton_flash", "torch_sdpa"]):
        model(x)                           # only these two, in this order

What is replaced
    The attribute ``torch.nn.functional.scaled_dot_product_attention`` itself, so every
    caller that looks the function up at call time is covered: ``F.scaled_dot_product_attention(...)``,
    ``torch.nn.functional.scaled_dot_product_attention(...)``, and code inside
    ``torch/nn/functional.py`` (``F.multi_head_attention_forward``, which
    ``nn.MultiheadAttention`` uses with ``need_weights=False`` and
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` use outside
    their fused inference fast path).

    Aliases: with ``aliases=True`` (the default), a module-level global named
    ``scaled_dot_product_attention`` bound to the original function before patching
    (``from torch.nn.functional import scaled_dot_product_attention``) is rebound too,
    and restored on undo if nobody has changed it since. Other names (``import ... as
    sdpa``, ``orig = F.scaled_dot_product_attention``) are left alone: such a handle is
    as often a deliberate way to reach PyTorch's own function. Modules of torch, attnhub, attention-kernel libraries and
    attnhub's backend plugins are skipped: they must keep reaching PyTorch's own
    function. Not covered: references held anywhere else (object attributes, closures,
    default arguments, ``functools.partial``, dicts), and calls to
    ``torch._C._nn.scaled_dot_product_attention`` or ``torch.ops.aten`` ops.

Semantics
    The replacement takes exactly PyTorch's signature ``(query, key, value,
    attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False)``
    and keeps its meaning (top-left causal, bool mask True = attend, float mask
    added). Calls outside attnhub's domain go to PyTorch's original function, so they
    behave, and fail, exactly as before: inputs that are not 4-D tensors (PyTorch
    accepts 3-D and more), nested tensors, ``is_causal`` together with ``attn_mask``,
    head counts that differ without ``enable_gqa``, a float mask whose dtype differs
    from the query's, broadcast batch dimensions, and anything else attnhub rejects
    with ``ValueError``/``TypeError``. A call no attnhub backend can serve
    (:class:`attnhub.NoBackendError`) goes there too, unless ``strict=True``.

    Overrides: when query, key, value or attn_mask has ``__torch_function__`` (a
    tensor subclass; the ``CausalBias`` masks of ``torch.nn.attention.bias``) or a
    ``TorchFunctionMode`` is active, the call is handed to the override as PyTorch's
    function does (``torch.overrides.handle_torch_function``), with
    ``torch.nn.functional.scaled_dot_product_attention`` as it is then as ``func``;
    what the override calls back comes through the patch again.

    The one documented difference: a query row whose every key is masked gives zeros
    (PyTorch's fused kernels may give NaN there). Dropout draws from PyTorch's
    generator but not necessarily the same stream as PyTorch's kernels.

TorchScript
    Each replacement is registered as TorchScript's builtin
    ``aten::scaled_dot_product_attention``: ``torch.jit.script`` compiles calls to it
    as PyTorch's op, patched or not (see :func:`_script_as_aten`).

Logging and counting
    The first call of each new signature is logged at INFO (``attnhub`` logger) with
    the backend that serves it; the first call of each kind handed to PyTorch's own
    function is logged at INFO with why. :func:`attnhub.stats` counts the calls each
    backend served, and those handed back under ``"pytorch_original"``.

Nesting
    Patches stack: the newest one's options are in force, and undoing it (in any
    order) puts the newest remaining one in force, or PyTorch's function back when
    none remains. ``undo()`` is idempotent. Nothing is patched at import.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function

from . import dispatch
from .api import attention, sdpa_entry
from .call_stats import ORIGINAL, record
from .dispatch import normalize_backend_arg
from .errors import BrokenBackendError, NoBackendError
from .mask_structure import recognize
from .registry import on_invalidate

_is_compiling = torch.compiler.is_compiling
_capturing = torch.cuda.is_current_stream_capturing
# Bound once, as in attnhub.api: the memo's context reads them on every call.
_grad_enabled = torch.is_grad_enabled
_deterministic = torch.are_deterministic_algorithms_enabled
_context_get = dispatch.context_selection.get
_env_get = dispatch.environment_get
_ENV_BACKEND, _ENV_STRICT = dispatch.ENVIRONMENT_KEYS

log = logging.getLogger("attnhub")

__all__ = ["PatchHandle", "active_patches", "is_patched", "patch"]

# Top-level packages whose aliases are never rebound: they implement attention (or
# dispatch to it) and must keep calling PyTorch's own function.
_NEVER_REBIND = frozenset(
    {"torch", "torchvision", "functorch", "attnhub", "triton", "xformers", "flash_attn"}
)

_NAME = "scaled_dot_product_attention"
_lock = threading.RLock()
_stack: list[PatchHandle] = []
_original: Callable[..., torch.Tensor] | None = None


class _Inside(threading.local):
    """Per thread: set while a patched call runs attnhub, so that a backend calling
    F.scaled_dot_product_attention (torch_sdpa does) reaches PyTorch's function instead
    of recursing. Dynamo traces threading.local reads and writes without a graph break.
    Every thread's instance holds the attribute from the start (threading.local runs
    ``__init__`` per thread): a compiled graph guards on whether the instance has it, so
    a first call that set it would change that and recompile."""

    def __init__(self) -> None:
        self.active = False


_inside = _Inside()
_logged_fallbacks: set[str] = set()
_LOGGED_LIMIT = 4096
# One C call over the tensor arguments (about 0.1 us): True when any has
# __torch_function__ or a TorchFunctionMode is active, as PyTorch's own check.
_has_torch_function = torch._C._has_torch_function
_jit_tracing = torch._C._get_tracing_state
# torch.nested's jagged layout (a tensor subclass; torch.nested imports it with torch).
_JAGGED: type = getattr(
    getattr(getattr(torch.nested, "_internal", None), "nested_tensor", None),
    "NestedTensor",
    type(None),
)


def _jagged(*args: Any) -> bool:
    return any(isinstance(a, _JAGGED) for a in args if a is not None)


class PatchHandle:
    """One active :func:`patch`; ``undo()`` it, or use it as a context manager."""

    def __init__(self, backend: tuple[str, ...] | None, strict: bool, aliases: bool) -> None:
        self.backend = backend
        self.strict = strict
        self.aliases = aliases
        self.function = _make_replacement(self)
        # (module, name) pairs this handle rebound.
        self._rebound: list[tuple[types.ModuleType, str]] = []
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def undo(self) -> None:
        """Remove this patch (no-op if already undone); the newest remaining one takes over."""
        with _lock:
            if not self._active:
                return
            self._active = False
            _stack.remove(self)
            _install(_stack[-1].function if _stack else None, replacing=self.function)
            for module, name in self._rebound:
                if getattr(module, name, None) is self.function:
                    setattr(module, name, _stack[-1].function if _stack else _original)
            self._rebound.clear()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self._active else "undone"
        return f"<attnhub.PatchHandle {state} backend={self.backend} strict={self.strict}>"


def patch(
    backend: str | Sequence[str] | None = None,
    *,
    strict: bool = False,
    aliases: bool = True,
) -> PatchHandle:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through attnhub.

    Args:
        backend: None (every registered backend, ranked as usual), a backend name, or
            names to choose among in that order, for the patched calls.
        strict: raise :class:`attnhub.NoBackendError` when no allowed backend can
            serve a call, instead of handing it to PyTorch's original function.
            Patched calls never fall back to the slow ``torch_reference`` unless
            ``backend`` names it: where only it could serve, PyTorch's own function
            serves (or, with ``strict``, the error is raised).
        aliases: also rebind module-level aliases of the function bound before
            patching (see the module docstring for what is and is not covered).

    Returns:
        A :class:`PatchHandle`; the patch is in force until ``handle.undo()`` or the
        end of a ``with attnhub.patch(...):`` block.
    """
    names = normalize_backend_arg(backend)
    if names is not None:
        from .registry import get_registry

        registry = get_registry()
        for name in names:
            registry.get(name)  # ValueError listing the known names
    for name, flag in (("strict", strict), ("aliases", aliases)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    handle = PatchHandle(names, strict, aliases)
    global _original
    with _lock:
        current = F.scaled_dot_product_attention
        if not _stack:
            _original = current
        previous = _stack[-1].function if _stack else _original
        _install(handle.function, replacing=previous)
        _stack.append(handle)
        handle._active = True
        if aliases:
            handle._rebound = _rebind_aliases(previous, handle.function)
    return handle


def is_patched() -> bool:
    """Whether an attnhub patch is in force."""
    return bool(_stack)


def active_patches() -> list[PatchHandle]:
    """The patches in force, oldest first (the last one's options apply)."""
    with _lock:
        return list(_stack)


def original_function() -> Callable[..., torch.Tensor]:
    """PyTorch's ``scaled_dot_product_attention`` as it was before the first patch."""
    return _original if _original is not None else F.scaled_dot_product_attention


def _install(function: Callable[..., Any] | None, replacing: Callable[..., Any] | None) -> None:
    target = function if function is not None else _original
    if (
        F.scaled_dot_product_attention is not replacing
        and F.scaled_dot_product_attention is not target
    ):
        # Someone else replaced the function after us: leave theirs in place.
        log.warning(
            "attnhub.patch: torch.nn.functional.scaled_dot_product_attention was replaced "
            "by %r outside attnhub; leaving it in place",
            F.scaled_dot_product_attention,
        )
        return
    F.scaled_dot_product_attention = target  # type: ignore[assignment]


def _skip_module(module_name: str) -> bool:
    top = module_name.partition(".")[0]
    if top in _NEVER_REBIND:
        return True
    # Backend plugins (built-in or third-party) keep PyTorch's function.
    return top in _backend_packages()


def _backend_packages() -> frozenset[str]:
    from .registry import get_registry

    return frozenset(type(b).__module__.partition(".")[0] for b in get_registry().backends())


def _rebind_aliases(
    previous: Callable[..., Any] | None, function: Callable[..., Any]
) -> list[tuple[types.ModuleType, str]]:
    """Rebind module globals that are ``previous`` (the function before this patch)."""
    rebound: list[tuple[types.ModuleType, str]] = []
    if previous is None:
        return rebound
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or _skip_module(module_name):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        # Only the function's own name: a differently named reference is more often
        # a deliberate handle on PyTorch's function (to compare, or to call it
        # unpatched) than an import alias.
        for name, value in list(namespace.items()):
            if name == _NAME and value is previous:
                setattr(module, name, function)
                rebound.append((module, name))
    if rebound:
        log.info(
            "attnhub.patch: also rebound %s",
            ", ".join(f"{m.__name__}.{n}" for m, n in rebound),
        )
    return rebound


_Tensor = torch.Tensor


def _outside_domain(
    query: Any, key: Any, value: Any, attn_mask: Any, is_causal: Any, enable_gqa: Any
) -> str | None:
    """Why a call is not attnhub's to serve (None: it is), from metadata alone."""
    # The common call first, in as few attribute reads as it takes (this runs on every
    # patched call: a 4-D dense tensor each, no mask, a bool is_causal, equal heads).
    if (
        attn_mask is None
        and (is_causal is False or is_causal is True)
        and query.__class__ is _Tensor
        and key.__class__ is _Tensor
        and value.__class__ is _Tensor
        and not (query.is_nested or key.is_nested or value.is_nested)
        and query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and (enable_gqa is True or (enable_gqa is False and query.size(1) == key.size(1)))
    ):
        return None
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.is_nested:
            return f"{name} is a nested tensor"
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "attn_mask is not a tensor"
        if attn_mask.dim() < 2:  # PyTorch's function raises (IndexError): it must here too
            return f"attn_mask is {attn_mask.dim()}-D"
        if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
            return f"attn_mask dtype {attn_mask.dtype} differs from the query's {query.dtype}"
        if is_causal:
            return "is_causal with attn_mask"
    if enable_gqa is not True and enable_gqa is not False:  # PyTorch raises TypeError
        return "enable_gqa is not a bool"
    if query.shape[1] != key.shape[1] and enable_gqa is not True:
        return f"Hq={query.shape[1]} != Hkv={key.shape[1]} without enable_gqa"
    if not isinstance(is_causal, bool):
        return "is_causal is not a bool"
    return None


def _note_original(why: str, query: Any, key: Any) -> None:
    if _is_compiling():
        return
    record(ORIGINAL)
    # A nested tensor's shape raises (NestedTensorImpl has no sizes).
    shapes = tuple(
        "nested" if getattr(t, "is_nested", False) else getattr(t, "shape", None)
        for t in (query, key)
    )
    note = f"{why}; query/key shapes {shapes}"
    if note in _logged_fallbacks:
        return
    with _lock:
        if len(_logged_fallbacks) >= _LOGGED_LIMIT:
            _logged_fallbacks.clear()
        _logged_fallbacks.add(note)
    log.info("attnhub.patch: PyTorch's own scaled_dot_product_attention serves a call: %s", note)


class _Memo:
    """One replacement's last reusable decisions: ``value``, ``(context, api entry)``
    of a call decided without reading a mask's values, and ``masked``, ``(context,
    weak reference to the mask, its version, the mask handed to the entry (the plan's
    key mask, None, or ``_SAME_MASK``: the call's own), api entry)`` of a call whose
    mask was read (:func:`mask_arguments`).

    A model calls attention with one signature many times in a row (every layer of a
    step), so a patched call that has the last one's options, selection in force and
    tensor metadata (checked by the entry's guards, in one C call) runs the runner
    that call was decided to, skipping the domain checks, the strict context and
    :func:`attnhub.attention`'s keyword call (about 15,000 instructions,
    ``benchmarks/overhead.py``'s ``model_patched`` row). A call with a mask reuses the
    last masked decision only with the very same mask tensor, unchanged (identity and
    version counter: the layers of one step share it), outside CUDA-graph capture (a
    captured call does not read its mask: :func:`mask_arguments`): what was read from
    its values holds then. Cleared on any registry, policy or cost-table change.
    """

    __slots__ = ("__weakref__", "masked", "value")

    def __init__(self) -> None:
        self.value: tuple[Any, Any, bool] = _NO_VALUE
        self.masked: tuple[Any, ...] = _NO_MASKED


_NO_MEMO = object()  # a context no call has
_NO_VALUE: tuple[Any, Any, bool] = (_NO_MEMO, None, False)
_NO_MASKED: tuple[Any, ...] = (_NO_MEMO, lambda: None, -1, None, None, False)
_SAME_MASK = object()  # in _Memo.masked: the entry is handed the call's own mask
_memos: weakref.WeakSet[_Memo] = weakref.WeakSet()


@on_invalidate
def _clear_memos() -> None:
    for memo in list(_memos):
        memo.value = _NO_VALUE
        memo.masked = _NO_MASKED


def _native(runner: Any) -> bool:
    """Whether ``runner`` is a C function (PyTorch's SDPA, or a partial of it: what
    torch_sdpa hands most calls), which runs no Python and so cannot call
    F.scaled_dot_product_attention back: the memo's calls then skip the ``_inside``
    flag (two thread-local writes a call)."""
    if runner.__class__ is functools.partial:
        runner = runner.func
    return runner.__class__ is types.BuiltinFunctionType


def _make_replacement(handle: PatchHandle) -> Callable[..., torch.Tensor]:
    backend = handle.backend
    strict = handle.strict
    reference_named = backend is not None and dispatch.REFERENCE in backend
    memo = _Memo()
    _memos.add(memo)

    def scaled_dot_product_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if _has_torch_function((query, key, value, attn_mask)):
            if _jagged(query, key, value, attn_mask):
                # PyTorch's jagged nested tensors serve its SDPA only when their
                # override is handed the C function itself (they compare func with
                # torch._C._nn.scaled_dot_product_attention; CausalBias compares it
                # with the F attribute, _public_function's): the function as it was
                # before the patch dispatches to them, as unpatched.
                return original_function()(query, key, value, attn_mask, dropout_p,
                                           is_causal, scale=scale, enable_gqa=enable_gqa)  # fmt: skip
            # A tensor subclass or object with __torch_function__ (PyTorch's CausalBias
            # masks, wrapper subclasses) or an active TorchFunctionMode: dispatch to it
            # exactly as PyTorch's function does; see _public_function for which
            # function the override receives. PyTorch passes the arguments as the
            # caller did, which a Python signature cannot tell: the tensors go
            # positionally, every option by name (overrides such as CausalBias's bind
            # them to the signature, so either form reaches them the same way).
            return handle_torch_function(
                _public_function(), (query, key, value, attn_mask),
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )  # fmt: skip
        original = _original
        assert original is not None
        if _inside.active:
            # A backend's own call to F.scaled_dot_product_attention.
            return original(query, key, value, attn_mask, dropout_p, is_causal,
                            scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        compiling = _is_compiling()
        context: Any = None  # None: not a call the memo keeps
        if (
            not compiling
            and (is_causal is True or is_causal is False)
            and (enable_gqa is True or enable_gqa is False)
            and dropout_p.__class__ is float
            and (scale is None or scale.__class__ is float)
        ):
            # Exact types, so that equal values of other types (dropout_p=0, an int;
            # scale=numpy.float64), which may be decided otherwise, never match.
            context = (
                is_causal, enable_gqa, dropout_p, scale, attn_mask is None, _grad_enabled(),
                _context_get(), _env_get(_ENV_BACKEND), _env_get(_ENV_STRICT),
            )  # fmt: skip
            if attn_mask is None or memo.masked[1]() is not attn_mask:
                # An api entry, (name, runner, guards, ...), and whether its runner is
                # PyTorch's C function itself (_native).
                last_context, entry, native = memo.value
                mask = attn_mask  # what the entry is handed
            else:  # the mask the last masked call read
                last_context, _, version, mask, entry, native = memo.masked
                if mask is _SAME_MASK:
                    mask = attn_mask
                if version != attn_mask._version or (attn_mask.is_cuda and _capturing()):
                    last_context = _NO_MEMO
            try:
                hit = (
                    last_context == context
                    # Never a nested tensor into the C check: it would abort the process
                    # (tensor_guards.Guards); _outside_domain hands them to PyTorch.
                    and not (query.is_nested or key.is_nested or value.is_nested)
                    and (
                        entry[2].check(query, key, value)
                        if mask is None
                        else not mask.is_nested and entry[2].check(query, key, value, mask)
                    )
                    and (entry[4] is None or entry[4] is _deterministic())
                )
            except AttributeError:  # not a tensor: PyTorch's own function reports it
                hit = False
            if hit:
                entry[5]()  # attnhub.stats(), as in attnhub.attention
                if not native:  # a C runner cannot reach this function again
                    _inside.active = True
                try:
                    return entry[1](query, key, value, mask)
                except (ValueError, TypeError) as exc:
                    _note_original(f"attnhub rejects it ({type(exc).__name__}: {exc})", query, key)
                    return original(query, key, value, attn_mask, dropout_p, is_causal,
                                    scale=scale, enable_gqa=enable_gqa)  # fmt: skip
                except BrokenBackendError as exc:
                    if not exc.inputs_intact:
                        raise
                    _note_original(str(exc), query, key)
                    return original(query, key, value, attn_mask, dropout_p, is_causal,
                                    scale=scale, enable_gqa=enable_gqa)  # fmt: skip
                finally:
                    if not native:
                        _inside.active = False
        why = _outside_domain(query, key, value, attn_mask, is_causal, enable_gqa)
        if why is None and _jit_tracing() is not None:
            # Recorded as PyTorch's op, which serves the traced module's later shapes;
            # attnhub's decisions would be kept as constants (validation.refuse_jit_trace).
            why = "torch.jit.trace records the call"
        if why is None:
            _inside.active = True
            # Strict inside the patch: where only torch_reference (O(N^2) memory, slow)
            # could serve a call, PyTorch's own function serves it instead, as before
            # patching; a patch must never make a model much slower.
            # (Under torch.compile the choice is made at trace time, with the selection
            # in force then; context variables cannot be traced.)
            token = None if compiling else dispatch.enter_strict(reference_named)
            try:
                if not compiling and not _reads_mask(query, key, attn_mask):
                    # Decided from metadata alone: kept for the next call.
                    decided: Any = sdpa_entry(  # return_lse=False: its runner gives a tensor
                        query, key, value, attn_mask, is_causal, scale, dropout_p, backend
                    )
                    if context is not None:
                        memo.value = (context, decided, _native(decided[1]))
                    decided[5]()
                    return decided[1](query, key, value, attn_mask)
                mask, structure = mask_arguments(query, key, attn_mask, is_causal)
                if compiling:
                    return attention(
                        query, key, value, mask,
                        **structure, scale=scale, dropout_p=dropout_p, backend=backend,
                    )  # fmt: skip
                decided = sdpa_entry(
                    query, key, value, mask, structure["causal"], scale, dropout_p, backend,
                    structure["alignment"], structure["window"],
                )  # fmt: skip
                if (
                    context is not None
                    and attn_mask is not None
                    and not attn_mask.is_inference()  # it has no version counter
                    and not (attn_mask.is_cuda and _capturing())  # it was not read
                ):
                    # Kept for the next call with this very mask, unchanged (see _Memo),
                    # without keeping the mask alive (a (B, 1, N, N) mask run as given
                    # can be large): a weak reference, and _SAME_MASK for "hand it on".
                    handed = _SAME_MASK if mask is attn_mask else mask
                    memo.masked = (
                        context, weakref.ref(attn_mask), attn_mask._version, handed, decided,
                        _native(decided[1]),
                    )  # fmt: skip
                decided[5]()
                return decided[1](query, key, value, mask)
            except (ValueError, TypeError) as exc:
                why = f"attnhub rejects it ({type(exc).__name__}: {exc})"
            except BrokenBackendError as exc:  # it is disabled now: PyTorch's serves
                if not exc.inputs_intact:
                    raise
                why = str(exc)
            except NoBackendError as exc:
                if strict:
                    raise
                why = f"{str(exc).splitlines()[0]} ({exc.signature})"
            finally:
                if token is not None:
                    dispatch.context_selection.reset(token)
                _inside.active = False
        _note_original(why, query, key)
        return original(query, key, value, attn_mask, dropout_p, is_causal,
                        scale=scale, enable_gqa=enable_gqa)  # fmt: skip

    scaled_dot_product_attention.__doc__ = (
        "attnhub's replacement for torch.nn.functional.scaled_dot_product_attention "
        "(see attnhub.patch).\n\n" + (torch._C._nn.scaled_dot_product_attention.__doc__ or "")
    )
    scaled_dot_product_attention.__attnhub_patch__ = handle  # type: ignore[attr-defined]
    _script_as_aten(scaled_dot_product_attention)
    return scaled_dot_product_attention


# Devices where a mask's structure is worth reading: those with kernels that skip
# masked blocks (triton_flash).
STRUCTURED_MASK_DEVICES = frozenset({"cuda"})


def _reads_mask(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether :func:`mask_arguments` reads the mask's values (else: its metadata decides).

    Only a mask that broadcasts over the query's leading dims: one that does not is
    PyTorch's error to raise (the dense path keeps it), never dropped by a plan that
    needs no key mask. Not a decoding step's (one query row): its structure is at most
    key padding, and the kernels take it as it is (triton_flash's decode kernel reads it
    tile by tile beside the keys, and never the keys it masks), where reading it
    costs a device synchronization and several small kernels at every step: the first
    layer's patched call took 660 us of host time on an H100 where stock SDPA's took
    110 (archive/patched-generate-probe-padded-drain-h100-2026-12-06-2175d7e.txt).
    """
    return (
        attn_mask is not None
        and attn_mask.device.type in STRUCTURED_MASK_DEVICES
        and query.shape[-2] != 1
        and 2 <= attn_mask.dim() <= query.dim()
        and attn_mask.shape[-2:] == (query.shape[-2], key.shape[-2])
        and all(
            m == 1 or m == q
            for m, q in zip(reversed(attn_mask.shape[:-2]), reversed(query.shape[:-2]))
        )
    )


def mask_arguments(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """``attn_mask`` and ``is_causal`` as :func:`attnhub.attention`'s arguments: (the
    mask to pass, ``{"causal", "alignment", "window"}``).

    A dense mask that is exactly causal, window and key-padding structure (what model
    code materializes for SDPA, Hugging Face's among them) becomes ``causal``,
    ``alignment``, ``window`` and at most a (.., 1, Nk) key mask, so that the kernels
    skip what is masked (:mod:`attnhub.mask_structure`). Only on the devices in
    ``STRUCTURED_MASK_DEVICES``: on a CPU, PyTorch's kernel (the one that serves there)
    takes the dense mask as fast as any other form. Only a mask with a row per query
    and a column per key is read (one broadcast over queries has no diagonal), and
    never while torch.compile traces (the structure depends on the values) or a CUDA
    graph is captured (reading values synchronizes, which capture forbids, and a plan
    made before would fix its derived key mask into the graph, blind to later writes
    into the captured mask).
    """
    plan = (
        None
        if attn_mask is None
        or _is_compiling()
        or not _reads_mask(query, key, attn_mask)
        or (attn_mask.is_cuda and _capturing())
        else recognize(attn_mask)
    )
    if plan is None:  # the mask as given
        return attn_mask, {"causal": is_causal, "alignment": "top_left", "window": None}
    return plan.attn_mask, {
        "causal": plan.causal,
        "alignment": plan.alignment,
        "window": plan.window,
    }


def _public_function() -> Callable[..., Any]:
    """The function a ``__torch_function__`` override receives as ``func``.

    PyTorch's function passes itself, which is what
    ``torch.nn.functional.scaled_dot_product_attention`` is when nothing is patched,
    and overrides compare ``func`` with that attribute (``CausalBias`` does:
    ``func is torch.nn.functional.scaled_dot_product_attention``). So they receive
    whatever the attribute holds now: the newest patch's function while patched,
    PyTorch's own once every patch is undone, also when the call came through a
    stale reference to an older replacement. An override that re-calls ``func``
    on unwrapped tensors therefore goes where a fresh call would.
    """
    return F.scaled_dot_product_attention


def _script_as_aten(function: Callable[..., Any]) -> None:
    """Make TorchScript compile calls to ``function`` as PyTorch's own op.

    ``torch.jit.script`` compiles Python functions it reaches, such as
    ``F.multi_head_attention_forward``, and would try to compile the replacement
    (which it cannot: keyword-only arguments, dispatch in Python). Registered as a
    builtin, it compiles to ``aten::scaled_dot_product_attention``: scripted code keeps
    PyTorch's function, patched or not, and a module scripted while patched is the
    same one scripted without the patch (TorchScript caches compiled classes for the
    process, so a failed compile would also have broken scripting after undo).

    TorchScript's table is keyed by ``id(function)``; the entry is removed when the
    function is collected, so that a later object with the same id is not taken for it.
    """
    import torch.jit._builtins as jit_builtins

    jit_builtins._register_builtin(function, "aten::scaled_dot_product_attention")
    weakref.finalize(function, _unregister_builtin, id(function))


def _unregister_builtin(function_id: int) -> None:
    import torch.jit._builtins as jit_builtins

    table = jit_builtins._builtin_table
    if table is not None:
        table.pop(function_id, None)
