"""Context-parallel attention: tokens/s against sequence length and world size.

attnhub's ring (:func:`attnhub.distributed.context_parallel_attention`, each step an
``attnhub.attention`` call) and PyTorch's ``context_parallel``
(``torch.distributed.tensor.experimental``, ring attention over SDPA's own kernels) on
the same inputs and the same shards, forward (no grad) and forward+backward. One
process per GPU, launched with torchrun; every invocation is one world size:

    torchrun --standalone --nproc-per-node=1 benchmarks/context_parallel.py --out DIR
    torchrun --standalone --nproc-per-node=2 benchmarks/context_parallel.py --out DIR

Each writes ``DIR/context-parallel-ws{R}.json`` and then (re)builds, from every
``context-parallel-ws*.json`` in DIR, ``DIR/context-parallel.md`` (a table) and
``DIR/context-parallel.png`` (tokens/s against N, one line per implementation and world
size), so running it for 1, 2, 4 and 8 GPUs into one DIR gives one table and plot (use
one DIR per configuration: shapes, dtype and mask are listed per file, not per row).

What is measured: the median over ``--iters`` calls of the slowest rank's time per call
(CUDA events, after ``--warmup`` calls; a barrier before each timed window), and tokens/s
= B * N / that time, N the full sequence length (so tokens/s per GPU is that / R). Also
the peak memory per rank, and which attnhub backends served the steps (attnhub.stats()).
Before timing, both implementations are checked on a ``--check-seqlen`` sequence
against one float32 ``torch_reference`` call on the gathered sequence (max abs error in
the JSON and the table).

World size 1 adds the single-device calls (``attnhub.attention`` and
``F.scaled_dot_product_attention`` on the whole sequence): the ring's overhead.

PyTorch's ``context_parallel`` serves causal or no mask, equal head counts and no
softcap; other configurations list it as skipped with the reason. It is CUDA only
(its ring handles the CUDA SDPA ops); ``--device cpu`` (gloo) runs attnhub's side
alone, a smoke test of the script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnhub
from attnhub import distributed as cp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument(
        "--seqlens",
        default="4096,8192,16384,32768,65536,131072",
        help="full sequence lengths N, comma-separated (multiples of 2R)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--mask", choices=("causal", "none"), default="causal")
    p.add_argument("--window", default=None, help="LEFT,RIGHT (attnhub only)")
    p.add_argument("--softcap", type=float, default=None, help="(attnhub only)")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument(
        "--impls",
        default="attnhub_cp,torch_cp",
        help="attnhub_cp, torch_cp; at world size 1 also attnhub_single, sdpa_single",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="attnhub backend(s) for the ring steps, comma-separated (default: dispatch)",
    )
    p.add_argument(
        "--torch-kernel",
        choices=("flash", "efficient", "cudnn", "auto"),
        default="flash",
        help="SDPA kernel for PyTorch's context_parallel and sdpa_single",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check-seqlen", type=int, default=2048)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process group timeout")
    p.add_argument("--tag", default="", help="a label stored with the results")
    args = p.parse_args(argv)  # fmt: skip
    args.seqlens = [int(n) for n in args.seqlens.split(",") if n]
    args.modes = [m for m in args.modes.split(",") if m]
    args.impls = [i for i in args.impls.split(",") if i]
    args.kv_heads = args.kv_heads or args.heads
    args.window = None if args.window is None else tuple(
        None if s in ("", "none", "None") else int(s) for s in args.window.split(",")
    )  # fmt: skip
    if args.backend is not None:
        names = tuple(b for b in args.backend.split(",") if b)
        args.backend = names[0] if len(names) == 1 else names
    return args


# ---------------------------------------------------------------------------
# Setup


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """The process group from torchrun's environment (one process per GPU)."""
    if "RANK" not in os.environ:  # plain `python benchmarks/context_parallel.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=args.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return dist.get_rank(), dist.get_world_size(), device


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def full_inputs(
    args: argparse.Namespace, n: int, device: torch.device, seed: int
) -> list[torch.Tensor]:
    """q, k, v and the output gradient of the whole sequence, the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[args.dtype]
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    shapes = [(b, h, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, h, n, d)]
    return [torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes]


def layout_for(args: argparse.Namespace) -> str:
    # PyTorch's context_parallel balances causal calls with its head-tail balancer, the
    # zigzag layout, and refuses to balance non-causal ones (contiguous shards): the
    # same shards on both sides.
    return "zigzag" if args.mask == "causal" else "contiguous"


def attention_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"causal": args.mask == "causal", "window": args.window, "softcap": args.softcap}


# ---------------------------------------------------------------------------
# The implementations: each returns (forward, forward+backward) closures on its inputs


def torch_cp_reason(args: argparse.Namespace, device: torch.device) -> str | None:
    """Why PyTorch's context_parallel cannot run this configuration (None: it can)."""
    if device.type != "cuda":
        return "PyTorch's context_parallel handles the CUDA SDPA ops only"
    if args.window is not None or args.softcap is not None:
        return "SDPA has no window or softcap"
    if args.kv_heads != args.heads:
        return "grouped-query heads are not run through PyTorch's ring here"
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError as exc:
        return f"not in this PyTorch: {exc}"
    return None


