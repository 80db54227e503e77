"""A patched model's padded forward under ``torch.inference_mode`` against ``no_grad``.

Under ``torch.inference_mode`` the masks a model builds are inference tensors, which
keep no version counter, so attnhub's tensor memo (:mod:`attnhub.tensor_memo`) keeps
nothing for them: a patched model's layers each read their shared mask's structure
anew (:mod:`attnhub.mask_structure`, a few passes and synchronizations), where under
``no_grad`` the first layer's reading serves them all. This times one forward of a
Hugging Face model (the models bench's spec, its weights on one model for every way)
on a left-padded batch (a (B, 1, N, N) causal and padding mask every forward), stock
and patched, under each mode, in rotating rounds, and counts the mask readings::

    python benchmarks/inference_mode_probe.py [--model llama] [--batch 8] \
        [--seqlens 512,4096] [--rounds 6] [--device cuda] [--snapshot-bytes 0]

Prints, per sequence length, each way's median milliseconds a forward, its ratio to
stock's in the same mode, and the structure readings a forward made.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import attnhub
from attnhub import bench_models as bm
from attnhub import mask_structure, tensor_memo
from attnhub.timing import rotated, synchronize

MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}
WAYS = tuple(f"{way} {mode}" for mode in MODES for way in ("stock", "patch"))


def _forward(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, device: torch.device, way: str
) -> float:
    """Seconds of one forward the way ``way`` says ("patch inference_mode", ...)."""
    kind, mode = way.split()
    patched = attnhub.patch(aliases=False) if kind == "patch" else contextlib.nullcontext()
    with patched, MODES[mode]():
        synchronize(device)
        start = time.perf_counter()
        model(ids, attention_mask=mask)
        synchronize(device)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlens", default="512,4096")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--snapshot-bytes",
        type=int,
        help="tensor_memo.SNAPSHOT_BYTES for the run (0: inference tensors' masks are read "
        "at every call, as before the snapshots)",
    )
    args = parser.parse_args()
    if args.snapshot_bytes is not None:
        tensor_memo.SNAPSHOT_BYTES = args.snapshot_bytes
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (spec,) = [m for m in bm.MODELS if m.name == args.model]
    model, _ = bm.build_shared(spec, dtype, device, 32000)  # built running stock's
    readings = [0]
    recognize = mask_structure._recognize

    def counted(mask: torch.Tensor) -> Any:
        readings[0] += 1
        return recognize(mask)

    mask_structure._recognize = counted
    print(
        f"# {args.model}, B{args.batch}, left-padded, "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}, {args.rounds} rounds, "
        f"snapshots up to {tensor_memo.SNAPSHOT_BYTES} bytes"
    )
    for n in (int(s) for s in args.seqlens.split(",")):
        # The models bench's left-padded prompts (entry b pads b * N / (2B) keys).
        sized = dataclasses.replace(spec, gen_batch=args.batch, prompt=n)
        ids, mask = bm._inputs(sized, 32000, device)[1]["generate_padded"]
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        reads: dict[str, int] = {}

        forward = functools.partial(_forward, model, ids, mask, device)
        for way in WAYS:  # warm-up: compiles, autotuning, caches
            forward(way)
            readings[0] = 0
            forward(way)
            reads[way] = readings[0]
        for r in range(args.rounds):
            for way in rotated(WAYS, r):
                times[way].append(forward(way))
        print(f"\nN={n}: way, median ms a forward, x stock in the same mode, mask readings")
        for way in WAYS:
            median = statistics.median(times[way]) * 1e3
            stock = statistics.median(times[f"stock {way.split()[1]}"]) * 1e3
            print(f"  {way:24s} {median:9.2f}  {stock / median:5.2f}x  {reads[way]}")
    mask_structure._recognize = recognize


if __name__ == "__main__":
    main()
