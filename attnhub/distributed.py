"""Context parallelism: one attention call over a sequence sharded across processes.

Each rank of a ``torch.distributed`` process group holds a shard of the sequence:
query, key and value of shape (B, H, N_local, D). :func:`context_parallel_attention`
returns each rank's rows of what one :func:`attnhub.attention` over the gathered
sequence returns, forward and backward, within the contract's tolerance.

How (ring attention, the FlashAttention merge across devices): the key/value shards
travel around the ring of ranks; at every step a rank attends its queries to the
key/value block it holds with an ordinary ``attnhub.attention(..., return_lse=True)``
call, dispatched like any other (any backend that returns the log-sum-exp), and merges
the partial outputs exactly through their log-sum-exps::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

the same rescaling the online softmax does inside a kernel. The next block's transfer
is started before the current block is computed (batched ``isend``/``irecv``), so a
step takes about max(compute, transfer).

Sharding (:func:`shard`, :func:`unshard`, :func:`positions`): the sequence is cut into
chunks of equal length (or lengths ``N // C`` and ``N // C + 1`` when N is not a
multiple of the chunk count C: then pass ``seq_len=N`` to the call; :func:`gather`
finds N itself). ``layout="zigzag"`` (the default) cuts it into 2R chunks and gives
rank r chunks r and 2R-1-r, so that under a causal mask every rank has the same work
(an early chunk and a late one);
``layout="contiguous"`` gives rank r chunk r of R. Chunk pairs a mask hides entirely
are skipped, not computed.

Masks between chunks: a pair of chunks whose global positions differ is a band of the
(query, key) grid, ``key - query`` in ``[lo, hi]``. Every such band is expressed as a
contract call on a slice of the chunks: keys that no query of the chunk can see and
queries that see no key are cut off, and what remains is top-left ``causal`` and/or a
``window`` with non-negative sides, both of which every window-capable backend serves
(the contract needed no extension; see docs/distributed.md for the cost). A pair that
is fully visible is a call without a mask; a rank's own block under causal is one
causal call (the zigzag order keeps positions ascending within a shard).

Backward (:class:`_RingAttention`): the ring runs again. The block's key/value travel
as in the forward, and their gradient accumulators travel with them, one hop behind,
until they come home to their rank after R hops. Each step recomputes its partial
``(out_j, lse_j)`` under autograd and differentiates it with

    d out_j = w_j * d out,      d lse_j = w_j * (d out . out_j - d out . out + d lse)

where ``w_j = exp(lse_j - lse)`` is the step's weight in the merge (the lse term is
exact: the merge depends on lse_j). So the backward's steps need a backend whose lse
carries a gradient: a call that returns its lse under autograd is offered only the
backends that declare ``lse_grad`` (torch_reference and triton_flash; not PyTorch's
fused kernels, called through their ATen ops), so the forward may run on cuDNN and the
backward's steps on triton_flash, and where none is eligible dispatch's NoBackendError
says why. The recompute costs one forward per step in the
backward, the price of calling any backend through its public interface (a kernel's
backward fed the global output and lse would not need it). The gradients are first
derivatives: differentiating them again raises.

Failure: a peer that never takes part makes the call raise once the process group's
timeout expires (gloo raises from the wait; NCCL's watchdog aborts the communicator),
it does not hang forever. Shapes, options and the backend selection are compared across
ranks on every call (one small all-gather), so that mismatched shards or options raise
the same ValueError on every rank instead of corrupting a transfer, leaving ranks
waiting or computing each with its own options.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import api, dispatch
from .argcheck import index_below, int_at_least
from .registry import get_registry
from .validation import _check_window, make_params

__all__ = [
    "LAYOUTS",
    "chunk_ids",
    "context_parallel_attention",
    "gather",
    "local_length",
    "positions",
    "shard",
    "unshard",
]

LAYOUTS = ("zigzag", "contiguous")

# ---------------------------------------------------------------------------
# Sharding helpers


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return str(layout)


def _resolve(world_size: Any, rank: Any) -> tuple[int, int]:
    """``(world_size, rank)`` from ints, or from a process group (None: the default
    group) and this process's rank in it."""
    if world_size is None or isinstance(world_size, dist.ProcessGroup):
        group = world_size
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "world_size must be an int when torch.distributed is not initialized "
                "(or pass a process group once it is)"
            )
        world_size = dist.get_world_size(group)
        rank = dist.get_rank(group) if rank is None else rank
    elif rank is None:
        raise TypeError("rank must be an int when world_size is one")
    _check_world(world_size, rank)
    return world_size, rank


def _check_group(group: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be None (the default group) or a torch.distributed.ProcessGroup, "
            f"got {type(group).__name__}"
        )


