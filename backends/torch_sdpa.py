"""PyTorch's own fused attention: ``torch_sdpa`` and one backend per CUDA kernel.

``torch_sdpa`` calls ``F.scaled_dot_product_attention`` and lets PyTorch pick its
kernel. ``torch_sdpa_flash``, ``torch_sdpa_efficient`` and ``torch_sdpa_cudnn`` pin
one kernel each by calling its ATen op directly: that costs nothing per call (the
``sdpa_kernel`` context costs 25-70 us, see anchors-h200.md), PyTorch's autograd
formulas for those ops still give the backward, and the ops return the log-sum-exp.
Each declares the constraints PyTorch enforces for its kernel, so dispatch never hands
it a call it would reject or quietly route to the math kernel.

What no kernel here offers (window, softcap) is declared unsupported. Bottom-right
causal, which ``F.scaled_dot_product_attention`` lacks, is served by the flash op
natively (FlashAttention-2 aligns bottom-right), and by ``torch_sdpa`` through an
explicit mask (declared memory-quadratic for those calls).

Where a PyTorch kernel breaks the contract, the backend routes around it or declines
the call, with the reason in ``explain()`` (see ``_CPU_VECTOR_KEYS`` and
``TorchSDPA.extra_reasons``).
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from attnhub.backend import FLOAT_DTYPES, Backend, Runner
from attnhub.eager import keeps_tensors
from attnhub.mask_rows import known_row_keys
from attnhub.mask_values import clamp_beyond_log2_range
from attnhub.request import AttentionParams, AttentionRequest

from .torch_reference import keep_mask

_HALF = frozenset({torch.float16, torch.bfloat16})
# PyTorch's own function (what F.scaled_dot_product_attention is until something
# replaces it), bound here so that a runner never goes through a replacement:
# attnhub.patch()'s, which would pass the call back here (a Python frame and its
# checks, a few us a call), or dispatch it again when the runner is reached from
# attnhub.attention outside a patched call.
_SDPA = torch._C._nn.scaled_dot_product_attention
_MATH = torch._scaled_dot_product_attention_math


def _math_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA's math kernel, called as SDPA is (see _float_mask_backward_on_cpu)."""
    return _MATH(query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale,
                 enable_gqa=enable_gqa)[0]  # fmt: skip


def _float_mask_backward_on_cpu(request: AttentionRequest) -> bool:
    """A CPU call with a float mask and a backward: served by SDPA's math kernel.

    PyTorch's CPU flash kernel (which SDPA picks for a 2-D or 4-D mask; every backend is
    handed a 4-D one) stores one log-sum-exp per row, and its backward recomputes the
    weights as exp(s - lse). A row whose every key a model's additive mask hides with
    torch.finfo(dtype).min has scores of about -3.4e38, where the lse loses the row's
    log(Nk): the forward's weights are 1 / Nk, the backward's 1, and the gradients were
    3-9 from the float64 reference (tests/test_builtin_backends.py). The math kernel
    differentiates its softmax's own output. It holds the (B, H, Nq, Nk) weights: a
    quadratic memory class (memory_class)."""
    return request.device_type == "cpu" and request.mask == "float" and request.needs_grad


def _combined_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> torch.Tensor | None:
    """Fold causal into ``attn_mask`` when SDPA's ``is_causal`` cannot express it."""
    keep = keep_mask(query.shape[2], key.shape[2], params, query.device)
    if attn_mask is None:
        return keep
    if keep is None:
        return attn_mask
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


# PyTorch's CPU flash kernel (torch 2.13, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
# has two flaws that break the contract, seen here in every float dtype:
#
# - Without a mask, it takes each row's maximum with a vector max, which keeps a NaN,
#   over whole SIMD vectors of keys, and with std::max, which drops one, over the rest.
#   Where Nk is shorter than one vector, a row whose every kept score is NaN (a NaN
#   query row; a NaN key that is a causal row's only key) gets a maximum of -inf and is
#   taken for fully masked: zeros instead of NaN. (At Nk >= one vector, a vector holds
#   the NaN, and longer rows start with a whole vector.) With a mask, the maximum is a
#   vector max throughout: so calls with fewer keys than the widest vector (16 floats
#   in AVX-512; 8 doubles) get one, all zeros ((1, Nk): linear memory), or causal
#   folded into an (Nq, Nk <= 16) one.
# - With is_causal, it fills the scores above the diagonal with -inf *before* scaling
#   them: a scale <= 0 turns them into +inf or NaN, and every output into NaN. (An
#   explicit mask is added after the scaling.) Such calls are declined (extra_reasons).
_CPU_VECTOR_KEYS = 16


