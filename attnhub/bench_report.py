"""Plots and tables from ``attnhub bench`` results JSON.

``write_report(data, "h200-2026-12-01.json")`` writes beside the JSON:

- ``<stem>.md``: markdown tables (TFLOP/s per backend at every grid point, with
  ``auto`` against the fastest registered backend, and ``triton_flash`` against its
  competitors; the sliding-window extra in ms; what was skipped and why);
- ``<stem>-tflops-<dtype>.png``: TFLOP/s against N per backend, one panel per head dim
  x causal x mode;
- ``<stem>-memory-<dtype>.png``: peak memory beyond the inputs against N (CUDA runs);
- ``<stem>-window.png``: the sliding-window extra, ms against W;
- ``<stem>-block-sparse.png``: the block-sparse extra, ms against density for the
  random layouts (fwd and fwd_bwd panels), dense baselines as horizontal lines, the
  other layouts as single markers; its table (ms, peak memory, the ratios the issue's
  targets name) is in the markdown.

matplotlib (the ``bench`` extra) is imported only to draw; tables need nothing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .bench import AUTO, DEFAULT_BACKENDS, DENSE, FLEX, LAYOUT_KINDS, MODES, layout_label
from .request import dtype_tag

Row = dict[str, Any]


def load(
    path: str | os.PathLike[str], keys: tuple[str, str] = ("env", "results"), what: str = "bench"
) -> dict[str, Any]:
    """The ``what`` results in ``path`` (a JSON object with ``keys``); ValueError naming
    the file where it cannot be read, is not JSON or is not such results."""
    try:
        data: Any = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what} results ({exc})") from None
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ValueError(f"{path}: not attnhub {what} results (no {' and '.join(map(repr, keys))})")
    return data


def merge(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs as one (env of the first; the others' envs under ``merged_envs``)."""
    if len(runs) == 1:
        return runs[0]
    merged: dict[str, Any] = {
        "env": runs[0]["env"],
        "results": [row for run in runs for row in run["results"]],
        "skipped": [row for run in runs for row in run.get("skipped", [])],
        "merged_envs": [run["env"] for run in runs],
    }
    if "device_class" in runs[0]:
        merged["device_class"] = runs[0]["device_class"]
    return merged


def _backend_order(names: Iterable[str]) -> list[str]:
    names = set(names)
    known = [b for b in DEFAULT_BACKENDS if b in names and b != AUTO]
    rest = sorted(names - set(DEFAULT_BACKENDS))
    return known + rest + ([AUTO] if AUTO in names else [])


def _dense(data: dict[str, Any]) -> list[Row]:
    return [
        r
        for r in data["results"]
        if r.get("window") is None and r.get("density") is None and r.get("layout") is None
    ]


