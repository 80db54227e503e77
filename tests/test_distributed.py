"""attnhub.distributed: context-parallel attention against the single-process call.

The plan (which calls a ring step makes) is checked in-process against the contract's
keep mask; the ring itself runs in 2, 3 and 4 spawned processes over gloo, every case
of a world size in one group (each process pays one ``import torch``), each rank
comparing its shard of the output, lse and gradients with its shard of one
``attnhub.attention`` on the full sequence (float64 reference, contract tolerance).
Workers run under a join timeout and are killed after it: no test can hang.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from attnhub import distributed as cp
from attnhub.backends.torch_reference import keep_mask
from attnhub.request import AttentionParams

JOIN_TIMEOUT_S = 150.0

# ---------------------------------------------------------------------------
# In-process: sharding helpers and the plan


def test_shard_unshard_positions_round_trip():
    for n in (24, 25, 29, 3, 0):  # even, uneven, shorter than the chunk count, empty
        x = torch.arange(2 * n).reshape(2, n)
        for layout in cp.LAYOUTS:
            for world in (1, 2, 3, 4):
                shards = [cp.shard(x, 1, world, r, layout) for r in range(world)]
                assert torch.equal(cp.unshard(shards, 1, layout), x)
                for r in range(world):
                    pos = cp.positions(n, world, r, layout)
                    assert torch.equal(shards[r][0], pos), (layout, world, r)
                    assert len(pos) == cp.local_length(n, world, r, layout)
    # zigzag: rank r holds chunks r and 2R-1-r
    assert cp.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp.positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    # uneven: chunks of N // C and N // C + 1 (the first N % C chunks)
    assert cp.positions(10, 2, 0).tolist() == [0, 1, 2, 8, 9]
    assert cp.positions(11, 2, 1).tolist() == [3, 4, 5, 6, 7, 8]
    assert cp.positions(3, 4, 3).tolist() == []


def test_shard_errors():
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(torch.zeros(8), 0, 2, 0, "striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        cp.shard(torch.zeros(8), 0, 2, 2)
    with pytest.raises(TypeError, match="rank must be an int when world_size is one"):
        cp.shard(torch.zeros(8), 0, 2)
    with pytest.raises(ValueError, match=r"lengths along dim 0 are \[4, 6\]; zigzag shards "):
        cp.unshard([torch.zeros(4), torch.zeros(6)], 0)
    # Before: ZeroDivisionError, IndexError, AttributeError and RuntimeErrors from torch.
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        cp.shard(torch.zeros(8), 0, 0, 0)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-1, 1\)"):
        cp.shard(torch.zeros(8), 1, 2, 0)
    with pytest.raises(TypeError, match="x must be a tensor"):
        cp.shard([0.0] * 8, 0, 2, 0)
    with pytest.raises(ValueError, match=r"shards\[1\]: expected a tensor of shards\[0\]'s shape"):
        cp.unshard([torch.zeros(2, 4), torch.zeros(3, 4)], 1)
    with pytest.raises(ValueError, match="seq_len must be >= 0, got -1"):
        cp.positions(-1, 2, 0)
    with pytest.raises(TypeError, match=r"seq_len must be an int, got float 8\.0"):
        cp.positions(8.0, 2, 0)
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(
        TypeError, match=r"group must be None .* or a torch\.distributed\.ProcessGroup"
    ):
        cp.context_parallel_attention(q, q, q, group="world")


def _expressed(call: Any, c_rows: int, c_keys: int) -> torch.Tensor:
    """The (rows, keys) keep mask a planned call computes, placed in the full grid."""
    nq, nk = call.r1 - call.r0, call.k1 - call.k0
    params = AttentionParams(causal=call.causal, window=call.window)
    local = keep_mask(nq, nk, params, torch.device("cpu"))
    grid = torch.zeros(c_rows, c_keys, dtype=torch.bool)
    grid[call.r0 : call.r1, call.k0 : call.k1] = True if local is None else local
    return grid


@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_plan_covers_exactly_the_kept_positions(layout):
    """Over every (rank, source block) pair, the planned calls keep exactly the positions
    the contract's mask keeps on the full sequence, each once, for causal, windows of
    every size (crossing chunk borders, wider than the sequence, zero) and none, on 1
    to 8 ranks, chunks of equal and of unequal lengths."""
    options = [(False, None), (True, None)]
    for left in (None, 0, 1, 2, 3, 5, 7, 100):
        for right in (None, 0, 1, 4, 9):
            if (left, right) != (None, None):
                options += [(False, (left, right)), (True, (left, right))]
    for world in (1, 2, 3, 4, 5, 8):
        chunks = 2 * world if layout == "zigzag" else world
        # chunk lengths 1, 3 and 4, and uneven ones (N not a multiple of the chunks)
        for n in sorted({chunks, 3 * chunks, 4 * chunks, 3 * chunks + 1, 4 * chunks - 1, 5}):
            for causal, window in options:
                full = keep_mask(n, n, AttentionParams(causal=causal, window=window), "cpu")
                for rank in range(world):
                    rows = cp.positions(n, world, rank, layout)
                    for src in range(world):
                        cols = cp.positions(n, world, src, layout)
                        want = (
                            torch.ones(len(rows), len(cols), dtype=torch.bool)
                            if full is None
                            else full[rows][:, cols]
                        )
                        calls = cp._plan(world, rank, src, layout, n, causal, window)
                        count = torch.zeros(len(rows), len(cols), dtype=torch.int64)
                        for call in calls:
                            assert call.r1 > call.r0 and call.k1 > call.k0, call
                            count += _expressed(call, len(rows), len(cols)).long()
                        what = (layout, world, n, causal, window, rank, src, calls)
                        assert torch.equal(count, want.long()), what


def test_plan_skips_hidden_chunks_and_balances_causal_zigzag():
    """Causal zigzag: every rank computes the same number of (query, key) scores, hidden
    chunk pairs are not computed, and each step is a single call."""
    world, c = 4, 8
    areas = []
    for rank in range(world):
        area = 0
        for src in range(world):
            calls = cp._plan(world, rank, src, "zigzag", 2 * world * c, True, None)
            assert len(calls) == 1, calls
            area += sum((k.r1 - k.r0) * (k.k1 - k.k0) for k in calls)
        areas.append(area)
    assert len(set(areas)) == 1, areas
    # Each rank: one causal 2c x 2c diagonal and R-1 blocks of 2c^2: (R + 1) * 2c^2 of
    # the (2Rc)^2 grid in total over R ranks, half of it plus the diagonal chunks.
    assert areas[0] == 4 * c * c + (world - 1) * 2 * c * c
    # contiguous causal: rank r skips every later rank's block
    assert cp._plan(4, 1, 3, "contiguous", 4 * c, True, None) == ()
    # a narrow window skips far blocks: rank 0 (chunks 0, 7) sees nothing of rank 2's
    # chunks (2, 5) under window (1, 0) with chunks of 8
    assert cp._plan(4, 0, 2, "zigzag", 8 * c, False, (1, 0)) == ()


# ---------------------------------------------------------------------------
# Spawned process groups


def _start(target: str, rank: int, world: int, tmp_path: Path, *args: Any) -> Any:
    """Start rank ``rank`` of ``target`` as a process running this file (pytest imports
    test files in importlib mode: a spawned ``multiprocessing`` child could not)."""
    argv = [sys.executable, __file__, target, str(rank), str(world), str(tmp_path), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(procs: list[Any], deadline: float) -> tuple[list[Any], list[str]]:
    """Wait for ``procs`` until ``deadline``, then kill those still running; returns the
    killed ones and every process's output."""
    killed = []
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            killed.append(p)
    return killed, [p.stdout.read().decode(errors="replace")[-3000:] for p in procs]


