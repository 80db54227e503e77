"""``attnhub bench --workloads``: the calls real models make, timed as a model pays for them.

The benchmark grid (``attnhub bench``) is MHA, no mask, Nq == Nk, D 64/128. Models
also make grouped-query calls, decode against long caches (Nq = 1, or 4 for
speculative decoding), pad batches, slide windows, run head dim 256 and make tiny
calls. This times that list (:func:`workloads`; ``--workload-set models`` the calls
of model families off it instead, :func:`model_workloads`, and ``all`` both) on every
eligible backend, on ``auto`` (``attnhub.attention`` with no backend), on ``sdpa``
(``F.scaled_dot_product_attention`` called as a model calls it: ``enable_gqa``,
``is_causal``, and a materialized bool mask for what it cannot say) and on ``patched``
(that same call under :func:`attnhub.patch`).

Timing is wall clock per call in a loop after warm-up, host time included (a tiny or
decode call is often all host time): ``iters`` calls, a device synchronization, the
elapsed time divided by ``iters``; the median of ``repeats`` such loops, the
competitors' loops interleaved in rotating order (:func:`interleaved_ms`). ``fwd_bwd``
times the forward and ``torch.autograd.grad`` of a fixed output gradient.

Each row also records the largest difference from the ``sdpa`` output on the query
rows where that output is finite, a sanity check only (the conformance suite is the
correctness test).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .api import attention, explain
from .bench import environment, parse_dtype, write_json
from .cli import positive_float
from .errors import error_line
from .patching import patch
from .request import AttentionParams, dtype_name
from .timing import loop_ms, rotated, synchronize

SDPA = "sdpa"
PATCHED = "patched"
AUTO = "auto"
# torch_reference materializes (B, H, Nq, Nk) scores: no competitor at these sizes.
_NOT_TIMED = frozenset({"torch_reference"})


@dataclass(frozen=True)
class Workload:
    """One kind of call a model makes.

    Shapes: query (batch, heads_q, nq, head_dim), key/value (batch, heads_kv, nk,
    head_dim). ``lengths``: per-row valid key counts (right padding); the call then
    carries a mask. ``train``: a model would also run its backward.
    """

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    nq: int
    nk: int
    head_dim: int
    causal: bool = False
    alignment: str = "top_left"
    window: tuple[int, int] | None = None
    lengths: tuple[int, ...] | None = None
    train: bool = False

    @property
    def modes(self) -> tuple[str, ...]:
        return ("fwd", "fwd_bwd") if self.train else ("fwd",)

    def kv_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of K and V: what a decode call must read at least once."""
        size = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.batch * self.heads_kv * self.nk * self.head_dim * size


def workloads() -> list[Workload]:
    """The call list of issue 16: prefill, decode, speculative decoding, padding, window, tiny."""
    calls: list[Workload] = []
    for d in (64, 128, 256):
        for hq, hkv in ((16, 16), (32, 8)):
            tag = f"D{d} {'MHA' if hq == hkv else 'GQA'} {hq}/{hkv}"
            calls.append(Workload(f"prefill {tag}", 4, hq, hkv, 4096, 4096, d, True, train=True))
            for nk in (4096, 32768, 131072):
                calls.append(
                    Workload(f"decode {nk // 1024}K {tag}", 8, hq, hkv, 1, nk, d, True, "bottom_right")
                )  # fmt: skip
            calls.append(
                Workload(f"spec-decode Nq4 32K {tag}", 8, hq, hkv, 4, 32768, d, True, "bottom_right")
            )  # fmt: skip
    lengths = tuple(int(512 + i * (4096 - 512) / 7) for i in range(8))
    calls.append(
        Workload("padding B8 512..4096 D128 GQA 32/8", 8, 32, 8, 4096, 4096, 128, True, lengths=lengths, train=True)
    )  # fmt: skip
    calls.append(
        Workload("window 4096 N16K D128 GQA 32/8", 1, 32, 8, 16384, 16384, 128, True, window=(4095, 0), train=True)
    )  # fmt: skip
    calls.append(Workload("tiny (1,1,16,64)", 1, 1, 1, 16, 16, 64, train=True))
    return calls


