"""Batched greedy generation with a paged KV cache through attnhub.

    python examples/paged_generate.py                          # CPU, a tiny model, float32
    python examples/paged_generate.py --device cuda            # bf16, a 1B-class Llama shape
    python examples/paged_generate.py --check                  # compare with HF's generate()

A Hugging Face Llama-style model built from a config (random weights, nothing
downloaded) runs with a custom attention function registered with transformers'
``AttentionInterface`` as ``attn_implementation="attnhub_paged"``. The function keeps
no state itself: the generation loop hands it an :class:`attnhub.paged_cache.PagedKVCache`
(per layer a page pool (num_pages, page_size, Hkv, D); one block table (B, pages_per_seq)
whose pages a small allocator hands out as sequences grow) through the model call's
keyword arguments, and calls the model with ``use_cache=False``: transformers keeps no
cache of its own.

- Prefill: the prompts (different lengths) are packed into one row of T tokens, with
  position ids restarting at 0 for each prompt; the attention function writes their keys
  and values into the pages and runs ``attnhub.attention_varlen`` (causal per prompt).
  Packing, not padding, is the point of a paged cache: no token is computed twice and no
  page holds padding. (``attention_kvcache`` cannot do it in one call: its k_new has one
  Nnew for every sequence.)
- Decoding: one token per sequence per step, ``position_ids`` = the sequence's length;
  the attention function calls ``attnhub.attention_kvcache(q, k_pool, v_pool,
  cache_seqlens, block_table=..., k_new=key, v_new=value)``, which appends the new key
  and value into each sequence's page in place and attends to its keys.

Every sequence generates ``--new-tokens`` tokens (no end-of-sequence stop). Prints the
tokens, decode tokens/s, the backends that served the calls, and with ``--check``
whether the tokens equal transformers' own greedy ``generate()`` (DynamicCache, eager
attention, left-padded prompts with an attention mask); in float32 they do, in bf16 a
near-tie of two logits may resolve differently.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import attnhub
from attnhub.paged_cache import PagedKVCache

IMPLEMENTATION = "attnhub_paged"


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_cache: PagedKVCache | None = None,
    paged_backend: str | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function over a :class:`PagedKVCache`.

    query (B, Hq, N, D), key/value (B, Hkv, N, D) after the rotary embedding; returns
    ((B, N, Hq, D), None). A prefill step has B == 1 and the prompts packed along N.
    """
    if paged_cache is None:
        raise ValueError(
            f"attn_implementation={IMPLEMENTATION!r} needs paged_cache=PagedKVCache(...) "
            "in the model call (see generate())"
        )
    if attention_mask is not None or dropout:
        raise ValueError(f"{IMPLEMENTATION}: no attention mask and no dropout (got one)")
    options: dict[str, Any] = dict(scale=scaling, softcap=softcap, backend=paged_backend)
    if sliding_window is not None:
        options["window"] = (sliding_window - 1, 0)  # transformers keeps kv > q - W
    layer = module.layer_idx  # type: ignore[attr-defined]
    counts = paged_cache.step
    if query.shape[0] == paged_cache.batch and all(c == query.shape[2] for c in counts):
        # (B, Hq, Nq, D): Nq new tokens for every sequence (decoding).
        out = paged_cache.attend(layer, query, key, value, **options)
        return out.transpose(1, 2), None
    # One row of the step's tokens packed (a prefill of prompts of different lengths).
    packed = [t[0].transpose(0, 1) for t in (query, key, value)]  # (T, H, D)
    out = paged_cache.attend(layer, *packed, **options)
    return out.unsqueeze(0), None


def register() -> str:
    """Register :func:`paged_attention` as ``attn_implementation="attnhub_paged"``.

    No mask function is registered: transformers then builds no mask, which is what
    the cache's calls need (causality and per-sequence lengths are theirs)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention)
    return IMPLEMENTATION


def build_model(
    *, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, max_positions: int,
    dtype: torch.dtype, device: str | torch.device, seed: int = 0,
) -> Any:  # fmt: skip
    """A Llama-style causal LM from a config (random weights, as attnhub.bench_models)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        # Every row generates its full count: no token ends a sequence.
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model.eval()


