"""Hugging Face models on attnhub, both routes, against stock transformers ("sdpa").

Tiny models built from configs (2 layers, hidden 64, no downloads). Each compares
attnhub's route with the same weights running transformers' own SDPA path on
PyTorch's unpatched function: logits (left-padded batches included), greedy
generation with the KV cache, and a training step's gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import attnhub  # noqa: E402
from attnhub.integrations import transformers as hf  # noqa: E402

ORIGINAL = F.scaled_dot_product_attention
VOCAB = 128
WINDOW = 4
COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 64}  # fmt: skip


def _configs():
    t = transformers
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
        "llama-gqa": (t.LlamaForCausalLM, t.LlamaConfig(num_key_value_heads=2, **COMMON)),
        "mistral-sliding": (t.MistralForCausalLM, t.MistralConfig(
            num_key_value_heads=2, sliding_window=WINDOW, **COMMON)),
        # Layer 0 full attention, layer 1 sliding window.
        "qwen2-mixed": (t.Qwen2ForCausalLM, t.Qwen2Config(
            num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1, **COMMON)),
        "bert": (t.BertModel, t.BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    }  # fmt: skip


CONFIGS = _configs()
DECODERS = [name for name in CONFIGS if name != "bert"]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert hf.register() == "attnhub"


@pytest.fixture(autouse=True)
def _clean():
    attnhub.reset_stats()
    yield
    assert F.scaled_dot_product_attention is ORIGINAL


def _pair(name):
    """(stock model on "sdpa", the same weights on "attnhub"), in eval mode."""
    cls, config = CONFIGS[name]
    torch.manual_seed(0)
    # Each model gets its own config: the implementation is stored on it.
    stock = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation="attnhub").eval()
    ours.load_state_dict(stock.state_dict())
    assert stock.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == "attnhub"
    return stock, ours


def _batch(padding_side="left", n=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, n), generator=g)
    mask = torch.ones(3, n, dtype=torch.long)
    pad = slice(0, 5) if padding_side == "left" else slice(n - 5, n)
    mask[1, pad] = 0
    mask[2, pad.start : pad.start + 2 if padding_side == "left" else n] = 0
    ids[mask == 0] = 0
    return ids, mask


def _output(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_match_stock(name, padded):
    stock, ours = _pair(name)
    ids, mask = _batch("right" if name == "bert" else "left")
    if not padded:
        mask = torch.ones_like(mask)
    keep = mask.bool()
    with torch.no_grad():
        ref = _output(stock, ids, mask)
        registered = _output(ours, ids, mask)
        served = attnhub.stats()
        with attnhub.patch():
            patched = _output(stock, ids, mask)
    # Padded query rows are meaningless (and fully masked in decoders): compare the rest.
    torch.testing.assert_close(registered[keep], ref[keep], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(patched[keep], ref[keep], atol=2e-5, rtol=1e-4)
    assert sum(served.values()) == 2  # one call per layer, all served by attnhub
    assert attnhub.stats().get("pytorch_original", 0) == 0


def test_sliding_window_reaches_attnhub_as_window(monkeypatch):
    """Unpadded prefill and decoding pass window=(W-1, 0), not a mask; and it matters."""
    calls = []
    real = hf.attention

    def spy(q, k, v, mask=None, **kw):
        calls.append(
            (q.shape[2], k.shape[2], mask is None, kw["window"], kw["causal"], kw["alignment"])
        )
        return real(q, k, v, mask, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    stock, ours = _pair("mistral-sliding")
    ids = torch.randint(1, VOCAB, (2, 3 * WINDOW))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=2e-5, rtol=1e-4)
        prefill = calls[:]
        calls.clear()
        ours.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert prefill == [(3 * WINDOW, 3 * WINDOW, True, (WINDOW - 1, 0), True, "top_left")] * 2
    decode = [c for c in calls if c[0] == 1]
    assert decode and all(c[2:] == (True, (WINDOW - 1, 0), False, "bottom_right") for c in decode)
    # The window is not a no-op at this length: a model without it answers differently.
    config = copy.deepcopy(stock.config)
    config.sliding_window = None
    unwindowed = type(stock)._from_config(config, attn_implementation="sdpa").eval()
    unwindowed.load_state_dict(stock.state_dict())
    with torch.no_grad():
        assert not torch.allclose(unwindowed(ids).logits, ours(ids).logits, atol=1e-3)


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_generation_with_kv_cache_identical(name):
    stock, ours = _pair(name)
    ids, mask = _batch("left", n=6)
    kwargs = {"attention_mask": mask, "max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ref = stock.generate(ids, **kwargs)
        registered = ours.generate(ids, **kwargs)
        with attnhub.patch():
            patched = stock.generate(ids, **kwargs)
    assert ref.shape[1] == ids.shape[1] + 10
    assert torch.equal(registered, ref)
    assert torch.equal(patched, ref)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-sliding", "bert"])
def test_training_step_gradients_match_stock(name):
    stock, ours = _pair(name)
    stock.train()
    ours.train()
    ids, mask = _batch("right" if name == "bert" else "left")

    def grads(model, patched=False):
        model.zero_grad()
        with attnhub.patch() if patched else torch.enable_grad():
            out = _output(model, ids, mask)
        loss = out[mask.bool()].square().mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(stock)
    for got in (grads(ours), grads(stock, patched=True)):
        assert got.keys() == ref.keys()
        for n in ref:
            assert torch.isfinite(got[n]).all(), n
            torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def test_register_with_backend_choice():
    name = hf.register("attnhub_reference_only", backend="torch_reference")
    cls, config = CONFIGS["llama-gqa"]
    torch.manual_seed(0)
    stock = cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours = cls._from_config(copy.deepcopy(config), attn_implementation=name).eval()
    ours.load_state_dict(stock.state_dict())
    ids, mask = _batch()
    with torch.no_grad():
        got, ref = _output(ours, ids, mask), _output(stock, ids, mask)
    keep = mask.bool()
    torch.testing.assert_close(got[keep], ref[keep], atol=2e-5, rtol=1e-4)
    assert attnhub.stats() == {"torch_reference": 2}


def test_torch_compile_patched_hf_model_no_graph_break_from_attnhub():
    import torch._dynamo

    torch._dynamo.reset()
    stock, _ = _pair("llama-gqa")
    ids = torch.randint(1, VOCAB, (2, 8))
    with torch.no_grad():
        ref = stock(ids).logits
        with attnhub.patch():
            explanation = torch._dynamo.explain(stock)(ids)
            compiled = torch.compile(stock, backend="eager")
            got = compiled(ids).logits
    reasons = [str(r) for r in explanation.break_reasons]
    assert not [r for r in reasons if "attnhub" in r or "scaled_dot_product" in r], reasons
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    torch._dynamo.reset()


# --- attention sinks (GPT-OSS's s_aux) ------------------------------------------------


def _eager_with_sinks(q, k, v, keep, sinks, scale):
    """GPT-OSS's eager attention written out in float64: the sink joins each row's
    softmax as one more logit and is dropped before the values. keep: bool (B, 1, Nq, Nk)."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (p @ v).transpose(1, 2)


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("how", ["causal", "padded_mask", "window"])
def test_sinks_match_the_eager_formula_forward_and_backward(how):
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d, w = 2, 4, 2, 9, 16, 3
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g) * 2  # large enough to take much of each row
    for t in (q, k, v, sinks):
        t.requires_grad_(True)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    keep = causal.expand(b, 1, n, n).clone()
    mask, window = None, None
    if how == "padded_mask":
        keep[1, :, :, :4] = False  # row 1 left-padded by 4: its first 4 queries see nothing
        mask = keep
    if how == "window":
        window = w
        keep &= ~torch.ones(n, n, dtype=torch.bool).tril(-w)
    out, _ = hf.attention_forward(
        _Module(), q, k, v, mask, scaling=0.3, sliding_window=window, s_aux=sinks
    )
    ref = _eager_with_sinks(q, k, v, keep, sinks, 0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    if how == "padded_mask":
        assert torch.equal(out[1, :4], torch.zeros_like(out[1, :4]))  # as the eager sink
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    want = torch.autograd.grad(ref, (q, k, v, sinks), grad.double())
    for name, a, e in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        # (The reference's gradients arrive in the leaves' float32.)
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_sinks_of_the_wrong_shape_are_refused():
    q = k = v = torch.randn(1, 4, 5, 8)
    with pytest.raises(
        ValueError, match=r"s_aux must hold one sink logit per query head, shape \(4,\); got \(2,\)"
    ):
        hf.attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(TypeError, match="s_aux must be a tensor or None, got list"):
        hf.attention_forward(_Module(), q, k, v, None, s_aux=[0.0] * 4)


@pytest.mark.parametrize("family", ["bloom", "mpt", "xglm"])
def test_a_model_that_never_calls_the_attention_interface_is_stopped(family):
    """transformers accepts attn_implementation="attnhub" for any model; the layers of
    BLOOM, MPT and XGLM never look their attention function up, and read attnhub's
    boolean mask as a mask of their own kind (BLOOM adds it, MPT masks the kept keys:
    silently wrong). attnhub's mask function finds the model building the mask and
    stops it before its first mask is handed over."""
    t = transformers
    config, cls = {
        "bloom": (lambda: t.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
                  t.BloomForCausalLM),
        "mpt": (lambda: t.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                                    max_seq_len=64), t.MptForCausalLM),
        "xglm": (lambda: t.XGLMConfig(vocab_size=VOCAB, d_model=64, num_layers=2,
                                      attention_heads=4, ffn_dim=128), t.XGLMForCausalLM),
    }[family]  # fmt: skip
    model = cls._from_config(config(), attn_implementation="attnhub").eval()
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(RuntimeError, match=rf"{family}.*does not use transformers' attention interface"):  # fmt: skip
        model(input_ids=ids)  # the first pass
    assert attnhub.stats() == {}  # attnhub never served it


