"""Random packed (varlen), KV-cache and paged calls against a loop of dense float64 calls.

test_varlen.py, test_kvcache.py and test_paged_generate.py check planned cases. Here
each draw is one call of :func:`attnhub.attention_varlen` or
:func:`attnhub.attention_kvcache` (contiguous or paged) with every dimension and option
drawn at once: 1 to 4 sequences of lengths from 0 (an empty sequence or cache) up,
GQA, head dims 16-64 with Dv apart, causal in either alignment, a window, a softcap, a
scale (negative too), the lse; for a cache, 1 to 7 new queries, keys appended in place
or not, page sizes 1 to 16 with the pages shuffled. Each sequence must be the dense call
of that sequence alone (contract.md, "Packed sequences and KV caches"), by the
tolerance rule against float64 (``r_lp``: the kit's plain computation in the input
dtype), and the appended keys must land in the cache. A backend that declines a drawn
call (NoBackendError) is not held to it; every target must serve most of its draws.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnhub  # noqa: E402
from attnhub.registry import get_registry  # noqa: E402
from attnhub.request import dtype_tag  # noqa: E402
from attnhub.testing import compare, highest_float32_precision, plain_attention  # noqa: E402


@dataclass(frozen=True)
class Draw:
    """One serving call: its kind ("varlen", "kvcache" or "paged"), heads, head dims,
    dtype, options, per-sequence lengths, and the seed of its inputs."""

    id: str
    kind: str
    hq: int
    hkv: int
    d: int
    dv: int
    dtype: torch.dtype
    options: dict[str, Any] = field(hash=False)
    q_lens: tuple[int, ...]  # varlen: queries per sequence; cache: (Nq,) * B
    k_lens: tuple[int, ...]  # varlen: keys per sequence; cache: keys already cached
    new: int  # cache: keys appended by the call
    capacity: int  # cache: Nmax
    page_size: int
    seed: int


def _length(rng: random.Random, longest: int) -> int:
    kind = rng.random()
    if kind < 0.08:
        return 0
    if kind < 0.2:
        return 1
    return max(1, int(math.exp(rng.uniform(0.0, math.log(longest)))))


def draw(seed: int, longest: int, dtypes: tuple[torch.dtype, ...]) -> Draw:
    """A random serving call (module docstring), a pure function of its arguments."""
    rng = random.Random(seed)
    kind = rng.choice(["varlen", "kvcache", "paged"])
    b, hkv = rng.randint(1, 4), rng.randint(1, 2)
    hq = hkv * rng.randint(1, 4)
    d = rng.choice([16, 32, 40, 64])
    dv = d if rng.random() < 0.85 else rng.choice([16, 32])
    dtype = rng.choice(dtypes)
    options: dict[str, Any] = {}
    if rng.random() < 0.4:
        options["causal"] = True
    if rng.random() < 0.3:
        options["alignment"] = rng.choice(["top_left", "bottom_right"])
    if rng.random() < 0.2:
        left = rng.choice([None, rng.randrange(0, 40)])
        options["window"] = (left, rng.randrange(0, 40) if left is None else rng.choice([None, 2]))
    if rng.random() < 0.2:
        options["softcap"] = rng.choice([3.0, 20.0])
    if rng.random() < 0.15:
        options["scale"] = rng.choice([-0.2, 0.1, 1.3])
    options["return_lse"] = rng.random() < 0.5
    new = capacity = page_size = 0
    if kind == "varlen":
        q_lens = tuple(_length(rng, longest) for _ in range(b))
        k_lens = tuple(_length(rng, longest) if rng.random() < 0.6 else n for n in q_lens)
    else:
        nq = rng.choice([1, 1, 2, 4, 7])
        new = rng.choice([0, 0, 1, nq])
        capacity = rng.randint(max(new, 1), longest)
        q_lens = (nq,) * b
        k_lens = tuple(rng.randint(0, capacity - new) for _ in range(b))
        page_size = rng.choice([1, 4, 16]) if kind == "paged" else 0
    flags = "".join(f"-{k}{v}" for k, v in options.items()).replace(" ", "")
    shape = "x".join(map(str, q_lens)) + "_" + "x".join(map(str, k_lens))
    ident = (f"{seed}-{kind}{page_size or ''}-H{hq}kv{hkv}D{d}v{dv}-{shape}"
             f"{f'+{new}' if new else ''}-{dtype_tag(dtype)}{flags}")  # fmt: skip
    return Draw(ident, kind, hq, hkv, d, dv, dtype, options, q_lens, k_lens, new, capacity,
                page_size, rng.randrange(1 << 30))  # fmt: skip


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> Any:
    """The kit's r_lp computation of one dense call (zeros and -inf without keys)."""
    if k.shape[2] == 0:
        shape = (*q.shape[:3], v.shape[-1])
        return q.new_zeros(shape), torch.full(q.shape[:3], float("-inf"))
    call = SimpleNamespace(
        scale=options.get("scale"), D=q.shape[-1], softcap=options.get("softcap"),
        causal=options.get("causal", False), alignment=options["alignment"],
        window=options.get("window"),
    )  # fmt: skip
    return plain_attention(q, k, v, None, call)


