"""triton_blocksparse: forward and backward against the float64 reference with the
layout's dense mask, in Triton's interpreter (float32, float16) on CPU.

The reference is ``reference_attention`` with the same ``block_sparse`` layout (it
applies ``layout.to_dense_mask``); the tolerance rule is contract.md's (via
attnhub.testing.tolerance). GPU cases are marked ``gpu`` and skipped without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import attnhub  # noqa: E402
from attnhub import BlockSparseLayout  # noqa: E402
from attnhub.backends.torch_reference import reference_attention  # noqa: E402
from attnhub.backends.triton_blocksparse import TritonBlockSparse, ops  # noqa: E402
from attnhub.request import AttentionParams  # noqa: E402
from attnhub.testing.tolerance import assert_matches_reference  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16]
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
interpreter_only = pytest.mark.skipif(HAS_CUDA, reason="checks the interpreter's CPU declaration")


def _random_layout(b, h, nq, nk, block, density, seed):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    bq, bk = (block, block) if isinstance(block, int) else block
    shape = (b, h, -(-nq // bq), -(-nk // bk))
    return BlockSparseLayout.from_block_mask(torch.rand(shape, generator=gen) < density, block)


def _run(layout, q, k, v, dout, mask=None, **kw):  # type: ignore[no-untyped-def]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = ops.block_sparse_attention(q, k, v, layout.to(q.device), mask, **kw)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _ref(layout, q, k, v, dout, dtype, mask=None, causal=False, bottom_right=False,
         window=None, softcap=None):  # type: ignore[no-untyped-def]  # fmt: skip
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    params = AttentionParams(
        causal=causal, alignment="bottom_right" if bottom_right else "top_left", window=window,
        softcap=softcap, scale=q.shape[-1] ** -0.5, block_sparse=layout.to(q.device),
    )  # fmt: skip
    out, lse = reference_attention(q, k, v, mask, params)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _check(layout, dtype, b, hq, hkv, nq, nk, d, mask=None, qkv=None, dout=None, **kw):  # type: ignore[no-untyped-def]
    if qkv is None:
        q = torch.randn(b, hq, nq, d, dtype=dtype, device=DEVICE)
        k = torch.randn(b, hkv, nk, d, dtype=dtype, device=DEVICE)
        v = torch.randn(b, hkv, nk, d, dtype=dtype, device=DEVICE)
    else:
        q, k, v = qkv
    if dout is None:
        dout = torch.randn(b, hq, nq, d, dtype=dtype, device=DEVICE)
    got = _run(layout, q, k, v, dout, mask, scale=d**-0.5, **kw)
    r64 = _ref(layout, q, k, v, dout, torch.float64, mask, **kw)
    rlp = _ref(layout, q, k, v, dout, dtype, mask, **kw)
    for name, x, lp, r in zip(("out", "lse", "dq", "dk", "dv"), got, rlp, r64):
        assert_matches_reference(x, lp, r, name)
    empty = torch.isinf(r64[1])
    assert (got[0][empty] == 0).all() and (got[2][empty] == 0).all()
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_random_layouts(dtype: torch.dtype, density: float) -> None:
    torch.manual_seed(int(density * 10))
    layout = _random_layout(1, 2, 192, 192, 64, density, seed=int(density * 100))
    _check(layout, dtype, 1, 2, 2, 192, 192, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_empty_rows_and_ragged(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    keep = torch.rand(1, 1, 3, 2) < 0.6
    keep[0, 0, 1] = False  # a query block with no kept key block
    layout = BlockSparseLayout.from_block_mask(keep, 64)
    got = _check(layout, dtype, 1, 2, 2, 150, 100, 40)
    assert torch.isinf(got[1][:, :, 64:128]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("bottom_right", [False, True], ids=["tl", "br"])
def test_causal_combined(dtype: torch.dtype, bottom_right: bool) -> None:
    torch.manual_seed(2)
    layout = _random_layout(1, 1, 130, 200, 64, 0.6, seed=3)
    _check(layout, dtype, 1, 2, 2, 130, 200, 32, causal=True, bottom_right=bottom_right)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, requires_cuda])])
def test_a_float_mask_call_without_lse_derives_none(
    device: str, check_lse_derived_only_when_returned: Any
) -> None:
    """As triton_flash's: a float mask's call derives its lse from the row stats only
    where it returns one (the backend passes params.return_lse); without it, the output
    and gradients of the call with it, bitwise. On CUDA each runs three times: the third
    call replays the cached launch plans (the CPU has none)."""
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layout = _random_layout(1, 2, 130, 150, 64, 0.6, seed=6).to(device)
    mask = torch.randn(1, 1, 130, 150, device=device, dtype=dtype)
    mask[:, :, 5] = torch.finfo(dtype).min  # a hidden row
    inputs = [torch.randn(1, 2, n, 16, device=device, dtype=dtype) for n in (130, 150, 150)]
    dout = torch.randn(1, 2, 130, 16, device=device, dtype=dtype)
    check_lse_derived_only_when_returned(
        lambda leaves, return_lse: ops.block_sparse_attention(
            *leaves, layout, mask, return_lse=return_lse
        ),
        inputs, dout, 3 if device == "cuda" else 1,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_gqa_and_head_broadcast_layout(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    layout = _random_layout(2, 4, 128, 128, 64, 0.5, seed=4)  # per batch and head
    _check(layout, dtype, 2, 4, 2, 128, 128, 16)
    layout = _random_layout(1, 4, 128, 128, 64, 0.5, seed=5)  # batch broadcast
    _check(layout, dtype, 2, 4, 1, 128, 128, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_partial_blocks_causal_layout(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    _check(BlockSparseLayout.causal(170, 64), dtype, 1, 2, 2, 170, 170, 32)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16,
     pytest.param(torch.bfloat16, marks=[gpu, requires_cuda])],  # not in the interpreter
    ids=SHORT.get,
)  # fmt: skip
def test_rows_hidden_by_the_most_negative_float_keep_their_gradients(dtype: torch.dtype) -> None:
    """A float mask of finfo.min on whole rows (a model's padding rows): every kept key
    of such a row ties (finfo.min plus a score rounds to finfo.min in float32 for fp32
    and bf16; fp16's -65504 leaves the scores' differences), and
    its weights are 1 / (keys it sees) in the forward and the backward alike (the
    backward took each as 1 when the row's lse was all it had: fp32 failed, fp16 kept
    enough bits). Under a causal layout row i sees i + 1 keys: counts of 1 to 80."""
    torch.manual_seed(6)
    b, h, n, d = 1, 2, 150, 32
    q, k, v, dout = (torch.randn(b, h, n, d, dtype=dtype, device=DEVICE) for _ in range(4))
    mask = torch.randn(b, 1, n, n, dtype=dtype, device=DEVICE)
    mask[..., :80, :] = torch.finfo(dtype).min
    layout = BlockSparseLayout.causal(n, 64)
    got = _run(layout, q, k, v, dout, mask, scale=d**-0.5, causal=True)
    r64 = _ref(layout, q, k, v, dout, torch.float64, mask, causal=True)
    rlp = _ref(layout, q, k, v, dout, dtype, mask, causal=True)
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        assert_matches_reference(got[i], rlp[i], r64[i], name)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_partial_blocks_sliding_window(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    layout = BlockSparseLayout.sliding_window(200, 50, 64, causal=False)
    _check(layout, dtype, 1, 2, 1, 200, 200, 32, softcap=3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_partial_blocks_with_even_lengths(dtype: torch.dtype) -> None:
    # N a multiple of the block and no band: the full blocks take the flat loop
    # (EVEN_BLOCKS) while partial ones (the window's diagonal and left edge) are masked.
    torch.manual_seed(8)
    layout = BlockSparseLayout.sliding_window(256, 200, 64)
    assert (layout.block_mask & ~layout.full_mask).any() and layout.full_mask.any()
    _check(layout, dtype, 1, 2, 1, 256, 256, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_partial_blocks_with_even_lengths_per_head(dtype: torch.dtype) -> None:
    # The flat loops of even calls (EVEN_BLOCKS) over a per-batch, per-head layout read
    # through GQA: rows and columns with two, one and no partial block (odd heads have
    # only full blocks), and a query row (and key columns) with no block at all.
    torch.manual_seed(9)

    def mod(b, h, q, kv):  # type: ignore[no-untyped-def]
        qb, kb = q // 64, kv // 64
        full = kb == (qb + h + b) % 3
        part = ((q + 2 * kv + h) % 5 != 0) & (
            ((h == 0) & (kb != (qb + b) % 3)) | ((h == 2) & (kb == (qb + b) % 3))
        )
        return (full | part) & ~((qb == 1) & (h == 3))

    layout = BlockSparseLayout.from_mask_mod(mod, 192, 192, 64, batch=2, heads=4)
    n_part = (layout.block_mask & ~layout.full_mask).sum(-1)
    assert n_part.amax() == 2 and (n_part[:, 1::2] == 0).all() and layout.full_mask.any()
    assert not layout.block_mask[:, 3, 1].any()
    _check(layout, dtype, 2, 4, 2, 192, 192, 16)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_packed_and_strided_inputs_in_one_call(dtype: torch.dtype) -> None:
    """Q and dO through a transpose ((B, N, H, D) storage), K/V packed: the forward and dQ
    kernels stream K/V with constant row strides (STRIDE_KN/STRIDE_VN), dK/dV streams
    Q/dO with runtime ones (triton_flash.ops._row_strides). Even lengths (the flat loops)
    and a causal call on ragged ones (the per-block loops)."""
    from attnhub.backends.triton_flash.ops import _row_strides

    torch.manual_seed(12)
    for n, kw in ((192, {}), (150, {"causal": True})):
        q, dout = (torch.randn(1, n, 4, 32, dtype=dtype, device=DEVICE).transpose(1, 2)
                   for _ in range(2))  # fmt: skip
        k, v = (torch.randn(1, 2, n, 32, dtype=dtype, device=DEVICE) for _ in range(2))
        assert _row_strides(Q=q, DO=dout, K=k, V=v) == {
            "STRIDE_QM": 0, "STRIDE_DOM": 0, "STRIDE_KN": 32, "STRIDE_VN": 32
        }  # fmt: skip
        layout = BlockSparseLayout.sliding_window(n, 100, 64)
        _check(layout, dtype, 1, 4, 2, n, n, 32, qkv=(q, k, v), dout=dout, **kw)


def test_mask_mod_per_head_with_window_and_float_mask() -> None:
    torch.manual_seed(6)

    def mod(b, h, q, kv):  # type: ignore[no-untyped-def]
        return ((q + kv + h) % 3) != 0

    layout = BlockSparseLayout.from_mask_mod(mod, 100, 140, 64, heads=2)
    mask = torch.randn(100, 140, device=DEVICE)
    _check(layout, torch.float32, 1, 2, 2, 100, 140, 16, mask=mask, window=(30, 20))


def test_block_128_and_rectangular_blocks() -> None:
    torch.manual_seed(7)
    layout = _random_layout(1, 1, 256, 200, 128, 0.7, seed=8)
    _check(layout, torch.float16, 1, 1, 1, 256, 200, 16)
    layout = _random_layout(1, 1, 100, 130, (32, 64), 0.6, seed=9)
    _check(layout, torch.float32, 1, 1, 1, 100, 130, 16, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_dropped_blocks_are_never_read(dtype: torch.dtype) -> None:
    """NaN in the K/V rows of key blocks no query block keeps: the answer equals the
    reference on the clean tensors (so those rows were never loaded)."""
    torch.manual_seed(8)
    keep = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    keep[..., 1] = False
    keep[0, 0, 2, 3] = False
    keep[0, 0, 0, 3] = False
    keep[0, 0, 1, 3] = False  # key block 3 (ragged tail) dropped everywhere too
    layout = BlockSparseLayout.from_block_mask(keep, 64)
    q = torch.randn(1, 2, 150, 32, dtype=dtype, device=DEVICE)
    k = torch.randn(1, 2, 230, 32, dtype=dtype, device=DEVICE)
    v = torch.randn(1, 2, 230, 32, dtype=dtype, device=DEVICE)
    dout = torch.randn(1, 2, 150, 32, dtype=dtype, device=DEVICE)
    kn, vn = k.clone(), v.clone()
    for t in (kn, vn):
        t[:, :, 64:128] = float("nan")
        t[:, :, 192:] = float("nan")
    got = _run(layout, q, kn, vn, dout, scale=32**-0.5)
    for x in got[:3]:
        assert torch.isfinite(x).all() or x is got[1]
    assert not torch.isnan(got[1]).any()
    r64 = _ref(layout, q, k, v, dout, torch.float64)
    rlp = _ref(layout, q, k, v, dout, dtype)
    for name, x, lp, r in zip(("out", "lse", "dq"), got[:3], rlp, r64):
        assert_matches_reference(x, lp, r, name)
    keep_rows = torch.ones(230, dtype=torch.bool)
    keep_rows[64:128] = False
    keep_rows[192:] = False
    assert_matches_reference(
        got[3][:, :, keep_rows], rlp[3][:, :, keep_rows], r64[3][:, :, keep_rows], "dk"
    )
    assert_matches_reference(
        got[4][:, :, keep_rows], rlp[4][:, :, keep_rows], r64[4][:, :, keep_rows], "dv"
    )
    assert (got[3][:, :, ~keep_rows] == 0).all() and (got[4][:, :, ~keep_rows] == 0).all()


def test_dropout_full_layout_matches_triton_flash() -> None:
    """With every block kept, dropout draws triton_flash's Philox stream exactly."""
    from attnhub.backends.triton_flash import ops as flash_ops

    torch.manual_seed(9)
    q, k, v = (torch.randn(1, 2, 100, 32, device=DEVICE) for _ in range(3))
    dout = torch.randn(1, 2, 100, 32, device=DEVICE)
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 64)
    torch.manual_seed(10)
    got = _run(layout, q, k, v, dout, causal=True, dropout_p=0.3)
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(10)
    out, lse = flash_ops.flash_attention(qd, kd, vd, causal=True, dropout_p=0.3)
    out.backward(dout)
    for x, y in zip(got, (out, lse, qd.grad, kd.grad, vd.grad)):
        assert (x - y.detach()).abs().max().item() < 1e-4


