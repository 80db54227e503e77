"""Launch plans replay the launches of the full path, on the CPU.

Eager CUDA calls of triton_flash and triton_blocksparse reuse a plan per call signature
(``ops._PLANS``): the launches the full path recorded, replayed with the call's own
tensors. Plans exist only on CUDA, so their wiring (which tensor goes to which
launch's slot) was checked only by the GPU tests. Here the plan machinery runs under the
interpreter with two stand-ins: a key for CPU tensors, and a recorded launch that logs
the tensors it is handed instead of launching. A call replayed from a plan must hand
every launch the tensors, by role, that the full path handed the kernel it recorded:
the call's own inputs (never the recording call's), fresh outputs of the same shape,
dtype and strides, and the outputs it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch._library.triton import set_wrap_triton_enabled

from attnhub.backends.triton_blocksparse import ops as bs_ops
from attnhub.backends.triton_flash import key_ranges, ops
from attnhub.block_sparse import BlockSparseLayout

pytestmark = pytest.mark.skipif(not ops.interpreting(), reason="the interpreter's CPU path")


class _Replayed:
    """Stands in for ``launch.CachedLaunch``: keeps the tensors the full path passed the
    kernel, and logs the tensors a replay hands it (nothing is launched)."""

    log: ClassVar[list[tuple[str, tuple[torch.Tensor, ...]]]] = []

    def __init__(self, kernel: Any, compiled: Any, grid: Any, args: tuple, meta: dict,
                 tensors: int) -> None:  # fmt: skip
        self.name = kernel.fn.__name__
        self.recorded = args[:tensors]

    def __call__(self, *tensors: torch.Tensor) -> None:
        _Replayed.log.append((self.name, tensors))


def _cpu_key(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
             seed: Any, scalars: tuple, *extra: Any) -> tuple:  # fmt: skip
    """``ops._plan_key`` for CPU tensors: the layouts and values that decide a launch."""

    def layout(t: Any) -> Any:
        return (t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t

    return (kind, *map(layout, (q, k, v, mask, seed)), scalars, tuple(map(layout, extra)))


@pytest.fixture
def plans_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(ops, "_plan_key", _cpu_key)
    monkeypatch.setattr(key_ranges, "_plan_key", _cpu_key)
    monkeypatch.setattr(bs_ops, "_plan_key", _cpu_key)
    monkeypatch.setattr(ops, "_is_compiled", lambda compiled: True)
    monkeypatch.setattr(ops, "CachedLaunch", _Replayed)
    ops.clear_plans()
    _Replayed.log = []
    yield
    ops.clear_plans()


def _roles(named: dict[str, Any]) -> dict[int, str]:
    roles: dict[int, str] = {}
    for name, t in named.items():
        if isinstance(t, torch.Tensor):
            roles.setdefault(id(t), name)  # the first name wins: q stands in for None
    return roles


def _described(tensors: tuple[torch.Tensor, ...], roles: dict[int, str]) -> list[Any]:
    return [roles.get(id(t), ("new", t.shape, t.dtype, t.stride())) for t in tensors]


def _check_replay(call: Callable[[dict[str, Any]], dict[str, Any]],
                  inputs: Callable[[], dict[str, Any]]) -> None:  # fmt: skip
    """``call(named inputs) -> named outputs`` three times: the first marks its key, the
    second records a plan, the third (new inputs) replays it; the replay's launches must
    get, role by role, what the recording call's kernels got. ``call`` runs with
    wrap_triton off, as the eager path (DirectAttention) calls the ops; ``inputs`` with
    it on, so that a forward run to make a backward's inputs takes no plan."""

    def eagerly(x: dict[str, Any]) -> dict[str, Any]:
        with set_wrap_triton_enabled(False):
            return call(x)

    eagerly(inputs())
    first = inputs()
    recorded = eagerly(first)
    plan = next(p for p in ops._PLANS.values() if p is not ops._SEEN)
    launches = plan.launches if hasattr(plan, "launches") else (plan.launch,)
    roles = _roles({**first, **recorded})
    expected = [(launch.name, _described(launch.recorded, roles)) for launch in launches]
    _Replayed.log = []
    second = inputs()
    replayed = eagerly(second)
    roles = _roles({**second, **replayed})
    got = [(name, _described(tensors, roles)) for name, tensors in _Replayed.log]
    assert got == expected
    assert not set(map(id, replayed.values())) & set(map(id, recorded.values()))


def _dense(n: int = 48, d: int = 32, dv: int = 16, hkv: int = 1) -> dict[str, Any]:
    q = torch.randn(2, 2, n, d)
    k, v = torch.randn(2, hkv, n + 8, d), torch.randn(2, hkv, n + 8, dv)
    return {"q": q, "k": k, "v": v}


