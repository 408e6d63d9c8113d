// SelectiveStateUpdate CUDA kernel (the math is in selective_state_update_launcher.h and the op's doc).
//
// The op is memory-bound: each state element is read once and written once (Nemotron-H-8B, f32 state: 4 MB
// each way per layer and token) and everything else is a few KB. One block of 128 threads per (batch, head,
// block of rows p); inside it, `lanes_per_row` lanes (a power of two <= 32, within one warp) share a row and
// split its N state columns into chunks of `vec` elements, 16 bytes of state each (4 float or 8 half values).
// Each lane updates `kRows` rows. B and C chunks are loaded once per lane and reused for its rows; the
// per-head scalars (dt, dt_bias, softplus, dA = exp(d * A), D) are recomputed by every thread, which costs a
// few dozen instructions and no barrier, or (`shared_head`, where that measured faster: a half state in waves,
// whose time is set by each thread's instruction count, and two chunks a lane) computed by warp 0 and handed to
// the block through shared memory. The readout sum over N is a butterfly of shuffles among the row's lanes,
// after which lane r of the row's lanes writes out[b, h, row r].
//
// What sets the time (H200, Nsight Compute): at batch 1 the kernel is one wave, and its time is one round of
// memory loads plus the instructions each warp must run before its first load and after its data arrive.
// So every load a thread makes is issued before any loaded value is used (the state's first; the per-head
// values as raw bits, widened later: a conversion inside the `D present?` branch made each warp wait for D
// before it issued the state loads), and the per-element work is kept short: T-rounding two values per
// packed conversion, no round trip through T where the value already is one, and with a half state the
// products d B and dB x as packed half multiplies (ChunkProducts: the same values, 7-12 % fewer instructions).
// At batch 8 the kernel streams in waves and the same instruction count decides whether it keeps up with a
// copy (the half-state kernel issued on 75 % of cycles before these changes).
//
// The rounding points are those of the op: the state update is a float32 multiply and a separate add
// (__fmul_rn / __fadd_rn, never contracted into an FMA), the T-rounded products dB and dBx are rounded
// exactly as the exported graph rounds them. Only the readout's order of summation differs from a
// sequential sum (float32 accumulation, one rounding to T at the end).
//
// Rows per lane (ChooseSelectiveStateUpdateLaunch): 4 where that still gives every SM 8 blocks (the kernel
// runs in waves), else 2, and 1 only where 2 would leave SMs without a block. Nemotron-H-8B, f32 state:
// batch 1 is 32 lanes a row (128 floats = 32 x 16 bytes), 2 rows a lane, 8 rows a block: 1024 blocks of 4
// warps, one wave, the whole 4 MB state requested up front; batch 8 is 4 rows a lane, 4096 blocks.
// MAMBAFUSE_SSU_ROWS overrides rows a lane (the benchmark sweeps it).
//
// The scalar path (any N, any alignment): one element per lane, lanes striding N, the same math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "elem_convert.cuh"
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
// kN elements of X in one aligned access (16 bytes for the state, 8 or 16 for B and C).
template <typename X, int kN>
struct alignas(sizeof(X) * kN) Pack {
  X v[kN];
};

// The per-head inputs of one (batch, head), loaded next to the state and before any of them is used: a
// value that waits on another's arrival (A behind softplus(dt), D behind the readout's shuffles) adds a round
// trip to the kernel, whose whole time at batch 1 is about one round of loads.
template <typename T>
struct HeadInputs {
  T dt;        // dt[b, h]
  T bias;      // dt_bias[h]; not read without
  float a;     // A[h]
  uint32_t d;  // D[h]'s bits (a float, or a T in the low 16 bits); not read without
};

// D's value from its bits: a float, or a T.
template <typename T>
__device__ __forceinline__ float DValue(const Params& p, uint32_t bits) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(bits);
  } else if constexpr (std::is_same_v<T, __half>) {
    return p.d_is_float ? __uint_as_float(bits) : Widen(__ushort_as_half(static_cast<unsigned short>(bits)));
  } else {
    return p.d_is_float ? __uint_as_float(bits) : Widen(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
  }
}

// The loads only, as raw values: a conversion here would make the warp wait for this load before it issues the
// next (the compiler keeps a branch's conversion inside the branch), and the state's loads come after.
template <typename T>
__device__ __forceinline__ HeadInputs<T> LoadHead(const Params& p, int64_t bh, int h) {
  HeadInputs<T> in;
  in.dt = static_cast<const T*>(p.dt)[bh];
  in.bias = p.dt_bias != nullptr ? static_cast<const T*>(p.dt_bias)[h] : T{};
  in.a = p.a[h];
  in.d = 0;
  if (p.d != nullptr) {
    in.d = sizeof(T) == 4 || p.d_is_float ? static_cast<const uint32_t*>(p.d)[h]
                                          : static_cast<const uint16_t*>(p.d)[h];
  }
  return in;
}

