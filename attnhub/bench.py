"""``attnhub bench``: backends timed side by side, in one process, on one protocol.

The protocol is the one in ``shared/perf/anchors-h200.md``, so numbers compare:

- grid: dtypes x head dims D x sequence lengths N x causal, with batch
  ``B = tokens // N`` and heads ``H = hidden // D`` (16384 and 2048 by default), so
  every point does the same work per token;
- time with ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
  on CUDA (a median of a few ``time.perf_counter`` repetitions on CPU, for tests);
- modes: ``fwd`` (inputs that do not require grad: the call an inference step makes),
  ``fwd_bwd`` (forward, then backward of a fresh random output gradient) and ``bwd``
  = time(fwd_bwd) - time(the same forward with inputs that require grad, which is the
  forward the fwd_bwd run executes);
- FLOPs count the matrix products only: forward 4 * B * H * Nq * Nk * D, halved when
  causal (a sliding window counts the key/query pairs it keeps); backward 2.5x and
  forward+backward 3.5x the forward;
- peak memory: ``torch.cuda.max_memory_allocated()`` over one call after a reset,
  minus what was allocated before it (the inputs);
- fresh ``torch.randn`` inputs per grid point, shared by every competitor.

The block-sparse extra (``--block-sparse``, off by default; issue 5): bf16, B=2, H=16,
N=8192, D=128, non-causal, layouts of 128 x 128 blocks (``attnhub.BlockSparseLayout``):
random at densities 1, 0.5, 0.25, 0.1, 0.05 (a fixed seed; exactly round(s * blocks)
blocks kept), a sliding window of 1024 tokens and BigBird. ``triton_blocksparse`` and
``flex_attention`` (with a BlockMask of the same blocks) run each layout; dense
``triton_flash`` runs the same shape once (``"layout": ["dense", 0]``, density null);
and a memory point at N=65536 (sliding window, the same B, H, D) shows how peak memory
grows with N. Block-sparse rows carry ``"density"`` (the fraction of kept blocks),
``"layout"`` ([kind, parameter]) and ``"block_size"``; their FLOPs count the (query,
key) pairs inside kept blocks (the work a block-sparse kernel does, masked pairs of
partial blocks included), i.e. density * Nq * Nk when N is a multiple of the block.

Competitors: registered backends through ``attnhub.attention(..., backend=name)``
(skipped, with the reasons ``attnhub.explain`` gives, where they cannot serve),
``flex_attention`` timed directly (``torch.compile(flex_attention, dynamic=False)``
with a causal ``BlockMask``; it is never registered as a backend), and ``auto``
(``attnhub.attention`` with no backend; the row's ``chosen`` says what it picked).

Output: ``{"env": {...}, "results": [...], "skipped": [...], ...}``, rewritten after
every grid point so that a run cut short still leaves its results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .cli import positive_float, positive_int
from .jsonfile import write_json
from .request import dtype_name, dtype_tag

MODES = ("fwd", "bwd", "fwd_bwd")
FLEX = "flex_attention"
AUTO = "auto"
DEFAULT_BACKENDS = (
    "triton_flash",
    "torch_sdpa_flash",
    "torch_sdpa_cudnn",
    "torch_sdpa_efficient",
    "xformers",
    FLEX,
    AUTO,
)
DEFAULT_DTYPES = ("bfloat16", "float16")
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
# FlexAttention compiles once per shape (static shapes, about 5 s each on the H200);
# by default it runs at the sequence lengths the targets name.
DEFAULT_FLEX_SEQLENS = (1024, 4096, 16384)
DEFAULT_WINDOWS = (256, 1024, 4096)
# The sliding-window extra: bf16, B=2, H=16, N=16384, D=128, causal, window (W-1, 0).
WINDOW_SHAPE = (2, 16, 16384, 128)
# The block-sparse extra (issue 5): bf16, B=2, H=16, N=8192, D=128, block 128, non-causal.
BLOCK_SPARSE_SHAPE = (2, 16, 8192, 128)
BLOCK_SIZE = 128
# A layout spec is (kind, parameter): ("random", density), ("sliding_window", window in
# tokens: query i keeps keys i - W..i), ("bigbird", random blocks per query block; one
# global block and a band of 3 blocks), ("strided", stride in blocks), ("causal", 0).
# ("dense", 0) is the dense baseline: no block_sparse at all.
LayoutSpec = tuple[str, float]
DENSE: LayoutSpec = ("dense", 0)
LAYOUT_KINDS = ("random", "sliding_window", "bigbird", "strided", "causal")
DEFAULT_BLOCK_SPARSE_LAYOUTS: tuple[LayoutSpec, ...] = (
    ("random", 1.0),
    ("random", 0.5),
    ("random", 0.25),
    ("random", 0.1),
    ("random", 0.05),
    ("sliding_window", 1024),
    ("bigbird", 2),
)
BLOCK_SPARSE_BACKENDS = ("triton_blocksparse", FLEX)
BLOCK_SPARSE_DENSE_BACKENDS = ("triton_flash",)
# The memory point: the extra's B, H, D at N = 64K, with a cheap (linear) layout.
DEFAULT_BLOCK_SPARSE_LONG_SEQLENS = (65536,)
BLOCK_SPARSE_LONG_LAYOUT: LayoutSpec = ("sliding_window", 1024)

_DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPE_ALIASES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; use one of {', '.join(_DTYPE_ALIASES)}"
        ) from None


# -- the grid ------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One shape of the grid: every competitor runs on the same random inputs."""

    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    window: int | None = None  # W keys: window=(W - 1, 0)
    # The block-sparse extra: the layout spec (DENSE: the dense baseline) and its block.
    layout: LayoutSpec | None = None
    block_size: int | None = None
    # Filled in once the layout is built: its density and the token pairs it keeps.
    density: float | None = None
    kept_pairs: float | None = None

    def pairs(self) -> float:
        """(query, key) pairs computed, as the protocol counts them."""
        n = self.seqlen
        if self.kept_pairs is not None:
            return self.kept_pairs  # pairs inside the layout's kept blocks
        if self.window is not None:
            w = min(self.window, n)
            return float(w * n - w * (w - 1) // 2)  # causal window: min(i + 1, W) keys
        return n * n / 2 if self.causal else float(n * n)

    def flops(self, mode: str) -> float:
        return 4.0 * self.batch * self.heads * self.head_dim * self.pairs() * _FLOP_FACTOR[mode]

    @property
    def sparse(self) -> bool:
        """A block-sparse point (not the dense baseline)."""
        return self.layout is not None and self.layout[0] != DENSE[0]

    def label(self) -> str:
        text = (
            f"{dtype_tag(self.dtype)} B{self.batch} H{self.heads} N{self.seqlen} D{self.head_dim}"
        )
        text += " causal" if self.causal else ""
        if self.layout is not None:
            text += f" {layout_label(self.layout)}"
        return text + (f" window {self.window}" if self.window is not None else "")

    def where(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "dtype": self.dtype,
            "B": self.batch,
            "Hq": self.heads,
            "Nq": self.seqlen,
            "D": self.head_dim,
            "causal": self.causal,
        }
        if self.window is not None:
            row["window"] = [self.window - 1, 0]
        if self.layout is not None:
            row["layout"] = list(self.layout)
            row["block_size"] = self.block_size
        return row


def layout_label(spec: Sequence[Any]) -> str:
    """``random 0.25``, ``sliding_window 1024``, ``dense``: a layout spec for people."""
    kind, param = spec[0], spec[1]
    return kind if kind in (DENSE[0], "causal") else f"{kind} {param:g}"


@dataclass(frozen=True)
class BenchConfig:
    """What to time. The defaults are the full H200 grid of the issue."""

    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    head_dims: tuple[int, ...] = DEFAULT_HEAD_DIMS
    seqlens: tuple[int, ...] = DEFAULT_SEQLENS
    causal: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = MODES
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    tokens: int = 16384  # B = tokens // N
    hidden: int = 2048  # H = hidden // D
    grid: bool = True
    windows: tuple[int, ...] = ()  # the sliding-window extra (empty: not run)
    window_shape: tuple[int, int, int, int] = WINDOW_SHAPE
    flex_seqlens: tuple[int, ...] | None = DEFAULT_FLEX_SEQLENS  # None: every N
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    warmup: int = 25  # do_bench warmup, ms
    rep: int = 100  # do_bench repetitions, ms
    cpu_reps: int = 5  # perf_counter repetitions on CPU (median)
    memory: bool = True
    time_budget: float | None = None  # seconds; points not started by then are skipped
    flex_on_cpu: bool = False  # compiling FlexAttention on CPU is slow; tests only
    # The block-sparse extra (empty layouts and long seqlens: not run).
    block_sparse_layouts: tuple[LayoutSpec, ...] = ()
    block_sparse_shape: tuple[int, int, int, int] = BLOCK_SPARSE_SHAPE
    block_size: int = BLOCK_SIZE
    block_sparse_dtype: str = "bfloat16"
    block_sparse_backends: tuple[str, ...] = BLOCK_SPARSE_BACKENDS  # on the layouts
    block_sparse_dense_backends: tuple[str, ...] = BLOCK_SPARSE_DENSE_BACKENDS  # baseline
    block_sparse_long_seqlens: tuple[int, ...] = ()  # memory points: N (B, H, D as above)
    block_sparse_long_layout: LayoutSpec = BLOCK_SPARSE_LONG_LAYOUT
    block_sparse_seed: int = 0  # random and BigBird layouts

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
        for name in self.dtypes:
            parse_dtype(name)
        if not self.backends:
            raise ValueError("no backends to time")
        if len(self.window_shape) != 4:
            raise ValueError(f"window_shape must be B,H,N,D, got {self.window_shape!r}")
        if len(self.block_sparse_shape) != 4:
            raise ValueError(f"block_sparse_shape must be B,H,N,D, got {self.block_sparse_shape!r}")
        sizes = {
            "head_dims": self.head_dims,
            "seqlens": self.seqlens,
            "windows": self.windows,
            "window_shape": self.window_shape,
            "block_sparse_shape": self.block_sparse_shape,
            "block_sparse_long_seqlens": self.block_sparse_long_seqlens,
            "flex_seqlens": self.flex_seqlens or (),
            "tokens": (self.tokens,),
            "hidden": (self.hidden,),
            "block_size": (self.block_size,),
            "rep": (self.rep,),
            "cpu_reps": (self.cpu_reps,),
        }
        for name, values in sizes.items():
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0 ms, got {self.warmup}")
        parse_dtype(self.block_sparse_dtype)
        for spec in (*self.block_sparse_layouts, self.block_sparse_long_layout):
            check_layout_spec(spec)

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """About a minute on the H200: bf16, D=128, N in {1024, 4096}, causal no/yes."""
        base = {"dtypes": ("bfloat16",), "head_dims": (128,), "seqlens": (1024, 4096)}
        return cls(**{**base, **overrides})

    def points(self) -> list[Point]:
        points = []
        if self.grid:
            for dtype in self.dtypes:
                for d in self.head_dims:
                    for n in self.seqlens:
                        for causal in self.causal:
                            batch, heads = self.tokens // n, self.hidden // d
                            if batch >= 1 and heads >= 1:
                                name = dtype_name(parse_dtype(dtype))
                                points.append(Point(name, batch, heads, n, d, causal))
        b, h, n, d = self.window_shape
        for w in self.windows:
            points.append(Point("bfloat16", b, h, n, d, True, w))
        b, h, n, d = self.block_sparse_shape
        dtype = dtype_name(parse_dtype(self.block_sparse_dtype))
        specs = [DENSE, *self.block_sparse_layouts] if self.block_sparse_layouts else []
        runs = [(n, spec) for spec in specs]
        runs += [
            (long_n, self.block_sparse_long_layout) for long_n in self.block_sparse_long_seqlens
        ]
        for seqlen, spec in runs:
            points.append(
                Point(dtype, b, h, seqlen, d, False, layout=spec, block_size=self.block_size)
            )
        return points

    def backends_for(self, point: Point) -> tuple[str, ...]:
        """The competitors of a point: the grid's, or the block-sparse extra's."""
        if point.layout is None:
            return self.backends
        return self.block_sparse_backends if point.sparse else self.block_sparse_dense_backends


# -- timing --------------------------------------------------------------------


def time_ms(
    fn: Callable[[], Any],
    device: torch.device,
    config: BenchConfig,
    grads: Sequence[torch.Tensor] = (),
) -> float:
    """Median milliseconds of ``fn``: do_bench on CUDA, perf_counter elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(
            do_bench(
                fn,
                warmup=config.warmup,
                rep=config.rep,
                grad_to_none=list(grads) or None,
                return_mode="median",
            )
        )
    fn()  # warm up (first-call work: caches, lazy imports)
    times = []
    for _ in range(max(1, config.cpu_reps)):
        for t in grads:
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def peak_mib(
    fn: Callable[[], Any], device: torch.device, grads: Sequence[torch.Tensor]
) -> float | None:
    """Peak memory of one call beyond what was allocated before it (None off CUDA)."""
    if device.type != "cuda":
        return None
    for t in grads:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    for t in grads:
        t.grad = None
    return peak / 2**20


# -- FlexAttention, timed directly -----------------------------------------------

_flex_state: dict[str, Any] = {}


def _flex_compiled() -> Callable[..., Any]:
    """``torch.compile(flex_attention, dynamic=False)`` with dynamo's caches raised.

    With dynamo's default limits, the second new shape compiles a dynamic-shape kernel
    and the ninth runs eagerly (anchors-h200.md); the grid needs a static kernel each.
    """
    if "compiled" not in _flex_state:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name, value in (
            ("cache_size_limit", 1024),
            ("recompile_limit", 1024),
            ("accumulated_cache_size_limit", 16384),
        ):
            if hasattr(cfg, name):
                setattr(cfg, name, max(int(getattr(cfg, name)), value))
        _flex_state["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled: Callable[..., Any] = _flex_state["compiled"]
    return compiled


def _causal_mod(
    b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
) -> torch.Tensor:
    return q >= kv


def _window_mod(w: int) -> Callable[..., torch.Tensor]:
    mods: dict[int, Callable[..., torch.Tensor]] = _flex_state.setdefault("window_mods", {})
    if w not in mods:

        def mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return (q >= kv) & (q - kv < w)

        mods[w] = mod
    return mods[w]


def _flex_block_mask(point: Point, device: torch.device) -> Any:
    """The causal (or sliding-window) BlockMask, built once per length and reused."""
    if not point.causal and point.window is None:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    key = (point.seqlen, point.causal, point.window, str(device))
    masks: dict[Any, Any] = _flex_state.setdefault("block_masks", {})
    if key not in masks:
        mod = _causal_mod if point.window is None else _window_mod(point.window)
        masks[key] = create_block_mask(mod, None, None, point.seqlen, point.seqlen, device=device)
    return masks[key]


# -- block-sparse layouts ---------------------------------------------------------


def check_layout_spec(spec: Any) -> None:
    """ValueError unless ``spec`` is a (kind, parameter) pair the extra can build."""
    if not isinstance(spec, tuple) or len(spec) != 2 or not isinstance(spec[0], str):
        raise ValueError(f"a layout spec is a (kind, parameter) pair, got {spec!r}")
    kind, param = spec
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"unknown layout kind {kind!r}; kinds are {', '.join(LAYOUT_KINDS)}")
    if not isinstance(param, (int, float)) or isinstance(param, bool):
        raise ValueError(f"layout {kind}: the parameter must be a number, got {param!r}")
    if kind == "random" and not 0 < param <= 1:
        raise ValueError(f"random layout: density must be in (0, 1], got {param!r}")
    if kind in ("sliding_window", "bigbird") and param < 0:
        raise ValueError(f"{kind} layout: the parameter must be >= 0, got {param!r}")
    if kind == "strided" and param < 1:
        raise ValueError(f"strided layout: the stride must be >= 1, got {param!r}")


def build_layout(
    spec: LayoutSpec, seqlen: int, block_size: int, *, seed: int = 0, device: Any = "cpu"
) -> Any:
    """The ``attnhub.BlockSparseLayout`` of a spec, for Nq = Nk = ``seqlen``.

    ``("random", s)`` keeps exactly round(s * blocks) blocks (at least one), drawn with
    a generator seeded with ``seed``, the same blocks in every batch and head; so
    density 1.0 keeps every block and the densities are s up to rounding.
    """
    from .block_sparse import BlockSparseLayout

    check_layout_spec(spec)
    kind, param = spec
    if kind == "random":
        blocks = -(-seqlen // block_size)
        total = blocks * blocks
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        keep = torch.zeros(total, dtype=torch.bool)
        keep[order[: max(1, round(param * total))]] = True
        mask = keep.view(1, 1, blocks, blocks).to(device)
        return BlockSparseLayout.from_block_mask(mask, block_size)
    if kind == "sliding_window":
        return BlockSparseLayout.sliding_window(seqlen, int(param), block_size, device=device)
    if kind == "bigbird":
        return BlockSparseLayout.bigbird(
            seqlen, block_size, random_blocks=int(param), seed=seed, device=device
        )
    if kind == "strided":
        return BlockSparseLayout.strided(seqlen, block_size, stride=int(param), device=device)
    return BlockSparseLayout.causal(seqlen, block_size, device=device)


def kept_pairs(layout: Any, seqlen: int) -> float:
    """Token pairs inside the layout's kept blocks (blocks clipped at N), averaged over
    the layout's batch and heads: density * N * N when N is a multiple of the block."""
    bq, bk = layout.block_size
    nqb, nkb = layout.shape[2:]
    rows = torch.full((nqb,), float(bq))
    rows[-1] = seqlen - bq * (nqb - 1)
    cols = torch.full((nkb,), float(bk))
    cols[-1] = seqlen - bk * (nkb - 1)
    kept = layout.block_mask.float().mean(dim=(0, 1)).cpu()
    return float((kept * rows[:, None] * cols[None, :]).sum())


# (spec, N, block, seed, device) -> layout; built once, so that the compressed index
# lists a kernel builds on first use are built once too, outside the timed calls.
_layouts: dict[tuple[Any, ...], Any] = {}


def _layout_for(point: Point, device: torch.device, seed: int) -> Any:
    assert point.layout is not None and point.block_size is not None
    key = (point.layout, point.seqlen, point.block_size, seed, str(device))
    if key not in _layouts:
        _layouts[key] = build_layout(
            point.layout, point.seqlen, point.block_size, seed=seed, device=device
        )
    return _layouts[key]


def flex_layout_block_mask(layout: Any, seqlen: int, *, exact: bool) -> Any:
    """FlexAttention's ``BlockMask`` with the layout's blocks: its compressed per-query-
    block lists as they are (full blocks as ``full_kv_*``, partial ones as ``kv_*``),
    at the layout's block size.

    The compiled kernel visits only the listed blocks and evaluates ``mask_mod`` on the
    partial ones only, so there ``mask_mod`` is the layout's own token-level mask_mod
    (none when every kept block is full): the BlockMask a FlexAttention user would
    write. FlexAttention's eager path (CPU) ignores the lists and evaluates ``mask_mod``
    at every pair, so ``exact`` gives a mask_mod equal to ``layout.to_dense_mask``.
    """
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = layout.kv_lists()
    mask_mod = layout.token_mask_mod() if exact else layout.mask_mod
    return BlockMask.from_kv_blocks(
        partial.num,
        partial.indices,
        full.num,
        full.indices,
        BLOCK_SIZE=layout.block_size,
        mask_mod=mask_mod,
        seq_lengths=(seqlen, seqlen),
    )


# -- one grid point --------------------------------------------------------------


@dataclass
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    vg: torch.Tensor
    dout: torch.Tensor

    @property
    def grads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.qg, self.kg, self.vg)


