"""The measured-speed ranking: tables, the policy, its default installation, ``attnhub tune``.

Requests are built by hand (conftest.py's ``cuda_request``) with capability (9, 0):
dispatch reads only the request.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub import cli, cost_model, cost_table, dispatch, tune
from attnhub import registry as registry_module
from attnhub.backend import Backend
from attnhub.cost_table import CostTable, CostTablePolicy
from attnhub.registry import BackendRegistry


class _Fake(Backend):
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    memory = "linear"
    backward = True
    window = True


def fake(name: str, priority: int, **declarations) -> Backend:  # type: ignore[no-untyped-def]
    return type(name.title(), (_Fake,), {"name": name, "priority": priority, **declarations})()


TRITON, CUDNN, FLASH, NEWCOMER = (
    fake("triton_flash", 50),
    fake("torch_sdpa_cudnn", 40),
    fake("torch_sdpa_flash", 30),
    fake("newcomer", 99),
)
ALL = [TRITON, CUDNN, FLASH, NEWCOMER]

ENTRIES = {
    ("bfloat16", 128, 4096, True, "fwd"): {"torch_sdpa_cudnn": 1.0, "triton_flash": 1.23, "torch_sdpa_flash": 1.51},
    ("bfloat16", 128, 4096, True, "fwd_bwd"): {"torch_sdpa_cudnn": 4.0, "triton_flash": 3.5, "torch_sdpa_flash": 5.0},
    ("bfloat16", 128, 1024, True, "fwd"): {"torch_sdpa_cudnn": 0.2, "triton_flash": 0.1},
    ("bfloat16", 128, 16384, True, "fwd"): {"torch_sdpa_cudnn": 9.0, "triton_flash": 8.0},
}  # fmt: skip
TABLE = CostTable("sm90", ENTRIES, "cost_table_sm90.json")


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A private cache dir, no env selection, and no table read before or after."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("ATTNHUB_RANKING", "ATTNHUB_BACKEND", "ATTNHUB_STRICT", "TRITON_INTERPRET"):
        monkeypatch.delenv(name, raising=False)
    # Hide the shipped sm_90 table and cost model: these tests decide which tables
    # exist (tests/test_cost_model.py covers the model beneath a table).
    monkeypatch.setattr(cost_table, "shipped_path", lambda device: tmp_path / "none" / device)
    monkeypatch.setattr(cost_model, "_DATA", tmp_path / "none")
    cost_table.forget_tables()
    yield
    attnhub.set_policy(None)
    cost_table.forget_tables()


@pytest.fixture
def fake_registry(monkeypatch):  # type: ignore[no-untyped-def]
    fresh = BackendRegistry()
    for b in ALL:
        fresh.add(b)
    monkeypatch.setattr(registry_module, "_registry", fresh)
    dispatch.clear_cache()
    yield fresh
    dispatch.clear_cache()


@pytest.fixture
def sm90(cuda_request):  # type: ignore[no-untyped-def]
    """The call TABLE measures: bfloat16, causal, D=128, N~4096 on sm_90 (conftest's)."""
    return cuda_request()


def test_the_shipped_sm90_table_is_well_formed():
    path = Path(cost_table.__file__).parent / "data" / "cost_table_sm90.json"
    table = cost_table.CostTable.from_json(json.loads(path.read_text()), path.name)
    assert table.device == "sm90" and table.entries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_shipped_sm90_table_covers_the_bench_grid(dtype, cuda_request):
    """Every point of issue 4's grid (D 64/128, N 1K-16K, causal or not, with and without
    gradients) finds an entry timing the built-in competitors, in both dtypes: a call
    the table misses falls back to declared priority, which put triton_flash ahead of a
    faster cuDNN for every fp16 training call until fp16 was measured."""
    table = CostTable.load(Path(cost_table.__file__).parent / "data" / "cost_table_sm90.json")
    policy = CostTablePolicy(table)
    for d in (64, 128):
        for n in (1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                for mode in cost_table.TABLE_MODES:
                    found = table.lookup(str(dtype).removeprefix("torch."), d, n, causal, mode)
                    assert found is not None, (dtype, d, n, causal, mode)
                    key, timings = found
                    assert n / 2 <= key[2] <= 2 * n, (key, n)  # within an octave
                    assert {"triton_flash", "torch_sdpa_flash", "torch_sdpa_cudnn"} <= set(timings)
                    request = cuda_request(
                        dtype=dtype, head_dim=d, head_dim_v=d, seqlen_q=n, seqlen_k=n,
                        causal=causal, needs_grad=mode == "fwd_bwd",
                    )  # fmt: skip
                    fastest = min(
                        (b.name for b in ALL if b.name in timings), key=timings.__getitem__
                    )
                    assert names(policy.rank(request, ALL))[0] == fastest, key


def names(ranked) -> list[str]:  # type: ignore[no-untyped-def]
    return [b.name for b, _ in ranked]


def test_ranks_eligible_backends_by_measured_time_and_says_which_entry_decided(sm90):
    ranked = CostTablePolicy(TABLE).rank(sm90, ALL)
    assert names(ranked) == ["torch_sdpa_cudnn", "triton_flash", "torch_sdpa_flash", "newcomer"]
    assert ranked[0][1] == (
        "measured 1 ms vs 1.23 ms for triton_flash in cost_table_sm90.json "
        "[bf16 D128 N~4096 causal fwd]"
    )
    assert ranked[2][1] == "measured 1.51 ms in cost_table_sm90.json [bf16 D128 N~4096 causal fwd]"
    # Not timed there: after every measured backend, by declared priority, and said so.
    assert ranked[3][1].startswith("linear memory, priority 99 (not timed in cost_table_sm90.json")


def test_ranks_only_the_eligible_and_is_deterministic(sm90):
    policy = CostTablePolicy(TABLE)
    ranked = policy.rank(sm90, [FLASH, TRITON])  # cuDNN is not eligible for this call
    assert names(ranked) == ["triton_flash", "torch_sdpa_flash"]
    assert "1.23 ms vs 1.51 ms for torch_sdpa_flash" in ranked[0][1]
    assert names(policy.rank(sm90, [TRITON, FLASH])) == names(ranked)  # order of input irrelevant
    only = policy.rank(sm90, [TRITON, NEWCOMER])
    assert names(only) == ["triton_flash", "newcomer"]
    assert "the only eligible backend timed there" in only[0][1]
    tie = CostTable("sm90", {("bfloat16", 128, 4096, True, "fwd"): {"b_one": 1.0, "a_one": 1.0}})
    assert names(CostTablePolicy(tie).rank(sm90, [fake("b_one", 0), fake("a_one", 0)])) == [
        "a_one",
        "b_one",
    ]


def test_calls_that_need_backward_rank_by_forward_plus_backward(cuda_request):
    ranked = CostTablePolicy(TABLE).rank(cuda_request(needs_grad=True), ALL)
    assert names(ranked)[:3] == ["triton_flash", "torch_sdpa_cudnn", "torch_sdpa_flash"]
    assert "[bf16 D128 N~4096 causal fwd_bwd]" in ranked[0][1]


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"head_dim": 96, "head_dim_v": 96}, "no entry in cost_table_sm90.json for [bf16 D96 N~4096 causal fwd]"),
        ({"dtype": torch.float16}, "no entry in cost_table_sm90.json for [fp16 D128 N~4096 causal fwd]"),
        ({"causal": False}, "no entry in cost_table_sm90.json for [bf16 D128 N~4096 non-causal fwd]"),
        ({"window": True}, "cost_table_sm90.json measures plain attention; this call has a window"),
        ({"mask": "bool"}, "cost_table_sm90.json measures plain attention; this call has a bool mask"),
        ({"heads_kv": 4}, "cost_table_sm90.json measures plain attention; this call has grouped-query heads"),
        ({"seqlen_q": 1, "same_seqlen": False}, "cost_table_sm90.json measures plain attention; this call has Nq != Nk"),
        ({"seqlen_q": 131072, "seqlen_k": 131072}, "no entry in cost_table_sm90.json for [bf16 D128 N~131072 causal fwd]"),
        ({"capability": (8, 0)}, "cost_table_sm90.json is for sm90, not cuda sm80"),
    ],
)  # fmt: skip
def test_uncovered_requests_fall_back_to_declared_priority(changes, why, cuda_request):
    ranked = CostTablePolicy(TABLE).rank(cuda_request(**changes), ALL)
    assert names(ranked) == ["newcomer", "triton_flash", "torch_sdpa_cudnn", "torch_sdpa_flash"]
    assert ranked[0][1] == f"linear memory, priority 99 ({why})"


