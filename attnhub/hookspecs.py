"""pluggy hook specifications: the whole plugin surface of attnhub.

Plugins (the built-in backends included) implement these with
``attnhub.hookimpl`` and are found through the ``attnhub`` entry-point group::

    [project.entry-points.attnhub]
    my_kernels = "my_package.attnhub_plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .registry import BackendRegistry

PROJECT = "attnhub"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def attnhub_register_backends(registry: BackendRegistry) -> None:
    """Add backends with ``registry.add(MyBackend())``. Called once, at first use.

    Raise freely: a plugin that raises is reported by ``attnhub info`` with its
    distribution and the exception text, everything it changed in the registry is
    rolled back (backends it added or removed), and the other plugins still load.

    attnhub may be called from here (``attnhub.list_backends()``, ``get_registry()``,
    even ``attnhub.attention``, also from a thread this hook starts and waits for): it
    answers with the registry as loaded so far, which is ``registry``. Only
    ``attnhub.registry.reload_registry()`` is refused (``RuntimeError``: the plugin
    fails), since it would load for ever.

    pluggy's own checks apply: an ``@hookimpl`` whose name is not a hook of this module
    (a typo) and a plugin that implements no hook at all are reported as failures.
    """