def _spawn(target: str, world: int, tmp_path: Path, *args: Any) -> list[dict[str, Any]]:
    """Run ``target(rank, world, tmp_dir, *args)`` in ``world`` processes under a join
    timeout (killed after it); return each rank's JSON result."""
    (tmp_path / "out").mkdir(exist_ok=True)
    procs = [_start(target, r, world, tmp_path, *args) for r in range(world)]
    killed, logs = _finish(procs, time.monotonic() + JOIN_TIMEOUT_S)
    results = []
    for r in range(world):
        path = tmp_path / "out" / f"{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"missing": logs[r]})
    assert not killed, f"ranks still running after {JOIN_TIMEOUT_S} s (killed): {logs}"
    return results


def _init(rank: int, world: int, tmp: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{Path(tmp, 'init')}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _write(tmp: str, rank: int, result: dict[str, Any]) -> None:
    Path(tmp, "out", f"{rank}.json").write_text(json.dumps(result))


# (name, options, heads (Hq, Hkv), chunk length, Dv)
CASES: list[tuple[str, dict[str, Any], tuple[int, int], int, int]] = [
    ("causal", {"causal": True}, (2, 2), 3, 8),
    ("full", {}, (2, 2), 3, 8),
    ("window", {"window": (4, 2)}, (2, 2), 3, 8),
    ("window_right_only", {"window": (None, 3)}, (2, 2), 3, 8),
    ("causal_window", {"causal": True, "window": (5, None)}, (2, 2), 3, 8),
    ("window_zero", {"window": (0, 0)}, (2, 2), 2, 8),
    ("softcap_gqa", {"causal": True, "softcap": 1.5}, (4, 2), 3, 8),
    ("mqa_scale_window", {"scale": -0.7, "window": (2, 2)}, (4, 1), 3, 6),
    ("contiguous_causal", {"causal": True, "layout": "contiguous"}, (2, 2), 4, 8),
    ("contiguous_window", {"window": (3, 0), "layout": "contiguous"}, (2, 1), 4, 8),
    # "extra": tokens beyond a multiple of the chunk count (uneven shards, seq_len=)
    ("uneven_causal", {"causal": True, "extra": 3}, (2, 2), 2, 8),
    ("uneven_window", {"window": (3, 1), "layout": "contiguous", "extra": 1}, (2, 1), 3, 8),
    ("shorter_than_the_chunks", {"causal": True, "extra": 3}, (2, 2), 0, 8),
]


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any], dout, dlse
) -> list[torch.Tensor]:
    """Output, lse and (dq, dk, dv) of one attnhub call on the full sequence."""
    import attnhub

    options = {key: val for key, val in options.items() if key not in ("layout", "extra")}
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = attnhub.attention(q, k, v, **options, return_lse=True, backend="torch_reference")
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout.to(out.dtype), dlse))
    return [out, lse, *grads]