def test_a_serving_call_is_not_ranked_by_dense_timings(cuda_request):
    """A varlen call whose every sequence has Nq == Nk looks like a covered dense call
    but runs other kernels on other lengths."""
    import dataclasses

    from attnhub.serving_validation import ServingRequest

    dense = cuda_request()
    varlen = ServingRequest(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}, layout="varlen")  # fmt: skip
    ranked = CostTablePolicy(TABLE).rank(varlen, ALL)
    assert ranked[0][1] == "linear memory, priority 99 (cost_table_sm90.json measures plain attention; this call has the varlen layout)"  # fmt: skip


def test_a_length_between_measured_ones_uses_the_nearest_within_two_octaves(cuda_request):
    policy = CostTablePolicy(TABLE)
    # 8192 is one octave from 4096 and from 16384: the tie goes to the longer one.
    ranked = policy.rank(cuda_request(seqlen_q=8192, seqlen_k=8192), [TRITON, CUDNN])
    assert ranked[0][1] == (
        "measured 8 ms vs 9 ms for torch_sdpa_cudnn in cost_table_sm90.json "
        "[bf16 D128 N~16384 causal fwd, nearest to N~8192]"
    )
    ranked = policy.rank(cuda_request(seqlen_q=256, seqlen_k=256), [CUDNN, TRITON])
    assert names(ranked) == ["triton_flash", "torch_sdpa_cudnn"]
    assert "N~1024 causal fwd, nearest to N~256" in ranked[0][1]


