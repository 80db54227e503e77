"""The built-in backends' own promises, beyond the generated conformance suite."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import attnhub
from attnhub.backends.torch_reference import reference_attention
from attnhub.registry import get_registry
from attnhub.request import AttentionParams
from attnhub.testing import Case, case_problems, compare, plain_attention

cuda_missing = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def _params(**kw) -> AttentionParams:  # type: ignore[no-untyped-def]
    kw.setdefault("scale", 0.3)
    return AttentionParams(**kw)


@pytest.mark.parametrize(
    "params",
    [
        _params(),
        _params(causal=True, alignment="bottom_right"),
        _params(window=(2, 1), softcap=1.5),
        _params(causal=True, window=(None, 0)),
    ],
    ids=["plain", "causal_br", "window_softcap", "causal_window_left_unbounded"],
)
def test_reference_gradients_pass_gradcheck_in_float64(params):
    """The reference's hand-made safe softmax has the true gradient, mask included."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 7, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = torch.randn(5, 7, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(q, k, v, mask):  # type: ignore[no-untyped-def]
        return reference_attention(q, k, v, mask, params)[0]  # the lse is float32 by contract

    assert torch.autograd.gradcheck(f, (q, k, v, mask))


def test_reference_matches_the_textbook_formula():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    out, lse = reference_attention(q, k, v, None, _params(scale=0.5))
    scores = 0.5 * q @ k.transpose(-1, -2)
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())


def test_reference_fully_masked_rows_give_zeros_minus_inf_and_zero_grads():
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    out, lse = attnhub.attention(q, k, v, mask, return_lse=True, backend="torch_reference")
    assert torch.equal(out[0, 0, 2], torch.zeros(8)) and lse[0, 0, 2] == -math.inf
    (out.sum() + lse[lse.isfinite()].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 0, 2], torch.zeros(8))


def test_bottom_right_causal_with_more_queries_than_keys_leaves_empty_rows_as_zeros():
    q = torch.randn(1, 2, 6, 8)
    k = v = torch.randn(1, 2, 3, 8)
    for name in ("torch_reference", "torch_sdpa"):
        out = attnhub.attention(q, k, v, causal=True, alignment="bottom_right", backend=name)
        # Rows 0..2 sit before key 0: nothing to attend to.
        assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3])), name
        assert not out.isnan().any()


def test_torch_sdpa_declares_memory_quadratic_only_where_it_builds_a_mask():
    sdpa = get_registry().get("torch_sdpa")
    q = torch.randn(1, 2, 8, 16)
    square = attnhub.explain(q, q, q, causal=True, backend="torch_sdpa")
    assert square.chosen == "torch_sdpa" and sdpa.memory_class(square.request) == "linear"
    k = q[:, :, :5]
    rect = attnhub.explain(q, k, k, causal=True, alignment="bottom_right", backend="torch_sdpa")
    # An (8, 5) mask is smaller than the call's tensors: not what the class guards.
    assert rect.chosen == "torch_sdpa" and sdpa.memory_class(rect.request) == "linear"
    q, k = torch.empty(1, 2, 4096, 16), torch.empty(1, 2, 2048, 16)
    long = attnhub.explain(q, k, k, causal=True, alignment="bottom_right", backend="torch_sdpa")
    assert long.chosen == "torch_sdpa" and sdpa.memory_class(long.request) == "quadratic"


@cuda_missing
@pytest.mark.parametrize("name", ["torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn"])
def test_pinned_kernels_are_unavailable_without_cuda(name):
    assert get_registry().unavailable_reason(name) == "CUDA is not available"
    q = torch.randn(1, 1, 4, 8, dtype=torch.float16)
    with pytest.raises(attnhub.NoBackendError, match=f"{name} +unavailable: CUDA is not available"):
        attnhub.attention(q, q, q, backend=name)


