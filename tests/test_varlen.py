"""attnhub.attention_varlen: packed sequences against a per-sequence loop of the dense
call (contract.md, "Packed sequences and KV caches"), its errors and its explain().

The oracle is independent of the varlen code: each sequence sliced out by hand and
run through ``attnhub.attention(..., backend="torch_reference")`` on float64 copies
(r64), and through ``reference_attention`` in the inputs' dtype (r_lp, for the
contract's tolerance bound).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import attnhub
from attnhub.backend import Backend
from attnhub.backends.torch_reference import reference_attention
from attnhub.request import AttentionParams
from attnhub.testing.tolerance import compare

# (query lengths, key lengths) per sequence: empty sequences, more queries than keys,
# a single query, no keys.
LENGTHS = [
    ([5, 3, 8], [5, 3, 8]),
    ([3, 0, 7, 1, 4], [6, 2, 7, 5, 0]),
]
OPTIONS: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"causal": True, "alignment": "bottom_right"},
    {"window": (2, 1), "alignment": "bottom_right"},
    {"causal": True, "window": (3, None)},
    {"softcap": 2.0, "scale": 0.7},
    {"scale": -0.4},
]


def _cu(lengths: list[int], dtype: torch.dtype = torch.int32, device: Any = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype, device=device)


def _packed(
    lq: list[int],
    lk: list[int],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g).to(device, dtype)
    k = torch.randn(sum(lk), hkv, d, generator=g).to(device, dtype)
    v = torch.randn(sum(lk), hkv, d, generator=g).to(device, dtype)
    return q, k, v


def _params(d: int, options: dict[str, Any]) -> AttentionParams:
    scale = options.get("scale")
    return AttentionParams(
        causal=options.get("causal", False),
        alignment=options.get("alignment", "top_left"),
        window=options.get("window"),
        softcap=options.get("softcap"),
        scale=1.0 / math.sqrt(d) if scale is None else scale,
        return_lse=True,
    )


def _oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lq: list[int],
    lk: list[int],
    options: dict[str, Any],
    *,
    float64: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A loop over the sequences of the dense call: (out (Tq, Hq, D), lse (Tq, Hq))."""
    outs, lses = [], []
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        qi = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ki = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vi = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        if float64:
            out, lse = attnhub.attention(
                qi.double(), ki.double(), vi.double(), backend="torch_reference",
                return_lse=True, **options,
            )  # fmt: skip
        else:  # plain PyTorch operations in the inputs' dtype: the tolerance's r_lp
            out, lse = reference_attention(qi, ki, vi, None, _params(q.shape[-1], options))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _cpu_varlen_backends() -> list[str]:
    registry = attnhub.get_registry()
    return [
        b.name
        for b in registry.backends()
        if "varlen" in b.layouts
        and "cpu" in b.devices
        and registry.unavailable_reason(b.name) is None
    ]


def _cpu_varlen_backward_backends() -> list[str]:
    """Those of :func:`_cpu_varlen_backends` that serve a packed call with a backward on
    the CPU (flex_attention, where the plugin is installed, declares a backward but has
    none on the CPU, and says so). The probe call has the tests' head dim (16)."""
    q = torch.zeros(3, 2, 16, requires_grad=True)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    return [
        name
        for name in _cpu_varlen_backends()
        if attnhub.explain_varlen(q, q, q, cu, cu, backend=name).chosen is not None
    ]


def _check(problems: list[str | None]) -> None:
    found = [p for p in problems if p]
    assert not found, "\n".join(found)


def _forward_problems(
    backend: str, dtype: torch.dtype, lq: list[int], lk: list[int], options: dict[str, Any],
    *, hq: int = 4, hkv: int = 2, d: int = 16, device: str = "cpu",
) -> list[str | None]:  # fmt: skip
    q, k, v = _packed(lq, lk, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=len(options), device=device)
    cu_q, cu_k = _cu(lq, device=device), _cu(lk, device=device)
    out, lse = attnhub.attention_varlen(
        q, k, v, cu_q, cu_k, return_lse=True, backend=backend, **options
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    r64, lse64 = _oracle(q, k, v, lq, lk, options, float64=True)
    r_lp, lse_lp = _oracle(q, k, v, lq, lk, options, float64=False)
    return [compare("out", out, r_lp, r64), compare("lse", lse, lse_lp, lse64)]


@pytest.mark.parametrize("backend", _cpu_varlen_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["equal", "ragged"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(map(str, o)) or "plain")
def test_forward_and_lse_match_a_loop_of_dense_calls(backend, dtype, lengths, options):
    _check(_forward_problems(backend, dtype, *lengths, options))


@pytest.mark.parametrize("backend", _cpu_varlen_backward_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"window": (1, 2), "softcap": 3.0, "alignment": "bottom_right"}],
    ids=["causal", "window-softcap"],
)
def test_gradients_match_a_loop_of_dense_calls(backend, dtype, options):
    _check(_gradient_problems(backend, dtype, LENGTHS[1], options))


