"""triton_flash's TMA forward (kernels_tma.attn_fwd_tma_kernel): the conformance cases it
can serve, forced onto it with ``tuning.override``, against the float64 reference with
contract.md's tolerance (the kit's ``case_problems``); the calls it must leave to the
pointer kernel; and on CUDA its cached launch plan (global scratch for the descriptors).

Without CUDA the kernel runs in Triton's interpreter (which emulates tensor
descriptors), with CUDA on the GPU, bfloat16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from attnhub.backends.torch_reference import contract_attention  # noqa: E402
from attnhub.backends.triton_flash import configs, ops, tuning  # noqa: E402
from attnhub.request import AttentionParams  # noqa: E402
from attnhub.testing import case_problems, cases_for  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
MARKS = [gpu] if HAS_CUDA else [pytest.mark.interpreter]
TMA = "attn_fwd_tma_kernel"
POINTER = "attn_fwd_kernel"

# The forced launches: the interpreter's tiles there, the table's TMA forward row and
# the lean D=128 backward rows on the GPU; each with TMA loads.
FORCED = (
    configs.LaunchConfig(128, 64, 4, 2, tma=True)
    if HAS_CUDA
    else configs.LaunchConfig(32, 16, 4, 1, tma=True)
)
FORCED_BWD = (
    {"bwd_kv": configs.LaunchConfig(64, 128, 8, 3, tma=True),
     "bwd_q": configs.LaunchConfig(128, 64, 8, 3, tma=True)}
    if HAS_CUDA
    else {"bwd_kv": configs.LaunchConfig(16, 32, 4, 1, tma=True),
          "bwd_q": configs.LaunchConfig(32, 16, 4, 1, tma=True)}
)  # fmt: skip
BWD_KERNELS = {"attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_kernel"}


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _servable(case) -> bool:  # type: ignore[no-untyped-def]
    """Whether the TMA kernel serves the case's forward (ops._tma_eligible)."""
    return (
        case.dtype in (torch.float16, torch.bfloat16) and case.mask == "none"
        and not case.dropout_p and _pow2(case.D) and _pow2(case.Dv) and max(case.D, case.Dv) <= 128
    )  # fmt: skip


_CASES = [
    pytest.param(case, launch, id=f"{case.id}-{launch}" if case.backward else case.id, marks=MARKS)
    for case in cases_for("triton_flash", DEVICE, size="large" if HAS_CUDA else "tiny")
    if _servable(case)
    for launch in (("split", "merged_heads") if case.backward else ("split",))
]


def _recording(launched: list[tuple[str, dict]]):  # type: ignore[no-untyped-def]
    """ops._launcher that also appends each launch's (kernel name, constexprs)."""
    launcher = ops._launcher

    def recording(kernel, like):  # type: ignore[no-untyped-def]
        launch = launcher(kernel, like)

        class Grid:
            def __getitem__(self, grid):  # type: ignore[no-untyped-def]
                def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                    launched.append((kernel.fn.__name__, kwargs))
                    return launch[grid](*args, **kwargs)

                return run

        return Grid()

    return recording


def test_some_cases_are_served() -> None:
    # Never pass by generating nothing: GQA, causal both ways, a window, softcap,
    # gradients and transposed layouts are among the kit's cases the kernel serves.
    ids = " ".join(p.id for p in _CASES)
    for feature in ("kv", "causal_br", "causal_tl", "window", "softcap", "bwd"):
        assert feature in ids, feature


