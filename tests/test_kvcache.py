"""attnhub.attention_kvcache: contiguous and paged caches against a per-sequence loop of
the dense call (contract.md, "Packed sequences and KV caches"), the in-place append,
its errors and its explain().

The oracle is independent of the cache code: the expected cache contents are built by
hand (new keys written at ``cache_seqlens[b]``), each sequence's first ``L_b`` keys
are sliced out and run through ``attnhub.attention(..., backend="torch_reference")``
on float64 copies (r64), and through ``reference_attention`` in the inputs' dtype
(r_lp, the contract's tolerance bound).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch._dynamo.exc import Unsupported

import attnhub
from attnhub.backends.torch_reference import reference_attention
from attnhub.request import AttentionParams
from attnhub.testing.tolerance import compare

OPTIONS: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"causal": True, "window": (3, 0)},
    {"window": (2, 1)},
    {"causal": True, "softcap": 2.5, "scale": 0.6},
    {"causal": True, "alignment": "top_left"},
]


def _params(d: int, options: dict[str, Any]) -> AttentionParams:
    scale = options.get("scale")
    return AttentionParams(
        causal=options.get("causal", False),
        alignment=options.get("alignment", "bottom_right"),
        window=options.get("window"),
        softcap=options.get("softcap"),
        scale=1.0 / math.sqrt(d) if scale is None else scale,
        return_lse=True,
    )


class Setup:
    """A batch of caches: contiguous (B, Hkv, Nmax, D) and the same keys in a paged
    cache whose pages are shuffled (and one spare), with new keys to append."""

    def __init__(
        self,
        seqlens: list[int],
        nq: int,
        new: int,
        *,
        hq: int = 4,
        hkv: int = 2,
        d: int = 8,
        page_size: int = 4,
        pages_per_seq: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        b = len(seqlens)
        self.nmax = page_size * pages_per_seq
        self.page_size = page_size

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(device, dtype)

        self.query = rand(b, hq, nq, d)
        self.k_cache = rand(b, hkv, self.nmax, d)
        self.v_cache = rand(b, hkv, self.nmax, d)
        self.k_new = rand(b, hkv, new, d) if new else None
        self.v_new = rand(b, hkv, new, d) if new else None
        self.cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device=device)
        # Paged: sequence b's page j is page perm[b * pages_per_seq + j] of the pool
        # (one page more than needed: a page no sequence owns).
        pages = b * pages_per_seq + 1
        perm = torch.randperm(pages, generator=g)[: b * pages_per_seq]
        self.block_table = perm.view(b, pages_per_seq).to(device, torch.int32)
        self.k_pages = rand(pages, page_size, hkv, d)
        self.v_pages = rand(pages, page_size, hkv, d)
        for cache, paged in ((self.k_cache, self.k_pages), (self.v_cache, self.v_pages)):
            tokens = cache.transpose(1, 2).reshape(b, pages_per_seq, page_size, hkv, d)
            paged[self.block_table.long()] = tokens

    def expected_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The contiguous caches after the append, written here position by position."""
        k, v = self.k_cache.clone(), self.v_cache.clone()
        if self.k_new is not None:
            for b, start in enumerate(self.cache_seqlens.tolist()):
                for j in range(self.k_new.shape[2]):
                    k[b, :, start + j] = self.k_new[b, :, j]
                    v[b, :, start + j] = self.v_new[b, :, j]
        return k, v

    def lengths(self) -> list[int]:
        new = 0 if self.k_new is None else self.k_new.shape[2]
        return [s + new for s in self.cache_seqlens.tolist()]

    def call(self, paged: bool, **options: Any) -> Any:
        k, v = (self.k_pages, self.v_pages) if paged else (self.k_cache, self.v_cache)
        return attnhub.attention_kvcache(
            self.query, k, v, self.cache_seqlens,
            block_table=self.block_table if paged else None,
            k_new=self.k_new, v_new=self.v_new, **options,
        )  # fmt: skip

    def oracle(self, options: dict[str, Any], *, float64: bool) -> tuple[torch.Tensor, ...]:
        k_cache, v_cache = self.expected_caches()
        outs, lses = [], []
        for b, length in enumerate(self.lengths()):
            q = self.query[b : b + 1]
            k, v = k_cache[b : b + 1, :, :length], v_cache[b : b + 1, :, :length]
            if float64:
                out, lse = attnhub.attention(
                    q.double(), k.double(), v.double(), backend="torch_reference",
                    return_lse=True, **{"alignment": "bottom_right", **options},
                )  # fmt: skip
            else:
                out, lse = reference_attention(q, k, v, None, _params(q.shape[-1], options))
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def _backends(layout: str, device: str) -> list[str]:
    registry = attnhub.get_registry()
    return [
        b.name
        for b in registry.backends()
        if layout in b.layouts
        and device in b.devices
        and (device != "cpu" or registry.unavailable_reason(b.name) is None)
    ]


