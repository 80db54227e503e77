"""A window side that excludes no key of the call is no side (issue 16: a decoding step
of a sliding-window model whose cache is shorter than its window ran on the only
kernels with windows, at several times the cost of PyTorch's)."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnhub
from attnhub.backends.torch_reference import reference_attention
from attnhub.validation import make_params


def _params(q, k, **options):  # type: ignore[no-untyped-def]
    opts = {"causal": False, "alignment": "top_left", "window": None, "softcap": None,
            "scale": None, "dropout_p": 0.0, "block_sparse": None, "return_lse": False,
            **options}  # fmt: skip
    return make_params(q, key=k, **opts)


def _excluded_keys(nq, nk, alignment, window):  # type: ignore[no-untyped-def]
    """Brute force: which (row, key) pairs the window's sides exclude."""
    left, right = window
    excluded = set()
    for i, j in itertools.product(range(nq), range(nk)):
        p = i + (nk - nq if alignment == "bottom_right" else 0)
        if (left is not None and j < p - left) or (right is not None and j > p + right):
            excluded.add((i, j))
    return excluded


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize(("nq", "nk"), [(1, 7), (3, 7), (7, 7), (7, 3), (1, 1)])
def test_a_side_is_dropped_exactly_when_it_excludes_no_key(alignment, nq, nk):
    q, k = torch.empty(1, 1, nq, 4), torch.empty(1, 1, nk, 4)
    for left, right in itertools.product([None, 0, 1, 2, 5, 6, 7, 9], repeat=2):
        if left is None and right is None:
            continue
        for causal in (False, True):
            params = _params(q, k, causal=causal, alignment=alignment, window=(left, right))
            kept_rule = params.causal or causal
            got = params.window or (None, None)
            for side, given, kept in zip(("left", "right"), (left, right), got):
                if given is None:
                    assert kept is None
                    continue
                only = (given, None) if side == "left" else (None, given)
                useless = not _excluded_keys(nq, nk, alignment, only) or (
                    side == "right" and kept_rule
                )
                assert (kept is None) == useless, (side, given, causal, params)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_dropping_sides_keeps_the_answer(alignment):
    torch.manual_seed(0)
    for nq, nk, window in [(1, 9, (8, 0)), (1, 9, (7, 0)), (4, 9, (8, 3)), (9, 9, (8, 8)), (5, 9, (3, 1))]:  # fmt: skip
        q = torch.randn(1, 2, nq, 8, dtype=torch.float64)
        k, v = (torch.randn(1, 2, nk, 8, dtype=torch.float64) for _ in range(2))
        for causal in (False, True):
            out = attnhub.attention(q, k, v, causal=causal, alignment=alignment, window=window)
            # The reference with the window as given, not simplified.
            from attnhub.request import AttentionParams

            given = AttentionParams(causal=causal and not (alignment == "bottom_right" and nq == 1),
                                    alignment=alignment, window=window, scale=8**-0.5)  # fmt: skip
            ref, _ = reference_attention(q, k, v, None, given)
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)


def test_a_decoding_step_inside_the_window_is_a_plain_call():
    q = torch.randn(2, 4, 1, 16)
    k = torch.randn(2, 4, 576, 16)
    inside = attnhub.explain(q, k, k, causal=True, alignment="bottom_right", window=(1023, 0))
    assert not inside.request.window and not inside.request.causal
    longer = torch.randn(2, 4, 2048, 16)
    outside = attnhub.explain(q, longer, longer, causal=True, alignment="bottom_right", window=(1023, 0))  # fmt: skip
    assert outside.request.window
