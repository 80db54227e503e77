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
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .request import dtype_name

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

    def pairs(self) -> float:
        """(query, key) pairs computed, as the protocol counts them."""
        n = self.seqlen
        if self.window is not None:
            w = min(self.window, n)
            return float(w * n - w * (w - 1) // 2)  # causal window: min(i + 1, W) keys
        return n * n / 2 if self.causal else float(n * n)

    def flops(self, mode: str) -> float:
        return 4.0 * self.batch * self.heads * self.head_dim * self.pairs() * _FLOP_FACTOR[mode]

    def label(self) -> str:
        text = f"{_short(self.dtype)} B{self.batch} H{self.heads} N{self.seqlen} D{self.head_dim}"
        text += " causal" if self.causal else ""
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
        return row


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}.get(
        dtype, dtype
    )


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
        return points


# -- timing --------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def _attnhub_calls(name: str, point: Point, x: _Inputs) -> _Calls:
    import attnhub

    backend = None if name == AUTO else name
    window = None if point.window is None else (point.window - 1, 0)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        return lambda: attnhub.attention(
            q, k, v, causal=point.causal, window=window, backend=backend
        )

    calls = _Calls(call(x.q, x.k, x.v), call(x.qg, x.kg, x.vg))
    for kind, (q, k, v) in (("fwd", (x.q, x.k, x.v)), ("train", x.grads)):
        decision = attnhub.explain(q, k, v, causal=point.causal, window=window, backend=backend)
        if decision.chosen is None:
            reasons = decision.reasons().get(name) if backend else None
            calls.unavailable[kind] = "; ".join(reasons or ()) or "no backend can serve this call"
        elif backend is None:
            calls.chosen[kind] = decision.chosen
    return calls


def _flex_calls(
    point: Point, x: _Inputs, device: torch.device, config: BenchConfig
) -> _Calls | str:
    if device.type != "cuda" and not config.flex_on_cpu:
        return "compiled FlexAttention is timed on CUDA only"
    if (
        point.window is None
        and config.flex_seqlens is not None
        and point.seqlen not in config.flex_seqlens
    ):
        allowed = ", ".join(map(str, config.flex_seqlens))
        return f"FlexAttention runs at N in {{{allowed}}} only (one compile per shape; --flex-seqlens all)"
    try:
        compiled = _flex_compiled()
        block_mask = _flex_block_mask(point, device)
    except Exception as exc:
        return f"FlexAttention unavailable: {type(exc).__name__}: {_first_line(exc)}"

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], Any]:
        return lambda: compiled(q, k, v, block_mask=block_mask)

    return _Calls(call(x.q, x.k, x.v), call(x.qg, x.kg, x.vg))


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
            "density": None,
        }
        if point.window is not None:
            row["window"] = [point.window - 1, 0]
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
) -> None:
    modes = [m for m in MODES if m in config.modes]
    calls = (
        _flex_calls(point, x, device, config) if name == FLEX else _attnhub_calls(name, point, x)
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


def write_json(data: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``data`` atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


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
    with _progress(len(points) * len(config.backends), progress) as bar:
        for i, point in enumerate(points):
            if config.time_budget is not None and time.monotonic() - start > config.time_budget:
                for rest in points[i:]:
                    for name in config.backends:
                        rec.skip(
                            name,
                            rest,
                            config.modes,
                            f"time budget of {config.time_budget:g} s spent",
                        )
                break
            x = _make_inputs(point, device)
            for name in config.backends:
                if bar is not None:
                    bar.set_postfix_str(f"{point.label()} {name}", refresh=False)
                _run_competitor(name, point, x, device, config, rec)
                if bar is not None:
                    bar.update(1)
            del x
            if output is not None:
                write_json(data, output)
    if output is not None:
        write_json(data, output)
    return data


def _config_json(config: BenchConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}


# -- command line --------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


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
    g.add_argument("--tokens", type=int, default=16384, help="B = tokens // N (default 16384)")
    g.add_argument("--hidden", type=int, default=2048, help="H = hidden // D (default 2048)")
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
        type=_ints,
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
    g.add_argument("--rep", type=int, default=100, help="do_bench repetitions in ms (default 100)")
    g.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip the peak-memory runs"
    )
    g.add_argument("--time-budget", type=float, help="seconds; grid points not started by then are skipped")  # fmt: skip


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
    chosen.update(overrides)
    return BenchConfig.quick(**chosen) if args.quick else BenchConfig(**chosen)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_grid_arguments(parser)
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

    if args.report:
        data = bench_report.merge([bench_report.load(p) for p in args.report])
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
    "add_grid_arguments",
    "config_from_args",
    "environment",
    "run_bench",
    "write_json",
]
