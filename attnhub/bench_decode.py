"""KV-cache decoding on the GPU: triton_flash's split-KV op against PyTorch and Flex.

``attnhub bench --decode [-o FILE.json] [--quick] [--decode-sections ...] [--no-sweep]
[--no-flex]``, on a CUDA machine. Writes the JSON (default ``attnhub-decode.json``), a
markdown table (``.md``) and a plot of K/V bandwidth against cache length
(``-bandwidth.png``) beside it, and prints the table; ``attnhub bench --decode --report
FILE.json`` redraws the table and plot from a results file. Meant to finish within about
three minutes (a deadline skips the sections left, and says so in the JSON's
``skipped_sections``; ``--decode-sections`` runs those in a second call).

Issue 17's shapes, bf16, B=8, Hq 32 / Hkv 8, D=128, every sequence at the cache's full
length Nk (so PyTorch's kernels read exactly the same keys from the un-sliced cache):

- ``nq1``: Nq=1, Nk 4K / 32K / 128K: ours (contiguous cache), SDPA's flash, cuDNN and
  memory-efficient kernels (``enable_gqa=True``, each forced alone through
  ``sdpa_kernel``; one that refuses the call is listed with its error), and compiled
  FlexAttention (its decoding kernel).
- ``softcap_window``: softcap 50 and a (4096, 0) window, Nk 32K and 128K: ours and Flex
  (a score_mod and a block mask); PyTorch's kernels cannot serve it.
- ``paged``: ours on a paged copy of the same cache (shuffled pages of 16 and 256
  keys), Nk 32K and 128K, against ours on the contiguous cache.
- ``nq4``: Nq=4 bottom-right causal, Nk 32K: ours, Flex (block mask), and SDPA's
  cuDNN / efficient kernels with a bool mask.
- ``padded``: Nq=1 with a left-padded batch's (B, 1, 1, Nk) bool key mask (entry b keeps
  its last Nk - b * Nk / (2B) keys), Nk 4K and 32K, the decoding step of a padded
  ``generate``: ours (the key mask read tile by tile, the keys it masks never read),
  SDPA's cuDNN and memory-efficient kernels with the mask, and Flex (a padding block
  mask built once; and built in each call, as a model's changing mask needs).
  Bandwidth counts the kept keys only.
- In each of these, ours with the other merge than its default also runs (rows
  ``triton_decode_fused`` / ``..._two_launch``, and ``..._paged{P}_...``: the merge fused
  into the split kernel, decode.DecodeConfig.fused_merge, or a second launch): the A/B
  behind the default. The fused rows' errors show whether it is right on the GPU (the
  last program reads other SMs' partials).
- ``sweep`` (not with --no-sweep): launch configurations of ours (BLOCK_N, warps,
  stages) at Nq=1 Nk=32K, contiguous and 16-key pages, and split counts at Nk 32K
  and 4K: data for decode.default_config and the split heuristic (the default's
  split count is printed with each run: ``splits`` in the rows of ours).
- ``host``: wall time per call of a tiny decode (B=1, Hq 8 / Hkv 2, Nk 256, D=64),
  launch-bound, ours (with its cached launch plan, and without: decode.USE_PLANS)
  against F.scaled_dot_product_attention.

Timing: ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs), median.
Bandwidth: bytes of K and V the call must read (B * Hkv * keys * D * 2 tensors * 2 bytes;
keys = min(Nk, window + Nq) with the window) over the median time. Every output is
compared with a float32 reference (max abs error, beside SDPA flash's where present).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton

from attnhub import bench_report
from attnhub.backends.triton_flash import decode

DEV = "cuda"
B, HQ, HKV, D = 8, 32, 8, 128
DTYPE = torch.bfloat16
DEADLINE_S = 170.0  # the device's calls are limited; stop starting new sections after this
START = time.monotonic()  # reset by run()
SECTIONS = ("nq1", "softcap_window", "paged", "nq4", "padded", "host", "sweep")


def _elapsed() -> float:
    return time.monotonic() - START


def env() -> dict:
    commit = None
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = proc.stdout.strip() or None
    except OSError:
        pass
    props = torch.cuda.get_device_properties(0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "attnhub_commit": commit,
    }


def bench_ms(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def make_cache(nk: int, nq: int, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, HQ, nq, D, device=DEV, dtype=DTYPE, generator=g)
    k = torch.randn(B, HKV, nk, D, device=DEV, dtype=DTYPE, generator=g)
    v = torch.randn(B, HKV, nk, D, device=DEV, dtype=DTYPE, generator=g)
    seqlens = torch.full((B,), nk, device=DEV, dtype=torch.int32)
    return q, k, v, seqlens


def to_paged(cache: torch.Tensor, page_size: int, seed: int = 1):
    """(paged (B * pages, page_size, Hkv, D), block table (B, pages) int32): the same
    keys as ``cache`` in shuffled pages."""
    b, h, n, d = cache.shape
    pages = n // page_size
    logical = cache.view(b, h, pages, page_size, d).permute(0, 2, 3, 1, 4)
    logical = logical.reshape(b * pages, page_size, h, d)
    g = torch.Generator(device=DEV).manual_seed(seed)
    perm = torch.randperm(b * pages, device=DEV, generator=g)
    paged = torch.empty_like(logical)
    paged[perm] = logical
    return paged, perm.view(b, pages).to(torch.int32)


def reference(q, k, v, *, scale, window=None, softcap=None, key_mask=None):
    """float32 bottom-right causal attention (GQA by reshape, no expanded K/V);
    ``key_mask``: (B, Nk) bool, True = kept."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    qg = q.float().view(b, hkv, (hq // hkv) * nq, d)
    s = qg @ k.float().transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq, device=q.device).repeat(hq // hkv)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    pos = i + nk - nq
    keep = j <= pos
    if window is not None:
        keep &= j >= pos - window[0]
    s = s.masked_fill(~keep, float("-inf"))
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    out = torch.softmax(s, -1) @ v.float()
    return out.view(b, hq, nq, -1)


def kv_bytes(nk: int, nq: int, window: int | None) -> int:
    keys = nk if window is None else min(nk, window + nq)
    return B * HKV * keys * D * 2 * DTYPE.itemsize


def row(case: str, impl: str, ms: float | None, nbytes: int, err: float | None = None,
        error: str | None = None, **extra: Any) -> dict:  # fmt: skip
    tbs = nbytes / (ms * 1e-3) / 1e12 if ms else None
    r = {"case": case, "impl": impl, "ms": ms, "tb_s": tbs, "max_abs_err": err, **extra}
    if error:
        r["error"] = error[:300]
    tag = f"{ms:.4f} ms  {tbs:.2f} TB/s" if ms else f"failed: {error and error[:120]}"
    launch = f" splits={extra['splits']}" if "splits" in extra else ""
    print(f"  {case:<28} {impl:<22} {tag}  err={err}{launch}", flush=True)
    return r


def measure(case: str, impl: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None,
            nbytes: int, **extra: Any) -> dict:  # fmt: skip
    extra = {**getattr(fn, "launch", {}), **extra}
    try:
        out = fn()
        torch.cuda.synchronize()
        if hasattr(fn, "compiled_info"):
            try:
                extra.update(fn.compiled_info())
            except Exception as exc:  # the numbers are extra: never lose the timing
                extra["compiled_info_error"] = f"{type(exc).__name__}: {exc}"[:200]
        err = (out.float() - ref).abs().max().item() if ref is not None else None
        return row(case, impl, bench_ms(fn), nbytes, err, **extra)
    except Exception as exc:  # a kernel that refuses the call: recorded, not fatal
        return row(case, impl, None, nbytes, None, f"{type(exc).__name__}: {exc}", **extra)


def sdpa_impls() -> dict[str, Any]:
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_flash": SDPBackend.FLASH_ATTENTION,
        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def sdpa_fn(q, k, v, kernel, mask=None):
    from torch.nn.attention import sdpa_kernel

    def fn() -> torch.Tensor:
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return fn


_FLEX: dict[str, Any] = {}


def _compiled_flex() -> Any:
    """flex_attention compiled once for every case (dynamic=False: a graph per shape)."""
    if "compiled" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["compiled"]


def flex_fn(q, k, v, *, nq: int, window: int | None = None, softcap: float | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    nk = k.shape[2]
    offset = nk - nq
    block_mask = None
    if nq > 1 or window is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx + offset
            if window is not None:
                keep = keep & (kv_idx >= q_idx + offset - window)
            return keep

        block_mask = create_block_mask(mask_mod, None, None, nq, nk, device=DEV)
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    compiled = _compiled_flex()

    def fn() -> torch.Tensor:
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    return fn


def ours_fn(q, k, v, seqlens, *, block_table=None, window=None, softcap=None, config=None,
            key_mask=None):  # fmt: skip
    scale = 1.0 / math.sqrt(D)
    win = (window, 0) if window is not None else None

    def fn() -> torch.Tensor:
        return decode.decode_attention(q, k, v, seqlens, block_table=block_table, scale=scale,
                                       window=win, softcap=softcap, config=config,
                                       key_mask=key_mask)  # fmt: skip

    # The launch the op chooses (decode._plan, as decode_attention calls it), for the rows.
    paged = block_table is not None
    page = k.shape[1] if paged else 0
    plan = decode._plan(
        q.device, q.shape[0], k.shape[2] if paged else k.shape[1],
        HQ // (k.shape[2] if paged else k.shape[1]), q.shape[2], D, v.shape[-1],
        block_table.shape[1] * page if paged else k.shape[2], page, window is not None,
        softcap is not None, q.element_size(), "tf32", config,
        decode._key_mask_view(key_mask, q)[2],
    )  # fmt: skip

    def compiled_info() -> dict:
        """Registers, spills and shared memory of the compiled kernels (after a call):
        with the SM's 64K registers and 227 KiB, how many programs fit per SM."""
        key = decode._plan_key(q, k, v, seqlens, block_table, key_mask, scale, win, softcap,
                               True, config)  # fmt: skip
        cached = decode._PLANS.get(key)
        info: dict[str, Any] = {}
        for name in ("split", "merge"):
            launch = getattr(cached, name, None)
            compiled = getattr(launch, "_compiled", None)
            if compiled is not None:
                info[name + "_kernel"] = {
                    "regs": getattr(compiled, "n_regs", None),
                    "spills": getattr(compiled, "n_spills", None),
                    "shared": compiled.metadata.shared,
                }
        return info

    fn.compiled_info = compiled_info
    meta = plan.split_meta
    fn.launch = {
        "splits": plan.num_splits, "block_n": meta["BLOCK_N"], "block_m": meta["BLOCK_M"],
        "warps": meta["num_warps"], "stages": meta["num_stages"],
    }  # fmt: skip
    return fn


def other_merge(page_size: int | None) -> tuple[decode.DecodeConfig, str]:
    """The default launch with the other merge (decode.DecodeConfig's fused_merge
    flipped), and its rows' name suffix."""
    cfg = decode.default_config(D, DTYPE.itemsize, page_size)
    fused = not cfg.fused_merge
    other = decode.DecodeConfig(cfg.block_n, cfg.num_warps, cfg.num_stages, None, fused)
    return other, "_fused" if fused else "_two_launch"


def section_nq1(rows: list[dict], nks: list[int], flex: bool) -> None:
    for nk in nks:
        q, k, v, sl = make_cache(nk, 1)
        ref = reference(q, k, v, scale=D**-0.5)
        nb = kv_bytes(nk, 1, None)
        case = f"nq1-{nk // 1024}K"
        rows.append(measure(case, "triton_decode", ours_fn(q, k, v, sl), ref, nb))
        other, suffix = other_merge(None)
        fn = ours_fn(q, k, v, sl, config=other)
        rows.append(measure(case, "triton_decode" + suffix, fn, ref, nb))
        for name, kernel in sdpa_impls().items():
            rows.append(measure(case, name, sdpa_fn(q, k, v, kernel), ref, nb))
        if flex:
            rows.append(measure(case, "flex", flex_fn(q, k, v, nq=1), ref, nb))
        del q, k, v, ref
        torch.cuda.empty_cache()


def section_softcap_window(rows: list[dict], nks: list[int], flex: bool) -> None:
    for nk in nks:
        q, k, v, sl = make_cache(nk, 1, seed=2)
        ref = reference(q, k, v, scale=D**-0.5, window=(4096, 0), softcap=50.0)
        nb = kv_bytes(nk, 1, 4096)
        case = f"softcap50-window4096-{nk // 1024}K"
        fn = ours_fn(q, k, v, sl, window=4096, softcap=50.0)
        rows.append(measure(case, "triton_decode", fn, ref, nb))
        other, suffix = other_merge(None)
        fn = ours_fn(q, k, v, sl, window=4096, softcap=50.0, config=other)
        rows.append(measure(case, "triton_decode" + suffix, fn, ref, nb))
        if flex:
            rows.append(measure(case, "flex", flex_fn(q, k, v, nq=1, window=4096, softcap=50.0),
                                ref, nb))  # fmt: skip
        del q, k, v, ref
        torch.cuda.empty_cache()


def section_paged(rows: list[dict], nks: list[int], page_sizes: list[int]) -> None:
    for nk in nks:
        q, k, v, sl = make_cache(nk, 1, seed=3)
        ref = reference(q, k, v, scale=D**-0.5)
        nb = kv_bytes(nk, 1, None)
        case = f"paged-{nk // 1024}K"
        rows.append(measure(case, "triton_decode", ours_fn(q, k, v, sl), ref, nb))
        for p in page_sizes:
            kp, table = to_paged(k, p)
            vp, _ = to_paged(v, p)
            fn = ours_fn(q, kp, vp, sl, block_table=table)
            rows.append(measure(case, f"triton_decode_paged{p}", fn, ref, nb))
            other, suffix = other_merge(p)
            fn = ours_fn(q, kp, vp, sl, block_table=table, config=other)
            rows.append(measure(case, f"triton_decode_paged{p}{suffix}", fn, ref, nb))
            del kp, vp
        del q, k, v, ref
        torch.cuda.empty_cache()


def section_nq4(rows: list[dict], flex: bool) -> None:
    nk, nq = 32768, 4
    q, k, v, sl = make_cache(nk, nq, seed=4)
    ref = reference(q, k, v, scale=D**-0.5)
    nb = kv_bytes(nk, nq, None)
    case = "nq4-causal-32K"
    rows.append(measure(case, "triton_decode", ours_fn(q, k, v, sl), ref, nb))
    other, suffix = other_merge(None)
    fn = ours_fn(q, k, v, sl, config=other)
    rows.append(measure(case, "triton_decode" + suffix, fn, ref, nb))
    mask = torch.arange(nk, device=DEV)[None, :] <= torch.arange(nq, device=DEV)[:, None] + nk - nq
    for name, kernel in sdpa_impls().items():
        if name != "sdpa_flash":  # flash takes no mask, and its is_causal is top-left
            rows.append(measure(case, name + "_boolmask", sdpa_fn(q, k, v, kernel, mask), ref, nb))
    if flex:
        rows.append(measure(case, "flex", flex_fn(q, k, v, nq=nq), ref, nb))
    del q, k, v, ref
    torch.cuda.empty_cache()


def section_padded(rows: list[dict], nks: list[int], flex: bool) -> None:
    for nk in nks:
        q, k, v, sl = make_cache(nk, 1, seed=6)
        pads = torch.arange(B, device=DEV) * (nk // (2 * B))
        keep = torch.arange(nk, device=DEV)[None, :] >= pads[:, None]  # (B, Nk)
        mask = keep[:, None, None, :]
        ref = reference(q, k, v, scale=D**-0.5, key_mask=keep)
        nb = int(keep.sum().item()) * HKV * D * 2 * DTYPE.itemsize
        case = f"padded-{nk // 1024}K"
        rows.append(measure(case, "triton_decode", ours_fn(q, k, v, sl, key_mask=keep), ref, nb))
        for name, kernel in sdpa_impls().items():
            if name != "sdpa_flash":  # flash takes no mask
                rows.append(
                    measure(case, name + "_boolmask", sdpa_fn(q, k, v, kernel, mask), ref, nb)
                )
        if flex:
            fn = flex_padded_fn(q, k, v, pads, build_each_call=False)
            rows.append(measure(case, "flex", fn, ref, nb))
            fn = flex_padded_fn(q, k, v, pads, build_each_call=True)
            rows.append(measure(case, "flex_mask_built_per_call", fn, ref, nb))
        del q, k, v, ref
        torch.cuda.empty_cache()


def flex_padded_fn(q, k, v, pads, *, build_each_call: bool):
    """FlexAttention with a padding mask_mod; ``build_each_call``: the block mask is built
    in every call (timed with it), as a model whose mask changes each step builds it,
    else once (the kernel alone)."""
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = _compiled_flex()
    nk = k.shape[2]

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= pads[b]

    def build() -> Any:
        return create_block_mask(mask_mod, q.shape[0], None, 1, nk, device=DEV)

    built = None if build_each_call else build()

    def fn() -> torch.Tensor:
        block_mask = build() if built is None else built
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    return fn


# Sweep: (BLOCK_N, warps, stages) per layout (paged launches need two stages more for
# the same K/V buffering: decode.default_config), then split counts at the default
# configuration, at Nk 4K and 32K.
SWEEP_CONTIGUOUS = ((64, 4, 3), (64, 4, 2), (64, 4, 4), (32, 4, 3), (128, 4, 2), (64, 8, 3))
SWEEP_PAGED = ((64, 4, 5), (64, 4, 3), (64, 4, 4), (32, 4, 4), (128, 4, 4), (64, 8, 5))
SWEEP_SPLITS = (2, 4, 6, 8, 12, 16, 24, 32)


def section_sweep(rows: list[dict], quick: bool) -> None:
    for nk in (32768,) if quick else (32768, 4096):
        q, k, v, sl = make_cache(nk, 1, seed=5)
        ref = reference(q, k, v, scale=D**-0.5)
        nb = kv_bytes(nk, 1, None)
        kp, table = to_paged(k, 16)
        vp, _ = to_paged(v, 16)
        layouts = (("", (q, k, v, sl), None, SWEEP_CONTIGUOUS),
                   ("-paged16", (q, kp, vp, sl), table, SWEEP_PAGED))  # fmt: skip
        for suffix, tensors, bt, tiles in layouts:
            case = f"sweep-{nk // 1024}K{suffix}"
            default = decode.default_config(D, 2, 16 if bt is not None else None)
            points: list[tuple[int, int, int, int | None]] = (
                [(*t, None) for t in tiles] if nk == 32768 else []
            )
            points += [(default.block_n, default.num_warps, default.num_stages, sp)
                       for sp in SWEEP_SPLITS]  # fmt: skip
            for bn, w, st, sp in points[:6] if quick else points:
                if _elapsed() > DEADLINE_S:
                    rows.append({"case": case, "skipped": "deadline"})
                    return
                cfg = decode.DecodeConfig(bn, w, st, sp)
                label = f"bn{bn}-w{w}-s{st}-splits{sp or 'auto'}"
                fn = ours_fn(*tensors, block_table=bt, config=cfg)
                rows.append(measure(case, label, fn, ref, nb))
        del q, k, v, kp, vp, ref
        torch.cuda.empty_cache()


def section_host(rows: list[dict]) -> None:
    """Wall time per call, CPU-bound: a tiny call whose kernels take a few us."""
    q = torch.randn(1, 8, 1, 64, device=DEV, dtype=DTYPE)
    k = torch.randn(1, 2, 256, 64, device=DEV, dtype=DTYPE)
    v = torch.randn(1, 2, 256, 64, device=DEV, dtype=DTYPE)
    sl = torch.full((1,), 256, device=DEV, dtype=torch.int32)

    def unplanned() -> torch.Tensor:
        decode.USE_PLANS = False
        try:
            return decode.decode_attention(q, k, v, sl, scale=0.125)
        finally:
            decode.USE_PLANS = True

    calls = {
        "triton_decode": lambda: decode.decode_attention(q, k, v, sl, scale=0.125),
        "triton_decode_no_plan": unplanned,
        "sdpa_default": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
        rows.append({"case": "host-tiny", "impl": name, "us_per_call": best})
        print(f"  host-tiny {name:<22} {best:.1f} us/call", flush=True)


def summary(rows: list[dict]) -> dict:
    """Issue 17's criteria, as far as this run's rows decide them."""
    timed = [r for r in rows if r.get("ms")]

    def ms(case: str, impl: str) -> float | None:
        return next((r["ms"] for r in timed if r["case"] == case and r["impl"] == impl), None)

    out: dict[str, Any] = {}
    for case in sorted({r["case"] for r in timed}):
        ours = ms(case, "triton_decode")
        others = {r["impl"]: r["ms"] for r in timed if r["case"] == case
                  and not r["impl"].startswith("triton_decode")}  # fmt: skip
        if ours is None or case.startswith("sweep"):
            continue
        entry: dict[str, Any] = {"ours_tb_s": next(r["tb_s"] for r in timed if r["case"] == case
                                                   and r["impl"] == "triton_decode")}  # fmt: skip
        if others:
            best = min(others, key=others.__getitem__)
            entry["fastest_other"] = best
            entry["speed_vs_fastest_other"] = others[best] / ours  # > 1: ours faster
        for r in timed:
            if r["case"] == case and r["impl"].startswith("triton_decode_"):
                # paged: < 0.9 is more than 10% slower than contiguous; the other merge:
                # > 1 faster than the default's
                entry[r["impl"] + "_speed_vs_default"] = ours / r["ms"]
        out[case] = entry
    return out


def markdown(meta: dict, rows: list[dict], summ: dict) -> str:
    lines = [
        "# KV-cache decode on the GPU (attnhub bench --decode)",
        "",
        f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, "
        f"commit {meta['attnhub_commit']}. bf16, B={B}, Hq {HQ} / Hkv {HKV}, D={D}. TB/s: bytes "
        "of K/V the call must read over the do_bench median.",
        "",
        "| case | impl | ms | TB/s | max abs err vs fp32 | launch | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "ms" not in r:
            continue
        ms = f"{r['ms']:.4f}" if r["ms"] else "-"
        tbs = f"{r['tb_s']:.2f}" if r.get("tb_s") else "-"
        err = f"{r['max_abs_err']:.2e}" if r.get("max_abs_err") is not None else "-"
        launch = (f"n{r['block_n']} w{r['warps']} s{r['stages']} x{r['splits']}"
                  if "splits" in r else "")  # fmt: skip
        if "split_kernel" in r:
            launch += " r{regs} smem{shared}".format(**r["split_kernel"])
        lines.append(f"| {r['case']} | {r['impl']} | {ms} | {tbs} | {err} | {launch} | "
                     f"{r.get('error', '')[:80]} |")  # fmt: skip
    host = [r for r in rows if r.get("case") == "host-tiny"]
    if host:
        lines += ["", "| host, tiny call | us/call |", "|---|---|"]
        lines += [f"| {r['impl']} | {r['us_per_call']:.1f} |" for r in host]
    lines += ["", "## Against issue 17's criteria", "", "```", json.dumps(summ, indent=1), "```"]
    return "\n".join(lines) + "\n"


def run(quick: bool = False, flex: bool = True, sections: tuple[str, ...] = SECTIONS) -> dict:
    """Time the chosen ``sections`` (``SECTIONS``; the module docstring says what each
    holds) and return ``{"kind": "decode", "meta", "rows", "summary"}``."""
    global START
    START = time.monotonic()
    meta = env()
    print(json.dumps(meta), flush=True)
    nks = [4096, 32768] if quick else [4096, 32768, 131072]
    long = [32768] if quick else [32768, 131072]
    rows: list[dict] = []
    runners: dict[str, Callable[[], None]] = {
        "nq1": lambda: section_nq1(rows, nks, flex),
        "softcap_window": lambda: section_softcap_window(rows, long, flex),
        "paged": lambda: section_paged(rows, long, [16, 256]),
        "nq4": lambda: section_nq4(rows, flex),
        "padded": lambda: section_padded(rows, nks[:2], flex),
        "host": lambda: section_host(rows),
        "sweep": lambda: section_sweep(rows, quick),
    }
    skipped = []
    for name in sections:
        if _elapsed() > DEADLINE_S:
            skipped.append(name)
            continue
        print(f"[{_elapsed():6.1f}s] {name}", flush=True)
        try:
            runners[name]()
        except Exception as exc:  # keep what the other sections measured
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"[:500]})
            print(f"  section {name} failed: {exc}", flush=True)
    meta["elapsed_s"] = round(_elapsed(), 1)
    meta["skipped_sections"] = skipped
    return {"kind": "decode", "meta": meta, "rows": rows, "summary": summary(rows)}


def plot(data: dict, path: pathlib.Path) -> pathlib.Path | None:
    """TB/s of K/V read against the cache length, one line per implementation, for the
    Nq=1 cases (``nq1-*``) and the paged ones (``paged-*``); None without matplotlib or
    such rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in data["rows"]:
        case, impl = r.get("case", ""), r.get("impl")
        if not r.get("tb_s") or not case.startswith(("nq1-", "paged-")):
            continue
        nk = int(case.rsplit("-", 1)[1].removesuffix("K")) * 1024
        if case.startswith("paged-") and impl == "triton_decode":
            continue  # the contiguous row again, as the paged cases' baseline
        lines.setdefault(impl, []).append((nk, r["tb_s"]))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl, points in sorted(lines.items()):
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache length Nk (keys per sequence)")
    ax.set_ylabel("K/V read, TB/s")
    meta = data.get("meta", {})
    ax.set_title(f"decode, Nq=1, B={B} Hq {HQ} / Hkv {HKV} D={D} bf16 ({meta.get('gpu', '?')})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(data: dict, output: pathlib.Path, plots: bool = True) -> list[pathlib.Path]:
    """The markdown table (``.md``) and the plot (``-bandwidth.png``) beside ``output``."""
    md = output.with_suffix(".md")
    md.write_text(
        markdown(data["meta"], data["rows"], data.get("summary") or summary(data["rows"]))
    )
    written = [md]
    if plots:
        png = plot(data, output.with_name(output.stem + "-bandwidth.png"))
        if png is not None:
            written.append(png)
    return written


def main(args: argparse.Namespace) -> int:
    """``attnhub bench --decode`` (see the module docstring)."""
    if args.report:
        (source,) = args.report
        try:
            data = bench_report.load(source, ("meta", "rows"), "decode")
        except ValueError as exc:
            print(f"attnhub bench --decode: {exc}", file=sys.stderr)
            return 2
        output = pathlib.Path(args.output or source)
    else:
        if not torch.cuda.is_available():
            print("attnhub bench --decode: needs a CUDA GPU", file=sys.stderr)
            return 2
        sections = tuple(args.decode_sections.split(",")) if args.decode_sections else SECTIONS
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            print(f"attnhub bench --decode-sections: unknown {', '.join(unknown)} "
                  f"(sections: {', '.join(SECTIONS)})", file=sys.stderr)  # fmt: skip
            return 2
        if args.no_sweep:
            sections = tuple(s for s in sections if s != "sweep")
        output = pathlib.Path(args.output or "attnhub-decode.json")
        data = run(args.quick, args.flex, sections)
    output.write_text(json.dumps(data, indent=1))
    written = [output, *write_report(data, output, plots=args.plots)]
    print(written[1].read_text())
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0