def test_dispatch_explains_the_table_entry(fake_registry, sm90):
    attnhub.set_policy(CostTablePolicy(TABLE))
    decision = dispatch.decide(sm90)
    assert decision.chosen == "torch_sdpa_cudnn"
    assert decision.policy == "measured cost (cost_table_sm90.json)"
    assert decision.why.startswith(
        "measured 1 ms vs 1.23 ms for triton_flash in cost_table_sm90.json [bf16 D128 N~4096 causal fwd]; "
        "ranked above triton_flash, torch_sdpa_flash, newcomer by measured cost"
    )
    assert "CHOSEN" in next(
        line for line in str(decision).splitlines() if "torch_sdpa_cudnn" in line
    )


def test_installed_by_default_from_the_users_cache_and_turned_off_by_env(fake_registry, monkeypatch, tmp_path, sm90, cuda_request):  # fmt: skip
    assert dispatch.decide(sm90).chosen == "newcomer"  # no table yet: declared priority
    TABLE.write(cost_table.cache_path("sm90"))
    assert cost_table.cache_path("sm90") == tmp_path / "cache" / "attnhub" / "cost_table_sm90.json"
    cost_table.forget_tables()
    decision = dispatch.decide(sm90)
    assert decision.chosen == "torch_sdpa_cudnn" and decision.policy.startswith("measured cost")
    # Another device class has no table: the declared priority ranks it.
    other = dispatch.decide(cuda_request(capability=(7, 5)))
    assert other.chosen == "newcomer" and other.policy == "declared priority"
    monkeypatch.setenv("ATTNHUB_RANKING", "priority")
    dispatch.clear_cache()
    assert dispatch.decide(sm90).chosen == "newcomer"
    # An explicitly set policy wins over the default.
    monkeypatch.delenv("ATTNHUB_RANKING")
    attnhub.set_policy(dispatch.DeclaredPriority())
    assert dispatch.decide(sm90).chosen == "newcomer"
    attnhub.set_policy(None)
    assert dispatch.decide(sm90).chosen == "torch_sdpa_cudnn"