def _short_keys_on_cpu(request: AttentionRequest) -> bool:
    """A CPU call without a mask whose rows may fit in the kernel's scalar remainder (it
    gets an explicit mask; see _CPU_VECTOR_KEYS). The bucket is exact here: Nk <= 16."""
    return (
        request.device_type == "cpu"
        and request.mask == "none"
        and request.seqlen_k <= _CPU_VECTOR_KEYS
    )


def _sums_in_half(request: AttentionRequest) -> bool:
    """A float16/bfloat16 call with a backward, off CUDA: PyTorch's CPU kernel (torch
    2.13) rounds its gradient sums in the inputs' dtype, which left the contract's
    tolerance in drawn cases (tests/test_builtin_backends.py): a group's dK/dV with
    enable_gqa by up to 1.5x; without groups, dV summed over hundreds of rows 1.04-1.3x,
    dK nonzero where a single key makes it exactly 0, one row's dQ 1.6x (about one in
    twelve drawn calls with at most 16 keys, one in forty with more). Such calls run in
    float32, cast back: one rounding of each gradient, and no repeated K/V."""
    return (
        request.device_type != "cuda"
        and request.needs_grad
        and request.dtype in (torch.float16, torch.bfloat16)
    )


def _uses_is_causal(request: AttentionRequest) -> bool:
    """The call reaches SDPA as ``is_causal=True`` (otherwise causal is a mask): causal,
    top-left (or Nq == Nk, where the alignments coincide: the request's alignment is
    normalized so), no attn_mask, and not given a mask for short rows on the CPU."""
    return (
        request.causal
        and request.mask == "none"
        and request.alignment == "top_left"
        and not _short_keys_on_cpu(request)
    )


def _sdpa_mask(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) to hand SDPA for this call, the route of :func:`_uses_is_causal`
    decided on the tensors themselves."""
    nk = key.shape[2]
    # Branches, not boolean expressions: under torch.compile with dynamic shapes the
    # comparisons are SymBools, which Dynamo decides (with a guard) only in a branch.
    if query.device.type == "cpu" and attn_mask is None and nk <= _CPU_VECTOR_KEYS:
        if params.causal:
            return _combined_mask(query, key, None, params), False
        return query.new_zeros((1, nk)), False
    if params.causal:
        if attn_mask is None and (not params.bottom_right or query.shape[2] == nk):
            return None, True
        attn_mask = _combined_mask(query, key, attn_mask, params)
    return attn_mask, False


# PyTorch's CUDA kernels return NaN for a query row whose every key is masked (seen on
# the H200, torch 2.11, benchmarks/results/archive/gpu-check-2026-11-30-run1.json): they take the
# softmax of a row of -inf. The contract wants zeros there (and finite gradients). So on
# CUDA a mask that may leave such rows is opened on exactly those rows (every key
# visible: a finite softmax of no consequence) and their outputs are then set to zero;
# the other rows keep their -inf, so their answer is the kernel's own, bit for bit.
# Which rows are empty is read from the mask (one pass over it, far cheaper than the
# attention that reads it too); the output's rows are zeroed out of place, so their
# gradient is zero and the opened row contributes nothing to dK and dV.


def _rows_above_the_diagonal(request: AttentionRequest) -> bool:
    """Bottom-right causal with Nq > Nk: the first Nq - Nk rows keep no key (SDPA's
    is_causal cannot say it, so a keep mask is built for it)."""
    return request.causal and request.alignment == "bottom_right" and request.q_longer


def _may_leave_rows_without_keys(request: AttentionRequest) -> bool:
    """On CUDA, the call's mask (given, or causal folded into one) may mask a whole row."""
    return request.device_type == "cuda" and (
        request.mask != "none" or _rows_above_the_diagonal(request)
    )


