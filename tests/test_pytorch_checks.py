"""PyTorch's fused kernels as attnhub serves them: eligibility asked of PyTorch's own
checks (torch.backends.cuda.can_use_*_attention), and the contract kept where a mask
leaves a query row without keys (issue 16, item 1)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import attnhub
from attnhub.backends import torch_sdpa
from attnhub.backends.torch_reference import reference_attention
from attnhub.errors import NoBackendError
from attnhub.registry import get_registry
from attnhub.validation import build_request, make_params

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _request(q, k, v, mask=None, **options):  # type: ignore[no-untyped-def]
    opts = {"causal": False, "alignment": "top_left", "window": None, "softcap": None,
            "scale": None, "dropout_p": 0.0, "block_sparse": None, "return_lse": False,
            **options}  # fmt: skip
    params = make_params(q, key=k, **opts)
    return build_request(q, k, v, mask, params), params


@pytest.mark.parametrize(
    ("nq", "nk"), [(1, 1), (1, 4096), (4, 32768), (4096, 4096), (300, 200), (200, 300), (64, 65)]
)
def test_probe_lengths_keep_what_the_checks_and_the_request_distinguish(nq, nk):
    q = torch.empty(1, 2, nq, 64, device="meta", dtype=torch.float16)
    k = torch.empty(1, 2, nk, 64, device="meta", dtype=torch.float16)
    request, _ = _request(q, k, k)
    pq, pk = torch_sdpa._probe_lengths(request)
    assert pq <= 129 and pk <= 129
    assert (pq == 1) == (nq == 1) and (pk == 1) == (nk == 1)
    assert (pq == pk) == (nq == nk)
    assert (pq > pk) == (nq > nk)


def test_c10_warnings_on_stderr_are_read_back_as_reasons():
    def warn() -> bool:
        os.write(
            2,
            b"[W1201 11:18:00.754823082 sdp_utils_cpp.h:262] Warning: Flash Attention does "
            b"not support non-null attn_mask. (function check_for_attn_mask)\n"
            b"[W1201 11:18:00.1 sdp_utils.cpp:9] Warning: head_dim should be no more than 128\n",
        )
        return False

    result, log = torch_sdpa._stderr_of(warn)
    assert result is False
    assert torch_sdpa._warning_text(log) == [
        "Flash Attention does not support non-null attn_mask.",
        "head_dim should be no more than 128",
    ]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_rows_without_keys_are_opened_and_reported_and_no_other_row_changes(dtype):
    keep = torch.tensor([[True, False, True], [False, False, False], [False, True, False]])
    mask = keep if dtype == torch.bool else torch.zeros(3, 3).masked_fill(~keep, float("-inf"))
    mask = mask[None, None].expand(2, 1, 3, 3)
    opened, empty = torch_sdpa._open_rows_without_keys(mask)
    assert empty.shape == (2, 1, 3, 1)
    assert empty[..., 0].tolist() == [[[False, True, False]]] * 2
    if dtype == torch.bool:
        assert opened[:, :, 1].all() and torch.equal(opened[:, :, [0, 2]], mask[:, :, [0, 2]])
    else:
        assert (opened[:, :, 1] == 0).all() and torch.equal(
            opened[:, :, [0, 2]], mask[:, :, [0, 2]]
        )


def test_rows_known_to_keep_a_key_are_not_opened():
    """A mask whose rows were read (attnhub.mask_rows: a patched decoding step's, by
    mask_structure) and all keep a key needs no opening and its output no zeroing; one
    not read, one with a row of none, one changed since, or a float mask is opened as
    before (the reading itself is never made here)."""
    from attnhub import mask_rows

    padded = torch.tensor([[True] * 6, [False] * 2 + [True] * 4]).view(2, 1, 1, 6)
    assert not torch_sdpa._every_row_keeps_a_key(padded)  # not read: not known
    assert mask_rows.known_row_keys(padded) is None
    mask_rows.row_keys(padded)
    assert torch_sdpa._every_row_keeps_a_key(padded)
    assert not torch_sdpa._every_row_keeps_a_key(padded.clone())  # another tensor
    padded[1] = False  # in place: a row of none now
    assert not torch_sdpa._every_row_keeps_a_key(padded)
    mask_rows.row_keys(padded)
    assert not torch_sdpa._every_row_keeps_a_key(padded)
    scores = torch.zeros(2, 1, 1, 6)
    assert not torch_sdpa._every_row_keeps_a_key(scores)


def test_on_cuda_torch_sdpa_serves_masks_and_rows_without_keys():
    """Before, a CUDA request with a mask (or bottom-right causal with Nq > Nk) was
    declined for the NaN PyTorch gives on key-less rows; those rows are now mended."""
    q = torch.empty(2, 4, 64, 64, device="meta", dtype=torch.float16)
    k = torch.empty(2, 4, 32, 64, device="meta", dtype=torch.float16)
    sdpa = get_registry().get("torch_sdpa")
    for mask, options in (
        (torch.empty(2, 1, 64, 64, device="meta", dtype=torch.bool), {}),
        (None, {"causal": True, "alignment": "bottom_right"}),
    ):
        keys = k if mask is None else q
        request, _ = _request(q, keys, keys, mask, **options)
        cuda = dataclasses.replace(request, device_type="cuda", capability=(9, 0))
        assert sdpa.extra_reasons(cuda) == []
        assert torch_sdpa._may_leave_rows_without_keys(cuda)
        assert not torch_sdpa._may_leave_rows_without_keys(request)  # the CPU gives zeros


def test_on_cuda_torch_sdpa_declines_a_mask_with_a_backward():
    """The H200 demo's causal key-padding step, served by torch_sdpa with a bool mask,
    gave gradients far outside the tolerance, and a float mask's rows hidden by -1e9 or
    finfo.min got dQ 20 from the reference on an H100: such calls with a backward go
    elsewhere; the same calls without one, and causal without a mask, are served."""
    q = torch.empty(2, 4, 64, 64, device="meta", dtype=torch.float16)
    k = torch.empty(2, 4, 32, 64, device="meta", dtype=torch.float16)
    sdpa = get_registry().get("torch_sdpa")
    bool_mask = torch.empty(2, 1, 1, 64, device="meta", dtype=torch.bool)
    float_mask = torch.empty(2, 1, 64, 64, device="meta", dtype=torch.float16)
    for mask, keys, options, why in (
        (bool_mask, q, {"causal": True}, "bool mask with a backward"),
        # a built bool mask
        (None, k, {"causal": True, "alignment": "bottom_right"}, "bool mask with a backward"),
        (float_mask, q, {}, "float mask with a backward"),
        (float_mask, q, {"causal": True}, "float mask with a backward"),
        (None, q, {"causal": True}, None),
    ):
        request, _ = _request(q, keys, keys, mask, **options)
        _check_declined_with_a_backward(sdpa, request, why is not None, why)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_float_mask_handed_to_cuda_kernels_keeps_its_infinities_and_clamps_the_rest(dtype):
    """What torch_sdpa hands PyTorch's CUDA kernels for a float mask: key-less rows
    (all -inf) opened to 0 and reported; other entries as given, except finite ones
    beyond +-2**127, which PyTorch's kernels overflowed in log2 units (finfo.min rows
    read as fully masked on an H100), clamped there; float16 holds none."""
    low, high = torch.finfo(dtype).min, torch.finfo(dtype).max
    inf = float("inf")
    mask = torch.tensor(
        [[0.5, -1e4, -inf, inf, low, high], [-inf] * 6, [low] * 6], dtype=dtype
    ).view(1, 1, 3, 6)
    opened, empty = torch_sdpa._open_rows_without_keys(mask)
    assert empty.view(-1).tolist() == [False, True, False]
    bound = min(2.0**127, high)
    want = torch.tensor(
        [[0.5, -1e4, -inf, inf, -bound, bound], [0.0] * 6, [-bound] * 6], dtype=dtype
    ).view(1, 1, 3, 6)
    assert opened.dtype == dtype
    assert torch.equal(opened, want)
    # The cached tensor is a new one: the caller's mask is untouched.
    assert mask[0, 0, 2, 0] == low


def _check_declined_with_a_backward(backend, request, declined, why):  # type: ignore[no-untyped-def]
    """``backend`` serves ``request`` on CUDA without a backward, declines it with one
    (saying ``why``) exactly where ``declined``, and serves it on the CPU either way."""
    cuda = dataclasses.replace(request, device_type="cuda", capability=(9, 0))
    assert backend.extra_reasons(cuda) == []  # no backward: served
    reasons = backend.extra_reasons(dataclasses.replace(cuda, needs_grad=True))
    assert bool(reasons) == declined, (request.describe(), reasons)
    if declined:
        assert why in reasons[0]
    assert backend.extra_reasons(dataclasses.replace(request, needs_grad=True)) == []  # CPU


@pytest.mark.parametrize("name", ["torch_sdpa", "torch_sdpa_efficient"])
def test_on_cuda_top_left_causal_off_the_square_with_a_backward_is_declined(name):
    """A patched call whose causal bool mask was read as top-left causal (Nq 16, Nk 64)
    reached SDPA as is_causal=True and got gradients 0.7-0.9 from the reference on an
    H100 (benchmarks/patch_fuzz.py): such calls with a backward go elsewhere; square,
    bottom-right, forward-only and CPU calls are still served."""
    backend = get_registry().get(name)
    q = torch.empty(3, 2, 16, 64, device="meta", dtype=torch.bfloat16)
    long_q = torch.empty(3, 2, 80, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(3, 2, 64, 64, device="meta", dtype=torch.bfloat16)
    for query, options, declined in (
        (q, {"causal": True}, True),  # Nq < Nk
        (long_q, {"causal": True}, True),  # Nq > Nk
        (k, {"causal": True}, False),  # square: the alignments coincide
        (q, {"causal": True, "alignment": "bottom_right"}, False),
        (q, {}, False),
    ):
        request, _ = _request(query, k, k, None, **options)
        why = "top-left causal with Nq != Nk and a backward"
        _check_declined_with_a_backward(backend, request, declined, why)


# --- on the GPU -----------------------------------------------------------------------


def _float64(q, k, v, mask=None, **options):  # type: ignore[no-untyped-def]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, params = _request(leaves[0], leaves[1], leaves[2], mask, **options)
    out, _ = reference_attention(*leaves, mask, params)
    return out, leaves


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["torch_sdpa_flash", "torch_sdpa_cudnn"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 2, 128), (4, 4, 256), (8, 2, 256), (4, 4, 192)])
def test_gpu_pinned_kernels_serve_what_pytorch_says_they_serve(name, hq, hkv, d):
    """GQA and head dims 192/256 on flash and cuDNN, where PyTorch's checks admit them,
    forward and backward against float64."""
    torch.manual_seed(0)
    q = torch.randn(2, hq, 200, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, hkv, 200, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    decision = attnhub.explain(q, k, v, causal=True, backend=name)
    if decision.chosen != name:
        reasons = str(decision)
        assert "PyTorch's can_use_" in reasons, reasons  # PyTorch's own words, quoted
        pytest.skip(f"PyTorch declines: {reasons}")
    out = attnhub.attention(q, k, v, causal=True, backend=name)
    ref, leaves = _float64(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, leaves, grad.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_explain_quotes_pytorch_for_a_kernel_it_rejects():
    """A call every declaration of torch_sdpa_flash admits, with the kernel switched off
    through PyTorch's own flag: PyTorch's check rejects it, and explain() quotes it. (A
    GQA call does not show this for the memory-efficient kernel: its ATen op takes no
    GQA, which the backend declares, so PyTorch is not asked.) The shape is this test's
    own, so no earlier answer for it is cached."""
    q = torch.randn(1, 3, 72, 40, device="cuda", dtype=torch.float16)
    enabled = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        decision = attnhub.explain(q, q, q)
    finally:
        torch.backends.cuda.enable_flash_sdp(enabled)
    (flash,) = [c for c in decision.candidates if c.name == "torch_sdpa_flash"]
    assert not flash.eligible
    assert any("PyTorch's can_use_flash_attention()" in r for r in flash.reasons), flash.reasons


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "float", "causal+bool", "bottom_right"])
def test_gpu_torch_sdpa_gives_zeros_on_rows_without_keys(dtype, kind):
    torch.manual_seed(0)
    b, h, nq, nk, d = 2, 4, 96, 80 if kind == "bottom_right" else 96, 64
    q = torch.randn(b, h, nq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    options: dict = {}
    mask = None
    if kind != "bottom_right":
        keep = torch.rand(b, 1, nq, nk, device="cuda") > 0.3
        keep[:, :, 5:9] = False  # rows without keys
        keep[1, :, 40:] = False
        mask = keep if kind != "float" else torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(~keep, float("-inf"))  # fmt: skip
        if kind == "causal+bool":
            options["causal"] = True
    else:
        options = {"causal": True, "alignment": "bottom_right"}
    ref, _ = _float64(q, k, v, mask, **options)
    # The mask reaches PyTorch's kernel (given, or a bool one built for bottom-right
    # causal with Nq > Nk): served without a backward, its key-less rows mended; declined
    # with one (_bool_mask_on_cuda, _float_mask_backward_on_cuda).
    with torch.no_grad():
        out = attnhub.attention(q, k, v, attn_mask=mask, backend="torch_sdpa", **options)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-2, rtol=2e-2)
    assert torch.isfinite(out).all()
    with pytest.raises(NoBackendError, match="torch_sdpa"):
        attnhub.attention(q, k, v, attn_mask=mask, backend="torch_sdpa", **options)
    (sdpa,) = [c for c in attnhub.explain(q, k, v, attn_mask=mask, **options).candidates
               if c.name == "torch_sdpa"]  # fmt: skip
    why = "float mask with a backward" if kind == "float" else "bool mask with a backward"
    assert any(why in r for r in sdpa.reasons), sdpa.reasons


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16])
def test_gpu_a_kept_mask_with_a_key_in_every_row_leaves_the_output_unzeroed(dtype):
    """What a mask's calls are handed is read once where it is kept (_BuiltMasks):
    without a key-less row (a finfo.min padding mask, bool rows that each keep a key)
    no zeroing pass follows the kernel; with one, or where the build serves one call
    only (nothing read), the key-less rows are reported and zeroed."""
    from attnhub.request import AttentionParams

    q = torch.randn(2, 4, 8, 16, device="cuda", dtype=torch.bfloat16)
    params = AttentionParams(scale=0.25)
    if dtype == torch.bool:
        mask = torch.ones(2, 1, 8, 8, device="cuda", dtype=torch.bool)
        mask[1, :, :, 5:] = False
    else:
        mask = torch.zeros(2, 1, 8, 8, device="cuda", dtype=dtype)
        mask[1, :, 5:] = torch.finfo(dtype).min  # hidden rows, each with its keys
    _, _, rows = torch_sdpa._sdpa_arguments(q, q, mask, params, kept=True)
    assert rows is None
    _, _, rows = torch_sdpa._sdpa_arguments(q, q, mask, params, kept=False)
    assert rows is not None and not rows.any()
    if dtype == torch.bool:
        mask[0, :, 3] = False
    else:
        mask[0, :, 3] = float("-inf")
    _, _, rows = torch_sdpa._sdpa_arguments(q, q, mask, params, kept=True)
    assert rows is not None and rows.view(-1).tolist() == [i == 3 for i in range(8)] + [False] * 8
    ref, _ = _float64(q, q, q, mask, scale=0.25)
    out = attnhub.attention(q, q, q, attn_mask=mask, backend="torch_sdpa", scale=0.25)
    torch.testing.assert_close(out.double(), ref.detach(), atol=2e-2, rtol=2e-2)
    assert (out[0, :, 3] == 0).all()


def test_a_mask_built_for_a_call_is_built_once_per_mask_tensor_and_version(monkeypatch):
    """The layers of one step share their mask: causal folded into it is built once,
    again after an in-place change, and never reused for another mask tensor."""
    builds = []
    real = torch_sdpa._sdpa_mask

    def counting(*args):  # type: ignore[no-untyped-def]
        builds.append(1)
        return real(*args)

    monkeypatch.setattr(torch_sdpa, "_sdpa_mask", counting)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 16) for _ in range(3))
    mask = torch.rand(2, 1, 1, 40) > 0.2

    def check(m):  # type: ignore[no-untyped-def]
        out = attnhub.attention(q, k, v, m, causal=True, backend="torch_sdpa")
        ref, _ = _float64(q, k, v, m, causal=True)
        torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)

    for _ in range(3):
        check(mask)
    assert len(builds) == 1
    mask[0, 0, 0, :5] = ~mask[0, 0, 0, :5]  # in place: a new version
    check(mask)
    check(mask.clone())  # another tensor
    assert len(builds) == 3


def test_a_mask_made_in_inference_mode_is_served_and_never_reused_stale():
    """An inference tensor keeps no version counter (reading it raises): such a mask is
    built for every call, so an in-place change is always seen."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    with torch.inference_mode():
        mask = torch.rand(1, 1, 1, 24) > 0.3
        first = attnhub.attention(q, k, v, mask, causal=True, backend="torch_sdpa")
        mask[..., :4] = ~mask[..., :4]
        second = attnhub.attention(q, k, v, mask, causal=True, backend="torch_sdpa")
    ref, _ = _float64(q, k, v, mask.clone(), causal=True)
    torch.testing.assert_close(second.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    assert not torch.equal(first, second)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(("nq", "nk"), [(16, 64), (80, 64)])
def test_gpu_a_patched_top_left_causal_mask_off_the_square_keeps_its_gradients(nq, nk, strided):
    """benchmarks/patch_fuzz.py's case on an H100: the causal bool mask read as top-left
    causal reached SDPA as is_causal=True, and the patched gradients were 0.7-0.9 from
    the float64 reference where stock's (the bool mask as given) were within 0.012."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, nq, 64, device="cuda", dtype=torch.bfloat16)
    if strided:  # (B, N, H, D) storage, as a model's projection leaves it
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    k, v = (torch.randn(3, 2, nk, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril()[None, None]
    weight = torch.linspace(-1, 1, q.numel(), device="cuda").view(3, 2, nq, 64)
    want_out, leaves = _float64(q, k, v, causal=True)
    want = [want_out.detach(), *torch.autograd.grad(want_out, leaves, weight.double())]

    def run(function):  # type: ignore[no-untyped-def]
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = function(*inputs, attn_mask=mask)
        grads = torch.autograd.grad(out, inputs, weight.to(out.dtype))
        return [(got.double() - ref).abs().max().item() for got, ref in zip((out, *grads), want)]

    stock = run(torch.nn.functional.scaled_dot_product_attention)
    with attnhub.patch():
        patched = run(torch.nn.functional.scaled_dot_product_attention)
    for name, mine, theirs in zip(("out", "dq", "dk", "dv"), patched, stock):
        assert mine <= max(3 * theirs, 2e-2), (name, patched, stock, attnhub.stats())