def test_a_broken_table_is_ignored_with_a_warning(fake_registry, caplog, sm90):
    path = cost_table.cache_path("sm90")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert dispatch.decide(sm90).chosen == "newcomer"
    assert any("ignoring cost table" in r.getMessage() for r in caplog.records)


def _results() -> dict:  # type: ignore[type-arg]
    def row(backend: str, n: int, mode: str, ms: float, **extra) -> dict:  # type: ignore[no-untyped-def,type-arg]
        return {"backend": backend, "dtype": "bfloat16", "B": 16384 // n, "Hq": 16, "Hkv": 16,
                "Nq": n, "Nk": n, "D": 128, "causal": True, "mode": mode, "ms": ms,
                "tflops": 1.0, "peak_mib": None, "density": None, **extra}  # fmt: skip

    rows = [
        row("torch_sdpa_cudnn", 4096, "fwd", 1.0),
        row("triton_flash", 4096, "fwd", 1.23),
        row("triton_flash", 4096, "fwd", 1.1),  # timed twice: the faster is kept
        row("torch_sdpa_flash", 4096, "fwd", 1.51),
        row("torch_sdpa_cudnn", 4096, "fwd_bwd", 4.0),
        row("triton_flash", 4096, "fwd_bwd", 3.5),
        row("triton_flash", 4096, "bwd", 2.4),  # bwd is not a dispatch mode
        row("auto", 4096, "fwd", 1.0, chosen="torch_sdpa_cudnn"),  # auto is dispatch itself
        row("triton_flash", 16384, "fwd", 0.5, window=[255, 0]),  # plain attention only
    ]
    env = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "cuda": "13.0",
           "date": "2026-12-01", "attnhub_commit": "abc1234"}  # fmt: skip
    return {"env": env, "results": rows, "skipped": [], "device_class": "sm90"}


def test_table_from_results_keeps_dense_fwd_and_fwd_bwd_and_round_trips(tmp_path):
    table = tune.table_from_results(_results(), source="h200.json")
    assert dict(table.entries) == {
        ("bfloat16", 128, 4096, True, "fwd"): {"torch_sdpa_cudnn": 1.0, "triton_flash": 1.1, "torch_sdpa_flash": 1.51},
        ("bfloat16", 128, 4096, True, "fwd_bwd"): {"torch_sdpa_cudnn": 4.0, "triton_flash": 3.5},
    }  # fmt: skip
    loaded = CostTable.load(table.write(tmp_path / "t.json"))
    assert loaded.device == "sm90" and dict(loaded.entries) == dict(table.entries)
    assert loaded.source == "t.json" and loaded.meta and loaded.meta["from"] == "h200.json"
    with pytest.raises(ValueError, match="no device class"):
        tune.table_from_results({**_results(), "device_class": None})


def test_tune_from_results_writes_the_cache_table_dispatch_then_uses(fake_registry, tmp_path, capsys, sm90, cuda_request):  # fmt: skip
    results = tmp_path / "h200.json"
    results.write_text(json.dumps(_results()))
    assert cli.main(["tune", "--from-results", str(results)]) == 0
    path = cost_table.cache_path("sm90")
    assert f"wrote {path}: 2 entries for sm90" in capsys.readouterr().out
    decision = dispatch.decide(sm90)
    assert decision.chosen == "torch_sdpa_cudnn"
    assert "1 ms vs 1.1 ms for triton_flash in cost_table_sm90.json" in decision.why
    assert dispatch.decide(cuda_request(needs_grad=True)).chosen == "triton_flash"
    # -o writes elsewhere (e.g. the shipped attnhub/data/cost_table_sm90.json).
    shipped = tmp_path / "data" / "cost_table_sm90.json"
    assert cli.main(["tune", "--from-results", str(results), "-o", str(shipped)]) == 0
    assert CostTable.load(shipped).entries == CostTable.load(path).entries


