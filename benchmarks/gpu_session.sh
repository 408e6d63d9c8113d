#!/usr/bin/env bash
# Everything the CUDA kernels need a GPU for, in one go on a GPU machine: build (or take a prebuilt library),
# the CUDA self-check, the GPU pytest suite, compute-sanitizer memcheck + racecheck, the benchmark and Nsight
# Compute profiles. Logs and the benchmark's markdown go to $OUT (default ./gpu-out). Each step runs even when
# an earlier one failed; the exit status is non-zero when any failed.
#
#   bash benchmarks/gpu_session.sh                 # builds into build/cuda with cmake + nvcc
#   MAMBAFUSE_PREBUILT=.gpu-build bash benchmarks/gpu_session.sh   # a library built elsewhere (same layout)
#   STEPS="selfcheck sanitizer" bash benchmarks/gpu_session.sh     # a subset of the steps
#   BASELINE_CUDA=path/to/old/contrib_ops/cuda bash ...            # also build that kernel: the bench and ncu
#                                                                  # compare it in the same process
#   STEPS=mobius bash ...  # the mobius cuda-target builds under the CUDA EP and in onnxruntime-genai-cuda
#   STEPS=e2e bash ...   # the Nemotron-H-8B-shaped model (benchmarks/bench_gpu_nemotron.py; graphs exported first)
#   STEPS="pytest_prefill budget_prefill sanitizer_prefill bench_prefill conv_sweep" bash ...  # the prefill ops
#       (MambaChunkScan, CausalConv1d): their GPU suites, the scan kernels against the budget without ORT,
#       compute-sanitizer memcheck, racecheck (not on RegisterStateScan) and synccheck, the benchmark (with
#       Triton where .bench-vendor/mamba_ssm_ssd holds mamba_ssm's package) and the conv kernel's variants side by side
#   STEPS=e2e_prefill bash ...  # the Nemotron-H-8B-shaped model's 2048-token prefill: unfused, rewrite, optimize
#
# Needs onnxruntime-gpu importable for pytest_cuda and the ORT tables (e.g. PYTHONPATH=/root/ortgpu), torch with
# CUDA, ONNX Runtime headers for a build (ONNXRUNTIME_ROOT, default .ort-headers), and for the Triton column
# .bench-vendor/layernorm_gated.py. CUDA_ARCHS (default 90-real) is what the build compiles for.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
failed=()
all_steps="build selfcheck selfcheck4 selfcheck2 selfcheck_generic pytest_cuda mobius sanitizer bench ncu e2e"
all_steps+=" e2e_prefill pytest_prefill budget_prefill sanitizer_prefill bench_prefill conv_sweep"
steps=" ${STEPS:-$all_steps} "  # a subset for split sessions
step() {  # step <name> <command...>: runs, logs to $out/<name>.log, remembers failures
  local name=$1
  shift
  [[ "$steps" == *" $name "* ]] || return 0
  echo "=== $name"
  local t0=$SECONDS
  if "$@" >"$out/$name.log" 2>&1; then echo "    ok ($((SECONDS - t0)) s)"; else
    echo "    FAILED ($((SECONDS - t0)) s)"
    failed+=("$name")
  fi
  tail -n "${TAIL:-6}" "$out/$name.log" | sed 's/^/    /'
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
headers=${ONNXRUNTIME_ROOT:-$PWD/.ort-headers}
configure() {  # configure <source dir> <build dir>
  cmake -S "$1" -B "$2" -G Ninja -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON -DMAMBAFUSE_WERROR=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90-real}" -DONNXRUNTIME_ROOT="$headers" && cmake --build "$2"
}
baseline_build=${BASELINE_BUILD:-}  # a baseline built earlier (BASELINE_CUDA builds one into /tmp/mambafuse-baseline)
if [[ -n "${MAMBAFUSE_PREBUILT:-}" ]]; then
  build=$MAMBAFUSE_PREBUILT
else
  build=build/cuda
  if [[ -n "${BASELINE_CUDA:-}" ]]; then  # the previous kernel, built beside the current one (in parallel)
    baseline_src=/tmp/mambafuse-baseline/contrib_ops
    rm -rf /tmp/mambafuse-baseline && mkdir -p /tmp/mambafuse-baseline && cp -r contrib_ops "$baseline_src"
    rm -rf "$baseline_src/cuda" && cp -r "$BASELINE_CUDA" "$baseline_src/cuda"
    baseline_build=/tmp/mambafuse-baseline/build
    (configure "$baseline_src" "$baseline_build" >"$out/build_baseline.log" 2>&1 || echo "baseline build FAILED") &
  fi
  step build configure contrib_ops "$build"
  wait
fi
export MAMBAFUSE_LIBRARY=$PWD/$build/libmambafuse_ops.so
baseline_args=()
[[ -n "${baseline_build:-}" && -f "${baseline_build}/cuda/libmambafuse_cuda_bench.so" ]] &&
  baseline_args=(--baseline-build "$baseline_build")
