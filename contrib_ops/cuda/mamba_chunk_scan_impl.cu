// MambaChunkScan CUDA kernels (docs/mamba_chunk_scan.md, Kernel). The math and its rounding points are the op's:
// d, a = A·d and u = x·d in float32 after the time step's T roundings, then the recurrence in float32.
//
// Chunked kernel (P and N up to about 128): one block of 8 warps per (batch row, head), walking the prompt in chunks
// of Q = 64 tokens with the head's state S (P × N, float32) in shared memory. Per chunk, with cs the float32
// cumulative sum of a from the chunk's first token:
//   W  = (exp(cs_l − cs_s)·d_s)[s ≤ l] ∘ C·Bᵀ                                     (Q × Q)
//   y  = W·x + diag(exp(cs))·C·Sᵀ + D·x                                          (Q × P)
//   S ← exp(cs_end)·S + (diag(exp(cs_end − cs))·u)ᵀ·B                            (P × N)
// The four products run on tensor cores (WMMA, TF32 in, float32 accumulation). TF32 keeps 11 significant bits:
// every float16 and bfloat16 value is exact in it, so x, B and C of those types enter as they are, while the
// float32 operands (W, the scaled u, the state, and x, B, C of a float model) enter as two TF32 parts, v = hi + lo,
// and the product is hi·hi + hi·lo + lo·hi (the dropped lo·lo and the part below lo are ~2⁻²² of v). So the
// products keep float32 accuracy and the kernel stays within the op's float32 budget, which TF32 alone (2⁻¹¹) or a
// float16 rounding of W would not (mamba_ssm's Triton kernels round W and the state to the input type).
//
// Sequential kernel (any P and N; also what the tests compare with): one warp per (batch row, head, channel p),
// the recurrence token by token with the state row in shared memory, the readout a warp sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "elem_convert.cuh"
#include "mamba_chunk_scan_launcher.h"

