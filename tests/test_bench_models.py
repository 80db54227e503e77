"""``attnhub bench --models``: HF models stock, patched and attn_implementation="attnhub"."""

from __future__ import annotations

import json

import pytest
import torch

from attnhub import bench_models as bm
from attnhub import cli

pytest.importorskip("transformers")

TINY = dict(layers=1, hidden=64, heads=4, kv_heads=2, train_batch=2, train_seq=16,
            gen_batch=2, prompt=6, new_tokens=3)  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        bm.ModelSpec("llama", "llama", **TINY),
        bm.ModelSpec("mistral", "mistral", window=4, **TINY),
        bm.ModelSpec("gemma2", "gemma2", window=4, softcap=50.0, **TINY),
        bm.ModelSpec("qwen2", "qwen2", **TINY),
    ],
    ids=lambda s: s.name,
)
def test_every_way_runs_each_family(spec):
    rows = list(bm.run_model(spec, torch.float32, torch.device("cpu"), repeats=1, vocab=50))
    assert {(r["task"], r["way"]) for r in rows} == {
        (task, way) for task in ("train", "generate", "generate_padded") for way in bm.WAYS
    }
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
    assert all(r["vs_sdpa"] == 1.0 for r in rows if r["way"] == "sdpa")
    # What served the attention calls: attnhub for both of its ways where the model
    # calls SDPA (patch() sees nothing of a model whose stock path is eager: gemma2's
    # softcap), nothing for stock.
    for r in rows:
        served = r["served"]
        if r["way"] == "sdpa" or (r["way"] == "patch" and r["implementation"] != "sdpa"):
            assert served == {}, (r["way"], r["implementation"], served)
        else:
            assert served and "pytorch_original" not in served, (r["way"], served)


def test_the_ways_run_one_model_switched_between_implementations(monkeypatch):
    """Each way built its own model; the instances' host costs differed (F.linear)."""
    spec = bm.ModelSpec("llama", "llama", **TINY)
    built, seen = [], []
    real_build, real_switch = bm.build, bm._switch
    monkeypatch.setattr(bm, "build", lambda *a, **k: built.append(real_build(*a, **k)[0]) or (built[-1], "sdpa"))  # fmt: skip
    monkeypatch.setattr(bm, "_switch", lambda m, i: seen.append((id(m), i)) or real_switch(m, i))
    rows = list(bm.run_model(spec, torch.float32, torch.device("cpu"), repeats=2, vocab=50))
    assert len(built) == 3  # one model per task, shared by the three ways
    ids = {id(m) for m in built}
    assert {i for i, _ in seen} <= ids
    assert {impl for _, impl in seen} == {"sdpa", "attnhub"}
    for r in rows:  # and each way ran what it says
        assert bool(r["served"]) == (r["way"] != "sdpa"), (r["task"], r["way"], r["served"])


def test_the_three_ways_compute_the_same_model():
    spec = bm.ModelSpec("gemma2", "gemma2", window=4, softcap=50.0, **TINY)
    ids = torch.randint(1, 50, (2, 16))
    logits = {}
    for way in bm.WAYS:
        model, _ = bm.build(spec, way, torch.float64, torch.device("cpu"), vocab=50)
        with bm._context(way), torch.no_grad():
            logits[way] = model(ids).logits
    torch.testing.assert_close(logits["patch"], logits["sdpa"])
    torch.testing.assert_close(logits["attnhub"], logits["sdpa"])


