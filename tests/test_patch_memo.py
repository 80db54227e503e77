"""The patched function's memo: a repeated call reuses the last decision, and only then.

Each case warms the memo with one call, changes one thing that decides a call (an
option, the selection in force, grad mode, determinism, tensor metadata, the
registry), and checks that the next call is decided again (``sdpa_entry`` is reached)
and gives what PyTorch's own function gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import attnhub
from attnhub import patching
from attnhub.registry import invalidate_caches

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture
def decided(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The calls the patch decided (rather than reused), as (is_causal, scale, dropout_p)."""
    seen: list[tuple[Any, ...]] = []
    real = patching.sdpa_entry

    def spy(query, key, value, attn_mask, is_causal, scale, dropout_p, backend, *structure):  # type: ignore[no-untyped-def]
        seen.append((is_causal, scale, dropout_p))
        return real(query, key, value, attn_mask, is_causal, scale, dropout_p, backend, *structure)

    monkeypatch.setattr(patching, "sdpa_entry", spy)
    attnhub.reset_stats()
    yield seen
    for handle in reversed(patching.active_patches()):
        handle.undo()


def _qkv(requires_grad: bool = False, nk: int = 9, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 4, 7, 16), (2, 4, nk, 16), (2, 4, nk, 16))
    return [torch.randn(s, generator=g).requires_grad_(requires_grad) for s in shapes]


def test_a_repeated_call_is_decided_once_and_runs_on_new_values(decided):
    with attnhub.patch():
        for seed in range(4):
            q, k, v = _qkv(seed=seed)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=0.3)
            torch.testing.assert_close(out, ORIGINAL(q, k, v, scale=0.3))
    assert len(decided) == 1
    assert attnhub.stats() == {"torch_sdpa": 4}