def _bool_mask_on_cuda(request: AttentionRequest) -> bool:
    """The call reaches PyTorch's CUDA kernel with a bool mask: one given, or the keep
    mask built for bottom-right causal with Nq > Nk.

    Declined with a backward: on the H200 (torch 2.11, cuDNN 9.19, bf16) the causal
    key-padding call of `attnhub demo` (B=2, H=16, N=4096, D=128, a left-padded row)
    served this way, its key-less rows opened and zeroed, gave parameter gradients 77x
    the contract's tolerance (benchmarks/results/demo-h200.log); stock SDPA's step on
    the same model is 3.71x outside it. The cause is not isolated: the forward was not
    seen to fail, small calls pass on the GPU
    (test_gpu_torch_sdpa_gives_zeros_and_finite_grads_on_rows_without_keys), and the
    demo's call alone, through each of PyTorch's kernels and through this backend's
    forward, stays within 0.44x of the bound at N 256-4096
    (benchmarks/sdpa_mask_probe.py, archive/sdpa-mask-probe-h200-*)."""
    return request.device_type == "cuda" and (
        request.mask == "bool" or _rows_above_the_diagonal(request)
    )


def _float_mask_backward_on_cuda(request: AttentionRequest) -> bool:
    """A CUDA call with a float mask and a backward: declined.

    PyTorch's CUDA kernels that take a float mask keep one float32 log-sum-exp per row
    and recompute the weights from it in the backward, as its CPU flash kernel does (see
    _float_mask_backward_on_cpu). A row whose every key the mask hides with a large
    finite value loses log(Nk) in it: on an H100 (torch 2.11, float32, 8 x 64, the
    hidden-row test of tests/test_builtin_backends.py) rows hidden by -1e9, -1e30 or
    finfo.min gave dQ 20 where the float64 reference gives 0.3, and -1e4 dQ 1.4x the
    tolerance. Which rows a mask hides is in its values, which dispatch does not read:
    every such call goes elsewhere (triton_flash keeps each row's max and sum apart;
    torch_reference where the mask needs a gradient)."""
    return request.device_type == "cuda" and request.mask == "float" and request.needs_grad


def _off_square_causal_backward_on_cuda(request: AttentionRequest) -> list[str]:
    """Top-left causal with Nq != Nk and a backward, on CUDA: declined where PyTorch's
    kernel would take it as ``is_causal``.

    Seen on an H100 (torch 2.11, bf16; benchmarks/patch_fuzz.py, archived as
    results/archive/patch-fuzz-h100-2026-12-07-9af4ac9.txt): a patched call whose causal
    bool mask was read as top-left causal (B3 H2, Nq 16, Nk 64, D 64, the query in (B, N,
    H, D) storage) went to SDPA as ``is_causal=True``; its output matched the float64
    reference, its dQ, dK and dV were 0.7-0.9 from it, where stock SDPA given the same
    mask as a bool attn_mask was within 0.012. Which of PyTorch's kernels (the
    memory-efficient one takes top-left causal off the square; flash and cuDNN are not
    offered it) and which shapes are affected is not isolated
    (benchmarks/sdpa_causal_probe.py asks each kernel), so every such call with a
    backward goes elsewhere. Training calls are square; decoding and chunked prefill
    align bottom-right."""
    if (
        request.device_type == "cuda"
        and request.needs_grad
        and request.causal
        and request.alignment == "top_left"
        and not request.same_seqlen
    ):
        return [
            "on CUDA, top-left causal with Nq != Nk and a backward: PyTorch's kernel gave "
            "gradients 0.7-0.9 from the reference (benchmarks/patch_fuzz.py, H100)"
        ]
    return []


def _open_rows_without_keys(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mask with its key-less rows made all-visible, those rows as a (.., Nq, 1) bool).

    ``mask`` is bool (True = kept) or float (-inf = masked), 4-D, broadcastable to the
    scores; the returned row mask broadcasts against the output (B, H, Nq, Dv). A float
    mask's finite entries also come back clamped to +-2**127, where PyTorch's kernels
    overflowed them (:mod:`attnhub.mask_values`).
    """
    kept = mask if mask.dtype == torch.bool else mask != float("-inf")
    empty = ~kept.any(dim=-1, keepdim=True)
    if mask.dtype == torch.bool:
        return mask | empty, empty
    return clamp_beyond_log2_range(mask).masked_fill(empty, 0.0), empty


def _mask_within_inputs(request: AttentionRequest) -> bool:
    """A mask built for the call (one (Nq, Nk) plane per batch row where the call has a
    mask, else one; two bytes an element) takes no more memory than q, k, v and the
    output. Lengths are the request's buckets (upper bounds); a symbolic batch: no."""
    if request.batch is None:
        return False
    element = torch.empty((), dtype=request.dtype).element_size()
    planes = request.batch if request.mask != "none" else 1
    mask_bytes = 2 * planes * request.seqlen_q * request.seqlen_k
    per_row = request.heads_q * request.seqlen_q * (request.head_dim + request.head_dim_v)
    per_row += request.heads_kv * request.seqlen_k * (request.head_dim + request.head_dim_v)
    return mask_bytes <= request.batch * per_row * element


