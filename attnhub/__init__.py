"""attnhub: every scaled-dot-product-attention call on the fastest correct kernel.

Quick tour::

    import attnhub
    out = attnhub.attention(q, k, v, causal=True)          # best eligible backend
    out = attnhub.attention_varlen(q, k, v, cu_q, cu_k)    # packed (T, H, D) sequences
    out = attnhub.attention_kvcache(q, k_cache, v_cache, cache_seqlens)  # decoding
    print(attnhub.explain(q, k, v, causal=True))           # why, and why not the others
    with attnhub.use_backend("torch_sdpa"):                # restrict / order backends
        out = attnhub.attention(q, k, v)
    with attnhub.patch():                                  # existing models, unchanged
        model(x)                                           # (F.scaled_dot_product_attention)
    attnhub.stats()                                        # calls served per backend
    attnhub.list_backends()

Importing attnhub changes nothing: backends are registered at first use, no torch
flag is touched and nothing is patched.
"""

from __future__ import annotations

from importlib import metadata as _metadata

from .api import attention, explain, list_backends
from .backend import Backend
from .block_sparse import BlockSparseLayout
from .call_stats import reset_stats, stats
from .dispatch import Decision, RankingPolicy, set_policy, use_backend
from .errors import BrokenBackendError, NoBackendError
from .hookspecs import hookimpl
from .patching import PatchHandle, patch
from .registry import BackendRegistry, get_registry
from .request import AttentionParams, AttentionRequest
from .serving import attention_kvcache, attention_varlen, explain_kvcache, explain_varlen

try:
    __version__ = _metadata.version("attnhub")
except _metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0+unknown"

__all__ = [
    "AttentionParams",
    "AttentionRequest",
    "Backend",
    "BackendRegistry",
    "BlockSparseLayout",
    "BrokenBackendError",
    "Decision",
    "NoBackendError",
    "PatchHandle",
    "RankingPolicy",
    "attention",
    "attention_kvcache",
    "attention_varlen",
    "explain",
    "explain_kvcache",
    "explain_varlen",
    "get_registry",
    "hookimpl",
    "list_backends",
    "patch",
    "reset_stats",
    "set_policy",
    "stats",
    "use_backend",
]
