// C entry points to the CUDA launcher, for benchmarks and tests that drive the kernel directly (ctypes,
// with buffers and a stream from PyTorch): the kernel alone, without an ONNX Runtime session around it.
// Built only with MAMBAFUSE_CUDA_TOOLS=ON; not part of the shipped library.
#include <cstdint>

#include "gated_group_rms_norm_launcher.h"

#define MAMBAFUSE_BENCH_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

mambafuse::GatedGroupRMSNormArgs MakeArgs(const void* y, const void* z, const void* w, void* out, int y_type,
                                          int z_type, int w_type, int norm_type, int out_type, int out_storage_type,
                                          int64_t rows, int64_t channels, int64_t group_size, float epsilon,
                                          int gated_type = 1) {
  using mambafuse::ElemType;
  mambafuse::GatedGroupRMSNormArgs args;
  args.y = y;
  args.z = z;
  args.w = w;
  args.out = out;
  args.y_type = static_cast<ElemType>(y_type);
  args.z_type = static_cast<ElemType>(z_type);
  args.w_type = static_cast<ElemType>(w_type);
  args.norm_type = static_cast<ElemType>(norm_type);
  args.out_type = static_cast<ElemType>(out_type);
  args.out_storage_type = static_cast<ElemType>(out_storage_type);
  args.gated_type = static_cast<ElemType>(gated_type);
  args.rows = rows;
  args.channels = channels;
  args.group_size = group_size;
  args.epsilon = epsilon;
  return args;
}

}  // namespace

// Returns a cudaError_t (0 = success), or -1 when the arguments fail ValidateArgs.
MAMBAFUSE_BENCH_EXPORT int mambafuse_cuda_launch(const void* y, const void* z, const void* w, void* out, int y_type,
                                                 int z_type, int w_type, int norm_type, int out_type,
                                                 int out_storage_type, int64_t rows, int64_t channels,
                                                 int64_t group_size, float epsilon, void* stream, int path) {
  const auto args = MakeArgs(y, z, w, out, y_type, z_type, w_type, norm_type, out_type, out_storage_type, rows,
                             channels, group_size, epsilon);
  if (mambafuse::ValidateArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchGatedGroupRMSNorm(args, static_cast<cudaStream_t>(stream),
                                                             static_cast<mambafuse::CudaPath>(path)));
}

// mambafuse_cuda_launch with the gated_dtype rounding point (an ONNX type number; 1 = float = none).
MAMBAFUSE_BENCH_EXPORT int mambafuse_cuda_launch_gated(const void* y, const void* z, const void* w, void* out,
                                                       int y_type, int z_type, int w_type, int norm_type,
                                                       int out_type, int out_storage_type, int gated_type,
                                                       int64_t rows, int64_t channels, int64_t group_size,
                                                       float epsilon, void* stream, int path) {
  const auto args = MakeArgs(y, z, w, out, y_type, z_type, w_type, norm_type, out_type, out_storage_type, rows,
                             channels, group_size, epsilon, gated_type);
  if (mambafuse::ValidateArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchGatedGroupRMSNorm(args, static_cast<cudaStream_t>(stream),
                                                             static_cast<mambafuse::CudaPath>(path)));
}

// The path (1 warp, 2 vector) the launcher would take for these arguments; *warps_per_group and
// *chunks_per_thread get the vector path's configuration.
MAMBAFUSE_BENCH_EXPORT int mambafuse_cuda_choose(const void* y, const void* z, const void* w, void* out, int y_type,
                                                 int z_type, int w_type, int64_t rows, int64_t channels,
                                                 int64_t group_size, int path, int* warps_per_group,
                                                 int* chunks_per_thread) {
  const auto args = MakeArgs(y, z, w, out, y_type, z_type, w_type, y_type, y_type, y_type, rows, channels,
                             group_size, 0.f);
  int device = 0;
  int multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return -1;
  }
  const auto launch = mambafuse::ChooseCudaLaunch(args, static_cast<mambafuse::CudaPath>(path), multiprocessors);
  if (warps_per_group != nullptr) *warps_per_group = launch.warps_per_group;
  if (chunks_per_thread != nullptr) *chunks_per_thread = launch.chunks_per_thread;
  return static_cast<int>(launch.path);
}
