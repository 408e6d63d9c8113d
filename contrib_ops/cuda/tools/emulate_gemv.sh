#!/usr/bin/env bash
# Builds DecodeMatMulNBits' CUDA kernels (the bulk-copy and register-load int4 GEMVs, the float32 one and the M > 8
# dequantization) for the host emulation in host_emulation.h and host_gemv_ptx.h, with g++ and the CUDA headers only
# (no GPU, no nvcc run): libmambafuse_gemv_emulated.so, the benchmarks' ctypes entry points
# (tools/cuda_gemv_bench_launch.cc) on host memory, used by tests/test_decode_matmul_cuda_emulation.py. The kernel
# source is copied with its `<<<grid, block, bytes, stream>>>` launches rewritten to EmuLaunch and its `extern
# __shared__` array to EmuDynamicShared, and host_gemv_ptx.h copied in as gemv_ptx.cuh; nothing else changes.
# DecodeMatMul's dense GEMV (thread-block clusters) is not emulated: its entry points are stubs that abort.
# mambafuse_emu_last_block_threads() gives the block size of the newest launch.
# Usage: emulate_gemv.sh <out dir> [kernel source for decode_matmul_nbits_impl.cu]   (the second: try a variant)
set -euo pipefail
out=${1:?usage: emulate_gemv.sh <out dir> [decode_matmul_nbits_impl.cu variant]}
tools=$(cd "$(dirname "$0")" && pwd)
cuda_src=$(dirname "$tools")
ops=$(dirname "$cuda_src")
nbits=${2:-$cuda_src/decode_matmul_nbits_impl.cu}
include=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$out"
source "$tools/emulate_common.sh"
emu_rewrite "$nbits" "$out/nbits_impl.cc"
cp "$tools/host_gemv_ptx.h" "$out/gemv_ptx.cuh"
printf '#include "host_emulation.h"\n#include "nbits_impl.cc"\n' >"$out/emu_nbits.cc"
printf '#include "host_emulation.h"\n#include "tools/cuda_gemv_bench_launch.cc"\n' >"$out/emu_launch.cc"
cat >"$out/emu_extras.cc" <<'CC'
// DecodeMatMul's entry points, which the emulated library does not build (its kernel uses thread-block clusters),
// and the block size of the newest launch (which kernel the launcher chose).
#include <cstdio>
#include <cstdlib>
#include "decode_matmul_launcher.h"
#include "host_emulation.h"
extern "C" __attribute__((visibility("default"))) unsigned mambafuse_emu_last_block_threads() {
  return emu_last_block_threads;
}
namespace mambafuse {
[[noreturn]] static void NotHere() {
  std::fputs("libmambafuse_gemv_emulated: DecodeMatMul's dense GEMV is not emulated\n", stderr);
  std::abort();
}
const char* CheckDecodeMatMulGemvArgs(const DecodeMatMulArgs&) { NotHere(); }
cudaError_t LaunchDecodeMatMulGemv(const DecodeMatMulArgs&, cudaStream_t) { NotHere(); }
}  // namespace mambafuse
CC
flags=(-std=c++20 -O2 -fPIC -ffp-contract=off -I"$out" -I"$tools" -I"$cuda_src" -I"$ops" -I"$include")
objects=()
pids=()
for source in "$out/emu_nbits.cc" "$out/emu_launch.cc" "$out/emu_extras.cc"; do
  object="$out/$(basename "${source%.cc}").o"
  ${CXX:-g++} "${flags[@]}" -c "$source" -o "$object" &
  pids+=($!)
  objects+=("$object")
done
for pid in "${pids[@]}"; do wait "$pid"; done
${CXX:-g++} -shared -Wl,--no-undefined -o "$out/libmambafuse_gemv_emulated.so" "${objects[@]}" -lpthread
