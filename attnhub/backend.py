"""The backend interface: declare what you support, then implement ``forward``.

A backend is a subclass of :class:`Backend` whose class attributes declare, as data,
which calls it can serve. :func:`declared_reasons` turns those declarations into
sentences for a given request ("head_dim=300 is not in 16..256"); a backend adds only
what declarations cannot say through :meth:`Backend.extra_reasons`, and whether it can
run on this machine at all through :meth:`Backend.unavailable_reason`.

Dispatch trusts declarations: a backend that declares a feature must serve every call
with it exactly as contract.md says, and the conformance suite
(:mod:`attnhub.testing`) holds it to that.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from .request import AttentionParams, AttentionRequest, dtype_name

if TYPE_CHECKING:
    from collections.abc import Sequence

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# The tensor layouts a call comes in (contract.md): "dense" is attnhub.attention's
# (B, H, N, D); "varlen" attnhub.attention_varlen's packed (total_tokens, H, D) with
# cu_seqlens; "kvcache" and "paged" attnhub.attention_kvcache's contiguous
# (B, Hkv, Nmax, D) cache and paged (num_pages, page_size, Hkv, D) cache.
LAYOUTS = ("dense", "varlen", "kvcache", "paged")
MEMORY_CLASSES = ("linear", "quadratic")
_NO_LIMIT = 1 << 30


def is_finite_number(value: object) -> bool:
    """A real number that is finite, not a bool (nothing is coerced): what a backend's
    ``priority`` and the numbers of the cost files must be."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


Runner = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"],
    "torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
]


# The contract features of capabilities()'s "features" line, in its order.
_FEATURE_NAMES = ("window", "softcap", "dropout", "gqa", "block_sparse", "lse", "lse_grad",
                  "mask_grad")  # fmt: skip


