"""triton_flash's dense calls whose bool mask is key padding, run as key ranges.

A model's padding mask (Hugging Face's, after :mod:`attnhub.mask_structure` has taken
the causal or window structure out of it, or a (B, 1, 1, Nk) mask passed as it is, to a
call of more query rows than the decode kernel takes: serving.decode_shaped)
says, for each batch entry, which keys every query row may see; where those keys are
one contiguous run (right or left padding), the call is the dense call restricted to
keys lo_b .. hi_b - 1. The kernels then run in their key-range mode (kernels'
glossary, "Key ranges"): no mask is read, and the key tiles outside the run are never
visited, where the mask path reads a mask tile and computes every tile (seen on the
H200, the workload bench's padding call, B8 Hq32/Hkv8 N4096 causal, lengths 512..4096:
17.2 ms forward with the mask, 1.88 ms as key ranges, 6.8 ms for PyTorch's SDPA;
benchmarks/results/archive/workloads-padding-h200-2026-12-02-953f2b6.md).

What qualifies (:func:`ranges_of`): a bool mask of shape (1 or B, 1, 1, Nk) whose True
entries form one run per batch entry (an empty run too: every row then has no key and
gets zeros, lse -inf, as the contract says), in an eager call outside CUDA-graph
capture; reading the runs costs one device synchronization per mask tensor
(:mod:`attnhub.mask_rows`, shared with torch_sdpa's reading of the same mask), kept while
the tensor lives unchanged (:class:`attnhub.tensor_memo.TensorMemo`), so the layers of
one forward pass pay it once (under ``torch.inference_mode``, where tensors keep no
version counter, the memo compares a snapshot, or knows attnhub's own key mask by
identity). Dropout calls keep the mask path (its random stream is
indexed by the dense key positions). Anything else (per-head or per-row masks, holes
in the run, tracing) runs with the mask as given.
"""

from __future__ import annotations

import torch

from attnhub.eager import keeps_tensors
from attnhub.mask_rows import row_keys
from attnhub.tensor_memo import TensorMemo

from .ops import (
    _aligned,
    _bwd_full,
    _forward,
    _lookup,
    _plan_key,
    apply_direct,
    backward_plan_key,
    call_scalars,
)

_memo: TensorMemo[torch.Tensor | None] = TensorMemo()


def _runs(mask: torch.Tensor) -> torch.Tensor | None:
    """int32 (mb, 2) [first, end) of each row's True run of a (mb, 1, 1, Nk) bool mask,
    or None where a row's True entries are not one run ((0, 0) for a row of none): one
    synchronization, kept with the mask (:mod:`attnhub.mask_rows`)."""
    rows = row_keys(mask)
    if not rows.runs:
        return None
    return torch.stack([rows.first, rows.end], 1).to(torch.int32)


def ranges_of(
    mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float
) -> torch.Tensor | None:
    """The int32 (B, 2) key ranges that ``mask`` (4-D, as the backend receives it) means
    for a call on q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D/Dv), or None (module
    docstring)."""
    if mask.dtype != torch.bool or dropout_p > 0.0 or mask.dim() != 4:
        return None
    batch, nk = q.shape[0], k.shape[2]
    mb, mh, mq, mk = mask.shape
    if mh != 1 or mq != 1 or mk != nk or mb not in (1, batch) or nk == 0:
        return None
    if not keeps_tensors(mask, q, k, v):
        return None
    runs = _memo(mask, _runs)
    if runs is None:
        return None
    return runs.expand(batch, 2).contiguous() if mb != batch else runs


# Eager CUDA calls reuse cached launch plans as the dense calls do (ops._PLANS): the
# ranges are a per-call tensor of the plan (the kernels' CuK argument), never a recorded
# one, and only their 16-byte alignment enters the key: no launch argument depends on
# their values (the kernels read them), so one plan serves every padding of a shape.
# Both functions run inside DirectAttention or apply_direct, with wrap_triton off.


def _fwd(q, k, v, mask, seed, ranges, *scalars, store_lse=True):  # type: ignore[no-untyped-def]
    """(out, lse or None, None): the forward in key-range mode (no mask: no row stats)."""
    key = _plan_key("fwd_ranges", q, k, v, None, None, scalars, store_lse, _aligned(ranges))
    plan, key = _lookup(key)
    if plan is not None:
        return plan(q, k, v, None, None, ranges)
    return _forward(q, k, v, None, None, scalars, store_lse, key, key_ranges=ranges)


def _bwd(dout, q, k, v, mask, seed, ranges, out, lse, dlse, *scalars):  # type: ignore[no-untyped-def]
    """(dq, dk, dv): DirectAttention's backward in key-range mode."""
    key = backward_plan_key("bwd_ranges", dout, q, k, v, None, None, out, lse, dlse, scalars,
                            _aligned(ranges))  # fmt: skip
    plan, key = _lookup(key)
    if plan is not None:
        return plan(dout, q, k, v, None, None, out, lse, dlse, ranges)
    return _bwd_full(dout, q, k, v, None, None, out, lse, dlse, scalars, key, key_ranges=ranges)


def flash_attention_key_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ranges: torch.Tensor,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense attention over keys ``ranges[b, 0] .. ranges[b, 1] - 1`` of each batch entry,
    differentiable: shapes and options as :func:`.ops.flash_attention` (no dropout), the
    same answer as that call with the key mask the ranges stand for. ``ranges``: as
    :func:`ranges_of` gives them, int32 (B, 2) contiguous on q's device with
    0 <= lo <= hi <= Nk (the values are the caller's to vouch for: they are not read
    on the host)."""
    if ranges.dtype != torch.int32 or ranges.shape != (q.shape[0], 2) or not ranges.is_contiguous():
        raise ValueError(
            f"ranges: expected a contiguous int32 ({q.shape[0]}, 2) tensor, got "
            f"{ranges.dtype} {tuple(ranges.shape)} strides {ranges.stride()}"
        )
    if ranges.device != q.device:
        raise ValueError(f"ranges: on {ranges.device}, expected q's device {q.device}")
    _, scalars = call_scalars(q, causal, bottom_right, window, softcap, scale, 0.0)
    out, lse = apply_direct(_fwd, _bwd, (ranges,), q, k, v, scalars, return_lse)
    return out, (lse if return_lse else None)
