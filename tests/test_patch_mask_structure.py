"""Patch mode runs dense causal / window / padding masks as their structure, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub import patching
from attnhub.mask_structure import recognize

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
    # More query rows than PACKED_ROWS_MAX: broadcast_rows is not a packed decoding step.
    n = patching.PACKED_ROWS_MAX + 4
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


def test_a_windowed_decoding_step_runs_as_a_window(structured_on_cpu):
    """One query whose window's keys are the newest (a sliding-window model's decode
    step from a static cache) read as a negative top-left window, which attention()
    refused, so every such step went to PyTorch's function."""
    nk, width = 10, 4
    mask = (torch.arange(nk) >= nk - width).reshape(1, 1, 1, nk)
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, nk, 8), torch.randn(1, 2, nk, 8)
    attnhub.reset_stats()
    # On a CPU only the reference takes a window (on CUDA triton_flash's decode kernel).
    with attnhub.patch(backend="torch_reference"):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, STOCK(q, k, v, attn_mask=mask))
    assert attnhub.stats() == {"torch_reference": 1}
    assert structured_on_cpu[-1]["window"] == (width - 1, None)
    assert structured_on_cpu[-1]["alignment"] == "bottom_right"


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


def _packed_step(batch=3, kv_heads=2, rows=4, keys=9, dtype=torch.float64, grad=False):  # type: ignore[no-untyped-def]
    """Hugging Face's packed grouped-query decoding step (``pack_gqa``): query
    (B, Hkv, G, D), key/value (B, Hkv, Nk, D), a left-padding mask (B, 1, 1, Nk)."""
    q = torch.randn(batch, kv_heads, rows, 8, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(batch, kv_heads, keys, 8, dtype=dtype, requires_grad=grad) for _ in "kv")
    lengths = torch.arange(batch) % keys + 1
    mask = (torch.arange(keys) >= keys - lengths[:, None])[:, None, None, :]
    return q, k, v, mask


@pytest.mark.parametrize(
    "form",
    ["bool", "float", "mask batch 1", "3-D mask", "grouped heads"],
)
def test_a_packed_grouped_decoding_step_runs_as_the_step(structured_on_cpu, form):
    """The padded decoding step Hugging Face packs (query rows = the heads of a group,
    one mask row for all) ran as given: its mask has no row per query, so it was not
    read and the step never reached the decoding kernels (patched padded generation ran
    at 0.88x stock on an H100). It runs as the (B, Hkv * G, 1, D) grouped step now, with
    its key mask read, giving stock's output and gradients."""
    q, k, v, mask = _packed_step(grad=True)
    gqa = False
    if form == "float":
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    elif form == "mask batch 1":
        mask = mask[-1:]
    elif form == "3-D mask":
        mask = mask[-1]
    elif form == "grouped heads":  # query heads grouped over the key heads too
        q = torch.randn(3, 4, 2, 8, dtype=q.dtype, requires_grad=True)
        gqa = True
    expected = STOCK(q, k, v, attn_mask=mask, enable_gqa=gqa)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)
    (call,) = structured_on_cpu
    heads, rows = q.shape[1], q.shape[2]
    assert call["query_shape"] == (3, heads * rows, 1, 8)
    plan = recognize(mask)  # read: run as its plan, not as the mask given
    assert plan is not None
    assert (call["causal"], call["alignment"], call["window"]) == (
        plan.causal, plan.alignment, plan.window
    )  # fmt: skip


