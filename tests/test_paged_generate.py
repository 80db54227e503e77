"""examples/paged_generate.py and attnhub.paged_cache: batched greedy generation through a
paged KV cache gives transformers' own greedy tokens; the allocator's bookkeeping."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub.paged_cache import PagedKVCache

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "paged_generate.py"


def _example():
    spec = importlib.util.spec_from_file_location("paged_generate_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return _example()


@pytest.fixture(scope="module")
def model(example):
    example.register()
    m = example.build_model(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128,
                            max_positions=128, dtype=torch.float32, device="cpu")  # fmt: skip
    m.set_attn_implementation(example.IMPLEMENTATION)
    return m


# Lengths that start inside a page, fill one exactly (16, 32) and cross pages while
# decoding. NEW_TOKENS = 5 is 4 decode steps, storing keys L .. L + 3 of each prompt:
# the prompts that fill their pages (32; 16 under 16-key pages) open a new page at the
# first step, the 30-token one at key 32 in the third (under either page size), and
# the fourth reads that page back from the pool. (Each step is seconds of the Triton
# interpreter: no more steps than the boundaries need. The steps' logits are compared
# too, so that a wrong key shows at its step even where the argmax does not move.)
PROMPTS_LENGTHS = (3, 16, 30, 32)
NEW_TOKENS = 5


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


@contextlib.contextmanager
def _logits_of_each_call(model):
    """The logits of every call of ``model`` inside the block, in call order."""
    seen: list[torch.Tensor] = []

    def record(module, args, output):  # type: ignore[no-untyped-def]
        seen.append(output.logits.detach().clone())

    handle = model.register_forward_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize("page_size", [16, 32])
def test_greedy_tokens_equal_transformers_generate(example, model, page_size):
    """The tokens are transformers' own greedy tokens, and each step's logits are its
    logits (float32, to rounding): a key read from a wrong page or slot moves the
    logits of its step even where the tiny random model's argmax stays."""
    prompts = _prompts(PROMPTS_LENGTHS)
    attnhub.reset_stats()
    with _logits_of_each_call(model) as logits:
        ours = example.generate(model, prompts, NEW_TOKENS, page_size=page_size)
    served = attnhub.stats()
    with _logits_of_each_call(model) as reference_logits:
        reference = example.hf_generate(model, prompts, NEW_TOKENS)
    assert ours.shape == (4, NEW_TOKENS)
    assert torch.equal(ours, reference), (ours, reference)
    # 2 layers: one varlen prefill and 4 paged decode steps each, all through attnhub.
    assert sum(served.values()) == 2 * NEW_TOKENS
    assert model.config._attn_implementation == example.IMPLEMENTATION  # restored
    # Our first call is the packed prefill, (1, prompts, vocab) at the prompts' last
    # positions; every other call's (B, positions, vocab) ends at the step's position.
    steps = [logits[0][0], *(x[:, -1] for x in logits[1:])]
    reference_steps = [x[:, -1] for x in reference_logits]
    assert len(steps) == len(reference_steps) == NEW_TOKENS
    for step, (x, r) in enumerate(zip(steps, reference_steps, strict=True)):
        torch.testing.assert_close(x, r, msg=lambda m, step=step: f"step {step}: {m}")


def test_each_step_passes_the_new_tokens_positions(example, model, monkeypatch):
    """Prefill positions 0..L-1 per prompt, then decode step t at position L + t (the
    keys already cached). The tiny random model barely reacts to positions, so the
    tokens alone did not show the decode steps' positions one step behind (and 0 first)."""
    seen = []
    forward = type(model).forward

    def recording(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs["position_ids"].tolist())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", recording)
    lengths = (3, 5)
    example.generate(model, _prompts(lengths), 4, page_size=16)
    assert seen[0] == [[*range(3), *range(5)]]
    assert seen[1:] == [[[3 + t], [5 + t]] for t in range(3)]