# The cases run with triton_flash in the Triton interpreter (a kernel backend's lse
# gradient through the ring): float32, the interpreter is slow.
TRITON_CASES = ("window", "softcap_gqa")  # bands; causal zigzag (GQA, softcap)


def _correctness_worker(rank: int, world: int, tmp: str, backend: str = "torch_reference") -> None:
    from attnhub.testing.tolerance import compare

    result: dict[str, Any] = {"problems": [], "checked": 0}
    reference_run = backend == "torch_reference"
    dtypes = (torch.float64, torch.float32) if reference_run else (torch.float32,)
    try:
        _init(rank, world, tmp, float(os.environ.get("CP_TEST_TIMEOUT", "60")))
        for name, options, (hq, hkv), c, dv in CASES:
            if not reference_run and name not in TRITON_CASES:
                continue
            layout = options.get("layout", "zigzag")
            n = c * (2 * world if layout == "zigzag" else world) + options.get("extra", 0)
            call = {key: val for key, val in options.items() if key != "extra"}
            if "extra" in options:
                call["seq_len"] = n
            gen = torch.Generator().manual_seed(1234 + len(name))
            b, d = 2, 8
            if not reference_run:  # triton_flash: head dims 16..256; the interpreter is slow
                b, d, dv = 1, 16, 16
            q64 = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)
            k64 = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)
            v64 = torch.randn(b, hkv, n, dv, generator=gen, dtype=torch.float64)
            dout = torch.randn(b, hq, n, dv, generator=gen, dtype=torch.float64)
            dlse = torch.randn(b, hq, n, generator=gen).float()
            r64 = _reference(q64, k64, v64, options, dout, dlse)
            r32 = _reference(q64.float(), k64.float(), v64.float(), options, dout, dlse)
            for dtype in dtypes:
                q, k, v = (
                    cp.shard(t, 2, world, rank, layout).to(dtype).requires_grad_(True)
                    for t in (q64, k64, v64)
                )
                o, lse = cp.context_parallel_attention(
                    q, k, v, **call, return_lse=True, backend=backend
                )
                upstream = (cp.shard(dout, 2, world, rank, layout).to(o.dtype),
                            cp.shard(dlse, 2, world, rank, layout))  # fmt: skip
                grads = torch.autograd.grad((o, lse), (q, k, v), upstream)
                lp = r64 if dtype == torch.float64 else r32
                for what, x, r_lp, r_64 in zip(
                    ("out", "lse", "dq", "dk", "dv"), (o, lse, *grads), lp, r64
                ):
                    problem = compare(
                        f"{name} {dtype} {what}",
                        x,
                        cp.shard(r_lp, 2, world, rank, layout),
                        cp.shard(r_64, 2, world, rank, layout),
                    )
                    result["checked"] += 1
                    if problem:
                        result["problems"].append(problem)
        if not reference_run:
            torch.distributed.destroy_process_group()
            _write(tmp, rank, result)
            return
        # Without gradients, and without return_lse: the plain forward path.
        q = cp.shard(torch.randn(1, 2, 4 * world, 8, dtype=torch.float64), 2, world, rank)
        o = cp.context_parallel_attention(q, q, q, causal=True, backend="torch_reference")
        import attnhub

        full = cp.gather(q, 2)
        want = cp.shard(attnhub.attention(full, full, full, causal=True), 2, world, rank)
        # float64 within 1e-5, not exactly: every step's lse is float32 (the contract's)
        problem = compare("no-grad forward", o, want, want)
        if problem:
            result["problems"].append(problem)
        result["checked"] += 1
        if world == 2:
            result["errors"] = _error_cases(rank, world)
            result["compile"] = _compile_case(rank, world)
            result["lse_fallback"] = _lse_fallback_case(rank, world)
            result["api"] = _api_cases(rank, world)
            result["fsdp"] = _fsdp_case(rank, world)
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        result["problems"].append(f"rank {rank} raised {type(exc).__name__}: {exc}")
    _write(tmp, rank, result)


