"""triton_flash: forward and backward against the float64 reference, every contract feature.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1 is set here,
before the kernel module is imported) on small shapes in float32 and float16 (bfloat16
is broken in the interpreter). With CUDA the same cases run on the GPU, bfloat16 too.
The tolerance rule is contract.md's: max|x - r64| <= 2 * max|r_lp - r64| + 1e-5.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from attnhub.backends.torch_reference import reference_attention  # noqa: E402
from attnhub.backends.triton_flash import TritonFlash, ops  # noqa: E402
from attnhub.backends.triton_flash import configs as configs_module  # noqa: E402
from attnhub.request import AttentionParams  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Case:
    label: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dv: int | None = None
    causal: bool = False
    bottom_right: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    mask: str | None = None  # "bool_rows" (some rows fully masked), "float_bcast", "float_inf"
    layout: str = "bhnd"  # or "bnhd": (B, N, H, D) storage seen through a transpose
    scale: float | None = None  # None: 1 / sqrt(D)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def id(self) -> str:
        n = f"N{self.nq}" if self.nq == self.nk else f"N{self.nq}x{self.nk}"
        h = f"H{self.hq}" if self.hq == self.hkv else f"H{self.hq}g{self.hkv}"
        dv = f"v{self.dv}" if self.dv and self.dv != self.d else ""
        return f"{self.label}-B{self.b}{h}{n}D{self.d}{dv}"

    @property
    def softmax_scale(self) -> float:
        return self.d**-0.5 if self.scale is None else self.scale

    def params(self) -> AttentionParams:
        return AttentionParams(
            causal=self.causal,
            alignment="bottom_right" if self.bottom_right else "top_left",
            window=self.window,
            softcap=self.softcap,
            scale=self.softmax_scale,
        )


CASES = [
    Case("plain", 2, 4, 4, 77, 77, 40),
    Case("plain", 1, 2, 2, 33, 70, 16),
    Case("plain", 1, 2, 2, 70, 33, 64),
    Case("plain", 1, 2, 2, 1, 1, 16),
    # Lengths that are multiples of every interpreter tile (32 and 16): the kernels are
    # compiled without the masked segments that cannot be non-empty (ops._edge_segments).
    Case("even", 1, 2, 2, 64, 96, 32),
    Case("even_causal", 1, 2, 2, 96, 64, 32, causal=True, bottom_right=True),
    Case("even_window", 1, 4, 2, 64, 64, 16, window=(20, None)),
    Case("even_window_right", 1, 2, 2, 64, 96, 16, window=(None, 7)),
    Case("causal_tl", 2, 2, 2, 77, 77, 40, causal=True),
    Case("causal_tl", 1, 2, 2, 40, 90, 64, causal=True),
    Case("causal_tl", 1, 2, 2, 90, 40, 32, causal=True),
    Case("causal_br", 1, 2, 2, 45, 77, 40, causal=True, bottom_right=True),
    Case("causal_br", 1, 2, 2, 70, 33, 16, causal=True, bottom_right=True),  # rows with no key
    Case("causal_br", 1, 2, 2, 1, 50, 64, causal=True, bottom_right=True),  # decoding
    Case("window", 1, 2, 2, 96, 96, 96, window=(8, 4)),
    Case("window", 1, 2, 2, 50, 80, 32, window=(10, None), bottom_right=True),
    Case("window", 1, 2, 2, 80, 50, 32, window=(None, 3)),
    Case("causal_window", 1, 2, 2, 60, 90, 40, causal=True, bottom_right=True, window=(17, 5)),
    Case("softcap", 1, 2, 2, 65, 65, 32, softcap=2.0),
    Case("softcap_causal", 1, 2, 2, 48, 48, 64, causal=True, softcap=5.0),
    Case("bool_mask", 2, 2, 2, 40, 52, 32, mask="bool_rows"),
    Case("float_mask", 2, 2, 2, 37, 45, 40, mask="float_bcast"),
    Case("float_mask_inf", 1, 2, 2, 33, 40, 16, mask="float_inf"),
    Case("gqa", 2, 4, 2, 50, 50, 32, causal=True),
    Case("mqa", 1, 4, 1, 45, 61, 40, causal=True, bottom_right=True),
    Case("dv", 1, 2, 2, 40, 40, 32, dv=16),
    Case("strided", 2, 3, 3, 41, 41, 40, layout="bnhd"),
    # Scales where the forward may not fold the scale into the exponent (ops._setup):
    # negative (max and scale do not commute), zero and below float32's normal range
    # (-inf * 0 would be NaN in masked tiles); masked tiles and empty rows included.
    Case("scale_neg", 1, 2, 2, 70, 33, 32, causal=True, bottom_right=True, scale=-0.4),
    Case("scale_zero", 2, 2, 2, 40, 52, 32, mask="bool_rows", scale=0.0),
    Case("scale_tiny", 1, 2, 2, 45, 45, 16, causal=True, scale=1e-39),
    Case(
        "all",
        2,
        4,
        2,
        53,
        71,
        40,
        causal=True,
        bottom_right=True,
        window=(20, None),
        softcap=3.0,
        mask="float_bcast",
    ),
]


def _make(shape, dtype, layout="bhnd", generator=None):  # type: ignore[no-untyped-def]
    if layout == "bnhd":  # (B, N, H, D) storage seen as (B, H, N, D)
        b, h, n, d = shape
        return torch.randn(b, n, h, d, dtype=dtype, device=DEVICE).transpose(1, 2)
    return torch.randn(shape, dtype=dtype, device=DEVICE)


def _mask(case: Case, dtype: torch.dtype) -> torch.Tensor | None:
    if case.mask is None:
        return None
    shape = (case.b, 1, case.nq, case.nk)
    if case.mask == "bool_rows":
        mask = torch.rand(shape, device=DEVICE) > 0.3
        mask[:, :, ::7] = False  # fully masked rows
        return mask
    if case.mask == "float_bcast":  # (Nq, Nk): broadcast over batch and heads
        return torch.randn(case.nq, case.nk, device=DEVICE, dtype=dtype)
    mask = torch.randn(shape, device=DEVICE, dtype=dtype)
    mask[:, :, ::5] = float("-inf")  # fully masked rows via the float mask
    mask[..., ::3] = float("-inf")
    return mask


def _inputs(case: Case, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    q = _make((case.b, case.hq, case.nq, case.d), dtype, case.layout)
    k = _make((case.b, case.hkv, case.nk, case.d), dtype, case.layout)
    v = _make((case.b, case.hkv, case.nk, case.dv or case.d), dtype, case.layout)
    return q, k, v, _mask(case, dtype)


def _recording(launcher, calls: list):  # type: ignore[no-untyped-def]
    """``launcher`` (ops._launcher) that also appends (kernel name, constexprs) per launch."""

    def recording(kernel, like):  # type: ignore[no-untyped-def]
        launch = launcher(kernel, like)

        class Grid:
            def __getitem__(self, grid):  # type: ignore[no-untyped-def]
                def run(*args, **kwargs):  # type: ignore[no-untyped-def]
                    calls.append((kernel.fn.__name__, kwargs))
                    return launch[grid](*args, **kwargs)

                return run

        return Grid()

    return recording


def _run_flash(case: Case, q, k, v, mask, dout, dropout_p=0.0):  # type: ignore[no-untyped-def]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ops.flash_attention(
        q, k, v, mask, causal=case.causal, bottom_right=case.bottom_right, window=case.window,
        softcap=case.softcap, scale=case.softmax_scale, dropout_p=dropout_p,
    )  # fmt: skip
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _run_reference(case: Case, q, k, v, mask, dout, dtype):  # type: ignore[no-untyped-def]
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = reference_attention(q, k, v, mask, case.params())
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _check(name: str, x: torch.Tensor, r_lp: torch.Tensor, r64: torch.Tensor) -> None:
    assert not torch.isnan(x).any(), f"{name}: NaN"
    finite = torch.isfinite(r64)
    assert torch.equal(torch.isfinite(x), finite), f"{name}: infinities differ from the reference"
    assert torch.equal(x[~finite], r64.to(x.dtype)[~finite]), f"{name}: wrong infinities"
    err = (x.double() - r64)[finite].abs().max().item() if finite.any() else 0.0
    diff = (r_lp.double() - r64)[finite]
    diff = diff[torch.isfinite(diff)]
    bound = 2 * (diff.abs().max().item() if diff.numel() else 0.0) + 1e-5
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"


def _check_all(case: Case, dtype: torch.dtype, got, q, k, v, mask, dout) -> None:  # type: ignore[no-untyped-def]
    ref64 = _run_reference(case, q, k, v, mask, dout, torch.float64)
    ref_lp = _run_reference(case, q, k, v, mask, dout, dtype)
    for name, x, r_lp, r64 in zip(("out", "lse", "dq", "dk", "dv"), got, ref_lp, ref64):
        _check(name, x, r_lp, r64)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_backward_matches_reference(case: Case, dtype: torch.dtype) -> None:
    torch.manual_seed(hash(case.id) % 1000)
    q, k, v, mask = _inputs(case, dtype)
    dout = torch.randn(case.b, case.hq, case.nq, case.dv or case.d, dtype=dtype, device=DEVICE)
    got = _run_flash(case, q, k, v, mask, dout)
    _check_all(case, dtype, got, q, k, v, mask, dout)
    if case.mask in ("bool_rows", "float_inf"):
        # Fully masked rows: exact zeros, lse -inf, zero query gradient.
        out, lse, dq = got[0], got[1], got[2]
        empty = torch.isinf(lse)
        assert empty.any()
        assert (out[empty] == 0).all() and (dq[empty] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=SHORT.get)
def test_nan_canary(dtype: torch.dtype) -> None:
    """Inputs, mask and dout as views into NaN-filled buffers: nothing outside leaks in."""
    case = Case("canary", 2, 2, 2, 37, 45, 40, causal=True, bottom_right=True, mask="float_bcast")
    torch.manual_seed(1)

    def view(shape):  # type: ignore[no-untyped-def]
        b, h, n, d = shape
        buf = torch.full((b, h + 1, n + 19, d + 24), float("nan"), dtype=dtype, device=DEVICE)
        t = buf[:, 1:, 7 : 7 + n, 3 : 3 + d]
        t.copy_(torch.randn(shape, dtype=dtype, device=DEVICE))
        return t

    q, k, v = view((2, 2, 37, 40)), view((2, 2, 45, 40)), view((2, 2, 45, 40))
    mbuf = torch.full((40, 60), float("nan"), dtype=dtype, device=DEVICE)
    mask = mbuf[2:39, 5:50]
    mask.copy_(torch.randn(37, 45, dtype=dtype, device=DEVICE))
    dout = view((2, 2, 37, 40))
    got = _run_flash(case, q, k, v, mask, dout)
    for x in got:
        assert not torch.isnan(x).any()
    _check_all(case, dtype, got, q, k, v, mask, dout)


def test_a_float_mask_beyond_the_log2_range_is_added_as_it_is() -> None:
    """finfo.min entries (float32's; bfloat16's is as low) overflowed to -inf in log2
    units, so a row whose every key carried one gave zeros, where the contract's softmax
    of equal scores gives the mean of the values (as torch_reference); one beyond
    +2.36e38 overflowed to +inf and made its row NaN. Then they were clamped, and such
    a row's lse read the clamp (-2.36e38). Now a float mask's scores are in natural
    units: outputs, lse and gradients as the reference's (a row whose keys tie at
    finfo.min weighs each 1/N in the backward too: its row stats keep log2(N) beside
    the max)."""
    import attnhub

    torch.manual_seed(0)
    q = torch.randn(2, 2, 5, 16, device=DEVICE)
    k, v = torch.randn(2, 2, 7, 16, device=DEVICE), torch.randn(2, 2, 7, 16, device=DEVICE)
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 1, 5, 7, device=DEVICE)
    mask[..., 0, :] = low  # every key: the mean of the values
    mask[..., 1, ::2] = -3e38  # half the keys: weight 0
    mask[..., 2, 3:] = low
    mask[..., 4, :] = float("-inf")  # fully masked: zeros
    mask[..., 3, 5] = 3e38  # one key far above the rest: its value (it was NaN)
    mask[..., 3, 6] = 3e38  # two keys tied at the upper clamp: half each
    dout = torch.randn(2, 2, 5, 16, device=DEVICE)
    results = []
    for backend in ("torch_reference", "triton_flash"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = attnhub.attention(*inputs, mask, backend=backend, return_lse=True)
        out.backward(dout)
        results.append((out, lse, *(t.grad for t in inputs)))
    (ref_out, ref_lse, *ref_grads), (out, lse, *grads) = results
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(out[..., 0, :], v.mean(2).expand_as(out[..., 0, :]))
    torch.testing.assert_close(out[..., 3, :], v[:, :, 5:].mean(2).expand_as(out[..., 3, :]))
    torch.testing.assert_close(lse, ref_lse)
    assert float(lse[..., 0].max()) < -3.4e38  # finfo.min + ln(7): not a clamp's -2.36e38
    for got, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_a_scale_beyond_the_log2_range_is_declined() -> None:
    """scale * log2(e) overflowed float32 for |scale| in (2.36e38, 3.4e38], which the
    contract admits: every output was NaN even where each score is a plain float32."""
    import attnhub

    q, k, v = (torch.randn(1, 2, 6, 16, device=DEVICE) * 0.05 for _ in range(3))
    for scale in (3e38, -3e38):
        decision = attnhub.explain(q, k, v, scale=scale)
        assert decision.reasons()["triton_flash"] == [
            "|scale| above 2.36e38: the kernels' scores in log2 units (scale * log2 e) "
            "overflow float32 there, whatever q.k is"
        ]
        reference = attnhub.attention(q.double(), k.double(), v.double(), scale=scale,
                                      backend="torch_reference")  # fmt: skip
        torch.testing.assert_close(attnhub.attention(q, k, v, scale=scale).double(), reference)
    assert attnhub.explain(q, k, v, scale=2e38).reasons()["triton_flash"] == []
    # validation writes the limit out (for Dynamo): the same number as the request's.
    from pathlib import Path

    from attnhub import request, validation

    written = repr(request.LOG2_SCALE_LIMIT).replace("e+", "e")
    assert f"-{written} <= params.scale <= {written}" in Path(validation.__file__).read_text()


def test_forward_and_backward_bitwise_repeatable() -> None:
    case = Case("repeat", 1, 4, 2, 70, 70, 40, causal=True, softcap=4.0)
    torch.manual_seed(2)
    q, k, v, mask = _inputs(case, torch.float16)
    dout = torch.randn_like(q)
    first = _run_flash(case, q, k, v, mask, dout)
    second = _run_flash(case, q, k, v, mask, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# Feature combinations for the merged backward: causal GQA, MQA with Nq < Nk bottom-right
# (ragged tiles on both axes), Nq > Nk, and everything at once; and CASES' even lengths,
# where the roles' edge-segment flags (KV_MASK_*, Q_MASK_*) turn segments off. causal_gqa
# has B = 2: a merged grid that leaves out the batch (B * HKV dK/dV, B * H dQ programs)
# fails there. "all" is CASES' "all" at B = 1: half the interpreted work of the slowest
# case here, with the same roles, tiles and edge-segment flags per program.
MERGED_CASES = [
    Case("causal_gqa", 2, 4, 2, 50, 50, 32, causal=True),
    Case("mqa_ragged_br", 1, 4, 1, 45, 61, 40, causal=True, bottom_right=True),
    Case("ragged", 1, 2, 2, 70, 33, 16),
    Case("all", 1, 4, 2, 53, 71, 40, causal=True, bottom_right=True, window=(20, None),
         softcap=3.0, mask="float_bcast"),
] + [case for case in CASES if case.label.startswith("even")]  # fmt: skip


@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("case", MERGED_CASES, ids=lambda c: c.id)
def test_merged_backward_bitwise_equals_split(
    case: Case, dropout_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch (attn_bwd_kernel, in either program order) and two launches give bitwise
    the same outputs and gradients, dropout included (same seed): the same programs
    compute the same sums in the same order, whichever launch runs them. The merged
    launch gets each role's edge-segment flags as the split kernels get theirs."""
    from attnhub.backends.triton_flash import configs, tuning

    torch.manual_seed(hash(case.id) % 1000)
    q, k, v, mask = _inputs(case, torch.float16)
    dout = torch.randn(case.b, case.hq, case.nq, case.dv or case.d, dtype=torch.float16,
                       device=DEVICE)  # fmt: skip
    launcher = ops._launcher
    results, launched = {}, {}
    for mode in configs.BWD_MODES:
        calls: list[tuple[str, dict]] = []
        monkeypatch.setattr(ops, "_launcher", _recording(launcher, calls))
        torch.manual_seed(5)  # the dropout seed
        with tuning.override(backward_launch=mode):
            results[mode] = _run_flash(case, q, k, v, mask, dout, dropout_p=dropout_p)
        launched[mode] = calls
    # These cases' configurations (the interpreter's; D <= 64 on a GPU) allow the merged
    # launch: check that it did run, not the split fallback, with the split kernels' flags.
    split = launched["split"]
    assert [name for name, _ in split[-2:]] == ["attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
    flags = {f"{role}{name}": split[i][1][name] for i, role in ((-2, "KV_"), (-1, "Q_"))
             for name in ("MASK_HEAD", "MASK_TAIL")}  # fmt: skip
    if case.label.startswith("even") and not case.causal and case.window is None:
        # No band: only a ragged last tile is masked, as the tiles (the interpreter's,
        # or the GPU's, which need not divide these lengths) make it.
        kv, dq = split[-2][1], split[-1][1]
        assert flags == {
            "KV_MASK_HEAD": False,
            "KV_MASK_TAIL": bool(case.nq % kv["BLOCK_M"] or case.nk % kv["BLOCK_N"]),
            "Q_MASK_HEAD": False,
            "Q_MASK_TAIL": bool(case.nk % dq["BLOCK_N"]),
        }
    for mode in ("merged", "merged_heads"):
        assert [name for name, _ in launched[mode][-2:]] == [
            "attn_bwd_preprocess_kernel", "attn_bwd_kernel",
        ]  # fmt: skip
        merged = launched[mode][-1][1]
        assert {name: merged[name] for name in flags} == flags
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["split"], results[mode]):
            assert torch.equal(a, b), f"{mode}: {name} differs from split"