def _gradient_problems(
    backend: str, dtype: torch.dtype, lengths: Any, options: dict[str, Any],
    *, hq: int = 4, hkv: int = 2, d: int = 16, device: str = "cpu",
) -> list[str | None]:  # fmt: skip
    if not attnhub.get_registry().get(backend).backward:
        pytest.skip(f"{backend} declares no backward")
    lq, lk = lengths
    q, k, v = _packed(lq, lk, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=7, device=device)
    cu_q, cu_k = _cu(lq, device=device), _cu(lk, device=device)
    g = torch.Generator().manual_seed(3)
    grad_out = torch.randn(q.shape[0], hq, d, generator=g, dtype=torch.float64).to(device)
    results = {}
    for name, run in (
        ("x", lambda q, k, v: attnhub.attention_varlen(
            q, k, v, cu_q, cu_k, backend=backend, **options)),
        ("r64", lambda q, k, v: _oracle(q, k, v, lq, lk, options, float64=True)[0]),
        ("r_lp", lambda q, k, v: _oracle(q, k, v, lq, lk, options, float64=False)[0]),
    ):  # fmt: skip
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        (out.double() * grad_out).sum().backward()
        results[name] = [t.grad for t in leaves]
    return [
        compare(f"d{name}", x, r_lp, r64)
        for name, x, r_lp, r64 in zip("qkv", results["x"], results["r_lp"], results["r64"])
    ]


def test_max_seqlen_and_int64_cu_seqlens_give_the_same_answer():
    lq, lk = LENGTHS[1]
    q, k, v = _packed(lq, lk, hq=2, hkv=2, d=8, dtype=torch.float64, seed=1)
    base = attnhub.attention_varlen(q, k, v, _cu(lq), _cu(lk), causal=True)
    same = attnhub.attention_varlen(
        q, k, v, _cu(lq, torch.int64), _cu(lk, torch.int64), 64, 64, causal=True
    )
    torch.testing.assert_close(same, base, rtol=0, atol=0)


def test_a_sequence_without_keys_gives_zeros_and_minus_infinity():
    q, k, v = _packed([2, 3], [4, 0], hq=2, hkv=1, d=8, dtype=torch.float32, seed=2)
    out, lse = attnhub.attention_varlen(q, k, v, _cu([2, 3]), _cu([4, 0]), return_lse=True)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(lse[2:], torch.full_like(lse[2:], float("-inf")))
    assert torch.isfinite(lse[:2]).all()


def test_empty_batch_and_empty_tokens():
    q = torch.randn(0, 2, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse = attnhub.attention_varlen(q, q, q, cu, cu, return_lse=True)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)
    cu2 = torch.zeros(3, dtype=torch.int32)
    assert attnhub.attention_varlen(q, q, q, cu2, cu2).shape == (0, 2, 8)


# -- errors --------------------------------------------------------------------------


def _good() -> dict[str, Any]:
    q, k, v = _packed([3, 2], [4, 1], hq=4, hkv=2, d=8, dtype=torch.float32, seed=0)
    return {
        "query": q, "key": k, "value": v,
        "cu_seqlens_q": _cu([3, 2]), "cu_seqlens_k": _cu([4, 1]),
    }  # fmt: skip


