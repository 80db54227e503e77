"""block_sparse=layout on flex_attention: exact against the float64 reference with the
layout's dense mask, alone and combined with causal, window and masks; the BlockMask
lists mean what the layout means (the CUDA kernel's reading, checked on CPU); reused
layouts reuse their BlockMask."""

from __future__ import annotations

import attnhub_flex
import pytest
import torch

import attnhub
from attnhub import BlockSparseLayout

ATOL = 2e-5


def _qkv(b, hq, hkv, nq, nk, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=gen)
    k = torch.randn(b, hkv, nk, d, generator=gen)
    v = torch.randn(b, hkv, nk, d, generator=gen)
    return q, k, v


def _random_layout(nq, nk, block, density, *, bh=(1, 1), partial=True, seed=0):
    """Random kept blocks; with ``partial``, some kept blocks partial under a token mod."""
    gen = torch.Generator().manual_seed(seed)
    bq, bk = block
    shape = (*bh, -(-nq // bq), -(-nk // bk))
    kept = torch.rand(shape, generator=gen) < density
    if not partial:
        return BlockSparseLayout.from_block_mask(kept, block)
    full = kept & (torch.rand(shape, generator=gen) < 0.5)

    def mod(b, h, q, k):
        return (q * 7 + k * 3 + h) % 5 != 0

    return BlockSparseLayout(kept, block, full, mod)


def _check(q, k, v, layout, attn_mask=None, **options):
    nq, nk = q.shape[2], k.shape[2]
    dense = layout.to_dense_mask(nq, nk)
    if attn_mask is None:
        ref_mask = dense
    elif attn_mask.dtype == torch.bool:
        ref_mask = dense & attn_mask
    else:
        ref_mask = attn_mask.double().masked_fill(~dense, float("-inf"))
    out, lse = attnhub.attention(
        q, k, v, attn_mask, block_sparse=layout, return_lse=True, backend="flex_attention",
        **options,
    )  # fmt: skip
    ref, ref_lse = attnhub.attention(
        q.double(), k.double(), v.double(), ref_mask, return_lse=True,
        backend="torch_reference", **options,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=ATOL, rtol=0)
    return out, lse


def test_declared() -> None:
    registry = attnhub.get_registry()
    assert "block_sparse" in registry.get("flex_attention").capabilities()["features"]


@pytest.mark.parametrize("density", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("partial", [False, True], ids=["full-only", "partial"])
def test_random_layouts(density: float, partial: bool) -> None:
    q, k, v = _qkv(2, 4, 2, 96, 128, seed=int(density * 100))
    layout = _random_layout(96, 128, (16, 32), density, bh=(1, 4), partial=partial)
    _check(q, k, v, layout)


def test_empty_query_block_row_gives_zeros_and_minus_inf() -> None:
    q, k, v = _qkv(1, 2, 2, 64, 64)
    kept = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    kept[..., 1, :] = False
    layout = BlockSparseLayout.from_block_mask(kept, 16)
    out, lse = _check(q, k, v, layout)
    assert (out[:, :, 16:32] == 0).all()
    assert (lse[:, :, 16:32] == float("-inf")).all()


def test_ragged_lengths() -> None:
    q, k, v = _qkv(2, 2, 2, 70, 100, seed=1)
    _check(q, k, v, _random_layout(70, 100, (16, 32), 0.5, bh=(2, 1), seed=1))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"causal": True, "alignment": "bottom_right"},
        {"window": (9, 3)},
        {"causal": True, "window": (20, None), "softcap": 3.0},
    ],
    ids=["alone", "causal", "causal-br", "window", "causal-window-softcap"],
)
@pytest.mark.parametrize("pattern", ["causal", "sliding", "random"])
def test_patterns_with_masks(pattern: str, options: dict) -> None:
    n = 75  # ragged against the 16-token blocks
    if pattern == "causal":
        layout = BlockSparseLayout.causal(n, 16)
    elif pattern == "sliding":
        layout = BlockSparseLayout.sliding_window(n, 21, 16, causal=False)
    else:
        layout = _random_layout(n, n, (16, 16), 0.6, seed=4)
    q, k, v = _qkv(2, 4, 1, n, n, seed=2)
    _check(q, k, v, layout, **options)