def _model_call(
    family: str,
    kind: str,
    batch: int,
    heads: tuple[int, int],
    nq: int,
    nk: int,
    d: int,
    **fields: Any,
) -> Workload:
    """A model family's call, named "<family> <kind> Hq/Hkv D<d> N<n>" (``Nq<nq> Nk<nk>``
    where they differ); ``fields``: the rest of :class:`Workload` (causal, lengths, ...)."""
    hq, hkv = heads
    n = f"N{nq}" if nq == nk else f"Nq{nq} Nk{nk}"
    return Workload(f"{family} {kind} {hq}/{hkv} D{d} {n}", batch, hq, hkv, nq, nk, d, **fields)


def model_workloads() -> list[Workload]:
    """Attention calls of model families that :func:`workloads` does not hold: head dims
    40/80/96, MQA 71/1 and GQA 28/4 and 16/8, padded and unpadded encoders, cross
    attention (Nq != Nk, no mask), diffusion self-attention, chunked prefill (Nq < Nk,
    bottom-right causal) and D256 at 8K. Nobody tuned dispatch for these shapes: they
    check that ``auto`` holds up off the tuned list. Shapes are those of one layer's call
    (heads and head dim from each model's config; batch and length a typical use)."""
    causal = {"causal": True, "train": True}  # a decoder's prefill, trained
    at_cache_end = {"causal": True, "alignment": "bottom_right"}  # new rows end the cache
    # BERT-base padded to 512: 32 rows whose valid key counts spread evenly over 128..512.
    padded = {"lengths": tuple(128 + i * (512 - 128) // 31 for i in range(32)), "train": True}
    return [
        _model_call("Qwen2.5-7B", "prefill", 1, (28, 4), 4096, 4096, 128, **causal),
        _model_call("Phi-3-mini", "prefill", 2, (32, 32), 4096, 4096, 96, **causal),
        _model_call("Phi-3-mini", "decode", 16, (32, 32), 1, 4096, 96, **at_cache_end),
        _model_call("Phi-2/StableLM", "prefill", 4, (32, 32), 2048, 2048, 80, **causal),
        _model_call("Falcon-7B", "MQA prefill", 2, (71, 1), 2048, 2048, 64, **causal),
        _model_call("BERT-base", "encoder padded 128..512", 32, (12, 12), 512, 512, 64, **padded),
        _model_call("ViT-B/16", "encoder", 64, (12, 12), 197, 197, 64, train=True),
        _model_call("Whisper", "decoder cross-attention", 8, (20, 20), 448, 1500, 64),
        _model_call("SD-1.5", "UNet self-attention", 2, (8, 8), 4096, 4096, 40),
        _model_call("SDXL", "UNet self-attention", 2, (10, 10), 4096, 4096, 64),
        _model_call("Flux/DiT", "joint attention", 1, (24, 24), 4608, 4608, 128, train=True),
        # 32/8 D128: Llama-3-8B's heads; a 512-token chunk against an 8K cache.
        _model_call("Llama-3-8B", "chunked prefill", 1, (32, 8), 512, 8192, 128, **at_cache_end),
        # Gemma 2's attention-logit softcap (50) is not a Workload field: left out.
        _model_call("Gemma-2-9B", "global prefill", 1, (16, 8), 8192, 8192, 256, **causal),
        # Llama-3-8B batch decode at mixed cache lengths needs per-row cache lengths
        # with bottom-right alignment per row, which these fields cannot say: left out.
    ]


# The call lists ``--workload-set`` chooses from.
WORKLOAD_SETS = ("issue16", "models", "all")


def select_workloads(name: str) -> list[Workload]:
    """The call list ``name`` names: ``issue16`` (:func:`workloads`), ``models``
    (:func:`model_workloads`) or ``all`` (the first, then the second)."""
    if name not in WORKLOAD_SETS:
        raise ValueError(f"unknown workload set {name!r}; sets are {', '.join(WORKLOAD_SETS)}")
    # Looked up at call time, so that both lists can be replaced (tests shrink them).
    issue16 = workloads() if name in ("issue16", "all") else []
    models = model_workloads() if name in ("models", "all") else []
    return issue16 + models


@dataclass
class _Inputs:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_out: torch.Tensor
    key_mask: torch.Tensor | None  # (B, 1, 1, Nk) valid keys, for attnhub's own calls
    dense_mask: torch.Tensor | None  # (B, 1, Nq, Nk) bool, as a model builds it for SDPA


def _dense_mask(w: Workload, key_mask: torch.Tensor | None, device: torch.device) -> Any:
    """The bool mask a model passes to SDPA for what ``is_causal`` cannot say, or None."""
    needs = w.window is not None or key_mask is not None or (w.causal and w.nq not in (1, w.nk))
    if not needs:
        return None
    from .backends.torch_reference import keep_mask  # the contract's kept positions

    params = AttentionParams(causal=w.causal, alignment=w.alignment, window=w.window)
    keep = keep_mask(w.nq, w.nk, params, device)
    keep = (torch.ones(w.nq, w.nk, dtype=torch.bool, device=device) if keep is None else keep)[
        None, None
    ]
    return keep & key_mask if key_mask is not None else keep


def _inputs(w: Workload, dtype: torch.dtype, device: torch.device) -> _Inputs:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    q = randn(w.batch, w.heads_q, w.nq, w.head_dim)
    k = randn(w.batch, w.heads_kv, w.nk, w.head_dim)
    v = randn(w.batch, w.heads_kv, w.nk, w.head_dim)
    key_mask = None
    if w.lengths is not None:
        lengths = torch.tensor(w.lengths, device=device)
        key_mask = (torch.arange(w.nk, device=device) < lengths[:, None])[:, None, None, :]
    grad = randn(w.batch, w.heads_q, w.nq, w.head_dim)
    return _Inputs(q, k, v, grad, key_mask, _dense_mask(w, key_mask, device))


def _attnhub_call(w: Workload, x: _Inputs, backend: str | None) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, x.key_mask, causal=w.causal, alignment=w.alignment,
                         window=w.window, backend=backend)  # fmt: skip

    return call


def _sdpa_call(w: Workload, x: _Inputs) -> Callable[..., torch.Tensor]:
    # Nq == 1 bottom-right sees every key: no mask and no is_causal, as decoders call it.
    is_causal = w.causal and x.dense_mask is None and w.nq != 1
    gqa = w.heads_q != w.heads_kv

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=x.dense_mask, is_causal=is_causal, enable_gqa=gqa
        )

    return call


