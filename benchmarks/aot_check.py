"""Compile the Triton kernels (triton_flash, triton_blocksparse) for a GPU target on a
machine without a GPU. A developer tool: it lives beside the benchmarks, outside the
installed package.

The interpreter proves tile arithmetic, not that a kernel compiles for sm_90 (it
accepted a ``x: tl.constexpr = ...`` global that the compiler rejects). This module
runs the ops on CPU tensors with kernel launches recorded instead of executed, then
compiles every recorded launch with Triton's ahead-of-time path (``triton.compile``
with a ``GPUTarget``; ptxas ships with Triton) and reports shared memory per kernel
against the H100/H200 limit.

    python benchmarks/aot_check.py [--quick] [--capability 90]
    python benchmarks/aot_check.py --blocksparse [--quick]   # triton_blocksparse's kernels
    python benchmarks/aot_check.py --mask-reading   # a mask's structure read (mask_reading)

One launch as a GPU test makes it, with launch configurations forced
(``tuning.override``), compile time, registers and spills per kernel (the fp32 D=256
rows were sized this way):

    python benchmarks/aot_check.py --dtype fp32 --head-dim 256 \
        --shape 1,16,16,2049,1000 --causal --bottom-right --config bwd_kv=16,32,8,1 \
        --kernel bwd --registers

The backward is recorded as the split pair (``attn_bwd_dkdv_kernel``,
``attn_bwd_dq_kernel``) and as the merged launch (``attn_bwd_kernel``) in both program
orders, whatever the table says (``--bwd`` picks one). Registers, spills
(also those inside loops) and shared memory of the merged kernel beside the two it
merges, bf16 D=64/128, causal and not, at the benchmark grid's shapes (B = 16384 / N,
H = 2048 / D) for N = 1024, 4096 and 16384, and with GQA 4:1 at N = 4096, with the
configurations of a call without attn_mask (the lean table where it has a row):

    python benchmarks/aot_check.py --bwd-table

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
from collections.abc import Iterator
from typing import Any

# Kernel modules decide between interpreter and compiler when imported.
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from attnhub.backends.triton_flash import configs, ops, tuning

SHARED_LIMIT = 232448  # bytes of shared memory per block on sm_90 (227 KiB)
_TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int64: "i64",
    torch.int32: "i32",  # triton_blocksparse's block lists
    torch.int8: "i8",  # mask_reading's keys kept
}


class _Recorder:
    def __init__(self, kernel: Any, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append((self.kernel, args, kwargs))

        return launch


BWD_RECORDED = configs.BWD_MODES  # the backward launch modes recorded by default


def record(
    cases: list[tuple[torch.dtype, int, dict]],
    bwd_modes: tuple[str, ...] = BWD_RECORDED,
    capability: int = 90,
) -> list:
    """Run forward+backward for each (dtype, head dim, options) on CPU, recording launches.

    ``options`` may hold ``bwd_kv`` and ``bwd_q``, LaunchConfigs forced for dK/dV and dQ
    (configs.GLUON_BWD's, which the table gives only calls of 4096 keys or more), and
    ``shape``: (B, Hq, Hkv, Nq, Nk), default (1, 2, 1, 40, 50); the shape decides the
    JIT's specialization (ints equal to 1, multiples of 16), so a GPU test's launch is
    reproduced exactly by passing its shape. The backward gets a
    contiguous grad_out, as in training and in the conformance tests. Each case runs
    once per backward launch mode in ``bwd_modes`` (``configs.BWD_MODES``; a mode that
    is not allowed for the case's configurations records the split launches again, and
    :func:`compile_all` compiles each distinct launch once). The ops see the CPU
    tensors' device as one of compute capability ``capability``, so that the launches
    are the ones that GPU would make (the TMA forward's included)."""
    launches: list = []
    original, original_capability = ops._launcher, ops._capability
    ops._launcher = lambda kernel, like: _Recorder(kernel, launches)  # type: ignore[assignment]
    ops._capability = lambda device: divmod(capability, 10)  # type: ignore[assignment]
    try:
        for (dtype, d, options), mode in ((c, m) for c in cases for m in bwd_modes):
            options = dict(options)
            b, hq, hkv, nq, nk = options.pop("shape", (1, 2, 1, 40, 50))
            q = torch.randn(b, hq, nq, d, dtype=dtype, requires_grad=True)
            k = torch.randn(b, hkv, nk, d, dtype=dtype, requires_grad=True)
            mask = options.pop("mask", None)
            if mask == "float":
                mask = torch.randn(nq, nk, dtype=dtype)
            elif mask == "bool":
                mask = torch.rand(1, 1, nq, nk) > 0.5
            forced = {role: options.pop(role, None) for role in ("bwd_kv", "bwd_q")}
            with tuning.override(backward_launch=mode, **forced):
                out, _ = ops.flash_attention(q, k, k, mask, **options)
                out.backward(torch.randn_like(out))
    finally:
        ops._launcher, ops._capability = original, original_capability
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
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    source_type = GluonASTSource if kernel.is_gluon() else ASTSource
    source = source_type(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 64), options=options)


def variants(quick: bool) -> list[tuple[torch.dtype, int, dict]]:
    full = {"causal": True, "bottom_right": True, "window": (30, None), "softcap": 5.0,
            "mask": "float", "dropout_p": 0.1}  # fmt: skip
    # Rows walk more keys than a narrow window (configs.NARROW_N): the causal D=128
    # forward then takes the TMA row (kernels_tma), with GQA; past configs.SHORT_N keys
    # the D=128 forward takes the Gluon row (kernels_gluon), bottom-right and ragged.
    tma = {"causal": True, "shape": (1, 4, 2, 400, 500)}
    gluon = {"causal": True, "bottom_right": True, "shape": (1, 2, 1, 1030, 1100)}
    # The Gluon backward kernels (kernels_gluon_bwd), forced: GQA, bottom-right, ragged
    # (Nq a multiple of 4: ops._gluon_bwd_eligible).
    gluon_bwd = {**gluon, "shape": (1, 4, 2, 1032, 1100), **configs.GLUON_BWD}
    gluon_bwd_256 = {**gluon_bwd, **configs.GLUON_BWD_256}
    if quick:
        return [(torch.bfloat16, 128, {"causal": True}), (torch.float32, 40, full),
                (torch.bfloat16, 128, tma), (torch.bfloat16, 128, gluon),
                (torch.bfloat16, 128, gluon_bwd), (torch.bfloat16, 256, gluon_bwd_256)]  # fmt: skip
    cases: list[tuple[torch.dtype, int, dict]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128, 256, 96):
            cases += [(dtype, d, {}), (dtype, d, {"causal": True})]
        cases += [(dtype, 40, full), (dtype, 128, {"mask": "bool", "window": (3, 4)}),
                  (dtype, 128, tma), (dtype, 128, gluon), (dtype, 128, gluon_bwd),
                  (dtype, 256, gluon_bwd_256),
                  (dtype, 128, {**gluon_bwd, "causal": False, "window": (300, 40)})]  # fmt: skip
    return cases


def ptxas_numbers(ptx: str, capability: int) -> tuple[int, int, int] | None:
    """(registers, stack frame bytes, spill store bytes) of compiled PTX, from
    ``ptxas -v`` (the ptxas Triton ships; the AOT metadata lacks them: the driver reports
    them only on load); None where ptxas printed neither."""
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
        return None
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def loop_spills(cubin: bytes) -> tuple[int, int] | None:
    """(STL, LDL): spill stores and loads inside the kernel's innermost loops (SASS from
    the cuobjdump Triton ships; a loop is a backward branch's range). ptxas's spill
    bytes count the whole kernel, where a spill around the prologue costs next to
    nothing; one in a loop costs on every tile. None where cuobjdump fails."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
        except (OSError, RuntimeError, subprocess.CalledProcessError):
            return None
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, op in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    inner = [(lo, hi) for lo, hi in loops
             if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)]  # fmt: skip

    def count(name: str) -> int:
        return sum(1 for a, op in code if re.search(rf"\b{name}\b", op)
                   and any(lo <= a <= hi for lo, hi in inner))  # fmt: skip

    return count("STL"), count("LDL")


def ptxas_usage(ptx: str, capability: int) -> str:
    """:func:`ptxas_numbers` as text."""
    numbers = ptxas_numbers(ptx, capability)
    if numbers is None:
        return "registers=?"
    return "registers={} stack={} spill_stores={}".format(*numbers)


def sass_text(cubin: bytes) -> str | None:
    """The kernel's SASS instructions, one a line, without addresses, encodings or
    comments (so that two compilations of the same code compare equal whatever their
    source line numbers); None where cuobjdump fails."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
        except (OSError, RuntimeError, subprocess.CalledProcessError):
            return None
    return "\n".join(op.strip() for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)) + "\n"


