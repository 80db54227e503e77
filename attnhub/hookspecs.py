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
    distribution and the exception text, and the other plugins still load.
    """
