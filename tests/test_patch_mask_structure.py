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
        seen.append({"mask": attn_mask, "query_shape": tuple(query.shape), **options})
        return real(query, key, value, attn_mask, **options)

    # Eager calls are decided without attention()'s keyword call (sdpa_entry), with the
    # structure read off their mask.
    real_entry = patching.sdpa_entry

    def entry_spy(query, key, value, attn_mask, is_causal, scale, dropout_p, backend,  # type: ignore[no-untyped-def]
                  alignment="top_left", window=None):  # fmt: skip
        seen.append({"mask": attn_mask, "causal": is_causal, "alignment": alignment,
                     "window": window, "query_shape": tuple(query.shape)})  # fmt: skip
        return real_entry(query, key, value, attn_mask, is_causal, scale, dropout_p, backend,
                          alignment, window)  # fmt: skip

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
    n = 20
    almost = _hf_mask([n, 6], n)
    almost[1, 0, n - 2, n - 1] = True  # one key past the diagonal
    broadcast_rows = torch.rand(2, 1, 1, n) > 0.3  # no row per query: no diagonal to read
    scores = torch.zeros(n, n).masked_fill(~_hf_mask([n], n)[0, 0], -1e4)  # scores, not -inf
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
    assert patching.mask_arguments(q, q, mask, False) == (
        mask, {"causal": False, "alignment": "top_left", "window": None}
    )  # fmt: skip


@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(3, 1, 4, 4, dtype=torch.bool).tril(),  # a batch of 3 for 2 queries
        torch.ones(1, 3, 4, 4, dtype=torch.bool),  # 3 heads for 1
        torch.ones(1, 1, 1, 4, 4, dtype=torch.bool).tril(),  # more dims than the query
    ],
    ids=["batch", "heads", "rank"],
)
def test_a_structured_mask_that_does_not_broadcast_fails_as_stock(structured_on_cpu, mask):
    """A plan that needs no key mask dropped the mask, and its shape with it: the call
    succeeded where PyTorch's function raises."""
    q = k = v = torch.randn(2, 1, 4, 8)
    with pytest.raises(RuntimeError) as stock:
        STOCK(q, k, v, attn_mask=mask)
    with attnhub.patch(), pytest.raises(RuntimeError) as patched:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert str(patched.value) == str(stock.value)


def _decoding_step(batch=3, kv_heads=2, rows=1, keys=9, dtype=torch.float64, grad=False):  # type: ignore[no-untyped-def]
    """A padded batch's grouped-query decoding step: query (B, 2 * Hkv, 1, D) (``rows``
    > 1: Hugging Face's packed form, ``pack_gqa``, (B, Hkv, G, D)), key/value
    (B, Hkv, Nk, D), a left-padding mask (B, 1, 1, Nk)."""
    heads = 2 * kv_heads if rows == 1 else kv_heads
    q = torch.randn(batch, heads, rows, 8, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(batch, kv_heads, keys, 8, dtype=dtype, requires_grad=grad) for _ in "kv")
    lengths = torch.arange(batch) % keys + 1
    mask = (torch.arange(keys) >= keys - lengths[:, None])[:, None, None, :]
    return q, k, v, mask


@pytest.mark.parametrize(
    "form", ["bool", "float", "mask batch 1", "3-D mask", "window", "packed rows"]
)
def test_a_decoding_steps_mask_is_not_read(structured_on_cpu, monkeypatch, form):
    """A decoding step's mask (one query row; or the packed form's one mask row for
    its G rows) goes to attention() as it is, unread: its structure is at most key
    padding, which the decode kernel takes as it is, and reading it cost a device
    synchronization and several kernels at every step (read before: the first layer's
    patched call took 6x stock's host time on an H100). Stock's output and gradients."""
    monkeypatch.setattr(patching, "recognize", lambda mask: pytest.fail("the mask was read"))
    q, k, v, mask = _decoding_step(rows=4 if form == "packed rows" else 1, grad=True)
    gqa = form != "packed rows"
    if form == "float":
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    elif form == "mask batch 1":
        mask = mask[-1:]
    elif form == "3-D mask":
        mask = mask[-1]
    elif form == "window":  # a sliding-window model's step: the 4 newest keys
        mask = (torch.arange(9) >= 5).reshape(1, 1, 1, 9)
    expected = STOCK(q, k, v, attn_mask=mask, enable_gqa=gqa)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    (call,) = structured_on_cpu
    assert call["mask"] is mask and call["causal"] is False
    assert call["query_shape"] == tuple(q.shape)