def test_unchecked_indices_and_one_page_per_token_step(example, model):
    """check_indices=False (the allocator vouches) gives the same tokens, and so does a
    pool with pages to spare (other page numbers in the table)."""
    prompts = _prompts((7, 21), seed=1)
    checked = example.generate(model, prompts, 6, page_size=16)
    unchecked = example.generate(model, prompts, 6, page_size=16, check_indices=False,
                                 num_pages=9)  # fmt: skip
    assert torch.equal(checked, unchecked)
    assert torch.equal(checked, example.hf_generate(model, prompts, 6))


def test_triton_flash_serves_the_paged_decode_steps(example, model):
    """triton_flash pinned first (the Triton interpreter on CPU): it serves the packed
    prefill (its varlen kernels) and the paged decode calls (its decode kernel), and the
    tokens are transformers' own."""
    name = "triton_flash"
    if attnhub.get_registry().unavailable_reason(name) is not None:
        pytest.skip(f"{name}: {attnhub.get_registry().unavailable_reason(name)}")
    prompts = _prompts((5, 18), seed=2)
    attnhub.reset_stats()
    ours = example.generate(model, prompts, 3, page_size=16,
                            backend=(name, "torch_reference"))  # fmt: skip
    served = attnhub.stats()
    assert served == {name: 2 * (1 + 2)}, served  # 2 layers x (1 prefill + 2 decode steps)
    assert torch.equal(ours, example.hf_generate(model, prompts, 3))


def test_the_example_runs_as_a_script(example, capsys):
    assert example.main(["--batch", "2", "--new-tokens", "4", "--page-size", "32", "--check"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out
    assert "equal to transformers' generate() (DynamicCache, eager): True" in out


def test_the_attention_function_refuses_a_call_without_a_cache(example, model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="paged_cache"):
        model(input_ids=ids, use_cache=False)


# -- the cache's bookkeeping ------------------------------------------------------------


def _cache(**changes):
    args = dict(num_layers=1, batch=2, num_pages=6, page_size=16, kv_heads=2, head_dim=8)
    args.update(changes)
    return PagedKVCache(**args)


def test_pages_are_handed_out_as_sequences_grow_and_come_back_on_release():
    cache = _cache()
    cache.start([20, 3])  # 2 pages and 1
    cache.finish()
    assert cache.lengths == [20, 3]
    assert cache.pages_of(0) == [0, 1] and cache.pages_of(1) == [2]
    assert cache.block_table.tolist() == [[0, 1, -1, -1, -1, -1], [2, -1, -1, -1, -1, -1]]
    cache.start(13)  # 33 keys: a third page for sequence 0; 16 keys: still one for 1
    assert cache.cache_seqlens.tolist() == [20, 3]  # the lengths before the step
    cache.finish()
    assert cache.pages_of(0) == [0, 1, 3] and cache.pages_of(1) == [2]
    assert cache.free_pages == 2
    cache.release(0)
    assert cache.free_pages == 5 and cache.lengths == [0, 16]
    assert cache.block_table[0].tolist() == [-1] * 6
    cache.start([40, 0])
    assert cache.pages_of(0) == [0, 1, 3]  # reused, lowest first
    cache.finish()


def test_packed_prefill_writes_each_key_into_its_page_slot():
    cache = _cache(check_indices=True)
    lengths = [20, 5]
    total = sum(lengths)
    q = torch.randn(total, 4, 8)
    k, v = torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    cache.start(lengths)
    out = cache.attend(0, q, k, v)
    cache.finish()
    # The answer is attention_varlen's, and every key sits at block_table[b, p // 16], p % 16.
    cu = torch.tensor([0, 20, 25])
    torch.testing.assert_close(out, attnhub.attention_varlen(q, k, v, cu, cu, causal=True))
    start = 0
    for b, n in enumerate(lengths):
        for p in range(n):
            page = int(cache.block_table[b, p // 16])
            torch.testing.assert_close(cache.k_pools[0][page, p % 16], k[start + p], rtol=0, atol=0)
            torch.testing.assert_close(cache.v_pools[0][page, p % 16], v[start + p], rtol=0, atol=0)
        start += n


def test_decode_step_equals_dense_attention_on_the_gathered_keys():
    cache = _cache(check_indices=True)
    cache.start([20, 5])
    total = 25
    cache.attend(0, torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8))
    cache.finish()
    q, k_new, v_new = torch.randn(2, 4, 2, 8), torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8)
    cache.start(2)
    out = cache.attend(0, q, k_new, v_new)
    cache.finish()
    for b, n in enumerate(cache.lengths):
        pages = cache.block_table[b, : -(-n // 16)].long()
        keys = cache.k_pools[0][pages].flatten(0, 1)[:n].transpose(0, 1)[None]
        values = cache.v_pools[0][pages].flatten(0, 1)[:n].transpose(0, 1)[None]
        torch.testing.assert_close(keys[0, :, -2:], k_new[b], rtol=0, atol=0)
        dense = attnhub.attention(q[b : b + 1], keys, values, causal=True, alignment="bottom_right")
        torch.testing.assert_close(out[b : b + 1], dense)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"num_layers": 0}, ValueError, "num_layers must be >= 1, got 0"),
        ({"batch": True}, TypeError, "batch must be an int, got bool True"),  # was a batch of 1
        ({"page_size": 16.0}, TypeError, r"page_size must be an int, got float 16\.0"),
        ({"pages_per_seq": -2}, ValueError, "pages_per_seq must be >= 1, got -2"),
    ],
)
def test_bad_sizes_raise_naming_the_argument(changes, error, message):
    with pytest.raises(error, match=message):
        _cache(**changes)


