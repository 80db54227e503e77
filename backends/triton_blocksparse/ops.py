"""``attnhub::triton_blocksparse_fwd`` / ``_bwd``: the block-sparse kernels as torch ops.

Registered like triton_flash's ops (``triton_op`` on the GPU, an opaque ``custom_op``
under the interpreter; the same launcher and interpreter lock). The layout enters as a
list of int32/uint8 tensors built once per (layout, device) by :func:`layout_tensors`.

Memory of the layout tensors (beyond the layout's own block masks):
- block lists: 4 directions x (num + indices) int32, plus the tile numbers of partial
  blocks in both directions: (B_l, H_l, Nq/bq, Nk/bk) int32 each, the same size as the
  layout's ``block_mask`` (Lb x Lh x (Nq/bq) x (Nk/bk)), i.e. N^2 / (bq * bk) entries
  (FlexAttention's BlockMask keeps the same);
- token masks of partial blocks: uint8 (P, bq, bk), P = number of partial blocks, so
  P * bq * bk bytes. Causal and sliding-window layouts have O(N / bq) partial blocks:
  linear in N (causal at N = 64K, block 128: 512 tiles, 8 MiB). Nothing N x N is built.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch

from attnhub.backends.triton_flash import tuning
from attnhub.backends.triton_flash.configs import SHORT_N, LaunchConfig, launch_config
from attnhub.backends.triton_flash.ops import (
    DirectAttention,
    _aligned,
    _capability,
    _define,
    _delta,
    _forward_outputs,
    _gluon_bwd_eligible,
    _gluon_eligible,
    _grad_outputs,
    _keeps_row_stats,
    _launch_kernel_of_row,
    _lookup,
    _plan_key,
    _planned_delta,
    _remember,
    _row_strides,
    _setup,
    _tma_eligible,
    _with_lse,
    backward_plan_key,
    call_scalars,
    cdiv,
    direct,
    interpreting,
    is_wrap_triton_enabled,
    op_outputs,
    raise_double_backward,
    saved_rows,
)
from attnhub.block_sparse import BlockSparseLayout, _compress

from . import SUPPORTED_BLOCKS, kernels

try:  # Gluon's Hopper API, as triton_flash's Gluon forward (its ops.kernels_gluon)
    from . import kernels_gluon
except ImportError:
    kernels_gluon = None  # type: ignore[assignment]

_TILE_CHUNK = 256  # partial blocks evaluated per mask_mod call when building tiles

# A block counts as heavy, and its programs run first with heads interleaved, when its
# row (column) keeps more than this many times the mean number of blocks.
_HEAVY_FACTOR = 2.0


class LayoutFacts(NamedTuple):
    """What a call needs to know about a layout on the host, kept beside its tensors so
    that a call never reads a device tensor (no GPU sync)."""

    has_partial: bool  # any partial block (the HAS_PARTIAL constexpr)
    heavy_rows: int  # leading entries of the row order that run heads interleaved
    heavy_cols: int  # the same for the column order (dK/dV)
    long_rows: bool  # rows keep _GLUON_MIN_KEYS keys or more on average (Gluon forward, dQ)
    long_cols: bool  # columns keep _GLUON_KV_MIN_QUERIES queries or more on average (dK/dV)


_cache: weakref.WeakKeyDictionary[BlockSparseLayout, dict[str, list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)
_facts: weakref.WeakKeyDictionary[BlockSparseLayout, LayoutFacts] = weakref.WeakKeyDictionary()


def unsupported_block_size(block_size: tuple[int, int]) -> str | None:
    bad = [b for b in block_size if b not in SUPPORTED_BLOCKS]
    if bad:
        return (
            f"block_sparse block_size {tuple(block_size)} is not supported by triton_blocksparse "
            f"(each side must be one of {SUPPORTED_BLOCKS}: the kernel's tile is the layout's block)"
        )
    return None


def _tiles(layout: BlockSparseLayout, partial: torch.Tensor) -> torch.Tensor:
    """uint8 (P, bq, bk) token masks of the partial blocks, in row-major block order."""
    bq, bk = layout.block_size
    coords = partial.nonzero()
    count = coords.shape[0]
    device = partial.device
    tiles = torch.empty(max(count, 1), bq, bk, dtype=torch.uint8, device=device)
    if count == 0 or layout.mask_mod is None:
        tiles.fill_(1)
        return tiles
    rq = torch.arange(bq, device=device).view(1, -1, 1)
    rk = torch.arange(bk, device=device).view(1, 1, -1)
    for lo in range(0, count, _TILE_CHUNK):
        c = coords[lo : lo + _TILE_CHUNK]
        b, h = c[:, 0].view(-1, 1, 1), c[:, 1].view(-1, 1, 1)
        q = c[:, 2].view(-1, 1, 1) * bq + rq
        kv = c[:, 3].view(-1, 1, 1) * bk + rk
        keep = layout.mask_mod(b, h, q, kv).expand(c.shape[0], bq, bk)
        tiles[lo : lo + c.shape[0]] = keep.to(torch.uint8)
    return tiles


def _heaviest_first(kept: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(order, heavy) for the kernels' program order (see ``_program_tile``): the row
    blocks of a (B_l, H_l, rows, cols) block mask by descending count of kept blocks
    over all of the layout's batches and heads (int32), and how many of them are heavy
    (more than ``_HEAVY_FACTOR`` times the mean count)."""
    work = kept.sum(dim=(0, 1, 3), dtype=torch.int64)
    order = torch.argsort(work, descending=True, stable=True).to(torch.int32)
    heavy = int((work.double() > _HEAVY_FACTOR * work.double().mean()).sum())
    return order, heavy


