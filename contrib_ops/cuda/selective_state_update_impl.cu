// SelectiveStateUpdate on CUDA: the host side. Checks the arguments, chooses the path and block shape, and
// dispatches on (T, S) to the instantiations in selective_state_update_impl_t{f32,f16,bf16}.cu.
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "selective_state_update_kernels.cuh"

namespace mambafuse {
namespace {

using ssu_kernels::kBlock;

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
size_t Bytes(ElemType t) { return t == ElemType::kFloat ? 4 : 2; }
bool Supported(ElemType t) {
  return t == ElemType::kFloat || t == ElemType::kFloat16 || t == ElemType::kBFloat16;
}

int MultiprocessorCount() {
  int device = 0;
  int count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();  // a failed query must not surface as the launch's error
    return 132;          // an H100/H200's count: only sizes the grid
  }
  return count;
}

int Pow2Ceil(int64_t v) {
  int p = 1;
  while (p < v && p < 32) p *= 2;
  return p;
}

int Log2(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

const char* CheckSelectiveStateUpdateArgs(const SelectiveStateUpdateArgs& a) {
  if (!Supported(a.t_type)) return "the activation type is not float, float16 or bfloat16";
  if (a.s_type != ElemType::kFloat && a.s_type != a.t_type) return "the state type is neither float nor x's type";
  if (a.d != nullptr && a.d_type != ElemType::kFloat && a.d_type != a.t_type) {
    return "D's type is neither float nor x's type";
  }
  if (a.batch < 0 || a.heads < 0 || a.head_dim < 0 || a.state_size < 0 || a.groups <= 0) return "negative sizes";
  if (a.heads % a.groups != 0) return "heads is not a multiple of groups";
  // The grid: rows and N are int in the kernel, heads and batch are grid dimensions y and z.
  if (a.head_dim > INT_MAX / 2 || a.state_size > INT_MAX / 2 || a.heads > 65535 || a.batch > 65535) {
    return "a dimension is beyond the kernel's grid (heads and batch <= 65535, P and N < 2^30)";
  }
  return nullptr;
}

SelectiveStateUpdateLaunch ChooseSelectiveStateUpdateLaunch(const SelectiveStateUpdateArgs& a, int multiprocessors) {
  SelectiveStateUpdateLaunch launch;
  const int vec = static_cast<int>(16 / Bytes(a.s_type));
  const int64_t chunks_total = a.state_size / vec;
  const char* path = std::getenv("MAMBAFUSE_SSU_PATH");  // read per launch: tests switch it in-process
  const bool forced_scalar = path != nullptr && std::strcmp(path, "scalar") == 0;
  // 16-byte state chunks; B and C chunks of vec elements of T (8 or 16 bytes). Every row starts aligned when
  // N is a multiple of vec and the base pointers are 16-byte aligned (ORT's allocations are 256-byte aligned).
  launch.vector = !forced_scalar && a.state_size % vec == 0 && chunks_total <= 2 * 32 && Aligned(a.state, 16) &&
                  Aligned(a.present_state, 16) && Aligned(a.b, 16) && Aligned(a.c, 16);
  if (launch.vector) {
    launch.vec = vec;
    launch.lanes_per_row = Pow2Ceil(chunks_total);
    // MAMBAFUSE_SSU_LANES: fewer lanes a row (a power of two), each lane taking two chunks; the benchmark sweeps it.
    if (const char* forced = std::getenv("MAMBAFUSE_SSU_LANES")) {
      const int value = std::atoi(forced);
      if (value > 0 && (value & (value - 1)) == 0 && value < launch.lanes_per_row && 2 * value >= chunks_total) {
        launch.lanes_per_row = value;
      }
    }
    launch.chunks = static_cast<int>((chunks_total + launch.lanes_per_row - 1) / launch.lanes_per_row);
  } else {
    launch.vec = 1;
    launch.lanes_per_row = Pow2Ceil(a.state_size);
    launch.chunks = static_cast<int>((a.state_size + launch.lanes_per_row - 1) / launch.lanes_per_row);
  }
  // Rows per lane. 4 (each lane keeps 4 rows' loads in flight, and the per-head work is shared by more rows)
  // where that still gives every SM 8 blocks, i.e. when the kernel runs in waves and streams at the copy's rate;
  // 2 where fewer blocks are the whole kernel (batch 1: one wave whose time is one round of loads, and 2 rows
  // a lane was as fast as 4 or faster in every H200 measurement); 1 only where 2 would leave SMs without a
  // block. Nemotron-H-8B (H = 128, P = 64, N = 128, f32 state): batch 1 at 2 rows is 32 lanes a row, 8 rows a
  // block, 1024 blocks; batch 8 at 4 rows is 4096 blocks.
  const int teams = kBlock / launch.lanes_per_row;
  const int64_t heads_total = a.batch * a.heads;
  const auto blocks_at = [&](int rows) { return heads_total * ((a.head_dim + teams * rows - 1) / (teams * rows)); };
  int rows = 4;
  if (blocks_at(4) < 8 * static_cast<int64_t>(multiprocessors)) rows = 2;
  if (rows == 2 && blocks_at(2) < multiprocessors) rows = 1;
  if (const char* forced = std::getenv("MAMBAFUSE_SSU_ROWS")) {
    const int value = std::atoi(forced);
    if (value == 1 || value == 2 || value == 4) rows = value;
  }
  launch.rows_per_lane = rows;
  launch.rows_per_block = teams * rows;
  launch.blocks = blocks_at(rows);
  // The per-head chain (softplus, exp) once a block instead of once a thread where it was faster on the H200:
  // a half state in waves (4 rows a lane), whose kernel is bound by the instructions each thread issues
  // (Nemotron-H-8B batch 8: 0.94x the time), and a lane of two chunks (N = 256, float32 state; Bamba-9B batch 1:
  // 0.95x). Elsewhere the block's barrier cost as much as the chain or more (0.95-1.05x; at batch 1, one wave,
  // it sits on the critical path).
  launch.shared_head = launch.vector && ((Bytes(a.s_type) == 2 && rows == 4) || launch.chunks == 2);
  if (const char* forced = std::getenv("MAMBAFUSE_SSU_SHARED_HEAD")) {
    if (launch.vector && (forced[0] == '0' || forced[0] == '1') && forced[1] == '\0') {
      launch.shared_head = forced[0] == '1';
    }
  }
  return launch;
}

cudaError_t LaunchSelectiveStateUpdate(const SelectiveStateUpdateArgs& a, cudaStream_t stream) {
  if (CheckSelectiveStateUpdateArgs(a) != nullptr) return cudaErrorInvalidValue;
  if (a.batch == 0 || a.heads == 0 || a.head_dim == 0) return cudaSuccess;
  const SelectiveStateUpdateLaunch launch = ChooseSelectiveStateUpdateLaunch(a, MultiprocessorCount());
  ssu_kernels::Params params{};
  params.state = a.state;
  params.x = a.x;
  params.dt = a.dt;
  params.dt_bias = a.dt_bias;
  params.a = a.a;
  params.b = a.b;
  params.c = a.c;
  params.d = a.d;
  params.out = a.out;
  params.present = a.present_state;
  params.heads = static_cast<int>(a.heads);
  params.head_dim = static_cast<int>(a.head_dim);
  params.state_size = static_cast<int>(a.state_size);
  params.groups = static_cast<int>(a.groups);
  params.heads_per_group = static_cast<int>(a.heads / a.groups);
  params.lane_shift = Log2(launch.lanes_per_row);
  params.chunks = launch.chunks;
  params.d_is_float = a.d_type == ElemType::kFloat;
  params.softplus = a.dt_softplus;
  const dim3 grid(static_cast<unsigned>((a.head_dim + launch.rows_per_block - 1) / launch.rows_per_block),
                  static_cast<unsigned>(a.heads), static_cast<unsigned>(a.batch));
  const bool state_float = a.s_type == ElemType::kFloat;
  switch (a.t_type) {
    case ElemType::kFloat: ssu_kernels::LaunchTyped<float, float>(params, launch, grid, stream); break;
    case ElemType::kFloat16:
      if (state_float) {
        ssu_kernels::LaunchTyped<__half, float>(params, launch, grid, stream);
      } else {
        ssu_kernels::LaunchTyped<__half, __half>(params, launch, grid, stream);
      }
      break;
    default:
      if (state_float) {
        ssu_kernels::LaunchTyped<__nv_bfloat16, float>(params, launch, grid, stream);
      } else {
        ssu_kernels::LaunchTyped<__nv_bfloat16, __nv_bfloat16>(params, launch, grid, stream);
      }
      break;
  }
  // The launch's own error (bad configuration, no device, no kernel image for this GPU); never a sync.
  return cudaGetLastError();
}

}  // namespace mambafuse
