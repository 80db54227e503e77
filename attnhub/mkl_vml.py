"""MKL VML's kernels resolved once, on one thread, before attention runs on the CPU.

PyTorch's x86 builds hand contiguous float32 and float64 unary ops (``exp``, ``log``,
``tanh``, ...) to MKL's vector math library, each intra-op thread calling it on its
chunk. oneMKL 2024.2, the release torch 2.13 bundles, picks a VML function's kernel
on that function's first call; when the first call runs on several threads at once,
one of them can run a low-accuracy kernel for its whole chunk of that call, though
high accuracy was asked for (pytorch/pytorch#188792; its proposed fix, #188791, makes
the same one-element calls inside ATen). Later calls are exact, so a rerun hides it.

Seen in attnhub: FlexAttention's eager CPU path computes the lse with
``torch.logsumexp``, whose ``exp_`` was the process's first parallel exp. In about one
fresh process in ten on two threads (10 of 76), the chunk of one thread came out with
errors up to 1.5e-4 relative, an lse 4.5e-5 off in float32, beyond the contract's
bound; the output, computed by softmax's own kernel, was exact.

One call of each function on a one-element tensor runs on one thread and settles the
dispatch for the process. The functions are those attention's CPU math reaches (and
their neighbours in the same family), in both precisions VML serves.
"""

from __future__ import annotations

import functools

import torch

# Unary ops that ATen's CPU kernels route to VML (aten/src/ATen/cpu/vml.h) and that
# attention's CPU math may call: the exp and log of logsumexp and of the references'
# spelled-out softmax, softcap's tanh, and the square roots of scales and norms.
_FUNCTIONS = (
    torch.exp,
    torch.expm1,
    torch.log,
    torch.log1p,
    torch.log2,
    torch.tanh,
    torch.sqrt,
    torch.rsqrt,
)
_DTYPES = (torch.float32, torch.float64)


@functools.cache
def resolve_dispatch() -> bool:
    """Call each function of :data:`_FUNCTIONS` once per dtype on one element, on the
    calling thread (once per process). False where torch has no MKL (nothing to do)."""
    if not torch.backends.mkl.is_available():
        return False
    for dtype in _DTYPES:
        one = torch.ones(1, dtype=dtype)
        for function in _FUNCTIONS:
            function(one)
    return True