def _check(problems: list[str | None]) -> None:
    found = [p for p in problems if p]
    assert not found, "\n".join(found)


def _problems(setup: Setup, backend: str, paged: bool, options: dict[str, Any]) -> list[Any]:
    out, lse = setup.call(paged, return_lse=True, backend=backend, **options)
    assert out.dtype == setup.query.dtype and lse.dtype == torch.float32
    r64, lse64 = setup.oracle(options, float64=True)
    r_lp, lse_lp = setup.oracle(options, float64=False)
    return [compare("out", out, r_lp, r64), compare("lse", lse, lse_lp, lse64)]


# seqlens per sequence: an empty cache, a full one after the append, short ones where
# causal masks whole rows (L_b < Nq).
SEQLENS = [0, 13, 5, 1]


@pytest.mark.parametrize("layout", ["kvcache", "paged"])
@pytest.mark.parametrize(
    "backend", sorted(set(_backends("kvcache", "cpu")) | set(_backends("paged", "cpu")))
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("nq", "new"), [(1, 0), (1, 1), (3, 3), (2, 0)])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(map(str, o)) or "plain")
def test_matches_a_loop_of_dense_calls(layout, backend, dtype, nq, new, options):
    """Every CPU backend serving the layout (triton_flash's decode kernel too, under
    TRITON_INTERPRET=1), on the cases it declares it serves (explain() says which)."""
    setup = Setup(SEQLENS, nq, new, d=16, dtype=dtype, seed=nq + new)
    paged = layout == "paged"
    _skip_unless_chosen(setup, backend, paged, options)
    _check(_problems(setup, backend, paged, options))


def _skip_unless_chosen(setup: Setup, backend: str, paged: bool, options: dict[str, Any]) -> None:
    k, v = (setup.k_pages, setup.v_pages) if paged else (setup.k_cache, setup.v_cache)
    decision = attnhub.explain_kvcache(
        setup.query, k, v, setup.cache_seqlens, block_table=setup.block_table if paged else None,
        k_new=setup.k_new, v_new=setup.v_new, return_lse=True, backend=backend, **options,
    )  # fmt: skip
    if decision.chosen != backend:
        pytest.skip(f"{backend}: {'; '.join(decision.reasons()[backend])}")