def _sdpa_kernel(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    if args.torch_kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kinds = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }
    return sdpa_kernel([kinds[args.torch_kernel]])


_mesh: Any = None  # one device mesh per process (it is made of the default group)


@contextlib.contextmanager
def torch_cp_context(
    args: argparse.Namespace, world: int, device: torch.device, tensors: list[torch.Tensor]
) -> Iterator[list[torch.Tensor]]:
    """PyTorch's context_parallel over copies of ``tensors`` (sharded in place inside)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    global _mesh
    if _mesh is None:
        _mesh = init_device_mesh(device.type, (world,))
    mesh = _mesh
    buffers = [t.detach().clone() for t in tensors]
    balance = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = args.mask == "causal"
    try:
        with (
            context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)),
            _sdpa_kernel(args),
        ):
            yield buffers
    finally:
        _cp_options.enable_load_balance = balance


def attnhub_cp_fns(
    args: argparse.Namespace, shards: list[torch.Tensor]
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    q, k, v, dout = shards
    options = attention_options(args)
    layout = layout_for(args)

    def forward() -> Any:
        with torch.no_grad():
            return cp.context_parallel_attention(
                q, k, v, **options, layout=layout, backend=args.backend
            )

    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def forward_backward() -> Any:
        out = cp.context_parallel_attention(
            qg, kg, vg, **options, layout=layout, backend=args.backend
        )
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    return forward, forward_backward


def sdpa_fns(
    args: argparse.Namespace, tensors: list[torch.Tensor], kernel: bool = True
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """F.scaled_dot_product_attention on ``tensors`` (PyTorch's ring when they are
    context_parallel's buffers, the single-device call otherwise)."""
    q, k, v, dout = tensors
    causal = args.mask == "causal"
    gqa = args.kv_heads != args.heads

    def forward() -> Any:
        with torch.no_grad(), _sdpa_kernel(args) if kernel else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    def forward_backward() -> Any:
        for t in (q, k, v):
            t.requires_grad_(True)
        try:
            with _sdpa_kernel(args) if kernel else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                return torch.autograd.grad(out, (q, k, v), dout)
        finally:
            for t in (q, k, v):
                t.requires_grad_(False)

    return forward, forward_backward


def attnhub_single_fns(
    args: argparse.Namespace, tensors: list[torch.Tensor]
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    q, k, v, dout = tensors
    options = attention_options(args)

    def forward() -> Any:
        with torch.no_grad():
            return attnhub.attention(q, k, v, **options, backend=args.backend)

    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))

    def forward_backward() -> Any:
        out = attnhub.attention(qg, kg, vg, **options, backend=args.backend)
        return torch.autograd.grad(out, (qg, kg, vg), dout)

    return forward, forward_backward


