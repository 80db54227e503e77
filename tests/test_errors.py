"""Every bad input that contract.md lists raises the documented error, naming the argument;
empty tensors behave as the reference says."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

import attnhub
from attnhub import NoBackendError


def _qkv(
    b: int = 2, hq: int = 4, hkv: int = 2, nq: int = 5, nk: int = 7, d: int = 8, dv: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(b, hq, nq, d, generator=gen),
        torch.randn(b, hkv, nk, d, generator=gen),
        torch.randn(b, hkv, nk, dv, generator=gen),
    )


@pytest.mark.parametrize("which", [0, 1, 2], ids=["query", "key", "value"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_wrong_ndim_names_the_tensor(which: int, ndim: int) -> None:
    tensors = list(_qkv())
    t = tensors[which]
    tensors[which] = t[0] if ndim == 3 else t.unsqueeze(0)
    name = ("query", "key", "value")[which]
    with pytest.raises(ValueError, match=rf"{name} must be 4-D .* got a {ndim}-D tensor"):
        attnhub.attention(*tensors)


@pytest.mark.parametrize("which", [1, 2], ids=["key", "value"])
def test_batch_mismatch(which: int) -> None:
    tensors = list(_qkv())
    tensors[which] = tensors[which][:1]
    with pytest.raises(ValueError, match=r"batch sizes differ: query \(2, 4, 5, 8\)"):
        attnhub.attention(*tensors)


def test_key_value_head_mismatch() -> None:
    q, k, _ = _qkv(hkv=2)
    v = torch.randn(2, 1, 7, 8)
    with pytest.raises(
        ValueError, match=r"key and value must have the same number of heads, got 2 and 1"
    ):
        attnhub.attention(q, k, v)


def test_key_value_length_mismatch() -> None:
    q, k, _ = _qkv()
    v = torch.randn(2, 2, 6, 8)
    with pytest.raises(
        ValueError, match=r"key and value must have the same sequence length, got 7 and 6"
    ):
        attnhub.attention(q, k, v)


def test_hq_not_multiple_of_hkv() -> None:
    q, k, v = _qkv(hq=5, hkv=2)
    with pytest.raises(
        ValueError, match=r"query heads Hq=5 must be a multiple of key/value heads Hkv=2"
    ):
        attnhub.attention(q, k, v)


def test_head_dim_mismatch() -> None:
    q, _, v = _qkv()
    k = torch.randn(2, 2, 7, 16)
    with pytest.raises(
        ValueError, match=r"query and key must have the same head dim D, got 8 and 16"
    ):
        attnhub.attention(q, k, v)


@pytest.mark.parametrize("which", [1, 2], ids=["key", "value"])
def test_mixed_devices(which: int) -> None:
    tensors = list(_qkv())
    tensors[which] = tensors[which].to("meta")
    name = ("query", "key", "value")[which]
    with pytest.raises(ValueError, match=rf"{name} is on meta but query is on cpu"):
        attnhub.attention(*tensors)


@pytest.mark.parametrize("which", [1, 2], ids=["key", "value"])
def test_mixed_dtypes(which: int) -> None:
    tensors = list(_qkv())
    tensors[which] = tensors[which].double()
    name = ("query", "key", "value")[which]
    with pytest.raises(
        TypeError, match=rf"{name} has dtype torch.float64 but query has torch.float32"
    ):
        attnhub.attention(*tensors)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("which", [0, 1, 2], ids=["query", "key", "value"])
def test_non_float_dtypes(dtype: torch.dtype, which: int) -> None:
    tensors = list(_qkv())
    tensors[which] = tensors[which].to(dtype)
    name = ("query", "key", "value")[which]
    with pytest.raises(TypeError, match=rf"{name} must have a floating-point dtype .* got {dtype}"):
        attnhub.attention(*tensors)


def test_non_tensor_input() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"key must be a torch.Tensor, got list"):
        attnhub.attention(q, k.tolist(), v)


@pytest.mark.parametrize(
    "shape", [(5, 8), (3, 5, 7), (2, 4, 5, 7, 1), (1, 3, 1, 7)], ids=lambda s: "x".join(map(str, s))
)
def test_mask_that_does_not_broadcast(shape: tuple[int, ...]) -> None:
    q, k, v = _qkv()
    with pytest.raises(
        ValueError,
        match=r"attn_mask of shape .* does not broadcast to \(B, Hq, Nq, Nk\) = \(2, 4, 5, 7\)",
    ):
        attnhub.attention(q, k, v, torch.zeros(shape))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.complex64])
def test_bad_mask_dtype(dtype: torch.dtype) -> None:
    q, k, v = _qkv()
    with pytest.raises(
        TypeError, match=rf"attn_mask must be bool \(True = may attend\) or floating, got {dtype}"
    ):
        attnhub.attention(q, k, v, torch.ones(5, 7, dtype=dtype))


def test_mask_not_a_tensor() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"attn_mask must be None or a torch.Tensor, got list"):
        attnhub.attention(q, k, v, [[True] * 7] * 5)


def test_mask_on_another_device() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attn_mask is on meta but query is on cpu"):
        attnhub.attention(q, k, v, torch.ones(5, 7, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(p: float) -> None:
    with pytest.raises(ValueError, match=rf"dropout_p must be in \[0, 1\), got {p}"):
        attnhub.attention(*_qkv(), dropout_p=p)


@pytest.mark.parametrize("p", [float("nan"), float("inf")])
def test_dropout_not_finite(p: float) -> None:
    with pytest.raises(ValueError, match=r"dropout_p must be finite"):
        attnhub.attention(*_qkv(), dropout_p=p)


def test_dropout_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"dropout_p must be a real number, got str"):
        attnhub.attention(*_qkv(), dropout_p="0.1")


@pytest.mark.parametrize(("window", "side"), [((-1, 2), "left=-1"), ((2, -3), "right=-3")])
def test_window_negative_side(window: tuple[int, int], side: str) -> None:
    with pytest.raises(ValueError, match=rf"window sides must be >= 0 .* got {side}"):
        attnhub.attention(*_qkv(), window=window)


@pytest.mark.parametrize("window", [3, (1, 2, 3), "ab", (1.5, 2), (True, 2)], ids=str)
def test_window_wrong_type(window: object) -> None:
    with pytest.raises(TypeError, match=r"window"):
        attnhub.attention(*_qkv(), window=window)


@pytest.mark.parametrize("softcap", [0.0, -1.0])
def test_softcap_not_positive(softcap: float) -> None:
    with pytest.raises(ValueError, match=rf"softcap must be None or > 0, got {softcap}"):
        attnhub.attention(*_qkv(), softcap=softcap)


def test_bad_alignment_and_flags() -> None:
    with pytest.raises(ValueError, match=r"alignment must be one of .* got 'diagonal'"):
        attnhub.attention(*_qkv(), alignment="diagonal")
    with pytest.raises(TypeError, match=r"causal must be a bool, got int"):
        attnhub.attention(*_qkv(), causal=1)
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got str"):
        attnhub.attention(*_qkv(), return_lse="yes")
    with pytest.raises(TypeError, match=r"scale must be a real number, got str"):
        attnhub.attention(*_qkv(), scale="0.1")


def test_unknown_backend_lists_known_names() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown backend 'no_such_kernel'; known backends: .*torch_reference.*torch_sdpa",
    ):
        attnhub.attention(*_qkv(), backend="no_such_kernel")
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        attnhub.attention(*_qkv(), backend=["torch_sdpa", "nope"])
    with pytest.raises(
        TypeError, match=r"backend must be None, a backend name or a sequence of names"
    ):
        attnhub.attention(*_qkv(), backend=3)


def test_named_backend_that_cannot_serve_raises_never_substitutes() -> None:
    # torch_sdpa declares no window; asked for by name it must refuse, not fall back.
    with pytest.raises(NoBackendError) as info:
        attnhub.attention(*_qkv(), window=(2, 2), backend="torch_sdpa")
    message = str(info.value)
    assert "no backend among those asked for (torch_sdpa" in message
    assert "call: attention(q=(2,4,~8,8) k/v=(2,2,~8,8/8)" in message
    assert "window" in message.splitlines()[1]
    lines = {line.split()[0]: line for line in message.splitlines()[2:]}
    # One reason line per registered backend.
    assert set(lines) == set(attnhub.list_backends())
    assert "window (local attention) is not supported" in lines["torch_sdpa"]
    assert "not selected" in lines["torch_reference"]
    assert info.value.reasons["torch_sdpa"] == ["window (local attention) is not supported"]


def test_named_backend_on_the_wrong_device_raises() -> None:
    with pytest.raises(
        NoBackendError,
        match=r"torch_sdpa_flash\s+unavailable: CUDA is not available|torch_sdpa_flash\s+runs on cuda",
    ):
        attnhub.attention(*_qkv(), backend="torch_sdpa_flash")


# -- empty tensors ----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(0, 4, 2, 5, 7), (2, 0, 0, 5, 7), (2, 4, 2, 0, 7)],
    ids=["B0", "H0", "Nq0"],
)
@pytest.mark.parametrize("backend", [None, "torch_sdpa"])
def test_empty_inputs_give_empty_outputs(shape: tuple[int, ...], backend: str | None) -> None:
    b, hq, hkv, nq, nk = shape
    q, k, v = _qkv(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, dv=6)
    out, lse = attnhub.attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == (b, hq, nq, 6) and out.dtype == q.dtype
    assert lse.shape == (b, hq, nq) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", [None, "torch_sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_no_keys_gives_zeros_and_minus_inf_lse(backend: str | None, dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(nk=0, dv=6))
    out, lse = attnhub.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == (2, 4, 5, 6) and out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full((2, 4, 5), float("-inf")))
    (grad_q,) = torch.autograd.grad(out.sum(), [q])
    assert torch.equal(grad_q, torch.zeros_like(q))


def test_empty_query_with_mask_and_grad() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(nq=0))
    mask = torch.ones(0, 7, dtype=torch.bool)
    out = attnhub.attention(q, k, v, mask)
    assert out.shape == (2, 4, 0, 8)
    grads = torch.autograd.grad(out.sum(), [q, k, v], allow_unused=True)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g is None or (g.shape == t.shape and not g.any())


# -- masks of every rank, empty head dims, extreme options --------------------------


def _sdpa64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """PyTorch's own function in float64, GQA on: the independent reference."""
    mask = kwargs.pop("attn_mask", None)
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        mask = mask.double()
    out = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True, **kwargs
    )
    return out.to(q.dtype)