def _dim_problem(x: torch.Tensor, dim: Any, name: str) -> str | None:
    """Why ``dim`` is not a dim of the tensor ``x`` (None: it is)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
        return f"dim must be an int in [{-x.ndim}, {x.ndim}) for a {x.ndim}-d {name}, got {dim!r}"  # fmt: skip
    return None


def _check_dim(x: Any, dim: Any, name: str = "x") -> int:
    """``dim`` of the tensor ``x``, as a non-negative index."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    problem = _dim_problem(x, dim, name)
    if problem is not None:
        raise ValueError(problem)
    return dim % x.ndim


def _check_world(world_size: Any, rank: Any) -> None:
    int_at_least("world_size", world_size, 1)
    index_below("rank", rank, world_size)


def chunk_ids(world_size: int, rank: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in its local order.

    ``zigzag``: the sequence is cut into ``2 * world_size`` chunks and the rank holds
    ``(rank, 2 * world_size - 1 - rank)``; ``contiguous``: ``world_size`` chunks, the
    rank holds ``(rank,)``. Local order is ascending in position in both layouts.
    """
    _check_layout(layout)
    _check_world(world_size, rank)
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def _num_chunks(world_size: int, layout: str) -> int:
    return 2 * world_size if layout == "zigzag" else world_size


@functools.lru_cache(maxsize=4096)
def _local_chunks(n: int, world_size: int, rank: int, layout: str) -> tuple[tuple[int, int], ...]:
    """``(global offset, length)`` of each chunk rank ``rank`` holds, in local order, for
    a sequence of ``n``: the layout's chunks have lengths ``n // C`` or one more (the
    first ``n % C`` chunks), C the chunk count, so uneven lengths shard too."""
    chunks = _num_chunks(world_size, layout)
    base, extra = divmod(n, chunks)
    offsets = [i * base + min(i, extra) for i in range(chunks + 1)]
    return tuple(
        (offsets[i], offsets[i + 1] - offsets[i]) for i in chunk_ids(world_size, rank, layout)
    )


def local_length(n: int, world_size: int, rank: int, layout: str = "zigzag") -> int:
    """The length of rank ``rank``'s shard of a sequence of ``n`` (``n / world_size``
    when ``n`` is a multiple of the layout's chunk count; otherwise ranks differ by up to
    one token per chunk)."""
    return sum(length for _, length in _local_chunks(n, world_size, rank, layout))


def shard(
    x: torch.Tensor,
    dim: int,
    world_size: Any = None,
    rank: int | None = None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim``.

    ``world_size`` is an int (then ``rank`` too), or a process group, or None (the
    default group), whose size it is and, unless ``rank`` is given, this process's rank.

    Example: q of shape (B, H, N, D) -> ``shard(q, 2, R, r)`` of shape (B, H, N/R, D),
    holding the chunks :func:`chunk_ids` names, concatenated. Position ids for the
    shard (for rotary embeddings and the like) are :func:`positions`. A length that is
    not a multiple of the chunk count is cut into chunks of ``N // C`` and ``N // C + 1``
    (:func:`local_length`); pass ``seq_len=N`` to :func:`context_parallel_attention`
    when the ranks' shards then differ in length.
    """
    dim = _check_dim(x, dim)
    world_size, rank = _resolve(world_size, rank)
    chunks = _local_chunks(x.shape[dim], world_size, rank, _check_layout(layout))
    return torch.cat([x.narrow(dim, offset, length) for offset, length in chunks], dim=dim)


def _gather_ints(group: Any, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each), by one small all-gather: row r
    is rank r's. On the tensors' device (NCCL; read back on the host, a wait for the
    device), or the CPU where the group is gloo."""
    if dist.get_backend(group) == "gloo":
        device = torch.device("cpu")
    local = torch.tensor(values, dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [p.tolist() for p in parts]


def _sharded_length(lengths: list[int], dim: int, layout: str, prefix: str = "") -> int:
    """The sequence length N whose ``layout`` shards have these per-rank ``lengths``
    (their sum); ``ValueError`` where they are not such shards. ``prefix``: "gather: ",
    whose message speaks of the ranks' shards (unshard's of a list's)."""
    n = sum(lengths)
    expected = [local_length(n, len(lengths), r, layout) for r in range(len(lengths))]
    if lengths != expected:
        per_rank = " per rank" if prefix else ""
        raise ValueError(
            f"{prefix}the shards' lengths along dim {dim}{per_rank} are {lengths}; {layout} "
            f"shards of a sequence of {n} have lengths {expected}"
        )
    return n


