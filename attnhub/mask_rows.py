"""What each row of a bool mask keeps, read once per mask tensor: counts and runs of keys.

Two readers want a key padding mask's rows: triton_flash (key ranges: each row's keys
as one run, visited without a mask, for a dense call of more query rows than a decoding
step's) and torch_sdpa (whether a row keeps no key, which PyTorch's kernels answer with
NaN, and which it otherwise finds and patches with three kernels a mask and one a call).
Each reading costs a device synchronization; :func:`row_keys` makes one, for both, and
keeps it while the tensor lives unchanged (:mod:`attnhub.tensor_memo`): the layers of
one forward pass, which share their mask, pay it once. A reader that only profits where
the reading exists asks :func:`known_row_keys`, which never reads.

A row is one (.., Nq) position of the mask: ``keep.reshape(-1, Nk)``'s rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tensor_memo import TensorMemo

__all__ = ["RowKeys", "known_row_keys", "row_keys"]


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


def _read(keep: torch.Tensor) -> RowKeys:
    """:class:`RowKeys` of a bool (.., Nk) mask with Nk >= 1: one synchronization."""
    nk = keep.shape[-1]
    rows = keep.reshape(-1, nk)
    if rows.shape[0] == 0:
        none = rows.new_zeros(0, dtype=torch.int64)
        return RowKeys(none, none, 0, True)
    counts = rows.sum(dim=-1)
    # argmax takes the first of equal maxima: each row's first kept key (0 for a row of
    # none). Key j weighted j + 1: the greatest is one past the row's last (0 for none).
    first = rows.view(torch.uint8).argmax(dim=-1)
    end = (rows * torch.arange(1, nk + 1, device=keep.device)).amax(dim=-1)
    # A row keeps only keys in [first, end), so they are one run exactly when it keeps
    # them all (a row of none: 0 == 0). One count of the rows that do not.
    gaps = (end - first).ne_(counts).sum()
    fewest, gapped = torch.stack([counts.amin(), gaps]).tolist()
    return RowKeys(first, end, fewest, gapped == 0)


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