def _mask(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if kind == "float":
        return torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) > 0.4
    if mask.dim():
        mask[..., 0] = True  # every query row keeps a key (PyTorch's NaN rows aside)
    else:
        mask.fill_(True)
    return mask


@pytest.mark.parametrize("backend", [None, "torch_sdpa", "torch_reference"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize(
    "shape", [(), (7,), (1, 7), (5, 1), (4, 1, 7)], ids=lambda s: "x".join(map(str, s)) or "0d"
)
def test_masks_of_every_rank_broadcast(
    shape: tuple[int, ...], kind: str, backend: str | None
) -> None:
    # contract.md: a mask broadcastable to (B, Hq, Nq, Nk) is legal, 0-d and 1-D ones too.
    q, k, v = _qkv()
    mask = _mask(shape, kind)
    want = _sdpa64(q, k, v, attn_mask=mask.expand(2, 4, 5, 7))
    for _ in range(2):  # the first call decides (slow path), the second is the cached one
        got = attnhub.attention(q, k, v, mask, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_low_rank_float_mask_gets_its_gradient() -> None:
    q, k, v = _qkv()
    mask = torch.randn(7, requires_grad=True)
    expanded = mask.detach().double().requires_grad_()
    out = attnhub.attention(q, k, v, mask)
    want = _sdpa64(q, k, v, attn_mask=expanded.expand(2, 4, 5, 7))
    (grad,) = torch.autograd.grad(out.sum(), [mask])
    (want_grad,) = torch.autograd.grad(want.sum(), [expanded])
    assert grad.shape == (7,)
    torch.testing.assert_close(grad, want_grad.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(), (16,)], ids=["0d", "1d"])
def test_low_rank_masks_reach_the_triton_kernel_as_4d(shape: tuple[int, ...]) -> None:
    # The Triton kernels (float32; on a machine without CUDA, in the interpreter) read
    # the mask through its strides.
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton_flash on a CPU needs TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen).to(device) for _ in range(3))
    mask = _mask(shape, "bool").to(device)
    got = attnhub.attention(q, k, v, mask, backend="triton_flash")
    want = _sdpa64(q, k, v, attn_mask=mask.expand(1, 2, 16, 16))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("d", "dv", "message"),
    [
        (0, 8, r"query and key head dim D must be >= 1, got query \(2, 4, 5, 0\)"),
        (8, 0, r"value head dim Dv must be >= 1, got value \(2, 2, 7, 0\)"),
        (0, 0, r"query and key head dim D must be >= 1"),
    ],
)
def test_an_empty_head_dim_is_named(d: int, dv: int, message: str) -> None:
    q, k, v = _qkv(d=d, dv=dv)
    with pytest.raises(ValueError, match=message):
        attnhub.attention(q, k, v)
    with pytest.raises(ValueError, match=message):
        attnhub.explain(q, k, v)