// The per-head step size d and decay dA (float32).
template <typename T>
__device__ __forceinline__ void HeadScalars(const Params& p, const HeadInputs<T>& in, float& d, float& da) {
  float v = Widen(in.dt);
  if (p.dt_bias != nullptr) v = RoundTo<T>(v + Widen(in.bias));
  // torch's softplus (threshold 20): log1p(exp(v)) in float32, rounded to T; above 20 the input itself.
  if (p.softplus) v = v > 20.f ? v : RoundTo<T>(log1pf(expf(v)));
  d = v;
  da = expf(__fmul_rn(v, in.a));
}

// out = D ? round_T(y + round_T(x * D[h])) : y, with y = round_T(acc).
template <typename T>
__device__ __forceinline__ T Readout(const Params& p, const HeadInputs<T>& in, float acc, float x) {
  float y = RoundTo<T>(acc);
  if (p.d != nullptr) y = __fadd_rn(y, RoundTo<T>(__fmul_rn(x, DValue<T>(p, in.d))));
  return Narrow<T>(y);
}

// Sum over the lanes of one row (a power of two <= 32, aligned in the warp). Every lane of the warp calls it.
// Unrolled over the five possible levels, each taken or not by the (uniform) row width.
template <int kRows>
__device__ __forceinline__ void RowSums(float (&acc)[kRows], int lanes) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    if (offset >= lanes) continue;
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
  }
}

// The state update of one element and its readout term (the scalar path).
template <typename T, typename S>
__device__ __forceinline__ float Update(float s, float da, float db, float x, float c, S& stored) {
  const float dbx = RoundTo<T>(__fmul_rn(db, x));
  const S next = Narrow<S>(__fadd_rn(__fmul_rn(s, da), dbx));
  stored = next;
  // round_T(present): with S = T the stored value already is one.
  return (std::is_same_v<S, T> ? Widen(next) : RoundTo<T>(Widen(next))) * c;
}

// Two values narrowed by one packed conversion (round-to-nearest-even each, as Narrow) and widened back.
template <typename X>
struct Pair;
template <>
struct Pair<__half> {
  using Type = __half2;
  static __device__ __forceinline__ Type Narrow(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 Widen(Type v) { return __half22float2(v); }
};
template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ __forceinline__ Type Narrow(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 Widen(Type v) { return __bfloat1622float2(v); }
};

// v[j] = RoundTo<X>(v[j]) for every j, two values a conversion.
template <typename X, int kN>
__device__ __forceinline__ void RoundAll(float (&v)[kN]) {
  if constexpr (!std::is_same_v<X, float>) {
    static_assert(kN % 2 == 0, "pairs");
#pragma unroll
    for (int j = 0; j < kN; j += 2) {
      const float2 w = Pair<X>::Widen(Pair<X>::Narrow(v[j], v[j + 1]));
      v[j] = w.x;
      v[j + 1] = w.y;
    }
  }
}

// stored = Narrow<S>(v) element by element, two values a conversion; v becomes the stored values (RoundTo<S>).
template <typename S, int kN>
__device__ __forceinline__ void NarrowAll(float (&v)[kN], Pack<S, kN>& stored) {
  if constexpr (std::is_same_v<S, float>) {
#pragma unroll
    for (int j = 0; j < kN; ++j) stored.v[j] = v[j];
  } else {
#pragma unroll
    for (int j = 0; j < kN; j += 2) {
      const typename Pair<S>::Type two = Pair<S>::Narrow(v[j], v[j + 1]);
      *reinterpret_cast<typename Pair<S>::Type*>(&stored.v[j]) = two;
      const float2 w = Pair<S>::Widen(two);
      v[j] = w.x;
      v[j + 1] = w.y;
    }
  }
}

// The chunk's products dB = round_T(d B) and, per row, dBx = round_T(dB x) (as float32), kVec at a time.
template <typename T, int kVec, bool kPackedHalf>
struct ChunkProducts {
  float db[kVec];
  __device__ __forceinline__ void Init(float d, const Pack<T, kVec>& b) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) db[j] = __fmul_rn(d, Widen(b.v[j]));
    RoundAll<T>(db);
  }
  __device__ __forceinline__ void Dbx(float x, T /*x_raw*/, float (&dbx)[kVec]) const {
#pragma unroll
    for (int j = 0; j < kVec; ++j) dbx[j] = __fmul_rn(db[j], x);
    RoundAll<T>(dbx);
  }
};

