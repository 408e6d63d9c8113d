// SelectiveStateUpdate CUDA kernel (the math is in selective_state_update_launcher.h and the op's doc).
//
// The op is memory-bound: each state element is read once and written once (Nemotron-H-8B, f32 state: 4 MB
// each way per layer and token) and everything else is a few KB. One block of 128 threads per (batch, head,
// block of rows p); inside it, `lanes_per_row` lanes (a power of two <= 32, within one warp) share a row and
// split its N state columns into chunks of `vec` elements, 16 bytes of state each (4 float or 8 half values).
// Each lane updates `kRows` rows, and issues every state load of its rows (kRows x kChunks 16-byte loads)
// before the first use, so the whole state of a decode step is in flight at once. The per-head scalars
// (dt, dt_bias, softplus, dA = exp(d * A), D) are recomputed by every thread from L1-cached loads, which
// costs a few instructions and no barrier; B and C chunks are loaded once per lane and reused for its rows.
// The readout sum over N is a butterfly of shuffles among the row's lanes; lane 0 writes out[b, h, p].
//
// The rounding points are those of the op: the state update is a float32 multiply and a separate add
// (__fmul_rn / __fadd_rn, never contracted into an FMA), the T-rounded products dB and dBx are rounded
// exactly as the exported graph rounds them. Only the readout's order of summation differs from a
// sequential sum (float32 accumulation, one rounding to T at the end).
//
// Block shape (ChooseSelectiveStateUpdateLaunch): a decode step moves so few bytes (8 MB at Nemotron-H-8B,
// batch 1) that the kernel is one wave whose time is the memory latency of its loads plus their transfer, so
// every SM must have work and every load must be issued up front. Nemotron-H-8B, f32 state, batch 1: 32 lanes
// a row (128 floats = 32 x 16 bytes), 4 rows a lane, 16 rows a block, 4 blocks a head: 512 blocks of 4 warps,
// 3.9 a SM on 132 SMs (15.5 warps a SM, 16 state loads of 16 bytes in flight per lane); P-blocks of 16 rows
// rather than whole heads, because 128 heads alone would leave 4 SMs idle and put 32 KB of state behind each
// block. Half state: 16 lanes a row, two rows a warp; rows a lane drop to 2 (1) while 4 (2) would give fewer
// than two blocks per SM. Batch 8: 4096 blocks, 2 waves at 16 blocks a SM. MAMBAFUSE_SSU_ROWS overrides
// rows a lane (the benchmark sweeps it).
//
// The scalar path (any N, any alignment): one element per lane, lanes striding N, the same math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "selective_state_update_launcher.h"

