"""Autotune: the first call of a signature times every eligible backend on that call,
the fastest serves it and every later call, the measurement persists and explains."""

from __future__ import annotations

import json
import sys
import time
from typing import ClassVar

import pytest
import torch

import attnhub
from attnhub import autotune, dispatch, measured, timing
from attnhub import registry as registry_module
from attnhub.backend import FLOAT_DTYPES, Backend
from attnhub.backends.torch_reference import reference_attention
from attnhub.registry import BackendRegistry


class _Timed(Backend):
    """A correct backend that takes ``delay`` seconds a call and counts its calls."""

    devices = frozenset({"cpu"})
    dtypes = FLOAT_DTYPES
    causal_alignments = frozenset({"top_left", "bottom_right"})
    mask_kinds = frozenset({"none", "bool", "float"})
    dropout = backward = gqa = True
    memory = "linear"
    delay = 0.0
    fails = False

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.fails:
            raise RuntimeError("kernel failed")
        time.sleep(self.delay)
        return reference_attention(query, key, value, attn_mask, params)[0]


class _VirtualClock:
    """``time.perf_counter`` and ``time.sleep`` on a clock that sleeping advances, and
    each reading by a nanosecond (as a real clock would, so no call takes zero time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 1e-9
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _backend(name: str, priority: int, delay: float, fails: bool = False) -> _Timed:
    cls = type(
        name.title(),
        (_Timed,),
        {"name": name, "priority": priority, "delay": delay, "fails": fails},
    )
    return cls()


@pytest.fixture
def tuned(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A registry of a slow backend that declared priority prefers and a fast one, on a
    CPU treated as a measured device, with the measurements in a fresh cache folder.
    Timing reads a virtual clock that only the backends' delays advance, so what
    autotune measures is exactly their delays, whatever the machine's load."""
    clock = _VirtualClock()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(sys.modules[__name__], "time", clock)
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    monkeypatch.setattr(measured, "DEVICES", frozenset({"cpu"}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in ("ATTNHUB_BACKEND", "ATTNHUB_STRICT", "ATTNHUB_AUTOTUNE", "ATTNHUB_RANKING",
                 "ATTNHUB_MEASUREMENTS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    slow, fast = _backend("slow", 100, 0.004), _backend("fast", 10, 0.0)
    fresh.add(slow)
    fresh.add(fast)
    measured.forget_stores()
    yield slow, fast, fresh
    measured.forget_stores()
    dispatch.clear_cache()


# The slow backend's 4 ms a call exceeds autotune.ROUND_MS: each of its rounds is
# MIN_CALLS calls, after its warm-up call.
SLOW_TIMED_CALLS = 1 + autotune.ROUNDS * autotune.MIN_CALLS


def _qkv(n: int = 16, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(1, 2, n, 8, requires_grad=requires_grad) for _ in range(3))


def test_the_first_call_measures_and_the_fastest_serves(tuned):
    slow, fast, _ = tuned
    q, k, v = _qkv()
    assert attnhub.explain(q, k, v).chosen == "slow"  # declared priority, before measuring
    attnhub.reset_stats()
    out = attnhub.attention(q, k, v)
    torch.testing.assert_close(out, reference_attention(q, k, v, None, _params(q))[0])
    assert attnhub.stats() == {"fast": 1}
    assert slow.calls == SLOW_TIMED_CALLS  # timed (warm-up and rounds), never served
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast"
    assert "measured here on first use" in decision.why and "for slow" in decision.why
    # Later calls of the signature (another length in the same bucket too) do not time.
    calls = slow.calls, fast.calls
    attnhub.attention(q, k, v)
    attnhub.attention(*_qkv(n=15))
    assert slow.calls == calls[0] and fast.calls == calls[1] + 2


def _params(q):  # type: ignore[no-untyped-def]
    from attnhub.validation import make_params

    return make_params(q, key=q, causal=False, alignment="top_left", window=None, softcap=None,
                       scale=None, dropout_p=0.0, block_sparse=None, return_lse=False)  # fmt: skip


def test_measurements_persist_and_a_new_process_reuses_them(tuned, tmp_path):
    slow, _, _ = tuned
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    (path,) = (tmp_path / "attnhub").glob("measured-*.json")
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    assert set(entry["ms"]) == {"slow", "fast"} and entry["ms"]["slow"] > entry["ms"]["fast"]
    measured.forget_stores()  # as a new process: read from the file
    calls = slow.calls
    assert attnhub.explain(q, k, v).chosen == "fast"
    attnhub.attention(q, k, v)
    assert slow.calls == calls  # no timing again


def test_a_backend_eligible_since_the_measurement_is_measured_with_the_rest(tuned):
    """A measurement that neither timed nor excused an eligible backend (one a newer
    attnhub or a plugin made eligible since, kept in the same file) is taken again, once,
    with it; the new one replaces the old and ranks all of them."""
    slow, _, registry = tuned
    q, k, v = _qkv()
    attnhub.attention(q, k, v)  # measures slow and fast
    newer = _backend("newer", 50, 0.001)
    registry.add(newer)
    dispatch.clear_cache()
    slow_calls = slow.calls
    assert attnhub.explain(q, k, v).chosen == "fast"  # ranked, not yet timed
    attnhub.attention(q, k, v)
    assert newer.calls > 1 and slow.calls == slow_calls + SLOW_TIMED_CALLS  # all timed again
    decision = attnhub.explain(q, k, v)
    (candidate,) = [c for c in decision.candidates if c.name == "newer"]
    assert "measured here" in candidate.note and "not timed" not in candidate.note
    calls = newer.calls
    measured.forget_stores()  # a new process: the file holds the complete measurement
    dispatch.clear_cache()
    attnhub.attention(q, k, v)
    assert newer.calls == calls


def test_training_calls_are_timed_with_their_backward(tuned):
    q, k, v = _qkv(requires_grad=True)
    out = attnhub.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None  # the caller's graph and tensors are untouched by timing
    assert attnhub.explain(q, k, v).request.needs_grad
    assert "measured here" in attnhub.explain(q, k, v).why


@pytest.mark.parametrize(
    "setting", ["env off", "dropout", "named backends", "distributed", "one eligible"]
)
def test_no_measuring_where_it_must_not(tuned, monkeypatch, setting):
    slow, fast, registry = tuned
    q, k, v = _qkv()
    options: dict = {}
    if setting == "env off":
        monkeypatch.setenv("ATTNHUB_AUTOTUNE", "0")
    elif setting == "dropout":
        options["dropout_p"] = 0.5
    elif setting == "named backends":
        options["backend"] = ["slow", "fast"]
    elif setting == "distributed":
        monkeypatch.setattr(measured, "distributed_job", lambda: True)
    else:
        registry.remove("fast")
    attnhub.attention(q, k, v, **options)
    assert slow.calls == 1  # served once, never timed
    assert fast.calls == 0
    assert measured.store_for(q.device).get(attnhub.explain(q, k, v).request) is None


class _SeesEveryOp(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode as FlopCounterMode or a profiler installs one: it sees every op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["FakeTensorMode", "dispatch mode", "vmap"])
def test_no_measuring_outside_plain_eager_mode(tuned, mode):
    """Under FakeTensorMode the timed calls run no kernel (a fake call's host time would
    be persisted as the backend's); under a dispatch mode the mode would see the timing
    calls as the caller's. Both measured before, and the decision was kept for the
    signature's later eager calls (failed before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    slow, fast, _ = tuned
    q, k, v = _qkv()
    if mode == "FakeTensorMode":
        with FakeTensorMode() as fake:
            attnhub.attention(*(fake.from_tensor(t) for t in (q, k, v)))
    elif mode == "dispatch mode":
        with _SeesEveryOp():
            attnhub.attention(q, k, v)
    else:
        torch.vmap(lambda x: attnhub.attention(x, k, v))(q.expand(2, *q.shape))
    assert (slow.calls, fast.calls) == (1, 0)  # served once, never timed
    assert measured.store_for(q.device).get(attnhub.explain(q, k, v).request) is None
    attnhub.reset_stats()
    attnhub.attention(q, k, v)  # the first eager call of the signature measures
    assert slow.calls == 1 + SLOW_TIMED_CALLS and attnhub.stats() == {"fast": 1}


def test_calls_under_a_mode_are_decided_once_and_apart_from_eager_ones(tuned, monkeypatch):
    """Selective activation checkpointing runs every forward under a dispatch mode: its
    calls are decided once (kept apart from eager calls', which still measure), not
    validated and decided again at every call."""
    from attnhub import api

    slow, fast, _ = tuned
    decided = []
    prepare = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda *a: decided.append(1) or prepare(*a))
    q, k, v = _qkv()
    with _SeesEveryOp():
        for _ in range(3):
            attnhub.attention(q, k, v)
    assert (len(decided), slow.calls, fast.calls) == (1, 3, 0)
    attnhub.attention(q, k, v)  # eager: measures, and its entry serves eager calls
    assert len(decided) == 2 and slow.calls == 3 + SLOW_TIMED_CALLS


def test_ranks_of_a_distributed_job_read_only_a_shared_measurement_file(
    tuned, monkeypatch, tmp_path
):
    """Every rank must pick the same backend: a rank ignores its machine's own file
    (another machine's may differ, or be missing) and reads the file that
    ATTNHUB_MEASUREMENTS names for all of them."""
    q, k, v = _qkv()
    attnhub.attention(q, k, v)  # measured into this machine's file, as one process
    assert attnhub.explain(q, k, v).chosen == "fast"
    monkeypatch.setattr(measured, "distributed_job", lambda: True)
    measured.forget_stores()
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "slow" and "measured" not in decision.why  # declared priority
    shared = tmp_path / "shared" / "measurements.json"
    monkeypatch.setenv("ATTNHUB_MEASUREMENTS", str(shared))
    measured.forget_stores()
    assert attnhub.explain(q, k, v).chosen == "slow"  # the shared file has no entry yet
    (local,) = (tmp_path / "attnhub").glob("measured-*.json")
    shared.parent.mkdir()
    shared.write_text(local.read_text())  # e.g. written by `attnhub tune` on one machine
    measured.forget_stores()
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast" and "measurements.json" in decision.why


def test_a_backend_that_fails_while_timed_is_left_out_with_its_reason(tuned):
    registry = tuned[2]
    broken = _backend("broken", 1000, 0.0, fails=True)
    registry.add(broken)
    q, k, v = _qkv()
    out = attnhub.attention(q, k, v)
    assert out.shape == q.shape
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast"
    note = next(c.note for c in decision.candidates if c.name == "broken")
    assert "RuntimeError: kernel failed when measured" in note


def test_a_signature_where_nothing_could_be_timed_says_so_and_is_not_written(tuned, caplog):
    for backend in tuned[:2]:
        type(backend).fails = True  # the classes are the fixture's own
    q, k, v = _qkv()
    with caplog.at_level("INFO", logger="attnhub"), pytest.raises(RuntimeError):
        attnhub.attention(q, k, v)
    assert "nothing could be timed (fast: RuntimeError: kernel failed; slow:" in caplog.text
    assert "measured again by the next process" in caplog.text
    assert not measured.store_path(q.device).exists()  # kept in memory only


def test_a_broken_measurement_file_is_ignored(tuned, tmp_path, caplog):
    q, k, v = _qkv()
    path = measured.store_path(q.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '{"format": "attnhub-measured/1", "entries": {"x": {"ms": {"a": -1}, "when": "now"}}}'
    )
    measured.forget_stores()
    attnhub.attention(q, k, v)
    assert "ignoring measurements" in caplog.text
    assert attnhub.explain(q, k, v).chosen == "fast"


def test_every_spelling_of_a_device_shares_one_store(tuned):
    """autotune stores under the tensors' device (cuda:0), the policy reads under the
    request's device type (cuda): one store, or measurements are never read back."""
    assert measured.store_for(torch.device("cpu", 0)) is measured.store_for(torch.device("cpu"))
    q, k, v = _qkv()
    attnhub.attention(q.to(torch.device("cpu", 0)), k, v)
    assert "measured here" in attnhub.explain(q, k, v).why


def test_tune_prewarms_the_workload_calls_into_the_measurement_file(tuned, capsys):
    """`attnhub tune --workloads` runs each call once, so autotune measures it then and
    not at a user's first call; a second run finds nothing left to measure."""
    from attnhub import cli

    argv = ["tune", "--workloads", "--only", "tiny", "--dtypes", "fp32", "--device", "cpu",
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # The tiny call runs forward, then forward and backward: two signatures.
    assert ": 2 call signatures measured now, 2 in all" in out
    q = torch.randn(1, 1, 16, 64)
    assert "measured here on first use" in attnhub.explain(q, q, q).why
    assert cli.main(argv) == 0
    assert ": 0 call signatures measured now, 2 in all" in capsys.readouterr().out


def test_tune_refuses_a_device_autotune_does_not_measure(capsys):
    from attnhub import cli

    assert cli.main(["tune", "--workloads", "--device", "cpu"]) == 2
    assert "autotune measures on cuda only, not cpu" in capsys.readouterr().err


def test_tune_model_prewarm_measures_the_calls_a_model_makes(tuned):
    from attnhub import bench_models

    spec = bench_models.ModelSpec("llama", "llama", layers=1, hidden=64, heads=4, kv_heads=2,
                                  train_batch=1, train_seq=16, gen_batch=2, prompt=8,
                                  new_tokens=2)  # fmt: skip
    store = measured.store_for(torch.device("cpu"))
    assert len(store) == 0
    bench_models.prewarm(spec, torch.float32, torch.device("cpu"), vocab=50)
    # Training (forward and backward), prefill and decoding steps, in both ways.
    assert len(store) >= 3


def test_a_backend_that_compiles_per_shape_is_not_timed_at_a_first_call(tuned):
    """FlexAttention compiled with static shapes would compile (seconds) in the timing
    of every new signature: it is left untimed, ranked after the timed backends."""
    registry = tuned[2]
    compiling = _backend("compiling", 1000, 0.0)
    type(compiling).compiles_per_shape = True
    registry.add(compiling)
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    assert compiling.calls == 0
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast"
    (note,) = [c.note for c in decision.candidates if c.name == "compiling"]
    assert "compiles per shape: not timed at a first call" in note


def test_one_timed_backend_beside_untimed_ones_is_measured_and_serves(tuned, monkeypatch):
    """Where a single eligible backend can be timed (the others compile per shape, or
    are the reference), it is still measured, and the measurement ranks it above the
    untimed ones, as the module says, where the declared priority (or the cost model)
    would put an untimed one first."""
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    dispatch.clear_cache()
    fast = _backend("fast", 10, 0.0)
    compiling = _backend("compiling", 1000, 0.0)
    type(compiling).compiles_per_shape = True
    fresh.add(fast)
    fresh.add(compiling)
    q, k, v = _qkv()
    assert attnhub.explain(q, k, v).chosen == "compiling"  # declared priority, unmeasured
    attnhub.reset_stats()
    attnhub.attention(q, k, v)
    assert attnhub.stats() == {"fast": 1}
    assert compiling.calls == 0 and fast.calls > 1  # timed, then served
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast"
    assert "measured here on first use" in decision.why
    (note,) = [c.note for c in decision.candidates if c.name == "compiling"]
    assert "compiles per shape: not timed at a first call" in note


def test_backends_no_timing_could_rank_first_are_not_timed(tuned):
    """The reference (ranked last whatever it costs) and, beside a linear-memory backend,
    a quadratic-memory one (ranked after every linear one) are not timed: timing them
    spends the caller's memory (the reference's float32 scores) for nothing."""
    registry = tuned[2]
    reference = _backend("torch_reference", -100, 0.0)
    type(reference).memory = "quadratic"
    quadratic = _backend("quadratic", 1000, 0.0)
    type(quadratic).memory = "quadratic"
    registry.add(reference)
    registry.add(quadratic)
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    assert reference.calls == 0 and quadratic.calls == 0
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "fast"
    notes = {c.name: c.note for c in decision.candidates}
    assert "quadratic memory, ranked after the linear-memory backends" in notes["quadratic"]
    assert "measured" not in notes["torch_reference"]  # ranked last, by declaration


def test_quadratic_backends_are_timed_where_no_linear_one_is_eligible(tuned):
    slow, fast, _ = tuned
    for timed in (slow, fast):
        type(timed).memory = "quadratic"
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    assert slow.calls == SLOW_TIMED_CALLS
    assert attnhub.explain(q, k, v).chosen == "fast"


class _Spelled(_Timed):
    """Takes ``delay`` a call, except calls ``spell`` (counted from 1), which take 20 ms:
    a slow spell of the machine that hits whichever backend is running then."""

    spell: tuple[int, ...] = ()
    log: ClassVar[list[str]] = []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        type(self).log.append(self.name)
        if self.calls + 1 in self.spell:
            time.sleep(0.02)
        return super().forward(query, key, value, attn_mask, params)


def test_rounds_interleave_and_each_backend_keeps_its_best_round(tuned, monkeypatch):
    """A slow spell during one backend's round does not decide the ranking: its best
    round does. Five calls timed back to back (the old way) read the spelled backend at
    (3 * 1 + 2 * 20) / 5 = 8.6 ms against the other's 3 ms, and ranked it last."""
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    dispatch.clear_cache()
    log: list[str] = []
    spelled = type("Spelled", (_Spelled,), {"name": "spelled", "priority": 1, "delay": 0.001,
                                            "spell": (2, 3), "log": log})()  # fmt: skip
    steady = type("Steady", (_Spelled,), {"name": "steady", "priority": 2, "delay": 0.003,
                                          "log": log})()  # fmt: skip
    fresh.add(spelled)
    fresh.add(steady)
    q, k, v = _qkv()
    attnhub.reset_stats()
    attnhub.attention(q, k, v)
    assert attnhub.stats() == {"spelled": 1}
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "spelled" and "for steady" in decision.why
    # Warm-up calls first, then rounds of MIN_CALLS calls (both take more than
    # ROUND_MS) in rotating order: the backends alternate round by round.
    timed = log[2:-1]  # after the warm-ups, before the served call
    rounds = [timed[i : i + autotune.MIN_CALLS] for i in range(0, len(timed), autotune.MIN_CALLS)]
    assert len(rounds) == 2 * autotune.ROUNDS
    assert all(len(set(r)) == 1 for r in rounds)
    firsts = [rounds[2 * i][0] for i in range(autotune.ROUNDS)]
    assert len(set(firsts)) == 2  # the order rotates


def test_rounds_that_disagree_take_more_rounds_before_a_tie(tuned, monkeypatch, tmp_path):
    """Short calls whose first rounds a slow spell hit (a cold device): after ROUNDS the
    spelled backend's median round is a spelled one, and that spread would make its
    1.5x lead a tie, handing the call to the stock backend; extra rounds settle the
    spread, and the faster backend serves."""
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    log: list[str] = []
    # Its calls 2-3 and 4-5 are its rounds 1 and 2 (MIN_CALLS each after the warm-up
    # call 1: the spelled first round sets the calls per round).
    fast = type("Fast", (_Spelled,), {"name": "fast", "priority": 2, "delay": 0.0001,
                                      "spell": (2, 4), "log": log})()  # fmt: skip
    stock = type("Stock", (_Spelled,), {"name": "stock", "priority": 1, "delay": 0.00015,
                                        "stock": True, "log": log})()  # fmt: skip
    fresh.add(fast)
    fresh.add(stock)
    q, k, v = _qkv()
    for extra, served in ((autotune.EXTRA_ROUNDS, "fast"), (0, "stock")):
        monkeypatch.setattr(autotune, "EXTRA_ROUNDS", extra)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / str(extra)))  # a fresh store
        measured.forget_stores()
        dispatch.clear_cache()
        fast.calls = stock.calls = 0
        log.clear()
        attnhub.reset_stats()
        attnhub.attention(q, k, v)
        assert attnhub.stats() == {served: 1}
        found = measured.store_for(q.device).get(attnhub.explain(q, k, v).request)
        assert found is not None and found.ms["fast"] == pytest.approx(0.1, rel=0.01)
        timed_calls = log.count("fast") - (served == "fast")
        if extra:
            assert found.spread["fast"] <= autotune.SETTLED
            assert timed_calls > 1 + autotune.ROUNDS * autotune.MIN_CALLS
        else:  # the tie the module comment describes
            assert found.spread["fast"] > 1.5
            assert timed_calls == 1 + autotune.ROUNDS * autotune.MIN_CALLS
            assert "tie" in attnhub.explain(q, k, v).why


def test_short_calls_repeat_to_fill_a_round(tuned, monkeypatch):
    monkeypatch.setattr(autotune, "ROUND_MS", 1000.0)  # every call is short beside it
    fast = tuned[1]
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    # Round 1 is MIN_CALLS calls; rounds 2.. are as many as fill ROUND_MS, capped.
    assert fast.calls == 1 + autotune.MIN_CALLS + (autotune.ROUNDS - 1) * autotune.MAX_CALLS + 1


def _measured_as(tuned, ms: dict[str, float], stock: str, spread=None):  # type: ignore[no-untyped-def]
    """explain() for a call whose measurement is ``ms`` (and ``spread``), ``stock``
    declared stock."""
    monkeypatch = pytest.MonkeyPatch()
    for backend in tuned[:2]:
        monkeypatch.setattr(type(backend), "stock", backend.name == stock)
    q, k, v = _qkv()
    request = attnhub.explain(q, k, v).request
    found = measured.Measurement(ms, measured.now(), spread=spread or {})
    measured.store_for(q.device).put(request, found)
    dispatch.clear_cache()
    try:
        return attnhub.explain(q, k, v)
    finally:
        monkeypatch.undo()


def test_a_tie_goes_to_the_stock_backend(tuned):
    """Within measured.TIE of the fastest, the stock backend (F.sdpa's path) ranks first:
    the measurement cannot tell them apart, and stock is what the user would have had."""
    within = 1.0 * (1 + measured.TIE * 0.9)
    decision = _measured_as(tuned, {"fast": 1.0, "slow": within}, stock="slow")
    assert decision.chosen == "slow"
    assert "a tie, which goes to the stock path" in decision.why
    beyond = 1.0 * (1 + measured.TIE * 1.1)
    decision = _measured_as(tuned, {"fast": 1.0, "slow": beyond}, stock="slow")
    assert decision.chosen == "fast" and "tie" not in decision.why


@pytest.mark.parametrize("noisy", ["fast", "slow"])
def test_a_difference_within_the_rounds_spread_is_a_tie(tuned, noisy):
    """Beyond TIE, but within the spread of either backend's rounds: not resolved by the
    measurement, so a tie; and the spread persists with the times."""
    ms = {"fast": 1.0, "slow": 1.1}
    decision = _measured_as(tuned, ms, stock="slow", spread={noisy: 0.12})
    assert decision.chosen == "slow" and "tie" in decision.why
    decision = _measured_as(tuned, ms, stock="slow", spread={noisy: 0.08})
    assert decision.chosen == "fast"
    measured.forget_stores()  # as a new process
    q, k, v = _qkv()
    found = measured.store_for(q.device).get(attnhub.explain(q, k, v).request)
    assert found is not None and dict(found.spread) == {noisy: 0.08}


def test_the_spread_is_the_median_round_over_the_best_not_the_slowest():
    """One slow round (a spell, a cold first round) is not the measurement's noise: on
    the H200 it read a tiny call's noise as a tie with a 15% slower stock backend."""
    assert autotune._best_and_spread([1.0, 1.01, 1.9]) == pytest.approx((1.0, 0.01))
    assert autotune._best_and_spread([1.2, 1.0]) == pytest.approx((1.0, 0.2))
    assert autotune._best_and_spread([1.0]) == (1.0, 0.0)


def test_autotune_records_the_spread_of_its_rounds(tuned):
    q, k, v = _qkv()
    attnhub.attention(q, k, v)
    found = measured.store_for(q.device).get(attnhub.explain(q, k, v).request)
    assert found is not None and set(found.spread) == {"slow", "fast"}
    assert all(0 <= x < 10 for x in found.spread.values())


def test_a_tie_never_crosses_memory_classes(tuned, monkeypatch):
    slow = tuned[0]
    monkeypatch.setattr(type(slow), "memory", "quadratic")
    decision = _measured_as(tuned, {"fast": 1.0, "slow": 1.0}, stock="slow")
    assert decision.chosen == "fast"