class _LayoutTensors(list):
    """:func:`layout_tensors`' list, carrying its launch-plan key (:func:`_index_key`),
    computed when the list is built (about 20 us of Python a call otherwise)."""

    __slots__ = ("plan_key",)


# Places in layout_tensors' list: a query row's key blocks (the forward's and dQ's
# lists), a key column's query blocks (dK/dV's), the token masks, the program orders.
_BY_ROW, _BY_COLUMN = slice(0, 5), slice(5, 10)
_TILES, _ROW_ORDER, _COLUMN_ORDER = 10, 11, 12


def layout_tensors(layout: BlockSparseLayout, device: torch.device) -> list[torch.Tensor]:
    """[kv full num, kv full idx, kv partial num, kv partial idx, kv partial tile,
    q full num, q full idx, q partial num, q partial idx, q partial tile, tiles,
    row order, column order]: int32 block lists (B_l, H_l, rows[, cols]), the uint8
    (P, bq, bk) token masks and the int32 program orders (rows, heaviest first; see
    :func:`_heaviest_first`). Built once per layout and device (cached weakly on the
    layout), with the layout's :class:`LayoutFacts`."""
    per_layout = _cache.setdefault(layout, {})
    key = str(device)
    if key in per_layout:
        return per_layout[key]
    block = layout.block_mask.to(device)
    full = layout.full_blocks.to(device)
    partial = block & ~full
    row_order, heavy_rows = _heaviest_first(block)
    col_order, heavy_cols = _heaviest_first(block.mT)
    kept_keys = float(block.sum(-1).float().mean()) * layout.block_size[1]
    kept_queries = float(block.sum(-2).float().mean()) * layout.block_size[0]
    _facts[layout] = LayoutFacts(bool(partial.any()), heavy_rows, heavy_cols,
                                 kept_keys >= _GLUON_MIN_KEYS,
                                 kept_queries >= _GLUON_KV_MIN_QUERIES)  # fmt: skip
    tile_id = torch.full(block.shape, -1, dtype=torch.int32, device=device)
    tile_id[partial] = torch.arange(int(partial.sum()), dtype=torch.int32, device=device)
    out: list[torch.Tensor] = []
    for f, p, t in ((full, partial, tile_id), (full.mT, partial.mT, tile_id.mT)):
        fi, pi = _compress(f), _compress(p)
        ptile = t.gather(-1, pi.indices.long()).to(torch.int32)
        out += [fi.num, fi.indices, pi.num, pi.indices, ptile]
    out = [x.contiguous() for x in out]
    out += [_tiles(layout, partial), row_order, col_order]
    tensors = _LayoutTensors(out)
    tensors.plan_key = _index_key(tensors)  # its tensors never change: once, not per call
    per_layout[key] = tensors
    return tensors