namespace mambafuse {
namespace ssu_kernels {

constexpr int kBlock = 128;

struct Params {
  const void* state;
  const void* x;
  const void* dt;
  const void* dt_bias;  // null: no bias
  const float* a;
  const void* b;
  const void* c;
  const void* d;  // null: no D skip
  void* out;
  void* present;
  int heads;
  int head_dim;
  int state_size;
  int heads_per_group;
  int groups;
  int lane_shift;  // log2(lanes per row)
  int chunks;      // scalar path: ceil(N / lanes per row)
  int d_is_float;  // D's type: 1 float, 0 T
  int softplus;
};

// Launches the kernel of `launch` for one (T, S) pair; defined by the instantiation files.
template <typename T, typename S>
void LaunchTyped(const Params& params, const SelectiveStateUpdateLaunch& launch, dim3 grid, cudaStream_t stream);

// The kernels are compiled only in the instantiation files (selective_state_update_impl_t*.cu define
// MAMBAFUSE_SSU_T); the host launcher sees the declaration above.
#if defined(MAMBAFUSE_SSU_T)

// --- conversions (exact widening, round-to-nearest-even narrowing) ---------------------------------
__device__ __forceinline__ float Widen(float v) { return v; }
__device__ __forceinline__ float Widen(__half v) { return __half2float(v); }
__device__ __forceinline__ float Widen(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename X>
__device__ __forceinline__ X Narrow(float f);
template <>
__device__ __forceinline__ float Narrow<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ __half Narrow<__half>(float f) {
  return __float2half_rn(f);
}
template <>
__device__ __forceinline__ __nv_bfloat16 Narrow<__nv_bfloat16>(float f) {
  return __float2bfloat16_rn(f);
}

template <typename X>
__device__ __forceinline__ float RoundTo(float f) {
  if constexpr (std::is_same_v<X, float>) {
    return f;
  } else {
    return Widen(Narrow<X>(f));
  }
}

// kN elements of X in one aligned access (16 bytes for the state, 8 or 16 for B and C).
template <typename X, int kN>
struct alignas(sizeof(X) * kN) Pack {
  X v[kN];
};

// The per-head step size d and decay dA (float32), for head h of batch row bh = b * heads + h.
template <typename T>
__device__ __forceinline__ void HeadScalars(const Params& p, int64_t bh, int h, float& d, float& da) {
  float v = Widen(static_cast<const T*>(p.dt)[bh]);
  if (p.dt_bias != nullptr) v = RoundTo<T>(v + Widen(static_cast<const T*>(p.dt_bias)[h]));
  // torch's softplus (threshold 20): log1p(exp(v)) in float32, rounded to T; above 20 the input itself.
  if (p.softplus) v = v > 20.f ? v : RoundTo<T>(log1pf(expf(v)));
  d = v;
  da = expf(__fmul_rn(v, p.a[h]));
}

// out = D ? round_T(y + round_T(x * D[h])) : y, with y = round_T(acc).
template <typename T>
__device__ __forceinline__ T Readout(const Params& p, int h, float acc, float x) {
  float y = RoundTo<T>(acc);
  if (p.d != nullptr) {
    const float dv = p.d_is_float ? static_cast<const float*>(p.d)[h] : Widen(static_cast<const T*>(p.d)[h]);
    y = __fadd_rn(y, RoundTo<T>(__fmul_rn(x, dv)));
  }
  return Narrow<T>(y);
}

// Sum over the lanes of one row (a power of two, aligned in the warp). Every lane of the warp calls it.
template <int kRows>
__device__ __forceinline__ void RowSums(float (&acc)[kRows], int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
  }
}

// The state update of one element and its readout term.
template <typename T, typename S>
__device__ __forceinline__ float Update(float s, float da, float db, float x, float c, S& stored) {
  const float dbx = RoundTo<T>(__fmul_rn(db, x));
  const S next = Narrow<S>(__fadd_rn(__fmul_rn(s, da), dbx));
  stored = next;
  return RoundTo<T>(Widen(next)) * c;
}

// Vector path: kChunks 16-byte chunks of state per lane and row, kRows rows per lane.
template <typename T, typename S, int kChunks, int kRows>
__global__ void __launch_bounds__(kBlock) VectorKernel(const Params p) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(S));
  const int lanes = 1 << p.lane_shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int team = static_cast<int>(threadIdx.x) >> p.lane_shift;
  const int teams = kBlock >> p.lane_shift;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t batch = blockIdx.z;
  const int64_t bh = batch * p.heads + h;
  const int64_t bg = batch * p.groups + h / p.heads_per_group;
  const int n_size = p.state_size, rows = p.head_dim;
  const int row0 = (static_cast<int>(blockIdx.x) * teams + team) * kRows;
  const S* state = static_cast<const S*>(p.state) + bh * rows * n_size;
  S* present = static_cast<S*>(p.present) + bh * rows * n_size;
  const T* x = static_cast<const T*>(p.x) + bh * rows;
  const T* bv = static_cast<const T*>(p.b) + bg * n_size;
  const T* cv = static_cast<const T*>(p.c) + bg * n_size;

  // Every load first: the state chunks of all rows, B and C, x; then the per-head scalars.
  Pack<S, kVec> st[kChunks][kRows];
  Pack<T, kVec> bk[kChunks], ck[kChunks];
  float xr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) xr[r] = row0 + r < rows ? Widen(x[row0 + r]) : 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int n0 = (k * lanes + lane) * kVec;
    if (n0 < n_size) {
      bk[k] = *reinterpret_cast<const Pack<T, kVec>*>(bv + n0);
      ck[k] = *reinterpret_cast<const Pack<T, kVec>*>(cv + n0);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (row0 + r < rows) {
          st[k][r] = *reinterpret_cast<const Pack<S, kVec>*>(state + static_cast<int64_t>(row0 + r) * n_size + n0);
        }
      }
    }
  }
  float d, da;
  HeadScalars<T>(p, bh, h, d, da);

  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int n0 = (k * lanes + lane) * kVec;
    if (n0 >= n_size) continue;
    float db[kVec], cf[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      db[j] = RoundTo<T>(__fmul_rn(d, Widen(bk[k].v[j])));
      cf[j] = Widen(ck[k].v[j]);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= rows) continue;
      Pack<S, kVec> next;
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[r] += Update<T, S>(Widen(st[k][r].v[j]), da, db[j], xr[r], cf[j], next.v[j]);
      *reinterpret_cast<Pack<S, kVec>*>(present + static_cast<int64_t>(row0 + r) * n_size + n0) = next;
    }
  }
  RowSums(acc, lanes);
  if (lane == 0) {
    T* out = static_cast<T*>(p.out) + bh * rows;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) out[row0 + r] = Readout<T>(p, h, acc[r], xr[r]);
    }
  }
}

