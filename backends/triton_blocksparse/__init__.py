"""``triton_blocksparse``: block-sparse FlashAttention in Triton, forward and backward.

Visits only the kept blocks of an :class:`attnhub.BlockSparseLayout` (per query block
the kept key blocks for the forward and dQ, per key block the kept query blocks for
dK/dV), full blocks without mask arithmetic, partial blocks with their token mask. The
rest of the contract is triton_flash's (its kernels' helpers and inner loops are
reused): any Nq/Nk, head dims 16..256, GQA, causal in both alignments, window, softcap,
bool/float masks, dropout, return_lse, fully masked rows as zeros. Extra memory is
linear in N for layouts with O(N) partial blocks (see ops.py for the accounting).

Runs on CUDA (sm_90, checked on the H200: tests/test_triton_blocksparse.py -m gpu) and,
under ``TRITON_INTERPRET=1``, on CPU tensors like triton_flash. A warp-specialized
Gluon forward (kernels_gluon.py, for 128-row blocks at D=128) takes the calls whose
layout rows keep 1536 keys or more on average (ops._GLUON_MIN_KEYS: where it was
measured faster on an H200); a forced Gluon launch row sends any admitted call there.
"""

from __future__ import annotations

from attnhub.request import AttentionRequest

from ..triton_flash import TritonFlash, kernel_options

# Block sizes (bq and bk each) the kernels take as tiles: powers of two that tl.dot
# accepts; 64 and 128 are the sizes the issue asks for.
SUPPORTED_BLOCKS = (16, 32, 64, 128)


class TritonBlockSparse(TritonFlash):
    """triton_flash's declarations (the same kernels' inner loops run each kept block),
    plus block_sparse."""

    name = "triton_blocksparse"
    description = "block-sparse FlashAttention in Triton (visits only kept blocks)"
    block_sparse = True
    layouts = frozenset({"dense"})  # not triton_flash's KV-cache layouts: no block layouts there

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
        return super().extra_reasons(request)

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        from .ops import block_sparse_attention

        out, lse = block_sparse_attention(
            query, key, value, params.block_sparse, attn_mask, return_lse=params.return_lse,
            **kernel_options(params),
        )  # fmt: skip
        return (out, lse) if params.return_lse else out