@pytest.mark.interpreter
def test_triton_flash_steps_in_the_interpreter(tmp_path):
    """Two processes whose ring steps run triton_flash (Triton's CPU interpreter): a
    kernel backend's lse and its gradient through the ring, against the reference."""
    results = _spawn("correctness", 2, tmp_path, "triton_flash")
    for rank, result in enumerate(results):
        assert not result.get("missing"), f"rank {rank} wrote no result: {result}"
        assert result["problems"] == [], (rank, result["problems"])
        assert result["checked"] == len(TRITON_CASES) * 5


def _error_cases(rank: int, world: int) -> list[str]:
    """Uneven and mismatched shards and bad options: the same clear error on every rank,
    and the group still works afterwards."""
    seen = []
    x = torch.randn(1, 2, 4, 8)
    attempts = [
        # shards of 4 are not those of a sequence of 9 (5 and 4 tokens)
        lambda: cp.context_parallel_attention(x, x, x, seq_len=9),
        # different shard lengths on the two ranks without seq_len (checked across ranks)
        lambda: cp.context_parallel_attention(*(torch.randn(1, 2, 4 + 2 * rank, 8),) * 3),
        # a different dtype on one rank
        lambda: cp.context_parallel_attention(*(x.double() if rank else x,) * 3),
        lambda: cp.context_parallel_attention(x, x, x, seq_len=-1),
        # Hq not a multiple of Hkv: the contract's error, before any communication
        lambda: cp.context_parallel_attention(torch.randn(1, 3, 4, 8), x, x),
        lambda: cp.context_parallel_attention(x, x, x, window=(-1, 2)),
        lambda: cp.context_parallel_attention(x, x[:, :, :2], x[:, :, :2]),
        lambda: cp.context_parallel_attention(x, x, x, layout="ring"),
    ]
    for attempt in attempts:
        try:
            attempt()
            seen.append("no error")
        except ValueError as exc:
            seen.append(str(exc))
    # Checked on every call, not once per signature: options that differ in a later call
    # of a signature both ranks have seen (each rank would mask with its own), and a
    # backend= name one rank lacks (it raises after the check's all-gather, so that the
    # other rank does not wait in it); the same unknown name everywhere raises alike.
    ref = "torch_reference"
    cp.context_parallel_attention(x, x, x, causal=True, backend=ref)
    later = [
        lambda: cp.context_parallel_attention(x, x, x, causal=rank == 0, backend=ref),
        lambda: cp.context_parallel_attention(x, x, x, backend="no_such_backend" if rank == 0 else ref),
        lambda: cp.context_parallel_attention(x, x, x, backend="no_such_backend"),
        # only one rank's shard needs a gradient: the other would skip the backward ring
        lambda: cp.context_parallel_attention(x.clone().requires_grad_(rank == 0), x, x, backend=ref),
    ]  # fmt: skip
    for attempt in later:
        try:
            attempt()
            seen.append("no error")
        except ValueError as exc:
            text = str(exc)
            seen.append(
                "differ between ranks" if "differ between ranks" in text else text.split(";")[0]
            )
    out = cp.context_parallel_attention(x, x, x, causal=True, backend=ref)
    seen.append(f"works after: {tuple(out.shape)}")
    return seen


