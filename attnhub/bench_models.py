"""``attnhub bench --models``: Hugging Face models end to end, stock against attnhub.

Llama-, Mistral-, Gemma 2-, Gemma 3-, Qwen2-, Qwen3- and Phi-3-style causal language
models built from configs (random weights, nothing downloaded), each run three ways on
the same weights and tokens:

- ``sdpa``: transformers' ``attn_implementation="sdpa"`` (PyTorch's function);
- ``patch``: the same model under :func:`attnhub.patch`;
- ``attnhub``: ``attn_implementation="attnhub"``
  (:func:`attnhub.integrations.transformers.register`).

Three measurements per way: a training step (forward and backward of the next-token
loss, no optimizer) in tokens per second, and greedy ``generate`` with the KV cache
(a batch of prompts, a fixed number of new tokens, ``min_new_tokens`` so that every
row runs to the end) in new tokens per second, of prompts of one length
(``generate``) and of left-padded prompts of different lengths (``generate_padded``:
every step then passes attention a padding mask); each with peak memory. Timed by wall
clock after a warm-up step, the median of a few repetitions, the ways interleaved, in
an order that rotates from one repetition to the next, so that drift hits them alike
(in one fixed order the first way gained from a host that slowed over a run: stock's
generate went from 0.43 to 0.62 s over five repetitions on the H200, 2026-12-02).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .bench import environment, write_json
from .call_stats import reset_stats, stats
from .cli import positive_int
from .patching import patch
from .timing import rotated, synchronize

WAYS = ("sdpa", "patch", "attnhub")


@dataclass(frozen=True)
class ModelSpec:
    """A model family at one size, and the shapes it is run at."""

    name: str
    family: str  # a key of FAMILIES
    layers: int = 8
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    window: int | None = None
    softcap: float | None = None
    train_batch: int = 2
    train_seq: int = 4096
    gen_batch: int = 8
    prompt: int = 512
    new_tokens: int = 64


MODELS = (
    ModelSpec("llama", "llama"),
    ModelSpec("mistral-window1024", "mistral", window=1024, train_batch=1, train_seq=8192),
    ModelSpec("gemma2-window1024-softcap50", "gemma2", window=1024, softcap=50.0, train_batch=1, train_seq=8192),
    ModelSpec("qwen2", "qwen2"),
    ModelSpec("qwen3", "qwen3"),
    ModelSpec("phi3", "phi3"),
    ModelSpec("gemma3-window1024", "gemma3", layers=12, window=1024, train_batch=1, train_seq=8192),
)  # fmt: skip


# Each family's transformers config class and what it adds to the common sizes.
FAMILIES: dict[str, tuple[str, Callable[[ModelSpec], dict[str, Any]]]] = {
    "llama": ("LlamaConfig", lambda spec: {}),
    "qwen2": ("Qwen2Config", lambda spec: {}),
    "qwen3": ("Qwen3Config", lambda spec: {"head_dim": spec.hidden // spec.heads}),
    "phi3": ("Phi3Config", lambda spec: {"pad_token_id": 0}),
    "mistral": ("MistralConfig", lambda spec: {"sliding_window": spec.window}),
    "gemma2": ("Gemma2Config", lambda spec: {
        "head_dim": spec.hidden // spec.heads, "sliding_window": spec.window,
        "attn_logit_softcapping": spec.softcap, "final_logit_softcapping": None}),
    # Gemma 3's own layer pattern: five sliding-window layers to one global.
    "gemma3": ("Gemma3TextConfig", lambda spec: {
        "head_dim": spec.hidden // spec.heads, "sliding_window": spec.window,
        "final_logit_softcapping": None}),
}  # fmt: skip


def _config(spec: ModelSpec, vocab: int) -> Any:
    import transformers

    if spec.family not in FAMILIES:
        raise ValueError(f"unknown model family {spec.family!r}; known: {', '.join(FAMILIES)}")
    config_class, extra = FAMILIES[spec.family]
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=int(2.75 * spec.hidden),
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=max(spec.train_seq, spec.prompt + spec.new_tokens),
    )  # fmt: skip
    return getattr(transformers, config_class)(**common, **extra(spec))


def build(
    spec: ModelSpec, way: str, dtype: torch.dtype, device: torch.device, vocab: int
) -> tuple[Any, str]:
    """The model for ``way`` and the attn_implementation it runs, weights seeded alike.

    A family whose transformers version refuses ``sdpa`` (Gemma2 with softcapping, in
    some versions) runs stock as ``eager``, and so does ``patch`` (which then changes
    nothing: eager attention does not call SDPA); the row says so.
    """
    from transformers import AutoModelForCausalLM

    implementations = ["sdpa", "eager"]
    if way == "attnhub":
        from .integrations.transformers import register

        implementations = [register()]
    for implementation in implementations:
        torch.manual_seed(0)
        try:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    _config(spec, vocab), attn_implementation=implementation, dtype=dtype
                )
        except ValueError:
            if implementation == implementations[-1]:
                raise
            continue
        return model, implementation
    raise AssertionError("unreachable")


def build_shared(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device, vocab: int
) -> tuple[Any, dict[str, str]]:
    """One model for every way, and the attn_implementation each way runs on it.

    The ways switch the one model (transformers' ``set_attn_implementation``) instead of
    each building its own: with a model per way, a ``generate``'s 3,648 ``F.linear``
    calls took 150-180 ms of host time in the stock and patched models and 104 ms in
    the attn_implementation one (cProfile, H100, benchmarks/NOTES.md 2026-12-06): a
    difference of the instances, not of the attention, in a host-bound task; and each
    way's peak memory counted the other ways' weights.
    """
    from .integrations.transformers import register

    model, stock = build(spec, "sdpa", dtype, device, vocab)
    if not hasattr(model, "set_attn_implementation"):
        import transformers

        raise RuntimeError(
            "attnhub bench --models switches one model between the ways with "
            "PreTrainedModel.set_attn_implementation, which transformers "
            f"{transformers.__version__} lacks: upgrade transformers"
        )
    implementations = {"sdpa": stock, "patch": stock, "attnhub": register()}
    return model, implementations


def _switch(model: Any, implementation: str) -> Any:
    """``model`` running ``implementation`` (set only when it runs another)."""
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)
    return model


def _context(way: str) -> contextlib.AbstractContextManager[Any]:
    return patch(aliases=False) if way == "patch" else contextlib.nullcontext()


def _train_step(model: Any, ids: torch.Tensor) -> None:
    logits = model(ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def _generate(model: Any, prompts: torch.Tensor, mask: torch.Tensor, new: int) -> None:
    with torch.no_grad():
        model.generate(
            input_ids=prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip


@dataclass
class _Timed:
    seconds: list[float]
    peak_mib: float | None


def _time(fn: Callable[[], None], device: torch.device) -> tuple[float, float | None]:
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return time.perf_counter() - start, peak


def _inputs(
    spec: ModelSpec, vocab: int, device: torch.device
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The training batch, and each generate task's (prompts, attention mask): all of
    ``spec.prompt`` tokens, and a batch of prompts of different lengths (entry b keeps
    its last prompt - b * prompt / (2 * batch) tokens), left-padded as a tokenizer pads
    a batch for generation: the model then builds a padding mask every step."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(1, vocab, (spec.train_batch, spec.train_seq), generator=gen)
    prompts = torch.randint(1, vocab, (spec.gen_batch, spec.prompt), generator=gen)
    pads = torch.arange(spec.gen_batch) * spec.prompt // (2 * spec.gen_batch)
    padded = (torch.arange(spec.prompt)[None, :] >= pads[:, None]).long()
    return ids.to(device), {
        "generate": (prompts.to(device), torch.ones_like(prompts).to(device)),
        "generate_padded": ((prompts * padded).to(device), padded.to(device)),
    }


def prewarm(spec: ModelSpec, dtype: torch.dtype, device: torch.device, vocab: int = 32000) -> None:
    """One training step and each generate task of ``spec`` in both of attnhub's ways,
    for what they run through attnhub (``attnhub tune --model``)."""
    ids, generate = _inputs(spec, vocab, device)
    model, implementations = build_shared(spec, dtype, device, vocab)
    for way in ("patch", "attnhub"):
        with _context(way):
            _switch(model, implementations[way])
            _train_step(model, ids)
            for prompts, mask in generate.values():
                _generate(model, prompts, mask, spec.new_tokens)
    del model


def run_model(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device, repeats: int, vocab: int = 32000
) -> Iterator[dict[str, Any]]:
    """Rows for one model: each way, training and generation, interleaved repeats."""
    ids, generate = _inputs(spec, vocab, device)
    work: dict[str, Callable[[Any], None]] = {"train": lambda m: _train_step(m, ids)}
    tokens = {"train": ids.numel()}
    for task, (prompts, mask) in generate.items():
        work[task] = functools.partial(_generate, prompts=prompts, mask=mask, new=spec.new_tokens)
        tokens[task] = spec.gen_batch * spec.new_tokens
    for task, fn in work.items():
        timed: dict[str, _Timed] = {}
        model, implementations = build_shared(spec, dtype, device, vocab)
        served: dict[str, dict[str, int]] = {}
        for way in WAYS:  # warm-up: compilation, caches, autotuning
            with _context(way):
                _switch(model, implementations[way])
                fn(model)
                reset_stats()  # what serves the attention calls, once warm
                fn(model)
                served[way] = stats()
        for repeat in range(repeats):
            for way in rotated(WAYS, repeat):
                with _context(way):
                    _switch(model, implementations[way])
                    seconds, peak = _time(functools.partial(fn, model), device)
                entry = timed.setdefault(way, _Timed([], peak))
                entry.seconds.append(seconds)
                if peak is not None:
                    entry.peak_mib = max(entry.peak_mib or 0.0, peak)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        stock = statistics.median(timed["sdpa"].seconds)
        for way, t in timed.items():
            seconds = statistics.median(t.seconds)
            yield {
                **asdict(spec), "task": task, "way": way, "implementation": implementations[way],
                "seconds": seconds,
                "tokens_per_s": tokens[task] / seconds, "vs_sdpa": stock / seconds,
                "peak_mib": t.peak_mib, "all_seconds": t.seconds, "served": served[way],
            }  # fmt: skip


def paired_ratio(stock: list[float], mine: list[float]) -> float:
    """The median over repeats of stock's time over mine in the same repeat.

    A repeat runs every way back to back (:func:`run_model`), so a host whose speed
    drifts over the run (on the H200, stock's generate moved from 728 to 1,181 tokens/s
    between two runs minutes apart) moves both times of a pair alike, and their ratio
    little; the ratio of the medians takes its two medians from different repeats.
    """
    return statistics.median(s / m for s, m in zip(stock, mine, strict=True))


def markdown(data: dict[str, Any]) -> str:
    env = data["env"]
    lines = [
        f"# Models: {env['gpu']}, torch {env['torch']}, transformers {data.get('transformers')}, "
        f"attnhub {env['attnhub_commit']}, {env['date']}, {data['dtype']}",
        "",
        "Tokens per second (training: tokens in the batch per forward+backward; generate: "
        "new tokens per second), the median of the repeats; `x sdpa` = speed relative to "
        "stock `sdpa` (median / best / paired: the ratio of the medians, of the fastest "
        "repeats, and the median of each repeat's own ratio, its ways run back to back: "
        "the two that a host changing speed during the run disturbs least).",
        "",
        "| model | task | sdpa tok/s | patch tok/s | x sdpa median / best / paired | attnhub tok/s | x sdpa median / best / paired | peak MiB sdpa / patch / attnhub |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in data["results"]:
        rows.setdefault((r["name"], r["task"]), {})[r["way"]] = r
    for (name, task), ways in rows.items():

        def cell(way: str, key: str, spec: str, ways: Any = ways) -> str:
            value = ways.get(way, {}).get(key)
            return "-" if value is None else format(value, spec)

        def ratio(way: str, ways: Any = ways) -> str:
            median = cell(way, "vs_sdpa", ".2f", ways)
            stock, mine = (ways.get(w, {}).get("all_seconds") for w in ("sdpa", way))
            if not (stock and mine and len(stock) == len(mine)):
                return median
            return f"{median} / {min(stock) / min(mine):.2f} / {paired_ratio(stock, mine):.2f}"

        stock_impl = ways.get("sdpa", {}).get("implementation", "sdpa")
        label = name if stock_impl == "sdpa" else f"{name} (stock runs {stock_impl})"
        lines.append(
            f"| {label} | {task} | {cell('sdpa', 'tokens_per_s', ',.0f')} | "
            f"{cell('patch', 'tokens_per_s', ',.0f')} | {ratio('patch')} | "
            f"{cell('attnhub', 'tokens_per_s', ',.0f')} | {ratio('attnhub')} | "
            f"{' / '.join(cell(w, 'peak_mib', '.0f') for w in WAYS)} |"
        )
    lines += ["", "Attention calls of one warm run, by what served them (`attnhub.stats()`):", ""]
    for (name, task), ways in rows.items():
        for way in ("patch", "attnhub"):
            served = ways.get(way, {}).get("served")
            if served:
                text = ", ".join(f"{backend} {n}" for backend, n in served.items())
                lines.append(f"- {name} {task}, {way}: {text}")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models (--models)")
    g.add_argument("--models", action="store_true", help="Hugging Face models end to end: stock sdpa vs patch() vs attn_implementation='attnhub'")  # fmt: skip
    g.add_argument("--model-names", help=f"with --models: comma-separated subset of {','.join(m.name for m in MODELS)}")  # fmt: skip
    g.add_argument("--repeats", type=positive_int, default=6, help="with --models: timed repetitions per way, the order of the ways rotating (default 6)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    import transformers

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = set(args.model_names.split(",")) if args.model_names else None
    specs = [m for m in MODELS if names is None or m.name in names]
    output = Path(args.output or "attnhub-models.json")
    data: dict[str, Any] = {
        "kind": "models", "env": environment(device), "transformers": transformers.__version__,
        "dtype": str(dtype).removeprefix("torch."), "results": [],
    }  # fmt: skip
    for spec in specs:
        if args.progress:
            print(f"model {spec.name}", file=sys.stderr, flush=True)
        data["results"].extend(run_model(spec, dtype, device, args.repeats))
        write_json(data, output)
    table = markdown(data)
    output.with_suffix(".md").write_text(table)
    print(table)
    return 0
