"""Compile the triton_flash kernels for a GPU target on a machine without a GPU.

The interpreter proves tile arithmetic, not that a kernel compiles for sm_90 (it
accepted a ``x: tl.constexpr = ...`` global that the compiler rejects). This module
runs the ops on CPU tensors with kernel launches recorded instead of executed, then
compiles every recorded launch with Triton's ahead-of-time path (``triton.compile``
with a ``GPUTarget``; ptxas ships with Triton) and reports shared memory per kernel
against the H100/H200 limit.

    python -m attnhub.backends.triton_flash.aot_check [--quick] [--capability 90]

Run it without ``TRITON_INTERPRET`` in the environment (it removes it itself, so run
it in a fresh process). Exit status 1 when any variant fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

# Kernel modules decide between interpreter and compiler when imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import ops

SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)
_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int64: "i64",
    torch.int32: "i32",  # triton_blocksparse's block lists
}


class _Recorder:
    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.kernel, args, kwargs))

        return launch


def record(cases: list[tuple[torch.dtype, int, dict]]) -> list:
    """Run forward+backward for each (dtype, head dim, options) on CPU, recording launches."""
    launches: list = []
    original = ops._launcher
    ops._launcher = lambda kernel, like: _Recorder(kernel, launches)  # type: ignore[assignment]
    try:
        for dtype, d, options in cases:
            options = dict(options)
            q = torch.randn(1, 2, 40, d, dtype=dtype, requires_grad=True)
            k = torch.randn(1, 1, 50, d, dtype=dtype, requires_grad=True)
            mask = options.pop("mask", None)
            if mask == "float":
                mask = torch.randn(40, 50, dtype=dtype)
            elif mask == "bool":
                mask = torch.rand(1, 1, 40, 50) > 0.5
            out, _ = ops.flash_attention(q, k, k, mask, **options)
            out.sum().backward()
    finally:
        ops._launcher = original
    return launches


def compile_launch(kernel: Any, args: tuple, kwargs: dict, capability: int) -> Any:
    """Compile one recorded launch, specializing as Triton's JIT would (ints equal to 1
    become constants unless marked do_not_specialize)."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, param in enumerate(kernel.params):
        value = kwargs[param.name] if param.name in kwargs else args[i]
        # The JIT marks 16-byte aligned pointers and ints divisible by 16; without the
        # hint Triton does not pipeline loads, and shared memory would be understated.
        aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
            isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0
            and not param.do_not_specialize and not param.is_constexpr
        )  # fmt: skip
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
        if param.is_constexpr or (
            isinstance(value, int) and not isinstance(value, bool) and value == 1
            and not param.do_not_specialize
        ):  # fmt: skip
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{param.name}={value!r}")
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 64), options=options)


def variants(quick: bool) -> list[tuple[torch.dtype, int, dict]]:
    full = {"causal": True, "bottom_right": True, "window": (30, None), "softcap": 5.0,
            "mask": "float", "dropout_p": 0.1}  # fmt: skip
    if quick:
        return [(torch.bfloat16, 128, {"causal": True}), (torch.float32, 40, full)]
    cases: list[tuple[torch.dtype, int, dict]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128, 256, 96):
            cases += [(dtype, d, {}), (dtype, d, {"causal": True})]
        cases += [(dtype, 40, full), (dtype, 128, {"mask": "bool", "window": (3, 4)})]
    return cases


def compile_all(launches: list, capability: int) -> int:  # type: ignore[type-arg]
    """Compile each distinct recorded launch for ``sm_<capability>``; print shared
    memory per kernel; return the number of failures (errors or over the limit)."""
    seen, failures, start = set(), 0, time.time()
    for kernel, kargs, kwargs in launches:
        key = (kernel.fn.__name__, str([_TYPES.get(getattr(a, "dtype", None), a == 1) for a in kargs]),
               str(sorted(kwargs.items())))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        name = f"{kernel.fn.__name__} {_TYPES[kargs[0].dtype]} {kwargs}"
        try:
            shared = compile_launch(kernel, kargs, kwargs, capability).metadata.shared
        except Exception as exc:
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            continue
        over = shared > SHARED_LIMIT
        failures += over
        print(f"{'FAIL' if over else 'ok'} {name} shared={shared}", flush=True)
    print(f"{len(seen)} launches compiled for sm_{capability} in {time.time() - start:.0f} s, "
          f"{failures} failures")  # fmt: skip
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two variants (for CI)")
    parser.add_argument("--capability", type=int, default=90)
    args = parser.parse_args(argv)
    return 1 if compile_all(record(variants(args.quick)), args.capability) else 0


if __name__ == "__main__":
    sys.exit(main())
