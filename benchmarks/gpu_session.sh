#!/usr/bin/env bash
# Everything the CUDA kernels need a GPU for, in one go on a GPU machine: build (or take a prebuilt library),
# the CUDA self-check, the GPU pytest suite, compute-sanitizer memcheck + racecheck, and the benchmark.
# Logs and the benchmark's markdown go to $OUT (default ./gpu-out). Each step runs even when an earlier
# one failed; the exit status is non-zero when any failed.
#
#   bash benchmarks/gpu_session.sh                 # builds into build/cuda with cmake + nvcc
#   MAMBAFUSE_PREBUILT=.gpu-build bash benchmarks/gpu_session.sh   # a library built elsewhere (same layout)
#   STEPS="selfcheck sanitizer" bash benchmarks/gpu_session.sh     # a subset of the steps
#
# Needs onnxruntime-gpu importable (e.g. PYTHONPATH=/root/ortgpu), torch with CUDA, ONNX Runtime headers for
# a build (ONNXRUNTIME_ROOT, default .ort-headers), and for the Triton column .bench-vendor/layernorm_gated.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
failed=()
steps=" ${STEPS:-build selfcheck selfcheck4 pytest_cuda sanitizer bench} "  # a subset for split sessions
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
  tail -n 6 "$out/$name.log" | sed 's/^/    /'
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
if [[ -n "${MAMBAFUSE_PREBUILT:-}" ]]; then
  build=$MAMBAFUSE_PREBUILT
else
  build=build/cuda
  step build bash -c "cmake -S contrib_ops -B $build -G Ninja -DMAMBAFUSE_CUDA=ON -DMAMBAFUSE_CUDA_TOOLS=ON \
    -DMAMBAFUSE_WERROR=ON -DONNXRUNTIME_ROOT=${ONNXRUNTIME_ROOT:-$PWD/.ort-headers} && cmake --build $build"
fi
export MAMBAFUSE_LIBRARY=$PWD/$build/libmambafuse_ops.so
step selfcheck "$build/cuda/mambafuse_cuda_selfcheck"
step selfcheck4 env MAMBAFUSE_CUDA_CHUNKS=4 "$build/cuda/mambafuse_cuda_selfcheck"  # the four-chunk kernel
step pytest_cuda "$py" -m pytest -q -p no:cacheprovider -rs tests/test_kernel_cuda.py
step sanitizer bash contrib_ops/cuda/tools/sanitize.sh "$build" "$out"
step bench "$py" benchmarks/bench_cuda.py --build "$build" --markdown "$out/bench_cuda.md" ${BENCH_ARGS:-}
echo "=== failed steps: ${failed[*]:-none}"
[[ ${#failed[@]} -eq 0 ]]
