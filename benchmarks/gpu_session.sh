#!/usr/bin/env bash
# One H200 call that checks and times what a change can move, writing under $OUT.
# Each step runs when its time limit (seconds) is > 0 and is cut at that limit, so that
# the call ends inside the device's 10 minutes; a step cut short leaves what it wrote.
#   TESTS_S     gpu-tests.log: the GPU suite (pytest -m gpu -n 6; cut by SIGINT, so the
#               failures so far are still summarized); TESTS: the paths (default tests)
#   NOTGPU_S    notgpu-tests.log: the tests not marked gpu, run on the device (NOTGPU: the
#               paths, default tests; NOTGPU_K: a -k expression). There the flex plugin is
#               installed and the Triton interpreter off, so CPU calls take other backends
#               than on the dev machine, and tests that pick CUDA when present run on it
#   PROBE_S     sdpa-mask-probe.txt/json: benchmarks/sdpa_mask_probe.py
#   DEMO_S      demo.log: `attnhub demo` (the large model, stock vs patched, judged)
#   OVERHEAD_S  overhead.json/txt: dispatch overhead over PyTorch's own calls
#   CHURN_S     churn.json/txt: per-call cost with a new key length each call
#   SOFTCAP_S   softcap-probe.txt: benchmarks/softcap_probe.py with the kernels' tanh as
#               shipped (approx) and swapped for the exp2 formula (exact), one after the
#               other (SOFTCAP_ARGS, default --no-flex)
#   INFMODE_S   inference-mode-probe.txt: benchmarks/inference_mode_probe.py (a patched
#               padded forward under inference_mode against no_grad; INFMODE_ARGS)
#   TINYBWD_S   tiny-backward.txt: benchmarks/tiny_backward_probe.py (auto's tiny fwd+bwd step)
#   GAP_S       decode-gap.json/txt: benchmarks/decode_gap_probe.py (GAP_ARGS, e.g. --shape ...)
#   DECODE_S    decode.json/md/-bandwidth.png: `attnhub bench --decode` (DECODE_ARGS, e.g. --no-sweep)
#   HOST_S      host-time-tiny.json/md, host.log: benchmarks/host_time.py (the tiny call's host time;
#               HOST_ARGS, e.g. --profile --profile-only=mask: enqueue and cProfile cases)
#   SERVING_S   serving.json/txt: `attnhub bench --serving` (SERVING_ARGS, e.g. --quick)
#   VARLEN_S    varlen.json/txt: `attnhub bench --varlen` (VARLEN_ARGS, e.g. --iters 10)
#   CP_S        context-parallel*: benchmarks/context_parallel.py at world size 1 (torchrun)
#   MODELS_S    models.json/md: `attnhub bench --models` (MODELS: comma-separated names;
#               MODELS_REPEATS: timed repetitions per way, default 3)
#   PROFILE_S   model-profile.json/md: benchmarks/model_profile.py, attention kernels' share of
#               a model step per way (PROFILE_MODELS, default Gemma 2; PROFILE_TASK: train,
#               generate, generate_padded or prefill_padded, default train;
#               PROFILE_HOST_TOP: also a cProfile of one run per way, this many functions)
#   WORKLOADS_S workloads.json/md: `attnhub bench --workloads` (DTYPES, default bfloat16;
#               WORKLOADS_ONLY: only the workloads whose name contains it, or any of a
#               comma-separated list; WORKLOADS_BUDGET: seconds per competitor, default 0.04;
#               WORKLOADS_SET: issue16 (default), models or all: --workload-set)
#   GRID_S      grid-quick.json/md: `attnhub bench --quick` (GRID_ARGS: other grid options in
#               its place, e.g. --dtypes=bf16,fp16 --head-dims=128 --seqlens=1024,4096,16384)
#   BSPROBE_S   block-sparse-probe.txt: benchmarks/block_sparse_probe.py (BSPROBE_ARGS, e.g.
#               --forward: the pointer forward against the Gluon one, forced rows;
#               --gluon-backward: the backward with the Gluon dQ and dK/dV forced)
#   MASKPROBE_S masked-fwd-probe.txt: benchmarks/masked_fwd_probe.py (MASKPROBE_ARGS, e.g.
#               --shape 4,16,4096,128): the dense-mask forward under forced configurations
#   MASKBWD_S   masked-bwd-probe.txt: benchmarks/masked_bwd_probe.py (MASKBWD_ARGS, e.g.
#               --configs=64,128,8,2/128,64,8,2): the dense-mask backward under forced rows
#   GLUONBWD_S  gluon-bwd-probe.txt: benchmarks/gluon_bwd_probe.py (GLUONBWD_ARGS, e.g.
#               --shapes "4,16,16,4096"): the Gluon backward kernels forced, the table's
#               backward, cuDNN and SDPA flash beside them
#   BLOCKSPARSE_S block-sparse.json/md: `attnhub bench --block-sparse --no-grid` (Flex beside it)
#   TMA_S       tma-sweep.json/log: benchmarks/tma_sweep.py (TMA_ARGS, e.g. --head-dims 128)
#   FUZZ_S      patch-fuzz-N.txt: benchmarks/patch_fuzz.py --device cuda, FUZZ_PROCS processes
#               at once (default 3; seeds 1..N, FUZZ_ARGS e.g. --cases 400), each cut at FUZZ_S
#               (FUZZ_DEVICE: another device than cuda)
#   CAUSALPROBE_S sdpa-causal-probe.txt: benchmarks/sdpa_causal_probe.py (PyTorch's kernels
#               with is_causal off the square: output and gradients against float64)
#   FLOATMASK_S float-mask-probe.txt: benchmarks/float_mask_probe.py (a float mask with
#               finfo.min padding rows, fwd and fwd+bwd: triton_flash, SDPA, Flex; errors
#               against float64 and times; FLOATMASK_ARGS e.g. --dtype fp16)
#   SWEEP_S     sweep.json/log: benchmarks/triton_flash_gpu.py's launch-config sweep (B4 H8,
#               causal and not; SWEEP_DIMS head dims, default 256; SWEEP_SEQLENS, default
#               4096), SDPA flash and cuDNN timed beside it
# Usage (on the device): TESTS_S=150 MODELS_S=200 bash benchmarks/gpu_session.sh
# The *_ARGS variables are split by the shell without quote removal: write
# GLUONBWD_ARGS='--shapes=4,16,16,4096;2,32,8,8192', not --shapes "..." (the quotes
# reach the script). To read the bundle in the same call, unpack it outside $OUT
# (tar xzf "$OUT/session.tgz" -C /tmp/x): unpacked into $OUT, its files push the bundle
# past the device's 8 returned files. TESTS_N (default 6, for an H200) workers share one
# GPU: on an 80 GB H100 take 4 (6, 8 and 10 ran tests out of memory there).
# The steps write into a scratch folder, bundled into $OUT/session.tgz (the only file in
# $OUT) after each step: the device returns at most 8 files (more, and the rest are lost),
# and a call cut at its limit still returns what the finished steps wrote. A command run
# after this script in the same call must not write session.tgz again (tar of $OUT into
# it replaced the bundle with itself on 2026-12-02): write other files beside it.
# Kept outputs are committed as benchmarks/results/<kind>-h200.* (gpu-tests-h200.log,
# demo-h200.log, ...), the previous ones moved to archive/ (benchmarks/results/README.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
DEST=${OUT:-out}
OUT=$(mktemp -d)
mkdir -p "$DEST"
python3 -m pip install -q --no-build-isolation --no-deps -e . -e plugins/attnhub-flex 2>&1 | grep -v WARNING