@pytest.mark.parametrize(("case", "launch"), _CASES)
def test_tma_kernels_keep_the_contract(case, launch, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The forward's TMA kernel and the backward kernels' TMA streams, split and merged."""
    launched: list[tuple[str, dict]] = []
    monkeypatch.setattr(ops, "_launcher", _recording(launched))
    with tuning.override(fwd=FORCED, **FORCED_BWD, backward_launch=launch):
        problems = case_problems("triton_flash", case, DEVICE)
    assert not problems, f"{case.id}: " + "; ".join(problems)
    # Single-row calls go to the decode kernel (not through ops._launcher); every other
    # forward of a served case ran the TMA kernel and none ran the pointer kernel, and
    # every backward launch streamed through TMA.
    names = [name for name, _ in launched]
    if names:
        assert TMA in names and POINTER not in names, names
    backward = [(name, meta) for name, meta in launched if name in BWD_KERNELS]
    assert bool(backward) == case.backward
    assert all(meta["TMA"] for _, meta in backward), backward
    if backward:
        merged = [name for name, _ in backward] == ["attn_bwd_kernel"] * len(backward)
        assert merged == (launch == "merged_heads")


def _qkv(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(3)]


DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16


@pytest.mark.parametrize(
    "what",
    ["row stride not a multiple of 16 bytes", "head dim not a power of two", "bool mask",
     "float32"],
)  # fmt: skip
@pytest.mark.parametrize("marks", [pytest.param(None, marks=MARKS, id="")])
def test_calls_tma_cannot_take_run_the_pointer_kernel(what: str, marks, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    d = 24 if what == "head dim not a power of two" else 32
    q, k, v = _qkv((2, 2, 40, d), torch.float32 if what == "float32" else DTYPE)
    if what == "row stride not a multiple of 16 bytes":  # rows of 36 elements, 32 used
        q, k, v = (torch.nn.functional.pad(t, (0, 4))[..., :32] for t in (q, k, v))
    mask = torch.rand(2, 1, 40, 40, device=DEVICE) > 0.3 if what == "bool mask" else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    launched: list[tuple[str, dict]] = []
    monkeypatch.setattr(ops, "_launcher", _recording(launched))
    with tuning.override(fwd=FORCED, **FORCED_BWD):
        out = ops.flash_attention(q, k, v, mask, causal=True)[0]
        out.sum().backward()
    assert launched[0][0] == POINTER
    assert not any(meta.get("TMA") for _, meta in launched)
    params = AttentionParams(causal=True, scale=q.shape[-1] ** -0.5)
    expected, _ = contract_attention(q.double(), k.double(), v.double(), mask, params)
    assert (out.double() - expected).abs().max().item() < 2e-2


@gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_tma_plans_allocate_scratch_and_match_the_full_path(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A key's third call runs its cached plan (ops._PLANS), which launches the compiled
    kernel directly and so allocates the descriptors' global scratch itself
    (launch.CachedLaunch): the same outputs, bitwise, as the full path's first call."""
    q, k, v = _qkv((2, 8, 1000, 128), torch.bfloat16)
    ops.clear_plans()
    with tuning.override(fwd=FORCED):
        calls = [ops.flash_attention(q, k, v, causal=True, return_lse=True) for _ in range(3)]
        plans = [p for p in ops._PLANS.values() if isinstance(p, ops._ForwardPlan)]
    assert len(plans) == 1 and plans[0].launch._compiled.name == TMA
    for out, lse in calls[1:]:
        assert torch.equal(out, calls[0][0]) and torch.equal(lse, calls[0][1])


def test_the_table_takes_the_tma_row_only_where_the_call_allows_it() -> None:
    """The causal D=128 forward's TMA row (configs._LEAN_2B) goes to calls that
    ops._tma_eligible admits; every other call falls through to the pointer kernel's
    rows (a pointer kernel on the TMA row's four warps would spill)."""
    sm90 = (9, 0)
    for n in (1024, 4096):
        tma = configs.launch_config("fwd", 128, 2, True, sm90, False, n, lean=True, tma=True)
        assert tma == configs.LaunchConfig(128, 64, 4, 2, tma=True)
        pointer = configs.launch_config("fwd", 128, 2, True, sm90, False, n, lean=True)
        assert not pointer.tma and pointer == configs.launch_config(
            "fwd", 128, 2, True, sm90, False, n, lean=False
        )
    # Non-causal D=128 and D=64 have no TMA row.
    for d, causal in ((128, False), (64, False), (64, True)):
        key = ("fwd", d, 2, causal, sm90, False, 4096)
        assert configs.launch_config(*key, lean=True, tma=True) == configs.launch_config(
            *key, lean=True
        )