def test_lse_gradient() -> None:
    torch.manual_seed(11)
    layout = BlockSparseLayout.causal(96, 64, device=DEVICE)
    q, k, v = (torch.randn(1, 1, 96, 16, dtype=torch.float64, device=DEVICE, requires_grad=True)
               for _ in range(3))  # fmt: skip
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = ops.block_sparse_attention(q32, k32, v32, layout)
    (out.sum() + lse.sum()).backward()
    params = AttentionParams(scale=16**-0.5, block_sparse=layout)
    ro, rl = reference_attention(q, k, v, None, params)
    (ro.sum() + rl.sum()).backward()
    for x, r in ((q32.grad, q.grad), (k32.grad, k.grad), (v32.grad, v.grad)):
        assert (x.double() - r).abs().max().item() < 1e-4


def test_forward_and_backward_are_bitwise_repeatable() -> None:
    """Declared deterministic: the same call twice gives identical bits, grads included."""
    layout = _random_layout(1, 2, 100, 90, 32, 0.6, seed=4).to(DEVICE)
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, n, 32, device=DEVICE, requires_grad=True) for n in (100, 90, 90))
    dout = torch.randn(1, 2, 100, 32, device=DEVICE)
    runs = []
    for _ in range(2):
        out = attnhub.attention(
            q, k, v, block_sparse=layout, causal=True, backend="triton_blocksparse"
        )
        runs.append([out.detach(), *torch.autograd.grad(out, (q, k, v), dout)])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_layout_tensors_are_compact_and_cached() -> None:
    layout = BlockSparseLayout.causal(64 * 40, 64)
    first = ops.layout_tensors(layout, torch.device("cpu"))
    assert ops.layout_tensors(layout, torch.device("cpu")) is first
    # The launch-plan key the list carries is the one its tensors give.
    assert ops._index_key(first) == ops._index_key(list(first))
    tiles = first[10]
    assert tiles.shape == (40, 64, 64)  # one token mask per diagonal block: linear in N
    assert torch.equal(tiles[0].bool(), torch.ones(64, 64, dtype=torch.bool).tril())