def _call(**changes: Any) -> Any:
    args = _good()
    options = {n: changes.pop(n) for n in list(changes) if n not in args and "max" not in n}
    args.update(changes)
    return attnhub.attention_varlen(**args, **options)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (
            {"cu_seqlens_q": torch.tensor([0.0, 3.0, 5.0])},
            TypeError,
            "cu_seqlens_q must have dtype int32 or int64, got torch.float32",
        ),
        (
            {"cu_seqlens_k": torch.tensor([0, 4, 5], dtype=torch.int16)},
            TypeError,
            "cu_seqlens_k must have dtype int32 or int64",
        ),
        ({"cu_seqlens_q": [0, 3, 5]}, TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (
            {"cu_seqlens_q": torch.tensor([[0, 3, 5]], dtype=torch.int32)},
            ValueError,
            "cu_seqlens_q must be 1-D",
        ),
        (
            {"cu_seqlens_q": torch.tensor([1, 3, 5], dtype=torch.int32)},
            ValueError,
            "cu_seqlens_q must start at 0, got cu_seqlens_q[0] = 1",
        ),
        (
            {
                "cu_seqlens_k": torch.tensor([0, 4, 3, 5], dtype=torch.int32),
                "cu_seqlens_q": torch.tensor([0, 3, 4, 5], dtype=torch.int32),
            },
            ValueError,
            "cu_seqlens_k must be non-decreasing, got cu_seqlens_k[1] = 4 > cu_seqlens_k[2] = 3",
        ),
        (
            {"cu_seqlens_q": torch.tensor([0, 3, 4], dtype=torch.int32)},
            ValueError,
            "cu_seqlens_q[-1] = 4 must equal the query's total tokens (query.shape[0] = 5)",
        ),
        (
            {"cu_seqlens_k": torch.tensor([0, 5], dtype=torch.int32)},
            ValueError,
            "cu_seqlens_q and cu_seqlens_k must have the same length B + 1",
        ),
        (
            {
                "cu_seqlens_q": torch.zeros(0, dtype=torch.int32),
                "cu_seqlens_k": torch.zeros(0, dtype=torch.int32),
            },
            ValueError,
            "cu_seqlens_q must have B + 1 >= 1 entries",
        ),
        (
            {"max_seqlen_q": 2},
            ValueError,
            "max_seqlen_q=2 is shorter than the longest sequence (3)",
        ),
        ({"max_seqlen_k": 4.0}, TypeError, "max_seqlen_k must be None or an int, got float"),
        (
            {"query": torch.randn(1, 5, 4, 8)},
            ValueError,
            "query must be 3-D (total_tokens, heads, head_dim)",
        ),
        (
            {"key": torch.randn(5, 3, 8), "value": torch.randn(5, 3, 8)},
            ValueError,
            "query heads Hq=4 must be a multiple of key/value heads Hkv=3",
        ),
        (
            {"value": torch.randn(4, 2, 8)},
            ValueError,
            "key and value must have the same number of tokens, got 5 and 4",
        ),
        (
            {"key": torch.randn(5, 2, 4)},
            ValueError,
            "query and key must have the same head dim D, got 8 and 4",
        ),
        (
            {"value": torch.randn(5, 2, 8, dtype=torch.float64)},
            TypeError,
            "value has dtype torch.float64 but query has torch.float32",
        ),
        (
            {"query": torch.randint(0, 3, (5, 4, 8))},
            TypeError,
            "query must have a floating-point dtype",
        ),
        ({"causal": 1}, TypeError, "causal must be a bool, got int"),
        ({"window": (-1, 2)}, ValueError, "window sides must be >= 0"),
        ({"softcap": 0.0}, ValueError, "softcap must be None or > 0"),
        ({"alignment": "center"}, ValueError, "alignment must be one of"),
    ],
)
def test_bad_input_names_the_argument(changes, error, message):
    with pytest.raises(error) as info:
        _call(**changes)
    assert message in str(info.value)


def test_bad_input_raises_before_any_backend_runs(monkeypatch):
    ran = []
    ref = attnhub.get_registry().get("torch_reference")
    monkeypatch.setattr(type(ref), "forward_varlen", lambda *a: ran.append(a))
    with pytest.raises(ValueError, match="must be non-decreasing"):
        _call(cu_seqlens_q=torch.tensor([0, 4, 3, 5], dtype=torch.int32),
              cu_seqlens_k=torch.tensor([0, 4, 4, 5], dtype=torch.int32))  # fmt: skip
    assert ran == []


def test_unknown_backend_and_dense_only_backend_are_refused():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        _call(backend="nope")
    with pytest.raises(attnhub.NoBackendError, match="varlen layout is not supported"):
        _call(backend="torch_sdpa")


# -- explain and registry ------------------------------------------------------------