def test_backward_launch_mode() -> None:
    """The table (or tuning.override(backward_launch=...) over it) picks the launch where
    the two roles' configurations (the split path's own, lean or not) share their launch
    options (warps, stages, register cap), and split elsewhere."""
    from attnhub.backends.triton_flash import configs, tuning

    sm90 = (9, 0)

    def pair(d: int, esize: int, causal: bool, n: int = 4096, lean: bool = True):  # type: ignore[no-untyped-def]
        return configs.backward_configs(d, esize, causal, sm90, False, n, lean)

    def table(d: int, esize: int, causal: bool, n: int = 4096, lean: bool = True) -> str:
        return configs.backward_launch(*pair(d, esize, causal, n, lean), d, esize, lean)

    assert tuning.current() is None
    # Outside every override, the table: one launch for lean 2-byte D=128 calls only.
    for causal, n in ((False, 1024), (True, 1024), (False, 16384), (True, 4096)):
        assert table(128, 2, causal, n) == "merged_heads"
    assert table(128, 2, True, lean=False) == configs.BWD_DEFAULT  # a mask tile: unmeasured
    assert table(128, 4, True) == configs.BWD_DEFAULT
    assert table(64, 2, True) == table(64, 2, False) == configs.BWD_DEFAULT
    assert configs.backward_launch(*pair(128, 2, True)) == configs.BWD_DEFAULT
    with tuning.override(backward_launch="split"):
        assert table(128, 2, True) == "split"  # the override wins over the table
    for mode in configs.BWD_MODES:
        with tuning.override(backward_launch=mode):
            # Equal warps and stages (2-byte D <= 128, lean or not, short or not; fp32 rows).
            for d, esize, causal, n, lean in ((64, 2, False, 4096, True), (128, 2, True, 1024, True),
                                              (128, 2, False, 1024, True), (128, 2, False, 4096, False),
                                              (256, 4, True, 4096, True)):  # fmt: skip
                assert configs.backward_launch(*pair(d, esize, causal, n, lean)) == mode
            # 2-byte D=256: 4 vs 8 warps, one launch cannot have both: split.
            assert configs.backward_launch(*pair(256, 2, False)) == "split"
            kv, q = configs.LaunchConfig(32, 64, 4, 3), configs.LaunchConfig(64, 32, 4, 2)
            assert configs.backward_launch(kv, q) == "split"  # stages differ
            capped = configs.LaunchConfig(64, 32, 4, 3, maxnreg=128)
            assert configs.backward_launch(kv, capped) == "split"  # one role's register cap
            assert configs.backward_launch(capped, capped) == mode
            assert configs.merged_meta(capped, capped, mode)["maxnreg"] == 128
    # The lean D=128 tiles reach the merged kernel as its two roles' tiles.
    merged = configs.merged_meta(*pair(128, 2, False), "merged_heads")
    assert merged == {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                      "HEAD_MAJOR": True, "num_warps": 8, "num_stages": 3}  # fmt: skip