def _index_strides(num: torch.Tensor, idx: torch.Tensor) -> tuple[int, ...]:
    """(num batch, num head, idx batch, idx head) strides, 0 where the layout broadcasts,
    and the idx row length."""
    lb, lh = num.shape[:2]
    return (
        0 if lb == 1 else num.stride(0),
        0 if lh == 1 else num.stride(1),
        0 if lb == 1 else idx.stride(0),
        0 if lh == 1 else idx.stride(1),
        idx.shape[-1],
    )


# The launches where the block-sparse kernels' own measurement beat triton_flash's
# table, keyed (direction, padded head dim, element size, causal, capability), for
# calls past SHORT_N keys (below it the table's short rows stay: not measured). dQ at
# D=128 in 2-byte dtypes on sm_90: 64 x 64 tiles on 4 warps read 1.11-1.13x the dense
# table's (128, 64, 8, 2) at densities 1, 0.25 and 0.05 and 1.11x on a 1024-token
# sliding window, the gradients bitwise the same (B2 H16 N8192 bf16, block 128;
# benchmarks/block_sparse_sweep.py, results/archive/block-sparse-sweep-h200-*). The
# table's dK/dV tiles were the best or within 2% of it there, so they stay.
_OWN_CONFIGS: dict[tuple[str, int, int, bool, tuple[int, int] | None], LaunchConfig] = {
    ("bwd_q", 128, 2, False, (9, 0)): LaunchConfig(64, 64, 4, 3),
}


def _launch_config(
    direction: str, block_d: int, q: torch.Tensor, causal: bool, seqlen: int, gluon: bool = False
) -> LaunchConfig:
    """The launch configuration of one block-sparse kernel: a forced one
    (``tuning.override``), else triton_flash's Gluon row for the call (``gluon``: a call
    that ``direction``'s Gluon kernel may serve and that this family gives to it), else
    this family's own row (``_OWN_CONFIGS``), else triton_flash's table for the call."""
    tuned = tuning.current()
    capability, interpret = _capability(q.device), interpreting()
    table = launch_config(direction, block_d, q.element_size(), causal, capability, interpret,
                          seqlen, gluon=gluon)  # fmt: skip
    forced = tuned is not None and tuned.config(direction) is not None
    if forced or table.gluon or seqlen <= SHORT_N or interpret:
        return table
    own = _OWN_CONFIGS.get((direction, block_d, q.element_size(), causal, capability))
    return table if own is None else own


def _even_blocks(meta: dict[str, Any], bq: int, bk: int, nq: int, nk: int) -> bool:
    """EVEN_BLOCKS (kernels.py): no band, no ragged block, so full blocks need no mask."""
    return not meta["HAS_BAND"] and nq % bq == 0 and nk % bk == 0


def _tiles_meta(
    direction: str, bq: int, bk: int, meta: dict[str, Any], q: torch.Tensor, nk: int,
    causal: bool, gluon: bool = False,
) -> tuple[LaunchConfig, int, int, dict[str, Any]]:  # fmt: skip
    """(configuration, BLOCK_M, BLOCK_N, launch meta) for one kernel: its launch
    configuration (:func:`_launch_config`), with the tile capped at the layout's block
    so that it divides it (both are powers of two); and EVEN_BLOCKS."""
    block_d = max(meta["BLOCK_D"], meta["BLOCK_DV"])
    cfg = _launch_config(direction, block_d, q, causal, max(q.shape[2], nk), gluon)
    block_m, block_n = min(cfg.block_m, bq), min(cfg.block_n, bk)
    even = _even_blocks(meta, bq, bk, q.shape[2], nk)
    launch = {**cfg.meta(), "BLOCK_M": block_m, "BLOCK_N": block_n, "BQ": bq, "BK": bk,
              "EVEN_BLOCKS": even}  # fmt: skip
    return cfg, block_m, block_n, launch


