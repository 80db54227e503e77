"""triton_flash's split-KV decode op (backends/triton_flash/decode.py) against float64.

The reference is contract.md's attention computed sequence by sequence: query row i of
sequence b sits at key position L_b - Nq + i among the first L_b = cache_seqlens[b] keys
of its cache (bottom-right alignment), computed by torch_reference's
``reference_attention`` on that slice in float64. Tolerance, contract.md's rule:
max|x - r64| <= 2 * max|r_lp - r64| + 1e-5 (r_lp: the same reference in the inputs'
dtype); rows with no key must be exactly zero with lse -inf.

Keys at or past L_b (and pages the block table does not reach) hold NaN, so a kernel
that reads one, even with a zero weight, fails. Without CUDA the kernels run in
Triton's interpreter on tiny shapes (16-key tiles) in float16 and float32; the GPU
tests (``-m gpu``) run bfloat16 too, larger shapes and every page size 16..256.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import attnhub  # noqa: E402
from attnhub.backends.torch_reference import reference_attention  # noqa: E402
from attnhub.backends.triton_flash import decode  # noqa: E402
from attnhub.request import AttentionParams  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
INTERP = not HAS_CUDA


def make_inputs(b, hq, hkv, nq, nmax, d, dtype, lengths, dv=None, seed=0, magnitude=1.0):  # type: ignore[no-untyped-def]
    """q (B, Hq, Nq, D) and a contiguous cache (B, Hkv, Nmax, D/Dv) whose keys and values
    at positions >= lengths[b] are NaN."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or d
    q = torch.randn(b, hq, nq, d, generator=g) * magnitude
    k = torch.randn(b, hkv, nmax, d, generator=g) * magnitude
    v = torch.randn(b, hkv, nmax, dv, generator=g)
    for i, n in enumerate(lengths):
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    return (q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), seqlens.to(DEVICE))


