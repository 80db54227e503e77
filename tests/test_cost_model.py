"""The cost model: what ranks a call no measurement and no table covers (issue 16.2)."""

from __future__ import annotations

import json

import pytest
import torch

from attnhub import cost_model, cost_table, dispatch
from attnhub import registry as registry_module
from attnhub.backend import Backend
from attnhub.cost_model import CostModel, CostModelPolicy, KernelCost, work
from attnhub.registry import BackendRegistry


class _Fake(Backend):
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16, torch.float16})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    memory = "linear"
    backward = True
    gqa = True


def fake(name: str, priority: int, **declarations) -> Backend:  # type: ignore[no-untyped-def]
    return type(name.title(), (_Fake,), {"name": name, "priority": priority, **declarations})()


# A fast-launching kernel with modest compute (like PyTorch's), and a slow-launching one
# with more compute (like a Triton kernel before its host path was cut).
LAUNCH = KernelCost(host_us=10, fwd_tflops=300, fwd_bwd_tflops=200, tbps=4.0)
COMPUTE = KernelCost(host_us=80, fwd_tflops=600, fwd_bwd_tflops=400, tbps=1.0)
MODEL = CostModel("sm90", "cost_model_sm90.json", {"launch": LAUNCH, "compute": COMPUTE}, LAUNCH)


def test_work_counts_flops_of_kept_pairs_and_bytes_moved(cuda_request):
    plain = work(cuda_request(causal=False))  # B4 H16 N4096 D128 bf16
    pairs = 4 * 16 * 4096 * 4096
    assert plain.flops == 2 * (128 + 128) * pairs and not plain.backward
    assert plain.bytes == 2 * 4 * (16 * 4096 * 256 + 16 * 4096 * 256)
    causal = work(cuda_request(causal=True))
    assert causal.flops == pytest.approx(plain.flops * (4096 + 1) / (2 * 4096))
    trained = work(cuda_request(causal=False, needs_grad=True))
    assert trained.flops == plain.flops * cost_model.BACKWARD_FACTOR and trained.backward
    masked = work(cuda_request(causal=False, mask="bool"))
    assert masked.bytes == plain.bytes + 4 * 4096 * 4096


def test_estimates_follow_the_roofline_and_the_host(cuda_request):
    w = work(cuda_request(causal=False))
    assert LAUNCH.ms(w) == pytest.approx(0.01 + w.flops / 300e9)
    decode = work(cuda_request(causal=False, seqlen_q=1, same_seqlen=False, seqlen_k=32768))
    assert COMPUTE.ms(decode) == pytest.approx(0.08 + decode.bytes / 1e9)


@pytest.mark.parametrize(
    "bad",
    [
        {"host_us": -1.0},
        {"tbps": 0.0},
        {"fwd_tflops": float("nan")},
        {"tbps": True},
        {"host_us": "1"},
    ],
)
def test_constants_that_cannot_be_right_are_rejected(bad):
    good = {"host_us": 1.0, "fwd_tflops": 1.0, "fwd_bwd_tflops": 1.0, "tbps": 1.0}
    with pytest.raises(ValueError, match="must be"):
        KernelCost(**{**good, **bad})


def test_the_model_ranks_big_calls_by_compute_and_small_ones_by_launch_and_bandwidth(cuda_request):
    policy = CostModelPolicy(MODEL)
    backends = [fake("launch", 1), fake("compute", 2), fake("plugin", 99)]
    prefill = policy.rank(cuda_request(), backends)
    assert next(b.name for b, _ in prefill) == "compute"
    tiny = cuda_request(batch=1, heads_q=1, heads_kv=1, seqlen_q=16, seqlen_k=16, head_dim=64, head_dim_v=64)  # fmt: skip
    decode = cuda_request(seqlen_q=1, same_seqlen=False, seqlen_k=32768, causal=False)
    for request in (tiny, decode):
        ranked = [b.name for b, _ in policy.rank(request, backends)]
        # "plugin" has the default constants (LAUNCH's): ties break by priority.
        assert ranked == ["plugin", "launch", "compute"], request
    why = dict((b.name, w) for b, w in policy.rank(decode, backends))
    assert why["plugin"].startswith("estimated ") and "default constants" in why["plugin"]
    assert "its constants" in why["launch"]