# The Gluon forward takes calls from triton_flash's table (its Gluon rows) where the
# layout's rows keep this many keys or more on average (LayoutFacts.long_rows): its
# warp-specialized pipeline pays over long rows and costs over short ones. Against the
# pointer kernel on an H200 (B2 H16 N8192 D128 bf16, 128-key blocks; benchmarks/results/
# archive/block-sparse-probe-fwd-h200-2026-12-05-1096702.txt): 1.42x at 8192 kept keys a
# row, 1.24x at 2048, 0.98-1.02x at 820-1150 (random 0.1, a 1024 window, BigBird), 0.85x
# at 410.
_GLUON_MIN_KEYS = 1536

# The Gluon dK/dV kernel takes the table's calls from shorter columns than the forward
# and dQ kernels take rows (LayoutFacts.long_cols: columns keep this many queries or
# more on average). On an H200 (B2 H16 N8192 D128 bf16, 128 x 128 blocks; two runs,
# benchmarks/results/archive/block-sparse-probe-bwd-h200-2026-12-05-*.txt), the Gluon
# dK/dV beside the pointer dQ against the pointer backward: 1.01-1.03x at 820 queries a
# column (random 0.1), 1.03-1.04x at ~860 (BigBird), 1.03-1.06x at ~1080 (a 1024 window;
# its kernel alone 1.09x), but 0.93-0.99x at 410 (random 0.05). The Gluon dQ over the
# same rows read 0.92-1.00x, so it keeps _GLUON_MIN_KEYS.
_GLUON_KV_MIN_QUERIES = 768


def _gluon_ok(c: Any, bq: int, bk: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor) -> bool:  # fmt: skip
    """Whether a forward may run kernels_gluon.bs_fwd_gluon_kernel (where its launch row
    asks for Gluon): what triton_flash's Gluon forward takes (ops._tma_eligible,
    ops._gluon_eligible), EVEN_BLOCKS, 128-row query blocks (one program's rows) and
    key blocks of 64 or 128 (the sizes its GPU test covers: test_gpu_gluon_forward)."""
    return (
        kernels_gluon is not None and bq == 128 and bk in (64, 128)
        and _even_blocks(c.meta, bq, bk, q.shape[2], k.shape[2])
        and _tma_eligible(c, 0, q, k, v, out) and _gluon_eligible(c, q)
    )  # fmt: skip


