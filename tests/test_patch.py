"""attnhub.patch(): the replacement keeps F.scaled_dot_product_attention's behaviour.

Every numeric check compares against PyTorch's own function, called on the same inputs
before patching (or through the saved original).
"""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import threading
import types
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub import patching as patch_module
from attnhub.call_stats import ORIGINAL as SERVED_BY_PYTORCH

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _clean():
    assert not patch_module.is_patched()
    attnhub.reset_stats()
    yield
    for handle in reversed(patch_module.active_patches()):
        handle.undo()
    assert F.scaled_dot_product_attention is ORIGINAL


def _qkv(b=2, hq=4, hkv=4, nq=7, nk=7, d=16, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def test_nothing_patched_at_import():
    code = (
        "import torch.nn.functional as F; before = F.scaled_dot_product_attention; "
        "import attnhub, attnhub.integrations, attnhub.integrations.transformers; "
        "assert F.scaled_dot_product_attention is before; assert not attnhub.stats()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal-nq<nk": {"is_causal": True, "nk": 11},
    "causal-nq>nk": {"is_causal": True, "nq": 9, "nk": 5},
    "scale": {"scale": 0.3},
    "gqa": {"hkv": 2, "enable_gqa": True, "is_causal": True},
    "bool-mask": {"mask": "bool"},
    "float-mask": {"mask": "float"},
    "mask-2d": {"mask": "bool2d"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_pytorch_forward_and_backward(case):
    opts = dict(CASES[case])
    shape = {k: opts.pop(k) for k in ("hkv", "nq", "nk") if k in opts}
    q, k, v = _qkv(**shape, requires_grad=True)
    mask_kind = opts.pop("mask", None)
    g = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, q.shape[2], k.shape[2], generator=g) > 0.3
        mask[..., 0] = True  # no fully masked rows: PyTorch's NaN/zero choice differs there
    elif mask_kind == "float":
        mask = torch.randn(2, 4, q.shape[2], k.shape[2], generator=g)
    elif mask_kind == "bool2d":
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    ref = ORIGINAL(q, k, v, mask, **opts)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, mask, **opts)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    served = attnhub.stats()
    assert SERVED_BY_PYTORCH not in served and sum(served.values()) == 1


def test_positional_arguments_and_keyword_only_like_pytorch():
    q, k, v = _qkv()
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        torch.testing.assert_close(out, ORIGINAL(q, k, v, None, 0.0, True))
        # scale and enable_gqa are keyword-only in PyTorch: keep that.
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.5)


def _error_of(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc), str(exc)
    return None


