"""Patch mode runs dense causal / window / padding masks as their structure, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub import patching

STOCK = F.scaled_dot_product_attention


@pytest.fixture
def structured_on_cpu(monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cpu", "cuda"}))
    seen: list[dict] = []
    real = patching.attention

    def spy(query, key, value, attn_mask=None, **options):  # type: ignore[no-untyped-def]
        seen.append({"mask": attn_mask, **options})
        return real(query, key, value, attn_mask, **options)

    # Calls whose mask is not read are decided without attention()'s keyword call.
    real_entry = patching.sdpa_entry

    def entry_spy(query, key, value, attn_mask, is_causal, scale, dropout_p, backend):  # type: ignore[no-untyped-def]
        seen.append({"mask": attn_mask, "causal": is_causal})
        return real_entry(query, key, value, attn_mask, is_causal, scale, dropout_p, backend)

    monkeypatch.setattr(patching, "attention", spy)
    monkeypatch.setattr(patching, "sdpa_entry", entry_spy)
    return seen


def _hf_mask(lengths: list[int], n: int, window: int | None = None, left: bool = True):  # type: ignore[no-untyped-def]
    """What Hugging Face's sdpa path builds: (B, 1, N, N) bool, causal, padding, window."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    valid = torch.stack(
        [(torch.arange(n) >= n - m) if left else (torch.arange(n) < m) for m in lengths]
    )
    return keep[None, None] & valid[:, None, None, :]


CASES = {
    "left padding": dict(lengths=[12, 7, 3], window=None, left=True),
    "right padding": dict(lengths=[12, 9, 1], window=None, left=False),
    "window and padding": dict(lengths=[12, 5, 12], window=4, left=True),
    "no padding": dict(lengths=[12, 12, 12], window=None, left=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", [None, "triton_flash"])
def test_structured_masks_give_the_same_answer(structured_on_cpu, case, backend):
    if backend == "triton_flash":
        pytest.importorskip("triton")
        if attnhub.get_registry().unavailable_reason("triton_flash"):
            pytest.skip("triton_flash needs a GPU or TRITON_INTERPRET=1")
    n = 12
    mask = _hf_mask(n=n, **CASES[case])
    q = torch.randn(3, 4, n, 16)
    k, v = torch.randn(3, 2, n, 16), torch.randn(3, 2, n, 16)
    expected = STOCK(
        q, k, v, attn_mask=mask, enable_gqa=True
    )  # PyTorch's CPU kernel: zeros on empty rows
    with attnhub.patch(backend):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    (call,) = structured_on_cpu
    assert call["causal"] is True  # run as causal, not as a dense mask
    assert call.get("window") == (None if CASES[case]["window"] is None else (3, None))
    if case == "no padding":
        assert call["mask"] is None
    else:
        assert call["mask"].shape == (3, 1, 1, n)


def test_masks_that_are_not_exactly_a_structure_run_as_given(structured_on_cpu):
    n = 10
    almost = _hf_mask([10, 6], n)
    almost[1, 0, 8, 9] = True  # one key past the diagonal
    broadcast_rows = torch.rand(2, 1, 1, n) > 0.3  # no row per query: no diagonal to read
    scores = torch.zeros(n, n).masked_fill(~_hf_mask([10], n)[0, 0], -1e4)  # scores, not -inf
    q = k = v = torch.randn(2, 2, n, 8)
    for mask in (almost, broadcast_rows, scores):
        structured_on_cpu.clear()
        expected = STOCK(q, k, v, attn_mask=mask)
        with attnhub.patch():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, expected)
        assert structured_on_cpu[0]["mask"] is mask and structured_on_cpu[0]["causal"] is False


def test_structure_is_read_only_on_the_listed_devices():
    mask = _hf_mask([8, 4], 8)
    q = torch.randn(2, 2, 8, 8)
    assert "cpu" not in patching.STRUCTURED_MASK_DEVICES
    assert patching.mask_arguments(q, q, mask, False) == (mask, {"causal": False})