// With T = half both products are the half multiply of two half values (d is one: dt, dt + bias and softplus
// are each rounded to T). A float32 product of two half values is exact (11 + 11 significant bits, exponents far
// inside float32's range), so round_T of it is the exact product rounded to nearest even: what __hmul2 returns.
// One packed multiply for two elements instead of two multiplies, a packed narrowing and two widenings. Used
// with a half state (1.01-1.03x at batch 1 on the H200); with a float32 state it measured 0.98-1.01x and is not.
template <int kVec>
struct ChunkProducts<__half, kVec, true> {
  static_assert(kVec % 2 == 0, "pairs");
  __half2 db[kVec / 2];
  __device__ __forceinline__ void Init(float d, const Pack<__half, kVec>& b) {
    const __half2 d2 = __float2half2_rn(d);  // exact: d is a half value
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) db[j] = __hmul2(d2, __halves2half2(b.v[2 * j], b.v[2 * j + 1]));
  }
  __device__ __forceinline__ void Dbx(float /*x*/, __half x_raw, float (&dbx)[kVec]) const {
    const __half2 x2 = __half2half2(x_raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      const float2 f = __half22float2(__hmul2(db[j], x2));
      dbx[2 * j] = f.x;
      dbx[2 * j + 1] = f.y;
    }
  }
};

// Vector path: kChunks 16-byte chunks of state per lane and row, kRows rows per lane.
template <typename T, typename S, int kChunks, int kRows, bool kSharedHead>
__global__ void __launch_bounds__(kBlock) VectorKernel(const Params p) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(S));
  const int lanes = 1 << p.lane_shift;
  const int lane = static_cast<int>(threadIdx.x) & (lanes - 1);
  const int team = static_cast<int>(threadIdx.x) >> p.lane_shift;
  const int h = static_cast<int>(blockIdx.y);
  const int64_t bh = static_cast<int64_t>(blockIdx.z) * p.heads + h;
  const int n_size = p.state_size, rows = p.head_dim;
  // The block's first row (64-bit, the same for every thread) and this lane's place in the block (32-bit: the
  // vector path has N <= 512 and at most 512 rows a block).
  const int block_rows = (kBlock >> p.lane_shift) * kRows;
  const int row0 = static_cast<int>(blockIdx.x) * block_rows + team * kRows;
  const int64_t block_first = (bh * rows + static_cast<int64_t>(blockIdx.x) * block_rows) * n_size;
  const int lane_first = team * kRows * n_size + lane * kVec;
  const S* state = static_cast<const S*>(p.state) + block_first + lane_first;
  S* present = static_cast<S*>(p.present) + block_first + lane_first;
  // Whether chunk k of this lane is inside the row (lanes are a power of two, chunks of a row may be fewer).
  const auto in_row = [&](int k) { return (k * lanes + lane) * kVec < n_size; };

  // Every load first, the state's (from DRAM, the long ones) ahead of the rest; nothing waits on another load.
  Pack<S, kVec> st[kChunks][kRows];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (in_row(k) && row0 + r < rows) {
        st[k][r] = *reinterpret_cast<const Pack<S, kVec>*>(state + r * n_size + k * lanes * kVec);
      }
    }
  }
  const HeadInputs<T> head = LoadHead<T>(p, bh, h);
  const T* x = static_cast<const T*>(p.x) + bh * rows + row0;
  constexpr bool kPackedHalf = std::is_same_v<S, __half>;  // S is float or T
  T x_raw[kRows];  // read by the packed products only
  float xr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if constexpr (kPackedHalf) {
      x_raw[r] = row0 + r < rows ? x[r] : T{};
      xr[r] = Widen(x_raw[r]);
    } else {
      x_raw[r] = T{};
      xr[r] = row0 + r < rows ? Widen(x[r]) : 0.f;
    }
  }
  const int64_t bg = static_cast<int64_t>(blockIdx.z) * p.groups + h / p.heads_per_group;
  const T* bv = static_cast<const T*>(p.b) + bg * n_size + lane * kVec;
  const T* cv = static_cast<const T*>(p.c) + bg * n_size + lane * kVec;
  Pack<T, kVec> bk[kChunks], ck[kChunks];
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (in_row(k)) {
      bk[k] = *reinterpret_cast<const Pack<T, kVec>*>(bv + k * lanes * kVec);
      ck[k] = *reinterpret_cast<const Pack<T, kVec>*>(cv + k * lanes * kVec);
    }
  }
#if defined(MAMBAFUSE_SSU_TRAFFIC_FLOOR)
  // Diagnostic builds only (CMake -DMAMBAFUSE_SSU_TRAFFIC_FLOOR=ON, which builds no op library): this launch's
  // loads and stores with no arithmetic, a measured reference for what the traffic alone costs (benchmarks/
  // RESULTS.md). present = the loaded state, out = x plus the loaded per-head values (every load is used).
  // MAMBAFUSE_SSU_TRAFFIC_FLOOR_OMIT (CMake) leaves parts out, to measure what each costs: the per-head loads
  // (head), B and C (bc), x (x), the output store (out; without it no small load is used, so none is made).
