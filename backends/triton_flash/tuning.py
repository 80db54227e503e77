"""One scoped switch for tuning runs: force launch configurations, the backward's launch
mode or the row-stride specialization of both Triton kernel families, inside a block.

    from attnhub.backends.triton_flash import tuning

    with tuning.override(fwd=(128, 64, 8, 3), backward_launch="split"):
        out, lse = flash_attention(q, k, v)  # these tiles, two backward launches

Normal calls never enter one: the library's tables (configs.py) decide. The override is
a :class:`contextvars.ContextVar`, so it holds for the thread (or asyncio task) that
entered the block and ends with it, whatever happens inside; nothing is written to
``os.environ`` or to module globals, and other threads keep the tables. Overrides nest:
an inner block changes only the fields it names. A call's backward runs under the
override its forward ran under (:func:`restored`; the ops save it with the call), also
when autograd runs it on its CUDA device thread or after the block. Under
``torch.compile`` the override active when a graph is traced is baked into that graph
(as any Python-level choice is).

Who reads it: :func:`configs.launch_config` (``fwd``, ``bwd_kv``, ``bwd_q``; the
block-sparse ops take their tiles from it too), :func:`configs.backward_launch`
(``backward_launch``), ``ops._row_strides`` (``packed_row_strides``, both families) and
``ops._heavy_first`` (``heavy_first``, triton_flash's forward and dQ kernels).
The cached launch plans of ``ops`` are keyed by the active override, so a plan built
under one override is never reused under another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeAlias

    from .configs import LaunchConfig

    ConfigLike: TypeAlias = "LaunchConfig | tuple[int, ...]"

# The backward's launch modes (configs.backward_launch documents them).
BACKWARD_LAUNCHES = ("split", "merged", "merged_heads")
DIRECTIONS = ("fwd", "bwd_kv", "bwd_q")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """What an :func:`override` block forces; ``None`` / empty leaves the table's choice.

    ``configs``: (direction, LaunchConfig) pairs, direction one of ``DIRECTIONS``.
    ``backward_launch``: one of ``BACKWARD_LAUNCHES``. ``packed_row_strides``: False
    passes every streamed row stride at run time instead of as a constant where rows are
    packed (ops._row_strides); the outputs are bitwise the same either way.
    ``heavy_first``: True or False forces the order of the row-block programs of the
    forward and dQ kernels (ops._heavy_first; None: its rule); outputs are bitwise the
    same either way."""

    configs: tuple[tuple[str, LaunchConfig], ...] = ()
    backward_launch: str | None = None
    packed_row_strides: bool = True
    heavy_first: bool | None = None

    def config(self, direction: str) -> LaunchConfig | None:
        """The forced configuration for ``direction``, or None."""
        for name, config in self.configs:
            if name == direction:
                return config
        return None


_CURRENT: ContextVar[Tuning | None] = ContextVar("attnhub_triton_tuning", default=None)


def current() -> Tuning | None:
    """The active override, or None outside every :func:`override` block."""
    return _CURRENT.get()


@contextlib.contextmanager
def restored(saved: Tuning | None) -> Iterator[None]:
    """Inside the block, ``saved`` (what :func:`current` returned at a call's forward) is
    the active tuning. A backward runs under the tuning of its forward: autograd runs a
    CUDA backward on its own device thread, which sees none of the forward thread's
    context variables, and a backward may run after the forward's block has ended."""
    token = _CURRENT.set(saved)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _as_config(direction: str, value: ConfigLike) -> LaunchConfig:
    from .configs import LaunchConfig

    if isinstance(value, LaunchConfig):
        return value
    if isinstance(value, tuple) and 4 <= len(value) <= 5 and all(isinstance(v, int) for v in value):
        return LaunchConfig(*value)
    raise TypeError(
        f"tuning.override({direction}=...): expected a LaunchConfig or a tuple "
        f"(BLOCK_M, BLOCK_N, num_warps, num_stages[, maxnreg]) of ints, got {value!r}"
    )


@contextlib.contextmanager
def override(
    *,
    fwd: ConfigLike | None = None,
    bwd_kv: ConfigLike | None = None,
    bwd_q: ConfigLike | None = None,
    backward_launch: str | None = None,
    packed_row_strides: bool | None = None,
    heavy_first: bool | None = None,
) -> Iterator[Tuning]:
    """Inside the block, launches use the given configurations (per direction: the
    forward, the dK/dV role, the dQ role), backwards launch as ``backward_launch``
    (``"split"``, ``"merged"`` or ``"merged_heads"``; a merged mode is still split where
    the two roles' launch options differ, see configs.backward_launch) and, with
    ``packed_row_strides=False``, every row stride is a runtime argument; ``heavy_first``
    forces the row blocks' program order (True: the last row block first). Arguments left
    None keep the enclosing block's value (or the table's). The backward of a call made
    inside the block uses the block's tuning wherever it runs. Yields the active
    :class:`Tuning`. Bad values raise before the block runs."""
    if backward_launch is not None and backward_launch not in BACKWARD_LAUNCHES:
        raise ValueError(
            f"tuning.override(backward_launch={backward_launch!r}): expected one of "
            f"{', '.join(BACKWARD_LAUNCHES)}"
        )
    if packed_row_strides is not None and not isinstance(packed_row_strides, bool):
        raise TypeError(f"tuning.override(packed_row_strides=...): expected a bool, got {packed_row_strides!r}")  # fmt: skip
    if heavy_first is not None and not isinstance(heavy_first, bool):
        raise TypeError(f"tuning.override(heavy_first=...): expected a bool, got {heavy_first!r}")
    outer = _CURRENT.get() or Tuning()
    forced = dict(outer.configs)
    for direction, value in zip(DIRECTIONS, (fwd, bwd_kv, bwd_q)):
        if value is not None:
            forced[direction] = _as_config(direction, value)
    active = Tuning(
        configs=tuple(sorted(forced.items())),
        backward_launch=backward_launch if backward_launch is not None else outer.backward_launch,
        packed_row_strides=outer.packed_row_strides if packed_row_strides is None else packed_row_strides,
        heavy_first=outer.heavy_first if heavy_first is None else heavy_first,
    )  # fmt: skip
    token = _CURRENT.set(active)
    try:
        yield active
    finally:
        _CURRENT.reset(token)
