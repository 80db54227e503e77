"""triton_flash's backward with the Gluon kernels (kernels_gluon_bwd) forced, beside the
pointer kernels' backward, the table's and PyTorch's cuDNN and flash kernels, in one
process.

For each shape (bf16, D = ``--head-dim``: 128, or 256 with its own Gluon rows), causal
and not: the backward alone (the forward run once, its graph kept) of the pointer
kernels (the rows the table gives calls that the Gluon kernels cannot serve, forced), of
the table's launch and, at each ``--stages``, of the Gluon dK/dV kernel, the Gluon dQ
kernel (each beside the other role's pointer row) and both (the backward then runs
split): the time of each in ms and TFLOP/s (2.5 x the forward's FLOPs, causal halved),
each gradient's largest difference from the pointer kernels', and the Triton kernels it
launched. The ratios: the pointer kernels' time, cuDNN's and flash's over each way's
(> 1: the way is faster). ``--kernel-times``: each way's kernels' device time a call
(torch.profiler), to see which kernel a way's time goes to.

    python benchmarks/gluon_bwd_probe.py [--shapes "4,16,16,4096;2,32,8,8192"] [--stages 2,3]
    python benchmarks/gluon_bwd_probe.py --head-dim 256 --shapes "4,8,8,4096;1,8,8,16384"
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from block_sparse_probe import kernel_us  # this folder's: scripts run with it on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnhub.backends.triton_flash import ops, tuning
from attnhub.backends.triton_flash.configs import GLUON_BWD, GLUON_BWD_256, backward_rows
from attnhub.timing import event_ms


def _backward(forward: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...],
              grad: torch.Tensor) -> tuple[Callable[[], tuple], tuple, list[str]]:  # fmt: skip
    """(a step that runs the backward of one forward again, that step's gradients, the
    Triton kernels its first run launched)."""
    out = forward()

    def step() -> tuple:
        return torch.autograd.grad(out, inputs, grad, retain_graph=True)

    launcher, launched = ops._launcher, []

    def recording(kernel, like):  # type: ignore[no-untyped-def]
        launched.append(kernel.fn.__name__)
        return launcher(kernel, like)

    ops._launcher = recording  # the first backward's kernels (the full path), named
    try:
        grads = step()
    finally:
        ops._launcher = launcher
    return step, grads, launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4,16,16,4096;2,32,8,8192", help="B,Hq,Hkv,N;...")
    parser.add_argument("--stages", default="2")
    parser.add_argument("--head-dim", type=int, choices=(128, 256), default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernel-times", action="store_true",
                        help="also each way's kernels' device time (torch.profiler)")  # fmt: skip
    args = parser.parse_args()
    torch.manual_seed(0)
    d = args.head_dim
    gluon_rows = GLUON_BWD if d == 128 else GLUON_BWD_256
    for text in args.shapes.split(";"):
        b, hq, hkv, n = (int(x) for x in text.split(","))
        for causal in (False, True):
            q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True) for _ in range(2))  # fmt: skip
            grad = torch.randn_like(q)
            flops = 4 * b * hq * n * n * d * 2.5 / (2 if causal else 1)
            print(f"B{b} Hq{hq} Hkv{hkv} N{n} D{d} bf16 {'causal' if causal else 'non-causal'}:"
                  " backward ms, TFLOP/s, ratios (other's time / this way's)")  # fmt: skip

            def flash(q=q, k=k, v=v, causal=causal) -> torch.Tensor:  # type: ignore[no-untyped-def]
                return ops.flash_attention(q, k, v, causal=causal)[0]

            ways: dict[str, tuple[Callable[[], tuple], tuple, list[str]]] = {}
            pointer = backward_rows(d, 2, causal, (9, 0), False, n, True)
            with tuning.override(**pointer):
                ways["pointer"] = _backward(flash, (q, k, v), grad)
            ways["table"] = _backward(flash, (q, k, v), grad)
            for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"),
                                  (SDPBackend.FLASH_ATTENTION, "sdpa flash")):  # fmt: skip
                try:
                    with sdpa_kernel(backend):
                        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v,
                                                 is_causal=causal, enable_gqa=hq != hkv)  # fmt: skip
                        ways[name] = _backward(sdpa, (q, k, v), grad)
                except RuntimeError as exc:
                    print(f"  {name}: {str(exc)[:100]}")
            for stages in (int(s) for s in args.stages.split(",")):
                rows = {role: dataclasses.replace(row, num_stages=stages)
                        for role, row in gluon_rows.items()}  # fmt: skip
                for label, roles in (("dK/dV", ("bwd_kv",)), ("dQ", ("bwd_q",)),
                                     ("both", ("bwd_kv", "bwd_q"))):  # fmt: skip
                    name = f"gluon {label}, {stages} stages"
                    with tuning.override(**{**pointer, **{role: rows[role] for role in roles}}):
                        try:
                            ways[name] = _backward(flash, (q, k, v), grad)
                        except Exception as exc:  # a configuration that does not fit: say so
                            print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            times = {}
            for name, (step, _, _) in ways.items():  # each graph keeps its forward's kernel
                times[name] = event_ms(step, args.iters, windows=3)
            reference = ways["pointer"][1]
            for name, (_, grads, kernels) in ways.items():
                diffs = " ".join(
                    f"{label} {(g.float() - r.float()).abs().max().item():.2e}"
                    for label, g, r in zip(("dq", "dk", "dv"), grads, reference)
                )
                ms = times[name]
                ratios = " ".join(f"{times[o] / ms:.2f}x {o}" for o in ("pointer", "cudnn", "sdpa flash")
                                  if o in times and o != name)  # fmt: skip
                print(f"  {name:22s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s  {ratios}  "
                      f"max|diff| vs pointer: {diffs}  {' '.join(kernels)}")  # fmt: skip
            if args.kernel_times:
                for name, (step, _, _) in ways.items():
                    shares = ", ".join(f"{k[:40]} {us:.0f}" for k, us in kernel_us(step, 5).items())
                    print(f"    {name}: device us a call: {shares}")


if __name__ == "__main__":
    main()
