"""contract.md's tolerance rule, and the exact rules for fully masked rows.

A result ``x`` (an output, a log-sum-exp or a gradient) passes against the float64
reference ``r64`` when

    max|x - r64| <= 2 * max|r_lp - r64| + 1e-5

where ``r_lp`` is the reference computed in the input's dtype by plain PyTorch
operations from the same inputs (``r64`` from those inputs upcast). The rule scales
with dtype, sequence length and head dim, so one rule serves every case (it is the
rule of FlashAttention's own tests).

Beyond the bound: NaN never passes; infinities must sit exactly where the reference
has them (an lse of -inf marks a fully masked row); and on a fully masked row the
output is exactly zero and so is the row's query gradient.

float32 on CUDA: PyTorch may compute float32 matmuls in TF32 unless
``torch.get_float32_matmul_precision()`` is ``"highest"``. The contract makes TF32 the
caller's choice, so the kit measures float32 conformance with IEEE products:
:func:`highest_float32_precision` sets ``"highest"`` around the backend's call and the
references, and restores the previous setting afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

RTOL_FACTOR = 2.0
ATOL = 1e-5


@contextlib.contextmanager
def highest_float32_precision() -> Iterator[None]:
    """IEEE float32 matmuls (no TF32) inside the block; the previous setting after it."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def tolerance_bound(r_lp: torch.Tensor, r64: torch.Tensor) -> float:
    """``2 * max|r_lp - r64| + 1e-5`` over the positions where ``r64`` is finite."""
    finite = torch.isfinite(r64)
    diff = r_lp.detach().double()[finite] - r64.detach().double()[finite]
    # A non-finite r_lp where r64 is finite (fp16 overflow) would make the bound
    # infinite and the check vacuous; such positions do not widen it.
    diff = diff[torch.isfinite(diff)]
    return RTOL_FACTOR * _max_abs(diff) + ATOL


def compare(name: str, x: torch.Tensor, r_lp: torch.Tensor, r64: torch.Tensor) -> str | None:
    """None when ``x`` passes against ``r64`` (see the module doc), else what differed."""
    if tuple(x.shape) != tuple(r64.shape):
        return f"{name}: shape {tuple(x.shape)}, expected {tuple(r64.shape)}"
    x64 = x.detach().double()
    ref = r64.detach().double()
    nan = torch.isnan(x64)
    if nan.any():
        where = tuple(int(i) for i in nan.nonzero()[0])
        return f"{name}: {int(nan.sum())} NaN values (first at index {where})"
    finite = torch.isfinite(ref)
    wrong_inf = (torch.isfinite(x64) != finite) | (~finite & (x64 != ref))
    if wrong_inf.any():
        where = tuple(int(i) for i in wrong_inf.nonzero()[0])
        return (
            f"{name}: {int(wrong_inf.sum())} values infinite where the reference is not, or "
            f"the reverse (first at index {where}: got {float(x64[where])}, "
            f"reference {float(ref[where])})"
        )
    diff = (x64 - ref)[finite].abs()
    error = float(diff.max()) if diff.numel() else 0.0
    bound = tolerance_bound(r_lp, r64)
    if error > bound:
        where = tuple(int(i) for i in ((x64 - ref).abs() * finite == error).nonzero()[0])
        return (
            f"{name}: max|x - r64| = {error:.3g} > bound {bound:.3g} "
            f"(2 * max|r_lp - r64| + 1e-5); worst at index {where}: got {float(x64[where]):.6g}, "
            f"reference {float(ref[where]):.6g}"
        )
    return None


def assert_matches_reference(
    x: torch.Tensor, r_lp: torch.Tensor, r64: torch.Tensor, name: str = "output"
) -> None:
    """Raise ``AssertionError`` unless ``x`` passes contract.md's tolerance rule."""
    problem = compare(name, x, r_lp, r64)
    if problem is not None:
        raise AssertionError(problem)


def fully_masked_problems(
    empty_rows: torch.Tensor, out: torch.Tensor, dq: torch.Tensor | None = None
) -> list[str]:
    """Exact rules on rows whose every key is masked (``empty_rows``: bool (B, Hq, Nq)).

    The output row is exactly zero and, when given, the query gradient row too. (The
    lse of -inf is checked by :func:`compare`, which requires infinities to match.)
    """
    problems: list[str] = []
    if not empty_rows.any():
        return problems
    for name, t in (("out", out), ("dq", dq)):
        if t is None:
            continue
        rows = t.detach()[empty_rows]
        bad = rows.isnan() | (rows != 0)
        if bad.any():
            where = tuple(int(i) for i in empty_rows.nonzero()[int(bad.any(dim=-1).nonzero()[0])])
            problems.append(
                f"{name}: fully masked rows must be exactly 0 (without NaN); "
                f"{int(bad.any(dim=-1).sum())} of {rows.shape[0]} are not (first at row {where})"
            )
    return problems