def write_sass(directory: str, name: str, cubin: bytes) -> None:
    """Write :func:`sass_text` of one launch to ``directory``, named by a hash of
    ``name`` (kernel, argument dtype and constexprs), with ``name`` on its first line."""
    import hashlib

    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha1(name.encode()).hexdigest()[:16]
    kernel = name.split()[0]
    with open(os.path.join(directory, f"{kernel}-{digest}.sass"), "w") as f:
        f.write(f"// {name}\n{sass_text(cubin) or '(cuobjdump failed)'}")


def _distinct(launches: list, kernel_filter: tuple[str, ...] | None = None) -> Iterator[tuple]:
    """The recorded launches that compile differently (kernel, argument types and
    specializations, constexprs and options), first occurrence each; ``kernel_filter``:
    only the kernels of these names."""
    seen = set()
    for kernel, kargs, kwargs in launches:
        if kernel_filter is not None and kernel.fn.__name__ not in kernel_filter:
            continue
        key = (kernel.fn.__name__, str([_TYPES.get(getattr(a, "dtype", None), a == 1) for a in kargs]),
               str(sorted(kwargs.items())))  # fmt: skip
        if key not in seen:
            seen.add(key)
            yield kernel, kargs, kwargs


def _try_compile(kernel: Any, kargs: tuple, kwargs: dict, capability: int, name: str) -> Any:
    """:func:`compile_launch`, or None after printing a FAIL line with the error."""
    try:
        return compile_launch(kernel, kargs, kwargs, capability)
    except Exception as exc:
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
        return None