step selfcheck "$build/cuda/mambafuse_cuda_selfcheck"
step selfcheck4 env MAMBAFUSE_CUDA_CHUNKS=4 "$build/cuda/mambafuse_cuda_selfcheck"  # the four-chunk kernel
step selfcheck2 env MAMBAFUSE_CUDA_CHUNKS=2 MAMBAFUSE_CUDA_GRID=full "$build/cuda/mambafuse_cuda_selfcheck" --quick
# the generic kernels on the uniform-type forms too (the launcher otherwise takes their specialized kernels)
step selfcheck_generic env MAMBAFUSE_CUDA_SPECIALIZED=0 "$build/cuda/mambafuse_cuda_selfcheck"
step pytest_cuda "$py" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_cuda.py
# The mobius cuda-target builds under the CUDA EP, and onnxruntime-genai-cuda where it is importable (-s: the
# measured rounding counts, parity lines and logits differences are printed)
step mobius "$py" -m pytest -q -s -p no:cacheprovider -rs tests/test_mobius_cuda.py
step sanitizer bash contrib_ops/cuda/tools/sanitize.sh "$build" "$out"
step bench "$py" benchmarks/bench_cuda.py --build "$build" "${baseline_args[@]}" --markdown "$out/bench_cuda.md" \
  ${BENCH_ARGS:-}
ncu_profile() {  # the kernels at decode and prefill sizes, fp16
  local ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || echo /usr/local/cuda/bin/ncu)
  for size in "${NCU_SIZES:-8192x7680 512x7680 1x7680}"; do
    for s in $size; do
      echo "##### ${s} fp16"
      "$ncu" --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        "$py" benchmarks/ncu_cuda.py --build "$build" "${baseline_args[@]}" --rows "${s%x*}" --channels "${s#*x}" \
        --dtype fp16 || return 1
    done
  done
}
step ncu ncu_profile
# The Nemotron-H-8B-shaped model, graphs exported here beforehand (python -m benchmarks.bench_gpu_nemotron export)
step e2e "$py" benchmarks/bench_gpu_nemotron.py run --graphs "${E2E_GRAPHS:-.bench-vendor/nemotron}" \
  --library "$build/libmambafuse_ops.so" --markdown "$out/e2e.md"
# Its prefill by variant and kernel family (graphs exported with --modes prefill; mobius folders: --builder mobius)
e2e_prefill() {
  local mode
  for mode in prefill prefill-dynamic; do
    "$py" benchmarks/bench_gpu_nemotron.py step --mode "$mode" --graphs "${E2E_GRAPHS:-.bench-vendor/nemotron}" \
      --dtypes fp16 --library "$build/libmambafuse_ops.so" --markdown "$out/e2e_$mode.md" || return 1
  done
}
step e2e_prefill e2e_prefill
# The prefill ops: GPU suites, compute-sanitizer on their kernels, the benchmark, the conv kernel's variants
step pytest_prefill "$py" -m pytest -q -p no:cacheprovider -rs tests/test_mamba_chunk_scan_cuda.py \
  tests/test_causal_conv1d_cuda.py tests/test_prefill_ops_placement.py
# Both half-path scan kernels against the float64 budget without ONNX Runtime (the bench library and PyTorch)
step budget_prefill "$py" contrib_ops/cuda/tools/scan_budget_gpu.py "$build/cuda/libmambafuse_cuda_prefill_bench.so"
# racecheck leaves RegisterStateScan out: it mis-reports that kernel's barriers (sanitize_prefill.py's docstring);
# tests/test_prefill_cuda_races.py checks them
sanitize_prefill() {
  local tool states
  for tool in memcheck racecheck synccheck; do
    states=registers,shared
    [[ $tool == racecheck ]] && states=shared
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$py" contrib_ops/cuda/tools/sanitize_prefill.py \
      "$build/cuda/libmambafuse_cuda_prefill_bench.so" --quick --states "$states" || return 1
  done
}
step sanitizer_prefill sanitize_prefill
triton_args=()
[[ -d .bench-vendor/mamba_ssm_ssd ]] && triton_args=(--triton .bench-vendor/mamba_ssm_ssd)
step bench_prefill "$py" benchmarks/bench_cuda_prefill.py --bench-lib "$build/cuda/libmambafuse_cuda_prefill_bench.so" \
  "${triton_args[@]}" --markdown "$out/bench_prefill.md"
step conv_sweep "$py" benchmarks/sweep_cuda_conv.py --variant v8= --variant "v16=-DMAMBAFUSE_CONV_VECTOR_BYTES=16" \
  --variant "v4=-DMAMBAFUSE_CONV_VECTOR_BYTES=4" --markdown "$out/conv_sweep.md"
echo "=== failed steps: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
