"""Fit attnhub's cost model (attnhub/cost_model.py) to a workload run, and check it.

Reads the JSON of ``attnhub bench --workloads`` (one device), fits each backend's
constants and writes ``attnhub/data/cost_model_<class>.json``; then ranks every
workload call of the run by the model and reports, per call, how fast the backend the
model would pick was against the fastest one measured (a markdown table)::

    python benchmarks/fit_cost_model.py benchmarks/results/workloads-h200.json \
        --device sm90 --report benchmarks/results/cost-model-fit-h200.md

The fit, per backend, from the calls it served (the padding and window calls, whose
masks the model sees only in part, are left out of the fit, not of the check):

- forward TFLOP/s: the median over the prefill calls' forwards (compute-bound);
- forward+backward TFLOP/s: the same over their training steps;
- TB/s: the median over the decoding steps with a cache of 32K keys or more
  (bandwidth-bound);
- host us: the median, over the 4K-key decoding steps (where the host is most of
  it), of what the bandwidth term leaves, at least 1 us.

A constant the run has no call for is the median of the other backends'; ``default``
(for backends the file does not name) is the median of every backend's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from attnhub.cost_model import FORMAT, CostModel, KernelCost, work
from attnhub.request import AttentionRequest, seqlen_bucket

NOT_BACKENDS = frozenset({"auto", "sdpa", "patched", "torch_reference"})
# Backends whose first call of a shape compiles, which the cost model ranks after the
# others (cost_model.py): those the registry here declares so, and the FlexAttention
# plugin's (attnhub_flex declares compiles_per_shape), which the machine that checks a
# fit may not have installed.
PLUGINS_THAT_COMPILE_PER_SHAPE = frozenset({"flex_attention"})
CONSTANTS = ("host_us", "fwd_tflops", "fwd_bwd_tflops", "tbps")


def request_of(row: dict[str, Any]) -> AttentionRequest:
    """The request attnhub builds for a workload row's call (bucketed lengths; a decode
    step's bottom-right causal with one query is no causal, as validation makes it)."""
    nq, nk = row["nq"], row["nk"]
    causal = row["causal"] and not (row["alignment"] == "bottom_right" and nq == 1)
    return AttentionRequest(
        device_type="cuda", capability=(9, 0), dtype=getattr(torch, row["dtype"]),
        batch=row["batch"], heads_q=row["heads_q"], heads_kv=row["heads_kv"],
        seqlen_q=seqlen_bucket(nq), seqlen_k=seqlen_bucket(nk),
        same_seqlen=nq == nk, q_longer=nq > nk, head_dim=row["head_dim"],
        head_dim_v=row["head_dim"], mask="bool" if row["lengths"] else "none",
        mask_per_key=bool(row["lengths"]),  # the padding call's (B, 1, 1, Nk) key mask
        causal=causal, alignment=row["alignment"] if causal and nq != nk else "top_left",
        window=row["window"] is not None, needs_grad=row["mode"] == "fwd_bwd",
    )  # fmt: skip


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data["results"] if r.get("ms") and r["backend"] not in NOT_BACKENDS]