@cuda_missing
def test_xformers_without_kernels_quotes_its_own_reason():
    reason = get_registry().unavailable_reason("xformers")
    if importlib.util.find_spec("xformers") is None:
        assert reason.startswith("xformers does not import: ModuleNotFoundError")
    else:
        # The PyPI wheel on a CPU machine: xformers says why it has no kernels.
        assert reason.startswith("xformers has no compiled kernels here (xformers: ")
        assert "C++/CUDA extensions" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_kernels_return_the_log_sum_exp_of_the_reference():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _, ref = reference_attention(q.double(), k.double(), v.double(), None, _params(scale=0.125))
    for name in ("torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn"):
        if get_registry().unavailable_reason(name):
            continue
        _, lse = attnhub.attention(q, k, v, return_lse=True, backend=name)
        assert lse.shape == (2, 4, 300) and lse.dtype == torch.float32, name
        torch.testing.assert_close(lse, ref, atol=2e-2, rtol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_loss_on_the_lse_differentiates_through_it_on_cuda():
    """PyTorch's fused kernels return an lse without a gradient: dispatch leaves them out
    of a call that returns its lse under autograd (before, cuDNN's kernel served it and
    a loss on the lse was a constant), and the gradients match the float64 contract."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    g_out = torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16)
    g_lse = torch.randn(2, 4, 300, device="cuda")
    decision = attnhub.explain(q, k, v, causal=True, return_lse=True)
    for name in ("torch_sdpa_flash", "torch_sdpa_efficient", "torch_sdpa_cudnn"):
        if not get_registry().unavailable_reason(name):
            assert (
                "a gradient through the returned lse is not supported" in decision.reasons()[name]
            )
    out, lse = attnhub.attention(q, k, v, causal=True, return_lse=True)
    got = torch.autograd.grad((out, lse), (q, k, v), (g_out, g_lse))
    r, rl, leaves = _float64_reference(q, k, v, causal=True)
    expected = torch.autograd.grad((r, rl), leaves, (g_out.double(), g_lse.to(rl.dtype)))
    for name, g, e in zip(("dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(
            g.double(), e, atol=2e-2 * float(e.abs().max()), rtol=0, msg=name
        )


def _float64_reference(q, k, v, **options):  # type: ignore[no-untyped-def]
    """The contract in float64 on upcast copies, with gradients (the oracle)."""
    from attnhub.validation import make_params

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    opts = {"causal": False, "alignment": "top_left", "window": None, "softcap": None,
            "scale": None, "dropout_p": 0.0, "return_lse": False, **options}  # fmt: skip
    out, lse = reference_attention(
        *leaves, None, make_params(leaves[0], key=leaves[1], **opts, block_sparse=None)
    )
    return out, lse, leaves


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_backend_accumulates_half_precision_in_float32(dtype):
    """Issue 18.4: q @ k^T of 80 channels of 256 is 5.2e6, beyond float16 (65504). The
    backend computes scores and softmax in float32 (the contract's accumulation), so it
    stays finite and matches PyTorch's fused kernel; its gradients match float64."""
    x = torch.full((1, 2, 23, 80), 256.0, dtype=dtype)
    out = attnhub.attention(x, x, x, backend="torch_reference")
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(x, x, x))

    gen = torch.Generator().manual_seed(4)
    # Products q.k up to about 7e4, beyond float16, and scores (scale 1e-4) of a few
    # units: the product overflowed before the scale could shrink it.
    q, k, v = (
        (torch.randn(2, 2, 19, 80, generator=gen) * s).to(dtype).requires_grad_()
        for s in (48.0, 48.0, 1.0)
    )
    options = {"causal": True, "scale": 1e-4}
    out, lse = attnhub.attention(q, k, v, **options, return_lse=True, backend="torch_reference")
    ref, ref_lse, leaves = _float64_reference(q, k, v, **options)
    assert out.dtype == dtype and lse.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    # float32 arithmetic, then one rounding to the output dtype.
    torch.testing.assert_close(out.double(), ref.detach(), rtol=eps, atol=eps)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-6, atol=1e-6)
    grad_out = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, leaves, grad_out.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        scale = r.abs().max().item()
        assert (g.double() - r).abs().max().item() <= 4 * eps * scale, name


_BIASES = {
    # A constant bias beyond float16's range: cast to float16 it is -inf, and every row
    # came out empty (zeros) where the contract keeps all keys equally.
    "beyond-fp16": lambda n: torch.full((n, n), -1e5),
    # ALiBi-like slopes on a large offset: bfloat16 rounds -1000.37 to -1000.
    "fine-slopes": lambda n: -1000.0 - 0.37 * torch.arange(float(n)).expand(n, n),
}