def compile_all(
    launches: list,
    capability: int,
    *,
    kernel_filter: tuple[str, ...] | None = None,
    registers: bool = False,
    sass_dir: str | None = None,
) -> int:
    """Compile each distinct recorded launch for ``sm_<capability>``; print shared
    memory and compile time per kernel (with ``registers``: registers, spills, and
    spill stores/loads inside loops, :func:`loop_spills`);
    return the number of failures (errors or over the limit). ``kernel_filter``: only
    the kernels of these names. ``sass_dir``: also write each launch's SASS there
    (:func:`write_sass`), to diff two trees' kernels instruction by instruction."""
    count, failures, start = 0, 0, time.time()
    for kernel, kargs, kwargs in _distinct(launches, kernel_filter):
        count += 1
        name = f"{kernel.fn.__name__} {_TYPES[kargs[0].dtype]} {kwargs}"
        began = time.time()
        compiled = _try_compile(kernel, kargs, kwargs, capability, name)
        if compiled is None:
            failures += 1
            continue
        took = time.time() - began
        shared = compiled.metadata.shared
        usage = ""
        if registers:
            in_loops = loop_spills(compiled.asm["cubin"])
            loops = "?" if in_loops is None else "{}/{}".format(*in_loops)
            usage = f" {ptxas_usage(compiled.asm['ptx'], capability)} loop_STL/LDL={loops}"
        if sass_dir is not None:
            write_sass(sass_dir, name, compiled.asm["cubin"])
        over = shared > SHARED_LIMIT
        failures += over
        print(f"{'FAIL' if over else 'ok'} {name} shared={shared}{usage} compile={took:.1f}s",
              flush=True)  # fmt: skip
    print(f"{count} launches compiled for sm_{capability} in {time.time() - start:.0f} s, "
          f"{failures} failures")  # fmt: skip
    return failures


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_KV, _Q, _MERGED = "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel", "attn_bwd_kernel"
_KV_GLUON, _Q_GLUON = "attn_bwd_dkdv_gluon_kernel", "attn_bwd_dq_gluon_kernel"
_KERNELS = {"fwd": ("attn_fwd_kernel", "attn_fwd_tma_kernel", "attn_fwd_gluon_kernel"),
            "bwd": (_KV, _KV_GLUON, _Q, _Q_GLUON, _MERGED), "bwd_kv": (_KV, _KV_GLUON),
            "bwd_q": (_Q, _Q_GLUON), "bwd_merged": (_MERGED,),
            "pre": ("attn_bwd_preprocess_kernel",)}  # fmt: skip


