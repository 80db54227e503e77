"""The fused mask reading (backends/triton_flash/mask_reading.py) against PyTorch's.

attnhub.mask_structure reads a mask on CUDA with two Triton kernels and one
synchronization; it must be the same function as the PyTorch ops' reading, output for
output: the candidate, the comparison, the key mask and its rows. Here both readings
run on the same masks (the kernels in Triton's interpreter on a machine without a GPU),
masks of every kind the structure tests make, at sizes that cross the kernels' tiles,
with strides that are not contiguous.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from attnhub import mask_rows, mask_structure  # noqa: E402
from attnhub.backends.torch_reference import keep_mask  # noqa: E402
from attnhub.backends.triton_flash import mask_reading  # noqa: E402
from attnhub.request import AttentionParams  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

STRUCTURES = [
    {},
    {"causal": True},
    {"causal": True, "alignment": "bottom_right"},
    {"causal": True, "window": (3, None)},
    {"causal": True, "alignment": "bottom_right", "window": (70, None)},
    {"window": (2, 4)},
    {"alignment": "bottom_right", "window": (None, 1)},
    {"window": (0, 0)},
]


def _masks(nq: int, nk: int, seed: int) -> list[torch.Tensor]:
    """Structured masks with and without padding, almost-structures and random masks,
    (B, 1, Nq, Nk), (B, Nq, Nk) and (Nq, Nk), contiguous or not."""
    g = torch.Generator().manual_seed(seed)
    masks = []
    for structure in STRUCTURES:
        keep = keep_mask(nq, nk, AttentionParams(**structure), torch.device("cpu"))
        keep = torch.ones(nq, nk, dtype=torch.bool) if keep is None else keep
        j = torch.arange(nk)
        lengths = torch.randint(1, nk + 1, (3,), generator=g)
        left = (j >= nk - lengths[:, None])[:, None, None, :]
        right = (j < lengths[:, None])[:, None, None, :]
        masks += [keep, keep & left, keep & right, (keep & left)[:, 0]]
        almost = (keep & left).clone()
        almost[1, 0, int(torch.randint(nq, (1,), generator=g)), int(torch.randint(nk, (1,), generator=g))] ^= True  # fmt: skip
        masks.append(almost)
    masks.append(torch.rand(2, 1, nq, nk, generator=g) < 0.7)
    masks.append(torch.zeros(2, 1, nq, nk, dtype=torch.bool))
    # Not contiguous: a transposed (B, Nk, Nq) mask read as (B, Nq, Nk), and a slice of a
    # wider one.
    masks.append(torch.ones(2, nk, nq, dtype=torch.bool).triu().transpose(1, 2))
    wide = torch.ones(2, 1, nq, nk + 5, dtype=torch.bool).tril()
    masks.append(wide[..., :nk])
    return [m.to(DEVICE) for m in masks]


def _torch_reading(keep: torch.Tensor, monkeypatch) -> mask_structure.MaskPlan | None:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as patch:
        patch.setattr(mask_structure, "FUSED_DEVICES", frozenset())
        return mask_structure._rows(keep)


def _fused_reading(keep: torch.Tensor, monkeypatch) -> mask_structure.MaskPlan | None:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as patch:
        patch.setattr(mask_structure, "FUSED_DEVICES", frozenset({keep.device.type}))
        patch.setattr(mask_structure, "_candidate", None)  # the PyTorch reading must not run
        return mask_structure._rows(keep)


def _check_the_same_plan(keep: torch.Tensor, monkeypatch, i: int) -> None:  # type: ignore[no-untyped-def]
    """Both readings of ``keep``: the same plan, the key mask's rows given as a fresh
    reading of it gives them."""
    assert mask_reading.takes(keep)
    expected = _torch_reading(keep, monkeypatch)
    plan = _fused_reading(keep, monkeypatch)
    assert (plan is None) == (expected is None), (i, keep.shape, expected, plan)
    if plan is not None and expected is not None:
        assert (plan.causal, plan.alignment, plan.window) == (expected.causal, expected.alignment, expected.window), i  # fmt: skip
        assert (plan.attn_mask is None) == (expected.attn_mask is None), i
        if plan.attn_mask is not None and expected.attn_mask is not None:
            assert plan.attn_mask.dtype == torch.bool and plan.attn_mask.shape == expected.attn_mask.shape  # fmt: skip
            assert torch.equal(plan.attn_mask, expected.attn_mask), i
            given = mask_rows.known_row_keys(plan.attn_mask)
            fresh = mask_rows._read(expected.attn_mask)
            assert given is not None
            assert torch.equal(given.first, fresh.first) and torch.equal(given.end, fresh.end), i
            assert (given.fewest, given.runs) == (fresh.fewest, fresh.runs), i


@pytest.mark.parametrize(("nq", "nk"), [(1, 7), (9, 9), (5, 12), (12, 8), (70, 140), (130, 66)])
def test_the_fused_reading_is_the_pytorch_reading(nq, nk, monkeypatch):  # type: ignore[no-untyped-def]
    for i, keep in enumerate(_masks(nq, nk, seed=nq * 1000 + nk)):
        _check_the_same_plan(keep, monkeypatch, i)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("b", "n"), [(8, 512), (2, 4096), (3, 1000)])
def test_gpu_the_fused_reading_of_model_masks(b, n, monkeypatch):  # type: ignore[no-untyped-def]
    """The masks a padded batch's forward makes (Hugging Face's sdpa path: (B, 1, N, N)
    bool), causal and with a sliding window of 1024, left and right padded, and one
    element changed: both readings on the GPU, the same plan."""
    g = torch.Generator().manual_seed(n)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0] = n
    for k, structure in enumerate([j <= i, (j <= i) & (j > i - 1024)]):
        for left in (True, False):
            pad = (j >= n - lengths[:, None]) if left else (j < lengths[:, None])
            keep = (structure & pad[:, None, :])[:, None].to(DEVICE)
            _check_the_same_plan(keep, monkeypatch, 2 * k + left)
            almost = keep.clone()
            almost[b - 1, 0, n - 1, 0] ^= True
            _check_the_same_plan(almost, monkeypatch, 4 + 2 * k + left)


def test_the_fused_readings_raw_outputs(monkeypatch):  # type: ignore[no-untyped-def]
    """read_rows' key_ok, candidate and key-mask rows, each against its PyTorch form,
    on masks whose candidate comes back whatever the comparison says (random ones
    among them)."""
    for keep in _masks(33, 150, seed=3):
        key_ok, read, first, end = mask_reading.read_rows(keep)
        assert torch.equal(key_ok, keep.any(dim=-2))
        found = mask_structure._candidate(keep)
        assert bool(read[mask_reading.ANY_SEEN]) == (found is not None)
        if found is not None:
            _, offset, left = found
            bounded = bool(read[mask_reading.BOUNDED])
            assert read[mask_reading.OFFSET] == offset
            assert (read[mask_reading.LEFT] if bounded else None) == left
        t_first, t_end, t_scalars = mask_rows.summary(key_ok)
        assert torch.equal(first, t_first) and torch.equal(end, t_end)
        assert [read[mask_reading.FEWEST], read[mask_reading.GAPS]] == t_scalars.tolist()


def test_masks_broadcast_along_a_leading_dim_are_left_to_pytorch():
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    assert not mask_reading.takes(keep.expand(2, 3, 4, 4))
    assert mask_reading.takes(keep.expand(1, 1, 4, 4))
    assert not mask_reading.takes(keep.expand(2, 1, 1, 4, 4))  # five dims
    assert not mask_reading.takes(torch.zeros(0, 1, 4, 4, dtype=torch.bool))
    assert not mask_reading.takes(keep.float())