namespace mambafuse {
namespace {

constexpr int kQ = kCudaChunkSize;
// Floats added to each shared-memory row, so that the rows of a 16-row tile start on different banks. A row
// stays a multiple of 16 bytes and a tile's origin a multiple of 32 bytes, as WMMA's loads require.
constexpr int kPad = 4;
constexpr int kSeqWarps = 4;
constexpr unsigned kFull = 0xffffffffu;

struct Params {
  const void* x;
  const void* dt;
  const void* dt_bias;  // null: no bias
  const float* a;
  const void* b;
  const void* c;
  const void* d;              // null: no skip
  const void* initial_state;  // null: zeros
  float* out;
  float* final_state;
  int64_t length;
  int heads, head_dim, groups, state_size;
  int d_is_float, state_is_float, softplus;
  float dt_min, dt_max;
  int p16, n16;  // the chunked kernel's P and N rounded up to 16
  int staged;    // the chunked kernel copies x, B and C asynchronously, 16 bytes at a time
};

template <typename T>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  return Widen(static_cast<const T*>(p)[i]);
}

// Element i of a tensor that is float or T.
template <typename T>
__device__ __forceinline__ float LoadFloatOrT(const void* p, int is_float, int64_t i) {
  return is_float ? static_cast<const float*>(p)[i] : Load<T>(p, i);
}

// softplus in float32 as the contract has it, log1p(exp(v)) with each function rounded once to float32: both are
// evaluated in double and rounded, which gives the correctly rounded float32 results that the CPU's libm and numpy
// give, where CUDA's expf and log1pf may be an ulp off and so flip a float16 rounding of the time step.
__device__ __forceinline__ float Softplus(float v) {
  const float e = static_cast<float>(exp(static_cast<double>(v)));
  return static_cast<float>(log1p(static_cast<double>(e)));
}

// The time step d of token row `bt` (b·T + t) and head h, at the contract's rounding points.
template <typename T>
__device__ __forceinline__ float TimeStep(const Params& p, int64_t bt, int h) {
  float v = Load<T>(p.dt, bt * p.heads + h);
  if (p.dt_bias != nullptr) v = RoundTo<T>(v + Load<T>(p.dt_bias, h));
  if (p.softplus && !(v > 20.f)) v = RoundTo<T>(Softplus(v));
  const float lo = RoundTo<T>(p.dt_min), hi = RoundTo<T>(p.dt_max);
  v = v < lo ? lo : v;  // a NaN time step stays NaN, as in the CPU kernel
  return hi < v ? hi : v;
}

// --- chunked kernel ------------------------------------------------------------------------------------------

namespace wmma = nvcuda::wmma;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// hi = the TF32 rounding of each element; lo = the TF32 rounding of what hi leaves (kSplit), else untouched.
template <bool kSplit, typename Frag>
__device__ __forceinline__ void SplitTf32(Frag& hi, Frag& lo) {
#pragma unroll
  for (int i = 0; i < hi.num_elements; ++i) {
    const float v = hi.x[i];
    hi.x[i] = wmma::__float_to_tf32(v);
    if constexpr (kSplit) lo.x[i] = wmma::__float_to_tf32(v - hi.x[i]);
  }
}

// acc += A·B over k_steps steps of 8: A's 16 × 8 block k at a + k·a_step (leading dimension lda), B's 8 × 16
// block at b + k·b_step. An operand marked kSplit enters as two TF32 parts; the small products go first.
template <bool kSplitA, bool kSplitB, typename LayoutA, typename LayoutB>
__device__ __forceinline__ void Mma(Acc& acc, const float* a, int lda, int a_step, const float* b, int ldb, int b_step,
                                    int k_steps) {
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a_hi, a_lo;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutB> b_hi, b_lo;
  for (int k = 0; k < k_steps; ++k) {
    wmma::load_matrix_sync(a_hi, a + k * a_step, lda);
    wmma::load_matrix_sync(b_hi, b + k * b_step, ldb);
    SplitTf32<kSplitA>(a_hi, a_lo);
    SplitTf32<kSplitB>(b_hi, b_lo);
    if constexpr (kSplitA) wmma::mma_sync(acc, a_lo, b_hi, acc);
    if constexpr (kSplitB) wmma::mma_sync(acc, a_hi, b_lo, acc);
    wmma::mma_sync(acc, a_hi, b_hi, acc);
  }
}

// acc0 += A·B0 and acc1 += A·B1 with B1 the 16 columns after B0 (row-major B), A split into two TF32 parts once for
// both.
template <bool kSplitB, typename LayoutA>
__device__ __forceinline__ void Mma2(Acc& acc0, Acc& acc1, const float* a, int lda, int a_step, const float* b,
                                     int ldb, int b_step, int k_steps) {
  wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a_hi, a_lo;
  wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> b_hi, b_lo;
  for (int k = 0; k < k_steps; ++k) {
    wmma::load_matrix_sync(a_hi, a + k * a_step, lda);
    SplitTf32<true>(a_hi, a_lo);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      Acc& acc = half == 0 ? acc0 : acc1;
      wmma::load_matrix_sync(b_hi, b + k * b_step + 16 * half, ldb);
      SplitTf32<kSplitB>(b_hi, b_lo);
      wmma::mma_sync(acc, a_lo, b_hi, acc);
      if constexpr (kSplitB) wmma::mma_sync(acc, a_hi, b_lo, acc);
      wmma::mma_sync(acc, a_hi, b_hi, acc);
    }
  }
}

// The chunked kernel's shared memory in bytes, for P and N rounded up to 16: the float tiles, four per-token
// arrays (two of them the next chunk's time step and a spare), and the staging buffer of the raw next chunk
// (x, B and C as they are in global memory) where the loads are asynchronous.
__host__ __device__ constexpr int64_t ChunkedSharedBytesFor(int64_t p16, int64_t n16, int64_t elem_size,
                                                            bool staged) {
  const int64_t floats =
      3 * kQ * (p16 + kPad) + 2 * kQ * (n16 + kPad) + p16 * (n16 + kPad) + kQ * (kQ + kPad) + 6 * kQ;
  const int64_t raw = staged ? kQ * (p16 + 2 * n16) * elem_size : 0;
  return floats * 4 + raw;
}