@pytest.mark.parametrize("where", ["another thread", "after the block"])
def test_a_backward_runs_under_the_tuning_of_its_forward(monkeypatch, where: str) -> None:
    """Autograd runs a CUDA backward on its own device thread, which sees none of the
    forward thread's context variables, and a backward may run after the block: the
    override the forward ran under holds for its backward either way (before, the
    backward launched the table's tiles, and a sweep of backward tiles timed none)."""
    import threading

    from attnhub.backends.triton_flash import tuning

    launched: list[tuple[str, dict]] = []
    monkeypatch.setattr(ops, "_launcher", _recording(ops._launcher, launched))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    forced = (16, 16, 4, 1)  # not the interpreter's table (16, 32, 4, 1)
    with tuning.override(bwd_kv=forced, backward_launch="split"):
        out, _ = ops.flash_attention(q, k, v, causal=True)
    grads: list = []

    def backward() -> None:
        grads.extend(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    if where == "another thread":
        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
    else:
        backward()
    (dkdv,) = [kw for name, kw in launched if name == "attn_bwd_dkdv_kernel"]
    assert (dkdv["BLOCK_M"], dkdv["BLOCK_N"]) == forced[:2]
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(
        reference_attention(*ref, None, AttentionParams(causal=True, scale=0.25))[0],
        ref,
        torch.ones_like(out).double(),
    )
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_tuning_override_is_scoped_validated_and_nests() -> None:
    """tuning.override: bad values raise before the block; inner blocks change only the
    fields they name; the enclosing value comes back after a block, also when it
    raises; another thread does not see it (a context variable, not os.environ)."""
    import threading

    from attnhub.backends.triton_flash import configs, tuning

    sm90 = (9, 0)
    table_fwd = configs.launch_config("fwd", 64, 2, False, sm90, False, 4096)
    bad: list[tuple[type[Exception], str, dict]] = [
        (ValueError, "backward_launch='fused'", {"backward_launch": "fused"}),
        (TypeError, "fwd=", {"fwd": (128, 64)}),
        (TypeError, "packed_row_strides", {"packed_row_strides": 0}),
        (TypeError, "heavy_first", {"heavy_first": 1}),
    ]
    for error, match, kwargs in bad:
        entered = False
        with pytest.raises(error, match=match), tuning.override(**kwargs):
            entered = True
        assert not entered and tuning.current() is None
    seen_in_thread: list[object] = []
    with tuning.override(fwd=(64, 32, 4, 2), backward_launch="merged") as outer:
        assert configs.launch_config("fwd", 64, 2, False, sm90, False, 4096) == (
            configs.LaunchConfig(64, 32, 4, 2)
        )
        # A forced direction holds in the interpreter too; others keep the table.
        assert configs.launch_config("fwd", 64, 2, False, None, True) == outer.config("fwd")
        assert configs.launch_config("bwd_q", 64, 2, False, None, True) == configs.INTERPRETER_BWD_Q
        thread = threading.Thread(target=lambda: seen_in_thread.append(tuning.current()))
        thread.start()
        thread.join()
        with pytest.raises(RuntimeError), tuning.override(bwd_q=configs.LaunchConfig(16, 16, 4, 1)):
            inner = tuning.current()
            assert inner is not None and inner.backward_launch == "merged"
            assert inner.config("fwd") == configs.LaunchConfig(64, 32, 4, 2)
            assert inner.config("bwd_q") == configs.LaunchConfig(16, 16, 4, 1)
            raise RuntimeError
        assert tuning.current() == outer
    assert seen_in_thread == [None]
    assert tuning.current() is None
    assert configs.launch_config("fwd", 64, 2, False, sm90, False, 4096) == table_fwd


def _dropout_case() -> Case:
    return Case("dropout", 1, 2, 2, 32, 40, 32, causal=True, bottom_right=True)


def _dropout_keep(case: Case, seed: int, p: float) -> torch.Tensor:
    """The dropout keep pattern: with V = I the output row is P * Z / (1 - p) itself."""
    q = _make((case.b, case.hq, case.nq, case.d), torch.float32)
    k = _make((case.b, case.hkv, case.nk, case.d), torch.float32)
    eye = torch.eye(case.nk, device=DEVICE).expand(case.b, case.hkv, case.nk, case.nk)
    torch.manual_seed(seed)
    out, _ = ops.flash_attention(q, k, eye, causal=case.causal, bottom_right=case.bottom_right,
                                 scale=case.d**-0.5, dropout_p=p)  # fmt: skip
    return out != 0


def test_dropout_zero_is_exact() -> None:
    case = replace(_dropout_case(), label="dropout0")
    torch.manual_seed(3)
    q, k, v, mask = _inputs(case, torch.float32)
    dout = torch.randn_like(q)
    got = _run_flash(case, q, k, v, mask, dout, dropout_p=0.0)
    _check_all(case, torch.float32, got, q, k, v, mask, dout)


def test_dropout_matches_reference_with_its_own_mask() -> None:
    """Forward and backward with dropout equal float64 attention under the same keep mask."""
    case, p = _dropout_case(), 0.25
    torch.manual_seed(4)
    keep = _dropout_keep(case, seed=123, p=p)
    q, k, v, _ = _inputs(case, torch.float32)
    dout = torch.randn_like(q)
    torch.manual_seed(123)
    out, lse, dq, dk, dv = _run_flash(case, q, k, v, None, dout, dropout_p=p)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.transpose(-1, -2)) * case.d**-0.5
    allowed = torch.ones(case.nq, case.nk, dtype=torch.bool, device=DEVICE).tril(case.nk - case.nq)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = (probs * keep / (1 - p)) @ v64
    ref.backward(dout.double())
    for x, r in ((out, ref), (dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        assert (x.double() - r).abs().max().item() < 1e-4
    assert torch.allclose(
        lse.double(), torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1), atol=1e-5
    )


def test_dropout_seeded_reproducible_and_fraction() -> None:
    case, p = _dropout_case(), 0.3
    q, k, v, _ = _inputs(case, torch.float16)
    dout = torch.randn_like(q)
    torch.manual_seed(7)
    a = _run_flash(case, q, k, v, None, dout, dropout_p=p)
    torch.manual_seed(7)
    b = _run_flash(case, q, k, v, None, dout, dropout_p=p)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    c = _run_flash(case, q, k, v, None, dout, dropout_p=p)  # the generator moved on
    assert not torch.equal(a[0], c[0])

    big = Case("dropout", 2, 2, 2, 64, 64, 64)
    keep = _dropout_keep(big, seed=11, p=p)
    fraction = keep.float().mean().item()  # 16384 draws: std ~ 0.0036
    assert abs(fraction - (1 - p)) < 0.02, fraction


def test_fp32_follows_matmul_precision() -> None:
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert ops._input_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert ops._input_precision(torch.float32) == "tf32"
        assert ops._input_precision(torch.float16) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_opcheck_forward_and_backward() -> None:
    torch.manual_seed(5)
    q = torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 24, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 1, 24, 16, device=DEVICE, requires_grad=True)
    mask = torch.randn(20, 24, device=DEVICE)
    args = (q, k, v, mask, None, True, True, 5, ops.NO_WINDOW, 3.0, 0.25, 0.0)
    torch.library.opcheck(torch.ops.attnhub.triton_flash_fwd.default, args)
    out, lse, stats = torch.ops.attnhub.triton_flash_fwd(*args)
    # A float mask's call: the backward reads the row stats in the lse's place.
    assert stats.shape == lse.shape and stats.dtype == torch.int64
    torch.testing.assert_close(ops.lse_of_row_stats(stats), lse, rtol=0, atol=0)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), mask, None,
             out.detach(), stats, None, *args[5:])  # fmt: skip
    torch.library.opcheck(torch.ops.attnhub.triton_flash_bwd.default, bargs)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "hidden_rows"])