# ---------------------------------------------------------------------------
# Timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> float:
    """The median ms per call of the slowest rank (all ranks run ``fn`` together)."""
    for _ in range(args.warmup):
        fn()
    _sync(device)
    dist.barrier()
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64)
    median = median.to(device) if device.type == "cuda" else median
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure(
    impl: str,
    mode: str,
    fn: Callable[[], Any],
    args: argparse.Namespace,
    n: int,
    world: int,
    device: torch.device,
) -> dict[str, Any]:
    row: dict[str, Any] = {"impl": impl, "mode": mode, "seqlen": n, "world_size": world}
    attnhub.reset_stats()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        ms = time_ms(fn, args, device)
    except torch.OutOfMemoryError:
        # On one rank alone the others wait in the ring until the group's timeout.
        torch.cuda.empty_cache()
        row["status"] = "out of memory"
        return row
    tokens = args.batch * n
    row.update(
        status="ok",
        ms=ms,
        tokens_per_s=tokens / (ms / 1e3),
        tokens_per_s_per_gpu=tokens / (ms / 1e3) / world,
        backends=dict(attnhub.stats()),
    )
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        row["peak_gib_max_rank"] = _max_over_ranks(peak, device)
    return row


# ---------------------------------------------------------------------------
# The correctness check before timing


