"""``triton_blocksparse``: block-sparse FlashAttention in Triton, forward and backward.

Visits only the kept blocks of an :class:`attnhub.BlockSparseLayout` (per query block
the kept key blocks for the forward and dQ, per key block the kept query blocks for
dK/dV), full blocks without mask arithmetic, partial blocks with their token mask. The
rest of the contract is triton_flash's (its kernels' helpers and inner loops are
reused): any Nq/Nk, head dims 16..256, GQA, causal in both alignments, window, softcap,
bool/float masks, dropout, return_lse, fully masked rows as zeros. Extra memory is
linear in N for layouts with O(N) partial blocks (see ops.py for the accounting).

Not yet run on a GPU: offered only under ``TRITON_INTERPRET=1`` (CPU tensors) until
the GPU check passes on the H200.
"""

from __future__ import annotations

import os

import torch

from attnhub.backend import Backend
from attnhub.request import AttentionRequest

# Block sizes (bq and bk each) the kernels take as tiles: powers of two that tl.dot
# accepts; 64 and 128 are the sizes the issue asks for.
SUPPORTED_BLOCKS = (16, 32, 64, 128)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBlockSparse(Backend):
    name = "triton_blocksparse"
    description = "block-sparse FlashAttention in Triton (visits only kept blocks)"
    min_capability = (9, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (16, 256)
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    mask_grad = False
    causal_alignments = frozenset({"top_left", "bottom_right"})
    window = softcap = dropout = gqa = lse = True
    block_sparse = True
    backward = True
    deterministic = True
    memory = "linear"
    compile_safe = False
    copies_strided = False

    @property  # type: ignore[override]
    def priority(self) -> int:  # type: ignore[override]
        return 0 if _interpreting() else 50

    @property  # type: ignore[override]
    def devices(self) -> frozenset[str]:  # type: ignore[override]
        # Not yet run on a GPU: CPU through the interpreter only. Add "cuda" once the
        # GPU check (tests/test_triton_blocksparse.py -m gpu) has passed on the H200.
        return frozenset({"cpu"}) if _interpreting() else frozenset()

    def unavailable_reason(self) -> str | None:
        try:
            import triton  # noqa: F401
        except Exception as exc:
            return f"triton does not import: {type(exc).__name__}: {exc}"
        if not _interpreting():
            return "not yet run on a GPU; available under TRITON_INTERPRET=1 only"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if not request.block_sparse:
            return ["only serves block_sparse calls; the dense kernel is triton_flash"]
        if request.block_size is not None and any(
            side not in SUPPORTED_BLOCKS for side in request.block_size
        ):
            return [
                f"block_size {request.block_size} is not supported (each side must be one of "
                f"{SUPPORTED_BLOCKS}: the kernel's tile is the layout's block)"
            ]
        if request.device_type == "cpu" and request.dtype == torch.bfloat16:
            return ["bfloat16 is not reliable in Triton's CPU interpreter"]
        return []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        from .ops import block_sparse_attention

        out, lse = block_sparse_attention(
            query,
            key,
            value,
            params.block_sparse,
            attn_mask,
            causal=params.causal,
            bottom_right=params.bottom_right,
            window=params.window,
            softcap=params.softcap,
            scale=params.scale,
            dropout_p=params.dropout_p,
        )
        return (out, lse) if params.return_lse else out