def _dense(q: Any, k: Any, v: Any, options: dict[str, Any], dtype: torch.dtype | None) -> Any:
    """(out, lse) of one sequence's dense call: float64 by torch_reference, or r_lp."""
    if dtype is None:
        return _plain(q, k, v, options)
    return attnhub.attention(q.to(dtype), k.to(dtype), v.to(dtype), return_lse=True,
                             backend="torch_reference", **options)  # fmt: skip


def case_problems(backend: str | None, c: Draw, device: str) -> list[str] | None:
    """What the call gets wrong against the loop of dense calls; None where the backend
    declines it."""
    gen = torch.Generator().manual_seed(c.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(c.dtype)

    options = {k: v for k, v in c.options.items() if k != "return_lse"}
    return_lse = c.options["return_lse"]
    dense_options = {"alignment": "bottom_right" if c.kind != "varlen" else "top_left",
                     **options}  # fmt: skip
    problems: list[str] = []
    if c.kind == "varlen":
        q = randn(sum(c.q_lens), c.hq, c.d)
        k, v = randn(sum(c.k_lens), c.hkv, c.d), randn(sum(c.k_lens), c.hkv, c.dv)
        cu_q = torch.tensor([0, *torch.tensor(c.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(c.k_lens).cumsum(0).tolist()], dtype=torch.int32)
        try:
            got = attnhub.attention_varlen(
                q.to(device), k.to(device), v.to(device), cu_q.to(device), cu_k.to(device),
                return_lse=return_lse, backend=backend, **options,
            )  # fmt: skip
        except attnhub.NoBackendError:
            return None
        # Sequence j: its rows of the packed tensors as a (1, H, N, D) dense call.
        calls = [
            tuple(t[lo:hi].transpose(0, 1)[None] for t, lo, hi in (
                (q, cu_q[j], cu_q[j + 1]), (k, cu_k[j], cu_k[j + 1]), (v, cu_k[j], cu_k[j + 1])))
            for j in range(len(c.q_lens))
        ]  # fmt: skip

        def joined(dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
            results = [_dense(*call, dense_options, dtype) for call in calls]
            out = torch.cat([o[0].transpose(0, 1) for o, _ in results])
            return out, torch.cat([lse[0].transpose(0, 1) for _, lse in results])
    else:
        b, nq = len(c.q_lens), c.q_lens[0]
        cache_k, cache_v = randn(b, c.hkv, c.capacity, c.d), randn(b, c.hkv, c.capacity, c.dv)
        q = randn(b, c.hq, nq, c.d)
        k_new = randn(b, c.hkv, c.new, c.d) if c.new else None
        v_new = randn(b, c.hkv, c.new, c.dv) if c.new else None
        want_k, want_v = cache_k.clone(), cache_v.clone()
        for j, cached in enumerate(c.k_lens):
            if c.new:
                want_k[j, :, cached : cached + c.new] = k_new[j]  # type: ignore[index]
                want_v[j, :, cached : cached + c.new] = v_new[j]  # type: ignore[index]
        seqlens = torch.tensor(c.k_lens, dtype=torch.int32)
        table = None
        if c.kind == "paged":
            pages = -(-c.capacity // c.page_size)
            table = torch.randperm(b * pages + 3, generator=gen)[: b * pages].view(b, pages)
            k_store = randn(b * pages + 3, c.page_size, c.hkv, c.d)
            v_store = randn(b * pages + 3, c.page_size, c.hkv, c.dv)
            for j in range(b):
                for page in range(pages):
                    lo, hi = page * c.page_size, min(c.capacity, (page + 1) * c.page_size)
                    k_store[table[j, page], : hi - lo] = cache_k[j, :, lo:hi].transpose(0, 1)
                    v_store[table[j, page], : hi - lo] = cache_v[j, :, lo:hi].transpose(0, 1)
            table = table.to(torch.int32)
        else:
            k_store, v_store = cache_k, cache_v
        k_store, v_store = k_store.to(device), v_store.to(device)
        try:
            got = attnhub.attention_kvcache(
                q.to(device), k_store, v_store, seqlens.to(device),
                block_table=None if table is None else table.to(device),
                k_new=None if k_new is None else k_new.to(device),
                v_new=None if v_new is None else v_new.to(device),
                return_lse=return_lse, backend=backend, **options,
            )  # fmt: skip
        except attnhub.NoBackendError:
            return None
        if c.kind == "kvcache" and not (
            torch.equal(k_store.cpu(), want_k) and torch.equal(v_store.cpu(), want_v)
        ):
            problems.append("the cache does not hold the appended keys and values, or more changed")
        calls = [
            (q[j : j + 1], want_k[j : j + 1, :, : n + c.new], want_v[j : j + 1, :, : n + c.new])
            for j, n in enumerate(c.k_lens)
        ]

        def joined(dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
            results = [_dense(*call, dense_options, dtype) for call in calls]
            return torch.cat([o for o, _ in results]), torch.cat([lse for _, lse in results])

    out, lse = got if return_lse else (got, None)
    with highest_float32_precision():
        r64, r_lp = joined(torch.float64), joined(None)
    problems += [p for p in [compare("out", out.cpu(), r_lp[0], r64[0])] if p]
    if return_lse:
        problems += [p for p in [compare("lse", lse.cpu(), r_lp[1], r64[1])] if p]
    return problems


def _serves(name: str, device: str) -> bool:
    registry = get_registry()
    return (
        name in registry.names()
        and registry.unavailable_reason(name) is None
        and device in registry.get(name).devices
    )


# (backend or None for attnhub's own choice, device, draws, longest length, dtypes).
# Triton's interpreter runs fewer, shorter draws in float32 and float16 (it has no
# bfloat16); CUDA draws reach past a few tiles.
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TARGETS = [
    (None, "cpu", 40, 100, _CPU_DTYPES),
    ("torch_reference", "cpu", 20, 100, _CPU_DTYPES),
    ("triton_flash", "cpu", 20, 60, (torch.float32, torch.float16)),
    (None, "cuda", 40, 1100, (torch.float16, torch.bfloat16)),
    ("triton_flash", "cuda", 40, 1100, (torch.float16, torch.bfloat16, torch.float32)),
    ("torch_varlen", "cuda", 30, 1100, (torch.float16, torch.bfloat16)),
]


def _params() -> list[Any]:
    params = []
    for index, (name, device, count, longest, dtypes) in enumerate(_TARGETS):
        if device == "cuda":
            marks = [pytest.mark.gpu,
                     pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]  # fmt: skip
        elif HAS_CUDA and name == "triton_flash":
            continue  # with CUDA the Triton backends run on it, not in the interpreter
        else:
            marks = []
        for i in range(count):
            c = draw(1000 * index + i, longest, dtypes)
            params.append(pytest.param(name, device, c, id=f"{name or 'auto'}-{device}-{c.id}",
                                       marks=marks))  # fmt: skip
    return params


@pytest.mark.parametrize(("backend", "device", "case"), _params())
def test_serving_draw(backend: str | None, device: str, case: Draw) -> None:
    if backend is not None and not _serves(backend, device):
        pytest.skip(f"{backend} does not serve {device} here")
    problems = case_problems(backend, case, device)
    if problems is None:
        pytest.skip(f"{backend} declines this call (NoBackendError)")
    assert not problems, f"{case.id}: " + "; ".join(problems)


def test_the_draws_are_served_and_cover_the_options() -> None:
    """Most draws are served (the suite does not pass by declining), and over the draws
    every kind, option and edge (an empty sequence or cache, one query) occurs."""
    cases = [draw(seed, 100, _CPU_DTYPES) for seed in range(150)]
    ids = " ".join(c.id for c in cases)
    for part in ("varlen", "kvcache", "paged1", "paged4", "paged16", "-causalTrue",
                 "bottom_right", "top_left", "-window(", "-softcap", "-scale-",
                 "return_lseTrue", "+1", "fp16", "bf16"):  # fmt: skip
        assert part in ids, part
    assert any(0 in c.q_lens or 0 in c.k_lens for c in cases)
    assert any(c.hq > c.hkv for c in cases) and any(c.dv != c.d for c in cases)
    served = sum(case_problems(None, c, "cpu") is not None for c in cases[:30])
    assert served == 30


@pytest.mark.parametrize("kind", ["varlen", "kvcache", "paged"])
def test_a_wrong_answer_is_caught(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: outputs 1% off, or a cache left unwritten, are reported."""
    case = next(
        c for c in (draw(seed, 100, (torch.float32,)) for seed in range(200))
        if c.kind == kind and min(c.q_lens) > 0 and min(c.k_lens) > 0
        and (kind != "kvcache" or c.new)
    )  # fmt: skip
    name = "attention_varlen" if kind == "varlen" else "attention_kvcache"
    served = getattr(attnhub, name)

    def off(*args: Any, **kwargs: Any) -> Any:
        if kind == "kvcache":  # serve it on copies: the cache stays unwritten
            args = (args[0], args[1].clone(), args[2].clone(), *args[3:])
        got = served(*args, **kwargs)
        return (got[0] * 1.01, got[1]) if isinstance(got, tuple) else got * 1.01

    monkeypatch.setattr(attnhub, name, off)
    problems = case_problems(None, case, "cpu")
    assert problems and any(p.startswith("out:") for p in problems), problems
    if kind == "kvcache":
        assert any("appended" in p for p in problems), problems