@pytest.mark.parametrize(
    ("window", "same_as"),
    [
        ((10**20, 0), (None, 0)),
        ((2, 10**20), (2, None)),
        ((2**31, 1), (None, 1)),
        ((1 << 30, 2**63 - 1), None),
        ((10**20, 10**20), None),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", [None, "torch_reference"])
def test_window_sides_beyond_every_key_are_unbounded(
    window: tuple[int, int], same_as: tuple[int | None, int | None] | None, backend: str | None
) -> None:
    q, k, v = _qkv()
    got, lse = attnhub.attention(q, k, v, window=window, return_lse=True, backend=backend)
    want, want_lse = attnhub.attention(
        q.double(), k.double(), v.double(), window=same_as, return_lse=True,
        backend="torch_reference",
    )  # fmt: skip
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # The request says what the call is: no window where both sides are unbounded.
    decision = attnhub.explain(q, k, v, window=window, backend=backend)
    assert decision.request.window == (same_as is not None)


def test_window_sides_may_be_numpy_ints() -> None:
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    want = attnhub.attention(q, k, v, window=(2, 1))
    got = attnhub.attention(q, k, v, window=(np.int64(2), np.int32(1)))
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match=r"window left side must be an int >= 0 or None"):
        attnhub.attention(q, k, v, window=(np.bool_(True), 1))
    with pytest.raises(ValueError, match=r"window sides must be >= 0 .* got left=-1"):
        attnhub.attention(q, k, v, window=(np.int64(-1), 1))


@pytest.mark.parametrize("window", [(float("inf"), 0), (2.0, 1), (0, float("nan"))], ids=str)
def test_window_sides_that_are_floats_are_named(window: tuple[float, float]) -> None:
    with pytest.raises(TypeError, match=r"window (left|right) side must be an int >= 0 or None"):
        attnhub.attention(*_qkv(), window=window)


@pytest.mark.parametrize("scale", [1e300, -1e300, 3.5e38, 1e39], ids=str)
def test_a_scale_beyond_float32_is_named(scale: float) -> None:
    message = rf"scale must be at most 3.40\d+e\+38 in magnitude .* got {re.escape(str(scale))}"
    with pytest.raises(ValueError, match=message):
        attnhub.attention(*_qkv(), scale=scale)


@pytest.mark.parametrize("name", ["scale", "softcap", "dropout_p"])
@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), float("nan")], ids=str)
def test_options_beyond_float64_or_not_finite_are_named(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be finite"):
        attnhub.attention(*_qkv(), **{name: value})


@pytest.mark.parametrize("scale", [0.0, -0.0, 1e-300, 1e-45])
def test_vanishing_scales_give_uniform_attention(scale: float) -> None:
    # scale * q.k is 0 (or below float32's resolution): every key weighs the same.
    q, k, v = _qkv()
    got = attnhub.attention(q, k, v, scale=scale)
    torch.testing.assert_close(got, _sdpa64(q, k, v, scale=0.0), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("softcap", [1e300, 3.5e38, 1e-40, 1e-300], ids=str)
def test_a_softcap_outside_float32_is_named(softcap: float) -> None:
    with pytest.raises(ValueError, match=r"softcap must be within float32's normal range"):
        attnhub.attention(*_qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", [1e-30, 3e38])
def test_extreme_softcaps_within_float32_keep_the_contract(softcap: float) -> None:
    q, k, v = _qkv()
    got = attnhub.attention(q, k, v, softcap=softcap)
    want = attnhub.attention(
        q.double(), k.double(), v.double(), softcap=softcap, backend="torch_reference"
    )
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_numpy_bools_for_flags_are_named() -> None:
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match=r"causal must be a bool, got numpy\.bool"):
        attnhub.attention(*_qkv(), causal=np.bool_(True))
    with pytest.raises(TypeError, match=r"return_lse must be a bool, got numpy\.bool"):
        attnhub.attention(*_qkv(), return_lse=np.bool_(False))
    with pytest.raises(TypeError, match=r"dropout_p must be a real number, got numpy\.bool"):
        attnhub.attention(*_qkv(), dropout_p=np.bool_(False))


def _nested_or_sparse(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sparse":
        return t.to_sparse()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        return torch.nested.nested_tensor([t[0], t[0, ..., :3, :]])


@pytest.mark.parametrize("which", ["query", "key", "value", "attn_mask"])
@pytest.mark.parametrize("kind", ["nested", "sparse"])
def test_nested_and_sparse_tensors_are_refused_naming_the_argument(which: str, kind: str) -> None:
    """A nested tensor reached PyTorch's "NestedTensorImpl doesn't support sizes"
    RuntimeError (failed before); a sparse one, whatever its first dense operation
    raised. Both are a TypeError naming the argument."""
    tensors = {"query": torch.randn(1, 2, 5, 8), "key": torch.randn(1, 2, 5, 8),
               "value": torch.randn(1, 2, 5, 8), "attn_mask": torch.randn(1, 5, 5)}  # fmt: skip
    tensors[which] = _nested_or_sparse(tensors[which], kind)
    got = "a nested" if kind == "nested" else "a torch.sparse_coo"
    with pytest.raises(TypeError, match=rf"{which} must be a dense \(strided\) tensor, got {got} tensor"):  # fmt: skip
        attnhub.attention(tensors["query"], tensors["key"], tensors["value"], tensors["attn_mask"])


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_sparse_packed_tensors_are_refused_naming_the_argument(which: str) -> None:
    packed = {name: torch.randn(5, 2, 8) for name in ("query", "key", "value")}
    packed[which] = packed[which].to_sparse()
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match=f"{which} must be a dense"):
        attnhub.attention_varlen(packed["query"], packed["key"], packed["value"], cu, cu)


# A decided call's memo compares the next call's tensors in one C check (Guards), which
# reads their strides first: a nested tensor's implementation throws on that in C++,
# and the process aborted ("terminate called after throwing an instance of
# 'c10::Error'"). A subprocess, so that a regression fails this test, not the run.
_NESTED_AFTER_DECIDED = """
import warnings, torch, attnhub
import torch.nn.functional as F
warnings.simplefilter("ignore", UserWarning)  # nested tensors: "prototype stage"
q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
mask = torch.ones(8, 8, dtype=torch.bool)
nested = torch.nested.nested_tensor([torch.randn(4, 8, 16), torch.randn(4, 6, 16)])
nested_mask = torch.nested.nested_tensor([torch.ones(8, 8, dtype=torch.bool)] * 2)

def outcome(call):
    try:
        call()
        return "returned"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

for _ in range(3):
    attnhub.attention(q, k, v)
    attnhub.attention(q, k, v, mask)
print(outcome(lambda: attnhub.attention(nested, k, v)))
print(outcome(lambda: attnhub.attention(q, nested, v)))
print(outcome(lambda: attnhub.attention(q, k, v, nested_mask)))
stock = outcome(lambda: F.scaled_dot_product_attention(nested, k, v))
with attnhub.patch():
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v)
    print(outcome(lambda: F.scaled_dot_product_attention(nested, k, v)) == stock)
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, mask)
    print(outcome(lambda: F.scaled_dot_product_attention(q, k, v, nested_mask))
          == outcome(lambda: attnhub.patching.original_function()(q, k, v, nested_mask)))
"""


def test_a_nested_tensor_after_a_decided_call_is_refused_not_a_crash() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _NESTED_AFTER_DECIDED], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "TypeError: query must be a dense (strided) tensor, got a nested tensor",
        "TypeError: key must be a dense (strided) tensor, got a nested tensor",
        "TypeError: attn_mask must be a dense (strided) tensor, got a nested tensor",
        "True",  # patched: PyTorch's own outcome, as unpatched
        "True",
    ]