def _gluon_backward(c: Any, bq: int, bk: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> bool:  # fmt: skip
    """Whether a backward's dQ (or, with 128-key blocks, its dK/dV) may run
    kernels_gluon's Gluon kernel where its launch row asks for it: the layouts and calls
    the Gluon forward takes (:func:`_gluon_ok`, with dout for out) and what triton_flash's
    Gluon backward kernels take (ops._gluon_bwd_eligible)."""
    return _gluon_ok(c, bq, bk, q, k, v, dout) and _gluon_bwd_eligible(c, lse, q, k, v, dout)


def _grid(n: int, block: int, tile: int, heads: int) -> int:
    """Programs of a 1-D block-sparse grid: every tile of every layout block (the last
    one whole, even if ragged) for each of ``heads`` (batch x heads); see
    ``kernels._program_tile``, which maps a program to its tile, heaviest rows first."""
    return cdiv(n, block) * (block // tile) * heads


# Eager calls on CUDA reuse cached launch plans as triton_flash's do (its ops._PLANS,
# the same table): the layout's index tensors are per-call tensors of a plan, never
# recorded ones; their shapes, strides and alignments enter the key (the token masks'
# alignment only: the kernels index them through the block lists, so their count
# decides no argument), and the layout facts the launches read (block size,
# has_partial, the heavy counts) are among the scalars. So layouts of one geometry
# share a plan (sliding windows of different widths, say), each launched on its own
# block lists and token masks.


def _index_key(index: list[torch.Tensor]) -> tuple:
    """What of the layout tensors (:func:`layout_tensors`) decides a launch other than
    their addresses; the key the list carries where it has one."""
    known = getattr(index, "plan_key", None)
    if known is not None:
        return known  # type: ignore[no-any-return]
    return tuple(
        _aligned(t) if i == _TILES else (t.shape, t.stride(), _aligned(t))
        for i, t in enumerate(index)
    )


def _fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    index: list[torch.Tensor],
    bq: int,
    bk: int,
    has_partial: bool,
    heavy_rows: int,
    heavy_cols: int,
    long_rows: bool,
    long_cols: bool,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward over the kept blocks: (out, lse, row stats or an empty tensor), shapes
    and conventions as triton_flash's op."""
    return op_outputs(*_fwd_rows(q, k, v, mask, seed, index, bq, bk, has_partial, heavy_rows,
                                 heavy_cols, long_rows, long_cols, causal, bottom_right,
                                 window_left, window_right, softcap, scale, dropout_p))  # type: ignore[no-any-return]  # fmt: skip


def _fwd_rows(q, k, v, mask, seed, index, *scalars, public_lse=True):  # type: ignore[no-untyped-def]
    """:func:`_fwd_impl`'s (out, lse, stats), stats None where the backward reads the
    lse itself (triton_flash.ops._fwd_rows); DirectAttention's forward. Without
    ``public_lse`` a float mask's call derives no lse from its stats (None)."""
    (bq, bk, has_partial, heavy_rows, _heavy_cols, long_rows, _long_cols, causal, bottom_right,
     window_left, window_right, softcap, scale, dropout_p) = scalars  # fmt: skip
    key = None
    if not is_wrap_triton_enabled():
        key = _plan_key("bs_fwd", q, k, v, mask, seed, scalars, _index_key(index))
    plan, key = _lookup(key)
    if plan is not None:
        return plan(q, k, v, mask, seed, index, public_lse)
    row_stats = _keeps_row_stats(mask)
    out, lse, empty = _forward_outputs(q, k, v, True, row_stats)
    if empty:
        return _with_lse(out, lse, row_stats, public_lse)
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    c = _setup(q, v, mask, nk, causal, bottom_right, window_left, window_right, softcap,
               scale, dropout_p)  # fmt: skip
    fnum, fidx, pnum, pidx, ptile = index[_BY_ROW]
    tiles, row_order = index[_TILES], index[_ROW_ORDER]
    gluon = _gluon_ok(c, bq, bk, q, k, v, out)
    cfg, block_m, _, launch = _tiles_meta("fwd", bq, bk, c.meta, q, nk, causal,
                                          gluon and long_rows)  # fmt: skip
    record: list | None = [] if key is not None else None
    args = (
        q, k, v, c.mask, q if seed is None else seed, out, lse,
        fnum, fidx, pnum, pidx, ptile, tiles, row_order, heavy_rows,
        *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *out.stride(),
        *_index_strides(fnum, fidx), hq, hq // hkv, nq, nk, d, dv, *c.scalars,
    )  # fmt: skip
    meta = {"HAS_PARTIAL": has_partial, "FOLD_SCALE": c.fold_scale, **c.meta, **launch,
            **_row_strides(K=k, V=v)}  # fmt: skip
    _launch_kernel_of_row(
        kernels.bs_fwd_kernel, getattr(kernels_gluon, "bs_fwd_gluon_kernel", None), cfg, gluon,
        q, (_grid(nq, bq, block_m, b * hq),), args, meta, 14, record,
    )  # fmt: skip
    if key is not None and record and record[0] is not None:
        _remember(key, _Plan(record, (out, lse), None))
    return _with_lse(out, lse, row_stats, public_lse)


_fwd_rows_without_lse = functools.partial(_fwd_rows, public_lse=False)


def _bwd_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    index: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    bq: int,
    bk: int,
    has_partial: bool,
    heavy_rows: int,
    heavy_cols: int,
    long_rows: bool,
    long_cols: bool,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward over the kept blocks: (dq, dk, dv); deterministic, no atomics."""
    scalars = (bq, bk, has_partial, heavy_rows, heavy_cols, long_rows, long_cols, causal,
               bottom_right, window_left, window_right, softcap, scale, dropout_p)  # fmt: skip
    key = None
    if not is_wrap_triton_enabled():
        key = backward_plan_key("bs_bwd", dout, q, k, v, mask, seed, out, lse, dlse, scalars,
                                _index_key(index))  # fmt: skip
    plan, key = _lookup(key)
    if plan is not None:
        return plan.backward(dout, q, k, v, mask, seed, index, out, lse, dlse)  # type: ignore[no-any-return]
    dq, dk, dv, empty = _grad_outputs(q, k, v)
    if empty:
        return dq, dk, dv
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    c = _setup(q, v, mask, nk, causal, bottom_right, window_left, window_right, softcap,
               scale, dropout_p)  # fmt: skip
    record: list | None = [] if key is not None else None
    delta = _delta(out, dout, dlse, c.meta, record)
    seed_t = q if seed is None else seed
    tiles, row_order, col_order = index[_TILES], index[_ROW_ORDER], index[_COLUMN_ORDER]
    meta = {**c.meta, "HAS_PARTIAL": has_partial}

    fnum, fidx, pnum, pidx, ptile = index[_BY_COLUMN]
    # The Gluon kernels (triton_flash's programs on the layout's columns and rows; dK/dV's
    # for 128-key blocks) past triton_flash's rows' own bound (configs._GLUON_MIN_N):
    # dQ where rows keep many keys (_GLUON_MIN_KEYS), as the forward's, dK/dV where
    # columns keep fewer (_GLUON_KV_MIN_QUERIES). On an H200 (B2 H16 N8192 D128 bf16,
    # 128-key blocks; two runs, benchmarks/results/archive/
    # block-sparse-probe-bwd-h200-2026-12-05-*.txt), against the pointer kernels, both:
    # 1.22-1.25x at density 1, 1.16-1.17x at 0.25.
    # (A forced Gluon row serves every call the kernels admit, short rows included.)
    gluon_ok = _gluon_backward(c, bq, bk, q, k, v, dout, lse)
    kv_cfg, _, block_n, kv_launch = _tiles_meta("bwd_kv", bq, bk, meta, q, nk, causal,
                                                gluon_ok and long_cols and bk == 128)  # fmt: skip
    q_cfg, block_m, _, q_launch = _tiles_meta("bwd_q", bq, bk, meta, q, nk, causal,
                                              gluon_ok and long_rows)  # fmt: skip
    args = (
        q, k, v, c.mask, seed_t, dout, lse, delta, dk, dv,
        fnum, fidx, pnum, pidx, ptile, tiles, col_order, heavy_cols,
        *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *dout.stride(), *dk.stride(), *dv.stride(),
        *_index_strides(fnum, fidx),
        hq, hkv, hq // hkv, nq, nk, d, dv_dim, *c.scalars,
    )  # fmt: skip
    _launch_kernel_of_row(
        kernels.bs_bwd_dkdv_kernel, getattr(kernels_gluon, "bs_bwd_dkdv_gluon_kernel", None),
        kv_cfg, gluon_ok and bk == 128, q, (_grid(nk, bk, block_n, b * hkv),), args,
        {**meta, **kv_launch, **_row_strides(Q=q, DO=dout)}, 17, record,
    )  # fmt: skip
    fnum, fidx, pnum, pidx, ptile = index[_BY_ROW]
    args = (
        q, k, v, c.mask, seed_t, dout, lse, delta, dq,
        fnum, fidx, pnum, pidx, ptile, tiles, row_order, heavy_rows,
        *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *dout.stride(), *dq.stride(),
        *_index_strides(fnum, fidx),
        hq, hq // hkv, nq, nk, d, dv_dim, *c.scalars,
    )  # fmt: skip
    _launch_kernel_of_row(
        kernels.bs_bwd_dq_kernel, getattr(kernels_gluon, "bs_bwd_dq_gluon_kernel", None), q_cfg,
        gluon_ok, q, (_grid(nq, bq, block_m, b * hq),), args,
        {**meta, **q_launch, **_row_strides(K=k, V=v)}, 16, record,
    )  # fmt: skip
    if key is not None and record and all(x is not None for x in record):
        _remember(key, _Plan(record, (dq, dk, dv), delta))
    return dq, dk, dv


class _Plan:
    """A block-sparse call's cached launches and the shapes of what it allocates: the
    forward's launch, or the backward's preprocess, dK/dV and dQ launches (see the
    comment above :func:`_index_key`)."""

    __slots__ = ("delta_shape", "device", "launches", "outputs")

    def __init__(self, launches: list, outputs: tuple, delta: torch.Tensor | None) -> None:
        self.launches = tuple(launches)
        self.outputs = tuple((t.shape, t.dtype) for t in outputs)
        self.device = outputs[0].device
        self.delta_shape = None if delta is None else delta.shape

    def _allocate(self) -> list[torch.Tensor]:
        return [torch.empty(s, dtype=t, device=self.device) for s, t in self.outputs]

    def __call__(self, q, k, v, mask, seed, index, public_lse=True):  # type: ignore[no-untyped-def]
        """The forward: (out, lse, stats) as _fwd_rows's."""
        out, rows = self._allocate()
        self.launches[0](q, k, v, q if mask is None else mask, q if seed is None else seed,
                         out, rows, *index[_BY_ROW], index[_TILES], index[_ROW_ORDER])  # fmt: skip
        return _with_lse(out, rows, rows.dtype == torch.int64, public_lse)

    def backward(self, dout, q, k, v, mask, seed, index, out, lse, dlse):  # type: ignore[no-untyped-def]
        """(dq, dk, dv)."""
        dq, dk, dv = self._allocate()
        delta = _planned_delta(self.launches[0], out, dout, dlse, self.delta_shape)
        m, s = q if mask is None else mask, q if seed is None else seed
        tiles = index[_TILES]
        self.launches[1](q, k, v, m, s, dout, lse, delta, dk, dv, *index[_BY_COLUMN], tiles,
                         index[_COLUMN_ORDER])  # fmt: skip
        self.launches[2](q, k, v, m, s, dout, lse, delta, dq, *index[_BY_ROW], tiles,
                         index[_ROW_ORDER])  # fmt: skip
        return dq, dk, dv


triton_blocksparse_fwd = _define("attnhub::triton_blocksparse_fwd", _fwd_impl)
triton_blocksparse_bwd = _define("attnhub::triton_blocksparse_bwd", _bwd_impl)
# bq, bk, has_partial, heavy_rows, heavy_cols, long_rows, long_cols, causal,
# bottom_right, window_left, window_right, softcap, scale, p
_N_SCALARS = 14


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, seed, index, *scalars = inputs
    out, lse, stats = output
    ctx.save_for_backward(q, k, v, mask, seed, out, saved_rows(lse, stats), *index)
    ctx.scalars = scalars
    ctx.tuning = tuning.current()


def _backward(ctx, dout, dlse, dstats):  # type: ignore[no-untyped-def]
    q, k, v, mask, seed, out, lse, *index = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    with tuning.restored(ctx.tuning):
        dq, dk, dv = triton_blocksparse_bwd(
            dout, q, k, v, mask, seed, list(index), out, lse, dlse, *ctx.scalars
        )
    return (dq, dk, dv, None, None, [None] * len(index)) + (None,) * _N_SCALARS


triton_blocksparse_fwd.register_autograd(_backward, setup_context=_setup_context)
# Differentiating the gradients raises, as in triton_flash (DOUBLE_BACKWARD_ERROR).
triton_blocksparse_bwd.register_autograd(raise_double_backward)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockSparseLayout,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable block-sparse attention; returns (out, lse), lse None where
    ``return_lse`` is False (a float mask's call then derives none from its row stats).
    As triton_flash's ``flash_attention`` with the layout's token mask applied as well."""
    why = unsupported_block_size(layout.block_size)
    if why is not None:
        raise ValueError(why)
    layout.check_compatible(q, k)
    seed, call = call_scalars(q, causal, bottom_right, window, softcap, scale, dropout_p)
    extra: Any = layout_tensors(layout, q.device)
    scalars = (*layout.block_size, *_facts[layout], *call)
    if direct(q, k, v, mask):  # plain eager: skip the op's dispatch (see triton_flash.ops)
        fwd = _fwd_rows if return_lse else _fwd_rows_without_lse
        out, lse = DirectAttention.apply(fwd, _bwd_impl, (extra,), q, k, v, mask, seed, *scalars)
    else:
        out, lse, _ = triton_blocksparse_fwd(q, k, v, mask, seed, extra, *scalars)
    return out, (lse if return_lse else None)