// cp.async of 16 bytes from global to shared memory (sm_80 and later), and the waits on them.
__device__ __forceinline__ void CopyAsync16(void* shared, const void* global) {
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

template <typename T, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1) ChunkedScan(Params p) {
  constexpr int kThreads = kWarps * 32;
  // Inputs of float16 and bfloat16 are exact in TF32; float inputs are split like the computed operands.
  constexpr bool kSplitInput = std::is_same_v<T, float>;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements a 16-byte copy moves
  extern __shared__ __align__(128) float smem[];
  const int p16 = p.p16, n16 = p.n16;
  const int ldp = p16 + kPad, ldn = n16 + kPad, ldq = kQ + kPad;
  float* const xs = smem;                  // [Q][ldp]  x, zeros past P and past the prompt
  float* const us = xs + kQ * ldp;         // [Q][ldp]  u·exp(cs_end − cs)
  float* const ys = us + kQ * ldp;         // [Q][ldp]  the chunk's output before the skip
  float* const bs = ys + kQ * ldp;         // [Q][ldn]  B
  float* const cm = bs + kQ * ldn;         // [Q][ldn]  C
  float* const ss = cm + kQ * ldn;         // [p16][ldn] the state S[p][n]
  float* const ws = ss + p16 * ldn;        // [Q][ldq]  C·Bᵀ, then W
  float* const step = ws + kQ * ldq;       // [Q] d
  float* const cumsum = step + kQ;         // [Q] cs
  float* const decay_in = cumsum + kQ;     // [Q] exp(cs)
  float* const decay_out = decay_in + kQ;  // [Q] exp(cs_end − cs)
  float* const step_next = decay_out + kQ; // [Q] the next chunk's d
  T* const raw_x = reinterpret_cast<T*>(step_next + 2 * kQ);  // [Q][p16] (staged loads only)
  T* const raw_b = raw_x + kQ * p16;                          // [Q][n16]
  T* const raw_c = raw_b + kQ * n16;                          // [Q][n16]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads;
  const int h = static_cast<int>(bh % p.heads);
  const int g = h / (p.heads / p.groups);
  const int P = p.head_dim, N = p.state_size;
  const int64_t len = p.length;
  const auto* const x_in = static_cast<const T*>(p.x);
  const auto* const b_in = static_cast<const T*>(p.b);
  const auto* const c_in = static_cast<const T*>(p.c);

  // Staged loads: the prompt rows of chunk t0 into the raw buffer, 16 bytes a copy (P and N are multiples of kVec
  // and the tensors 16-byte aligned: the host checks). Rows past the prompt are not copied (the conversion zeroes
  // them).
  const auto stage = [&](int64_t t0) {
    const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
    const int xv = P / kVec, nv = N / kVec;
    for (int i = tid; i < q * xv; i += kThreads) {
      const int l = i / xv, v = i % xv;
      CopyAsync16(raw_x + l * p16 + v * kVec, x_in + ((b * len + t0 + l) * p.heads + h) * P + v * kVec);
    }
    for (int i = tid; i < q * nv; i += kThreads) {
      const int l = i / nv, v = i % nv;
      const int64_t row = ((b * len + t0 + l) * p.groups + g) * N + v * kVec;
      CopyAsync16(raw_b + l * n16 + v * kVec, b_in + row);
      CopyAsync16(raw_c + l * n16 + v * kVec, c_in + row);
    }
    CopyAsyncCommit();
  };
  // The time step of the chunk at t0 for token l of it (0 past the prompt).
  const auto time_step = [&](int64_t t0, int l) {
    return t0 + l < len ? TimeStep<T>(p, b * len + t0 + l, h) : 0.f;
  };

  if (p.staged) stage(0);
  // Element loops run rows over warps and columns over lanes: no index division, and whole rows a warp.
  for (int row = warp; row < p16; row += kWarps) {
    for (int n = lane; n < n16; n += 32) {
      float v = 0.f;
      if (p.initial_state != nullptr && row < P && n < N) {
        v = LoadFloatOrT<T>(p.initial_state, p.state_is_float, (bh * P + row) * N + n);
      }
      ss[row * ldn + n] = v;
    }
  }
  if (tid < kQ) step_next[tid] = time_step(0, tid);
  __syncthreads();
  bool state_zero = p.initial_state == nullptr;
  const float a_h = p.a[h];
  const float skip = p.d != nullptr ? LoadFloatOrT<T>(p.d, p.d_is_float, h) : 0.f;
  const int p_tiles = p16 / 16, n_tiles = n16 / 16, q_tiles = kQ / 16;

  for (int64_t t0 = 0; t0 < len; t0 += kQ) {
    const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
    // 1. The chunk's x, B and C in float, zero-padded (from the staging buffer, or straight from global memory);
    // the cumulative sum of a (warp 0, two tokens a lane, from the time steps computed during the last chunk).
    if (p.staged) {
      CopyAsyncWaitAll();
      __syncthreads();
    }
    for (int l = warp; l < kQ; l += kWarps) {
      for (int col = lane; col < p16; col += 32) {
        float v = 0.f;
        if (l < q && col < P) {
          v = p.staged ? Widen(raw_x[l * p16 + col]) : Load<T>(p.x, ((b * len + t0 + l) * p.heads + h) * P + col);
        }
        xs[l * ldp + col] = v;
      }
      for (int n = lane; n < n16; n += 32) {
        float bv = 0.f, cv = 0.f;
        if (l < q && n < N) {
          if (p.staged) {
            bv = Widen(raw_b[l * n16 + n]);
            cv = Widen(raw_c[l * n16 + n]);
          } else {
            const int64_t row = ((b * len + t0 + l) * p.groups + g) * N + n;
            bv = Load<T>(p.b, row);
            cv = Load<T>(p.c, row);
          }
        }
        bs[l * ldn + n] = bv;
        cm[l * ldn + n] = cv;
      }
    }
    if (warp == 0) {
      const int l0 = 2 * lane;
      const float d0 = step_next[l0], d1 = step_next[l0 + 1];
      const float a0 = __fmul_rn(a_h, d0), a1 = __fmul_rn(a_h, d1);
      float inclusive = __fadd_rn(a0, a1);
      for (int offset = 1; offset < 32; offset *= 2) {
        const float v = __shfl_up_sync(kFull, inclusive, offset);
        if (lane >= offset) inclusive = __fadd_rn(inclusive, v);
      }
      float before = __shfl_up_sync(kFull, inclusive, 1);
      if (lane == 0) before = 0.f;
      const float c0 = __fadd_rn(before, a0), c1 = __fadd_rn(c0, a1);
      const float end = __shfl_sync(kFull, c1, 31);
      step[l0] = d0;
      step[l0 + 1] = d1;
      cumsum[l0] = c0;
      cumsum[l0 + 1] = c1;
      decay_in[l0] = expf(c0);
      decay_in[l0 + 1] = expf(c1);
      decay_out[l0] = expf(__fsub_rn(end, c0));
      decay_out[l0 + 1] = expf(__fsub_rn(end, c1));
    }
    __syncthreads();
    // The raw buffer is free: the next chunk's loads run under this chunk's products.
    if (p.staged && t0 + kQ < len) stage(t0 + kQ);

    // 2. C·Bᵀ on the causal tiles (s ≤ l), and the state's readout C·Sᵀ.
    for (int tile = warp; tile < q_tiles * q_tiles; tile += kWarps) {
      const int i = tile / q_tiles, j = tile % q_tiles;
      if (j > i) continue;
      Acc acc;
      wmma::fill_fragment(acc, 0.f);
      Mma<kSplitInput, kSplitInput, wmma::row_major, wmma::col_major>(acc, cm + i * 16 * ldn, ldn, 8,
                                                                      bs + j * 16 * ldn, ldn, 8, n16 / 8);
      wmma::store_matrix_sync(ws + i * 16 * ldq + j * 16, acc, ldq, wmma::mem_row_major);
    }
    if (!state_zero) {
      for (int tile = warp; tile < q_tiles * p_tiles; tile += kWarps) {
        const int i = tile / p_tiles, j = tile % p_tiles;
        Acc acc;
        wmma::fill_fragment(acc, 0.f);
        Mma<kSplitInput, true, wmma::row_major, wmma::col_major>(acc, cm + i * 16 * ldn, ldn, 8, ss + j * 16 * ldn,
                                                                 ldn, 8, n16 / 8);
        wmma::store_matrix_sync(ys + i * 16 * ldp + j * 16, acc, ldp, wmma::mem_row_major);
      }
    }
    __syncthreads();

    // 3. W from C·Bᵀ; u·exp(cs_end − cs) for the state; the readout times exp(cs); the next chunk's time steps.
    for (int l = warp; l < kQ; l += kWarps) {
      const float cs_l = cumsum[l];
      for (int s = lane; s < kQ; s += 32) {
        float w = 0.f;
        if (s <= l) w = ws[l * ldq + s] * expf(__fsub_rn(cs_l, cumsum[s])) * step[s];
        ws[l * ldq + s] = w;
      }
      const float d_l = step[l], out_l = decay_out[l], in_l = decay_in[l];
      for (int col = lane; col < p16; col += 32) {
        us[l * ldp + col] = __fmul_rn(xs[l * ldp + col], d_l) * out_l;
        ys[l * ldp + col] = state_zero ? 0.f : ys[l * ldp + col] * in_l;
      }
    }
    if (tid >= kThreads - kQ) step_next[tid - (kThreads - kQ)] = time_step(t0 + kQ, tid - (kThreads - kQ));
    __syncthreads();

    // 4. y += W·x (row tile i needs s < 16(i + 1) only); S ← exp(cs_end)·S + uᵀ·B.
    for (int tile = warp; tile < q_tiles * p_tiles; tile += kWarps) {
      const int i = tile / p_tiles, j = tile % p_tiles;
      Acc acc;
      wmma::load_matrix_sync(acc, ys + i * 16 * ldp + j * 16, ldp, wmma::mem_row_major);
      Mma<true, kSplitInput, wmma::row_major, wmma::row_major>(acc, ws + i * 16 * ldq, ldq, 8, xs + j * 16, ldp,
                                                               8 * ldp, 2 * (i + 1));
      wmma::store_matrix_sync(ys + i * 16 * ldp + j * 16, acc, ldp, wmma::mem_row_major);
    }
    const float decay_chunk = decay_in[kQ - 1];
    // Two state tiles of one row of tiles a warp where there are enough tiles: they share uᵀ's split fragments.
    const int pair = p_tiles * n_tiles >= 2 * kWarps && n_tiles % 2 == 0 ? 2 : 1;
    for (int tile = warp; tile < p_tiles * n_tiles / pair; tile += kWarps) {
      const int i = tile / (n_tiles / pair), j = tile % (n_tiles / pair) * pair;
      Acc acc[2];
      float* const s_tile = ss + i * 16 * ldn + j * 16;
      for (int k = 0; k < pair; ++k) {
        wmma::load_matrix_sync(acc[k], s_tile + 16 * k, ldn, wmma::mem_row_major);
#pragma unroll
        for (int e = 0; e < acc[k].num_elements; ++e) acc[k].x[e] *= decay_chunk;
      }
      if (pair == 2) {
        Mma2<kSplitInput, wmma::col_major>(acc[0], acc[1], us + i * 16, ldp, 8 * ldp, bs + j * 16, ldn, 8 * ldn,
                                          kQ / 8);
      } else {
        Mma<true, kSplitInput, wmma::col_major, wmma::row_major>(acc[0], us + i * 16, ldp, 8 * ldp, bs + j * 16, ldn,
                                                                 8 * ldn, kQ / 8);
      }
      for (int k = 0; k < pair; ++k) wmma::store_matrix_sync(s_tile + 16 * k, acc[k], ldn, wmma::mem_row_major);
    }
    __syncthreads();

    // 5. out = y + D·x for the chunk's tokens.
    for (int l = warp; l < q; l += kWarps) {
      float* const out_row = p.out + ((b * len + t0 + l) * p.heads + h) * P;
      for (int col = lane; col < P; col += 32) {
        const float y = ys[l * ldp + col];
        out_row[col] = p.d != nullptr ? __fadd_rn(y, __fmul_rn(skip, xs[l * ldp + col])) : y;
      }
    }
    state_zero = false;
    __syncthreads();
  }
  for (int row = warp; row < P; row += kWarps) {
    for (int n = lane; n < N; n += 32) p.final_state[(bh * P + row) * N + n] = ss[row * ldn + n];
  }
}