OUTSIDE = {
    # PyTorch accepts these; attnhub does not serve them: same result as PyTorch.
    "3-d": lambda q, k, v: ((q[0], k[0], v[0]), {}),
    "5-d": lambda q, k, v: ((q[None], k[None], v[None]), {}),
    "broadcast-batch": lambda q, k, v: ((q, k[:1], v[:1]), {}),
    # PyTorch raises on these; so must the patched function, the same way.
    "causal-with-mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(7, 7, dtype=torch.bool), "is_causal": True}),
    "heads-differ-without-gqa": lambda q, k, v: ((q, k[:, :2], v[:, :2]), {}),
    "gqa-not-multiple": lambda q, k, v: ((q, k[:, :3], v[:, :3]), {"enable_gqa": True}),
    "mixed-dtype": lambda q, k, v: ((q, k.double(), v), {}),
    "int-mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(7, 7, dtype=torch.int64)}),
    "mask-dtype-differs": lambda q, k, v: ((q.double(), k.double(), v.double()), {"attn_mask": torch.zeros(7, 7)}),
    "bad-mask-shape": lambda q, k, v: ((q, k, v), {"attn_mask": torch.ones(3, 5, dtype=torch.bool)}),
    "d-differs": lambda q, k, v: ((q, k[..., :8], v), {}),
    "not-tensor": lambda q, k, v: (([1.0], k, v), {}),
    # PyTorch raises IndexError for masks of rank 0 and 1 (2.13, every CPU path), where
    # attnhub.attention serves them: the patched function raised nothing (failed before).
    "0-d-mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.tensor(True)}),
    "1-d-mask": lambda q, k, v: ((q, k, v), {"attn_mask": torch.zeros(7)}),
    # PyTorch's binding takes enable_gqa as a bool only (TypeError for 1, 0, None): so
    # must the patched function (it served them: failed before).
    "gqa-flag-int": lambda q, k, v: ((q, k, v), {"enable_gqa": 1}),
    "gqa-flag-none": lambda q, k, v: ((q, k[:, :2], v[:, :2]), {"enable_gqa": None}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_outside_the_domain_behaves_exactly_as_pytorch(case):
    q, k, v = _qkv()
    args, kwargs = OUTSIDE[case](q, k, v)
    expected_error = _error_of(lambda: ORIGINAL(*args, **kwargs))
    with attnhub.patch():
        got_error = _error_of(lambda: F.scaled_dot_product_attention(*args, **kwargs))
        if expected_error is None:
            torch.testing.assert_close(
                F.scaled_dot_product_attention(*args, **kwargs), ORIGINAL(*args, **kwargs)
            )
    assert got_error == expected_error
    assert set(attnhub.stats()) == {SERVED_BY_PYTORCH}


def test_fully_masked_rows_give_zeros():
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    mask[:, :, 3] = False  # row 3 attends to nothing
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    keep = torch.arange(7) != 3
    torch.testing.assert_close(out[:, :, keep], ORIGINAL(q, k, v, mask)[:, :, keep])


def test_undo_context_manager_nesting_and_options():
    q, k, v = _qkv()
    outer = attnhub.patch()
    assert F.scaled_dot_product_attention is not ORIGINAL and outer.active
    with attnhub.patch(backend="torch_reference") as inner:
        F.scaled_dot_product_attention(q, k, v)
        assert attnhub.stats() == {"torch_reference": 1}
    assert not inner.active
    assert F.scaled_dot_product_attention is outer.function  # the outer patch is back
    F.scaled_dot_product_attention(q, k, v)
    assert attnhub.stats()["torch_sdpa"] == 1
    # Undoing out of order: the newest remaining patch stays in force.
    a, b = attnhub.patch(backend="torch_reference"), attnhub.patch(backend="torch_sdpa")
    a.undo()
    assert F.scaled_dot_product_attention is b.function
    b.undo()
    assert F.scaled_dot_product_attention is outer.function
    outer.undo()
    outer.undo()  # idempotent
    assert F.scaled_dot_product_attention is ORIGINAL
    assert not patch_module.is_patched()


def test_backend_order_and_strict():
    q, k, v = _qkv()
    with attnhub.patch(backend=["torch_reference", "torch_sdpa"]):
        F.scaled_dot_product_attention(q, k, v)
    assert attnhub.stats() == {"torch_reference": 1}
    with pytest.raises(ValueError, match="nonexistent"):
        attnhub.patch(backend="nonexistent")
    assert F.scaled_dot_product_attention is ORIGINAL
    # No backend among those named can serve the call: PyTorch's function serves it,
    # or, with strict=True, NoBackendError.
    if torch.cuda.is_available():
        pytest.skip("needs a machine where torch_sdpa_flash is unavailable")
    qd, kd, vd = (t.to(torch.float16) for t in (q, k, v))
    attnhub.reset_stats()
    names = ["torch_sdpa_flash"]  # a CUDA-only kernel: it cannot serve CPU calls
    with attnhub.patch(backend=names):
        torch.testing.assert_close(F.scaled_dot_product_attention(qd, kd, vd), ORIGINAL(qd, kd, vd))
    assert attnhub.stats() == {SERVED_BY_PYTORCH: 1}
    with attnhub.patch(backend=names, strict=True), pytest.raises(attnhub.NoBackendError):
        F.scaled_dot_product_attention(qd, kd, vd)


def test_first_call_of_a_signature_is_logged(caplog):
    attnhub.dispatch.clear_cache()
    q, k, v = _qkv(nq=5, nk=5, d=8)
    with caplog.at_level(logging.INFO, logger="attnhub"), attnhub.patch():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    served = [r for r in caplog.records if "serves attention(" in r.getMessage()]
    assert len(served) == 1 and "torch_sdpa" in served[0].getMessage()


def test_aliases_rebound_only_where_safe():
    module = types.ModuleType("user_model_with_alias")
    module.scaled_dot_product_attention = ORIGINAL  # from torch.nn.functional import ...
    module.keep_original = ORIGINAL  # a deliberate handle on PyTorch's function
    sys.modules[module.__name__] = module
    try:
        with attnhub.patch() as handle:
            assert module.scaled_dot_product_attention is handle.function
            assert module.keep_original is ORIGINAL
            assert torch._C._nn.scaled_dot_product_attention is ORIGINAL
        assert module.scaled_dot_product_attention is ORIGINAL
        with attnhub.patch(aliases=False):
            assert module.scaled_dot_product_attention is ORIGINAL
    finally:
        del sys.modules[module.__name__]


def test_threads_share_the_patch_and_count_every_call():
    q, k, v = _qkv()
    ref = ORIGINAL(q, k, v, is_causal=True)
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(50):
                torch.testing.assert_close(
                    F.scaled_dot_product_attention(q, k, v, is_causal=True), ref
                )
        except BaseException as exc:
            errors.append(exc)

    with attnhub.patch():
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert attnhub.stats() == {"torch_sdpa": 200}
    attnhub.reset_stats()
    assert attnhub.stats() == {}


def test_torch_sdpa_reaches_pytorch_directly_while_patched():
    """torch_sdpa's runner calls PyTorch's own function, never the patched one: called
    through attnhub.attention while a patch is in force, it went back into the patch
    (served twice, counted twice), and a patched call took an extra Python frame."""
    q, k, v = _qkv()
    ref = ORIGINAL(q, k, v, is_causal=True)
    attnhub.reset_stats()
    with attnhub.patch():
        for _ in range(2):  # decided, then from the call cache
            out = attnhub.attention(q, k, v, causal=True, backend="torch_sdpa")
            torch.testing.assert_close(out, ref)
    assert attnhub.stats() == {"torch_sdpa": 2}


def test_torch_sdpa_does_not_call_another_replacement_of_the_function(monkeypatch):
    q, k, v = _qkv()
    seen = []

    def wrapper(*args, **kwargs):  # a user's own replacement (logging, say)
        seen.append(1)
        return ORIGINAL(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrapper)
    torch.testing.assert_close(
        attnhub.attention(q, k, v, causal=True, backend="torch_sdpa"),
        ORIGINAL(q, k, v, is_causal=True),
    )
    assert seen == []


def test_multihead_attention_and_encoder_layer():
    """Which torch.nn modules go through F.scaled_dot_product_attention (torch 2.13)."""
    torch.manual_seed(0)
    x = torch.randn(3, 6, 32)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    ref_mha = mha(x, x, x, need_weights=False, key_padding_mask=pad)[0]
    ref_weights = mha(x, x, x)[0]
    ref_layer = layer(x, src_mask=causal, src_key_padding_mask=pad)
    with attnhub.patch():
        out_mha = mha(x, x, x, need_weights=False, key_padding_mask=pad)[0]
        assert sum(attnhub.stats().values()) == 1  # need_weights=False: the function
        attnhub.reset_stats()
        out_weights = mha(x, x, x)[0]  # need_weights=True (the default): explicit bmm
        assert attnhub.stats() == {}
        out_layer = layer(x, src_mask=causal, src_key_padding_mask=pad)  # training mode
        assert sum(attnhub.stats().values()) == 1
        attnhub.reset_stats()
        with torch.no_grad():
            layer.eval()  # the fused inference fast path calls no Python function
            out_fast = layer(x, src_key_padding_mask=pad)
            assert attnhub.stats() == {}
    for a, b in ((out_mha, ref_mha), (out_weights, ref_weights), (out_layer, ref_layer)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        ref_fast = layer(x, src_key_padding_mask=pad)
    torch.testing.assert_close(out_fast, ref_fast, atol=1e-5, rtol=1e-5, equal_nan=True)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(1)


def test_torch_compile_patched_model_without_graph_break():
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 9, 32)
    ref = block(x)
    with attnhub.patch():
        explanation = torch._dynamo.explain(block)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(block, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), ref, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_a_call_only_the_reference_could_serve_goes_to_pytorch_instead():
    from attnhub.registry import reload_registry

    registry = reload_registry()
    # Only torch_reference is left (installed plugins, flex_attention among them, serve
    # float64 on the CPU too).
    for name in registry.names():
        if name != "torch_reference":
            registry.remove(name)
    attnhub.dispatch.clear_cache()
    try:
        q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
        expected = ORIGINAL(q, k, v, is_causal=True)
        with attnhub.patch():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(out, expected)
        assert attnhub.stats() == {SERVED_BY_PYTORCH: 1}
        attnhub.reset_stats()
        with attnhub.patch(backend=["torch_reference"]):  # named: then it serves
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out, expected)
        assert attnhub.stats() == {"torch_reference": 1}
        with attnhub.patch(strict=True), pytest.raises(attnhub.NoBackendError, match="strict mode"):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        reload_registry()


# --- __torch_function__: the replacement dispatches overrides as PyTorch's function does


def _causal_bias_case(variant, nq, nk, hq=2, hkv=2):
    from torch.nn.attention import bias

    make = {"upper_left": bias.causal_upper_left, "lower_right": bias.causal_lower_right}
    q, k, v = _qkv(b=2, hq=hq, hkv=hkv, nq=nq, nk=nk, d=8, requires_grad=True, seed=nq * 31 + nk)
    return (q, k, v), (lambda: make[variant](nq, nk)), {"enable_gqa": hq != hkv}


@pytest.mark.parametrize(
    "variant,nq,nk,hq,hkv",
    [
        ("upper_left", 5, 7, 2, 2),
        ("upper_left", 7, 5, 2, 2),
        ("upper_left", 6, 6, 4, 2),
        ("lower_right", 5, 7, 2, 2),
        ("lower_right", 6, 6, 2, 2),
        ("lower_right", 3, 9, 4, 2),
    ],
)
def test_causal_bias_masks_dispatch_like_pytorch(variant, nq, nk, hq, hkv):
    """torch.nn.attention.bias masks hold no data: only their __torch_function__ knows them."""
    (q, k, v), bias, kwargs = _causal_bias_case(variant, nq, nk, hq, hkv)
    ref = ORIGINAL(q, k, v, attn_mask=bias(), **kwargs)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    with attnhub.patch():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias(), **kwargs)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The bias turns into is_causal=True or a materialized mask that attnhub serves.
    assert set(attnhub.stats()) == {"torch_sdpa"}
    with attnhub.patch(), pytest.raises(ValueError, match="CausalBias should not be used"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias(), is_causal=True)


