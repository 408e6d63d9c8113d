#!/usr/bin/env bash
# Builds the decode-step CUDA kernels (SelectiveStateUpdate, CausalConv1dUpdate) for the host emulation in
# host_emulation.h, with g++ and the CUDA headers only (no GPU, no nvcc run): the self-check driver
# (mambafuse_decode_selfcheck_emulated) and the benchmarks' ctypes entry points (libmambafuse_decode_emulated.so,
# used by tests/test_kernel_cuda_decode.py's emulation test). The kernel sources are copied with their
# `<<<grid, kBlock, 0, stream>>>` launches rewritten to EmuLaunch; nothing else changes.
# Usage: emulate_decode.sh <out dir> [--run]   (--run: also run the self-check, quick list)
set -euo pipefail
out=${1:?usage: emulate_decode.sh <out dir> [--run]}
tools=$(cd "$(dirname "$0")" && pwd)
cuda_src=$(dirname "$tools")
include=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$out"
launch='s/(\w+<[^<>]*>)<<<([^,]+), kBlock, 0, stream>>>\(params\)/EmuLaunch(\1, \2, params)/'
sed -E "$launch" "$cuda_src/selective_state_update_kernels.cuh" | sed 's/^#pragma once$//' >"$out/ssu_kernels.cuh"
sed 's/#include "selective_state_update_kernels.cuh"/#include "ssu_kernels.cuh"/' \
  "$cuda_src/selective_state_update_impl.cu" >"$out/ssu_impl.cc"
sed -E "$launch" "$cuda_src/causal_conv1d_update_impl.cu" >"$out/conv_impl.cc"
cat >"$out/emu_ssu.cc" <<'CC'
#include "host_emulation.h"
#define MAMBAFUSE_SSU_T float
#define MAMBAFUSE_SSU_T_IS_FLOAT 1
#include "ssu_impl.cc"
#define MAMBAFUSE_EMU_INSTANTIATE(T, S)                                                                   \
  template void mambafuse::ssu_kernels::LaunchTyped<T, S>(const mambafuse::ssu_kernels::Params&,          \
                                                          const mambafuse::SelectiveStateUpdateLaunch&, dim3, \
                                                          cudaStream_t);
MAMBAFUSE_EMU_INSTANTIATE(__half, float)
MAMBAFUSE_EMU_INSTANTIATE(__half, __half)
MAMBAFUSE_EMU_INSTANTIATE(__nv_bfloat16, float)
MAMBAFUSE_EMU_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
CC
printf '#include "host_emulation.h"\n#include "conv_impl.cc"\n' >"$out/emu_conv.cc"
printf '#include "host_emulation.h"\n#include "tools/cuda_decode_selfcheck.cc"\n' >"$out/emu_selfcheck.cc"
printf '#include "host_emulation.h"\n#include "tools/cuda_decode_bench_launch.cc"\n' >"$out/emu_launch.cc"
flags=(-std=c++20 -O1 -fPIC -ffp-contract=off -I"$out" -I"$tools" -I"$cuda_src" -I"$cuda_src/.." -I"$include")
pids=()
for name in emu_ssu emu_conv emu_selfcheck emu_launch; do
  ${CXX:-g++} "${flags[@]}" -c "$out/$name.cc" -o "$out/$name.o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
${CXX:-g++} -o "$out/mambafuse_decode_selfcheck_emulated" "$out/emu_ssu.o" "$out/emu_conv.o" "$out/emu_selfcheck.o" -lpthread
${CXX:-g++} -shared -o "$out/libmambafuse_decode_emulated.so" "$out/emu_ssu.o" "$out/emu_conv.o" "$out/emu_launch.o" \
  -lpthread
if [[ "${2:-}" == "--run" ]]; then
  "$out/mambafuse_decode_selfcheck_emulated" --quick
fi
