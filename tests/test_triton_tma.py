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

# The forced forward: the interpreter's tiles there, the table's TMA row on the GPU.
FORCED = (
    configs.LaunchConfig(128, 64, 4, 2, tma=True)
    if HAS_CUDA
    else configs.LaunchConfig(32, 16, 4, 1, tma=True)
)


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _servable(case) -> bool:  # type: ignore[no-untyped-def]
    """Whether the TMA kernel serves the case's forward (ops._tma_eligible)."""
    return (
        case.dtype in (torch.float16, torch.bfloat16) and case.mask == "none"
        and not case.dropout_p and _pow2(case.D) and _pow2(case.Dv) and max(case.D, case.Dv) <= 128
    )  # fmt: skip


_CASES = [
    pytest.param(case, id=case.id, marks=MARKS)
    for case in cases_for("triton_flash", DEVICE, size="large" if HAS_CUDA else "tiny")
    if _servable(case)
]


def test_some_cases_are_served() -> None:
    # Never pass by generating nothing: GQA, causal both ways, a window, softcap,
    # gradients and transposed layouts are among the kit's cases the kernel serves.
    ids = " ".join(p.id for p in _CASES)
    for feature in ("kv", "causal_br", "causal_tl", "window", "softcap", "bwd"):
        assert feature in ids, feature


@pytest.mark.parametrize("case", _CASES)
def test_tma_forward_keeps_the_contract(case, launched_kernels: list[str]) -> None:  # type: ignore[no-untyped-def]
    launched = launched_kernels
    with tuning.override(fwd=FORCED):
        problems = case_problems("triton_flash", case, DEVICE)
    assert not problems, f"{case.id}: " + "; ".join(problems)
    # Single-row calls go to the decode kernel (not through ops._launcher); every other
    # forward of a served case ran the TMA kernel and none ran the pointer kernel.
    if launched:
        assert TMA in launched and POINTER not in launched, launched


def _qkv(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(3)]


DTYPE = torch.bfloat16 if HAS_CUDA else torch.float16


@pytest.mark.parametrize(
    "what",
    ["row stride not a multiple of 16 bytes", "keys expanded along the sequence",
     "head dim not a power of two", "bool mask", "float32"],
)  # fmt: skip
@pytest.mark.parametrize("marks", [pytest.param(None, marks=MARKS, id="")])
def test_calls_tma_cannot_take_run_the_pointer_kernel(what: str, marks, launched_kernels) -> None:  # type: ignore[no-untyped-def]
    d = 24 if what == "head dim not a power of two" else 32
    q, k, v = _qkv((2, 2, 40, d), torch.float32 if what == "float32" else DTYPE)
    if what == "row stride not a multiple of 16 bytes":  # rows of 36 elements, 32 used
        q, k, v = (torch.nn.functional.pad(t, (0, 4))[..., :32] for t in (q, k, v))
    if what == "keys expanded along the sequence":  # one key row, stride 0, 40 times
        k = k[:, :, :1].expand(-1, -1, 40, -1)
    mask = torch.rand(2, 1, 40, 40, device=DEVICE) > 0.3 if what == "bool mask" else None
    with tuning.override(fwd=FORCED):
        out = ops.flash_attention(q, k, v, mask, causal=True)[0]
    assert launched_kernels == [POINTER]
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