def test_causal_bias_through_a_reference_kept_from_an_undone_patch():
    (q, k, v), bias, _ = _causal_bias_case("lower_right", 4, 6)
    ref = ORIGINAL(q, k, v, attn_mask=bias())
    with attnhub.patch():
        kept = F.scaled_dot_product_attention
    torch.testing.assert_close(kept(q, k, v, attn_mask=bias()), ref)  # nothing patched now
    with attnhub.patch(), attnhub.patch(backend="torch_reference"):  # newer patches
        torch.testing.assert_close(kept(q, k, v, attn_mask=bias()), ref)


class _Recorded(torch.Tensor):
    """A tensor subclass that records the functions its __torch_function__ sees."""

    seen: ClassVar[list] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _sdpa_signature(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
    enable_gqa=False,
):  # fmt: skip
    pass


class _Opaque:
    """Not a tensor, but an override: PyTorch hands the whole call to it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        bound = inspect.signature(_sdpa_signature).bind(*args, **(kwargs or {}))
        bound.apply_defaults()
        return "handled", func, {name: id(value) for name, value in bound.arguments.items()}


@pytest.mark.parametrize("position", range(4))
def test_torch_function_overrides_in_any_tensor_argument(position):
    q, k, v = _qkv(nq=5, nk=5, d=8)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.2
    mask[:, 0] = True
    args = [q, k, v, mask]
    args[position] = args[position].as_subclass(_Recorded)
    _Recorded.seen = []
    ref = ORIGINAL(*args, is_causal=False)
    assert _Recorded.seen == [ORIGINAL]
    with attnhub.patch() as handle:
        _Recorded.seen = []
        out = F.scaled_dot_product_attention(*args)
        # The override sees the function callers reach, as PyTorch's passes itself.
        assert _Recorded.seen[0] is handle.function
    assert type(out) is type(ref) is _Recorded
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ref.as_subclass(torch.Tensor))
    assert attnhub.stats() == {"torch_sdpa": 1}

    opaque = [q, k, v, mask]
    opaque[position] = _Opaque()
    dropout_p, scale = 0.25, 0.5  # the very same objects must reach the override
    expected = ORIGINAL(*opaque, dropout_p=dropout_p, scale=scale)
    with attnhub.patch() as handle:
        got = F.scaled_dot_product_attention(*opaque, dropout_p=dropout_p, scale=scale)
    assert expected[0] == got[0] == "handled" and expected[2] == got[2]
    assert expected[1] is ORIGINAL and got[1] is handle.function


def test_jagged_nested_tensors_get_pytorchs_own_attention():
    """PyTorch's jagged nested tensors serve its SDPA only when their override is handed
    the C function itself; handed the patch's function (as CausalBias wants it) they
    fell through to the dense kernel: "If inputs are nested tensors they must be
    contiguous" (failed before). Patched, the call is PyTorch's, as unpatched."""
    gen = torch.Generator().manual_seed(5)

    def jagged() -> torch.Tensor:  # (B, H, ragged L, D), as the nested tutorial builds it
        parts = [torch.randn(n, 2, 8, generator=gen) for n in (5, 3)]
        return torch.nested.nested_tensor(parts, layout=torch.jagged).transpose(1, 2)

    q, k, v = jagged(), jagged(), jagged()
    ref = ORIGINAL(q, k, v)
    with attnhub.patch():
        F.scaled_dot_product_attention(*_qkv())  # a decided call in the memo first
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.is_nested
    for got, want in zip(out.unbind(), ref.unbind(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after-eager-calls"])
@pytest.mark.parametrize(("nq", "nk"), [(8, 8), (32, 40)])
def test_torch_jit_trace_of_a_patched_model_records_pytorchs_op(warm, nq, nk):
    """torch.jit.trace hands Python sizes as tensors: the patched call raised
    AttributeError ('Tensor' object has no attribute 'bit_length', failed before). It
    is recorded as PyTorch's op, so the traced module serves other lengths as stock's."""
    import warnings

    class Causal(torch.nn.Module):
        def forward(self, q, k, v):  # type: ignore[no-untyped-def]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (nq, nk, nk))
    with attnhub.patch(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        if warm:
            Causal()(q, k, v)
        traced = torch.jit.trace(Causal(), (q, k, v))
    for grow in (0, 8):
        q2, k2, v2 = (torch.randn(1, 2, n + grow, 16, generator=gen) for n in (nq, nk, nk))
        torch.testing.assert_close(traced(q2, k2, v2), ORIGINAL(q2, k2, v2, is_causal=True))


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "bool-mask"])
@pytest.mark.parametrize("position", range(3))
def test_a_non_tensor_after_decided_calls_gets_pytorchs_own_error(masked, position):
    """The memo tests each argument's is_nested before its C check: a list there raised
    AttributeError (the nested-tensor fix's first version) where PyTorch's function
    raises its TypeError naming the argument."""
    q, k, v = _qkv()
    mask = torch.rand(q.shape[2], k.shape[2], generator=torch.Generator().manual_seed(4)) > 0.2
    extra = (mask,) if masked else ()
    args = [q, k, v]
    args[position] = args[position].tolist()
    with pytest.raises(TypeError) as stock:
        ORIGINAL(*args, *extra)
    with attnhub.patch():
        for _ in range(3):  # decided, then served by the memo
            F.scaled_dot_product_attention(q, k, v, *extra)
        with pytest.raises(TypeError) as patched:
            F.scaled_dot_product_attention(*args, *extra)
    assert str(patched.value) == str(stock.value)


def test_torch_function_mode_sees_patched_calls():
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    ref = ORIGINAL(q, k, v, is_causal=True)
    with attnhub.patch() as handle, Seen() as mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert mode.funcs[0] is handle.function
    torch.testing.assert_close(out, ref)
    assert attnhub.stats() == {"torch_sdpa": 1}  # the mode's func(...) reached attnhub


# --- TorchScript


_SCRIPT_CHECK = """
import torch, torch.nn.functional as F, attnhub

def check(label):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    scripted = torch.jit.script(mha)
    got = scripted(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got, mha(x, x, x, need_weights=False)[0])

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)

    q = torch.randn(1, 2, 4, 8)
    torch.testing.assert_close(torch.jit.script(f)(q, q, q), f(q, q, q))
    print(label, "ok")

handle = attnhub.patch()
check("patched")
# Scripted code keeps PyTorch's own function: nothing served by attnhub while scripting.
attnhub.reset_stats()
torch.jit.script(torch.nn.MultiheadAttention(8, 2))
assert attnhub.stats() == {}, attnhub.stats()
handle.undo()
check("undone")
with attnhub.patch():
    check("patched again")
"""


def test_torchscript_while_patched_and_after_undo(tmp_path):
    """In a fresh process: TorchScript caches compiled classes for the whole process."""
    script = tmp_path / "script_check.py"  # TorchScript reads the source of f
    script.write_text(_SCRIPT_CHECK)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["patched", "ok", "undone", "ok", "patched", "again", "ok"]


def test_torchscript_entry_goes_with_the_function():
    import gc

    import torch.jit._builtins as jit_builtins

    with attnhub.patch() as handle:
        key = id(handle.function)
        assert jit_builtins._find_builtin(handle.function) == "aten::scaled_dot_product_attention"
    del handle
    gc.collect()
    assert key not in jit_builtins._get_builtin_table()


# --- benchmarks/pytorch_sdpa_tests.py: runs a test file plain and patched, and compares

_SYNTHETIC_TESTS = """
import torch
import torch.nn.functional as F


def test_same_result():
    q = torch.randn(1, 2, 4, 8)
    ref = torch.ops.aten.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, is_causal=True), ref)


def test_pytorch_function_in_place():
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_fails_anyway():
    assert False
"""


def test_pytorch_tests_runner_reports_what_the_patch_changes(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pytorch_sdpa_tests.py"
    spec = importlib.util.spec_from_file_location("pytorch_sdpa_tests", path)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # its dataclasses look their module up
    try:
        spec.loader.exec_module(runner)
    finally:
        del sys.modules[spec.name]
    test_file = tmp_path / "test_synthetic.py"
    test_file.write_text(_SYNTHETIC_TESTS)
    plain, patched = (runner.run_tests(test_file, p, "", [], 300, []) for p in (False, True))
    groups = runner.compare(plain, patched)
    assert groups["regressed"] == ["test_synthetic::test_pytorch_function_in_place"]
    assert groups["fail_both"] == ["test_synthetic::test_fails_anyway"]
    assert patched.stats == {"torch_sdpa": 1}  # the plugin patched, attnhub served
    assert plain.stats == {}
    text = runner.report(plain, patched, {"test file": "synthetic"})
    assert "## Pass plain, fail patched: 1" in text


def test_a_compiled_function_is_not_recompiled_by_its_own_second_call_while_patched():
    """The per-thread flag that stops a backend's own SDPA call from recursing was
    created by the first patched call: a graph compiled then guarded on its absence and
    recompiled at the second call. Run in a new thread (whose flag is fresh)."""
    import threading

    import torch._dynamo

    q = torch.randn(1, 2, 8, 16)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with attnhub.patch():
                sdpa = torch.nn.functional.scaled_dot_product_attention
                compiled = torch.compile(lambda q: sdpa(q, q, q), backend="eager", fullgraph=True)
                compiled(q)
                with torch._dynamo.config.patch(error_on_recompile=True):
                    compiled(q)
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive() and not errors, errors