def bwd_table(capability: int) -> int:
    """Print registers, spills and shared memory of the merged backward kernel beside the
    two kernels it merges (markdown), for bf16 D=64/128, causal and not, at the benchmark
    grid's shapes (B = 16384 / N, H = 2048 / D) for N = 1024, 4096 and 16384, and with
    GQA 4:1 (Hkv = H / 4, which adds the dK/dV program's loop over query heads) at
    N = 4096, with the configurations a call without attn_mask gets (the lean ones where
    listed). Returns the number of compile failures. A merged kernel gets at least the
    registers of its hungrier role; where it spills inside a loop and neither separate
    kernel did, expect it slower."""
    print("| D | N | heads | causal | kernel | tiles (M,N) | warps, stages | registers | "
          "spill stores (B) | stack (B) | STL/LDL in loops | shared (B) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    points = [(d, n, c, 1) for d in (64, 128) for n in (1024, 4096, 16384) for c in (False, True)]
    points += [(d, 4096, c, 4) for d in (64, 128) for c in (False, True)]
    for d, n, causal, group in points:
        shape = (16384 // n, 2048 // d, 2048 // d // group, n, n)
        cases = [(torch.bfloat16, d, {"shape": shape, "causal": causal})]
        launches = record(cases, configs.BWD_MODES, capability)
        for kernel, kargs, kwargs in _distinct(launches, _KERNELS["bwd"]):
            name = kernel.fn.__name__
            compiled = _try_compile(kernel, kargs, kwargs, capability, name)
            if compiled is None:
                failures += 1
                continue
            if name == _MERGED:
                order = " (heads)" if kwargs["HEAD_MAJOR"] else ""
                label = f"merged{order}"
                tiles = "dK/dV ({},{}), dQ ({},{})".format(
                    *(kwargs[x] for x in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"))
                )
            else:
                label = "dK/dV" if name == _KV else "dQ"
                tiles = f"({kwargs['BLOCK_M']},{kwargs['BLOCK_N']})"
            regs, stack, spills = ptxas_numbers(compiled.asm["ptx"], capability) or ("?",) * 3
            in_loops = "{}/{}".format(*(loop_spills(compiled.asm["cubin"]) or ("?", "?")))
            heads = f"{shape[1]}" if group == 1 else f"{shape[1]}:{shape[2]}"
            print(f"| {d} | {n} | {heads} | {'yes' if causal else 'no'} | {label} | {tiles} | "
                  f"{kwargs['num_warps']}, {kwargs['num_stages']} | {regs} | {spills} | "
                  f"{stack} | {in_loops} | {compiled.metadata.shared} |", flush=True)  # fmt: skip
    return failures


def _config(text: str) -> tuple[str, configs.LaunchConfig]:
    direction, _, values = text.partition("=")
    if direction not in ("fwd", "bwd_kv", "bwd_q"):
        raise argparse.ArgumentTypeError(f"{direction!r}: not one of fwd, bwd_kv, bwd_q")
    parts = values.split(",")
    flags = {f: f in parts for f in ("tma", "gluon")}  # e.g. 64,128,4,2,gluon
    return direction, configs.LaunchConfig(*(int(v) for v in parts if v not in flags), **flags)


# ---------------------------------------------------------------- triton_blocksparse


def record_blocksparse(
    cases: list[tuple[torch.dtype, int, int, dict]], capability: int = 90
) -> list:
    """triton_blocksparse's forward+backward for each (dtype, head dim, block, options) on
    CPU, recorded: its own kernels and the preprocess kernel it shares with triton_flash
    (all launched through triton_flash's ops module, ``ops._launch``), as a GPU of
    compute capability ``capability`` would launch them (its Gluon forward included)."""
    from attnhub.backends.triton_blocksparse import ops as bs_ops
    from attnhub.block_sparse import BlockSparseLayout

    launches: list = []
    originals = ops._launcher, ops._capability, bs_ops._capability
    ops._launcher = lambda kernel, like: _Recorder(kernel, launches)  # type: ignore[assignment]
    ops._capability = bs_ops._capability = lambda device: divmod(capability, 10)  # type: ignore[assignment]
    try:
        for dtype, d, block, options in cases:
            options = dict(options)
            # A ragged length runs the per-block loops; an even one without a band
            # (option "even") the flat loops of EVEN_BLOCKS; "long" (even, 16 blocks: past
            # SHORT_N keys at block 128) also a layout of full blocks only: at D=128 in
            # half precision on sm_90 it takes the Gluon forward (its rows keep 2048 keys,
            # past ops._GLUON_MIN_KEYS at block 128).
            long = options.pop("long", False)
            # "gluon_bwd": the Gluon backward kernels forced (bs_bwd_dq_gluon_kernel,
            # bs_bwd_dkdv_gluon_kernel; the table gives them only calls of 4096 keys or
            # more), on the layouts "long" builds.
            forced = configs.GLUON_BWD if options.pop("gluon_bwd", False) else {}
            n = 16 * block if long else 4 * block if options.pop("even", False) else 2 * block + 40
            layouts = [BlockSparseLayout.sliding_window(n, block + 10, block)]
            if long:
                layouts.append(
                    BlockSparseLayout.from_block_mask(torch.ones(1, 1, 16, 16) > 0, block)
                )
            q = torch.randn(1, 2, n, d, dtype=dtype, requires_grad=True)
            k = torch.randn(1, 1, n, d, dtype=dtype, requires_grad=True)
            mask = options.pop("mask", None)
            if mask == "float":
                mask = torch.randn(n, n, dtype=dtype)
            for layout in layouts:
                with tuning.override(**forced):
                    out, _ = bs_ops.block_sparse_attention(q, k, k, layout, mask, **options)
                    out.backward(torch.randn_like(out))
    finally:
        ops._launcher, ops._capability, bs_ops._capability = originals  # type: ignore[assignment]
    return launches


# ---------------------------------------------------------------- mask_reading


def record_mask_reading() -> list:
    """mask_reading.read_rows' two launches on CPU bool masks, recorded: a contiguous
    (B, 1, Nq, Nk) one (its strides specialized: 1 and multiples of 16) and a transposed
    one (its key stride not 1)."""
    from attnhub.backends.triton_flash import mask_reading

    launches: list = []
    names = ("_union_and_keys_kernel", "_verify_kernel")
    originals = {name: getattr(mask_reading, name) for name in names}
    for name, kernel in originals.items():
        setattr(mask_reading, name, _Recorder(kernel, launches))
    try:
        for keep in (
            torch.ones(2, 1, 48, 64, dtype=torch.bool).tril(),
            torch.ones(2, 64, 40, dtype=torch.bool).triu().transpose(1, 2),
        ):
            mask_reading.read_rows(keep)
    finally:
        for name, kernel in originals.items():
            setattr(mask_reading, name, kernel)
    return launches


def variants_blocksparse(quick: bool) -> list[tuple[torch.dtype, int, int, dict]]:
    full = {"causal": True, "bottom_right": True, "window": (30, None), "softcap": 5.0,
            "mask": "float", "dropout_p": 0.1}  # fmt: skip
    if quick:
        return [(torch.bfloat16, 128, 128, {"causal": True}), (torch.float32, 40, 64, full),
                (torch.bfloat16, 128, 128, {"even": True}),
                (torch.bfloat16, 128, 128, {"long": True}),
                (torch.bfloat16, 128, 128, {"long": True, "gluon_bwd": True})]  # fmt: skip
    cases: list[tuple[torch.dtype, int, int, dict]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for block in (64, 128):
            for d in (64, 128):
                cases += [(dtype, d, block, {}), (dtype, d, block, {"causal": True}),
                          (dtype, d, block, {"even": True}), (dtype, d, block, {"long": True}),
                          (dtype, d, block, {"long": True, "gluon_bwd": True})]  # fmt: skip
            cases += [(dtype, 40, block, full)]
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two variants (for CI)")
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument("--blocksparse", action="store_true",
                        help="triton_blocksparse's kernels instead (with --quick and --capability)")  # fmt: skip
    parser.add_argument("--mask-reading", action="store_true",
                        help="mask_reading's two kernels instead (a mask's structure read)")  # fmt: skip
    one = parser.add_argument_group("one case instead of the variants (given --dtype)")
    one.add_argument("--dtype", choices=sorted(_DTYPES))
    one.add_argument("--head-dim", type=int, default=128)
    one.add_argument("--shape", default="1,2,1,40,50", help="B,Hq,Hkv,Nq,Nk (default %(default)s)")
    one.add_argument("--causal", action="store_true")
    one.add_argument("--bottom-right", action="store_true")
    one.add_argument("--window", help="LEFT,RIGHT (empty side: unbounded)")
    one.add_argument("--mask", choices=("bool", "float"),
                     help="an attn_mask: bool (1, 1, Nq, Nk) or float (Nq, Nk)")  # fmt: skip
    parser.add_argument(
        "--config", type=_config, action="append", default=[],
        help="force a launch config: fwd|bwd_kv|bwd_q=BLOCK_M,BLOCK_N,WARPS,STAGES[,MAXNREG][,tma|gluon] (repeatable)",
    )  # fmt: skip
    parser.add_argument("--kernel", choices=sorted(_KERNELS), help="compile only these kernels")
    parser.add_argument(
        "--bwd", choices=(*configs.BWD_MODES, "all"), default="all",
        help="backward launch mode to record (default: all of them)",
    )  # fmt: skip
    parser.add_argument(
        "--bwd-table", action="store_true",
        help="only the merged-vs-split backward register table (bf16, D 64/128, N 1K/4K/16K, GQA)",
    )  # fmt: skip
    parser.add_argument(
        "--registers", action="store_true",
        help="also report registers and spills (runs ptxas -v once more per kernel)",
    )  # fmt: skip
    parser.add_argument(
        "--sass-dir", help="write each launch's SASS there (diff two trees: diff -r A B)"
    )
    args = parser.parse_args(argv)
    if args.mask_reading:
        failures = compile_all(record_mask_reading(), args.capability, registers=args.registers,
                               sass_dir=args.sass_dir)  # fmt: skip
        return 1 if failures else 0
    if args.blocksparse:
        launches = record_blocksparse(variants_blocksparse(args.quick), args.capability)
        failures = compile_all(launches, args.capability, registers=args.registers,
                               sass_dir=args.sass_dir)  # fmt: skip
        return 1 if failures else 0
    if args.bwd_table:
        return 1 if bwd_table(args.capability) else 0
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
        if args.mask:
            options["mask"] = args.mask
        cases = [(_DTYPES[args.dtype], args.head_dim, options)]
    with tuning.override(**dict(args.config)):
        launches = record(
            cases, BWD_RECORDED if args.bwd == "all" else (args.bwd,), args.capability
        )
    kernel_filter = _KERNELS[args.kernel] if args.kernel else None
    failures = compile_all(launches, args.capability, kernel_filter=kernel_filter,
                           registers=args.registers, sass_dir=args.sass_dir)  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
