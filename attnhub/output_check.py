"""What a third-party backend's runner hands back, checked before the caller sees it.

The built-in backends are held to the contract by the conformance suite, on every
commit; a plugin's forward is not (plugins.md: its author runs the kit, or not). So
the runners of backends from outside attnhub are wrapped: each call's result must be
what the contract promises for the call, judged from metadata alone (no device
synchronization): a tensor (B, Hq, Nq, Dv) in the query's dtype on its device, and
with ``return_lse`` also a float32 (B, Hq, Nq) lse; and the call must leave its
inputs as they were (their version counters, which every in-place change bumps).

A backend that breaks this is disabled for the process (``attnhub info`` and
``explain()`` show why) and :class:`BrokenBackendError` is raised: :func:`attnhub.attention`,
:func:`attnhub.attention_varlen` and :func:`attnhub.attention_kvcache` then serve the
call again without it, and the patched ``F.scaled_dot_product_attention`` hands it to
PyTorch's own function, so a broken plugin breaks nothing but itself. Where the inputs were changed in place no answer
can be trusted, and the error reaches the caller. Checking costs 1-2 microseconds of
host time per call (docs/plugins.md), paid by third-party backends only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .backend import Runner
from .errors import BrokenBackendError

__all__ = ["call_checked", "checked", "unchecked"]

_UNCHECKED = contextvars.ContextVar("attnhub_output_unchecked", default=False)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Runners hand back what the backend returned, unchecked, inside the block: for the
    conformance kit (:mod:`attnhub.testing`), which judges a backend's results itself and
    reports them in its own terms, without disabling the backend."""
    token = _UNCHECKED.set(True)
    try:
        yield
    finally:
        _UNCHECKED.reset(token)


def checked(
    runner: Runner, backend: str, return_lse: bool, disable: Callable[[str, str], None]
) -> Runner:
    """``runner`` with each call's result and inputs checked (see :func:`call_checked`)."""

    def run(query: Any, key: Any, value: Any, attn_mask: Any) -> Any:
        tensors = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
        return call_checked(
            backend, lambda: runner(query, key, value, attn_mask), tensors, query, value,
            return_lse, disable,
        )  # fmt: skip

    return run


def call_checked(
    backend: str,
    call: Callable[[], Any],
    tensors: Sequence[Any],
    query: torch.Tensor,
    value: torch.Tensor,
    return_lse: bool,
    disable: Callable[[str, str], None],
) -> Any:
    """``call()``, a backend's forward of any layout, with its result checked: the
    output shaped like ``query`` but for its last dim, ``value``'s (dense (B, Hq, Nq, Dv),
    packed (Tq, Hq, Dv)), in the query's dtype on its device; with ``return_lse`` also a
    float32 lse shaped like ``query`` without its last dim; ``tensors`` (its inputs,
    caches included; None entries skipped) unchanged. On a breach ``disable(backend,
    reason)`` and :class:`BrokenBackendError`."""
    if _UNCHECKED.get():
        return call()
    inputs = [t for t in tensors if t is not None]
    before = _versions(inputs)
    result = call()
    why = _result_problem(result, query, value, return_lse)
    intact = _versions(inputs) == before
    if why is None and not intact:
        why = "changed its inputs in place"
    if why is not None:
        disable(backend, f"forward {why}")
        raise BrokenBackendError(backend, f"forward {why}", intact)
    return result


def _versions(tensors: Sequence[torch.Tensor]) -> Any:
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference tensor (torch.inference_mode) keeps no counter
        return [None if t.is_inference() else t._version for t in tensors]


def _result_problem(result: Any, query: Any, value: Any, return_lse: bool) -> str | None:
    """What is wrong with a forward's result for this call, or None."""
    rows = query.shape[:-1]
    if return_lse:
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            return f"returned {_shown(result)}, not (output, lse)"
        out, lse = result
    else:
        out, lse = result, None
    problem = _tensor_problem("output", out, rows + value.shape[-1:], query.dtype, query.device)
    if problem is None and lse is not None:
        problem = _tensor_problem("lse", lse, rows, torch.float32, query.device)
    return problem


def _tensor_problem(
    what: str, x: Any, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> str | None:
    if not isinstance(x, torch.Tensor):
        return f"returned {_shown(x)} as its {what}, not a tensor"
    if x.shape != shape:
        return f"returned an {what} of shape {tuple(x.shape)}, not {tuple(shape)}"
    if x.dtype != dtype:
        return f"returned a {x.dtype} {what}, not {dtype}"
    if x.device != device:
        return f"returned its {what} on {x.device}, not {device}"
    return None


def _shown(x: Any) -> str:
    return f"{type(x).__name__} {x!r:.80}" if not isinstance(x, torch.Tensor) else "a tensor"