def test_masks_built_outside_a_model_are_counted():
    """Where the model building a mask is not among the mask function's callers (here
    it is called directly), masks built with no attention call between them are
    counted, and stopped past MASKS_WITHOUT_ATTENTION."""
    hf.register()
    config = transformers.LlamaConfig(**COMMON)
    config._attn_implementation = "attnhub"
    hf._masks_since_attention.clear()
    for _ in range(hf.MASKS_WITHOUT_ATTENTION):
        hf.mask(1, 4, 4, config=config)
    with pytest.raises(RuntimeError, match="llama and its attention never called attnhub"):
        hf.mask(1, 4, 4, config=config)


def test_models_building_several_masks_a_pass_run_on():
    """Gemma 3 builds a full and a sliding-window mask each pass: the masks between two
    attention calls stay few, however long the generation."""
    t = transformers
    config = t.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                **COMMON)  # fmt: skip
    torch.manual_seed(0)
    stock = t.Gemma3ForCausalLM._from_config(
        copy.deepcopy(config), attn_implementation="sdpa"
    ).eval()
    ours = t.Gemma3ForCausalLM._from_config(
        copy.deepcopy(config), attn_implementation="attnhub"
    ).eval()
    ours.load_state_dict(stock.state_dict())
    ids, mask = _batch("left", n=6)
    kwargs = {"attention_mask": mask, "max_new_tokens": 2 * hf.MASKS_WITHOUT_ATTENTION,
              "do_sample": False, "pad_token_id": 0}  # fmt: skip
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), stock.generate(ids, **kwargs))


