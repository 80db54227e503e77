"""GPU evidence for triton_flash, in one run: correctness, determinism, memory, timing.

Usage (on the H200 machine, after ``pip install --no-build-isolation --no-deps -e .``)::

    python benchmarks/triton_flash_gpu.py OUT.json [--quick] [--no-sanitizer] [--commit SHA]

1. Correctness against the float64 reference on the GPU (bf16, fp16, fp32; N up to
   16K; D 64/128/256; contract features), with contract.md's tolerance rule.
2. The backward repeated 20 times, compared bitwise (triton_flash declares
   ``deterministic``).
3. compute-sanitizer memcheck on a small case (in a subprocess, when the tool exists).
4. Extra peak memory for forward+backward at N = 16K and 64K (B=1, H=16, D=128, bf16)
   beside SDPA flash, and an N = 128K forward+backward checked against SDPA flash.
5. Timing on the anchor grid (shared/perf/anchors-h200.md protocol: bf16, D 64/128,
   N 1K/4K/16K, B = 16384/N, H = 2048/D, causal and not, do_bench(warmup=25,
   rep=100, median)) beside SDPA flash, in the same process on the same inputs.
6. A sweep of a few launch configurations at N=4096, each checked against SDPA flash,
   then timed beside SDPA flash and cuDNN (data for the configuration table);
   ``--only sweep --sweep-head-dims 256`` the D=256 rows at the issue's B=4, H=8.
7. ``--only window_sweep``: a few forward and backward configurations for W = 256 and
   1024 at the issue's sliding-window shape, each compared with the table's choice, then
   timed.

The sweeps force their candidates with ``tuning.override`` (backends/triton_flash/
tuning.py), the one switch for tuning runs. The finished A/B sections (scale fold,
merged-vs-split backward, window tiles, row-stride constants) were removed once their
results were in the tables; their files are in benchmarks/results/archive/ and their code in
git history (before the tuning context replaced the switches they flipped).

Writes JSON to OUT.json and prints the timing table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time

import torch
import triton

from attnhub.backends.torch_reference import reference_attention
from attnhub.backends.triton_flash.ops import flash_attention
from attnhub.request import AttentionParams

DEV = "cuda"
MIB = 1 << 20


def _git_head() -> str | None:
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    commit = proc.stdout.strip() if proc.returncode == 0 else ""
    return commit if len(commit) == 40 else None  # not a real hash (e.g. a copied tree)


def env(commit: str | None = None) -> dict:
    """The run's machine and versions. ``commit``: the tree's commit as the caller knows
    it (``--commit``); else ``git rev-parse HEAD``, which names a stale commit where the
    tree was copied without its git metadata (the device tool's copies did so)."""
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "attnhub_commit": commit or _git_head(),
        "note": "working tree may differ from the commit (uncommitted changes)",
    }


# ---------------------------------------------------------------- correctness


def _run(q, k, v, mask, dout, kw, dtype=None):  # type: ignore[no-untyped-def]
    """Reference (dtype given) or triton_flash; returns out, lse, dq, dk, dv."""
    q, k, v = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v))
    if dtype is None:
        out, lse = flash_attention(q, k, v, mask, **kw)
    else:
        m = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
        params = AttentionParams(
            causal=kw.get("causal", False),
            alignment="bottom_right" if kw.get("bottom_right") else "top_left",
            window=kw.get("window"), softcap=kw.get("softcap"), scale=kw["scale"],
        )  # fmt: skip
        out, lse = reference_attention(q, k, v, m, params)
    out.backward(dout.to(out.dtype))
    return [x.detach() for x in (out, lse, q.grad, k.grad, v.grad)]


def _compare(x, r_lp, r64) -> dict:  # type: ignore[no-untyped-def]
    finite = torch.isfinite(r64)
    nan = bool(torch.isnan(x).any())
    inf_ok = bool(torch.equal(torch.isfinite(x), finite))
    err = (x.double() - r64)[finite].abs().max().item() if finite.any() else 0.0
    diff = (r_lp.double() - r64)[finite]
    diff = diff[torch.isfinite(diff)]
    bound = 2 * (diff.abs().max().item() if diff.numel() else 0.0) + 1e-5
    return {"err": err, "bound": bound, "ok": (not nan) and inf_ok and err <= bound}


