"""Where a patched model's ``generate`` spends its time, against stock and the other ways.

``attnhub bench --models`` gives each way's tokens per second; this splits a patched
run's wall clock into the host time inside ``F.scaled_dot_product_attention`` (wall
clock of the Python call, no synchronization: what the model's host thread pays per
call) by the call's layer, next to stock's and attn_implementation="attnhub"'s (its
``attention`` call), and times variants of the patched way that each remove one suspect:

- ``sdpa``: stock (``attn_implementation="sdpa"``);
- ``patch``: under ``attnhub.patch()`` entered for each run, as the models bench does;
- ``patch-once``: the patch entered once for every run (its memo survives between runs);
- ``patch-torch_sdpa``: ``patch(backend="torch_sdpa")``: PyTorch's kernel choice behind the
  patch's dispatch (no Triton launch; a prefill's mask is still read for its plan, a
  decoding step's is not: patching._reads_mask);
- ``patch-triton_flash``: ``patch(backend="triton_flash")``: our kernels behind the patch
  (the decoding steps on triton_flash's split-KV decode, whatever the dispatch would pick);
- ``attnhub``: ``attn_implementation="attnhub"``.

    python benchmarks/patched_generate_probe.py [--model llama] [--task generate_padded] \
        [--repeats 6] [--ways sdpa,patch,...] [--drain] [--profile-layer0 N] [--explain] \
        [--json OUT]

Prints, per way, the median run time, its ratio to stock, the mean host time of the
prefill's attention calls, and that of the decoding steps' calls by layer (layer 0 of a
step sees a new key length and a new mask; the others repeat layer 0's shapes). ``--explain``: also ``attnhub.explain`` of the
last layer-0 call of the patched way and of attn_implementation="attnhub"'s, as each
made it (the backend each chose, the others' reasons and measured times).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import inspect
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import attnhub
from attnhub import bench_models as bm
from attnhub.integrations import transformers as hf_attnhub
from attnhub.timing import synchronize

WAYS = ("sdpa", "patch", "patch-once", "patch-torch_sdpa", "patch-triton_flash", "attnhub")
DEFAULT_WAYS = ("sdpa", "patch", "patch-once", "patch-torch_sdpa", "attnhub")
PREFILL = -1  # the host-time slot of the prefill's calls


@contextlib.contextmanager
def _timed_calls(
    owner: Any,
    name: str,
    layers: int,
    host: dict[int, list[float]],
    drain: bool,
    profiler: cProfile.Profile | None = None,
    captured: dict[str, Any] | None = None,
) -> Iterator[None]:
    """``owner.name`` (F.scaled_dot_product_attention, PyTorch's or a patch's, or the
    ``attention`` that attn_implementation="attnhub" calls) wrapped so that each call's
    host time is appended to ``host[layer]`` for the decoding steps' calls and to
    ``host[PREFILL]`` for the prefill's (the run's first ``layers`` calls; in patch mode
    they read their mask, a synchronization, which a layer's mean over the steps would
    otherwise carry). ``drain``: the device's queue is emptied before each call, so that
    a call that synchronizes does not count the wait for the work queued before it.
    ``profiler``: enabled around the decoding steps' layer-0 calls (a new key length, a
    new mask). ``captured``: holds the arguments of the last of them ("args", "kwargs")."""
    inner = getattr(owner, name)
    count = [0]

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        if drain:
            synchronize(args[0].device)
        step_call = count[0] - layers  # < 0: the prefill's
        slot = PREFILL if step_call < 0 else step_call % layers
        first = profiler is not None and slot == 0
        if captured is not None and slot == 0:
            captured["args"], captured["kwargs"] = args, kwargs
        if first:
            profiler.enable()
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        host[slot].append(time.perf_counter() - start)
        if first:
            profiler.disable()
        count[0] += 1
        return out

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, inner)


def _way_context(way: str) -> contextlib.AbstractContextManager[Any]:
    if way == "patch":
        return attnhub.patch(aliases=False)
    if way.startswith("patch-") and way != "patch-once":
        return attnhub.patch(way.removeprefix("patch-"), aliases=False)
    return contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument(
        "--task", choices=("generate", "generate_padded"), default="generate_padded"
    )
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument(
        "--ways",
        default=",".join(DEFAULT_WAYS),
        help=f"comma-separated, in order, sdpa first (of {', '.join(WAYS)})",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--drain",
        action="store_true",
        help="synchronize before each timed attention call (the runs' times then include those waits)",
    )
    parser.add_argument(
        "--profile-layer0",
        type=int,
        default=0,
        metavar="N",
        help="also cProfile each way's layer-0 calls (timed runs), listing N functions",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="also attnhub.explain the last layer-0 call of the patch and attnhub ways",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    ways = tuple(args.ways.split(","))
    if ways[0] != "sdpa" or not set(ways) <= set(WAYS):
        parser.error(f"--ways: sdpa first, then any of {', '.join(WAYS)}")
    device = torch.device(args.device)
    (spec,) = [m for m in bm.MODELS if m.name == args.model]
    _, generate = bm._inputs(spec, 32000, device)
    prompts, mask = generate[args.task]
    # One model for every way, switched between stock's implementation and attnhub's
    # (as `attnhub bench --models` does): a model per way made host time that is not
    # attention's differ between the ways (F.linear, benchmarks/NOTES.md 2026-12-06).
    model, implementations = bm.build_shared(spec, torch.bfloat16, device, 32000)

    def generate(way: str) -> None:
        bm._switch(model, implementations["attnhub" if way == "attnhub" else "sdpa"])
        bm._generate(model, prompts, mask, spec.new_tokens)

    run: dict[str, Callable[[], None]] = {way: functools.partial(generate, way) for way in ways}
    once = attnhub.patch(aliases=False)
    once.undo()  # re-entered around each of its runs below, the same handle's function

    def context(way: str) -> contextlib.AbstractContextManager[Any]:
        if way == "patch-once":
            return _Reentered(once)
        return _way_context(way)

    profilers: dict[str, cProfile.Profile] = {}
    seconds: dict[str, list[float]] = defaultdict(list)
    host: dict[str, dict[int, list[float]]] = {way: defaultdict(list) for way in ways}
    captured: dict[str, dict[str, Any]] = {way: {} for way in ("patch", "attnhub")}
    served: dict[str, dict[str, int]] = {}
    for way in ways:  # warm-up: compiles, autotuning, caches
        with context(way):
            run[way]()
            attnhub.reset_stats()
            run[way]()
            served[way] = attnhub.stats()
    for repeat in range(args.repeats):
        for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
            timed = (
                (hf_attnhub, "attention")
                if way == "attnhub"
                else (F, "scaled_dot_product_attention")
            )
            profiler = (
                profilers.setdefault(way, cProfile.Profile()) if args.profile_layer0 else None
            )
            capture = captured.get(way) if args.explain else None
            with (
                context(way),
                _timed_calls(*timed, spec.layers, host[way], args.drain, profiler, capture),
            ):
                synchronize(device)
                start = time.perf_counter()
                run[way]()
                synchronize(device)
                seconds[way].append(time.perf_counter() - start)
    stock = statistics.median(seconds["sdpa"])
    print(
        f"# {args.model} {args.task}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, {args.repeats} repeats"
    )
    print(
        "way                 median s  x sdpa   prefill | host us per decoding call by layer (mean)   served"
    )
    rows = []
    for way in ways:
        median = statistics.median(seconds[way])
        mean_us = {
            slot: statistics.fmean(times) * 1e6 if times else float("nan")
            for slot, times in host[way].items()
        }
        prefill = mean_us.get(PREFILL, float("nan"))
        by_layer = [mean_us.get(i, float("nan")) for i in range(spec.layers)]
        print(
            f"{way:18}  {median:8.4f}  {stock / median:5.3f}   {prefill:7.1f} | "
            + " ".join(f"{t:6.1f}" for t in by_layer)
            + f"   {served[way]}"
        )
        rows.append(
            {
                "way": way,
                "seconds": seconds[way],
                "host_us_prefill": prefill,
                "host_us_by_layer": by_layer,
                "served": served[way],
            }
        )
    for way, profiler in profilers.items():
        print(
            f"\n## {way}: the calls of layer 0, cProfile (top {args.profile_layer0} by cumulative time)"
        )
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile_layer0)
    for way, call in captured.items():
        if call:
            print(f"\n## {way}: attnhub.explain of its last layer-0 call\n")
            print(_explained(way, call["args"], call["kwargs"], once.function))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "task": args.task, "rows": rows}, f, indent=1)


def _explained(way: str, args: tuple, kwargs: dict[str, Any], patched: Callable[..., Any]) -> str:
    """``attnhub.explain`` of a captured call: attention()'s arguments as
    attn_implementation="attnhub" made them, or F.scaled_dot_product_attention's (bound
    to the signature of ``patched``, a patch's replacement) as the patch translates
    them (attnhub.api.sdpa_entry: causal, scale, dropout)."""
    if way == "attnhub":
        return str(attnhub.explain(*args, **kwargs))
    bound = inspect.signature(patched).bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    decision = attnhub.explain(
        call["query"], call["key"], call["value"], call["attn_mask"],
        causal=call["is_causal"], scale=call["scale"], dropout_p=call["dropout_p"],
    )  # fmt: skip
    return str(decision)


class _Reentered(contextlib.AbstractContextManager[Any]):
    """A patch handle's own function installed again for a block (its memo kept)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __enter__(self) -> None:
        self.saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self.handle.function

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = self.saved


if __name__ == "__main__":
    main()
