#!/usr/bin/env bash
# One H200 call that checks and times what a change can move, writing under $OUT:
#   gpu-tests.log     the whole GPU suite (pytest -m gpu -n 6: bf16, fp16, fp32)
#   demo.log          `attnhub demo` (the large model, stock vs patched, judged)
#   workloads.json/md `attnhub bench --workloads` (bf16): the calls real models make
#   grid-quick.json/md `attnhub bench --quick`: triton_flash against PyTorch's kernels
#                     and FlexAttention on the grid's D=128 points (forward, backward)
# Each step has its own time limit so that the call ends inside the device's 10 minutes;
# a step cut short leaves what it wrote. Usage (on the device): bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-build-isolation --no-deps -e . -e plugins/attnhub-flex 2>&1 | grep -v WARNING
timeout "${TESTS_S:-170}" python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider \
    --continue-on-collection-errors tests 2>&1 | tail -40 > "$OUT/gpu-tests.log"
tail -3 "$OUT/gpu-tests.log"
timeout "${DEMO_S:-100}" python3 -m attnhub demo > "$OUT/demo.log" 2>&1; echo "demo exit $?" >> "$OUT/demo.log"
tail -8 "$OUT/demo.log"
timeout "${WORKLOADS_S:-200}" python3 -m attnhub bench --workloads --device cuda --dtypes bfloat16 \
    --budget 0.05 -o "$OUT/workloads.json" > /dev/null 2> "$OUT/workloads.err"
timeout "${GRID_S:-100}" python3 -m attnhub bench --quick --no-plots --no-progress \
    -o "$OUT/grid-quick.json" > /dev/null 2> "$OUT/grid-quick.err"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    from attnhub import bench_workloads as bw
    data = json.loads((out / "workloads.json").read_text())
    rows = bw.summarize(data)
    bad = [r for r in rows if (r["auto_vs_fastest"] or 0) < 0.97]
    print(f"workloads: {len(rows)} rows, auto >= 0.97x fastest at {len(rows) - len(bad)}")
except Exception as exc:
    print("workloads summary failed:", exc)
PY