def test_the_model_never_ranks_against_the_memory_class(cuda_request):
    policy = CostModelPolicy(MODEL)
    ranked = policy.rank(
        cuda_request(), [fake("compute", 1, memory="quadratic"), fake("launch", 1)]
    )
    assert [b.name for b, _ in ranked] == ["launch", "compute"]


def test_a_backend_that_compiles_per_shape_ranks_after_those_that_do_not(cuda_request):
    """The model ranks unmeasured calls, whose first call on a compile-per-shape backend
    compiles: its estimate (the cheaper one here) does not put it first; within its
    memory class only, and explain() says why."""
    policy = CostModelPolicy(MODEL)
    decode = cuda_request(seqlen_q=1, same_seqlen=False, seqlen_k=32768, causal=False)
    compiling = fake("launch", 1, compiles_per_shape=True)
    ranked = policy.rank(decode, [compiling, fake("compute", 1)])
    assert [b.name for b, _ in ranked] == ["compute", "launch"]
    assert "after those that do not compile per shape" in ranked[1][1]
    quadratic = fake("compute", 1, memory="quadratic")
    ranked = policy.rank(decode, [quadratic, compiling])
    assert [b.name for b, _ in ranked] == ["launch", "compute"]
    assert "compile per shape" not in ranked[0][1]  # none of its class compiles once


@pytest.fixture
def isolated(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("ATTNHUB_RANKING", "ATTNHUB_BACKEND", "ATTNHUB_STRICT", "ATTNHUB_AUTOTUNE"):
        monkeypatch.delenv(name, raising=False)
    fresh = BackendRegistry()
    for b in (fake("launch", 1), fake("compute", 2)):
        fresh.add(b)
    monkeypatch.setattr(registry_module, "_registry", fresh)
    data = tmp_path / "data"
    data.mkdir()
    document = {
        "format": cost_model.FORMAT, "device": "sm90",
        "backends": {"launch": LAUNCH.__dict__, "compute": COMPUTE.__dict__},
        "default": LAUNCH.__dict__,
    }  # fmt: skip
    (data / "cost_model_sm90.json").write_text(json.dumps(document))
    monkeypatch.setattr(cost_model, "_DATA", data)
    cost_table.forget_tables()
    yield data
    cost_table.forget_tables()
    dispatch.clear_cache()


def test_dispatch_ranks_what_the_table_does_not_cover_by_the_model(isolated, cuda_request):
    """The shipped table measures plain attention; a decoding step with grouped-query
    heads is the model's to rank (it used to be the declared priority's: 'compute')."""
    decode = cuda_request(seqlen_q=1, same_seqlen=False, seqlen_k=32768, heads_kv=4, causal=False)
    decision = dispatch.decide(decode)
    assert decision.chosen == "launch"
    assert "estimated" in decision.why and "cost model" in decision.why
    # Under a table that does not cover the call, the model still ranks it.
    table = cost_table.CostTable(
        "sm90", {("bfloat16", 128, 4096, True, "fwd"): {"compute": 1.0, "launch": 2.0}}
    )
    table.write(cost_table.cache_path("sm90"))
    cost_table.forget_tables()
    assert dispatch.decide(decode).chosen == "launch"
    assert dispatch.decide(cuda_request()).chosen == "compute"  # covered: the table's


def test_a_broken_model_file_is_ignored_with_a_warning(isolated, cuda_request, caplog):
    (isolated / "cost_model_sm90.json").write_text('{"format": "attnhub-cost-model/1"}')
    decision = dispatch.decide(cuda_request(seqlen_q=1, same_seqlen=False, causal=False))
    assert decision.chosen == "compute"  # declared priority
    assert any("ignoring the cost model" in r.getMessage() for r in caplog.records)


def test_the_shipped_model_knows_the_built_in_cuda_backends():
    shipped = CostModel.shipped("sm90")
    assert shipped is not None
    for name in ("torch_sdpa", "torch_sdpa_flash", "torch_sdpa_cudnn", "triton_flash"):
        assert shipped.cost(name)[1], name