@pytest.mark.parametrize("kind", ["nested", "sparse"])
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k", "cache_seqlens", "block_table"])
def test_nested_and_sparse_index_tensors_are_refused_naming_the_argument(
    which: str, kind: str
) -> None:
    """Index tensors were read as given: a nested one reached PyTorch's "NestedTensorImpl
    doesn't support sizes" RuntimeError (failed before), a sparse one went on to be read."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    lengths = torch.tensor([8, 8], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    index = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "cache_seqlens": lengths, "block_table": table}
    index[which] = _nested_or_sparse_index(index[which], kind)
    got = "a nested" if kind == "nested" else "a torch.sparse_coo"
    with pytest.raises(TypeError, match=rf"{which} must be a dense \(strided\) tensor, got {got} tensor"):  # fmt: skip
        if which.startswith("cu_"):
            packed = torch.randn(10, 2, 8)
            attnhub.attention_varlen(
                packed, packed, packed, index["cu_seqlens_q"], index["cu_seqlens_k"]
            )
        else:
            pages = torch.randn(4, 8, 2, 8)  # (pages, page size, Hkv, D)
            attnhub.attention_kvcache(
                torch.randn(2, 2, 1, 8), pages, pages, index["cache_seqlens"],
                block_table=index["block_table"],
            )  # fmt: skip


def _nested_or_sparse_index(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sparse":
        return t.to_sparse()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.nested_tensor([t, t])


@pytest.mark.parametrize("function", ["attention", "attention_varlen", "attention_kvcache"])
def test_torch_jit_trace_is_refused_with_what_works_instead(function: str) -> None:
    """Under torch.jit.trace sizes are tensors: the calls raised AttributeError from deep
    inside (failed before); a recording would keep one call's decisions as constants."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    lengths = torch.tensor([4, 5], dtype=torch.int32)
    calls = {
        "attention": (lambda q: attnhub.attention(q, q, q, causal=True), torch.randn(1, 2, 8, 16)),
        "attention_varlen": (
            lambda q: attnhub.attention_varlen(q, q, q, cu, cu),
            torch.randn(10, 2, 16),
        ),
        "attention_kvcache": (
            lambda q: attnhub.attention_kvcache(q[:, :, :1], q, q, lengths, check_indices=False),
            torch.randn(2, 2, 8, 16),
        ),
    }
    call, example = calls[function]
    call(example)  # a decided call first: the memos must not serve the recording either
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        with pytest.raises(RuntimeError, match=rf"attnhub.{function} cannot be recorded by torch.jit.trace .*use torch.compile or torch.export"):  # fmt: skip
            torch.jit.trace(call, (example,))
