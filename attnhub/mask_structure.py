"""Recognizing the structure of a dense attention mask, so that it runs as that structure.

Models written for ``F.scaled_dot_product_attention`` (Hugging Face's ``sdpa`` path
among them) materialize causal, sliding-window and padding masks as 4-D bool tensors.
Run as generic masks they cost a full pass over every (query, key) block; run as what
they are (``causal``, ``window``, and at most a per-key padding vector) the kernels skip
the blocks that are masked whole. :func:`recognize` finds that form, exactly:

    keep[b, h, i, j] == key_ok[b, h, j] and structure(i, j)

where ``structure`` is attnhub's causal/window rule (``i`` the query row, ``j`` the key)
and ``key_ok`` is the set of keys that some query may see (the padding). It is a
rewrite of the same function, never an approximation: the candidate is built from the
mask and then compared with it element by element; a mask that is almost a window is
not a window, and comes back as None (the call runs with the mask as given).

Recognition costs a few passes over the mask: on CUDA two Triton kernels and one
device synchronization (``backends/triton_flash/mask_reading.py``), elsewhere (or
without Triton) some thirty PyTorch ops and two synchronizations (a float mask adds one
either way); the reading also gives the rows of the plan's key mask, for the backends
that read them (:mod:`attnhub.mask_rows`). It is cached per
mask tensor (identity and version counter, :mod:`attnhub.tensor_memo`), so the layers
of one forward pass, which share their mask, pay it once; under
``torch.inference_mode`` (inference tensors keep no version counter) the later layers
pay one comparison with a snapshot of the mask and one synchronization instead, for
masks up to ``tensor_memo.SNAPSHOT_BYTES``. It never runs while ``torch.compile`` traces
(the answer depends on the mask's values).

Masks recognized: bool (True = may attend) and float masks whose every value is 0 or
-inf (other float values are scores to add, not a mask, and are left alone).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import mask_rows
from .tensor_memo import TensorMemo, own

__all__ = ["MaskPlan", "recognize"]

log = logging.getLogger("attnhub")


@dataclass(frozen=True)
class MaskPlan:
    """What a mask means, in attnhub's terms.

    ``attn_mask`` is None (no mask left) or a bool (mb, mh, 1, Nk) key mask (True = the
    key may be seen), broadcast like the original; ``causal``, ``alignment`` and
    ``window`` are :func:`attnhub.attention`'s arguments.
    """

    attn_mask: torch.Tensor | None
    causal: bool
    alignment: str
    window: tuple[int | None, int | None] | None

    def describe(self) -> str:
        parts = [f"causal ({self.alignment})"] if self.causal else []
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.attn_mask is not None:
            parts.append("key padding")
        return ", ".join(parts) or "no mask"


def _keep(mask: torch.Tensor) -> torch.Tensor | None:
    """The bool keep-mask of a bool mask, or of a float mask of only 0 and -inf."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        return None
    keep = mask == 0
    if not bool((keep | (mask == float("-inf"))).all()):
        return None
    return keep


