"""attnhub's built-in backends, shipped inside the wheel as ``attnhub.backends``.

They register through the same ``attnhub_register_backends`` hook as any third-party
plugin; this module is the plugin. Importing it is cheap: backends import their
optional libraries (Triton, xformers) only when probed or first run.
"""

from __future__ import annotations

from attnhub.hookspecs import hookimpl
from attnhub.registry import BackendRegistry

from .torch_reference import TorchReference
from .torch_sdpa import PINNED, TorchSDPA
from .torch_varlen import TorchVarlen
from .triton_blocksparse import TritonBlockSparse
from .triton_flash import TritonFlash
from .xformers_backend import XFormers


@hookimpl
def attnhub_register_backends(registry: BackendRegistry) -> None:
    for backend in (
        TorchReference, TorchSDPA, *PINNED, TorchVarlen, XFormers, TritonFlash, TritonBlockSparse,
    ):  # fmt: skip
        registry.add(backend())