// Scalar path: one element per lane, lanes striding the row; kRows rows per lane.
template <typename T, typename S, int kRows>
__global__ void __launch_bounds__(kBlock) ScalarKernel(const Params p) {
  const int lanes = 1 << p.lane_shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int team = static_cast<int>(threadIdx.x) >> p.lane_shift;
  const int teams = kBlock >> p.lane_shift;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t batch = blockIdx.z;
  const int64_t bh = batch * p.heads + h;
  const int64_t bg = batch * p.groups + h / p.heads_per_group;
  const int n_size = p.state_size, rows = p.head_dim;
  const int row0 = (static_cast<int>(blockIdx.x) * teams + team) * kRows;
  const S* state = static_cast<const S*>(p.state) + bh * rows * n_size;
  S* present = static_cast<S*>(p.present) + bh * rows * n_size;
  const T* x = static_cast<const T*>(p.x) + bh * rows;
  const T* bv = static_cast<const T*>(p.b) + bg * n_size;
  const T* cv = static_cast<const T*>(p.c) + bg * n_size;

  float xr[kRows], acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    xr[r] = row0 + r < rows ? Widen(x[row0 + r]) : 0.f;
    acc[r] = 0.f;
  }
  float d, da;
  HeadScalars<T>(p, bh, h, d, da);
  for (int k = 0; k < p.chunks; ++k) {
    const int n = k * lanes + lane;
    if (n >= n_size) break;
    S st[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      st[r] = row0 + r < rows ? state[static_cast<int64_t>(row0 + r) * n_size + n] : Narrow<S>(0.f);
    }
    const float db = RoundTo<T>(__fmul_rn(d, Widen(bv[n])));
    const float cf = Widen(cv[n]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= rows) continue;
      acc[r] += Update<T, S>(Widen(st[r]), da, db, xr[r], cf, present[static_cast<int64_t>(row0 + r) * n_size + n]);
    }
  }
  RowSums(acc, lanes);
  if (lane == 0) {
    T* out = static_cast<T*>(p.out) + bh * rows;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) out[row0 + r] = Readout<T>(p, h, acc[r], xr[r]);
    }
  }
}

template <typename T, typename S, int kRows>
void LaunchRows(const Params& params, const SelectiveStateUpdateLaunch& launch, dim3 grid, cudaStream_t stream) {
  if (!launch.vector) {
    ScalarKernel<T, S, kRows><<<grid, kBlock, 0, stream>>>(params);
  } else if (launch.chunks == 1) {
    VectorKernel<T, S, 1, kRows><<<grid, kBlock, 0, stream>>>(params);
  } else {
    VectorKernel<T, S, 2, kRows><<<grid, kBlock, 0, stream>>>(params);
  }
}

template <typename T, typename S>
void LaunchTyped(const Params& params, const SelectiveStateUpdateLaunch& launch, dim3 grid, cudaStream_t stream) {
  switch (launch.rows_per_lane) {
    case 1: LaunchRows<T, S, 1>(params, launch, grid, stream); break;
    case 2: LaunchRows<T, S, 2>(params, launch, grid, stream); break;
    default: LaunchRows<T, S, 4>(params, launch, grid, stream); break;
  }
}

#endif  // MAMBAFUSE_SSU_T

}  // namespace ssu_kernels
}  // namespace mambafuse

// Explicit instantiations for one T (the including .cu defines MAMBAFUSE_SSU_T): S = float and S = T.
#if defined(MAMBAFUSE_SSU_T)
template void mambafuse::ssu_kernels::LaunchTyped<MAMBAFUSE_SSU_T, float>(
    const mambafuse::ssu_kernels::Params&, const mambafuse::SelectiveStateUpdateLaunch&, dim3, cudaStream_t);
#if !defined(MAMBAFUSE_SSU_T_IS_FLOAT)
template void mambafuse::ssu_kernels::LaunchTyped<MAMBAFUSE_SSU_T, MAMBAFUSE_SSU_T>(
    const mambafuse::ssu_kernels::Params&, const mambafuse::SelectiveStateUpdateLaunch&, dim3, cudaStream_t);
#endif
#endif