step() {  # step LIMIT_S NAME COMMAND...: run COMMAND under LIMIT_S seconds, if > 0
    local limit=$1 name=$2
    shift 2
    [ "${limit:-0}" -gt 0 ] || return 0
    local start=$SECONDS
    timeout -s INT -k 10 "$limit" "$@"
    echo "[$name: exit $?, $((SECONDS - start)) s]"
    tar czf "$DEST/session.tgz" -C "$OUT" . 2>/dev/null
}

# -v: each test's outcome is logged as it ends, so a step cut at its limit (SIGINT, then
# SIGKILL when pytest-xdist does not stop in time) still says which failed.
step "${TESTS_S:-0}" tests python3 -m pytest -m gpu -n "${TESTS_N:-6}" -v -rfE --tb=line -p no:cacheprovider --timeout 120 \
    --continue-on-collection-errors ${TESTS:-tests} > "$OUT/gpu-tests.log" 2>&1
grep -E "FAILED|ERROR" "$OUT/gpu-tests.log" 2>/dev/null | grep -v "^FAILED\|^ERROR" | head -20
tail -3 "$OUT/gpu-tests.log" 2>/dev/null
step "${NOTGPU_S:-0}" notgpu python3 -m pytest -m "not gpu" -n "${TESTS_N:-6}" -v -rfE --tb=short \
    -p no:cacheprovider --timeout 120 ${NOTGPU_K:+-k "$NOTGPU_K"} ${NOTGPU:-tests} \
    > "$OUT/notgpu-tests.log" 2>&1
tail -3 "$OUT/notgpu-tests.log" 2>/dev/null
step "${PROBE_S:-0}" probe python3 benchmarks/sdpa_mask_probe.py --json "$OUT/sdpa-mask-probe.json" \
    > "$OUT/sdpa-mask-probe.txt" 2>&1
