"""``attnhub tune``: measure this machine (or read bench results) into a cost table.

Tooling on top of the runtime: it imports :mod:`attnhub.bench` to time and
:mod:`attnhub.cost_table` for the table it writes; nothing in the runtime imports it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from . import bench, bench_report
from .bench import add_grid_arguments
from .cost_table import (
    RANKING_ENV,
    TABLE_MODES,
    CostTable,
    Key,
    cache_path,
    forget_tables,
    is_time,
    ranking_disabled,
    table_filename,
)
from .registry import get_registry


def table_from_results(
    results: Mapping[str, Any], device: str | None = None, source: str = "(in memory)"
) -> CostTable:
    """A cost table from ``attnhub bench`` results: dense rows of fwd and fwd_bwd.

    ``auto`` rows are left out (auto is dispatch itself); so are windowed and
    block-sparse rows (the table covers plain attention). Where a key was timed more
    than once, the fastest time is kept.
    """
    device = device or results.get("device_class")
    if not device:
        raise ValueError("the results name no device class; pass device= (e.g. 'sm90')")
    entries: dict[Key, dict[str, float]] = {}
    for r in results["results"]:
        if r["backend"] == "auto" or r["mode"] not in TABLE_MODES:
            continue
        if r.get("window") is not None or r.get("density") is not None:
            continue
        if r["Nq"] != r["Nk"] or r["Hq"] != r["Hkv"] or not is_time(r["ms"]):
            continue  # (a failed or skipped timing has no time)
        key: Key = (r["dtype"], int(r["D"]), int(r["Nq"]), bool(r["causal"]), r["mode"])
        timings = entries.setdefault(key, {})
        timings[r["backend"]] = min(float(r["ms"]), timings.get(r["backend"], math.inf))
    if not entries:
        raise ValueError("no dense fwd or fwd_bwd timings in these results")
    meta = {"from": source, "env": results.get("env", {})}
    return CostTable(device, entries, table_filename(device), meta)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prewarm the measurements that autotune would take at first use")
    g.add_argument("--workloads", action="store_true", help="run the workload calls (attnhub bench --workloads) once each through attnhub.attention, so autotune measures each signature now")  # fmt: skip
    g.add_argument("--model", action="append", metavar="NAME", help="run a training step and a generate() of a bench --models model (repeatable), patched and with attn_implementation='attnhub', so autotune measures every call signature it makes")  # fmt: skip
    g.add_argument("--only", help="with --workloads: only workloads whose name contains this")
    parser.add_argument("--from-results", nargs="+", metavar="RESULTS", help="build the table from bench results JSON (merged) instead of measuring")  # fmt: skip
    parser.add_argument("--device-class", help="device class of the table (default: from the results, or this machine)")  # fmt: skip
    parser.add_argument("-o", "--output", help="where to write the table (default: the user cache, ~/.cache/attnhub/cost_table_<class>.json)")  # fmt: skip
    parser.add_argument("--results", help="also write the raw bench results here (when measuring)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    add_grid_arguments(parser)


def _tune_backends() -> tuple[str, ...]:
    # The reference is the slow fallback: never worth timing for speed.
    return tuple(n for n in get_registry().names() if n != "torch_reference")


def prewarm(args: argparse.Namespace) -> int:
    """Run calls through attnhub so that autotune measures their signatures now, into
    the measurement file (``ATTNHUB_MEASUREMENTS`` or this device's in the user cache)."""
    import torch

    from . import bench_models, bench_workloads, measured
    from .timing import synchronize

    device = torch.device(args.device)
    if device.type not in measured.DEVICES:
        print(f"attnhub tune: autotune measures on {', '.join(sorted(measured.DEVICES))} only, "
              f"not {device.type}", file=sys.stderr)  # fmt: skip
        return 2
    store = measured.store_for(device)
    before = len(store)
    # --dtypes (shared with the grid's options): bf16 unless given.
    dtypes = [getattr(torch, name) for name in args.dtypes or ("bfloat16",)]
    for dtype in dtypes:
        for w in bench_workloads.workloads() if args.workloads else ():
            if args.only and args.only not in w.name:
                continue
            x = bench_workloads._inputs(w, dtype, device)
            call = bench_workloads._attnhub_call(w, x, None)
            for mode in w.modes:
                bench_workloads._runner(call, x, mode)()
            if args.progress:
                print(f"[{dtype}] {w.name}", file=sys.stderr, flush=True)
        for name in args.model or ():
            specs = {m.name: m for m in bench_models.MODELS}
            if name not in specs:
                print(f"attnhub tune: unknown model {name!r}; one of {', '.join(specs)}", file=sys.stderr)  # fmt: skip
                return 2
            bench_models.prewarm(specs[name], dtype, device)
            if args.progress:
                print(f"[{dtype}] model {name}", file=sys.stderr, flush=True)
    synchronize(device)
    print(f"{store.path}: {len(store) - before} call signatures measured now, {len(store)} in all")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.workloads or args.model:
        return prewarm(args)
    if args.from_results:
        try:
            results = bench_report.merge([bench_report.load(p) for p in args.from_results])
        except ValueError as exc:
            print(f"attnhub tune: {exc}", file=sys.stderr)
            return 2
        source = ", ".join(Path(p).name for p in args.from_results)
    else:
        overrides: dict[str, Any] = {}
        if args.backends is None:
            overrides["backends"] = _tune_backends()
        if args.modes is None:
            overrides["modes"] = TABLE_MODES
        try:
            config = bench.config_from_args(args, **overrides)
        except ValueError as exc:
            print(f"attnhub tune: {exc}", file=sys.stderr)
            return 2
        results = bench.run_bench(config, output=args.results, progress=args.progress)
        source = args.results or "attnhub tune"
        print(bench_report.skipped_summary(results), file=sys.stderr)
    try:
        table = table_from_results(results, args.device_class, source)
    except ValueError as exc:
        print(f"attnhub tune: {exc}", file=sys.stderr)
        return 1
    path = table.write(args.output or cache_path(table.device))
    forget_tables()
    print(f"wrote {path}: {len(table.entries)} entries for {table.device}, backends "
          f"{', '.join(sorted(_backends(table.entries.values())))}")  # fmt: skip
    if ranking_disabled():
        print(f"note: {RANKING_ENV}={os.environ.get(RANKING_ENV)} is set, so dispatch ignores it")
    return 0


def _backends(timings: Iterable[Mapping[str, float]]) -> set[str]:
    return {b for t in timings for b in t}