@pytest.mark.parametrize("options", OPTIONS[:3], ids=lambda o: ",".join(map(str, o)) or "plain")
def test_paged_and_contiguous_give_identical_results(options):
    setup = Setup(SEQLENS, 2, 2, seed=5)
    contiguous = setup.call(False, return_lse=True, **options)
    paged = setup.call(True, return_lse=True, **options)
    for a, b in zip(contiguous, paged):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_writes_the_new_keys_and_nothing_else(paged):
    setup = Setup([0, 9, 3], 2, 3, seed=11)
    expected_k, expected_v = setup.expected_caches()
    before = setup.cache_seqlens.clone()
    k_pages_before = setup.k_pages.clone()
    setup.call(paged)
    assert torch.equal(setup.cache_seqlens, before)  # not advanced: the caller's count
    if not paged:
        assert torch.equal(setup.k_cache, expected_k)
        assert torch.equal(setup.v_cache, expected_v)
        return
    # Each sequence's pages now hold the expected contiguous cache's positions ...
    b, hkv, nmax, d = expected_k.shape
    for cache, expected in ((setup.k_pages, expected_k), (setup.v_pages, expected_v)):
        gathered = cache[setup.block_table.long()].reshape(b, nmax, hkv, d).transpose(1, 2)
        assert torch.equal(gathered, expected)
    # ... and the page no sequence owns is untouched.
    spare = sorted(set(range(setup.k_pages.shape[0])) - set(setup.block_table.flatten().tolist()))
    assert torch.equal(setup.k_pages[spare], k_pages_before[spare])


def test_rows_that_keep_no_key_are_zeros_with_minus_infinity():
    setup = Setup([0, 2], 4, 0, seed=3)
    out, lse = setup.call(False, causal=True, return_lse=True)
    # sequence 0: no keys at all; sequence 1: L = 2 < Nq = 4, rows 0 and 1 see nothing.
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], float("-inf")))
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
    assert torch.isinf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2:]).all()


def test_a_decoding_step_with_causal_is_the_same_call_without():
    setup = Setup([5, 9], 1, 1, seed=2)
    causal = setup.call(False, causal=True)
    setup2 = Setup([5, 9], 1, 1, seed=2)
    plain = setup2.call(False)
    torch.testing.assert_close(causal, plain, rtol=0, atol=0)
    assert not attnhub.explain_kvcache(
        setup.query, setup.k_cache, setup.v_cache, setup.cache_seqlens, causal=True
    ).request.causal


def test_gradient_to_the_query_matches_the_oracle():
    setup = Setup([4, 12], 3, 0, seed=8)
    q = setup.query.clone().requires_grad_()
    out = attnhub.attention_kvcache(
        q, setup.k_cache, setup.v_cache, setup.cache_seqlens, causal=True
    )
    out.sum().backward()
    q64 = setup.query.double().requires_grad_()
    ref = torch.cat([
        attnhub.attention(q64[b : b + 1], setup.k_cache[b : b + 1, :, :n].double(),
                          setup.v_cache[b : b + 1, :, :n].double(), causal=True,
                          alignment="bottom_right", backend="torch_reference")
        for b, n in enumerate([4, 12])
    ])  # fmt: skip
    ref.sum().backward()
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=0, atol=1e-5)


# -- errors --------------------------------------------------------------------------


def _call(paged: bool = False, **changes: Any) -> Any:
    setup = Setup([3, 5], 1, 1, seed=0)
    args: dict[str, Any] = {
        "query": setup.query,
        "k_cache": setup.k_pages if paged else setup.k_cache,
        "v_cache": setup.v_pages if paged else setup.v_cache,
        "cache_seqlens": setup.cache_seqlens,
        "block_table": setup.block_table if paged else None,
        "k_new": setup.k_new,
        "v_new": setup.v_new,
    }
    args.update(changes)
    return attnhub.attention_kvcache(**args)