def test_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "MODELS", (bm.ModelSpec("llama", "llama", **TINY),))
    output = tmp_path / "m.json"
    argv = ["bench", "--models", "--device", "cpu", "--repeats", "1", "--no-progress", "-o", str(output)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(output.read_text())
    assert data["kind"] == "models" and len(data["results"]) == 9
    assert "| llama | train |" in output.with_suffix(".md").read_text()


def test_each_way_is_timed_in_each_position_equally_often(monkeypatch):
    """A fixed order gave the first way the head start of a host that slows over a run."""
    spec = bm.ModelSpec("llama", "llama", **TINY)
    ways_seen: list[str] = []
    real_context = bm._context

    def context(way):  # type: ignore[no-untyped-def]
        ways_seen.append(way)
        return real_context(way)

    monkeypatch.setattr(bm, "_context", context)
    list(bm.run_model(spec, torch.float32, torch.device("cpu"), repeats=3, vocab=50))
    # Per task: two warm-up calls' contexts (one per way), then 3 repeats x 3 ways.
    per_task = len(bm.WAYS) + 3 * len(bm.WAYS)
    for task in range(3):
        timed_ways = ways_seen[task * per_task + len(bm.WAYS) : (task + 1) * per_task]
        rounds = [tuple(timed_ways[i : i + 3]) for i in range(0, 9, 3)]
        assert sorted(rounds) == sorted(bm.rotated(bm.WAYS, r) for r in range(3))
        for position in range(3):
            assert sorted(r[position] for r in rounds) == sorted(bm.WAYS)


def test_the_table_gives_the_ratio_of_medians_of_the_fastest_repeats_and_paired():
    def row(way, seconds):  # type: ignore[no-untyped-def]
        median = sorted(seconds)[len(seconds) // 2]
        return {"name": "llama", "task": "generate", "way": way, "implementation": "sdpa",
                "tokens_per_s": 512 / median, "vs_sdpa": 2.0 / median, "peak_mib": None,
                "all_seconds": seconds, "served": {}}  # fmt: skip

    env = {"gpu": "g", "torch": "t", "attnhub_commit": "c", "date": "d"}
    data = {"env": env, "dtype": "bfloat16", "results": [
        row("sdpa", [1.0, 2.0, 2.0]), row("patch", [1.25, 1.0, 2.5]), row("attnhub", [0.5, 4.0, 4.0]),
    ]}  # fmt: skip
    line = next(x for x in bm.markdown(data).splitlines() if x.startswith("| llama | generate"))
    # patch: medians 2.0 / 1.25, fastest 1.0 / 1.0, per repeat 0.8, 2.0, 0.8;
    # attnhub: medians 2.0 / 4.0, fastest 1.0 / 0.5, per repeat 2.0, 0.5, 0.5.
    assert "| 1.60 / 1.00 / 0.80 |" in line and "| 0.50 / 2.00 / 0.50 |" in line


def test_left_padded_generation_gives_stock_tokens_in_every_way(monkeypatch):
    """The generate_padded task's batch (left-padded prompts: a padding mask every step)
    generates stock's tokens in each way, the patch reading masks as on CUDA: the
    prefill's (causal and key padding), once for its layers; the decoding steps' masks
    ((B, 1, 1, Nk), or broadcast over the query heads that transformers packs into rows
    for grouped-query attention) are not read."""
    from attnhub import mask_structure, patching

    monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cpu", "cuda"}))
    plans = []
    real = mask_structure._recognize
    monkeypatch.setattr(mask_structure, "_recognize", lambda m: plans.append(real(m)) or plans[-1])
    spec = bm.ModelSpec("llama", "llama", **{**TINY, "layers": 3, "gen_batch": 4, "prompt": 12})
    _, generate = bm._inputs(spec, 50, torch.device("cpu"))
    prompts, mask = generate["generate_padded"]
    assert mask.sum(1).tolist() == [12, 11, 9, 8]  # left padding of 0, 1, 3, 4 tokens
    tokens = {}
    for way in bm.WAYS:
        model, _ = bm.build(spec, way, torch.float64, torch.device("cpu"), vocab=50)
        with bm._context(way), torch.no_grad():
            tokens[way] = model.generate(
                input_ids=prompts, attention_mask=mask, max_new_tokens=5, min_new_tokens=5,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        if way == "patch":
            assert len(plans) == 1 and plans[0] is not None  # the prefill's only
            assert plans[0].causal and plans[0].attn_mask is not None
    assert torch.equal(tokens["patch"], tokens["sdpa"])
    assert torch.equal(tokens["attnhub"], tokens["sdpa"])
