"""Turning what a backend raises into a line of the kit's report.

The kit runs code it does not trust. Whatever a backend raises (in ``extra_reasons``,
``prepare``, ``forward`` or the backward; any exception type, ``SystemExit`` and
pytest's own outcomes included) is a failure of the case that ran it, reported with the
exception's type, its message and where it was raised, and the run goes on to the next
case. Only ``KeyboardInterrupt`` passes through: it is the person at the keyboard
stopping the run, not the backend failing.
"""

from __future__ import annotations

import os
import re
import traceback

import torch

from attnhub.errors import NoBackendError

# Frames inside PyTorch say less about where a backend went wrong than the backend's
# own line that called into PyTorch; the location reported skips them.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def passes_through(exc: BaseException) -> bool:
    """True for the exceptions the kit must not swallow (``KeyboardInterrupt``)."""
    return isinstance(exc, KeyboardInterrupt)


def _location(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    own = [f for f in frames if not f.filename.startswith(_TORCH_DIR)]
    frame = (own or frames)[-1]
    return f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"


def _refusal(exc: NoBackendError, backend: str) -> str:
    """Dispatch's refusal of ``backend``, without the table of every other backend: the
    headline and the backend's own reasons (where dispatch disabled a backend whose
    ``prepare`` or ``extra_reasons`` raised, they quote that exception)."""
    headline = str(exc).splitlines()[0]
    reasons: list[str] = getattr(exc, "reasons", {}).get(backend) or []
    return f"NoBackendError: {headline}; {backend}: " + ("; ".join(reasons) or "eligible")


def _traced(exc: BaseException, backend: str | None) -> str | None:
    """What a Dynamo error says in one line (None: ``exc`` is not one). Dynamo re-raises
    what traced code raised wrapped in an error of its own, with pages of hints: that
    original is reported. Its own errors (a graph break, a data-dependent guard) are
    reported by their first line and the innermost traced frame outside PyTorch."""
    if not type(exc).__module__.startswith("torch._dynamo"):
        return None
    cause = exc.__cause__ or exc.__context__
    if cause is not None and not type(cause).__module__.startswith("torch"):
        return describe_exception(cause, backend)
    text = str(exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    said = next(iter(str(cause).splitlines()), "") if cause is not None else ""
    if said and said not in first:  # e.g. "raised exception RuntimeError('boom')"
        first += f": {said}"
    frames = [
        (path, line, name)
        for path, line, name in _TRACED_FRAME.findall(text.split("from user code:")[-1])
        if not path.startswith(_TORCH_DIR)
    ]
    where = ""
    if frames:
        path, line, name = frames[-1]
        where = f" (traced at {os.path.basename(path)}:{line} in {name})"
    return f"{type(exc).__name__}: {first}{where}"


# A frame of the traced code as Dynamo's messages list them.
_TRACED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def describe_exception(exc: BaseException, backend: str | None = None) -> str:
    """``"RuntimeError: boom (at my_backend.py:42 in forward)"``: type, message, and the
    innermost frame outside PyTorch. Never raises, even when ``str(exc)`` does.

    A :class:`attnhub.NoBackendError` refusing ``backend`` (the backend under test) is
    shortened to its headline and that backend's reasons; an error of Dynamo's
    (``torch.compile``) to one line, or to the exception it wraps.
    """
    try:
        if (traced := _traced(exc, backend)) is not None:
            return traced
        if backend is not None and isinstance(exc, NoBackendError):
            return _refusal(exc, backend)
        message = str(exc)
    except Exception as inner:
        message = f"<str() of the exception raised {type(inner).__name__}>"
    text = f"{type(exc).__name__}: {message}" if message else f"{type(exc).__name__} (no message)"
    return text + _location(exc)