I32 = torch.int32
BAD_CONTIGUOUS = [
    ({"cache_seqlens": torch.tensor([3.0, 5.0])}, TypeError,
     "cache_seqlens must have dtype int32 or int64, got torch.float32"),
    ({"cache_seqlens": torch.tensor([3, 5, 1], dtype=I32)}, ValueError,
     "cache_seqlens must have shape (B,) = (2,), got (3)"),
    ({"cache_seqlens": torch.tensor([[3, 5]], dtype=I32)}, ValueError,
     "cache_seqlens must be 1-D"),
    ({"cache_seqlens": 3}, TypeError, "cache_seqlens must be a torch.Tensor"),
    ({"cache_seqlens": torch.tensor([3, -1], dtype=I32)}, ValueError,
     "cache_seqlens must be >= 0, got cache_seqlens[1] = -1"),
    ({"cache_seqlens": torch.tensor([3, 16], dtype=I32)}, ValueError,
     "cache_seqlens[1] = 16 + 1 new keys is beyond the cache: sequence 1 may hold at most "
     "k_cache's Nmax = 16 keys"),
    ({"cache_seqlens": torch.tensor([17, 0], dtype=I32), "k_new": None, "v_new": None},
     ValueError, "cache_seqlens[0] = 17 is beyond the cache"),
    ({"v_new": None}, ValueError, "k_new was given without v_new: append both or neither"),
    ({"k_new": None}, ValueError, "v_new was given without k_new"),
    ({"k_new": torch.randn(2, 2, 1, 4)}, ValueError,
     "k_new must have shape (B, Hkv, Nnew, D) = (2, 2, Nnew, 8), got (2, 2, 1, 4)"),
    ({"v_new": torch.randn(2, 2, 2, 8)}, ValueError,
     "k_new and v_new must have the same Nnew, got 1 and 2"),
    ({"k_new": torch.randn(2, 2, 1, 8, dtype=torch.float64)}, TypeError,
     "k_new has dtype torch.float64 but query has torch.float32"),
    ({"query": torch.randn(2, 4, 8)}, ValueError, "query must be 4-D (B, Hq, Nq, D)"),
    ({"query": torch.randn(3, 4, 1, 8)}, ValueError, "batch sizes differ"),
    ({"query": torch.randn(2, 3, 1, 8)}, ValueError,
     "query heads Hq=3 must be a multiple of key/value heads Hkv=2"),
    ({"v_cache": torch.randn(2, 2, 8, 8)}, ValueError,
     "k_cache and v_cache must have the same (B, Hkv, Nmax)"),
    ({"k_cache": torch.randn(2, 2, 16, 8, dtype=torch.float16)}, TypeError,
     "k_cache has dtype torch.float16 but query has torch.float32"),
    ({"k_cache": torch.randn(2, 2, 16, 8).requires_grad_()}, ValueError,
     "k_cache is a leaf tensor that requires grad"),
    ({"causal": "yes"}, TypeError, "causal must be a bool, got str"),
    ({"scale": float("nan")}, ValueError, "scale must be finite"),
]  # fmt: skip
BAD_PAGED = [
    ({"block_table": torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int64)},
     TypeError, "block_table must have dtype int32, got torch.int64"),
    ({"block_table": torch.tensor([0, 1, 2, 3], dtype=I32)}, ValueError,
     "block_table must be 2-D"),
    ({"block_table": torch.tensor([[0, 1, 2, 3]], dtype=I32)}, ValueError,
     "block_table must have shape (B, pages_per_seq) with B = 2, got (1, 4)"),
    # sequence 1 holds 5 + 1 keys: pages 0 and 1 of its row are in use, -1 after them is not
    ({"block_table": torch.tensor([[0, 1, 2, 3], [4, 9, -1, -1]], dtype=I32)}, ValueError,
     "block_table[1, 1] = 9 is not a page of k_cache (0 <= page < num_pages = 9); "
     "sequence 1 uses that entry"),
    ({"block_table": torch.tensor([[-3, 1, 2, 3], [4, 5, 6, 7]], dtype=I32)}, ValueError,
     "block_table[0, 0] = -3 is not a page of k_cache"),
    ({"cache_seqlens": torch.tensor([3, 16], dtype=I32)}, ValueError,
     "cache_seqlens[1] = 16 + 1 new keys is beyond the cache: sequence 1 may hold at most "
     "pages_per_seq * page_size = 4 * 4 keys"),
    ({"v_cache": torch.randn(9, 2, 2, 8)}, ValueError,
     "k_cache and v_cache must have the same (num_pages, page_size, Hkv)"),
    ({"k_cache": torch.randn(9, 0, 2, 8), "v_cache": torch.randn(9, 0, 2, 8)}, ValueError,
     "k_cache page_size must be >= 1"),
    ({"k_cache": torch.randn(36, 2, 8), "v_cache": torch.randn(36, 2, 8)}, ValueError,
     "k_cache must be 4-D (num_pages, page_size, Hkv, D)"),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "error", "message"), BAD_CONTIGUOUS)
