"""Random block-sparse calls, every option at once, against the layout's dense meaning.

test_triton_blocksparse.py checks planned cases, and the sampled suite
(test_sampled_cases.py) draws no block-sparse call. Here each draw builds a layout with
one of the public constructors (a random block mask, per batch or head or broadcast; a
token ``mask_mod``, whose edge blocks are partial; causal, sliding window, strided and
BigBird), block sides among triton_blocksparse's tiles and lengths that are no multiple
of them, and a call around it: GQA, Nq and Nk apart from 1 up, causal in either
alignment, a window, a softcap, a scale (negative too), a bool or float ``attn_mask``
(rows left with no key among them), the lse and the backward. A backend's answer passes
the contract's tolerance rule against float64 attention on the layout's
``to_dense_mask`` combined with the call's mask and no layout (the backends read the
layout's block index lists instead), and rows with no key are exactly zero. The draw is
a pure function of its seed: a failing id reproduces alone.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnhub  # noqa: E402
from attnhub import BlockSparseLayout  # noqa: E402
from attnhub.backends.torch_reference import reference_attention  # noqa: E402
from attnhub.registry import get_registry  # noqa: E402
from attnhub.testing.tolerance import compare, fully_masked_problems  # noqa: E402
from attnhub.validation import make_params  # noqa: E402

BLOCK_SIDES = (16, 32, 64, 128)  # triton_blocksparse's tiles (SUPPORTED_BLOCKS)
_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_CALL_DEFAULTS: dict[str, Any] = {
    "causal": False, "alignment": "top_left", "window": None, "softcap": None,
    "scale": None, "dropout_p": 0.0,
}  # fmt: skip


@dataclass(frozen=True)
class Draw:
    """One call: shapes, dtype, options, the layout's recipe and the seed of its inputs."""

    id: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: torch.dtype
    options: dict[str, Any] = field(hash=False)
    layout: Callable[[], BlockSparseLayout] = field(hash=False)
    mask: str | None
    mask_batch: int
    backward: bool
    seed: int


def _length(rng: random.Random, longest: int) -> int:
    """1 a tenth of the time (a decode row), else log-uniform up to ``longest``."""
    if rng.random() < 0.1:
        return 1
    return max(1, int(math.exp(rng.uniform(0.0, math.log(longest)))))