def _scale_keyword(request: AttentionRequest, params: AttentionParams) -> dict[str, float]:
    """``{"scale": params.scale}`` where the call's scale is not 1 / sqrt(D), else ``{}``.

    SDPA and the kernels' ATen ops compute that default themselves, in double as Python
    does (``sdp::calculate_scale``: 1.0 / sqrt(double(D)), D the query's last dim), so
    leaving it out gives the same bits. Each keyword costs PyTorch's argument parser
    about 0.3-0.8 us, a large part of attnhub's budget (``scale=`` alone, about 2,000
    instructions through a generated binding, 5,300 through ``torch.ops``).
    """
    if params.scale != 1.0 / math.sqrt(request.head_dim):
        return {"scale": params.scale}
    return {}


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
    kept: bool = False,
) -> tuple[torch.Tensor | None, bool, torch.Tensor | None]:
    """(attn_mask, is_causal, key-less rows or None) to hand SDPA for this call.

    ``kept``: these arguments serve every call with this mask tensor (:class:`_BuiltMasks`
    keeps them), so whether any row is key-less is read back once (one synchronization
    a mask, outside graph capture): a mask with none (a padding mask of finfo.min, or
    of bools that keep a key in every row) costs its calls no zeroing pass over their
    output. That pass cost 79 us a call beside cuDNN's 418 (an H100, B4 H16 N2048 D128,
    bf16: benchmarks/float_mask_probe.py --kernels)."""
    attn_mask, is_causal = _sdpa_mask(query, key, attn_mask, params)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(query.dtype)
    empty_rows = None
    if (
        attn_mask is not None
        and query.device.type != "cpu"
        and not _every_row_keeps_a_key(attn_mask)
    ):
        attn_mask, empty_rows = _open_rows_without_keys(attn_mask)
        if kept and not torch.cuda.is_current_stream_capturing() and not bool(empty_rows.any()):
            empty_rows = None
    return attn_mask, is_causal, empty_rows


def _every_row_keeps_a_key(mask: torch.Tensor) -> bool:
    """Whether every row of ``mask`` is known to keep a key, from a reading of this very
    tensor already made (:mod:`attnhub.mask_rows`: a patched decoding step's padding mask,
    read by :mod:`attnhub.mask_structure`); never reads it. Then no row needs opening,
    and the call's output needs no zeroing (a kernel launch every call)."""
    rows = known_row_keys(mask) if mask.dtype == torch.bool else None
    return rows is not None and rows.fewest > 0