def check(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Max abs error of each implementation's output shard against one float32
    torch_reference call on the gathered ``--check-seqlen`` sequence."""
    n = args.check_seqlen
    layout = layout_for(args)
    full = full_inputs(args, n, device, seed=1)
    q, k, v = (t.float() for t in full[:3])
    ref = attnhub.attention(q, k, v, **attention_options(args), backend="torch_reference")
    want = cp.shard(ref, 2, world, rank, layout).float()
    errors: dict[str, Any] = {"seqlen": n}
    shards = [cp.shard(t, 2, world, rank, layout) for t in full]
    with torch.no_grad():
        out = cp.context_parallel_attention(
            *shards[:3], **attention_options(args), layout=layout, backend=args.backend
        )
    errors["attnhub_cp"] = _max_over_ranks(float((out.float() - want).abs().max()), device)
    reason = torch_cp_reason(args, device)
    if "torch_cp" in args.impls and reason is None:
        with torch_cp_context(args, world, device, full) as buffers:
            out = sdpa_fns(args, buffers, kernel=False)[0]()
            # context_parallel shards with the same layout (see layout_for)
            errors["torch_cp"] = _max_over_ranks(float((out.float() - want).abs().max()), device)
    return errors


# ---------------------------------------------------------------------------
# Reports


def environment(args: argparse.Namespace, world: int, device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "attnhub": attnhub.__version__,
        "python": platform.python_version(),
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _fmt_rate(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row.get("status") != "ok":
        return row.get("status", "")
    return f"{row['tokens_per_s'] / 1e3:,.1f}k"


def write_reports(out: Path) -> None:
    """The markdown table and the plot, from every result file in ``out``."""
    runs = [
        json.loads(Path(p).read_text())
        for p in sorted(glob.glob(str(out / "context-parallel-ws*.json")))
    ]
    rows = [row for run in runs for row in run["rows"]]
    impls = sorted({r["impl"] for r in rows}, key=lambda i: (i != "attnhub_cp", i != "torch_cp", i))
    lines = [
        "# Context-parallel attention: tokens/s (thousands; B * N per second, slowest rank)",
        "",
    ]
    for run in runs:
        env = run["environment"]
        a = env["args"]
        lines.append(
            f"- world size {env['world_size']}: {env['device']}, torch {env['torch']}, "
            f"NCCL {env.get('nccl', '-')}, attnhub {env['attnhub']}, {env['time']}; "
            f"B={a['batch']} H={a['heads']} Hkv={a['kv_heads']} D={a['head_dim']} {a['dtype']} "
            f"mask={a['mask']} window={a['window']} softcap={a['softcap']} "
            f"ring backend={a['backend'] or 'dispatch'} torch kernel={a['torch_kernel']}; "
            f"check at N={run['check'].get('seqlen')}: max abs error vs float32 reference "
            + ", ".join(f"{k} {v:.2e}" for k, v in run["check"].items() if k != "seqlen")
        )
        for impl, why in run.get("skipped", {}).items():
            lines.append(f"  - {impl} skipped: {why}")
    lines.append("")
    header = ["R", "N", "mode", *impls]
    if {"attnhub_cp", "torch_cp"} <= set(impls):
        header.append("attnhub_cp / torch_cp")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = sorted({(r["world_size"], r["seqlen"], r["mode"]) for r in rows})
    for world, n, mode in keys:
        by_impl = {
            r["impl"]: r
            for r in rows
            if (r["world_size"], r["seqlen"], r["mode"]) == (world, n, mode)
        }
        cells = [str(world), str(n), mode, *(_fmt_rate(by_impl.get(i)) for i in impls)]
        if header[-1] == "attnhub_cp / torch_cp":
            a, t = by_impl.get("attnhub_cp"), by_impl.get("torch_cp")
            ok = a and t and a.get("status") == t.get("status") == "ok"
            cells.append(f"{a['tokens_per_s'] / t['tokens_per_s']:.2f}" if ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    backends = sorted(
        {f"{r['impl']} {r['mode']}: {r['backends']}" for r in rows if r.get("backends")}
    )
    lines += [
        "",
        "attnhub backends that served rank 0's calls (counts over warmup and timed calls):",
        "",
    ]
    lines += [f"- {b}" for b in backends]
    (out / "context-parallel.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "context-parallel.png")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = sorted({(r["impl"], r["world_size"]) for r in rows if r["mode"] == mode})
        for impl, world in series:
            pts = sorted(
                (r["seqlen"], r["tokens_per_s"])
                for r in rows
                if r["mode"] == mode and r["impl"] == impl and r["world_size"] == world
                and r.get("status") == "ok"
            )  # fmt: skip
            if pts:
                style = "-" if impl == "attnhub_cp" else "--" if impl == "torch_cp" else ":"
                ax.plot(*zip(*pts), style, marker="o", label=f"{impl} R={world}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (tokens, whole sequence)")
        ax.set_ylabel("tokens/s (B * N / time of the slowest rank)")
        ax.set_title({"fwd": "forward", "fwdbwd": "forward + backward"}.get(mode, mode))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world, device = setup(args)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    layout = layout_for(args)
    impls = list(args.impls)
    if world == 1:
        impls += [i for i in ("attnhub_single", "sdpa_single") if i not in impls]
    skipped: dict[str, str] = {}
    why = torch_cp_reason(args, device)
    if "torch_cp" in impls and why is not None:
        skipped["torch_cp"] = why
    if "sdpa_single" in impls and (args.window is not None or args.softcap is not None):
        skipped["sdpa_single"] = "SDPA has no window or softcap"
    impls = [i for i in impls if i not in skipped]
    result: dict[str, Any] = {"environment": environment(args, world, device), "rows": [],
                              "skipped": skipped}  # fmt: skip
    result["check"] = check(args, rank, world, device)
    if rank == 0:
        print("check:", result["check"], flush=True)
    for n in args.seqlens:
        full = full_inputs(args, n, device, seed=n)
        shards = [cp.shard(t, 2, world, rank, layout) for t in full]
        for impl in impls:
            with contextlib.ExitStack() as stack:
                if impl == "attnhub_cp":
                    fns = attnhub_cp_fns(args, shards)
                elif impl == "torch_cp":
                    buffers = stack.enter_context(torch_cp_context(args, world, device, full))
                    fns = sdpa_fns(args, buffers, kernel=False)  # the context pins the kernel
                elif impl == "attnhub_single":
                    fns = attnhub_single_fns(args, full)
                else:
                    fns = sdpa_fns(args, full)
                for mode, fn in zip(("fwd", "fwdbwd"), fns):
                    if mode in args.modes:
                        row = measure(impl, mode, fn, args, n, world, device)
                        result["rows"].append(row)
                        if rank == 0:
                            print(json.dumps(row), flush=True)
        del full, shards
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        (out / f"context-parallel-ws{world}.json").write_text(json.dumps(result, indent=1))
        write_reports(out)
        print(f"wrote {out}/context-parallel-ws{world}.json, context-parallel.md, .png", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