def test_the_layers_of_a_packed_step_reuse_its_unpacking(structured_on_cpu, monkeypatch):
    """The layers of one decoding step (one mask, new tensors of the same layout) are
    unpacked and decided once: the later layers hit the patch's memo (no _packed_rows
    check, no new decision), each with stock's answer and gradients. A mask written in
    place, a query of another layout or row count, is decided again, with stock's answer."""
    checks = []
    real_rows = patching._packed_rows
    monkeypatch.setattr(  # counts the packed calls checked (not the unpacked ones)
        patching, "_packed_rows",
        lambda q, *args: (q.shape[2] > 1 and checks.append(1)) or real_rows(q, *args),
    )  # fmt: skip
    # Left padding with a row of every key: a key-padding plan (no window) that
    # torch_sdpa serves in float64 on the CPU (a plan only torch_reference serves runs
    # on PyTorch's function, and is not kept).
    lengths = torch.tensor([9, 7, 3])
    mask = (torch.arange(9) >= 9 - lengths[:, None])[:, None, None, :]

    def layer(rows=4, transposed=False):  # type: ignore[no-untyped-def]
        q, k, v, _ = _packed_step(rows=rows, grad=True)
        if transposed:  # same shape, another layout: (B, G, Hkv, D) memory, as a view
            q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        return q, k, v

    def check(q, k, v):  # type: ignore[no-untyped-def]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        expected = STOCK(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
            torch.testing.assert_close(got, want)

    with attnhub.patch():
        for _ in range(4):
            check(*layer())
        assert (len(checks), len(structured_on_cpu)) == (1, 1)
        mask[1, 0, 0, :4] = False  # written in place: read again
        check(*layer())
        assert (len(checks), len(structured_on_cpu)) == (2, 2)
        check(*layer(transposed=True))
        check(*layer(rows=2))
        assert len(checks) == 4
    assert all(call["query_shape"][2] == 1 for call in structured_on_cpu)


@pytest.mark.parametrize(
    "change",
    ["row per query", "mask per head", "dropout", "too many rows", "not a listed device"],
)
def test_calls_that_are_not_a_packed_step_run_as_given(structured_on_cpu, monkeypatch, change):
    q, k, v, mask = _packed_step()
    options = {}
    if change == "row per query":  # a mask row per query: read as such, not unpacked
        mask = mask.expand(-1, 1, q.shape[2], -1).clone()
        mask[0, 0, 0, -2] = False
    elif change == "mask per head":
        mask = mask.expand(-1, q.shape[1], 1, -1).clone()
        mask[0, 1, 0, -2] = False
    elif change == "dropout":
        options = {"dropout_p": 0.5}
    elif change == "too many rows":
        q = torch.randn(3, 2, patching.PACKED_ROWS_MAX + 1, 8, dtype=q.dtype)
    else:
        monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cuda"}))
    torch.manual_seed(0)
    expected = STOCK(q, k, v, attn_mask=mask, **options)
    with attnhub.patch():
        torch.manual_seed(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options)
    assert out.shape == expected.shape
    if change != "dropout":  # dropout draws need not be stock's
        torch.testing.assert_close(out, expected)
    assert all(call["query_shape"] == tuple(q.shape) for call in structured_on_cpu)


@pytest.mark.parametrize("bad", ["heads do not group", "batch", "mask keys", "dtype"])
def test_packed_steps_that_stock_refuses_fail_as_stock(structured_on_cpu, bad):
    """Only calls PyTorch serves are unpacked: the others keep its error."""
    q, k, v, mask = _packed_step()
    gqa = False
    if bad == "heads do not group":
        q, gqa = torch.randn(3, 3, 4, 8, dtype=q.dtype), True
    elif bad == "batch":
        q = q[:2]
    elif bad == "mask keys":
        mask = mask[..., :-1]
    else:
        q = q.float()
    with pytest.raises(RuntimeError) as stock:
        STOCK(q, k, v, attn_mask=mask, enable_gqa=gqa)
    with attnhub.patch(), pytest.raises(RuntimeError) as patched:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert str(patched.value) == str(stock.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_a_packed_grouped_decoding_step_runs_as_the_step(structured_on_cpu, dtype):
    """On CUDA the packed step runs unpacked, with its mask read, on the backend that
    attention() picks for that step, close to the float64 answer in bf16/fp16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    batch, kv_heads, rows, keys, dim = 4, 8, 4, 4096, 128
    q = torch.randn(batch, kv_heads, rows, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, keys, dim, device="cuda", dtype=dtype) for _ in "kv")
    lengths = torch.tensor([keys, keys - 1, keys - 100, 17], device="cuda")
    mask = (torch.arange(keys, device="cuda") >= keys - lengths[:, None])[:, None, None, :]
    expected = STOCK(q.double(), k.double(), v.double(), attn_mask=mask)
    attnhub.reset_stats()
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    step = q.reshape(batch, kv_heads * rows, 1, dim)
    key_mask, structure = patching.mask_arguments(step, k, mask, False)
    unpacked = attnhub.explain(step, k, v, key_mask, **structure)
    assert attnhub.stats() == {unpacked.chosen: 1}
    (call,) = structured_on_cpu
    assert call["query_shape"] == tuple(step.shape)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
