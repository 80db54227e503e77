"""triton_flash runs a key padding mask as per-batch key ranges (backends/triton_flash/
key_ranges.py), with the answer of the masked call: output, lse and gradients against
float64 (contract.md's tolerance), the keys outside each range never read (they hold
NaN here) and their dK/dV exactly zero. Masks that are not one run of keys per batch
entry keep the mask path. Without CUDA the kernels run in Triton's interpreter on
small shapes; the GPU tests (``-m gpu``) run bf16 and fp16 at model sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import attnhub  # noqa: E402
from attnhub.backends.triton_flash import configs, key_ranges, tuning  # noqa: E402
from attnhub.testing.cases import Case  # noqa: E402
from attnhub.testing.reference import plain_attention  # noqa: E402
from attnhub.testing.tolerance import compare  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def counted(monkeypatch):  # type: ignore[no-untyped-def]
    """The calls that ran in key-range mode."""
    calls: list[torch.Tensor] = []
    real = key_ranges.flash_attention_key_ranges

    def counting(q, k, v, ranges, **options):  # type: ignore[no-untyped-def]
        calls.append(ranges)
        return real(q, k, v, ranges, **options)

    monkeypatch.setattr(key_ranges, "flash_attention_key_ranges", counting)
    return calls


def padding_mask(batch: int, nk: int, runs: list[tuple[int, int]]) -> torch.Tensor:
    """(B, 1, 1, Nk) bool: batch entry b sees keys runs[b][0] .. runs[b][1] - 1."""
    mask = torch.zeros(batch, 1, 1, nk, dtype=torch.bool)
    for b, (lo, hi) in enumerate(runs):
        mask[b, ..., lo:hi] = True
    return mask.to(DEVICE)


def inputs(b, hq, hkv, nq, nk, d, dtype, mask, seed=0):  # type: ignore[no-untyped-def]
    """q, and k/v whose keys outside the mask are NaN (a kernel that reads one fails)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    hidden = ~mask.cpu()[:, 0, 0].expand(b, nk)[:, None, :, None].expand(b, hkv, nk, d)
    k = k.masked_fill(hidden, float("nan"))
    v = v.masked_fill(hidden, float("nan"))
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def _case(q, k, v, options):  # type: ignore[no-untyped-def]
    """The kit's description of the call, for its plain reference."""
    return Case(
        q.dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
        v.shape[3], causal=options.get("causal", False),
        alignment=options.get("alignment", "top_left"), window=options.get("window"),
        softcap=options.get("softcap"), scale=options.get("scale"),
    )  # fmt: skip