def fit(data: dict[str, Any]) -> dict[str, dict[str, float]]:
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    plain = [r for r in _rows(data) if not r["lengths"] and r["window"] is None]
    for r in plain:
        w = work(request_of(r))
        per_ms = w.flops / (r["ms"] * 1e9)
        if r["nq"] == r["nk"]:
            samples[r["backend"]]["fwd_bwd_tflops" if w.backward else "fwd_tflops"].append(per_ms)
        elif r["nq"] <= 16 and r["nk"] >= 32768:
            samples[r["backend"]]["tbps"].append(w.bytes / (r["ms"] * 1e9))
    fitted: dict[str, dict[str, float]] = {}
    for backend, found in samples.items():
        fitted[backend] = {name: statistics.median(v) for name, v in found.items()}
    for r in plain:
        tbps = fitted.get(r["backend"], {}).get("tbps")
        if tbps and r["nq"] <= 16 and r["nk"] == 4096:
            w = work(request_of(r))
            samples[r["backend"]]["host_us"].append(max(1.0, (r["ms"] - w.bytes / (tbps * 1e9)) * 1e3))  # fmt: skip
    for backend, found in samples.items():
        if found.get("host_us"):
            fitted[backend]["host_us"] = statistics.median(found["host_us"])
    medians = {
        name: statistics.median(c[name] for c in fitted.values() if name in c) for name in CONSTANTS
    }
    constants = {
        b: {name: round(c.get(name, medians[name]), 3) for name in CONSTANTS}
        for b, c in sorted(fitted.items())
    }
    return constants | {"default": {name: round(v, 3) for name, v in medians.items()}}


def check(data: dict[str, Any], model: CostModel) -> list[dict[str, Any]]:
    """Per workload call: the model's pick among the timed backends against the fastest
    (ranked as CostModelPolicy ranks: compile-per-shape backends last)."""
    from attnhub.registry import get_registry

    compiles = PLUGINS_THAT_COMPILE_PER_SHAPE | {
        b.name for b in get_registry().backends() if b.compiles_per_shape
    }
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in _rows(data):
        groups[(r["name"], r["dtype"], r["mode"])].append(r)
    out = []
    for (name, dtype, mode), rows in groups.items():
        w = work(request_of(rows[0]))
        picked = min(
            rows, key=lambda r: (r["backend"] in compiles, model.cost(r["backend"])[0].ms(w))
        )
        fastest = min(rows, key=lambda r: r["ms"])
        out.append({
            "workload": name, "dtype": dtype, "mode": mode, "model_pick": picked["backend"],
            "pick_ms": picked["ms"], "fastest": fastest["backend"], "fastest_ms": fastest["ms"],
            "pick_vs_fastest": fastest["ms"] / picked["ms"],
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("workloads", type=Path)
    parser.add_argument("--device", default="sm90")
    parser.add_argument(
        "--output", type=Path, help="default: attnhub/data/cost_model_<device>.json"
    )
    parser.add_argument("--report", type=Path)
    args = parser.parse_args()
    data = json.loads(args.workloads.read_text())
    fitted = fit(data)
    default = fitted.pop("default")
    document = {
        "format": FORMAT, "device": args.device,
        "source_run": f"{args.workloads.name}: {data['env']}",
        "backends": fitted, "default": default,
    }  # fmt: skip
    output = args.output or Path(__file__).resolve().parents[1] / "attnhub" / "data" / f"cost_model_{args.device}.json"  # fmt: skip
    output.write_text(json.dumps(document, indent=1) + "\n")
    model = CostModel(args.device, output.name, {b: KernelCost(**c) for b, c in fitted.items()}, KernelCost(**default))  # fmt: skip
    rows = check(data, model)
    lines = [
        f"# Cost model fit: {output.name} from {args.workloads.name}",
        "",
        f"Run: {data['env']}. `pick/fastest` = the fastest timed backend's ms / the ms of "
        "the backend the model ranks first (1.00: the model picks the fastest).",
        "",
        "| workload | dtype | mode | model picks | ms | fastest | ms | pick/fastest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['dtype']} | {r['mode']} | {r['model_pick']} | {r['pick_ms']:.4g} | "
            f"{r['fastest']} | {r['fastest_ms']:.4g} | {r['pick_vs_fastest']:.2f} |"
        )
    ratios = [r["pick_vs_fastest"] for r in rows]
    lines += ["", f"{len(rows)} calls; median {statistics.median(ratios):.2f}, "
              f"worst {min(ratios):.2f}; >= 0.9 at {sum(x >= 0.9 for x in ratios)}.", ""]  # fmt: skip
    text = "\n".join(lines)
    if args.report:
        args.report.write_text(text)
    print(text)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
