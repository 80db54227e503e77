"""``triton_flash``: attnhub's own FlashAttention-2 in Triton, forward and backward.

The whole contract lives in the kernels (kernels.py): any Nq/Nk, head dims 16..256
(padded inside the kernel), GQA/MQA by head index, causal in both alignments, window,
softcap, bool/float masks read through broadcast strides, dropout from Philox seeded
by PyTorch's generator, return_lse, fully masked rows as zeros, strided inputs. Extra
memory is O(N) (lse and delta); the backward computes dK/dV and dQ in separate passes
without atomics, so it is bitwise deterministic.

Triton is imported on first probe or call, never when attnhub is imported. With
``TRITON_INTERPRET=1`` in the environment (before the first call) the backend also
serves CPU tensors through Triton's interpreter: slow, for CI and machines without a
GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from attnhub.backend import Backend
from attnhub.request import AttentionParams, AttentionRequest, dtype_name


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_options(params: AttentionParams) -> dict[str, Any]:
    """The call's options as the ops' keyword arguments (``flash_attention`` and the
    block-sparse ``block_sparse_attention`` take the same ones)."""
    return {
        "causal": params.causal,
        "bottom_right": params.bottom_right,
        "window": params.window,
        "softcap": params.softcap,
        "scale": params.scale,
        "dropout_p": params.dropout_p,
    }


# The largest softcap (as the power of two at or above it) each dtype is served with.
# Half precision runs PTX tanh.approx.f32 on the GPU (common._tanh; relative error about
# 2**-11, the rounding float16 scores carry anyway). Float32 runs a series below
# |x| = 1/4 and 1 - 2 / (exp(2x) + 1) above it (relative error about 2**-22 over the
# whole range in the interpreter; the GPU's exp2 and division are approximate, a few
# ulp). Measured against the contract's tolerance in the interpreter
# (tests/test_triton_flash.py, test_the_largest_softcap_served_keeps_the_tolerance_in_
# the_gradients_too's cases, three seeds): float32 output and gradients within 0.2x the
# bound at every c from 16 to 2048 (the formula alone: 1.2-1.9x at 64, 3.5x at 128).
# float32 stops at 2**6, which covers the models' 30 and 50, until the GPU's largest-
# softcap tests have run a larger one. float16 0.13x at 16384.
_SOFTCAP_LOG2_LIMIT = {torch.float32: 6, torch.float16: 13, torch.bfloat16: 13}


class TritonFlash(Backend):
    name = "triton_flash"
    description = "attnhub's FlashAttention-2 in Triton (whole contract, deterministic backward)"
    # Run and checked on sm_90 (H200); older GPUs are not claimed until they are run.
    min_capability = (9, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (16, 256)
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    mask_grad = False
    causal_alignments = frozenset({"top_left", "bottom_right"})
    window = softcap = dropout = gqa = lse = True
    backward = lse_grad = True  # the backward takes the lse's gradient (ops.py)
    deterministic = True
    memory = "linear"
    # torch.compile(fullgraph=True) through attnhub.attention compiles with no graph break
    # and matches eager: on CPU (interpreter, aot_eager) and on the H200 (Inductor, plus
    # CUDA-graph capture: tests/test_triton_flash.py::test_gpu_compile_fullgraph_and_cuda_graph,
    # benchmarks/results/archive/gpu-compile-2026-11-30.log).
    compile_safe = True
    copies_strided = False
    # attnhub.attention_kvcache through the split-KV decode kernel (serving.py), which
    # also runs dense calls shaped like decoding (serving.decode_shaped);
    # attnhub.attention_varlen through the dense kernels' packed mode (packed.py).
    layouts = frozenset({"dense", "varlen", "kvcache", "paged"})

    @property  # type: ignore[override]
    def priority(self) -> int:  # type: ignore[override]
        # Under TRITON_INTERPRET=1 every launch runs in numpy (about 1 s for a 4x512x64
        # forward): rank below PyTorch's own kernels then, so that setting the variable
        # (for CI, or to debug another kernel) never slows down calls they can serve.
        return 0 if _interpreting() else 50

    @property  # type: ignore[override]
    def devices(self) -> frozenset[str]:  # type: ignore[override]
        # Read when dispatch asks, not at import: the interpreter adds CPU tensors.
        return frozenset({"cuda", "cpu"}) if _interpreting() else frozenset({"cuda"})

    def unavailable_reason(self) -> str | None:
        try:
            import triton  # noqa: F401
        except Exception as exc:
            return f"triton does not import: {type(exc).__name__}: {exc}"
        if not _interpreting() and not torch.cuda.is_available():
            return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if request.device_type == "cpu" and request.dtype == torch.bfloat16:
            # Seen with triton 3.6: tl.dot on bf16 returns values near 1e10 in the
            # interpreter (shared/gpu.md). Lift when the interpreter handles bf16.
            return ["bfloat16 is not reliable in Triton's CPU interpreter"]
        if not request.scale_in_log2_range and not request.softcap:  # (softcap: clamped)
            return [
                "|scale| above 2.36e38: the kernels' scores in log2 units (scale * log2 e) "
                "overflow float32 there, whatever q.k is"
            ]
        limit = _SOFTCAP_LOG2_LIMIT.get(request.dtype)
        if request.softcap_log2 is not None and limit is not None and request.softcap_log2 > limit:
            return [
                f"softcap above 2**{limit} in {dtype_name(request.dtype)}: the kernels' "
                "tanh is off by about 1e-7 near 0, softcap * 1e-7 in the scores, beyond "
                "the contract's tolerance there"
            ]
        if getattr(request, "layout", "dense") in ("kvcache", "paged"):
            from .serving import kvcache_reasons

            return kvcache_reasons(request)
        return []

    def forward_varlen(  # type: ignore[no-untyped-def]
        self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params
    ):
        from .packed import flash_attention_varlen

        out, lse = flash_attention_varlen(
            query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            return_lse=params.return_lse, causal=params.causal, bottom_right=params.bottom_right,
            window=params.window, softcap=params.softcap, scale=params.scale,
        )  # fmt: skip
        return (out, lse) if params.return_lse else out

    def forward_kvcache(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, seqlens_k, block_table, params
    ):
        from .serving import forward_kvcache

        return forward_kvcache(query, k_cache, v_cache, seqlens_k, block_table, params)

    def prepare(self, request: AttentionRequest, params: AttentionParams) -> Any:
        dense = super().prepare(request, params)
        from .serving import decode_shaped

        if not decode_shaped(request):
            return dense
        from torch.autograd import forward_ad

        from .serving import dense_decode_runner

        decode = dense_decode_runner(params)

        def runner(query, key, value, attn_mask):  # type: ignore[no-untyped-def]
            if forward_ad._current_level >= 0:  # dual tensors: the prefill path's autograd
                return dense(query, key, value, attn_mask)
            return decode(query, key, value, attn_mask)

        return runner

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        global _flash_attention, _key_ranges
        if _flash_attention is None:  # imports Triton: on the first call, not at import
            from . import key_ranges as _key_ranges
            from .ops import flash_attention as _flash_attention
        options = kernel_options(params)
        # A key padding mask runs as per-batch key ranges: no mask read, and the padded
        # key tiles skipped (key_ranges.py).
        ranges = None
        if attn_mask is not None:
            ranges = _key_ranges.ranges_of(attn_mask, query, key, value, params.dropout_p)
        if ranges is not None:
            del options["dropout_p"]
            out, lse = _key_ranges.flash_attention_key_ranges(
                query, key, value, ranges, return_lse=params.return_lse, **options
            )
        else:
            out, lse = _flash_attention(
                query, key, value, attn_mask, return_lse=params.return_lse, **options
            )
        return (out, lse) if params.return_lse else out


_flash_attention: Any = None
_key_ranges: Any = None