class _BuiltMasks:
    """The masks built for calls, per mask tensor and the lengths and options they were
    built for: the layers of one model step share their mask, and each would otherwise
    build the same (B, 1, Nq, Nk) mask again (PyTorch's SDPA does not: the model built
    it once). What was built for a mask lives as long as the mask (weakly keyed by its
    identity; its version counter tells an in-place change). Calls without a mask (a
    causal mask built for the lengths) keep a few. Only in plain eager mode and outside
    CUDA-graph capture (:mod:`attnhub.eager`: a mask built under FakeTensorMode is fake,
    one built while capturing is unwritten until replay, and was handed to later real
    calls), and not for a mask that needs a gradient (the build must be part of its
    graph)."""

    PLAIN_SLOTS = 8

    def __init__(self) -> None:
        self._by_mask: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._plain: dict[Any, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def slot(query: torch.Tensor, key: torch.Tensor, attn_mask: Any, params: AttentionParams) -> Any:  # fmt: skip
        """The key this call's build is kept under, or None where it is not kept (it
        serves this call only)."""
        if not keeps_tensors(query, key, attn_mask) or (
            attn_mask is not None and attn_mask.requires_grad
        ):
            return None
        version = None
        if attn_mask is not None:
            if attn_mask.is_inference():
                return None  # it keeps no version counter: an in-place change is invisible
            version = attn_mask._version
        # Built under torch.inference_mode, a mask is an inference tensor, which a call
        # recorded by autograd cannot save: such builds serve only calls in that mode.
        return (version, query.shape[2], key.shape[2], query.dtype, query.device,
                params.causal, params.alignment, torch.is_inference_mode_enabled())  # fmt: skip

    def get(self, slot: Any, attn_mask: Any) -> Any:
        """What was built under ``slot`` (:meth:`slot`) for ``attn_mask``, or None."""
        if slot is None:
            return None
        built = self._plain if attn_mask is None else self._by_mask.get(attn_mask, {})
        return built.get(slot)

    def put(self, slot: Any, attn_mask: Any, built: Any) -> Any:
        """Keep ``built`` under ``slot`` (nothing where it is None); returns ``built``."""
        if slot is None:
            return built
        with self._lock:
            if attn_mask is None:
                if len(self._plain) >= self.PLAIN_SLOTS:
                    self._plain.clear()
                self._plain[slot] = built
            else:  # one entry per mask: a mask changed in place needs no older build
                self._by_mask[attn_mask] = {slot: built}
        return built


_built_masks = _BuiltMasks()


class TorchSDPA(Backend):
    name = "torch_sdpa"
    description = "torch.nn.functional.scaled_dot_product_attention, PyTorch picks the kernel"
    priority = 10
    devices = frozenset({"cpu", "cuda"})
    dtypes = FLOAT_DTYPES
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    mask_grad = True
    causal_alignments = frozenset({"top_left", "bottom_right"})
    dropout = True
    gqa = True
    backward = True
    memory = "linear"
    compile_safe = True
    copies_strided = False
    stock = True

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if request.mask_rounded:
            # SDPA takes a float mask in the query's dtype only: cast, it would be rounded.
            return [
                "a float attn_mask in another dtype than the float16/bfloat16 query: "
                "PyTorch's SDPA takes it in the query's dtype, which would round it"
            ]
        if request.device_type != "cuda":
            if not request.scale_positive and _uses_is_causal(request):
                return [
                    "causal with scale <= 0: PyTorch's CPU kernel masks the scores with "
                    "-inf before scaling them (NaN everywhere)"
                ]
            return []
        if not request.scale_positive:
            # Seen on the H200 (torch 2.11): the flash and cuDNN kernels, which PyTorch
            # picks for fp16/bf16, give NaN for every call; the memory-efficient one,
            # NaN gradients where it is given a mask (bottom-right causal here).
            return ["on CUDA, scale <= 0: PyTorch's flash and cuDNN kernels give NaN"]
        if request.needs_grad and _bool_mask_on_cuda(request):
            return [
                "on CUDA, a bool mask with a backward: PyTorch's kernel gave gradients "
                "77x outside the contract's tolerance on the H200 (attnhub demo)"
            ]
        if _float_mask_backward_on_cuda(request):
            return [
                "on CUDA, a float mask with a backward: PyTorch's kernels keep one float32 "
                "lse per row, and rows the mask hides with a large finite value (-1e9, "
                "finfo.min) got gradients 20 from the reference (H100)"
            ]
        if _uses_is_causal(request):
            return _off_square_causal_backward_on_cuda(request)
        return []

    def memory_class(self, request: AttentionRequest) -> str:
        # Causal that is_causal cannot say (bottom-right, or beside a mask) becomes a
        # materialized mask, as do the opened rows of a mask on CUDA. Extra memory no
        # larger than the call's own tensors is not what the memory class guards
        # against (a decode step's (Nq, Nk) mask, a padded batch's (B, 1, N, N) one at
        # moderate N, which stock SDPA builds too); beyond that it is quadratic.
        builds_mask = (
            request.causal and (request.alignment == "bottom_right" or request.mask != "none")
        ) or _may_leave_rows_without_keys(request)
        if (builds_mask and not _mask_within_inputs(request)) or _float_mask_backward_on_cpu(
            request
        ):
            return "quadratic"
        return self.memory

    def prepare(self, request: AttentionRequest, params: AttentionParams) -> Runner:
        runner = self._runner(request, params)
        if _sums_in_half(request):
            return lambda query, key, value, attn_mask: runner(
                query.float(), key.float(), value.float(), attn_mask
            ).to(query.dtype)
        return runner

    def _runner(self, request: AttentionRequest, params: AttentionParams) -> Runner:
        if (
            (params.causal and not _uses_is_causal(request))
            or _short_keys_on_cpu(request)
            or _may_leave_rows_without_keys(request)
        ):
            return super().prepare(request, params)  # a mask built for the exact lengths
        # Only the arguments that differ from SDPA's defaults: each keyword costs
        # PyTorch's argument parser about 0.3-0.8 us, a large part of attnhub's budget.
        static: dict[str, Any] = _scale_keyword(request, params)
        if params.dropout_p:
            static["dropout_p"] = params.dropout_p
        if params.causal:
            static["is_causal"] = True
        if request.heads_q != request.heads_kv:
            static["enable_gqa"] = True
        sdpa = _math_sdpa if _float_mask_backward_on_cpu(request) else _SDPA
        if request.mask == "float":
            return lambda query, key, value, attn_mask: sdpa(
                query, key, value, attn_mask=attn_mask.to(query.dtype), **static
            )
        # SDPA itself, or a partial of it, is the runner: its fourth positional
        # argument is attn_mask (None, or the bool mask), and no Python frame runs
        # between the call and PyTorch's (a lambda's frame cost 400-500 instructions a
        # call: benchmarks/overhead.py --instructions, dev CPU).
        return functools.partial(sdpa, **static) if static else sdpa

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        slot = _built_masks.slot(query, key, attn_mask, params)
        cached = _built_masks.get(slot, attn_mask)
        if cached is None:
            cached = _built_masks.put(slot, attn_mask, _sdpa_arguments(query, key, attn_mask, params, slot is not None))  # fmt: skip
        attn_mask, is_causal, empty_rows = cached
        sdpa = _SDPA
        if (
            query.device.type == "cpu"
            and attn_mask is not None
            and attn_mask.dtype != torch.bool
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (query, key, value, attn_mask))
        ):
            sdpa = _math_sdpa  # see _float_mask_backward_on_cpu
        out = sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=params.dropout_p,
            is_causal=is_causal, scale=params.scale,
            # A branch: with symbolic head counts (torch.compile(dynamic=True)) the
            # comparison is a SymBool, which SDPA rejects; Dynamo guards a branch.
            enable_gqa=True if query.shape[1] != key.shape[1] else False,  # noqa: SIM210
        )  # fmt: skip
        # One pass: masked_fill out of place is a copy, then a fill (20 + 59 us, H100,
        # the case in _sdpa_arguments).
        return out if empty_rows is None else torch.where(empty_rows, 0.0, out)


