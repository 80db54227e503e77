"""The Gluon kernels: triton_flash's forward (kernels_gluon.attn_fwd_gluon_kernel) and
backward (kernels_gluon_bwd's dK/dV and dQ) and, for which calls reach them,
triton_blocksparse's (its kernels_gluon; its GPU checks are
tests/test_triton_blocksparse.py's test_gpu_gluon_forward and test_gpu_gluon_backward).

On the GPU: calls the launch table sends to them (D = 128, half precision; the forward
past configs.SHORT_N keys, the backward from 4096) and calls under forced Gluon rows,
checked against the float64 reference with contract.md's tolerance (the kit's
``case_problems``: output, lse, gradients, fully masked rows), with the kernels seen to
run; the forward's cached launch plan, bitwise against the full path. Everywhere: which
calls may reach them (ops._gluon_eligible, ops._gluon_bwd_eligible, the table's rows),
by recording the launches an sm_90 would make. Gluon has no interpreter, so the CPU
suite cannot run the kernels; tests/test_sm90_compile.py compiles them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attnhub.backends.triton_flash import configs, ops
from attnhub.testing import Case, case_problems

HAS_CUDA = torch.cuda.is_available()
SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.gpu
GLUON = "attn_fwd_gluon_kernel"


def _case(dtype: torch.dtype, hkv: int, nq: int, nk: int, d: int = 128, **options) -> Case:  # type: ignore[no-untyped-def]
    return Case(
        dtype=dtype, B=2, Hq=4, Hkv=hkv, Nq=nq, Nk=nk, D=d, Dv=d, return_lse=True, **options
    )


# Every kind of call the kernel serves: either causal alignment (bottom-right with more
# queries than keys leaves rows with no key), windows on either side, GQA and MQA,
# lengths that are not tile multiples, (B, N, H, D) views, gradients through its out and lse.
_SERVED = [
    (hkv, nq, nk, options)
    for hkv, nq, nk, options in (
        (4, 1100, 1100, {}),
        (2, 1500, 1100, {"causal": True}),
        (4, 1100, 1700, {"causal": True, "alignment": "bottom_right"}),
        (1, 1700, 1100, {"causal": True, "alignment": "bottom_right", "backward": True}),
        (2, 2048, 2048, {"causal": True, "window": (1100, 0)}),
        (4, 1300, 1300, {"window": (1030, 200), "strided": True}),
        (2, 1200, 2500, {"window": (None, 700), "alignment": "bottom_right"}),
        (4, 2100, 2100, {"causal": True, "backward": True, "strided": True}),
        (1, 1025, 4000, {"scale": 0.3}),
    )
]
_CASES = [
    pytest.param(case, marks=gpu, id=case.id)
    for case in (
        _case(dtype, hkv, nq, nk, **options)
        for dtype in (torch.bfloat16, torch.float16)
        for hkv, nq, nk, options in _SERVED
    )
]


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", _CASES)
def test_gpu_gluon_forward_keeps_the_contract(case: Case, launched_kernels: list[str]) -> None:
    problems = case_problems("triton_flash", case, "cuda")
    assert not problems, f"{case.id}: " + "; ".join(problems)
    assert launched_kernels and launched_kernels[0] == GLUON, launched_kernels


GLUON_KV, GLUON_Q = "attn_bwd_dkdv_gluon_kernel", "attn_bwd_dq_gluon_kernel"
# The Gluon kernels' rows by head dim (the table's for admitted calls); forced here.
_GLUON_ROWS = configs.GLUON_BWD
_GLUON_ROWS_BY_D = {128: _GLUON_ROWS, 256: configs.GLUON_BWD_256}
# The table's rows for calls that the Gluon kernels cannot serve: a role forced alone
# has the other on them (the table would give an admitted call Gluon's there too).
_POINTER_ROWS = {
    d: configs.backward_rows(d, 2, False, (9, 0), False, 4096, True) for d in _GLUON_ROWS_BY_D
}
_BWD_CASES = [
    pytest.param(case, roles, marks=gpu, id=f"{'+'.join(roles)}-{case.id}")
    for roles in (("bwd_kv",), ("bwd_q",), ("bwd_kv", "bwd_q"))
    for case in (
        _case(dtype, hkv, nq, nk, d, backward=True, **options)
        for d in (128, 256)
        for dtype in (torch.bfloat16, torch.float16)
        for hkv, nq, nk, options in (
            (4, 1100, 1100, {}),
            (2, 1500, 1100, {"causal": True}),
            (1, 1700, 1100, {"causal": True, "alignment": "bottom_right"}),
            (4, 1100, 1700, {"causal": True, "alignment": "bottom_right", "strided": True}),
            (2, 1300, 1300, {"window": (300, 40)}),
            (1, 1028, 4000, {"scale": -0.3}),
        )
    )
]


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize(("case", "roles"), _BWD_CASES)
def test_gpu_gluon_backward_keeps_the_contract(
    case: Case, roles: tuple[str, ...], launched_kernels: list[str]
) -> None:
    """The Gluon backward kernels (kernels_gluon_bwd), forced, each alone (the other role
    on a pointer row) and both, at D = 128 and 256 (whose dK/dV consumers split the head
    dim): gradients within the contract's tolerance of the float64 reference, for either
    alignment, windows, GQA, ragged lengths, rows without keys, strided views and a
    negative scale."""
    from attnhub.backends.triton_flash import tuning

    rows = _GLUON_ROWS_BY_D[case.D]
    with tuning.override(**{**_POINTER_ROWS[case.D], **{role: rows[role] for role in roles}}):
        problems = case_problems("triton_flash", case, "cuda")
    assert not problems, f"{case.id}: " + "; ".join(problems)
    for role, kernel in (("bwd_kv", GLUON_KV), ("bwd_q", GLUON_Q)):
        assert (kernel in launched_kernels) == (role in roles), launched_kernels


# Calls that the table gives the Gluon backward (4096 keys or more a row, Nq % 4 == 0).
_TABLE_BWD_CASES = [
    pytest.param(case, marks=gpu, id=case.id)
    for case in (
        _case(dtype, hkv, nq, nk, d, backward=True, **options)
        for dtype in (torch.bfloat16, torch.float16)
        for hkv, nq, nk, d, options in (
            (2, 4096, 4096, 128, {"causal": True}),
            (4, 4096, 4100, 128, {}),
            (1, 4100, 4096, 128, {"causal": True, "alignment": "bottom_right", "strided": True}),
            (2, 4096, 4096, 256, {"causal": True}),
            (4, 4100, 4096, 256, {"causal": True, "alignment": "bottom_right", "strided": True}),
        )
    )
]


@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("case", _TABLE_BWD_CASES)
def test_gpu_the_tables_gluon_backward_keeps_the_contract(
    case: Case, launched_kernels: list[str]
) -> None:
    """The launch table's own choice (no forced row) for long half-precision D = 128
    and D = 256 calls: both Gluon backward kernels run, and the gradients keep the contract
    against the float64 reference."""
    problems = case_problems("triton_flash", case, "cuda")
    assert not problems, f"{case.id}: " + "; ".join(problems)
    assert GLUON_KV in launched_kernels and GLUON_Q in launched_kernels, launched_kernels


_POINTERS, _MERGED = ("attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"), ("attn_bwd_kernel",)


@pytest.mark.parametrize(
    ("what", "rows", "expected"),
    [
        ("served", "table", (GLUON_KV, GLUON_Q)),
        ("served", "forced", (GLUON_KV, GLUON_Q)),
        ("fewer than 4096 keys", "table", _MERGED),
        ("fewer than 4096 keys", "forced", (GLUON_KV, GLUON_Q)),
        ("fewer than 4096 keys", "dQ forced", ("attn_bwd_dkdv_kernel", GLUON_Q)),
        ("softcap", "table", _MERGED),
        ("softcap", "forced", _POINTERS),
        ("head dim 64", "table", _POINTERS),
        ("bool mask", "table", _POINTERS),
        ("bool mask", "forced", _POINTERS),
        ("float32", "table", _POINTERS),
        ("sm_100", "table", _MERGED),
        ("sm_100", "forced", _POINTERS),
        ("a Triton without Gluon", "table", _MERGED),
        ("a Triton without Gluon", "forced", _POINTERS),
        ("Nq not a multiple of 4", "table", _MERGED),
        ("Nq not a multiple of 4", "forced", _POINTERS),
        ("head dim 256", "table", (GLUON_KV, GLUON_Q)),
        ("head dim 256, 512 keys", "table", (GLUON_KV, GLUON_Q)),
        ("head dim 256, 508 keys", "table", _POINTERS),
        ("head dim 256, softcap", "table", _POINTERS),
        ("head dim 256, float32", "table", _POINTERS),
    ],
)
def test_which_backward_kernels_an_sm90_call_gets(what: str, rows: str, expected: tuple[str, ...],
                                                  monkeypatch) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """The backward's launches on an sm_90 (recorded, not run), by the table or with the
    Gluon rows forced: the table gives the Gluon kernels the dense half-precision D = 128
    calls of 4096 keys or more and D = 256 calls of 512 or more that they can serve, and
    leaves the rest on the rows they had (D = 128 merged, D = 256 split); under forced
    rows, calls that the Gluon kernels cannot serve run the pointer kernels on the same
    tiles, split (Nq not a multiple of 4: a head's lse row would start unaligned for
    TMA, which faulted on the H200 at Nq = 1025)."""
    from attnhub.backends.triton_flash import tuning

    launched = _recorded_as_on(monkeypatch, (10, 0) if what == "sm_100" else (9, 0))
    if what == "a Triton without Gluon":
        monkeypatch.setattr(ops, "kernels_gluon_bwd", None)
    dtype = torch.float32 if what.endswith("float32") else torch.bfloat16
    d = 64 if what == "head dim 64" else 256 if what.startswith("head dim 256") else 128
    n = {"Nq not a multiple of 4": 4097, "fewer than 4096 keys": 4092,
         "head dim 256, 512 keys": 512, "head dim 256, 508 keys": 508}.get(what, 4096)  # fmt: skip
    q, k, v = (torch.zeros(1, 4, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, n, n, dtype=torch.bool) if what == "bool mask" else None
    forced = {"table": {}, "dQ forced": {"bwd_q": _GLUON_ROWS["bwd_q"]}}.get(rows, _GLUON_ROWS)
    with tuning.override(**forced):
        out, _ = ops.flash_attention(q, k, v, mask, causal=True,
                                     softcap=30.0 if what.endswith("softcap") else 0.0)  # fmt: skip
        launched.clear()  # the forward's
        out.backward(torch.ones_like(out))
    assert tuple(launched[1:]) == expected, launched  # after the preprocess


@gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_gpu_gluon_plans_match_the_full_path() -> None:
    """A key's third call runs its cached plan (ops._PLANS: the compiled kernel launched
    directly, global scratch for the descriptors allocated by launch.CachedLaunch): the
    same outputs, bitwise, as the full path's first call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1500, 128, generator=g).cuda().bfloat16() for _ in range(3))
    ops.clear_plans()
    calls = [ops.flash_attention(q, k, v, causal=True, return_lse=True) for _ in range(3)]
    plans = [p for p in ops._PLANS.values() if isinstance(p, ops._ForwardPlan)]
    assert len(plans) == 1 and plans[0].launch._compiled.name == GLUON
    for out, lse in calls[1:]:
        assert torch.equal(out, calls[0][0]) and torch.equal(lse, calls[0][1])


