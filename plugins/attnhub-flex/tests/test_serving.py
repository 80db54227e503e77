"""flex_attention serves attention_varlen (document masks) and attention_kvcache (contiguous
and paged caches through mask_mod), held to torch_reference in float64 (which
attnhub's tests/test_varlen.py and tests/test_kvcache.py hold to a per-sequence loop of
the dense call). CPU: FlexAttention's eager path, forward only."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from attnhub_flex import FlexAttention

import attnhub


@pytest.fixture(autouse=True, scope="module")
def _registered():
    # Installed, the entry point registers it; from a source checkout (PYTHONPATH=src),
    # registered here for the module.
    registry = attnhub.get_registry()
    added = "flex_attention" not in registry
    if added:
        registry.add(FlexAttention())
    yield
    if added:
        registry.remove("flex_attention")


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _close(got: Any, ref: Any) -> None:
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r.double(), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("lengths", "options"),
    [
        (([5, 0, 9, 3], [5, 0, 9, 3]), {"causal": True}),
        (([5, 2, 9, 3], [7, 0, 4, 3]), {}),
        (([5, 2, 9, 3], [7, 0, 4, 3]), {"causal": True, "alignment": "bottom_right"}),
        (([5, 2, 9, 3], [7, 3, 4, 3]), {"causal": True}),  # top-left on unequal lengths
        (([4, 6], [8, 6]), {"window": (2, 1), "softcap": 2.0, "alignment": "bottom_right"}),
    ],
)
def test_varlen_matches_the_reference(lengths, options):
    lq, lk = lengths
    g = torch.Generator().manual_seed(sum(lq))
    q = torch.randn(sum(lq), 4, 16, generator=g)
    k = torch.randn(sum(lk), 2, 16, generator=g)
    v = torch.randn(sum(lk), 2, 16, generator=g)
    cu_q, cu_k = _cu(lq), _cu(lk)
    got = attnhub.attention_varlen(
        q, k, v, cu_q, cu_k, return_lse=True, backend="flex_attention", **options
    )
    ref = attnhub.attention_varlen(
        q.double(), k.double(), v.double(), cu_q, cu_k, return_lse=True,
        backend="torch_reference", **options,
    )  # fmt: skip
    _close(got, ref)


@pytest.mark.parametrize("page_size", [None, 4, 16])
@pytest.mark.parametrize(
    ("nq", "new", "options"),
    [
        (1, 1, {}),
        (3, 3, {"causal": True}),
        (2, 0, {"causal": True, "window": (4, 0), "softcap": 3.0}),
        (2, 1, {"window": (1, 1)}),
    ],
)
def test_kvcache_matches_the_reference(page_size, nq, new, options):
    g = torch.Generator().manual_seed(nq + new)
    b, hq, hkv, d, per_seq = 3, 4, 2, 16, 3
    nmax = per_seq * (page_size or 8)
    seqlens = torch.tensor([0, nmax - new, 5], dtype=torch.int32)
    q = torch.randn(b, hq, nq, d, generator=g)
    k_new = torch.randn(b, hkv, new, d, generator=g) if new else None
    v_new = torch.randn(b, hkv, new, d, generator=g) if new else None
    if page_size is None:
        k_cache = torch.randn(b, hkv, nmax, d, generator=g)
        v_cache = torch.randn(b, hkv, nmax, d, generator=g)
        table = None
    else:
        pages = b * per_seq + 2
        k_cache = torch.randn(pages, page_size, hkv, d, generator=g)
        v_cache = torch.randn(pages, page_size, hkv, d, generator=g)
        table = torch.randperm(pages, generator=g)[: b * per_seq].view(b, per_seq).int()
        table[0, 1:] = -1  # sequence 0 (at most Nnew keys) uses its first entry at most

    def call(backend: str, dtype: torch.dtype) -> Any:
        caches = (k_cache.clone().to(dtype), v_cache.clone().to(dtype))
        new_kv = {} if not new else {"k_new": k_new.to(dtype), "v_new": v_new.to(dtype)}
        return attnhub.attention_kvcache(
            q.to(dtype), *caches, seqlens, block_table=table, return_lse=True,
            backend=backend, **new_kv, **options,
        )  # fmt: skip

    _close(call("flex_attention", torch.float32), call("torch_reference", torch.float64))


def test_serving_layouts_are_declared():
    backend = attnhub.get_registry().get("flex_attention")
    assert backend.layouts == frozenset({"dense", "varlen", "kvcache", "paged"})


@pytest.mark.parametrize("page_size", [None, 4])
def test_kvcache_ignores_what_slots_no_key_occupies_hold(page_size):
    """Slots at or beyond a sequence's length, and pages no sequence uses, may hold
    anything (the contract): NaN and Inf there (a cache from torch.empty, a page freed
    by an earlier sequence) leave the answer as it is with zeros there. Before, the
    masked (zero) weights times a NaN value made every row NaN."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, nmax = 2, 4, 2, 16, 12
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    q = torch.randn(b, hq, 2, d, generator=g)
    k, v = (torch.randn(b, hkv, nmax, d, generator=g) for _ in range(2))
    used = torch.arange(nmax)[None, None, :, None] < seqlens[:, None, None, None].long()
    clean = [t.masked_fill(~used, 0.0) for t in (k, v)]
    dirty = [t.masked_fill(~used, bad) for t, bad in zip((k, v), (float("inf"), float("nan")))]
    table = None
    if page_size is not None:  # the same keys in pages, one spare page full of NaN
        per_seq = nmax // page_size
        order = torch.randperm(b * per_seq + 1, generator=g)
        table = order[: b * per_seq].view(b, per_seq).int()

        def paged(t: torch.Tensor, spare: float) -> torch.Tensor:
            pool = torch.full((b * per_seq + 1, page_size, hkv, d), spare)
            logical = t.transpose(1, 2).reshape(b, per_seq, page_size, hkv, d)
            pool[table.long()] = logical
            return pool

        clean = [paged(t, 0.0) for t in clean]
        dirty = [paged(t, float("nan")) for t in dirty]
    got = attnhub.attention_kvcache(q, *dirty, seqlens, block_table=table, causal=True,
                                    return_lse=True, backend="flex_attention")  # fmt: skip
    want = attnhub.attention_kvcache(q, *clean, seqlens, block_table=table, causal=True,
                                     return_lse=True, backend="torch_reference")  # fmt: skip
    assert torch.isfinite(got[0]).all()
    _close(got, want)


def test_a_page_named_twice_in_one_table_is_read_twice():
    """Position p reads page block_table[b, p // page_size], also where the table names
    one page at two positions (the inverse table used before kept one of them)."""
    g = torch.Generator().manual_seed(3)
    kp, vp = (torch.randn(3, 4, 2, 16, generator=g) for _ in range(2))
    q = torch.randn(1, 4, 1, 16, generator=g)
    table = torch.tensor([[1, 1, 2]], dtype=torch.int32)
    seqlens = torch.tensor([10], dtype=torch.int32)
    got = attnhub.attention_kvcache(q, kp, vp, seqlens, block_table=table, return_lse=True,
                                    backend="flex_attention")  # fmt: skip
    contiguous = [t[table[0].long()].reshape(1, 12, 2, 16).transpose(1, 2) for t in (kp, vp)]
    want = attnhub.attention_kvcache(q, *contiguous, seqlens, return_lse=True,
                                     backend="torch_reference")  # fmt: skip
    _close(got, want)