def _check_a_float32_mask_is_added_in_float32(dtype, bias, device):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 32, generator=gen).to(device, dtype) for _ in range(3))
    mask = _BIASES[bias](16).to(device)
    assert mask.dtype == torch.float32
    with pytest.raises(attnhub.NoBackendError, match="another dtype than the float16/bfloat16"):
        attnhub.attention(q, k, v, mask, backend="torch_sdpa")
    assert attnhub.explain(q, k, v, mask).chosen != "torch_sdpa"
    ref = attnhub.attention(
        q.double(), k.double(), v.double(), mask.double(), backend="torch_reference"
    )
    out = attnhub.attention(q, k, v, mask)
    # Float32 scores (the contract's accumulation) of magnitude |mask| are rounded by
    # 2**-24 of it, which moves the weights by as much; then the output's own rounding.
    # The rounded mask was off by 0.16-1.6 here.
    eps = torch.finfo(dtype).eps
    scores = 2.0**-24 * mask.abs().max().item() * v.abs().max().item()
    bound = 4 * (eps * ref.abs().max().item() + scores)
    assert (out.double() - ref).abs().max().item() <= bound
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", list(_BIASES))
def test_a_float32_mask_with_a_half_precision_query_is_added_in_float32(dtype, bias):
    """The contract adds a float mask to float32 scores. PyTorch's SDPA takes the mask in
    the query's dtype, so torch_sdpa would round a float32 mask first: it declines the
    call, saying so, and what serves it matches float64."""
    q, k, v, mask = _check_a_float32_mask_is_added_in_float32(dtype, bias, "cpu")
    # A mask already in the query's dtype is PyTorch's to serve, as before.
    assert attnhub.explain(q, k, v, mask.to(dtype)).chosen == "torch_sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", list(_BIASES))
def test_gpu_a_float32_mask_with_a_half_precision_query_is_added_in_float32(dtype, bias):
    """The same on CUDA, where another backend (triton_flash) takes the call."""
    _check_a_float32_mask_is_added_in_float32(dtype, bias, "cuda")


def _cuda_request(request, **changes):  # type: ignore[no-untyped-def]
    """The same request as if on an sm_90 CUDA device (what the declarations admit there)."""
    import dataclasses

    return dataclasses.replace(request, device_type="cuda", capability=(9, 0), **changes)


@pytest.mark.parametrize(
    "case",
    [
        # Drawn by tests/test_sampled_cases.py; each left the tolerance in dv (by 1.2x to
        # 1.5x) when PyTorch's CPU kernel summed the group's gradients in half precision.
        # Each case here failed with PyTorch's CPU kernel run in the inputs' dtype.
        Case(
            torch.bfloat16,
            2,
            3,
            1,
            1,
            86,
            128,
            128,
            causal=True,
            strided=True,
            backward=True,
            seed=4015998938,
        ),
        Case(
            torch.float16,
            1,
            8,
            2,
            83,
            22,
            128,
            128,
            causal=True,
            strided=True,
            backward=True,
            seed=4249828856,
        ),
        Case(torch.float16, 1, 12, 3, 130, 30, 80, 80, mask="keys", backward=True, seed=2317158189),
        Case(torch.bfloat16, 1, 12, 3, 1, 1, 16, 16, mask="keys", backward=True, seed=3341927347),
        # Without grouped heads (drawn, tests/test_sampled_cases.py seeds 10-15 and a
        # sweep of half-precision backwards): dV summed over many rows 1.04-1.3x outside,
        # dK nonzero where a single key makes it exactly 0, dQ of one row 1.6x outside.
        Case(
            torch.float16,
            2,
            1,
            1,
            84,
            1,
            16,
            16,
            alignment="bottom_right",
            backward=True,
            seed=631575663,
        ),
        Case(torch.float16, 2, 2, 2, 700, 2, 64, 64, mask="bool", backward=True, seed=186776492),
        Case(torch.float16, 2, 1, 1, 700, 1, 64, 64, mask="keys", backward=True, seed=2337522027),
        Case(torch.bfloat16, 2, 2, 2, 1, 8, 16, 16, mask="float", backward=True, seed=447857711),
        Case(torch.bfloat16, 1, 2, 2, 700, 5, 80, 80, mask="bool", backward=True, seed=2342376404),
        Case(torch.float16, 2, 2, 2, 700, 24, 16, 16, mask="keys", backward=True, seed=3119014493),
        Case(
            torch.bfloat16, 1, 1, 1, 700, 130, 64, 64, mask="keys", backward=True, seed=3871200684
        ),
    ],
    ids=lambda case: case.id,
)
def test_torch_sdpa_half_precision_gradients_on_the_cpu(case):
    assert not case_problems("torch_sdpa", case, "cpu")