_SCALARS = (True, True, -1, -1, 0.0, 0.25, 0.0)  # causal, bottom-right, no window


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "float_mask"])
def test_a_forward_plan_hands_its_launch_the_calls_tensors(plans_on_the_cpu, masked: bool) -> None:  # type: ignore[no-untyped-def]
    def inputs() -> dict[str, Any]:
        named = _dense(hkv=2)
        named["mask"] = torch.randn(2, 1, 48, 56) if masked else None
        return named

    def call(x: dict[str, Any]) -> dict[str, Any]:
        out, lse, stats = ops._fwd_impl(x["q"], x["k"], x["v"], x["mask"], None, *_SCALARS)
        return {"out": out, "lse": lse, "stats": stats}

    _check_replay(call, inputs)


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "float_mask"])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no_dlse", "dlse"])
@pytest.mark.parametrize("merged", [False, True], ids=["split", "merged"])
def test_a_backward_plan_hands_its_launches_the_calls_tensors(plans_on_the_cpu, with_dlse: bool,
                                                              merged: bool, masked: bool) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    from attnhub.backends.triton_flash import tuning

    def inputs() -> dict[str, Any]:
        named = _dense()
        named["mask"] = torch.randn(2, 1, 48, 56) if masked else None
        out, lse, stats = ops._fwd_impl(named["q"], named["k"], named["v"], named["mask"], None,
                                        *_SCALARS)  # fmt: skip
        # What the backward reads per row: a float mask's row stats, else the lse.
        named.update(out=out, lse=stats if masked else lse, dout=torch.randn_like(out))
        named["dlse"] = torch.randn_like(lse) if with_dlse else None
        return named

    def call(x: dict[str, Any]) -> dict[str, Any]:
        dq, dk, dv = ops._bwd_impl(x["dout"], x["q"], x["k"], x["v"], x["mask"], None, x["out"],
                                   x["lse"], x["dlse"], *_SCALARS)  # fmt: skip
        return {"dq": dq, "dk": dk, "dv": dv}

    with tuning.override(backward_launch="merged" if merged else "split"):
        _check_replay(call, inputs)
        assert len(_Replayed.log) == (2 if merged else 3)


def test_key_range_plans_hand_their_launches_each_calls_ranges(plans_on_the_cpu) -> None:  # type: ignore[no-untyped-def]
    scalars = _SCALARS
    ranges = iter([[[0, 30], [5, 56]], [[0, 30], [5, 56]], [[2, 40], [0, 0]]])

    def inputs() -> dict[str, Any]:
        named = _dense()
        named["ranges"] = torch.tensor(next(ranges), dtype=torch.int32)
        out, lse, _ = ops._forward(named["q"], named["k"], named["v"], None, None, _SCALARS,
                                   True, None, key_ranges=named["ranges"])  # fmt: skip
        named.update(out=out, lse=lse, dout=torch.randn_like(out))
        return named

    def forward(x: dict[str, Any]) -> dict[str, Any]:
        out, lse, _ = key_ranges._fwd(x["q"], x["k"], x["v"], None, None, x["ranges"], *scalars)
        return {"out": out, "lse": lse}

    def backward(x: dict[str, Any]) -> dict[str, Any]:
        dq, dk, dv = key_ranges._bwd(x["dout"], x["q"], x["k"], x["v"], None, None,
                                     x["ranges"], x["out"], x["lse"], None, *scalars)  # fmt: skip
        return {"dq": dq, "dk": dk, "dv": dv}

    _check_replay(forward, inputs)
    ranges = iter([[[0, 30], [5, 56]], [[0, 30], [5, 56]], [[2, 40], [0, 0]]])
    ops.clear_plans()
    _check_replay(backward, inputs)


@pytest.mark.parametrize("partial", [False, True], ids=["full_blocks", "partial_blocks"])
def test_block_sparse_plans_hand_their_launches_each_calls_layout(
    plans_on_the_cpu, partial: bool
) -> None:  # type: ignore[no-untyped-def]
    n, block = 64, 16
    windows = iter([20, 20, 27])  # sliding windows of other widths share a plan

    def inputs() -> dict[str, Any]:
        # A new layout of one geometry at every call: its block lists are new tensors,
        # which the plan must take from the call (its key holds only their layout).
        if partial:
            layout = BlockSparseLayout.sliding_window(n, next(windows), block)
        else:
            keep = torch.rand(1, 2, n // block, n // block) < 0.6
            keep[..., 0] = True
            layout = BlockSparseLayout.from_block_mask(keep, block)
        named = _dense(n=n)
        named["k"], named["v"] = named["k"][:, :, :n], named["v"][:, :, :n]
        index = bs_ops.layout_tensors(layout, named["q"].device)
        named.update({f"index{i}": t for i, t in enumerate(index)}, index=index)
        named["scalars"] = (*layout.block_size, *bs_ops._facts[layout], False, False, -1, -1,
                            0.0, 0.25, 0.0)  # fmt: skip
        named["layout"] = layout  # alive while its tensors are in use
        out, lse, _ = bs_ops._fwd_impl(named["q"], named["k"], named["v"], None, None, index,
                                       *named["scalars"])  # fmt: skip
        named.update(out=out, lse=lse, dout=torch.randn_like(out))
        return named

    def forward(x: dict[str, Any]) -> dict[str, Any]:
        out, lse, _ = bs_ops._fwd_impl(
            x["q"], x["k"], x["v"], None, None, x["index"], *x["scalars"]
        )
        return {"out": out, "lse": lse}

    def backward(x: dict[str, Any]) -> dict[str, Any]:
        dq, dk, dv = bs_ops._bwd_impl(x["dout"], x["q"], x["k"], x["v"], None, None, x["index"],
                                      x["out"], x["lse"], None, *x["scalars"])  # fmt: skip
        return {"dq": dq, "dk": dk, "dv": dv}

    _check_replay(forward, inputs)
    windows = iter([20, 20, 27])
    ops.clear_plans()
    _check_replay(backward, inputs)
