"""Hugging Face model families through attnhub, both ways, against eager attention (CPU).

For each transformers model type named, a tiny random-init model from its default
config with small sizes (2 layers, hidden 64, 4 heads, 2 KV heads where it has them),
float32 on the CPU, eager attention against ``attn_implementation="attnhub"`` and
against ``"sdpa"`` under ``attnhub.patch()``: for causal LMs (``--types``) the logits
of a left-padded batch (valid positions) and six greedy tokens; for encoders and
encoder-decoders (``--encoders``, through ``AutoModel``) the last hidden state of a
right-padded batch (valid positions; an encoder-decoder's decoder states); for both,
every parameter's gradient of a random weighting of those outputs (eval mode, the
largest difference over the eager gradients' largest magnitude). A family
that cannot be built this way, or whose eager run fails, is listed as skipped with the
reason; a way transformers or attnhub refuses is listed with its error (an error is
the right answer for a model whose attention code never calls the interface)::

    python benchmarks/hf_family_sweep.py [--types llama,mpt,...] [--encoders bert,...] [-o FILE.md]
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import torch

import attnhub
from attnhub.integrations.transformers import register

TYPES = (
    "llama,mistral,qwen2,qwen3,gemma,gemma2,gemma3_text,opt,gpt_neox,falcon,phi,starcoder2,"
    "stablelm,mixtral,olmo,olmo2,cohere,granite,gpt_bigcode,gptj,codegen,persimmon,nemotron,"
    "helium,qwen2_moe,qwen3_moe,gpt_oss,ernie4_5,apertus,arcee,dots1,seed_oss,exaone4,lfm2,"
    "granitemoe,olmoe,phimoe,mpt,bloom,xglm"
)
ENCODERS = (
    "bert,roberta,distilbert,albert,electra,deberta-v2,xlm-roberta,camembert,modernbert,ernie,"
    "bart,mbart,pegasus,marian,m2m_100,blenderbot,t5,mt5,longt5,led,mpnet"
)
# Small sizes under each name a config may use for them.
SMALL: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
    n_embd=64, n_layer=2, n_head=4, n_positions=256, d_model=64, ffn_dim=128, num_layers=2,
    attention_heads=4, n_heads=4, n_layers=2, max_seq_len=256, rotary_dim=8, sliding_window=8,
    num_local_experts=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, dim=64, hidden_dim=128,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, embedding_size=64, num_heads=4, d_ff=128,
    d_kv=16,
)  # fmt: skip


def build(model_type: str, implementation: str, causal: bool = True) -> Any:
    import transformers as t

    names = t.AutoConfig.for_model(model_type).to_dict()
    config = t.AutoConfig.for_model(model_type, **{k: v for k, v in SMALL.items() if k in names})
    layers = getattr(config, "num_hidden_layers", None)
    if getattr(config, "layer_types", None) is not None and layers is not None:
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    auto = t.AutoModelForCausalLM if causal else t.AutoModel
    return auto.from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()


def run(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                do_sample=False, pad_token_id=0)  # fmt: skip
    return logits, tokens


def encode(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last hidden state (an encoder-decoder's: its decoder's, on the first 5 ids)."""
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs.update(decoder_input_ids=ids[:, :5], decoder_attention_mask=mask[:, :5])
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def gradients(model: Any, ids: torch.Tensor, mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector, of a fixed random weighting
    of the valid positions' outputs (logits, or the last hidden state) in eval mode (no
    dropout): the backward of every attention call the forward made."""
    inputs = {"input_ids": ids, "attention_mask": mask}
    if not causal and model.config.is_encoder_decoder:
        inputs.update(decoder_input_ids=ids[:, :5], decoder_attention_mask=mask[:, :5])
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = model(**inputs)
        out = out.logits if causal else out.last_hidden_state
        valid = mask.bool()[:, : out.shape[1]]
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * weight)[valid].sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def sweep(model_type: str, causal: bool = True) -> str:
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    if causal:
        mask[1, :4] = 0  # left padding
    else:
        mask[1, 7:] = 0  # right padding (the decoder's first 5 positions stay valid)

    def outputs(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run(model, ids, mask) if causal else (encode(model, ids, mask), None)

    try:
        eager = build(model_type, "eager", causal)
        want, want_tokens = outputs(eager)
        want_grads = gradients(eager, ids, mask, causal)
    except Exception as exc:  # a family this tiny config cannot make
        return f"| {model_type} | skipped: {type(exc).__name__}: {str(exc)[:80]} | |"
    valid = mask.bool()[:, : want.shape[1]]
    cells = []
    for way in ("attnhub", "patch"):
        try:
            if way == "attnhub":
                model = build(model_type, register(), causal)
                got, tokens = outputs(model)
                grads = gradients(model, ids, mask, causal)
            else:
                model = build(model_type, "sdpa", causal)
                with attnhub.patch():
                    got, tokens = outputs(model)
                    grads = gradients(model, ids, mask, causal)
            err = (got - want)[valid].abs().max().item()
            grad_err = ((grads - want_grads).abs().max() / want_grads.abs().max()).item()
            cell = f"max err {err:.1e}, grads {grad_err:.1e}"
            if tokens is None:
                cells.append(cell)
            else:
                same = "same tokens" if torch.equal(tokens, want_tokens) else "OTHER TOKENS"
                cells.append(f"{cell}, {same}")
        except Exception as exc:  # reported as the way's outcome
            cells.append(f"{type(exc).__name__}: {str(exc)[:90]}")
    return f"| {model_type} | {cells[0]} | {cells[1]} |"


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=TYPES, help="causal LMs ('' for none)")
    parser.add_argument("--encoders", default=ENCODERS, help="encoders, encoder-decoders")
    parser.add_argument("-o", "--output")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32",
        "",
        '| model type | attn_implementation="attnhub" | "sdpa" under attnhub.patch() |',
        "|---|---|---|",
    ]
    for causal, types in ((True, args.types), (False, args.encoders)):
        if not causal:
            lines += [
                "",
                '| encoder model type | attn_implementation="attnhub" | "sdpa" under attnhub.patch() |',
                "|---|---|---|",
            ]
        for model_type in filter(None, types.split(",")):
            lines.append(sweep(model_type, causal))
            print(lines[-1], flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write("# Model families through attnhub (`benchmarks/hf_family_sweep.py`)\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
