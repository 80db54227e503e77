"""Values computed from a tensor's contents, remembered while the tensor lives unchanged.

Mask analyses (:mod:`attnhub.mask_structure`, triton_flash's key ranges) read a mask's
values on the host, one device synchronization each; the layers of one forward pass
share their mask, so the answer is kept per mask tensor. An entry is keyed by the
tensor's id (a view's: its base's, with the view's shape, strides and offset) and
checked against a weak reference (an id is reused once the tensor is gone) and the
version counter (an in-place change makes it another mask; writes that bypass the
counter, through ``.data``, a NumPy or DLPack view or the untyped storage, are not
seen, as autograd does not see them). Inference tensors
(``torch.inference_mode``) have no version counter: their answers are computed at
every call, never kept (one synchronization per layer then). What is computed for an
ordinary tensor under that mode is kept apart from what is computed outside it (it is
made of inference tensors, which autograd cannot save).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

__all__ = ["TensorMemo"]

T = TypeVar("T")


class TensorMemo(Generic[T]):
    """``memo(tensor, compute)``: ``compute(tensor)``, once per live, unchanged tensor.

    At most ``limit`` entries: the table is cleared when full (entries are cheap to
    recompute and a forward pass uses few masks)."""

    def __init__(self, limit: int = 64) -> None:
        self._entries: dict[tuple, tuple[weakref.ref[torch.Tensor], int, T]] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def _find(self, tensor: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple | None]:
        """(the tensor's base, its key, its entry where one holds for the tensor as it
        is now, else None)."""
        # A view is known by its base and its geometry: attnhub.attention views a mask
        # of fewer than 4 dims anew at every call (one object per call), and a view
        # shares its base's version counter.
        base = tensor._base if tensor._base is not None else tensor
        # What is computed under torch.inference_mode is made of inference tensors, which
        # a call recorded by autograd cannot save for its backward: kept apart, for
        # calls in that mode.
        key = (id(base), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype,
               torch.is_inference_mode_enabled())  # fmt: skip
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is base and entry[1] == base._version:
            return base, key, entry
        return base, key, None

    def get(self, tensor: torch.Tensor, default: T | None = None) -> T | None:
        """What was computed for ``tensor`` as it is now, or ``default`` (nothing is
        computed: another module's reading of the tensor, where one was made)."""
        if tensor.is_inference():
            return default
        entry = self._find(tensor)[2]
        return default if entry is None else entry[2]

    def clear(self) -> None:
        """Forget every entry (a probe timing the computation itself)."""
        with self._lock:
            self._entries.clear()

    def __call__(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], T]) -> T:
        if tensor.is_inference():
            # An inference tensor (made under torch.inference_mode) has no version
            # counter: an in-place change could not be told apart, so nothing is kept.
            return compute(tensor)
        base, key, entry = self._find(tensor)
        if entry is not None:
            return entry[2]
        value = compute(tensor)
        with self._lock:
            if len(self._entries) >= self._limit:
                self._entries.clear()
            self._entries[key] = (weakref.ref(base), base._version, value)
        return value