@pytest.mark.parametrize("scale", [-0.5, 0.0, -1e-30, 1e-300])  # 1e-300 is 0 in float32
def test_causal_with_a_scale_of_at_most_zero_matches_float64_on_the_cpu(scale):
    """Issue 18.2: given is_causal, PyTorch's CPU kernel fills the scores above the
    diagonal with -inf before it scales them, so a scale <= 0 made every output NaN.
    Whatever serves such a call must be right; torch_sdpa declines the calls that
    would reach is_causal, saying why, and serves the others (short rows go through an
    explicit mask, which PyTorch adds after the scale)."""
    gen = torch.Generator().manual_seed(7)
    served = {}
    for nq, nk, d in ((3, 4, 8), (30, 40, 8), (33, 33, 16)):
        q = torch.randn(1, 2, nq, d, generator=gen)
        k, v = (torch.randn(1, 2, nk, d, generator=gen) for _ in range(2))
        ref = _float64_reference(q, k, v, causal=True, scale=scale)[0].detach()
        for backend in (None, "torch_reference"):
            out = attnhub.attention(q, k, v, causal=True, scale=scale, backend=backend)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
        decision = attnhub.explain(q, k, v, causal=True, scale=scale)
        served[(nq, nk)] = decision.chosen
        if decision.chosen != "torch_sdpa":
            reasons = decision.reasons()["torch_sdpa"]
            assert any("scale <= 0" in r for r in reasons), reasons
    # Rows of 4 keys get a mask: torch_sdpa serves them; longer rows would reach is_causal.
    assert served[(3, 4)] == "torch_sdpa"
    assert served[(30, 40)] != "torch_sdpa" and served[(33, 33)] != "torch_sdpa"
    # A positive scale still goes to is_causal on torch_sdpa.
    q = torch.randn(1, 2, 30, 8, generator=gen)
    assert attnhub.explain(q, q, q, causal=True, scale=0.5).chosen == "torch_sdpa"


def test_cuda_kernels_that_give_nan_for_a_scale_of_at_most_zero_decline_it():
    """Issue 18.2 on CUDA (seen on the H200, torch 2.11): PyTorch's flash and cuDNN
    kernels give NaN for every scale <= 0, causal or not; the memory-efficient kernel is
    right. The declarations say so for a CUDA request."""
    from attnhub.validation import build_request, make_params

    q = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.float16)
    registry = get_registry()
    for scale, bad in ((-0.5, True), (0.0, True), (1e-300, True), (0.125, False)):
        params = make_params(q, key=q, causal=False, alignment="top_left", window=None, softcap=None,
                             scale=scale, dropout_p=0.0, block_sparse=None, return_lse=False)  # fmt: skip
        request = _cuda_request(build_request(q, q, q, None, params))
        assert request.scale_positive is not bad
        for name in ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_cudnn", "torch_sdpa_efficient"):
            reasons = registry.get(name).extra_reasons(request)
            declined = any("scale <= 0" in r for r in reasons)
            assert declined is (bad and name != "torch_sdpa_efficient"), (name, scale, reasons)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_gpu_scale_of_at_most_zero_matches_float64(dtype, scale):
    torch.manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 4, 64, 64, device="cuda", dtype=dtype).requires_grad_()
                   for _ in range(3))  # fmt: skip
        out = attnhub.attention(q, k, v, causal=causal, scale=scale)
        ref = _float64_reference(q, k, v, causal=causal, scale=scale)[0].detach()
        # Half precision: its rounding; float32: float32 accumulation over 64 terms.
        tol = max(4 * torch.finfo(dtype).eps, 2e-5)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


