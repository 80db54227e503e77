"""Per-call overhead of attnhub's dispatch over calling PyTorch's SDPA directly.

Times, on a tiny input (B=1, H=1, N=16, D=64 by default) where the kernel itself is
cheap, ``F.scaled_dot_product_attention`` against ``attnhub.attention(...,
backend="torch_sdpa")`` and ``attnhub.attention(...)`` with no backend named, and
prints each and the difference. The budget (issue 2) is 5 us, the goal 2 us. On CUDA
it also times ``attnhub.attention(..., backend="torch_sdpa_flash")`` against the flash
op called as that backend calls it, through PyTorch's generated binding
(``torch._scaled_dot_product_flash_attention``; issue 16: at most 2 us over it), and
shows the same op called through ``torch.ops.aten`` (the baseline issue 16's +2.72 us
was measured over), whose Python ``__call__`` and schema matching cost about 11,000
instructions more (counted on the CPU op of the same schema). With cuDNN, it times
``attnhub.attention(..., backend="torch_sdpa_cudnn")`` against cuDNN's op the same way
(and ``torch_sdpa_efficient`` against the memory-efficient op),
then ``attnhub.attention()`` over the direct call of the kernel it dispatched to
(on the H200, cuDNN's or the memory-efficient one, once its first call has measured
the candidates). Last, a model's call (issue 16: measure the calls models make):
Hugging Face's sdpa call (every option by name, its scale, ``is_causal=True``)
direct, as its ``attn_implementation="attnhub"`` path calls ``attention()``, and under
``attnhub.patch()`` (the ``model_*`` rows); and a padded batch's decoding step (one query
row, a (2, 1, 1, Nk) bool mask with a left-padded entry, the same mask every call as the
layers of a step share it) direct and patched (the ``decode_*`` rows: the patch leaves
a decoding step's mask unread and reuses its decision for the next call), and the
same step of a grouped-query model as Hugging Face packs it (the ``packed_*`` rows: four
query rows per key head, the mask as it is), and the
unpadded step of a grouped-query model (the ``gqa_*`` rows: no mask, ``enable_gqa=True``).

    python benchmarks/overhead.py [--device cuda] [--repeat 2000] [--rounds 200]
    python benchmarks/overhead.py --instructions    # needs valgrind and a C compiler

Wall time on a shared machine is noisy, so the three calls are timed in interleaved
rounds (a slow spell hits all three alike) and each reports its fastest round.
``--instructions`` counts CPU instructions per call instead, under valgrind's
callgrind: they repeat to within about 1% from run to run (the direct call's own
count wanders by a few hundred), so they are the number to compare when changing the
hot path. Counting starts only around the counted loops (a small helper, built with
the C compiler, toggles callgrind), which skips the minutes valgrind would need to
run ``import torch`` instrumented.

Measured (input (1, 1, 16, 64) float32; overhead = attnhub minus the direct call):

    instructions, 2-core dev machine, torch 2.13, Python 3.11 (2 runs each):
      5d3766f:  named +26,532 / +26,617   auto +26,550 / +26,641
      f226c4c:  named +12,749 / +12,843   auto +12,735 / +12,910
    wall, the H200 host's quiet CPU, torch 2.11, Python 3.12 (3 runs each, us):
      5d3766f:  named +3.30 / +3.23 / +3.74   auto +3.33 / +3.18 / +3.65
      f226c4c:  named +1.89 / +1.85 / +1.79   auto +1.79 / +1.91 / +2.01

The model rows, same machine, ``--shape 1,1,32,64`` (over ``model_direct``):

      bdb9323:  model_attnhub +10,979   model_patched +27,921   (named +12,890)
      the patched function's memo (attnhub.patching._Memo):
                model_attnhub +10,894   model_patched +12,227   (named +12,679)

Since 1384c46 a CPU call with Nk <= 16 and no mask reaches PyTorch with an explicit
mask (backends/torch_sdpa.py, ``_CPU_VECTOR_KEYS``), so on the CPU the default shape
no longer takes the path CUDA calls take (at 23edab6: named +37,553, auto +37,562);
``--shape 1,1,32,64`` does (named +12,747, auto +12,752).

On the quiet machine both the kernel and the overhead run about 8,000 instructions
per microsecond. On the shared 2-core development machine the overhead's wall time
moves by a microsecond or more from run to run (seen there, 5d3766f: +3.3 to +5.7 us;
f226c4c: +1.3 to +2.6 us).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import attnhub

_HELPER_C = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def _calls(
    args: argparse.Namespace,
) -> tuple[dict[str, Callable[[], object]], str, Callable[[], str]]:
    """The timed calls by name, the header line, and the auto call's ``explain()``."""
    shape = tuple(int(s) for s in args.shape.split(","))
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    torch.set_num_threads(1)
    sdpa = F.scaled_dot_product_attention  # PyTorch's own, bound before the patch below
    # The patched function, in force for the rest of the process: every other call here
    # reaches PyTorch's function through a name bound before it (aliases=False leaves
    # them as they are), and attnhub's backends call PyTorch's own.
    patched_sdpa = attnhub.patch(aliases=False).function
    calls: dict[str, Callable[[], object]] = {
        "direct": lambda: sdpa(q, k, v),
        "named": lambda: attnhub.attention(q, k, v, backend="torch_sdpa"),
        "auto": lambda: attnhub.attention(q, k, v),
    }
    # A model's call (issue 16: "measure the calls models make"): Hugging Face's sdpa
    # path passes every option by name, its scale among them, and is_causal=True for a
    # prefill; its attn_implementation="attnhub" path (attnhub.integrations.transformers)
    # passes attention() all of its options. The patched call is HF's, under patch().
    scale = shape[-1] ** -0.5
    calls["model_direct"] = lambda: sdpa(
        q, k, v, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=True
    )
    calls["model_attnhub"] = lambda: attnhub.attention(
        q, k, v, None, causal=True, alignment="top_left", window=None, softcap=None,
        scale=scale, dropout_p=0.0, backend=None,
    )  # fmt: skip
    calls["model_patched"] = lambda: patched_sdpa(
        q, k, v, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=True
    )
    # A padded batch's decoding step as Hugging Face makes it: one query row, a (B, 1, 1,
    # Nk) bool mask shared by every layer of the step (the second entry left-padded).
    # Under the patch the mask is not read (patching._reads_mask): each call after the
    # first reuses the decision made from the tensors' metadata.
    _, h, n, d = shape
    dq, dk, dv = (torch.randn(2, h, m, d, device=device, dtype=dtype) for m in (1, n, n))
    padding = torch.ones(2, 1, 1, n, device=device, dtype=torch.bool)
    padding[1, ..., : n // 4] = False
    calls["decode_direct"] = lambda: sdpa(
        dq, dk, dv, attn_mask=padding, dropout_p=0.0, scale=scale, is_causal=False
    )
    calls["decode_patched"] = lambda: patched_sdpa(
        dq, dk, dv, attn_mask=padding, dropout_p=0.0, scale=scale, is_causal=False
    )
    # The same step of a grouped-query model, as Hugging Face packs it (pack_gqa: the 4
    # query heads of each key head as 4 query rows, the mask as it is), run as given.
    pq = torch.randn(2, h, 4, d, device=device, dtype=dtype)
    calls["packed_direct"] = lambda: sdpa(
        pq, dk, dv, attn_mask=padding, dropout_p=0.0, scale=scale, is_causal=False
    )
    calls["packed_patched"] = lambda: patched_sdpa(
        pq, dk, dv, attn_mask=padding, dropout_p=0.0, scale=scale, is_causal=False
    )
    # The unpadded decoding step of a grouped-query model as Hugging Face passes it
    # (no mask: PyTorch's own grouping, enable_gqa=True; 4 query heads per key head).
    gq = torch.randn(2, 4 * h, 1, d, device=device, dtype=dtype)
    calls["gqa_direct"] = lambda: sdpa(
        gq, dk, dv, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False, enable_gqa=True
    )
    calls["gqa_patched"] = lambda: patched_sdpa(
        gq, dk, dv, attn_mask=None, dropout_p=0.0, scale=scale, is_causal=False, enable_gqa=True
    )
    if device.type == "cuda" and torch.backends.cuda.is_flash_attention_available():
        # A pinned kernel against its own ATen op, called the way torch_sdpa_flash calls
        # it (the op's generated binding), and through torch.ops.aten (shown alone).
        flash = torch._scaled_dot_product_flash_attention
        flash_ops = torch.ops.aten._scaled_dot_product_flash_attention
        calls["flash_direct"] = lambda: flash(q, k, v, 0.0, False, False)
        calls["flash_ops"] = lambda: flash_ops(q, k, v, 0.0, False, False)
        calls["flash_named"] = lambda: attnhub.attention(q, k, v, backend="torch_sdpa_flash")
    if device.type == "cuda":
        # The memory-efficient op (in every CUDA build), as torch_sdpa_efficient calls it
        # (no mask, no lse without grad): what auto serves the tiny call with on the H200
        # (seen 2026-12-02).
        efficient = torch._scaled_dot_product_efficient_attention
        calls["efficient_direct"] = lambda: efficient(q, k, v, None, False, 0.0, False)
        calls["efficient_named"] = lambda: attnhub.attention(
            q, k, v, backend="torch_sdpa_efficient"
        )
    if device.type == "cuda" and torch.backends.cudnn.is_available():
        # cuDNN's op, as torch_sdpa_cudnn calls it (no mask, no lse without grad): what
        # auto serves the tiny call with on the H200 (seen 2026-12-02).
        cudnn = torch._scaled_dot_product_cudnn_attention
        calls["cudnn_direct"] = lambda: cudnn(q, k, v, None, False, 0.0, False, False)
        calls["cudnn_named"] = lambda: attnhub.attention(q, k, v, backend="torch_sdpa_cudnn")
    return calls, f"input {shape} {dtype} on {device}", lambda: str(attnhub.explain(q, k, v))


def _served_auto(calls: dict[str, Callable[[], object]]) -> str:
    """What serves the ``auto`` call once it has run: on CUDA its first call measures
    the eligible backends (autotune), so ``explain()`` before it may name another."""
    attnhub.reset_stats()
    calls["auto"]()
    return ", ".join(attnhub.stats())


_LABELS = (
    # (variant, label, the variant it is the overhead over)
    ("direct", "F.scaled_dot_product_attention", None),
    ("named", "attnhub.attention(backend='torch_sdpa')", "direct"),
    ("auto", "attnhub.attention()", "direct"),
    ("flash_direct", "torch._scaled_dot_product_flash_attention", None),
    ("flash_ops", "torch.ops.aten._scaled_dot_product_flash_attention", None),
    ("flash_named", "attnhub.attention(backend='torch_sdpa_flash')", "flash_direct"),
    ("efficient_direct", "torch._scaled_dot_product_efficient_attention", None),
    ("efficient_named", "attnhub.attention(backend='torch_sdpa_efficient')", "efficient_direct"),
    ("cudnn_direct", "torch._scaled_dot_product_cudnn_attention", None),
    ("cudnn_named", "attnhub.attention(backend='torch_sdpa_cudnn')", "cudnn_direct"),
    ("model_direct", "F.sdpa(..., scale=, is_causal=True) as HF calls it", None),
    ("model_attnhub", "attention(...) as attn_implementation='attnhub' calls it", "model_direct"),
    ("model_patched", "the HF call under attnhub.patch()", "model_direct"),
    ("decode_direct", "HF decode step, padding mask: F.sdpa", None),
    ("decode_patched", "the same under attnhub.patch()", "decode_direct"),
    ("packed_direct", "HF packed GQA decode step (4 rows): F.sdpa", None),
    ("packed_patched", "the same under attnhub.patch()", "packed_direct"),
    ("gqa_direct", "HF GQA decode step, no mask (enable_gqa): F.sdpa", None),
    ("gqa_patched", "the same under attnhub.patch()", "gqa_direct"),
)
# The direct call of each backend's own kernel: auto's overhead over what it dispatched
# to (issue 16's "dispatch to a PyTorch kernel costs <= 2 us over calling that kernel").
_KERNEL_CALL = {"torch_sdpa": "direct", "torch_sdpa_flash": "flash_direct",
                "torch_sdpa_efficient": "efficient_direct",
                "torch_sdpa_cudnn": "cudnn_direct"}  # fmt: skip


def _report(
    title: str, values: dict[str, float], unit: str, digits: int, served: str = ""
) -> dict[str, float]:
    """Prints each variant and its overhead; returns the overheads. ``served``: the
    backend that served ``auto``; its overhead over that backend's kernel comes last."""
    print(title)
    overheads = {}
    for name, label, base in _LABELS:
        if name not in values:
            continue
        line = f"  {label:<50}  {values[name]:10,.{digits}f} {unit}"
        if base is not None:
            overheads[name] = values[name] - values[base]
            line += f"  (+{overheads[name]:,.{digits}f} {unit})"
        print(line)
    kernel = _KERNEL_CALL.get(served)
    if kernel in values and "auto" in values:
        overheads["auto_over_its_kernel"] = values["auto"] - values[kernel]
        label = f"attnhub.attention() over {served}'s kernel"
        print(
            f"  {label:<50}  {'':>10}    (+{overheads['auto_over_its_kernel']:,.{digits}f} {unit})"
        )
    return overheads


def wall_times(args: argparse.Namespace) -> None:
    """The fastest of ``--rounds`` interleaved rounds of ``--repeat`` calls each."""
    calls, header, explain = _calls(args)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for fn in calls.values():
        for _ in range(500):
            fn()
    served = _served_auto(calls)
    header += f"; attnhub's own choice, once warm: {served}"
    best = dict.fromkeys(calls, float("inf"))
    repeat = args.repeat
    for _ in range(args.rounds):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / repeat * 1e6)
    print(header)
    # Why auto serves what it serves: on CUDA, the measurement its first call made.
    print(explain())
    title = f"wall time per call, best of {args.rounds} rounds x {repeat}:"
    overheads = _report(title, best, "us", 2, served)
    if args.json:
        data = {
            "kind": "attnhub-overhead/1",
            "header": header,
            "device": torch.cuda.get_device_name() if cuda else args.device,
            "torch": torch.__version__,
            "attnhub": attnhub.__version__,
            "rounds": args.rounds,
            "repeat": repeat,
            "us_per_call": best,
            "overhead_us": overheads,
        }
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