def test_eager_calls_skip_the_op_and_traced_calls_see_it(masked: bool) -> None:
    """Plain eager calls run the implementations directly (DirectAttention); a dispatch
    mode (as used by tracers, profilers and FLOP counters) sees the registered ops, and
    both give the same outputs and gradients: with a float mask whose rows -1e9 hides
    too, whose backward reads the row stats (the op carries them as a third output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE) for _ in range(3))
    mask = None
    if masked:
        mask = torch.randn(20, 20, device=DEVICE)
        mask[:4] = -1e9
    assert ops.direct(q, k, v, mask)
    grads = []
    seen = Seen()
    for mode in (None, seen):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        if mode is None:
            out, lse = ops.flash_attention(qs, ks, vs, mask, causal=True)
            out.backward(torch.ones_like(out) + torch.arange(16, device=DEVICE))
        else:
            with mode:
                assert not ops.direct(q, k, v, mask)
                out, lse = ops.flash_attention(qs, ks, vs, mask, causal=True)
                out.backward(torch.ones_like(out) + torch.arange(16, device=DEVICE))
        grads.append((out.detach(), lse.detach(), qs.grad, ks.grad, vs.grad))
    assert "attnhub.triton_flash_fwd" in seen.ops and "attnhub.triton_flash_bwd" in seen.ops
    for direct, through_op in zip(*grads):
        assert torch.equal(direct, through_op)
    if masked:
        # A hidden row weighs its keys 1 / (keys it sees) in the backward too, as
        # PyTorch's float32 math kernel (reference_attention computes in float64, where
        # -1e9 + q.k keeps q.k: another softmax).
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        causal = torch.ones(20, 20, dtype=torch.bool, device=DEVICE).tril()
        r = torch._scaled_dot_product_attention_math(
            qr, kr, vr, mask.masked_fill(~causal, float("-inf"))
        )[0]
        r.backward(torch.ones_like(r) + torch.arange(16, device=DEVICE))
        for got, ref in zip(grads[0][2:], (qr.grad, kr.grad, vr.grad)):
            assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "float_mask"])
@pytest.mark.parametrize("with_out", [True, False], ids=["out_and_lse", "lse_only"])
def test_lse_gradient(with_out: bool, masked: bool) -> None:
    """A loss on the returned lse differentiates through it (d lse / d s = P), with or
    without one on the output (then no output gradient reaches the backward at all);
    with a float mask too (whose call keeps row stats, from which the lse is derived)."""
    case = Case("lse_grad", 1, 2, 2, 30, 40, 16, causal=True, bottom_right=True)
    torch.manual_seed(6)
    q, k, v, _ = _inputs(case, torch.float32)
    mask = torch.randn(30, 40, device=DEVICE) if masked else None
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ops.flash_attention(qs, ks, vs, mask, causal=True, bottom_right=True, scale=0.25)
    (lse.sum() + (out.sum() if with_out else 0.0)).backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    params = AttentionParams(causal=True, alignment="bottom_right", scale=0.25)
    r, rl = reference_attention(q64, k64, v64, None if mask is None else mask.double(), params)
    (rl.double().sum() + (r.sum() if with_out else 0.0)).backward()
    for x, ref in ((qs.grad, q64.grad), (ks.grad, k64.grad), (vs.grad, v64.grad)):
        if ref is None:  # lse does not depend on v: the reference leaves no gradient
            ref = torch.zeros_like(x, dtype=torch.float64)
        assert (x.double() - ref).abs().max().item() < 1e-4


def test_launch_config_lean_entries() -> None:
    """Calls without a mask tile (``lean``) take the larger tiles measured for them, short
    and long; everything else, block-sparse included, keeps the general table; a lean key
    that is not listed falls through to it (short entries included). Narrow calls (a
    short sliding window) take the narrow entries first."""
    from attnhub.backends.triton_flash import configs

    sm90 = (9, 0)

    def cfg(direction, d, causal, n, lean, esize=2):  # type: ignore[no-untyped-def]
        return configs.launch_config(direction, d, esize, causal, sm90, False, n, lean)

    big = configs.LaunchConfig(128, 128, 8, 3)
    two_per_sm = configs.LaunchConfig(128, 64, 8, 2, maxnreg=128)
    assert two_per_sm.meta()["maxnreg"] == 128 and "maxnreg" not in big.meta()
    assert cfg("fwd", 128, False, 4096, True) == big
    assert cfg("fwd", 128, False, 1025, True) == big
    assert cfg("fwd", 128, False, 1024, True) == two_per_sm
    assert cfg("fwd", 128, False, 4096, False) == configs.LaunchConfig(128, 64, 8, 3)
    assert cfg("fwd", 128, False, 4096, True, esize=4) == cfg("fwd", 128, False, 4096, False, 4)
    three_stage = [configs.LaunchConfig(64, 128, 8, 3), configs.LaunchConfig(128, 64, 8, 3)]
    for causal in (False, True):
        assert [cfg(d, 128, causal, 16384, True) for d in ("bwd_kv", "bwd_q")] == three_stage
    assert [cfg(d, 128, False, 1024, True) for d in ("bwd_kv", "bwd_q")] == three_stage
    # Causal D=128 at N <= 1024 and causal D=64 forward at N <= 1024 are not lean keys.
    assert cfg("bwd_kv", 128, True, 1024, True) == cfg("bwd_kv", 128, True, 1024, False)
    assert cfg("fwd", 64, True, 1024, True) == configs.LaunchConfig(64, 64, 4, 3)
    # Narrow calls (at most NARROW_N keys per row: a short window), mask or not.
    narrow = configs.LaunchConfig(64, 64, 4, 3)
    assert cfg("fwd", 128, True, 256, True) == cfg("fwd", 128, True, 256, False) == narrow
    assert cfg("fwd", 128, True, 257, True) == configs.LaunchConfig(128, 64, 8, 3)
    assert cfg("fwd", 128, False, 256, True) == two_per_sm  # non-causal: no narrow row
    assert cfg("fwd", 128, True, 256, True, esize=4) != narrow


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, requires_cuda])])
def test_a_float_mask_call_without_lse_derives_none(
    device: str, check_lse_derived_only_when_returned: Any
) -> None:
    """A float mask's call keeps row stats for its backward; its lse is derived from
    them (two elementwise launches) only where the call returns it. Without return_lse:
    no derivation, and the output and gradients of the call with it. On CUDA the third
    call of each runs the cached launch plan (ops._PLANS; the CPU has none)."""
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    mask = torch.randn(2, 1, 9, 12, device=device, dtype=dtype)
    mask[1, :, 3] = torch.finfo(dtype).min  # a hidden row
    inputs = [torch.randn(2, 2, n, 16, device=device, dtype=dtype) for n in (9, 12, 12)]
    dout = torch.randn(2, 2, 9, 16, device=device, dtype=dtype)
    check_lse_derived_only_when_returned(
        lambda leaves, return_lse: ops.flash_attention(*leaves, mask, return_lse=return_lse),
        inputs, dout, 3 if device == "cuda" else 1,
    )  # fmt: skip


@pytest.mark.parametrize(("mask", "bool_mask"), [(None, False), ("bool", True), ("float", False)])
def test_a_bool_mask_forward_takes_the_bool_mask_row(mask, bool_mask, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The forward tells launch_config whether its dense mask is bool (and only the
    forward: the backward keeps its rows); the D=64 and D=128 2-byte forwards of such a
    call take the bool-mask rows (after the narrow entries), and nothing else does."""
    from attnhub.backends.triton_flash import configs

    seen: list[tuple[str, bool]] = []
    launch_config = ops.launch_config

    def spy(direction, *key, **kw):  # type: ignore[no-untyped-def]
        seen.append((direction, kw.get("bool_mask", False)))
        return launch_config(direction, *key, **kw)

    monkeypatch.setattr(ops, "launch_config", spy)
    monkeypatch.setattr(configs, "launch_config", spy)
    ops.clear_plans()
    masks = {None: None, "bool": torch.rand(8, 8) < 0.8, "float": torch.randn(8, 8)}
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    out, _ = ops.flash_attention(q, q, q, masks[mask])
    out.sum().backward()
    assert seen == [("fwd", bool_mask), ("bwd_kv", False), ("bwd_q", False)]

    sm90 = (9, 0)

    def cfg(d, causal=False, n=4096, esize=2, direction="fwd", flag=True):  # type: ignore[no-untyped-def]
        return configs.launch_config(direction, d, esize, causal, sm90, False, n, bool_mask=flag)

    row = configs.LaunchConfig(64, 64, 4, 3)
    assert cfg(64) == cfg(64, n=512) == cfg(64, causal=True) == row
    assert cfg(64, flag=False) == configs.LaunchConfig(128, 64, 4, 3)
    assert cfg(32) == cfg(32, flag=False)  # keyed by the padded head dim measured
    assert cfg(128) == cfg(128, n=1024) == configs.LaunchConfig(128, 32, 8, 3)
    assert cfg(128, flag=False) == configs.LaunchConfig(128, 64, 8, 3)
    assert cfg(128, causal=True, n=256) == cfg(128, causal=True, n=256, flag=False)  # narrow
    assert cfg(256) == cfg(256, flag=False)
    assert cfg(64, esize=4) == cfg(64, esize=4, flag=False)
    assert cfg(64, direction="bwd_kv") == cfg(64, direction="bwd_kv", flag=False)
    with configs.tuning.override(fwd=configs.LaunchConfig(32, 16, 4, 1)):
        assert cfg(64) == configs.LaunchConfig(32, 16, 4, 1)


