"""Every bad input that contract.md lists raises the documented error, naming the argument;
empty tensors behave as the reference says."""

from __future__ import annotations

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