def test_attnhubs_mask_paired_with_another_attention_function_is_not_counted():
    """The check counts only implementations register() made: a user pairing attnhub's
    mask function with an attention function of their own is not stopped."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("paired_elsewhere", sdpa_attention_forward)
    AttentionMaskInterface.register("paired_elsewhere", hf.mask)
    cls, config = CONFIGS["llama-gqa"]
    model = cls._from_config(copy.deepcopy(config), attn_implementation="paired_elsewhere").eval()
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(hf.MASKS_WITHOUT_ATTENTION + 2):
            model(input_ids=ids)


def test_a_window_is_verified_on_the_cpu_once_per_function_shape(monkeypatch):
    """mask() passes a window as data only for transformers' own sliding-window causal
    function: verified by a probe (not a chunked mask, not plain causal, not another
    window size). The probe's answer is kept per function shape, so the new closure
    transformers builds at each decoding step is not probed again; one holding a
    tensor (a chunked mask's padding) has no shape, and is probed each time."""
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    monkeypatch.setattr(hf, "_VERIFIED", {})
    probes = []
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: probes.append(a) or arange(*a, **k))
    assert hf._sliding_window_verified(sliding_window_causal_mask_function(8), 8)
    assert hf._sliding_window_verified(sliding_window_causal_mask_function(8), 8)
    assert len(probes) == 1  # the second function, of the same shape: the kept answer
    assert not hf._sliding_window_verified(sliding_window_causal_mask_function(8), 9)
    assert not hf._sliding_window_verified(sliding_window_causal_mask_function(9), 8)
    assert not hf._sliding_window_verified(causal_mask_function, 8)
    padding = torch.zeros(2, dtype=torch.long)
    assert hf._function_shape(chunked_causal_mask_function(8, padding)) is None
    probes.clear()
    for _ in range(2):
        assert not hf._sliding_window_verified(chunked_causal_mask_function(8, padding), 8)
    assert len(probes) == 2
    assert hf._function_shape(lambda b, h, q, k, w=[8]: k > q - w[0]) is None  # a list default


def test_output_attentions_is_answered_with_a_warning_not_silence():
    """transformers' sdpa and flash functions warn that they return no weights; attnhub's
    returned None silently (the model's `attentions` then held no weights)."""
    _, ours = _pair("llama-gqa")
    ids, mask = _batch()
    with torch.no_grad(), pytest.warns(UserWarning, match="does not return attention weights"):
        out = ours(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert not any(a is not None for a in out.attentions or ())