def _windowed(data: dict[str, Any]) -> list[Row]:
    return [r for r in data["results"] if r.get("window") is not None]


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _md(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def _get(row: Row | None, key: str) -> Any:
    return None if row is None else row.get(key)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def dense_table(data: dict[str, Any]) -> str:
    """TFLOP/s per backend at every dense grid point (empty string if there are none)."""
    rows = _dense(data)
    if not rows:
        return ""
    backends = _backend_order(r["backend"] for r in rows)
    cells: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        key = (r["dtype"], r["D"], r["causal"], MODES.index(r["mode"]), r["Nq"], r["B"], r["Hq"])
        cells[key][r["backend"]] = r
    registered = [b for b in backends if b not in (AUTO, FLEX)]
    ratios = [
        (label, other)
        for label, other in (
            ("tf/flash", "torch_sdpa_flash"),
            ("tf/cudnn", "torch_sdpa_cudnn"),
            ("tf/flex", FLEX),
        )
        if "triton_flash" in backends and other in backends
    ]
    header = ["dtype", "D", "N", "causal", "mode", *backends]
    header += ["auto/best"] if AUTO in backends else []
    header += [label for label, _ in ratios]
    table = [header]
    for key in sorted(cells):
        dtype, d, causal, mode_index, n, _, _ = key
        by = cells[key]
        line = [dtype_tag(dtype), str(d), str(n), "yes" if causal else "no", MODES[mode_index]]
        for b in backends:
            cell = by.get(b)
            text = _num(cell["tflops"]) if cell else ""
            if cell and b == AUTO and cell.get("chosen"):
                text += f" ({cell['chosen']})"
            line.append(text)
        if AUTO in backends:
            timed = [by[b]["ms"] for b in registered if b in by and by[b]["ms"] > 0]
            auto = by.get(AUTO)
            best = min(timed) if timed else None
            line.append(_ratio(best, auto["ms"] if auto else None))
        for _, other in ratios:
            mine, theirs = by.get("triton_flash"), by.get(other)
            line.append(_ratio(_get(mine, "tflops"), _get(theirs, "tflops")))
        table.append(line)
    return _md(table)


def window_table(data: dict[str, Any]) -> str:
    """The sliding-window extra: ms per backend, per W and mode."""
    rows = _windowed(data)
    if not rows:
        return ""
    backends = _backend_order(r["backend"] for r in rows)
    cells: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        cells[(r["window"][0] + 1, MODES.index(r["mode"]), r["dtype"], r["Nq"])][r["backend"]] = r
    table = [["W", "mode", "dtype", "N", *(f"{b} ms" for b in backends)]]
    for key in sorted(cells):
        w, mode_index, dtype, n = key
        line = [str(w), MODES[mode_index], dtype_tag(dtype), str(n)]
        for b in backends:
            cell = cells[key].get(b)
            text = _num(cell["ms"], 3) if cell else ""
            if cell and b == AUTO and cell.get("chosen"):
                text += f" ({cell['chosen']})"
            line.append(text)
        table.append(line)
    return _md(table)


# -- the block-sparse extra ---------------------------------------------------------

BLOCK_SPARSE = "triton_blocksparse"
DENSE_BASELINE = "triton_flash"


def _block_sparse_order(names: Iterable[str]) -> list[str]:
    """The dense baseline, triton_blocksparse, flex_attention, then the rest."""
    names = set(names)
    first = [b for b in (DENSE_BASELINE, BLOCK_SPARSE, FLEX) if b in names]
    return first + [b for b in _backend_order(names) if b not in first]


def _block_sparse(data: dict[str, Any]) -> list[Row]:
    return [r for r in data["results"] if r.get("layout") is not None]


def _shape_key(r: Row) -> tuple[Any, ...]:
    return (r["dtype"], r["B"], r["Hq"], r["Nq"], r["D"], r.get("block_size"))


def _shape_text(key: tuple[Any, ...]) -> str:
    dtype, b, h, n, d, block = key
    return f"{dtype_tag(dtype)} B{b} H{h} N{n} D{d} block {block}"


def _layout_order(layout: Sequence[Any]) -> tuple[int, float, str]:
    """Dense first, then random by falling density, then the other kinds."""
    kind, param = layout[0], layout[1]
    if kind == DENSE[0]:
        rank = 0
    else:
        rank = 1 + LAYOUT_KINDS.index(kind) if kind in LAYOUT_KINDS else len(LAYOUT_KINDS) + 1
    return (rank, -param if kind == "random" else param, kind)


def _dense_rows(rows: list[Row]) -> dict[tuple[Any, ...], dict[str, Row]]:
    """(shape, mode) -> backend -> row of the dense baselines."""
    out: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        if r["layout"][0] == DENSE[0]:
            out[(_shape_key(r), r["mode"])][r["backend"]] = r
    return out


def block_sparse_table(data: dict[str, Any]) -> str:
    """The block-sparse extra: ms per backend per (shape, layout, mode), with
    bs/dense (triton_blocksparse over dense triton_flash; the issue's forward target is
    at most s + 0.05, the ``target`` column), dense/bs (the speedup) and flex/bs
    (flex_attention over triton_blocksparse: >= 1 where triton_blocksparse is faster)."""
    rows = _block_sparse(data)
    if not rows:
        return ""
    backends = _block_sparse_order(r["backend"] for r in rows)
    dense = _dense_rows(rows)
    cells: dict[tuple[Any, ...], dict[str, Row]] = defaultdict(dict)
    for r in rows:
        key = (_shape_key(r), _layout_order(r["layout"]), tuple(r["layout"]), MODES.index(r["mode"]))  # fmt: skip
        cells[key][r["backend"]] = r
    with_peak = [b for b in backends if any(r.get("peak_mib") is not None for r in rows if r["backend"] == b)]  # fmt: skip
    header = ["shape", "layout", "density", "mode", *(f"{b} ms" for b in backends)]
    vs_dense = BLOCK_SPARSE in backends and DENSE_BASELINE in backends
    vs_flex = BLOCK_SPARSE in backends and FLEX in backends
    header += ["bs/dense", "target", "dense/bs"] if vs_dense else []
    header += ["flex/bs"] if vs_flex else []
    header += [f"{b} MiB" for b in with_peak]
    table = [header]
    for key in sorted(cells):
        shape, _, layout, mode_index = key
        mode = MODES[mode_index]
        by = cells[key]
        density = next((r["density"] for r in by.values() if r.get("density") is not None), None)
        line = [_shape_text(shape), layout_label(layout), _num(density, 3), mode]
        for b in backends:
            cell = by.get(b)
            text = _num(cell["ms"], 3) if cell else ""
            if cell and b == AUTO and cell.get("chosen"):
                text += f" ({cell['chosen']})"
            line.append(text)
        base = dense.get((shape, mode), {}).get(DENSE_BASELINE)
        bs = by.get(BLOCK_SPARSE) if layout[0] != DENSE[0] else None
        bs_ms, base_ms = _get(bs, "ms"), _get(base, "ms")
        if vs_dense:
            line.append(_ratio(bs_ms, base_ms))
            target = density + 0.05 if density is not None and mode == "fwd" else None
            line.append(_num(target, 3))
            line.append(_ratio(base_ms, bs_ms))
        if vs_flex:
            line.append(_ratio(_get(by.get(FLEX), "ms"), bs_ms))
        for b in with_peak:
            line.append(_num(_get(by.get(b), "peak_mib"), 1))
        table.append(line)
    return _md(table)


def skipped_summary(data: dict[str, Any]) -> str:
    """One line per (backend, reason), with how many grid points it covers."""
    points: dict[tuple[str, str], set[tuple[Any, ...]]] = defaultdict(set)
    for s in data.get("skipped", []):
        keys = ("dtype", "B", "Hq", "Nq", "D", "causal", "window", "layout", "block_size")
        point = tuple(str(s.get(k)) for k in keys)
        points[(s["backend"], s["reason"])].add(point)
    if not points:
        return "skipped: nothing"
    lines = ["skipped:"]
    for (backend, reason), seen in sorted(points.items()):
        lines.append(f"  {backend} ({len(seen)} point(s)): {reason}")
    return "\n".join(lines)


# Why auto/best can read below 1 when auto ran the best backend's own kernel.
AUTO_NOISE = (
    "\n\nauto/best compares two timing windows. Where auto picked the fastest backend it "
    "runs that backend's kernel, and windows of one kernel read up to 10% apart on the "
    "H200 (benchmarks/NOTES.md); benchmarks/auto_paired.py times auto against its pick "
    "call by call."
)


def markdown_table(data: dict[str, Any]) -> str:
    env = data["env"]
    parts = [
        f"attnhub bench: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"cuda {env.get('cuda')}, attnhub {env.get('attnhub_commit')}, {env.get('date')}"
    ]
    dense = dense_table(data)
    if dense:
        timed_auto = any(r["backend"] == AUTO for r in data["results"])
        parts.append("TFLOP/s (auto/best: fastest registered backend's time over auto's; "
                     "tf/x: triton_flash TFLOP/s over x's)\n\n" + dense
                     + (AUTO_NOISE if timed_auto else ""))  # fmt: skip
    windows = window_table(data)
    if windows:
        parts.append("Sliding window (causal, window=(W-1, 0)), ms\n\n" + windows)
    sparse = block_sparse_table(data)
    if sparse:
        parts.append(
            "Block-sparse (non-causal; density: fraction of kept blocks), ms. bs/dense: "
            f"{BLOCK_SPARSE} over dense {DENSE_BASELINE} (forward target: at most the "
            f"target column, s + 0.05); dense/bs: the speedup; flex/bs: {FLEX} over "
            f"{BLOCK_SPARSE} (>= 1: {BLOCK_SPARSE} faster)\n\n" + sparse
        )
    parts.append(skipped_summary(data))
    return "\n\n".join(parts)


# -- plots -----------------------------------------------------------------------


def _figure(rows: int, cols: int) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _color(backend: str, backends: list[str]) -> str:
    """The same color for a backend in every panel of a figure."""
    return f"C{backends.index(backend) % 10}"


def _panels(rows: list[Row], modes: Sequence[str]) -> tuple[list[tuple[int, bool]], list[str]]:
    combos = sorted({(r["D"], r["causal"]) for r in rows})
    present = [m for m in modes if any(r["mode"] == m for r in rows)]
    return combos, present


def _plot_vs_n(rows: list[Row], value: str, ylabel: str, title: str, modes: Sequence[str], path: Path) -> Path | None:  # fmt: skip
    rows = [r for r in rows if r.get(value) is not None]
    combos, present = _panels(rows, modes)
    if not combos or not present:
        return None
    fig, axes = _figure(len(combos), len(present))
    backends = _backend_order(r["backend"] for r in rows)
    for i, (d, causal) in enumerate(combos):
        for j, mode in enumerate(present):
            ax = axes[i][j]
            for b in backends:
                pts = sorted(
                    (r["Nq"], r[value])
                    for r in rows
                    if r["backend"] == b
                    and r["D"] == d
                    and r["causal"] == causal
                    and r["mode"] == mode
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=b, color=_color(b, backends),
                            linestyle="--" if b == AUTO else "-")  # fmt: skip
            ax.set_xscale("log", base=2)
            seqlens = sorted({r["Nq"] for r in rows})
            ax.set_xticks(seqlens, [str(n) for n in seqlens], fontsize=7)
            ax.minorticks_off()
            ax.set_title(f"D={d}, {'causal' if causal else 'non-causal'}, {mode}", fontsize=9)
            ax.set_xlabel("N")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def plot_window(rows: list[Row], title: str, path: Path) -> Path | None:
    present = [m for m in MODES if any(r["mode"] == m for r in rows)]
    if not present:
        return None
    fig, axes = _figure(1, len(present))
    backends = _backend_order(r["backend"] for r in rows)
    for j, mode in enumerate(present):
        ax = axes[0][j]
        for b in backends:
            pts = sorted(
                (r["window"][0] + 1, r["ms"])
                for r in rows
                if r["backend"] == b and r["mode"] == mode
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=b, color=_color(b, backends))
        ax.set_xscale("log", base=2)
        ws = sorted({r["window"][0] + 1 for r in rows})
        ax.set_xticks(ws, [str(w) for w in ws], fontsize=7)
        ax.minorticks_off()
        ax.set_title(mode, fontsize=9)
        ax.set_xlabel("window W (keys)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def plot_block_sparse(rows: list[Row], title: str, path: Path) -> Path | None:
    """ms against density: a line per backend over the random layouts, the other
    layouts as single markers, dense baselines as horizontal lines and, in the forward
    panel, the issue's target (s + 0.05) x dense triton_flash. A row of panels per
    shape that has random layouts; columns fwd and fwd_bwd."""
    shapes = sorted({_shape_key(r) for r in rows if r["layout"][0] == "random"})
    present = [m for m in ("fwd", "fwd_bwd") if any(r["mode"] == m for r in rows)]
    if not shapes or not present:
        return None
    fig, axes = _figure(len(shapes), len(present))
    backends = _block_sparse_order(r["backend"] for r in rows)
    markers = {"sliding_window": "s", "bigbird": "^", "strided": "D", "causal": "v"}
    dense = _dense_rows(rows)
    for i, shape in enumerate(shapes):
        for j, mode in enumerate(present):
            ax = axes[i][j]
            here = [r for r in rows if _shape_key(r) == shape and r["mode"] == mode]
            for b in backends:
                color = _color(b, backends)
                pts = sorted(
                    (r["density"], r["ms"])
                    for r in here
                    if r["backend"] == b and r["layout"][0] == "random"
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=b, color=color)
                for r in here:
                    kind = r["layout"][0]
                    if r["backend"] == b and kind not in ("random", DENSE[0]):
                        ax.plot([r["density"]], [r["ms"]], marker=markers.get(kind, "*"),
                                linestyle="none", color=color,
                                label=f"{b}, {layout_label(r['layout'])}")  # fmt: skip
            for b, r in sorted(dense.get((shape, mode), {}).items()):
                ax.axhline(r["ms"], color=_color(b, backends), linestyle="--",
                           label=f"{b} (dense)")  # fmt: skip
            base = dense.get((shape, mode), {}).get(DENSE_BASELINE)
            if mode == "fwd" and base is not None:
                ax.plot([0, 1], [0.05 * base["ms"], 1.05 * base["ms"]], color="gray",
                        linestyle=":", label="target (s + 0.05) x dense")  # fmt: skip
            ax.set_xlim(0, 1.05)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{_shape_text(shape)}, {mode}", fontsize=9)
            ax.set_xlabel("density (fraction of kept blocks)")
            ax.set_ylabel("ms")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


def write_plots(data: dict[str, Any], stem: Path) -> list[Path]:
    """PNG plots beside ``stem`` (a path without suffix); returns the files written."""
    env = data["env"]
    what = f"{env.get('gpu')}, torch {env.get('torch')}, attnhub {env.get('attnhub_commit')}"
    written: list[Path] = []
    dense = _dense(data)
    for dtype in sorted({r["dtype"] for r in dense}):
        rows = [r for r in dense if r["dtype"] == dtype]
        for value, label, kind, modes in (
            ("tflops", "TFLOP/s", "tflops", MODES),
            # bwd rows carry the fwd_bwd run's peak: plotting them again adds nothing.
            ("peak_mib", "peak MiB beyond inputs", "memory", ("fwd", "fwd_bwd")),
        ):
            path = stem.with_name(f"{stem.name}-{kind}-{dtype_tag(dtype)}.png")
            title = f"{label}, {dtype_tag(dtype)}: {what}"
            out = _plot_vs_n(rows, value, label, title, modes, path)
            if out is not None:
                written.append(out)
    windowed = _windowed(data)
    if windowed:
        out = plot_window(
            windowed, f"sliding window, ms: {what}", stem.with_name(f"{stem.name}-window.png")
        )
        if out is not None:
            written.append(out)
    sparse = _block_sparse(data)
    if sparse:
        out = plot_block_sparse(
            sparse,
            f"block-sparse, ms against density: {what}",
            stem.with_name(f"{stem.name}-block-sparse.png"),
        )
        if out is not None:
            written.append(out)
    return written


def write_report(
    data: dict[str, Any], results_path: str | os.PathLike[str], *, plots: bool = True
) -> list[Path]:
    """The markdown table and (with ``plots``) the PNGs beside ``results_path``."""
    path = Path(results_path)
    stem = path.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    table = stem.with_name(stem.name + ".md")
    table.write_text(markdown_table(data) + "\n")
    written = [table]
    if plots:
        written += write_plots(data, stem)
    return written
