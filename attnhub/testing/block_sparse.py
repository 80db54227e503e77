"""Conformance cases for ``block_sparse``: random layouts in random calls.

:func:`cases_for` and :func:`sample_cases` plan and draw calls without a layout, so a
backend that declares ``block_sparse`` was held to nothing there. Each case here builds
a layout with one of :class:`attnhub.BlockSparseLayout`'s constructors (a random block
mask, per batch entry or head or broadcast; a token ``mask_mod`` band, whose edge
blocks are partial; causal, sliding window, strided and BigBird) with block sides of
16 to 128 tokens and lengths that are no multiple of them, and a call around it: GQA,
Nq and Nk apart from 1 up, causal in either alignment, a window, a softcap, a scale
(negative too), a bool or float ``attn_mask`` (rows left with no key among them), the
lse and the backward. contract.md: the call means the same call with the layout's
``to_dense_mask`` as one more bool mask; the backend's answer is held to the tolerance
rule against float64 attention on that dense mask with no layout (backends read the
layout's block index lists instead; ``r_lp``, the bound's width, is the same in the
input dtype, every operation in that dtype as in :func:`plain_attention`), and rows
with no key must be exactly zero.

A case is a pure function of its seed and size: a failing id reproduces alone.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import attnhub
from attnhub.backend import Backend, declared_reasons
from attnhub.block_sparse import BlockSparseLayout
from attnhub.output_check import unchecked
from attnhub.registry import get_registry
from attnhub.request import device_capability, dtype_tag
from attnhub.validation import build_request, make_params

from .cases import _extra_reasons, first_admitted
from .faults import describe_exception, passes_through
from .tolerance import compare, fully_masked_problems, highest_float32_precision

BLOCK_SIDES = (16, 32, 64, 128)
# The longest sequence a case of each size draws ("tiny" keeps Triton's interpreter
# quick; "large" reaches past a few 128-token tiles on a GPU).
LONGEST = {"tiny": 150, "small": 200, "large": 1100}
_CALL_DEFAULTS: dict[str, Any] = {
    "causal": False, "alignment": "top_left", "window": None, "softcap": None,
    "scale": None, "dropout_p": 0.0,
}  # fmt: skip


@dataclass(frozen=True)
class BlockSparseCase:
    """One block-sparse call: shapes, dtype, options (:func:`attnhub.attention`'s
    keywords), the layout's recipe, the call's own mask ("bool", "float" or None, over
    ``mask_batch`` batch entries), whether the lse is returned and a backward runs, the
    seed of its inputs."""

    id: str
    b: int
    hq: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: torch.dtype
    options: dict[str, Any] = field(hash=False)
    layout: Callable[[], BlockSparseLayout] = field(hash=False, repr=False)
    mask: str | None
    mask_batch: int
    return_lse: bool
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


def draw_block_sparse_case(
    seed: int, size: str = "small", dtypes: tuple[torch.dtype, ...] | None = None
) -> BlockSparseCase:
    """One random block-sparse call (module docstring), a pure function of its
    arguments: lengths up to ``LONGEST[size]``, a dtype among ``dtypes`` (default
    float32, float16, bfloat16)."""
    if size not in LONGEST:
        raise ValueError(f"size must be one of {tuple(LONGEST)}, got {size!r}")
    rng = random.Random(seed)
    longest = LONGEST[size]
    b, hkv = rng.randint(1, 2), rng.randint(1, 2)
    hq = hkv * rng.randint(1, 3)
    nq = _length(rng, longest)
    nk = nq if rng.random() < 0.3 else _length(rng, longest)
    d = rng.choice([16, 32, 40, 64])
    dtype = rng.choice(dtypes or (torch.float32, torch.float16, torch.bfloat16))
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
    return_lse = rng.random() < 0.5
    backward = rng.random() < 0.5
    flags = "".join(f"-{k}{v}" for k, v in options.items()).replace(" ", "")
    ident = (f"{seed}-{name}-B{b}H{hq}kv{hkv}N{nq}x{nk}D{d}-{dtype_tag(dtype)}{flags}"
             f"{'-' + mask + 'mask' if mask else ''}{'-lse' if return_lse else ''}"
             f"{'-bwd' if backward else ''}")  # fmt: skip
    return BlockSparseCase(ident, b, hq, hkv, nq, nk, d, dtype, options, layout, mask,
                           mask_batch, return_lse, backward, rng.randrange(1 << 30))  # fmt: skip


def _inputs(c: BlockSparseCase) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
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


def block_sparse_reasons(
    backend: Backend, case: BlockSparseCase, device: torch.device | str
) -> list[str]:
    """Why ``backend`` would not be offered ``case`` on ``device`` (empty: it would): its
    declarations and ``extra_reasons`` on the request dispatch would build."""
    device = torch.device(device)
    (q, k, v), mask, _ = _inputs(case)
    grad = case.backward
    params = make_params(q, key=k, block_sparse=case.layout(), return_lse=case.return_lse,
                         **{**_CALL_DEFAULTS, **case.options})  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_(grad)
    with torch.enable_grad():
        request = build_request(q, k, v, mask, params)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    capability = device_capability(device) if cuda else None
    request = dataclasses.replace(request, device_type=device.type, capability=capability)
    return declared_reasons(backend, request) or _extra_reasons(backend, request)


def sample_block_sparse_cases(
    backend: Backend | str,
    device: torch.device | str = "cpu",
    count: int = 12,
    *,
    seed: int = 0,
    size: str = "small",
) -> list[BlockSparseCase]:
    """Up to ``count`` block-sparse cases that ``backend`` claims on ``device``, drawn
    from seed ``seed`` on (50 draws at most per case asked for); none for a backend
    that does not declare ``block_sparse``."""
    if isinstance(backend, str):
        backend = get_registry().get(backend)
    if not backend.block_sparse:
        return []
    return first_admitted(
        lambda case_seed: draw_block_sparse_case(case_seed, size),
        lambda case: block_sparse_reasons(backend, case, device),
        count, seed,
    )  # fmt: skip


def _results(
    fn: Callable, qkv: list[torch.Tensor], mask: torch.Tensor | None, dout: torch.Tensor,
    backward: bool, dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """out, the lse where ``fn`` returns one (and dq, dk, dv) of ``fn(q, k, v, mask) ->
    out or (out, lse)`` on copies of the inputs, converted to ``dtype`` where given (a
    float mask too)."""
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_(backward) for t in qkv]
    if mask is not None and dtype is not None and mask.dtype != torch.bool:
        mask = mask.to(dtype)
    returned = fn(*leaves, mask)
    out, lse = returned if isinstance(returned, tuple) else (returned, None)
    results = {"out": out.detach()}
    if lse is not None:
        results["lse"] = lse.detach()
    if backward:
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        results.update(zip(("dq", "dk", "dv"), grads))
    return results


def _reference(q: Any, k: Any, v: Any, mask: Any, options: dict[str, Any]) -> Any:
    """The contract's attention, every operation in the inputs' dtype, no layout."""
    from attnhub.backends.torch_reference import reference_attention

    params = make_params(q, key=k, block_sparse=None, return_lse=True,
                         **{**_CALL_DEFAULTS, **options})  # fmt: skip
    return reference_attention(q, k, v, mask, params)


def block_sparse_problems(
    backend_name: str | None, case: BlockSparseCase, device: torch.device | str = "cpu"
) -> list[str]:
    """What ``attnhub.attention(..., block_sparse=layout, backend=backend_name)`` on
    ``device`` gets wrong against the dense-mask reference (module docstring); [] when
    nothing. ``None`` holds attnhub's own choice to it. What the backend raises is a
    problem in the list, never an exception through it."""
    device = torch.device(device)
    layout = case.layout()
    qkv, mask, dout = _inputs(case)
    dense = layout.to_dense_mask(case.nq, case.nk)
    if mask is None:
        combined: torch.Tensor = dense
    elif mask.dtype == torch.bool:
        combined = dense & mask
    else:
        combined = mask.masked_fill(~dense, float("-inf"))
    device_layout = layout.to(device)

    def call(q: Any, k: Any, v: Any, m: Any) -> Any:
        returned = attnhub.attention(q, k, v, m, block_sparse=device_layout,
                                     return_lse=case.return_lse, backend=backend_name,
                                     **case.options)  # fmt: skip
        if isinstance(returned, tuple) != case.return_lse:
            raise TypeError(
                f"return_lse={case.return_lse}: expected "
                f"{'(out, lse)' if case.return_lse else 'a tensor'}, got {type(returned).__name__}"
            )
        return returned

    def reference(q: Any, k: Any, v: Any, m: Any) -> Any:
        return _reference(q, k, v, m, case.options)

    with highest_float32_precision():
        r64 = _results(reference, qkv, combined, dout, case.backward, torch.float64)
        r_lp = _results(reference, qkv, combined, dout, case.backward)
        try:  # unchecked: the kit judges the results, and the backend stays enabled
            with unchecked():
                got = _results(call, [t.to(device) for t in qkv],
                               None if mask is None else mask.to(device), dout.to(device),
                               case.backward)  # fmt: skip
        except BaseException as exc:
            if passes_through(exc):
                raise
            return [f"raised {describe_exception(exc, backend_name)}"]
    dtypes = [
        f"{name}: {t.dtype} on {t.device.type}, expected {want} on {device.type}"
        for name, t in got.items()
        if t.dtype != (want := torch.float32 if name == "lse" else case.dtype)
        or t.device.type != device.type
    ]
    if dtypes:
        return dtypes
    got = {name: t.cpu() for name, t in got.items()}
    wanted = [name for name in r64 if name != "lse" or case.return_lse]
    if "lse" in wanted and "lse" not in got:  # (out, None)
        return ["returned no lse"]
    problems = [p for name in wanted if (p := compare(name, got[name], r_lp[name], r64[name]))]
    if problems:  # (a shape among them: the rows below could not be read)
        return problems
    return fully_masked_problems(torch.isinf(r64["lse"]), got["out"], got.get("dq"))
