"""Recognizing causal, window and padding structure in dense masks, exactly."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from attnhub import mask_rows, mask_structure
from attnhub.backends.torch_reference import keep_mask
from attnhub.request import AttentionParams


def _rebuilt(plan: mask_structure.MaskPlan, nq: int, nk: int) -> torch.Tensor:
    """The keep-mask that attnhub's arguments in ``plan`` mean (torch_reference's rule),
    which must be arguments attnhub.attention takes (window sides >= 0)."""
    assert plan.window is None or all(side is None or side >= 0 for side in plan.window), plan
    params = AttentionParams(causal=plan.causal, alignment=plan.alignment, window=plan.window)
    keep = keep_mask(nq, nk, params, torch.device("cpu"))
    keep = torch.ones(nq, nk, dtype=torch.bool) if keep is None else keep
    return keep if plan.attn_mask is None else keep & plan.attn_mask


def _padding(lengths: list[int], nk: int, left: bool) -> torch.Tensor:
    """(B, 1, 1, Nk) key validity: the last (right padding) or first (left) keys unused."""
    j = torch.arange(nk)
    rows = [(j >= nk - n) if left else (j < n) for n in lengths]
    return torch.stack(rows)[:, None, None, :]


STRUCTURES = [
    dict(causal=False, window=None),
    dict(causal=True, alignment="top_left", window=None),
    dict(causal=True, alignment="bottom_right", window=None),
    dict(causal=True, alignment="top_left", window=(3, None)),
    dict(causal=True, alignment="bottom_right", window=(5, None)),
    dict(causal=False, alignment="top_left", window=(2, 4)),
    dict(causal=False, alignment="bottom_right", window=(None, 1)),
    dict(causal=False, alignment="top_left", window=(0, 0)),
]


@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: str(sorted(s.items())))
@pytest.mark.parametrize(("nq", "nk"), [(9, 9), (5, 12), (1, 7), (12, 8)])
@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_every_structure_is_recognized_and_means_the_same_mask(structure, nq, nk, padding):
    keep = keep_mask(nq, nk, AttentionParams(**structure), torch.device("cpu"))
    keep = torch.ones(nq, nk, dtype=torch.bool) if keep is None else keep
    if padding is not None:
        keep = keep & _padding([nk, nk - 2, max(nk - 5, 1)], nk, left=padding == "left")
    else:
        keep = keep.expand(2, 1, nq, nk)
    plan = mask_structure._recognize(keep)
    if not keep.any(dim=-1).any():
        assert plan is None  # no query sees a key anywhere: nothing to read off
        return
    assert plan is not None, keep
    assert torch.equal(_rebuilt(plan, nq, nk).expand_as(keep), keep)
    # The float form (0 / -inf) is the same mask.
    as_float = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    float_plan = mask_structure._recognize(as_float)
    assert float_plan is not None
    assert torch.equal(_rebuilt(float_plan, nq, nk).expand_as(keep), keep)


def test_a_causal_left_padded_batch_becomes_causal_plus_a_key_mask():
    n = 16
    keep = torch.ones(n, n, dtype=torch.bool).tril() & _padding([16, 12, 5], n, left=True)
    plan = mask_structure._recognize(keep)
    assert plan is not None and plan.causal and plan.alignment == "top_left"
    assert plan.window is None
    assert plan.attn_mask is not None and plan.attn_mask.shape == (3, 1, 1, n)
    assert plan.attn_mask.sum().item() == 16 + 12 + 5
    # An all-visible mask needs nothing at all.
    full = mask_structure._recognize(torch.ones(2, 1, 4, 6, dtype=torch.bool))
    assert full == mask_structure.MaskPlan(None, False, "top_left", None)


def test_a_sliding_window_with_padding_is_a_window():
    n, w = 20, 6
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = (j <= i) & (j > i - w) & _padding([20, 14], n, left=False)
    plan = mask_structure._recognize(keep)
    assert plan is not None and plan.causal and plan.window == (w - 1, None)


@pytest.mark.parametrize(("nq", "window"), [(4, None), (4, (9, None)), (1, None), (3, (None, 1))])
def test_a_decoding_mask_reads_as_what_a_decoder_passes_attention(nq, window):
    """Bottom-right causal with Nq < Nk (speculative decoding, chunked prefill) is also
    the top-left window (None, Nk - Nq); it must come out as the bottom-right causal call
    (or window) that attnhub.attention gets from a decoder, which triton_flash runs on
    its decode kernel (as a top-left window it took the prefill kernel, 4.4x slower on
    the H200). The same call: the same keys kept, the same arguments."""
    from attnhub.backends.torch_reference import keep_mask

    nk = 40
    causal = window is None or window[1] is None
    params = AttentionParams(causal=causal, alignment="bottom_right", window=window)
    keep = keep_mask(nq, nk, params, "cpu")
    plan = mask_structure._recognize(keep)
    assert plan is not None and plan.attn_mask is None
    assert torch.equal(_rebuilt(plan, nq, nk), keep)
    if nq > 1:  # Nq == 1 bottom-right causal keeps every key: no structure is needed
        assert (plan.causal, plan.alignment, plan.window) == (causal, "bottom_right", window)


@pytest.mark.parametrize("flip", list(itertools.product([0, 5, 15], [0, 7, 15])))
def test_almost_a_structure_is_no_structure(flip):
    """One changed element anywhere makes it another mask: recognized exactly or not at all."""
    n = 16
    keep = torch.ones(n, n, dtype=torch.bool).tril() & _padding([16, 11], n, left=True)
    b_i_j = (1, 0, *flip)
    keep[b_i_j] = ~keep[b_i_j]
    plan = mask_structure._recognize(keep)
    if plan is not None:  # still a structure (e.g. it moved the padding): it must be exact
        assert torch.equal(_rebuilt(plan, n, n).expand_as(keep), keep)


def test_random_masks_are_never_misread():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        nq, nk = (int(x) for x in torch.randint(1, 9, (2,), generator=gen))
        keep = torch.rand(2, 1, nq, nk, generator=gen) < 0.7
        plan = mask_structure._recognize(keep)
        if plan is not None:
            assert torch.equal(_rebuilt(plan, nq, nk).expand_as(keep), keep)


def test_a_mask_without_rows_has_no_plan():
    """A mask of an empty batch has no structure to run: None (the call runs as given).
    The one-row reading raised a RuntimeError on it (a reduction over no rows)."""
    assert mask_structure.recognize(torch.zeros(0, 1, 1, 5, dtype=torch.bool)) is None
    assert mask_structure.recognize(torch.zeros(0, 1, 4, 5, dtype=torch.bool)) is None


def test_float_masks_with_scores_and_masks_that_need_grad_are_left_alone():
    scores = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -1e9)
    assert mask_structure.recognize(scores) is None  # -1e9 is a score to add, not -inf
    causal = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -torch.inf)
    assert mask_structure.recognize(causal) is not None
    assert mask_structure.recognize(causal.clone().requires_grad_()) is None


def test_recognition_is_cached_per_tensor_and_version():
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    first = mask_structure.recognize(keep)
    assert first is not None and first.causal
    assert mask_structure.recognize(keep) is first  # the same tensor, unchanged: cached
    keep.fill_(True)  # an in-place change is another mask
    again = mask_structure.recognize(keep)
    assert again is not None and not again.causal and again.attn_mask is None


def test_a_recognized_mask_is_not_kept_alive_by_the_memo():
    """The memo keeps each mask's plan while the mask lives, never the mask itself (a
    plan that held it kept each step's mask alive until 64 more were read)."""
    tril = torch.ones(12, 12, dtype=torch.bool).tril()
    for make in (
        lambda: _padding([12, 7, 3], 12, left=True),
        lambda: _padding([12, 7], 12, left=False) & tril,
    ):
        mask = make()
        plan = mask_structure.recognize(mask)
        assert plan is not None and plan.attn_mask is not None
        assert mask_structure.recognize(mask) is plan  # from the memo
        alive = weakref.ref(mask)
        del mask, plan
        gc.collect()
        assert alive() is None