@pytest.mark.parametrize(
    ("direction", "d", "row"),
    [(direction, d, row) for (direction, d), row in configs_module._BOOL_MASK_2B.items()],
    ids=[f"{direction}-D{d}" for direction, d in configs_module._BOOL_MASK_2B],
)
def test_the_bool_mask_rows_keep_the_contract(direction: str, d: int, row) -> None:  # type: ignore[no-untyped-def]
    """Each bool-mask row's tiles, forced (in the interpreter too), on ragged lengths, a
    causal band, a window and rows that keep no key, against the references; the GPU
    runs the rows unforced in test_gpu_large."""
    from attnhub.backends.triton_flash import tuning

    dtype = torch.float16
    for case in (
        Case(
            "bool_causal_br", 1, 2, 2, 150, 300, d, causal=True, bottom_right=True, mask="bool_rows"
        ),
        Case("bool_window", 1, 2, 1, 140, 170, d, window=(40, 10), mask="bool_rows"),
    ):
        torch.manual_seed(1)
        q, k, v, mask = _inputs(case, dtype)
        dout = torch.randn(case.b, case.hq, case.nq, case.d, dtype=dtype, device=DEVICE)
        with tuning.override(**{direction: row}):
            got = _run_flash(case, q, k, v, mask, dout)
        _check_all(case, dtype, got, q, k, v, mask, dout)


@pytest.mark.parametrize(
    ("scale", "softcap", "mask", "fold"),
    [
        (0.125, 0.0, None, True),
        (0.125, 0.0, "bool", True),  # boolean masks write -inf before the scale: fine
        (0.125, 0.0, "float", False),  # added after the scale
        (0.125, 2.0, None, False),  # tanh between product and scale
        (-0.125, 0.0, None, False),
        (0.0, 0.0, None, False),
        (1e-39, 0.0, None, False),  # qk_scale below float32's normal range
    ],
)
def test_forward_folds_the_scale_only_where_exact(scale, softcap, mask, fold) -> None:  # type: ignore[no-untyped-def]
    """The forward's FOLD_SCALE flag (the scale moved into the exponent's FMA): on for
    plain scaled products with a positive float32 scale, off where the max over raw
    products would not be the max over scores (the cases above run in CASES too)."""
    q = torch.randn(1, 1, 8, 16)
    masks = {None: None, "bool": torch.ones(8, 8, dtype=torch.bool), "float": torch.zeros(8, 8)}
    setup = ops._setup(q, q, masks[mask], 8, False, False, ops.NO_WINDOW, ops.NO_WINDOW,
                       softcap, scale, 0.0)  # fmt: skip
    assert setup.fold_scale is fold


@pytest.mark.parametrize(
    ("causal", "window", "walk"),
    [
        (False, (None, None), 50),  # max(Nq, Nk)
        (True, (None, None), 50),
        (True, (15, None), 16),  # a causal window of 16 keys
        (False, (15, None), 50),  # no right side: rows see every later key
        (False, (10, 5), 16),
        (True, (10, 5), 11),  # causal clamps the right side to 0
        (False, (100, 100), 50),  # wider than the sequence
        (False, (0, -3), 1),  # an empty band still launches with some tiles
    ],
)
def test_tiles_are_chosen_by_the_keys_a_row_walks(causal, window, walk, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """launch_config's sequence length is the band's width where both sides are bounded
    (a sliding window walks as many tiles as a sequence of its width), else the longer
    length; the forward and both backward configurations get it."""
    from attnhub.backends.triton_flash import configs

    left, right = (ops.NO_WINDOW if w is None else w for w in window)
    q = torch.randn(1, 1, 40, 16)
    setup = ops._setup(q, q, None, 50, causal, False, left, right, 0.0, 0.25, 0.0)
    assert setup.walk == walk
    seen: list[int | None] = []
    launch_config = ops.launch_config

    def spy(direction, *key, **kw):  # type: ignore[no-untyped-def]
        seen.append(key[5] if len(key) > 5 else kw.get("seqlen"))
        return launch_config(direction, *key, **kw)

    monkeypatch.setattr(ops, "launch_config", spy)
    monkeypatch.setattr(configs, "launch_config", spy)  # backward_configs' two calls
    ops.clear_plans()  # on a GPU, a cached plan of an earlier call would skip launch_config
    k = torch.randn(1, 1, 50, 16, requires_grad=True)
    qg = torch.randn(1, 1, 40, 16, requires_grad=True)
    win = None if window == (None, None) else window
    out, _ = ops.flash_attention(qg, k, k, causal=causal, window=win)
    out.sum().backward()
    assert seen == [walk] * 3  # forward, dK/dV, dQ


def test_row_strides_are_constants_only_for_packed_rows() -> None:
    """A streamed tensor's row stride becomes a kernel constant where its rows are packed
    (stride == head dim), else 0 (the kernel reads the runtime stride); inside
    tuning.override(packed_row_strides=False), 0 for all."""
    from attnhub.backends.triton_flash import tuning

    packed = torch.empty(2, 3, 40, 24)
    view = torch.empty(2, 40, 3, 24).transpose(1, 2)  # (B, N, H, D) storage: stride 72
    narrow_v = torch.empty(2, 3, 40, 16)
    assert ops._row_strides(K=packed, V=narrow_v, Q=view) == {
        "STRIDE_KN": 24, "STRIDE_VN": 16, "STRIDE_QM": 0
    }  # fmt: skip
    with tuning.override(packed_row_strides=False):
        assert ops._row_strides(K=packed, DO=packed) == {"STRIDE_KN": 0, "STRIDE_DOM": 0}
    assert ops._row_strides(K=packed) == {"STRIDE_KN": 24}


def _orders_agree(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, **options: Any
) -> None:
    """Output, lse and gradients (an lse gradient too) of ops.flash_attention with the
    row blocks last first and in grid order (tuning.override(heavy_first=...)) are
    bitwise equal; the override reaches ops._heavy_first."""
    from attnhub.backends.triton_flash import tuning

    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:-1], device=q.device)

    def run(heavy_first: bool) -> list[torch.Tensor]:
        with tuning.override(heavy_first=heavy_first):
            assert ops._heavy_first(causal, 128) is heavy_first
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = ops.flash_attention(*leaves, causal=causal, **options)
            return [out, lse, *torch.autograd.grad((out, lse), leaves, (dout, dlse))]

    for first, last in zip(run(True), run(False)):
        assert torch.equal(first, last)


@pytest.mark.parametrize(
    ("causal", "bottom_right", "window"),
    [(True, False, None), (True, True, (20, None)), (False, False, None)],
    ids=["causal", "bottom_right_window", "dense"],
)
def test_row_block_order_changes_no_bit(
    causal: bool, bottom_right: bool, window: tuple[int, None] | None
) -> None:
    """HEAVY_FIRST (common._row_block) only reorders the forward's and dQ's programs:
    several row blocks, a ragged last one, GQA, either order gives the same bits; the
    rule (ops._heavy_first) turns it on for causal calls up to head dim 128."""
    torch.manual_seed(3)
    q = torch.randn(2, 4, 77, 16, device=DEVICE)
    k, v = (torch.randn(2, 2, 90, 16, device=DEVICE) for _ in range(2))
    assert ops._heavy_first(causal, 16) is ops._heavy_first(causal, 128) is causal
    assert not ops._heavy_first(causal, 256)
    _orders_agree(q, k, v, causal, bottom_right=bottom_right, window=window)


