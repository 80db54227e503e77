"""Plugin loading through (fake) entry points: failures are recorded, never fatal.

Each test builds a fresh :class:`attnhub.registry.BackendRegistry` whose entry points
come from a stand-in for ``importlib.metadata``; the process-wide registry is reloaded
after the tests that touch it. End-to-end discovery through real installed entry
points is the ``plugins`` tox env's job (plugins/*/tests).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import attnhub
import attnhub.registry as registry_module
from attnhub import hookimpl
from attnhub.backends.torch_reference import TorchReference
from attnhub.registry import BUILTIN, BackendRegistry, reload_registry

BUILTINS = {"torch_reference", "torch_sdpa"}


@dataclass
class FakeDist:
    name: str


class FakeEntryPoint:
    """What the registry reads of an ``importlib.metadata.EntryPoint``."""

    group = "attnhub"

    def __init__(self, name: str, dist: str, load: Callable[[], Any], value: str = "") -> None:
        self.name = name
        self.value = value or f"{dist.replace('-', '_')}.plugin"
        self.dist = FakeDist(dist)
        self._load = load

    def load(self) -> Any:
        return self._load()


class FakeMetadata:
    def __init__(self, entry_points: list[FakeEntryPoint]) -> None:
        self._entry_points = entry_points
        self.calls = 0

    def entry_points(self, *, group: str) -> list[FakeEntryPoint]:
        self.calls += 1
        return [ep for ep in self._entry_points if ep.group == group]


def _backend(backend_name: str, **declarations: Any) -> type[attnhub.Backend]:
    attributes = {"name": backend_name, **declarations}
    return type("Fake" + backend_name.title().replace("_", ""), (TorchReference,), attributes)


def _plugin(*backends: type[attnhub.Backend], fail: Exception | None = None) -> types.ModuleType:
    module = types.ModuleType("fake_plugin")

    @hookimpl
    def attnhub_register_backends(registry: BackendRegistry) -> None:
        for backend in backends:
            registry.add(backend())
        if fail is not None:
            raise fail

    module.attnhub_register_backends = attnhub_register_backends  # type: ignore[attr-defined]
    return module


def _raise(exc: Exception) -> Callable[[], Any]:
    def load() -> Any:
        raise exc

    return load


def _load(monkeypatch: pytest.MonkeyPatch, *entry_points: FakeEntryPoint) -> BackendRegistry:
    monkeypatch.setattr(registry_module, "metadata", FakeMetadata(list(entry_points)))
    registry = BackendRegistry()
    registry.load()
    return registry


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for var in (
        "ATTNHUB_DISABLE_PLUGIN_AUTOLOAD",
        "ATTNHUB_DISABLE_PLUGINS",
        "ATTNHUB_TRACE_PLUGINS",
    ):
        monkeypatch.delenv(var, raising=False)
    yield monkeypatch


def test_good_plugin_is_registered_with_its_distribution(clean_env: pytest.MonkeyPatch) -> None:
    ep = FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good")))
    registry = _load(clean_env, ep)
    assert "fake_good" in registry.names() and set(registry.names()) >= BUILTINS
    assert registry.origin("fake_good") == "attnhub-good"
    assert registry.origin("torch_sdpa") == BUILTIN
    assert registry.failures == []


def test_plugin_that_fails_to_import(clean_env: pytest.MonkeyPatch, caplog: Any) -> None:
    broken = FakeEntryPoint(
        "fancy", "attnhub-fancy", _raise(ModuleNotFoundError("No module named 'fancy_kernels'"))
    )
    good = FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good")))
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        registry = _load(clean_env, broken, good)
    assert [(f.plugin, f.distribution, f.error) for f in registry.failures] == [
        ("fancy", "attnhub-fancy", "ModuleNotFoundError: No module named 'fancy_kernels'")
    ]
    assert "fake_good" in registry.names() and set(registry.names()) >= BUILTINS
    assert "attnhub-fancy" in caplog.text and "fancy_kernels" in caplog.text


def test_plugin_that_raises_while_registering_contributes_nothing(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # It registered one backend before raising: all or nothing, so that one goes too.
    plugin = _plugin(_backend("fake_half"), fail=RuntimeError("CUDA driver 11.8 is too old"))
    registry = _load(clean_env, FakeEntryPoint("half", "attnhub-half", lambda: plugin))
    assert "fake_half" not in registry.names()
    (failure,) = registry.failures
    assert failure.distribution == "attnhub-half"
    assert failure.error == "RuntimeError: CUDA driver 11.8 is too old"
    assert set(registry.names()) >= BUILTINS


@pytest.mark.parametrize(
    ("declarations", "error"),
    [
        ({"dtypes": frozenset({torch.int32})}, r"declares nonsense: dtypes .* must be floating"),
        ({"mask_kinds": frozenset({"none", "causal"})}, r"mask_kinds must be within"),
        ({"causal_alignments": frozenset({"center"})}, r"causal_alignments must be within"),
        ({"memory": "constant"}, r"memory must be one of"),
        ({"head_dims": (128, 64)}, r"head_dims \(128, 64\) must be a \(low, high\) range"),
        ({"devices": frozenset({0})}, r"devices must be device type names"),
        ({"name": "Bad-Name"}, r"name 'Bad-Name' must be a lowercase identifier"),
        # Every declaration dispatch reads, with its type (issue 18, item 8).
        ({"priority": "high"}, r"priority must be a finite int or float \(not a bool\), got 'high'"),
        ({"priority": True}, r"priority must be a finite int or float"),
        ({"priority": float("nan")}, r"priority must be a finite int or float"),
        ({"devices": "cuda"}, r"devices must be device type names .*, got 'cuda'"),
        ({"devices": frozenset()}, r"devices must be device type names such as 'cuda' \(a non-empty set\)"),
        ({"dtypes": frozenset()}, r"dtypes frozenset\(\) must be floating torch dtypes \(a non-empty set\)"),
        ({"mask_kinds": "none"}, r"mask_kinds must be within .*, got 'none'"),
        ({"min_capability": [8, 0]}, r"min_capability must be None or a \(major, minor\) tuple of ints"),
        ({"min_capability": (8,)}, r"min_capability must be None or a \(major, minor\) tuple"),
        ({"head_dims": (16.0, 128)}, r"head_dims \(16.0, 128\) must be a \(low, high\) range of ints"),
        ({"head_dim_multiple": 0}, r"head_dim_multiple must be an int >= 1, got 0"),
        ({"head_dim_multiple": 8.0}, r"head_dim_multiple must be an int >= 1, got 8.0"),
        ({"window": "yes"}, r"window must be a bool, got 'yes'"),
        ({"backward": 1}, r"backward must be a bool, got 1"),
        ({"description": 5}, r"description must be a str, got 5"),
        ({"memory_class": "linear"}, r"memory_class must be a method, got 'linear'"),
        ({"dtypes": property(lambda self: 1 / 0)}, r"reading dtypes raised ZeroDivisionError"),
    ],
    ids=[
        "dtype", "mask", "alignment", "memory", "head_dims", "devices", "name",
        "priority_str", "priority_bool", "priority_nan", "devices_str", "devices_empty",
        "dtypes_empty", "mask_kinds_str", "capability_list", "capability_short",
        "head_dims_float", "multiple_zero", "multiple_float", "window_str", "backward_int",
        "description", "memory_class_attr", "property_raises",
    ],
)  # fmt: skip
def test_plugin_that_declares_nonsense(
    clean_env: pytest.MonkeyPatch, declarations: dict[str, Any], error: str
) -> None:
    backend = _backend("fake_nonsense", **declarations)
    good = _backend("fake_good")
    registry = _load(
        clean_env,
        FakeEntryPoint("nonsense", "attnhub-nonsense", lambda: _plugin(backend)),
        FakeEntryPoint("zgood", "attnhub-good", lambda: _plugin(good)),
    )
    (failure,) = registry.failures
    assert (failure.plugin, failure.distribution) == ("nonsense", "attnhub-nonsense")
    assert failure.error.startswith("ValueError: backend ")

    assert re.search(error, failure.error), failure.error
    assert "fake_nonsense" not in registry.names() and "fake_good" in registry.names()


def test_one_nonsense_backend_does_not_take_its_plugins_others_down(
    clean_env: pytest.MonkeyPatch,
) -> None:
    bad = _backend("fake_bad", memory="constant")
    good = _backend("fake_fine")
    registry = _load(
        clean_env, FakeEntryPoint("mixed", "attnhub-mixed", lambda: _plugin(bad, good))
    )
    (failure,) = registry.failures
    assert (
        failure.distribution == "attnhub-mixed" and "'fake_bad' declares nonsense" in failure.error
    )
    assert "fake_fine" in registry.names() and "fake_bad" not in registry.names()
    with pytest.raises(ValueError, match="declares nonsense"):  # outside loading it raises
        registry.add(bad)


def test_name_collision_with_a_builtin_and_between_plugins(clean_env: pytest.MonkeyPatch) -> None:
    impostor = _backend("torch_sdpa")
    first = _backend("fake_dup", description="first")
    second = _backend("fake_dup", description="second")
    registry = _load(
        clean_env,
        FakeEntryPoint("impostor", "attnhub-impostor", lambda: _plugin(impostor)),
        FakeEntryPoint("a_first", "attnhub-first", lambda: _plugin(first)),
        FakeEntryPoint("b_second", "attnhub-second", lambda: _plugin(second)),
    )
    errors = {f.distribution: f.error for f in registry.failures}
    assert errors["attnhub-impostor"] == (
        "ValueError: backend name 'torch_sdpa' from attnhub-impostor is already registered "
        "by attnhub (built-in)"
    )
    assert (
        "'fake_dup' from attnhub-second is already registered by attnhub-first"
        in errors["attnhub-second"]
    )
    # The built-in is untouched, and the first plugin keeps its name.
    assert registry.origin("torch_sdpa") == BUILTIN
    assert registry.get("torch_sdpa").description != impostor.description
    assert registry.get("fake_dup").description == "first"


def test_a_backend_added_at_run_time_is_not_called_built_in(clean_env: pytest.MonkeyPatch) -> None:
    registry = _load(clean_env)
    registry.add(_backend("fake_added"))
    assert registry.origin("fake_added") == registry_module.RUN_TIME
    assert registry.origin("torch_sdpa") == BUILTIN


def test_collision_winner_does_not_depend_on_install_order(clean_env: pytest.MonkeyPatch) -> None:
    first = FakeEntryPoint(
        "a_first", "attnhub-first", lambda: _plugin(_backend("fake_dup", description="first"))
    )
    second = FakeEntryPoint(
        "b_second", "attnhub-second", lambda: _plugin(_backend("fake_dup", description="second"))
    )
    one = _load(clean_env, first, second)
    other = _load(clean_env, second, first)
    assert one.get("fake_dup").description == other.get("fake_dup").description == "first"


def test_hook_with_a_wrong_signature_is_a_recorded_failure(clean_env: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("wrong_signature")

    @hookimpl
    def attnhub_register_backends(reg: BackendRegistry) -> None:  # not "registry"
        reg.add(_backend("fake_never")())

    module.attnhub_register_backends = attnhub_register_backends  # type: ignore[attr-defined]
    registry = _load(clean_env, FakeEntryPoint("wrong", "attnhub-wrong", lambda: module))
    (failure,) = registry.failures
    assert failure.distribution == "attnhub-wrong"
    assert "PluginValidationError" in failure.error and "reg" in failure.error
    assert "fake_never" not in registry.names()


def test_disable_autoload_skips_entry_points_but_not_builtins(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("ATTNHUB_DISABLE_PLUGIN_AUTOLOAD", "1")
    fake = FakeMetadata(
        [FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good")))]
    )
    clean_env.setattr(registry_module, "metadata", fake)
    registry = BackendRegistry()
    registry.load()
    assert fake.calls == 0
    assert "fake_good" not in registry.names() and set(registry.names()) >= BUILTINS


@pytest.mark.parametrize("value", ["0", "", "false", "no", "off", "False", " OFF "])
def test_disable_autoload_off_values(clean_env: pytest.MonkeyPatch, value: str) -> None:
    clean_env.setenv("ATTNHUB_DISABLE_PLUGIN_AUTOLOAD", value)
    registry = _load(
        clean_env, FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good")))
    )
    assert "fake_good" in registry.names()


def test_disable_named_plugins_by_entry_point_or_distribution(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("ATTNHUB_DISABLE_PLUGINS", "one, attnhub-two")
    loaded: list[str] = []

    def plugin(name: str) -> Callable[[], Any]:
        def load() -> Any:
            loaded.append(name)
            return _plugin(_backend(f"fake_{name}"))

        return load

    registry = _load(
        clean_env,
        FakeEntryPoint("one", "attnhub-one", plugin("one")),
        FakeEntryPoint("two", "attnhub-two", plugin("two")),
        FakeEntryPoint("three", "attnhub-three", plugin("three")),
    )
    assert loaded == ["three"]  # blocked plugins are not even imported
    assert "fake_three" in registry.names()
    assert not {"fake_one", "fake_two"} & set(registry.names())
    assert {(s.plugin, s.distribution) for s in registry.skipped} == {
        ("one", "attnhub-one"),
        ("two", "attnhub-two"),
    }
    assert all("ATTNHUB_DISABLE_PLUGINS" in s.why for s in registry.skipped)


@pytest.mark.parametrize("blocked", ["attnhub.backends", "attnhub"])
def test_disable_plugins_never_takes_the_built_ins_and_reports_names_matching_nothing(
    clean_env: pytest.MonkeyPatch, caplog: Any, blocked: str
) -> None:
    clean_env.setenv("ATTNHUB_DISABLE_PLUGINS", f"{blocked}, one, tpyo")
    with caplog.at_level(logging.WARNING, logger="attnhub"):
        registry = _load(
            clean_env,
            FakeEntryPoint("one", "attnhub-one", lambda: _plugin(_backend("fake_one"))),
            FakeEntryPoint("two", "attnhub-two", lambda: _plugin(_backend("fake_two"))),
        )
    assert {"torch_reference", "torch_sdpa", "fake_two"} <= set(registry.names())
    assert "fake_one" not in registry.names()
    unmatched = [
        r.getMessage() for r in caplog.records if "names no installed plugin" in r.getMessage()
    ]
    assert unmatched == [
        f"attnhub: ATTNHUB_DISABLE_PLUGINS names no installed plugin entry point or "
        f"distribution: {', '.join(sorted([blocked, 'tpyo']))}"
    ]


def test_trace_logs_what_was_loaded_from_where(clean_env: pytest.MonkeyPatch, caplog: Any) -> None:
    clean_env.setenv("ATTNHUB_TRACE_PLUGINS", "1")
    clean_env.setenv("ATTNHUB_DISABLE_PLUGINS", "blocked")
    with caplog.at_level(logging.INFO, logger="attnhub"):
        _load(
            clean_env,
            FakeEntryPoint(
                "good", "attnhub-good", lambda: _plugin(_backend("fake_good")), "good_pkg.plugin"
            ),
            FakeEntryPoint("blocked", "attnhub-blocked", lambda: _plugin()),
        )
    text = caplog.text
    assert "loaded built-in backends from" in text
    assert "loaded plugin good = good_pkg.plugin from attnhub-good" in text
    assert "skipped plugin blocked (attnhub-blocked)" in text


def test_no_trace_without_the_variable(clean_env: pytest.MonkeyPatch, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="attnhub"):
        _load(
            clean_env,
            FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good"))),
        )
    assert "loaded plugin" not in caplog.text


def test_global_registry_with_a_failing_plugin_still_serves_calls(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Through ``reload_registry``: a plugin backend is dispatched to by name, a broken
    plugin is only a recorded failure, and the built-ins keep working."""
    fake = FakeMetadata(
        [
            FakeEntryPoint(
                "good", "attnhub-good", lambda: _plugin(_backend("fake_good", priority=1000))
            ),
            FakeEntryPoint("bad", "attnhub-bad", _raise(ImportError("libcuda.so.1: cannot open"))),
        ]
    )
    clean_env.setattr(registry_module, "metadata", fake)
    try:
        registry = reload_registry()
        assert "fake_good" in attnhub.list_backends()
        assert registry.failures[0].error == "ImportError: libcuda.so.1: cannot open"
        q = torch.randn(1, 2, 5, 8)
        decision = attnhub.explain(q, q, q, backend="fake_good")
        assert decision.chosen == "fake_good"
        assert "attnhub-good" in str(decision)
        out = attnhub.attention(q, q, q, backend="fake_good")
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
    finally:
        clean_env.undo()
        reload_registry()
    assert "fake_good" not in attnhub.list_backends()


