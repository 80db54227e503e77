"""``flex_attention``: PyTorch's FlexAttention behind attnhub.

contract.md's features become FlexAttention's two hooks:

- ``mask_mod`` (which keys a query may see; it also builds the ``BlockMask`` that lets
  the kernel skip whole blocks): causal in both alignments, the window, and a bool
  ``attn_mask`` read from the captured tensor;
- ``score_mod`` (how a kept score changes): the softcap, then a float ``attn_mask``
  added from the captured tensor, in contract.md's order (FlexAttention has already
  applied ``scale``).

Grouped-query attention is ``enable_gqa=True``; the log-sum-exp comes from the kernel
(natural log, -inf on rows with no key). Not offered, and declared so: dropout
(FlexAttention has none, pytorch/pytorch#141784), a gradient for a float mask, and
float64.

How it runs: on CUDA through ``torch.compile(flex_attention, dynamic=False)``, the
fused Triton kernel (memory linear in N). Each new shape compiles once; the dynamo
cache limits are raised so that a run with many shapes neither falls back to a slower
dynamic-shape kernel nor, after eight shapes, to the eager path (see
shared/perf/anchors-h200.md). On CPU the compiled kernel serves only inference without
the lse ("torch.compile on CPU only supports inference and `return_lse` is not
supported yet"), so the CPU path is FlexAttention's eager implementation, which
materializes the scores (memory quadratic there, declared so per call) and has no
backward ("FlexAttention does not support backward on CPU"), so CPU calls that need
gradients are refused.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from attnhub import AttentionParams, AttentionRequest, Backend, hookimpl
from attnhub.registry import BackendRegistry

__all__ = ["FlexAttention", "attnhub_register_backends"]

# Above the number of distinct shapes a benchmark or a model's run sees.
_DYNAMO_CACHE_LIMIT = 256


def _flex_module() -> Any:
    from torch.nn.attention import flex_attention as flex

    return flex


@functools.cache
def _compiled_flex() -> Any:
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):  # fmt: skip
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _DYNAMO_CACHE_LIMIT))
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _index(sizes: torch.Size, *indices: Any) -> tuple[Any, ...]:
    """Index a captured (broadcast) mask: dimensions of size 1 are read at 0."""
    return tuple(i if n > 1 else 0 for n, i in zip(sizes, indices, strict=True))


def _mods(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, params: AttentionParams
) -> tuple[Any, Any]:
    """(mask_mod or None, score_mod or None) for the call."""
    nq, nk = query.shape[2], key.shape[2]
    offset = nk - nq if params.bottom_right else 0
    conditions = []
    if params.causal:
        conditions.append(lambda b, h, q, k: k <= q + offset)
    if params.window is not None:
        left, right = params.window
        if left is not None:
            conditions.append(lambda b, h, q, k: k >= q + offset - left)
        if right is not None:
            conditions.append(lambda b, h, q, k: k <= q + offset + right)
    bool_mask = float_mask = None
    if attn_mask is not None:
        m = _as_4d(attn_mask)
        # Index broadcast dimensions at 0 so the captured tensor keeps its own size.
        sizes = m.shape
        if m.dtype == torch.bool:
            bool_mask = m
            conditions.append(lambda b, h, q, k: bool_mask[_index(sizes, b, h, q, k)])
        else:
            float_mask = m
    mask_mod = None
    if conditions:

        def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
            keep = conditions[0](b, h, q, k)
            for condition in conditions[1:]:
                keep = keep & condition(b, h, q, k)
            return keep

    score_mod = None
    if params.softcap is not None or float_mask is not None:
        cap = params.softcap
        fm = float_mask
        fsizes = None if fm is None else fm.shape

        def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if fm is not None:
                assert fsizes is not None
                score = score + fm[_index(fsizes, b, h, q, k)].to(score.dtype)
            return score

    return mask_mod, score_mod


class FlexAttention(Backend):
    name = "flex_attention"
    description = "torch.nn.attention.flex_attention (compiled on CUDA, eager on CPU)"
    priority = 15
    devices = frozenset({"cpu", "cuda"})
    min_capability = (8, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (16, 256)  # the kernel: "embedding dimension ... at least 16"
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    window = softcap = gqa = lse = True
    backward = True
    memory = "linear"
    compile_safe = True
    copies_strided = False

    def unavailable_reason(self) -> str | None:
        try:
            _flex_module()
        except Exception as exc:
            return f"torch.nn.attention.flex_attention does not import: {type(exc).__name__}: {exc}"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if request.device_type == "cpu" and request.needs_grad:
            # FlexAttention's own words: "FlexAttention does not support backward on CPU".
            return ["FlexAttention has no backward on CPU"]
        if request.device_type == "cuda" and request.head_dim & (request.head_dim - 1):
            # The compiled kernel pads D to a power of two in recent releases only.
            return [f"head_dim={request.head_dim} is not a power of two (compiled kernel)"]
        return []

    def memory_class(self, request: AttentionRequest) -> str:
        return "quadratic" if request.device_type == "cpu" else "linear"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        flex = _flex_module()
        b, hq, nq, _ = query.shape
        nk = key.shape[2]
        mask_mod, score_mod = _mods(query, key, attn_mask, params)
        block_mask = None
        if mask_mod is not None:
            block_mask = flex.create_block_mask(mask_mod, b, hq, nq, nk, device=query.device)
        kwargs: dict[str, Any] = {
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": params.scale,
            "enable_gqa": hq != key.shape[1],
        }
        if params.return_lse:
            kwargs["return_aux"] = flex.AuxRequest(lse=True)
        if query.device.type == "cuda":
            result = _compiled_flex()(query, key, value, **kwargs)
        else:
            with warnings.catch_warnings():
                # "flex_attention called without torch.compile()": on purpose, see above.
                warnings.simplefilter("ignore", UserWarning)
                result = flex.flex_attention(query, key, value, **kwargs)
        if params.return_lse:
            out, aux = result
            return out, aux.lse.float()
        return result


@hookimpl
def attnhub_register_backends(registry: BackendRegistry) -> None:
    registry.add(FlexAttention())