@gpu
@requires_cuda
@pytest.mark.parametrize("n", [1024, 4096], ids=["N1024", "N4096"])
def test_row_block_order_changes_no_bit_on_the_gpu(n: int) -> None:
    """As above on the GPU's own kernels, bf16 D=128 causal: at N=1024 the TMA forward
    and the pointer dQ, at N=4096 the Gluon forward and dQ (where this Triton and GPU
    have them; the launch table decides)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _orders_agree(q, k, v, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_packed_and_strided_inputs_in_one_call(dtype: torch.dtype) -> None:
    """Q and dO through a transpose, K/V packed: the forward and dQ kernels stream K/V
    with constant row strides, dK/dV streams Q/dO with runtime ones (ops._row_strides)."""
    torch.manual_seed(11)
    case = Case("mixed", 2, 4, 2, 45, 52, 32, causal=True, bottom_right=True)
    q = _make((case.b, case.hq, case.nq, case.d), dtype, "bnhd")
    k, v = (_make((case.b, case.hkv, case.nk, case.d), dtype) for _ in range(2))
    dout = _make((case.b, case.hq, case.nq, case.d), dtype, "bnhd")
    got = _run_flash(case, q, k, v, None, dout)
    _check_all(case, dtype, got, q, k, v, None, dout)


@pytest.mark.parametrize(
    ("scale", "softcap", "causal"),
    [(1e30, 1e-10, False), (-1e30, 1e-10, True), (1e20, 1e-25, False)],
    ids=["ratio1e40", "negative_ratio_causal", "ratio1e45"],
)
def test_softcap_ratio_beyond_float32(scale: float, softcap: float, causal: bool) -> None:
    """scale / softcap beyond float32 (1e40 and more; both are in range): the kernels'
    ratio was inf, and a q.k of exactly 0 (a zero query row, a zero key) made
    0 * inf = NaN where the contract's softcap * tanh(0) is 0. Output, lse and gradients
    (GQA, through attnhub.attention with an lse gradient too) against float64."""
    import attnhub

    case = Case("softcap_ratio", 1, 2, 1, 9, 9, 16, causal=causal, softcap=softcap, scale=scale)
    torch.manual_seed(5)
    q, k, v, _ = _inputs(case, torch.float32)
    q[0, 0, 3] = 0.0  # every q.k of this row is 0
    k[0, 0, 5] = 0.0  # and every q.k with this key
    dout = torch.randn(1, 2, 9, 16, device=DEVICE)
    dlse = torch.randn(1, 2, 9, device=DEVICE)

    def run(dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
        qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out, lse = attnhub.attention(
            qd, kd, vd, causal=causal, softcap=softcap, scale=scale, return_lse=True,
            backend=backend,
        )  # fmt: skip
        grads = torch.autograd.grad((out, lse), (qd, kd, vd), (dout.to(dtype), dlse))
        return [out.detach(), lse.detach(), *grads]

    got = run(torch.float32, "triton_flash")
    ref64, ref32 = run(torch.float64, "torch_reference"), run(torch.float32, "torch_reference")
    for name, x, r_lp, r64 in zip(("out", "lse", "dq", "dk", "dv"), got, ref32, ref64):
        _check(name, x, r_lp, r64)


def test_softcap_beyond_float32_max_over_log2e() -> None:
    """softcap > 2.36e38 (float32's largest / log2(e), within the contract's range):
    softcap * log2(e), the kernels' multiplier to log2 units, was inf, and every score
    NaN or inf (then inf - inf in the running max). Clamped: the weights, here one-hot
    (scores softcap * tanh(q.k) differ by about 1e37), and so the output are the
    contract's; the lse is finite, in the documented approximation (common._scores)
    of float32's largest * ln(2) / softcap times the contract's (scores near +-softcap
    have no float32 log2-domain representation). The backward is not checked: its
    weights exp2(s - lse) need |lse| well below 2**24 to be exact in float32. The op
    is called directly: dispatch declines a float32 softcap this large
    (test_a_large_softcap_is_declined_where_it_breaks_the_tolerance), which here would
    be safe only because the scale saturates every weight."""
    import attnhub

    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 2, 7, 16, device=DEVICE) * 0.3 for _ in range(3))
    cap = 3e38
    with pytest.raises(attnhub.NoBackendError, match=r"softcap above 2\*\*6"):
        attnhub.attention(q, k, v, softcap=cap, scale=cap, backend="triton_flash")
    out, lse = ops.flash_attention(q, k, v, softcap=cap, scale=cap)
    r64, lse64 = reference_attention(
        q.double(), k.double(), v.double(), None, AttentionParams(softcap=cap, scale=cap)
    )
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out.double() - r64).abs().max().item() <= 1e-6
    shrink = 3.4028234663852886e38 * 0.6931471805599453 / cap
    assert torch.allclose(lse.double(), lse64.double() * shrink, rtol=1e-5, atol=0.0)


def test_declarations_and_dispatch() -> None:
    import attnhub

    backend = TritonFlash()
    assert backend.unavailable_reason() is None
    assert "cuda" in backend.devices
    if not HAS_CUDA:
        assert "cpu" in backend.devices
    q = torch.randn(1, 2, 20, 16, device=DEVICE).transpose(1, 2).contiguous().transpose(1, 2)
    k = torch.randn(1, 1, 20, 16, device=DEVICE)
    out, lse = attnhub.attention(q, k, k, causal=True, window=(4, None), softcap=2.0,
                                 return_lse=True, backend="triton_flash")  # fmt: skip
    assert out.shape == (1, 2, 20, 16) and lse.shape == (1, 2, 20)


def test_bf16_refused_in_interpreter() -> None:
    from attnhub.validation import build_request

    q = torch.randn(1, 1, 4, 16, dtype=torch.bfloat16)
    request = build_request(q, q, q, None, AttentionParams(scale=0.25))
    assert TritonFlash().extra_reasons(request)


def test_import_attnhub_does_not_load_kernels() -> None:
    code = "import sys, attnhub; attnhub.list_backends(); print('attnhub.backends.triton_flash.ops' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().endswith("False")


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=SHORT.get)
@pytest.mark.parametrize(
    "case",
    [
        Case("causal_br", 2, 8, 2, 1000, 1537, 128, causal=True, bottom_right=True),
        Case("plain", 1, 4, 4, 2048, 2048, 64),
        # Bool masks at D=64 and D=128: the forward's bool-mask rows
        # (configs._BOOL_MASK_2B), with ragged tails and rows that keep no key.
        Case("bool_mask", 2, 4, 2, 1100, 1300, 64, mask="bool_rows"),
        Case("bool_mask", 1, 4, 4, 1500, 1200, 128, mask="bool_rows"),
        Case("window", 1, 4, 4, 2047, 2047, 256, window=(300, 0)),
        # A 256-key causal window: tiles chosen by its width (ops._Setup.walk: the narrow
        # forward row, the short backward pair) and, at D=128, the one-launch backward
        # with both band edges masked.
        Case("sliding", 1, 8, 2, 3000, 3000, 128, causal=True, window=(255, 0)),
        Case(
            "all",
            1,
            4,
            1,
            777,
            1029,
            96,
            causal=True,
            window=(200, 30),
            softcap=20.0,
            mask="float_bcast",
        ),
        # Gemma 2's softcap on its two kinds of layer (global causal; a 1024 window):
        # half precision runs common._tanh's tanh.approx.f32 in forward and backward.
        Case("softcap50_causal", 1, 8, 4, 2048, 2048, 128, causal=True, softcap=50.0),
        Case(
            "softcap50_window",
            1,
            8,
            2,
            3000,
            3000,
            256,
            causal=True,
            window=(1023, 0),
            softcap=50.0,
        ),
    ],
    ids=lambda c: c.id,
)
def test_gpu_large(case: Case, dtype: torch.dtype) -> None:
    torch.manual_seed(8)
    q, k, v, mask = _inputs(case, dtype)
    dout = torch.randn(case.b, case.hq, case.nq, case.dv or case.d, dtype=dtype, device=DEVICE)
    got = _run_flash(case, q, k, v, mask, dout)
    _check_all(case, dtype, got, q, k, v, mask, dout)


@gpu
@requires_cuda
def test_gpu_compile_fullgraph_and_cuda_graph() -> None:
    import attnhub

    q = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(q, k):  # type: ignore[no-untyped-def]
        return attnhub.attention(q, k, k, causal=True, backend="triton_flash")

    eager = f(q, k)
    compiled = torch.compile(f, fullgraph=True)(q, k)
    # Inductor launches the same kernel, possibly specialized differently: near-equal.
    torch.testing.assert_close(eager, compiled, atol=2e-2, rtol=2e-2)
    compiled.sum().backward()

    static_q = q.detach().clone()
    static_k = k.detach().clone()
    for _ in range(2):  # warm up (compile) outside the graph
        ops.flash_attention(static_q, static_k, static_k, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, _ = ops.flash_attention(static_q, static_k, static_k, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, eager.detach())


def test_launch_config_short_sequence_entries() -> None:
    from attnhub.backends.triton_flash import configs

    sm90 = (9, 0)
    table = configs.launch_config("fwd", 64, 2, True, sm90, False)
    # Up to SHORT_N keys, the measured short entry; above it, and without a length,
    # the table's row; 4-byte dtypes and unlisted keys never take a short entry.
    assert configs.launch_config("fwd", 64, 2, True, sm90, False, 1024) == configs.LaunchConfig(
        64, 64, 4, 3
    )
    assert configs.launch_config("fwd", 64, 2, True, sm90, False, 1025) == table
    assert configs.launch_config("fwd", 64, 4, True, sm90, False, 512) == configs.launch_config(
        "fwd", 64, 4, True, sm90, False
    )
    assert configs.launch_config("fwd", 128, 2, True, sm90, False, 512) == configs.launch_config(
        "fwd", 128, 2, True, sm90, False
    )
    short_bwd = [
        configs.launch_config(d, 128, 2, False, sm90, False, 1024) for d in ("bwd_kv", "bwd_q")
    ]
    assert short_bwd == [configs.LaunchConfig(32, 64, 4, 3), configs.LaunchConfig(64, 32, 4, 3)]
    assert configs.launch_config("fwd", 64, 2, True, sm90, True, 512) == configs.INTERPRETER_FWD


def test_double_backward_raises_instead_of_dropping_the_attention_terms() -> None:
    """Issue 18.3: a gradient taken with create_graph=True came back with no graph, so a
    second derivative through it silently lost every attention term (d/dv of
    |dq|^2 + sum(v) was all 1.0). The kernels' backward is not differentiable: the
    first-order gradients are unchanged, and differentiating them raises, as PyTorch's
    fused kernels do, through attnhub (DirectAttention) and through the registered op."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 20, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    _, scalars = ops.call_scalars(q, True, False, None, None, None, 0.0)
    calls = {
        "attnhub": lambda: attnhub_attention(q, k, v, causal=True, backend="triton_flash"),
        "op": lambda: torch.ops.attnhub.triton_flash_fwd(q, k, v, None, None, *scalars)[0],
    }
    for path, call in calls.items():
        plain = torch.autograd.grad(call().sum(), (q, k, v))
        grads = torch.autograd.grad(call().sum(), (q, k, v), create_graph=True)
        for a, b in zip(plain, grads):
            assert torch.equal(a, b.detach()), path
        for wrt in (q, k, v):
            with pytest.raises(RuntimeError, match="double backward"):
                torch.autograd.grad(grads[0].pow(2).sum() + v.sum(), wrt)
    # Without create_graph, nothing changes: a plain backward, twice.
    out = attnhub_attention(q, k, v, backend="triton_flash")
    out.sum().backward(retain_graph=True)
    out.sum().backward()


