"""MKL VML's dispatch is settled before any backend can run (see attnhub.mkl_vml; the
race itself is tested where it showed, in the flex plugin's suite: its first CPU lse
of a fresh process)."""

from __future__ import annotations

import pytest
import torch

from attnhub import mkl_vml
from attnhub import registry as registry_module


def test_the_registry_resolves_vml_dispatch_before_it_loads_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    load = registry_module.BackendRegistry.load

    def recording_load(self: registry_module.BackendRegistry) -> None:
        order.append("load")
        load(self)

    monkeypatch.setattr(mkl_vml, "resolve_dispatch", lambda: order.append("resolve"))
    monkeypatch.setattr(registry_module.BackendRegistry, "load", recording_load)
    try:
        registry_module.reload_registry()
        assert order == ["resolve", "load"]
    finally:
        monkeypatch.undo()
        registry_module.reload_registry()


def test_each_function_is_called_once_per_dtype_on_one_element(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, torch.dtype, int]] = []

    def recorder(name: str):  # type: ignore[no-untyped-def]
        def call(t: torch.Tensor) -> None:
            calls.append((name, t.dtype, t.numel()))

        return call

    monkeypatch.setattr(mkl_vml, "_FUNCTIONS", (recorder("exp"), recorder("tanh")))
    mkl_vml.resolve_dispatch.cache_clear()
    try:
        resolved = mkl_vml.resolve_dispatch()
        mkl_vml.resolve_dispatch()  # once per process
    finally:
        mkl_vml.resolve_dispatch.cache_clear()
    assert resolved is torch.backends.mkl.is_available()
    expected = [(n, d, 1) for d in (torch.float32, torch.float64) for n in ("exp", "tanh")]
    assert calls == (expected if resolved else [])


def test_the_kits_references_settle_vml_dispatch_before_computing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kit computes its references before any backend runs, so they may be a
    # process's first exp; settling dispatch is the first thing they do.
    from attnhub.testing import reference
    from attnhub.testing.cases import Case, make_inputs

    order: list[str] = []
    results = reference._results

    def recording_results(*args: object) -> object:
        order.append("compute")
        return results(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(mkl_vml, "resolve_dispatch", lambda: order.append("resolve"))
    monkeypatch.setattr(reference, "_results", recording_results)
    case = Case(torch.float32, 1, 2, 2, 5, 7, 16, 16, seed=1)
    reference.references(make_inputs(case, "cpu"), case)
    assert order == ["resolve", "compute", "compute"]
