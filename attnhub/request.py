"""The normalized form of one attention call.

``AttentionParams`` holds the call's options (what a backend needs to compute);
``AttentionRequest`` is a frozen, hashable summary of a call's *metadata* (what
dispatch needs to choose). Dispatch reads only the request, so its decisions can be
cached per request and explained. Sequence lengths are bucketed to powers of two so
that a new length does not mean a new decision (or a recompile under
``torch.compile``); the facts that depend on exact lengths (``Nq == Nk``,
``Nq > Nk``) are kept as flags. The batch size is kept but decides nothing: under
``torch.compile`` with a dynamic batch, or ``torch.export`` with a batch ``Dim``, one
graph serves every batch size, and the request's ``batch`` is None.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import Any

import torch

MASK_KINDS = ("none", "bool", "float")
ALIGNMENTS = ("top_left", "bottom_right")
# float32's largest over log2(e): the largest |scale| whose scale * log2(e) float32 holds.
LOG2_SCALE_LIMIT = 3.4028234663852886e38 / 1.4426950408889634


def seqlen_bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 stays 0): the request's sequence-length key."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_TAGS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def dtype_tag(dtype: torch.dtype | str) -> str:
    """The short name of a floating dtype in labels and ids (``bf16``, ``fp16``, ``fp32``,
    ``fp64``), given the dtype or its :func:`dtype_name`; another dtype's name as it is."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return _DTYPE_TAGS.get(name, name)


@dataclass(frozen=True)
class AttentionParams:
    """What a backend computes, beyond the tensors.

    ``scale`` is resolved (never None). ``window`` sides are key counts; None on a
    side means unbounded. ``block_sparse`` is a :class:`attnhub.BlockSparseLayout`.
    """

    causal: bool = False
    alignment: str = "top_left"
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    scale: float = 1.0
    dropout_p: float = 0.0
    block_sparse: Any = None
    return_lse: bool = False

    @property
    def bottom_right(self) -> bool:
        return self.alignment == "bottom_right"


# The call options of attnhub.attention and explain, in this order wherever they travel
# as a tuple (the api's hot path passes them positionally): AttentionParams' fields.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(AttentionParams))