def _make_inputs(point: Point, device: torch.device) -> _Inputs:
    dtype = parse_dtype(point.dtype)
    shape = (point.batch, point.heads, point.seqlen, point.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn(shape, dtype=dtype, device=device)
    return _Inputs(q, k, v, qg, kg, vg, dout)


@dataclass
class _Calls:
    """What to time for one competitor: forward without and with grad, and fwd+bwd."""

    fwd: Callable[[], Any]
    fwd_train: Callable[[], Any]
    chosen: dict[str, str] = field(default_factory=dict)  # mode -> backend (auto only)
    unavailable: dict[str, str] = field(default_factory=dict)  # "fwd"/"train" -> reason


def _attnhub_calls(name: str, point: Point, x: _Inputs, layout: Any = None) -> _Calls:
    import attnhub

    backend = None if name == AUTO else name
    window = None if point.window is None else (point.window - 1, 0)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        return lambda: attnhub.attention(
            q, k, v, causal=point.causal, window=window, block_sparse=layout, backend=backend
        )

    calls = _Calls(call(x.q, x.k, x.v), call(x.qg, x.kg, x.vg))
    for kind, (q, k, v) in (("fwd", (x.q, x.k, x.v)), ("train", x.grads)):
        decision = attnhub.explain(
            q, k, v, causal=point.causal, window=window, block_sparse=layout, backend=backend
        )
        if decision.chosen is None:
            reasons = decision.reasons().get(name) if backend else None
            calls.unavailable[kind] = "; ".join(reasons or ()) or "no backend can serve this call"
        elif backend is None:
            calls.chosen[kind] = decision.chosen
    return calls


def _flex_calls(
    point: Point, x: _Inputs, device: torch.device, config: BenchConfig, layout: Any = None
) -> _Calls | str:
    if device.type != "cuda" and not config.flex_on_cpu:
        return "compiled FlexAttention is timed on CUDA only"
    if (
        point.window is None
        and point.layout is None
        and config.flex_seqlens is not None
        and point.seqlen not in config.flex_seqlens
    ):
        allowed = ", ".join(map(str, config.flex_seqlens))
        return f"FlexAttention runs at N in {{{allowed}}} only (one compile per shape; --flex-seqlens all)"
    try:
        compiled = _flex_compiled()
        if layout is None:
            block_mask = _flex_block_mask(point, device)
        else:
            block_mask = _flex_layout_mask(point, layout, device)
    except Exception as exc:
        return f"FlexAttention unavailable: {type(exc).__name__}: {_first_line(exc)}"

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        return lambda: compiled(q, k, v, block_mask=block_mask)

    return _Calls(call(x.q, x.k, x.v), call(x.qg, x.kg, x.vg))


def _flex_layout_mask(point: Point, layout: Any, device: torch.device) -> Any:
    """The layout's BlockMask, built once per layout (see flex_layout_block_mask)."""
    key = (point.layout, point.seqlen, point.block_size, id(layout), str(device))
    masks: dict[Any, Any] = _flex_state.setdefault("layout_masks", {})
    if key not in masks:
        # The layout is kept alive beside its BlockMask, so its id is not reused.
        block_mask = flex_layout_block_mask(layout, point.seqlen, exact=device.type != "cuda")
        masks[key] = (layout, block_mask)
    return masks[key][1]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


class _Recorder:
    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []

    def skip(self, backend: str, point: Point, modes: Iterable[str], reason: str) -> None:
        modes = list(modes)
        if modes:
            self.skipped.append(
                {"backend": backend, **point.where(), "modes": modes, "reason": reason}
            )

    def add(
        self,
        backend: str,
        point: Point,
        mode: str,
        ms: float,
        peak: float | None,
        chosen: str | None,
    ) -> None:
        tflops = point.flops(mode) / (ms * 1e-3) / 1e12 if ms > 0 else None
        row: dict[str, Any] = {
            "backend": backend,
            "dtype": point.dtype,
            "B": point.batch,
            "Hq": point.heads,
            "Hkv": point.heads,
            "Nq": point.seqlen,
            "Nk": point.seqlen,
            "D": point.head_dim,
            "causal": point.causal,
            "mode": mode,
            "ms": ms,
            "tflops": tflops,
            "peak_mib": peak,
            "density": point.density,
        }
        if point.window is not None:
            row["window"] = [point.window - 1, 0]
        if point.layout is not None:
            row["layout"] = list(point.layout)
            row["block_size"] = point.block_size
        if chosen is not None:
            row["chosen"] = chosen
        self.results.append(row)


def _run_competitor(
    name: str,
    point: Point,
    x: _Inputs,
    device: torch.device,
    config: BenchConfig,
    rec: _Recorder,
    layout: Any = None,
) -> None:
    modes = [m for m in MODES if m in config.modes]
    calls = (
        _flex_calls(point, x, device, config, layout)
        if name == FLEX
        else _attnhub_calls(name, point, x, layout)
    )
    if isinstance(calls, str):
        rec.skip(name, point, modes, calls)
        return
    train_modes = [m for m in modes if m != "fwd"]
    if "fwd" in modes and "fwd" in calls.unavailable:
        rec.skip(name, point, ["fwd"], calls.unavailable["fwd"])
        modes.remove("fwd")
    if train_modes and "train" in calls.unavailable:
        rec.skip(name, point, train_modes, calls.unavailable["train"])
        modes = [m for m in modes if m == "fwd"]
        train_modes = []

    def guarded(what: list[str], body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # OOM, a compile failure: record it and go on
            rec.skip(name, point, what, f"raised {type(exc).__name__}: {_first_line(exc)}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            for t in x.grads:
                t.grad = None

    def forward() -> None:
        ms = time_ms(calls.fwd, device, config)
        peak = peak_mib(calls.fwd, device, ()) if config.memory else None
        rec.add(name, point, "fwd", ms, peak, calls.chosen.get("fwd"))

    def training() -> None:
        def fwd_bwd() -> None:
            out = calls.fwd_train()
            out.backward(x.dout)

        total = time_ms(fwd_bwd, device, config, x.grads)
        peak = peak_mib(fwd_bwd, device, x.grads) if config.memory else None
        chosen = calls.chosen.get("train")
        if "bwd" in train_modes:
            forward_part = time_ms(calls.fwd_train, device, config)
            rec.add(name, point, "bwd", total - forward_part, peak, chosen)
        if "fwd_bwd" in train_modes:
            rec.add(name, point, "fwd_bwd", total, peak, chosen)

    if "fwd" in modes:
        guarded(["fwd"], forward)
    if train_modes:
        guarded(train_modes, training)


# -- the run ---------------------------------------------------------------------


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except Exception:
        return "unknown"
    return out.stdout.strip() or "unknown"


def environment(device: torch.device, commit: str | None = None) -> dict[str, Any]:
    """The ``env`` block: gpu, torch, triton, cuda, date, attnhub_commit."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except Exception:
        triton_version = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"none ({device.type}: {platform.processor() or platform.machine()})"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "attnhub_commit": commit or _git_commit(),
    }


def device_class_of(device: torch.device) -> str:
    from .cost_table import device_class

    capability = None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    return device_class(device.type, capability)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    bar: Any = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
        except ImportError:  # the bench extra is not installed: no bar
            bar = None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def run_bench(
    config: BenchConfig | None = None,
    *,
    output: str | os.PathLike[str] | None = None,
    progress: bool = True,
    commit: str | None = None,
) -> dict[str, Any]:
    """Time every competitor of ``config`` at every grid point; return the results JSON.

    With ``output``, the JSON is (re)written after every grid point.
    """
    config = config or BenchConfig()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the bench was asked for CUDA, but CUDA is not available here")
    points = config.points()
    rec = _Recorder()
    data: dict[str, Any] = {
        "env": environment(device, commit),
        "results": rec.results,
        "skipped": rec.skipped,
        "device_class": device_class_of(device),
        "config": _config_json(config),
    }
    start = time.monotonic()
    total = sum(len(config.backends_for(p)) for p in points)
    with _progress(total, progress) as bar:
        for i, point in enumerate(points):
            if config.time_budget is not None and time.monotonic() - start > config.time_budget:
                for rest in points[i:]:
                    for name in config.backends_for(rest):
                        rec.skip(
                            name,
                            rest,
                            config.modes,
                            f"time budget of {config.time_budget:g} s spent",
                        )
                break
            backends = config.backends_for(point)
            layout = None
            if point.sparse:
                try:
                    layout = _layout_for(point, device, config.block_sparse_seed)
                except Exception as exc:
                    reason = f"layout not built: {type(exc).__name__}: {_first_line(exc)}"
                    for name in backends:
                        rec.skip(name, point, config.modes, reason)
                    if bar is not None:
                        bar.update(len(backends))
                    continue
                point = replace(
                    point, density=layout.density, kept_pairs=kept_pairs(layout, point.seqlen)
                )
            x = _make_inputs(point, device)
            for name in backends:
                if bar is not None:
                    bar.set_postfix_str(f"{point.label()} {name}", refresh=False)
                _run_competitor(name, point, x, device, config, rec, layout)
                if bar is not None:
                    bar.update(1)
            del x
            if output is not None:
                write_json(data, output)
    if output is not None:
        write_json(data, output)
    return data


def _config_json(config: BenchConfig) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        return [plain(v) for v in value] if isinstance(value, tuple) else value

    return {k: plain(v) for k, v in asdict(config).items()}


# -- command line --------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers (sizes, lengths, windows), at least one."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _dtypes(text: str) -> tuple[str, ...]:
    try:
        return tuple(dtype_name(parse_dtype(v)) for v in _names(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _causal(text: str) -> tuple[bool, ...]:
    table = {"no": (False,), "yes": (True,), "both": (False, True), "no,yes": (False, True)}
    try:
        return table[text.replace(" ", "").lower()]
    except KeyError:
        raise argparse.ArgumentTypeError("--causal takes no, yes or both") from None


def _modes(text: str) -> tuple[str, ...]:
    modes = _names(text)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {', '.join(bad)}; modes are {', '.join(MODES)}"
        )
    return modes


def _flex_seqlens(text: str) -> tuple[int, ...] | None:
    return None if text.strip().lower() == "all" else _ints(text)


def _layout_spec(text: str) -> LayoutSpec:
    kind, _, param = text.strip().partition(":")
    try:
        param = param.strip()
        value: float = int(param) if param.lstrip("-").isdigit() else float(param or 0)
        spec = (kind.strip(), value)
        check_layout_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"layout {text!r}: {exc}") from None
    return spec


def _layout_specs(text: str) -> tuple[LayoutSpec, ...]:
    return tuple(_layout_spec(v) for v in text.split(",") if v.strip())


def _shape(text: str) -> tuple[int, ...]:
    shape = _ints(text)
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected B,H,N,D (four positive integers), got {text!r}")
    return shape


def _dtype(text: str) -> str:
    try:
        return dtype_name(parse_dtype(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _spec_text(specs: Iterable[LayoutSpec]) -> str:
    return ",".join(f"{kind}:{param:g}" for kind, param in specs)


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that select what to time (shared by ``bench`` and ``tune``)."""
    g = parser.add_argument_group("what to time")
    g.add_argument(
        "--quick",
        action="store_true",
        help="a one-minute subset: bf16, D=128, N in {1024, 4096}, causal no/yes",
    )
    g.add_argument(
        "--dtypes", type=_dtypes, help="comma-separated (bf16, fp16, fp32); default bf16,fp16"
    )
    g.add_argument("--head-dims", type=_ints, help="default 64,128")
    g.add_argument("--seqlens", type=_ints, help="default 1024,2048,4096,8192,16384")
    g.add_argument("--causal", type=_causal, help="no, yes or both (default)")
    g.add_argument("--modes", type=_modes, help="comma-separated of fwd,bwd,fwd_bwd (default all)")
    g.add_argument("--backends", type=_names, help=f"default {','.join(DEFAULT_BACKENDS)}")
    g.add_argument(
        "--tokens", type=positive_int, default=16384, help="B = tokens // N (default 16384)"
    )
    g.add_argument(
        "--hidden", type=positive_int, default=2048, help="H = hidden // D (default 2048)"
    )
    g.add_argument(
        "--window",
        action="store_true",
        help="add the sliding-window extra (bf16, B=2, H=16, N=16384, D=128, causal, W in 256,1024,4096)",
    )
    g.add_argument(
        "--windows", type=_ints, help="the sliding-window extra with these W (window=(W-1, 0))"
    )
    g.add_argument(
        "--window-shape",
        type=_shape,
        default=WINDOW_SHAPE,
        help="B,H,N,D of the sliding-window extra (default 2,16,16384,128)",
    )
    g.add_argument(
        "--no-grid",
        dest="grid",
        action="store_false",
        help="skip the dense grid (e.g. with --window)",
    )
    g.add_argument(
        "--flex-seqlens",
        type=_flex_seqlens,
        default=DEFAULT_FLEX_SEQLENS,
        help="N at which FlexAttention is compiled and timed, or 'all' (default 1024,4096,16384)",
    )
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--warmup", type=int, default=25, help="do_bench warmup in ms (default 25)")
    g.add_argument(
        "--rep", type=positive_int, default=100, help="do_bench repetitions in ms (default 100)"
    )
    g.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip the peak-memory runs"
    )
    g.add_argument("--time-budget", type=positive_float, help="seconds; grid points not started by then are skipped")  # fmt: skip


def config_from_args(args: argparse.Namespace, **overrides: Any) -> BenchConfig:
    chosen: dict[str, Any] = {}
    for key in ("dtypes", "head_dims", "seqlens", "causal", "modes", "backends"):
        value = getattr(args, key, None)
        if value is not None:
            chosen[key] = value
    windows = args.windows or (DEFAULT_WINDOWS if args.window else ())
    chosen.update(
        tokens=args.tokens,
        hidden=args.hidden,
        grid=args.grid,
        windows=tuple(windows),
        window_shape=tuple(args.window_shape),
        flex_seqlens=args.flex_seqlens,
        device=args.device,
        warmup=args.warmup,
        rep=args.rep,
        memory=args.memory,
        time_budget=args.time_budget,
    )
    chosen.update(_block_sparse_config(args))
    chosen.update(overrides)
    return BenchConfig.quick(**chosen) if args.quick else BenchConfig(**chosen)


def add_block_sparse_arguments(parser: argparse.ArgumentParser) -> None:
    """The block-sparse extra's options (``bench`` only: the cost table is dense)."""
    g = parser.add_argument_group(
        "block-sparse extra (issue 5)",
        "Layouts of BLOCK x BLOCK blocks at one shape, non-causal: triton_blocksparse and "
        "flex_attention (a BlockMask of the same blocks) on each layout, the dense "
        "baseline (triton_flash) once on the same shape, and a memory point at long N. "
        "Rows carry density (fraction of kept blocks), layout [kind, parameter] and "
        "block_size; TFLOP/s count the pairs inside kept blocks.",
    )
    g.add_argument(
        "--block-sparse",
        action="store_true",
        help=(
            "add the block-sparse extra: bf16, B=2, H=16, N=8192, D=128, block 128; layouts "
            f"{_spec_text(DEFAULT_BLOCK_SPARSE_LAYOUTS)}; plus the memory point at N=65536 "
            f"({_spec_text([BLOCK_SPARSE_LONG_LAYOUT])})"
        ),
    )
    g.add_argument(
        "--block-sparse-layouts",
        type=_layout_specs,
        metavar="KIND:P,...",
        help=(
            "the extra with these layouts (implies --block-sparse): random:DENSITY, "
            "sliding_window:W (query i keeps keys i-W..i), bigbird:RANDOM_BLOCKS, "
            "strided:STRIDE, causal"
        ),
    )
    g.add_argument(
        "--block-sparse-shape",
        type=_shape,
        default=BLOCK_SPARSE_SHAPE,
        metavar="B,H,N,D",
        help="shape of the extra (default 2,16,8192,128)",
    )
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=BLOCK_SIZE,
        help="layout block size (default 128)",
    )
    g.add_argument("--block-sparse-dtype", type=_dtype, default="bfloat16", help="default bf16")
    g.add_argument(
        "--block-sparse-backends",
        type=_names,
        help=f"run on each layout (default {','.join(BLOCK_SPARSE_BACKENDS)})",
    )
    g.add_argument(
        "--block-sparse-dense-backends",
        type=_names,
        help=(
            "dense baselines, run once on the extra's shape without block_sparse "
            f"(default {','.join(BLOCK_SPARSE_DENSE_BACKENDS)})"
        ),
    )
    g.add_argument(
        "--block-sparse-long-seqlens",
        type=_ints,
        metavar="N,...",
        help=(
            "N of the memory points (the extra's B, H, D; default "
            f"{','.join(map(str, DEFAULT_BLOCK_SPARSE_LONG_SEQLENS))}); implies --block-sparse"
        ),
    )
    g.add_argument(
        "--block-sparse-long-layout",
        type=_layout_spec,
        default=BLOCK_SPARSE_LONG_LAYOUT,
        metavar="KIND:P",
        help=f"layout of the memory points (default {_spec_text([BLOCK_SPARSE_LONG_LAYOUT])})",
    )
    g.add_argument(
        "--no-block-sparse-long",
        dest="block_sparse_long",
        action="store_false",
        help="skip the memory points",
    )
    g.add_argument(
        "--block-sparse-seed",
        type=int,
        default=0,
        help="seed of the random and BigBird layouts (default 0)",
    )


def _block_sparse_config(args: argparse.Namespace) -> dict[str, Any]:
    """BenchConfig fields from the block-sparse options (none: ``tune``'s parser)."""
    if not hasattr(args, "block_sparse"):
        return {}
    chosen: dict[str, Any] = {
        "block_sparse_shape": tuple(args.block_sparse_shape),
        "block_size": args.block_size,
        "block_sparse_dtype": args.block_sparse_dtype,
        "block_sparse_long_layout": args.block_sparse_long_layout,
        "block_sparse_seed": args.block_sparse_seed,
    }
    for key in ("block_sparse_backends", "block_sparse_dense_backends"):
        if getattr(args, key) is not None:
            chosen[key] = getattr(args, key)
    layouts = args.block_sparse_layouts
    long_seqlens = args.block_sparse_long_seqlens
    on = bool(args.block_sparse or layouts or long_seqlens)
    if on:
        chosen["block_sparse_layouts"] = (
            layouts if layouts is not None else DEFAULT_BLOCK_SPARSE_LAYOUTS
        )
        if args.block_sparse_long:
            chosen["block_sparse_long_seqlens"] = long_seqlens or DEFAULT_BLOCK_SPARSE_LONG_SEQLENS
    return chosen


def add_serving_arguments(parser: argparse.ArgumentParser) -> None:
    """--decode (attnhub.bench_decode) and --serving / --varlen (attnhub.bench_serving),
    declared here: those modules import Triton and CUDA-only code, which ``--help`` and
    the other kinds must not need."""
    g = parser.add_argument_group(
        "serving (--decode, --serving, --varlen; CUDA)",
        "--decode: triton_flash's split-KV decode op against PyTorch's kernels and "
        "FlexAttention (B=8, Hq 32 / Hkv 8, D=128, bf16; Nq=1 at Nk 4K-128K, softcap + "
        "window, paged caches, Nq=4), JSON + table + bandwidth plot. --serving: "
        "attention_kvcache and attention_varlen through the public API per eligible "
        "backend; --varlen: the varlen part only (16 documents, 64K tokens, causal, "
        "against SDPA on the padded batch). --quick shortens both.",
    )
    g.add_argument("--decode", action="store_true", help="the decode kernels (attnhub.bench_decode)")  # fmt: skip
    g.add_argument("--decode-sections", metavar="S,...", help="with --decode: a subset of nq1,softcap_window,paged,nq4,padded,host,sweep")  # fmt: skip
    g.add_argument("--no-sweep", action="store_true", help="with --decode: skip the launch-configuration sweep")  # fmt: skip
    g.add_argument("--no-flex", dest="flex", action="store_false", help="with --decode: leave FlexAttention out")  # fmt: skip
    g.add_argument("--serving", action="store_true", help="decode and varlen through the public API (attnhub.bench_serving)")  # fmt: skip
    g.add_argument("--varlen", action="store_true", help="attention_varlen through the public API only")  # fmt: skip
    g.add_argument("--iters", type=positive_int, default=20, help="with --serving/--varlen: timed calls per case (default 20)")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench_models import add_arguments as add_model_arguments
    from .bench_workloads import add_arguments as add_workload_arguments

    add_grid_arguments(parser)
    add_block_sparse_arguments(parser)
    add_workload_arguments(parser)
    add_model_arguments(parser)
    add_serving_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", help="results JSON (default attnhub-bench-<date>.json); plots and a markdown table go beside it")  # fmt: skip
    out.add_argument("--no-plots", dest="plots", action="store_false", help="write no PNG plots")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument(
        "--commit", help="attnhub_commit to record (default: git rev-parse --short HEAD)"
    )
    out.add_argument("--report", nargs="+", metavar="RESULTS", help="regenerate plots and table from results JSON file(s) (merged) instead of timing")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from . import bench_report

    if args.workloads:
        from .bench_workloads import main as workloads_main

        return workloads_main(args)
    if args.models:
        from .bench_models import main as models_main

        return models_main(args)
    if args.decode:
        if args.report is not None and len(args.report) != 1:
            print("attnhub bench --decode --report: one results file", file=sys.stderr)
            return 2
        from .bench_decode import main as decode_main

        return decode_main(args)
    if args.serving or args.varlen:
        from .bench_serving import main as serving_main

        return serving_main(args)
    if args.report:
        try:
            data = bench_report.merge([bench_report.load(p) for p in args.report])
        except ValueError as exc:
            print(f"attnhub bench: {exc}", file=sys.stderr)
            return 2
        target = Path(args.output) if args.output else Path(args.report[0])
        if args.output:
            write_json(data, target)
        written = bench_report.write_report(data, target, plots=args.plots)
        print(bench_report.markdown_table(data))
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
        return 0
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"attnhub bench: {exc}", file=sys.stderr)
        return 2
    output = Path(args.output or f"attnhub-bench-{datetime.date.today().isoformat()}.json")
    data = run_bench(config, output=output, progress=args.progress, commit=args.commit)
    written = [output, *bench_report.write_report(data, output, plots=args.plots)]
    print(bench_report.skipped_summary(data), file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    print(bench_report.markdown_table(data))
    return 0


__all__ = [
    "AUTO",
    "DEFAULT_BACKENDS",
    "FLEX",
    "MODES",
    "BenchConfig",
    "Point",
    "add_arguments",
    "add_block_sparse_arguments",
    "add_grid_arguments",
    "build_layout",
    "config_from_args",
    "environment",
    "flex_layout_block_mask",
    "kept_pairs",
    "run_bench",
    "write_json",
]