def attnhub_attention(*args, **kwargs):  # type: ignore[no-untyped-def]
    import attnhub

    return attnhub.attention(*args, **kwargs)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else []),
                         ids=SHORT.get)  # fmt: skip
def test_one_key_per_row_has_exactly_zero_dq_and_dk(dtype: torch.dtype, d: int) -> None:
    """Issue 18.17: with window (0, 0), bottom-right, Nq = 17 > Nk = 16, every row but
    the first keeps one key, so out_i = v_(i-1) whatever q and k are, and dq and dk are
    exactly 0 (the float64 reference's too). They came out as 1e-5 and more (over the
    contract's bound of 1e-5 there): dS = P * (dP - delta) subtracted delta, a row sum of
    dO * O, from dP, a dot product of dO and V, two float32 sums of the same products
    in different orders. delta is now summed as dP is (kernels._row_dots)."""
    gen = torch.Generator().manual_seed(d)
    shape_q, shape_k = (2, 2, 17, d), (2, 2, 16, d)
    q, k, v = (torch.randn(s, generator=gen).to(DEVICE, dtype).requires_grad_()
               for s in (shape_q, shape_k, shape_k))  # fmt: skip
    mask = (2.0 * torch.randn(17, 16, generator=gen)).to(DEVICE, dtype)
    dout = torch.randn(shape_q, generator=gen).to(DEVICE, dtype)
    out, _ = ops.flash_attention(q, k, v, mask, bottom_right=True, window=(0, 0), scale=2.0)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))  # row 0 keeps no key
    assert torch.equal(out[:, :, 1:], v.detach())
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
    # dv_j = P * dO_(j+1) with P = 1 up to the float32 rounding of the recomputed softmax
    # (exactly 1 once rounded to half precision for the dot).
    rtol = 1e-5 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(dv, dout[:, :, 1:], rtol=rtol, atol=0.0)


def test_cached_launch_passes_tensors_then_the_recorded_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """launch.CachedLaunch (the eager plans' launch, issue 17.3) calls the compiled
    launcher as Triton's own launch does: grid, stream, function, flags, metadata, then
    every kernel parameter in signature order (the call's tensors first, then the
    recorded positional, constexpr and defaulted values); no launch hooks unless one is
    set, and then with the launch metadata (the tensors passed as their addresses).
    Checked on CPU with a stand-in compiled
    kernel: the real one needs a GPU (test_gpu_cached_plans_match_the_full_path)."""
    from types import SimpleNamespace

    from triton import knobs

    from attnhub.backends.triton_flash import launch as launch_mod

    names = ["A", "B", "n", "x", "BLOCK", "FLAG"]
    defaults = {"FLAG": "default"}
    kernel = SimpleNamespace(
        params=[SimpleNamespace(name=n, num=i, default=defaults.get(n)) for i, n in enumerate(names)],
        fn=SimpleNamespace(__name__="k"),
    )  # fmt: skip
    seen: list[tuple] = []
    launcher = SimpleNamespace(
        global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
        launch_pdl=True, launch=lambda *a: seen.append(a),
    )  # fmt: skip
    compiled = SimpleNamespace(
        run=launcher, function="fn", packed_metadata=(4, 1, 0),
        launch_metadata=lambda grid, stream, *args: ("meta", grid, len(args)),
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    a0, b0 = torch.zeros(2), torch.ones(2)
    cached = launch_mod.CachedLaunch(kernel, compiled, (3, 2), (a0, b0, 5, 0.5), {"BLOCK": 64}, 2)
    a1, b1 = torch.zeros(3), torch.ones(3)
    cached(a1, b1)
    head = (3, 2, 1, 77, "fn", False, True, None, None, (4, 1, 0), None, None, None)
    assert len(seen) == 1 and seen[0][: len(head)] == head
    # The tensors as their addresses (the launcher then skips its device-memory query).
    assert seen[0][len(head) : len(head) + 2] == (a1.data_ptr(), b1.data_ptr())
    assert seen[0][len(head) + 2 :] == (5, 0.5, 64, "default")
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        cached(a1, b1)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen[1][10] == ("meta", (3, 2, 1), 6)
    assert seen[1][11] is knobs.runtime.launch_enter_hook
    with pytest.raises(ValueError, match="first 3 arguments must be the tensors"):
        launch_mod.CachedLaunch(kernel, compiled, (1,), (a0, b0, 5, 0.5), {"BLOCK": 64}, 3)


def test_calls_on_cpu_or_recorded_launches_make_no_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans are for eager CUDA calls only: none is keyed for CPU tensors (the
    interpreter), and none while a tool has replaced the launcher."""
    q = torch.randn(1, 1, 8, 16)
    scalars = (False, False, ops.NO_WINDOW, ops.NO_WINDOW, 0.0, 0.25, 0.0)
    assert ops._plan_key("fwd", q, q, q, None, None, scalars) is None
    before = len(ops._PLANS)
    ops.flash_attention(q.to(DEVICE), q.to(DEVICE), q.to(DEVICE), return_lse=False)
    if not HAS_CUDA:
        assert len(ops._PLANS) == before == 0
    if HAS_CUDA:
        monkeypatch.setattr(
            ops, "_launcher", lambda kernel, like: ops._default_launcher(kernel, like)
        )
        assert ops._plan_key("fwd", q.cuda(), q.cuda(), q.cuda(), None, None, scalars) is None


def test_forward_mode_ad_raises_instead_of_dropping_tangents() -> None:
    """Dual tensors (forward-mode AD) do not require grad, but a call on them must not
    take the no-autograd-node path, which would return an output without a tangent:
    they go through DirectAttention, which has no jvp and says so."""
    import torch.autograd.forward_ad as fwAD

    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(NotImplementedError, match="jvp"):
            ops.flash_attention(dual, q, q)
    assert ops.flash_attention(q, q, q)[0].shape == q.shape


def test_a_plan_is_recorded_on_a_keys_second_call() -> None:
    """ops._lookup: a key's first call marks it (no recording, so a shape that changes
    every call never pays for one), its second asks the full path to record a plan,
    later calls get the plan; the table is cleared when full. A call without a key (it
    may not use plans) gets neither and marks nothing."""
    ops.clear_plans()
    assert ops._lookup(None) == (None, None) and not ops._PLANS
    key = ("test", 1)
    assert ops._lookup(key) == (None, None)
    assert ops._lookup(key) == (None, key)
    plan = object()
    ops._remember(key, plan)
    assert ops._lookup(key) == (plan, None)
    for i in range(ops._MAX_PLANS):
        ops._lookup(("fill", i))
    assert len(ops._PLANS) <= ops._MAX_PLANS and key not in ops._PLANS
    ops.clear_plans()


def test_return_lse_false_returns_no_lse_and_the_same_output() -> None:
    """flash_attention(return_lse=False): lse None (not computed where no gradient is
    recorded), the output bitwise as with it; with gradients the backward still runs."""
    torch.manual_seed(12)
    q, k, v = (torch.randn(1, 2, 24, 16, device=DEVICE) for _ in range(3))
    out, lse = ops.flash_attention(q, k, v, causal=True)
    out2, none = ops.flash_attention(q, k, v, causal=True, return_lse=False)
    assert lse is not None and none is None and torch.equal(out, out2)
    qg = q.clone().requires_grad_()
    out3, none = ops.flash_attention(qg, k, v, causal=True, return_lse=False)
    assert none is None and torch.equal(out3.detach(), out)
    out3.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


@gpu
@requires_cuda
def test_gpu_cached_plans_match_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager CUDA calls reuse a cached launch plan (issue 17.3): from the third call of a
    key on, the launch skips Triton's binder (the JIT's run is not called) and gives
    bitwise the forward of the full path, for masks, GQA, dropout, strided and misaligned inputs
    (a 16-byte misaligned view is its own key: Triton specializes on alignment), with
    and without lse, fp32 under both matmul precisions; tuning overrides key apart."""
    from attnhub.backends.triton_flash import kernels, tuning

    torch.manual_seed(13)
    dt = torch.bfloat16
    base = torch.randn(2 * 4 * 77 * 64 + 1, device="cuda", dtype=dt)
    misaligned = base[1:].view(2, 4, 77, 64)  # storage offset of 2 bytes
    assert misaligned.data_ptr() % 16 != 0
    k = torch.randn(2, 2, 90, 64, device="cuda", dtype=dt)
    v = torch.randn(2, 2, 90, 64, device="cuda", dtype=dt)
    bnhd = torch.randn(2, 77, 4, 64, device="cuda", dtype=dt).transpose(1, 2)
    mask_b = torch.rand(77, 90, device="cuda") > 0.3
    mask_f = torch.randn(2, 1, 77, 90, device="cuda", dtype=dt)
    calls = [
        (misaligned.contiguous(), None, {}),
        (misaligned, None, {}),
        (bnhd, mask_b, {"causal": True, "bottom_right": True}),
        (bnhd.contiguous(), mask_f, {"window": (20, 3), "softcap": 5.0}),
        (bnhd.contiguous(), None, {"dropout_p": 0.2}),
    ]
    jit_runs = []
    run = kernels.attn_fwd_kernel.run

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        jit_runs.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernels.attn_fwd_kernel, "run", counting)
    for q, mask, kw in calls:
        for return_lse in (True, False):
            ops.clear_plans()
            results = []
            for _ in range(3):  # a key's first two calls take the full path, the second records
                torch.manual_seed(1)
                results.append(ops.flash_attention(q, k, v, mask, return_lse=return_lse, **kw))
            assert len(jit_runs) == 2, "the third call went through Triton's binder"
            assert len(ops._PLANS) == 1 and ops._SEEN not in ops._PLANS.values()
            with tuning.override():  # another key: the full path again
                torch.manual_seed(1)
                results.append(ops.flash_attention(q, k, v, mask, return_lse=return_lse, **kw))
            assert len(jit_runs) == 3 and len(ops._PLANS) == 2
            (out, lse), later = results[0], results[1:]
            for out_b, lse_b in later:
                assert torch.equal(out, out_b)
                assert (lse is None) == (lse_b is None) == (not return_lse)
                if return_lse:
                    assert torch.equal(lse, lse_b)
            jit_runs.clear()
    q32, k32 = (torch.randn(1, 2, 40, 32, device="cuda") for _ in range(2))
    previous = torch.get_float32_matmul_precision()
    try:
        outs = {}
        for precision in ("highest", "highest", "high", "high", "highest"):
            torch.set_float32_matmul_precision(precision)
            outs.setdefault(precision, []).append(ops.flash_attention(q32, k32, k32)[0])
        assert torch.equal(outs["highest"][0], outs["highest"][2])  # the plan's: IEEE
        ref = reference_attention(q32.double(), k32.double(), k32.double(), None,
                                  AttentionParams(scale=32**-0.5))[0]  # fmt: skip
        assert (outs["highest"][2].double() - ref).abs().max() < 1e-5  # IEEE, not TF32's plan
    finally:
        torch.set_float32_matmul_precision(previous)


