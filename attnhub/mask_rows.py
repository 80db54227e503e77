"""What each row of a bool mask keeps, read once per mask tensor: counts and runs of keys.

Two readers want a key padding mask's rows: triton_flash (key ranges: each row's keys
as one run, visited without a mask, for a dense call of more query rows than a decoding
step's) and torch_sdpa (whether a row keeps no key, which PyTorch's kernels answer with
NaN, and which it otherwise finds and patches with three kernels a mask and one a call).
Each reading costs a device synchronization; :func:`row_keys` makes one, for both, and
keeps it while the tensor lives unchanged (:mod:`attnhub.tensor_memo`): the layers of
one forward pass, which share their mask, pay it once. A key mask that
:mod:`attnhub.mask_structure` derives from a dense mask comes with its reading, made in
the structure's own synchronization (:func:`summary`, :func:`remember`). A reader that
only profits where the reading exists asks :func:`known_row_keys`, which never reads.

A row is one (.., Nq) position of the mask: ``keep.reshape(-1, Nk)``'s rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tensor_memo import TensorMemo

__all__ = ["RowKeys", "from_summary", "known_row_keys", "remember", "row_keys", "summary"]


@dataclass(frozen=True)
class RowKeys:
    """The kept keys of each row of a bool (.., Nk) mask.

    ``first`` and ``end``: int64 (R,) on the mask's device, each row's first kept key
    and one past its last (both 0 for a row that keeps none). On the host: ``fewest``,
    the least number of keys a row keeps; ``runs``, whether every row's kept keys are
    one contiguous run (a row that keeps none counts as one).
    """

    first: torch.Tensor
    end: torch.Tensor
    fewest: int
    runs: bool


def summary(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first, end, scalars) of a bool (.., Nk) mask with Nk >= 1 and at least one row,
    nothing read back: ``first`` and ``end`` as :class:`RowKeys` has them, ``scalars``
    an int64 (2,) device tensor of the least count of keys a row keeps and the number of
    rows whose keys are not one run. A caller with its own values to read back reads
    these in the same synchronization (:func:`from_summary`)."""
    nk = keep.shape[-1]
    rows = keep.reshape(-1, nk)
    counts = rows.sum(dim=-1)
    # argmax takes the first of equal maxima: each row's first kept key (0 for a row of
    # none). Key j weighted j + 1: the greatest is one past the row's last (0 for none).
    first = rows.view(torch.uint8).argmax(dim=-1)
    end = (rows * torch.arange(1, nk + 1, device=keep.device)).amax(dim=-1)
    # A row keeps only keys in [first, end), so they are one run exactly when it keeps
    # them all (a row of none: 0 == 0). One count of the rows that do not.
    gaps = (end - first).ne_(counts).sum()
    return first, end, torch.stack([counts.amin(), gaps])


def from_summary(first: torch.Tensor, end: torch.Tensor, scalars: list[int]) -> RowKeys:
    """:class:`RowKeys` of :func:`summary`'s tensors and its scalars read back."""
    fewest, gapped = scalars
    return RowKeys(first, end, fewest, gapped == 0)


def _read(keep: torch.Tensor) -> RowKeys:
    """:class:`RowKeys` of a bool (.., Nk) mask with Nk >= 1: one synchronization."""
    if keep.numel() == 0:
        none = keep.new_zeros(0, dtype=torch.int64)
        return RowKeys(none, none, 0, True)
    first, end, scalars = summary(keep)
    return from_summary(first, end, scalars.tolist())


_memo: TensorMemo[RowKeys] = TensorMemo()


def row_keys(keep: torch.Tensor) -> RowKeys:
    """:class:`RowKeys` of a bool (.., Nk) mask, Nk >= 1, read once per tensor."""
    if keep.dtype != torch.bool or keep.dim() < 1 or keep.shape[-1] == 0:
        raise ValueError(
            f"keep: expected a bool mask with at least one key, got {keep.dtype} "
            f"{tuple(keep.shape)}"
        )
    return _memo(keep, _read)


def known_row_keys(mask: torch.Tensor) -> RowKeys | None:
    """The :class:`RowKeys` :func:`row_keys` read for ``mask`` as it is now, or None
    (never reads)."""
    return _memo.get(mask)


def remember(keep: torch.Tensor, rows: RowKeys) -> RowKeys:
    """Keep ``rows`` as :func:`row_keys`' reading of ``keep``, a mask whose maker read
    its rows already (:mod:`attnhub.mask_structure`'s key mask, whose rows it reads with
    the mask's structure): no backend then reads it again. Returns the reading kept (an
    earlier one, where the tensor has one)."""
    return _memo(keep, lambda _: rows)
