"""The ``attnhub`` command line: ``info``, ``explain`` (and more subcommands as they land).

Each subcommand is a function taking the parsed arguments and returning an exit code,
registered in ``_COMMANDS``; ``main`` builds the parser from that table.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Callable, Sequence

import torch

from .registry import get_registry


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


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


def cmd_info(args: argparse.Namespace) -> int:
    """Every backend: origin, availability here, declared capabilities; plugin failures."""
    from . import __version__

    registry = get_registry()
    print(f"attnhub {__version__}: {_environment()}\n")
    rows = [["backend", "origin", "priority", "available here"]]
    for backend in registry.backends():
        why = registry.unavailable_reason(backend.name)
        rows.append(
            [backend.name, registry.origin(backend.name), str(backend.priority),
             "yes" if why is None else f"no: {why}"]
        )  # fmt: skip
    print(_table(rows))
    columns = ["devices", "dtypes", "head dim", "masks", "causal", "features", "backward", "memory", "layouts"]  # fmt: skip
    rows = [["backend", *columns]]
    for backend in registry.backends():
        caps = backend.capabilities()
        rows.append([backend.name, *(caps[c] for c in columns)])
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
    return values


def cmd_explain(args: argparse.Namespace) -> int:
    """Explain the choice for a described call, built from meta tensors (no memory used)."""
    from .api import explain

    b, h, n, d = args.shape
    nk = args.kv_len if args.kv_len is not None else n
    hkv = args.kv_heads if args.kv_heads is not None else h
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        print(f"attnhub explain: unknown dtype {args.dtype!r}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("attnhub explain: --device cuda but CUDA is not available here", file=sys.stderr)
        return 2
    # Uninitialized tensors of the described shapes: explain reads only metadata.
    q = torch.empty(b, h, n, d, dtype=dtype, device=device).requires_grad_(args.backward)
    k = torch.empty(b, hkv, nk, d, dtype=dtype, device=device)
    v = torch.empty(b, hkv, nk, d, dtype=dtype, device=device)
    window = None
    if args.window is not None:
        left, right = (int(x) for x in args.window.split(","))
        window = (left, right)
    decision = explain(
        q, k, v,
        causal=args.causal,
        alignment=args.alignment,
        window=window,
        softcap=args.softcap,
        dropout_p=args.dropout,
        return_lse=args.lse,
        backend=args.backend.split(",") if args.backend else None,
    )  # fmt: skip
    print(decision)
    return 0 if decision.chosen else 1


def _add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=_parse_shape, required=True, help="query shape B,H,N,D")
    parser.add_argument("--kv-len", type=int, help="key/value length Nk (default: N)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads Hkv (default: H)")
    parser.add_argument("--dtype", default="float16", help="float16, bfloat16, float32, float64")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--alignment", default="top_left", choices=["top_left", "bottom_right"])
    parser.add_argument("--window", help="LEFT,RIGHT")
    parser.add_argument("--softcap", type=float)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lse", action="store_true", help="return_lse=True")
    parser.add_argument("--backward", action="store_true", help="inputs require grad")
    parser.add_argument("--backend", help="restrict to these backends, comma-separated")


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
