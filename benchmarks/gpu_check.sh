#!/usr/bin/env bash
# The H200 evidence run, in one call: install, then the GPU test suite (conformance of
# every CUDA backend in bf16/fp16/fp32, large shapes), the FlexAttention plugin's
# conformance, triton_flash's own GPU evidence (memory, determinism, long N), and the
# benchmark grid. Everything lands under $OUT; what is kept is committed under
# benchmarks/results/ as the kind's current file (<kind>-h200.*, the previous one moved to
# archive/: see benchmarks/results/README.md).
#
#   bash benchmarks/gpu_check.sh [tests|evidence|bench|all]   (default: all)
set -uo pipefail
STEP=${1:-all}
OUT=${OUT:-/tmp/attnhub-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
DATE=$(date -u +%Y-%m-%d)

# xformers (and the CUDA 12 runtime it needs) travel as wheels in .whl/ (see gpu.md).
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site \
        LD_LIBRARY_PATH=/tmp/site/nvidia/cuda_runtime/lib:${LD_LIBRARY_PATH:-}
fi
python3 -m pip install -q --no-build-isolation --no-deps -e . ./plugins/attnhub-flex \
    ./plugins/attnhub-template || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu \
    --format=csv | tee "$OUT/nvidia-smi.csv"
python3 -m attnhub info | tee "$OUT/info.txt"

if [[ $STEP == tests || $STEP == all ]]; then
    # -m gpu: the CUDA half of the suite (conformance on CUDA runs large cases).
    timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -v -m gpu -p no:cacheprovider tests \
        --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -n 40
    mkdir -p /tmp/empty-dir
    timeout ${FLEX_TIMEOUT:-90} python3 -m pytest -q -p no:cacheprovider -p attnhub.testing \
        --attnhub-backend flex_attention --attnhub-device cuda --attnhub-size large \
        -v --rootdir /tmp /tmp/empty-dir > "$OUT/flex-conformance.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/flex-conformance.log" | tail -n 20
    python3 benchmarks/gpu_summary.py "$OUT/gpu-tests.log" "$OUT/flex-conformance.log" \
        --out "$OUT/gpu-check-$DATE.json"
fi
if [[ $STEP == evidence || $STEP == all ]]; then
    [[ -f benchmarks/triton_flash_gpu.py ]] && timeout 300 python3 benchmarks/triton_flash_gpu.py \
        "$OUT/triton_flash-gpu-check-$DATE.json" 2>&1 | tail -n 60
fi
if [[ $STEP == bench || $STEP == all ]]; then
    timeout 540 python3 -m attnhub bench --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -n 80
fi
ls -la "$OUT"
