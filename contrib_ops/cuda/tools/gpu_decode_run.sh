#!/usr/bin/env bash
# The decode-step ops' GPU checks and benchmark, unattended, on a GPU machine: build the library with the CUDA
# kernels and tools (CMake + nvcc), the self-check, the pytest suite on the CUDA EP, compute-sanitizer
# (memcheck, racecheck, synccheck) and the benchmark. One log per step in $OUT (default ./gpu-out): build.log,
# selfcheck.log, pytest.log, sanitize.log, bench.log and bench_cuda_decode_ops.md, step.log and
# bench_gpu_step.md; a summary on stdout. Each
# step runs even when an earlier one failed (except that nothing runs without a build); the exit status is
# non-zero when any failed.
#
#   STEPS="build selfcheck pytest sanitize" bash contrib_ops/cuda/tools/gpu_decode_run.sh
#   STEPS="build bench" bash contrib_ops/cuda/tools/gpu_decode_run.sh
#   STEPS="build step" bash contrib_ops/cuda/tools/gpu_decode_run.sh   # the whole decode step, before vs after
#   STEPS="build cpubench" CPUBENCH_ARGS="--cold" ...   # the CPU state update on the GPU machine's host CPU
#   PYTEST_ARGS="tests/test_attention_rule.py -k cuda" picks the pytest step's tests
#
# Needs: nvcc and CMake; ONNX Runtime's headers in $ONNXRUNTIME_ROOT (default ./.ort-headers); Eigen's headers where
# the build finds them (EIGEN_DIR=<the directory holding Eigen/Core> on a machine without cmeel-eigen); for pytest and the
# ORT rows of the benchmark onnxruntime-gpu importable (e.g. PYTHONPATH=/root/ortgpu); torch with CUDA; for
# the Triton column the folder $MAMBA_SSM_TRITON (default .bench-vendor/mamba_ssm_triton) with mamba_ssm's
# ops/triton selective_state_update.py and softplus.py. CUDA_ARCHS (default 90-real) is what the build targets.
set -uo pipefail
cd "$(dirname "$0")/../../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
build=${BUILD_DIR:-build/cuda}
export PYTHONUNBUFFERED=1
steps=" ${STEPS:-build selfcheck pytest sanitize bench} "
failed=()
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
  tail -n "${TAIL:-8}" "$out/$name.log" | sed 's/^/    /'
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || echo "no nvidia-smi"
build_library() {
  local log
  log=$(mktemp)
  cmake -S contrib_ops -B "$build" -G Ninja -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON -DMAMBAFUSE_WERROR=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90-real}" -DONNXRUNTIME_ROOT="${ONNXRUNTIME_ROOT:-$PWD/.ort-headers}" \
    ${EIGEN_DIR:+-DMAMBAFUSE_EIGEN_INCLUDE_DIR="$EIGEN_DIR"} \
    2>&1 | tee "$log" || return 1
  cmake --build "$build" --parallel "$(nproc)" 2>&1 | tee -a "$log" || return 1
  # warning-free in contrib_ops/cuda, as tests/test_build_cuda.py demands
  ! grep -n 'contrib_ops/cuda/.*warning' "$log"
}
step build build_library
if [[ ! -f "$build/libmambafuse_ops.so" ]]; then
  echo "=== no library in $build: nothing else can run"
  exit 1
fi
export MAMBAFUSE_LIBRARY=$PWD/$build/libmambafuse_ops.so
selfcheck() {  # the kernels against the host reference, and the half-product identity their half path relies on
  "$build/cuda/mambafuse_cuda_decode_selfcheck" && "$build/cuda/mambafuse_cuda_half_product_check"
}
step selfcheck selfcheck
step pytest "$py" -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-tests/test_kernel_cuda_decode.py}
sanitize() {  # the three tools' logs, one after the other, in sanitize.log
  local logs
  logs=$(mktemp -d)
  bash contrib_ops/cuda/tools/sanitize_decode.sh "$build" "$logs"
  local status=$?
  for f in "$logs"/*.log; do
    echo "##### $(basename "$f")"
    tail -n 40 "$f"
  done
  return $status
}
step sanitize sanitize
step bench "$py" benchmarks/bench_cuda_decode_ops.py --build "$build" \
  --mamba-ssm "${MAMBA_SSM_TRITON:-.bench-vendor/mamba_ssm_triton}" --markdown "$out/bench_cuda_decode_ops.md" ${BENCH_ARGS:-}
# The whole decode step of the Nemotron-H-8B-shaped model, its variants side by side (graphs from
# `python benchmarks/bench_gpu_nemotron.py export --modes decode`, in $STEP_GRAPHS).
step step "$py" benchmarks/bench_gpu_nemotron.py step --graphs ${STEP_GRAPHS:-.bench-vendor/nemotron} \
  --library "$build/libmambafuse_ops.so" --markdown "$out/bench_gpu_step.md" ${STEP_ARGS:-}
# The CPU state-update benchmark on this machine's (quieter) host CPU, the library's CPU kernels in ORT.
step cpubench "$py" -m benchmarks.bench_selective_state_update_cpu ${CPUBENCH_ARGS:-}
echo "=== failed steps: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