def _needs_lse(params: AttentionParams, *inputs: torch.Tensor) -> bool:
    """The kernels' backward reads the lse of the forward: compute it when asked, or when
    autograd will need it (PyTorch's SDPA passes the same flag)."""
    return params.return_lse or (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))


def _square_causal_only(request: AttentionRequest) -> list[str]:
    if request.causal and request.alignment == "top_left" and not request.same_seqlen:
        return ["top-left causal with Nq != Nk is not supported (the kernel aligns bottom-right)"]
    return []


# What PyTorch's own checks say about a call (torch.backends.cuda.can_use_*_attention):
# they know the installed build (its kernels' head dims, GQA, masks, the cuDNN version),
# which hand-written declarations guessed wrong. They read tensors, so they are asked
# about small stand-ins with the request's heads, head dims, dtype, device and gradient
# flag, and lengths that keep what the checks and the request distinguish (1, equal,
# longer): the answer is cached per request. In debug mode the checks explain a "no"
# through TORCH_WARN, which from these bindings goes to the process's stderr, not to
# Python's warnings; it is read from there (once per request, only for a "no").
_PROBE_LEN = 128


def _probe_lengths(request: AttentionRequest) -> tuple[int, int]:
    nq, nk = min(request.seqlen_q, _PROBE_LEN), min(request.seqlen_k, _PROBE_LEN)
    if request.same_seqlen:
        return nq, nq
    if request.q_longer and nq <= nk:
        return nk + 1, nk
    if not request.q_longer and nq >= nk:
        return nq, nq + 1
    return nq, nk


