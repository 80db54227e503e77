"""``attnhub bench --workloads``: the call list, timed on every eligible backend, auto,
stock SDPA and the patched function, with a summary table."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import pytest
import torch

from attnhub import bench, cli
from attnhub import bench_workloads as bw
from attnhub.bench_workloads import Workload

# Small CPU versions of each kind of call in the list.
SMALL = [
    Workload("prefill", 1, 4, 2, 24, 24, 16, True, train=True),
    Workload("decode", 2, 4, 2, 1, 40, 16, True, "bottom_right"),
    Workload("spec-decode", 2, 4, 2, 4, 40, 16, True, "bottom_right"),
    Workload("padding", 3, 4, 2, 24, 24, 16, True, lengths=(5, 17, 24), train=True),
    Workload("window", 1, 4, 2, 32, 32, 16, True, window=(7, 0), train=True),
]


def shrunk(w: Workload, scale: int = 64) -> Workload:
    """``w`` at CPU size, the same kind of call: Nq, Nk, the valid key counts and the
    window divided by ``scale``, rounded up (Nq = 1 stays 1, Nq == Nk stays equal, a
    count stays at most Nk), at most 2 K/V heads with up to 3 query heads each, batch at
    most 2 unless rows carry valid key counts; head dim, causal, alignment, train kept."""

    def n(x: int) -> int:
        return -(-x // scale)

    hkv = min(w.heads_kv, 2)
    return dataclasses.replace(
        w, batch=w.batch if w.lengths else min(w.batch, 2), heads_kv=hkv,
        heads_q=hkv * min(w.heads_q // w.heads_kv, 3), nq=n(w.nq), nk=n(w.nk),
        lengths=None if w.lengths is None else tuple(n(x) for x in w.lengths),
        window=None if w.window is None else (n(w.window[0]), n(w.window[1])),
    )  # fmt: skip


# The model families' calls (bench --workload-set models), shrunk the same way.
SMALL_MODELS = [shrunk(w) for w in bw.model_workloads()]


def test_the_call_list_covers_the_issue():
    calls = bw.workloads()
    names = [w.name for w in calls]
    assert len(names) == len(set(names))
    for d in (64, 128, 256):
        for heads in ("MHA 16/16", "GQA 32/8"):
            tag = f"D{d} {heads}"
            assert f"prefill {tag}" in names
            assert all(f"decode {n}K {tag}" in names for n in (4, 32, 128))
            assert f"spec-decode Nq4 32K {tag}" in names
    padding = next(w for w in calls if w.lengths)
    assert (padding.batch, padding.nq, min(padding.lengths), max(padding.lengths)) == (
        8,
        4096,
        512,
        4096,
    )
    assert any(w.window == (4095, 0) and w.nq == 16384 for w in calls)
    assert any((w.batch, w.heads_q, w.nq, w.head_dim) == (1, 1, 16, 64) for w in calls)


def _shape(w: Workload) -> tuple:  # type: ignore[type-arg]
    """Everything but the name: the call a workload makes."""
    return dataclasses.astuple(dataclasses.replace(w, name=""))


def test_the_model_call_list_is_well_formed_and_off_the_issue_list():
    calls = bw.model_workloads()
    names = [w.name for w in calls]
    assert len(names) == len(set(names))
    assert not set(names) & {w.name for w in bw.workloads()}  # "all" keeps names unique
    issue16 = {_shape(w) for w in bw.workloads()}
    for w in calls:
        assert _shape(w) not in issue16, w.name
        assert w.heads_q % w.heads_kv == 0, w.name
        assert f"{w.heads_q}/{w.heads_kv} D{w.head_dim} " in w.name
        assert 1 <= w.nq <= w.nk or not w.causal, w.name
        if w.lengths is not None:
            assert len(w.lengths) == w.batch and max(w.lengths) <= w.nk, w.name
            assert min(w.lengths) >= 1, w.name
    assert {40, 64, 80, 96, 128, 256} <= {w.head_dim for w in calls}
    # The field combinations the issue list never makes.
    assert any(w.lengths and not w.causal for w in calls)  # padded encoder
    assert any(w.nq != w.nk and not w.causal for w in calls)  # cross-attention
    assert any(w.causal and w.alignment == "bottom_right" and 1 < w.nq < w.nk for w in calls)
    assert any(w.heads_kv == 1 for w in calls)  # MQA
    bert = next(w for w in calls if w.lengths)
    assert (bert.batch, min(bert.lengths), max(bert.lengths)) == (32, 128, 512)
    assert sorted(bert.lengths) == list(bert.lengths)


def test_shrunk_model_calls_keep_their_kind():
    for big, small in zip(bw.model_workloads(), SMALL_MODELS):
        assert (small.nq == 1, small.nq == small.nk) == (big.nq == 1, big.nq == big.nk)
        assert (small.heads_q == small.heads_kv) == (big.heads_q == big.heads_kv)
        assert small.lengths is None or max(small.lengths) <= small.nk
        assert small.nq * small.nk * small.batch * small.heads_q <= 2**16


def test_workload_sets():
    issue16, models = bw.workloads(), bw.model_workloads()
    assert bw.select_workloads("issue16") == issue16
    assert bw.select_workloads("models") == models
    assert bw.select_workloads("all") == issue16 + models
    with pytest.raises(ValueError, match="issue16, models, all"):
        bw.select_workloads("llama")


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def test_workload_set_option_parses(capsys):
    assert _bench_args("--workloads").workload_set == "issue16"  # today's list by default
    for name in bw.WORKLOAD_SETS:
        assert _bench_args("--workloads", "--workload-set", name).workload_set == name
    with pytest.raises(SystemExit):
        _bench_args("--workloads", "--workload-set", "llama")
    assert "invalid choice: 'llama'" in capsys.readouterr().err


@pytest.mark.parametrize("w", SMALL + SMALL_MODELS, ids=lambda w: w.name)
def test_sdpa_mask_means_what_attnhub_computes(w):
    """The stock call (materialized mask) and attnhub's call compute the same attention."""
    x = bw._inputs(w, torch.float64, torch.device("cpu"))
    ref = bw._sdpa_call(w, x)(x.query, x.key, x.value)
    out = bw._attnhub_call(w, x, "torch_reference")(x.query, x.key, x.value)
    assert bw._max_diff(out, ref) < 1e-10