def test_import_attnhub_survives_a_broken_real_entry_point(tmp_path: Any) -> None:
    """A real (installed-looking) distribution whose plugin module raises on import."""
    dist = tmp_path / "attnhub_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: attnhub-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnhub]\nbroken = attnhub_broken_plugin\n")
    (tmp_path / "attnhub_broken_plugin.py").write_text(
        "raise RuntimeError('kernel build failed: nvcc not found')\n"
    )
    code = (
        "import attnhub\n"
        "names = attnhub.list_backends()\n"
        "assert 'torch_sdpa' in names, names\n"
        "(f,) = [f for f in attnhub.get_registry().failures if f.plugin == 'broken']\n"
        "print(f.distribution, '|', f.error)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert (
        run.stdout.strip() == "attnhub-broken | RuntimeError: kernel build failed: nvcc not found"
    )


# -- issue 18: rollback, pluggy's checks, environment, re-entry ------------------------


def _hook_module(hook: Callable[[BackendRegistry], None], name: str = "fake_plugin") -> Any:
    module = types.ModuleType(name)
    module.attnhub_register_backends = hookimpl(hook)  # type: ignore[attr-defined]
    return module


def test_a_failed_plugin_is_rolled_back_completely(clean_env: pytest.MonkeyPatch) -> None:
    """A hook that removes built-ins (one replaced by its own) and then raises, and a
    plugin that does the same at import, leave the registry as it was."""
    loading = BackendRegistry()

    def hook(registry: BackendRegistry) -> None:
        registry.remove("torch_reference")
        registry.remove("torch_sdpa")
        registry.add(_backend("torch_sdpa", description="impostor")())
        registry.add(_backend("fake_mine")())
        raise RuntimeError("half-way")

    def import_time() -> Any:
        loading.remove("torch_sdpa")  # as through attnhub.get_registry() while it loads
        raise ImportError("needs a newer CUDA")

    clean_env.setattr(registry_module, "metadata", FakeMetadata([
        FakeEntryPoint("a_hook", "attnhub-hook", lambda: _hook_module(hook)),
        FakeEntryPoint("b_import", "attnhub-import", import_time),
    ]))  # fmt: skip
    loading.load()
    registry = loading
    assert {"torch_reference", "torch_sdpa"} <= set(registry.names())
    assert "fake_mine" not in registry.names()
    assert registry.origin("torch_sdpa") == BUILTIN
    assert registry.get("torch_sdpa").description != "impostor"
    assert [(f.plugin, f.error) for f in registry.failures] == [
        ("a_hook", "RuntimeError: half-way"),
        ("b_import", "ImportError: needs a newer CUDA"),
    ]