def _structure(
    nq: int, nk: int, offset: int, left: int | None, device: torch.device
) -> torch.Tensor:
    """keep[i, j] = i - left <= j <= i + offset (left None: no lower bound)."""
    i = torch.arange(nq, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    keep = j <= i + offset
    if left is not None:
        keep &= j >= i - left
    return keep


def _to_arguments(
    offset: int, left: int | None, nq: int, nk: int
) -> tuple[bool, str, tuple[int | None, int | None] | None] | None:
    """(causal, alignment, window) keeping keys ``i - left <= j <= i + offset``, or None.

    The diagonal of ``causal`` sits at ``i`` (top-left) or ``i + nk - nq`` (bottom-right);
    other offsets, and the lower bound, become a window around one of them. None where
    no window with sides >= 0 says it. Where both alignments say it, ``causal`` wins,
    then the bottom-right window: a speculative-decoding mask (Nq 4, Nk 32K, keys up to
    ``i + nk - nq``) is bottom-right causal, the call attnhub.attention gets from a
    decoder, which triton_flash runs on its split-KV decode kernel; as the top-left
    window (None, nk - nq) it took the prefill kernel, 4.4x slower on the H200
    (``benchmarks/results/workloads-h200.md``: patched 1.14 ms, auto 0.26).
    """
    if offset >= nk - 1:  # no upper bound within the keys
        if left is None:
            return False, "top_left", None
        # A lower bound alone: from the top-left diagonal, else from the bottom-right one
        # (a windowed decoding step: one query, the window's keys the newest).
        for alignment, diagonal in (("top_left", 0), ("bottom_right", nk - nq)):
            if left + diagonal >= 0:
                return False, alignment, (left + diagonal, None)
        return None
    windows = []
    for alignment, diagonal in (("top_left", 0), ("bottom_right", nk - nq)):
        # Relative to the diagonal p = i + diagonal: keys p - lower <= j <= p + upper.
        upper = offset - diagonal
        lower = None if left is None else left + diagonal
        if upper < 0 or (lower is not None and lower < 0):
            continue
        if upper == 0:
            return True, alignment, None if lower is None else (lower, None)
        windows.append((False, alignment, (lower, upper)))
    return windows[-1] if windows else None


def _candidate(keep: torch.Tensor) -> tuple[torch.Tensor, int, int | None] | None:
    """(key_ok, offset, left) read off the mask; to be verified by the caller."""
    nq, nk = keep.shape[-2:]
    key_ok = keep.any(dim=-2)  # (..., nk): keys that some query sees
    # The structure shows in the union of the rows of every batch and head, where
    # padding (which differs between them) is least in the way.
    union = keep.flatten(0, -3).any(dim=0) if keep.dim() > 2 else keep  # (nq, nk)
    columns = torch.arange(nk, device=keep.device)
    rows = torch.arange(nq, device=keep.device)
    seen = union.any(dim=-1)
    last = torch.where(union, columns, -1).amax(dim=-1)  # (nq,)
    first = torch.where(union, columns, nk).amin(dim=-1)
    # The upper bound shows where it is below the last key; the lower where above 0.
    upper_cut = seen & (last < nk - 1)
    lower_cut = seen & (first > 0)
    offset, left, any_seen, bounded_below = torch.stack(
        [
            torch.where(upper_cut, last - rows, nk - 1).amin(),
            torch.where(seen, rows - first, -nk).amax(),
            seen.any(),
            lower_cut.any(),
        ]
    ).tolist()
    if not any_seen:
        return None
    return key_ok, int(offset), int(left) if bounded_below else None


def _recognize(mask: torch.Tensor) -> MaskPlan | None:
    keep = _keep(mask)
    if keep is None:
        return None
    if keep.numel() == 0:  # no row or no key: nothing to run as a structure
        return None
    return _rows(keep)


def _rows(keep: torch.Tensor) -> MaskPlan | None:
    """:func:`_recognize` of a bool keep-mask of any number of rows."""
    nq, nk = keep.shape[-2:]
    fused = _fused_reading(keep)
    if fused is not None:
        key_ok, read, first, end = fused
        reader = _reader()
        if not read[reader.ANY_SEEN]:
            return None
        left = read[reader.LEFT] if read[reader.BOUNDED] else None
        arguments = _to_arguments(read[reader.OFFSET], left, nq, nk)
        if arguments is None or read[reader.BAD]:
            return None
        row_scalars = [read[reader.FEWEST], read[reader.GAPS]]
        return _plan(key_ok, arguments, not read[reader.NOT_IMPLIED], first, end, row_scalars)
    found = _candidate(keep)
    if found is None:
        return None
    key_ok, offset, left = found
    arguments = _to_arguments(offset, left, nq, nk)
    if arguments is None:
        return None
    structure = _structure(nq, nk, offset, left, keep.device)
    same = (keep == (key_ok.unsqueeze(-2) & structure)).all()
    # No key mask where the structure alone keeps exactly key_ok's keys: every key
    # (keep == structure then), or all but those no row of the structure sees (a window's
    # lower bound hides the oldest keys from every row of a short query block), so that
    # the call stays maskless, as a decoder's is.
    implied = (key_ok == structure.any(dim=-2)).all()
    # The key mask's rows (attnhub.mask_rows: triton_flash's key ranges, torch_sdpa's
    # empty rows), read back with the comparison: one synchronization for the three,
    # where each took its own (a backend's reading of the key mask came after).
    first, end, scalars = mask_rows.summary(key_ok)
    is_same, is_implied, *row_scalars = torch.cat([same.view(1), implied.view(1), scalars]).tolist()
    if not is_same:
        return None
    return _plan(key_ok, arguments, is_implied, first, end, row_scalars)


def _plan(
    key_ok: torch.Tensor,
    arguments: tuple[bool, str, tuple[int | None, int | None] | None],
    implied: bool,
    first: torch.Tensor,
    end: torch.Tensor,
    row_scalars: list[int],
) -> MaskPlan:
    """The plan of a mask read as ``key_ok & structure`` (``arguments``), its key mask
    given the rows read with it (``first``, ``end``, ``row_scalars``: mask_rows.summary's)."""
    causal, alignment, window = arguments
    if implied:
        return MaskPlan(None, causal, alignment, window)
    # attnhub's own tensor (tensor_memo.own): the memos that read it later (key ranges,
    # row keys) know it by identity under torch.inference_mode too.
    key_mask = own(key_ok.unsqueeze(-2))
    mask_rows.remember(key_mask, mask_rows.from_summary(first, end, row_scalars))
    return MaskPlan(key_mask, causal, alignment, window)


# Where a mask's reading runs as two Triton kernels and one synchronization
# (backends/triton_flash/mask_reading.py) instead of some thirty PyTorch ops and two
# synchronizations: on CUDA, where each small op costs the host several microseconds (a
# B8 N512 mask took about 0.5 ms on an H100). Elsewhere PyTorch's ops serve (on a CPU
# the kernels would run in Triton's interpreter). On CUDA from FUSED_CAPABILITY up:
# sm_90, the GPUs triton_flash runs and is checked on; older ones keep PyTorch's ops
# until the kernels are run there.
FUSED_DEVICES = frozenset({"cuda"})
FUSED_CAPABILITY = (9, 0)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= FUSED_CAPABILITY


@functools.cache
def _reader() -> Any:
    """The fused reading's module, or None where Triton does not import."""
    try:
        from .backends.triton_flash import mask_reading
    except Exception as exc:  # no Triton, or one that fails to import
        log.info("attnhub: masks are read with PyTorch ops (%s: %s)", type(exc).__name__, exc)
        return None
    return mask_reading


def _fused_reading(keep: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """mask_reading.read_rows(keep) where it serves this mask, else None."""
    if keep.device.type not in FUSED_DEVICES or (keep.is_cuda and not _capable(keep.get_device())):
        return None
    reader = _reader()
    if reader is None or not reader.takes(keep):
        return None
    return reader.read_rows(keep)


_memo: TensorMemo[MaskPlan | None] = TensorMemo()


def recognize(mask: torch.Tensor) -> MaskPlan | None:
    """The structure of ``mask`` (broadcastable to (B, H, Nq, Nk)), or None.

    None when the mask is not exactly key padding combined with causal or window
    structure, when it is a float mask with values other than 0 and -inf, or when it
    requires grad (a gradient is owed to it). The plan's ``attn_mask`` is attnhub's own
    (never write into it). See the module docstring.
    """
    if mask.requires_grad or mask.dim() < 2:
        return None
    return _memo(mask, _recognize)