CORRECTNESS = [
    # (label, B, Hq, Hkv, Nq, Nk, D, options, mask kind, dtypes)
    ("causal-16K", 1, 2, 2, 16384, 16384, 128, {"causal": True}, None, ("bf16", "fp16")),
    ("gqa-4K", 2, 8, 2, 4096, 4096, 64, {}, None, ("bf16", "fp16", "fp32")),
    ("causal_br-D256", 1, 4, 4, 3000, 4096, 256, {"causal": True, "bottom_right": True}, None,
     ("bf16", "fp16", "fp32")),
    ("window_softcap-D96", 2, 4, 1, 2048, 2500, 96,
     {"causal": True, "window": (512, None), "softcap": 30.0, "bottom_right": True}, "float",
     ("bf16", "fp16", "fp32")),
    ("bool_mask-D128", 2, 4, 4, 1500, 1700, 128, {}, "bool", ("bf16", "fp16", "fp32")),
    ("causal_tl_q_longer", 1, 4, 2, 2000, 1000, 128, {"causal": True}, None, ("bf16",)),
]  # fmt: skip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def correctness(quick: bool) -> list[dict]:
    rows = []
    for label, b, hq, hkv, nq, nk, d, kw, mask_kind, dtypes in CORRECTNESS:
        if quick and nq > 4096:
            continue
        for name in dtypes:
            dtype = DTYPES[name]
            torch.manual_seed(0)
            q = torch.randn(b, hq, nq, d, device=DEV, dtype=dtype)
            k = torch.randn(b, hkv, nk, d, device=DEV, dtype=dtype)
            v = torch.randn(b, hkv, nk, d, device=DEV, dtype=dtype)
            dout = torch.randn(b, hq, nq, d, device=DEV, dtype=dtype)
            mask = None
            if mask_kind == "float":
                mask = torch.randn(nq, nk, device=DEV, dtype=dtype)
            elif mask_kind == "bool":
                mask = torch.rand(b, 1, nq, nk, device=DEV) > 0.2
                mask[:, :, ::97] = False  # fully masked rows
            kw = dict(kw, scale=d**-0.5)
            t0 = time.time()
            got = _run(q, k, v, mask, dout, kw)
            ref64 = _run(q, k, v, mask, dout, kw, torch.float64)
            ref_lp = _run(q, k, v, mask, dout, kw, dtype)
            checks = {n: _compare(x, rl, r) for n, x, rl, r in
                      zip(("out", "lse", "dq", "dk", "dv"), got, ref_lp, ref64)}  # fmt: skip
            del ref64, ref_lp
            torch.cuda.empty_cache()
            row = {"case": label, "dtype": name, "B": b, "Hq": hq, "Hkv": hkv, "Nq": nq,
                   "Nk": nk, "D": d, "mask": mask_kind, "options": {k2: str(v2) for k2, v2 in kw.items()},
                   "checks": checks, "ok": all(c["ok"] for c in checks.values()),
                   "seconds": round(time.time() - t0, 1)}  # fmt: skip
            print(f"correctness {label:22s} {name}: {'PASS' if row['ok'] else 'FAIL'} "
                  + " ".join(f"{n}={c['err']:.2e}/{c['bound']:.2e}" for n, c in checks.items()),
                  flush=True)  # fmt: skip
            rows.append(row)
    return rows


def determinism(repeats: int = 20) -> dict:
    torch.manual_seed(1)
    b, hq, hkv, n, d = 2, 8, 2, 4096, 128
    q = torch.randn(b, hq, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, hq, n, d, device=DEV, dtype=torch.bfloat16)
    first = None
    same = True
    for _ in range(repeats):
        q.grad = k.grad = v.grad = None
        out, _ = flash_attention(q, k, v, causal=True, softcap=20.0)
        out.backward(dout)
        grads = [out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()]
        if first is None:
            first = grads
        else:
            same &= all(torch.equal(a, c) for a, c in zip(first, grads))
    print(f"determinism: backward x{repeats} bitwise identical: {same}", flush=True)
    return {"repeats": repeats, "bitwise_identical": same, "shape": [b, hq, hkv, n, d],
            "options": "causal, softcap=20, GQA 4:1, bf16"}  # fmt: skip


SANITIZER_CODE = """
import torch
from attnhub.backends.triton_flash.ops import flash_attention
torch.manual_seed(0)
q = torch.randn(1, 2, 77, 40, device="cuda", dtype=torch.float16, requires_grad=True)
k = torch.randn(1, 1, 93, 40, device="cuda", dtype=torch.float16, requires_grad=True)
m = torch.randn(77, 93, device="cuda", dtype=torch.float16)
out, lse = flash_attention(q, k, k, m, causal=True, bottom_right=True, window=(30, None),
                           softcap=5.0, dropout_p=0.1)
out.sum().backward()
torch.cuda.synchronize()
print("sanitizer case ran")
"""


