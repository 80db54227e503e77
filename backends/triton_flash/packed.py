"""triton_flash's packed-sequence calls (layout "varlen"): attnhub.attention_varlen run
by the dense kernels in their VARLEN mode (kernels' glossary, "Packed sequences").

One launch covers every sequence: the grid spans the longest sequence, each program
reads its sequence's first rows and lengths from the cumulative lengths and walks only
that sequence's band, so no token is padded and no tile of another sequence is
visited. The backward is the dense backward in the same mode (deterministic, no
atomics). Calls run eagerly: torch.compile breaks the graph around them (the serving
calls read their index tensors on the host anyway, contract.md), and they take no
launch plans.
"""

from __future__ import annotations

import torch

from .ops import Packed, _bwd_full, _forward, apply_direct, call_scalars


def _fwd(q, k, v, mask, seed, packed, *scalars, store_lse=True):  # type: ignore[no-untyped-def]
    """(out (Tq, Hq, Dv), lse (Hq, Tq) or None, None): the forward on packed tensors
    (no mask: no row stats)."""
    views = (packed.view(t) for t in (q, k, v))
    return _forward(*views, None, None, scalars, store_lse, None, packed)


def _bwd(dout, q, k, v, mask, seed, packed, out, lse, dlse, *scalars):  # type: ignore[no-untyped-def]
    """(dq, dk, dv) packed: DirectAttention's backward (dlse (Hq, Tq) or None)."""
    dout, q, k, v, out = (packed.view(t) for t in (dout, q, k, v, out))
    return _bwd_full(dout, q, k, v, None, None, out, lse, dlse, scalars, None, packed)


@torch.compiler.disable
def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed attention, differentiable: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv),
    cu_seqlens_* int32/int64 (B + 1,) on q's device (valid: the caller checked them),
    max_seqlen_* at least the longest sequence's lengths. Options as
    :func:`.ops.flash_attention`, the diagonal placed per sequence. Returns (out
    (Tq, Hq, Dv) in q's dtype, lse float32 (Tq, Hq) or None where ``return_lse`` is
    False); the lse is a transposed view of the kernels' (Hq, Tq)."""
    packed = Packed(cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    _, scalars = call_scalars(q, causal, bottom_right, window, softcap, scale, 0.0)
    out, lse = apply_direct(_fwd, _bwd, (packed,), q, k, v, scalars, return_lse)
    return out, (lse.t() if return_lse and lse is not None else None)
