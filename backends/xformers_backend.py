"""``xformers``: ``xformers.ops.memory_efficient_attention``, for comparison.

xformers takes (B, N, H, D) tensors, so the backend passes transposed views of
attnhub's (B, H, N, D) inputs (no copy where xformers accepts the strides) and
transposes the output back. Grouped-query attention uses xformers' 5-D form
(B, N, G, H, D), with key/value expanded by a stride-0 view, never repeated in memory.

Whether xformers has a kernel for a call is xformers' own business: the backend asks
xformers' dispatcher once per request and quotes its reasons when it has none (for
example, a CPU-only machine where the PyPI wheel has no CUDA kernels).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

import torch

from attnhub.backend import Backend
from attnhub.request import AttentionRequest


@contextlib.contextmanager
def _quiet(sink: io.StringIO | None = None) -> Any:
    """xformers prints build warnings on import; keep them out of the user's output."""
    sink = sink if sink is not None else io.StringIO()
    logger = logging.getLogger("xformers")
    handler = logging.StreamHandler(sink)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# What xformers printed when it was first imported: its own account of missing kernels.
_import_messages: list[str] = []


def _import_xformers() -> Any:
    sink = io.StringIO()
    with _quiet(sink):
        import xformers.ops as xops

    if sink.getvalue():
        _import_messages.append(sink.getvalue())
    return xops


class XFormers(Backend):
    name = "xformers"
    description = "xformers.ops.memory_efficient_attention (comparison)"
    priority = 5
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (8, 256)
    causal_alignments = frozenset({"top_left", "bottom_right"})
    gqa = True
    backward = True
    memory = "linear"
    copies_strided = True

    def unavailable_reason(self) -> str | None:
        try:
            _import_xformers()
        except Exception as exc:
            return f"xformers does not import: {type(exc).__name__}: {exc}"
        import xformers

        if not getattr(xformers, "_has_cpp_library", True):
            said = " ".join(" ".join(_import_messages).split())
            return "xformers has no compiled kernels here" + (
                f" (xformers: {said[:300]})" if said else ""
            )
        if not torch.cuda.is_available():
            return "CUDA is not available (xformers' attention kernels are CUDA-only)"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        """Ask xformers' dispatcher whether it has a kernel, on tiny tensors like the call's."""
        if request.causal and request.q_longer and request.alignment == "bottom_right":
            return ["bottom-right causal with Nq > Nk leaves rows with no key"]
        if not request.scale_positive:
            # Not run (no xformers on the H200): xformers sends fp16/bf16 calls to
            # FlashAttention-2 first, whose kernels in PyTorch's build give NaN for every
            # scale <= 0 there (torch_sdpa_flash); no promise is made for it.
            return ["scale <= 0 is not known to work in xformers' FlashAttention-2 kernels"]
        if request.needs_grad and request.heads_q != request.heads_kv:
            # Seen on the H200 (xformers 0.0.35,
            # benchmarks/results/archive/gpu-check-2026-11-30-run2.json): gradients through
            # the grouped 5-D form fail the conformance tolerance.
            return ["the backward of xformers' grouped-query (5-D) form is not conformant"]
        xops = _import_xformers()
        from xformers.ops.fmha import Inputs
        from xformers.ops.fmha.dispatch import _dispatch_fw

        device = torch.device(request.device_type)
        q = torch.empty(1, 4, request.heads_q, request.head_dim, device=device, dtype=request.dtype)
        kv = torch.empty(
            1, 4, request.heads_q, request.head_dim, device=device, dtype=request.dtype
        )
        bias = _causal_bias(xops, request.alignment) if request.causal else None
        try:
            with _quiet():
                _dispatch_fw(Inputs(q, kv, kv, attn_bias=bias), request.needs_grad)
        except NotImplementedError as exc:
            lines = [line.strip() for line in str(exc).splitlines()[5:] if line.strip()]
            return ["xformers has no kernel: " + " ".join(lines)[:400]]
        return []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        xops = _import_xformers()
        bias = _causal_bias(xops, params.alignment) if params.causal else None
        b, hq, nq, d = query.shape
        hkv = key.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if hkv != hq:
            group = hq // hkv
            q = q.reshape(b, nq, hkv, group, d)
            k = k.unsqueeze(3).expand(-1, -1, -1, group, -1)
            v = v.unsqueeze(3).expand(-1, -1, -1, group, -1)
        out = xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=params.scale)
        return out.reshape(b, nq, hq, value.shape[-1]).transpose(1, 2)


def _causal_bias(xops: Any, alignment: str) -> Any:
    from xformers.ops.fmha import attn_bias

    if alignment == "bottom_right":
        return attn_bias.LowerTriangularFromBottomRightMask()
    return attn_bias.LowerTriangularMask()
