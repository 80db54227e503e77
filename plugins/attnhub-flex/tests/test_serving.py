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
