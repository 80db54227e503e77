"""Values computed from a tensor's contents, remembered while the tensor lives unchanged.

Mask analyses (:mod:`attnhub.mask_structure`, triton_flash's key ranges) read a mask's
values on the host, one device synchronization each; the layers of one forward pass
share their mask, so the answer is kept per mask tensor. An entry is keyed by the
tensor's id (a view's: its base's, with the view's shape, strides and offset) and
checked against a weak reference (an id is reused once the tensor is gone) and the
version counter (an in-place change makes it another mask; writes that bypass the
counter, through ``.data``, a NumPy or DLPack view or the untyped storage, are not
seen, as autograd does not see them). Inference tensors
(``torch.inference_mode``) have no version counter: an answer for one is kept with a
private copy of the tensor (a snapshot, up to ``SNAPSHOT_BYTES``) and served while the
tensor still equals it (one comparison and one device synchronization a call, where
computing the answer anew, a mask's structure, took several passes and
synchronizations at every layer); the snapshot goes with the tensor. Larger inference
tensors are computed at every call. Tensors attnhub made itself and hands to no caller
(:func:`own`: the key mask of a mask's structure) are known by identity alone. What is
computed for an ordinary tensor under that mode is kept apart from what is computed
outside it (it is made of inference tensors, which autograd cannot save).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

__all__ = ["SNAPSHOT_BYTES", "TensorMemo", "own"]

T = TypeVar("T")

# An inference tensor's snapshot doubles its memory while it lives: masks up to this size
# (a (8, 1, 4096, 4096) bool mask is 128 MiB) are kept; a larger one's attention costs
# far more than reading it anew.
SNAPSHOT_BYTES = 128 * 2**20

# Bases of inference tensors that attnhub made and passes to no caller (see own()):
# id -> weak reference, checked for identity.
_owned: dict[int, weakref.ref[torch.Tensor]] = {}
# Reentrant, as is TensorMemo's: a weak reference's callback may run on a thread that
# holds the lock (a garbage collection while an entry is stored).
_owned_lock = threading.RLock()


def _base(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._base if tensor._base is not None else tensor


def own(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` (its base) as attnhub's own: made here, handed to no caller, never
    written after. Memos then know it by identity even as an inference tensor. Returns
    it."""
    if tensor.is_inference():
        base = _base(tensor)
        key = id(base)

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            with _owned_lock:
                if _owned.get(key) is ref:
                    del _owned[key]

        with _owned_lock:
            _owned[key] = weakref.ref(base, forget)
    return tensor


def _is_owned(base: torch.Tensor) -> bool:
    ref = _owned.get(id(base))
    return ref is not None and ref() is base


class TensorMemo(Generic[T]):
    """``memo(tensor, compute)``: ``compute(tensor)``, once per live, unchanged tensor.

    At most ``limit`` entries: the table is cleared when full (entries are cheap to
    recompute and a forward pass uses few masks). An entry is (weak reference to the
    base, what proves the tensor unchanged, the value): the base's version (an ordinary
    tensor), None (an inference tensor attnhub owns) or a snapshot (another inference
    tensor)."""

    def __init__(self, limit: int = 64) -> None:
        self._entries: dict[tuple, tuple[weakref.ref[torch.Tensor], Any, T]] = {}
        self._lock = threading.RLock()  # see _owned_lock
        self._limit = limit

    @staticmethod
    def _key(tensor: torch.Tensor, base: torch.Tensor) -> tuple:
        # A view is known by its base and its geometry: attnhub.attention views a mask
        # of fewer than 4 dims anew at every call (one object per call), and a view
        # shares its base's version counter. What is computed under
        # torch.inference_mode is made of inference tensors, which a call recorded by
        # autograd cannot save for its backward: kept apart, for calls in that mode.
        return (id(base), tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype,
                torch.is_inference_mode_enabled())  # fmt: skip

    def _find(
        self, tensor: torch.Tensor, compare: bool = True
    ) -> tuple[torch.Tensor, tuple, tuple | None]:
        """(the tensor's base, its key, its entry where one holds for the tensor as it
        is now, else None). ``compare=False``: a snapshot entry is not compared (that
        reads the tensor and synchronizes) and counts as none."""
        base = _base(tensor)
        key = self._key(tensor, base)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not base:
            return base, key, None
        check = entry[1]
        if tensor.is_inference():
            if check is None:  # attnhub's own: identity is enough
                return base, key, entry if _is_owned(base) else None
            holds = compare and isinstance(check, torch.Tensor) and torch.equal(check, tensor)
            return base, key, entry if holds else None
        return base, key, entry if check == base._version else None

    def get(self, tensor: torch.Tensor, default: T | None = None) -> T | None:
        """What was computed for ``tensor`` as it is now, or ``default`` (nothing is
        computed, nothing read: another module's reading of the tensor, where one was
        made; an inference tensor's snapshot is not compared)."""
        entry = self._find(tensor, compare=False)[2]
        return default if entry is None else entry[2]

    def clear(self) -> None:
        """Forget every entry (a probe timing the computation itself)."""
        with self._lock:
            self._entries.clear()

    def _check(self, tensor: torch.Tensor, base: torch.Tensor) -> tuple[bool, Any]:
        """(whether an answer for ``tensor`` can be kept, what will prove it unchanged)."""
        if not tensor.is_inference():
            return True, base._version
        if _is_owned(base):
            return True, None
        if tensor.numel() * tensor.element_size() <= SNAPSHOT_BYTES:
            return True, tensor.clone()
        return False, None

    def __call__(self, tensor: torch.Tensor, compute: Callable[[torch.Tensor], T]) -> T:
        base, key, entry = self._find(tensor)
        if entry is not None:
            return entry[2]
        keep, check = self._check(tensor, base)
        value = compute(tensor)
        if not keep:
            return value
        if isinstance(check, torch.Tensor):
            # The snapshot goes with the tensor (it doubles the tensor's memory while kept).
            def forget(ref: weakref.ref[torch.Tensor], key: tuple = key) -> None:
                with self._lock:
                    held = self._entries.get(key)
                    if held is not None and held[0] is ref:
                        del self._entries[key]

            ref = weakref.ref(base, forget)
        else:
            ref = weakref.ref(base)
        with self._lock:
            if len(self._entries) >= self._limit:
                self._entries.clear()
            self._entries[key] = (ref, check, value)
        return value
