"""attnhub inside PyTorch's compilers: ``torch.compile`` with changing shapes (automatic
dynamic shapes and ``dynamic=True``), for ``attnhub.attention`` and the patched
``F.scaled_dot_product_attention``, and ``torch.export`` with a dynamic or
data-dependent batch.

Every compiled or exported result is compared with the float64 reference. Graphs are
counted where it matters: one serves every length of its power-of-two bucket and every
batch size, and none is reused for a call its backend cannot serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F
from torch.export import Dim, export

import attnhub
from attnhub.backend import Backend
from attnhub.registry import get_registry
from attnhub.request import AttentionRequest


def _qkv(b: int, nq: int, nk: int, hq: int = 4, hkv: int = 2, d: int = 8) -> list[torch.Tensor]:
    return [torch.randn(b, hq, nq, d), torch.randn(b, hkv, nk, d), torch.randn(b, hkv, nk, d)]


def _reference(q: Any, k: Any, v: Any, mask: Any = None, **options: Any) -> Any:
    """The contract's answer, computed in float64 (output, or (output, lse))."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    return attnhub.attention(
        q.double(), k.double(), v.double(), mask, backend="torch_reference", **options
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


# -- torch.compile: attnhub.attention -------------------------------------------

# (B, N) of successive calls: lengths in two buckets (16: 10, 13, 12; 64: 40, 33), a
# batch that changes. No B or N equals a head count (4, 2) or the head dim (8):
# attnhub specializes those, and Dynamo gives equal sizes one symbol (duck sizing), so
# a coincidence would specialize the batch or length too, for one more recompile.
_CALLS = [(3, 10), (5, 13), (6, 12), (3, 40), (5, 33)]
# One graph per bucket, none for a new length within a bucket or a new batch. With
# automatic dynamic shapes the first call's graph is static, and the second call (new
# B and N) compiles the dynamic one.
_GRAPHS = {True: 2, None: 3}


