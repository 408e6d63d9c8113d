#!/usr/bin/env bash
# compute-sanitizer over the decode-step self-check driver (SelectiveStateUpdate, CausalConv1dUpdate): memcheck
# on the full case list (misaligned buffers, odd shapes, every path and rows-per-lane variant) and racecheck on
# the quick list (the kernels share no shared memory; racecheck also reports shuffle misuse and hazards).
# Usage: sanitize_decode.sh <build dir> [log dir]. Exit status: non-zero on any finding.
set -uo pipefail
build=${1:?usage: sanitize_decode.sh <build dir> [log dir]}
logs=${2:-.}
driver="$build/cuda/mambafuse_cuda_decode_selfcheck"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
status=0
"$sanitizer" --tool memcheck --error-exitcode 3 --print-limit 20 "$driver" >"$logs/decode_memcheck.log" 2>&1 || status=1
tail -n 3 "$logs/decode_memcheck.log"
"$sanitizer" --tool racecheck --racecheck-report all --error-exitcode 3 --print-limit 20 "$driver" --quick \
  >"$logs/decode_racecheck.log" 2>&1 || status=1
tail -n 3 "$logs/decode_racecheck.log"
"$sanitizer" --tool synccheck --error-exitcode 3 --print-limit 20 "$driver" --quick \
  >"$logs/decode_synccheck.log" 2>&1 || status=1
tail -n 3 "$logs/decode_synccheck.log"
exit $status
