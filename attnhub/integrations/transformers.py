"""Hugging Face transformers: ``attn_implementation="attnhub"``.

Usage::

    from attnhub.integrations.transformers import register
    register()                                   # once; idempotent
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnhub")
    # or, on a loaded model: model.set_attn_implementation("attnhub")

:func:`register` adds an attention function to transformers' ``AttentionInterface``
and a mask function to its ``AttentionMaskInterface`` under the same name (both are
needed: transformers builds no mask at all for an implementation without a mask
function). The other route, :func:`attnhub.patch`, needs no registration and serves
models running transformers' ``"sdpa"`` implementation.

What reaches attnhub
    - Grouped-query attention natively (key/value are never repeated).
    - Causality as ``causal=True`` when transformers needs no mask (no padding);
      otherwise transformers' boolean (B, 1, Nq, Nk) mask, True = attend.
    - Sliding windows (Mistral, Qwen2, Gemma, ...): transformers' ``sliding_window=W``
      keeps keys with ``kv_idx > q_idx - W``, which is ``window=(W - 1, 0)`` with
      ``causal=True``. Without padding, the mask function hands the window to attnhub
      as ``window`` (no mask is built) during prefill/training (Nq == Nk) and during
      decoding (Nq == 1) when the query is the newest key; otherwise (padding, static
      caches, chunked prefill) the window is part of the boolean mask.
    - ``scaling`` as ``scale``, ``dropout`` as ``dropout_p``, ``softcap`` (Gemma 2)
      as ``softcap``, ``position_bias`` (T5-style) folded into a float mask.
    - Attention sinks (``s_aux``, GPT-OSS: one learned logit per query head that joins
      each row's softmax and carries no value) from the call's lse: the sink turns the
      row's normalizer Z into Z + e^s, so the output is ``out * sigmoid(lse - s)``;
      a fully masked row stays zeros, as with the eager sink (its weight all on the sink).
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from ..api import attention
from ..dispatch import normalize_backend_arg

__all__ = ["attention_forward", "mask", "register"]


def _sliding_window_verified(mask_function: Callable[..., Any], window: int) -> bool:
    """Whether ``mask_function`` is exactly transformers' sliding-window causal mask.

    ``local_size`` is also passed for chunked attention, so the function is probed on
    a few query rows around the window's size (chunked and sliding masks differ there).
    The probe runs on the CPU: on the model's GPU its dozen small ops (an upload, the
    launches, a synchronization for the answer) cost every decoding step of a windowed
    model well over a hundred microseconds. A function that closes over device tensors
    (a chunked mask's padding) fails there or answers on its device: not a pure
    window, so no. The answer is kept per function shape (:func:`_function_shape`):
    transformers builds a new closure, alike, at every step.
    """
    shape = _function_shape(mask_function)
    if shape is not None and (shape, window) in _VERIFIED:
        return _VERIFIED[shape, window]
    q_idx = torch.tensor([0, window - 1, window, window + 1, 2 * window])
    kv_idx = torch.arange(2 * window + 1)
    zero = torch.zeros(1, dtype=torch.long)
    try:
        got = mask_function(
            zero[:, None, None, None], zero[None, :, None, None], q_idx[None, None, :, None],
            kv_idx[None, None, None, :],
        )  # fmt: skip
    except Exception:  # a custom function that cannot take index tensors
        return False
    q, k = q_idx[:, None], kv_idx[None, :]
    expected = (k <= q) & (k > q - window)
    verified = (
        isinstance(got, torch.Tensor)
        and got.device.type == "cpu"
        and got.numel() == expected.numel()
        and bool(torch.equal(got.reshape(expected.shape), expected))
    )
    if shape is not None:
        if len(_VERIFIED) >= _VERIFIED_MAX:
            _VERIFIED.clear()
        _VERIFIED[shape, window] = verified
    return verified


_VERIFIED: dict[tuple[Any, int], bool] = {}
_VERIFIED_MAX = 256
_SCALARS = (bool, int, float, str, type(None))


def _function_shape(fn: Any, depth: int = 0) -> Any:
    """What decides a mask function's answer, as a hashable value: its code, defaults
    and closure values, closed-over functions (and tuples of them, as ``and_masks``
    keeps) by their own shape; None where a closure holds anything else (a tensor's
    values are not part of the key) or the nesting is deeper than a few levels. Two
    functions of one shape compute the same mask (module globals aside)."""
    code = getattr(fn, "__code__", None)
    if code is None or depth > 6 or getattr(fn, "__kwdefaults__", None):
        return None
    defaults = _value_shape(fn.__defaults__ or (), depth)
    if defaults is None:
        return None
    parts: list[Any] = [code, defaults]
    for cell in fn.__closure__ or ():
        try:
            parts.append(_value_shape(cell.cell_contents, depth))
        except ValueError:  # an empty cell
            return None
        if parts[-1] is None:
            return None
    return tuple(parts)


def _value_shape(value: Any, depth: int) -> Any:
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, tuple):
        shapes = tuple(_value_shape(v, depth) for v in value)
        return None if None in shapes else ("tuple", shapes)
    if callable(value):
        return _function_shape(value, depth + 1)
    return None


# Masks built since attnhub's attention function last ran, by model type (any thread;
# only attention_forward resets them, so other threads can only delay the error, never
# cause it, and one model type's count never counts against another's).
# transformers 5 accepts attn_implementation="attnhub" for every model, also for those
# that never look their attention function up (BLOOM, XGLM, MPT, ...): they still build
# their mask through mask() and then add attnhub's boolean mask to their scores as if it
# were additive, silently wrong. A model that uses the interface calls attention_forward
# after its one to three masks of a forward pass; MASKS_WITHOUT_ATTENTION in a row can
# only be a model that does not.
MASKS_WITHOUT_ATTENTION = 8
_masks_since_attention: dict[str, int] = {}
# The names register() gave attnhub's pair of functions: a config naming another
# implementation (this mask function paired with someone else's attention) is not counted.
_registered: set[str] = set()


# Of a model's config (by identity; a weak reference says the object is still the
# same): whether the model building masks with it has attention code that looks
# attention functions up in transformers' interface (None: its model was not found).
_uses_interface: dict[int, tuple[Any, bool | None]] = {}
_MAX_USES_INTERFACE = 64
# The names a modeling module imports to look attention functions up by
# attn_implementation (transformers' own modules the first; remote code may make its
# own interface instance); modules of models that never do (BLOOM, MPT, XGLM) lack both.
_INTERFACE_NAMES = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")


# What a model that does not use the interface can do instead (both stops say it).
_REMEDY = (
    "Load it with attn_implementation='eager', or 'sdpa' where transformers offers that "
    "for it (attnhub.patch() then serves its F.scaled_dot_product_attention calls)."
)


def _check_mask_use(config: Any) -> None:
    """Stop a model that would read attnhub's mask with its own attention code.

    First, by the model itself, before its first mask is handed over: the model whose
    forward builds the mask (found on the call stack, holding this config) is checked
    once for a module whose code looks attention functions up in transformers'
    interface; a model with none (BLOOM, MPT, XGLM in transformers 5.25) would add the
    boolean mask to its scores, or mask the kept keys, silently wrong. Where the model
    is not found, the masks built with no attention call between them are counted.
    """
    if getattr(config, "_attn_implementation", None) not in _registered:
        return
    model = str(getattr(config, "model_type", None) or "this model")
    if _model_uses_interface(config) is False:
        raise RuntimeError(
            f"attn_implementation='attnhub': {model}'s attention code does not use "
            "transformers' attention interface: it would run its own attention with "
            "attnhub's boolean mask read as its own kind of mask, and its outputs would be "
            "wrong. " + _REMEDY
        )
    count = _masks_since_attention.get(model, 0) + 1
    _masks_since_attention[model] = count
    if count > MASKS_WITHOUT_ATTENTION:
        _masks_since_attention.pop(model, None)
        raise RuntimeError(
            f"attn_implementation='attnhub': {count} attention masks were built for "
            f"{model} and its attention never called attnhub: it does not use "
            "transformers' attention interface, so its own attention code ran with "
            "attnhub's boolean mask read as an additive one, and its outputs were wrong. " + _REMEDY
        )


def _model_uses_interface(config: Any) -> bool | None:
    """Whether the model building a mask with ``config`` has a module defined where
    transformers' attention interface is looked up; None where no module holding this
    config is found among its callers (kept per config object)."""
    kept = _uses_interface.get(id(config))
    if kept is not None and kept[0]() is config:
        return cast("bool | None", kept[1])
    verdict: bool | None = None
    frame: Any = sys._getframe(2)
    for _ in range(16):  # transformers' mask builders, then the model's forward
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and getattr(owner, "config", None) is config:
            modules = {type(m).__module__ for m in owner.modules()}
            verdict = any(
                interface in vars(sys.modules[name])
                for name in modules
                if name in sys.modules
                for interface in _INTERFACE_NAMES
            )
            break
        frame = frame.f_back
    try:
        reference = weakref.ref(config)
    except TypeError:  # not weakly referenceable: decided again next time
        return verdict
    if len(_uses_interface) >= _MAX_USES_INTERFACE:
        _uses_interface.clear()
    _uses_interface[id(config)] = (reference, verdict)
    return verdict


def mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask function for attnhub: ``sdpa_mask``, plus windows as data.

    Returns None where :func:`attention_forward` can say the pattern with ``causal``
    and ``window`` (see the module docstring), else ``sdpa_mask``'s boolean mask
    (B, 1, Nq, Nk), True = attend (or its None when it needs none).
    """
    from transformers.masking_utils import (
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )

    if not torch.compiler.is_compiling():
        _check_mask_use(kwargs.get("config"))
    if mask_function is None:
        mask_function = causal_mask_function
    if (
        # Reading the mask's values would break a torch.compile graph.
        not torch.compiler.is_compiling()
        and local_size is not None
        and allow_is_causal_skip
        and isinstance(q_offset, int)
        # The query rows are the newest keys (bottom-right), and Nq == Nk (where
        # top-left and bottom-right coincide) or Nq == 1 (decoding).
        and q_offset + q_length == kv_offset + kv_length
        and (q_length == kv_length or q_length == 1)
    ):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is not None:
            padding = padding[:, kv_offset : kv_offset + kv_length]
        if (padding is None or bool(padding.all())) and _sliding_window_verified(
            mask_function, local_size
        ):
            return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=allow_is_causal_skip,
        **kwargs,
    )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    backend: str | Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for attnhub.

    Shapes: query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D); returns
    ``(output (B, Nq, Hq, Dv), None)`` (attention weights are never materialized).
    """
    if _masks_since_attention:
        _masks_since_attention.clear()
    if kwargs.get("output_attentions"):
        # As transformers' sdpa and flash functions do: say so, rather than hand back
        # None silently (the model's `attentions` then holds no weights).
        warnings.warn(
            "attnhub attention does not return attention weights (output_attentions=True); "
            "set attn_implementation='eager' to get them",
            UserWarning,
            stacklevel=2,
        )
    sinks: torch.Tensor | None = kwargs.get("s_aux")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"s_aux must be a tensor or None, got {type(sinks).__name__}")
        if sinks.shape != (query.shape[1],):
            raise ValueError(
                f"s_aux must hold one sink logit per query head, shape ({query.shape[1]},); "
                f"got {tuple(sinks.shape)}"
            )
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(is_causal) and attention_mask is None and q_length > 1
    window = None
    alignment = "top_left"
    if attention_mask is None and sliding_window is not None and is_causal:
        # No mask: either mask() left the window to us, or transformers found it
        # irrelevant (every key within it). Decoding aligns the query with the newest key.
        window = (sliding_window - 1, 0)
        alignment = "bottom_right" if q_length == 1 else "top_left"
    if position_bias is not None:
        if attention_mask is None:
            attention_mask = position_bias
            if causal:
                keep = torch.ones(q_length, key.shape[2], dtype=torch.bool, device=query.device)
                attention_mask = attention_mask.masked_fill(~keep.tril(), float("-inf"))
                causal = False
        elif attention_mask.dtype == torch.bool:
            attention_mask = position_bias.masked_fill(~attention_mask, float("-inf"))
        else:
            attention_mask = position_bias + attention_mask
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    # One call with the options written out: this is every Hugging Face attention call's
    # hot path (a dict of options unpacked into it cost ~300 ns a call on the dev CPU).
    out = attention(
        query, key, value, attention_mask,
        causal=causal, alignment=alignment, window=window, softcap=softcap, scale=scaling,
        dropout_p=dropout, backend=backend, return_lse=sinks is not None,
    )  # fmt: skip
    if isinstance(out, tuple):  # the sinks' call, with its lse
        out, lse = out
        kept = torch.sigmoid(lse - cast(torch.Tensor, sinks).float()[:, None])  # Z / (Z + e^s)
        out = (out.float() * kept[..., None]).to(out.dtype)  # in float32, as the lse is
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "attnhub", backend: str | Sequence[str] | None = None) -> str:
    """Register attnhub with transformers as ``attn_implementation=name``; returns the name.

    ``backend`` restricts/orders attnhub's backends for this implementation (another
    name, e.g. ``register("attnhub_triton", backend="triton_flash")``, can hold another
    choice; transformers reads any name containing "flash", "sdpa" or "flex" as a
    request for its own kernels of that kind). Registering the same name again replaces
    it. Needs transformers >= 4.48.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = normalize_backend_arg(backend)
    function: Callable[..., Any] = attention_forward
    if names is not None:
        function = functools.partial(attention_forward, backend=names)
        functools.update_wrapper(function, attention_forward)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, mask)
    _registered.add(name)
    return name