def _stderr_of(call: Callable[[], Any]) -> tuple[Any, str]:
    """``call()``'s result and what it wrote to file descriptor 2 (C++ warnings)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            result = call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        sink.seek(0)
        return result, sink.read().decode(errors="replace")


def _warning_text(log: str) -> list[str]:
    """The messages of c10 warnings ("[W... file:line] Warning: text (function f)")."""
    found = re.findall(r"Warning: (.*?)(?: \(function \w+\))?$", log, flags=re.MULTILINE)
    return [text.strip() for text in found if text.strip()]


@functools.lru_cache(maxsize=4096)
def _pytorch_reasons(
    check_name: str, request: AttentionRequest, is_causal: bool
) -> tuple[str, ...]:
    """Why ``torch.backends.cuda.<check_name>`` rejects the request (empty: it accepts)."""
    check = getattr(torch.backends.cuda, check_name, None)
    sdpa_params = getattr(torch.backends.cuda, "SDPAParams", None)
    if check is None or sdpa_params is None or not torch.cuda.is_available():
        return ()  # nothing to ask: the declarations alone decide
    nq, nk = _probe_lengths(request)
    grad = request.needs_grad
    make = functools.partial(torch.empty, dtype=request.dtype, device="cuda", requires_grad=grad)
    q = make((1, request.heads_q, nq, request.head_dim))
    k = make((1, request.heads_kv, nk, request.head_dim))
    v = make((1, request.heads_kv, nk, request.head_dim_v))
    # 0.25: a multiple of 1/16, which cuDNN's dropout needs; the value decides nothing else.
    params = sdpa_params(q, k, v, None, 0.25 if request.dropout else 0.0, is_causal,
                         request.heads_q != request.heads_kv)  # fmt: skip
    if check(params, False):
        return ()
    _, log = _stderr_of(lambda: check(params, True))
    why = _warning_text(log) or ["no reason given (it warns once per process)"]
    return tuple(f"PyTorch's {check_name}(): {text}" for text in why)


class _PinnedSDPA(Backend):
    """One CUDA kernel of PyTorch's SDPA, called through its ATen op."""

    devices = frozenset({"cuda"})
    causal_alignments = frozenset({"top_left"})
    lse = True
    backward = True
    memory = "linear"
    compile_safe = True
    copies_strided = True
    # Each pinned kernel's availability flag and eligibility check in torch.backends.cuda.
    _available_flag = ""
    _check = ""

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "CUDA is not available"
        flag = getattr(torch.backends.cuda, self._available_flag, None)
        if flag is not None and not flag():
            return f"torch.backends.cuda.{self._available_flag}() is False in this PyTorch build"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if _rows_above_the_diagonal(request):
            # Rows above the diagonal have no key; the fused kernels disagree with the
            # contract there (lse of +inf in FlashAttention-2), so do not offer them.
            return ["bottom-right causal with Nq > Nk leaves rows with no key"]
        if request.device_type != "cuda":
            return []
        # The op aligns causal bottom-right natively where it serves that alignment;
        # PyTorch's check speaks for SDPA's top-left is_causal, so it is asked about the
        # kernel without the flag then (which accepts exactly the same tensors).
        is_causal = request.causal and request.alignment == "top_left"
        return list(_pytorch_reasons(self._check, request, is_causal))

    @staticmethod
    def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]

    def _op_call(
        self, request: AttentionRequest, params: AttentionParams
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """(the ATen op's Python binding, its positional arguments after q, k, v) for
        this call; ``scale`` is passed by :meth:`prepare`."""
        raise NotImplementedError

    def prepare(self, request: AttentionRequest, params: AttentionParams) -> Runner:
        # The commonest call (contiguous last dims, output only) calls the op with its
        # arguments decided here, once per signature, through the binding PyTorch
        # generates for it (torch._scaled_dot_product_flash_attention, ...): the same
        # op, dispatcher and autograd formula as torch.ops.aten's, whose Python
        # __call__ and generic schema matching cost about 11,000 instructions more a
        # call (callgrind, on the CPU op of the same schema; some 1.4 us at the H200
        # host's 8,000 instructions per us). ``scale=`` only where it is not the op's
        # default (_scale_keyword). forward, which torch.compile traces and the rarer
        # calls run, keeps calling torch.ops.aten.
        if not request.last_dim_contiguous or params.return_lse:
            return super().prepare(request, params)
        op, args = self._op_call(request, params)
        scale = _scale_keyword(request, params)
        if scale:
            return lambda query, key, value, attn_mask: op(query, key, value, *args, **scale)[0]
        return lambda query, key, value, attn_mask: op(query, key, value, *args)[0]


def _positive_scale_only(request: AttentionRequest) -> list[str]:
    # Seen on the H200 (torch 2.11): NaN outputs and gradients for every scale <= 0,
    # causal or not (the memory-efficient kernel is right).
    if not request.scale_positive:
        return ["scale <= 0 gives NaN in this kernel"]
    return []


class TorchSDPAFlash(_PinnedSDPA):
    name = "torch_sdpa_flash"
    description = "PyTorch's FlashAttention-2 kernel (aten::_scaled_dot_product_flash_attention)"
    priority = 30
    min_capability = (8, 0)
    dtypes = _HALF
    # The op itself does not pad D to a multiple of 8 (SDPA does, before calling it);
    # what else it serves (head dims up to 256, GQA) PyTorch's check says.
    head_dims = (8, 256)
    head_dim_multiple = 8
    gqa = True
    # FlashAttention-2 aligns causal bottom-right natively; top-left needs Nq == Nk
    # (where the two coincide), the same rule PyTorch's SDPA enforces.
    causal_alignments = frozenset({"top_left", "bottom_right"})
    dropout = True
    _available_flag = "is_flash_attention_available"
    _check = "can_use_flash_attention"

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        return (
            _square_causal_only(request)
            + _positive_scale_only(request)
            + super().extra_reasons(request)
        )

    def _op_call(self, request, params):  # type: ignore[no-untyped-def]
        return torch._scaled_dot_product_flash_attention, (params.dropout_p, params.causal, False)

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        query, key, value = self._contiguous(query, key, value)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, params.dropout_p, params.causal, False, scale=params.scale
        )
        return (out, lse) if params.return_lse else out


