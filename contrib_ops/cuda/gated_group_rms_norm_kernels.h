// Between the CUDA launcher (gated_group_rms_norm_impl.cu) and the kernel instantiations
// (gated_group_rms_norm_impl_y*.cu): the kernel parameters, launch constants, and the declaration of the
// per-type launch that each instantiation file defines for one Y type.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gated_group_rms_norm_launcher.h"

namespace mambafuse {
namespace cuda_kernels {

constexpr int kWarpSize = 32;
constexpr int kWarpBlock = 128;        // warp path: 4 (row, group) items per block
constexpr int kWarpKept = 8;           // warp path: strided elements per lane kept in registers
constexpr int kVec = 8;                // vector path: elements per chunk (one 16-byte load of a 2-byte type)
constexpr int kMaxChunks = 4;          // vector path: chunks per thread kept in registers
constexpr int kMaxWarpsPerGroup = 8;   // vector path: group_size <= 8 * 32 * 4 * 8 = 8192 (8 * 32 * 1 * 8 = 2048
                                       // for the one-chunk kernel)
constexpr int kVectorBlockOneWarp = 128;  // vector path, one warp per group: 4 groups per block
constexpr int kVectorBlockMax = kMaxWarpsPerGroup * kWarpSize;

struct KernelParams {
  const void* y;
  const void* z;
  const void* w;
  void* out;
  int64_t items;           // rows * groups_per_row
  int64_t groups_per_row;
  int64_t channels;
  int group_size;
  float group_size_f;
  float inv_group_size;    // 1 / group_size (vector path: FastInvRms)
  float epsilon;
  int epilogue;            // see ForEachEpilogue
  int gated;               // rounding of h: 0 none (float), 1 float16, 2 bfloat16 (see RoundGated)
  // Vector path only (the launcher takes it only when items < 2^31, so item indices are 32-bit):
  int warps_per_group;
  int group_shift;         // log2(threads per group): threads per group are a power of two
  int groups_per_block;    // blockDim.x / threads per group
  uint32_t row_multiplier; // item / groups_per_row == (item * row_multiplier) >> row_shift (see FastDivisor)
  int row_shift;
};

// floor(x / d) for 0 <= x < 2^31 as one wide multiply and a shift (Granlund-Montgomery): with
// l = ceil(log2 d) and m = ceil(2^(31+l) / d), x * m / 2^(31+l) = x / d + an error below 2^-l <= 1/d, which
// never reaches the next integer. m < 2^32 for every d >= 1.
struct FastDivisor {
  uint32_t multiplier = 1u << 31;
  int shift = 31;
  explicit FastDivisor(int64_t d) {
    int l = 0;
    while ((int64_t{1} << l) < d) ++l;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) + static_cast<uint64_t>(d) - 1) /
                                       static_cast<uint64_t>(d));
    shift = 31 + l;
  }
};

// Launches the kernel of `launch.path` for one (Y, Z, W) type combination; errors are read by the caller.
template <typename TY, typename TZ, typename TW>
void LaunchTyped(const KernelParams& params, const CudaLaunch& launch, int multiprocessors, cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace mambafuse
