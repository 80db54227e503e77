"""Exceptions raised by attnhub.

Bad input is a plain ``ValueError`` or ``TypeError`` naming the argument; these
classes are for what only attnhub can say: no backend can serve a call, or a
third-party backend broke the contract at one.
"""

from __future__ import annotations

from collections.abc import Sequence


def error_line(exc: BaseException) -> str:
    """``exc`` in one line: its type and its message's first line (a backend that failed
    while timed, a competitor that raised)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class NoBackendError(RuntimeError):
    """No registered backend can serve a call, or the backend asked for cannot.

    The message holds the call's signature and one line per backend with the
    reasons it was not eligible. ``signature`` and ``reasons`` carry the same
    information as data.
    """

    def __init__(self, headline: str, signature: str, reasons: Sequence[tuple[str, Sequence[str]]]):
        self.signature = signature
        self.reasons = {name: list(why) for name, why in reasons}
        width = max((len(name) for name, _ in reasons), default=0)
        lines = [f"{headline}", f"  call: {signature}"]
        for name, why in reasons:
            lines.append(f"  {name:<{width}}  {'; '.join(why) if why else 'eligible'}")
        super().__init__("\n".join(lines))


class BrokenBackendError(RuntimeError):
    """A backend's forward broke the contract at a call (:mod:`attnhub.output_check`).

    ``backend``: its name; ``inputs_intact``: False where it changed its inputs in
    place (the call cannot be served again from them).
    """

    def __init__(self, backend: str, why: str, inputs_intact: bool) -> None:
        self.backend = backend
        self.inputs_intact = inputs_intact
        super().__init__(f"backend {backend!r} {why}; it is disabled for this process")
