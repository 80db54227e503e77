"""Where triton_blocksparse's backward spends its time, layout by layout.

The block-sparse bench (``attnhub bench --block-sparse``) reads the backward against
FlexAttention's per layout; this splits it into its CUDA kernels (preprocess, dK/dV,
dQ and anything else launched) from the profiler, dense triton_flash's first (the
table's backward, and its pointer rows merged and split), with the layout's facts (kept
blocks, empty rows and columns, the heavy-first counts), for the bench's shape (B2 H16
N8192 D128 bf16, block 128) by default::

    python benchmarks/block_sparse_probe.py [--shape B,H,N,D] [--layouts random:0.05,...]

``--forward`` times the forward instead: the pointer kernel (the table's row without
Gluon, forced), what the table picks (the Gluon forward on layouts with long rows:
``triton_blocksparse.ops._GLUON_MIN_KEYS``) and the Gluon forward under forced rows of
128 and 64 keys (``--gluon-key-tiles``), each with its output's and lse's largest
difference from the pointer kernel's, dense triton_flash's forward beside them.

``--gluon-backward`` also times each layout's backward on the pointer kernels (the rows
without Gluon, forced) and with the Gluon backward kernels forced
(``kernels_gluon.bs_bwd_dq_gluon_kernel`` through a ``bwd_q`` row with gluon=True,
``bs_bwd_dkdv_gluon_kernel`` through a ``bwd_kv`` one; each alone beside the other
role's pointer row, then both), with their kernels and the gradients' largest
difference from the pointer backward's; the ratios are the pointer backward's time
over each way's.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import defaultdict
from typing import Any

import torch

import attnhub
from attnhub.backends.triton_blocksparse import ops as bs_ops
from attnhub.backends.triton_flash import tuning
from attnhub.backends.triton_flash.configs import GLUON_BWD, LaunchConfig, backward_rows
from attnhub.bench import build_layout
from attnhub.timing import loop_ms


def kernel_us(step, iters: int = 10) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """CUDA time per step (us) of each kernel ``step`` launches, the longest first (the
    profiler's per-kernel totals over ``iters`` steps); none without CUDA (a smoke run)."""
    if not torch.cuda.is_available():
        return {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total:
            times[event.key] += event.self_device_time_total / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _kernels(times: dict[str, float]) -> str:
    return ", ".join(f"{name[:24]} {us:.0f} us" for name, us in times.items())


def forwards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layouts: str,
             device: torch.device, key_tiles: list[int]) -> None:  # fmt: skip
    """Per layout: the forward's time (ms) on the pointer kernel (the table's row without
    Gluon, forced), on what the table picks, and on the Gluon one (forced rows of 128 rows
    and each of ``key_tiles`` keys), and each one's largest output and lse difference from
    the pointer kernel's."""
    b, h, n, d = q.shape
    pointer_row = bs_ops._launch_config("fwd", d, q, False, n, gluon=False)
    with torch.no_grad():

        def dense() -> torch.Tensor:
            return attnhub.attention(q, k, v, backend="triton_flash")  # type: ignore[no-any-return]

        dense()  # compiles (the first call's compile read 129 ms a call over 20 calls)
        ms = loop_ms(dense, device, 20)
        print(f"shape B{b} H{h} N{n} D{d} {q.dtype}, block 128; dense triton_flash forward "
              f"{ms:.3f} ms; pointer row {pointer_row}")  # fmt: skip
        for text in layouts.split(","):
            kind, param = text.split(":")
            layout = build_layout((kind, float(param)), n, 128, device=device)

            def fwd(layout: Any = layout) -> tuple[torch.Tensor, torch.Tensor]:
                return bs_ops.block_sparse_attention(q, k, v, layout)  # type: ignore[no-any-return]

            with tuning.override(fwd=pointer_row):
                out_p, lse_p = fwd()
                ms_p = loop_ms(fwd, device, 20)
            long_rows = bs_ops._facts[layout].long_rows  # (the calls above built the facts)
            print(f"{text}: pointer {ms_p:.3f} ms; long rows (Gluon from the table) {long_rows}")
            finite = torch.isfinite(lse_p)
            ways = [("table", None)] + [
                ("forced", LaunchConfig(128, block_n, 4, 2, gluon=True)) for block_n in key_tiles
            ]
            for what, row in ways:
                with tuning.override(fwd=row) if row else contextlib.nullcontext():
                    out_g, lse_g = fwd()
                    ms_g, us_g = loop_ms(fwd, device, 20), kernel_us(fwd)
                diff_out = (out_g.float() - out_p.float()).abs().max().item()
                diff_lse = (
                    (lse_g[finite] - lse_p[finite]).abs().max().item() if finite.any() else 0.0
                )
                same_empty = torch.equal(finite, torch.isfinite(lse_g))
                print(f"    {what} {row or ''} {ms_g:.3f} ms ({_kernels(us_g)}): "
                      f"{ms_p / ms_g:.2f}x the pointer kernel's speed; - pointer: out "
                      f"{diff_out:.3g}, lse {diff_lse:.3g}, same rows without keys {same_empty}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="2,16,8192,128")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--layouts",
        default="random:1,random:0.25,random:0.1,random:0.05,sliding_window:1024,bigbird:2",
    )
    parser.add_argument("--forward", action="store_true", help="the forwards (see above)")
    parser.add_argument("--gluon-key-tiles", default="128,64",
                        help="--forward: the forced Gluon rows' key tiles")  # fmt: skip
    parser.add_argument("--gluon-backward", action="store_true",
                        help="also the backward with the Gluon kernels forced")  # fmt: skip
    args = parser.parse_args()
    b, h, n, d = (int(x) for x in args.shape.split(","))
    device = torch.device(args.device)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # --device cpu: a smoke run
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))  # fmt: skip
    g = torch.randn_like(q)
    if args.forward:
        forwards(q, k, v, args.layouts, device, [int(x) for x in args.gluon_key_tiles.split(",")])
        return
    print(f"shape B{b} H{h} N{n} D{d} {dtype}, block 128; backward kernels, us per step")
    # Dense triton_flash beside it: the table's backward, and its pointer rows (those of
    # calls the Gluon kernels cannot serve) in both launch modes.
    key = (d, q.element_size(), False, bs_ops._capability(device), bs_ops.interpreting(), n, True)
    dense_rows = backward_rows(*key)
    for launch, rows in (("the table's", {}), ("pointer rows, merged", {**dense_rows, "backward_launch": "merged_heads"}),
                         ("pointer rows, split", {**dense_rows, "backward_launch": "split"})):  # fmt: skip
        with tuning.override(**rows):
            out = attnhub.attention(q, k, v, backend="triton_flash")

        def dense(out: torch.Tensor = out) -> None:
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

        dense()
        print(f"dense triton_flash, {launch} backward: {loop_ms(dense, device, 20):.3f} ms")
        for name, us in kernel_us(dense).items():
            print(f"    {us:9.1f}  {name[:60]}")
    for text in args.layouts.split(","):
        kind, param = text.split(":")
        layout = build_layout((kind, float(param)), n, 128, device=device)
        out = attnhub.attention(q, k, v, block_sparse=layout, backend="triton_blocksparse")
        bs_ops.layout_tensors(layout, device)
        facts = bs_ops._facts[layout]
        kept = layout.block_mask
        rows_empty = int((kept.sum(-1) == 0).sum())
        cols_empty = int((kept.sum(-2) == 0).sum())

        def bwd(out: torch.Tensor = out) -> tuple[torch.Tensor, ...]:
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

        reference = bwd()  # compiles
        ms = loop_ms(bwd, device, 20)
        print(f"{text}: density {kept.float().mean():.3f}, rows/cols without a block "
              f"{rows_empty}/{cols_empty}, heavy rows/cols {facts.heavy_rows}/"
              f"{facts.heavy_cols}, partial {facts.has_partial}, long rows/cols (Gluon dQ/"
              f"dK/dV from the table) {facts.long_rows}/{facts.long_cols}; backward "
              f"{ms:.3f} ms")  # fmt: skip
        for name, us in kernel_us(bwd).items():
            print(f"    {us:9.1f}  {name[:60]}")
        if not args.gluon_backward:
            continue
        pointer = {role: bs_ops._launch_config(role, d, q, False, n) for role in GLUON_BWD}
        ways = {"pointer rows": pointer}
        for roles in (("bwd_q",), ("bwd_kv",), ("bwd_q", "bwd_kv")):
            ways[f"Gluon {'+'.join(roles)}"] = {
                **pointer,
                **{role: GLUON_BWD[role] for role in roles},
            }
        for label, rows in ways.items():
            with tuning.override(**rows):
                out_g = attnhub.attention(
                    q, k, v, block_sparse=layout, backend="triton_blocksparse"
                )

            def bwd_g(out: torch.Tensor = out_g) -> tuple[torch.Tensor, ...]:
                return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

            grads = bwd_g()
            ms_g = loop_ms(bwd_g, device, 20)
            if label == "pointer rows":  # the first way: the others' reference
                reference, pointer_ms = grads, ms_g
            diffs = " ".join(
                f"{name} {(x.float() - r.float()).abs().max().item():.2e}"
                for name, x, r in zip(("dq", "dk", "dv"), grads, reference)
            )
            print(f"  {label} forced: backward {ms_g:.3f} ms ({pointer_ms / ms_g:.2f}x the "
                  f"pointer rows'; the table's {ms / ms_g:.2f}x), max|diff| {diffs}")  # fmt: skip
            for name, us in kernel_us(bwd_g).items():
                print(f"    {us:9.1f}  {name[:60]}")


if __name__ == "__main__":
    main()