@pytest.fixture
def no_interpreted_kernels(monkeypatch):  # type: ignore[no-untyped-def]
    """Leave the Triton backends (Triton's CPU interpreter: seconds a call) untimed."""
    monkeypatch.setattr(bw, "_NOT_TIMED", bw._NOT_TIMED | {"triton_flash", "triton_blocksparse"})


def test_rows_summary_and_table(monkeypatch, no_interpreted_kernels):
    monkeypatch.setattr(bw, "workloads", lambda: SMALL)
    monkeypatch.setattr(bw, "model_workloads", lambda: SMALL_MODELS)
    data = bw.run_workloads(("float32",), torch.device("cpu"), workload_set="all",
                            budget_s=0.005, repeats=1, progress=False)  # fmt: skip
    assert data["config"]["workload_set"] == "all"
    rows = data["results"]
    assert {r["name"] for r in rows} == {w.name for w in SMALL + SMALL_MODELS}
    for w in SMALL + SMALL_MODELS:
        for mode in w.modes:
            mine = {r["backend"]: r for r in rows if r["name"] == w.name and r["mode"] == mode}
            assert {bw.AUTO, bw.SDPA, bw.PATCHED} <= set(mine)
            assert mine["torch_reference"]["skipped"] == "not timed"
            for name in (bw.AUTO, bw.SDPA, bw.PATCHED):
                assert mine[name]["ms"] > 0, mine[name]
                assert mine[name]["max_abs_vs_sdpa"] < 1e-4
            assert mine[bw.AUTO]["served_by"]  # what auto ran, from attnhub.stats()
    summary = {(s["workload"], s["mode"]): s for s in bw.summarize(data)}
    assert summary[("prefill", "fwd")]["fastest"] == "torch_sdpa"
    table = bw.markdown(data)
    assert table.count("\n| ") == len(summary) + 1