def test_explain_varlen_names_the_layout_and_why_others_cannot_serve():
    args = _good()
    decision = attnhub.explain_varlen(**args, causal=True, alignment="bottom_right")
    text = str(decision)
    assert decision.chosen == "torch_reference"
    assert text.startswith("attention(varlen: q=(2,4,~4,8) k/v=(2,2,~4,8/8) Nq>Nk float32 cpu")
    assert "causal (bottom_right)" in text.splitlines()[0]
    assert decision.reasons()["torch_sdpa"] == ["varlen layout is not supported (layouts: dense)"]
    # explain runs nothing and validates as the call does
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        attnhub.explain_varlen(**{**args, "cu_seqlens_q": torch.tensor([2, 3, 5])})


def test_same_lengths_normalize_the_alignment_away():
    q, k, v = _packed([3, 2], [3, 2], hq=2, hkv=2, d=8, dtype=torch.float32, seed=0)
    cu = _cu([3, 2])
    top = attnhub.explain_varlen(q, k, v, cu, cu, causal=True).request
    bottom = attnhub.explain_varlen(q, k, v, cu, cu, causal=True, alignment="bottom_right")
    assert top == bottom.request and top.same_seqlen and top.layout == "varlen"


def test_a_backend_declaring_varlen_must_implement_it():
    class NoVarlen(Backend):
        name = "no_varlen"
        devices = frozenset({"cpu"})
        dtypes = frozenset({torch.float32})
        layouts = frozenset({"dense", "varlen"})

    class BadLayout(Backend):
        name = "bad_layout"
        devices = frozenset({"cpu"})
        dtypes = frozenset({torch.float32})
        layouts = frozenset({"ragged"})

    from attnhub.registry import declaration_problems

    assert declaration_problems(NoVarlen()) == [
        "layouts declares 'varlen' but forward_varlen is not implemented"
    ]
    assert declaration_problems(BadLayout()) == [
        "layouts must be within ('dense', 'varlen', 'kvcache', 'paged') (a non-empty set), "
        "got frozenset({'ragged'})"
    ]
    assert Backend.layouts == frozenset({"dense"})  # existing backends and plugins unchanged


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_plugin_returning_the_wrong_dtype_is_disabled_and_the_call_served_again(return_lse):
    from attnhub.backends.torch_reference import TorchReference

    def forward_varlen(self, *args):  # type: ignore[no-untyped-def]
        self.calls += 1
        result = TorchReference.forward_varlen(self, *args)
        return (result[0].double(), result[1]) if return_lse else result.double()

    attributes = {"name": "varlen_wrong_dtype", "priority": 1000, "calls": 0,
                  "forward_varlen": forward_varlen}  # fmt: skip
    plugin = type("Plugin", (TorchReference,), attributes)()
    registry = attnhub.get_registry()
    registry.add(plugin)
    try:
        got = _call(return_lse=return_lse)
        expected = attnhub.attention_varlen(
            **_good(), return_lse=return_lse, backend="torch_reference"
        )
        for g, e in zip(got if return_lse else [got], expected if return_lse else [expected]):
            assert g.dtype == e.dtype and torch.equal(g, e)
        assert plugin.calls == 1
        assert "torch.float64 output, not torch.float32" in (
            registry.unavailable_reason(plugin.name) or ""
        )
    finally:
        registry.remove(plugin.name)


def test_stats_count_the_serving_backend():
    attnhub.reset_stats()
    _call()
    assert attnhub.stats() == {"torch_reference": 1}


# -- GPU (the lead runs these on the H200) ---------------------------------------------

# A sequence without queries (0, 16) and one without keys (5, 0), where lengths differ.
# Sequences longer than a kernel tile (the interpreter's tiles are 16 and 32 rows), so
# that programs start inside a sequence, tiles straddle its end, and the grid (sized by
# the longest sequence) holds programs past the shorter ones.
LONG_LENGTHS = ([40, 0, 33, 70, 1], [40, 5, 17, 70, 0])


@pytest.mark.parametrize("backend", _cpu_varlen_backward_backends())
@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True, "alignment": "bottom_right"}, {"window": (20, 3), "softcap": 4.0}],
    ids=["plain", "causal-bottom_right", "window-softcap"],
)
def test_sequences_longer_than_a_tile_match_a_loop_of_dense_calls(backend, options):
    _check(_forward_problems(backend, torch.float32, *LONG_LENGTHS, options))
    _check(_gradient_problems(backend, torch.float32, LONG_LENGTHS, options))