def test_nonsquare_with_causal_alignments_and_bool_mask() -> None:
    q, k, v = _qkv(2, 2, 2, 40, 90, seed=5)
    mod = lambda b, h, q, k: (k - q) % 3 != 1  # noqa: E731
    layout = BlockSparseLayout.from_mask_mod(mod, 40, 90, (16, 32))
    gen = torch.Generator().manual_seed(6)
    bool_mask = torch.rand(2, 1, 40, 90, generator=gen) < 0.7
    float_mask = torch.randn(1, 2, 40, 90, generator=gen)
    for alignment in ("top_left", "bottom_right"):
        _check(q, k, v, layout, bool_mask, causal=True, alignment=alignment)
        _check(q, k, v, layout, float_mask, causal=True, alignment=alignment, softcap=2.0)


def test_a_structure_mask_is_built_once_per_signature() -> None:
    """Causal and window calls without a bool mask share one BlockMask per (Nq, Nk,
    device, causal, offset, window, B, Hq): not rebuilt for a float mask (score_mod's),
    rebuilt for another batch or head count, window or alignment; the answers match the
    float64 reference whichever call built the mask."""
    from attnhub.backends.torch_reference import reference_attention

    attnhub_flex._structure_masks.clear()
    q, k, v = _qkv(2, 4, 2, 48, 80)
    calls = [
        (q, k, v, {"causal": True}),
        (q, k, v, {"causal": True, "attn_mask": torch.randn(2, 1, 48, 80)}),
        (q[:1, :2], k[:1, :1], v[:1, :1], {"causal": True}),  # another B and Hq: built
    ]
    built = attnhub_flex.block_mask_builds
    for qq, kk, vv, options in calls:
        got = attnhub.attention(qq, kk, vv, backend="flex_attention", **options)
        mask = options.pop("attn_mask", None)
        want, _ = reference_attention(
            *(t.double() for t in (qq, kk, vv)),
            None if mask is None else mask.double(),
            attnhub.AttentionParams(**options, scale=qq.shape[-1] ** -0.5),
        )
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    assert attnhub_flex.block_mask_builds == built + 2
    attnhub.attention(q, k, v, causal=True, window=(9, None), backend="flex_attention")
    attnhub.attention(q, k, v, causal=True, alignment="bottom_right", backend="flex_attention")
    assert attnhub_flex.block_mask_builds == built + 4


def test_reused_layout_reuses_its_block_mask() -> None:
    q, k, v = _qkv(1, 2, 2, 64, 64)
    layout = BlockSparseLayout.sliding_window(64, 10, 16)
    attnhub.attention(q, k, v, block_sparse=layout, backend="flex_attention")
    built = attnhub_flex.block_mask_builds
    cached = dict(attnhub_flex._block_masks[layout])
    attnhub.attention(q, k, v, block_sparse=layout, backend="flex_attention")
    attnhub.attention(q * 2, k, v, block_sparse=layout, backend="flex_attention")
    attnhub.api.clear_call_cache()  # a fresh dispatch still finds the layout's BlockMask
    attnhub.attention(q, k, v, block_sparse=layout, backend="flex_attention")
    assert attnhub_flex.block_mask_builds == built
    assert attnhub_flex._block_masks[layout] == cached
    # Another mask signature is another BlockMask, built once.
    attnhub.attention(q, k, v, block_sparse=layout, causal=True, backend="flex_attention")
    attnhub.attention(q, k, v, block_sparse=layout, causal=True, backend="flex_attention")
    assert attnhub_flex.block_mask_builds == built + 1
    # The cache does not keep a layout alive.
    del layout
    import gc

    gc.collect()
    assert all(len(v) for v in attnhub_flex._block_masks.values())


