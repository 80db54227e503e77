"""Block-sparse layouts: builders against hand-made masks, index lists, semantics."""

from __future__ import annotations

import pytest
import torch

import attnhub
from attnhub import BlockSparseLayout


def blocks_of(dense: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Which (bq, bk) tiles of a token mask hold any kept pair (hand-made reduction)."""
    nq, nk = dense.shape
    rows = -(-nq // bq)
    cols = -(-nk // bk)
    out = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = dense[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    return out


def test_from_block_mask_means_every_token_of_kept_blocks():
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool).view(1, 1, 2, 3)
    layout = BlockSparseLayout.from_block_mask(mask, (4, 3))
    dense = layout.to_dense_mask(7, 8)
    expected = torch.zeros(7, 8, dtype=torch.bool)
    expected[:4, :3] = True
    expected[:4, 6:8] = True
    assert torch.equal(dense[0, 0], expected)
    assert layout.density == pytest.approx(2 / 6)
    assert "density=0.333" in repr(layout) and "kept=2 blocks (0 partial)" in repr(layout)


@pytest.mark.parametrize("n, block", [(300, 64), (256, 64), (65, (16, 32))])
def test_causal_layout_is_the_lower_triangle_with_partial_diagonal_blocks(n, block):
    layout = BlockSparseLayout.causal(n, block)
    dense = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(layout.to_dense_mask(n, n)[0, 0], dense)
    bq, bk = (block, block) if isinstance(block, int) else block
    assert torch.equal(layout.block_mask[0, 0], blocks_of(dense, bq, bk))


def test_sliding_window_layout_matches_the_token_rule():
    n, w = 200, 37
    layout = BlockSparseLayout.sliding_window(n, w, 32)
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    dense = (j <= i) & (i - j <= w)
    assert torch.equal(layout.to_dense_mask(n, n)[0, 0], dense)
    assert torch.equal(layout.block_mask[0, 0], blocks_of(dense, 32, 32))


def test_strided_and_bigbird_layouts_match_hand_made_block_masks():
    strided = BlockSparseLayout.strided(512, 64, local_blocks=2, stride=3, causal=False)
    qb = torch.arange(8).view(-1, 1)
    kb = torch.arange(8).view(1, -1)
    expected = ((qb - kb).abs() < 2) | ((kb + 1) % 3 == 0)
    assert torch.equal(strided.block_mask[0, 0], expected)
    big = BlockSparseLayout.bigbird(1024, 128, global_blocks=1, window_blocks=3, random_blocks=0)
    expected = ((qb - kb).abs() <= 1) | (qb < 1) | (kb < 1)
    assert torch.equal(big.block_mask[0, 0], expected)
    with_random = BlockSparseLayout.bigbird(1024, 128, random_blocks=2, seed=3)
    assert (with_random.block_mask[0, 0] & ~expected).sum(-1).le(2).all()
    assert torch.equal(
        with_random.block_mask,
        BlockSparseLayout.bigbird(1024, 128, random_blocks=2, seed=3).block_mask,
    )


def test_from_mask_mod_keeps_token_masking_inside_partial_blocks():
    def mod(b, h, q, kv):  # type: ignore[no-untyped-def]
        return (q + kv + h) % 3 == 0

    layout = BlockSparseLayout.from_mask_mod(mod, 40, 24, 16, heads=2)
    q = torch.arange(40).view(1, 1, -1, 1)
    kv = torch.arange(24).view(1, 1, 1, -1)
    h = torch.arange(2).view(1, -1, 1, 1)
    assert torch.equal(layout.to_dense_mask(40, 24), ((q + kv + h) % 3 == 0).expand(1, 2, 40, 24))


def test_token_mask_mod_means_the_dense_mask():
    torch.manual_seed(3)
    layouts = [
        BlockSparseLayout.from_block_mask(torch.rand(2, 3, 4, 3) < 0.5, (32, 48)),
        BlockSparseLayout.causal(100, 32),
        BlockSparseLayout.sliding_window(130, 40, 32, causal=False),
    ]
    for layout in layouts:
        nq = layout.seq_lens[0] if layout.seq_lens else layout.shape[2] * layout.block_size[0]
        nk = layout.seq_lens[1] if layout.seq_lens else layout.shape[3] * layout.block_size[1]
        b = torch.arange(2).view(-1, 1, 1, 1)
        h = torch.arange(3).view(1, -1, 1, 1)
        q = torch.arange(nq).view(1, 1, -1, 1)
        kv = torch.arange(nk).view(1, 1, 1, -1)
        got = layout.token_mask_mod()(b, h, q, kv)
        want = layout.to_dense_mask(nq, nk).expand(2, 3, nq, nk)
        assert torch.equal(got.expand(2, 3, nq, nk), want)


def test_index_lists_name_the_kept_blocks_in_order():
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool).view(1, 1, 3, 3)
    layout = BlockSparseLayout.from_block_mask(mask, 16)
    kv = layout.index("kv")
    assert kv.num.tolist() == [[[2, 0, 3]]]
    assert kv.indices[0, 0, 0, :2].tolist() == [0, 2] and kv.indices[0, 0, 2].tolist() == [0, 1, 2]
    q = layout.index("q")
    assert q.num.tolist() == [[[2, 1, 2]]] and q.indices[0, 0, 1, :1].tolist() == [2]
    assert layout.index("partial_kv").num.sum() == 0
    assert layout.index("kv") is kv  # built once


def test_kv_lists_split_kept_blocks_into_partial_and_full():
    causal = BlockSparseLayout.causal(48, 16)  # the diagonal blocks are partial
    partial, full = causal.kv_lists()
    assert partial is causal.index("partial_kv") and full is causal.index("full_kv")
    assert partial.num.tolist() == [[[1, 1, 1]]] and full.num.tolist() == [[[0, 1, 2]]]
    # Without a mask_mod every kept block is full, whatever full_mask says.
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool).view(1, 1, 3, 3)
    plain = BlockSparseLayout(mask, (16, 16), torch.zeros_like(mask))
    partial, full = plain.kv_lists()
    assert full is plain.index("kv") and partial.num.tolist() == [[[0, 0, 0]]]


def test_attention_with_a_layout_equals_attention_with_its_dense_mask():
    torch.manual_seed(0)
    q = torch.randn(2, 2, 70, 16)
    k = v = torch.randn(2, 2, 50, 16)
    mask = torch.rand(1, 2, 5, 4) < 0.5
    mask[0, 0, 1] = False  # an empty query-block row: those rows give zeros
    layout = BlockSparseLayout.from_block_mask(mask, 16)
    out = attnhub.attention(q, k, v, block_sparse=layout, causal=True, alignment="bottom_right")
    dense = layout.to_dense_mask(70, 50)
    expected = attnhub.attention(q, k, v, dense, causal=True, alignment="bottom_right")
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[0, 0, 16:32], torch.zeros(16, 16))


def test_bad_layouts_and_mismatches_raise_naming_block_sparse():
    q = torch.randn(1, 1, 64, 8)
    layout = BlockSparseLayout.causal(128, 64)
    with pytest.raises(ValueError, match="block_sparse layout has 2 x 2 blocks"):
        attnhub.attention(q, q, q, block_sparse=layout)
    with pytest.raises(
        TypeError, match=r"block_sparse must be None or an attnhub\.BlockSparseLayout"
    ):
        attnhub.attention(q, q, q, block_sparse=torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockSparseLayout.from_block_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool), "64")
    with pytest.raises(ValueError, match="4-D"):
        BlockSparseLayout.from_block_mask(torch.ones(2, 2, dtype=torch.bool), 64)
    heads3 = BlockSparseLayout.from_block_mask(torch.ones(1, 3, 1, 1, dtype=torch.bool), 64)
    with pytest.raises(ValueError, match="does not broadcast to B=1, Hq=1"):
        attnhub.attention(q, q, q, block_sparse=heads3)


@pytest.mark.parametrize(
    ("build", "error", "name"),
    [
        # Before: a ZeroDivisionError (block_size 0, stride 0), an empty layout for a
        # negative length, and silently other layouts: random_blocks=-1 drew all but one
        # key block per row, negative global or local blocks kept none.
        (lambda: BlockSparseLayout.causal(-5, 16), ValueError, "seq_len_q"),
        (lambda: BlockSparseLayout.causal(64.5, 16), TypeError, "seq_len_q"),
        (lambda: BlockSparseLayout.sliding_window(64, 1.5, 16), TypeError, "window"),
        (lambda: BlockSparseLayout.sliding_window(64, -1, 16), ValueError, "window"),
        (lambda: BlockSparseLayout.strided(64, 0), ValueError, "block_size"),
        (lambda: BlockSparseLayout.strided(64, 16, stride=0), ValueError, "stride"),
        (lambda: BlockSparseLayout.strided(64, 16, local_blocks=-1), ValueError, "local_blocks"),
        (lambda: BlockSparseLayout.strided(-1, 16), ValueError, "seq_len"),
        (lambda: BlockSparseLayout.bigbird(64, 0), ValueError, "block_size"),
        (lambda: BlockSparseLayout.bigbird(64, 16, random_blocks=-1), ValueError, "random_blocks"),
        (lambda: BlockSparseLayout.bigbird(64, 16, global_blocks=-3), ValueError, "global_blocks"),
        (lambda: BlockSparseLayout.bigbird(64, 16, window_blocks=-1), ValueError, "window_blocks"),
        (lambda: BlockSparseLayout.bigbird(64, True), TypeError, "block_size"),
        (lambda: BlockSparseLayout.from_mask_mod(_causal, 64, 64, 16, batch=0), ValueError, "batch"),
        (lambda: BlockSparseLayout.from_mask_mod(_causal, 64, 64, 16, heads=-1), ValueError, "heads"),
        (lambda: BlockSparseLayout.from_mask_mod(lambda b, h, q, kv: q - kv, 64, 64, 16), TypeError, "mask_mod"),
    ],
)  # fmt: skip
def test_layout_builders_reject_bad_arguments_naming_them(build, error, name):
    with pytest.raises(error, match=name):
        build()


def _causal(b, h, q, kv):  # type: ignore[no-untyped-def]
    return kv <= q