def unshard(shards: Sequence[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank r's), the
    inverse of :func:`shard` along ``dim``."""
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards must hold one tensor per rank, got none")
    dim = _check_dim(shards[0], dim, "shards[0]")
    for r, s in enumerate(shards):
        if (
            not isinstance(s, torch.Tensor)
            or s.ndim != shards[0].ndim
            or any(a != b for i, (a, b) in enumerate(zip(s.shape, shards[0].shape)) if i != dim)
        ):
            raise ValueError(
                f"shards[{r}]: expected a tensor of shards[0]'s shape but along dim {dim} "
                f"({tuple(shards[0].shape)}), got "
                f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}"
            )
    lengths = [s.shape[dim] for s in shards]
    n = _sharded_length(lengths, dim, layout)
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, s in enumerate(shards):
        start = 0
        for offset, length in _local_chunks(n, world_size, r, layout):
            pieces.append((offset, s.narrow(dim, start, length)))
            start += length
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim=dim)


def positions(
    seq_len: int,
    world_size: Any = None,
    rank: int | None = None,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global position ids (int64, shape (local_length,)) of rank ``rank``'s shard
    of a ``seq_len`` sequence, in the shard's order: feed them to rotary embeddings (or
    anything positional) instead of ``arange(N_local)``. ``world_size`` and ``rank`` as
    :func:`shard`."""
    int_at_least("seq_len", seq_len, 0)
    return shard(torch.arange(seq_len, device=device), 0, world_size, rank, layout)


def gather(
    x: torch.Tensor,
    dim: int,
    group: Any = None,
    layout: str = "zigzag",
    seq_len: int | None = None,
) -> torch.Tensor:
    """The full sequence on every rank: an all-gather of ``x`` (this rank's shard along
    ``dim``) and :func:`unshard`. Not differentiable; for evaluation and tests.

    The shards may differ in length (a sequence that is not a multiple of the chunk
    count): the ranks' lengths are all-gathered first (one small all-gather), the
    sequence's length is their sum (a layout's shards always add up to it), and the
    shards are padded to the longest for the all-gather, then trimmed. ``seq_len`` is
    not needed; when given, it is checked against that sum. Bad arguments on any rank,
    and shards that differ between ranks (dtype, the other dims, ``dim``, ``layout``) or
    whose lengths are not a ``layout`` sharding, raise a ValueError on every rank, after
    the lengths' all-gather and before the shards' (which would otherwise abort or
    hang on mismatched sizes)."""
    _check_group(group)
    world_size = dist.get_world_size(group)
    problem = (
        f"layout must be one of {LAYOUTS}, got {layout!r}"
        if layout not in LAYOUTS
        else _dim_problem(x, dim, "shard")
    )
    if problem is None and (
        seq_len is not None
        and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0)
    ):
        problem = f"seq_len must be None or an int >= 0, got {seq_len!r}"
    if problem is None:
        dim %= x.ndim
        others = (*x.shape[:dim], *x.shape[dim + 1 :])
        facts = zlib.crc32(repr((others, str(x.dtype), dim, layout)).encode())
        mine = [x.shape[dim], -1 if seq_len is None else seq_len, facts, 0]
    else:
        mine = [-1, -1, 0, 1]
    rows = _gather_ints(group, mine, x.device)
    if problem is not None:
        raise ValueError(f"gather: {problem}")
    bad = [r for r, row in enumerate(rows) if row[3]]
    if bad:
        raise ValueError(f"gather: bad arguments on rank(s) {bad} (they raise why)")
    if any(row[2] != rows[0][2] for row in rows):
        raise ValueError(
            "gather: the shards' dtype, shape (but along dim), dim or layout differ "
            f"between ranks (this rank's: {x.dtype}, {tuple(x.shape)}, dim={dim}, {layout})"
        )
    lengths = [row[0] for row in rows]
    n = _sharded_length(lengths, dim, layout, prefix="gather: ")
    given = [row[1] for row in rows]
    if any(s not in (-1, n) for s in given):
        raise ValueError(
            f"gather: seq_len per rank is {[None if s == -1 else s for s in given]}, but the "
            f"shards' lengths along dim {dim} ({lengths}) add up to {n}"
        )
    longest = max(lengths)
    padded = x.movedim(dim, 0)
    if padded.shape[0] < longest:  # all_gather needs one shape: pad, then trim
        pad = padded.new_zeros((longest - padded.shape[0], *padded.shape[1:]))
        padded = torch.cat([padded, pad])
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    if padded.numel():  # the same on every rank (checked): nothing to send otherwise
        dist.all_gather(parts, padded.contiguous(), group=group)
    trimmed = [p[:length].movedim(0, dim) for p, length in zip(parts, lengths)]
    return unshard(trimmed, dim, layout)


# ---------------------------------------------------------------------------
# The plan: which calls a step makes


@dataclass(frozen=True)
class _Call:
    """One attnhub call of a ring step: local query rows ``[r0, r1)`` against the held
    block's rows ``[k0, k1)``, with a top-left ``causal`` flag and ``window``."""

    r0: int
    r1: int
    k0: int
    k1: int
    causal: bool
    window: tuple[int | None, int | None] | None


_INF = math.inf


def _band(
    q_off: int,
    k_off: int,
    nq: int,
    nk: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> tuple[float, float]:
    """Visible ``key - query`` offsets ``[lo, hi]`` (local indices j - i) of a chunk pair
    (nq queries at global offset q_off, nk keys at k_off), clipped to the pair's range."""
    d = q_off - k_off  # global key pos - query pos = (j - i) - d
    lo, hi = -_INF, _INF
    if window is not None:
        left, right = window
        if left is not None:
            lo = d - left
        if right is not None:
            hi = d + right
    if causal:
        hi = min(hi, d)
    return max(lo, -(nq - 1)), min(hi, nk - 1)


def _band_call(a_row: int, b_row: int, nq: int, nk: int, lo: int, hi: int) -> _Call:
    """A non-empty band ``j - i in [lo, hi]`` of an nq x nk chunk pair as a top-left call:
    cut the keys no query sees and the queries that see no key, then the band is
    ``causal`` and/or ``window`` with non-negative sides (see the module doc)."""
    t = max(0, -hi)  # rows i < -hi see no key (j <= i + hi < 0)
    s = max(0, lo)  # keys j < lo are seen by no row (j >= i + lo >= lo)
    r_end = min(nq, nk - lo)  # rows i > nk - 1 - lo see no key
    k_end = min(nk, nq + hi)  # keys j > nq - 1 + hi are seen by no row
    rows, keys = r_end - t, k_end - s
    left, right = s - t - lo, hi - s + t  # relative band: j' - i' in [-left, right]
    causal = right == 0
    side_left: int | None = None if left >= rows - 1 else left
    side_right: int | None = None if causal or right >= keys - 1 else right
    window = None if side_left is None and side_right is None else (side_left, side_right)
    return _Call(a_row + t, a_row + r_end, b_row + s, b_row + k_end, causal, window)


@functools.lru_cache(maxsize=4096)
def _plan(
    world_size: int,
    rank: int,
    src: int,
    layout: str,
    n: int,
    causal: bool,
    window: tuple[int | None, int | None] | None,
) -> tuple[_Call, ...]:
    """The calls rank ``rank`` makes against the block of rank ``src``, for a sequence of
    ``n`` (the chunks of :func:`_local_chunks`)."""
    q_chunks = _local_chunks(n, world_size, rank, layout)
    k_chunks = _local_chunks(n, world_size, src, layout)
    if src == rank and window is None:
        # One call on the whole shard: positions ascend within it, so top-left causal on
        # local indices is global causal (a later chunk sees an earlier one fully).
        length = sum(size for _, size in q_chunks)
        return (_Call(0, length, 0, length, causal, None),) if length else ()
    q_rows = [sum(size for _, size in q_chunks[:a]) for a in range(len(q_chunks) + 1)]
    k_rows = [sum(size for _, size in k_chunks[:b]) for b in range(len(k_chunks) + 1)]
    visible: dict[tuple[int, int], tuple[int, int]] = {}
    for a, (q_off, nq) in enumerate(q_chunks):
        for b, (k_off, nk) in enumerate(k_chunks):
            if nq and nk:
                lo, hi = _band(q_off, k_off, nq, nk, causal, window)
                if lo <= hi:
                    visible[a, b] = (int(lo), int(hi))
    if not visible:
        return ()
    full = {
        (a, b)
        for (a, b), (lo, hi) in visible.items()
        if lo == -(q_chunks[a][1] - 1) and hi == k_chunks[b][1] - 1
    }
    rows = sorted({a for a, _ in visible})
    cols = sorted({b for _, b in visible})
    rectangle = {(a, b) for a in rows for b in cols}
    if (
        full == set(visible) == rectangle
        and rows == list(range(rows[0], rows[-1] + 1))
        and cols == list(range(cols[0], cols[-1] + 1))
    ):
        # Every visible pair is fully visible and they tile one rectangle: one call.
        return (
            _Call(q_rows[rows[0]], q_rows[rows[-1] + 1], k_rows[cols[0]], k_rows[cols[-1] + 1],
                  False, None),
        )  # fmt: skip
    return tuple(
        _band_call(q_rows[a], k_rows[b], q_chunks[a][1], k_chunks[b][1], lo, hi)
        for (a, b), (lo, hi) in sorted(visible.items())
    )


# ---------------------------------------------------------------------------
# Communication


class _Ring:
    """Sends to the next rank and receives from the previous one, in batches.

    ``torch.distributed.batch_isend_irecv`` of P2P ops: asynchronous on every backend
    (gloo runs them on its own threads). On CUDA the ops are issued from a dedicated
    side stream, which first waits for the compute stream (the sent tensors are ready),
    so a transfer overlaps the compute that follows it; :meth:`wait` makes the compute
    stream wait for the side stream before received tensors are read. The handle holds
    the sent and received tensors until then, so the caching allocator cannot hand
    their memory to the compute stream while a transfer still reads or writes it
    (ProcessGroupNCCL also records them on its own stream).
    """

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.world_size)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: list[Any] = []  # started, not yet waited for

    def start(
        self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor]
    ) -> tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]:
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        if self.stream is None:
            works = dist.batch_isend_irecv(ops)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                works = dist.batch_isend_irecv(ops)
        handle = (works, list(send), list(recv))
        self.pending.append(handle)
        return handle

    def wait(self, handle: tuple[list[Any], list[torch.Tensor], list[torch.Tensor]]) -> None:
        works = handle[0]
        self.pending = [h for h in self.pending if h is not handle]
        if self.stream is None:
            for work in works:
                work.wait()  # raises when the process group's timeout expires (gloo)
            return
        with torch.cuda.stream(self.stream):
            for work in works:
                work.wait()  # NCCL: the side stream waits for the transfer
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def drain(self) -> None:
        """Complete the transfers still in flight, ignoring their errors: called when a
        step raised, so that a failure every rank meets alike (the same bad call) leaves
        no transfer behind to be matched by the next call's. (A rank that failed alone
        waits here until the group's timeout, then raises its own error.)"""
        for handle in list(self.pending):
            try:
                self.wait(handle)
            except Exception:
                self.pending = [h for h in self.pending if h is not handle]