def check(q, k, v, mask, options, dtype):  # type: ignore[no-untyped-def]
    """Output, lse and gradients of triton_flash against float64 (the reference on the
    keys the mask keeps: NaN keys zeroed there, which the mask removes anyway)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attnhub.attention(*leaves, mask, backend="triton_flash", return_lse=True, **options)
    g = torch.Generator().manual_seed(7)
    grad = torch.randn(out.shape, generator=g).to(DEVICE, dtype)
    grads = torch.autograd.grad(out, leaves, grad)
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]
    problems = []
    refs = {}
    for ref_dtype in (torch.float64, dtype):
        ref_leaves = [t.to(ref_dtype).requires_grad_() for t in clean]
        if ref_dtype == torch.float64:
            r, rl = attnhub.attention(
                *ref_leaves, mask, backend="torch_reference", return_lse=True, **options
            )
        else:  # r_lp: the kit's plain operations in the inputs' dtype, as contract.md says
            # (torch_reference accumulates half precision in float32: with it as r_lp the
            # bound was about one ulp of the largest gradients, tighter than the contract)
            r, rl = plain_attention(*ref_leaves, mask, _case(q, k, v, options))
        refs[ref_dtype] = (r, rl, *torch.autograd.grad(r, ref_leaves, grad.to(ref_dtype)))
    for name, x, lp, r64 in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), refs[dtype], refs[torch.float64]):  # fmt: skip
        problems.append(compare(name, x, lp, r64))
    kept = mask[:, 0, 0][:, None, :].expand(k.shape[:3])
    for name, d in (("dk", grads[1]), ("dv", grads[2])):
        if not torch.equal(d[~kept], torch.zeros_like(d[~kept])):
            problems.append(f"{name}: not zero at the keys the mask removes")
    assert not [p for p in problems if p], problems


B, HQ, HKV, N, D = 3, 4, 2, 70, 16
RUNS = {
    "right": [(0, N), (0, 33), (0, 0)],  # one entry without keys: zeros, lse -inf
    "left": [(17, N), (0, N), (N - 1, N)],
    "middle": [(10, 40), (64, N), (3, 4)],
}
OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "bottom_right": {"causal": True, "alignment": "bottom_right"},
    "window": {"window": (5, 3)},
    "causal_softcap": {"causal": True, "softcap": 3.0},
}
CASES = [
    ("right", "causal", torch.float32),
    ("left", "bottom_right", torch.float32),
    ("middle", "window", torch.float32),
    ("left", "plain", torch.float32),
    ("right", "causal_softcap", torch.float16),
    ("middle", "causal", torch.float16),
]


@pytest.mark.parametrize(("runs", "options", "dtype"), CASES)
def test_key_padding_masks_run_as_key_ranges(counted, runs, options, dtype):  # type: ignore[no-untyped-def]
    opts = OPTIONS[options]
    nq = 50 if opts.get("alignment") == "bottom_right" else N
    mask = padding_mask(B, N, RUNS[runs])
    q, k, v = inputs(B, HQ, HKV, nq, N, D, dtype, mask)
    check(q, k, v, mask, opts, dtype)
    assert len(counted) == 1
    assert counted[0].tolist() == [[lo, hi] if hi > lo else [0, 0] for lo, hi in RUNS[runs]]


def test_key_ranges_compute_what_the_dense_kernel_computes_on_the_kept_keys():
    """Each batch entry's output and gradients are bitwise the dense kernel's on its
    kept keys alone (top-left causal over keys lo.. is bottom-right causal over the
    slice when lo > 0 and the run ends at Nk): the rewrite changes which tiles are
    visited, not the arithmetic."""
    runs = [(0, N), (0, 33), (20, N)]
    mask = padding_mask(B, N, runs)
    q, k, v = inputs(B, HQ, HKV, N, N, D, torch.float16, mask, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnhub.attention(*leaves, mask, backend="triton_flash", causal=True)
    out.float().square().sum().backward()
    for b, (lo, hi) in enumerate(runs):
        alignment = "top_left" if lo == 0 else "bottom_right"
        one = [t[b : b + 1].clone() for t in (q, k, v)]
        one = [one[0].requires_grad_()] + [t[:, :, lo:hi].requires_grad_() for t in one[1:]]
        want = attnhub.attention(*one, backend="triton_flash", causal=True, alignment=alignment)
        want.float().square().sum().backward()
        assert torch.equal(out[b : b + 1], want), b
        assert torch.equal(leaves[0].grad[b : b + 1], one[0].grad), b
        for got, slice_grad in ((leaves[1].grad, one[1].grad), (leaves[2].grad, one[2].grad)):
            assert torch.equal(got[b : b + 1, :, lo:hi], slice_grad), b


def test_a_mask_shared_by_the_batch_is_read_once_while_it_is_unchanged(counted, monkeypatch):  # type: ignore[no-untyped-def]
    """One (1, 1, 1, Nk) mask for every batch entry; its runs are read on the host once
    per mask tensor (the layers of a forward share it), again after an in-place change."""
    reads = []
    real = key_ranges._runs
    monkeypatch.setattr(key_ranges, "_runs", lambda m: reads.append(1) or real(m))
    mask = padding_mask(1, N, [(5, 60)])
    q, k, v = inputs(B, HQ, HKV, N, N, D, torch.float32, mask.expand(B, 1, 1, N))
    for _ in range(2):
        got = attnhub.attention(q, k, v, mask, backend="triton_flash", causal=True)
    assert len(reads) == 1 and counted[0].tolist() == [[5, 60]] * B
    want = attnhub.attention(*(t.nan_to_num(0.0) for t in (q, k, v)), mask, backend="torch_reference", causal=True)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    mask[..., 59] = False
    attnhub.attention(q, k, v, mask, backend="triton_flash", causal=True)
    assert len(reads) == 2 and counted[-1].tolist() == [[5, 59]] * B


def test_a_patched_decoding_step_never_reads_its_padding_mask(counted, monkeypatch):  # type: ignore[no-untyped-def]
    """A patched model's decoding step passes a fresh (B, 1, 1, Nk) padding mask each
    step: it runs on the decode kernel with the mask as given, never read on the host
    (read, it cost a synchronization and several kernels per step, once for the plan
    and the key ranges together), for every layer of the step."""
    import torch.nn.functional as F

    from attnhub import mask_rows, patching

    monkeypatch.setattr(patching, "STRUCTURED_MASK_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(mask_rows, "_read", lambda m: pytest.fail("the mask was read"))
    mask = padding_mask(B, N, [(0, N), (9, N), (40, N)])  # left padding: the newest kept
    # Finite padded keys: a tile the mask keeps in part is read whole, and a NaN there
    # is the contract's unspecified case.
    q, k, v = (t.nan_to_num(0.0) for t in inputs(B, HQ, HQ, 1, N, D, torch.float32, mask))
    want = attnhub.attention(q, k, v, mask, backend="torch_reference")
    with attnhub.patch(backend="triton_flash"):
        for _ in range(2):  # two layers of one step share the mask
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counted == []  # no key ranges: the decode kernel reads the mask itself


@pytest.mark.parametrize("case", ["hole", "per_head", "per_row", "dropout"])
def test_other_masks_keep_the_mask_path(counted, case):  # type: ignore[no-untyped-def]
    """A run with a hole, a per-head or per-row mask, and dropout (whose random stream
    is indexed by dense key positions) run with the mask as given: the same answer."""
    mask = padding_mask(B, N, RUNS["right"])
    if case == "hole":
        mask[0, ..., 20] = False
    elif case == "per_head":
        mask = mask.expand(B, HQ, 1, N).clone()
        mask[1, 2, 0, :5] = False
    elif case == "per_row":
        mask = mask.expand(B, 1, N, N).clone()
        mask[0, 0, 3, 7] = False
    q, k, v = inputs(B, HQ, HKV, N, N, D, torch.float32, torch.ones(B, 1, 1, N, dtype=torch.bool))
    if case == "dropout":
        torch.manual_seed(3)
        attnhub.attention(q, k, v, mask, backend="triton_flash", dropout_p=0.3)
        assert counted == []
        return
    got = attnhub.attention(q, k, v, mask, backend="triton_flash", causal=True)
    want = attnhub.attention(q, k, v, mask, backend="torch_reference", causal=True)
    assert counted == []
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backward_launches_give_bitwise_the_same_gradients():
    """Two launches and one (both program orders): bitwise the same gradients in key
    range mode, as for dense calls."""
    mask = padding_mask(B, N, RUNS["middle"])
    q, k, v = inputs(B, HQ, HKV, N, N, D, torch.float16, mask, seed=4)
    results = {}
    for mode in configs.BWD_MODES:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with tuning.override(backward_launch=mode):
            out = attnhub.attention(*leaves, mask, backend="triton_flash", causal=True)
            out.float().square().sum().backward()
        results[mode] = [t.grad for t in leaves]
    for mode in configs.BWD_MODES:
        for name, a, b in zip("qkv", results["split"], results[mode]):
            assert torch.equal(a, b), f"{mode}: d{name} differs from split"


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("options", ["causal", "bottom_right", "window", "plain"])
@pytest.mark.parametrize("path", ["ranges", "mask"])
def test_gpu_key_ranges_at_model_sizes(counted, monkeypatch, dtype, d, options, path):  # type: ignore[no-untyped-def]
    """B4, Hq 8 / Hkv 2, N 1500 (ragged tiles), right padding as a batch of prompts has it
    and left padding as generation has it, one entry without keys; in key-range mode and,
    for comparison, through the mask path."""
    if path == "mask":
        monkeypatch.setattr(key_ranges, "ranges_of", lambda *args: None)
    opts = dict(OPTIONS[options])
    if options == "window":
        opts["window"] = (300, 40)
    n = 1500
    nq = 700 if options == "bottom_right" else n
    runs = [(0, n), (0, 1023), (477, n), (0, 0)]
    mask = padding_mask(4, n, runs)
    q, k, v = inputs(4, 8, 2, nq, n, d, dtype, mask, seed=d)
    if path == "mask":  # it reads the keys it masks (0 * NaN): the same values, no NaN
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    check(q, k, v, mask, opts, dtype)
    assert len(counted) == (path == "ranges")


@gpu
@requires_cuda
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_key_range_plans_take_each_calls_ranges(monkeypatch, count_jit_runs, d):  # type: ignore[no-untyped-def]
    """Key-range calls reuse cached launch plans (ops._PLANS): from a key's third call
    on, forward and backward skip Triton's binder, and each call runs on its own ranges,
    never a recorded call's. Each call's keys outside its ranges are NaN, so a plan that
    kept earlier ranges reads NaN; output, lse and gradients equal, bitwise, the full
    path's on the same inputs (dK/dV outside the ranges exactly zero)."""
    from attnhub.backends.triton_flash import kernels, ops

    jit_runs = count_jit_runs(
        kernels.attn_fwd_kernel, kernels.attn_bwd_preprocess_kernel, kernels.attn_bwd_kernel,
        kernels.attn_bwd_dkdv_kernel, kernels.attn_bwd_dq_kernel,
    )  # fmt: skip
    n = 300
    paddings = [
        [(0, n), (0, 130), (0, 0)],
        [(0, n), (0, 130), (0, 0)],  # the key's second call: records the plans
        [(41, n), (0, 1), (0, n)],
        [(0, 0), (299, n), (7, 200)],
    ]

    def step(runs):  # type: ignore[no-untyped-def]
        mask = padding_mask(3, n, runs)
        q, k, v = inputs(3, 4, 2, n, n, d, torch.bfloat16, mask, seed=runs[1][1])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ranges = key_ranges.ranges_of(mask, *leaves, 0.0)
        out, lse = key_ranges.flash_attention_key_ranges(*leaves, ranges, causal=True)
        dout = torch.randn_like(out)
        loss = (out * dout).sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()
        return (out, lse, *torch.autograd.grad(loss, leaves))

    full = []
    with monkeypatch.context() as m:  # a replaced launcher: no plans (ops._plan_key)
        m.setattr(ops, "_launcher", lambda kernel, like: ops._default_launcher(kernel, like))
        for i, runs in enumerate(paddings):
            torch.manual_seed(i)
            full.append(step(runs))
    ops.clear_plans()
    for i, runs in enumerate(paddings):
        torch.manual_seed(i)
        jit_runs.clear()
        planned = step(runs)
        assert (jit_runs == []) == (i >= 2), (i, jit_runs)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), planned, full[i]):
            assert torch.equal(a, b), (i, name)
        assert not planned[0].isnan().any() and not planned[3].isnan().any()
    ops.clear_plans()


