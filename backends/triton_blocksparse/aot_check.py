"""Compile the triton_blocksparse kernels for a GPU target on a machine without a GPU.

Mirrors ``attnhub.backends.triton_flash.aot_check`` (and reuses its recorder and
compiler): runs the block-sparse ops on CPU tensors with launches recorded instead of
executed, compiles each recorded launch for sm_90 with Triton's ahead-of-time path and
reports shared memory against the H100/H200 limit.

    python -m attnhub.backends.triton_blocksparse.aot_check [--quick] [--capability 90]

Exit status 1 when any variant fails.
"""

from __future__ import annotations

import argparse
import os
import sys

# Kernel modules decide between interpreter and compiler when imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch

from attnhub.backends.triton_flash import aot_check as flash_aot
from attnhub.backends.triton_flash import ops as flash_ops
from attnhub.block_sparse import BlockSparseLayout

from . import ops


def record(cases: list[tuple[torch.dtype, int, int, dict]]) -> list:
    """Forward+backward for each (dtype, head dim, block, options) on CPU, recorded."""
    launches: list = []
    # Every launch: ops.py's kernels, and the shared preprocess kernel that
    # triton_flash's ops module launches (through its own _launcher).
    modules = (ops, flash_ops)
    originals = [m._launcher for m in modules]
    for m in modules:
        m._launcher = lambda kernel, like: flash_aot._Recorder(kernel, launches)  # type: ignore[assignment]
    try:
        for dtype, d, block, options in cases:
            options = dict(options)
            # A ragged length runs the per-block loops; an even one without a band
            # (option "even") the flat loops of EVEN_BLOCKS.
            n = 4 * block if options.pop("even", False) else 2 * block + 40
            layout = BlockSparseLayout.sliding_window(n, block + 10, block)
            q = torch.randn(1, 2, n, d, dtype=dtype, requires_grad=True)
            k = torch.randn(1, 1, n, d, dtype=dtype, requires_grad=True)
            mask = options.pop("mask", None)
            if mask == "float":
                mask = torch.randn(n, n, dtype=dtype)
            out, _ = ops.block_sparse_attention(q, k, k, layout, mask, **options)
            out.sum().backward()
    finally:
        for m, original in zip(modules, originals):
            m._launcher = original  # type: ignore[assignment]
    return launches


def variants(quick: bool) -> list[tuple[torch.dtype, int, int, dict]]:
    full = {"causal": True, "bottom_right": True, "window": (30, None), "softcap": 5.0,
            "mask": "float", "dropout_p": 0.1}  # fmt: skip
    if quick:
        return [(torch.bfloat16, 128, 128, {"causal": True}), (torch.float32, 40, 64, full),
                (torch.bfloat16, 128, 128, {"even": True})]  # fmt: skip
    cases: list[tuple[torch.dtype, int, int, dict]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block in (64, 128):
            for d in (64, 128):
                cases += [(dtype, d, block, {}), (dtype, d, block, {"causal": True}),
                          (dtype, d, block, {"even": True})]  # fmt: skip
            cases += [(dtype, 40, block, full)]
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two variants (for CI)")
    parser.add_argument("--capability", type=int, default=90)
    args = parser.parse_args(argv)
    return 1 if flash_aot.compile_all(record(variants(args.quick)), args.capability) else 0


if __name__ == "__main__":
    sys.exit(main())
