"""The backend registry, plugin loading, and the cache-invalidation hook.

Backends arrive only through the ``attnhub_register_backends`` hook: the built-in
ones (module :mod:`attnhub.backends`) exactly like a third party's, found through the
``attnhub`` entry-point group. Loading happens at first use, not at import, and never
raises for a plugin's sake: a plugin that fails to import, implements a hook pluggy
does not know (``check_pending``), raises while registering or declares nonsense
becomes a :class:`PluginFailure` that ``attnhub info`` shows with its distribution and
the real exception text, and everything it changed in the registry is rolled back.

Plugin code may call attnhub while it loads (``attnhub.list_backends()`` at import,
``get_registry()`` in its hook, an ``attnhub.attention`` self-test): the loading
thread, and threads started while it loads, get the registry as loaded so far instead
of waiting for a load that is waiting for them (see :func:`get_registry`).

Environment (read when the registry loads; grammar in :mod:`attnhub.env`):

``ATTNHUB_DISABLE_PLUGIN_AUTOLOAD=1``  skip entry-point plugins (built-ins still load)
``ATTNHUB_DISABLE_PLUGINS=a,b``        skip the named entry points or distributions
                                       (blocked through pluggy's ``set_blocked``; never
                                       the built-ins; a name matching none is logged)
``ATTNHUB_TRACE_PLUGINS=1``            log every plugin loaded or skipped, and from where

Caches: everything that changes what dispatch would decide (a backend added, removed
or found broken, the registry reloaded, a ranking policy or cost table changed) calls
:func:`invalidate_caches`; modules that cache decisions subscribe with
:func:`on_invalidate`. This module imports nothing above it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy
import torch

from . import env, hookspecs, mkl_vml
from .backend import FLOAT_DTYPES, LAYOUTS, MEMORY_CLASSES, Backend, is_finite_number
from .request import ALIGNMENTS, MASK_KINDS

log = logging.getLogger("attnhub")

BUILTIN = "attnhub (built-in)"
# The origin of a backend added by code outside plugin loading (registry.add at run time).
RUN_TIME = "registry.add at run time"
BUILTIN_PLUGIN = "attnhub.backends"
ENTRY_POINT_GROUP = "attnhub"
LOAD_WAIT_S = 60.0
"""How long a thread that was running before the registry started loading waits for it
(a plugin's own threads do not wait at all); past that it gets the registry as loaded
so far, with a warning, rather than risk waiting for ever on a plugin that waits on it."""


# -- cache invalidation -------------------------------------------------------------

_listeners: list[Callable[[], None]] = []
_generation = 0


def on_invalidate(listener: Callable[[], None]) -> Callable[[], None]:
    """Call ``listener()`` after every change that can alter a dispatch decision.

    For modules that cache decisions or anything derived from them (dispatch's
    decisions, the api's per-call entries); returns ``listener``, so it decorates.
    """
    _listeners.append(listener)
    return listener


def invalidate_caches() -> None:
    """Tell every subscriber that cached decisions are stale (and bump :func:`generation`)."""
    global _generation
    _generation += 1
    for listener in tuple(_listeners):
        listener()


def generation() -> int:
    """A counter that :func:`invalidate_caches` bumps: a cache fills only where it did
    not change while the value was computed, so a decision made against a registry
    that changed meanwhile is not stored."""
    return _generation


# -- declarations ------------------------------------------------------------------------


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


_COLLECTIONS = (set, frozenset, tuple, list)


def _collection_of(item_ok: Callable[[Any], bool], nonempty: bool) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        return (
            isinstance(value, _COLLECTIONS)
            and (len(value) > 0 or not nonempty)
            and all(item_ok(item) for item in value)
        )

    return check


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value.isidentifier() and value == value.lower()


def _is_capability(value: Any) -> bool:
    return value is None or (
        isinstance(value, tuple) and len(value) == 2 and all(_is_int(v) and v >= 0 for v in value)
    )


def _is_head_dims(value: Any) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(_is_int(v) for v in value)
        and 1 <= value[0] <= value[1]
    )


def _is_float_dtype(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value in FLOAT_DTYPES


_FLAG_DECLARATIONS = (
    "value_head_dim", "mask_grad", "window", "softcap", "dropout", "gqa", "block_sparse",
    "lse", "backward", "deterministic", "compile_safe", "compiles_per_shape", "copies_strided",
    "stock",
)  # fmt: skip
_METHODS = (
    "unavailable_reason", "extra_reasons", "memory_class", "prepare", "forward", "capabilities",
)  # fmt: skip

# Every declaration a backend makes, with what it must be: (attribute, check, message).
# The message formats with {value!r}; the phrases "must be within", "must be one of"
# and "must be floating" are what the docs and plugin authors' tests look for.
_DECLARATIONS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("name", _is_name, "name {value!r} must be a lowercase identifier"),
    ("description", lambda v: isinstance(v, str), "description must be a str, got {value!r}"),
    (
        "priority",
        is_finite_number,
        "priority must be a finite int or float (not a bool), got {value!r}",
    ),
    (
        "devices",
        _collection_of(lambda d: isinstance(d, str) and bool(d), nonempty=True),
        "devices must be device type names such as 'cuda' (a non-empty set), got {value!r}",
    ),
    (
        "min_capability",
        _is_capability,
        "min_capability must be None or a (major, minor) tuple of ints, got {value!r}",
    ),
    (
        "dtypes",
        _collection_of(_is_float_dtype, nonempty=True),
        "dtypes {value!r} must be floating torch dtypes (a non-empty set)",
    ),
    (
        "head_dims",
        _is_head_dims,
        "head_dims {value!r} must be a (low, high) range of ints with 1 <= low <= high",
    ),
    (
        "head_dim_multiple",
        lambda v: _is_int(v) and v >= 1,
        "head_dim_multiple must be an int >= 1, got {value!r}",
    ),
    (
        "mask_kinds",
        _collection_of(lambda k: k in MASK_KINDS, nonempty=True),
        f"mask_kinds must be within {MASK_KINDS} (a non-empty set), got {{value!r}}",
    ),
    (
        "causal_alignments",
        _collection_of(lambda a: a in ALIGNMENTS, nonempty=False),
        f"causal_alignments must be within {ALIGNMENTS}, got {{value!r}}",
    ),
    (
        "layouts",
        _collection_of(lambda k: k in LAYOUTS, nonempty=True),
        f"layouts must be within {LAYOUTS} (a non-empty set), got {{value!r}}",
    ),
    (
        "memory",
        lambda v: v in MEMORY_CLASSES,
        f"memory must be one of {MEMORY_CLASSES}, got {{value!r}}",
    ),
    *(
        (flag, lambda v: isinstance(v, bool), f"{flag} must be a bool, got {{value!r}}")
        for flag in _FLAG_DECLARATIONS
    ),
    *((method, callable, f"{method} must be a method, got {{value!r}}") for method in _METHODS),
)


def declaration_problems(backend: Backend) -> list[str]:
    """Declarations that cannot be right, each with its type; a backend with any is not
    registered. Dispatch reads every one of these at every decision, so a wrong type
    here would otherwise fail every call, not only the calls this backend could serve."""
    problems = []
    for attribute, ok, message in _DECLARATIONS:
        try:
            value = getattr(backend, attribute)
            valid = bool(ok(value))
        except Exception as exc:  # a property that raises
            problems.append(f"reading {attribute} raised {type(exc).__name__}: {exc}")
            continue
        if not valid:
            problems.append(message.format(value=value))
    problems += _layout_methods(backend)
    return problems


# The method that serves each layout beyond "dense" (whose ``forward`` is checked above).
_LAYOUT_METHODS = {
    "varlen": "forward_varlen",
    "kvcache": "forward_kvcache",
    "paged": "forward_kvcache",
}


def _layout_methods(backend: Backend) -> list[str]:
    """A declared layout whose method the backend does not implement (it would raise
    NotImplementedError at every call dispatch sends it)."""
    try:
        layouts = set(backend.layouts)
    except Exception:
        return []  # reported above
    return [
        f"layouts declares {layout!r} but {method} is not implemented"
        for layout, method in sorted(_LAYOUT_METHODS.items())
        if layout in layouts and getattr(type(backend), method, None) is getattr(Backend, method)
    ]


def _shown_name(backend: Backend) -> Any:
    try:
        return backend.name
    except Exception:
        return f"<{type(backend).__name__}>"


# -- the registry -------------------------------------------------------------------------

_UNPROBED = object()


class BackendRegistry:
    """Registered backends by name, where each came from, and what failed to load.

    Safe to read from several threads while another adds or removes (reads take
    snapshots); every change calls :func:`invalidate_caches`.
    """

    def __init__(self) -> None:
        self._backends: dict[str, Backend] = {}
        self._origins: dict[str, str] = {}
        # Why a backend cannot run here (None: it can); filled by its own probe, or
        # by dispatch when the backend's code fails (see disable).
        self._unavailable: dict[str, str | None] = {}
        self._probing: set[tuple[int, str]] = set()  # (thread, backend) probes under way
        self._lock = threading.RLock()
        self.failures: list[PluginFailure] = []
        self.skipped: list[PluginSkip] = []
        self._current_origin = RUN_TIME  # while no plugin loads
        self._current_plugin = RUN_TIME
        self._loader: int | None = None  # the thread running load(), while it runs

    # -- registration ------------------------------------------------------
    def add(self, backend: Backend) -> None:
        """Register a backend instance (a class is instantiated).

        Raises ``ValueError`` for a name already taken or declarations that cannot be
        right (:func:`declaration_problems`). While plugins load, such a backend is
        instead left out and recorded as a failure of its plugin, so that the plugin's
        other backends still register.
        """
        if isinstance(backend, type) and issubclass(backend, Backend):
            backend = backend()
        if not isinstance(backend, Backend):
            raise TypeError(
                f"registry.add expects an attnhub.Backend, got {type(backend).__name__}"
            )
        problems = declaration_problems(backend)
        # (A name that cannot be read or is not a str is among the problems.)
        name: str = backend.name if not problems else _shown_name(backend)
        with self._lock:
            if problems:
                message = f"backend {name!r} declares nonsense: " + "; ".join(problems)
            elif name in self._backends:
                message = (
                    f"backend name {name!r} from {self._current_origin} is already "
                    f"registered by {self._origins[name]}"
                )
            else:
                self._backends[name] = backend
                self._origins[name] = self._current_origin
                self._unavailable.pop(name, None)
                message = ""
            plugin, origin = self._current_plugin, self._current_origin
        if not message:
            invalidate_caches()
            return
        if self._loader != threading.get_ident():
            raise ValueError(message)
        self.failures.append(PluginFailure(plugin, origin, f"ValueError: {message}"))
        log.warning("attnhub plugin %s (%s): %s", plugin, origin, message)

    def remove(self, name: str) -> None:
        """Unregister a backend; ``ValueError`` (listing the known ones) for an unknown name."""
        with self._lock:
            self.get(name)
            del self._backends[name]
            self._origins.pop(name, None)
            self._unavailable.pop(name, None)
        invalidate_caches()

    def disable(self, name: str, reason: str) -> None:
        """Mark a registered backend unavailable here, for the rest of the process.

        Dispatch calls this when the backend's own code fails (raises, or returns the
        wrong type): ``reason`` is then what ``attnhub info`` and ``explain()`` show.
        """
        with self._lock:
            if name not in self._backends or self._unavailable.get(name) == reason:
                return
            self._unavailable[name] = reason
            origin = self._origins.get(name, "?")
        log.warning("attnhub: backend %s (%s) is disabled: %s", name, origin, reason)
        invalidate_caches()

    # -- queries -----------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(dict(self._backends))

    def get(self, name: str) -> Backend:
        try:
            return self._backends[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown backend {name!r}; known backends: {', '.join(self.names())}"
            ) from None

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._backends
        except TypeError:  # unhashable
            return False

    def backends(self) -> list[Backend]:
        """The registered backends, sorted by name (a snapshot)."""
        snapshot = dict(self._backends)
        return [snapshot[n] for n in sorted(snapshot)]

    def origin(self, name: str) -> str:
        return self._origins[name]

    def unavailable_reason(self, name: str) -> str | None:
        """Why a backend cannot run here (None: it can).

        Its own ``unavailable_reason()`` probe runs once and is cached; an exception
        in it, or a value that is neither None nor a str, is the reason. The probe runs
        under no lock (two threads may both probe, the first answer stays), so a probe
        that calls attnhub, or waits on a thread that does, cannot deadlock; one that
        re-enters its own probe gets a reason saying so.
        """
        why: Any = self._unavailable.get(name, _UNPROBED)
        if why is not _UNPROBED:
            return why
        backend = self.get(name)
        probe = (threading.get_ident(), name)
        if probe in self._probing:
            return "its availability probe re-entered itself (it calls attnhub dispatch)"
        self._probing.add(probe)
        try:
            why = _probe(backend)
        finally:
            self._probing.discard(probe)
        with self._lock:
            if name in self._backends:
                why = self._unavailable.setdefault(name, why)
        return why

    # -- plugin loading ----------------------------------------------------
    def load(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        """Register the built-ins, then every entry-point plugin not disabled.

        Raises ``ValueError`` (before loading anything) for an environment variable
        that does not parse, and ``RuntimeError`` if called again while it runs;
        nothing a plugin does makes it raise.
        """
        trace = env.flag(env.TRACE_PLUGINS)
        no_autoload = env.flag(env.DISABLE_PLUGIN_AUTOLOAD)
        blocked = env.names(env.DISABLE_PLUGINS)
        if self._loader is not None:
            raise RuntimeError("BackendRegistry.load() called again while it is loading")
        pm = plugin_manager or pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        pm.check_pending()  # a caller's plugin manager must be sound before ours join it
        for name in blocked:
            # Entry points and distributions only: the built-ins are attnhub itself (its
            # pluggy name is an implementation detail; torch_reference serves what no
            # other backend can).
            if name != BUILTIN_PLUGIN:
                pm.set_blocked(name)
        self._loader = threading.get_ident()
        try:
            if self._load_plugin(pm, BUILTIN_PLUGIN, BUILTIN, _import_builtin_backends) and trace:
                log.warning(
                    "attnhub: loaded built-in backends from %s",
                    getattr(pm.get_plugin(BUILTIN_PLUGIN), "__file__", "?"),
                )
            if no_autoload:
                if trace:
                    log.warning(
                        "attnhub: %s is set; skipping entry points", env.DISABLE_PLUGIN_AUTOLOAD
                    )
                return
            unmatched = set(blocked)
            for ep in _entry_points():
                dist = ep.dist.name if ep.dist is not None else "unknown distribution"
                unmatched -= {ep.name, dist}
                if pm.is_blocked(ep.name) or pm.is_blocked(dist):
                    self.skipped.append(
                        PluginSkip(ep.name, dist, f"blocked by {env.DISABLE_PLUGINS}")
                    )
                    if trace:
                        log.warning("attnhub: skipped plugin %s (%s): blocked", ep.name, dist)
                    continue
                if self._load_plugin(pm, ep.name, dist, ep.load) and trace:
                    log.warning("attnhub: loaded plugin %s = %s from %s", ep.name, ep.value, dist)
            if unmatched:  # a typo would otherwise block nothing, silently
                log.warning(
                    "attnhub: %s names no installed plugin entry point or distribution: %s",
                    env.DISABLE_PLUGINS, ", ".join(sorted(unmatched)),
                )  # fmt: skip
        finally:
            self._loader = None

    def _load_plugin(
        self, pm: pluggy.PluginManager, plugin_name: str, distribution: str, load: Callable[[], Any]
    ) -> bool:
        """Import one plugin, register it with pluggy and run its hook; True if it loaded.

        One transaction: if any step fails, the plugin is unregistered from pluggy,
        the registry is restored to what it was before the import (so a plugin that
        removed a built-in and then raised leaves it in place), and the failure is
        recorded.
        """
        registered: list[Any] = []
        with self._transaction(plugin_name, distribution, pm, registered):
            plugin = load()
            if pm.register(plugin, name=plugin_name) is None:  # blocked in the caller's manager
                self.skipped.append(PluginSkip(plugin_name, distribution, "blocked"))
                return False
            registered.append(plugin)
            _check_hooks(pm, plugin, plugin_name)
            arguments = {"registry": self}
            for impl in _own_impls(pm, plugin):
                impl.function(*[arguments[name] for name in impl.argnames])
            return True
        return False

    @contextlib.contextmanager
    def _transaction(
        self, plugin_name: str, distribution: str, pm: pluggy.PluginManager, registered: list[Any]
    ) -> Iterator[None]:
        with self._lock:
            saved = (dict(self._backends), dict(self._origins), dict(self._unavailable))
            self._current_plugin, self._current_origin = plugin_name, distribution
        try:
            yield
        except BaseException as exc:
            self._restore(*saved)
            for plugin in registered:
                pm.unregister(plugin)
            # SystemExit too: a plugin calling sys.exit() must not end the process.
            if not isinstance(exc, (Exception, SystemExit)):
                raise
            self.failures.append(
                PluginFailure(plugin_name, distribution, f"{type(exc).__name__}: {exc}")
            )
            log.warning("attnhub plugin %s (%s) failed: %s", plugin_name, distribution, exc)
        finally:
            with self._lock:
                self._current_plugin, self._current_origin = RUN_TIME, RUN_TIME

    def _restore(
        self,
        backends: dict[str, Backend],
        origins: dict[str, str],
        unavailable: dict[str, str | None],
    ) -> None:
        with self._lock:
            self._backends, self._origins, self._unavailable = backends, origins, unavailable
        invalidate_caches()


def _probe(backend: Backend) -> str | None:
    """A backend's own ``unavailable_reason()``, contained: never raises."""
    try:
        why = backend.unavailable_reason()
    except Exception as exc:
        return f"availability probe raised {type(exc).__name__}: {exc}"
    if why is None or isinstance(why, str):
        return why or None  # "" is no reason
    return f"unavailable_reason returned {why!r}, not a str or None"


def _own_impls(pm: pluggy.PluginManager, plugin: Any) -> list[Any]:
    """The hook implementations of one plugin (called per plugin, not through
    ``pm.hook``, so that a failure is attributed to its plugin and stops no other)."""
    hook = pm.hook.attnhub_register_backends
    return [impl for impl in hook.get_hookimpls() if impl.plugin is plugin]


def _check_hooks(pm: pluggy.PluginManager, plugin: Any, plugin_name: str) -> None:
    """pluggy's own checks, then ours: a plugin must implement a known hook, plainly.

    ``check_pending`` reports an ``@hookimpl`` whose name matches no hook (a typo such
    as ``attnhub_register_backend``), which pluggy otherwise ignores; plugins before
    this one passed it or were unregistered, so what it finds is this plugin's.
    """
    known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("attnhub_")))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise pluggy.PluginValidationError(plugin, f"{exc} (attnhub's hooks: {known})") from None
    impls = _own_impls(pm, plugin)
    if not impls:
        raise pluggy.PluginValidationError(
            plugin,
            f"plugin {plugin_name} implements no attnhub hook: define {known} and decorate "
            "it with @attnhub.hookimpl",
        )
    if any(impl.hookwrapper or getattr(impl, "wrapper", False) for impl in impls):
        raise pluggy.PluginValidationError(
            plugin, f"plugin {plugin_name}: attnhub_register_backends cannot be a hook wrapper"
        )