def test_bad_input_names_the_argument(changes, error, message):
    with pytest.raises(error) as info:
        _call(**changes)
    assert message in str(info.value)


@pytest.mark.parametrize(("changes", "error", "message"), BAD_PAGED)
def test_bad_paged_input_names_the_argument(changes, error, message):
    with pytest.raises(error) as info:
        _call(paged=True, **changes)
    assert message in str(info.value)


def test_bad_input_or_no_backend_writes_nothing():
    setup = Setup([3, 5], 1, 1, seed=0)
    before = setup.k_cache.clone(), setup.v_cache.clone()
    with pytest.raises(ValueError, match="beyond the cache"):
        attnhub.attention_kvcache(
            setup.query, setup.k_cache, setup.v_cache, torch.tensor([3, 16], dtype=I32),
            k_new=setup.k_new, v_new=setup.v_new,
        )  # fmt: skip
    with pytest.raises(attnhub.NoBackendError, match="kvcache layout is not supported"):
        setup.call(False, backend="torch_sdpa")
    assert torch.equal(setup.k_cache, before[0]) and torch.equal(setup.v_cache, before[1])


# -- explain -------------------------------------------------------------------------


def test_explain_kvcache_says_the_layout_and_writes_nothing():
    setup = Setup([3, 5], 2, 2, seed=0)
    before = setup.k_pages.clone()
    decision = attnhub.explain_kvcache(
        setup.query, setup.k_pages, setup.v_pages, setup.cache_seqlens,
        block_table=setup.block_table, k_new=setup.k_new, v_new=setup.v_new, causal=True,
    )  # fmt: skip
    assert torch.equal(setup.k_pages, before)
    first = str(decision).splitlines()[0]
    assert first == (
        "attention(paged (page_size 4): q=(2,4,~2,8) k/v=(2,2,~16,8/8) Nq<Nk float32 cpu, "
        "causal (bottom_right))"
    )
    assert decision.chosen == "torch_reference"
    assert decision.reasons()["torch_sdpa"] == ["paged layout is not supported (layouts: dense)"]
    request = decision.request
    assert (request.layout, request.page_size, request.batch) == ("paged", 4, 2)
    contiguous = attnhub.explain_kvcache(
        setup.query, setup.k_cache, setup.v_cache, setup.cache_seqlens
    ).request
    assert (contiguous.layout, contiguous.page_size) == ("kvcache", None)


# -- GPU (the lead runs these on the H200) ---------------------------------------------