cat "$OUT/sdpa-mask-probe.txt" 2>/dev/null
step "${DEMO_S:-0}" demo python3 -m attnhub demo > "$OUT/demo.log" 2>&1
tail -4 "$OUT/demo.log" 2>/dev/null
step "${OVERHEAD_S:-0}" overhead python3 benchmarks/overhead.py --device cuda --rounds 40 \
    --repeat 500 --json "$OUT/overhead.json" > "$OUT/overhead.txt" 2>&1
cat "$OUT/overhead.txt" 2>/dev/null
step "${SOFTCAP_S:-0}" softcap bash -c "for t in approx exact; do python3 benchmarks/softcap_probe.py --tanh \$t ${SOFTCAP_ARGS:---no-flex}; done" \
    > "$OUT/softcap-probe.txt" 2>&1
cat "$OUT/softcap-probe.txt" 2>/dev/null
step "${INFMODE_S:-0}" infmode python3 benchmarks/inference_mode_probe.py ${INFMODE_ARGS:-} \
    > "$OUT/inference-mode-probe.txt" 2>&1
cat "$OUT/inference-mode-probe.txt" 2>/dev/null
step "${CHURN_S:-0}" churn python3 benchmarks/shape_churn_probe.py --json "$OUT/churn.json" \
    > "$OUT/churn.txt" 2>&1
cat "$OUT/churn.txt" 2>/dev/null
step "${TINYBWD_S:-0}" tiny-backward python3 benchmarks/tiny_backward_probe.py \
    > "$OUT/tiny-backward.txt" 2>&1
cat "$OUT/tiny-backward.txt" 2>/dev/null
step "${GAP_S:-0}" decode-gap python3 benchmarks/decode_gap_probe.py --json "$OUT/decode-gap.json" \
    ${GAP_ARGS:-} > "$OUT/decode-gap.txt" 2>&1
head -12 "$OUT/decode-gap.txt" 2>/dev/null
step "${DECODE_S:-0}" decode python3 -m attnhub bench --decode -o "$OUT/decode.json" ${DECODE_ARGS:-} \
    > "$OUT/decode.log" 2>&1
tail -40 "$OUT/decode.md" 2>/dev/null
step "${HOST_S:-0}" host python3 benchmarks/host_time.py "$OUT" ${HOST_ARGS:-} > "$OUT/host.log" 2>&1
cat "$OUT/host-time-tiny.md" 2>/dev/null
step "${SERVING_S:-0}" serving python3 -m attnhub bench --serving -o "$OUT/serving.json" ${SERVING_ARGS:-} \
    > "$OUT/serving.txt" 2>&1
cat "$OUT/serving.txt" 2>/dev/null
step "${VARLEN_S:-0}" varlen python3 -m attnhub bench --varlen -o "$OUT/varlen.json" ${VARLEN_ARGS:-} \
    > "$OUT/varlen.txt" 2>&1
cat "$OUT/varlen.txt" 2>/dev/null
step "${CP_S:-0}" context-parallel torchrun --standalone --nproc-per-node=1 \
    benchmarks/context_parallel.py --out "$OUT/cp" --impls attnhub_cp,torch_cp,attnhub_single,sdpa_single \
    --seqlens "${CP_SEQLENS:-8192,32768,131072}" > "$OUT/cp.log" 2>&1
cat "$OUT/cp/context-parallel.md" 2>/dev/null
step "${MODELS_S:-0}" models python3 -m attnhub bench --models --model-names "${MODELS:-llama,mistral-window1024,gemma2-window1024-softcap50,qwen2}" \
    --device cuda --repeats "${MODELS_REPEATS:-3}" -o "$OUT/models.json" > "$OUT/models.md" 2> "$OUT/models.err"
cat "$OUT/models.md" 2>/dev/null
step "${PROFILE_S:-0}" profile python3 benchmarks/model_profile.py \
    --models "${PROFILE_MODELS:-gemma2-window1024-softcap50}" --task "${PROFILE_TASK:-train}" --host-top "${PROFILE_HOST_TOP:-0}" \
    --json "$OUT/model-profile.json" > "$OUT/model-profile.md" 2> "$OUT/model-profile.err"
head -40 "$OUT/model-profile.md" 2>/dev/null; tail -5 "$OUT/model-profile.err" 2>/dev/null
step "${WORKLOADS_S:-0}" workloads python3 -m attnhub bench --workloads --device cuda \
    --dtypes "${DTYPES:-bfloat16}" --budget "${WORKLOADS_BUDGET:-0.04}" --workload-set "${WORKLOADS_SET:-issue16}" ${WORKLOADS_ONLY:+--only "$WORKLOADS_ONLY"} \
    -o "$OUT/workloads.json" > /dev/null 2> "$OUT/workloads.err"