class _NoLaunch:
    """A launcher that records the kernel and runs nothing (outputs stay unwritten)."""

    def __init__(self, launched: list[str]) -> None:
        self.launched = launched

    def __call__(self, kernel, like):  # type: ignore[no-untyped-def]
        self.launched.append(kernel.fn.__name__)
        return self

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: None


def _recorded_as_on(monkeypatch, capability: tuple[int, int], *modules) -> list[str]:  # type: ignore[no-untyped-def]
    """Launches recorded, not run (their kernels' names, returned), as a GPU of
    ``capability`` would make them: triton_flash's ops and each of ``modules`` (ops
    modules that import ``_capability`` and ``interpreting`` from it) see that device,
    outside the interpreter."""
    for module in (ops, *modules):
        monkeypatch.setattr(module, "_capability", lambda device: capability)
        monkeypatch.setattr(module, "interpreting", lambda: False)
    launched: list[str] = []
    monkeypatch.setattr(ops, "_launcher", _NoLaunch(launched))
    return launched


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("served", GLUON),
        ("at most SHORT_N keys", "attn_fwd_tma_kernel"),
        ("softcap", "attn_fwd_tma_kernel"),
        ("head dim 64", "attn_fwd_kernel"),
        ("head dims 128 and 64", "attn_fwd_tma_kernel"),
        ("bool mask", "attn_fwd_kernel"),
        ("float32", "attn_fwd_kernel"),
        ("sm_100", "attn_fwd_tma_kernel"),
        ("sm_80", "attn_fwd_kernel"),
        ("a Triton without Gluon", "attn_fwd_tma_kernel"),
    ],
)
def test_which_forward_an_sm90_call_gets(what: str, expected: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The launches a GPU of that capability would make (recorded, not run): only dense
    half-precision D = Dv = 128 calls past SHORT_N keys, without softcap, on sm_90, take
    the Gluon forward; the rest keep the TMA or pointer kernels they had."""
    capability = {"sm_100": (10, 0), "sm_80": (8, 0)}.get(what, (9, 0))
    launched = _recorded_as_on(monkeypatch, capability)
    if what == "a Triton without Gluon":
        monkeypatch.setattr(ops, "kernels_gluon", None)
    n = 1000 if what == "at most SHORT_N keys" else 1100
    dtype = torch.float32 if what == "float32" else torch.bfloat16
    q = torch.zeros(1, 2, n, 64 if what == "head dim 64" else 128, dtype=dtype)
    k = torch.zeros_like(q)
    v = torch.zeros(1, 2, n, 64 if what == "head dims 128 and 64" else q.shape[-1], dtype=dtype)
    mask = torch.ones(1, 1, n, n, dtype=torch.bool) if what == "bool mask" else None
    ops.flash_attention(q, k, v, mask, causal=True, softcap=30.0 if what == "softcap" else 0.0)
    assert launched == [expected]


def test_the_table_takes_the_gluon_row_only_where_the_call_allows_it() -> None:
    sm90 = (9, 0)
    for causal in (False, True):
        row = configs.launch_config("fwd", 128, 2, causal, sm90, False, 4096, lean=True,
                                    tma=True, gluon=True)  # fmt: skip
        assert row == configs.LaunchConfig(128, 128, 4, 2, gluon=True)
        # Without the call's admission, at SHORT_N keys or fewer, or another head dim:
        # the rows the call had before.
        for key, kwargs in (
            ((128, 2, causal, sm90, False, 4096), {"tma": True}),
            ((128, 2, causal, sm90, False, configs.SHORT_N), {"tma": True, "gluon": True}),
            ((64, 2, causal, sm90, False, 4096), {"tma": True, "gluon": True}),
        ):
            got = configs.launch_config("fwd", *key, lean=True, **kwargs)
            assert not got.gluon
            assert got == configs.launch_config("fwd", *key, lean=True, tma=kwargs["tma"])
        # The backward's rows: the Gluon kernels' own tiles, under the same conditions.
        for direction in ("bwd_kv", "bwd_q"):
            assert configs.launch_config(direction, 128, 2, causal, sm90, False, 4096, True,
                                         gluon=True) == _GLUON_ROWS[direction]  # fmt: skip
            assert configs.launch_config(direction, 256, 2, causal, sm90, False, 512, True,
                                         gluon=True) == configs.GLUON_BWD_256[direction]  # fmt: skip
            for key, gluon in (
                ((128, 2, causal, sm90, False, 4096), False),
                ((128, 2, causal, sm90, False, 4095), True),
                ((64, 2, causal, sm90, False, 4096), True),
                ((256, 2, causal, sm90, False, 511), True),
                ((256, 2, causal, sm90, False, 4096), False),
            ):
                got = configs.launch_config(direction, *key, True, gluon=gluon)
                assert not got.gluon
                assert got == configs.launch_config(direction, *key, True)


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("served", "bs_fwd_gluon_kernel"),
        ("128 x 64 blocks", "bs_fwd_gluon_kernel"),
        ("partial blocks", "bs_fwd_gluon_kernel"),
        ("short rows", "bs_fwd_kernel"),
        ("64-row blocks", "bs_fwd_kernel"),
        ("128 x 32 blocks", "bs_fwd_kernel"),
        ("ragged length", "bs_fwd_kernel"),
        ("causal", "bs_fwd_kernel"),
        ("at most SHORT_N keys", "bs_fwd_kernel"),
        ("float mask", "bs_fwd_kernel"),
        ("softcap", "bs_fwd_kernel"),
        ("head dim 64", "bs_fwd_kernel"),
        ("float32", "bs_fwd_kernel"),
        ("sm_100", "bs_fwd_kernel"),
        ("a Triton without Gluon", "bs_fwd_kernel"),
    ],
)
def test_which_block_sparse_forward_an_sm90_call_gets(
    what: str, expected: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """triton_blocksparse's forward (recorded, not run): the Gluon kernel takes what
    triton_flash's Gluon forward takes, on layouts with 128-row blocks and 64- or 128-key
    blocks that divide both lengths, without a band, whose rows keep 1536 keys or more on
    average (ops._GLUON_MIN_KEYS; "short rows": a 300-key window); every other call
    keeps the pointer kernel."""
    from attnhub import BlockSparseLayout
    from attnhub.backends.triton_blocksparse import ops as bs_ops

    launched = _recorded_as_on(monkeypatch, (10, 0) if what == "sm_100" else (9, 0), bs_ops)
    if what == "a Triton without Gluon":
        monkeypatch.setattr(bs_ops, "kernels_gluon", None)
    n = {"at most SHORT_N keys": 1024, "ragged length": 2000}.get(what, 2048)
    block = {"64-row blocks": 64, "128 x 64 blocks": (128, 64), "128 x 32 blocks": (128, 32)}.get(
        what, 128
    )
    if what == "partial blocks":  # rows of 1700-3400 keys, partial blocks on both edges
        n = 4096
        layout = BlockSparseLayout.sliding_window(n, 1700, block, causal=False)
    elif what == "short rows":
        layout = BlockSparseLayout.sliding_window(n, 300, block)
    else:
        bq, bk = (block, block) if isinstance(block, int) else block
        keep = torch.ones(1, 1, -(-n // bq), -(-n // bk), dtype=torch.bool)
        layout = BlockSparseLayout.from_block_mask(keep, block)  # full blocks only
    dtype = torch.float32 if what == "float32" else torch.bfloat16
    q = torch.zeros(1, 2, n, 64 if what == "head dim 64" else 128, dtype=dtype)
    mask = torch.zeros(n, n, dtype=dtype) if what == "float mask" else None
    bs_ops.block_sparse_attention(
        q, q, q, layout, mask, causal=what == "causal", softcap=30.0 if what == "softcap" else 0.0
    )
    assert launched == [expected]


def _block_sparse_backward_launches(monkeypatch, what: str, rows: dict) -> list[str]:  # type: ignore[no-untyped-def]
    """The kernels triton_blocksparse's backward launches (recorded, not run) on an
    sm_90 under the forced ``rows`` (none: the table's): preprocess, dK/dV, dQ. ``what``
    names the call: "served" (128 x 128 full blocks, N = 4096, bf16, D = 128), "fewer
    than 4096 keys" (N = 2048), "partial blocks" (a 300-key window), "a 1024-key window"
    (rows and columns of ~1100, partial blocks), "64-row blocks",
    "128 x 64 blocks", "causal", "softcap", "a Triton without the Gluon backward"."""
    from attnhub import BlockSparseLayout
    from attnhub.backends.triton_blocksparse import ops as bs_ops
    from attnhub.backends.triton_flash import tuning

    launched = _recorded_as_on(monkeypatch, (9, 0), bs_ops)
    if what == "a Triton without the Gluon backward":
        monkeypatch.setattr(ops, "kernels_gluon_bwd", None)
    n = 2048 if what == "fewer than 4096 keys" else 4096
    block = {"64-row blocks": 64, "128 x 64 blocks": (128, 64)}.get(what, 128)
    if what in ("partial blocks", "a 1024-key window"):
        layout = BlockSparseLayout.sliding_window(
            n, 300 if what == "partial blocks" else 1024, block
        )
    else:
        bq, bk = (block, block) if isinstance(block, int) else block
        keep = torch.ones(1, 1, n // bq, n // bk, dtype=torch.bool)
        layout = BlockSparseLayout.from_block_mask(keep, block)
    q = torch.zeros(1, 2, n, 128, dtype=torch.bfloat16, requires_grad=True)
    with tuning.override(**rows):
        out, _ = bs_ops.block_sparse_attention(
            q, q, q, layout, None, causal=what == "causal",
            softcap=30.0 if what == "softcap" else 0.0,
        )  # fmt: skip
        launched.clear()  # the forward's
        out.backward(torch.ones_like(out))
    assert len(launched) == 3, launched  # preprocess, dK/dV, dQ
    return launched


@pytest.mark.parametrize(
    ("what", "forced", "expected"),
    [
        ("served", False, "bs_bwd_dq_gluon_kernel"),
        ("served", True, "bs_bwd_dq_gluon_kernel"),
        ("128 x 64 blocks", False, "bs_bwd_dq_gluon_kernel"),
        ("partial blocks", False, "bs_bwd_dq_kernel"),
        ("partial blocks", True, "bs_bwd_dq_gluon_kernel"),
        ("a 1024-key window", False, "bs_bwd_dq_kernel"),
        ("fewer than 4096 keys", False, "bs_bwd_dq_kernel"),
        ("64-row blocks", True, "bs_bwd_dq_kernel"),
        ("causal", True, "bs_bwd_dq_kernel"),
        ("softcap", True, "bs_bwd_dq_kernel"),
        ("a Triton without the Gluon backward", True, "bs_bwd_dq_kernel"),
    ],
)
def test_which_block_sparse_dq_kernel_an_sm90_call_gets(
    what: str, forced: bool, expected: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """triton_blocksparse's dQ launch (recorded, not run), by the table or under a forced
    Gluon dQ row: the Gluon kernel (kernels_gluon.bs_bwd_dq_gluon_kernel) takes the
    layouts its forward takes, by the table only where rows keep many keys (as the
    forward: "partial blocks" keeps 300 a row) and calls have 4096 keys or more; every
    other call keeps the pointer kernel."""
    rows = {"bwd_q": _GLUON_ROWS["bwd_q"]} if forced else {}
    launched = _block_sparse_backward_launches(monkeypatch, what, rows)
    assert launched[-1] == expected, launched


@pytest.mark.parametrize(
    ("what", "forced", "expected"),
    [
        ("served", False, "bs_bwd_dkdv_gluon_kernel"),
        ("partial blocks", False, "bs_bwd_dkdv_kernel"),
        ("partial blocks", True, "bs_bwd_dkdv_gluon_kernel"),
        ("a 1024-key window", False, "bs_bwd_dkdv_gluon_kernel"),
        ("fewer than 4096 keys", False, "bs_bwd_dkdv_kernel"),
        ("128 x 64 blocks", False, "bs_bwd_dkdv_kernel"),
        ("128 x 64 blocks", True, "bs_bwd_dkdv_kernel"),
        ("causal", False, "bs_bwd_dkdv_kernel"),
        ("causal", True, "bs_bwd_dkdv_kernel"),
    ],
)
def test_which_block_sparse_dkdv_kernel_an_sm90_call_gets(
    what: str, forced: bool, expected: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """triton_blocksparse's dK/dV launch (recorded, not run), by the table or under a
    forced Gluon dK/dV row: the Gluon kernel (kernels_gluon.bs_bwd_dkdv_gluon_kernel)
    takes layouts of 128 x 128 blocks that the Gluon forward takes (its program is one
    128-key column block), by the table where columns keep 768 queries or more on
    average (ops._GLUON_KV_MIN_QUERIES: a 1024-key window's do, a 300-key one's do not)
    and calls have 4096 keys or more; every other call keeps the pointer kernel."""
    rows = {"bwd_kv": _GLUON_ROWS["bwd_kv"]} if forced else {}
    launched = _block_sparse_backward_launches(monkeypatch, what, rows)
    assert launched[1] == expected, launched


def test_a_forced_gluon_row_serves_short_rows_too(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Short rows keep the pointer kernel by the table's choice only: a forced Gluon row
    sends them to the Gluon forward (what the GPU tests and block_sparse_probe.py use)."""
    from attnhub import BlockSparseLayout
    from attnhub.backends.triton_blocksparse import ops as bs_ops
    from attnhub.backends.triton_flash import tuning

    launched = _recorded_as_on(monkeypatch, (9, 0), bs_ops)
    layout = BlockSparseLayout.sliding_window(2048, 300, 128)
    q = torch.zeros(1, 2, 2048, 128, dtype=torch.bfloat16)
    bs_ops.block_sparse_attention(q, q, q, layout)
    with tuning.override(fwd=configs.LaunchConfig(128, 128, 4, 2, gluon=True)):
        bs_ops.block_sparse_attention(q, q, q, layout)
    assert launched == ["bs_fwd_kernel", "bs_fwd_gluon_kernel"]