def _count_instructions(args: argparse.Namespace, helper: str, out_dir: str) -> None:
    """Runs under callgrind: per-call instruction counts of each call, from the dumps."""
    import ctypes

    lib = ctypes.CDLL(helper)
    calls, header, _ = _calls(args)
    calls = {"empty": lambda: None, **calls}
    for fn in calls.values():
        for _ in range(300):
            fn()
    lib.cg_start()
    n = args.calls
    counts: dict[str, float] = {}
    for name, fn in calls.items():
        for _ in range(50):  # instrumented warm-up: valgrind translates the code once
            fn()
        lib.cg_zero()
        lib.cg_toggle()
        for _ in range(n):
            fn()
        lib.cg_toggle()
        lib.cg_dump(name.encode())
        newest = max(
            (os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.count(".") >= 2),
            key=os.path.getmtime,
        )
        with open(newest) as dump:
            totals = [line for line in dump if line.startswith("totals:")]
        counts[name] = int(totals[0].split()[1]) / n
        os.remove(newest)
    loop = counts.pop("empty")  # the benchmark loop and the lambda call themselves
    served = _served_auto(calls)
    print(f"{header}; attnhub's own choice, once warm: {served}")
    _report(
        f"instructions per call (callgrind, {n} calls, loop cost {loop:.0f} removed):",
        {name: c - loop for name, c in counts.items()},
        "instructions",
        0,
        served,
    )