_PINNED_OPS = {
    "torch_sdpa_flash": "_scaled_dot_product_flash_attention",
    "torch_sdpa_efficient": "_scaled_dot_product_efficient_attention",
    "torch_sdpa_cudnn": "_scaled_dot_product_cudnn_attention",
}


def _make_params(q, **options):  # type: ignore[no-untyped-def]
    from attnhub.validation import make_params

    opts = {"causal": False, "alignment": "top_left", "window": None, "softcap": None,
            "scale": None, "dropout_p": 0.0, "block_sparse": None, "return_lse": False,
            **options}  # fmt: skip
    return make_params(q, key=q, **opts)  # self-attention


@pytest.mark.parametrize("name", sorted(_PINNED_OPS))
@pytest.mark.parametrize(
    "options",
    [{}, {"scale": 0.1}, {"causal": True}, {"dropout_p": 0.25}, {"grad": True}],
    ids=["plain", "scale", "causal", "dropout", "grad"],
)
def test_pinned_runner_calls_the_op_binding_with_the_arguments_of_forward(
    monkeypatch, name, options
):
    """The runner a pinned kernel prepares (every call of a signature but the first)
    calls the op through PyTorch's generated binding (``torch._scaled_dot_product_*``,
    cheaper per call than ``torch.ops.aten``, which ``forward`` uses) with forward's
    arguments, leaving ``scale=`` out where it is the op's default, 1 / sqrt(D) (the
    same bits: test_leaving_out_the_default_scale_gives_the_same_bits)."""
    from attnhub.validation import build_request

    op_name = _PINNED_OPS[name]
    assert callable(getattr(torch, op_name))  # the binding exists in this PyTorch
    options = dict(options)
    grad = options.pop("grad", False)
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=grad)
    params = _make_params(q, **options)
    request = _cuda_request(build_request(q, q, q, None, params))
    assert request.needs_grad is grad
    out, calls = object(), {}

    def recorder(route):  # type: ignore[no-untyped-def]
        def op(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[route] = (
                tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args),
                kwargs,
            )
            return (out,) + (None,) * 8

        return op

    monkeypatch.setattr(torch, op_name, recorder("binding"))
    monkeypatch.setattr(torch.ops.aten, op_name, recorder("torch.ops"))
    backend = get_registry().get(name)
    assert backend.prepare(request, params)(q, q, q, None) is out
    assert backend.forward(q, q, q, None, params) is out
    args, kwargs = calls["binding"]
    assert args == calls["torch.ops"][0]
    assert calls["torch.ops"][1] == {"scale": params.scale}
    assert kwargs == ({"scale": 0.1} if "scale" in options else {})