def test_cpu_backward_is_refused_honestly() -> None:
    q = torch.randn(1, 2, 32, 16, requires_grad=True)
    layout = BlockSparseLayout.causal(32, 16)
    with pytest.raises(attnhub.NoBackendError) as info:
        attnhub.attention(q, q, q, block_sparse=layout, backend="flex_attention")
    assert any("no backward on CPU" in why for why in info.value.reasons["flex_attention"])


# -- the BlockMask as the CUDA kernel reads it -------------------------------------------


def _kernel_reading(block_mask, b, h, nq, nk) -> torch.Tensor:
    """The token mask the Triton kernel computes from a BlockMask: partial blocks through
    mask_mod, full blocks kept whole, unlisted blocks skipped, the ragged edge cut."""
    bq, bk = block_mask.BLOCK_SIZE
    nqb = block_mask.kv_num_blocks.shape[-1]
    out = torch.zeros(b, h, nqb * bq, block_mask.kv_indices.shape[-1] * bk, dtype=torch.bool)
    bi = torch.arange(b).view(-1, 1, 1, 1)
    hi = torch.arange(h).view(1, -1, 1, 1)
    qi = torch.arange(out.shape[2]).view(1, 1, -1, 1)
    ki = torch.arange(out.shape[3]).view(1, 1, 1, -1)
    mod = block_mask.mask_mod(bi, hi, qi.clamp(max=nq - 1), ki.clamp(max=nk - 1))
    mod = mod.expand(out.shape)

    def expand(t):
        return t.expand(b, h, *t.shape[2:])

    lists = [
        (block_mask.kv_num_blocks, block_mask.kv_indices, False),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True),
    ]
    for num, idx, full in lists:
        num, idx = expand(num), expand(idx)
        for bb in range(b):
            for hh in range(h):
                for row in range(nqb):
                    for col in idx[bb, hh, row, : num[bb, hh, row]].tolist():
                        rs, cs = slice(row * bq, (row + 1) * bq), slice(col * bk, (col + 1) * bk)
                        out[bb, hh, rs, cs] = True if full else mod[bb, hh, rs, cs]
    return out[..., :nq, :nk]


@pytest.mark.parametrize(
    ("block", "sparse_block"),
    [((16, 32), (16, 32)), ((32, 64), (128, 128)), ((64, 128), (128, 128))],
    ids=["native", "coarsened", "coarsened-q"],
)
@pytest.mark.parametrize("with_masks", [False, True], ids=["layout", "layout+masks"])
def test_block_lists_mean_the_layout(block, sparse_block, with_masks) -> None:
    nq, nk = 150, 300
    layout = _random_layout(nq, nk, block, 0.5, bh=(1, 2), seed=7)
    q, k, _ = _qkv(2, 2, 2, nq, nk)
    gen = torch.Generator().manual_seed(8)
    attn_mask = torch.rand(2, 1, nq, nk, generator=gen) < 0.8 if with_masks else None
    options = {"causal": True, "alignment": "bottom_right"} if with_masks else {}
    params = attnhub.AttentionParams(**options, block_sparse=layout)
    other_mod, _ = attnhub_flex._mods(q, k, attn_mask, params)
    bh = (2, 1) if with_masks else (1, 1)
    bm = attnhub_flex._build_layout_block_mask(
        layout, nq, nk, other_mod, bh, q.device, sparse_block
    )
    assert tuple(bm.BLOCK_SIZE) == tuple(sparse_block)
    expected = layout.to_dense_mask(nq, nk).expand(2, 2, nq, nk)
    if with_masks:
        qi = torch.arange(nq).view(-1, 1)
        ki = torch.arange(nk).view(1, -1)
        expected = expected & attn_mask & (ki <= qi + nk - nq)
    torch.testing.assert_close(_kernel_reading(bm, 2, 2, nq, nk), expected)


def test_sparse_block_sizes_for_cuda() -> None:
    layout = _random_layout(512, 512, (256, 64), 0.5)
    assert attnhub_flex._sparse_block(layout, "cuda") == (256, 128)
    assert attnhub_flex._sparse_block(layout, "cpu") == (256, 64)
    assert min(attnhub_flex._sparse_block(_random_layout(96, 96, (48, 48), 0.5), "cuda")) < 1
