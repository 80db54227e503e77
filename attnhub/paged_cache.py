"""A paged KV cache for batched generation through :func:`attnhub.attention_kvcache`.

Per layer a key pool and a value pool ``(num_pages, page_size, Hkv, D)``, one block
table ``(B, pages_per_seq)`` int32 shared by the layers, and a free-page allocator:
key position ``p`` of sequence ``b`` lives in slot ``p % page_size`` of page
``block_table[b, p // page_size]`` (contract.md, "Packed sequences and KV caches").
Pages are handed out as sequences grow and come back when a sequence is released, so
sequences of different lengths share one pool without padding.

One forward step of the model (every layer) is bracketed by :meth:`PagedKVCache.start`
and :meth:`PagedKVCache.finish`::

    cache.start([len(p) for p in prompts])     # prefill: pages for each prompt
    ... each layer: out = cache.attend(layer, q, k, v)   # packed (T, H, D) tensors
    cache.finish()                             # lengths += the step's tokens
    cache.start([1] * batch)                   # then decoding, one token a sequence
    ... each layer: out = cache.attend(layer, q, k, v)   # (B, H, 1, D) tensors
    cache.finish()

- A prefill step (packed tensors, each sequence's cache empty) writes the prompts' keys
  and values into their pages with one indexed write per tensor and runs
  :func:`attnhub.attention_varlen` on the packed tokens (causal): the prompts' own keys
  are at hand, so nothing is read back from the pages.
- A decoding step (``(B, Hq, Nq, D)``, the same Nq new tokens for every sequence) is
  :func:`attnhub.attention_kvcache` with ``k_new``/``v_new``: the kernel's call
  appends them in place and attends to the sequence's keys, bottom-right causal.

Bookkeeping (lengths, the block table, the free list) lives on the host; the device
copies of ``cache_seqlens`` and the block table are refreshed once per step, not per
layer. Because the allocator builds them, a caller may pass ``check_indices=False``
(no host read of the index tensors at every layer, see the contract's Errors); the
default checks them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .argcheck import index_below, int_at_least
from .serving import attention_kvcache, attention_varlen

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Page pools for ``num_layers`` layers, a block table and an allocator.

    Args:
        num_layers: layers, each with its own key and value pool.
        batch: sequences (rows of the block table).
        num_pages: pages in each pool (shared by the sequences).
        page_size: keys per page (a power of two from 16 serves every built-in
            KV-cache backend; see each backend's ``extra_reasons``).
        kv_heads, head_dim: the pools' Hkv and D (values have the same D).
        pages_per_seq: block-table columns, the longest sequence in pages
            (default ``num_pages``).
        dtype, device: of the pools.
        check_indices: passed to the attention calls (True: the index tensors are
            validated on the host at every call).

    Attributes:
        k_pools, v_pools: lists of (num_pages, page_size, Hkv, D) tensors, per layer.
        block_table: (B, pages_per_seq) int32 on ``device``; unused entries are -1.
        cache_seqlens: (B,) int32 on ``device``: keys in the cache per sequence.
        lengths: the same on the host (a list of ints).
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        pages_per_seq: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        check_indices: bool = True,
    ) -> None:
        pages_per_seq = num_pages if pages_per_seq is None else pages_per_seq
        for name, value in (("num_layers", num_layers), ("batch", batch),
                            ("num_pages", num_pages), ("page_size", page_size),
                            ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("pages_per_seq", pages_per_seq)):  # fmt: skip
            int_at_least(name, value, 1)
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages_per_seq = pages_per_seq
        self.check_indices = check_indices
        self.device = torch.device(device)
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * batch
        # Pages are handed out lowest first (a stack popped from the end).
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: list[list[int]] = [[] for _ in range(batch)]
        self._table = torch.full((batch, pages_per_seq), -1, dtype=torch.int32)
        self.block_table = self._table.to(self.device)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self._step: list[int] | None = None
        self._prefill: dict[str, Any] | None = None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def step(self) -> tuple[int, ...]:
        """The started step's new tokens per sequence (empty between steps)."""
        return tuple(self._step or ())

    def pages_of(self, b: int) -> list[int]:
        """The pages sequence ``b`` holds, in key order."""
        return list(self._pages[index_below("b", b, self.batch)])

    def start(self, new_tokens: Sequence[int] | int) -> None:
        """Begin a step adding ``new_tokens[b]`` tokens to sequence ``b`` (an int: the
        same for all): allocate the pages they need and refresh the device copies of
        the block table and the lengths.

        Raises:
            ValueError: a count that is negative, of the wrong number, or that would
                take a sequence past ``pages_per_seq`` pages.
            RuntimeError: not enough free pages, or a step already started.
        """
        if self._step is not None:
            raise RuntimeError("PagedKVCache.start: the previous step was not finished")
        counts = [new_tokens] * self.batch if isinstance(new_tokens, int) else list(new_tokens)
        if len(counts) != self.batch or any(not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError(
                f"new_tokens must be {self.batch} non-negative ints, got {new_tokens!r}"
            )
        needed = []
        for b, count in enumerate(counts):
            pages = -(-(self.lengths[b] + count) // self.page_size)
            if pages > self.pages_per_seq:
                raise ValueError(
                    f"new_tokens: sequence {b} would hold {self.lengths[b] + count} keys, "
                    f"more than pages_per_seq * page_size = "
                    f"{self.pages_per_seq * self.page_size}"
                )
            needed.append(pages - len(self._pages[b]))
        if sum(needed) > len(self._free):
            raise RuntimeError(
                f"PagedKVCache: the step needs {sum(needed)} new pages, {len(self._free)} "
                "are free (release finished sequences, or make the pool larger)"
            )
        changed = False
        for b, count in enumerate(needed):
            for _ in range(count):
                page = self._free.pop()
                self._table[b, len(self._pages[b])] = page
                self._pages[b].append(page)
                changed = True
        if changed:
            self.block_table.copy_(self._table)
        self.cache_seqlens.copy_(torch.tensor(self.lengths, dtype=torch.int32))
        self._step = counts
        self._prefill = None

    def finish(self) -> None:
        """End the step: each sequence's length grows by its step's tokens."""
        if self._step is None:
            raise RuntimeError("PagedKVCache.finish: no step was started")
        self.lengths = [n + c for n, c in zip(self.lengths, self._step)]
        self._step = None
        self._prefill = None

    def release(self, b: int) -> None:
        """Return sequence ``b``'s pages to the pool and empty it (a new request can
        take its row)."""
        if self._step is not None:
            raise RuntimeError("PagedKVCache.release: inside a step")
        b = index_below("b", b, self.batch)
        self._free.extend(reversed(self._pages[b]))
        self._pages[b] = []
        self._table[b] = -1
        self.block_table[b] = -1
        self.lengths[b] = 0

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **options: Any,
    ) -> torch.Tensor:
        """Store this step's keys and values for ``layer`` and attend to the cache.

        Prefill (packed): query (T, Hq, D), key and value (T, Hkv, D), T the step's
        tokens in sequence order; every sequence's cache must be empty. Returns
        (T, Hq, D), causal within each sequence.

        Decoding: query (B, Hq, Nq, D), key and value (B, Hkv, Nq, D), with Nq the
        step's count for every sequence. Returns (B, Hq, Nq, D), bottom-right causal.

        ``options`` (scale, softcap, window, backend) go to the attention call.

        Raises:
            TypeError, ValueError: a layer outside [0, num_layers), or tensors that do
                not fit the step or the pools (nothing is written then).
            RuntimeError: no step started.
        """
        if self._step is None:
            raise RuntimeError("PagedKVCache.attend: call start() first")
        layer = index_below("layer", layer, len(self.k_pools))
        k_pool, v_pool = self.k_pools[layer], self.v_pools[layer]
        if query.dim() == 3:
            return self._attend_packed(k_pool, v_pool, query, key, value, options)
        nq = query.shape[2] if query.dim() == 4 else -1
        if query.dim() != 4 or any(c != nq for c in self._step):
            raise ValueError(
                f"query: expected (B, Hq, Nq, D) with Nq the step's new tokens {self._step} "
                f"(or packed (T, Hq, D) for a prefill), got {tuple(query.shape)}"
            )
        return attention_kvcache(
            query, k_pool, v_pool, self.cache_seqlens, block_table=self.block_table,
            k_new=key, v_new=value, causal=True, check_indices=self.check_indices, **options,
        )  # fmt: skip

    def _attend_packed(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        options: dict[str, Any],
    ) -> torch.Tensor:
        assert self._step is not None
        if any(self.lengths):
            # Chunked prefill onto cached keys would need the cached keys in the
            # attention too: not offered (decode steps with Nq > 1 do that).
            raise ValueError("a packed (prefill) step needs every sequence's cache empty")
        total = sum(self._step)
        if query.shape[0] != total or key.shape[0] != total or value.shape[0] != total:
            raise ValueError(
                f"query, key, value: expected {total} packed tokens (the step's), got "
                f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}"
            )
        # The pools are written before the attention call validates anything: what the
        # write would cast or fail on is refused first, with nothing written.
        for name, t, pool in (("key", key, k_pool), ("value", value, v_pool)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.shape[1:] != pool.shape[2:] or t.dtype != pool.dtype or t.device != pool.device:
                raise ValueError(
                    f"{name}: expected (T, Hkv, D) = (T, {pool.shape[2]}, {pool.shape[3]}) "
                    f"{pool.dtype} on {pool.device}, the cache's, got {tuple(t.shape)} "
                    f"{t.dtype} on {t.device}"
                )
        if self._prefill is None:  # once per step, shared by the layers
            positions = torch.cat([torch.arange(c) for c in self._step]).long()
            rows = torch.cat([torch.full((c,), b) for b, c in enumerate(self._step)]).long()
            pages = self._table.long()[rows, positions // self.page_size]
            lengths = torch.tensor(self._step, dtype=torch.int32)
            cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            self._prefill = {
                "pages": pages.to(self.device),
                "slots": (positions % self.page_size).to(self.device),
                "cu": cu.to(self.device),
                "max": max(self._step, default=0),
            }
        p = self._prefill
        k_pool[p["pages"], p["slots"]] = key
        v_pool[p["pages"], p["slots"]] = value
        return attention_varlen(
            query, key, value, p["cu"], p["cu"], p["max"], p["max"], causal=True,
            check_indices=self.check_indices, **options,
        )  # fmt: skip
