#!/usr/bin/env bash
# Builds the prefill CUDA kernels (MambaChunkScan, CausalConv1d) for the host emulation in host_emulation.h and
# host_warp_mma.h, with g++ and the CUDA headers only (no GPU, no nvcc run): libmambafuse_prefill_emulated.so, the
# benchmarks' ctypes entry points (tools/cuda_prefill_bench_launch.cc) on host memory, used by
# tests/test_prefill_cuda_emulation.py. The kernel sources are copied with their `<<<grid, block, bytes, stream>>>`
# launches rewritten to EmuLaunch and their `extern __shared__` arrays to EmuDynamicShared, and host_warp_mma.h and
# host_approx_math.h copied in as warp_mma.cuh and approx_math.cuh; nothing else changes. The CPU core's argument
# checks link in; its math entry points (which the emulated library never calls) are stubs that abort.
# Usage: emulate_prefill.sh <out dir> [kernel source for mamba_chunk_scan_impl.cu]   (the second: try a variant)
set -euo pipefail
out=${1:?usage: emulate_prefill.sh <out dir> [mamba_chunk_scan_impl.cu variant]}
tools=$(cd "$(dirname "$0")" && pwd)
cuda_src=$(dirname "$tools")
ops=$(dirname "$cuda_src")
scan=${2:-$cuda_src/mamba_chunk_scan_impl.cu}
include=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$out"
source "$tools/emulate_common.sh"
emu_rewrite "$scan" "$out/scan_impl.cc"
emu_rewrite "$cuda_src/causal_conv1d_impl.cu" "$out/conv_impl.cc"
cp "$tools/host_warp_mma.h" "$out/warp_mma.cuh"
cp "$tools/host_approx_math.h" "$out/approx_math.cuh"
printf '#include "host_emulation.h"\n#include "scan_impl.cc"\n' >"$out/emu_scan.cc"
printf '#include "host_emulation.h"\n#include "conv_impl.cc"\n' >"$out/emu_conv.cc"
printf '#include "host_emulation.h"\n#include "tools/cuda_prefill_bench_launch.cc"\n' >"$out/emu_launch.cc"
cat >"$out/emu_cpu_stubs.cc" <<'CC'
// The CPU math entry points the argument checks' files refer to; the emulated library runs only CUDA kernels.
#include <cstdio>
#include <cstdlib>
#include "causal_conv1d_impl.h"
#include "gated_group_rms_norm_impl.h"
#include "mamba_chunk_scan_impl.h"
namespace mambafuse::isa_generic {
[[noreturn]] static void NotHere() {
  std::fputs("libmambafuse_prefill_emulated: a CPU kernel was called\n", stderr);
  std::abort();
}
void ComputeItems(const GatedGroupRMSNormArgs&, int64_t, int64_t) { NotHere(); }
void MambaChunkScanItems(const MambaChunkScanCpuArgs&, int64_t, int64_t) { NotHere(); }
void CausalConv1dItems(const CausalConv1dCpuArgs&, int64_t, int64_t) { NotHere(); }
}  // namespace mambafuse::isa_generic
CC
flags=(-std=c++20 -O2 -fPIC -ffp-contract=off -I"$out" -I"$tools" -I"$cuda_src" -I"$ops" -I"$ops/cpu" -I"$include")
objects=()
pids=()
for source in "$out/emu_scan.cc" "$out/emu_conv.cc" "$out/emu_launch.cc" "$out/emu_cpu_stubs.cc" \
  "$ops/cpu/mamba_chunk_scan_impl.cc" "$ops/cpu/causal_conv1d_impl.cc" "$ops/cpu/gated_group_rms_norm_impl.cc"; do
  object="$out/$(basename "${source%.cc}").o"
  ${CXX:-g++} "${flags[@]}" -c "$source" -o "$object" &
  pids+=($!)
  objects+=("$object")
done
for pid in "${pids[@]}"; do wait "$pid"; done
${CXX:-g++} -shared -Wl,--no-undefined -o "$out/libmambafuse_prefill_emulated.so" "${objects[@]}" -lpthread