step "${GRID_S:-0}" grid python3 -m attnhub bench ${GRID_ARGS:---quick} --no-plots --no-progress \
    -o "$OUT/grid-quick.json" > /dev/null 2> "$OUT/grid-quick.err"
step "${BSPROBE_S:-0}" block-sparse-probe python3 benchmarks/block_sparse_probe.py ${BSPROBE_ARGS:-} \
    > "$OUT/block-sparse-probe.txt" 2>&1
cat "$OUT/block-sparse-probe.txt" 2>/dev/null | grep -v Warning | tail -40
step "${MASKPROBE_S:-0}" masked-fwd-probe python3 benchmarks/masked_fwd_probe.py ${MASKPROBE_ARGS:-} \
    > "$OUT/masked-fwd-probe.txt" 2>&1
grep -v Warning "$OUT/masked-fwd-probe.txt" 2>/dev/null | tail -20
step "${MASKBWD_S:-0}" masked-bwd-probe python3 benchmarks/masked_bwd_probe.py ${MASKBWD_ARGS:-} \
    > "$OUT/masked-bwd-probe.txt" 2>&1
grep -v Warning "$OUT/masked-bwd-probe.txt" 2>/dev/null | tail -30
step "${GLUONBWD_S:-0}" gluon-bwd-probe python3 benchmarks/gluon_bwd_probe.py ${GLUONBWD_ARGS:-} \
    > "$OUT/gluon-bwd-probe.txt" 2>&1
grep -v Warning "$OUT/gluon-bwd-probe.txt" 2>/dev/null | tail -60
step "${BLOCKSPARSE_S:-0}" block-sparse python3 -m attnhub bench --block-sparse --no-grid --no-progress \
    -o "$OUT/block-sparse.json" > "$OUT/block-sparse.log" 2>&1
grep "fwd_bwd" "$OUT/block-sparse.md" 2>/dev/null
step "${TMA_S:-0}" tma-sweep python3 benchmarks/tma_sweep.py "$OUT/tma-sweep.json" ${TMA_ARGS:-} \
    > "$OUT/tma-sweep.log" 2>&1
grep -c '"kernel"' "$OUT/tma-sweep.log" 2>/dev/null; grep -m5 error "$OUT/tma-sweep.log" 2>/dev/null | cut -c1-300
# Each process under its own timeout (a signal to the step's shell would not reach them;
# on the dev CPU one of three once ran on past its SIGINT: -k 10 kills a straggler).
step "$((${FUZZ_S:-0} > 0 ? ${FUZZ_S:-0} + 30 : 0))" patch-fuzz bash -c "for s in \$(seq ${FUZZ_PROCS:-3}); do \
    timeout -s INT -k 10 ${FUZZ_S:-0} python3 benchmarks/patch_fuzz.py --device ${FUZZ_DEVICE:-cuda} --seed \$s \
    ${FUZZ_ARGS:-} > $OUT/patch-fuzz-\$s.txt 2>&1 & done; wait"
grep -hE "^[a-z0-9]+-B|^seed" "$OUT"/patch-fuzz-*.txt 2>/dev/null | cut -c1-400
step "${CAUSALPROBE_S:-0}" causal-probe python3 benchmarks/sdpa_causal_probe.py \
    > "$OUT/sdpa-causal-probe.txt" 2>&1
grep -v Warning "$OUT/sdpa-causal-probe.txt" 2>/dev/null | tail -70
step "${FLOATMASK_S:-0}" float-mask-probe python3 benchmarks/float_mask_probe.py ${FLOATMASK_ARGS:-} \
    > "$OUT/float-mask-probe.txt" 2>&1
grep -v Warning "$OUT/float-mask-probe.txt" 2>/dev/null | tail -30
step "${SWEEP_S:-0}" sweep python3 benchmarks/triton_flash_gpu.py "$OUT/sweep.json" --only sweep \
    --sweep-head-dims "${SWEEP_DIMS:-256}" --sweep-seqlens "${SWEEP_SEQLENS:-4096}" > "$OUT/sweep.log" 2>&1
grep -c "^sweep" "$OUT/sweep.log" 2>/dev/null
[ -f "$OUT/workloads.json" ] && python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    from attnhub import bench_workloads as bw
    data = json.loads((out / "workloads.json").read_text())
    rows = bw.summarize(data)
    bad = [r for r in rows if (r["auto_vs_fastest"] or 0) < 0.97]
    slower = [r for r in rows if (r["auto_vs_sdpa"] or 0) < 1.0]
    print(f"workloads: {len(rows)} rows, auto >= 0.97x fastest at {len(rows) - len(bad)}, "
          f"auto slower than sdpa at {len(slower)}")
    (out / "workloads.md").write_text(bw.markdown(data))
except Exception as exc:
    print("workloads summary failed:", exc)
PY
tar czf "$DEST/session.tgz" -C "$OUT" . 2>/dev/null
true
