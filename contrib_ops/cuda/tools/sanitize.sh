#!/usr/bin/env bash
# compute-sanitizer over the CUDA self-check driver: memcheck (out-of-bounds and misaligned accesses, on the
# full case list with misaligned buffers; the four-chunk kernel and the generic kernels on the quick list) and
# racecheck (shared-memory races of the vector path's cross-warp sum, on the quick list).
# Usage: sanitize.sh <build dir> [log dir]. Exit status: non-zero on any finding.
set -uo pipefail
build=${1:?usage: sanitize.sh <build dir> [log dir]}
logs=${2:-.}
driver="$build/cuda/mambafuse_cuda_selfcheck"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=0
"$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 "$driver" >"$logs/memcheck.log" 2>&1 || status=1
tail -n 3 "$logs/memcheck.log"
MAMBAFUSE_CUDA_CHUNKS=4 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 "$driver" --quick \
  >"$logs/memcheck4.log" 2>&1 || status=1
tail -n 3 "$logs/memcheck4.log"
MAMBAFUSE_CUDA_SPECIALIZED=0 "$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 "$driver" --quick \
  >"$logs/memcheck_generic.log" 2>&1 || status=1
tail -n 3 "$logs/memcheck_generic.log"
"$sanitizer" --tool racecheck --racecheck-report all --error-exitcode 3 --print-limit 20 "$driver" --quick \
  >"$logs/racecheck.log" 2>&1 || status=1
tail -n 3 "$logs/racecheck.log"
MAMBAFUSE_CUDA_CHUNKS=4 "$sanitizer" --tool racecheck --racecheck-report all --error-exitcode 3 --print-limit 20 \
  "$driver" --quick >"$logs/racecheck4.log" 2>&1 || status=1
tail -n 3 "$logs/racecheck4.log"
# The decode-step ops' driver, where it was built (tools/sanitize_decode.sh).
if [[ -x "$build/cuda/mambafuse_cuda_decode_selfcheck" ]]; then
  bash "$(dirname "$0")/sanitize_decode.sh" "$build" "$logs" || status=1
fi
exit $status