def test_tune_measures_this_machine_into_the_cache(tmp_path, capsys):
    argv = ["tune", "--device", "cpu", "--dtypes", "fp32", "--head-dims", "16", "--seqlens", "32",
            "--tokens", "64", "--hidden", "32", "--causal", "no",
            "--backends", "torch_sdpa,torch_reference", "--no-progress",
            "--results", str(tmp_path / "raw.json")]  # fmt: skip
    assert cli.main(argv) == 0
    table = CostTable.load(cost_table.cache_path("cpu"))
    key = ("float32", 16, 32, False, "fwd")
    assert set(table.entries) == {key, (*key[:4], "fwd_bwd")}
    assert set(table.entries[key]) == {"torch_sdpa", "torch_reference"}
    assert json.loads((tmp_path / "raw.json").read_text())["device_class"] == "cpu"
    q = torch.randn(2, 2, 32, 16)
    decision = attnhub.explain(q, q, q)
    assert decision.policy == "measured cost (cost_table_cpu.json)"
    # The reference serves only where nothing else can, whatever it measured (dispatch
    # ranks it last): on this tiny call it is sometimes timed faster than SDPA.
    timed = {b: ms for b, ms in table.entries[key].items() if b != "torch_reference"}
    assert decision.chosen == min(timed, key=timed.__getitem__)
    assert "in cost_table_cpu.json [fp32 D16 N~32 non-causal fwd]" in decision.why


def test_importing_attnhub_reads_no_table_and_imports_no_tooling():
    code = (
        "import sys, attnhub, attnhub.cost_table as c; "
        "print(bool(c._policies), sorted(m for m in sys.modules if m.startswith('attnhub.') "
        "and m.split('.')[1] in ('bench', 'bench_report', 'tune', 'cli', 'demo')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False []"


# -- issue 18, item 6: memory class first, validated tables, strict mode ------------------

REFERENCE = fake("torch_reference", -100, memory="quadratic")
QUADRATIC = fake("quadratic_plugin", 60, memory="quadratic")


def test_a_table_never_ranks_a_quadratic_backend_above_a_linear_one(sm90):
    timed_fast = CostTable("sm90", {("bfloat16", 128, 4096, True, "fwd"): {
        "torch_reference": 0.01, "quadratic_plugin": 0.02, "triton_flash": 1.23, "torch_sdpa_flash": 1.51,
    }})  # fmt: skip
    ranked = CostTablePolicy(timed_fast).rank(sm90, [REFERENCE, QUADRATIC, FLASH, TRITON, NEWCOMER])
    # Linear first (by time, then the untimed by priority), then quadratic by time.
    assert names(ranked) == [
        "triton_flash", "torch_sdpa_flash", "newcomer", "torch_reference", "quadratic_plugin",
    ]  # fmt: skip
    assert ranked[0][1].startswith("measured 1.23 ms vs 1.51 ms for torch_sdpa_flash")


def test_dispatch_serves_what_others_can_even_where_the_table_times_the_reference_fastest(
    fake_registry, sm90, caplog
):
    fake_registry.add(REFERENCE)
    fake_registry.add(QUADRATIC)
    table = CostTable("sm90", {("bfloat16", 128, 4096, True, "fwd"): {
        "torch_reference": 0.01, "quadratic_plugin": 0.5,
    }})  # fmt: skip
    attnhub.set_policy(CostTablePolicy(table))
    strict = dispatch.Selection(None, True, "test")
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        # Linear backends eligible: the best of them (untimed: declared priority).
        decision = dispatch.decide(sm90, strict)
        assert (dispatch.choose(decision).name, decision.fallback) == ("newcomer", False)
        # Only quadratic ones: the plugin, though the table times the reference faster;
        # strict mode serves it (only a call that needs the reference is refused).
        for b in ALL:
            fake_registry.remove(b.name)
        decision = dispatch.decide(sm90, strict)
        assert (dispatch.choose(decision).name, decision.fallback) == ("quadratic_plugin", False)
        assert [c.name for c in sorted(decision.candidates, key=lambda c: c.rank or 0)] == [
            "quadratic_plugin", "torch_reference",
        ]  # fmt: skip
    assert not any("falling back" in r.getMessage() for r in caplog.records)


def _entry(**changes):  # type: ignore[no-untyped-def]
    entry = {"dtype": "bfloat16", "head_dim": 128, "n": 1024, "causal": True, "mode": "fwd",
             "ms": {"triton_flash": 0.1, "torch_sdpa_cudnn": 0.2}}  # fmt: skip
    return {**entry, **changes}


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"n": 0}, r"n 0 must be an int >= 1"),
        ({"n": -4096}, r"n -4096 must be an int >= 1"),
        ({"n": "4096"}, r"n '4096' must be an int >= 1"),
        ({"head_dim": 0}, r"head_dim 0 must be an int >= 1"),
        ({"causal": "false"}, r"causal 'false' must be a bool"),
        ({"dtype": "fp16"}, r"dtype 'fp16' must be one of bfloat16, float16, float32, float64"),
        ({"mode": "bwd"}, r"mode 'bwd' must be one of fwd, fwd_bwd"),
        ({"ms": {"triton_flash": float("nan")}}, r"ms\['triton_flash'\] = nan must be a finite number"),
        ({"ms": {"triton_flash": float("inf")}}, r"ms\['triton_flash'\] = inf must be a finite"),
        ({"ms": {"triton_flash": 0}}, r"ms\['triton_flash'\] = 0 must be a finite number of milliseconds > 0"),
        ({"ms": {"triton_flash": -1.0}}, r"ms\['triton_flash'\] = -1.0 must be"),
        ({"ms": {"triton_flash": "fast"}}, r"ms\['triton_flash'\] = 'fast' must be"),
        ({"ms": [1.0]}, r"ms \[1.0\] must be a mapping"),
        ({"n": 4096}, r"repeats the key \('bfloat16', 128, 4096, True, 'fwd'\)"),
    ],
)  # fmt: skip
def test_a_table_that_cannot_be_right_is_rejected_on_load(changes, error):
    data = {"format": cost_table.FORMAT, "device": "sm90",
            "entries": [_entry(n=4096), _entry(**changes)]}  # fmt: skip
    with pytest.raises(ValueError, match=r"^t\.json: entry #1:? " + error):
        CostTable.from_json(data, "t.json")
    with pytest.raises(ValueError, match="must be a finite number"):  # built in memory too
        CostTable("sm90", {("bfloat16", 128, 4096, True, "fwd"): {"a": float("nan")}})


