"""Conformance cases drawn at random from the contract's whole call space.

:func:`attnhub.testing.cases_for` plans a few dozen cases: each declared feature on one
of six shapes. Kernels fail where features meet at shapes nobody planned: a window on a
GQA call whose lengths are not a multiple of any tile, a key-padding mask with a
bottom-right diagonal and a softcap, a strided decode row. :func:`sample_cases` draws
such calls (every dimension and option at once, lengths spread from 1 to the size's
longest) and keeps those the backend's declarations and ``extra_reasons`` admit, so a
backend is held to the contract on calls it claims, never on calls it declines.

The draw is a pure function of ``(backend name, device type, size, count, seed)``:
the same arguments give the same cases on every machine, so a failure found by a
large seeded run reproduces from its case id and seed alone.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import torch

from attnhub.argcheck import int_at_least
from attnhub.backend import Backend

from .cases import Case, _admitted, _head_dim_ok, _resolve


@dataclass(frozen=True)
class _Space:
    """Bounds of one size's draws: batch, kv heads and query heads per kv head up to
    these, sequence lengths 1..``max_len``, head dims among ``head_dims``."""

    batch: int
    kv_heads: int
    group: int
    max_len: int
    head_dims: tuple[int, ...]


# "tiny" keeps the Triton interpreter fast and still crosses its 16/32-wide tiles;
# "large" reaches past 1024 keys, where triton_flash's TMA and Gluon rows take over on
# sm_90, and covers the head dims models use (80, 96, 192 are not powers of two).
SPACES: dict[str, _Space] = {
    "tiny": _Space(batch=2, kv_heads=2, group=3, max_len=40, head_dims=(8, 16, 24, 32, 40, 64)),
    "small": _Space(3, 3, 4, 130, (8, 16, 32, 40, 64, 80, 96, 128)),
    "large": _Space(3, 4, 4, 2100, (16, 32, 64, 80, 96, 128, 192, 256)),
}

# Mask kinds by weight: half the calls carry none, as models' calls mostly do.
_MASKS = (("none", 9), ("bool", 3), ("keys", 3), ("float", 3), ("float32", 2))


def _length(rng: random.Random, max_len: int) -> int:
    """A sequence length: 1 (decoding) or a few (speculative decoding, short prompts)
    15% of the time each, else log-uniform up to ``max_len``."""
    kind = rng.random()
    if kind < 0.15:
        return 1
    if kind < 0.3:
        return rng.randint(2, min(16, max_len))
    return min(max_len, int(math.exp(rng.uniform(math.log(3), math.log(max_len + 1)))))


def _head_dims(rng: random.Random, backend: Backend, space: _Space) -> tuple[int, int] | None:
    """(D, Dv) within the backend's declarations: Dv differs one time in ten."""
    fitting = [d for d in space.head_dims if _head_dim_ok(backend, d)]
    if not fitting:
        return None
    d = rng.choice(fitting)
    dv = rng.choice(fitting) if rng.random() < 0.1 else d
    return d, dv


def _draw(
    rng: random.Random, backend: Backend, space: _Space, dtypes: list[torch.dtype]
) -> Case | None:
    """One call from the whole space (None: no head dim of the space fits the backend)."""
    dims = _head_dims(rng, backend, space)
    if dims is None:
        return None
    dtype = rng.choice(dtypes)
    hkv = rng.randint(1, space.kv_heads)
    hq = hkv * (rng.randint(1, space.group) if backend.gqa else 1)
    nq, nk = _length(rng, space.max_len), _length(rng, space.max_len)
    mask = rng.choices([m for m, _ in _MASKS], [w for _, w in _MASKS])[0]
    if mask == "float32" and dtype not in (torch.float16, torch.bfloat16):
        mask = "float"
    backward = rng.random() < 0.35
    causal = rng.random() < 0.35
    window: tuple[int | None, int | None] | None = None
    if rng.random() < 0.15:
        left = None if rng.random() < 0.3 else rng.randint(0, nk)
        right = rng.randint(0, nk) if left is None or rng.random() < 0.5 else None
        window = (left, right)
    scale = None
    if rng.random() < 0.15:
        scale = rng.choice((0.5, 2.0, -1.0)) / math.sqrt(dims[0])
    return Case(
        dtype=dtype,
        B=rng.randint(1, space.batch),
        Hq=hq,
        Hkv=hkv,
        Nq=nq,
        Nk=nk,
        D=dims[0],
        Dv=dims[1],
        mask=mask,
        mask_grad=backward and mask in ("float", "float32") and rng.random() < 0.5,
        causal=causal,
        alignment=rng.choice(("top_left", "bottom_right")),
        window=window,
        softcap=round(rng.uniform(1.0, 50.0), 1) if rng.random() < 0.12 else None,
        scale=scale,
        dropout_p=0.0 if rng.random() < 0.05 else None,
        return_lse=rng.random() < 0.3,
        backward=backward,
        strided=rng.random() < 0.3,
    )


def sample_cases(
    backend: Backend | str,
    device: torch.device | str = "cpu",
    count: int = 20,
    *,
    seed: int = 0,
    size: str = "small",
) -> list[Case]:
    """Up to ``count`` random cases that ``backend`` (an instance or a registered name)
    claims on ``device``, drawn with ``seed`` from the space of ``size`` (``"tiny"``,
    ``"small"`` or ``"large"``, as for :func:`attnhub.testing.cases_for`).

    Each case is one call with every dimension drawn at once: batch, GQA group, lengths
    from 1 up (Nq and Nk apart), head dims (Dv apart one time in ten), dtype, mask kind
    (none, bool with fully masked rows, key padding, float, float32 bias), causal,
    alignment, window, softcap, scale (negative ones too), lse, backward, strided
    layout. Cases the declarations decline are drawn again, up to 50 draws per case
    asked for, so a backend that claims little gets fewer than ``count``.
    """
    if size not in SPACES:
        raise ValueError(f"size must be one of {tuple(SPACES)}, got {size!r}")
    int_at_least("count", count, 0)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:  # torch.device("nope"): RuntimeError
        raise ValueError(
            f"device must be a torch.device or a device string, got {device!r}"
        ) from exc
    backend = _resolve(backend)
    dtypes = sorted(backend.dtypes, key=str)
    if not dtypes:
        return []
    key = f"{backend.name}/{device.type}/{size}/{seed}"
    rng = random.Random(zlib.crc32(key.encode()))
    found: dict[str, Case] = {}
    for _ in range(50 * count):
        if len(found) >= count:
            break
        kept = _admitted(backend, device, [_draw(rng, backend, SPACES[size], dtypes)])
        for case in kept:
            found.setdefault(case.id, case)
    return list(found.values())