// --- sequential kernel -----------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kSeqWarps * 32) SequentialScan(Params p) {
  extern __shared__ __align__(16) float rows[];  // [kSeqWarps][N]: each warp's state row
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads;
  const int h = static_cast<int>(bh % p.heads);
  const int g = h / (p.heads / p.groups);
  const int row = blockIdx.y * kSeqWarps + warp;
  const int P = p.head_dim, N = p.state_size;
  const int64_t len = p.length;
  if (row >= P) return;  // no barrier below: a warp without a row may leave
  float* const s = rows + static_cast<int64_t>(warp) * N;
  for (int n = lane; n < N; n += 32) {
    s[n] = p.initial_state != nullptr ? LoadFloatOrT<T>(p.initial_state, p.state_is_float, (bh * P + row) * N + n)
                                      : 0.f;
  }
  const float a_h = p.a[h];
  const float skip = p.d != nullptr ? LoadFloatOrT<T>(p.d, p.d_is_float, h) : 0.f;
  for (int64_t t0 = 0; t0 < len; t0 += 32) {
    // Lane j prepares token t0 + j: its decay, u and x; the warp then walks the 32 tokens.
    float decay = 1.f, u = 0.f, x = 0.f;
    if (t0 + lane < len) {
      const int64_t bt = b * len + t0 + lane;
      const float d = TimeStep<T>(p, bt, h);
      decay = expf(__fmul_rn(a_h, d));
      x = Load<T>(p.x, (bt * p.heads + h) * P + row);
      u = __fmul_rn(x, d);
    }
    const int steps = static_cast<int>(len - t0 < 32 ? len - t0 : 32);
    for (int j = 0; j < steps; ++j) {
      const float decay_j = __shfl_sync(kFull, decay, j), u_j = __shfl_sync(kFull, u, j);
      const float x_j = __shfl_sync(kFull, x, j);
      const int64_t bc = ((b * len + t0 + j) * p.groups + g) * N;
      float acc = 0.f;
      for (int n = lane; n < N; n += 32) {
        const float v = __fadd_rn(__fmul_rn(decay_j, s[n]), __fmul_rn(u_j, Load<T>(p.b, bc + n)));
        s[n] = v;
        acc = fmaf(Load<T>(p.c, bc + n), v, acc);
      }
      for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(kFull, acc, offset);
      if (lane == 0) {
        p.out[((b * len + t0 + j) * p.heads + h) * P + row] = p.d != nullptr ? __fadd_rn(acc, __fmul_rn(skip, x_j)) : acc;
      }
    }
  }
  for (int n = lane; n < N; n += 32) p.final_state[(bh * P + row) * N + n] = s[n];
}

