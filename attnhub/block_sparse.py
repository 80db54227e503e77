"""Block-sparse layouts: which (query block, key block) tiles attention visits.

A :class:`BlockSparseLayout` divides the (Nq, Nk) score matrix into tiles of
``block_size = (bq, bk)`` tokens and keeps some of them. Kept tiles are *full* (every
token pair kept) or *partial* (a token-level ``mask_mod`` decides inside the tile,
as for the diagonal tiles of a causal layout). ``attnhub.attention(...,
block_sparse=layout)`` means attention with ``layout.to_dense_mask(Nq, Nk)`` applied,
combined with ``causal``, ``window`` and ``attn_mask`` as usual; rows with no kept key
give zeros.

Like FlexAttention's ``BlockMask``, a layout keeps compressed index lists, built once
and reused across calls: per query block the key blocks to visit (full and partial
apart), and per key block the query blocks (for a backward pass that walks columns).

Shapes: ``block_mask`` and ``full_mask`` are bool (B or 1, H or 1, ceil(Nq / bq),
ceil(Nk / bk)). A ``mask_mod(b, h, q_idx, kv_idx)`` takes broadcastable integer index
tensors and returns a bool tensor (True = keep), as FlexAttention's ``mask_mod`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .argcheck import int_at_least

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pair(block_size: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        pair = (block_size, block_size)
    elif (
        isinstance(block_size, (tuple, list))
        and len(block_size) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) for b in block_size)
    ):
        pair = (int(block_size[0]), int(block_size[1]))
    else:
        raise TypeError(f"block_size must be an int or a (bq, bk) pair of ints, got {block_size!r}")
    if min(pair) < 1:
        raise ValueError(f"block_size must be positive, got {block_size!r}")
    return pair


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


@dataclass(frozen=True)
class BlockIndex:
    """Compressed lists of one direction: for each row block, the column blocks kept.

    ``num``: int32 (B, H, rows); ``indices``: int32 (B, H, rows, cols), the kept
    column indices first, in ascending order (the rest is padding).
    """

    num: torch.Tensor
    indices: torch.Tensor


def _compress(mask: torch.Tensor) -> BlockIndex:
    num = mask.sum(-1, dtype=torch.int32)
    # A stable sort on "not kept" puts kept columns first, in ascending order.
    indices = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return BlockIndex(num, indices)


@dataclass(frozen=True, eq=False)
class BlockSparseLayout:
    """A reusable block-sparsity pattern; build one with a ``from_*`` or pattern method."""

    block_mask: torch.Tensor
    block_size: tuple[int, int]
    full_mask: torch.Tensor
    mask_mod: MaskMod | None = None
    seq_lens: tuple[int, int] | None = None
    _index: dict[str, BlockIndex] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("block_mask", "full_mask"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() != 4:
                raise TypeError(f"{name} must be a 4-D bool tensor (B, H, Nq blocks, Nk blocks)")
        if self.full_mask.shape != self.block_mask.shape:
            raise ValueError("full_mask must have block_mask's shape")
        if (self.full_mask & ~self.block_mask).any():
            raise ValueError("full_mask may only mark blocks that block_mask keeps")

    # -- construction -------------------------------------------------------
    @classmethod
    def from_block_mask(
        cls, block_mask: torch.Tensor, block_size: int | tuple[int, int]
    ) -> BlockSparseLayout:
        """Keep exactly the blocks ``block_mask`` marks, every token inside them."""
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
            raise TypeError("block_mask must be a bool torch.Tensor")
        if block_mask.dim() != 4:
            raise ValueError(
                f"block_mask must be 4-D (B or 1, H or 1, Nq blocks, Nk blocks), "
                f"got shape {tuple(block_mask.shape)}"
            )
        return cls(block_mask.clone(), _pair(block_size), block_mask.clone())

    @classmethod
    def from_mask_mod(
        cls,
        mask_mod: MaskMod,
        seq_len_q: int,
        seq_len_k: int,
        block_size: int | tuple[int, int] = 128,
        *,
        batch: int = 1,
        heads: int = 1,
        device: torch.device | str = "cpu",
    ) -> BlockSparseLayout:
        """Reduce a token-level ``mask_mod`` to blocks; partial blocks keep its masking.

        Evaluated one query block at a time, so building needs O(bq * Nk) memory.
        """
        bq, bk = _pair(block_size)
        for name, value, low in (("seq_len_q", seq_len_q, 0), ("seq_len_k", seq_len_k, 0),
                                 ("batch", batch, 1), ("heads", heads, 1)):  # fmt: skip
            int_at_least(name, value, low)
        nqb, nkb = _blocks(seq_len_q, bq), _blocks(seq_len_k, bk)
        keep = torch.zeros(batch, heads, nqb, nkb, dtype=torch.bool, device=device)
        full = torch.zeros_like(keep)
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        kv = torch.arange(nkb * bk, device=device).view(1, 1, 1, -1)
        in_range_k = kv < seq_len_k
        for row in range(nqb):
            q = torch.arange(row * bq, (row + 1) * bq, device=device).view(1, 1, -1, 1)
            valid = (q < seq_len_q) & in_range_k
            kept = mask_mod(b, h, q, kv)
            if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool:
                raise TypeError(
                    "mask_mod must return a bool tensor (True = kept), got "
                    f"{getattr(kept, 'dtype', type(kept).__name__)}"
                )
            tile = kept.expand(batch, heads, bq, nkb * bk) & valid
            tile = tile.view(batch, heads, bq, nkb, bk)
            valid = valid.expand(1, 1, bq, nkb * bk).view(1, 1, bq, nkb, bk)
            keep[:, :, row] = tile.any(dim=(2, 4))
            # Full: every *valid* token pair of the block is kept.
            full[:, :, row] = (tile | ~valid).all(dim=(2, 4)) & keep[:, :, row]
        return cls(keep, (bq, bk), full, mask_mod, (seq_len_q, seq_len_k))

    @classmethod
    def causal(
        cls, seq_len: int, block_size: int | tuple[int, int] = 128, *, device: Any = "cpu"
    ) -> BlockSparseLayout:
        """Lower-triangular (top-left): query i keeps keys 0..i."""
        return cls.from_mask_mod(_causal_mod, seq_len, seq_len, block_size, device=device)

    @classmethod
    def sliding_window(
        cls,
        seq_len: int,
        window: int,
        block_size: int | tuple[int, int] = 128,
        *,
        causal: bool = True,
        device: Any = "cpu",
    ) -> BlockSparseLayout:
        """Local attention: query i keeps keys within ``window`` positions before it
        (and after it too, if not ``causal``)."""
        int_at_least("window", window, 0)

        def mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (q - kv <= window) & (kv - q <= (0 if causal else window))

        return cls.from_mask_mod(mod, seq_len, seq_len, block_size, device=device)

    @classmethod
    def strided(
        cls,
        seq_len: int,
        block_size: int = 128,
        *,
        local_blocks: int = 1,
        stride: int = 4,
        causal: bool = True,
        device: Any = "cpu",
    ) -> BlockSparseLayout:
        """Sparse Transformer's strided pattern, in blocks: each query block keeps its
        ``local_blocks`` nearest key blocks and every ``stride``-th key block (the
        "summary" columns), optionally causal (then the diagonal block is partial)."""
        for name, value, low in (("seq_len", seq_len, 0), ("block_size", block_size, 1),
                                 ("local_blocks", local_blocks, 0), ("stride", stride, 1)):  # fmt: skip
            int_at_least(name, value, low)
        n = _blocks(seq_len, block_size)
        qb = torch.arange(n, device=device).view(-1, 1)
        kb = torch.arange(n, device=device).view(1, -1)
        keep = ((qb - kb).abs() < local_blocks) | ((kb + 1) % stride == 0)
        return cls._from_blocks_and_causal(keep, seq_len, block_size, causal)

    @classmethod
    def bigbird(
        cls,
        seq_len: int,
        block_size: int = 128,
        *,
        global_blocks: int = 1,
        window_blocks: int = 3,
        random_blocks: int = 2,
        seed: int = 0,
        device: Any = "cpu",
    ) -> BlockSparseLayout:
        """BigBird / Longformer: global blocks (rows and columns), a band of
        ``window_blocks`` around the diagonal, and ``random_blocks`` random key blocks
        per query block (drawn from a generator seeded with ``seed``)."""
        for name, value, low in (("seq_len", seq_len, 0), ("block_size", block_size, 1),
                                 ("global_blocks", global_blocks, 0),
                                 ("window_blocks", window_blocks, 0),
                                 ("random_blocks", random_blocks, 0)):  # fmt: skip
            int_at_least(name, value, low)
        n = _blocks(seq_len, block_size)
        qb = torch.arange(n).view(-1, 1)
        kb = torch.arange(n).view(1, -1)
        keep = (qb - kb).abs() <= window_blocks // 2
        keep |= (qb < global_blocks) | (kb < global_blocks)
        gen = torch.Generator().manual_seed(seed)
        for row in range(n):
            picks = torch.randperm(n, generator=gen)[: min(random_blocks, n)]
            keep[row, picks] = True
        return cls._from_blocks_and_causal(keep.to(device), seq_len, block_size, False)

    @classmethod
    def _from_blocks_and_causal(
        cls, keep: torch.Tensor, seq_len: int, block_size: int, causal: bool
    ) -> BlockSparseLayout:
        keep = keep.view(1, 1, *keep.shape)
        if not causal:
            return cls.from_block_mask(keep, block_size)
        n = keep.shape[-1]
        qb = torch.arange(n, device=keep.device).view(-1, 1)
        kb = torch.arange(n, device=keep.device).view(1, -1)
        keep = keep & (kb <= qb)
        full = keep & (kb < qb)
        return cls(keep, (block_size, block_size), full, _causal_mod, (seq_len, seq_len))

    # -- what it means ------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.block_mask.shape)  # type: ignore[return-value]

    @property
    def density(self) -> float:
        """The fraction of blocks kept (full or partial)."""
        return float(self.block_mask.float().mean())

    @property
    def full_blocks(self) -> torch.Tensor:
        """The kept blocks whose every token is kept: ``full_mask``, or every kept block
        where there is no ``mask_mod`` (:meth:`to_dense_mask` keeps whole blocks then)."""
        return self.full_mask if self.mask_mod is not None else self.block_mask

    def to_dense_mask(self, seq_len_q: int, seq_len_k: int) -> torch.Tensor:
        """The token-level bool mask (B or 1, H or 1, Nq, Nk) that this layout means."""
        self._check_lengths(seq_len_q, seq_len_k)
        bq, bk = self.block_size
        kept = self.block_mask.repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        kept = kept[..., :seq_len_q, :seq_len_k]
        if self.mask_mod is None:
            return kept
        full = self.full_mask.repeat_interleave(bq, 2).repeat_interleave(bk, 3)
        full = full[..., :seq_len_q, :seq_len_k]
        device = self.block_mask.device
        b = torch.arange(self.shape[0], device=device).view(-1, 1, 1, 1)
        h = torch.arange(self.shape[1], device=device).view(1, -1, 1, 1)
        q = torch.arange(seq_len_q, device=device).view(1, 1, -1, 1)
        kv = torch.arange(seq_len_k, device=device).view(1, 1, 1, -1)
        return kept & (full | self.mask_mod(b, h, q, kv))

    def token_mask_mod(self) -> MaskMod:
        """:meth:`to_dense_mask` as a mask_mod: ``mod(b, h, q, kv)`` is True where the
        layout keeps the token pair, for broadcastable index tensors (as FlexAttention
        calls a mask_mod). Looks up each pair's block (dropped, partial or full) and
        asks the layout's own mask_mod only on partial blocks. Holds the block table
        and the layout's mask_mod, not the layout."""
        # 0 dropped, 1 partial, 2 full
        state = self.block_mask.to(torch.int8) + self.full_blocks.to(torch.int8)
        bq, bk = self.block_size
        lb, lh = state.shape[:2]
        inner = self.mask_mod

        def mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
            # A layout of batch or heads 1 applies to every batch or head, read at 0.
            b = b if lb > 1 else b * 0
            h = h if lh > 1 else h * 0
            s = state[b, h, q // bq, kv // bk]
            if inner is None:
                return s > 0
            return (s == 2) | ((s == 1) & inner(b, h, q, kv))

        return mod

    def index(self, direction: str = "kv") -> BlockIndex:
        """Compressed block lists, built once: ``"kv"`` (per query block, the kept key
        blocks), ``"full_kv"`` (only the full ones), ``"partial_kv"`` (only the partial
        ones), and ``"q"``, ``"full_q"``, ``"partial_q"`` (per key block, the query
        blocks; for the backward)."""
        if direction not in self._index:
            masks = {
                "kv": self.block_mask,
                "full_kv": self.full_mask,
                "partial_kv": self.block_mask & ~self.full_mask,
            }
            for name, mask in list(masks.items()):
                masks[name.replace("kv", "q")] = mask.transpose(-1, -2)
            if direction not in masks:
                raise ValueError(f"direction must be one of {sorted(masks)}, got {direction!r}")
            self._index[direction] = _compress(masks[direction])
        return self._index[direction]

    def kv_lists(self) -> tuple[BlockIndex, BlockIndex]:
        """The per-query-block lists ``(partial, full)`` by :attr:`full_blocks`'s rule:
        ``index("partial_kv")`` and ``index("full_kv")``, or without a ``mask_mod`` an
        empty partial list and every kept block (``index("kv")``) as full. In this order
        they are FlexAttention's ``BlockMask.from_kv_blocks`` lists (``kv_*``, then
        ``full_kv_*``) at the layout's ``block_size``."""
        if self.mask_mod is None:
            full = self.index("kv")
            return BlockIndex(torch.zeros_like(full.num), full.indices), full
        return self.index("partial_kv"), self.index("full_kv")

    def _check_lengths(self, seq_len_q: int, seq_len_k: int) -> None:
        bq, bk = self.block_size
        want = (_blocks(seq_len_q, bq), _blocks(seq_len_k, bk))
        if tuple(self.shape[2:]) != want:
            raise ValueError(
                f"block_sparse layout has {self.shape[2]} x {self.shape[3]} blocks of "
                f"{bq} x {bk}, but Nq={seq_len_q}, Nk={seq_len_k} need {want[0]} x {want[1]}"
            )
        if self.seq_lens is not None and self.seq_lens != (seq_len_q, seq_len_k):
            raise ValueError(
                f"block_sparse layout was built for Nq, Nk = {self.seq_lens}, "
                f"not {(seq_len_q, seq_len_k)}"
            )

    def check_compatible(self, query: Any, key: Any) -> None:
        """ValueError naming ``block_sparse`` unless this layout fits the call."""
        b, hq, nq, _ = query.shape
        self._check_lengths(nq, key.shape[2])
        lb, lh = self.shape[:2]
        if lb not in (1, b) or lh not in (1, hq):
            raise ValueError(
                f"block_sparse layout of batch {lb} and heads {lh} does not broadcast to "
                f"B={b}, Hq={hq}"
            )
        if self.block_mask.device != query.device:
            raise ValueError(
                f"block_sparse layout is on {self.block_mask.device}, query on {query.device}"
            )

    def to(self, device: torch.device | str) -> BlockSparseLayout:
        """The same layout with its tensors on ``device``."""
        return BlockSparseLayout(
            self.block_mask.to(device),
            self.block_size,
            self.full_mask.to(device),
            self.mask_mod,
            self.seq_lens,
        )

    def __repr__(self) -> str:
        kept = int(self.block_mask.sum())
        partial = kept - int(self.full_mask.sum())
        return (
            f"BlockSparseLayout(shape={self.shape}, block_size={self.block_size}, "
            f"density={self.density:.3f}, kept={kept} blocks ({partial} partial))"
        )


def _causal_mod(
    b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    return kv <= q