def to_paged(cache: torch.Tensor, page_size: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """(paged cache, block table) holding the same keys as a contiguous (B, H, Nmax, D)
    cache: pages in a shuffled order, plus one page of NaN that every table entry past
    a sequence's capacity points at (a kernel that reads it fails)."""
    b, h, nmax, d = cache.shape
    pages = nmax // page_size
    assert pages * page_size == nmax
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(b * pages + 1, generator=g)  # slot order[k] holds logical page k
    paged = torch.full((b * pages + 1, page_size, h, d), float("nan"), dtype=cache.dtype,
                       device=cache.device)  # fmt: skip
    # Logical page (bi, p) -> slot order[bi * pages + p]; the last logical page is poison.
    logical = cache.reshape(b, h, pages, page_size, d).permute(0, 2, 3, 1, 4)
    paged[order[: b * pages].to(cache.device)] = logical.reshape(b * pages, page_size, h, d)
    table = order[: b * pages].reshape(b, pages).to(torch.int32)
    # Two more table columns past the capacity, pointing at the NaN page.
    poison = order[b * pages].item()
    table = torch.cat([table, torch.full((b, 2), poison, dtype=torch.int32)], 1)
    return paged, table.to(cache.device)


def reference(
    q, k, v, lengths, *, scale, window=None, softcap=None, causal=True, dtype=None, key_mask=None
):  # type: ignore[no-untyped-def]
    """(out, lse) sequence by sequence, in ``dtype`` (default float64); ``key_mask``:
    decode_attention's (1 or B, Nk), as the contract's (1, 1, 1, L_b) mask of each."""
    dtype = dtype or torch.float64
    params = AttentionParams(
        causal=causal, alignment="bottom_right", window=window, softcap=softcap, scale=scale
    )
    outs, lses = [], []
    for i, n in enumerate(lengths):
        mask = None
        if key_mask is not None:
            mask = key_mask[i if key_mask.shape[0] > 1 else 0, :n].reshape(1, 1, 1, n)
            mask = mask.to(q.device) if mask.dtype == torch.bool else mask.to(q.device, dtype)
        o, lse = reference_attention(
            q[i : i + 1].to(dtype), k[i : i + 1, :, :n].to(dtype), v[i : i + 1, :, :n].to(dtype),
            mask, params,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def check(out, lse, q, k, v, lengths, **kw):  # type: ignore[no-untyped-def]
    """Output and lse against float64 by contract.md's rule; empty rows exact."""
    r64, lse64 = reference(q, k, v, lengths, **kw)
    rlp, lselp = reference(q, k, v, lengths, dtype=q.dtype, **kw)
    assert out.shape == r64.shape and out.dtype == q.dtype
    assert lse.shape == lse64.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(lse64)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key: lse -inf, only them"
    assert (out[empty] == 0).all(), "rows with no key give zeros"
    err = (out.double() - r64).abs().max().item()
    bound = 2 * (rlp.double() - r64).abs().max().item() + 1e-5
    assert err <= bound, f"out: {err:.3g} > {bound:.3g}"
    if (~empty).any():
        lerr = (lse.double() - lse64)[~empty].abs().max().item()
        lbound = 2 * (lselp.double() - lse64)[~empty].abs().max().item() + 1e-5
        assert lerr <= lbound, f"lse: {lerr:.3g} > {lbound:.3g}"


DTYPES = [torch.float32, torch.float16]
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("nq", [1, 4])
def test_gqa_lengths_and_splits(dtype, nq):  # type: ignore[no-untyped-def]
    """GQA (4 query heads on 2 kv heads), lengths 0, 1, 16 (one whole tile), 37 and 64
    (the capacity), the default split count (here 4, one per tile), one split (no
    merge), and 3 splits merged by the last program of each (the fused merge), which
    leaves its arrival counters at zero."""
    lengths = [0, 1, 16, 37, 64]
    q, k, v, sl = make_inputs(5, 4, 2, nq, 64, 32, dtype, lengths, seed=nq)
    scale = 1 / math.sqrt(32)
    fused = decode.DecodeConfig(16, 4, 1, num_splits=3, fused_merge=True)
    for cfg in (None, decode.DecodeConfig(16, 4, 1, num_splits=1), fused):
        out, lse = decode.decode_attention(q, k, v, sl, scale=scale, return_lse=True, config=cfg)
        check(out, lse, q, k, v, lengths, scale=scale)
    assert all((s.counters == 0).all() for s in decode._SCRATCH.values()), "counters left at zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_window_softcap(dtype):  # type: ignore[no-untyped-def]
    """A sliding window (left 5, 20, 10: row 0 of the 29-key sequence starts at key 15,
    the last of a tile; 0: each row keeps its own key only), softcap with scores large
    enough to saturate it, Nq 4."""
    lengths = [3, 29, 50]
    q, k, v, sl = make_inputs(3, 4, 2, 4, 64, 32, dtype, lengths, seed=3, magnitude=2.0)
    for window, softcap in (
        ((5, 0), None),
        ((20, None), 10.0),
        ((10, 0), None),
        ((0, 0), None),
        (None, 5.0),
    ):
        out, lse = decode.decode_attention(
            q, k, v, sl, scale=0.3, window=window, softcap=softcap, return_lse=True
        )
        check(out, lse, q, k, v, lengths, scale=0.3, window=window, softcap=softcap)


def _key_masks(batch: int, nk: int) -> dict[str, torch.Tensor]:
    """Key masks of a padded batch's decoding step, (B, Nk): left padding (row 1 keeps
    its last 20 keys), right padding, holes, a row keeping no key, one keeping a single
    key; as bool and as the float 0 / -inf, and a float one
    with finite biases, -3e38 among them (beyond float32 once in log2 units)."""
    g = torch.Generator().manual_seed(nk)
    keep = torch.ones(batch, nk, dtype=torch.bool)
    keep[1, : nk - 20] = False
    keep[2, 25:] = False
    keep[3] = torch.rand(nk, generator=g) > 0.4
    keep[4] = False
    keep[0, :-1] = False  # one key, the newest
    bias = torch.randn(batch, nk, generator=g)
    bias[:, 3] = -3e38
    bias[1, : nk - 20] = float("-inf")
    return {
        "bool": keep,
        "float-inf": torch.zeros(batch, nk).masked_fill(~keep, float("-inf")),
        "float": bias,
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("kind", ["bool", "float-inf", "float"])
def test_key_mask(dtype, kind):  # type: ignore[no-untyped-def]
    """A key mask (a padded batch's dense decoding step, read as given) against float64
    with the same mask: every row keeps or drops its keys by it, besides the lengths,
    causal and window; a row it masks whole gives zeros and lse -inf; the keys it masks
    are never read (their keys and values hold NaN for the kernel, a finite value for
    the reference). GQA, Nq 1 and 4, one split, several, fused merge; a mask shared by
    the batch (one row), a strided view; each also as the 4-D (B, 1, 1, Nk) mask a
    model passes (the kernel reads it through its first and last strides)."""
    lengths = [64, 64, 40, 64, 64]
    for nq in (1, 4):
        q, k, v, sl = make_inputs(5, 4, 2, nq, 64, 32, dtype, lengths, seed=nq + 40)
        mask = _key_masks(5, 64)[kind]
        mask = mask.to(DEVICE, mask.dtype if mask.dtype == torch.bool else dtype)
        wide = torch.zeros(5, 1, 1, 96, dtype=mask.dtype, device=DEVICE)
        wide[..., :64] = mask.reshape(5, 1, 1, 64)
        views = {"contiguous": mask, "strided": wide[:, 0, 0, :64], "shared": mask[2:3]}
        views |= {
            "contiguous 4-D": mask.reshape(5, 1, 1, 64),
            "strided 4-D": wide[..., :64],
            "shared 4-D": mask[2:3].reshape(1, 1, 1, 64),
        }
        for view_name, given in views.items():
            km = given.reshape(given.shape[0], given.shape[-1])  # the reference's
            masked = ~km if km.dtype == torch.bool else km == float("-inf")
            hidden = masked.expand(5, 64)[:, None, :, None]
            kp, vp = k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("nan"))
            for causal, window, cfg in (
                (False, None, decode.DecodeConfig(16, 4, 1, num_splits=2)),
                (True, None, decode.DecodeConfig(16, 4, 1, num_splits=1)),
                (False, (9, None), decode.DecodeConfig(16, 4, 1, num_splits=3, fused_merge=True)),
                (False, None, None),  # the default launch
            ):
                out, lse = decode.decode_attention(
                    q, kp, vp, sl, scale=0.3, causal=causal, window=window, key_mask=given,
                    return_lse=True, config=cfg,
                )  # fmt: skip
                kw = {"scale": 0.3, "causal": causal, "window": window, "key_mask": km}
                try:
                    check(out, lse, q, k, v, lengths, **kw)
                except AssertionError as exc:
                    where = f"{view_name} nq={nq} causal={causal} window={window}"
                    raise AssertionError(f"{where}: {exc}") from exc


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
def test_paged_equals_contiguous(page_size, dtype):  # type: ignore[no-untyped-def]
    """A paged cache (shuffled pages, NaN pages past each table's reach) gives bitwise
    the contiguous cache's answer (the same tiles and splits; one page per tile at 16,
    two tiles per page at 32), which matches float64; Nq 4, GQA, a window."""
    lengths = [0, 17, 64, 45]
    q, k, v, sl = make_inputs(4, 4, 2, 4, 64, 32, dtype, lengths, seed=page_size)
    kp, table = to_paged(k, page_size)
    vp, _ = to_paged(v, page_size)
    # The same slots for k and v (same seed): the table fits both.
    for window in (None, (9, 0)):
        ref = decode.decode_attention(q, k, v, sl, scale=0.2, window=window, return_lse=True)
        got = decode.decode_attention(
            q, kp, vp, sl, block_table=table[:, :-2].contiguous(), scale=0.2, window=window,
            return_lse=True,
        )  # fmt: skip
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        check(*got, q, k, v, lengths, scale=0.2, window=window)
    # Table columns past the capacity (pointing at NaN) change nothing; fused merge too.
    for fused in (False, True):
        cfg = decode.DecodeConfig(16, 4, 1, num_splits=4, fused_merge=fused)
        wide = decode.decode_attention(q, kp, vp, sl, block_table=table, scale=0.2,
                                       return_lse=True, config=cfg)  # fmt: skip
        check(*wide, q, k, v, lengths, scale=0.2)


def test_paged_small_pages_under_wide_tiles():  # type: ignore[no-untyped-def]
    """16-key pages under 32-key tiles: the per-key page gather (PAGE_SIZE < BLOCK_N),
    whose masked tail must not read table entries past the length; lengths and table
    given as strided views."""
    lengths = [33, 64, 5]
    q, k, v, sl = make_inputs(3, 2, 1, 1, 64, 16, torch.float32, lengths, seed=7)
    kp, table = to_paged(k, 16)
    vp, _ = to_paged(v, 16)
    cfg = decode.DecodeConfig(32, 4, 1, num_splits=2)
    got = decode.decode_attention(q, kp, vp, sl, block_table=table, scale=0.25,
                                  return_lse=True, config=cfg)  # fmt: skip
    check(*got, q, k, v, lengths, scale=0.25)
    # Lengths and table as strided views (every other element of wider storage).
    sl2 = torch.stack([sl, torch.full_like(sl, 10**6)], 1)[:, 0]
    table2 = torch.stack([table, torch.full_like(table, 10**6)], 2)[:, :, 0]
    assert sl2.stride(0) == 2 and table2.stride(1) == 2
    got = decode.decode_attention(q, kp, vp, sl2, block_table=table2, scale=0.25,
                                  return_lse=True, config=cfg)  # fmt: skip
    check(*got, q, k, v, lengths, scale=0.25)


def test_head_dims_and_many_splits():  # type: ignore[no-untyped-def]
    """D = 40 with Dv = 24 (padded, masked head dims), and D = 64 with one query row per
    kv head; 8 splits over at most 4 tiles (splits with no keys merge as nothing);
    int64 lengths."""
    lengths = [50, 7]
    for d, dv, nq in ((40, 24, 2), (64, 64, 1)):  # Nq 1 without GQA: one row per tile
        q, k, v, sl = make_inputs(2, 2, 2, nq, 64, d, torch.float16, lengths, dv=dv, seed=d)
        cfg = decode.DecodeConfig(16, 4, 1, num_splits=8)
        out, lse = decode.decode_attention(q, k, v, sl.long(), scale=0.15, return_lse=True,
                                           config=cfg)  # fmt: skip
        check(out, lse, q, k, v, lengths, scale=0.15)


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` in storage 8 elements wider in its last dim (a strided view of it)."""
    wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 8, dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


def test_strided_inputs_and_large_group():  # type: ignore[no-untyped-def]
    """q and the cache as transposed (B, N, H, D) storage; 8 query heads x 16 tokens on
    one kv head: 128 rows, two row blocks of 64 (each with its own counter in the fused
    merge); causal and not."""
    lengths = [40, 21]
    q, k, v, sl = make_inputs(2, 8, 1, 16, 48, 16, torch.float32, lengths, seed=11)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    # (B, N, H, D + 8) storage, the cache its first D channels: row stride D + 8.
    kt = _padded(k.transpose(1, 2)).transpose(1, 2)
    vt = _padded(v.transpose(1, 2)).transpose(1, 2)
    assert not qt.is_contiguous() and kt.stride(2) == 24
    fused = decode.DecodeConfig(16, 4, 1, num_splits=2, fused_merge=True)
    for causal, cfg in ((True, None), (False, None), (True, fused)):
        out, lse = decode.decode_attention(qt, kt, vt, sl, scale=0.5, causal=causal,
                                           return_lse=True, config=cfg)  # fmt: skip
        check(out, lse, q, k, v, lengths, scale=0.5, causal=causal)
    out = decode.decode_attention(qt, kt, vt, sl, scale=0.5, window=(3, 2), causal=False)
    check(out, decode.decode_attention(qt, kt, vt, sl, scale=0.5, window=(3, 2), causal=False,
                                       return_lse=True)[1],
          q, k, v, lengths, scale=0.5, window=(3, 2), causal=False)  # fmt: skip


def test_softcap_ratio_beyond_float32():  # type: ignore[no-untyped-def]
    """scale / softcap beyond float32 (1e40): the kernel's ratio was inf, and a q.k of
    exactly 0 (a zero query row, a zero key) made 0 * inf = NaN where the contract's
    softcap * tanh(0) is 0; against float64 by the contract's rule. And a softcap above
    float32's largest / log2(e) (softcap * log2(e) was inf: NaN scores): the output
    (one-hot weights) is float64's, the lse finite (common._scores says how close)."""
    lengths = [20, 32]
    q, k, v, sl = make_inputs(2, 2, 1, 2, 32, 32, torch.float32, lengths, seed=4)
    q[0, 0, 0] = 0.0
    k[1, 0, 3] = 0.0
    for scale in (1e30, -1e30):
        out, lse = decode.decode_attention(q, k, v, sl, scale=scale, softcap=1e-10, return_lse=True)
        check(out, lse, q, k, v, lengths, scale=scale, softcap=1e-10)
    q, k, v, sl = make_inputs(2, 2, 1, 2, 32, 32, torch.float32, lengths, seed=5, magnitude=0.2)
    out, lse = decode.decode_attention(q, k, v, sl, scale=3e38, softcap=3e38, return_lse=True)
    r64, lse64 = reference(q, k, v, lengths, scale=3e38, softcap=3e38)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert (out.double() - r64).abs().max().item() <= 1e-6
    shrink = 3.4028234663852886e38 * 0.6931471805599453 / 3e38
    assert torch.allclose(lse.double(), lse64.double() * shrink, rtol=1e-5, atol=0.0)


def test_empty_calls():  # type: ignore[no-untyped-def]
    """No rows, or a cache of capacity 0: empty or zero outputs, lse -inf; nothing runs."""
    q, k, v, sl = make_inputs(2, 2, 1, 1, 0, 16, torch.float32, [0, 0])
    out, lse = decode.decode_attention(q, k, v, sl, scale=1.0, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and out.shape == (2, 2, 1, 16)
    q, k, v, sl = make_inputs(2, 2, 1, 0, 16, 16, torch.float32, [3, 4])
    out = decode.decode_attention(q, k, v, sl, scale=1.0)
    assert out.shape == (2, 2, 0, 16)


def test_compile_fullgraph():  # type: ignore[no-untyped-def]
    """Under torch.compile (fullgraph) the call goes through the registered op
    attnhub::triton_decode (on CPU an opaque custom op whose fake implementation only
    allocates) and gives the eager answer; paged, GQA, window, lse."""
    lengths = [40, 9]
    q, k, v, sl = make_inputs(2, 4, 2, 4, 64, 32, torch.float32, lengths, seed=31)
    kp, table = to_paged(k, 16)
    vp, _ = to_paged(v, 16)

    def f(q, kp, vp, sl, table):  # type: ignore[no-untyped-def]
        return decode.decode_attention(q, kp, vp, sl, block_table=table, scale=0.3,
                                       window=(20, 0), return_lse=True)  # fmt: skip

    backend = "inductor" if HAS_CUDA else "aot_eager"
    got = torch.compile(f, backend=backend, fullgraph=True)(q, kp, vp, sl, table)
    eager = f(q, kp, vp, sl, table)
    torch.testing.assert_close(got[0], eager[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], eager[1], atol=1e-5, rtol=1e-5)
    check(*got, q, k, v, lengths, scale=0.3, window=(20, 0))


def test_compile_fullgraph_with_a_key_mask():  # type: ignore[no-untyped-def]
    """The key mask goes through the registered op too (an optional tensor argument):
    compiled, the eager answer, float64's."""
    lengths = [64, 64]
    q, k, v, sl = make_inputs(2, 4, 2, 1, 64, 32, torch.float32, lengths, seed=32)
    keep = torch.arange(64, device=DEVICE)[None, :] >= torch.tensor([[0], [37]], device=DEVICE)

    def f(q, k, v, sl, keep):  # type: ignore[no-untyped-def]
        return decode.decode_attention(q, k, v, sl, scale=0.3, causal=False, key_mask=keep,
                                       return_lse=True)  # fmt: skip

    backend = "inductor" if HAS_CUDA else "aot_eager"
    got = torch.compile(f, backend=backend, fullgraph=True)(q, k, v, sl, keep)
    eager = f(q, k, v, sl, keep)
    torch.testing.assert_close(got[0], eager[0], atol=1e-5, rtol=1e-5)
    check(*got, q, k, v, lengths, scale=0.3, causal=False, key_mask=keep)


def test_split_heuristic(monkeypatch):  # type: ignore[no-untyped-def]
    """The fewest splits whose waves of 3 programs per SM are within 15% of the best
    filled, with at least 4 tiles per split, at most 64 (under the interpreter: up to 4
    splits of a tile or more)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # read per call, not imported
    # B*Hkv = 64 on 132 SMs (396 slots): 6 splits fill 384 (97%); 5 fill 320 (81%).
    assert decode.num_splits_for(64, 512, 132) == 6
    assert decode.num_splits_for(64, 8, 132) == 2  # 8 tiles: 4 per split at least
    assert decode.num_splits_for(64, 3, 132) == 1
    # 256 programs: 1 or 2 splits fill 65% of their last wave, 3 fill 97%.
    assert decode.num_splits_for(256, 10**6, 132) == 3
    assert decode.num_splits_for(1, 10**6, 132) == 55  # 0.85 x the efficiency of 64
    assert decode.num_splits_for(396 * 4, 10**6, 132) == 1
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode.num_splits_for(10, 4, 4) == 4  # CPU: up to 4 splits, a tile or more each
    assert decode.num_splits_for(10, 2, 4) == 2


def test_the_last_plan_serves_only_what_its_key_held(monkeypatch):  # type: ignore[no-untyped-def]
    """decode._LastPlan.serves, the memo in front of the plan key (its launches are the
    GPU's: test_gpu_the_last_plan_serves_only_calls_of_its_key): new tensors of the
    same metadata and options, yes; a view one element in (not 16-byte aligned),
    another option, a key mask given, another fp32 matmul precision or another current
    device, no. A contiguous cache of another length: yes where _plan_key would give it
    the same key (the length's bucket, the strides' classes), else no. Calls with a
    misaligned tensor keep no last plan."""
    current = [0]
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)
    monkeypatch.setattr(decode, "_last_plan", None)
    q, k, v, sl = make_inputs(2, 4, 2, 1, 64, 32, torch.float32, [64, 10])
    options = (0.1, None, None, False, None)
    misaligned = torch.empty(q.numel() + 1, device=q.device)[1:].view_as(q).copy_(q)
    decode._remember_last(misaligned, k, v, sl, None, None, options, "plan")
    assert decode._last_plan is None
    decode._remember_last(q, k, v, sl, None, None, options, "plan")
    last = decode._last_plan
    assert last is not None and last.plan == "plan"
    assert last.serves(*[t.clone() for t in (q, k, v, sl)], None, None, options)
    assert not last.serves(misaligned, k, v, sl, None, None, options)
    assert not last.serves(q, k, v, sl, None, None, (0.2, None, None, False, None))
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool, device=q.device)
    assert not last.serves(q, k, v, sl, None, mask, options)

    def same_key(k2, v2):  # type: ignore[no-untyped-def]
        key = decode._plan_key(q, k, v, sl, None, None, *options)
        return decode._plan_key(q, k2, v2, sl, None, None, *options) == key

    longer = make_inputs(2, 4, 2, 1, 71, 32, torch.float32, [64, 10])  # bucket 64..71
    assert same_key(*longer[1:3]) and last.serves(q, *longer[1:3], sl, None, None, options)
    assert last.serves(q, k, v, sl, None, None, options)  # and back
    beyond = make_inputs(2, 4, 2, 1, 72, 32, torch.float32, [64, 10])  # bucket 72..79
    assert not same_key(*beyond[1:3])
    assert not last.serves(q, *beyond[1:3], sl, None, None, options)
    # Values with a row stride of 33 (not a multiple of 16: Triton specializes it so)
    odd_v = torch.zeros(2, 2, 65, 33, device=q.device)[..., :32]
    assert not same_key(longer[1], odd_v)
    assert not last.serves(q, longer[1], odd_v, sl, None, None, options)
    wider = make_inputs(3, 4, 2, 1, 64, 32, torch.float32, [64, 10, 5])  # another batch
    assert not last.serves(q, *wider[1:3], sl, None, None, options)

    # With a key mask (B, 1, 1, Nk): its length and batch stride go with the cache's
    # (bucket 256..287; of its lengths, 256 and 272 are multiples of 16).
    def cache_and_mask(n, batch=2):  # type: ignore[no-untyped-def]
        _, k2, v2, _ = make_inputs(2, 4, 2, 1, n, 32, torch.float32, [64, 10])
        return k2, v2, torch.ones(batch, 1, 1, n, dtype=torch.bool, device=q.device)

    def masked_plan(k2, v2, key_mask):  # type: ignore[no-untyped-def]
        decode._remember_last(q, k2, v2, sl, None, key_mask, options, "masked plan")
        return decode._last_plan, lambda *c: decode._plan_key(q, *c[:2], sl, None, c[2], *options)

    base = cache_and_mask(256)
    masked, key_of = masked_plan(*base)
    for n, served in ((272, True), (256, True), (257, False), (288, False)):
        other = cache_and_mask(n)
        assert (key_of(*other) == key_of(*base)) is served
        assert masked.serves(q, *other[:2], sl, None, other[2], options) is served
    assert not masked.serves(q, *base[:2], sl, None, base[2][:, :, :, :1], options)  # one key
    # A mask shared by the batch (batch stride 0): any length of the bucket.
    base = cache_and_mask(64, batch=1)
    masked, key_of = masked_plan(*base)
    other = cache_and_mask(71, batch=1)
    assert key_of(*other) == key_of(*base)
    assert masked.serves(q, *other[:2], sl, None, other[2], options)
    decode._remember_last(q, k, v, sl, None, None, options, "plan")
    last = decode._last_plan
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high" if precision == "highest" else "highest")
        assert not last.serves(q, k, v, sl, None, None, options)
    finally:
        torch.set_float32_matmul_precision(precision)
    assert last.serves(q, k, v, sl, None, None, options)
    current[0] = 1
    assert not last.serves(q, k, v, sl, None, None, options)


# The interpreter proves the tile arithmetic, not that Triton's compiler accepts the
# kernels: this compiles representative launches for sm_90 ahead of time (Triton's own
# ptxas, no GPU needed), in a fresh process without TRITON_INTERPRET, and checks that
# each fits the H200's shared memory and spills nothing.
_AOT_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnhub.backends.triton_flash import decode

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
         torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
launches = []

class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

decode.decode_split_kernel = Recorder(decode.decode_split_kernel)
decode.decode_merge_kernel = Recorder(decode.decode_merge_kernel)
decode._sm_count = lambda device: 132
for dtype, d, nq, page, kw in [
    (torch.bfloat16, 128, 1, 0, {}),
    (torch.bfloat16, 128, 4, 16, {"window": (100, 0), "softcap": 50.0}),
    (torch.float16, 64, 1, 256, {}),
    (torch.float32, 256, 4, 0, {"window": (100, 0)}),
    (torch.bfloat16, 96, 16, 32, {}),
    (torch.bfloat16, 128, 4, 0, {"config": decode.DecodeConfig(64, 4, 3, 6, True)}),
    (torch.bfloat16, 128, 1, 16, {"config": decode.DecodeConfig(64, 4, 5, 6, True)}),
    (torch.bfloat16, 128, 1, 0, {"key_mask": torch.ones(8, 4096, dtype=torch.bool)}),
    (torch.float16, 64, 4, 0, {"key_mask": torch.zeros(1, 4096, dtype=torch.float16)}),
]:
    q = torch.randn(8, 32, nq, d, dtype=dtype)
    seqlens = torch.full((8,), 4096, dtype=torch.int32)
    if page:
        k = torch.randn(8 * 4096 // page, page, 8, d, dtype=dtype)
        table = torch.arange(8 * 4096 // page, dtype=torch.int32).view(8, -1)
        decode.decode_attention(q, k, k, seqlens, block_table=table, scale=0.1, **kw)
    else:
        k = torch.randn(8, 8, 4096, d, dtype=dtype)
        decode.decode_attention(q, k, k, seqlens, scale=0.1, **kw)

from triton.backends.nvidia.compiler import get_ptxas
seen = set()
for kernel, args, kwargs in launches:
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = kwargs[param.name] if param.name in kwargs else args[i]
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
            is_int and value % 16 == 0 and not param.do_not_specialize and not param.is_constexpr
        ):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if param.is_constexpr or (is_int and value == 1 and not param.do_not_specialize):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif is_int:
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    key = (kernel.fn.__name__, tuple(sorted(signature.items())), tuple(sorted(constexprs.items())))
    if key in seen:
        continue
    seen.add(key)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o",
                              os.path.join(tmp, "k.o")], capture_output=True, text=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    print(kernel.fn.__name__, compiled.metadata.shared, spills.group(1) if spills else "?")
"""


def test_kernels_compile_for_sm90():  # type: ignore[no-untyped-def]
    """Both kernels compile for sm_90 at their default launches (contiguous and paged,
    every dtype, D 64/96/128/256, window and softcap, bool and float key masks), within
    227 KiB of shared memory and without register spills."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("decode_")]
    assert {name for name, _, _ in lines} == {"decode_split_kernel", "decode_merge_kernel"}
    for name, shared, spills in lines:
        assert int(shared) <= 232448, (name, shared)
        assert spills == "0", (name, spills, proc.stdout)


# ----------------------------------------------------------------------------- GPU


GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("nq", [1, 4])
def test_gpu_against_float64(dtype, d, nq):  # type: ignore[no-untyped-def]
    """Hq 32 / Hkv 8, lengths 0 .. 3000 (ragged, one at capacity), default launch."""
    lengths = [0, 1, 777, 3000, 2049, 64]
    q, k, v, sl = make_inputs(6, 32, 8, nq, 3000, d, dtype, lengths, seed=d + nq)
    out, lse = decode.decode_attention(q, k, v, sl, scale=d**-0.5, return_lse=True)
    check(out, lse, q, k, v, lengths, scale=d**-0.5)


PAGED_CASES = [(p, torch.bfloat16) for p in (16, 32, 64, 128, 256)] + [
    (16, torch.float16),
    (256, torch.float16),
]


@gpu
@requires_cuda
@pytest.mark.parametrize(("page_size", "dtype"), PAGED_CASES, ids=lambda x: SHORT.get(x, x))
def test_gpu_paged(page_size, dtype):  # type: ignore[no-untyped-def]
    """Every page size: right against float64 at the default launch (a table with
    columns past the capacity, pointing at NaN), Nq 1, and Nq 4 with softcap 50 + window
    300 and without; and bitwise equal to the contiguous cache at the same launch
    (tiles, warps, stages and splits: only the addressing differs)."""
    lengths = [4096, 1, 0, 3333, 1000]
    same = decode.DecodeConfig(64, 4, 5, num_splits=7)
    for nq in (1, 4):
        q, k, v, sl = make_inputs(5, 32, 8, nq, 4096, 128, dtype, lengths, seed=page_size + nq)
        kp, table = to_paged(k, page_size)
        vp, _ = to_paged(v, page_size)
        exact = table[:, :-2].contiguous()
        for kw in ({}, {"softcap": 50.0, "window": (300, 0)})[: nq // 2 + 1]:
            got = decode.decode_attention(q, kp, vp, sl, block_table=table, scale=128**-0.5,
                                          return_lse=True, **kw)  # fmt: skip
            check(*got, q, k, v, lengths, scale=128**-0.5, **kw)
            ref = decode.decode_attention(q, k, v, sl, scale=128**-0.5, return_lse=True,
                                          config=same, **kw)  # fmt: skip
            got = decode.decode_attention(q, kp, vp, sl, block_table=exact, scale=128**-0.5,
                                          return_lse=True, config=same, **kw)  # fmt: skip
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@gpu
@requires_cuda
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_gpu_split_counts(splits):  # type: ignore[no-untyped-def]
    """Forced split counts (1: the direct write; 64: many splits with no keys for the
    short sequences), bf16, Nq 4, a window."""
    lengths = [20000, 100, 5]
    q, k, v, sl = make_inputs(3, 16, 4, 4, 20000, 128, torch.bfloat16, lengths, seed=splits)
    cfg = decode.default_config(128, 2, None)
    cfg = decode.DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages, splits)
    for window in (None, (4096, 0)):
        out, lse = decode.decode_attention(q, k, v, sl, scale=0.1, window=window,
                                           return_lse=True, config=cfg)  # fmt: skip
        check(out, lse, q, k, v, lengths, scale=0.1, window=window)


@gpu
@requires_cuda
def test_gpu_cuda_graph():  # type: ignore[no-untyped-def]
    """The op captures into a CUDA graph (no host sync on the lengths) and replays with
    new lengths written into the same tensor."""
    lengths = [1000, 3000]
    q, k, v, sl = make_inputs(2, 8, 2, 1, 4096, 128, torch.bfloat16, [4096, 4096], seed=5)
    sl.copy_(torch.tensor(lengths, dtype=torch.int32))
    decode.decode_attention(q, k, v, sl, scale=0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.decode_attention(q, k, v, sl, scale=0.1)
    for lens in ([1000, 3000], [4096, 7]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        r64, _ = reference(q, k, v, lens, scale=0.1)
        rlp, _ = reference(q, k, v, lens, scale=0.1, dtype=q.dtype)
        err = (out.double() - r64).abs().max().item()
        assert err <= 2 * (rlp.double() - r64).abs().max().item() + 1e-5


@gpu
@requires_cuda
def test_gpu_cached_plan():  # type: ignore[no-untyped-def]
    """The second call of a signature launches the cached plan (decode._PLANS): with new
    tensors of that signature it computes their answer, not the first call's; a
    signature that differs in a stride or an option misses the plan."""
    decode._PLANS.clear()
    lengths = [300, 4000, 0]
    q, k, v, sl = make_inputs(3, 8, 2, 4, 4096, 128, torch.bfloat16, lengths, seed=21)
    kp, table = to_paged(k, 64)
    vp, _ = to_paged(v, 64)
    for kw in ({}, {"block_table": table}):
        kk, vv = (kp, vp) if kw else (k, v)
        first = decode.decode_attention(q, kk, vv, sl, scale=0.1, return_lse=True, **kw)
        assert len(decode._PLANS) == (2 if kw else 1)
        again = decode.decode_attention(q, kk, vv, sl, scale=0.1, return_lse=True, **kw)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        q2 = torch.randn_like(q)
        out, lse = decode.decode_attention(q2, kk, vv, sl, scale=0.1, return_lse=True, **kw)
        check(out, lse, q2, k, v, lengths, scale=0.1)
    assert len(decode._PLANS) == 2
    out = decode.decode_attention(q, k, v, sl, scale=0.1, window=(100, 0))
    assert len(decode._PLANS) == 3
    check(out, decode.decode_attention(q, k, v, sl, scale=0.1, window=(100, 0), return_lse=True)[1],
          q, k, v, lengths, scale=0.1, window=(100, 0))  # fmt: skip


@gpu
@requires_cuda
@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "bool_mask"])
def test_gpu_cached_plan_serves_a_longer_cache(masked, monkeypatch):  # type: ignore[no-untyped-def]
    """A model's decoding steps: each a contiguous cache one key longer than the last
    (new strides; with a padding mask, a new mask batch stride) and full lengths. A
    step takes the plan of its length's bucket, launched with its own strides: every
    answer is its own. A new bucket (1024 keys), or a mask stride that Triton would
    specialize otherwise (a multiple of 16 or not), keys a plan of its own. The other
    steps take the last plan (decode._LastPlan) without computing a key."""
    keyed = []
    plan_key = decode._plan_key
    monkeypatch.setattr(decode, "_plan_key", lambda *a: keyed.append(a[1].shape[2]) or plan_key(*a))
    decode._PLANS.clear()
    decode._last_plan = None
    g = torch.Generator().manual_seed(5)
    for n in range(1000, 1040):
        q, k, v, sl = make_inputs(4, 8, 2, 1, n, 128, torch.bfloat16, [n] * 4, seed=n)
        km = None
        if masked:  # left padding, its own per sequence
            pads = torch.randint(0, n // 2, (4, 1), generator=g)
            km = (torch.arange(n) >= pads).to(DEVICE)
        out, lse = decode.decode_attention(q, k, v, sl, scale=0.1, causal=False, key_mask=km,
                                           return_lse=True)  # fmt: skip
        check(out, lse, q, k, v, [n] * 4, scale=0.1, causal=False, key_mask=km)
    # Buckets 960..1023 and 1024..1151; with the mask, strides 1008 and 1024 (multiples
    # of 16) besides the others of each bucket.
    assert len(decode._PLANS) == (4 if masked else 2)
    # Keyed: a plan's first call (the full path records it, the last plan stays) and the
    # call after it (found by key: the last plan from then on); with the mask, 1025's
    # class is the last plan's (1009's) but not its bucket, so 1026 is keyed as well.
    assert keyed == ([1000, 1001, 1008, 1024, 1025, 1026] if masked else [1000, 1001, 1024, 1025])


@gpu
@requires_cuda
def test_gpu_the_last_plan_serves_only_calls_of_its_key(monkeypatch):  # type: ignore[no-untyped-def]
    """decode._LastPlan: a call repeating the last call's tensors' metadata, alignment
    and options launches its plan without computing the key (a decoding step's later
    layers); one that differs in alignment (a view one element in), in an option or in
    a tensor given (a key mask) computes its key. Every answer is its own."""
    keyed = []
    plan_key = decode._plan_key
    monkeypatch.setattr(decode, "_plan_key", lambda *a: keyed.append(1) or plan_key(*a))
    decode._PLANS.clear()
    decode._last_plan = None
    lengths = [300, 1000, 64]
    q, k, v, sl = make_inputs(3, 8, 2, 1, 1024, 128, torch.bfloat16, lengths, seed=3)

    def call(q, key_mask=None, **kw):  # type: ignore[no-untyped-def]
        out, lse = decode.decode_attention(q, k, v, sl, causal=False, return_lse=True,
                                           key_mask=key_mask, **kw)  # fmt: skip
        flat = None if key_mask is None else key_mask.reshape(key_mask.shape[0], -1)
        check(out, lse, q, k, v, lengths, causal=False, key_mask=flat, **kw)

    call(q, scale=0.1)  # the full path records the plan
    call(q, scale=0.1)  # found by its key: the last plan from now on
    assert len(keyed) == 2
    call(torch.randn_like(q), scale=0.1)
    assert len(keyed) == 2
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view_as(q)
    misaligned.copy_(torch.randn_like(q))
    call(misaligned, scale=0.1)
    assert len(keyed) == 3
    call(q, scale=0.2)
    assert len(keyed) == 4
    call(q, scale=0.2, key_mask=torch.rand(3, 1, 1, 1024, device=q.device) > 0.3)
    assert len(keyed) == 5


@gpu
@requires_cuda
def test_gpu_plans_share_their_streams_scratch(monkeypatch):  # type: ignore[no-untyped-def]
    """Cached plans take the partials, the fused merge's counters and the lse they do not
    return from one set of buffers per (device, stream) (decode._scratch): calls of two
    sizes in turn (the buffers grow, then serve the smaller), fused and two-launch
    merges, with and without lse, on the default stream and a side stream, each answer
    bitwise what the full path gives with buffers of its own (USE_PLANS off)."""
    cases = []
    for b, n, seed in ((2, 3000, 1), (6, 9000, 2)):
        lengths = [n - 17 * i for i in range(b)]
        q, k, v, sl = make_inputs(b, 32, 8, 1, n, 128, torch.bfloat16, lengths, seed=seed)
        base = decode.default_config(128, 2, None)
        for fused in (False, True):
            cfg = decode.DecodeConfig(base.block_n, base.num_warps, base.num_stages, 8, fused)
            kw = {"scale": 0.1, "config": cfg}
            monkeypatch.setattr(decode, "USE_PLANS", False)
            want = decode.decode_attention(q, k, v, sl, return_lse=True, **kw)
            monkeypatch.setattr(decode, "USE_PLANS", True)
            cases.append(((q, k, v, sl), kw, want))
    decode._PLANS.clear()
    decode._last_plan = None
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            outs = [
                decode.decode_attention(*t, return_lse=lse, **kw)
                for _ in range(3)
                for t, kw, _ in cases
                for lse in (False, True)
            ]
        stream.synchronize()
        for i, got in enumerate(outs):
            want = cases[i // 2 % len(cases)][2]
            if i % 2:
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            else:
                assert torch.equal(got, want[0])
    assert len(decode._SCRATCH) >= 2
    assert all((s.counters == 0).all() for s in decode._SCRATCH.values())


@gpu
@requires_cuda
@pytest.mark.parametrize("page_size", [0, 16, 256])
def test_gpu_fused_merge(page_size):  # type: ignore[no-untyped-def]
    """The merge fused into the split kernel (the last program of each row block reads
    the partials other SMs wrote) gives bitwise the two-launch answer (the same partials
    merged by the same code in the same order), call after call (each launch leaves its
    counters at zero for the next), for 3 to 64 splits; and inside a CUDA graph."""
    lengths = [8192, 3000, 1, 0, 5000, 8191]
    q, k, v, sl = make_inputs(6, 32, 8, 4, 8192, 128, torch.bfloat16, lengths, seed=page_size)
    table = None
    if page_size:
        k, table = to_paged(k, page_size)
        v, _ = to_paged(v, page_size)
    base = decode.default_config(128, 2, page_size or None)
    for splits in (3, 16, 64):
        two = decode.DecodeConfig(base.block_n, base.num_warps, base.num_stages, splits)
        one = decode.DecodeConfig(base.block_n, base.num_warps, base.num_stages, splits, True)
        ref = decode.decode_attention(q, k, v, sl, block_table=table, scale=0.1,
                                      window=(2000, 0), return_lse=True, config=two)  # fmt: skip
        for _ in range(20):
            got = decode.decode_attention(q, k, v, sl, block_table=table, scale=0.1,
                                          window=(2000, 0), return_lse=True, config=one)  # fmt: skip
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        torch.cuda.synchronize()
        assert all((s.counters == 0).all() for s in decode._SCRATCH.values())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.decode_attention(q, k, v, sl, block_table=table, scale=0.1,
                                      window=(2000, 0), config=one)  # fmt: skip
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref[0])


# -- dense calls shaped like decoding (serving.decode_shaped) ------------------------------


def test_full_lengths_are_rows_of_a_shared_table(monkeypatch):  # type: ignore[no-untyped-def]
    """serving._full_lengths: (B,) int32 of Nk, contiguous and 16-byte aligned (Triton
    specializes the pointer on it) for any B; calls within _LENGTH_ROWS keys of the
    table's first length take rows of one table (a model's layers and steps), a length
    outside makes a new one."""
    from attnhub.backends.triton_flash import serving

    monkeypatch.setattr(serving, "_FULL_LENGTHS", {})
    for b in (1, 3, 4, 5, 8):
        rows = []  # kept: a table freed could give its address to the next
        for nk in (500, 501, 500, 500 + serving._LENGTH_ROWS - 1, 499, 500 + serving._LENGTH_ROWS):
            lengths = serving._full_lengths(torch.empty(b, 2, nk, 8, device=DEVICE))
            assert torch.equal(lengths, torch.full((b,), nk, dtype=torch.int32, device=DEVICE))
            assert lengths.is_contiguous() and lengths.data_ptr() % 16 == 0
            rows.append(lengths)
        tables = {row.untyped_storage().data_ptr() for row in rows}
        assert len(tables) == 3  # 500.., then 499.., then 756..


def test_full_lengths_made_under_fake_tensor_mode_stay_there(monkeypatch):  # type: ignore[no-untyped-def]
    """A decode-shaped dense call under FakeTensorMode made its lengths table there, a
    fake one, and kept it for the next real call; a real table kept before reached the
    fake call. Either way: "Please convert all Tensors to FakeTensors" (failed before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnhub.backends.triton_flash import serving

    monkeypatch.setattr(serving, "_FULL_LENGTHS", {})
    monkeypatch.setattr(serving, "_last_row", (-2, -1, -1, None))
    gen = torch.Generator().manual_seed(3)
    real = [
        torch.randn(2, h, n, 16, generator=gen).to(DEVICE) for h, n in ((4, 1), (2, 40), (2, 40))
    ]
    expected = attnhub.attention(*real, backend="torch_reference")
    for step in range(3):  # real, fake, real
        if step == 1:
            with FakeTensorMode() as fake:
                out = attnhub.attention(
                    *(fake.from_tensor(t) for t in real), backend="triton_flash"
                )
                assert out.shape == expected.shape
        else:
            out = attnhub.attention(*real, backend="triton_flash")
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _count_decode_calls(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    from attnhub.backends.triton_flash import serving

    calls: list[int] = []
    real = decode.decode_attention
    # No last plan: the runner's steady state (serving.dense_decode_runner) would launch
    # a call that repeats the last one's key without the counted entry.
    monkeypatch.setattr(decode, "_last_plan", None)

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(serving, "_decode_attention", counting)
    return calls


DENSE_DECODE_CASES = [
    (1, 77, {}),
    (4, 100, {"causal": True, "alignment": "bottom_right"}),
    (16, 9, {"causal": True, "alignment": "bottom_right"}),  # rows without keys
    (3, 50, {"causal": True, "alignment": "bottom_right", "window": (10, 0), "softcap": 5.0}),
    (5, 5, {"causal": True, "window": (2, 1)}),  # equal lengths: any alignment
    (2, 33, {"window": (4, 3), "alignment": "bottom_right", "scale": -0.3}),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("nq", "nk", "options"), DENSE_DECODE_CASES)
def test_dense_calls_shaped_like_decoding_run_on_the_decode_kernel(monkeypatch, dtype, nq, nk, options):  # type: ignore[no-untyped-def]  # fmt: skip
    """attnhub.attention with a few query rows, no mask and no gradient runs on the
    split-KV decode kernel (key and value as full caches), with the contract's answer:
    output and lse against float64, Dv != D, GQA, rows without keys."""
    g = torch.Generator().manual_seed(nq * 100 + nk)
    q = torch.randn(2, 8, nq, 32, generator=g).to(DEVICE, dtype)
    k = torch.randn(2, 2, nk, 32, generator=g).to(DEVICE, dtype)
    v = torch.randn(2, 2, nk, 16, generator=g).to(DEVICE, dtype)
    _check_on_the_decode_kernel(monkeypatch, q, k, v, options)


def test_a_4d_key_mask_that_varies_by_head_or_row_is_refused():
    """decode_attention reads a 4-D key mask at [b, 0, 0, j]: one whose head or row dim
    is not 1 would be read in part, so it is refused, naming the argument."""
    q, k, v, sl = make_inputs(2, 4, 2, 1, 16, 32, torch.float32, [16, 16])
    for shape in ((2, 4, 1, 16), (2, 1, 2, 16)):
        mask = torch.ones(shape, dtype=torch.bool, device=DEVICE)
        with pytest.raises(ValueError, match=r"key_mask: a 4-D key mask is \(1 or B, 1, 1, Nk\)"):
            decode.decode_attention(q, k, v, sl, scale=0.1, key_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("batch_rows", [3, 1], ids=["per_sequence", "shared"])
def test_a_dense_decoding_step_takes_its_4d_key_mask_as_given(monkeypatch, kind, batch_rows):  # type: ignore[no-untyped-def]  # fmt: skip
    """A padded batch's decoding step, attention(q (B, Hq, 1, D), k, v, mask (B or 1, 1,
    1, Nk)): the decode kernel reads the 4-D mask through its strides (no view of it is
    made), against float64: left padding, a row keeping one key, one keeping none
    (zeros), a float mask with finite biases."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 1, 32, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(3, 2, 40, 32, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(3, 2, 40, 32, generator=g).to(DEVICE, torch.float16)
    keep = torch.ones(3, 40, dtype=torch.bool)
    keep[0, :25] = False
    keep[1, :-1] = False
    keep[2] = False
    keep = keep[:batch_rows] if batch_rows == 3 else keep[:1]
    mask = keep[:, None, None, :].to(DEVICE)
    if kind == "float":
        bias = torch.randn(keep.shape, generator=g).masked_fill(~keep, float("-inf"))
        mask = bias[:, None, None, :].to(DEVICE, torch.float16)
    _check_on_the_decode_kernel(monkeypatch, q, k, v, {}, mask)


def _check_on_the_decode_kernel(monkeypatch, q, k, v, options, mask=None):  # type: ignore[no-untyped-def]
    """attnhub.attention(backend="triton_flash") runs the call on the decode kernel, once,
    with output and lse within the contract's tolerance of float64."""
    from attnhub.testing.tolerance import compare

    calls = _count_decode_calls(monkeypatch)
    out, lse = attnhub.attention(q, k, v, mask, backend="triton_flash", return_lse=True,
                                 **options)  # fmt: skip
    assert len(calls) == 1
    m64 = mask if mask is None or mask.dtype == torch.bool else mask.double()
    r64, lse64 = attnhub.attention(q.double(), k.double(), v.double(), m64,
                                   backend="torch_reference", return_lse=True, **options)  # fmt: skip
    r_lp, lse_lp = attnhub.attention(q, k, v, mask, backend="torch_reference", return_lse=True,
                                     **options)  # fmt: skip
    problems = [compare("out", out, r_lp, r64), compare("lse", lse, lse_lp, lse64)]
    assert not [p for p in problems if p], problems


@gpu
@requires_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize(
    ("nq", "nk", "options"),
    [
        (1, 8191, {}),
        (4, 4100, {"causal": True, "alignment": "bottom_right"}),
        (
            2,
            6000,
            {"causal": True, "alignment": "bottom_right", "window": (1024, 0), "softcap": 50.0},
        ),
    ],
)
def test_gpu_dense_calls_shaped_like_decoding(monkeypatch, dtype, d, nq, nk, options):  # type: ignore[no-untyped-def]  # fmt: skip
    """The model-shaped dense decode calls (GQA 32/8, caches of thousands of keys, the
    window and softcap Gemma 2 decodes with) through attnhub.attention(backend=
    "triton_flash"): served by the decode kernel, output and lse against float64."""
    from attnhub.backends.triton_flash import _SOFTCAP_LOG2_LIMIT

    largest = 2.0 ** _SOFTCAP_LOG2_LIMIT[dtype]  # fp32: below Gemma 2's 50
    if options.get("softcap", 0) > largest:
        options = {**options, "softcap": largest}
    g = torch.Generator().manual_seed(d + nq)
    q = torch.randn(3, 32, nq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(3, 8, nk, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(3, 8, nk, d, generator=g).to(DEVICE, dtype)
    _check_on_the_decode_kernel(monkeypatch, q, k, v, options)


@gpu
@requires_cuda
def test_gpu_dense_decoding_steps_through_the_runner(monkeypatch):  # type: ignore[no-untyped-def]
    """A model's decoding steps through attnhub.attention(backend="triton_flash"): per
    step, layers that repeat the first one's call (the runner launches the last plan
    directly: serving.dense_decode_runner), the next step's cache one key longer, and
    calls of another signature in between (another scale, a key mask, another batch, a
    window with softcap), each of which the last plan must not serve. Every answer
    against float64; most calls never reach the general entry."""
    from attnhub.testing.tolerance import compare

    calls = _count_decode_calls(monkeypatch)
    g = torch.Generator().manual_seed(11)
    served = 0
    for n in range(1000, 1010):
        others: list[tuple[int, dict, bool]] = [(4, {}, False)] * 3 + [
            (4, {"scale": 0.3}, False), (4, {}, True), (2, {}, False),
            (4, {"window": (100, 0), "causal": True, "alignment": "bottom_right",
                 "softcap": 30.0}, False),
            (4, {}, False),
        ]  # fmt: skip
        for b, options, masked in others:
            q = torch.randn(b, 16, 1, 128, generator=g).to(DEVICE, torch.bfloat16)
            k = torch.randn(b, 4, n, 128, generator=g).to(DEVICE, torch.bfloat16)
            v = torch.randn(b, 4, n, 128, generator=g).to(DEVICE, torch.bfloat16)
            mask = None
            if masked:  # left padding, its own per sequence
                pads = torch.randint(0, n // 2, (b, 1), generator=g)
                mask = (torch.arange(n) >= pads)[:, None, None, :].to(DEVICE)
            before = len(calls)
            out = attnhub.attention(q, k, v, mask, backend="triton_flash", **options)
            served += len(calls) == before
            r64 = attnhub.attention(q.double(), k.double(), v.double(), mask,
                                    backend="torch_reference", **options)  # fmt: skip
            r_lp = attnhub.attention(q, k, v, mask, backend="torch_reference", **options)
            problem = compare("out", out, r_lp, r64)
            assert not problem, (n, b, options, masked, problem)
    assert served >= 20, served  # the repeated layers, at least


@pytest.mark.parametrize(
    "case",
    ["grad", "mask", "top_left_causal", "17_rows", "forward_ad"],
)
def test_other_dense_calls_keep_the_prefill_kernels(monkeypatch, case):  # type: ignore[no-untyped-def]
    """What the decode kernel cannot give stays on the prefill kernels, with the same
    answer: a gradient, a mask, a top-left diagonal with Nq != Nk, more than 16 rows;
    forward-mode AD (dual tensors) gets the prefill path's error (its autograd.Function
    has no jvp), never a primal without its tangent."""
    from torch.autograd import forward_ad

    calls = _count_decode_calls(monkeypatch)
    nq = 17 if case == "17_rows" else 3
    q, k, v = (torch.randn(1, 4, n, 16, device=DEVICE) for n in (nq, 40, 40))
    options: dict = {"causal": True} if case == "top_left_causal" else {}
    mask = torch.rand(1, 1, nq, 40, device=DEVICE) > 0.3 if case == "mask" else None
    want = attnhub.attention(q, k, v, mask, backend="torch_reference", **options)
    if case == "grad":
        q.requires_grad_()
    if case == "forward_ad":
        with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="jvp"):
            attnhub.attention(forward_ad.make_dual(q, torch.randn_like(q)), k, v,
                              backend="triton_flash")  # fmt: skip
        assert calls == []
        return
    got = attnhub.attention(q, k, v, mask, backend="triton_flash", **options)
    assert calls == []
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_nan_query_gives_a_nan_row_and_lse(splits):  # type: ignore[no-untyped-def]
    """A NaN in query row i: its output row and its lse are NaN (contract: NaN in, NaN
    out), on the one-split path and through the merge; other rows are untouched. The
    epilogues took a NaN row sum for "no key" and wrote lse -inf."""
    q, k, v, seqlens = make_inputs(1, 4, 2, 3, 96, 16, torch.float32, [96])
    q[0, :, 1, 5] = float("nan")
    config = decode.DecodeConfig(16, 4, 1, num_splits=splits)
    out, lse = decode.decode_attention(q, k, v, seqlens, scale=0.25, return_lse=True,
                                       causal=False, config=config)  # fmt: skip
    assert out[0, :, 1].isnan().all() and lse[0, :, 1].isnan().all()
    others = torch.tensor([0, 2])
    assert out[0, :, others].isfinite().all() and lse[0, :, others].isfinite().all()