@dataclass(frozen=True)
class AttentionRequest:
    """Frozen summary of one call's metadata; the only input to dispatch.

    Shapes: query (batch, heads_q, Nq, head_dim), key (batch, heads_kv, Nk, head_dim),
    value (batch, heads_kv, Nk, head_dim_v). ``seqlen_q``/``seqlen_k`` are buckets
    (see :func:`seqlen_bucket`).

    ``batch`` is None where the batch size is symbolic (``torch.compile`` with a
    dynamic batch, ``torch.export`` with a batch ``Dim``): the graph traced for the
    request serves every batch size, so no eligibility reason or ranking may depend on
    the batch. (Every other field is fixed by guards for as long as the graph is used;
    see :func:`attnhub.validation.request_facts`.)
    """

    device_type: str
    capability: tuple[int, int] | None
    dtype: torch.dtype
    batch: int | None
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    same_seqlen: bool
    q_longer: bool
    head_dim: int
    head_dim_v: int
    mask: str = "none"
    mask_needs_grad: bool = False
    # The mask varies along the keys only (its head and query-row dims are 1 or absent):
    # key padding. triton_flash runs such a bool mask as key ranges, many times faster
    # than a mask of rows (backends/triton_flash/key_ranges.py), so a measurement of one
    # must not rank the other.
    mask_per_key: bool = False
    # A float mask in another dtype than a float16/bfloat16 query's. The contract adds it
    # to float32 scores; PyTorch's kernels take the mask in the query's dtype, and the
    # cast rounds it (-1e5 becomes -inf in float16, emptying rows that keep keys).
    mask_rounded: bool = False
    causal: bool = False
    alignment: str = "top_left"
    window: bool = False
    softcap: bool = False
    # The softcap's size as a power of two: the smallest n with softcap <= 2**n (None
    # without one). A kernel's score error can grow with it (triton_flash's tanh).
    softcap_log2: int | None = None
    dropout: bool = False
    needs_grad: bool = False
    deterministic: bool = False
    last_dim_contiguous: bool = True
    block_sparse: bool = False
    block_size: tuple[int, int] | None = None  # the block_sparse layout's (bq, bk)
    return_lse: bool = False
    # The scale is > 0 as float32 holds it (at most 2**-150 rounds to 0): kernels that
    # mask or take row maxima before scaling need it (backends/torch_sdpa.py).
    scale_positive: bool = True
    # |scale| <= FP32_MAX / log2(e) (2.36e38): kernels that keep scores in log2 units
    # (scale * log2 e in float32) overflow beyond it, whatever q.k is.
    scale_in_log2_range: bool = True
    # Decided while torch.compile or torch.export traces the call: the chosen backend's
    # forward goes into the graph, so only backends that declare ``compile_safe`` are
    # eligible, and one whose compiled form serves less than its eager one says so.
    # Measurements are taken eagerly and rank traced calls too (measured.request_key).
    traced: bool = False

    @property
    def lse_needs_grad(self) -> bool:
        """The call returns its lse under autograd: a loss may differentiate through it."""
        return self.return_lse and self.needs_grad

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 1

    @property
    def empty(self) -> bool:
        """The call has no query rows or no keys (B, H, Nq or Nk of zero).

        A symbolic batch (None) counts as non-empty: symbolic sizes are at least 2
        under ``torch.compile``, and an unbacked one in ``torch.export`` is assumed so.
        """
        return self.batch == 0 or self.heads_q == 0 or self.seqlen_q == 0 or self.seqlen_k == 0

    @property
    def device_label(self) -> str:
        if self.capability is None:
            return self.device_type
        return f"{self.device_type} sm{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        """One line, e.g. ``q=(2,16,~4096,128) k/v=(2,4,~4096,128) bfloat16 cuda sm90, causal``."""
        flags = []
        if self.causal:
            flags.append(f"causal ({self.alignment})")
        for name in ("window", "softcap", "dropout", "return_lse"):
            if getattr(self, name):
                flags.append(name)
        if self.softcap_log2 is not None:
            flags[flags.index("softcap")] = f"softcap <= 2**{self.softcap_log2}"
        if not self.scale_positive:
            flags.append("scale <= 0")
        if not self.scale_in_log2_range:
            flags.append("|scale| > 2.36e38")
        if self.block_sparse:
            flags.append(
                "block_sparse" + ("{}x{}".format(*self.block_size) if self.block_size else "")
            )
        if self.mask != "none":
            per_key = " (per key)" if self.mask_per_key else ""
            rounded = " (not the query's dtype)" if self.mask_rounded else ""
            flags.append(
                f"{self.mask} mask{per_key}{rounded}"
                + (" with grad" if self.mask_needs_grad else "")
            )
        if self.needs_grad:
            flags.append("backward")
        if self.deterministic:
            flags.append("deterministic")
        if self.traced:
            flags.append("traced")
        if not self.last_dim_contiguous:
            flags.append("last dim strided")
        lengths = "Nq==Nk" if self.same_seqlen else ("Nq>Nk" if self.q_longer else "Nq<Nk")
        batch = "B" if self.batch is None else self.batch  # B: any batch (symbolic)
        text = (
            f"q=({batch},{self.heads_q},~{self.seqlen_q},{self.head_dim}) "
            f"k/v=({batch},{self.heads_kv},~{self.seqlen_k},{self.head_dim}/{self.head_dim_v}) "
            f"{lengths} {dtype_name(self.dtype)} {self.device_label}"
        )
        return text + (", " + ", ".join(flags) if flags else "")


def softcap_log2(softcap: float | None) -> int | None:
    """The request's ``softcap_log2``: the smallest n with ``softcap <= 2**n``, or None."""
    return None if softcap is None else math.ceil(math.log2(softcap))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability for CUDA devices, None elsewhere."""
    if device.type != "cuda":
        return None
    return _cuda_capability(
        device.index if device.index is not None else torch.cuda.current_device()
    )


# A device's capability never changes; asking the driver costs a few us (every new call
# key asks: a decoding step's first layer).
@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor)
