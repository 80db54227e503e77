"""Input checks for :func:`attnhub.attention`.

Every message names the argument, what was expected and what came, so that bad input
fails here with a ``ValueError`` or ``TypeError`` and never reaches a kernel. The
checks read only metadata (shapes, dtypes, devices, option values), which is why the
dispatch cache may skip them for a call whose metadata it has seen before.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .request import ALIGNMENTS, AttentionParams, AttentionRequest, device_capability, seqlen_bucket

_TENSOR_NAMES = ("query", "key", "value")


class TensorMeta:
    """The metadata of a tensor, standing in for it where only metadata is read.

    Validation and request building read nothing else, so they accept either.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: torch.dtype,
        device: str | torch.device,
        requires_grad: bool,
    ) -> None:
        self.shape = torch.Size(shape)
        self._stride = tuple(stride)
        self.dtype = dtype
        self.device = torch.device(device)
        self.requires_grad = requires_grad

    def dim(self) -> int:
        return len(self.shape)

    def stride(self, dim: int | None = None) -> Any:
        return self._stride if dim is None else self._stride[dim]

    def numel(self) -> int:
        return self.shape.numel()


_TENSOR_TYPES = (torch.Tensor, TensorMeta)


def _shape(t: Any) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_tensors(query: Any, key: Any, value: Any, attn_mask: Any) -> None:
    """Types, ranks, dtypes, devices and shapes of the tensors (see contract.md, Errors)."""
    tensors = (query, key, value)
    for name, t in zip(_TENSOR_NAMES, tensors):
        if not isinstance(t, _TENSOR_TYPES):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
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
    bv, hv, nv, _ = value.shape
    if bk != b or bv != b:
        raise ValueError(
            f"batch sizes differ: query {_shape(query)}, key {_shape(key)}, value {_shape(value)}"
        )
    if hv != hkv:
        raise ValueError(f"key and value must have the same number of heads, got {hkv} and {hv}")
    if nv != nk:
        raise ValueError(f"key and value must have the same sequence length, got {nk} and {nv}")
    if dk != d:
        raise ValueError(f"query and key must have the same head dim D, got {d} and {dk}")
    if (hkv == 0 and hq != 0) or (hkv and hq % hkv):
        raise ValueError(
            f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
            "(grouped-query attention)"
        )
    if attn_mask is not None:
        check_mask(attn_mask, query, key)


def check_mask(attn_mask: Any, query: torch.Tensor, key: torch.Tensor) -> None:
    if not isinstance(attn_mask, _TENSOR_TYPES):
        raise TypeError(f"attn_mask must be None or a torch.Tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = may attend) or floating, got {attn_mask.dtype}"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    ok = attn_mask.dim() <= 4 and all(
        m in (1, t) for m, t in zip(reversed(attn_mask.shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"attn_mask of shape {_shape(attn_mask)} does not broadcast to (B, Hq, Nq, Nk) = "
            f"({', '.join(map(str, target))})"
        )


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_window(window: Any) -> tuple[int | None, int | None] | None:
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
        sides.append(int(value))
    return (sides[0], sides[1])


def make_params(
    query: torch.Tensor,
    *,
    causal: Any,
    alignment: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    dropout_p: Any,
    block_sparse: Any,
    return_lse: Any,
) -> AttentionParams:
    """Check the options and resolve them into :class:`AttentionParams`."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    dropout = _check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout}")
    if softcap is not None:
        softcap = _check_real("softcap", softcap)
        if softcap <= 0:
            raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if scale is None:
        d = query.shape[-1]
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    else:
        scale = _check_real("scale", scale)
    if block_sparse is not None:
        from .block_sparse import BlockSparseLayout

        if not isinstance(block_sparse, BlockSparseLayout):
            raise TypeError(
                f"block_sparse must be None or an attnhub.BlockSparseLayout, "
                f"got {type(block_sparse).__name__}"
            )
    return AttentionParams(
        causal=causal,
        alignment=alignment,
        window=_check_window(window),
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
    b, hq, nq, d = query.shape
    _, hkv, nk, _ = key.shape
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask)
    )
    if attn_mask is None:
        mask = "none"
    else:
        mask = "bool" if attn_mask.dtype == torch.bool else "float"
    return AttentionRequest(
        device_type=query.device.type,
        capability=device_capability(query.device),
        dtype=query.dtype,
        batch=b,
        heads_q=hq,
        heads_kv=hkv,
        seqlen_q=seqlen_bucket(nq),
        seqlen_k=seqlen_bucket(nk),
        same_seqlen=nq == nk,
        q_longer=nq > nk,
        head_dim=d,
        head_dim_v=value.shape[-1],
        mask=mask,
        mask_needs_grad=needs_grad and attn_mask is not None and attn_mask.requires_grad,
        causal=params.causal,
        # The alignment only matters where a diagonal does and the lengths differ;
        # normalizing it keeps backends that lack one alignment eligible elsewhere.
        alignment=params.alignment
        if (params.causal or params.window is not None) and nq != nk
        else "top_left",
        window=params.window is not None,
        softcap=params.softcap is not None,
        dropout=params.dropout_p > 0.0,
        needs_grad=needs_grad,
        deterministic=needs_grad and torch.are_deterministic_algorithms_enabled(),
        last_dim_contiguous=all(t.stride(-1) == 1 or t.shape[-1] <= 1 for t in (query, key, value)),
        block_sparse=params.block_sparse is not None,
        block_size=params.block_sparse.block_size if params.block_sparse is not None else None,
        return_lse=params.return_lse,
    )