def _entry_points() -> list[Any]:
    # Sorted: the order plugins load in must not depend on install order.
    return sorted(
        metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value)
    )


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


# -- the process-wide registry ----------------------------------------------------------


@dataclass(frozen=True)
class _Loading:
    """A process-wide registry being loaded: by which thread, and which threads ran then."""

    registry: BackendRegistry
    thread: int
    threads_before: frozenset[int | None]


_registry: BackendRegistry | None = None
_loading: _Loading | None = None
_loaded = threading.Condition()


def get_registry() -> BackendRegistry:
    """The process-wide registry, loaded on first use.

    While it loads, plugin code that asks for it (at import, in its hook, or from a
    thread it started) gets the registry as loaded so far: the built-ins and the
    plugins before it. Waiting would deadlock on a load that waits for that very call.
    Any other thread waits for the load to finish (up to :data:`LOAD_WAIT_S`).
    """
    registry = _registry
    if registry is not None:
        return registry
    return _load_process_registry()


def _load_process_registry() -> BackendRegistry:
    global _registry, _loading
    # Before any backend can run: see mkl_vml (a race in MKL's first parallel call).
    # Ahead of the loading state, so that nothing here can leave a load half begun.
    mkl_vml.resolve_dispatch()
    me = threading.get_ident()
    with _loaded:
        deadline = time.monotonic() + LOAD_WAIT_S
        while _registry is None and _loading is not None:
            loading = _loading
            if me == loading.thread or me not in loading.threads_before:
                return loading.registry  # plugin code asking while it loads
            if not _loaded.wait(timeout=max(0.0, deadline - time.monotonic())):
                log.warning(
                    "attnhub: the backend registry is still loading after %.0f s (now in "
                    "plugin %s); going on with the backends registered so far",
                    LOAD_WAIT_S,
                    loading.registry._current_plugin,
                )
                return loading.registry
        if _registry is not None:
            return _registry
        registry = BackendRegistry()
        _loading = _Loading(registry, me, frozenset(t.ident for t in threading.enumerate()))
    loaded = False
    try:
        registry.load()
        loaded = True
    finally:
        # Published only if load() returned: it raises only for a bad environment
        # variable, before registering anything, and then the next call tries again.
        with _loaded:
            _loading = None
            if loaded:
                _registry = registry
            _loaded.notify_all()
    invalidate_caches()
    return registry


def reload_registry() -> BackendRegistry:
    """Forget the registry and every cached decision, then load again.

    ``RuntimeError`` when called by plugin code while the registry loads (it would
    load for ever).
    """
    global _registry
    with _loaded:
        if _loading is not None and _loading.thread == threading.get_ident():
            raise RuntimeError(
                "attnhub.registry.reload_registry() called while the registry is loading "
                f"(from plugin {_loading.registry._current_plugin})"
            )
        _registry = None
    invalidate_caches()
    return get_registry()
