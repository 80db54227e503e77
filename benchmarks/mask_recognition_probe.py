"""What recognizing a dense mask's structure costs (attnhub.mask_structure), per mask.

A patched model passes ``F.scaled_dot_product_attention`` a new mask tensor every
forward (Hugging Face's ``sdpa`` path builds one per step: (B, 1, Nq, Nk) bool, or
(B, 1, 1, Nk) while decoding with padding); the patch reads the structure of a mask of
several query rows once per tensor (a decoding step's it leaves unread:
patching._reads_mask). This times, wall clock per mask with the host's launches and
synchronizations included, that reading with the reading of the plan's key mask's rows
that a backend then makes (given with the structure's reading), by the fused kernels
(backends/triton_flash/mask_reading.py, on CUDA) and by PyTorch's ops, in one run, and
a whole patched decoding call with a fresh mask each call against PyTorch's own call
with that mask::

    python benchmarks/mask_recognition_probe.py [--calls 200] [--device cuda] [--profile N]

``--profile N``: also a cProfile of one loop of each prefill mask's fused reading (the N
functions with the most own time): how much of it is Triton's per-launch binder.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import pstats

import torch
import torch.nn.functional as F

import attnhub
from attnhub import mask_rows, mask_structure
from attnhub.timing import loop_ms


def _padded(b: int, nq: int, nk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(B, 1, Nq, Nk) bool: left padding of 0 .. nk/2 keys per batch entry, causal
    (bottom-right) or not."""
    j = torch.arange(nk, device=device)
    pad = torch.linspace(0, nk // 2, b, device=device).long()
    keep = (j[None, :] >= pad[:, None])[:, None, None, :].expand(b, 1, nq, nk)
    if causal:
        i = torch.arange(nq, device=device)[:, None] + (nk - nq)
        keep = keep & (j[None, :] <= i)
    return keep.contiguous()


def _recognize_unkept(keep: torch.Tensor, fused: bool) -> mask_structure.MaskPlan | None:
    """mask_structure's reading of ``keep`` as a new mask's (the rows' memo,
    attnhub.mask_rows, forgotten first), by the fused kernels or (not ``fused``)
    PyTorch's ops, and what a patched forward's backend then reads of the plan's key
    mask (triton_flash's key ranges: its rows, given with the structure's reading)."""
    mask_rows._memo.clear()
    devices = mask_structure.FUSED_DEVICES
    mask_structure.FUSED_DEVICES = frozenset({keep.device.type} if fused else ())
    try:
        plan = mask_structure._recognize(keep)
    finally:
        mask_structure.FUSED_DEVICES = devices
    if plan is not None and plan.attn_mask is not None:
        mask_rows.row_keys(plan.attn_mask)
    return plan


def _decode_calls(q: torch.Tensor, nk: int, calls: int) -> str:
    """A decoding call as a patched model makes it, with a fresh (B, 1, 1, Nk) mask each
    call (what each step's first layer pays) and with the same mask (the other layers),
    beside F.sdpa and attnhub.attention given the key mask directly (no structure read)."""
    device = q.device
    k, v = (torch.randn(8, 8, nk, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    pool = [_padded(8, 1, nk, False, device) for _ in range(calls)]
    it = iter(range(10**9))

    def fresh() -> torch.Tensor:
        return pool[next(it) % len(pool)].clone()

    def same() -> torch.Tensor:
        return pool[0]

    def through(fn, masks, **extra) -> None:  # type: ignore[no-untyped-def]
        fn(q, k, v, attn_mask=masks(), **extra)

    cells = []
    for way in ("F.sdpa", "patched", "attention()"):
        with attnhub.patch(aliases=False) if way == "patched" else contextlib.nullcontext():
            fn = (
                functools.partial(through, attnhub.attention)
                if way == "attention()"
                else functools.partial(through, F.scaled_dot_product_attention, enable_gqa=True)
            )
            for masks in (fresh, same):
                fn(masks)
                attnhub.reset_stats()
                ms = min(loop_ms(functools.partial(fn, masks), device, calls) for _ in range(3))
                served = attnhub.stats()
                cells.append(
                    f"{way} {masks.__name__} mask {ms * 1e3:.1f} (served: {served or 'PyTorch'})"
                )
    return f"decode call B8 Hq32/Hkv8 Nk{nk} D128 bf16, left-padded mask, us a call: " + "; ".join(
        cells
    )


def _same(a: mask_structure.MaskPlan | None, b: mask_structure.MaskPlan | None) -> bool:
    if a is None or b is None:
        return a is b
    masks = (a.attn_mask, b.attn_mask)
    return (a.causal, a.alignment, a.window) == (b.causal, b.alignment, b.window) and (
        masks == (None, None) or (None not in masks and torch.equal(*masks))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}; us per mask, fastest of 3 loops of {args.calls}")  # fmt: skip
    masks = {
        "prefill B8 N512 causal left-padded": _padded(8, 512, 512, True, device),
        "prefill B8 N4096 causal left-padded": _padded(8, 4096, 4096, True, device),
    }
    for name, keep in masks.items():
        plan = mask_structure._recognize(keep)
        cells = []
        for fused in (True, False):
            read = functools.partial(_recognize_unkept, keep, fused)
            if not _same(read(), plan):
                raise SystemExit(f"{name}: the {'fused' if fused else 'PyTorch'} reading differs")
            us = min(loop_ms(read, device, args.calls) for _ in range(3)) * 1e3
            cells.append(f"{'fused kernels' if fused else 'PyTorch ops'} {us:.1f} us")
        print(f"{name}: {'; '.join(cells)}; plan: {plan.describe() if plan else None}")
        if args.profile:
            profiler = cProfile.Profile()
            read = functools.partial(_recognize_unkept, keep, True)
            profiler.enable()
            for _ in range(args.calls):
                read()
            profiler.disable()
            print(f"## {name}, the fused reading: cProfile of {args.calls} readings, by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)

    if device.type != "cuda":
        return
    q = torch.randn(8, 32, 1, 128, device=device, dtype=torch.bfloat16)
    for nk in (576, 4096):
        print(_decode_calls(q, nk, args.calls))


if __name__ == "__main__":
    main()
