// Launcher of the GatedGroupRMSNorm CUDA kernels: plain C++ and the CUDA runtime types only. ONNX
// Runtime's C++ headers do not compile under nvcc 13, so this is the one header that the
// .cu file and the ORT-facing .cc share.
#pragma once

#include <cuda_runtime_api.h>

#include "cpu/gated_group_rms_norm_impl.h"  // GatedGroupRMSNormArgs, ElemType: no ORT types

namespace mambafuse {

// The two kernels. kAuto picks kVector whenever its alignment conditions hold.
enum class CudaPath : int { kAuto = 0, kWarp = 1, kVector = 2 };

// Launch configuration, chosen on the host from the arguments and the device (see ChooseCudaLaunch).
struct CudaLaunch {
  CudaPath path = CudaPath::kWarp;
  int warps_per_group = 1;  // vector path: warps that share one (row, group)
  int chunks_per_thread = 4;  // vector path: 4 (kMaxChunks), 2 or 1, the registers per thread of its kernel
  bool full_grid = false;     // vector path: one block per item slot instead of one wave and an item loop
  bool specialized = true;    // vector path: the uniform-type kernels with one compiled epilogue, where they apply
};

// Which path and configuration LaunchGatedGroupRMSNorm uses for `args` when asked for `requested`.
// A request for kVector on arguments that do not meet its conditions falls back to kWarp.
// Environment overrides (for tests and tuning): MAMBAFUSE_CUDA_PATH=warp|vector,
// MAMBAFUSE_CUDA_WARPS_PER_GROUP=<power of two>, MAMBAFUSE_CUDA_CHUNKS=1|2|4, MAMBAFUSE_CUDA_GRID=wave|full,
// MAMBAFUSE_CUDA_SPECIALIZED=0 (the generic kernels for the uniform-type forms too).
CudaLaunch ChooseCudaLaunch(const GatedGroupRMSNormArgs& args, CudaPath requested, int multiprocessors);

// Enqueues the op on `stream`: no host synchronization, no allocation, safe under CUDA-graph capture.
// `args` must be validated (ValidateArgs) and its pointers device-accessible. Returns the launch error
// (cudaSuccess when nothing was wrong; an empty tensor launches nothing).
cudaError_t LaunchGatedGroupRMSNorm(const GatedGroupRMSNormArgs& args, cudaStream_t stream,
                                    CudaPath requested = CudaPath::kAuto);

}  // namespace mambafuse
