"""The backend registry and plugin loading.

Backends arrive only through the ``attnhub_register_backends`` hook: the built-in
ones (module :mod:`attnhub.backends`) exactly like a third party's, found through the
``attnhub`` entry-point group. Loading happens at first use, not at import, and never
raises: a plugin that fails to import, raises while registering or declares nonsense
becomes a :class:`PluginFailure` that ``attnhub info`` shows with its distribution
and the real exception text.

Environment (read when the registry loads):

``ATTNHUB_DISABLE_PLUGIN_AUTOLOAD=1``  skip entry-point plugins (built-ins still load)
``ATTNHUB_DISABLE_PLUGINS=a,b``        skip the named entry points or distributions
``ATTNHUB_TRACE_PLUGINS=1``            log every plugin loaded or skipped, and from where
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy
import torch

from . import hookspecs
from .backend import FLOAT_DTYPES, MEMORY_CLASSES, Backend
from .request import ALIGNMENTS, MASK_KINDS

log = logging.getLogger("attnhub")

BUILTIN = "attnhub (built-in)"
ENTRY_POINT_GROUP = "attnhub"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not contribute: where it came from and what went wrong."""

    plugin: str
    distribution: str
    error: str


@dataclass(frozen=True)
class PluginSkip:
    plugin: str
    distribution: str
    why: str


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _env_list(name: str) -> set[str]:
    return {item.strip() for item in os.environ.get(name, "").split(",") if item.strip()}


def _declaration_problems(backend: Backend) -> list[str]:
    """Declarations that cannot be right; a backend with any is not registered."""
    problems = []
    name = backend.name
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        problems.append(f"name {name!r} must be a lowercase identifier")
    checks: list[tuple[bool, str]] = [
        (
            all(isinstance(d, torch.dtype) and d in FLOAT_DTYPES for d in backend.dtypes),
            f"dtypes {set(backend.dtypes)!r} must be floating torch dtypes",
        ),
        (set(backend.mask_kinds) <= set(MASK_KINDS), f"mask_kinds must be within {MASK_KINDS}"),
        (
            set(backend.causal_alignments) <= set(ALIGNMENTS),
            f"causal_alignments must be within {ALIGNMENTS}",
        ),
        (backend.memory in MEMORY_CLASSES, f"memory must be one of {MEMORY_CLASSES}"),
        (
            len(backend.head_dims) == 2 and 1 <= backend.head_dims[0] <= backend.head_dims[1],
            f"head_dims {backend.head_dims!r} must be a (low, high) range",
        ),
        (
            isinstance(backend.head_dim_multiple, int) and backend.head_dim_multiple >= 1,
            "head_dim_multiple must be an int >= 1",
        ),
        (
            all(isinstance(d, str) for d in backend.devices),
            "devices must be device type names such as 'cuda'",
        ),
    ]
    problems += [message for ok, message in checks if not ok]
    return problems


