"""The kit's serving cases (attnhub.testing.serving): random packed (varlen), KV-cache
and paged calls against a loop of dense float64 calls, on every backend that serves
them here and on attnhub's own choice.

test_varlen.py, test_kvcache.py and test_paged_generate.py check planned cases. Each
case here is one call of :func:`attnhub.attention_varlen` or
:func:`attnhub.attention_kvcache` with every dimension and option drawn at once (the
kit's module docstring says what is drawn and the rule). Named backends get draws from
their own declarations (:func:`sample_serving_cases`); attnhub's own choice gets every
draw and must serve each. Seeded: a failing id reproduces from its seed.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attnhub.serving  # noqa: E402
from attnhub.backends.torch_reference import TorchReference  # noqa: E402
from attnhub.registry import get_registry  # noqa: E402
from attnhub.testing import (  # noqa: E402
    ServingCase,
    check_backend,
    draw_serving_case,
    sample_serving_cases,
    serving_problems,
    serving_reasons,
)


def _serves(name: str, device: str) -> bool:
    registry = get_registry()
    return (
        name in registry.names()
        and registry.unavailable_reason(name) is None
        and device in registry.get(name).devices
    )


# (backend or None for attnhub's own choice, device, cases, size, dtypes). Triton's
# interpreter runs fewer, shorter draws in float32 and float16 (it has no bfloat16);
# CUDA draws reach past a few tiles.
_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TARGETS = [
    (None, "cpu", 40, "small", _CPU_DTYPES),
    ("torch_reference", "cpu", 20, "small", _CPU_DTYPES),
    ("triton_flash", "cpu", 20, "tiny", (torch.float32, torch.float16)),
    (None, "cuda", 40, "large", (torch.float16, torch.bfloat16)),
    ("triton_flash", "cuda", 40, "large", (torch.float16, torch.bfloat16, torch.float32)),
    ("torch_varlen", "cuda", 30, "large", (torch.float16, torch.bfloat16)),
]


def _params() -> list[Any]:
    params = []
    for index, (name, device, count, size, dtypes) in enumerate(_TARGETS):
        if device == "cuda":
            if not HAS_CUDA:
                continue  # drawing a named backend's cases asks dispatch on the device
            marks = [pytest.mark.gpu]
        elif HAS_CUDA and name == "triton_flash":
            continue  # with CUDA the Triton backends run on it, not in the interpreter
        elif name is not None and not _serves(name, device):
            continue
        else:
            marks = []
        if name is None:
            cases = [draw_serving_case(1000 * index + i, size, dtypes) for i in range(count)]
        else:
            cases = sample_serving_cases(name, device, count, seed=index, size=size,
                                         dtypes=dtypes)  # fmt: skip
        for c in cases:
            params.append(pytest.param(name, device, c, id=f"{name or 'auto'}-{device}-{c.id}",
                                       marks=marks))  # fmt: skip
    return params


_PARAMS = _params()


@pytest.mark.parametrize(("backend", "device", "case"), _PARAMS)
def test_serving_case(backend: str | None, device: str, case: ServingCase) -> None:
    problems = serving_problems(backend, case, device)
    assert not problems, f"{case.id}: " + "; ".join(problems)


def test_cpu_cases_are_not_empty() -> None:
    # The suite must never pass by drawing nothing: auto and torch_reference always run.
    drawn = [p.values[0] for p in _PARAMS if p.values[1] == "cpu"]
    assert drawn.count(None) == 40 and drawn.count("torch_reference") == 20


def test_the_draws_cover_the_options() -> None:
    """Over the draws every kind, option and edge (an empty sequence or cache, one
    query, a backward) occurs, and the same seed draws the same call."""
    cases = [draw_serving_case(seed) for seed in range(150)]
    ids = " ".join(c.id for c in cases)
    for part in ("varlen", "kvcache", "paged1-", "paged4-", "paged16-", "paged256-",
                 "-causalTrue", "bottom_right", "top_left", "-window(", "-softcap", "-scale-",
                 "-lse", "-bwd", "-unchecked", "+1", "fp16", "bf16", "fp32"):  # fmt: skip
        assert part in ids, part
    assert any(0 in c.q_lens or 0 in c.k_lens for c in cases)
    assert any(c.hq > c.hkv for c in cases) and any(c.dv != c.d for c in cases)
    assert draw_serving_case(7) == draw_serving_case(7)
    assert {c.kind for c in (draw_serving_case(s, kinds=("paged",)) for s in range(20))} == {
        "paged"
    }
    longer = [draw_serving_case(seed, "large") for seed in range(100)]
    assert max(max(c.k_lens) for c in longer) > 200
    with pytest.raises(ValueError, match="size must be one of"):
        draw_serving_case(0, "huge")
    with pytest.raises(ValueError, match="kinds must be"):
        draw_serving_case(0, kinds=("dense",))


def test_cases_stay_inside_the_declarations() -> None:
    """A named backend's draws are calls it serves: only its layouts, dtypes, no
    backward where it declares none; none at all for a backend without a serving
    layout."""

    class Narrow(TorchReference):
        name = "serving_sampled_narrow"
        dtypes = frozenset({torch.float16})
        layouts = frozenset({"paged"})
        backward = lse_grad = False

    registry = get_registry()
    registry.add(Narrow())
    try:
        cases = sample_serving_cases(Narrow.name, "cpu", 10)
        assert len(cases) == 10
        for case in cases:
            assert case.kind == "paged" and case.dtype == torch.float16 and not case.backward
            assert not serving_reasons(registry.get(Narrow.name), case, "cpu")
            assert serving_problems(Narrow.name, case, "cpu") == []
        assert sample_serving_cases("torch_sdpa", "cpu", 5) == []  # dense only
    finally:
        registry.remove(Narrow.name)


class _Off(TorchReference):
    """The reference, with its varlen and KV-cache answers 1% off."""

    name = "serving_sampled_off"

    def forward_varlen(self, *args: Any) -> Any:
        got = super().forward_varlen(*args)
        return (got[0] * 1.01, got[1]) if isinstance(got, tuple) else got * 1.01

    def forward_kvcache(self, *args: Any) -> Any:
        got = super().forward_kvcache(*args)
        return (got[0] * 1.01, got[1]) if isinstance(got, tuple) else got * 1.01


@pytest.mark.parametrize("kind", ["varlen", "kvcache", "paged"])
def test_a_wrong_answer_is_caught(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: outputs 1% off, or a cache left unwritten (attnhub's append
    switched off), are reported, and check_backend, which runs serving cases for a
    backend declaring a serving layout, names them."""
    registry = get_registry()
    registry.add(_Off())
    if kind != "varlen":
        monkeypatch.setattr(attnhub.serving, "append_kv", lambda *args: None)
    try:
        case = next(
            c for c in sample_serving_cases(_Off.name, "cpu", 40, dtypes=(torch.float32,))
            if c.kind == kind and min(c.q_lens) > 0 and min(c.k_lens) > 0
            and (kind == "varlen" or c.new)
        )  # fmt: skip
        problems = serving_problems(_Off.name, case, "cpu")
        assert any(p.startswith("out:") for p in problems), problems
        if kind != "varlen":
            assert any("appended" in p for p in problems), problems
        if kind == "varlen":
            with pytest.raises(AssertionError, match=r"serving_sampled_off failed \d+ of "):
                check_backend(_Off.name, "cpu")
    finally:
        registry.remove(_Off.name)


def test_what_a_backend_raises_or_changes_is_a_problem() -> None:
    """An exception is reported, never raised through; an input changed in place
    (here the packed query) is named."""

    class Raises(TorchReference):
        name = "serving_sampled_raises"

        def forward_varlen(self, *args: Any) -> Any:
            raise RuntimeError("boom")

    class Scribbles(TorchReference):
        name = "serving_sampled_scribbles"

        def forward_varlen(self, query, *args: Any) -> Any:  # type: ignore[no-untyped-def]
            got = super().forward_varlen(query, *args)
            with torch.no_grad():
                query.add_(1)
            return got

    registry = get_registry()
    registry.add(Raises())
    registry.add(Scribbles())
    try:
        case = next(c for c in (draw_serving_case(s, kinds=("varlen",)) for s in range(50))
                    if sum(c.q_lens) and sum(c.k_lens))  # fmt: skip
        problems = serving_problems(Raises.name, case, "cpu")
        assert len(problems) == 1 and "RuntimeError: boom" in problems[0], problems
        problems = serving_problems(Scribbles.name, case, "cpu")
        assert "query: changed by the call" in problems, problems
    finally:
        registry.remove(Raises.name)
        registry.remove(Scribbles.name)