@torch.no_grad()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    page_size: int = 16,
    num_pages: int | None = None,
    backend: str | None = None,
    check_indices: bool = True,
    timings: dict[str, float] | None = None,
) -> torch.Tensor:
    """Greedy tokens (B, max_new_tokens) for ``prompts``, through a paged KV cache.

    The model must run ``attn_implementation="attnhub_paged"`` (:func:`register`).
    ``num_pages`` defaults to exactly the pages the batch needs; ``backend`` pins
    attnhub's backend for every attention call; ``check_indices`` goes to the calls
    (False: no host read of the index tensors at every layer, the allocator vouches
    for them). ``timings`` (if given) receives ``prefill_s`` and ``decode_s``.
    """
    if model.config._attn_implementation != IMPLEMENTATION:
        raise ValueError(f"the model must run attn_implementation={IMPLEMENTATION!r}")
    if not prompts or any(len(p) == 0 for p in prompts) or max_new_tokens < 1:
        raise ValueError("prompts: at least one, none empty; max_new_tokens >= 1")
    config = model.config
    device = model.device
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    lengths = [len(p) for p in prompts]
    # The last generated token is never fed back: its key is not stored.
    per_seq = [math.ceil((n + max_new_tokens - 1) / page_size) for n in lengths]
    cache = PagedKVCache(
        config.num_hidden_layers, len(prompts), num_pages or sum(per_seq), page_size,
        config.num_key_value_heads, head_dim, pages_per_seq=max(per_seq),
        dtype=model.dtype, device=device, check_indices=check_indices,
    )  # fmt: skip
    extra = {"paged_cache": cache, "paged_backend": backend, "use_cache": False}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    start = time.perf_counter()
    ids = torch.tensor([t for p in prompts for t in p], device=device)[None]
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)[None]
    last = torch.tensor(lengths).cumsum(0).sub(1).to(device)
    cache.start(lengths)
    logits = model(input_ids=ids, position_ids=positions, logits_to_keep=last, **extra).logits
    cache.finish()
    tokens = [logits[0].argmax(-1)]
    sync()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        cache.start(1)  # refreshes cache_seqlens: the keys before this step
        positions = cache.cache_seqlens.long()[:, None]  # the new token's position
        logits = model(input_ids=tokens[-1][:, None], position_ids=positions, **extra).logits
        cache.finish()
        tokens.append(logits[:, -1].argmax(-1))
    sync()
    if timings is not None:
        timings.update(prefill_s=prefill_s, decode_s=time.perf_counter() - start)
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def hf_generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> torch.Tensor:
    """transformers' greedy generate() with its DynamicCache and eager attention, the
    prompts left-padded with an attention mask: the new tokens (B, max_new_tokens)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p) :] = torch.tensor(p)
            mask[b, longest - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    finally:
        model.set_attn_implementation(previous)
    return out[:, longest:]


def _prompts(batch: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of lengths spread from ``shortest`` to ``longest``, tokens 1..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(shortest, longest, batch).round().long().tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-lengths", default=None, help="SHORTEST,LONGEST (default 5,40 on CPU, 128,2048 on CUDA)")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=None, help="default 16 on CPU, 128 on CUDA")  # fmt: skip
    parser.add_argument("--size", choices=["tiny", "1b"], help="model shape (default tiny on CPU, 1b on CUDA: 16 layers, hidden 2048, 32/8 heads, D 64)")  # fmt: skip
    parser.add_argument("--backend", help="pin attnhub's backend for every call")
    parser.add_argument("--check", action="store_true", help="compare with transformers' generate()")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available here", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    size = args.size or ("1b" if cuda else "tiny")
    shape = (
        dict(layers=16, hidden=2048, heads=32, kv_heads=8, vocab=32000)
        if size == "1b"
        else dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    )
    shortest, longest = (int(x) for x in (args.prompt_lengths or ("128,2048" if cuda else "5,40")).split(","))  # fmt: skip
    new = args.new_tokens or (128 if cuda else 16)
    register()
    model = build_model(**shape, max_positions=longest + new, dtype=dtype, device=args.device,
                        seed=args.seed)  # fmt: skip
    model.set_attn_implementation(IMPLEMENTATION)
    prompts = _prompts(args.batch, shortest, longest, shape["vocab"], args.seed)
    # A warm-up run (kernel compilation, autotuning) and the timed one.
    generate(model, prompts, min(new, 4), page_size=args.page_size, backend=args.backend,
             check_indices=not cuda)  # fmt: skip
    attnhub.reset_stats()
    timings: dict[str, float] = {}
    tokens = generate(model, prompts, new, page_size=args.page_size, backend=args.backend,
                      check_indices=not cuda, timings=timings)  # fmt: skip
    served = attnhub.stats()
    print(f"{size} model, {dtype}, {args.device}, page size {args.page_size}, "
          f"prompt lengths {[len(p) for p in prompts]}, {new} new tokens each")  # fmt: skip
    for b, row in enumerate(tokens.tolist()):
        print(f"  sequence {b}: {row[:16]}{' ...' if len(row) > 16 else ''}")
    decoded = args.batch * (new - 1)
    print(f"prefill {timings['prefill_s'] * 1e3:.1f} ms ({sum(map(len, prompts))} tokens); "
          f"decode {decoded / timings['decode_s']:.1f} tokens/s "
          f"({timings['decode_s'] / (new - 1) * 1e3:.2f} ms a step of {args.batch})"
          if new > 1 else f"prefill {timings['prefill_s'] * 1e3:.1f} ms")  # fmt: skip
    print(f"attention calls served: {served}")
    if args.check:
        same = torch.equal(tokens.cpu(), hf_generate(model, prompts, new).cpu())
        print(f"equal to transformers' generate() (DynamicCache, eager): {same}")
        return 0 if same or dtype != torch.float32 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