@pytest.mark.parametrize("backend", _cpu_varlen_backward_backends())
def test_a_nan_in_one_sequence_stays_in_it(backend):
    """Sequence 1's keys and values hold a NaN: its rows are NaN (a NaN key is a NaN
    score), and every other sequence's output and gradients are exact, as if it were
    alone: no program reads another sequence's tokens."""
    lq, lk = LONG_LENGTHS
    q, k, v = _packed(lq, lk, hq=4, hkv=2, d=16, dtype=torch.float32, seed=1)
    ck = _cu(lk).tolist()
    k[ck[1]], v[ck[1] + 2] = float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnhub.attention_varlen(*leaves, _cu(lq), _cu(lk), causal=True, backend=backend)
    out.sum().backward()
    cq = _cu(lq).tolist()
    own = torch.zeros(q.shape[0], dtype=torch.bool)
    own[cq[1] : cq[2]] = True
    assert out[own].isnan().all()
    r64, _ = _oracle(q, k, v, lq, lk, {"causal": True}, float64=True)
    torch.testing.assert_close(out[~own].double(), r64[~own], atol=1e-5, rtol=1e-5)
    keep_k = torch.ones(k.shape[0], dtype=torch.bool)
    keep_k[ck[1] : ck[2]] = False
    for grad, rows in ((leaves[0].grad, ~own), (leaves[1].grad, keep_k), (leaves[2].grad, keep_k)):
        assert grad[rows].isfinite().all()


@pytest.mark.parametrize("backend", _cpu_varlen_backward_backends())
def test_an_unchecked_call_under_torch_compile_gives_the_eager_answer(backend):
    """torch.compile runs the call eagerly (a graph break: the kernels read the index
    tensors' values) and computes what the eager call computes, gradients included."""
    lq, lk = LENGTHS[1]
    q, k, v = _packed(lq, lk, hq=4, hkv=2, d=16, dtype=torch.float32, seed=4)
    cu_q, cu_k = _cu(lq), _cu(lk)

    def step(q, k, v):  # type: ignore[no-untyped-def]
        out = attnhub.attention_varlen(
            q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, backend=backend,
            check_indices=False,
        )  # fmt: skip
        return (out * 2).sum()

    results = []
    for run in (step, torch.compile(step, backend="aot_eager")):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        loss = run(*leaves)
        loss.backward()
        results.append([loss.detach(), *(t.grad for t in leaves)])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)


def _triton_flash_interpreted() -> bool:
    return "triton_flash" in _cpu_varlen_backends()


@pytest.mark.skipif(not _triton_flash_interpreted(), reason="needs TRITON_INTERPRET=1")
def test_triton_flash_backward_launches_give_bitwise_the_same_gradients():
    """The packed backward as two launches and as one (both program orders): bitwise the
    same gradients, as for dense calls (the same programs summing in the same order)."""
    from attnhub.backends.triton_flash import configs, tuning

    lq, lk = LONG_LENGTHS
    q, k, v = _packed(lq, lk, hq=4, hkv=2, d=16, dtype=torch.float16, seed=2)
    results = {}
    for mode in configs.BWD_MODES:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with tuning.override(backward_launch=mode):
            out = attnhub.attention_varlen(
                *leaves, _cu(lq), _cu(lk), causal=True, window=(40, None), backend="triton_flash"
            )
            out.float().square().sum().backward()
        results[mode] = [t.grad for t in leaves]
    for mode in configs.BWD_MODES:
        for name, a, b in zip("qkv", results["split"], results[mode]):
            assert torch.equal(a, b), f"{mode}: d{name} differs from split"


GPU_LENGTHS = ([128, 1, 300, 77, 0, 512, 5], [128, 40, 300, 600, 16, 512, 0])
GPU_OPTIONS: list[dict[str, Any]] = [
    {},
    {"causal": True},
    {"causal": True, "alignment": "bottom_right"},
    {"causal": True, "window": (64, 0), "alignment": "bottom_right"},
    {"softcap": 30.0},
]


def _cuda_backends(layout: str) -> list[str]:
    """Every registered backend declaring ``layout`` on CUDA (each test skips, with
    explain()'s reasons, the cases a backend cannot serve)."""
    return [
        b.name for b in attnhub.get_registry().backends()
        if layout in b.layouts and "cuda" in b.devices
    ]  # fmt: skip


def _skip_unless_eligible(backend: str, *args: Any, **options: Any) -> None:
    decision = attnhub.explain_varlen(*args, backend=backend, **options)
    if decision.chosen != backend:
        pytest.skip(f"{backend}: {'; '.join(decision.reasons()[backend])}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", _cuda_backends("varlen"))
