"""Compile the triton_flash kernels for a GPU target on a machine without a GPU.

The interpreter proves tile arithmetic, not that a kernel compiles for sm_90 (it
accepted a ``x: tl.constexpr = ...`` global that the compiler rejects). This module
runs the ops on CPU tensors with kernel launches recorded instead of executed, then
compiles every recorded launch with Triton's ahead-of-time path (``triton.compile``
with a ``GPUTarget``; ptxas ships with Triton) and reports shared memory per kernel
against the H100/H200 limit.

    python -m attnhub.backends.triton_flash.aot_check [--quick] [--capability 90]

One launch as a GPU test makes it, with launch configurations forced (``configs.OVERRIDE``),
compile time, registers and spills per kernel (the fp32 D=256 rows were sized this way):

    python -m attnhub.backends.triton_flash.aot_check --dtype fp32 --head-dim 256 \
        --shape 1,16,16,2049,1000 --causal --bottom-right --config bwd_kv=16,32,8,1 \
        --kernel bwd --registers

Run it without ``TRITON_INTERPRET`` in the environment (it removes it itself, so run
it in a fresh process). Exit status 1 when any variant fails.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

# Kernel modules decide between interpreter and compiler when imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import configs, ops

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
    """Run forward+backward for each (dtype, head dim, options) on CPU, recording launches.

    ``options`` may hold ``shape``: (B, Hq, Hkv, Nq, Nk), default (1, 2, 1, 40, 50); the
    shape decides the JIT's specialization (ints equal to 1, multiples of 16), so a GPU
    test's launch is reproduced exactly by passing its shape. The backward gets a
    contiguous grad_out, as in training and in the conformance tests."""
    launches: list = []
    original = ops._launcher
    ops._launcher = lambda kernel, like: _Recorder(kernel, launches)  # type: ignore[assignment]
    try:
        for dtype, d, options in cases:
            options = dict(options)
            b, hq, hkv, nq, nk = options.pop("shape", (1, 2, 1, 40, 50))
            q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hkv, nk, d, dtype=dtype, requires_grad=True)
            mask = options.pop("mask", None)
            if mask == "float":
                mask = torch.randn(nq, nk, dtype=dtype)
            elif mask == "bool":
                mask = torch.rand(1, 1, nq, nk) > 0.5
            out, _ = ops.flash_attention(q, k, k, mask, **options)
            out.backward(torch.randn_like(out))
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


def ptxas_usage(ptx: str, capability: int) -> str:
    """Registers and spills of compiled PTX, from ``ptxas -v`` (the ptxas Triton ships;
    the AOT metadata lacks them: the driver reports them only on load)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}",
             src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True, text=True, check=False,
        ).stderr  # fmt: skip
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    if not (regs and spills):
        return "registers=?"
    return f"registers={regs.group(1)} stack={spills.group(1)} spill_stores={spills.group(2)}"


def compile_all(
    launches: list,
    capability: int,
    *,
    kernel_filter: str | None = None,
    registers: bool = False,
) -> int:
    """Compile each distinct recorded launch for ``sm_<capability>``; print shared
    memory and compile time per kernel (and registers/spills with ``registers``);
    return the number of failures (errors or over the limit). ``kernel_filter``: only
    kernels whose name contains it."""
    seen, failures, start = set(), 0, time.time()
    for kernel, kargs, kwargs in launches:
        if kernel_filter is not None and kernel_filter not in kernel.fn.__name__:
            continue
        key = (kernel.fn.__name__, str([_TYPES.get(getattr(a, "dtype", None), a == 1) for a in kargs]),
               str(sorted(kwargs.items())))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        name = f"{kernel.fn.__name__} {_TYPES[kargs[0].dtype]} {kwargs}"
        began = time.time()
        try:
            compiled = compile_launch(kernel, kargs, kwargs, capability)
        except Exception as exc:
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
            continue
        took = time.time() - began
        shared = compiled.metadata.shared
        usage = f" {ptxas_usage(compiled.asm['ptx'], capability)}" if registers else ""
        over = shared > SHARED_LIMIT
        failures += over
        print(f"{'FAIL' if over else 'ok'} {name} shared={shared}{usage} compile={took:.1f}s",
              flush=True)  # fmt: skip
    print(f"{len(seen)} launches compiled for sm_{capability} in {time.time() - start:.0f} s, "
          f"{failures} failures")  # fmt: skip
    return failures


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_KERNELS = {"fwd": "attn_fwd_kernel", "bwd": "attn_bwd_d", "bwd_kv": "attn_bwd_dkdv_kernel",
            "bwd_q": "attn_bwd_dq_kernel", "pre": "attn_bwd_preprocess_kernel"}  # fmt: skip


def _config(text: str) -> tuple[str, configs.LaunchConfig]:
    direction, _, values = text.partition("=")
    if direction not in ("fwd", "bwd_kv", "bwd_q"):
        raise argparse.ArgumentTypeError(f"{direction!r}: not one of fwd, bwd_kv, bwd_q")
    return direction, configs.LaunchConfig(*(int(v) for v in values.split(",")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two variants (for CI)")
    parser.add_argument("--capability", type=int, default=90)
    one = parser.add_argument_group("one case instead of the variants (given --dtype)")
    one.add_argument("--dtype", choices=sorted(_DTYPES))
    one.add_argument("--head-dim", type=int, default=128)
    one.add_argument("--shape", default="1,2,1,40,50", help="B,Hq,Hkv,Nq,Nk (default %(default)s)")
    one.add_argument("--causal", action="store_true")
    one.add_argument("--bottom-right", action="store_true")
    one.add_argument("--window", help="LEFT,RIGHT (empty side: unbounded)")
    parser.add_argument(
        "--config", type=_config, action="append", default=[],
        help="force a launch config: fwd|bwd_kv|bwd_q=BLOCK_M,BLOCK_N,WARPS,STAGES (repeatable)",
    )  # fmt: skip
    parser.add_argument("--kernel", choices=sorted(_KERNELS), help="compile only these kernels")
    parser.add_argument(
        "--registers", action="store_true",
        help="also report registers and spills (runs ptxas -v once more per kernel)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.dtype is None:
        cases = variants(args.quick)
    else:
        options: dict = {"shape": tuple(int(v) for v in args.shape.split(","))}
        if args.causal:
            options["causal"] = True
        if args.bottom_right:
            options["bottom_right"] = True
        if args.window:
            options["window"] = tuple(int(v) if v else None for v in args.window.split(","))
        cases = [(_DTYPES[args.dtype], args.head_dim, options)]
    configs.OVERRIDE.update(dict(args.config))
    try:
        launches = record(cases)
    finally:
        for direction, _ in args.config:
            configs.OVERRIDE.pop(direction, None)
    kernel_filter = _KERNELS[args.kernel] if args.kernel else None
    failures = compile_all(launches, args.capability, kernel_filter=kernel_filter,
                           registers=args.registers)  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