def test_a_masked_call_on_an_empty_batch_is_served_as_stock(structured_on_cpu):
    """B = 0 with a decoding step's (B, 1, 1, Nk) mask: the patch raised a RuntimeError
    from the mask's reading (stock returns an empty output)."""
    q, k, v = torch.randn(0, 2, 1, 8), torch.randn(0, 2, 6, 8), torch.randn(0, 2, 6, 8)
    mask = torch.ones(0, 1, 1, 6, dtype=torch.bool)
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == STOCK(q, k, v, attn_mask=mask).shape == (0, 2, 1, 8)


@pytest.mark.gpu
def test_gpu_a_captured_call_runs_its_mask_dense():
    """Under CUDA graph capture the mask is not read (a synchronization capture forbids)
    and no plan made before is used (its derived key mask would be fixed into the graph):
    a replay after new values are copied into the captured mask sees them."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    b, h, n, d = 2, 4, 64, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None]

    def hf_mask(lengths):  # type: ignore[no-untyped-def]
        # Causal, right-padded: every row keeps a key (no fully masked rows, where
        # PyTorch's kernels and attnhub differ by design).
        valid = torch.stack([j[0] < length for length in lengths])[:, None, None, :]
        return (j <= i)[None, None] & valid

    mask = hf_mask([n, n])  # unpadded: its plan is causal with no key mask
    with attnhub.patch():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        fresh = hf_mask([n, 50])
        with torch.cuda.graph(torch.cuda.CUDAGraph()):  # a mask never seen: no read
            F.scaled_dot_product_attention(q, k, v, attn_mask=fresh)
    mask.copy_(hf_mask([n, 40]))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, STOCK(q, k, v, attn_mask=mask), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["bool", "float", "packed rows"])
def test_gpu_a_padded_decoding_step_runs_its_mask_unread(monkeypatch, dtype, form):
    """On CUDA a patched padded decoding step runs on triton_flash's decode kernel with
    its key mask as given: no reading of the mask (no synchronization), close to the
    float64 answer in bf16/fp16; a row the mask empties gives zeros (the patch's one
    improvement on stock, whose kernels give NaN there)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from attnhub import mask_rows

    monkeypatch.setattr(mask_rows, "_read", lambda keep: pytest.fail("the mask was read"))
    torch.manual_seed(0)
    batch, kv_heads, group, keys, dim = 4, 8, 4, 4096, 128
    shape = (batch, kv_heads, group, dim) if form == "packed rows" else (batch, kv_heads * group, 1, dim)  # fmt: skip
    q = torch.randn(shape, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, keys, dim, device="cuda", dtype=dtype) for _ in "kv")
    lengths = torch.tensor([keys, keys - 1, 300, 0], device="cuda")
    mask = (torch.arange(keys, device="cuda") >= keys - lengths[:, None])[:, None, None, :]
    if form == "float":
        mask = torch.zeros(mask.shape, device="cuda", dtype=dtype).masked_fill(~mask, float("-inf"))
    gqa = form != "packed rows"
    live = mask[:3]  # the last row keeps no key: stock's kernels give NaN there
    expected = STOCK(q[:3].double(), k[:3].double(), v[:3].double(),
                     attn_mask=live if live.dtype == torch.bool else live.double(), enable_gqa=gqa)  # fmt: skip
    attnhub.reset_stats()
    with attnhub.patch(backend="triton_flash"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert attnhub.stats() == {"triton_flash": 1}
    torch.testing.assert_close(out[:3].double(), expected, atol=2e-2, rtol=2e-2)
    assert (out[3] == 0).all()


def test_under_inference_mode_the_layers_share_one_reading_and_a_change_is_read_anew(
    structured_on_cpu, monkeypatch
):
    """Inference tensors keep no version counter: each layer read the mask anew (a few
    passes and synchronizations a layer on a GPU). The memo's snapshot serves the later
    layers, and a mask written in place between two calls is read again."""
    from attnhub import mask_structure

    readings: list[torch.Tensor] = []
    real = mask_structure._recognize
    monkeypatch.setattr(mask_structure, "_recognize", lambda m: readings.append(m) or real(m))
    n = 12
    q = torch.randn(3, 4, n, 16)
    k, v = torch.randn(3, 2, n, 16), torch.randn(3, 2, n, 16)
    with torch.inference_mode(), attnhub.patch():
        mask = _hf_mask([12, 7, 3], n).clone()
        for _ in range(4):  # four layers, one mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert len(readings) == 1
        torch.testing.assert_close(
            out, STOCK(q, k, v, attn_mask=mask, enable_gqa=True), atol=2e-5, rtol=1e-4
        )
        mask.copy_(_hf_mask([12, 12, 5], n))  # in place: no version counter moves
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert len(readings) == 2
        torch.testing.assert_close(
            out, STOCK(q, k, v, attn_mask=mask, enable_gqa=True), atol=2e-5, rtol=1e-4
        )
    assert structured_on_cpu[-1]["causal"] is True
