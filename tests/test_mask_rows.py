"""attnhub.mask_rows: each row's kept keys of a bool mask, read once per mask tensor,
against a reading row by row in Python."""

from __future__ import annotations

import pytest
import torch

from attnhub import mask_rows


def _by_hand(keep: torch.Tensor) -> tuple[list[int], list[int], int, bool]:
    """(first, end, fewest, runs), row by row."""
    nk = keep.shape[-1]
    firsts, ends, counts, runs = [], [], [], True
    for row in keep.reshape(-1, nk).tolist():
        kept = [j for j, x in enumerate(row) if x]
        counts.append(len(kept))
        firsts.append(kept[0] if kept else 0)
        ends.append(kept[-1] + 1 if kept else 0)
        runs &= not kept or kept == list(range(kept[0], kept[-1] + 1))
    return firsts, ends, min(counts, default=0), runs


def _cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    j = torch.arange(10)
    cases = [
        torch.ones(3, 1, 1, 10, dtype=torch.bool),
        torch.zeros(2, 1, 1, 10, dtype=torch.bool),
        torch.stack([j >= 4, j < 7, (j >= 2) & (j < 5), j < 0]).view(4, 1, 1, 10),  # padding, none
        (j >= 3).expand(2, 4, 1, 10),  # broadcast: not contiguous
        torch.tensor([True]).view(1, 1, 1, 1),
        torch.zeros(0, 1, 1, 5, dtype=torch.bool),  # no rows
        torch.ones(4, 4, dtype=torch.bool).tril(),  # several query rows
    ]
    cases += [
        torch.rand(3, 2, 1, 10, generator=gen) < p for p in (0.1, 0.5, 0.9) for _ in range(10)
    ]
    # Runs of random ends, some empty.
    for _ in range(10):
        lo = torch.randint(0, 11, (5,), generator=gen)
        hi = torch.randint(0, 11, (5,), generator=gen)
        cases.append(((j >= lo[:, None]) & (j < hi[:, None])).view(5, 1, 1, 10))
    return cases


def test_rows_are_read_as_by_hand():
    for keep in _cases():
        got = mask_rows._read(keep)
        firsts, ends, fewest, runs = _by_hand(keep)
        assert got.first.tolist() == firsts and got.end.tolist() == ends, keep
        assert (got.fewest, got.runs) == (fewest, runs), keep


def test_a_reading_is_kept_per_tensor_and_version(monkeypatch):
    reads = []
    real = mask_rows._read
    monkeypatch.setattr(mask_rows, "_read", lambda m: reads.append(1) or real(m))
    keep = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert mask_rows.known_row_keys(keep) is None  # never reads
    first = mask_rows.row_keys(keep)
    assert mask_rows.row_keys(keep) is first and mask_rows.known_row_keys(keep) is first
    assert len(reads) == 1 and first.fewest == 8
    keep[1, ..., :3] = False  # in place: another mask
    assert mask_rows.known_row_keys(keep) is None
    again = mask_rows.row_keys(keep)
    assert len(reads) == 2 and (again.fewest, again.first.tolist()) == (5, [0, 3])
    with torch.inference_mode():
        inference = torch.ones(1, 4, dtype=torch.bool)
    mask_rows.row_keys(inference)
    assert mask_rows.known_row_keys(inference) is None  # no version counter: nothing kept


@pytest.mark.parametrize(
    "bad", [torch.ones(2, 3), torch.ones(2, 0, dtype=torch.bool), torch.tensor(True)],
    ids=["float", "no keys", "0-d"],
)  # fmt: skip
def test_what_is_not_a_bool_mask_with_keys_is_refused(bad):
    with pytest.raises(ValueError, match="keep: expected a bool mask with at least one key"):
        mask_rows.row_keys(bad)


def test_a_reading_made_in_inference_mode_serves_only_that_mode():
    """A reading made under torch.inference_mode is made of inference tensors, which a
    call recorded by autograd cannot save: a call outside that mode reads the mask
    anew (it was handed the inference mode's reading: failed before)."""
    mask = torch.rand(3, 1, 1, 9, generator=torch.Generator().manual_seed(0)) > 0.4
    with torch.inference_mode():
        inside = mask_rows.row_keys(mask)
    assert inside.first.is_inference()
    outside = mask_rows.row_keys(mask)
    assert outside is not inside and not outside.first.is_inference()
    assert torch.equal(outside.first, inside.first) and torch.equal(outside.end, inside.end)
    assert mask_rows.known_row_keys(mask) is outside
    with torch.inference_mode():
        assert mask_rows.row_keys(mask) is inside  # each mode keeps its own
