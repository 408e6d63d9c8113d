// GatedGroupRMSNorm on CUDA: the host side. Chooses the path and launch configuration, then dispatches on
// the (Y, Z, W) load types to one of the 27 instantiations in gated_group_rms_norm_impl_y{f32,f16,bf16}.cu.
// The kernels and the math are in gated_group_rms_norm_kernels.cuh.
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gated_group_rms_norm_kernels.h"

namespace mambafuse {
namespace {

using namespace cuda_kernels;  // NOLINT: the constants and instantiations of this op's kernels

int TypeIndex(ElemType t) { return t == ElemType::kFloat ? 0 : t == ElemType::kFloat16 ? 1 : 2; }

int EpilogueIndex(const GatedGroupRMSNormArgs& a) {
  int out_store = 0;
  if (a.out_type == ElemType::kFloat16) out_store = a.out_storage_type == ElemType::kFloat ? 2 : 1;
  if (a.out_type == ElemType::kBFloat16) out_store = a.out_storage_type == ElemType::kFloat ? 4 : 3;
  return TypeIndex(a.norm_type) * 5 + out_store;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The vector path's conditions: 16-byte aligned buffers, whole chunks, a group that fits its registers, and
// 32-bit item indices (the kernel splits them with FastDivisor; 2^31 groups is 2^31 * 8 elements at least).
bool VectorPathFits(const GatedGroupRMSNormArgs& a) {
  return Aligned16(a.y) && Aligned16(a.z) && Aligned16(a.w) && Aligned16(a.out) && a.group_size % kVec == 0 &&
         a.group_size <= static_cast<int64_t>(kVec) * kMaxChunks * kWarpSize * kMaxWarpsPerGroup &&
         a.rows * (a.channels / a.group_size) < (int64_t{1} << 31);
}

int GatedIndex(ElemType t) { return t == ElemType::kFloat16 ? 1 : t == ElemType::kBFloat16 ? 2 : 0; }

CudaPath PathFromEnv(CudaPath requested) {
  const char* forced = std::getenv("MAMBAFUSE_CUDA_PATH");  // read per launch: tests switch it in-process
  if (forced == nullptr) return requested;
  if (std::strcmp(forced, "warp") == 0) return CudaPath::kWarp;
  if (std::strcmp(forced, "vector") == 0) return CudaPath::kVector;
  return requested;
}

int MultiprocessorCount() {
  int device = 0;
  int count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();  // a failed query must not surface as the launch's error
    return 108;          // an A100's count: only sizes the grid
  }
  return count;
}

// The 27 (Y, Z, W) instantiations of both kernels, reached through a three-level switch on the types.
using LaunchFn = void (*)(const KernelParams&, const CudaLaunch&, int, cudaStream_t);

template <typename TY, typename TZ>
LaunchFn PickW(ElemType w) {
  switch (TypeIndex(w)) {
    case 0: return &LaunchTyped<TY, TZ, float>;
    case 1: return &LaunchTyped<TY, TZ, __half>;
    default: return &LaunchTyped<TY, TZ, __nv_bfloat16>;
  }
}
template <typename TY>
LaunchFn PickZW(ElemType z, ElemType w) {
  switch (TypeIndex(z)) {
    case 0: return PickW<TY, float>(w);
    case 1: return PickW<TY, __half>(w);
    default: return PickW<TY, __nv_bfloat16>(w);
  }
}
LaunchFn PickLauncher(ElemType y, ElemType z, ElemType w) {
  switch (TypeIndex(y)) {
    case 0: return PickZW<float>(z, w);
    case 1: return PickZW<__half>(z, w);
    default: return PickZW<__nv_bfloat16>(z, w);
  }
}

}  // namespace

CudaLaunch ChooseCudaLaunch(const GatedGroupRMSNormArgs& args, CudaPath requested, int multiprocessors) {
  CudaLaunch launch;
  const CudaPath path = PathFromEnv(requested);
  if (path == CudaPath::kWarp || !VectorPathFits(args)) return launch;
  launch.path = CudaPath::kVector;
  const int64_t chunks = args.group_size / kVec;
  const int64_t items = args.rows * (args.channels / args.group_size);
  const auto warps_for = [&](int per_thread) {  // fewest warps (a power of two) that hold the group
    int warps = 1;
    while (chunks > static_cast<int64_t>(warps) * kWarpSize * per_thread) warps *= 2;
    return warps;
  };
  // Measured on an H200, C = 7680/8192 in 8 groups, fp16, kernel time in a CUDA graph (RESULTS.md, launch
  // variants):
  //  - few groups (decode): the one-chunk kernel, a group spread over ceil(chunks / 32) warps, so that one
  //    group's latency, which is the whole kernel, is split over the most threads: 1 row, 2.1 us vs 2.6 for
  //    the four-chunk kernel with one warp;
  //  - many groups (from 512 rows): two chunks per thread, the fewest warps that hold the group (2 for
  //    960/1024), one block per group, no item loop: 8192 rows 96.3 us vs 99.7 for four chunks with one warp
  //    (128 registers, 25 % occupancy) and 114 for one chunk with four warps (barriers); 512 rows 6.6 us.
  //  - groups of <= 256 elements: one chunk, one warp, four groups a block (two chunks would idle half the
  //    warp).
  // "Few" is a launch of the one-chunk kernel that would fill less than 1/8 of the GPU's thread slots.
  const int64_t eighth_machine = static_cast<int64_t>(multiprocessors) * 2048 / 8;
  const bool one_chunk_fits = chunks <= static_cast<int64_t>(kMaxWarpsPerGroup) * kWarpSize;
  const bool two_chunks_fit = chunks <= static_cast<int64_t>(kMaxWarpsPerGroup) * kWarpSize * 2;
  int per_thread = kMaxChunks;
  if (one_chunk_fits && (chunks <= kWarpSize || items * warps_for(1) * kWarpSize < eighth_machine)) {
    per_thread = 1;
  } else if (two_chunks_fit) {
    per_thread = 2;
    launch.full_grid = true;
  }
  if (const char* forced = std::getenv("MAMBAFUSE_CUDA_CHUNKS")) {
    if (std::strcmp(forced, "4") == 0) per_thread = kMaxChunks;
    if (std::strcmp(forced, "2") == 0 && chunks <= static_cast<int64_t>(kMaxWarpsPerGroup) * kWarpSize * 2) {
      per_thread = 2;
    }
    if (std::strcmp(forced, "1") == 0 && one_chunk_fits) per_thread = 1;
  }
  if (const char* forced = std::getenv("MAMBAFUSE_CUDA_GRID")) launch.full_grid = std::strcmp(forced, "full") == 0;
  if (const char* forced = std::getenv("MAMBAFUSE_CUDA_SPECIALIZED")) launch.specialized = std::strcmp(forced, "0") != 0;
  launch.chunks_per_thread = per_thread;
  int warps = warps_for(per_thread);
  if (const char* forced = std::getenv("MAMBAFUSE_CUDA_WARPS_PER_GROUP")) {
    const int value = std::atoi(forced);
    if (value >= warps && value <= kMaxWarpsPerGroup && (value & (value - 1)) == 0) warps = value;
  }
  launch.warps_per_group = warps;
  return launch;
}

cudaError_t LaunchGatedGroupRMSNorm(const GatedGroupRMSNormArgs& args, cudaStream_t stream, CudaPath requested) {
  if (args.rows == 0 || args.channels == 0) return cudaSuccess;
  // FastDivisor needs groups_per_row < 2^31 (a row of 2^31 groups would be 2^31 elements at least).
  if (args.group_size <= 0 || args.group_size > INT_MAX || args.channels % args.group_size != 0 ||
      args.channels / args.group_size > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  const int multiprocessors = MultiprocessorCount();
  const CudaLaunch launch = ChooseCudaLaunch(args, requested, multiprocessors);
  KernelParams params{};
  params.y = args.y;
  params.z = args.z;
  params.w = args.w;
  params.out = args.out;
  params.groups_per_row = args.channels / args.group_size;
  params.items = args.rows * params.groups_per_row;
  params.channels = args.channels;
  params.group_size = static_cast<int>(args.group_size);
  params.group_size_f = static_cast<float>(args.group_size);
  params.inv_group_size = 1.f / static_cast<float>(args.group_size);
  params.epsilon = args.epsilon;
  params.epilogue = EpilogueIndex(args);
  params.gated = GatedIndex(args.gated_type);
  params.warps_per_group = launch.warps_per_group;
  const FastDivisor rows_of(params.groups_per_row);  // both paths split item indices with it
  params.row_multiplier = rows_of.multiplier;
  params.row_shift = rows_of.shift;
  if (launch.path == CudaPath::kVector) {
    // Threads per group are a power of two (warps_per_group is); with one warp per group, 4 groups a block.
    int shift = 0;
    while ((1 << shift) < launch.warps_per_group * kWarpSize) ++shift;
    params.group_shift = shift;
    params.groups_per_block = launch.warps_per_group == 1 ? kVectorBlockOneWarp / kWarpSize : 1;
  }
  PickLauncher(args.y_type, args.z_type, args.w_type)(params, launch, multiprocessors, stream);
  // The launch's own error (bad configuration, no device, no kernel image for this GPU); never a sync.
  return cudaGetLastError();
}

}  // namespace mambafuse