def _graphs() -> int:
    """Graphs Dynamo compiled since the last reset (a restart's empty graph aside)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_compiled_attention_follows_changing_lengths(compiler: str, dynamic: bool | None) -> None:
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnhub.attention(q, k, v, causal=True) * 2

    compiled = torch.compile(f, backend=compiler, fullgraph=True, dynamic=dynamic)
    for b, n in _CALLS:
        q, k, v = _qkv(b, n, n)
        _close(compiled(q, k, v), 2 * _reference(q, k, v, causal=True))
    assert _graphs() == _GRAPHS[dynamic]


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compiled_attention_follows_the_length_relation(dynamic: bool | None) -> None:
    # Nq == Nk, Nq < Nk and Nq > Nk decide how bottom-right causal is served (and by
    # which backends): a graph traced for one relation must not serve another.
    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnhub.attention(q, k, v, causal=True, alignment="bottom_right")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for nq, nk in [(9, 9), (10, 10), (9, 14), (14, 9), (10, 13), (13, 10)]:
        q, k, v = _qkv(2, nq, nk)
        _close(compiled(q, k, v), _reference(q, k, v, causal=True, alignment="bottom_right"))


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compiled_attention_with_a_mask_options_and_backward(dynamic: bool | None) -> None:
    options: dict[str, Any] = {"scale": 0.3, "window": (5, 2), "return_lse": True}

    def f(q, k, v, mask):  # type: ignore[no-untyped-def]
        return attnhub.attention(q, k, v, mask, **options)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for n in (8, 12, 20):
        q, k, v = (t.requires_grad_() for t in _qkv(2, n, n))
        mask = torch.randn(n)  # 1-D: broadcast over the query rows (and B, H)
        out, lse = compiled(q, k, v, mask)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = _reference(q64, k64, v64, mask, **options)
        _close(out, ref)
        _close(lse, ref_lse)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for got, want in zip(grads, torch.autograd.grad(ref.sum(), (q64, k64, v64))):
            _close(got, want)


class _ShortKeys(Backend):
    """Serves only calls with at most 16 keys (it says so from the request's bucket)
    and really computes over the first 16 keys alone: a graph that ran it for a longer
    call would give a wrong answer. It outranks the built-in backends."""

    name = "short_keys"
    priority = 1000
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    gqa = True
    memory = "linear"
    compile_safe = True
    admitted: list[int] = []  # noqa: RUF012 (the key buckets it was found eligible for)

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if request.seqlen_k > 16:
            return [f"Nk~{request.seqlen_k} is over 16"]
        _ShortKeys.admitted.append(request.seqlen_k)  # at decision (trace) time
        return []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        from attnhub.backends.torch_reference import reference_attention

        return reference_attention(query, key[:, :, :16], value[:, :, :16], None, params)[0]


@pytest.fixture
def short_keys() -> Iterator[type[_ShortKeys]]:
    registry = get_registry()
    registry.add(_ShortKeys())
    _ShortKeys.admitted.clear()
    try:
        yield _ShortKeys
    finally:
        registry.remove(_ShortKeys.name)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_a_graph_never_runs_a_backend_on_a_call_it_cannot_serve(
    short_keys: type[_ShortKeys], dynamic: bool | None
) -> None:
    compiled = torch.compile(
        lambda q, k, v: attnhub.attention(q, k, v, causal=True, alignment="bottom_right"),
        backend="eager", fullgraph=True, dynamic=dynamic,
    )  # fmt: skip
    for nk in (10, 12, 15, 16, 17, 40, 14):
        q, k, v = _qkv(2, 6, nk)
        out = compiled(q, k, v)
        _close(out, _reference(q, k, v, causal=True, alignment="bottom_right"))
    assert short_keys.admitted == [16]  # chosen for the short calls (one decision)


class _EagerOnly(_ShortKeys):
    """Serves every call, outranking the built-in backends, but does not declare
    ``compile_safe``: a graph must never trace it in."""

    name = "eager_only"
    compile_safe = False
    traced: list[bool] = []  # noqa: RUF012 (whether each call it ran was being traced)

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        return []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        _EagerOnly.traced.append(torch.compiler.is_compiling())
        from attnhub.backends.torch_reference import reference_attention

        return reference_attention(query, key, value, None, params)[0]


def test_a_graph_never_traces_a_backend_that_is_not_compile_safe() -> None:
    """Backend.compile_safe was declared and never read: a traced call took the
    eager-only backend, the one ranked first (failed before)."""
    registry = get_registry()
    registry.add(_EagerOnly())
    _EagerOnly.traced.clear()
    try:
        q, k, v = _qkv(2, 6, 10)
        assert attnhub.explain(q, k, v).chosen == "eager_only"
        attnhub.attention(q, k, v)
        compiled = torch.compile(lambda q, k, v: attnhub.attention(q, k, v), backend="eager", fullgraph=True)  # fmt: skip
        _close(compiled(q, k, v), _reference(q, k, v))
        assert _EagerOnly.traced == [False]  # the eager call only
    finally:
        registry.remove(_EagerOnly.name)


# -- torch.compile: the patched F.scaled_dot_product_attention ----------------------


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_compiled_patched_sdpa_follows_changing_shapes(
    short_keys: type[_ShortKeys], dynamic: bool | None
) -> None:
    original = F.scaled_dot_product_attention

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) + 1

    with attnhub.patch():
        # One call first: the patch's thread-local "inside a patched call" flag does not
        # exist before it, and Dynamo guards on that (one recompile, patching.py's).
        block(*_qkv(1, 3, 3))
        compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        for b, n in _CALLS:
            q, k, v = _qkv(b, n, n)
            want = original(q, k, v, is_causal=True, enable_gqa=True) + 1
            _close(compiled(q, k, v), want)
    assert 16 in short_keys.admitted  # attnhub served: short_keys chosen for N <= 16
    assert _graphs() == _GRAPHS[dynamic]


# -- torch.export ---------------------------------------------------------------


class _Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):  # type: ignore[no-untyped-def]
        return attnhub.attention(q, k, v, mask, causal=False)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("mask_shape", ["B1QK", "QK"])
def test_export_with_a_dynamic_batch_and_a_mask(strict: bool, mask_shape: str) -> None:
    def inputs(b: int) -> list[torch.Tensor]:
        shape = (b, 1, 5, 7) if mask_shape == "B1QK" else (5, 7)
        return [*_qkv(b, 5, 7), torch.rand(shape) > 0.3]

    batch = Dim("batch", max=64)
    dims = ({0: batch},) * 3 + (({0: batch},) if mask_shape == "B1QK" else (None,))
    program = export(_Attend(), tuple(inputs(3)), dynamic_shapes=dims, strict=strict)
    for b in (3, 2, 9):
        args = inputs(b)
        _close(program.module()(*args), _reference(*args))


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
def test_export_with_a_data_dependent_batch(strict: bool) -> None:
    class Rows(torch.nn.Module):
        def forward(self, keep, q, k, v, mask):  # type: ignore[no-untyped-def]
            rows = keep.nonzero().squeeze(1)  # how many: known only when it runs
            q, k, v, mask = (t.index_select(0, rows) for t in (q, k, v, mask))
            return attnhub.attention(q, k, v, mask)

    q, k, v = _qkv(4, 5, 7)
    mask = torch.randn(4, 1, 5, 7)
    program = export(Rows(), (torch.tensor([True, False, True, True]), q, k, v, mask),
                     strict=strict)  # fmt: skip
    for keep in ([True, False, True, True], [False, True, False, False], [False] * 4):
        rows = torch.tensor(keep).nonzero().squeeze(1)
        got = program.module()(torch.tensor(keep), q, k, v, mask)
        _close(got, _reference(q[rows], k[rows], v[rows], mask[rows]))