// --- host -------------------------------------------------------------------------------------------------------

int64_t RoundUp16(int64_t v) { return (v + 15) / 16 * 16; }

// How the chunked kernel runs for these arguments: with the staged (asynchronous, 16-byte) loads where P and N
// are whole 16-byte vectors, x, B and C are 16-byte aligned and the staging buffer fits; its shared memory.
struct ChunkedPlan {
  bool staged = false;
  size_t bytes = 0;
};

size_t ElemSize(ElemType type) { return type == ElemType::kFloat ? 4 : 2; }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// False when the chunked kernel's shared memory does not fit in `limit` bytes even without staging.
bool PlanChunked(const MambaChunkScanCpuArgs& args, int64_t limit, ChunkedPlan& plan) {
  const int64_t p16 = RoundUp16(args.head_dim), n16 = RoundUp16(args.state_size);
  const auto elem = static_cast<int64_t>(ElemSize(args.type));
  const int64_t vec = 16 / elem;
  const bool vectors = args.head_dim % vec == 0 && args.state_size % vec == 0 && Aligned16(args.x) &&
                       Aligned16(args.B) && Aligned16(args.C);
  const int64_t staged = ChunkedSharedBytesFor(p16, n16, elem, true);
  const int64_t plain = ChunkedSharedBytesFor(p16, n16, elem, false);
  if (vectors && staged <= limit) {
    plan = {true, static_cast<size_t>(staged)};
  } else if (plain <= limit) {
    plan = {false, static_cast<size_t>(plain)};
  } else {
    return false;
  }
  return true;
}