class BackendRegistry:
    """Registered backends by name, where each came from, and what failed to load."""

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self._origins: dict[str, str] = {}
        self._unavailable: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self.failures: list[PluginFailure] = []
        self.skipped: list[PluginSkip] = []
        self._current_origin = BUILTIN
        self._current_plugin = "attnhub.backends"
        self._loading = False

    # -- registration ------------------------------------------------------
    def add(self, backend: Backend) -> None:
        """Register a backend instance (a class is instantiated).

        Raises ``ValueError`` for a name already taken or nonsensical declarations.
        While plugins load, such a backend is instead left out and recorded as a
        failure of its plugin, so that the plugin's other backends still register.
        """
        if isinstance(backend, type) and issubclass(backend, Backend):
            backend = backend()
        if not isinstance(backend, Backend):
            raise TypeError(
                f"registry.add expects an attnhub.Backend, got {type(backend).__name__}"
            )
        problems = _declaration_problems(backend)
        if problems:
            message = f"backend {backend.name!r} declares nonsense: " + "; ".join(problems)
        elif backend.name in self._backends:
            message = (
                f"backend name {backend.name!r} from {self._current_origin} is already "
                f"registered by {self._origins[backend.name]}"
            )
        else:
            self._backends[backend.name] = backend
            self._origins[backend.name] = self._current_origin
            return
        if not self._loading:
            raise ValueError(message)
        self.failures.append(
            PluginFailure(self._current_plugin, self._current_origin, f"ValueError: {message}")
        )
        log.warning(
            "attnhub plugin %s (%s): %s", self._current_plugin, self._current_origin, message
        )

    def remove(self, name: str) -> None:
        """Unregister a backend (tests and interactive use)."""
        self._backends.pop(name)
        self._origins.pop(name, None)
        self._unavailable.pop(name, None)

    # -- queries -----------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._backends)

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise ValueError(
                f"unknown backend {name!r}; known backends: {', '.join(self.names())}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def backends(self) -> list[Backend]:
        return [self._backends[n] for n in self.names()]

    def origin(self, name: str) -> str:
        return self._origins[name]

    def unavailable_reason(self, name: str) -> str | None:
        """The backend's own probe, run once; an exception in it is the reason."""
        if name not in self._unavailable:
            with self._lock:
                if name not in self._unavailable:
                    try:
                        why = self._backends[name].unavailable_reason()
                    except Exception as exc:
                        why = f"availability probe raised {type(exc).__name__}: {exc}"
                    self._unavailable[name] = why
        return self._unavailable[name]

    # -- plugin loading ----------------------------------------------------
    def _call_plugin(
        self, pm: pluggy.PluginManager, plugin: Any, plugin_name: str, distribution: str
    ) -> None:
        """Run one plugin's ``attnhub_register_backends`` implementations.

        Called per plugin (not through ``pm.hook``) so that a failure is attributed
        to its plugin and does not stop the others.
        """
        hook = pm.hook.attnhub_register_backends
        impls = [impl for impl in hook.get_hookimpls() if impl.plugin is plugin]
        arguments = {"registry": self}
        self._current_origin, self._current_plugin = distribution, plugin_name
        self._loading = True
        before = set(self._backends)
        try:
            for impl in impls:
                impl.function(*[arguments[name] for name in impl.argnames])
        except Exception as exc:
            # All or nothing: a plugin that raised half-way contributes nothing.
            for name in set(self._backends) - before:
                self.remove(name)
            self.failures.append(
                PluginFailure(plugin_name, distribution, f"{type(exc).__name__}: {exc}")
            )
            log.warning("attnhub plugin %s (%s) failed: %s", plugin_name, distribution, exc)
        finally:
            self._loading = False
            self._current_origin, self._current_plugin = BUILTIN, "attnhub.backends"

    def load(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        """Register the built-ins, then every entry-point plugin not disabled."""
        trace = _env_flag("ATTNHUB_TRACE_PLUGINS")
        pm = plugin_manager or pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        builtin = _import_builtin_backends()
        pm.register(builtin, name="attnhub.backends")
        self._call_plugin(pm, builtin, "attnhub.backends", BUILTIN)
        if trace:
            log.warning("attnhub: loaded built-in backends from %s", builtin.__file__)
        if _env_flag("ATTNHUB_DISABLE_PLUGIN_AUTOLOAD"):
            if trace:
                log.warning(
                    "attnhub: ATTNHUB_DISABLE_PLUGIN_AUTOLOAD is set; skipping entry points"
                )
            return
        blocked = _env_list("ATTNHUB_DISABLE_PLUGINS")
        # Sorted: the order plugins load in must not depend on install order.
        entry_points = sorted(
            metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value)
        )
        for ep in entry_points:
            dist = ep.dist.name if ep.dist is not None else "unknown distribution"
            if ep.name in blocked or dist in blocked:
                self.skipped.append(PluginSkip(ep.name, dist, "blocked by ATTNHUB_DISABLE_PLUGINS"))
                if trace:
                    log.warning("attnhub: skipped plugin %s (%s): blocked", ep.name, dist)
                continue
            try:
                plugin = ep.load()
                pm.register(plugin, name=ep.name)
            except Exception as exc:
                self.failures.append(PluginFailure(ep.name, dist, f"{type(exc).__name__}: {exc}"))
                log.warning("attnhub plugin %s (%s) failed to load: %s", ep.name, dist, exc)
                continue
            self._call_plugin(pm, plugin, ep.name, dist)
            if trace:
                log.warning("attnhub: loaded plugin %s = %s from %s", ep.name, ep.value, dist)


def _import_builtin_backends() -> Any:
    """The built-in backends' module, ``attnhub.backends``.

    The wheel ships the source folder ``backends/`` as ``attnhub.backends`` (mapped in
    pyproject.toml). Where attnhub is imported from a source checkout instead (the
    repository root on ``sys.path``, as ``python -m attnhub`` run there does), that
    mapping does not exist, so the same folder is mapped here, the same way.
    """
    try:
        return importlib.import_module("attnhub.backends")
    except ModuleNotFoundError as exc:
        source = Path(__file__).resolve().parent.parent / "backends"
        if exc.name != "attnhub.backends" or not (source / "__init__.py").is_file():
            raise
    spec = importlib.util.spec_from_file_location(
        "attnhub.backends", source / "__init__.py", submodule_search_locations=[str(source)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["attnhub.backends"] = module
    spec.loader.exec_module(module)
    return module


_registry: BackendRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> BackendRegistry:
    """The process-wide registry, loaded on first use."""
    global _registry
    if _registry is None:
        with _registry_lock:
            if _registry is None:
                registry = BackendRegistry()
                registry.load()
                _registry = registry
    return _registry


def reload_registry() -> BackendRegistry:
    """Forget the registry and every cached decision, then load again."""
    global _registry
    from .dispatch import clear_cache

    with _registry_lock:
        _registry = None
    clear_cache()
    return get_registry()