def test_a_mask_made_under_inference_mode_is_recognized_at_every_call():
    """Inference tensors have no version counter (reading it raised RuntimeError, so a
    patched model under torch.inference_mode failed on its padding mask): recognized
    anew at every call, an in-place change inside inference mode included."""
    with torch.inference_mode():
        keep = torch.ones(6, 6, dtype=torch.bool).tril()
        first = mask_structure.recognize(keep)
        assert first is not None and first.causal
        keep.fill_(True)
        again = mask_structure.recognize(keep)
        assert again is not None and not again.causal and again.attn_mask is None


@pytest.mark.parametrize("padding", ["left", "right"])
def test_the_key_mask_of_a_plan_comes_with_its_rows_reading(padding):
    """The plan's key mask is given its rows' reading (attnhub.mask_rows, read back with
    the structure's comparison), which must be what reading it gives: triton_flash's key
    ranges and torch_sdpa use it without reading the mask again."""
    n = 16
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    keep = tril & _padding([16, 9, 1, 0], n, left=padding == "left")
    plan = mask_structure._recognize(keep)
    assert plan is not None and plan.attn_mask is not None
    given = mask_rows.known_row_keys(plan.attn_mask)
    read = mask_rows._read(plan.attn_mask)
    assert given is not None
    assert torch.equal(given.first, read.first) and torch.equal(given.end, read.end)
    assert (given.fewest, given.runs) == (read.fewest, read.runs) == (0, True)
    # A key mask with holes (the second entry's): its rows are not all runs, and the
    # reading says so.
    keys = torch.stack([torch.ones(n, dtype=torch.bool), torch.tensor([True, False] * 8)])
    holes = tril & keys[:, None, None, :]
    plan = mask_structure._recognize(holes)
    assert plan is not None and plan.attn_mask is not None
    given = mask_rows.known_row_keys(plan.attn_mask)
    assert given is not None and not given.runs and given.fewest == 8
