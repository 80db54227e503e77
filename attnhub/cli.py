"""The ``attnhub`` command line: ``info``, ``explain``, ``demo``, ``bench`` and ``tune``.

Each subcommand is a function taking the parsed arguments and returning an exit code,
registered in ``_COMMANDS``; ``main`` builds the parser from that table.

Option values are checked by argparse ``type=`` functions (this module's, shared by the
subcommands), so a value a command cannot use exits 2 with argparse's message naming
the option, never with a traceback: exit 1 keeps each command's own meaning.
"""

from __future__ import annotations

import argparse
import math
import platform
import reprlib
import sys
from collections.abc import Callable, Mapping, Sequence

import torch

from .backend import Backend
from .env import parse_list
from .errors import error_line
from .registry import get_registry


def _table(rows: Sequence[Sequence[str]]) -> str:
    """Rows as aligned columns, the first row's count of them. A shorter row is a note
    in place of values: its last cell runs on over the remaining columns (it does not
    widen them)."""
    n = len(rows[0])
    widths = [
        max(len(row[i]) for row in rows if i < len(row) - 1 or len(row) == n) for i in range(n)
    ]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


# Option types (argparse ``type=``): each raises ArgumentTypeError, which argparse
# reports as "argument --option: message", exiting 2.


def _integer(text: str, low: int) -> int:
    """``text`` as an integer >= ``low``."""
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (a count of rows, tokens, steps)."""
    return _integer(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a size the contract allows to be 0)."""
    return _integer(text, 0)


def positive_float(text: str) -> float:
    """A finite number > 0 (a time budget)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def usable_device(text: str) -> torch.device:
    """A device torch knows and can use here: CUDA only where it is available (an
    index below the device count), any other kind where a tensor of zero elements can
    be made on it (which allocates nothing)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}: expected one such as cpu, cuda or cuda:1"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: there are {torch.cuda.device_count()} CUDA devices here"
            )
    try:
        torch.empty(0, device=device)
    except Exception as exc:
        # The first sentence: PyTorch's "Could not run ..." goes on to list every
        # dispatch key (2,000 characters).
        reason = error_line(exc).split(". ")[0]
        raise argparse.ArgumentTypeError(f"device {text!r} cannot be used here: {reason}") from None
    return device


def _environment() -> str:
    parts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except Exception:
        parts.append("triton not installed")
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        parts.append(f"{name} (sm{major}{minor})")
    else:
        parts.append("no CUDA device")
    return ", ".join(parts)


# The capabilities() keys that info shows, in order.
_CAPABILITY_COLUMNS = (
    "devices", "dtypes", "head dim", "masks", "causal", "features", "backward", "memory",
    "layouts",
)  # fmt: skip


def _broken(what: str, exc: Exception) -> str:
    return f"broken: {what} raised {type(exc).__name__}: {exc}"


def _priority_cell(backend: Backend) -> str:
    """A backend's priority as text. Declarations are checked at registration, but a
    property can raise later: that is shown in its cell, not raised."""
    try:
        return str(backend.priority)
    except Exception as exc:
        return _broken("priority", exc)


def _capability_row(name: str, backend: Backend) -> list[str]:
    """``name`` and its declared capabilities, one cell a column; or, where the
    backend's own ``capabilities()`` raises or returns no mapping, ``name`` and why
    (a note running over the columns). A key it leaves out shows as ``?``."""
    try:
        caps = backend.capabilities()
    except Exception as exc:
        return [name, _broken("capabilities()", exc)]
    if not isinstance(caps, Mapping):
        return [name, f"broken: capabilities() returned {reprlib.repr(caps)}, not a dict of str"]
    return [name, *(str(caps.get(column, "?")) for column in _CAPABILITY_COLUMNS)]


def cmd_info(args: argparse.Namespace) -> int:
    """Every backend: origin, availability here, declared capabilities; plugin failures."""
    from . import __version__

    registry = get_registry()
    print(f"attnhub {__version__}: {_environment()}\n")
    # Backends by their registered name (what dispatch and ATTNHUB_BACKEND use). Each
    # cell that runs the backend's own code is contained (unavailable_reason by the
    # registry; priority, capabilities() here): one broken backend is shown broken, and
    # everything else is still printed; the exit code stays 0 (this is a report).
    backends = [(name, registry.get(name)) for name in registry.names()]
    rows = [["backend", "origin", "priority", "available here"]]
    for name, backend in backends:
        why = registry.unavailable_reason(name)
        rows.append(
            [name, registry.origin(name), _priority_cell(backend),
             "yes" if why is None else f"no: {why}"]
        )  # fmt: skip
    print(_table(rows))
    rows = [["backend", *_CAPABILITY_COLUMNS]]
    rows += [_capability_row(name, backend) for name, backend in backends]
    print("\ndeclared capabilities:")
    print(_table(rows))
    if registry.failures:
        print("\nplugins that failed to load:")
        for failure in registry.failures:
            print(f"  {failure.plugin} (distribution {failure.distribution}): {failure.error}")
    if registry.skipped:
        print("\nplugins skipped:")
        for skip in registry.skipped:
            print(f"  {skip.plugin} (distribution {skip.distribution}): {skip.why}")
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B,H,N,D integers, got {text!r}") from None
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"expected four integers B,H,N,D, got {text!r}")
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected B,H,N,D integers >= 0, got {text!r}")
    return values