def instructions(args: argparse.Namespace) -> None:
    """Re-runs this script under callgrind with the toggling helper built in a temp dir."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if shutil.which("valgrind") is None or cc is None:
        sys.exit("--instructions needs valgrind (with its headers) and a C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        helper = os.path.join(tmp, "cg_helper.so")
        source = os.path.join(tmp, "cg_helper.c")
        with open(source, "w") as f:
            f.write(_HELPER_C)
        subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", helper, source], check=True)
        out_dir = os.path.join(tmp, "dumps")
        os.mkdir(out_dir)
        cmd = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
            f"--callgrind-out-file={out_dir}/cg.%p", "--log-file=" + os.path.join(tmp, "vg.log"),
            sys.executable, os.path.abspath(__file__),
            "--device", args.device, "--shape", args.shape, "--calls", str(args.calls),
            "--_callgrind-child", helper, out_dir,
        ]  # fmt: skip
        sys.exit(subprocess.run(cmd).returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="1,1,16,64")
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=200, help="interleaved timed rounds")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions under callgrind"
    )
    parser.add_argument("--calls", type=int, default=1000, help="calls counted per variant")
    parser.add_argument("--json", help="also write the wall times and overheads to this file")
    parser.add_argument("--_callgrind-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._callgrind_child:
        _count_instructions(args, *args._callgrind_child)
    elif args.instructions:
        instructions(args)
    else:
        wall_times(args)


if __name__ == "__main__":
    main()