def test_a_mask_made_under_inference_mode_is_read_at_every_call(counted):
    """An inference tensor has no version counter (reading it raised RuntimeError): its
    runs are read at every call, so an in-place change inside inference mode is seen."""
    with torch.inference_mode():
        mask = padding_mask(B, N, RUNS["right"])
        q, k, v = inputs(
            B, HQ, HKV, N, N, D, torch.float32, torch.ones(B, 1, 1, N, dtype=torch.bool)
        )
        for _ in range(2):
            got = attnhub.attention(q, k, v, mask, backend="triton_flash", causal=True)
            want = attnhub.attention(q, k, v, mask, backend="torch_reference", causal=True)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            mask[1, ..., 20:] = False
    assert [r.tolist()[1] for r in counted] == [[0, 33], [0, 20]]


def test_a_mask_of_fewer_dims_is_read_once_too(counted, monkeypatch):
    """attnhub.attention views an (Nk,) mask as (1, 1, 1, Nk) anew at every call: the
    memo knows a view by its base and geometry, so the runs are read once (they were
    read at every call)."""
    reads = []
    real = key_ranges._runs
    monkeypatch.setattr(key_ranges, "_runs", lambda m: reads.append(1) or real(m))
    mask = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    mask[3:50] = True
    q, k, v = inputs(B, HQ, HKV, N, N, D, torch.float32, mask.expand(B, 1, 1, N))
    for _ in range(3):
        attnhub.attention(q, k, v, mask, backend="triton_flash")
    assert len(reads) == 1 and len(counted) == 3 and counted[0].tolist() == [[3, 50]] * B
    mask[49] = False  # the base changed in place: read again
    attnhub.attention(q, k, v, mask, backend="triton_flash")
    assert len(reads) == 2 and counted[-1].tolist() == [[3, 49]] * B


@pytest.mark.parametrize(
    "bad",
    [
        lambda r: r.long(),
        lambda r: r[:1],
        lambda r: r.t().contiguous().t(),
    ],
    ids=["int64", "short", "strided"],
)
def test_ranges_that_the_kernels_cannot_index_are_refused(bad):
    """flash_attention_key_ranges takes ranges_of's tensors only: any other dtype, shape
    or layout is a ValueError naming ``ranges`` before a kernel could read past it."""
    q, k, v = (torch.randn(B, HQ, N, D, device=DEVICE) for _ in range(3))
    good = torch.tensor([[0, N]] * B, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ranges: expected"):
        key_ranges.flash_attention_key_ranges(q, k, v, bad(good))
