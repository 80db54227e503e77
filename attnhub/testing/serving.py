"""Conformance cases for the serving calls: packed (varlen), KV-cache and paged.

:func:`cases_for`, :func:`sample_cases` and the block-sparse cases make dense calls of
:func:`attnhub.attention`, so a backend that declares the "varlen", "kvcache" or
"paged" layout was held to nothing there. Each case here is one call of
:func:`attnhub.attention_varlen` or :func:`attnhub.attention_kvcache` (contiguous or
paged) with every dimension and option drawn at once: 1 to 4 sequences of lengths from
0 (an empty sequence or cache) up, GQA, head dims 16-64 with Dv apart, causal in either
alignment, a window, a softcap, a scale (negative too), the lse, a backward (to the
packed query, key and value; to the query of a cache call), ``check_indices`` off (the
call then made twice: the second is a decoding loop's repeated call); for a cache, 1 to
7 new queries, keys appended in place or not, page sizes 1 to 256 with the pages
shuffled.

contract.md, "Packed sequences and KV caches": each sequence's rows are the dense call
of that sequence alone. The backend's answer is held to the tolerance rule against a
loop of float64 dense calls (``r64``, torch_reference) with the bound's width from the
kit's plain computation in the input dtype (``r_lp``, :func:`plain_attention`); rows
without a key must be exactly zero; the appended keys and values must land in the cache
(contiguous or paged) and nothing else in any input may change.

A case is a pure function of its seed, size and dtypes: a failing id reproduces alone.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

import attnhub
from attnhub.backend import Backend
from attnhub.output_check import unchecked
from attnhub.registry import get_registry
from attnhub.request import dtype_tag

from .cases import first_admitted
from .faults import describe_exception, passes_through
from .reference import plain_attention
from .tolerance import compare, fully_masked_problems, highest_float32_precision

# The layouts a case is drawn for: packed sequences, a contiguous cache, a paged one.
KINDS = ("varlen", "kvcache", "paged")
# 256: FlashAttention-2's paged kernels take multiples of it only (torch_varlen).
PAGE_SIZES = (1, 4, 16, 256)
# The longest sequence or cache of each size ("tiny" keeps Triton's interpreter quick;
# "large" reaches past a few 128-token tiles on a GPU).
LONGEST = {"tiny": 60, "small": 100, "large": 1100}


@dataclass(frozen=True)
class ServingCase:
    """One serving call: its kind (one of :data:`KINDS`), heads, head dims, dtype,
    options (the calls' keywords but ``return_lse``), whether the lse is returned, a
    backward runs and the index tensors are checked (``check_indices``; False: the
    call is made twice, the second time as a decoding loop's repeated call is), the
    per-sequence lengths, and the seed of its inputs.

    ``q_lens``: queries per sequence (a cache call: ``(Nq,) * B``); ``k_lens``: keys per
    sequence (a cache call: keys already cached); ``new``: keys a cache call appends;
    ``capacity``: a cache's Nmax; ``page_size``: a paged cache's (else 0).
    """

    id: str
    kind: str
    hq: int
    hkv: int
    d: int
    dv: int
    dtype: torch.dtype
    options: dict[str, Any] = field(hash=False)
    return_lse: bool
    backward: bool
    check_indices: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    new: int
    capacity: int
    page_size: int
    seed: int


def _length(rng: random.Random, longest: int) -> int:
    """0 (an empty sequence) 8% of the time, 1 12%, else log-uniform up to ``longest``."""
    kind = rng.random()
    if kind < 0.08:
        return 0
    if kind < 0.2:
        return 1
    return max(1, int(math.exp(rng.uniform(0.0, math.log(longest)))))


def draw_serving_case(
    seed: int,
    size: str = "small",
    dtypes: tuple[torch.dtype, ...] | None = None,
    kinds: tuple[str, ...] = KINDS,
) -> ServingCase:
    """One random serving call (module docstring), a pure function of its arguments:
    lengths up to ``LONGEST[size]``, a dtype among ``dtypes`` (default float32,
    float16, bfloat16), a kind among ``kinds``."""
    if size not in LONGEST:
        raise ValueError(f"size must be one of {tuple(LONGEST)}, got {size!r}")
    unknown = set(kinds) - set(KINDS)
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    rng = random.Random(seed)
    longest = LONGEST[size]
    kind = rng.choice(sorted(kinds))
    b, hkv = rng.randint(1, 4), rng.randint(1, 2)
    hq = hkv * rng.randint(1, 4)
    d = rng.choice([16, 32, 40, 64])
    dv = d if rng.random() < 0.85 else rng.choice([16, 32])
    dtype = rng.choice(dtypes or (torch.float32, torch.float16, torch.bfloat16))
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
    return_lse = rng.random() < 0.5
    backward = rng.random() < 0.35
    check_indices = rng.random() < 0.7
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
        page_size = rng.choice(PAGE_SIZES) if kind == "paged" else 0
    flags = "".join(f"-{k}{v}" for k, v in options.items()).replace(" ", "")
    shape = "x".join(map(str, q_lens)) + "_" + "x".join(map(str, k_lens))
    ident = (f"{seed}-{kind}{page_size or ''}-H{hq}kv{hkv}D{d}v{dv}-{shape}"
             f"{f'+{new}' if new else ''}-{dtype_tag(dtype)}{flags}"
             f"{'-lse' if return_lse else ''}{'-bwd' if backward else ''}"
             f"{'' if check_indices else '-unchecked'}")  # fmt: skip
    return ServingCase(ident, kind, hq, hkv, d, dv, dtype, options, return_lse, backward,
                       check_indices, q_lens, k_lens, new, capacity, page_size,
                       rng.randrange(1 << 30))  # fmt: skip


@dataclass
class _Inputs:
    """A case's tensors on the CPU, in its dtype.

    ``tensors``: the serving function's tensor arguments by name (the cache, paged or
    not, holds the cached keys; ``k_new``/``v_new`` are not yet in it). ``leaves``: the
    names of the tensors a backward differentiates. ``cache``: the keys and values of
    each sequence as the call must leave them, (B, Hkv, Nmax, D|Dv) (cache calls);
    ``stores``: the cache tensors as the call must leave them (the appended keys in
    their slots, everything else as it was). ``grad_out``: the output's gradient.
    """

    tensors: dict[str, torch.Tensor]
    leaves: tuple[str, ...]
    cache: tuple[torch.Tensor, torch.Tensor] | None
    stores: tuple[torch.Tensor, torch.Tensor] | None
    grad_out: torch.Tensor


def _inputs(c: ServingCase) -> _Inputs:
    """The case's tensors: normal values; cu_seqlens int32 (varlen); cache_seqlens int32
    and a block table of shuffled pages, with spare pages holding other values (paged)."""
    gen = torch.Generator().manual_seed(c.seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(c.dtype)

    if c.kind == "varlen":
        q = randn(sum(c.q_lens), c.hq, c.d)
        k, v = randn(sum(c.k_lens), c.hkv, c.d), randn(sum(c.k_lens), c.hkv, c.dv)
        cu_q, cu_k = ([0, *torch.tensor(lens).cumsum(0).tolist()] for lens in (c.q_lens, c.k_lens))
        tensors = {"query": q, "key": k, "value": v,
                   "cu_seqlens_q": torch.tensor(cu_q, dtype=torch.int32),
                   "cu_seqlens_k": torch.tensor(cu_k, dtype=torch.int32)}  # fmt: skip
        return _Inputs(tensors, ("query", "key", "value"), None, None,
                       randn(q.shape[0], c.hq, c.dv))  # fmt: skip
    b, nq = len(c.q_lens), c.q_lens[0]
    cache_k, cache_v = randn(b, c.hkv, c.capacity, c.d), randn(b, c.hkv, c.capacity, c.dv)
    q = randn(b, c.hq, nq, c.d)
    tensors = {"query": q, "k_cache": cache_k, "v_cache": cache_v,
               "cache_seqlens": torch.tensor(c.k_lens, dtype=torch.int32)}  # fmt: skip
    want_k, want_v = cache_k.clone(), cache_v.clone()
    if c.new:
        tensors["k_new"] = randn(b, c.hkv, c.new, c.d)
        tensors["v_new"] = randn(b, c.hkv, c.new, c.dv)
        for j, cached in enumerate(c.k_lens):
            want_k[j, :, cached : cached + c.new] = tensors["k_new"][j]
            want_v[j, :, cached : cached + c.new] = tensors["v_new"][j]
    if c.kind == "kvcache":
        return _Inputs(tensors, ("query",), (want_k, want_v), (want_k, want_v),
                       randn(b, c.hq, nq, c.dv))  # fmt: skip
    pages = -(-c.capacity // c.page_size)
    spare = 3  # pages no sequence uses
    table = torch.randperm(b * pages + spare, generator=gen)[: b * pages].view(b, pages)
    k_store = randn(b * pages + spare, c.page_size, c.hkv, c.d)
    v_store = randn(b * pages + spare, c.page_size, c.hkv, c.dv)
    # The stores as given, then as the call must leave them (the same values in the slots
    # no sequence uses).
    stores = [k_store, v_store, k_store.clone(), v_store.clone()]
    for store, cache in zip(stores, (cache_k, cache_v, want_k, want_v)):
        for j in range(b):
            for page in range(pages):
                lo, hi = page * c.page_size, min(c.capacity, (page + 1) * c.page_size)
                store[table[j, page], : hi - lo] = cache[j, :, lo:hi].transpose(0, 1)
    tensors.update(k_cache=stores[0], v_cache=stores[1], block_table=table.to(torch.int32))
    return _Inputs(tensors, ("query",), (want_k, want_v), (stores[2], stores[3]),
                   randn(b, c.hq, nq, c.dv))  # fmt: skip


def _function(c: ServingCase) -> Callable[..., Any]:
    return attnhub.attention_varlen if c.kind == "varlen" else attnhub.attention_kvcache


def _keywords(c: ServingCase) -> dict[str, Any]:
    """The call's keywords besides the tensors and options: ``check_indices``, and for
    an unchecked varlen call bounds of the longest sequences (it does not read the
    cu_seqlens), exact or up to 39 more (contract.md: at least the longest), from the
    case's seed."""
    if c.kind != "varlen" or c.check_indices:
        return {"check_indices": c.check_indices}
    more = c.seed % 40 if c.seed % 2 else 0
    return {"check_indices": False, "max_seqlen_q": max(c.q_lens) + more,
            "max_seqlen_k": max(c.k_lens) + more // 2}  # fmt: skip


def serving_reasons(backend: Backend, case: ServingCase, device: torch.device | str) -> list[str]:
    """Why ``backend`` would not serve ``case`` on ``device`` when asked by name (empty:
    it would): dispatch's reasons, from :func:`attnhub.explain_varlen` or
    :func:`attnhub.explain_kvcache`. A call with no query row or no key anywhere is
    served by the reference whatever is asked; for another backend it has a reason."""
    device = torch.device(device)
    if device.type not in backend.devices:  # (no tensor is made where none may be)
        return [f"{device.type} is not among its devices ({', '.join(sorted(backend.devices))})"]
    inputs = _inputs(case)
    explain = attnhub.explain_varlen if case.kind == "varlen" else attnhub.explain_kvcache
    tensors: dict[str, Any] = {name: t.to(device) for name, t in inputs.tensors.items()}
    for name in inputs.leaves:
        tensors[name].requires_grad_(case.backward)
    with torch.enable_grad():
        decision = explain(**tensors, **_keywords(case), return_lse=case.return_lse,
                           backend=backend.name, **case.options)  # fmt: skip
    if decision.chosen == backend.name:
        return []
    return decision.reasons().get(backend.name) or [f"served by {decision.chosen}: {decision.why}"]


def sample_serving_cases(
    backend: Backend | str,
    device: torch.device | str = "cpu",
    count: int = 12,
    *,
    seed: int = 0,
    size: str = "small",
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> list[ServingCase]:
    """Up to ``count`` serving cases that ``backend`` serves on ``device``, drawn from
    seed ``seed`` on among the layouts it declares (50 draws at most per case asked
    for); none for a backend that declares none of :data:`KINDS`."""
    if isinstance(backend, str):
        backend = get_registry().get(backend)
    kinds = tuple(kind for kind in KINDS if kind in backend.layouts)
    if not kinds:
        return []
    return first_admitted(
        lambda case_seed: draw_serving_case(case_seed, size, dtypes, kinds),
        lambda case: serving_reasons(backend, case, device),
        count, seed,
    )  # fmt: skip


def _sequences(
    c: ServingCase, leaves: dict[str, torch.Tensor], inputs: _Inputs
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each sequence's dense call (1, H, N, D) cut from ``leaves`` (the differentiated
    tensors, converted) and, for a cache call, the cache as the call must leave it."""
    if c.kind == "varlen":
        cu_q, cu_k = (inputs.tensors[f"cu_seqlens_{s}"].tolist() for s in "qk")
        q, k, v = leaves["query"], leaves["key"], leaves["value"]
        return [
            (q[cu_q[j] : cu_q[j + 1]].transpose(0, 1)[None],
             k[cu_k[j] : cu_k[j + 1]].transpose(0, 1)[None],
             v[cu_k[j] : cu_k[j + 1]].transpose(0, 1)[None])
            for j in range(len(c.q_lens))
        ]  # fmt: skip
    assert inputs.cache is not None
    q = leaves["query"]
    keys, values = (t.to(q.dtype) for t in inputs.cache)
    return [
        (q[j : j + 1], keys[j : j + 1, :, : n + c.new], values[j : j + 1, :, : n + c.new])
        for j, n in enumerate(c.k_lens)
    ]


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any], plain: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one sequence's dense call: r_lp (``plain``) or torch_reference."""
    if not plain:
        return attnhub.attention(q, k, v, return_lse=True, backend="torch_reference", **options)
    if k.shape[2] == 0:  # no keys: zeros (still a function of q) and -inf
        return (q[..., :1] * 0).expand(*q.shape[:3], v.shape[-1]), torch.full(
            q.shape[:3], float("-inf")
        )
    call = SimpleNamespace(
        scale=options.get("scale"), D=q.shape[-1], softcap=options.get("softcap"),
        causal=options.get("causal", False), alignment=options["alignment"],
        window=options.get("window"),
    )  # fmt: skip
    return plain_attention(q, k, v, None, call)  # type: ignore[arg-type]


def _reference(c: ServingCase, inputs: _Inputs, dtype: torch.dtype | None) -> dict[str, Any]:
    """out, lse (and the gradients of a backward case) of the loop of dense calls, on
    copies of the inputs converted to ``dtype`` (None: r_lp, in the case's dtype)."""
    leaves = {name: inputs.tensors[name].detach().to(dtype or c.dtype).requires_grad_(c.backward)
              for name in inputs.leaves}  # fmt: skip
    # The calls' default alignments: attention_varlen's, attention_kvcache's.
    options = {"alignment": "top_left" if c.kind == "varlen" else "bottom_right", **c.options}
    with torch.enable_grad():
        results = [_dense(q, k, v, options, dtype is None)
                   for q, k, v in _sequences(c, leaves, inputs)]  # fmt: skip
        if c.kind == "varlen":  # (1, H, n, D) per sequence -> packed (T, H, D)
            out = torch.cat([o[0].transpose(0, 1) for o, _ in results])
            lse = torch.cat([s[0].transpose(0, 1) for _, s in results])
        else:
            out, lse = torch.cat([o for o, _ in results]), torch.cat([s for _, s in results])
        found = {"out": out.detach(), "lse": lse.detach()}
        if c.backward:
            grads = torch.autograd.grad(
                out, list(leaves.values()), inputs.grad_out.to(out.dtype),
                allow_unused=True, materialize_grads=True,
            )  # fmt: skip
            found.update(zip(("dq", "dk", "dv"), grads))
    return found


def serving_problems(
    backend_name: str | None, case: ServingCase, device: torch.device | str = "cpu"
) -> list[str]:
    """What the serving call with ``backend=backend_name`` on ``device`` gets wrong
    (module docstring); [] when nothing. ``None`` holds attnhub's own choice to it.
    What the call raises (``NoBackendError`` too) is a problem in the list, never an
    exception through it."""
    inputs = _inputs(case)
    with highest_float32_precision():
        r64, r_lp = _reference(case, inputs, torch.float64), _reference(case, inputs, None)
    originals = dict(inputs.tensors)
    # Copies: what the call changes in place is compared with the originals after.
    given = {name: t.to(device, copy=True) for name, t in originals.items()}
    for name in inputs.leaves:
        given[name].requires_grad_(case.backward)
    if inputs.stores is not None:  # the caches as the call must leave them
        originals.update(k_cache=inputs.stores[0], v_cache=inputs.stores[1])
    try:
        # unchecked: the kit judges what the backend returned itself, and a backend that
        # breaks the contract stays enabled for the next case.
        with torch.enable_grad(), unchecked():
            call = functools.partial(_function(case), **given, **_keywords(case),
                                     return_lse=case.return_lse, backend=backend_name,
                                     **case.options)  # fmt: skip
            returned = call()
            if not case.check_indices:
                # Again, as a decoding loop calls (attention_kvcache's decided path): this
                # answer is held to the rule. The keys appended again land where they did.
                returned = call()
            if isinstance(returned, tuple) != case.return_lse:
                raise TypeError(
                    f"return_lse={case.return_lse}: expected "
                    f"{'(out, lse)' if case.return_lse else 'a tensor'}, "
                    f"got {type(returned).__name__}"
                )
            out, lse = returned if case.return_lse else (returned, None)
            got = {"out": out.detach().cpu()}
            if case.backward:
                grads = torch.autograd.grad(
                    out, [given[name] for name in inputs.leaves],
                    inputs.grad_out.to(device, out.dtype), allow_unused=True,
                    materialize_grads=True,
                )  # fmt: skip
                got.update(zip(("dq", "dk", "dv"), (g.cpu() for g in grads)))
    except BaseException as exc:
        if passes_through(exc):
            raise
        return [f"raised {describe_exception(exc, backend_name)}"]
    wanted = {"out": (out, case.dtype), "lse": (lse, torch.float32)}
    problems = [
        f"{name}: {t.dtype} on {t.device}, expected {dtype} on {device}"
        for name, (t, dtype) in wanted.items()
        if t is not None and (t.dtype != dtype or t.device.type != torch.device(device).type)
    ]
    if case.return_lse:
        if lse is None:
            problems.append("returned no lse")
        else:
            got["lse"] = lse.detach().cpu()
    for name, t in given.items():
        if not torch.equal(t.detach().cpu(), originals[name]):
            problems.append(
                f"{name}: the cache does not hold the appended keys and values, or more changed"
                if name in ("k_cache", "v_cache")
                else f"{name}: changed by the call"
            )
    compared = [p for name in got if (p := compare(name, got[name], r_lp[name], r64[name]))]
    if compared:  # (a shape among them: the rows below could not be read)
        return problems + compared
    return problems + fully_masked_problems(torch.isinf(r64["lse"]), got["out"], got.get("dq"))