@pytest.mark.parametrize("options", GPU_OPTIONS, ids=lambda o: ",".join(map(str, o)) or "plain")
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
def test_gpu_bf16_varlen_matches_a_loop_of_dense_calls(backend, options, grad):
    lq, lk = GPU_LENGTHS
    if options.get("alignment") != "bottom_right" and options:
        lk = lq  # top-left diagonals on equal lengths (what every kernel serves)
    q, k, v = _packed(lq, lk, 8, 2, 128, torch.bfloat16, 0, device="cuda")
    if grad:
        q.requires_grad_()
    _skip_unless_eligible(
        backend, q, k, v, _cu(lq, device="cuda"), _cu(lk, device="cuda"),
        return_lse=True, **options,
    )  # fmt: skip
    kwargs = {"hq": 8, "hkv": 2, "d": 128, "device": "cuda"}
    if grad:
        _check(_gradient_problems(backend, torch.bfloat16, (lq, lk), options, **kwargs))
    else:
        _check(_forward_problems(backend, torch.bfloat16, lq, lk, options, **kwargs))


# -- check_indices=False -----------------------------------------------------------------


def test_unchecked_indices_read_nothing_and_give_the_same_answer(monkeypatch):
    args = _good()
    checked = attnhub.attention_varlen(**args, causal=True, return_lse=True)
    from attnhub import serving_validation

    def no_read(*a: Any) -> Any:
        raise AssertionError("the cu_seqlens were read")

    monkeypatch.setattr(serving_validation, "_lengths", no_read)
    unchecked = attnhub.attention_varlen(
        **args, max_seqlen_q=3, max_seqlen_k=4, causal=True, return_lse=True,
        check_indices=False,
    )  # fmt: skip
    for a, b in zip(checked, unchecked):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="check_indices=False needs max_seqlen_q"):
        attnhub.attention_varlen(**args, check_indices=False)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0, got -1"):
        attnhub.attention_varlen(**args, max_seqlen_q=3, max_seqlen_k=-1, check_indices=False)
    with pytest.raises(TypeError, match=r"max_seqlen_q must be an int, got float 3\.0"):
        attnhub.attention_varlen(**args, max_seqlen_q=3.0, max_seqlen_k=4, check_indices=False)
    with pytest.raises(TypeError, match="check_indices must be a bool, got str"):
        attnhub.attention_varlen(**args, check_indices="no")
    q, k, v = _packed([3, 2], [3, 2], hq=2, hkv=2, d=8, dtype=torch.float32, seed=0)
    cu = _cu([3, 2])
    same = attnhub.explain_varlen(q, k, v, cu, cu, 3, 3, check_indices=False).request
    other = attnhub.explain_varlen(q, k, v, cu, cu.clone(), 3, 3, check_indices=False).request
    assert (same.same_seqlen, other.same_seqlen, other.q_longer) == (True, False, True)


@pytest.mark.parametrize("empty", ["keys", "queries"])
def test_unchecked_calls_without_tokens_on_a_side_are_empty(empty):
    """check_indices=False with no packed keys (or queries) at all but max_seqlen > 0:
    the request is empty, as the checked path finds, and the reference answers (zero
    rows, lse -inf); before, such a call went to a backend chosen for a non-empty one
    (FlexAttention then raised an IndexError)."""
    tq, tk = (5, 0) if empty == "keys" else (0, 6)
    q, k, v = (torch.randn(t, 2, 16) for t in (tq, tk, tk))
    cu_q, cu_k = torch.tensor([0, tq], dtype=torch.int32), torch.tensor([0, tk], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, 5, 6)
    decision = attnhub.explain_varlen(*args, window=(1, 2), check_indices=False)
    assert decision.request.empty and decision.chosen == "torch_reference"
    out, lse = attnhub.attention_varlen(*args, window=(1, 2), return_lse=True,
                                        check_indices=False)  # fmt: skip
    assert out.shape == (tq, 2, 16) and lse.shape == (tq, 2)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_selection_and_strict_mode_apply_as_for_attention():
    args = _good()
    strict = pytest.raises(attnhub.NoBackendError, match="strict mode: only torch_reference")
    with attnhub.use_backend(strict=True), strict:
        attnhub.attention_varlen(**args)
    with attnhub.use_backend("torch_sdpa", "torch_reference"):
        decision = attnhub.explain_varlen(**args)
    assert decision.chosen == "torch_reference" and decision.fallback