def test_partial_tiles_of_a_row_are_numbered_consecutively() -> None:
    # The forward's flat partial-block loop steps its token-mask pointer from one tile to
    # the next (no index load), which holds only if each row's partial blocks have
    # consecutive tile numbers, in the order PartIdx lists them.
    per_head = BlockSparseLayout.from_mask_mod(
        lambda b, h, q, kv: ((q + 7 * h + b) // 50 + kv // 40) % 3 == 0, 380, 380, 64,
        batch=2, heads=3,
    )  # fmt: skip
    for layout in (BlockSparseLayout.sliding_window(64 * 9, 150, 64), per_head):
        _, _, pnum, _, ptile = ops.layout_tensors(layout, torch.device("cpu"))[:5]
        steps = torch.arange(ptile.shape[-1], dtype=torch.int32)
        kept = steps < pnum[..., None]
        assert pnum.sum() > 0
        assert torch.equal((ptile - ptile[..., :1])[kept], steps.expand_as(ptile)[kept])


def test_program_order_puts_heavy_blocks_first() -> None:
    # BigBird's 2 global rows (and columns) keep every block; the rest keep a window
    # and 1 random block, far below twice the mean.
    layout = BlockSparseLayout.bigbird(64 * 32, 64, global_blocks=2, random_blocks=1)
    *_, row_order, col_order = ops.layout_tensors(layout, torch.device("cpu"))
    facts = ops._facts[layout]
    assert (facts.heavy_rows, facts.heavy_cols) == (2, 2)
    assert sorted(row_order[:2].tolist()) == [0, 1] and sorted(col_order[:2].tolist()) == [0, 1]
    assert sorted(row_order.tolist()) == list(range(32))  # a permutation of the blocks
    kept = layout.block_mask.sum(dim=(0, 1, 3))[row_order.long()]
    assert (kept[:-1] >= kept[1:]).all()  # heaviest first
    # A random layout has nothing far above its mean: heads are not interleaved.
    random_layout = _random_layout(1, 1, 64 * 16, 64 * 16, 64, 0.5, seed=9)
    ops.layout_tensors(random_layout, torch.device("cpu"))
    assert ops._facts[random_layout][1:3] == (0, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_heavy_rows_first_with_ragged_tiles_and_gqa(dtype: torch.dtype) -> None:
    # Per (batch, head) layouts with global rows and columns (so the programs of every
    # head's heavy blocks run first, heads interleaved), a ragged last block (its tiles
    # past N return at once), GQA, and query/key lengths that differ.
    torch.manual_seed(11)
    keep = torch.rand(1, 4, 8, 9, generator=torch.Generator().manual_seed(12)) < 0.1
    keep[:, :, 0] = True  # a global query block
    keep[:, :, :, 8] = True  # a global (ragged) key block
    layout = BlockSparseLayout.from_block_mask(keep, 64)
    ops.layout_tensors(layout, torch.device(DEVICE))
    assert ops._facts[layout].heavy_rows >= 1 and ops._facts[layout].heavy_cols >= 1
    _check(layout, dtype, 1, 4, 2, 64 * 7 + 8, 64 * 8 + 4, 16)


@interpreter_only
def test_declarations_and_dispatch() -> None:
    import attnhub

    backend = TritonBlockSparse()
    assert backend.block_sparse and backend.memory == "linear"
    assert backend.devices == frozenset({"cuda", "cpu"}) and backend.unavailable_reason() is None
    q = torch.randn(1, 2, 100, 16)
    layout = BlockSparseLayout.causal(100, 64)
    decision = attnhub.explain(q, q, q, block_sparse=layout)
    assert decision.chosen == "triton_blocksparse", str(decision)
    out, lse = attnhub.attention(q, q, q, block_sparse=layout, return_lse=True)
    ref, ref_lse = attnhub.attention(
        q, q, q, causal=True, return_lse=True, backend="torch_reference"
    )
    assert (out - ref).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5
    dense = attnhub.explain(q, q, q, causal=True)
    assert dense.chosen != "triton_blocksparse"
    reasons = dict((c.name, c.reasons) for c in dense.candidates)["triton_blocksparse"]
    assert any("only serves block_sparse" in r for r in reasons)


def test_without_interpreter_it_declares_cuda_like_triton_flash() -> None:
    code = (
        "from attnhub.backends.triton_blocksparse import TritonBlockSparse as T; "
        "from attnhub.backends.triton_flash import TritonFlash as F; b, f = T(), F(); "
        "print(sorted(b.devices), b.min_capability, b.unavailable_reason() == f.unavailable_reason())"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)  # fmt: skip
    assert result.stdout.strip() == "['cuda'] (9, 0) True"


def test_unsupported_block_size_is_declined_at_dispatch_and_raises_in_the_op() -> None:
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    layout = BlockSparseLayout.from_block_mask(mask, 48)
    q = torch.randn(1, 1, 96, 16, device=DEVICE)
    decision = attnhub.explain(q, q, q, block_sparse=layout)
    assert decision.chosen != "triton_blocksparse"
    assert decision.reasons()["triton_blocksparse"] == [
        "block_size (48, 48) is not supported (each side must be one of (16, 32, 64, 128): "
        "the kernel's tile is the layout's block)"
    ]
    with pytest.raises(ValueError, match="block_size"):
        ops.block_sparse_attention(q, q, q, layout)


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=SHORT.get)
@pytest.mark.parametrize("block", [64, 128])
def test_gpu_large(dtype: torch.dtype, block: int) -> None:
    """Model sizes past SHORT_N keys at D=128: the non-causal calls take the family's
    own dQ launch (ops._OWN_CONFIGS on sm_90), the causal ones triton_flash's table."""
    torch.manual_seed(12)
    for layout, causal in (
        (_random_layout(2, 4, 2048, 2048, block, 0.3, seed=13), True),
        (_random_layout(2, 4, 2048, 2048, block, 0.3, seed=14), False),
        (BlockSparseLayout.sliding_window(2048, 300, block), False),
        (BlockSparseLayout.bigbird(2048, block), True),
    ):
        _check(layout, dtype, 2, 4, 2, 2048, 2048, 128, causal=causal)


def _no_key_rows(b, h, q, kv):  # type: ignore[no-untyped-def]
    """Token-level: the first 5 rows of every 128-row block keep no key; the rest every
    key but one in three (so every block is partial)."""
    return (q % 128 >= 5) & ((q + kv) % 3 != 0)


def _with_empty_row(layout_mask: torch.Tensor) -> BlockSparseLayout:
    layout_mask[..., 3, :] = False  # query block 3 keeps no key block
    return BlockSparseLayout.from_block_mask(layout_mask, 128)


# Layouts the Gluon forward serves (bq = 128, Nq and Nk block multiples, no band): full
# blocks only (some rows without a block), full then partial blocks (a window), partial
# blocks only, rows with no key inside partial blocks, 128 x 64 blocks, per-head layouts;
# and 128 x 128 blocks walked in 64-key tiles (the forced row's, _GLUON_KEY_TILES).
_GLUON_KEY_TILES = {"window_in_64_key_tiles": 64}
_GLUON_LAYOUTS = {
    "window_in_64_key_tiles": lambda: BlockSparseLayout.sliding_window(2048, 300, 128),
    "full_blocks_and_an_empty_row": lambda: _with_empty_row(
        torch.rand(2, 4, 16, 16, generator=torch.Generator().manual_seed(31)) < 0.3
    ),
    "window_full_and_partial": lambda: BlockSparseLayout.sliding_window(2048, 300, 128),
    "window_partial_only": lambda: BlockSparseLayout.sliding_window(2048, 50, 128),
    "rows_without_keys": lambda: BlockSparseLayout.from_mask_mod(_no_key_rows, 2048, 2048, 128),
    "rect_128x64_window": lambda: BlockSparseLayout.sliding_window(2048, 200, (128, 64)),
    "rect_128x64_random": lambda: _random_layout(1, 4, 2048, 2048, (128, 64), 0.4, seed=32),
}


@gpu
@pytest.mark.skipif(
    not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=SHORT.get)
@pytest.mark.parametrize("name", sorted(_GLUON_LAYOUTS))
def test_gpu_gluon_forward(dtype: torch.dtype, name: str, launched_kernels: list[str]) -> None:
    """The calls ops._gluon_ok admits run kernels_gluon.bs_fwd_gluon_kernel under a
    forced Gluon row (seen to launch; see ops._GLUON_MIN_KEYS) and keep the contract
    against the float64 reference: output, lse, rows with no key (zeros, -inf), and the
    gradients through it (the pointer backward reads its lse). GQA, and (B, N, H, D)
    views for half the layouts."""
    from attnhub.backends.triton_flash import configs, tuning

    torch.manual_seed(33)
    layout = _GLUON_LAYOUTS[name]()
    b, hq, hkv, n = 2, 4, 2, 2048
    qkv = None
    if name.startswith(("window", "rect_128x64_random")):  # strided views
        qkv = tuple(torch.randn(b, n, h, 128, dtype=dtype, device="cuda").transpose(1, 2)
                    for h in (hq, hkv, hkv))  # fmt: skip
    row = configs.LaunchConfig(128, _GLUON_KEY_TILES.get(name, 128), 4, 2, gluon=True)
    with tuning.override(fwd=row):
        _check(layout, dtype, b, hq, hkv, n, n, 128, qkv=qkv)
    assert launched_kernels[0] == "bs_fwd_gluon_kernel", launched_kernels


@gpu
@pytest.mark.skipif(
    not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU"
)
@pytest.mark.parametrize("roles", ["bwd_q", "bwd_kv", "bwd_kv+bwd_q"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=SHORT.get)
@pytest.mark.parametrize("name", sorted(_GLUON_LAYOUTS))
def test_gpu_gluon_backward(
    dtype: torch.dtype, name: str, roles: str, launched_kernels: list[str]
) -> None:
    """The Gluon backward kernels (kernels_gluon.bs_bwd_dq_gluon_kernel, and for 128-key
    blocks bs_bwd_dkdv_gluon_kernel) under forced rows, each alone (the other role on
    its pointer row) and both, on the layouts the Gluon forward serves: seen to launch,
    and the contract against the float64 reference (the gradients; rows with no key get
    zeros). GQA 2:1, and (B, N, H, D) views for half the layouts."""
    from attnhub.backends.triton_blocksparse import ops as bs_ops
    from attnhub.backends.triton_flash import configs, tuning

    torch.manual_seed(34)
    layout = _GLUON_LAYOUTS[name]()
    b, hq, hkv, n = 2, 4, 2, 2048
    qkv = None
    if name.startswith(("window", "rect_128x64_random")):  # strided views
        qkv = tuple(torch.randn(b, n, h, 128, dtype=dtype, device="cuda").transpose(1, 2)
                    for h in (hq, hkv, hkv))  # fmt: skip
    like = torch.empty(1, 1, 1, 128, dtype=dtype, device="cuda")
    rows = {role: bs_ops._launch_config(role, 128, like, False, n) for role in configs.GLUON_BWD}
    rows.update({role: configs.GLUON_BWD[role] for role in roles.split("+")})
    with tuning.override(**rows):
        _check(layout, dtype, b, hq, hkv, n, n, 128, qkv=qkv)
    dq_gluon = "bwd_q" in roles
    dkdv_gluon = "bwd_kv" in roles and layout.block_size[1] == 128
    assert ("bs_bwd_dq_gluon_kernel" in launched_kernels) == dq_gluon, launched_kernels
    assert ("bs_bwd_dkdv_gluon_kernel" in launched_kernels) == dkdv_gluon, launched_kernels


@gpu
@requires_cuda
@pytest.mark.parametrize("partial", [False, True], ids=["full_blocks", "partial_blocks"])
def test_gpu_plans_take_each_calls_layout(monkeypatch, count_jit_runs, partial: bool) -> None:  # type: ignore[no-untyped-def]
    """Eager block-sparse calls reuse cached launch plans (triton_flash's ops._PLANS):
    from a key's third call on, forward and backward skip Triton's binder, and layouts
    of one geometry and the same facts share the plan, each call launched on its own
    block lists (a plan that kept the recording call's lists would compute another
    layout). Output, lse and gradients equal, bitwise, the full path's."""
    from attnhub.backends.triton_blocksparse import kernels
    from attnhub.backends.triton_flash import kernels as flash_kernels
    from attnhub.backends.triton_flash import ops as flash_ops

    jit_runs = count_jit_runs(
        kernels.bs_fwd_kernel, kernels.bs_bwd_dkdv_kernel, kernels.bs_bwd_dq_kernel,
        flash_kernels.attn_bwd_preprocess_kernel,
    )  # fmt: skip
    n, block = 1000, 64  # ragged last blocks
    if partial:  # token masks of their own, 41, 40 and 43 of them (not in the plan's key)
        layouts = [BlockSparseLayout.sliding_window(n, w, block) for w in (200, 200, 250, 130)]
    else:
        layouts = [_random_layout(1, 4, n, n, block, 0.5, seed=s) for s in (1, 1, 2, 3)]
    facts = set()
    for layout in layouts:
        ops.layout_tensors(layout, torch.device("cuda"))
        facts.add(ops._facts[layout])
    assert len(facts) == 1, "the layouts must share one plan key"
    torch.manual_seed(21)
    q, k, v = (torch.randn(2, 4, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    dout = torch.randn(2, 4, n, 128, device="cuda", dtype=torch.bfloat16)

    def step(layout):  # type: ignore[no-untyped-def]
        out, lse = ops.block_sparse_attention(q, k, v, layout.to("cuda"))
        loss = (out * dout).sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()
        return (out, lse, *torch.autograd.grad(loss, (q, k, v)))

    with monkeypatch.context() as m:  # a replaced launcher: no plans (ops._plan_key)
        m.setattr(
            flash_ops, "_launcher", lambda kernel, like: flash_ops._default_launcher(kernel, like)
        )
        full = [step(layout) for layout in layouts]
    flash_ops.clear_plans()
    for i, layout in enumerate(layouts):
        jit_runs.clear()
        planned = step(layout)
        assert (jit_runs == []) == (i >= 2), (i, jit_runs)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), planned, full[i]):
            assert torch.equal(a, b), (i, name)
    assert not torch.equal(full[2][0], full[3][0])
    flash_ops.clear_plans()


def test_own_launch_rows_apply_where_measured_and_yield_to_overrides(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """ops._launch_config: the family's own dQ row for 2-byte D=128 non-causal calls past
    SHORT_N keys on sm_90, and triton_flash's table for everything else (causal, short,
    float32, another GPU, the interpreter); a tuning.override of the direction wins."""
    from attnhub.backends.triton_flash import configs, tuning

    monkeypatch.setattr(ops, "interpreting", lambda: False)
    monkeypatch.setattr(ops, "_capability", lambda device: (9, 0))
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    n = configs.SHORT_N + 1
    own = ops._OWN_CONFIGS[("bwd_q", 128, 2, False, (9, 0))]
    assert ops._launch_config("bwd_q", 128, q, False, n) == own
    assert own != configs.launch_config("bwd_q", 128, 2, False, (9, 0), False, n)
    table = {
        "causal": (("bwd_q", 128, q, True, n), ("bwd_q", 128, 2, True, (9, 0), False, n)),
        "short": (("bwd_q", 128, q, False, configs.SHORT_N), ("bwd_q", 128, 2, False, (9, 0), False, configs.SHORT_N)),
        "float32": (("bwd_q", 128, q.float(), False, n), ("bwd_q", 128, 4, False, (9, 0), False, n)),
        "dK/dV": (("bwd_kv", 128, q, False, n), ("bwd_kv", 128, 2, False, (9, 0), False, n)),
    }  # fmt: skip
    for name, (ours, theirs) in table.items():
        assert ops._launch_config(*ours) == configs.launch_config(*theirs), name
    with tuning.override(bwd_q=(128, 64, 8, 2)):
        assert ops._launch_config("bwd_q", 128, q, False, n) == configs.LaunchConfig(128, 64, 8, 2)
    with tuning.override(bwd_kv=(64, 128, 8, 3)):  # another direction: the row stays
        assert ops._launch_config("bwd_q", 128, q, False, n) == own
    monkeypatch.setattr(ops, "_capability", lambda device: (8, 0))
    assert ops._launch_config("bwd_q", 128, q, False, n) == configs.launch_config(
        "bwd_q", 128, 2, False, (8, 0), False, n
    )
    monkeypatch.setattr(ops, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(ops, "interpreting", lambda: True)
    assert ops._launch_config("bwd_q", 128, q, False, n) == configs.launch_config(
        "bwd_q", 128, 2, False, (9, 0), True, n
    )


def test_double_backward_raises_instead_of_dropping_the_attention_terms() -> None:
    """Issue 18.3, as in triton_flash: differentiating the gradients raises (eager calls
    and the registered op), first-order gradients are unchanged."""
    torch.manual_seed(9)
    layout = _random_layout(1, 1, 32, 32, 16, 0.7, seed=3).to(DEVICE)
    q, k, v = (torch.randn(1, 2, 32, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    plain = torch.autograd.grad(attnhub.attention(q, k, v, block_sparse=layout).sum(), (q, k, v))
    out = attnhub.attention(q, k, v, block_sparse=layout, backend="triton_blocksparse")
    grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, grads):
        torch.testing.assert_close(a, b.detach())
    for wrt in (q, k, v):
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(grads[0].pow(2).sum() + v.sum(), wrt, retain_graph=True)
    seed, scalars = ops.call_scalars(q, False, False, None, None, None, 0.0)
    index = ops.layout_tensors(layout, q.device)
    op_out, _, _ = torch.ops.attnhub.triton_blocksparse_fwd(
        q, k, v, None, seed, index, *layout.block_size, *ops._facts[layout], *scalars
    )
    (dq,) = torch.autograd.grad(op_out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.pow(2).sum(), k)


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_one_key_per_row_has_exactly_zero_dq_and_dk(dtype: torch.dtype) -> None:
    """Issue 18.17, as in triton_flash (the same backward steps and delta): with
    window (0, 0), bottom-right, Nq = 17 > Nk = 16, scale 2 and a float mask, each row
    keeps at most one key, so dq and dk are exactly 0."""
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, 2, 17, 64, generator=gen).to(DEVICE, dtype)
    k, v = (torch.randn(2, 2, 16, 64, generator=gen).to(DEVICE, dtype) for _ in range(2))
    mask = (2.0 * torch.randn(17, 16, generator=gen)).to(DEVICE, dtype)
    dout = torch.randn(2, 2, 17, 64, generator=gen).to(DEVICE, dtype)
    layout = BlockSparseLayout.from_block_mask(torch.ones(1, 1, 2, 1, dtype=torch.bool), 16)
    out, _, dq, dk, _ = _run(layout, q, k, v, dout, mask, bottom_right=True, window=(0, 0),
                              scale=2.0)  # fmt: skip
    assert torch.equal(out[:, :, 1:], v)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))