class TorchSDPAEfficient(_PinnedSDPA):
    name = "torch_sdpa_efficient"
    description = (
        "PyTorch's memory-efficient kernel (aten::_scaled_dot_product_efficient_attention)"
    )
    priority = 20
    min_capability = (5, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (8, 512)
    head_dim_multiple = 8
    value_head_dim = True
    dropout = True
    _check = "can_use_efficient_attention"

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        return _off_square_causal_backward_on_cuda(request) + super().extra_reasons(request)

    def _op_call(self, request, params):  # type: ignore[no-untyped-def]
        # The backward reads the lse: asked for exactly when the call needs gradients.
        op = torch._scaled_dot_product_efficient_attention
        return op, (None, request.needs_grad, params.dropout_p, params.causal)

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        query, key, value = self._contiguous(query, key, value)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, _needs_lse(params, query, key, value), params.dropout_p,
            params.causal,
            scale=params.scale,
        )  # fmt: skip
        # The kernel pads the lse's query dimension to a multiple of 32.
        return (out, lse[..., : query.shape[2]]) if params.return_lse else out


class TorchSDPACudnn(_PinnedSDPA):
    name = "torch_sdpa_cudnn"
    description = "PyTorch's cuDNN attention (aten::_scaled_dot_product_cudnn_attention)"
    priority = 40
    min_capability = (9, 0)
    dtypes = _HALF
    # The head dims and GQA it serves depend on the cuDNN version and the GPU (D=256
    # from cuDNN 9.22 on sm_90/sm_100): PyTorch's check says, within this outer bound.
    head_dims = (8, 256)
    head_dim_multiple = 8
    gqa = True
    _check = "can_use_cudnn_attention"

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        return (
            _square_causal_only(request)
            + _positive_scale_only(request)
            + super().extra_reasons(request)
        )

    def unavailable_reason(self) -> str | None:
        why = super().unavailable_reason()
        if why is None and not torch.backends.cudnn.is_available():
            why = "cuDNN is not available"
        return why

    def _op_call(self, request, params):  # type: ignore[no-untyped-def]
        op = torch._scaled_dot_product_cudnn_attention
        return op, (None, request.needs_grad, 0.0, params.causal, False)

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        query, key, value = self._contiguous(query, key, value)
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, _needs_lse(params, query, key, value), 0.0, params.causal,
            False,
            scale=params.scale,
        )  # fmt: skip
        if params.return_lse:
            return out, lse.reshape(query.shape[:3]).float()
        return out


PINNED = (TorchSDPAFlash, TorchSDPAEfficient, TorchSDPACudnn)