GPU_OPTIONS: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"window": (256, 0)},
    {"softcap": 50.0},
    {"causal": True, "window": (100, 0), "softcap": 30.0},
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["kvcache", "paged"])
@pytest.mark.parametrize(
    "backend", sorted(set(_backends("kvcache", "cuda")) | set(_backends("paged", "cuda")))
)
@pytest.mark.parametrize(("nq", "new", "page_size"), [(1, 1, 16), (4, 4, 256), (1, 0, 64)])
@pytest.mark.parametrize("options", GPU_OPTIONS, ids=lambda o: ",".join(map(str, o)) or "plain")
def test_gpu_bf16_matches_a_loop_of_dense_calls(layout, backend, nq, new, page_size, options):
    pages_per_seq = max(1, 1024 // page_size)
    setup = Setup(
        [0, 700, 1023 - new, 3, 512], nq, new, hq=32, hkv=8, d=128, page_size=page_size,
        pages_per_seq=pages_per_seq, dtype=torch.bfloat16, device="cuda", seed=nq,
    )  # fmt: skip
    paged = layout == "paged"
    _skip_unless_chosen(setup, backend, paged, options)
    _check(_problems(setup, backend, paged, options))


# -- check_indices=False -----------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_unchecked_indices_read_nothing_and_give_the_same_answer(paged, monkeypatch):
    checked = Setup(SEQLENS, 2, 1, seed=4).call(paged, causal=True, return_lse=True)
    setup = Setup(SEQLENS, 2, 1, seed=4)
    from attnhub import serving_validation

    def no_read(*args: Any) -> Any:
        raise AssertionError("the index values were read")

    monkeypatch.setattr(serving_validation, "_kvcache_values", no_read)
    unchecked = setup.call(paged, causal=True, return_lse=True, check_indices=False)
    for a, b in zip(checked, unchecked):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    k, v = (setup.k_pages, setup.v_pages) if paged else (setup.k_cache, setup.v_cache)
    request = attnhub.explain_kvcache(
        setup.query, k, v, setup.cache_seqlens, block_table=setup.block_table if paged else None,
        check_indices=False,
    ).request  # fmt: skip
    assert (request.same_seqlen, request.q_longer) == (False, True)  # unknown: assumed


def test_check_indices_must_be_a_bool():
    with pytest.raises(TypeError, match="check_indices must be a bool, got int"):
        _call(check_indices=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_unchecked_decoding_step_is_captured_in_a_cuda_graph(paged):
    """check_indices=False reads nothing from the device: a decoding step (append and
    attention) captures in a CUDA graph and replays with new inputs as eager runs it."""
    setup = Setup(
        [100, 700, 5], 1, 1, hq=32, hkv=8, d=128, page_size=16, pages_per_seq=64,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    k, v = (setup.k_pages, setup.v_pages) if paged else (setup.k_cache, setup.v_cache)
    table = setup.block_table if paged else None

    def step() -> torch.Tensor:
        return attnhub.attention_kvcache(
            setup.query, k, v, setup.cache_seqlens, block_table=table, k_new=setup.k_new,
            v_new=setup.v_new, causal=True, check_indices=False,
        )  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and decides outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (setup.query, setup.k_new, setup.v_new):
        t.copy_(torch.randn_like(t))
    graph.replay()
    expected = step()  # the same append again, then attention eagerly
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)


def test_unchecked_calls_seen_before_skip_validation_and_dispatch(monkeypatch):
    from attnhub import serving, serving_validation

    setup = Setup(SEQLENS, 1, 1, seed=6)
    expected = setup.call(False, causal=True, check_indices=False)  # decided and cached
    calls = []
    real = serving_validation.check_kvcache

    def counting(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(serving, "check_kvcache", counting)
    again = Setup(SEQLENS, 1, 1, seed=6)
    torch.testing.assert_close(again.call(False, causal=True, check_indices=False), expected)
    assert calls == []  # the same metadata, options and selection: straight to the backend
    # Anything validation or the decision reads is in the key: each of these is new.
    again.call(False, causal=False, check_indices=False)
    again.call(False, causal=True, check_indices=False, scale=0.25)
    again.call(True, causal=True, check_indices=False)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="scale must be finite"):
        again.call(False, causal=True, check_indices=False, scale=float("nan"))
    with attnhub.use_backend(strict=True), pytest.raises(attnhub.NoBackendError):
        again.call(False, causal=True, check_indices=False)  # a fallback, refused
    attnhub.dispatch.clear_cache()  # a registry or policy change forgets every decision
    again.call(False, causal=True, check_indices=False)
    assert len(calls) == 6


@pytest.mark.parametrize("backend", sorted(set(_backends("kvcache", "cpu"))))
def test_strided_query_and_cache_views_give_the_contiguous_answer(backend):
    """Transposed views, as a (B, N, H, D) model layout hands them over: the append
    writes through the view, attention reads through the strides."""
    base = Setup([4, 9, 0], 3, 2, d=16, seed=9)
    expected = base.call(False, causal=True, backend=backend)

    def strided(t: torch.Tensor) -> torch.Tensor:  # same values, (B, N, H, D) storage
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    view = Setup([4, 9, 0], 3, 2, d=16, seed=9)
    view.query, view.k_cache, view.v_cache = (
        strided(t) for t in (view.query, view.k_cache, view.v_cache)
    )
    view.k_new, view.v_new = strided(view.k_new), strided(view.v_new)
    got = view.call(False, causal=True, backend=backend)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(view.k_cache, base.k_cache, rtol=0, atol=0)


def _serving_plugin(name: str, broken: Any) -> Any:
    """A third-party KV-cache backend (this test module's class, ranked first) whose
    forward_kvcache computes with torch_reference, then hands ``broken(out, lse,
    k_cache)`` back."""
    from attnhub.backends.torch_reference import TorchReference

    def forward_kvcache(self, query, k_cache, v_cache, seqlens_k, block_table, params):  # type: ignore[no-untyped-def]
        self.calls += 1
        result = TorchReference.forward_kvcache(
            self, query, k_cache, v_cache, seqlens_k, block_table, params
        )
        out, lse = result if params.return_lse else (result, None)
        return broken(out, lse, k_cache)

    attributes = {"name": name, "priority": 1000, "calls": 0, "forward_kvcache": forward_kvcache}
    return type("Plugin", (TorchReference,), attributes)()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_a_plugin_returning_the_wrong_output_is_disabled_and_the_step_served_once(
    monkeypatch, paged
):
    """The step is served again by the next backend, and the new keys are appended once."""
    registry = attnhub.get_registry()
    plugin = _serving_plugin("kv_wrong_shape", lambda out, lse, k_cache: out[..., :1])
    registry.add(plugin)
    try:
        setup = Setup([0, 9, 3], 2, 3, seed=5)
        expected_k, _ = setup.expected_caches()
        out = setup.call(paged)
        assert plugin.calls == 1
        assert "forward returned an output of shape" in (
            registry.unavailable_reason(plugin.name) or ""
        )
        reference, _ = setup.oracle({}, float64=False)
        torch.testing.assert_close(out, reference)
        if not paged:
            assert torch.equal(setup.k_cache, expected_k)  # appended once
    finally:
        registry.remove(plugin.name)


def test_a_plugin_writing_into_the_cache_is_stopped():
    registry = attnhub.get_registry()

    def scribble(out, lse, k_cache):  # type: ignore[no-untyped-def]
        k_cache.zero_()
        return out

    plugin = _serving_plugin("kv_scribbles", scribble)
    registry.add(plugin)
    try:
        setup = Setup([4, 2], 1, 0, seed=6)
        with pytest.raises(attnhub.BrokenBackendError, match="changed its inputs in place"):
            setup.call(False)
        assert registry.unavailable_reason(plugin.name) is not None
    finally:
        registry.remove(plugin.name)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_an_unchecked_call_under_torch_compile_gives_the_eager_answer(paged):
    """contract.md: torch.compile breaks the graph inside attention_kvcache (its decision
    runs eagerly), and the compiled step computes and appends what the eager one does.
    Dynamo raised an internal error at the call's count of its backend (failed before)."""
    results = []
    for compiled in (False, True):
        setup = Setup([3, 9], 2, 1, seed=6)

        def step(query: torch.Tensor, setup: Setup = setup) -> torch.Tensor:
            out = setup.call(paged, causal=True, check_indices=False)
            return out * 2 + query

        run = torch.compile(step, backend="aot_eager") if compiled else step
        out = run(setup.query)
        cache = (setup.k_pages, setup.v_pages) if paged else (setup.k_cache, setup.v_cache)
        results.append([out, *cache])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    with pytest.raises(Unsupported):  # fullgraph: no graph break allowed
        setup = Setup([3, 9], 2, 1, seed=6)
        torch.compile(lambda q: setup.call(paged, check_indices=False) + q, fullgraph=True)(
            setup.query
        )