def _layout(rng: random.Random, b: int, h: int, nq: int, nk: int) -> tuple[str, Callable]:
    """(its name, a builder) of a random layout for an (Nq, Nk) call; the square-only
    constructors are drawn where Nq == Nk."""
    kinds = ["blocks", "blocks", "mask_mod"] + (
        ["causal", "window", "strided", "bigbird"] if nq == nk else []
    )
    kind = rng.choice(kinds)
    side = rng.choice(BLOCK_SIDES)
    if kind == "blocks":
        block = (rng.choice(BLOCK_SIDES), rng.choice(BLOCK_SIDES))
        shape = (rng.choice([1, b]), rng.choice([1, h]), -(-nq // block[0]), -(-nk // block[1]))
        density, seed = rng.choice([0.1, 0.4, 0.8, 1.0]), rng.randrange(1 << 30)

        def blocks() -> BlockSparseLayout:
            keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
            return BlockSparseLayout.from_block_mask(keep, block)

        return f"blocks{block[0]}x{block[1]}-{density}", blocks
    if kind == "mask_mod":
        block = (rng.choice(BLOCK_SIDES), rng.choice(BLOCK_SIDES))
        shift, width = rng.randrange(-50, 50), rng.randrange(0, 80)

        def band(b: Any, h: Any, q: Any, kv: Any) -> Any:
            return (q - kv + shift).abs() <= width

        return (
            f"band{shift},{width}-{block[0]}x{block[1]}",
            lambda: BlockSparseLayout.from_mask_mod(band, nq, nk, block),
        )
    if kind == "causal":
        return f"causal{side}", lambda: BlockSparseLayout.causal(nq, side)
    if kind == "window":
        window, causal = rng.randrange(0, 100), rng.random() < 0.5
        return (
            f"window{window}{'c' if causal else ''}-{side}",
            lambda: BlockSparseLayout.sliding_window(nq, window, side, causal=causal),
        )
    if kind == "strided":
        local, stride, causal = rng.randrange(0, 3), rng.randrange(1, 4), rng.random() < 0.5
        return (
            f"strided{local},{stride}{'c' if causal else ''}-{side}",
            lambda: BlockSparseLayout.strided(
                nq, side, local_blocks=local, stride=stride, causal=causal
            ),
        )
    glob, band_blocks, rand, seed = (rng.randrange(0, 2), rng.randrange(0, 4),
                                     rng.randrange(0, 3), rng.randrange(100))  # fmt: skip
    return f"bigbird{glob},{band_blocks},{rand}-{side}", lambda: BlockSparseLayout.bigbird(
        nq, side, global_blocks=glob, window_blocks=band_blocks, random_blocks=rand, seed=seed
    )


def draw(seed: int, longest: int, dtypes: tuple[torch.dtype, ...], backward: bool) -> Draw:
    """One random block-sparse call (module docstring), a pure function of ``seed``;
    lengths up to ``longest``, a dtype among ``dtypes``, a backward only if allowed."""
    rng = random.Random(seed)
    b, hkv = rng.randint(1, 2), rng.randint(1, 2)
    hq = hkv * rng.randint(1, 3)
    nq = _length(rng, longest)
    nk = nq if rng.random() < 0.3 else _length(rng, longest)
    d, dtype = rng.choice([16, 32, 40, 64]), rng.choice(dtypes)
    name, layout = _layout(rng, b, hq, nq, nk)
    options: dict[str, Any] = {}
    if rng.random() < 0.3:
        options.update(causal=True, alignment=rng.choice(["top_left", "bottom_right"]))
    if rng.random() < 0.2:
        left = rng.choice([None, rng.randrange(0, 60)])
        options["window"] = (left, rng.randrange(0, 60) if left is None else rng.choice([None, 3]))
    if rng.random() < 0.2:
        options["softcap"] = rng.choice([2.0, 5.5, 30.0])
    if rng.random() < 0.15:
        options["scale"] = rng.choice([-0.3, 0.05, 1.0])
    mask = rng.choice([None, None, "bool", "float"])
    mask_batch = rng.choice([1, b])
    grad = backward and rng.random() < 0.5
    flags = "".join(f"-{k}{v}" for k, v in options.items()).replace(" ", "")
    ident = (f"{seed}-{name}-B{b}H{hq}kv{hkv}N{nq}x{nk}D{d}-{_SHORT[dtype]}{flags}"
             f"{'-' + mask + 'mask' if mask else ''}{'-bwd' if grad else ''}")  # fmt: skip
    return Draw(ident, b, hq, hkv, nq, nk, d, dtype, options, layout, mask, mask_batch, grad,
                rng.randrange(1 << 30))  # fmt: skip


def _inputs(c: Draw) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """q, k, v, the call's attn_mask and the output gradient, on CPU in c.dtype: normal
    values; a bool mask keeps 80% of keys, a float mask adds normal values and hides 20%
    with -inf (either may leave a row no key)."""
    gen = torch.Generator().manual_seed(c.seed)
    shapes = ((c.b, c.hq, c.nq, c.d), (c.b, c.hkv, c.nk, c.d), (c.b, c.hkv, c.nk, c.d))
    qkv = [torch.randn(s, generator=gen).to(c.dtype) for s in shapes]
    dout = torch.randn(c.b, c.hq, c.nq, c.d, generator=gen).to(c.dtype)
    shape = (c.mask_batch, 1, c.nq, c.nk)
    mask = None
    if c.mask == "bool":
        mask = torch.rand(shape, generator=gen) < 0.8
    elif c.mask == "float":
        hidden = torch.rand(shape, generator=gen) < 0.2
        mask = torch.randn(shape, generator=gen).to(c.dtype).masked_fill(hidden, float("-inf"))
    return qkv, mask, dout


def _results(
    fn: Callable, qkv: list[torch.Tensor], mask: torch.Tensor | None, dout: torch.Tensor,
    backward: bool, dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """out, lse (and dq, dk, dv) of ``fn(q, k, v, mask) -> (out, lse)`` on copies of the
    inputs, converted to ``dtype`` where given (a float mask too)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(backward) for t in qkv]
    if mask is not None and dtype is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    out, lse = fn(*leaves, mask)
    results = {"out": out.detach(), "lse": lse.detach()}
    if backward:
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.update(zip(("dq", "dk", "dv"), grads))
    return results


def case_problems(backend: str | None, c: Draw, device: str) -> list[str]:
    """What ``attnhub.attention(..., block_sparse=layout, backend=backend)`` on ``device``
    gets wrong against the dense-mask reference (module docstring); [] when nothing."""
    layout = c.layout()
    qkv, mask, dout = _inputs(c)
    dense = layout.to_dense_mask(c.nq, c.nk)
    if mask is None:
        combined: torch.Tensor = dense
    elif mask.dtype == torch.bool:
        combined = dense & mask
    else:
        combined = mask.masked_fill(~dense, float("-inf"))
    on_device = [t.to(device) for t in qkv]
    device_mask = None if mask is None else mask.to(device)
    device_layout = layout.to(device)

    def backend_call(q: Any, k: Any, v: Any, m: Any) -> Any:
        return attnhub.attention(q, k, v, m, block_sparse=device_layout, return_lse=True,
                                 backend=backend, **c.options)  # fmt: skip

    def reference(q: Any, k: Any, v: Any, m: Any) -> Any:
        params = make_params(q, key=k, block_sparse=None, return_lse=True,
                             **{**_CALL_DEFAULTS, **c.options})  # fmt: skip
        return reference_attention(q, k, v, m, params)

    got = _results(backend_call, on_device, device_mask, dout.to(device), c.backward)
    got = {name: t.cpu() for name, t in got.items()}
    r64 = _results(reference, qkv, combined, dout, c.backward, torch.float64)
    r_lp = _results(reference, qkv, combined, dout, c.backward)
    problems = [p for name in r64 if (p := compare(name, got[name], r_lp[name], r64[name]))]
    empty = torch.isinf(r64["lse"])
    return problems + fully_masked_problems(empty, got["out"], got.get("dq"))


def _claims(name: str, device: str) -> bool:
    registry = get_registry()
    return (
        name in registry.names()
        and registry.unavailable_reason(name) is None
        and (device in registry.get(name).devices)
    )


# (backend or None for attnhub's own choice, device, draws, longest length, dtypes,
# whether backward draws are made). Triton's interpreter runs fewer, shorter draws in
# float32 and float16 (it has no bfloat16); FlexAttention has no backward on CPU; CUDA
# draws reach past two 128-key tiles into lengths that no tile divides.
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TARGETS = [
    (None, "cpu", 30, 200, _CPU_DTYPES, True),
    ("torch_reference", "cpu", 30, 200, _CPU_DTYPES, True),
    ("triton_blocksparse", "cpu", 16, 150, (torch.float32, torch.float16), True),
    ("flex_attention", "cpu", 12, 200, _CPU_DTYPES, False),
    (None, "cuda", 30, 1100, _CUDA_DTYPES, True),
    ("triton_blocksparse", "cuda", 40, 1100, _CUDA_DTYPES, True),
    ("flex_attention", "cuda", 20, 1100, _CUDA_DTYPES, True),
]


def _params() -> list[Any]:
    params = []
    for index, (name, device, count, longest, dtypes, backward) in enumerate(_TARGETS):
        if device == "cuda":
            marks = [pytest.mark.gpu,
                     pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]  # fmt: skip
        elif HAS_CUDA and name == "triton_blocksparse":
            continue  # with CUDA the Triton backends run on it, not in the interpreter
        else:
            marks = []
        for i in range(count):
            c = draw(1000 * index + i, longest, dtypes, backward)
            label = f"{name or 'auto'}-{device}-{c.id}"
            params.append(pytest.param(name, device, c, id=label, marks=marks))
    return params


@pytest.mark.parametrize(("backend", "device", "case"), _params())
def test_block_sparse_draw(backend: str | None, device: str, case: Draw) -> None:
    if backend is not None and not _claims(backend, device):
        pytest.skip(f"{backend} does not serve {device} here")
    problems = case_problems(backend, case, device)
    assert not problems, f"{case.id}: " + "; ".join(problems)


def test_draws_cover_the_layouts_and_options() -> None:
    """The draws reach every layout constructor and option (the suite never passes by
    drawing narrow calls), and the same seed draws the same call."""
    cases = [draw(seed, 200, _CPU_DTYPES, True) for seed in range(200)]
    ids = " ".join(c.id for c in cases)
    for part in ("blocks", "band", "causal", "window", "strided", "bigbird", "-causalTrue",
                 "bottom_right", "-window(", "-softcap", "-scale-", "boolmask", "floatmask",
                 "-bwd", "N1x", "x1D"):  # fmt: skip
        assert part in ids, part
    assert any(c.hq > c.hkv for c in cases) and any(c.nq != c.nk for c in cases)
    assert draw(7, 200, _CPU_DTYPES, True).id == draw(7, 200, _CPU_DTYPES, True).id
    assert not any(draw(s, 200, _CPU_DTYPES, False).backward for s in range(50))


def test_a_wrong_backend_answer_is_caught() -> None:
    """The check fails a backend that ignores the layout (dense attention with only the
    call's own mask): the comparison can fail."""

    class IgnoresLayout(attnhub.Backend):
        name = "sampled_ignores_layout"
        devices = frozenset({"cpu"})
        dtypes = frozenset({torch.float32})
        block_sparse = lse = gqa = True

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            dense = make_params(query, key=key, block_sparse=None, return_lse=True,
                                **_CALL_DEFAULTS)  # fmt: skip
            return reference_attention(query, key, value, attn_mask, dense)

    registry = get_registry()
    registry.add(IgnoresLayout())
    try:
        sparse = next(
            c for c in (draw(s, 200, (torch.float32,), False) for s in range(100))
            if c.id.split("-")[1].startswith("blocks") and "0.1" in c.id and not c.options
            and c.nq > 1 and c.mask is None
        )  # fmt: skip
        assert case_problems(IgnoresLayout.name, sparse, "cpu")
    finally:
        registry.remove(IgnoresLayout.name)