def sanitizer() -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {"ran": False, "why": "compute-sanitizer not found"}
    try:
        proc = subprocess.run([tool, "--tool", "memcheck", sys.executable, "-c", SANITIZER_CODE],
                              capture_output=True, text=True, timeout=150)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"ran": False, "why": "timed out after 150 s"}
    tail = (proc.stdout + proc.stderr)[-1500:]
    ok = proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in tail
    print(f"compute-sanitizer memcheck: rc={proc.returncode} clean={ok}", flush=True)
    return {"ran": True, "rc": proc.returncode, "clean": ok, "tail": tail}


# ---------------------------------------------------------------- memory


def _peak_extra(fn, n: int) -> float:
    torch.manual_seed(2)
    shape = (1, 16, n, 128)
    q, k, v = (
        torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v)
    out.backward(dout)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    del out, q, k, v, dout
    torch.cuda.empty_cache()
    return peak


def _ours(q, k, v, causal=False):  # type: ignore[no-untyped-def]
    return flash_attention(q, k, v, causal=causal)[0]


def _sdpa_flash(q, k, v, causal=False):  # type: ignore[no-untyped-def]
    # The ATen op directly: sdpa_kernel() would add 25-70 us a call (anchors-h200.md).
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)[0]


def memory() -> list[dict]:
    rows = []
    for n in (16384, 65536):
        row = {"N": n, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
               "triton_flash_mib": round(_peak_extra(_ours, n), 1),
               "torch_sdpa_flash_mib": round(_peak_extra(_sdpa_flash, n), 1)}  # fmt: skip
        print(
            f"memory N={n}: triton_flash {row['triton_flash_mib']} MiB, "
            f"sdpa flash {row['torch_sdpa_flash_mib']} MiB (extra peak, fwd+bwd)",
            flush=True,
        )
        rows.append(row)
    return rows


