"""``template_chunked``: the smallest complete attnhub backend, for authors to copy.

Plain PyTorch attention, computed a block of query rows at a time in float32 (float64
for float64 inputs). It declares exactly what it serves: both causal alignments, bool
and float masks (with a gradient for the float one), grouped-query attention without
repeating K/V in memory, the log-sum-exp, and a backward through autograd. It declares
no window, softcap or dropout, so dispatch never hands it those calls.

Replace :func:`chunked_attention` with your kernel, adjust the declarations in
:class:`TemplateChunked`, and run ``attnhub.testing.check_backend("your_name")``.
"""

from __future__ import annotations

import torch

from attnhub import AttentionParams, Backend, hookimpl
from attnhub.registry import BackendRegistry

__all__ = ["TemplateChunked", "attnhub_register_backends", "chunked_attention"]


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    params: AttentionParams,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by the contract, ``chunk`` query rows at a time.

    Shapes: query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv),
    attn_mask broadcastable to (B, Hq, Nq, Nk). Returns out (B, Hq, Nq, Dv) in the
    query's dtype and lse float32 (B, Hq, Nq). A row with every key masked gives zeros
    and lse = -inf.
    """
    b, hq, nq, d = query.shape
    hkv, nk, dv = key.shape[1], key.shape[2], value.shape[3]
    group = hq // hkv
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    # Query head h reads key/value head h // group: view the query heads as
    # (Hkv, group) and broadcast K/V over the group dimension (no copy of K/V).
    q = query.to(acc).reshape(b, hkv, group, nq, d)
    k = key.to(acc).unsqueeze(2)
    v = value.to(acc).unsqueeze(2)
    mask = None if attn_mask is None else attn_mask.expand(b, hq, nq, nk)
    offset = nk - nq if params.bottom_right else 0
    key_pos = torch.arange(nk, device=query.device)
    outs, lses = [], []
    for start in range(0, nq, chunk):
        rows = slice(start, min(start + chunk, nq))
        scores = (q[:, :, :, rows] @ k.transpose(-2, -1)) * params.scale
        keep = None
        if params.causal:
            position = torch.arange(rows.start, rows.stop, device=query.device) + offset
            keep = key_pos[None, :] <= position[:, None]
        if mask is not None:
            m = mask[:, :, rows].reshape(b, hkv, group, rows.stop - rows.start, nk)
            if m.dtype == torch.bool:
                keep = m if keep is None else keep & m
            else:
                scores = scores + m.to(acc)
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        # Safe softmax: rows with no key get zero weights and lse = -inf, never NaN.
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(scores - row_max)
        total = weights.sum(dim=-1, keepdim=True)
        empty = total == 0
        total = torch.where(empty, torch.ones_like(total), total)
        outs.append((weights @ v) / total)
        lses.append(torch.where(empty, float("-inf"), torch.log(total) + row_max).squeeze(-1))
    out = torch.cat(outs, dim=3).reshape(b, hq, nq, dv)
    lse = torch.cat(lses, dim=3).reshape(b, hq, nq)
    return out.to(query.dtype), lse.float()


class TemplateChunked(Backend):
    # Every declaration is explained in attnhub's docs/plugins.md.
    name = "template_chunked"
    description = "template plugin: PyTorch attention a block of queries at a time"
    priority = -50  # below the built-in fused kernels: it is an example, not a speed-up
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    mask_grad = True
    causal_alignments = frozenset({"top_left", "bottom_right"})
    gqa = True
    lse = True
    backward = lse_grad = True  # plain PyTorch operations: autograd differentiates the lse
    memory = "quadratic"  # autograd keeps every chunk's weights for the backward
    copies_strided = True  # reshape copies non-contiguous query tensors
    chunk = 256

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        out, lse = chunked_attention(query, key, value, attn_mask, params, self.chunk)
        return (out, lse) if params.return_lse else out


@hookimpl
def attnhub_register_backends(registry: BackendRegistry) -> None:
    registry.add(TemplateChunked())