# ---------------------------------------------------------------------------
# The ring


@dataclass(frozen=True)
class _Config:
    group: Any
    world_size: int
    rank: int
    layout: str
    seq_len: int  # the full sequence's length
    causal: bool
    window: tuple[int | None, int | None] | None
    softcap: float | None
    scale: float
    backend: Any

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.world_size

    def calls(self, step: int) -> tuple[_Call, ...]:
        return _plan(
            self.world_size, self.rank, self.source(step), self.layout, self.seq_len,
            self.causal, self.window,
        )  # fmt: skip

    def block_like(self, t: torch.Tensor, step: int, dtype: torch.dtype | None = None) -> Any:
        """An empty tensor shaped as ``t`` but for the sequence length of the block held
        at ``step`` (shards may differ in length)."""
        n = local_length(self.seq_len, self.world_size, self.source(step), self.layout)
        return t.new_empty((*t.shape[:2], n, *t.shape[3:]), dtype=dtype or t.dtype)


def _step(
    cfg: _Config,
    call: _Call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attnhub call (``q``, ``k``, ``v`` already sliced to the call's rows), under
    ``backend`` (default: the caller's selection)."""
    result = api.attention(
        q, k, v,
        causal=call.causal, window=call.window, softcap=cfg.softcap, scale=cfg.scale,
        return_lse=True, backend=cfg.backend if backend is None else backend,
    )  # fmt: skip
    return result


def _merge(
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    r0: int,
    r1: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Merge a partial ``(out, lse)`` of rows [r0, r1) into the accumulators, in place.
    Rows with no key yet (lse -inf on both sides) stay zeros with lse -inf."""
    a_lse = acc_lse[..., r0:r1]
    new = torch.logaddexp(a_lse, lse)
    shift = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    w_acc = torch.exp(a_lse - shift).unsqueeze(-1).to(acc_out.dtype)
    w_new = torch.exp(lse - shift).unsqueeze(-1).to(acc_out.dtype)
    rows = acc_out[..., r0:r1, :]
    rows.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    a_lse.copy_(new)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _ring_forward(
    cfg: _Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    ring = _Ring(cfg.group, q.device) if cfg.world_size > 1 else None
    try:
        return _forward_loop(cfg, ring, q, k, v)
    except BaseException:
        if ring is not None:
            ring.drain()
        raise


def _forward_loop(
    cfg: _Config, ring: _Ring | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, n, _ = q.shape
    acc_dtype = _accumulate_dtype(q.dtype)
    # Accumulators: the first call's result when it covers every row (a rank's own
    # block without a window: always the first step's one call), else zeros and -inf.
    acc_out: torch.Tensor | None = None
    acc_lse: torch.Tensor | None = None
    k_blk, v_blk = k.contiguous(), v.contiguous()
    for step in range(cfg.world_size):
        pending = None
        if ring is not None and step < cfg.world_size - 1:
            k_next, v_next = cfg.block_like(k_blk, step + 1), cfg.block_like(v_blk, step + 1)
            pending = ring.start((k_blk, v_blk), (k_next, v_next))  # overlaps the compute
        for call in cfg.calls(step):
            out, lse = _step(
                cfg, call, q[:, :, call.r0 : call.r1],
                k_blk[:, :, call.k0 : call.k1], v_blk[:, :, call.k0 : call.k1],
            )  # fmt: skip
            if acc_out is None and call.r0 == 0 and call.r1 == n:
                if cfg.world_size == 1 and len(cfg.calls(0)) == 1:
                    return out, lse.float()  # one call: its answer, not a copy of it
                acc_out, acc_lse = out.to(acc_dtype), lse.to(acc_dtype)
                continue
            if acc_out is None or acc_lse is None:
                acc_out = torch.zeros(b, hq, n, v.shape[-1], dtype=acc_dtype, device=q.device)
                # The lse is float32 (the contract's); merged in the accumulation dtype.
                acc_lse = torch.full((b, hq, n), -math.inf, dtype=acc_dtype, device=q.device)
            _merge(acc_out, acc_lse, call.r0, call.r1, out, lse)
        if pending is not None and ring is not None:
            ring.wait(pending)
            k_blk, v_blk = k_next, v_next
    if acc_out is None or acc_lse is None:  # no call at all: every row fully masked
        acc_out = torch.zeros(b, hq, n, v.shape[-1], dtype=q.dtype, device=q.device)
        acc_lse = torch.full((b, hq, n), -math.inf, dtype=torch.float32, device=q.device)
    return acc_out.to(q.dtype), acc_lse.float()


def _step_grads(
    cfg: _Config,
    call: _Call,
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one call's rows and keys: the call recomputed under autograd and
    differentiated through its out and lse (see the module doc)."""
    rows = slice(call.r0, call.r1)
    qs = q[:, :, rows].detach().requires_grad_(True)
    ks = k_blk[:, :, call.k0 : call.k1].detach().requires_grad_(True)
    vs = v_blk[:, :, call.k0 : call.k1].detach().requires_grad_(True)
    # Recomputed under autograd, the call returns its lse with a gradient: dispatch
    # offers it only backends that declare lse_grad (PyTorch's fused kernels do not).
    with torch.enable_grad():
        out_j, lse_j = _step(cfg, call, qs, ks, vs)
    acc = delta.dtype
    lse_rows = lse[:, :, rows].to(acc)
    finite = torch.isfinite(lse_rows)
    weight = torch.where(
        finite, torch.exp(lse_j.detach().to(acc) - torch.where(finite, lse_rows, 0.0)), 0.0
    )
    dout_rows = dout[:, :, rows].to(acc)
    d_out_j = (weight.unsqueeze(-1) * dout_rows).to(out_j.dtype)
    d_lse_j = weight * ((dout_rows * out_j.detach().to(acc)).sum(-1) - delta[:, :, rows])
    dq, dk, dv = torch.autograd.grad(
        (out_j, lse_j), (qs, ks, vs), (d_out_j, d_lse_j.to(lse_j.dtype)), allow_unused=True
    )
    dq = torch.zeros_like(qs) if dq is None else dq
    dk = torch.zeros_like(ks) if dk is None else dk
    dv = torch.zeros_like(vs) if dv is None else dv
    return dq, dk, dv


def _ring_backward(
    cfg: _Config,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ring = _Ring(cfg.group, q.device) if cfg.world_size > 1 else None
    try:
        return _backward_loop(cfg, ring, q, k, v, out, lse, dout, dlse)
    except BaseException:
        if ring is not None:
            ring.drain()
        raise


def _backward_loop(
    cfg: _Config,
    ring: _Ring | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor | None,
    dlse: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = _accumulate_dtype(q.dtype)
    if dout is None:
        dout = torch.zeros_like(out)
    # delta = d out . out - d lse, per row: the part of every step's lse gradient that
    # depends on the merged result.
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        delta = delta - torch.where(torch.isfinite(lse), dlse.to(acc), 0.0)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_blk, v_blk = k.contiguous(), v.contiguous()
    dkv_pending = None
    dk_in = dv_in = None
    for step in range(cfg.world_size):
        kv_pending = None
        if ring is not None and step < cfg.world_size - 1:
            k_next, v_next = cfg.block_like(k_blk, step + 1), cfg.block_like(v_blk, step + 1)
            kv_pending = ring.start((k_blk, v_blk), (k_next, v_next))
        dk_blk = torch.zeros(k_blk.shape, dtype=acc, device=k.device)
        dv_blk = torch.zeros(v_blk.shape, dtype=acc, device=v.device)
        for call in cfg.calls(step):
            gq, gk, gv = _step_grads(cfg, call, q, k_blk, v_blk, dout, delta, lse)
            dq[:, :, call.r0 : call.r1] += gq
            dk_blk[:, :, call.k0 : call.k1] += gk
            dv_blk[:, :, call.k0 : call.k1] += gv
        if ring is not None:
            # The block's gradient so far arrives from the previous rank one hop behind
            # its key/value; add ours and pass it on (after R hops it is home).
            if dkv_pending is not None and dk_in is not None and dv_in is not None:
                ring.wait(dkv_pending)
                dk_blk += dk_in
                dv_blk += dv_in
            # What arrives is the gradient of the block held next (at the last step:
            # of this rank's own block, step R being step 0).
            dk_in, dv_in = cfg.block_like(dk_blk, step + 1), cfg.block_like(dv_blk, step + 1)
            dkv_pending = ring.start((dk_blk, dv_blk), (dk_in, dv_in))
        if kv_pending is not None and ring is not None:
            ring.wait(kv_pending)
            k_blk, v_blk = k_next, v_next
    if ring is None:
        dk_own, dv_own = dk_blk, dv_blk
    else:
        assert dkv_pending is not None and dk_in is not None and dv_in is not None
        ring.wait(dkv_pending)
        dk_own, dv_own = dk_in, dv_in
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention with a ring backward (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, q: Any, k: Any, v: Any, cfg: _Config) -> Any:
        out, lse = _ring_forward(cfg, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Any, dlse: Any) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.cfg, q, k, v, out, lse, dout, dlse)
        if torch.is_grad_enabled():  # create_graph=True: the gradients must not be
            needed = [t for t in (dout, dlse, q, k, v) if t is not None and t.requires_grad]
            if needed:  # differentiated again as if they had no attention terms
                dq, dk, dv = _FirstDerivativeOnly.apply(3, dq, dk, dv, *needed)
        return dq, dk, dv, None


DOUBLE_BACKWARD_ERROR = (
    "the derivative for attnhub.distributed's ring attention backward is not implemented "
    "(its gradients are first derivatives only)"
)


class _FirstDerivativeOnly(torch.autograd.Function):
    """``apply(count, *tensors)`` returns ``tensors[:count]`` (the gradients) as outputs
    of one node linked to every tensor that requires grad among the rest (the incoming
    gradients and the inputs); differentiating them raises, as contract.md asks of a
    backward that is not itself differentiable (the ring's gradients come from detached
    recomputations, so a graph through them would silently lack every attention term).
    The same construction as triton_flash's."""

    @staticmethod
    def forward(ctx: Any, count: int, *tensors: Any) -> Any:
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


# ---------------------------------------------------------------------------
# Validation across ranks

_DTYPE_CODES = {
    torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4,
}  # fmt: skip


def _as_int(value: Any) -> int:
    """An option as an int64 that means the same on every process (``hash`` of a str
    does not: it is salted per process)."""
    if value is None:
        return -1
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return int(value)


def _check_ranks(
    group: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int | None,
    layout: str,
    facts: tuple[Any, ...],
    local_problem: str | None = None,
) -> None:
    """The same shapes (but for the sequence length), dtype and options on every rank,
    and each rank's shard length that of its shard of a ``seq_len`` sequence (None:
    rank 0's shard length times the world size, the same on every rank): checked with
    one small all-gather on every call, so that every rank raises the same ValueError
    instead of some of them waiting in the ring for the others, or each computing
    with its own options. (Not once per signature: a rank that skipped the check for a
    signature it had seen would leave a rank that had not waiting in the all-gather,
    and options differing only in a later call would go unseen.) On NCCL the result is
    read on the host: the call waits for the device once there."""
    mine = [*q.shape, *k.shape, *v.shape, _DTYPE_CODES.get(q.dtype, 0), *map(_as_int, facts)]
    rows = _gather_ints(group, mine, q.device)
    world_size = len(rows)

    def rest(row: list[int]) -> list[int]:  # all but the three sequence lengths
        return row[:2] + row[3:6] + row[7:10] + row[11:]

    problems = [] if local_problem is None else [local_problem]
    if any(rest(row) != rest(rows[0]) for row in rows):
        listing = "; ".join(f"rank {r}: {row[:12]}" for r, row in enumerate(rows))
        what = "shapes" if all(row[12:] == rows[0][12:] for row in rows) else "dtype or options"
        problems.append(f"the {what} differ between ranks (q, k, v shapes: {listing})")
    lengths = [(row[2], row[6], row[10]) for row in rows]
    n = rows[0][2] * world_size if seq_len is None else seq_len
    expected = [local_length(n, world_size, r, layout) for r in range(world_size)]
    if lengths != [(n, n, n) for n in expected]:
        problems.append(
            f"the shards' (q, k, v) lengths per rank are {lengths}, and {layout} shards of a "
            f"sequence of {n} have lengths {expected} (attnhub.distributed.shard cuts "
            "them; where they differ between ranks, pass seq_len=)"
        )
    if problems:
        raise ValueError("context_parallel_attention: " + "; ".join(problems))


def _selection_fact(backend: str | Sequence[str] | None) -> tuple[int, str | None]:
    """(the backend selection every ring step will use: ``backend=``, else
    ``use_backend`` or ``ATTNHUB_BACKEND``, and strictness, as an int that is the same
    on every process for the same selection; why it cannot serve, or None). A name no
    backend has is not raised here but by :func:`_check_ranks`, after the all-gather,
    so that the other ranks do not wait in it for this one."""
    selection = dispatch.current_selection(backend)
    registry = get_registry()
    problem = None
    for name in selection.names or ():
        try:
            registry.get(name)
        except ValueError as exc:  # names the known backends
            problem = str(exc)
            break
    text = f"{','.join(selection.names or ('*',))};{int(selection.strict)}"
    return zlib.crc32(text.encode()), problem


# ---------------------------------------------------------------------------
# The call


@torch.compiler.disable  # communication and Python control flow: runs eagerly, see docs
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group: Any = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    layout: str = "zigzag",
    seq_len: int | None = None,
    backend: str | Sequence[str] | None = None,
    alignment: str = "top_left",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its shard, as :func:`shard` cuts it (the same ``layout``), and
    gets its shard of the output of one :func:`attnhub.attention` call on the full
    sequence: ``unshard([out of rank r for r in ranks])`` equals
    ``attnhub.attention(Q, K, V, causal=..., window=..., ...)`` on the gathered
    Q, K, V, within the contract's tolerance, and so do the gradients.

    Args:
        query: (B, Hq, N_local, D), this rank's shard.
        key: (B, Hkv, N_local, D); Hq a multiple of Hkv (grouped-query attention).
        value: (B, Hkv, N_local, Dv).
        group: the process group (None: the default group). One process per device.
        causal, window, softcap, scale: as :func:`attnhub.attention`, in global
            positions.
        alignment: "top_left" or "bottom_right", accepted for the signature's sake:
            the full query and key sequences have equal lengths, so both are the same.
        return_lse: also return this rank's rows of the float32 (B, Hq, N_local) lse.
        layout: "zigzag" (rank r holds chunks r and 2R-1-r of 2R: balanced under a
            causal mask) or "contiguous" (rank r holds chunk r of R).
        seq_len: the full sequence's length N; None means ``N_local * R`` (every rank's
            shard of the same length). Needed where N makes the shards' lengths differ
            (N not a multiple of the chunk count: :func:`local_length`).
        backend: passed to every ring step's ``attnhub.attention`` (None: dispatch
            chooses among backends that return an lse). For gradients the backend's
            lse must carry a gradient (see the module doc).

    Returns:
        This rank's output (B, Hq, N_local, Dv) in the query's dtype, or ``(out, lse)``.

    Raises:
        TypeError, ValueError: bad input (as :func:`attnhub.attention`, named), before
            any communication; shards whose shapes, dtypes or options differ between
            ranks, or whose lengths are not those :func:`shard` gives for ``seq_len``
            (every rank raises alike). Attention masks, dropout and block sparsity are
            not supported.
        RuntimeError: a peer that does not take part, once the group's timeout expires.
    """
    layout = _check_layout(layout)
    _check_group(group)
    api._validate(
        query, key, value, None,
        {"causal": causal, "alignment": alignment, "window": None, "softcap": softcap,
         "scale": scale, "dropout_p": 0.0, "block_sparse": None, "return_lse": return_lse},
    )  # fmt: skip
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            "context_parallel_attention needs query and key shards of the same length "
            f"(self-attention over one sharded sequence), got Nq={query.shape[2]} and "
            f"Nk={key.shape[2]}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context_parallel_attention needs an initialized torch.distributed process "
            "group (torch.distributed.init_process_group)"
        )
    if group is None:
        group = dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of group")
    if seq_len is None:
        n_total = query.shape[2] * world_size
    elif isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be None or an int >= 0, got {seq_len!r}")
    else:
        n_total = seq_len
    resolved = make_params(
        query, key=key, causal=causal, alignment="top_left", window=None, softcap=softcap,
        scale=scale, dropout_p=0.0, block_sparse=None, return_lse=return_lse,
    )  # fmt: skip
    sides = _check_window(window, 2 * n_total)
    selection, unusable = _selection_fact(backend)
    # Whether the call records a backward: a rank whose shard needs no gradient would
    # not take part in the others' backward ring.
    needs_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    options = (
        LAYOUTS.index(layout), causal, *(sides or (None, None)), sides is None,
        resolved.softcap, resolved.scale, seq_len, selection, needs_grad,
    )  # fmt: skip
    _check_ranks(group, query, key, value, seq_len, layout, options, unusable)
    cfg = _Config(
        group=group, world_size=world_size, rank=rank, layout=layout, seq_len=n_total,
        causal=causal, window=sides, softcap=resolved.softcap, scale=resolved.scale,
        backend=backend,
    )  # fmt: skip
    if query.shape[0] == 0 or query.shape[1] == 0 or key.shape[1] == 0 or n_total == 0:
        # Empty on every rank (checked): B, H or the whole sequence is 0, and the local
        # call gives the empty answer, with autograd; no ring is needed. (A rank whose
        # shard alone is empty, a sequence shorter than the chunk count, still relays
        # the others' blocks around the ring.)
        return api.attention(
            query, key, value, causal=causal, softcap=softcap, scale=scale,
            return_lse=return_lse, backend=backend,
        )  # fmt: skip
    if needs_grad:
        out, lse = _RingAttention.apply(query, key, value, cfg)
    else:
        out, lse = _ring_forward(cfg, query, key, value)
    return (out, lse) if return_lse else out
