"""Whether a call runs in plain eager mode: the one mode in which attnhub's per-call
caches of tensors (masks built for a call's lengths, tables of lengths, launch plans)
may keep a tensor for later calls and hand it to them.

Elsewhere a kept tensor would cross between worlds: a tensor made under a mode belongs
to it (FakeTensorMode makes fake tensors, which a real call cannot read, and a fake call
refuses a real one), a traced call must show every op to its tracer, and a tensor made
while a CUDA graph is captured holds nothing until the graph is replayed (the kernels
that fill it are recorded, not run).
"""

from __future__ import annotations

import torch

__all__ = ["capturing", "keeps_tensors", "plain_eager"]

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._are_functorch_transforms_active


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on ``tensors`` (None: an absent one) runs in plain eager mode: not
    traced (torch.compile, export), no dispatch mode (FakeTensorMode, FlopCounterMode)
    or function mode active, no functorch transform (vmap, grad), and every tensor a
    plain ``torch.Tensor`` (not a subclass: a fake tensor outside its mode is one)."""
    return (
        not _is_compiling()
        and all(t is None or t.__class__ is _Tensor for t in tensors)
        and _dispatch_modes() == 0
        and not _function_mode()
        and not _transforms()
    )


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is on CUDA while the current stream captures a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def keeps_tensors(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a call on ``t`` and ``others`` may keep a tensor it builds for later
    calls, or take one kept: plain eager mode, outside CUDA-graph capture (module
    docstring)."""
    return plain_eager(t, *others) and not capturing(t)
