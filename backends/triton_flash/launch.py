"""Launching a compiled Triton kernel again without Triton's per-call argument binding.

``kernel[grid](*args, **meta)`` in Triton 3.6 (``JITFunction.run``) specializes every
argument on every call (each pointer's dtype and 16-byte alignment, each int's type,
whether it is 1 or a multiple of 16), builds a cache key from those and ``str(options)``,
re-checks the kernel's globals, builds launch metadata for the launch hooks and only then
calls the compiled launcher: tens of microseconds of Python per launch, which a tiny call
(decode, a small batch) pays in full (issue 17, item 3).

:class:`CachedLaunch` keeps the ``CompiledKernel`` that such a call returned, its grid
and every argument but the leading tensors, and launches it through the kernel's
launcher directly. It is only valid for calls that Triton would specialize the same
way: the caller's cache key (``ops._PLANS``) must determine every argument other than
the tensors' addresses, and each tensor's dtype and 16-byte alignment. The launch goes
to the current CUDA stream of the device that was current when the plan was made (the
key holds that device), as Triton's own launch does, so CUDA-graph capture records it.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs


def _active(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps hook chains (empty: none set)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLaunch:
    """``launch(*tensors)``: the compiled kernel on ``grid`` with ``tensors`` as its first
    ``len(tensors)`` arguments and the recorded values for the rest.

    ``kernel``: the JITFunction; ``compiled``: what ``kernel[grid](*args, **meta)``
    returned for the recorded call; ``args``/``meta``: that call's arguments (meta holds
    constexprs by name and the launch options, which are not kernel parameters);
    ``tensors``: how many leading parameters are per-call tensors."""

    __slots__ = ("_compiled", "_device", "_launch", "_rest", "_x", "_y", "_z")

    def __init__(
        self,
        kernel: Any,
        compiled: Any,
        grid: tuple[int, ...],
        args: tuple,
        meta: dict,
        tensors: int,
    ) -> None:
        bound = []
        for param in kernel.params:
            if param.name in meta:
                bound.append(meta[param.name])
            elif param.num < len(args):
                bound.append(args[param.num])
            else:
                bound.append(param.default)
        if not all(isinstance(t, torch.Tensor) for t in bound[:tensors]) or any(
            isinstance(t, torch.Tensor) for t in bound[tensors:]
        ):
            raise ValueError(
                f"{kernel.fn.__name__}: the first {tensors} arguments must be the tensors"
            )
        self._rest = tuple(bound[tensors:])
        self._x, self._y, self._z = (*grid, 1, 1)[:3]
        self._compiled = compiled
        self._device = torch.cuda.current_device()
        launcher = compiled.run  # loads the module on first use (done by the recorded call)
        scratch = getattr(launcher, "global_scratch_size", None)
        if (
            scratch is not None
            and getattr(launcher, "profile_scratch_size", 1) == 0
            and hasattr(launcher, "launch")
        ):
            # CudaLauncher.__call__ only allocates scratch and forwards to its compiled
            # ``launch`` with the cooperative-grid and PDL flags: call it directly.
            head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
            direct = launcher.launch
            if scratch == 0:
                fixed = (*head, None, None, compiled.packed_metadata)

                def launch(stream: int, meta: Any, enter: Any, leave: Any, rest: tuple,
                           *tensors: Any) -> None:  # fmt: skip
                    direct(self._x, self._y, self._z, stream, *fixed, meta, enter, leave,
                           *tensors, *rest)  # fmt: skip
            else:
                # Global scratch (in-kernel tensor descriptors: kernels_tma,
                # kernels_gluon), sized as CudaLauncher sizes it, from PyTorch's allocator
                # on the plan's device (stream-ordered: the next launch may reuse it safely).
                size = self._x * self._y * self._z * launcher.num_ctas * scratch
                device = torch.device("cuda", self._device)

                def launch(stream: int, meta: Any, enter: Any, leave: Any, rest: tuple,
                           *tensors: Any) -> None:  # fmt: skip
                    buffer = torch.empty(size, dtype=torch.int8, device=device)
                    direct(self._x, self._y, self._z, stream, *head, buffer, None,
                           compiled.packed_metadata, meta, enter, leave, *tensors,
                           *rest)  # fmt: skip
        else:

            def launch(stream: int, meta: Any, enter: Any, leave: Any, rest: tuple,
                       *tensors: Any) -> None:  # fmt: skip
                launcher(self._x, self._y, self._z, stream, compiled.function,
                         compiled.packed_metadata, meta, enter, leave, *tensors, *rest)  # fmt: skip

        self._launch = launch

    def __call__(self, *tensors: torch.Tensor) -> None:
        self._run(self._rest, tensors)

    def with_leading(self, leading: tuple, *tensors: torch.Tensor) -> None:
        """The launch with the first ``len(leading)`` arguments after the tensors taken
        from ``leading`` instead of the recorded call (values the caller's cache key
        does not fix, such as strides: the key must still fix how Triton specializes
        each, whether it is 1 and whether a multiple of 16)."""
        self._run(leading + self._rest[len(leading) :], tensors)

    def _run(self, rest: tuple, tensors: tuple[torch.Tensor, ...]) -> None:
        stream = torch._C._cuda_getCurrentRawStream(self._device)
        # The launcher takes a pointer as an int or as an object with data_ptr(); for an
        # object it also asks the driver whether the address is device memory
        # (cuPointerGetAttribute, once per pointer and launch). Plans only hold CUDA
        # tensors (the plan key has their device), so the ints skip that query.
        pointers = [t.data_ptr() for t in tensors]
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _active(enter) or _active(leave):  # a profiler's hooks (proton): as Triton does
            grid = (self._x, self._y, self._z)
            meta = self._compiled.launch_metadata(grid, stream, *tensors, *rest)
            self._launch(stream, meta, enter, leave, rest, *pointers)
        else:
            self._launch(stream, None, None, None, rest, *pointers)
