"""Plugin loading through (fake) entry points: failures are recorded, never fatal.

Each test builds a fresh :class:`attnhub.registry.BackendRegistry` whose entry points
come from a stand-in for ``importlib.metadata``; the process-wide registry is reloaded
after the tests that touch it. End-to-end discovery through real installed entry
points is the ``plugins`` tox env's job (plugins/*/tests).
"""

from __future__ import annotations

import logging
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
    ],
    ids=["dtype", "mask", "alignment", "memory", "head_dims", "devices", "name"],
)
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


@pytest.mark.parametrize("value", ["0", "", "false"])
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