@pytest.mark.parametrize("head_dim", [8, 24, 64, 80, 96, 128, 256])
def test_leaving_out_the_default_scale_gives_the_same_bits(head_dim):
    """Why torch_sdpa and the pinned kernels' runners pass ``scale=`` only where it is
    not 1 / sqrt(D): PyTorch computes that default in double as Python does
    (sdp::calculate_scale, which SDPA and the kernels' ops share). Here SDPA and the
    CPU flash op, which read it there too."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, head_dim, generator=gen) for _ in range(3))
    scale = 1.0 / math.sqrt(head_dim)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(sdpa(q, k, v), sdpa(q, k, v, scale=scale))
    op = torch._scaled_dot_product_flash_attention_for_cpu
    assert torch.equal(op(q, k, v)[0], op(q, k, v, scale=scale)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(_PINNED_OPS))
@pytest.mark.parametrize("scale", [None, 0.1])
def test_gpu_pinned_runner_matches_forward(name, scale):
    """The prepared runner (the op's binding, ``scale=`` left out at its default) gives
    forward's output (torch.ops.aten, ``scale=`` always) bit for bit, and its gradients."""
    if get_registry().unavailable_reason(name):
        pytest.skip(get_registry().unavailable_reason(name))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))  # fmt: skip
    if attnhub.explain(q, k, v, scale=scale, backend=name).chosen != name:
        pytest.skip(f"{name} does not serve the call here")
    out = attnhub.attention(q, k, v, scale=scale, backend=name)
    out = attnhub.attention(q, k, v, scale=scale, backend=name)  # the cached runner
    ref = get_registry().get(name).forward(q, k, v, None, _make_params(q, scale=scale))
    assert torch.equal(out, ref)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize(
    "options",
    [
        {},  # a CPU call with at most 16 keys gets an explicit mask, built for its lengths
        {"causal": True, "alignment": "bottom_right", "float_mask": True},
    ],
    ids=["short-keys", "bottom-right-with-mask"],
)
def test_torch_sdpa_masks_built_in_inference_mode_are_not_reused_with_a_backward(options):
    """torch_sdpa keeps the masks it builds for a call's lengths; one built under
    torch.inference_mode is an inference tensor, which a call recorded by autograd
    cannot save: such a call, the next with a backward, raised RuntimeError."""
    options = dict(options)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for n in (5, 7, 7))
    if options.pop("float_mask", False):
        options["attn_mask"] = torch.randn(2, 1, 5, 7, generator=gen)
    with torch.inference_mode():
        attnhub.attention(q, k, v, backend="torch_sdpa", **options)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnhub.attention(*leaves, backend="torch_sdpa", **options)
    out.sum().backward()
    expected = [t.clone().requires_grad_() for t in (q, k, v)]
    attnhub.attention(*expected, backend="torch_reference", **options).sum().backward()
    for got, want in zip(leaves, expected):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True, "alignment": "bottom_right", "float_mask": True}],
    ids=["short-keys", "bottom-right-with-mask"],
)
def test_torch_sdpa_masks_built_under_fake_tensor_mode_stay_there(options):
    """A mask torch_sdpa built under FakeTensorMode is fake: kept, it reached the next
    real call ("Please convert all Tensors to FakeTensors", failed before), and a real
    one kept before reached the fake call (the same error, there)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    options = dict(options)
    float_mask = options.pop("float_mask", False)

    def call(*tensors: torch.Tensor) -> torch.Tensor:
        q, k, v, mask = tensors
        extra = {"attn_mask": mask} if float_mask else {}
        return attnhub.attention(q, k, v, backend="torch_sdpa", **options, **extra)

    gen = torch.Generator().manual_seed(1)
    real = [torch.randn(2, 2, n, 16, generator=gen) for n in (5, 7, 7)]
    real.append(torch.randn(2, 1, 5, 7, generator=gen))
    expected = attnhub.attention(
        *real[:3], backend="torch_reference", **options,
        **({"attn_mask": real[3]} if float_mask else {}),
    )  # fmt: skip
    with FakeTensorMode() as fake:
        fakes = [fake.from_tensor(t) for t in real]
        assert call(*fakes).shape == expected.shape
    torch.testing.assert_close(call(*real), expected)
    with FakeTensorMode() as fake:
        assert call(*(fake.from_tensor(t) for t in real)).shape == expected.shape


# A row whose every key a float mask hides with one large negative value (a model's
# padding: torch.finfo(dtype).min, or the -1e9 and -1e4 of hand-written masks): its
# scores all round to about that value, so the forward's softmax over it is uniform (the
# float64 reference's too), but a kernel that stores one float32 log-sum-exp per row
# loses the row's log(Nk) in it (|lse| ~ 1e9 or 3.4e38) and its backward, recomputing
# P = exp(s - lse), took every weight as 1 instead of 1 / Nk: gradients 3-24 from the
# reference here. PyTorch's CPU flash kernel (a 2-D or 4-D mask; a 3-D one goes to its
# math kernel) did so at finfo.min, and torch_sdpa sends such CPU calls to the math
# kernel. triton_flash did so at each: a float mask's calls now keep the row's max and
# log2 of its sum apart (ops._keeps_row_stats). PyTorch's CUDA kernels did so at each
# (H100, 2026-12-07: dQ 20 from the reference at -1e9): torch_sdpa declines a float
# mask with a backward on CUDA (test_pytorch_checks.py), and the flex plugin too.
_HIDE_WITH = {
    "finfo_min": torch.finfo(torch.float32).min,
    "-1e9": -1e9,
    "-1e4": -1e4,
    "-1e30": -1e30,
}


_NEEDS_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)
_NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("name", "device"),
    [
        ("torch_reference", "cpu"),
        ("torch_sdpa", "cpu"),  # on the CPU, such calls go to SDPA's math kernel
        pytest.param(
            "triton_flash",
            "cpu",
            marks=[pytest.mark.interpreter, _NEEDS_INTERPRETER],
        ),
        pytest.param("triton_flash", "cuda", marks=_NEEDS_CUDA),
    ],
)
@pytest.mark.parametrize("hide", list(_HIDE_WITH))
def test_a_row_hidden_by_a_large_negative_float_keeps_its_gradients(name, device, hide):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    mask = torch.randn(1, 1, 8, 64)
    mask[..., :3, :] = _HIDE_WITH[hide]
    weight = torch.randn(1, 2, 8, 16)
    case = Case(dtype=torch.float32, B=1, Hq=2, Hkv=2, Nq=8, Nk=64, D=16, Dv=16, mask="float")

    def run(function, dtype):  # type: ignore[no-untyped-def]
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        out = function(*leaves, mask.to(device, dtype))
        return [out, *torch.autograd.grad(out, leaves, weight.to(device, dtype))]

    want = run(lambda *a: attnhub.attention(*a, backend="torch_reference"), torch.float64)
    plain = run(lambda *a: plain_attention(*a, case)[0], torch.float32)
    got = run(lambda *a: attnhub.attention(*a, backend=name), torch.float32)
    found = [compare(n, x, r_lp, r64) for n, x, r_lp, r64 in zip(("out", "dq", "dk", "dv"), got, plain, want)]  # fmt: skip
    assert not any(found), found


_HIDE_FORWARD = [*_HIDE_WITH, "dtype_min", "-2e38"]


def _check_hidden_rows_forward(name: str, device: str, hide: str, dtype: torch.dtype) -> None:
    """A float mask hiding whole rows and keys with ``hide``: ``name``'s output against
    the float64 reference (forward only)."""
    if name not in attnhub.list_backends():
        pytest.skip(f"{name} is not installed")
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 64, device=device, dtype=dtype) for n in (40, 96, 96))
    mask = torch.randn(2, 1, 40, 96, device=device)
    low = {"dtype_min": torch.finfo(dtype).min, "-2e38": -2e38}.get(hide) or _HIDE_WITH[hide]
    mask[0, :, :7] = low  # whole rows
    mask[1, :, :, 50:] = low  # keys, as padding hides them
    mask[1, :, 30:] = low
    mask = mask.to(dtype)
    with torch.no_grad():
        got = attnhub.attention(q, k, v, mask, scale=0.3, backend=name)
    want, _ = reference_attention(q.double(), k.double(), v.double(), mask.double(), _params())
    plain, _ = reference_attention(q, k, v, mask, _params())
    assert compare("out", got, plain, want) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hide", _HIDE_FORWARD)
@pytest.mark.parametrize("name", ["torch_sdpa", "triton_flash", "flex_attention"])
def test_gpu_a_row_hidden_by_a_large_negative_float_gets_the_mean_of_the_values(name, hide, dtype):
    """Forward only, on CUDA (every float-mask backend serves it; with a backward only
    triton_flash does). PyTorch's kernels and FlexAttention's take scores to log2 units
    before exp2, where finfo.min overflowed to -inf: such rows read as fully masked and
    gave zeros (H100, 2026-12-07) where the contract gives the mean of the values; their
    masks' entries are now clamped at 2**127 (attnhub.mask_values)."""
    _check_hidden_rows_forward(name, "cuda", hide, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hide", _HIDE_FORWARD)
@pytest.mark.parametrize(
    "name",
    [
        "torch_sdpa",
        "torch_reference",
        "flex_attention",
        pytest.param("triton_flash", marks=[pytest.mark.interpreter, _NEEDS_INTERPRETER]),
    ],
)
def test_a_row_hidden_by_a_large_negative_float_gets_the_mean_of_the_values(name, hide, dtype):
    """The same on the CPU, float16 too (where -1e9 and beyond round to -inf: such rows
    have no key and give zeros, as the reference's do)."""
    if name == "triton_flash" and dtype == torch.bfloat16:
        pytest.skip("triton_flash declines bfloat16 in Triton's CPU interpreter")
    _check_hidden_rows_forward(name, "cpu", hide, dtype)
