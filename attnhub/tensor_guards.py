"""One C call that checks tensors have the metadata of those a decision was made for.

The memos in front of attnhub's per-call caches (:mod:`attnhub.api`'s last entry, the
decode kernel's last launch plan) compare a call's tensors with those of the call they
remember through :class:`Guards`.
"""

from __future__ import annotations

from typing import Any

import torch

# Of one tensor: (size dims, stride dims) its guards leave out.
Free = tuple[tuple[int, ...], tuple[int, ...]] | None


class Guards:
    """Checks, in one C call, that tensors have the metadata of those a call was decided for.

    Reading shape, stride, dtype, device and requires_grad of three tensors from
    Python, hashing and comparing them costs about 15,000 instructions per call; the
    same comparison in PyTorch's C++ ``TensorGuards`` (the tensor check Dynamo used
    for its compiled-frame guards, ``torch._C._dynamo.guards``) about 5,000. It
    compares each tensor's Python type, dispatch keys (device type, autograd, ...),
    dtype, device index, requires_grad, sizes and strides, exactly: a match means
    everything a cache key can hold about the tensors' metadata is the same (their
    addresses, and so their alignment, are not part of it).

    ``free`` (optional, one entry per tensor): None, or (size dims, stride dims) that
    the check leaves out, for a memo that checks those itself (a KV cache one key
    longer at each decoding step: decode._LastPlan).

    Never hand ``check`` a nested tensor (``is_nested``; its Python type is
    ``torch.Tensor`` and its layout strided, so nothing above tells it apart): the C
    check reads every tensor's strides first, NestedTensorImpl throws on that in C++,
    and no handler stands between it and Python, so the process aborts (torch 2.11 and
    2.13). The memos of attention() and patch() test ``is_nested`` first; the decode
    kernel's last plan sees only tensors that validation has passed.

    It is a private PyTorch class: :meth:`make` returns None (no memo; every call
    goes through the cache's key) where it is missing, fails, or does not pass a check of
    the behaviour relied on here, made once per process; also for tensor subclasses,
    and for one tensor passed as two arguments, which its check always rejects.
    """

    _usable: bool | None = None  # None: not checked yet

    @classmethod
    def make(cls, tensors: tuple[Any, ...], free: tuple[Free, ...] | None = None) -> Any:
        if cls._usable is None:
            cls._usable = cls._self_check()
        if not cls._usable or not all(type(t) is torch.Tensor for t in tensors):
            return None
        if len({id(t) for t in tensors}) < len(tensors):
            return None  # a tensor passed twice (attention(x, x, x)) never passes a check
        try:
            return cls._build(tensors, free)
        except Exception:
            return None

    @staticmethod
    def _build(tensors: tuple[torch.Tensor, ...], free: tuple[Free, ...] | None = None) -> Any:
        from torch._C._dynamo import guards

        sizes: list[list[int | None]] = [list(t.shape) for t in tensors]
        strides: list[list[int | None]] = [list(t.stride()) for t in tensors]
        for t_sizes, t_strides, t_free in zip(sizes, strides, free or (), strict=False):
            if t_free is not None:  # None in a dim: TensorGuards does not check it
                for dims, values in zip(t_free, (t_sizes, t_strides), strict=True):
                    for d in dims:
                        values[d] = None
        tensor_guards: Any = guards.TensorGuards  # its .pyi misstates the arguments
        return tensor_guards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)

    @classmethod
    def _self_check(cls) -> bool:
        """The class exists and tells apart everything the call key does."""
        try:
            base = torch.zeros(2, 3)
            guards = cls._build((base,))
            different = (
                torch.zeros(2, 4),  # size
                torch.zeros(3, 2),
                torch.zeros(2, 3, 1),  # rank
                torch.zeros(2, 6)[:, ::2],  # stride
                torch.zeros(2, 3, dtype=torch.float64),  # dtype
                torch.zeros(2, 3, device="meta"),  # device
                torch.zeros(2, 3, requires_grad=True),  # requires_grad
                torch.nn.Parameter(torch.zeros(2, 3)),  # type
            )
            # Size dim 1 and both strides left out: any length of dim 1 passes, the
            # rest is still checked.
            free = cls._build((base,), (((1,), (0, 1)),))
            return (
                bool(guards.check(torch.zeros(2, 3)))
                and not any(guards.check(t) for t in different)
                and bool(free.check(torch.zeros(2, 5)))
                and bool(free.check(torch.zeros(2, 6)[:, ::2]))
                and not any(free.check(t) for t in different[1:3] + different[4:])
            )
        except Exception:
            return False