int SharedOptinLimit() {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    return 0;
  }
  return limit;
}

// The chunked kernel's plan where `requested` and the arguments let it run, read once per launch (it queries the
// device's shared-memory limit); false: the sequential kernel.
bool ChunkedPlanFor(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath requested, ChunkedPlan& plan) {
  if (requested == ChunkScanCudaPath::kSequential || args.head_dim == 0 || args.state_size == 0) return false;
  return PlanChunked(args, SharedOptinLimit(), plan);
}

// Launches the chunked kernel with `chunked`'s plan, or the sequential one where it is null.
template <typename T>
cudaError_t LaunchTyped(const Params& params, const MambaChunkScanCpuArgs& args, const ChunkedPlan* chunked,
                        cudaStream_t stream) {
  const int64_t blocks = args.batch * args.heads;
  // Above 48 KB of dynamic shared memory a kernel must opt in, per device: a host-side attribute, not a stream
  // operation, so it is allowed under capture.
  const auto opt_in = [](const void* kernel, size_t bytes) {
    return bytes > 48 * 1024 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(bytes))
                             : cudaSuccess;
  };
  if (chunked != nullptr) {
    const ChunkedPlan& plan = *chunked;
    // 16 warps by default; MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS=8 runs 8 (a benchmark's comparison).
    const char* warps = std::getenv("MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS");
    const bool eight = warps != nullptr && std::strcmp(warps, "8") == 0;
    const void* kernel = eight ? reinterpret_cast<const void*>(&ChunkedScan<T, 8>)
                               : reinterpret_cast<const void*>(&ChunkedScan<T, 16>);
    if (const cudaError_t error = opt_in(kernel, plan.bytes); error != cudaSuccess) return error;
    const dim3 grid(static_cast<unsigned>(blocks));
    if (eight) {
      ChunkedScan<T, 8><<<grid, 8 * 32, plan.bytes, stream>>>(params);
    } else {
      ChunkedScan<T, 16><<<grid, 16 * 32, plan.bytes, stream>>>(params);
    }
  } else {
    const size_t bytes = static_cast<size_t>(kSeqWarps) * static_cast<size_t>(args.state_size) * sizeof(float);
    if (const cudaError_t error = opt_in(reinterpret_cast<const void*>(&SequentialScan<T>), bytes);
        error != cudaSuccess) {
      return error;
    }
    const auto row_blocks = static_cast<unsigned>((args.head_dim + kSeqWarps - 1) / kSeqWarps);
    SequentialScan<T><<<dim3(static_cast<unsigned>(blocks), row_blocks), kSeqWarps * 32, bytes, stream>>>(params);
  }
  return cudaGetLastError();
}

}  // namespace