def _iterations(fn: Callable[[], Any], device: torch.device, budget_s: float, repeats: int) -> int:
    """Warm ``fn`` up (compilation, caches, allocator) and size one timed loop of it:
    ``repeats`` loops fill about ``budget_s``."""
    for _ in range(2):
        fn()
    once = max(loop_ms(fn, device, 1) / 1e3, 1e-6)
    return max(3, min(1000, int(budget_s / repeats / once)))


def interleaved_ms(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    budget_s: float,
    repeats: int,
    context: Callable[[str], contextlib.AbstractContextManager[Any]] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """(median over ``repeats`` loops of each callable's wall-clock ms per call, the
    error of each that raised). The loops are interleaved, round by round in a rotating
    order, so that drift of the clocks or the host (seen on the H200: a tiny call's
    fwd+bwd read 0.18 ms on one backend and 0.31 on SDPA's function running the same
    kernel, timed one after the other) falls on every competitor alike; one that raises
    (out of memory, a failing kernel) is dropped, the others go on. ``context(name)``,
    where given, is entered around each of that competitor's loops (the patched way:
    ``attnhub.patch()``)."""
    errors: dict[str, str] = {}
    iters: dict[str, int] = {}
    times: dict[str, list[float]] = {}

    def attempt(name: str, measure: Callable[[], Any]) -> Any:
        try:
            with context(name) if context is not None else contextlib.nullcontext():
                return measure()
        except Exception as exc:
            errors[name] = error_line(exc)
            with contextlib.suppress(Exception):  # a sticky CUDA error raises here again
                synchronize(device)
            return None

    for name, fn in fns.items():
        found = attempt(name, functools.partial(_iterations, fn, device, budget_s, repeats))
        if found is not None:
            iters[name], times[name] = found, []
    for r in range(repeats):
        for name in rotated([n for n in iters if n not in errors], r):
            ms = attempt(name, functools.partial(loop_ms, fns[name], device, iters[name]))
            if ms is not None:
                times[name].append(ms)
    medians = {n: statistics.median(t) for n, t in times.items() if n not in errors and t}
    return medians, errors


def _runner(call: Callable[..., torch.Tensor], x: _Inputs, mode: str) -> Callable[[], Any]:
    if mode == "fwd":
        return lambda: call(x.query, x.key, x.value)
    leaves = [t.detach().requires_grad_() for t in (x.query, x.key, x.value)]

    def step() -> Any:
        out = call(*leaves)
        return torch.autograd.grad(out, leaves, x.grad_out)

    return step


def _max_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    rows = torch.isfinite(ref).all(dim=-1, keepdim=True)
    diff = (out.float() - ref.float()).abs().masked_fill(~rows, 0)
    return float(diff.max()) if diff.numel() else 0.0


def competitors(
    w: Workload, x: _Inputs, mode: str
) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """Callables to time, by name, and why each registered backend is not among them."""
    needs_grad = mode == "fwd_bwd"
    q = x.query.detach().requires_grad_(needs_grad)
    decision = explain(q, x.key, x.value, x.key_mask, causal=w.causal, alignment=w.alignment,
                       window=w.window)  # fmt: skip
    calls: dict[str, Callable[..., Any]] = {}
    skipped: dict[str, str] = {}
    for c in decision.candidates:
        if c.name in _NOT_TIMED:
            skipped[c.name] = "not timed"
        elif c.reasons:
            skipped[c.name] = "; ".join(c.reasons)
        else:
            calls[c.name] = _attnhub_call(w, x, c.name)
    calls[AUTO] = _attnhub_call(w, x, None)
    calls[SDPA] = _sdpa_call(w, x)
    calls[PATCHED] = _sdpa_call(w, x)  # run under attnhub.patch() by run_workloads
    return calls, skipped


def _patched_if(name: str) -> Any:
    return patch(aliases=False) if name == PATCHED else contextlib.nullcontext()


def _served_by(name: str, step: Callable[[], Any]) -> str | None:
    """Which backend ``auto`` or ``patched`` ran in one ``step`` (from attnhub.stats()).

    ``step`` is what is timed (:func:`_runner`): a call that needs gradients is decided
    for them, and may be served by another backend than its forward alone.
    """
    if name not in (AUTO, PATCHED):
        return None
    from .call_stats import reset_stats, stats

    reset_stats()
    with _patched_if(name):
        step()
    served = stats()
    return ", ".join(sorted(served)) or None


def _rows(
    w: Workload, dtype: torch.dtype, device: torch.device, budget_s: float, repeats: int
) -> Iterator[dict[str, Any]]:
    x = _inputs(w, dtype, device)
    base = {**asdict(w), "dtype": dtype_name(dtype)}
    with torch.no_grad():
        reference = _sdpa_call(w, x)(x.query, x.key, x.value)
    for mode in w.modes:
        calls, skipped = competitors(w, x, mode)
        for name, why in sorted(skipped.items()):
            yield {**base, "mode": mode, "backend": name, "ms": None, "skipped": why}
        rows: dict[str, dict[str, Any]] = {}
        timed: dict[str, Callable[[], Any]] = {}
        for name, call in calls.items():
            row = rows[name] = {**base, "mode": mode, "backend": name}
            try:
                with _patched_if(name), torch.no_grad():
                    row["max_abs_vs_sdpa"] = _max_diff(call(x.query, x.key, x.value), reference)
                step = _runner(call, x, mode)
                row["served_by"] = _served_by(name, step)
                timed[name] = step
            except Exception as exc:  # one failing competitor must not end the run
                row["ms"] = None
                row["error"] = error_line(exc)
        ms, errors = interleaved_ms(
            timed, device, budget_s=budget_s, repeats=repeats, context=_patched_if
        )
        for name, row in rows.items():
            if name in timed:
                row["ms"] = ms.get(name)
            if name in errors:
                row["error"] = errors[name]
            if mode == "fwd" and row.get("ms"):
                row["kv_tb_s"] = w.kv_bytes(dtype) / (row["ms"] * 1e-3) / 1e12
            yield row
    del x


def run_workloads(
    dtypes: tuple[str, ...],
    device: torch.device,
    *,
    only: str | None = None,
    workload_set: str = "issue16",
    budget_s: float = 0.15,
    repeats: int = 3,
    output: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every workload of the set ``workload_set`` (:data:`WORKLOAD_SETS`) in
    every dtype; the results JSON (rewritten as it goes), its ``config`` saying what ran.
    ``only``: comma-separated parts of names; the workloads whose name holds any."""
    config = {"workload_set": workload_set, "only": only, "dtypes": list(dtypes),
              "budget_s": budget_s, "repeats": repeats}  # fmt: skip
    data: dict[str, Any] = {
        "kind": "workloads", "env": environment(device), "config": config, "results": [],
    }  # fmt: skip
    parts = None if only is None else [p.strip() for p in only.split(",") if p.strip()]
    calls = select_workloads(workload_set)
    chosen = [w for w in calls if parts is None or any(p in w.name for p in parts)]
    for dtype_text in dtypes:
        dtype = parse_dtype(dtype_text)
        for w in chosen:
            if progress:
                print(f"[{dtype_name(dtype)}] {w.name}", file=sys.stderr, flush=True)
            data["results"].extend(_rows(w, dtype, device, budget_s, repeats))
            if output is not None:
                write_json(data, output)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return data


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, dtype, mode): auto against the fastest and against sdpa."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in data["results"]:
        groups.setdefault((r["name"], r["dtype"], r["mode"]), []).append(r)
    summary = []
    for (name, dtype, mode), rows in groups.items():
        timed = {r["backend"]: r for r in rows if r.get("ms")}
        backends = {b: r["ms"] for b, r in timed.items() if b not in (AUTO, SDPA, PATCHED)}
        best = min(backends, key=backends.__getitem__) if backends else None
        auto = timed.get(AUTO, {}).get("ms")
        summary.append(
            {
                "workload": name,
                "dtype": dtype,
                "mode": mode,
                "auto_ms": auto,
                "auto_picked": timed.get(AUTO, {}).get("served_by"),
                "fastest": best,
                "fastest_ms": backends.get(best) if best else None,
                "auto_vs_fastest": backends[best] / auto if best and auto else None,
                "sdpa_ms": timed.get(SDPA, {}).get("ms"),
                "auto_vs_sdpa": timed[SDPA]["ms"] / auto if auto and SDPA in timed else None,
                "patched_ms": timed.get(PATCHED, {}).get("ms"),
                "patched_vs_sdpa": timed[SDPA]["ms"] / timed[PATCHED]["ms"]
                if SDPA in timed and PATCHED in timed
                else None,
            }
        )
    return summary


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def markdown(data: dict[str, Any]) -> str:
    """The summary as a markdown table (ratios > 1: auto / patched is faster)."""
    env = data["env"]
    lines = [
        f"# Workloads: {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
        f"attnhub {env['attnhub_commit']}, {env['date']}",
        "",
        "Wall clock per call, host time included (ms). `auto/fastest` = fastest eligible "
        "backend's time / auto's (>= 0.97 is the bar); `auto/sdpa` and `patched/sdpa` = "
        "F.scaled_dot_product_attention's time / theirs (>= 1: not slower than stock).",
        "",
        "| workload | dtype | mode | auto | auto picked | fastest | fastest ms | auto/fastest | sdpa ms | auto/sdpa | patched ms | patched/sdpa |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summarize(data):
        lines.append(
            f"| {s['workload']} | {s['dtype']} | {s['mode']} | {_fmt(s['auto_ms'])} | "
            f"{s['auto_picked'] or '-'} | {s['fastest'] or '-'} | {_fmt(s['fastest_ms'])} | "
            f"{_fmt(s['auto_vs_fastest'], '.2f')} | {_fmt(s['sdpa_ms'])} | "
            f"{_fmt(s['auto_vs_sdpa'], '.2f')} | {_fmt(s['patched_ms'])} | "
            f"{_fmt(s['patched_vs_sdpa'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workloads (--workloads)")
    g.add_argument("--workloads", action="store_true", help="time the calls real models make (see attnhub.bench_workloads) instead of the grid")  # fmt: skip
    g.add_argument(
        "--only",
        help="with --workloads: only workloads whose name contains this (or any of these, comma-separated)",
    )
    g.add_argument("--workload-set", choices=WORKLOAD_SETS, default="issue16", help="with --workloads: issue16 (issue 16's list), models (model families' calls off that list: see model_workloads) or all (default issue16)")  # fmt: skip
    g.add_argument("--budget", type=positive_float, default=0.15, help="with --workloads: seconds of timed calls per competitor (default 0.15)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attnhub bench --workloads: CUDA is not available here", file=sys.stderr)
        return 2
    dtypes = tuple(args.dtypes) if args.dtypes else ("bfloat16", "float16")
    output = Path(args.output or "attnhub-workloads.json")
    data = run_workloads(dtypes, device, only=args.only, workload_set=args.workload_set,
                         budget_s=args.budget, output=output, progress=args.progress)  # fmt: skip
    write_json(data, output)
    table = markdown(data)
    output.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {output} and {output.with_suffix('.md')}", file=sys.stderr)
    return 0