def _parse_window(text: str) -> tuple[int, int]:
    """``LEFT,RIGHT``: how many keys before and after the query's diagonal it sees."""
    try:
        left, right = (int(v) for v in text.split(","))
        valid = left >= 0 and right >= 0
    except ValueError:  # not integers, or not two of them
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT integers >= 0, got {text!r}")
    return left, right


def _parse_dtype(text: str) -> torch.dtype:
    """A floating torch dtype by its name in torch (``float16``, ``half``, ...)."""
    dtype = getattr(torch, text, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise argparse.ArgumentTypeError(
            f"expected a floating dtype (float16, bfloat16, float32, float64), got {text!r}"
        )
    return dtype


def _parse_backends(text: str) -> tuple[str, ...]:
    """``a,b``: the grammar of ``ATTNHUB_BACKEND`` (its parser): blanks around a name and
    empty items ignored, a name given twice counts once; no names restricts nothing.
    Whether the names are registered is for explain() to say."""
    return parse_list("--backend", text)


def _described(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor with the metadata the decision reads of a described call's (shape,
    dtype, device, and a last stride of 1) that holds one row of D elements: the row,
    expanded over the other dimensions with stride 0. A call of any size is described
    without allocating it. (Meta tensors would allocate nothing, but their device,
    ``meta``, would change the decision.)"""
    *outer, d = shape
    return torch.empty(1, 1, 1, d, dtype=dtype, device=device).expand(*outer, d)


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain the choice for a described call (without allocating one of its size).

    Prints the decision for tensors of the described shapes, dtype and device; exit 0
    when a backend is chosen, 1 when none can serve the call, 2 when attention() would
    refuse it (``ValueError``/``TypeError``, e.g. head counts that do not divide, or an
    unknown backend name), with the message.
    """
    from .api import explain

    b, h, n, d = args.shape
    nk = args.kv_len if args.kv_len is not None else n
    hkv = args.kv_heads if args.kv_heads is not None else h
    q = _described((b, h, n, d), args.dtype, args.device).requires_grad_(args.backward)
    k = _described((b, hkv, nk, d), args.dtype, args.device)
    v = _described((b, hkv, nk, d), args.dtype, args.device)
    try:
        decision = explain(
            q, k, v,
            causal=args.causal,
            alignment=args.alignment,
            window=args.window,
            softcap=args.softcap,
            dropout_p=args.dropout,
            return_lse=args.lse,
            backend=args.backend or None,  # () names nothing: no restriction
        )  # fmt: skip
    except (ValueError, TypeError) as exc:  # what attention() raises for bad input
        print(f"attnhub explain: {exc}", file=sys.stderr)
        return 2
    print(decision)
    return 0 if decision.chosen else 1


def _add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=_parse_shape, required=True, help="query shape B,H,N,D")
    parser.add_argument("--kv-len", type=nonnegative_int, help="key/value length Nk (default: N)")
    parser.add_argument("--kv-heads", type=nonnegative_int, help="key/value heads Hkv (default: H)")  # fmt: skip
    parser.add_argument("--dtype", type=_parse_dtype, default="float16", help="float16, bfloat16, float32, float64")  # fmt: skip
    parser.add_argument(
        "--device",
        type=usable_device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda if available, else cpu",
    )
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alignment", default="top_left", choices=["top_left", "bottom_right"])
    parser.add_argument("--window", type=_parse_window, help="LEFT,RIGHT")
    parser.add_argument("--softcap", type=float)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lse", action="store_true", help="return_lse=True")
    parser.add_argument("--backward", action="store_true", help="inputs require grad")
    parser.add_argument(
        "--backend",
        type=_parse_backends,
        help="restrict to these backends, comma-separated (as ATTNHUB_BACKEND)",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """A small model stock and patched: which backend served each call, deviation, time."""
    from .demo import run

    return run(args)


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import add_arguments

    add_arguments(parser)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time backends side by side (JSON, plots, table); --report redraws from a JSON."""
    from .bench import main as bench_main

    return bench_main(args)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import add_arguments

    add_arguments(parser)


def cmd_tune(args: argparse.Namespace) -> int:
    """Measure this machine (or read bench results) into the cost table dispatch ranks by."""
    from .tune import main as tune_main

    return tune_main(args)


def _add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    from .tune import add_arguments

    add_arguments(parser)


_Command = tuple[
    Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None] | None
]
_COMMANDS: dict[str, _Command] = {
    "info": (cmd_info, None),
    "explain": (cmd_explain, _add_explain_arguments),
    "demo": (cmd_demo, _add_demo_arguments),
    "bench": (cmd_bench, _add_bench_arguments),
    "tune": (cmd_tune, _add_tune_arguments),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnhub", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (func, add_arguments) in _COMMANDS.items():
        command = sub.add_parser(name, help=(func.__doc__ or "").splitlines()[0])
        if add_arguments is not None:
            add_arguments(command)
    args = parser.parse_args(argv)
    return _COMMANDS[args.command][0](args)


if __name__ == "__main__":
    sys.exit(main())