def test_a_misspelled_hook_is_reported_by_pluggy_check_pending(
    clean_env: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType("typo")

    @hookimpl
    def attnhub_register_backend(registry: BackendRegistry) -> None:  # missing "s"
        registry.add(_backend("fake_typo")())

    module.attnhub_register_backend = attnhub_register_backend  # type: ignore[attr-defined]
    registry = _load(
        clean_env,
        FakeEntryPoint("typo", "attnhub-typo", lambda: module),
        FakeEntryPoint("zgood", "attnhub-good", lambda: _plugin(_backend("fake_good"))),
    )
    (failure,) = registry.failures
    assert failure.distribution == "attnhub-typo"
    assert failure.error.startswith(
        "PluginValidationError: unknown hook 'attnhub_register_backend'"
    )
    assert "attnhub's hooks: attnhub_register_backends" in failure.error
    assert "fake_good" in registry.names()  # the next plugin is not blamed


def test_a_plugin_without_a_marked_hook_is_reported(clean_env: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("unmarked")

    def attnhub_register_backends(registry: BackendRegistry) -> None:  # no @hookimpl
        registry.add(_backend("fake_unmarked")())

    module.attnhub_register_backends = attnhub_register_backends  # type: ignore[attr-defined]
    registry = _load(clean_env, FakeEntryPoint("unmarked", "attnhub-unmarked", lambda: module))
    (failure,) = registry.failures
    assert "implements no attnhub hook" in failure.error and "@attnhub.hookimpl" in failure.error


def test_blocked_names_go_through_pluggy(clean_env: pytest.MonkeyPatch) -> None:
    import pluggy

    from attnhub import hookspecs

    loaded: list[str] = []

    def plugin(name: str) -> Callable[[], Any]:
        return lambda: loaded.append(name) or _plugin(_backend(f"fake_{name}"))

    clean_env.setenv("ATTNHUB_DISABLE_PLUGINS", "env_blocked")
    clean_env.setattr(registry_module, "metadata", FakeMetadata([
        FakeEntryPoint("env_blocked", "attnhub-a", plugin("env_blocked")),
        FakeEntryPoint("pm_blocked", "attnhub-b", plugin("pm_blocked")),
        FakeEntryPoint("free", "attnhub-c", plugin("free")),
    ]))  # fmt: skip
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.set_blocked("pm_blocked")  # a caller's own block
    registry = BackendRegistry()
    registry.load(pm)
    assert loaded == ["free"]
    assert pm.is_blocked("env_blocked") and pm.is_blocked("pm_blocked")
    assert {s.plugin for s in registry.skipped} == {"env_blocked", "pm_blocked"}


@pytest.mark.parametrize("variable", ["ATTNHUB_DISABLE_PLUGIN_AUTOLOAD", "ATTNHUB_TRACE_PLUGINS"])
@pytest.mark.parametrize("value", ["banana", "2", "disable"])
def test_plugin_flags_reject_garbage_naming_the_variable(
    clean_env: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    loaded: list[str] = []
    good = FakeEntryPoint(
        "good", "attnhub-good", lambda: loaded.append("good") or _plugin(_backend("fake_good"))
    )
    with pytest.raises(ValueError, match=rf"{variable}='{value}' is not a boolean: use 1, true"):
        clean_env.setenv(variable, value)
        _load(clean_env, good)
    assert loaded == []  # nothing loaded on a guess


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_disable_autoload_on_values(clean_env: pytest.MonkeyPatch, value: str) -> None:
    clean_env.setenv("ATTNHUB_DISABLE_PLUGIN_AUTOLOAD", value)
    registry = _load(
        clean_env, FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("fake_good")))
    )
    assert "fake_good" not in registry.names() and set(registry.names()) >= BUILTINS


@pytest.mark.parametrize("value", ["0", "no", "off", "false"])
def test_trace_off_values_trace_nothing(
    clean_env: pytest.MonkeyPatch, caplog: Any, value: str
) -> None:
    clean_env.setenv("ATTNHUB_TRACE_PLUGINS", value)
    with caplog.at_level(logging.INFO, logger="attnhub"):
        _load(clean_env, FakeEntryPoint("good", "attnhub-good", lambda: _plugin(_backend("g"))))
    assert "loaded plugin" not in caplog.text and "built-in backends" not in caplog.text


_REENTRY_SCRIPT = """
import sys, threading, types
import attnhub
import attnhub.registry as r
from attnhub import hookimpl
from attnhub.backends.torch_reference import TorchReference


def backend(name):
    return type(name, (TorchReference,), {"name": name})()


def module(hook):
    m = types.ModuleType("m")
    m.attnhub_register_backends = hookimpl(hook)
    return m


seen = {}


def at_import():
    seen["at_import"] = attnhub.list_backends()  # at import: the built-ins so far
    return module(lambda registry: registry.add(backend("p_import")))


def in_hook(registry):
    assert attnhub.get_registry() is registry
    registry.add(backend("p_hook"))
    seen["in_hook"] = attnhub.list_backends()


def in_thread(registry):
    out = []
    worker = threading.Thread(target=lambda: out.append(attnhub.list_backends()))
    worker.start()
    worker.join()
    seen["in_thread"] = out[0]
    registry.add(backend("p_thread"))


def reloads(registry):
    r.reload_registry()


class EP:
    def __init__(self, name, load):
        self.name, self.value, self._load = name, name, load
        self.dist = types.SimpleNamespace(name="dist-" + name)

    def load(self):
        return self._load()


eps = [
    EP("a_import", at_import),
    EP("b_hook", lambda: module(in_hook)),
    EP("c_thread", lambda: module(in_thread)),
    EP("d_reload", lambda: module(reloads)),
]
r.metadata = types.SimpleNamespace(entry_points=lambda group: eps)
names = attnhub.list_backends()
print(sorted(n for n in names if n.startswith("p_")))
print("torch_sdpa" in seen["at_import"], "p_hook" in seen["in_hook"], "p_import" in seen["in_thread"])
print([(f.plugin, f.error.split(":")[0]) for f in attnhub.get_registry().failures])
"""


def test_plugins_that_call_attnhub_while_it_loads_do_not_hang(tmp_path: Any) -> None:
    """At import, in the hook, from a thread the hook waits for: each gets the registry
    as loaded so far; reloading from a hook fails that plugin. (A subprocess, with a
    timeout: before the fix, the first of these hung for ever.)"""
    script = tmp_path / "reentry.py"
    script.write_text(_REENTRY_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("ATTNHUB_")},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "['p_hook', 'p_import', 'p_thread']",
        "True True True",
        "[('d_reload', 'RuntimeError')]",
    ]


def test_another_thread_waits_for_the_whole_registry_while_plugins_load(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """Concurrent first use: a thread that was running before loading began does not
    see a half-loaded registry (only plugin code and its own threads do)."""
    import threading
    import time

    asking, seen = threading.Event(), []

    def slow_hook(registry: BackendRegistry) -> None:
        asking.set()  # the other thread now asks while this plugin is loading
        time.sleep(0.3)
        registry.add(_backend("fake_slow")())

    def other_thread() -> None:
        asking.wait(30)
        seen.append(attnhub.list_backends())

    clean_env.setattr(registry_module, "metadata", FakeMetadata([
        FakeEntryPoint("slow", "attnhub-slow", lambda: _hook_module(slow_hook)),
    ]))  # fmt: skip
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        reload_registry()
        thread.join(30)
        assert seen and "fake_slow" in seen[0] and set(seen[0]) >= BUILTINS
    finally:
        clean_env.undo()
        reload_registry()
