"""What each row of a bool mask keeps, read once per mask tensor: counts and runs of keys.

A padded batch's decoding step makes a fresh (B, 1, 1, Nk) mask every step, and three
readers want its rows: :mod:`attnhub.mask_structure` (the plan: how far the kept keys
reach), triton_flash (key ranges: each row's keys as one run, visited without a mask)
and torch_sdpa (whether a row keeps no key, which PyTorch's kernels answer with NaN,
and which it otherwise finds and patches with three kernels a mask and one a call).
Each reading costs a device synchronization; :func:`row_keys` makes one, for all of
them, and keeps it while the tensor lives unchanged (:mod:`attnhub.tensor_memo`). A
reader that only profits where the reading exists asks :func:`known_row_keys`, which
never reads.

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
    and one past its last (both 0 for a row that keeps none). The rest is on the host:
    ``first_kept`` / ``last_kept``, the first and last key any row keeps (Nk and -1
    where no row keeps one); ``fewest`` / ``most``, the least and greatest number of
    keys a row keeps; ``runs``, whether every row's kept keys are one contiguous run
    (a row that keeps none counts as one).
    """

    first: torch.Tensor
    end: torch.Tensor
    first_kept: int
    last_kept: int
    fewest: int
    most: int
    runs: bool


# Masks of at most this many rows (a decoding step's (B, 1, 1, Nk) has B) are summed up
# on the host from each row's count, first and end, copied in one piece: seven fewer
# kernels than the summary on the device, each a launch that the first layer of every
# decoding step pays (about 660 us of host time for that layer's patched call on an
# H100, the mask's reading among it: archive/patched-generate-probe-padded-drain-h100-
# 2026-12-06-2175d7e.txt). Larger masks (a prefill's (B, 1, N, N)) keep the device's
# reductions: their rows' values would be a long copy and a long Python loop.
HOST_SUMMARY_ROWS = 256


def _read(keep: torch.Tensor) -> RowKeys:
    """:class:`RowKeys` of a bool (.., Nk) mask with Nk >= 1: one synchronization."""
    nk = keep.shape[-1]
    rows = keep.reshape(-1, nk)
    if rows.shape[0] == 0:
        none = rows.new_zeros(0, dtype=torch.int64)
        return RowKeys(none, none, nk, -1, 0, 0, True)
    counts = rows.sum(dim=-1)
    # argmax takes the first of equal maxima: each row's first kept key (0 for a row of
    # none). Key j weighted j + 1: the greatest is one past the row's last (0 for none).
    first = rows.view(torch.uint8).argmax(dim=-1)
    end = (rows * torch.arange(1, nk + 1, device=keep.device)).amax(dim=-1)
    # A row keeps only keys in [first, end), so they are one run exactly when it keeps
    # them all (a row of none: 0 == 0).
    if rows.shape[0] <= HOST_SUMMARY_ROWS:
        row_counts, row_firsts, row_ends = torch.stack([counts, first, end]).tolist()
        runs = all(e - f == c for c, f, e in zip(row_counts, row_firsts, row_ends))
        kept_firsts = [f for c, f in zip(row_counts, row_firsts) if c]
        return RowKeys(
            first, end, min(kept_firsts, default=nk), max(row_ends) - 1,
            min(row_counts), max(row_counts), runs,
        )  # fmt: skip
    # One count of the rows that are not one run.
    gaps = (end - first).ne_(counts).sum()
    first_kept, end_kept, fewest, most, gapped = torch.stack(
        [rows.any(dim=0).view(torch.uint8).argmax(), end.amax(), *torch.aminmax(counts), gaps]
    ).tolist()
    if end_kept == 0:
        first_kept = nk
    return RowKeys(first, end, first_kept, end_kept - 1, fewest, most, gapped == 0)


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
