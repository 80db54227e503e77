"""A dense mask's structure read in two kernel launches and one synchronization.

:mod:`attnhub.mask_structure` reads a bool keep-mask (..., Nq, Nk) as key padding
combined with a causal or window rule. In PyTorch ops that reading is some thirty small
ops and two synchronizations: on an H100 host about 0.5 ms for a B8 N512 mask
(``benchmarks/results/mask-recognition-h100.txt``), more than the structured kernels
gain over a dense-mask kernel in an 8-layer forward of that size. Here the same reading
is two launches:

1. ``_union_and_keys_kernel``: programs of two roles. A row program reduces one
   leading index's block of query rows to each row's first and last kept key, folded
   into the union over the leading dims by atomic max; a key program reduces one
   leading index's block of keys over every row to ``key_ok[l, j]`` (some row keeps
   key j).
2. ``_verify_kernel``: every program derives the candidate (the diagonal's offset, the
   lower bound, whether any row keeps a key and whether the lower bound shows) from the
   rows' first and last keys, exactly as ``mask_structure._candidate`` does, and counts
   the entries of its block of rows where ``keep != key_ok & structure``; the first
   program of each leading index also checks whether the structure alone implies that
   index's keys and reads its key mask's row (its count, first and end, as
   :func:`attnhub.mask_rows.summary` gives them).

The counts, the candidate and the key mask's two scalars come back in one read. The
reading is the same function as ``mask_structure``'s PyTorch one, output for output
(tests/test_mask_reading.py compares them on every mask kind the tests generate).

Only for masks whose leading dims (at most two) have real strides: a mask broadcast
along a leading dim of size > 1 (stride 0) is left to the PyTorch reading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["read_rows", "takes"]

BLOCK_M = 64  # query rows of a tile
BLOCK_N = 128  # keys of a tile
SCAN = 1024  # rows' first and last keys reduced per step in _verify_kernel
# The least count of kept keys is reduced as BIG - count with atomic_max on a zeroed slot.
BIG = 2**62

# Slots of the result vector: what comes back in the one read.
BAD, NOT_IMPLIED, OFFSET, LEFT, ANY_SEEN, BOUNDED, FEWEST, GAPS = range(8)


# The mask tile's address and load are written out in each role, not shared through
# @triton.jit helpers: with the base and the tile load as helpers, the union kernel's
# SASS for sm_90 held 324 local-memory (spill) instructions, and none written out
# (`aot_check.py --mask-reading --sass-dir`, 2026-12-07).
# The strides are specialized (Triton's "== 1" and "divisible by 16"): a contiguous
# mask's rows then load as 16-byte vectors; unspecialized, every byte was its own
# load with its own 64-bit address (2.3 ms for a B8 N4096 mask on an H100, 1.8x
# PyTorch's ops: benchmarks/results/archive/mask-recognition-h100-2026-12-06-640690d.txt).
@triton.jit(do_not_specialize=["L2", "NQ", "NK", "ROW_PROGRAMS"])
def _union_and_keys_kernel(
    keep, s1, s2, sq, sk, L2, NQ, NK, ROW_PROGRAMS, row_first, row_last, key_ok,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < ROW_PROGRAMS:
        # Rows of one leading index: first and last kept key, into the union over the
        # leading dims by atomic max on zeroed slots (NK - first, last + 1: 0 is none).
        row_blocks = tl.cdiv(NQ, BM)
        lead = pid // row_blocks
        rows = (pid % row_blocks) * BM + tl.arange(0, BM)
        in_rows = rows < NQ
        first = tl.zeros([BM], tl.int64) + NK
        last = tl.zeros([BM], tl.int64) - 1
        base = keep + (lead // L2).to(tl.int64) * s1 + (lead % L2).to(tl.int64) * s2
        for start in range(0, NK, BN):
            cols = start + tl.arange(0, BN)
            tile = in_rows[:, None] & (cols < NK)[None, :]
            kept = tl.load(base + rows.to(tl.int64)[:, None] * sq + cols.to(tl.int64)[None, :] * sk,
                           mask=tile, other=0) != 0  # fmt: skip
            first = tl.minimum(first, tl.min(tl.where(kept, cols[None, :], NK), axis=1))
            last = tl.maximum(last, tl.max(tl.where(kept, cols[None, :], -1), axis=1))
        # (Not named like the key role's `seen`: Triton's compiler wants a name bound in
        # both branches of an `if` to have one type; the interpreter does not check.)
        has_key = in_rows & (last >= 0)
        tl.atomic_max(row_first + rows, NK - first, mask=has_key)
        tl.atomic_max(row_last + rows, last + 1, mask=has_key)
    else:
        # Keys of one leading index: kept by some row.
        blocks = tl.cdiv(NK, BN)
        lead = (pid - ROW_PROGRAMS) // blocks
        cols = ((pid - ROW_PROGRAMS) % blocks) * BN + tl.arange(0, BN)
        in_cols = cols < NK
        base = keep + (lead // L2).to(tl.int64) * s1 + (lead % L2).to(tl.int64) * s2
        seen = tl.zeros([BN], tl.int32)
        for start in range(0, NQ, BM):
            rows = start + tl.arange(0, BM)
            tile = (rows < NQ)[:, None] & in_cols[None, :]
            kept = tl.load(base + rows.to(tl.int64)[:, None] * sq + cols.to(tl.int64)[None, :] * sk,
                           mask=tile, other=0) != 0  # fmt: skip
            seen = tl.maximum(seen, tl.max(kept.to(tl.int32), axis=0))
        tl.store(key_ok + lead.to(tl.int64) * NK + cols, seen.to(tl.int8), mask=in_cols)


@triton.jit(do_not_specialize=["L2", "NQ", "NK", "ROW_BLOCKS"])
def _verify_kernel(
    keep, s1, s2, sq, sk, L2, NQ, NK, ROW_BLOCKS, row_first, row_last, key_ok, first_end, res,
    BM: tl.constexpr, BN: tl.constexpr, SCAN_ROWS: tl.constexpr, BIG_COUNT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    lead = pid // ROW_BLOCKS
    block = pid % ROW_BLOCKS
    # The candidate, from every row's first and last key (mask_structure._candidate).
    offset = (NK - 1).to(tl.int64)
    left = (-NK).to(tl.int64)
    any_seen = 0
    bounded = 0
    for start in range(0, NQ, SCAN_ROWS):
        r = start + tl.arange(0, SCAN_ROWS)
        f = NK - tl.load(row_first + r, mask=r < NQ, other=0)
        la = tl.load(row_last + r, mask=r < NQ, other=0) - 1
        seen = la >= 0
        offset = tl.minimum(offset, tl.min(tl.where(seen & (la < NK - 1), la - r, NK - 1)))
        left = tl.maximum(left, tl.max(tl.where(seen, r - f, -NK)))
        any_seen = tl.maximum(any_seen, tl.max(seen.to(tl.int32)))
        bounded = tl.maximum(bounded, tl.max((seen & (f > 0)).to(tl.int32)))
    # keep == key_ok & structure over this program's rows.
    base = keep + (lead // L2).to(tl.int64) * s1 + (lead % L2).to(tl.int64) * s2
    keys = key_ok + lead.to(tl.int64) * NK
    rows = block * BM + tl.arange(0, BM)
    in_rows = rows < NQ
    bad = 0
    for start in range(0, NK, BN):
        cols = start + tl.arange(0, BN)
        in_cols = cols < NK
        tile = in_rows[:, None] & in_cols[None, :]
        kept = tl.load(base + rows.to(tl.int64)[:, None] * sq + cols.to(tl.int64)[None, :] * sk,
                       mask=tile, other=0) != 0  # fmt: skip
        ok = tl.load(keys + cols, mask=in_cols, other=0) != 0
        structure = (cols[None, :] <= rows[:, None] + offset) & (
            (bounded == 0) | (cols[None, :] >= rows[:, None] - left)
        )
        bad += tl.sum(((kept != (ok[None, :] & structure)) & tile).to(tl.int32))
    tl.atomic_add(res + 0, bad.to(tl.int64))
    if block == 0:
        # Whether the structure alone keeps exactly these keys (some row i in [0, NQ)
        # keeps key j: max(0, j - offset) <= min(NQ - 1, j + left)), and the key mask's
        # row as mask_rows.summary reads it.
        missed = 0
        count = 0
        first = NK.to(tl.int64)
        end = 0
        for start in range(0, NK, BN):
            cols = start + tl.arange(0, BN)
            in_cols = cols < NK
            ok = tl.load(keys + cols, mask=in_cols, other=0) != 0
            lo = tl.maximum(cols - offset, 0)
            hi = tl.where(bounded != 0, tl.minimum(cols + left, NQ - 1), NQ - 1)
            missed += tl.sum(((ok != (lo <= hi)) & in_cols).to(tl.int32))
            count += tl.sum(ok.to(tl.int32))
            first = tl.minimum(first, tl.min(tl.where(ok, cols, NK)))
            end = tl.maximum(end, tl.max(tl.where(ok, cols + 1, 0)))
        first = tl.where(count == 0, 0, first)  # argmax's answer for a row of none
        tl.store(first_end + lead, first)
        tl.store(first_end + tl.num_programs(0) // ROW_BLOCKS + lead, end.to(tl.int64))
        tl.atomic_add(res + 1, missed.to(tl.int64))
        tl.atomic_max(res + 6, BIG_COUNT - count.to(tl.int64))
        tl.atomic_add(res + 7, (end - first != count).to(tl.int64))
        if lead == 0:
            tl.store(res + 2, offset)
            tl.store(res + 3, left)
            tl.store(res + 4, any_seen.to(tl.int64))
            tl.store(res + 5, bounded.to(tl.int64))


def takes(keep: torch.Tensor) -> bool:
    """Whether :func:`read_rows` reads this bool keep-mask: at most four dims, at least
    one row and key, no leading dim broadcast (stride 0 with size > 1)."""
    return (
        keep.dtype == torch.bool
        and 2 <= keep.dim() <= 4
        and keep.numel() > 0
        and all(size == 1 or stride != 0 for size, stride in zip(keep.shape[:-2], keep.stride()[:-2]))
    )  # fmt: skip


def read_rows(keep: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    """(key_ok, scalars, first, end) of a bool keep-mask that :func:`takes` admits.

    ``key_ok``: bool (..., Nk), a new tensor, ``keep.any(dim=-2)``. ``scalars``: the
    counts and candidate read back, indexed by BAD (entries where ``keep`` is not
    ``key_ok & structure``), NOT_IMPLIED (keys where ``key_ok`` is not what the
    structure alone keeps), OFFSET, LEFT, ANY_SEEN, BOUNDED (as mask_structure's
    candidate gives them; LEFT counts only where BOUNDED), FEWEST and GAPS (the key
    mask's least count of kept keys and how many of its rows are not one run).
    ``first``, ``end``: int64 (prod(leading),), each key mask row's first kept key and one
    past its last (0 and 0 for a row of none): :class:`attnhub.mask_rows.RowKeys`'."""
    *lead, nq, nk = keep.shape
    lead = [1] * (2 - len(lead)) + lead
    # As (L1, L2, Nq, Nk): missing leading dims are of size 1 (their stride never used).
    s1, s2 = [0] * (4 - keep.dim()) + list(keep.stride()[:-2])
    sq, sk = keep.stride()[-2:]
    leading = lead[0] * lead[1]
    device = keep.device
    # One zeroed buffer: the result slots, then each key mask row's first and end.
    buffer = torch.zeros(8 + 2 * leading + 2 * nq, dtype=torch.int64, device=device)
    res, first_end, row_first, row_last = buffer.split([8, 2 * leading, nq, nq])
    key_ok = torch.empty((leading, nk), dtype=torch.int8, device=device)
    bits = keep.view(torch.uint8)
    row_programs = triton.cdiv(nq, BLOCK_M)
    _union_and_keys_kernel[(leading * (row_programs + triton.cdiv(nk, BLOCK_N)),)](
        bits, s1, s2, sq, sk, lead[1], nq, nk, leading * row_programs, row_first, row_last,
        key_ok, BM=BLOCK_M, BN=BLOCK_N,
    )  # fmt: skip
    _verify_kernel[(leading * row_programs,)](
        bits, s1, s2, sq, sk, lead[1], nq, nk, row_programs, row_first, row_last, key_ok,
        first_end, res, BM=BLOCK_M, BN=BLOCK_N, SCAN_ROWS=SCAN, BIG_COUNT=BIG,
    )  # fmt: skip
    scalars = res.tolist()
    scalars[FEWEST] = BIG - scalars[FEWEST]
    first, end = first_end.view(2, leading)
    return key_ok.view(torch.bool).view(*keep.shape[:-2], nk), scalars, first, end