class Backend:
    """Base class of every attention backend, built-in or plugin.

    Declarations (class attributes; the defaults are the most conservative):

    ``name``               unique lowercase name, e.g. ``"triton_flash"``
    ``description``        one line for ``attnhub info``
    ``priority``           higher ranks first among eligible backends of one memory class
    ``devices``            device types served (``{"cuda"}``, ``{"cpu", "cuda"}``)
    ``min_capability``     lowest CUDA compute capability, or None
    ``dtypes``             dtypes served
    ``head_dims``          inclusive (low, high) range of the head dim D
    ``head_dim_multiple``  D must be a multiple of this
    ``value_head_dim``     True if Dv may differ from D
    ``mask_kinds``         subset of {"none", "bool", "float"}
    ``mask_grad``          gradient flows to a float ``attn_mask`` that requires it
    ``causal_alignments``  alignments served with ``causal=True`` (empty: no causal)
    ``window``, ``softcap``, ``dropout``, ``gqa``, ``block_sparse``, ``lse``
                           the contract features served (``lse`` = ``return_lse``)
    ``backward``           gradients flow to query, key and value
    ``lse_grad``           with ``return_lse`` under autograd, a gradient on the returned
                           lse flows back to query and key too (PyTorch's fused kernels,
                           called through their ATen ops, return an lse without one, and
                           ``varlen_attn``'s backward drops it: they do not declare it)
    ``deterministic``      the backward is bitwise reproducible
    ``memory``             "linear" (O(N) extra memory) or "quadratic" (O(N^2))
    ``compile_safe``       ``torch.compile(fullgraph=True)`` traces it without a break
                           (a call being traced is offered only to such backends)
    ``compiles_per_shape`` its first call of each new shape compiles (seconds): autotune
                           does not time it (a user's first call would pay that), it is
                           ranked by the policies beneath the measurement; the cost
                           model ranks it after its memory class's other backends
    ``stock``              this backend is what an unpatched model runs
                           (``F.scaled_dot_product_attention``): where measured times
                           tie (within :data:`attnhub.measured.TIE` or the spread of
                           autotune's rounds), it is ranked first, so a tie never costs
                           a user the stock speed
    ``copies_strided``     non-contiguous inputs are copied (True) or read through
                           their strides (False)
    ``layouts``            subset of :data:`LAYOUTS`: the calls served. "dense" (the
                           default) is :func:`attnhub.attention` through :meth:`forward`;
                           "varlen" is :func:`attnhub.attention_varlen` through
                           :meth:`forward_varlen`; "kvcache" and "paged" are
                           :func:`attnhub.attention_kvcache` with a contiguous or a
                           paged cache, through :meth:`forward_kvcache`
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    devices: ClassVar[frozenset[str]] = frozenset()
    min_capability: ClassVar[tuple[int, int] | None] = None
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    head_dims: ClassVar[tuple[int, int]] = (1, _NO_LIMIT)
    head_dim_multiple: ClassVar[int] = 1
    value_head_dim: ClassVar[bool] = False
    mask_kinds: ClassVar[frozenset[str]] = frozenset({"none"})
    mask_grad: ClassVar[bool] = False
    causal_alignments: ClassVar[frozenset[str]] = frozenset()
    window: ClassVar[bool] = False
    softcap: ClassVar[bool] = False
    dropout: ClassVar[bool] = False
    gqa: ClassVar[bool] = False
    block_sparse: ClassVar[bool] = False
    lse: ClassVar[bool] = False
    backward: ClassVar[bool] = False
    lse_grad: ClassVar[bool] = False
    deterministic: ClassVar[bool] = False
    memory: ClassVar[str] = "quadratic"
    compile_safe: ClassVar[bool] = False
    compiles_per_shape: ClassVar[bool] = False
    stock: ClassVar[bool] = False
    copies_strided: ClassVar[bool] = True
    layouts: ClassVar[frozenset[str]] = frozenset({"dense"})

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run on this machine at all (None: it can).

        Called once per process and cached by the registry; import optional
        libraries here, not at module import, and quote their own error text.
        """
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        """Reasons the declarations cannot express; empty when eligible."""
        return []

    def memory_class(self, request: AttentionRequest) -> str:
        """Memory class for this request; override when a route materializes a mask."""
        return self.memory

    def prepare(self, request: AttentionRequest, params: AttentionParams) -> Runner:
        """A callable ``(query, key, value, attn_mask) -> output`` for such calls.

        Called once per call signature; the result is cached and called for every
        matching call, so per-signature work (argument lists, launch configurations)
        belongs here rather than in :meth:`forward`. The default runs ``forward``.
        """
        forward = self.forward
        return lambda query, key, value, attn_mask: forward(query, key, value, attn_mask, params)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        params: AttentionParams,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Compute attention; differentiable where ``backward`` is declared.

        Shapes: query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv),
        attn_mask 4-D, broadcastable to (B, Hq, Nq, Nk) (a mask given with fewer
        dimensions arrives as a 4-D view). Returns the output (B, Hq, Nq, Dv)
        in the query's dtype, or ``(output, lse)`` with a float32 (B, Hq, Nq)
        log-sum-exp when ``params.return_lse``.
        """
        raise NotImplementedError(f"backend {self.name!r} does not implement forward")

    def forward_varlen(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        params: AttentionParams,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Packed variable-length attention (layout "varlen"); contract.md, Varlen.

        Shapes: query (Tq, Hq, D), key (Tk, Hkv, D), value (Tk, Hkv, Dv); sequence b
        is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` against key rows
        ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` (``cu_seqlens_*`` validated int32 or
        int64 (B + 1,) on the query's device; ``max_seqlen_*`` at least every
        sequence's length). ``causal`` and ``window`` are aligned per sequence.
        Returns the output (Tq, Hq, Dv) in the query's dtype, or ``(output, lse)``
        with a float32 (Tq, Hq) log-sum-exp. Differentiable where ``backward`` is
        declared.
        """
        raise NotImplementedError(f"backend {self.name!r} does not implement forward_varlen")

    def forward_kvcache(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seqlens_k: torch.Tensor,
        block_table: torch.Tensor | None,
        params: AttentionParams,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention against a KV cache (layouts "kvcache" and "paged"); contract.md.

        Shapes: query (B, Hq, Nq, D); ``seqlens_k`` int32 or int64 (B,): sequence b
        has ``seqlens_k[b]`` keys (any new keys already appended by attnhub). Without
        ``block_table`` ("kvcache"), k_cache (B, Hkv, Nmax, D) and v_cache
        (B, Hkv, Nmax, Dv), keys ``[:seqlens_k[b]]`` of row b. With it ("paged"),
        k_cache (num_pages, page_size, Hkv, D), v_cache (num_pages, page_size, Hkv,
        Dv), block_table int32 (B, pages_per_seq): key position p of sequence b is
        slot ``p % page_size`` of page ``block_table[b, p // page_size]``. The
        positions are bottom-right aligned by default (query i at key position
        ``seqlens_k[b] - Nq + i``; ``params.alignment``). Returns the output
        (B, Hq, Nq, Dv) in the query's dtype, or ``(output, lse)`` with a float32
        (B, Hq, Nq) log-sum-exp. The backend must not write to the caches.
        """
        raise NotImplementedError(f"backend {self.name!r} does not implement forward_kvcache")

    def capabilities(self) -> dict[str, str]:
        """The declarations as readable text, for ``attnhub info`` and the docs."""
        low, high = self.head_dims
        features = [name for name in _FEATURE_NAMES if getattr(self, name)]
        return {
            "devices": ", ".join(sorted(self.devices)) or "-",
            "capability": ">= {}.{}".format(*self.min_capability) if self.min_capability else "any",
            "dtypes": ", ".join(sorted(dtype_name(d) for d in self.dtypes)) or "-",
            "head dim": f"{low}..{high if high < _NO_LIMIT else 'any'}"
            + (f" (multiple of {self.head_dim_multiple})" if self.head_dim_multiple > 1 else ""),
            "masks": ", ".join(sorted(self.mask_kinds)),
            "causal": ", ".join(sorted(self.causal_alignments)) or "no",
            "features": ", ".join(features) or "-",
            "backward": ("deterministic" if self.deterministic else "yes")
            if self.backward
            else "no",
            "memory": self.memory,
            "layouts": ", ".join(sorted(self.layouts)),
        }


def _names(items: Sequence[str] | frozenset[str]) -> str:
    return ", ".join(sorted(items)) or "none"


# Feature flags of the request that a backend must declare to serve; one row each,
# so that adding a feature adds a row, not a branch.
_FEATURE_ROWS: tuple[tuple[str, str, str], ...] = (
    # (request flag, declaration, what the reason calls it)
    ("window", "window", "window (local attention)"),
    ("softcap", "softcap", "softcap"),
    ("dropout", "dropout", "dropout_p > 0"),
    ("block_sparse", "block_sparse", "block_sparse"),
    ("return_lse", "lse", "return_lse=True"),
    ("needs_grad", "backward", "backward (an input requires grad)"),
    ("lse_needs_grad", "lse_grad", "a gradient through the returned lse"),
    ("mask_needs_grad", "mask_grad", "a gradient for attn_mask"),
    ("traced", "compile_safe", "tracing by torch.compile or torch.export"),
)

_Check = Callable[[Backend, AttentionRequest], "str | None"]


def _layout(b: Backend, r: AttentionRequest) -> str | None:
    # A dense AttentionRequest has no layout field; the serving calls' requests
    # (attnhub.serving_validation.ServingRequest) do.
    layout = getattr(r, "layout", "dense")
    if layout not in b.layouts:
        return f"{layout} layout is not supported (layouts: {_names(b.layouts)})"
    return None


def _device(b: Backend, r: AttentionRequest) -> str | None:
    if r.device_type not in b.devices:
        return f"runs on {_names(b.devices)}, not {r.device_type}"
    return None


def _capability(b: Backend, r: AttentionRequest) -> str | None:
    if b.min_capability and r.capability is not None and r.capability < b.min_capability:
        need = "{}.{}".format(*b.min_capability)
        have = "{}.{}".format(*r.capability)
        return f"needs compute capability >= {need}, device has {have}"
    return None


def _dtype(b: Backend, r: AttentionRequest) -> str | None:
    if r.dtype not in b.dtypes:
        return (
            f"dtype {dtype_name(r.dtype)} is not one of {_names([dtype_name(d) for d in b.dtypes])}"
        )
    return None


def _head_dim(b: Backend, r: AttentionRequest) -> str | None:
    low, high = b.head_dims
    for label, d in (("head_dim", r.head_dim), ("value head_dim", r.head_dim_v)):
        if not low <= d <= high:
            return f"{label}={d} is not in {low}..{high}"
        if d % b.head_dim_multiple:
            return f"{label}={d} is not a multiple of {b.head_dim_multiple}"
    if r.head_dim_v != r.head_dim and not b.value_head_dim:
        return f"value head_dim {r.head_dim_v} differs from head_dim {r.head_dim}"
    return None


def _mask(b: Backend, r: AttentionRequest) -> str | None:
    if r.mask not in b.mask_kinds:
        return f"{r.mask} attn_mask is not supported (masks: {_names(b.mask_kinds)})"
    return None


def _causal(b: Backend, r: AttentionRequest) -> str | None:
    if r.causal and r.alignment not in b.causal_alignments:
        served = _names(b.causal_alignments) if b.causal_alignments else "no causal at all"
        return f"causal with {r.alignment} alignment is not supported ({served})"
    return None


def _gqa(b: Backend, r: AttentionRequest) -> str | None:
    if r.heads_q != r.heads_kv and not b.gqa:
        return f"grouped-query attention (Hq={r.heads_q}, Hkv={r.heads_kv}) is not supported"
    return None


def _deterministic(b: Backend, r: AttentionRequest) -> str | None:
    if r.deterministic and b.backward and not b.deterministic:
        return "backward is not deterministic and torch.use_deterministic_algorithms(True) is set"
    return None


_CHECKS: tuple[_Check, ...] = (
    _layout,
    _device,
    _capability,
    _dtype,
    _head_dim,
    _mask,
    _causal,
    _gqa,
    _deterministic,
)


def declared_reasons(backend: Backend, request: AttentionRequest) -> list[str]:
    """Why ``backend``'s declarations exclude ``request`` (empty list: they admit it)."""
    reasons = [why for check in _CHECKS if (why := check(backend, request))]
    reasons += [
        f"{label} is not supported"
        for flag, declaration, label in _FEATURE_ROWS
        if getattr(request, flag) and not getattr(backend, declaration)
    ]
    return reasons