#if defined(MAMBAFUSE_SSU_FLOOR_NO_HEAD)
  float sum = 0.f;
#else
  float sum = Widen(head.dt) + Widen(head.bias) + head.a + DValue<T>(p, head.d);
#endif
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#if !defined(MAMBAFUSE_SSU_FLOOR_NO_BC)
    if (in_row(k)) sum += Widen(bk[k].v[0]) + Widen(ck[k].v[0]);
#endif
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (in_row(k) && row0 + r < rows) {
        *reinterpret_cast<Pack<S, kVec>*>(present + r * n_size + k * lanes * kVec) = st[k][r];
      }
    }
  }
#if defined(MAMBAFUSE_SSU_FLOOR_NO_OUT)
  (void)sum;
#else
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#if defined(MAMBAFUSE_SSU_FLOOR_NO_X)
    const float value = sum;
#else
    const float value = xr[r] + sum;
#endif
    if (lane == r % lanes && row0 + r < rows) static_cast<T*>(p.out)[bh * rows + row0 + r] = Narrow<T>(value);
  }
#endif
  return;
#endif
  float d, da;
  if constexpr (kSharedHead) {
    // Warp 0 runs the chain while every warp's loads are in flight; the block waits for it once.
    __shared__ float head_scalars[2];
    if (threadIdx.x < 32) {
      HeadScalars<T>(p, head, d, da);
      if (threadIdx.x == 0) {
        head_scalars[0] = d;
        head_scalars[1] = da;
      }
    }
    __syncthreads();
    d = head_scalars[0];
    da = head_scalars[1];
  } else {
    HeadScalars<T>(p, head, d, da);
  }

  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!in_row(k)) continue;
    ChunkProducts<T, kVec, kPackedHalf> products;
    products.Init(d, bk[k]);
    float cf[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) cf[j] = Widen(ck[k].v[j]);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= rows) continue;
      float dbx[kVec], next[kVec];
      products.Dbx(xr[r], x_raw[r], dbx);
#pragma unroll
      for (int j = 0; j < kVec; ++j) next[j] = __fadd_rn(__fmul_rn(Widen(st[k][r].v[j]), da), dbx[j]);
      Pack<S, kVec> stored;
      NarrowAll(next, stored);                             // next = round_S(present)
      if constexpr (!std::is_same_v<S, T>) RoundAll<T>(next);  // the readout reads round_T(present)
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[r] += next[j] * cf[j];
      *reinterpret_cast<Pack<S, kVec>*>(present + r * n_size + k * lanes * kVec) = stored;
    }
  }
  RowSums(acc, lanes);
  // Lane r of the row's lanes writes row r (every lane holds every row's sum after the butterfly).
  T* out = static_cast<T*>(p.out) + bh * rows + row0;
  if (kRows <= lanes) {
    if (lane < kRows && row0 + lane < rows) {
      float sum = acc[0], xv = xr[0];
#pragma unroll
      for (int r = 1; r < kRows; ++r) {
        if (lane == r) {
          sum = acc[r];
          xv = xr[r];
        }
      }
      out[lane] = Readout<T>(p, head, sum, xv);
    }
  } else if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < rows) out[r] = Readout<T>(p, head, acc[r], xr[r]);
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
  const HeadInputs<T> head = LoadHead<T>(p, bh, h);
  float d, da;
  HeadScalars<T>(p, head, d, da);
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
      if (row0 + r < rows) out[row0 + r] = Readout<T>(p, head, acc[r], xr[r]);
    }
  }
}

template <typename T, typename S, int kChunks, int kRows>
void LaunchVector(const Params& params, const SelectiveStateUpdateLaunch& launch, dim3 grid, cudaStream_t stream) {
  if (launch.shared_head) {
    VectorKernel<T, S, kChunks, kRows, true><<<grid, kBlock, 0, stream>>>(params);
  } else {
    VectorKernel<T, S, kChunks, kRows, false><<<grid, kBlock, 0, stream>>>(params);
  }
}

template <typename T, typename S, int kRows>
void LaunchRows(const Params& params, const SelectiveStateUpdateLaunch& launch, dim3 grid, cudaStream_t stream) {
  if (!launch.vector) {
    ScalarKernel<T, S, kRows><<<grid, kBlock, 0, stream>>>(params);
  } else if (launch.chunks == 1) {
    LaunchVector<T, S, 1, kRows>(params, launch, grid, stream);
  } else {
    LaunchVector<T, S, 2, kRows>(params, launch, grid, stream);
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