def long_run(n: int = 131072) -> dict:
    torch.manual_seed(3)
    shape = (1, 16, n, 128)
    q, k, v = (
        torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.time()
    out = _ours(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    seconds = time.time() - t0
    ours = [out.detach(), q.grad, k.grad, v.grad]
    finite = all(bool(torch.isfinite(x).all()) for x in ours)
    q.grad = k.grad = v.grad = None
    ref = _sdpa_flash(q, k, v, causal=True)
    ref.backward(dout)
    diffs = [(a.float() - b.float()).abs().max().item()
             for a, b in zip(ours, [ref.detach(), q.grad, k.grad, v.grad])]  # fmt: skip
    print(
        f"N={n} causal fwd+bwd: {seconds:.2f} s (incl. compile), finite={finite}, "
        f"max |ours - sdpa flash| out/dq/dk/dv = {[f'{x:.2e}' for x in diffs]}",
        flush=True,
    )
    return {"N": n, "B": 1, "H": 16, "D": 128, "dtype": "bf16", "causal": True,
            "finite": finite, "seconds_first_call": round(seconds, 2),
            "max_abs_diff_vs_sdpa_flash": dict(zip(("out", "dq", "dk", "dv"), diffs))}  # fmt: skip


# ---------------------------------------------------------------- timing


def _bench(fn, q, k, v, dout, causal: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(forward ms, forward+backward ms), do_bench median as in anchors-h200.md."""

    def fwd() -> None:
        with torch.no_grad():
            fn(q, k, v, causal=causal)

    def fwd_bwd() -> None:
        out = fn(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    t_fb = triton.testing.do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
    return t_f, t_fb


def timing(quick: bool) -> list[dict]:
    rows = []
    dtype = torch.bfloat16
    ns = (1024, 4096) if quick else (1024, 4096, 16384)
    for d in (64, 128):
        for n in ns:
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                torch.manual_seed(4)
                q, k, v = (torch.randn(b, h, n, d, device=DEV, dtype=dtype, requires_grad=True)
                           for _ in range(3))  # fmt: skip
                dout = torch.randn(b, h, n, d, device=DEV, dtype=dtype)
                flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                for name, fn in (("triton_flash", _ours), ("torch_sdpa_flash", _sdpa_flash)):
                    t_f, t_fb = _bench(fn, q, k, v, dout, causal)
                    t_b = t_fb - t_f
                    for mode, ms, fl in (("fwd", t_f, flops), ("bwd", t_b, 2.5 * flops),
                                         ("fwd_bwd", t_fb, 3.5 * flops)):  # fmt: skip
                        rows.append({"backend": name, "dtype": "bf16", "B": b, "Hq": h, "Hkv": h,
                                     "Nq": n, "Nk": n, "D": d, "causal": causal, "mode": mode,
                                     "ms": round(ms, 4), "tflops": round(fl / ms / 1e9, 1)})  # fmt: skip
                del q, k, v, dout
    return rows


# D=256: the table's rows first, then the candidates that compile for sm_90 without
# spills, or with a few bytes outside the loops (archive/aot-d256-configs-2026-12-02.md).
SWEEP_FWD = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (64, 64, 4, 3),
         (128, 128, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
    # The lean row, then the masked calls' row.
    256: [(128, 64, 8, 2), (64, 64, 8, 2)],
}  # fmt: skip
SWEEP_BWD = {  # (dK/dV config, dQ config)
    64: [((32, 128, 4, 3), (128, 32, 4, 3)), ((64, 128, 8, 3), (128, 64, 8, 3)),
         ((32, 64, 4, 3), (64, 32, 4, 3))],
    128: [((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 128, 8, 2), (128, 64, 8, 2)),
          ((32, 64, 4, 3), (64, 32, 4, 3)), ((32, 128, 8, 3), (64, 64, 4, 3))],
    # The lean pair first (the best halves of archive/sweep-d256-h200-2026-12-02-9b87448.json),
    # then each half with the other's runner-up, and dQ on shorter key tiles.
    256: [((32, 64, 8, 3), (128, 32, 8, 2)), ((32, 64, 8, 2), (128, 32, 8, 2)),
          ((32, 64, 8, 3), (64, 64, 8, 2)), ((32, 64, 8, 3), (128, 16, 8, 2))],
}  # fmt: skip


def _sdpa_cudnn(q, k, v, causal=False):  # type: ignore[no-untyped-def]
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False
    )[0]


def _shape(n: int, d: int) -> tuple[int, int]:
    """(B, H) of the sweep at N, head dim D: the grid's B = 16384 / N, H = 2048 / D; at
    D = 256 the issue's B = 4, H = 8 (19: "D=256 (B=4, H=8, N=4K)")."""
    if d == 256:
        return 4, 8
    return max(1, 16384 // n), 2048 // d


def sweep(seqlens: tuple[int, ...] = (4096,), head_dims: tuple[int, ...] = (64, 128)) -> list[dict]:
    """A few launch configurations per direction at each N and head dim (bf16, shapes
    by :func:`_shape`), each checked against SDPA flash before it is timed, with SDPA
    flash and cuDNN timed beside them on the same inputs (rows of kind "baseline"):
    data for the configuration table."""
    from attnhub.backends.triton_flash import tuning

    rows = []
    for n, d in ((n, d) for n in seqlens for d in head_dims):
        b, h = _shape(n, d)
        torch.manual_seed(5)
        q, k, v = (torch.randn(b, h, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        dout = torch.randn(b, h, n, d, device=DEV, dtype=torch.bfloat16)
        for causal in (False, True):
            flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            ref = _sdpa_flash(q, k, v, causal)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
            for name, fn in (("torch_sdpa_flash", _sdpa_flash), ("torch_sdpa_cudnn", _sdpa_cudnn)):
                base = {"kind": "baseline", "backend": name, "D": d, "N": n, "B": b, "H": h,
                        "causal": causal}  # fmt: skip
                try:
                    t_f, t_fb = _bench(fn, q, k, v, dout, causal)
                    base.update(fwd_ms=round(t_f, 4), bwd_ms=round(t_fb - t_f, 4),
                                fwd_tflops=round(flops / t_f / 1e9, 1),
                                bwd_tflops=round(2.5 * flops / (t_fb - t_f) / 1e9, 1))  # fmt: skip
                except Exception as exc:
                    base["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"sweep {base}", flush=True)
                rows.append(base)
            trials = [("fwd", c, None) for c in SWEEP_FWD[d]]
            trials += [("bwd", kv, dq) for kv, dq in SWEEP_BWD[d]]
            for kind, first, second in trials:
                forced = {"fwd": first} if kind == "fwd" else {"bwd_kv": first, "bwd_q": second}
                row = {"kind": kind, "D": d, "N": n, "B": b, "H": h, "causal": causal,
                       "config": first if second is None else [first, second]}  # fmt: skip
                with tuning.override(**forced):
                    try:
                        out = _ours(q, k, v, causal)
                        err = (out.float() - ref.float()).abs().max().item()
                        if kind == "bwd":
                            grads = torch.autograd.grad(out, (q, k, v), dout)
                            err = max([err] + [(a.float() - r.float()).abs().max().item()
                                               for a, r in zip(grads, ref_grads)])  # fmt: skip
                        t_f, t_fb = _bench(_ours, q, k, v, dout, causal)
                        ms = t_f if kind == "fwd" else t_fb - t_f
                        fl = flops if kind == "fwd" else 2.5 * flops
                        row.update(max_abs_diff_vs_sdpa_flash=err, ms=round(ms, 4),
                                   tflops=round(fl / ms / 1e9, 1))  # fmt: skip
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"sweep {row}", flush=True)
                rows.append(row)
        del q, k, v, dout
    return rows


def _raw_backward(q, k, v, dout, out, lse, causal: bool, window: tuple[int, int] | None = None):  # type: ignore[no-untyped-def]
    """(dq, dk, dv) from the backward's launches alone (preprocess, dK/dV and dQ) on saved
    forward outputs, raw as an eager backward makes them (ops.DirectAttention.backward):
    host time included, as a training step pays it. ``window``: (left, right) in the
    ops' encoding (NO_WINDOW for an absent side), default none."""
    from torch._library.triton import set_wrap_triton_enabled

    from attnhub.backends.triton_flash import ops

    left, right = window if window is not None else (ops.NO_WINDOW, ops.NO_WINDOW)
    with set_wrap_triton_enabled(False):
        return ops._bwd_impl(dout, q, k, v, None, None, out, lse, None, causal, False,
                             left, right, 0.0, q.shape[-1] ** -0.5, 0.0)  # fmt: skip


def _max_abs_diff(xs, ys) -> float:  # type: ignore[no-untyped-def]
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys))


WINDOW_SHAPE = (2, 16, 16384, 128)  # B, H, N, D: the sliding-window extra


def _window_inputs() -> tuple[torch.Tensor, ...]:
    """q, k, v, dout at WINDOW_SHAPE, bf16."""
    torch.manual_seed(9)
    return tuple(torch.randn(*WINDOW_SHAPE, device=DEV, dtype=torch.bfloat16) for _ in range(4))


def _window_calls(q, k, v, dout, w: int):  # type: ignore[no-untyped-def]
    """(fwd, bwd, flops) for a causal window of ``w`` keys (window = (w - 1, 0)): the
    forward without grad, returning (out, lse); the raw backward on given (out, lse);
    and the forward's FLOPs over the kept pairs, as attnhub bench counts them."""
    b, h, n, d = q.shape

    def fwd():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return flash_attention(q, k, v, causal=True, window=(w - 1, 0))

    def bwd(out, lse):  # type: ignore[no-untyped-def]
        return _raw_backward(q, k, v, dout, out, lse, True, (w - 1, 0))

    return fwd, bwd, 4 * d * b * h * (w * n - w * (w - 1) // 2)


# Window sweep candidates (D=128); each is compared with the table's own choice at its
# W. First run (707a7e2): the general forward row and the short causal backward pair
# (one launch) were the table's choice at both W; then the first five backward pairs.
WINDOW_SWEEP_FWD = ((128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3),
                    (64, 32, 4, 3))  # fmt: skip
WINDOW_SWEEP_BWD = (
    ((32, 64, 4, 3), (64, 32, 4, 3)),
    ((64, 128, 8, 3), (128, 64, 8, 3)),
    ((64, 64, 4, 3), (64, 64, 4, 3)),
    ((32, 128, 4, 3), (128, 32, 4, 3)),
    ((64, 64, 8, 3), (64, 64, 8, 3)),
    ((32, 64, 4, 4), (64, 32, 4, 4)),
    ((32, 64, 4, 2), (64, 32, 4, 2)),
    ((32, 64, 8, 3), (64, 32, 8, 3)),
    ((16, 64, 4, 3), (64, 16, 4, 3)),
    ((32, 32, 4, 3), (32, 32, 4, 3)),
)


def window_sweep() -> list[dict]:
    """Launch configurations for sliding windows at the issue's window shape (bf16, B=2,
    H=16, N=16384, D=128, causal, window=(W-1, 0), W 256 and 1024), forward and backward
    alone (the library's launch: one for these D=128 pairs), each compared with the
    table's choice (max abs diff) and timed (do_bench median)."""
    from attnhub.backends.triton_flash import tuning

    b, h, n, d = WINDOW_SHAPE
    q, k, v, dout = _window_inputs()
    rows = []
    for w in (256, 1024):
        fwd, bwd, flops = _window_calls(q, k, v, dout, w)
        out, lse = fwd()
        ref = (out, *bwd(out, lse))
        trials = [("fwd", {"fwd": c}) for c in WINDOW_SWEEP_FWD]
        trials += [("bwd", {"bwd_kv": kv, "bwd_q": dq}) for kv, dq in WINDOW_SWEEP_BWD]
        for kind, chosen in trials:
            row = {"kind": kind, "W": w, "B": b, "H": h, "N": n, "D": d,
                   "config": list(chosen.values())}  # fmt: skip
            with tuning.override(**chosen):
                try:
                    if kind == "fwd":
                        got = fwd()[:1]
                        ms = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
                    else:
                        got = bwd(out, lse)
                        ms = triton.testing.do_bench(lambda: bwd(out, lse), warmup=25, rep=100,  # noqa: B023
                                                     return_mode="median")  # fmt: skip
                    expected = ref[:1] if kind == "fwd" else ref[1:]
                    err = _max_abs_diff(got, expected)
                    fl = flops if kind == "fwd" else 2.5 * flops
                    row.update(max_abs_diff_vs_table=err, ms=round(ms, 4),
                               tflops=round(fl / ms / 1e9, 1))  # fmt: skip
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"window_sweep {row}", flush=True)
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    by = {(r["backend"], r["D"], r["Nq"], r["causal"], r["mode"]): r["tflops"] for r in rows}
    print("\nbf16 TFLOP/s, triton_flash vs torch_sdpa_flash (fwd | bwd), ratio")
    print(f"{'D':>4} {'N':>6} {'causal':>6} | {'ours fwd':>8} {'sdpa fwd':>8} {'x':>5} | "
          f"{'ours bwd':>8} {'sdpa bwd':>8} {'x':>5}")  # fmt: skip
    for d, n, causal in sorted({(r["D"], r["Nq"], r["causal"]) for r in rows}):
        f1, f2 = (
            by[("triton_flash", d, n, causal, "fwd")],
            by[("torch_sdpa_flash", d, n, causal, "fwd")],
        )
        b1, b2 = (
            by[("triton_flash", d, n, causal, "bwd")],
            by[("torch_sdpa_flash", d, n, causal, "bwd")],
        )
        print(f"{d:>4} {n:>6} {causal!s:>6} | {f1:>8} {f2:>8} {f1 / f2:>5.2f} | "
              f"{b1:>8} {b2:>8} {b1 / b2 if b2 else math.nan:>5.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="skip N >= 16K cases")
    parser.add_argument("--no-sanitizer", action="store_true")
    parser.add_argument("--only", default="", help="comma list of sections to run")
    parser.add_argument("--sweep-seqlens", default="4096", help="comma list of N for the sweep")
    parser.add_argument("--sweep-head-dims", default="64,128", help="comma list of D for the sweep (64, 128, 256)")  # fmt: skip
    parser.add_argument("--commit", help="the tree's commit, recorded in env (default: git HEAD)")
    args = parser.parse_args()
    torch.set_float32_matmul_precision("highest")
    sections = set(args.only.split(",")) if args.only else {
        "correctness", "determinism", "sanitizer", "memory", "long", "timing", "sweep"}  # fmt: skip
    if args.no_sanitizer:
        sections.discard("sanitizer")
    result: dict = {"env": env(args.commit)}

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)

    steps = (
        ("correctness", lambda: correctness(args.quick)),
        ("determinism", determinism),
        ("sanitizer", sanitizer),
        ("memory", memory),
        ("long", long_run),
        ("timing", lambda: timing(args.quick)),
        (
            "sweep",
            lambda: sweep(
                tuple(int(n) for n in args.sweep_seqlens.split(",")),
                tuple(int(d) for d in args.sweep_head_dims.split(",")),
            ),
        ),
        ("window_sweep", window_sweep),
    )
    for name, step in steps:
        if name not in sections:
            continue
        t0 = time.time()
        try:
            result[name] = step()
        except Exception as exc:  # record and go on: one failure must not hide the rest
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name} FAILED: {type(exc).__name__}: {exc}", flush=True)
        result.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        save()
    if isinstance(result.get("timing"), list):
        print_table(result["timing"])


if __name__ == "__main__":
    main()