@contextlib.contextmanager
def _env(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> Iterator[None]:
    monkeypatch.setenv(name, value)
    yield
    monkeypatch.delenv(name)


# name -> (the change, as a context manager factory; call options; served by)
CHANGES: dict[str, tuple[Callable[[pytest.MonkeyPatch], Any], dict[str, Any], str]] = {
    "is_causal": (lambda mp: contextlib.nullcontext(), {"is_causal": True}, "torch_sdpa"),
    "scale": (lambda mp: contextlib.nullcontext(), {"scale": 0.5}, "torch_sdpa"),
    "scale None": (lambda mp: contextlib.nullcontext(), {"scale": None}, "torch_sdpa"),
    "use_backend": (
        lambda mp: attnhub.use_backend("torch_reference"),
        {},
        "torch_reference",
    ),
    "ATTNHUB_BACKEND": (
        lambda mp: _env(mp, "ATTNHUB_BACKEND", "torch_reference"),
        {},
        "torch_reference",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_that_decides_a_call_is_decided_again(decided, monkeypatch, change):
    make_context, options, served_by = CHANGES[change]
    q, k, v = _qkv()
    base = {"is_causal": False, "scale": 0.25}
    with attnhub.patch():
        F.scaled_dot_product_attention(q, k, v, **base)
        attnhub.reset_stats()
        with make_context(monkeypatch):
            out = F.scaled_dot_product_attention(q, k, v, **{**base, **options})
        torch.testing.assert_close(out, ORIGINAL(q, k, v, **{**base, **options}))
        assert attnhub.stats() == {served_by: 1}
        assert len(decided) == 2
        # And back: the first call's decision again (decided anew: the memo holds one).
        attnhub.reset_stats()
        F.scaled_dot_product_attention(q, k, v, **base)
        assert attnhub.stats() == {"torch_sdpa": 1}


def test_new_metadata_is_decided_again(decided):
    q, k, v = _qkv()
    with attnhub.patch():
        F.scaled_dot_product_attention(q, k, v)
        _, k12, v12 = _qkv(nk=12)  # a longer key sequence in the same bucket (9..16): the
        # memo serves it (its guards leave the key length to the bucket: api._LengthFreeGuards)
        torch.testing.assert_close(
            F.scaled_dot_product_attention(q, k12, v12), ORIGINAL(q, k12, v12)
        )
        assert len(decided) == 1
        q2, k2, v2 = _qkv(nk=17)  # a longer key sequence in another bucket
        torch.testing.assert_close(F.scaled_dot_product_attention(q2, k2, v2), ORIGINAL(q2, k2, v2))
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same shape, other strides
        torch.testing.assert_close(F.scaled_dot_product_attention(qt, k, v), ORIGINAL(qt, k, v))
        q64, k64, v64 = (t.double() for t in (q, k, v))
        torch.testing.assert_close(
            F.scaled_dot_product_attention(q64, k64, v64), ORIGINAL(q64, k64, v64)
        )
    assert len(decided) == 4


def test_grad_mode_and_determinism_are_part_of_the_decision(decided):
    q, k, v = _qkv(requires_grad=True)
    with attnhub.patch():
        with torch.no_grad():
            assert not F.scaled_dot_product_attention(q, k, v).requires_grad
        out = F.scaled_dot_product_attention(q, k, v)  # grad mode on: decided again
        assert len(decided) == 2
        out.sum().backward()
        expected_grads = torch.autograd.grad(ORIGINAL(q, k, v).sum(), (q, k, v))
        for got, expected in zip((q.grad, k.grad, v.grad), expected_grads):
            torch.testing.assert_close(got, expected)
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            F.scaled_dot_product_attention(q, k, v)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        assert len(decided) == 3


def test_registry_changes_clear_the_memo(decided):
    q, k, v = _qkv()
    with attnhub.patch():
        F.scaled_dot_product_attention(q, k, v)
        F.scaled_dot_product_attention(q, k, v)
        assert len(decided) == 1
        invalidate_caches()
        F.scaled_dot_product_attention(q, k, v)
    assert len(decided) == 2


class _CallsPyTorch(attnhub.Backend):
    """A backend whose runner, a Python function, calls F.scaled_dot_product_attention
    (as a plugin wrapping PyTorch's function would): inside a patched call that must be
    PyTorch's own function, on a reused decision too."""

    name = "calls_pytorch"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})
    memory = "linear"

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        self.calls += 1
        return F.scaled_dot_product_attention(query, key, value, scale=params.scale)


def test_a_reused_python_runner_calling_pytorch_does_not_recurse(decided):
    backend = _CallsPyTorch()
    registry = attnhub.get_registry()
    registry.add(backend)
    try:
        with attnhub.patch(backend="calls_pytorch"):
            for seed in range(3):
                q, k, v = _qkv(seed=seed)
                out = F.scaled_dot_product_attention(q, k, v, scale=0.3)
                torch.testing.assert_close(out, ORIGINAL(q, k, v, scale=0.3))
    finally:
        registry.remove("calls_pytorch")
    assert len(decided) == 1  # the second and third calls reused the decision
    assert backend.calls == 3
    assert attnhub.stats() == {"calls_pytorch": 3}
    assert not patching._inside.active


def test_options_of_other_types_are_not_taken_for_equal_values(decided):
    """``dropout_p=0`` (an int) equals 0.0 and ``is_causal=1`` equals True: PyTorch's
    answer for each, not the memo's for the value it equals."""
    q, k, v = _qkv()
    with attnhub.patch():
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        torch.testing.assert_close(
            F.scaled_dot_product_attention(q, k, v, dropout_p=0, is_causal=True),
            ORIGINAL(q, k, v, dropout_p=0, is_causal=True),
        )
        with pytest.raises(TypeError):
            ORIGINAL(q, k, v, is_causal=1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, is_causal=1)  # type: ignore[arg-type]
    assert len(decided) <= 2  # dropout_p=0 may be decided; never reused


def test_a_torch_function_mode_sees_calls_after_the_memo_is_warm(decided):
    seen: list[Any] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    with attnhub.patch() as handle:
        F.scaled_dot_product_attention(q, k, v)
        with Spy():
            F.scaled_dot_product_attention(q, k, v)
        assert handle.function in seen


def test_masks_whose_values_decide_are_reused_only_for_the_same_unchanged_tensor(
    decided, monkeypatch
):  # type: ignore[no-untyped-def]
    """A mask read for its structure (on the devices where it is) is decided per mask
    tensor: the layers of a step, which share one, decide once; another tensor of the
    same shape (a causal one, then a padding one), or the same tensor changed in place,
    is read and decided again, each run as what it is."""
    monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cpu", "cuda"}))
    reads = []
    real = patching.recognize
    monkeypatch.setattr(patching, "recognize", lambda m: reads.append(1) or real(m))
    q, k, v = _qkv(nk=7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    padding = torch.ones(7, 7, dtype=torch.bool)
    padding[:, 5:] = False
    with attnhub.patch():
        for mask, layers in ((causal, 3), (padding, 2), (causal, 1)):
            for _ in range(layers):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                torch.testing.assert_close(out, ORIGINAL(q, k, v, attn_mask=mask))
        assert len(decided) == len(reads) == 3
        padding[:, 3:] = False  # in place: a new mask under the same tensor
        for _ in range(2):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
            torch.testing.assert_close(out, ORIGINAL(q, k, v, attn_mask=padding))
        assert len(decided) == len(reads) == 4
        with torch.inference_mode():  # no version counter: decided at every call
            fresh = torch.ones(7, 7, dtype=torch.bool).tril()
            for _ in range(2):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=fresh)
                torch.testing.assert_close(out, ORIGINAL(q, k, v, attn_mask=fresh))
        assert len(decided) == len(reads) == 6
        invalidate_caches()  # the registry changed: decided again
        F.scaled_dot_product_attention(q, k, v, attn_mask=padding)
        assert len(decided) == 7


def test_the_memo_does_not_keep_a_mask_alive(decided, monkeypatch):
    """A mask that is no structure is handed on as given; the memo refers to it weakly,
    so a step's (B, 1, N, N) mask is freed with the step (it was kept until the next
    masked call)."""
    import gc
    import weakref

    monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cpu", "cuda"}))
    q, k, v = _qkv(nk=7)
    mask = torch.rand(2, 1, 7, 7, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    with attnhub.patch():
        for _ in range(2):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out, ORIGINAL(q, k, v, attn_mask=mask))
        assert len(decided) == 1
        gone = weakref.ref(mask)
        del mask
        gc.collect()
        assert gone() is None


def test_masks_decided_by_metadata_are_memoized_and_run_on_new_values(decided):
    q, k, v = _qkv()
    with attnhub.patch():
        for seed in range(3):
            mask = torch.rand(2, 1, 1, 9, generator=torch.Generator().manual_seed(seed)) > 0.3
            mask[..., 0] = True
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
            torch.testing.assert_close(out, ORIGINAL(q, k, v, attn_mask=mask, scale=0.25))
    assert len(decided) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_models_calls_on_cuda_match_pytorch_when_reused(decided, dtype):
    """Hugging Face's calls, each repeated with new values as the layers of a step make
    them: a prefill (is_causal, GQA through enable_gqa), a decode step with the query
    heads packed into rows and a per-key bool mask, and the same without a mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device="cuda", dtype=dtype, generator=g)

    calls = {
        "prefill": lambda: ((randn(2, 16, 256, 128), randn(2, 4, 256, 128), randn(2, 4, 256, 128)),
                            {"is_causal": True, "enable_gqa": True}),
        "decode, mask": lambda: ((randn(8, 4, 4, 128), randn(8, 4, 300, 128), randn(8, 4, 300, 128)),
                                 {"attn_mask": torch.rand(8, 1, 1, 300, device="cuda", generator=g) > 0.1}),
        "decode": lambda: ((randn(8, 16, 1, 128), randn(8, 4, 300, 128), randn(8, 4, 300, 128)),
                           {"enable_gqa": True}),
    }  # fmt: skip
    with attnhub.patch():
        for name, make in calls.items():
            before = len(decided)
            for _ in range(3):
                (q, k, v), options = make()
                options = {**options, "dropout_p": 0.0, "scale": 128**-0.5}
                out = F.scaled_dot_product_attention(q, k, v, **options)
                expected = ORIGINAL(q.double(), k.double(), v.double(), **options)
                torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
            assert len(decided) - before == 1, name  # decided once, reused twice