def test_bad_steps_raise_before_anything_is_allocated():
    cache = _cache(num_pages=2, pages_per_seq=2)
    with pytest.raises(ValueError, match="new_tokens"):
        cache.start([1])
    with pytest.raises(ValueError, match="new_tokens"):
        cache.start([-1, 2])
    with pytest.raises(ValueError, match="pages_per_seq"):
        cache.start([33, 0])
    with pytest.raises(RuntimeError, match="2 are free"):
        cache.start([17, 1])  # 3 pages
    assert cache.free_pages == 2
    with pytest.raises(RuntimeError, match="start"):
        cache.attend(0, torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    cache.start([1, 1])
    with pytest.raises(RuntimeError, match="not finished"):
        cache.start([1, 1])
    with pytest.raises(ValueError, match="expected 2 packed tokens"):
        cache.attend(0, torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8))
    with pytest.raises(ValueError, match="query"):
        cache.attend(0, torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    cache.finish()
    cache.start([1, 0])
    with pytest.raises(ValueError, match="cache empty"):
        cache.attend(0, torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    cache.finish()
    with pytest.raises(ValueError, match="page_size"):
        _cache(page_size=0)


def test_bad_rows_layers_and_prefill_tensors_raise_naming_the_argument():
    """A row or layer out of range raised IndexError, and a negative one silently named
    another from the end; a prefill key or value that does not fit the pools raised
    RuntimeError from the page write (or was cast into them). Now: TypeError or
    ValueError naming the argument, nothing written."""
    cache = _cache(num_layers=2)
    for bad in (2, -1):
        with pytest.raises(ValueError, match="b must be in"):
            cache.pages_of(bad)
        with pytest.raises(ValueError, match="b must be in"):
            cache.release(bad)
    with pytest.raises(TypeError, match="b must be an int"):
        cache.release(True)
    cache.start([3, 2])
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    for bad in (2, -1):
        with pytest.raises(ValueError, match="layer must be in"):
            cache.attend(bad, q, k, v)
    for name, key, value in [
        ("key", k.double(), v),
        ("value", k, v.double()),
        ("key", torch.randn(5, 1, 8), v),
        ("value", k, torch.randn(5, 2, 4)),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            cache.attend(0, q, key, value)
    assert not any(pool.any() for pool in (*cache.k_pools, *cache.v_pools))
    cache.attend(1, q, k, v)  # and the step goes on