ChunkScanCudaPath ResolveChunkScanCudaPath(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath requested) {
  ChunkedPlan plan;
  return ChunkedPlanFor(args, requested, plan) ? ChunkScanCudaPath::kChunked : ChunkScanCudaPath::kSequential;
}

const char* CheckMambaChunkScanCudaArgs(const MambaChunkScanCpuArgs& a) {
  // The op's own checks are the CPU kernel's (types, dims, pointers); its chunking fields do not apply here.
  MambaChunkScanCpuArgs common = a;
  common.chunk_size = kCudaChunkSize;
  common.heads_per_block = 1;
  if (const char* problem = ValidateArgs(common)) return problem;
  constexpr int64_t kIntMax = 0x7fffffff;
  if (a.heads > kIntMax || a.head_dim > kIntMax || a.state_size > kIntMax || a.batch * a.heads > kIntMax) {
    return "a dimension is too large for the CUDA kernel (B·H, H, P and N must be below 2^31)";
  }
  if (static_cast<int64_t>(kSeqWarps) * a.state_size * 4 > 227 * 1024) {
    return "the state size N is too large for the CUDA kernel (at most 14528)";
  }
  return nullptr;
}

cudaError_t LaunchMambaChunkScan(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath path, cudaStream_t stream) {
  if (CheckMambaChunkScanCudaArgs(args) != nullptr) return cudaErrorInvalidValue;
  if (args.batch * args.heads == 0 || args.head_dim == 0) return cudaSuccess;  // nothing to compute or write
  Params params{};
  params.x = args.x;
  params.dt = args.dt;
  params.dt_bias = args.dt_bias;
  params.a = args.A;
  params.b = args.B;
  params.c = args.C;
  params.d = args.D;
  params.initial_state = args.initial_state;
  params.out = args.out;
  params.final_state = args.final_state;
  params.length = args.length;
  params.heads = static_cast<int>(args.heads);
  params.head_dim = static_cast<int>(args.head_dim);
  params.groups = static_cast<int>(args.groups);
  params.state_size = static_cast<int>(args.state_size);
  params.d_is_float = args.d_type == ElemType::kFloat;
  params.state_is_float = args.state_type == ElemType::kFloat;
  params.softplus = args.dt_softplus;
  params.dt_min = args.dt_min;
  params.dt_max = args.dt_max;
  params.p16 = static_cast<int>(RoundUp16(args.head_dim));
  params.n16 = static_cast<int>(RoundUp16(args.state_size));
  ChunkedPlan plan;
  const ChunkedPlan* chunked = ChunkedPlanFor(args, path, plan) ? &plan : nullptr;
  params.staged = chunked != nullptr && plan.staged;
  switch (args.type) {
    case ElemType::kFloat16:
      return LaunchTyped<__half>(params, args, chunked, stream);
    case ElemType::kBFloat16:
      return LaunchTyped<__nv_bfloat16>(params, args, chunked, stream);
    default:
      return LaunchTyped<float>(params, args, chunked, stream);
  }
}

}  // namespace mambafuse
