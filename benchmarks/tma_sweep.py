"""Sweep triton_flash's TMA forward (kernels_tma), or with ``--kernel gluon`` its Gluon
forward (kernels_gluon), against the forward its table runs and the competitors, on the
grid's shapes (issue 19).

For each point (bf16 by default, D 64/128, N 1K/4K/16K with B = 16384 / N and H = 2048 /
D, causal and not) it times, in one process and on the same inputs: triton_flash as its
launch table runs it, the TMA forward at each candidate configuration (forced with
``tuning.override``), SDPA's flash (FA2) and cuDNN kernels, and FlexAttention (the flex
plugin, where installed; its causal rows here build the block mask in every call, so
they are not FlexAttention's speed: the grid bench's are). Each candidate's output is
compared with SDPA flash's first; a configuration that does not compile or run is a row
with its error. Prints one line per row and writes JSON (rows plus the environment).
The forward runs of 2026-12-04 in results/archive came from this script under its
first name, tma_fwd_sweep.py; the backward run from its ``--direction bwd`` at a136497,
whose backward TMA streams did not pay and were taken out (benchmarks/NOTES.md); the program-order
runs from its ``--orders`` at 97835d0, whose orders did not pay either.

    python benchmarks/tma_sweep.py OUT.json [--kernel tma|gluon] [--dtype bf16]
        [--head-dims 64,128] [--seqlens 1024,4096,16384] [--causal both|yes|no]
        [--configs BM,BN,W,S;...]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import triton

import attnhub
from attnhub.backends.triton_flash import configs, tuning

# Candidates: (BLOCK_M, BLOCK_N, num_warps, num_stages).
FWD_CANDIDATES = ((128, 64, 4, 2), (128, 64, 4, 3), (128, 32, 4, 2), (128, 32, 4, 3),
                  (128, 32, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2),
                  (64, 32, 4, 3), (128, 128, 8, 3))  # fmt: skip
# The Gluon forward's: 128-row blocks (two consumer warpgroups of 64 rows), 4 warps each.
GLUON_CANDIDATES = ((128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3))
COMPETITORS = ("triton_flash", "torch_sdpa_flash", "torch_sdpa_cudnn", "flex_attention")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _fwd_trials(q, k, v, causal: bool, kind: str, only: list) -> dict[str, tuple[Any, Any]]:  # type: ignore[no-untyped-def]
    trials = {}
    candidates = only or (GLUON_CANDIDATES if kind == "gluon" else FWD_CANDIDATES)
    for bm, bn, warps, stages in candidates:
        cfg = configs.LaunchConfig(bm, bn, warps, stages, tma=kind == "tma", gluon=kind == "gluon")

        def run(cfg=cfg):  # type: ignore[no-untyped-def]
            with tuning.override(fwd=cfg):
                return attnhub.attention(q, k, v, causal=causal, backend="triton_flash")

        trials[f"{kind}-{bm}-{bn}-{warps}-{stages}"] = ([bm, bn, warps, stages], run)
    return trials


def _rows_for(
    dtype: torch.dtype, d: int, n: int, causal: bool, kind: str, only: list
) -> list[dict]:
    b, h = 16384 // n, 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(3))
    flops = 4 * b * h * n * n * d // (2 if causal else 1)
    point = {"dtype": str(dtype).removeprefix("torch."), "D": d, "N": n, "B": b, "H": h,
             "causal": causal}  # fmt: skip
    registry = attnhub.registry.get_registry()
    names = [name for name in COMPETITORS if registry.unavailable_reason(name) is None]
    trials: dict[str, tuple[Any, Any]] = {}
    for name in names:
        trials[name] = (None, lambda name=name: attnhub.attention(q, k, v, causal=causal,
                                                                   backend=name))  # fmt: skip
    trials.update(_fwd_trials(q, k, v, causal, kind, only))
    reference = trials["torch_sdpa_flash"][1]().float()
    rows = []
    for name, (config, fn) in trials.items():
        row = {**point, "kernel": name.split("-")[0], "config": config}
        try:
            t0 = time.perf_counter()
            err = (fn().float() - reference).abs().max().item()
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            row.update(max_abs_diff_vs_sdpa_flash=err, ms=round(ms, 4),
                       tflops=round(flops / ms / 1e9, 1))  # fmt: skip
        except Exception as exc:  # a configuration that does not compile is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--kernel", default="tma", choices=("tma", "gluon"))
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--seqlens", default="4096,16384,1024")
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--configs", default="",
                        help="only these candidates: BLOCK_M,BLOCK_N,WARPS,STAGES;...")  # fmt: skip
    args = parser.parse_args()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    only = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c]
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in causals:
            for n in (int(x) for x in args.seqlens.split(",")):
                rows += _rows_for(DTYPES[args.dtype], d, n, causal, args.kernel, only)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "attnhub": attnhub.__version__,
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    with open(args.output, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
