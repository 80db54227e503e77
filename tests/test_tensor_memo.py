"""attnhub.tensor_memo: answers kept per tensor while it is unchanged, inference tensors too."""

from __future__ import annotations

import gc

import torch

from attnhub import tensor_memo
from attnhub.tensor_memo import TensorMemo, own


def _counting(memo: TensorMemo[float]):  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def compute(t: torch.Tensor) -> float:
        calls.append(1)
        return float(t.float().sum())

    return calls, lambda t: memo(t, compute)


def test_an_ordinary_tensor_is_read_once_until_changed_in_place():
    calls, read = _counting(TensorMemo())
    t = torch.ones(4, 4)
    assert read(t) == read(t) == 16.0 and len(calls) == 1
    t[0, 0] = 5.0
    assert read(t) == 20.0 and len(calls) == 2


def test_an_inference_tensor_is_read_once_and_a_change_in_place_is_seen():
    """An inference tensor keeps no version counter: the snapshot tells its change."""
    calls, read = _counting(TensorMemo())
    with torch.inference_mode():
        t = torch.ones(4, 4)
        assert read(t) == read(t) == read(t) == 16.0 and len(calls) == 1
        t[1, 2] = 3.0  # no version counter moves
        assert read(t) == 18.0 and len(calls) == 2
        assert read(t) == 18.0 and len(calls) == 2
        t.zero_()
        assert read(t) == 0.0 and len(calls) == 3
        view = t[:2]  # a view: its own geometry, its base's snapshot kept apart
        assert read(view) == 0.0 and len(calls) == 4
        view.fill_(1.0)
        assert read(view) == 8.0 and read(t) == 8.0 and len(calls) == 6


def test_an_inference_tensor_above_the_snapshot_size_is_read_every_call(monkeypatch):
    monkeypatch.setattr(tensor_memo, "SNAPSHOT_BYTES", 63)
    calls, read = _counting(TensorMemo())
    with torch.inference_mode():
        small, large = torch.ones(15), torch.ones(16)  # 60 and 64 bytes
        read(small), read(small), read(large), read(large)
    assert len(calls) == 3


def test_a_snapshot_goes_with_its_tensor():
    memo: TensorMemo[float] = TensorMemo()
    _calls, read = _counting(memo)
    with torch.inference_mode():
        t = torch.ones(8)
        read(t)
    assert len(memo._entries) == 1
    del t
    gc.collect()
    assert len(memo._entries) == 0


def test_attnhubs_own_inference_tensor_is_known_by_identity():
    memo: TensorMemo[float] = TensorMemo()
    calls, read = _counting(memo)
    with torch.inference_mode():
        mine = own(torch.ones(2, 1, 1, 6))
        view = mine.expand(2, 3, 1, 6)[:, :2]
        assert read(mine) == read(mine) == 12.0 and len(calls) == 1
        (entry,) = memo._entries.values()
        assert entry[1] is None  # no snapshot
        assert memo.get(mine) == 12.0
        read(view), read(view)
        assert len(calls) == 2
        theirs = torch.ones(2, 1, 1, 6)
        read(theirs)
        assert memo.get(theirs) is None  # a snapshot entry is never compared by get()


def test_an_ordinary_tensor_read_under_inference_mode_is_kept_apart():
    calls, read = _counting(TensorMemo())
    t = torch.ones(3)
    read(t)
    with torch.inference_mode():
        read(t)
        read(t)
    read(t)
    assert len(calls) == 2