@gpu
@requires_cuda
def test_gpu_cuda_graph_replays_a_planned_call_without_lse() -> None:
    """A planned no-grad call (no lse) captured in a CUDA graph: the launch goes to the
    capture stream, and replay on new inputs gives the eager output."""
    q, k = (torch.randn(1, 4, 16, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    for _ in range(2):  # the second call records the plan
        ops.flash_attention(q, k, k, return_lse=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, none = ops.flash_attention(q, k, k, return_lse=False)
    assert none is None
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, ops.flash_attention(q, k, k, return_lse=False)[0])


@gpu
@requires_cuda
@pytest.mark.parametrize("d", [64, 128], ids=["D64_split", "D128_merged"])
def test_gpu_cached_backward_plans_match_the_full_path(
    d: int, count_jit_runs: Callable[..., list[str]]
) -> None:
    """The backward's plan (preprocess, then the merged or the split launches) gives
    bitwise the gradients of the full path, with a gradient on lse too (dlse), and from
    a key's third call on no backward kernel runs through Triton's binder."""
    from attnhub.backends.triton_flash import kernels, tuning

    jit_runs = count_jit_runs(
        kernels.attn_bwd_preprocess_kernel, kernels.attn_bwd_kernel, kernels.attn_bwd_dkdv_kernel,
        kernels.attn_bwd_dq_kernel,
    )  # fmt: skip
    torch.manual_seed(14)
    q = torch.randn(2, 4, 100, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 120, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    dout = torch.randn(2, 4, 100, d, device="cuda", dtype=torch.bfloat16)
    for with_lse in (False, True):
        ops.clear_plans()
        grads = []
        for override in (False, False, False, True):
            jit_runs.clear()
            with tuning.override() if override else contextlib.nullcontext():
                out, lse = ops.flash_attention(q, k, v, causal=True, bottom_right=True)
                loss = (out * dout).sum() + (lse.sum() if with_lse else 0.0)
                grads.append(torch.autograd.grad(loss, (q, k, v)))
            backward_runs = [n for n in jit_runs if n != "attn_fwd_kernel"]
            if len(grads) == 3:
                assert backward_runs == [], "the third backward went through Triton's binder"
            else:
                assert backward_runs[0] == "attn_bwd_preprocess_kernel"
                merged = (
                    ["attn_bwd_kernel"]
                    if d == 128
                    else ["attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"]
                )
                assert backward_runs[1:] == merged
        for later in grads[1:]:
            for a, b in zip(grads[0], later):
                assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dtype", "softcap"),
    [(torch.float32, c) for c in (16.0, 30.0, 64.0, 128.0, 500.0, 5000.0)]
    + [(torch.float16, c) for c in (8192.0, 1e5, 1e6)],
)
def test_a_large_softcap_is_declined_where_it_breaks_the_tolerance(dtype, softcap):
    """The kernels' tanh error is scaled by c in c * tanh(s / c): past the largest
    softcap a dtype is served with (backends/triton_flash._SOFTCAP_LOG2_LIMIT), calls
    are declined (explain() says why) and served elsewhere; every call served meets
    the tolerance."""
    import attnhub
    from attnhub.testing.cases import Case
    from attnhub.testing.reference import plain_attention
    from attnhub.testing.tolerance import compare

    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(1, 2, 40, 32, generator=g) * 3).to(DEVICE, dtype) for _ in range(3))
    case = Case(dtype, 1, 2, 2, 40, 40, 32, 32, causal=True, softcap=softcap)
    r_lp, _ = plain_attention(q, k, v, None, case)
    r64 = attnhub.attention(
        q.double(), k.double(), v.double(), backend="torch_reference", causal=True,
        softcap=softcap,
    )  # fmt: skip
    limit = 64.0 if dtype == torch.float32 else 8192.0
    try:
        out = attnhub.attention(q, k, v, backend="triton_flash", causal=True, softcap=softcap)
    except attnhub.NoBackendError as exc:
        assert softcap > limit and "softcap above 2**" in str(exc)
        served = attnhub.attention(q, k, v, causal=True, softcap=softcap)  # by another backend
        assert compare("out", served, r_lp, r64) is None
        return
    assert softcap <= limit
    assert compare("out", out, r_lp, r64) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_largest_softcap_served_keeps_the_tolerance_in_the_gradients_too(dtype):
    """At the largest softcap triton_flash serves in a dtype, output and gradients meet
    the contract, with grouped heads (four query heads summed into each key head): with
    the tanh formula alone, fp32 at c = 64 had dK and dV at 1.1-1.9x the bound while its
    output was within it (common._tanh's series near 0 mends it)."""
    from attnhub.backends.triton_flash import _SOFTCAP_LOG2_LIMIT
    from attnhub.testing import Case, case_problems

    softcap = 2.0 ** _SOFTCAP_LOG2_LIMIT[dtype]
    for seed in range(2):
        case = Case(dtype=dtype, B=3, Hq=4, Hkv=1, Nq=80, Nk=9, D=32, Dv=32,
                    softcap=softcap, backward=True, seed=seed)  # fmt: skip
        assert case_problems("triton_flash", case, DEVICE) == []


def test_serving_calls_decline_a_large_softcap_too():
    """attention_kvcache and attention_varlen run the same tanh (common._tanh, which the
    decode and packed kernels share): their requests carry the softcap's size as dense ones do."""
    import attnhub

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 32, generator=g).to(DEVICE)
    cache = torch.randn(2, 2, 40, 32, generator=g).to(DEVICE)
    lengths = torch.tensor([40, 17], dtype=torch.int32, device=DEVICE)
    packed = torch.randn(30, 2, 32, generator=g).to(DEVICE)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32, device=DEVICE)
    served = attnhub.attention_kvcache(
        q, cache, cache, lengths, softcap=16.0, backend="triton_flash"
    )
    assert torch.isfinite(served).all()
    with pytest.raises(attnhub.NoBackendError, match=r"softcap above 2\*\*6"):
        attnhub.attention_kvcache(q, cache, cache, lengths, softcap=500.0, backend="triton_flash")
    with pytest.raises(attnhub.NoBackendError, match=r"softcap above 2\*\*6"):
        attnhub.attention_varlen(
            packed, packed, packed, cu, cu, softcap=500.0, backend="triton_flash"
        )