def test_cli(tmp_path, monkeypatch, no_interpreted_kernels):
    monkeypatch.setattr(bw, "workloads", lambda: SMALL)
    output = tmp_path / "w.json"
    argv = ["bench", "--workloads", "--only", "decode", "--dtypes", "float32", "--device", "cpu",
            "--budget", "0.005", "--no-progress", "-o", str(output)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(output.read_text())
    assert {r["name"] for r in data["results"]} == {"decode", "spec-decode"}
    assert data["config"]["workload_set"] == "issue16"
    assert "| decode | float32 | fwd |" in output.with_suffix(".md").read_text()


def test_cli_workload_set_models(tmp_path, monkeypatch, no_interpreted_kernels):
    monkeypatch.setattr(bw, "workloads", lambda: SMALL)
    monkeypatch.setattr(bw, "model_workloads", lambda: SMALL_MODELS)
    output = tmp_path / "w.json"
    argv = ["bench", "--workloads", "--workload-set", "models", "--only", "Whisper,Phi-3",
            "--dtypes", "float32", "--device", "cpu", "--budget", "0.005", "--no-progress",
            "-o", str(output)]  # fmt: skip
    assert cli.main(argv) == 0
    data = json.loads(output.read_text())
    assert data["config"]["workload_set"] == "models"
    expected = {w.name for w in SMALL_MODELS if "Whisper" in w.name or "Phi-3" in w.name}
    assert len(expected) == 3 and {r["name"] for r in data["results"]} == expected


def test_only_takes_comma_separated_parts_of_names(monkeypatch, no_interpreted_kernels):
    monkeypatch.setattr(bw, "workloads", lambda: SMALL)
    data = bw.run_workloads(("float32",), torch.device("cpu"), only="spec, prefill",
                            budget_s=0.005, progress=False)  # fmt: skip
    assert {r["name"] for r in data["results"]} == {"prefill", "spec-decode"}


def test_competitors_are_timed_in_interleaved_rounds_and_a_failing_one_is_dropped():
    """Round r times every competitor once, starting from the r-th (drift falls on all
    alike); one that raises is left out with its error and the others keep their
    medians; the context (the patched way's attnhub.patch()) wraps only its own loops."""
    order: list[str] = []
    inside: list[str] = []

    @contextlib.contextmanager
    def context(name):  # type: ignore[no-untyped-def]
        inside.append(name)
        yield
        inside.remove(name)

    def competitor(name):  # type: ignore[no-untyped-def]
        def call():  # type: ignore[no-untyped-def]
            order.append(name)
            assert inside == ([name] if name == "c" else [])
            if name == "b" and order.count("b") > 4:
                raise RuntimeError("out of memory\nmore")

        return call

    fns = {n: competitor(n) for n in "abc"}
    ms, errors = bw.interleaved_ms(
        fns, torch.device("cpu"), budget_s=0.0, repeats=3,
        context=lambda n: context(n) if n == "c" else contextlib.nullcontext(),
    )  # fmt: skip
    assert errors == {"b": "RuntimeError: out of memory"} and set(ms) == {"a", "c"}
    assert all(t > 0 for t in ms.values())
    # Warm-up and sizing: 3 calls each; then loops of 3 calls (b raising in its first),
    # round 1 starting from the second of those left, round 2 from the first again.
    rounds = ["aaa" + "bb" + "ccc", "ccc" + "aaa", "aaa" + "ccc"]
    assert "".join(order) == "aaabbbccc" + "".join(rounds)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_served_by_reports_the_step_that_is_timed(mode):
    """What served a fwd_bwd row is what its timed step ran: the call decided with
    gradients (a backend without a backward serves the forward alone; before, the
    column showed the forward's choice for every mode)."""
    w = SMALL[0]
    x = bw._inputs(w, torch.float32, torch.device("cpu"))
    seen: list[tuple[bool, bool]] = []

    def call(q, k, v):  # type: ignore[no-untyped-def]
        seen.append((torch.is_grad_enabled(), q.requires_grad))
        return bw._attnhub_call(w, x, "torch_reference")(q, k, v)

    assert bw._served_by(bw.AUTO, bw._runner(call, x, mode)) == "torch_reference"
    assert seen == [(True, mode == "fwd_bwd")]