def _lse_fallback_case(rank: int, world: int) -> list[str]:
    """A backend whose lse carries no gradient (as PyTorch's fused kernels, which do not
    declare lse_grad): it serves the forward, dispatch leaves it out of the backward's
    recomputed steps (the gradients are right); asked for by name alone, the backward
    raises dispatch's NoBackendError, which says why."""
    import attnhub
    from attnhub.backends.torch_reference import TorchReference
    from attnhub.testing.tolerance import compare

    class DetachedLse(TorchReference):
        name = "cp_test_detached_lse"
        description = "torch_reference with an lse that carries no gradient"
        priority = 1000
        lse_grad = False

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            out, lse = super().forward(query, key, value, attn_mask, params)
            return out, lse.detach()

    attnhub.get_registry().add(DetachedLse())
    seen = []
    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(1, 2, 8, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    q, k, v = (cp.shard(t, 2, world, rank).requires_grad_(True) for t in full)
    with torch.no_grad():
        seen.append(str(attnhub.explain(q, k, v, causal=True, return_lse=True).chosen))
    declined = attnhub.explain(q, k, v, causal=True, return_lse=True).reasons()[DetachedLse.name]
    seen.append("; ".join(declined))
    ref = _reference(*full, {"causal": True}, torch.ones(1, 2, 8, 8), torch.zeros(1, 2, 8))
    out = cp.context_parallel_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for what, x, r in zip(("dq", "dk", "dv"), grads, ref[2:]):
        seen.append(
            compare(what, x, cp.shard(r, 2, world, rank), cp.shard(r, 2, world, rank)) or "ok"
        )
    out = cp.context_parallel_attention(q, k, v, causal=True, backend="cp_test_detached_lse")
    try:
        torch.autograd.grad(out.sum(), (q, k, v))
        seen.append("no error")
    except attnhub.NoBackendError as exc:
        seen.append(str(exc).splitlines()[0])
        seen.append("; ".join(exc.reasons[DetachedLse.name]))
    attnhub.get_registry().remove("cp_test_detached_lse")
    out = cp.context_parallel_attention(q, k, v, causal=True, backend="torch_reference")
    seen.append(f"works after: {tuple(out.shape)}")
    return seen


def _api_cases(rank: int, world: int) -> list[str]:
    """The group defaults of shard/positions, bottom-right alignment (the same as
    top-left: equal lengths), empty batches, and a second derivative, which raises."""
    seen = []
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    seen.append(str(torch.equal(cp.shard(x, 2), cp.shard(x, 2, world, rank))))
    group = torch.distributed.group.WORLD
    seen.append(str(torch.equal(cp.positions(8, group), cp.positions(8, world, rank))))
    uneven = torch.arange(2 * 9 * 3).reshape(2, 9, 3)  # shards of 5 and 4 along dim 1
    seen.append(str(torch.equal(cp.gather(cp.shard(uneven, 1), 1, seq_len=9), uneven)))
    q = cp.shard(x, 2)
    a = cp.context_parallel_attention(q, q, q, causal=True, backend="torch_reference")
    b = cp.context_parallel_attention(
        q, q, q, causal=True, alignment="bottom_right", backend="torch_reference"
    )
    seen.append(str(torch.equal(a, b)))
    empty = torch.randn(0, 2, 4, 8, requires_grad=True)
    out, lse = cp.context_parallel_attention(empty, empty, empty, causal=True, return_lse=True)
    (grad,) = torch.autograd.grad(out.sum(), empty)
    seen.append(f"empty: {tuple(out.shape)} {tuple(lse.shape)} {tuple(grad.shape)}")
    q, k, v = (cp.shard(torch.randn(1, 2, 8, 8), 2).requires_grad_(True) for _ in range(3))
    out = cp.context_parallel_attention(q, k, v, causal=True, backend="torch_reference")
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    try:
        torch.autograd.grad(dq.sum(), k)
        seen.append("second derivative: no error")
    except RuntimeError as exc:
        seen.append(str(exc))
    return seen


def _fsdp_case(rank: int, world: int) -> dict[str, float]:
    """FSDP2 (fully_shard over the same ranks) around a block whose attention is the
    ring: the parameters' gradients (reduce-scattered, averaged over the ranks) times R
    are those of the block on the whole sequence in one process. Returns, per
    parameter, max|difference| / max|reference| (float64; the steps' lse is float32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import attnhub

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48, dtype=torch.float64)
            self.o = torch.nn.Linear(16, 16, dtype=torch.float64)

        def forward(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
            return self.o(attend(q, k, v).transpose(1, 2).reshape(b, n, 16))

    torch.manual_seed(0)
    reference = Block()
    model = Block()
    model.load_state_dict(reference.state_dict())
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(2, 8 * world, 16, dtype=torch.float64)
    target = torch.randn(2, 8 * world, 16, dtype=torch.float64)
    options = {"causal": True, "window": (5, None), "backend": "torch_reference"}
    out = reference(x, lambda q, k, v: attnhub.attention(q, k, v, **options))
    ((out - target) ** 2).sum().backward()
    out = model(cp.shard(x, 1), lambda q, k, v: cp.context_parallel_attention(q, k, v, **options))
    ((out - cp.shard(target, 1)) ** 2).sum().backward()
    errors = {}
    references = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = references[name].grad
        got = p.grad.full_tensor() * world  # type: ignore[union-attr]
        errors[name] = float((got - want).abs().max() / want.abs().max())
    return errors


def _compile_case(rank: int, world: int) -> str:
    """torch.compile of a function around the call: the call runs eagerly (a graph
    break), the result and gradients are those of the eager call."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 8, 8, generator=gen, requires_grad=True) for _ in range(3))

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o = cp.context_parallel_attention(
            q * 2, k, v, causal=True, window=(3, None), backend="torch_reference"
        )
        return torch.tanh(o).sum()

    eager = block(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(block, backend="eager")(q, k, v)
    g_compiled = torch.autograd.grad(compiled, (q, k, v))
    same = torch.allclose(eager, compiled) and all(
        torch.allclose(a, b) for a, b in zip(g_eager, g_compiled)
    )
    return "same" if same else f"differs: {float(eager)} vs {float(compiled)}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_the_single_process_call(world, tmp_path):
    results = _spawn("correctness", world, tmp_path)
    for rank, result in enumerate(results):
        assert not result.get("missing"), f"rank {rank} wrote no result"
        assert result["problems"] == [], (rank, result["problems"])
        assert result["checked"] == len(CASES) * 2 * 5 + 1
    if world == 2:
        errors = [r["errors"] for r in results]
        assert errors[0] == errors[1], errors  # every rank raises the same
        lengths_hint = (
            "(attnhub.distributed.shard cuts them; where they differ between ranks, pass seq_len=)"
        )
        want = [
            "context_parallel_attention: the shards' (q, k, v) lengths per rank are "
            "[(4, 4, 4), (4, 4, 4)], and zigzag shards of a sequence of 9 have lengths "
            f"[5, 4] {lengths_hint}",
            "context_parallel_attention: the shards' (q, k, v) lengths per rank are "
            "[(4, 4, 4), (6, 6, 6)], and zigzag shards of a sequence of 8 have lengths "
            f"[4, 4] {lengths_hint}",
            "context_parallel_attention: the dtype or options differ between ranks (q, k, "
            "v shapes: rank 0: [1, 2, 4, 8, 1, 2, 4, 8, 1, 2, 4, 8]; rank 1: [1, 2, 4, 8, "
            "1, 2, 4, 8, 1, 2, 4, 8])",
            "seq_len must be None or an int >= 0, got -1",
            "query heads Hq=3 must be a multiple of key/value heads Hkv=2 (grouped-query "
            "attention)",
            "window sides must be >= 0 (or None for unbounded), got left=-1",
            "context_parallel_attention needs query and key shards of the same length "
            "(self-attention over one sharded sequence), got Nq=4 and Nk=2",
            "layout must be one of ('zigzag', 'contiguous'), got 'ring'",
            "differ between ranks",
            "differ between ranks",
            "context_parallel_attention: unknown backend 'no_such_backend'",
            "differ between ranks",
            "works after: (1, 2, 4, 8)",
        ]
        assert errors[0] == want, errors[0]
        assert [r["compile"] for r in results] == ["same", "same"]
        for result in results:
            fsdp = result["fsdp"]
            assert set(fsdp) == {"qkv.weight", "qkv.bias", "o.weight", "o.bias"}, fsdp
            assert max(fsdp.values()) < 1e-6, fsdp
        for result in results:
            assert result["api"] == [
                "True",
                "True",
                "True",
                "True",
                "empty: (0, 2, 4, 8) (0, 2, 4) (0, 2, 4, 8)",
                "the derivative for attnhub.distributed's ring attention backward is not "
                "implemented (its gradients are first derivatives only)",
            ], result["api"]
        for result in results:
            assert result["lse_fallback"] == [
                "cp_test_detached_lse",
                "a gradient through the returned lse is not supported",
                "ok",
                "ok",
                "ok",
                "no backend among those asked for (cp_test_detached_lse, via backend=) can "
                "serve this call",
                "a gradient through the returned lse is not supported",
                "works after: (1, 2, 4, 8)",
            ], result["lse_fallback"]


def test_benchmark_script_runs_world_size_1_on_cpu(tmp_path):
    """benchmarks/context_parallel.py end to end, one process, gloo on the CPU (the GPU
    run is the lead's): results, check, table and plot written."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "context_parallel.py"
    argv = [
        sys.executable, str(script), "--device", "cpu", "--out", str(tmp_path),
        "--seqlens", "32,64", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
        "--dtype", "fp32", "--iters", "2", "--warmup", "1", "--check-seqlen", "32",
        "--window", "5,0", "--backend", "torch_reference",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=JOIN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "context-parallel-ws1.json").read_text())
    assert result["check"]["attnhub_cp"] < 1e-5, result["check"]
    assert result["skipped"] == {
        "torch_cp": "PyTorch's context_parallel handles the CUDA SDPA ops only",
        "sdpa_single": "SDPA has no window or softcap",
    }
    got = {(r["impl"], r["mode"], r["seqlen"]) for r in result["rows"] if r["status"] == "ok"}
    assert got == {
        (impl, mode, n)
        for impl in ("attnhub_cp", "attnhub_single")
        for mode in ("fwd", "fwdbwd")
        for n in (32, 64)
    }
    table = (tmp_path / "context-parallel.md").read_text()
    assert "| 1 | 64 | fwdbwd |" in table
    assert (tmp_path / "context-parallel.png").stat().st_size > 0


def _gather_worker(rank: int, world: int, tmp: str) -> None:
    """cp.gather on shards of every length without seq_len (each rank checks the full
    tensor it gets back against the one it sharded), then bad calls, each of which must
    raise on every rank without aborting the group (a last gather still works)."""
    result: dict[str, Any] = {"gathered": [], "errors": []}
    try:
        _init(rank, world, tmp, 30.0)
        for layout in cp.LAYOUTS:
            chunks = 2 * world if layout == "zigzag" else world
            for n in (chunks * 2, chunks * 2 + 1, chunks * 2 + chunks - 1, 1, 0):
                full = torch.arange(2 * n * 3, dtype=torch.float64).reshape(2, n, 3)
                for dim, seq_len in ((1, None), (-2, None), (1, n)):
                    got = cp.gather(cp.shard(full, dim, layout=layout), dim, None, layout, seq_len)
                    ok = got.shape == full.shape and torch.equal(got, full)
                    result["gathered"].append([layout, n, dim, seq_len, ok])
        x = torch.arange(9 * 4, dtype=torch.float32).reshape(9, 4)
        mine = cp.shard(x, 0)  # zigzag on 2 ranks: 5 and 4 rows
        bad_calls = [
            lambda: cp.gather(mine, 0, seq_len=10),  # the shards add up to 9
            lambda: cp.gather(mine[:-1] if rank == 1 else mine, 0),  # not a zigzag sharding
            lambda: cp.gather(mine.double() if rank == 1 else mine, 0),  # dtypes differ
            lambda: cp.gather(mine, 2 if rank == 1 else 0),  # bad dim on rank 1 only
        ]
        for call in bad_calls:
            try:
                call()
                result["errors"].append("no error")
            except ValueError as exc:
                result["errors"].append(str(exc))
        result["after"] = torch.equal(cp.gather(mine, 0), x)
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        result["errors"].append(f"rank {rank} raised {type(exc).__name__}: {exc}")
    _write(tmp, rank, result)


@pytest.mark.parametrize("world", [2, 3])
def test_gather_uneven_shards_without_seq_len(world, tmp_path):
    """Uneven shards (N not a multiple of the chunk count) gather without seq_len: the
    lengths are all-gathered first (gather used to take N = N_local * R, so the ranks
    padded to different lengths and gloo aborted the process on the mismatched sizes)."""
    results = _spawn("gather", world, tmp_path)
    for rank, result in enumerate(results):
        assert not result.get("missing"), f"rank {rank} wrote no result: {result}"
        assert [g for g in result["gathered"] if not g[-1]] == [], (rank, result)
        assert len(result["gathered"]) == 2 * 5 * 3
        assert result["after"] is True, (rank, result)
        assert [e for e in result["errors"] if "raised" in e or e == "no error"] == []
        assert result["errors"][0].startswith("gather: seq_len per rank is [10, 10")
    if world == 2:
        lengths = "gather: the shards' lengths along dim 0 per rank are"
        want = [
            "gather: seq_len per rank is [10, 10], but the shards' lengths along dim 0 "
            "([5, 4]) add up to 9",
            f"{lengths} [5, 3]; zigzag shards of a sequence of 8 have lengths [4, 4]",
        ]
        for result in results:
            assert result["errors"][:2] == want, result["errors"]
        assert [r["errors"][2] for r in results] == [
            "gather: the shards' dtype, shape (but along dim), dim or layout differ between "
            "ranks (this rank's: torch.float32, (5, 4), dim=0, zigzag)",
            "gather: the shards' dtype, shape (but along dim), dim or layout differ between "
            "ranks (this rank's: torch.float64, (4, 4), dim=0, zigzag)",
        ]
        assert [r["errors"][3] for r in results] == [
            "gather: bad arguments on rank(s) [1] (they raise why)",
            "gather: dim must be an int in [-2, 2) for a 2-d shard, got 2",
        ]


def _hang_worker(rank: int, world: int, tmp: str, timeout_s: str) -> None:
    result: dict[str, Any] = {}
    try:
        _init(rank, world, tmp, float(timeout_s))
        x = torch.randn(1, 2, 4, 8)
        # One call together (the shapes are checked and remembered), then rank 1 stops
        # taking part: rank 0's next call waits on the ring's transfers.
        cp.context_parallel_attention(x, x, x, causal=True, backend="torch_reference")
        if rank == 1:
            result["sleeping"] = True
            _write(tmp, rank, result)
            time.sleep(3600)  # never participates again; the parent kills it
        start = time.monotonic()
        try:
            cp.context_parallel_attention(x, x, x, causal=True, backend="torch_reference")
            result["outcome"] = "returned"
        except RuntimeError as exc:
            result["outcome"] = f"RuntimeError: {exc}"
        result["seconds"] = time.monotonic() - start
    except BaseException as exc:
        result["outcome"] = f"unexpected {type(exc).__name__}: {exc}"
    _write(tmp, rank, result)
    os._exit(0)  # skip destroy_process_group: the peer is gone


def test_a_hung_peer_makes_the_call_fail_with_the_group_timeout(tmp_path):
    timeout_s = 3.0
    (tmp_path / "out").mkdir()
    procs = [_start("hang", r, 2, tmp_path, timeout_s) for r in range(2)]
    # Rank 0 must finish on its own; rank 1 sleeps and is killed.
    killed, logs = _finish(procs[:1], time.monotonic() + JOIN_TIMEOUT_S)
    _finish(procs[1:], time.monotonic())
    assert not killed, f"rank 0 hung past the join timeout: {logs}"
    result = json.loads((tmp_path / "out" / "0.json").read_text())
    assert result["outcome"].startswith("RuntimeError"), result
    assert "timed out" in result["outcome"].lower(), result
    assert timeout_s * 0.5 <= result["seconds"] <= timeout_s + 20, result
    assert json.loads((tmp_path / "out" / "1.json").read_text()) == {"sleeping": True}


# ---------------------------------------------------------------------------
# CUDA (NCCL, one process per GPU): run by the lead on the GPU machine


def _cuda_cases() -> list[tuple[Any, Any]]:
    from attnhub.testing.cases import Case

    base = {"B": 2, "Hq": 4, "Hkv": 4, "D": 64, "Dv": 64, "return_lse": True, "backward": True}
    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for backend in (None, "triton_flash"):
            cases += [
                (Case(dtype=dtype, Nq=1024, Nk=1024, causal=True, **base), backend),
                (Case(dtype=dtype, Nq=1024, Nk=1024, **base), backend),
                (Case(dtype=dtype, Nq=1024, Nk=1024, window=(200, 0), **base), backend),
                (Case(dtype=dtype, Nq=1024, Nk=1024, window=(96, 33), **base), backend),
            ]
        gqa = {**base, "Hq": 8, "Hkv": 2}
        cases += [
            (Case(dtype=dtype, Nq=2048, Nk=2048, causal=True, softcap=30.0, **gqa), None),
            (Case(dtype=dtype, Nq=2048, Nk=2048, causal=True, **gqa), "triton_flash"),
            # uneven: shards of different lengths on 2 GPUs (seq_len=)
            (Case(dtype=dtype, Nq=1001, Nk=1001, causal=True, **base), None),
            (Case(dtype=dtype, Nq=1001, Nk=1001, window=(77, 0), **base), None),
        ]
    return cases


def _cuda_worker(rank: int, world: int, tmp: str) -> None:
    from attnhub.testing.cases import make_inputs
    from attnhub.testing.reference import references
    from attnhub.testing.tolerance import compare

    result: dict[str, Any] = {"problems": [], "checked": 0}
    try:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.distributed.init_process_group(
            "nccl",
            init_method=f"file://{Path(tmp, 'init')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
            device_id=device,
        )
        for case, backend in _cuda_cases():
            inputs = make_inputs(case, device)
            r_lp, r64 = references(inputs, case)
            options = {"causal": case.causal, "window": case.window, "softcap": case.softcap}

            def local(t: torch.Tensor) -> torch.Tensor:
                return cp.shard(t.detach(), 2, world, rank)

            q, k, v = (
                local(t).requires_grad_(True) for t in (inputs.query, inputs.key, inputs.value)
            )
            out, lse = cp.context_parallel_attention(
                q, k, v, **options, seq_len=case.Nq, return_lse=True, backend=backend
            )
            # The kit's references differentiate (out, lse) against (grad_out, grad_lse).
            outputs, upstream = [out], [local(inputs.grad_out)]
            if inputs.grad_lse is not None:
                outputs.append(lse)
                upstream.append(local(inputs.grad_lse))
            grads = torch.autograd.grad(outputs, (q, k, v), upstream)
            for what, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
                problem = compare(
                    f"{case.id} backend={backend} {what}", x, local(r_lp[what]), local(r64[what])
                )
                result["checked"] += 1
                if problem:
                    result["problems"].append(problem)
        torch.distributed.destroy_process_group()
    except BaseException as exc:
        result["problems"].append(f"rank {rank} raised {type(exc).__name__}: {exc}")
    _write(tmp, rank, result)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_nccl_matches_the_single_process_call(world, tmp_path):
    """One process per GPU over NCCL (the CUDA path: side stream, NCCL transfers, the
    backward's lse-gradient fallback when dispatch picks PyTorch's fused kernels):
    bf16 and fp16 against the float64 reference with the contract's tolerance."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = _spawn("cuda", world, tmp_path)
    for rank, result in enumerate(results):
        assert not result.get("missing"), f"rank {rank} wrote no result: {result}"
        assert result["problems"] == [], (rank, result["problems"])
        assert result["checked"] == len(_cuda_cases()) * 5


if __name__ == "__main__":  # a worker process (see _start)
    _target, _rank, _world, _tmp, *_args = sys.argv[1:]
    workers = {
        "correctness": _correctness_worker,
        "gather": _gather_worker,
        "hang": _hang_worker,
        "cuda": _cuda_worker,
    }
    workers[_target](int(_rank), int(_world), _tmp, *_args)