@pytest.mark.parametrize("bad", [{"n": 0}, {"n": -1024}, {"ms": {"newcomer": float("nan")}}])
def test_dispatch_ignores_a_bad_table_with_a_warning_instead_of_failing_calls(
    fake_registry, caplog, cuda_request, bad
):
    path = cost_table.cache_path("sm90")
    path.parent.mkdir(parents=True)
    data = {"format": cost_table.FORMAT, "device": "sm90", "entries": [_entry(**bad)]}
    path.write_text(json.dumps(data))
    # N~4096 has no entry of its own: the lookup compares it with the bad entry's N.
    decision = dispatch.decide(cuda_request())
    assert decision.chosen == "newcomer" and decision.policy == "declared priority"
    assert any("ignoring cost table" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("value", ["priority", "PRIORITY", " declared ", "off"])
def test_ranking_variable_turns_tables_off(fake_registry, monkeypatch, sm90, value):
    attnhub.set_policy(None)
    TABLE.write(cost_table.cache_path("sm90"))
    monkeypatch.setenv("ATTNHUB_RANKING", value)
    assert dispatch.decide(sm90).chosen == "newcomer"
    monkeypatch.setenv("ATTNHUB_RANKING", "measured")
    dispatch.clear_cache()
    assert dispatch.decide(sm90).chosen == "torch_sdpa_cudnn"


def test_ranking_variable_garbage_is_an_error_naming_it(fake_registry, monkeypatch, sm90):
    monkeypatch.setenv("ATTNHUB_RANKING", "fastest")
    with pytest.raises(
        ValueError,
        match=r"ATTNHUB_RANKING='fastest' is not one of measured, priority, declared, off",
    ):
        dispatch.decide(sm90)
