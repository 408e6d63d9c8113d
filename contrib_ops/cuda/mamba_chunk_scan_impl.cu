// MambaChunkScan CUDA kernels (docs/mamba_chunk_scan.md, Kernel). The math and its rounding points are the op's:
// d, a = A·d and u = x·d in float32 after the time step's T roundings, then the recurrence in float32.
//
// Chunked kernel (P up to 128, N while the shared memory fits): one block of 16 warps per (batch row, head),
// walking the prompt in chunks of Q = 64 tokens with the head's state S (P × N, float32) in shared memory. Per
// chunk, with cs the float32 cumulative sum of a from the chunk's first token:
//   W  = (exp(cs_l − cs_s)·d_s)[s ≤ l] ∘ C·Bᵀ                                     (Q × Q)
//   y  = W·x + diag(exp(cs))·C·Sᵀ + D·x                                          (Q × P)
//   S ← exp(cs_end)·S + (diag(exp(cs_end − cs))·u)ᵀ·B                            (P × N)
// The four products run on tensor cores (mma.sync m16n8k8, TF32 in, float32 accumulation), their fragments loaded
// from shared memory by each lane and C·Sᵀ + W·x accumulated in registers. TF32 keeps 11 significant bits: every
// float16 and bfloat16 value is exact in it, so x, B and C of those types enter as they are, while the float32
// operands (W, the scaled u, the state, and x, B, C of a float model) enter as two TF32 parts, v = hi + lo, and
// the product is hi·hi + hi·lo + lo·hi (the dropped lo·lo and the part below lo are ~2⁻²¹ of v). So the products
// keep float32 accuracy and the kernel stays within the op's float32 budget, which TF32 alone (2⁻¹¹) or a float16
// rounding of W would not (mamba_ssm's Triton kernels round W and the state to the input type).
//
// For the models' widths (P = 64, N = 128 or 64) in float16 and bfloat16 a build with those widths fixed takes the
// half path: RegisterStateScan by default (the state in registers, warp-specialized; see there), or with
// MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared ChunkedScan's fixed-width build (B and C read in their 16-bit staging
// buffer, C·Bᵀ on m16n8k16 tensor cores, u and B stored transposed for the state update).
//
// One-token kernels (any P and N, either state layout): a one-token prompt's step over the state once, the
// decode-step path (see there).
//
// Sequential kernel (any P and N; also what the tests compare with): one warp per (batch row, head, channel p),
// the recurrence token by token with the state row in shared memory, the readout a warp sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "elem_convert.cuh"
#include "mamba_chunk_scan_launcher.h"
#include "warp_mma.cuh"

namespace mambafuse {
namespace {

constexpr int kQ = kCudaChunkSize;
constexpr int kSeqWarps = 4;
constexpr unsigned kFull = 0xffffffffu;

struct Params {
  const void* x;
  const void* dt;       // float or T (dt_is_float)
  const void* dt_bias;  // dt's type; null: no bias
  const float* a;
  const void* b;
  const void* c;
  const void* d;              // null: no skip
  const void* initial_state;  // null: zeros
  float* out;
  float* final_state;
  int64_t length;
  int heads, head_dim, groups, state_size;
  int dt_is_float, d_is_float, state_is_float, softplus;
  int state_np;  // state_layout 1: both states [B, H, N, P] (else [B, H, P, N])
  float dt_min, dt_max;
  int p16, n16;  // the chunked kernel's P and N rounded up to 16
  int staged;    // the chunked kernel copies x, B and C asynchronously, 16 bytes at a time
};

// Where element (row p, column n) of row bh's state is in the [B, H, P, N] or (state_np) [B, H, N, P] layout.
__device__ __forceinline__ int64_t StateIndex(const Params& p, int64_t bh, int row, int n) {
  return p.state_np ? (bh * p.state_size + n) * p.head_dim + row : (bh * p.head_dim + row) * p.state_size + n;
}

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

// The time step d of head h from its raw value v (dt's element, in float), at the contract's rounding points in
// dt's type R.
template <typename R>
__device__ __forceinline__ float TimeStepIn(const Params& p, float v, int h) {
  if (p.dt_bias != nullptr) v = RoundTo<R>(v + Load<R>(p.dt_bias, h));
  if (p.softplus && !(v > 20.f)) v = RoundTo<R>(Softplus(v));
  const float lo = RoundTo<R>(p.dt_min), hi = RoundTo<R>(p.dt_max);
  v = v < lo ? lo : v;  // a NaN time step stays NaN, as in the CPU kernel
  return hi < v ? hi : v;
}

// The same with dt of type T or float (a graph that computes the time step in float32 for 16-bit x, B and C).
template <typename T>
__device__ __forceinline__ float TimeStepOf(const Params& p, float v, int h) {
  return p.dt_is_float ? TimeStepIn<float>(p, v, h) : TimeStepIn<T>(p, v, h);
}

// dt's element i, in float.
template <typename T>
__device__ __forceinline__ float LoadDt(const Params& p, int64_t i) {
  return LoadFloatOrT<T>(p.dt, p.dt_is_float, i);
}

// The time step d of token row `bt` (b·T + t) and head h.
template <typename T>
__device__ __forceinline__ float TimeStep(const Params& p, int64_t bt, int h) {
  return TimeStepOf<T>(p, LoadDt<T>(p, bt * p.heads + h), h);
}

// --- chunked kernel ------------------------------------------------------------------------------------------

// The products are register-level mma.sync on tensor cores (warp_mma.cuh: m16n8k8 TF32 and, on the half path,
// m16n8k16 float16 / bfloat16, with their fragment layouts). The operands come from shared memory, by ldmatrix where
// a fragment's 4-element rows are contiguous (C, W, and B and S as the second operand of C·Bᵀ and C·Sᵀ), else by
// 32- or 64-bit loads; the row strides are chosen so that the 32 lanes hit 32 banks (see the strides in the
// kernel).

// kRegs operand registers of one lane: hi, and where the operand is split (kSplit), lo. The split is v = hi + lo
// with hi the TF32 rounding of v to nearest, ties away from zero (cvt.rna's rounding, in two integer operations
// where sm_90 emulates the cvt with four) and lo = v − hi exactly, which the tensor core reads truncated to TF32
// (the low 13 bits of a .tf32 operand are ignored; CUTLASS's 3xTF32 passes its small part the same way). So the
// product keeps ~2⁻²¹ of v, float32-level. A NaN v may round to a zero hi, but then lo = v − hi is NaN and the
// product stays NaN; an infinite v gives lo = NaN, as the cvt-based split did.
template <int kRegs, bool kSplit>
struct Tf32Operand {
  uint32_t hi[kRegs];
  uint32_t lo[kSplit ? kRegs : 1];
  __device__ __forceinline__ void Set(int i, float v) {
    if constexpr (kSplit) {
      const uint32_t rounded = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
      hi[i] = rounded;
      lo[i] = __float_as_uint(__fsub_rn(v, __uint_as_float(rounded)));
    } else {
      hi[i] = __float_as_uint(v);  // float16 and bfloat16 values are exact in TF32
    }
  }
};

// A's fragment where A[r][k] is at base[k·ld + r] (A stored transposed: uᵀ), one 32-bit load an element.
template <bool kSplit>
__device__ __forceinline__ void LoadATransposed(Tf32Operand<4, kSplit>& a, const float* base, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const float* q = base + t * ld + g;
  a.Set(0, q[0]);
  a.Set(1, q[8]);
  a.Set(2, q[4 * ld]);
  a.Set(3, q[4 * ld + 8]);
}

// B's fragment where B[k][n] is at base[k·ld + n] (B stored by rows of k: x, B), one 32-bit load an element.
template <bool kSplit>
__device__ __forceinline__ void LoadBRows(Tf32Operand<2, kSplit>& b, const float* base, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const float* q = base + t * ld + g;
  b.Set(0, q[0]);
  b.Set(1, q[4 * ld]);
}

// A·B with the split operands' parts: d += a_hi·b_hi, and small += a_lo·b_hi + a_hi·b_lo in a second accumulator
// (added to d after the last step), so that the tensor core's operations form two independent chains, not one.
template <bool kSplitA, bool kSplitB>
__device__ __forceinline__ void MmaSplit(float (&d)[4], float (&small)[4], const Tf32Operand<4, kSplitA>& a,
                                         const Tf32Operand<2, kSplitB>& b) {
  if constexpr (kSplitA) MmaTf32(small, a.lo, b.hi[0], b.hi[1]);
  if constexpr (kSplitB) MmaTf32(small, a.hi, b.lo[0], b.lo[1]);
  MmaTf32(d, a.hi, b.hi[0], b.hi[1]);
}

// A's fragment where A[r][k] is at base[r·ld + k], by ldmatrix: blocks rows 0-7 and 8-15 at k, then at k + 4. (A
// 16-bit 8 × 8 block is 8 × 4 of 32-bit values, and lane i receives word i % 4 of row i / 4: the TF32 fragment
// layout, one instruction instead of four loads.)
template <bool kSplit>
__device__ __forceinline__ void LoadARows(Tf32Operand<4, kSplit>& a, const float* base, int ld, int lane) {
  uint32_t r[4];
  LoadMatrixX4(r, base + ((lane & 7) + (lane & 8)) * ld + (lane >> 4) * 4);
#pragma unroll
  for (int i = 0; i < 4; ++i) a.Set(i, __uint_as_float(r[i]));
}

// The fragments of two B tiles side by side (columns n 0-7 and 8-15) where B[k][n] is at base[n·ld + k], by
// ldmatrix: blocks n 0-7 at k, at k + 4, then n 8-15 at k, at k + 4.
template <bool kSplit>
__device__ __forceinline__ void LoadBColumns2(Tf32Operand<2, kSplit> (&b)[2], const float* base, int ld, int lane) {
  uint32_t r[4];
  LoadMatrixX4(r, base + ((lane & 7) + (lane >> 4) * 8) * ld + (lane & 8) / 2);
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i / 2].Set(i % 2, __uint_as_float(r[i]));
}

// d[n8] += A·B (with MmaSplit's second accumulator) on a 16 × 16 tile over k < k_end, A[r][k] at a[r·lda + k] and
// B[k][n] at b[n·ldb + k]: C·Sᵀ and C·Bᵀ in the kernel for any widths.
template <bool kSplitA, bool kSplitB>
__device__ __forceinline__ void ProductTile(float (&d)[2][4], float (&small)[2][4], const float* a, int lda,
                                            const float* b, int ldb, int k_end, int lane) {
  for (int k0 = 0; k0 < k_end; k0 += 8) {
    Tf32Operand<4, kSplitA> fa;
    LoadARows(fa, a + k0, lda, lane);
    Tf32Operand<2, kSplitB> fb[2];
    LoadBColumns2(fb, b + k0, ldb, lane);
    MmaSplit(d[0], small[0], fa, fb[0]);
    MmaSplit(d[1], small[1], fa, fb[1]);
  }
}

// The two 16-bit values of T in a 32-bit word (the lower address first) in float.
template <typename T>
__device__ __forceinline__ float2 WidenPair(uint32_t word) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 pair;
    memcpy(&pair, &word, 4);
    return __half22float2(pair);
  } else {
    return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
  }
}

// The ldmatrix row address of lane `lane` for a 16 × 16 tile of 16-bit values at `base` (row stride `ld`
// elements) read as four 8 × 8 matrices: rows 0-7 and 8-15 at k, then at k + 8 (m16n8k16's A fragment), or with
// kColumnsFirst rows 0-7 at k and k + 8, then rows 8-15 (two m16n8k16 B fragments side by side).
template <bool kColumnsFirst, typename T>
__device__ __forceinline__ const T* HalfTileRow(const T* base, int ld, int lane) {
  if constexpr (kColumnsFirst) return base + ((lane & 7) + (lane >> 4) * 8) * ld + (lane & 8);
  return base + ((lane & 7) + (lane & 8)) * ld + (lane >> 4) * 8;
}

// d += small, element by element (the second accumulator of MmaSplit).
__device__ __forceinline__ void AddSmall(float (&d)[4], const float (&small)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) d[e] += small[e];
}

// The 16 × 16 output tiles of a chunk (Q × P) that the kernel carries in registers from C·Sᵀ to W·x: P up to 128.
constexpr int kMaxOutputTiles = (kQ / 16) * (128 / 16);

// Row strides in floats. x and u are read down their columns (B of W·x, A of uᵀ·B): a stride of 8 modulo 16 puts
// the lanes' t·stride + g on 32 banks. C, B, S and W are read along their rows by ldmatrix (8 rows of 16 bytes a
// phase): 4 modulo 8 puts those rows on 32 banks. B is also read down its columns (B of uᵀ·B), where 4 modulo 8
// costs a 2-way conflict. Every row stays a multiple of 16 bytes (ldmatrix, the 16-byte conversion stores).
__host__ __device__ constexpr int64_t ColumnStride(int64_t width16) { return width16 + 8; }
__host__ __device__ constexpr int64_t RowStride(int64_t width16) { return width16 + 4; }

// The half path's strides: its staging rows (16-bit values) one 16-byte segment longer than the row, so the 8 rows
// of an ldmatrix phase fall on 8 different segments; its S rows 8 modulo 32 floats, so a half-warp's 64-bit loads
// of S (rows g, columns 2t) cover 32 banks.
__host__ __device__ constexpr int64_t RawStride(int64_t width16, bool half_path) {
  return width16 + (half_path ? 8 : 0);
}
__host__ __device__ constexpr int64_t StateStride(int64_t n16, bool half_path) {
  return half_path ? n16 + 8 : RowStride(n16);
}

// The chunked kernel's shared memory in bytes, for P and N rounded up to 16: the float tiles, the per-token arrays
// (two chunks' d, cs, exp(cs), exp(cs_end − cs) and the next chunk's d), and the staging buffer of the raw next
// chunk (x, B and C as they are in global memory) where the loads are asynchronous. The half path (float16 and
// bfloat16 at fixed widths; always staged) keeps no float copy of C, and u and B transposed.
__host__ __device__ constexpr int64_t ChunkedSharedBytesFor(int64_t p16, int64_t n16, int64_t elem_size,
                                                            bool staged, bool half_path = false) {
  const int64_t tiles = half_path ? kQ * ColumnStride(p16) + (p16 + n16) * (kQ + 8)  // x; uᵀ and Bᵀ
                                  : 2 * kQ * ColumnStride(p16) + 2 * kQ * RowStride(n16);  // x and u; B and C
  const int64_t floats = tiles + p16 * StateStride(n16, half_path) + kQ * RowStride(kQ) + 9 * kQ;
  const int64_t raw =
      staged ? kQ * (RawStride(p16, half_path) + 2 * RawStride(n16, half_path)) * elem_size : 0;
  return floats * 4 + raw;
}

// The 16 / sizeof(T) elements of T at `raw` (16-byte aligned) in float.
template <typename T>
__device__ __forceinline__ void Widen16Bytes(const T* raw, float (&f)[16 / sizeof(T)]) {
  const uint4 v = *reinterpret_cast<const uint4*>(raw);
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(words[i]);
    } else if constexpr (std::is_same_v<T, __half>) {
      __half2 pair;
      memcpy(&pair, &words[i], 4);
      const float2 wide = __half22float2(pair);
      f[2 * i] = wide.x;
      f[2 * i + 1] = wide.y;
    } else {
      __nv_bfloat162 pair;
      memcpy(&pair, &words[i], 4);
      const float2 wide = __bfloat1622float2(pair);
      f[2 * i] = wide.x;
      f[2 * i + 1] = wide.y;
    }
  }
}

// The accumulators of a 16 × 8·kN8 state tile S[p0.., n0..] (row stride lds): exp(cs_end)·S in, S out.
template <int kN8>
__device__ __forceinline__ void LoadStateTile(float (&acc)[kN8][4], const float* ss, int lds, int p0, int n0,
                                              float decay_chunk, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < kN8; ++n8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 s = *reinterpret_cast<const float2*>(ss + (p0 + g + 8 * r) * lds + n0 + 8 * n8 + 2 * t);
      acc[n8][2 * r] = s.x * decay_chunk;
      acc[n8][2 * r + 1] = s.y * decay_chunk;
    }
  }
}
template <int kN8>
__device__ __forceinline__ void StoreStateTile(const float (&acc)[kN8][4], float* ss, int lds, int p0, int n0,
                                               int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n8 = 0; n8 < kN8; ++n8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<float2*>(ss + (p0 + g + 8 * r) * lds + n0 + 8 * n8 + 2 * t) =
          make_float2(acc[n8][2 * r], acc[n8][2 * r + 1]);
    }
  }
}

// S[p0.., n0..] (16 × 8·kN8 of the state, row stride lds) ← exp(cs_end)·S + uᵀ·B over the chunk's Q tokens, one
// warp.
template <int kN8, bool kSplitInput>
__device__ __forceinline__ void UpdateStateTile(float* ss, int lds, const float* us, int ldx, const float* bs, int ldn,
                                                int p0, int n0, float decay_chunk, int lane) {
  float acc[kN8][4];
  LoadStateTile(acc, ss, lds, p0, n0, decay_chunk, lane);
  float small[kN8][4] = {};
  for (int k0 = 0; k0 < kQ; k0 += 8) {
    Tf32Operand<4, true> a;
    LoadATransposed(a, us + k0 * ldx + p0, ldx, lane);
#pragma unroll
    for (int n8 = 0; n8 < kN8; ++n8) {
      Tf32Operand<2, kSplitInput> b;
      LoadBRows(b, bs + k0 * ldn + n0 + 8 * n8, ldn, lane);
      MmaSplit(acc[n8], small[n8], a, b);
    }
  }
#pragma unroll
  for (int n8 = 0; n8 < kN8; ++n8) AddSmall(acc[n8], small[n8]);
  StoreStateTile(acc, ss, lds, p0, n0, lane);
}

// The same update on the half path, where u and B are stored transposed (uᵀ[p][l], Bᵀ[n][l], row stride ld): with
// the tokens of each k-step taken in the order 2t, 2t + 1 (A's column t and t + 4, B's row t and t + 4), every
// fragment pair is one 64-bit load — two for uᵀ's 16 rows and one for each 8 columns of B, where the row-major
// arrays need a 32-bit load an element.
template <int kN8>
__device__ __forceinline__ void UpdateStateTileTransposed(float* ss, int lds, const float* ut, const float* bt, int ld,
                                                          int p0, int n0, float decay_chunk, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float acc[kN8][4];
  LoadStateTile(acc, ss, lds, p0, n0, decay_chunk, lane);
  float small[kN8][4] = {};
  const float* const u_top = ut + (p0 + g) * ld + 2 * t;
  const float* const b_rows = bt + (n0 + g) * ld + 2 * t;
#pragma unroll 2
  for (int k0 = 0; k0 < kQ; k0 += 8) {
    const float2 top = *reinterpret_cast<const float2*>(u_top + k0);
    const float2 bottom = *reinterpret_cast<const float2*>(u_top + 8 * ld + k0);
    Tf32Operand<4, true> a;
    a.Set(0, top.x);
    a.Set(1, bottom.x);
    a.Set(2, top.y);
    a.Set(3, bottom.y);
#pragma unroll
    for (int n8 = 0; n8 < kN8; ++n8) {
      const float2 pair = *reinterpret_cast<const float2*>(b_rows + 8 * n8 * ld + k0);
      Tf32Operand<2, false> b;
      b.Set(0, pair.x);
      b.Set(1, pair.y);
      MmaSplit(acc[n8], small[n8], a, b);
    }
  }
#pragma unroll
  for (int n8 = 0; n8 < kN8; ++n8) AddSmall(acc[n8], small[n8]);
  StoreStateTile(acc, ss, lds, p0, n0, lane);
}

// A chunk's cumulative sums from its time steps, one warp, two tokens a lane (d0, d1 at tokens 2·lane and
// 2·lane + 1): cs = the float32 running sum of a = A·d from the chunk's first token into out[Q + l], exp(cs) into
// out[2Q + l] and exp(cs_end − cs) into out[3Q + l].
__device__ __forceinline__ void ChunkSums(float d0, float d1, float a_h, int lane, float* out) {
  const int l0 = 2 * lane;
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
  out[kQ + l0] = c0;
  out[kQ + l0 + 1] = c1;
  out[2 * kQ + l0] = expf(c0);
  out[2 * kQ + l0 + 1] = expf(c1);
  out[3 * kQ + l0] = expf(__fsub_rn(end, c0));
  out[3 * kQ + l0 + 1] = expf(__fsub_rn(end, c1));
}

// The row and column tiles (i, j), j ≤ i, of causal 16 × 16 tile number `tile` (row by row).
__device__ __forceinline__ void CausalTile(int tile, int& i, int& j) {
  i = 0;
  j = tile;
  while (j > i) j -= ++i;
}

// C·Bᵀ on the causal tile (i, j) from the 16-bit staging rows of C and B (row stride ld) over k < n: m16n8k16 with
// T's values as they are (exact products, float32 sums) into w[n8].
template <typename T>
__device__ __forceinline__ void CausalTileProduct(float (&w)[2][4], const T* c_rows, const T* b_rows, int ld, int i,
                                                  int j, int n, int lane) {
  const T* const c_tile = HalfTileRow<false>(c_rows + i * 16 * ld, ld, lane);
  const T* const b_tile = HalfTileRow<true>(b_rows + j * 16 * ld, ld, lane);
#pragma unroll
  for (int k0 = 0; k0 < n; k0 += 16) {
    uint32_t a[4], bt[4];
    LoadMatrixX4(a, c_tile + k0);
    LoadMatrixX4(bt, b_tile + k0);
    MmaHalf<T>(w[0], a, bt[0], bt[1]);
    MmaHalf<T>(w[1], a, bt[2], bt[3]);
  }
}

// W = (exp(cs_l − cs_s)·d_s)[s ≤ l] ∘ C·Bᵀ on the causal tile (i, j), from lane (g, t)'s C·Bᵀ accumulators, into
// ws (row stride ld).
__device__ __forceinline__ void StoreWTile(const float (&w)[2][4], int i, int j, const float* cumsum,
                                           const float* step, float* ws, int ld, int g, int t) {
#pragma unroll
  for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int l = i * 16 + g + 8 * r, s = j * 16 + 8 * n8 + 2 * t;
      const float cs_l = cumsum[l];
      float pair[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        pair[e] = s + e <= l ? w[n8][2 * r + e] * expf(__fsub_rn(cs_l, cumsum[s + e])) * step[s + e] : 0.f;
      }
      *reinterpret_cast<float2*>(ws + l * ld + s) = make_float2(pair[0], pair[1]);
    }
  }
}

// Three phases a chunk, a barrier after each:
//   1. x, B and C of the chunk in float (from the staging buffer, 16 bytes a thread-step, or from global memory),
//      and u·exp(cs_end − cs); then the next chunk's asynchronous loads start.
//   2. C·Sᵀ into registers (each warp keeps its 16 × 16 output tiles there until phase 3); C·Bᵀ on the causal
//      tiles, turned into W in registers and stored; the next chunk's time steps (the last two warps).
//   3. y = exp(cs)·C·Sᵀ + W·x on the carried tiles, written out with D·x; S ← exp(cs_end)·S + uᵀ·B; the next
//      chunk's cumulative sums (warp 0).
// The per-token arrays alternate between two buffers by chunk parity, so phase 3 can fill the next chunk's while
// this chunk's are read.
//
// kP and kN > 0: a kernel for exactly those P and N (multiples of 16), whose strides, trip counts and tile counts
// are compile-time constants; 0: P and N from the parameters. The fixed kernels are float16 and bfloat16 only and
// take the half path (staged loads required), which reads C and B where they land, in the staging buffer: C·Bᵀ on
// m16n8k16 tensor cores with T's values as they are (exact products, float32 sums), and C·Sᵀ's C fragments widened
// from there (no float copy of C; a third less shared-memory traffic for the two products); phase 1 stores u and B
// transposed, for UpdateStateTileTransposed's 64-bit fragment loads. The next chunk's loads then start after phase
// 2 (the last reader of the staging buffer), not phase 1. The products are those of the kernel for any widths.
template <typename T, int kWarps, int kP, int kN>
__global__ void __launch_bounds__(kWarps * 32, 1) ChunkedScan(Params p) {
  static_assert(kP % 16 == 0 && kN % 16 == 0 && (kP == 0) == (kN == 0) && kP <= 128, "fixed widths: multiples of 16");
  constexpr bool kHalfPath = kP > 0;  // the fixed-width build, which always takes the half path
  static_assert(!kHalfPath || !std::is_same_v<T, float>, "the half path is for 16-bit types");
  constexpr int kThreads = kWarps * 32;
  // Inputs of float16 and bfloat16 are exact in TF32; float inputs are split like the computed operands.
  constexpr bool kSplitInput = std::is_same_v<T, float>;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements a 16-byte copy moves
  constexpr int kOutputTiles = kHalfPath ? (kQ / 16) * (kP / 16) : kMaxOutputTiles;
  constexpr int kTilesPerWarp = (kOutputTiles + kWarps - 1) / kWarps;
  constexpr int kCausalTiles = (kQ / 16) * (kQ / 16 + 1) / 2;  // the 16 × 16 tiles of C·Bᵀ with s ≤ l
  constexpr int kStepThreads = (kCausalTiles < kWarps - 2 ? kCausalTiles : kWarps - 2) * 32;  // first of kQ
  extern __shared__ __align__(128) float smem[];
  const int p16 = kHalfPath ? kP : p.p16, n16 = kHalfPath ? kN : p.n16;
  const int ldx = static_cast<int>(ColumnStride(p16)), ldn = static_cast<int>(RowStride(n16));
  const int ldq = static_cast<int>(RowStride(kQ));
  const int lds = static_cast<int>(StateStride(n16, kHalfPath));
  constexpr int ldu = kHalfPath ? kQ + 8 : 0;  // the half path's uᵀ and Bᵀ rows: 8 modulo 32 floats
  const int ldr_x = static_cast<int>(RawStride(p16, kHalfPath)), ldr_n = static_cast<int>(RawStride(n16, kHalfPath));
  float* const xs = smem;                   // [Q][ldx]  x, zeros past P and past the prompt
  float* const us = xs + kQ * ldx;          // [Q][ldx]  u·exp(cs_end − cs) (the half path: uᵀ, [p16][ldu])
  float* const bs = us + (kHalfPath ? p16 * ldu : kQ * ldx);  // [Q][ldn]  B (the half path: Bᵀ, [n16][ldu])
  float* const cm = bs + (kHalfPath ? n16 * ldu : kQ * ldn);  // [Q][ldn]  C (not on the half path)
  float* const ss = cm + (kHalfPath ? 0 : kQ * ldn);  // [p16][lds] the state S[p][n]
  float* const ws = ss + p16 * lds;         // [Q][ldq]  W (its causal tiles)
  float* const tokens = ws + kQ * ldq;      // [2][4][Q] by chunk parity: d, cs, exp(cs), exp(cs_end − cs)
  float* const step_next = tokens + 8 * kQ;  // [Q] the next chunk's d
  T* const raw_x = reinterpret_cast<T*>(step_next + kQ);  // [Q][ldr_x] (staged loads only)
  T* const raw_b = raw_x + kQ * ldr_x;                    // [Q][ldr_n]
  T* const raw_c = raw_b + kQ * ldr_n;                    // [Q][ldr_n]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads;
  const int h = static_cast<int>(bh % p.heads);
  const int g = h / (p.heads / p.groups);
  const int P = kHalfPath ? kP : p.head_dim, N = kHalfPath ? kN : p.state_size;
  const int64_t len = p.length;
  const auto* const x_in = static_cast<const T*>(p.x);
  const auto* const b_in = static_cast<const T*>(p.b);
  const auto* const c_in = static_cast<const T*>(p.c);

  // Staged loads: the prompt rows of chunk t0 into the raw buffer, 16 bytes a copy (P and N are multiples of kVec
  // and the tensors 16-byte aligned: the host checks). Rows past the prompt are not copied (the conversion zeroes
  // them, in its float copies or, on the half path, in the raw buffer).
  const int64_t x_row = static_cast<int64_t>(p.heads) * P, bc_row = static_cast<int64_t>(p.groups) * N;
  const auto stage = [&](int64_t t0) {
    const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
    const int xv = P / kVec, nv = N / kVec;
    const T* const x_chunk = x_in + (b * len + t0) * x_row + static_cast<int64_t>(h) * P;
    for (int i = tid; i < q * xv; i += kThreads) {
      const int l = i / xv, v = i % xv;
      CopyAsync16(raw_x + l * ldr_x + v * kVec, x_chunk + l * x_row + v * kVec);
    }
    const int64_t bc_chunk = (b * len + t0) * bc_row + static_cast<int64_t>(g) * N;
    for (int i = tid; i < q * nv; i += kThreads) {
      const int l = i / nv, v = i % nv;
      const int64_t row = bc_chunk + l * bc_row + v * kVec;
      CopyAsync16(raw_b + l * ldr_n + v * kVec, b_in + row);
      CopyAsync16(raw_c + l * ldr_n + v * kVec, c_in + row);
    }
    CopyAsyncCommit();
  };
  // The time step of the chunk at t0 for token l of it (0 past the prompt).
  const auto time_step = [&](int64_t t0, int l) {
    return t0 + l < len ? TimeStep<T>(p, b * len + t0 + l, h) : 0.f;
  };
  const float a_h = p.a[h];
  // Warp 0: the chunk's d, cs, exp(cs) and exp(cs_end − cs) into `tokens` from step_next, two tokens a lane.
  const auto chunk_sums = [&](float* out) {
    const float d0 = step_next[2 * lane], d1 = step_next[2 * lane + 1];
    ChunkSums(d0, d1, a_h, lane, out);
    out[2 * lane] = d0;
    out[2 * lane + 1] = d1;
  };

  if (p.staged) stage(0);
  // Element loops run rows over warps and columns over lanes: no index division, and whole rows a warp.
  for (int row = warp; row < p16; row += kWarps) {
    for (int n = lane; n < n16; n += 32) {
      float v = 0.f;
      if (p.initial_state != nullptr && row < P && n < N) {
        v = LoadFloatOrT<T>(p.initial_state, p.state_is_float, StateIndex(p, bh, row, n));
      }
      ss[row * lds + n] = v;
    }
  }
  if (tid < kQ) step_next[tid] = time_step(0, tid);
  __syncthreads();
  if (warp == 0) chunk_sums(tokens);
  if (p.staged) CopyAsyncWaitAll();
  __syncthreads();
  bool state_zero = p.initial_state == nullptr;
  const float skip = p.d != nullptr ? LoadFloatOrT<T>(p.d, p.d_is_float, h) : 0.f;
  const int p_tiles = p16 / 16, q_tiles = kQ / 16;
  const int out_tiles = q_tiles * p_tiles;  // at most kMaxOutputTiles: the host checks
  const bool p_even = P % 2 == 0;

  int parity = 0;
  for (int64_t t0 = 0; t0 < len; t0 += kQ, parity ^= 1) {
    const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
    const float* const step = tokens + parity * 4 * kQ;
    const float* const cumsum = step + kQ;
    const float* const decay_in = step + 2 * kQ;
    const float* const decay_out = step + 3 * kQ;

    // 1. x, u, B and C in float, zero-padded (the half path: x, and u and B transposed; C stays in the staging
    // buffer, whose rows of B and C past the prompt are zeroed instead).
    if constexpr (kHalfPath) {
      // Lanes walk the tokens, so the transposed stores of u and B fall on 32 banks.
      for (int i = tid; i < kQ * (kP / kVec); i += kThreads) {
        const int l = i % kQ, col = i / kQ * kVec;
        float f[kVec] = {};
        if (l < q) Widen16Bytes(raw_x + l * ldr_x + col, f);
        const float d_l = step[l], out_l = decay_out[l];
#pragma unroll
        for (int e = 0; e < kVec; ++e) us[(col + e) * ldu + l] = __fmul_rn(f[e], d_l) * out_l;
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          *reinterpret_cast<float4*>(xs + l * ldx + col + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
        }
      }
      for (int i = tid; i < kQ * (kN / kVec); i += kThreads) {
        const int l = i % kQ, col = i / kQ * kVec;
        float fb[kVec] = {};
        if (l < q) {
          Widen16Bytes(raw_b + l * ldr_n + col, fb);
        } else {
          *reinterpret_cast<uint4*>(raw_b + l * ldr_n + col) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(raw_c + l * ldr_n + col) = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int e = 0; e < kVec; ++e) bs[(col + e) * ldu + l] = fb[e];
      }
    } else if (p.staged) {
      const int xv = p16 / kVec, nv = n16 / kVec;
      for (int i = tid; i < kQ * xv; i += kThreads) {
        const int l = i / xv, col = (i - l * xv) * kVec;
        float f[kVec] = {};
        if (l < q && col < P) Widen16Bytes(raw_x + l * ldr_x + col, f);
        const float d_l = step[l], out_l = decay_out[l];
        float u[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) u[e] = __fmul_rn(f[e], d_l) * out_l;
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          *reinterpret_cast<float4*>(xs + l * ldx + col + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
          *reinterpret_cast<float4*>(us + l * ldx + col + e) = make_float4(u[e], u[e + 1], u[e + 2], u[e + 3]);
        }
      }
      for (int i = tid; i < kQ * nv; i += kThreads) {
        const int l = i / nv, col = (i - l * nv) * kVec;
        float fb[kVec] = {}, fc[kVec] = {};
        if (l < q && col < N) {
          Widen16Bytes(raw_b + l * ldr_n + col, fb);
          Widen16Bytes(raw_c + l * ldr_n + col, fc);
        }
#pragma unroll
        for (int e = 0; e < kVec; e += 4) {
          *reinterpret_cast<float4*>(bs + l * ldn + col + e) = make_float4(fb[e], fb[e + 1], fb[e + 2], fb[e + 3]);
          *reinterpret_cast<float4*>(cm + l * ldn + col + e) = make_float4(fc[e], fc[e + 1], fc[e + 2], fc[e + 3]);
        }
      }
    } else {
      for (int l = warp; l < kQ; l += kWarps) {
        const float d_l = step[l], out_l = decay_out[l];
        for (int col = lane; col < p16; col += 32) {
          const float v = l < q && col < P ? Load<T>(p.x, ((b * len + t0 + l) * p.heads + h) * P + col) : 0.f;
          xs[l * ldx + col] = v;
          us[l * ldx + col] = __fmul_rn(v, d_l) * out_l;
        }
        for (int n = lane; n < n16; n += 32) {
          float bv = 0.f, cv = 0.f;
          if (l < q && n < N) {
            const int64_t row = ((b * len + t0 + l) * p.groups + g) * N + n;
            bv = Load<T>(p.b, row);
            cv = Load<T>(p.c, row);
          }
          bs[l * ldn + n] = bv;
          cm[l * ldn + n] = cv;
        }
      }
    }
    __syncthreads();
    // The raw buffer is free (the half path: after phase 2, which reads B and C there): the next chunk's loads run
    // under this chunk's products.
    if (!kHalfPath && p.staged && t0 + kQ < len) stage(t0 + kQ);

    // 2. The next chunk's time steps first (global loads and double math, under the other warps' products), by
    // two warps without a C·Bᵀ tile where there are such.
    if (tid >= kStepThreads && tid < kStepThreads + kQ) {
      step_next[tid - kStepThreads] = time_step(t0 + kQ, tid - kStepThreads);
    }
    // C·Sᵀ on this warp's output tiles, kept in registers.
    float y[kTilesPerWarp][2][4];
#pragma unroll
    for (int k = 0; k < kTilesPerWarp; ++k) {
#pragma unroll
      for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
        for (int e = 0; e < 4; ++e) y[k][n8][e] = 0.f;
      }
      const int tile = warp + k * kWarps;
      if (tile >= out_tiles || state_zero) continue;
      const int i = tile / p_tiles, j = tile % p_tiles;
      float small[2][4] = {};
      if constexpr (kHalfPath) {
        // C from the staging buffer, 16 × 16 by one ldmatrix: lane (g, t) gets C[g][k + 2t, 2t + 1] (and rows g + 8,
        // and k + 8), two k-steps of TF32 A fragments once k is taken in the order 2t, 2t + 1 (A's column t and
        // t + 4); S's B fragment in the same order is the pair S[p][k + 2t, 2t + 1], one 64-bit load, split.
        const T* const c_tile = HalfTileRow<false>(raw_c + i * 16 * ldr_n, ldr_n, lane);
        for (int k0 = 0; k0 < n16; k0 += 16) {
          uint32_t r[4];
          LoadMatrixX4(r, c_tile + k0);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float2 top = WidenPair<T>(r[2 * half]), bottom = WidenPair<T>(r[2 * half + 1]);
            const uint32_t a[4] = {__float_as_uint(top.x), __float_as_uint(bottom.x), __float_as_uint(top.y),
                                   __float_as_uint(bottom.y)};
#pragma unroll
            for (int n8 = 0; n8 < 2; ++n8) {
              const float2 pair =
                  *reinterpret_cast<const float2*>(ss + (j * 16 + 8 * n8 + g8) * lds + k0 + 8 * half + 2 * t4);
              Tf32Operand<2, true> st;
              st.Set(0, pair.x);
              st.Set(1, pair.y);
              MmaTf32(small[n8], a, st.lo[0], st.lo[1]);
              MmaTf32(y[k][n8], a, st.hi[0], st.hi[1]);
            }
          }
        }
      } else {
        ProductTile<kSplitInput, true>(y[k], small, cm + i * 16 * ldn, ldn, ss + j * 16 * lds, lds, n16, lane);
      }
      AddSmall(y[k][0], small[0]);
      AddSmall(y[k][1], small[1]);
    }
    // C·Bᵀ on the causal tiles (s ≤ l), then W = (exp(cs_l − cs_s)·d_s)[s ≤ l] ∘ C·Bᵀ.
    for (int tile = warp; tile < kCausalTiles; tile += kWarps) {
      int i, j;
      CausalTile(tile, i, j);
      float w[2][4] = {}, small[2][4] = {};
      if constexpr (kHalfPath) {
        // Both operands from the staging buffer as they are: C's rows (A) and B's rows (Bᵀ's columns).
        CausalTileProduct<T>(w, raw_c, raw_b, ldr_n, i, j, n16, lane);
      } else {
        ProductTile<kSplitInput, kSplitInput>(w, small, cm + i * 16 * ldn, ldn, bs + j * 16 * ldn, ldn, n16, lane);
      }
      if constexpr (kSplitInput) {
        AddSmall(w[0], small[0]);
        AddSmall(w[1], small[1]);
      }
      // StoreWTile's loop, written out here: through the function ptxas schedules this kernel differently (up to
      // +216 instructions), and this kernel's timings are those measured with it inline.
#pragma unroll
      for (int n8 = 0; n8 < 2; ++n8) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int l = i * 16 + g8 + 8 * r, s = j * 16 + 8 * n8 + 2 * t4;
          const float cs_l = cumsum[l];
          float pair[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            pair[e] = s + e <= l ? w[n8][2 * r + e] * expf(__fsub_rn(cs_l, cumsum[s + e])) * step[s + e] : 0.f;
          }
          *reinterpret_cast<float2*>(ws + l * ldq + s) = make_float2(pair[0], pair[1]);
        }
      }
    }
    __syncthreads();
    if (kHalfPath && t0 + kQ < len) stage(t0 + kQ);

    // 3. y = exp(cs)·C·Sᵀ + W·x (row tile i needs s < 16(i + 1) only), out = y + D·x.
#pragma unroll
    for (int k = 0; k < kTilesPerWarp; ++k) {
      const int tile = warp + k * kWarps;
      if (tile >= out_tiles) continue;
      const int i = tile / p_tiles, j = tile % p_tiles;
      if (!state_zero) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float in_l = decay_in[i * 16 + g8 + 8 * r];
#pragma unroll
          for (int n8 = 0; n8 < 2; ++n8) {
            y[k][n8][2 * r] *= in_l;
            y[k][n8][2 * r + 1] *= in_l;
          }
        }
      }
      float small[2][4] = {};
      for (int k0 = 0; k0 < 16 * (i + 1); k0 += 8) {
        Tf32Operand<4, true> a;
        LoadARows(a, ws + i * 16 * ldq + k0, ldq, lane);
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8) {
          Tf32Operand<2, kSplitInput> xt;
          LoadBRows(xt, xs + k0 * ldx + j * 16 + 8 * n8, ldx, lane);
          MmaSplit(y[k][n8], small[n8], a, xt);
        }
      }
      AddSmall(y[k][0], small[0]);
      AddSmall(y[k][1], small[1]);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int l = i * 16 + g8 + 8 * r;
        if (l >= q) continue;
        float* const out_row = p.out + ((b * len + t0 + l) * p.heads + h) * P;
#pragma unroll
        for (int n8 = 0; n8 < 2; ++n8) {
          const int col = j * 16 + 8 * n8 + 2 * t4;
          float v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            v[e] = y[k][n8][2 * r + e];
            if (p.d != nullptr) v[e] = __fadd_rn(v[e], __fmul_rn(skip, xs[l * ldx + col + e]));
          }
          if (p_even && col < P) {
            *reinterpret_cast<float2*>(out_row + col) = make_float2(v[0], v[1]);
          } else {
            if (col < P) out_row[col] = v[0];
            if (col + 1 < P) out_row[col + 1] = v[1];
          }
        }
      }
    }
    // S ← exp(cs_end)·S + uᵀ·B, in tiles of 16 × 32 where N allows (uᵀ's split fragments serve four products).
    const float decay_chunk = decay_in[kQ - 1];
    if constexpr (kHalfPath) {
      constexpr int n_tiles = kN / 32 > 0 ? kN / 32 : 1, width = kN / n_tiles;
      for (int tile = warp; tile < (kP / 16) * n_tiles; tile += kWarps) {
        UpdateStateTileTransposed<width / 8>(ss, lds, us, bs, ldu, tile / n_tiles * 16, tile % n_tiles * width,
                                             decay_chunk, lane);
      }
    } else if (n16 % 32 == 0) {
      const int n_tiles = n16 / 32;
      for (int tile = warp; tile < p_tiles * n_tiles; tile += kWarps) {
        UpdateStateTile<4, kSplitInput>(ss, lds, us, ldx, bs, ldn, tile / n_tiles * 16, tile % n_tiles * 32,
                                        decay_chunk, lane);
      }
    } else {
      const int n_tiles = n16 / 16;
      for (int tile = warp; tile < p_tiles * n_tiles; tile += kWarps) {
        UpdateStateTile<2, kSplitInput>(ss, lds, us, ldx, bs, ldn, tile / n_tiles * 16, tile % n_tiles * 16,
                                        decay_chunk, lane);
      }
    }
    if (warp == 0 && t0 + kQ < len) chunk_sums(tokens + (parity ^ 1) * 4 * kQ);
    state_zero = false;
    if (p.staged) CopyAsyncWaitAll();
    __syncthreads();
  }
  for (int row = warp; row < P; row += kWarps) {
    for (int n = lane; n < N; n += 32) p.final_state[StateIndex(p, bh, row, n)] = ss[row * lds + n];
  }
}

// --- register-state kernel --------------------------------------------------------------------------------------

// RegisterStateScan: the half path's widths (P = 64, N = 128 or 64; float16 and bfloat16) with the state in
// registers for the whole prompt. One block of 16 warps per (batch row, head), in two roles:
// - 8 state warps. Warp w holds Sᵀ[16·(w / 2) + 0..15][n] for its half of N (n in [N/2·(w % 2), N/2·(w % 2 + 1))) as
//   m16n8 accumulators, and for each chunk computes, from its registers and the chunk's staged x, B and C:
//     its half of exp(cs)·C·Sᵀ for the chunk's 64 tokens (Yᵀ = Sᵀ·Cᵀ: the accumulator of Sᵀ's k-step is the A
//     fragment of TF32 m16n8k8 once the k-step's columns are taken in the order 2t, 2t + 1, so S never moves);
//     W·x and D·x on the 4 token tiles of 8 it owns (the other 4 are its partner's, the warp of the other half),
//     the partner's partial sums of those tiles added through shared memory, and `out` stored;
//     S ← exp(cs_end)·S + uᵀ·B for its half, u = x·d·exp(cs_end − cs) formed from x's fragments.
// - 8 helper warps prepare the next chunk while the state warps run this one: its asynchronous copies (two
//   chunks ahead), time steps, cumulative sums and W = (exp(cs_l − cs_s)·d_s)[s ≤ l] ∘ C·Bᵀ (C·Bᵀ on m16n8k16
//   tensor cores with T's values as they are).
// One block-wide barrier a chunk; a pair of state warps meets at its own named barrier to exchange partial sums,
// the helpers at theirs. The products, their TF32 splits and the rounding points are the chunked kernel's: x, B and
// C exact in TF32, the state, W and u split in two TF32 parts (for float16 inputs the readout's state is split in
// two float16 parts instead, below).
constexpr int kRsThreads = 512;
constexpr int kRsHelperThreads = 256;  // warps 8-15
constexpr int kRsBlockBarrier = 0;     // named barrier ids: 0 the block, 1-4 the state warps' pairs, 5 the helpers
constexpr int kRsHelperBarrier = 5;
// A timing diagnostic, never for results: 1 the helpers stage but do not prepare (the state warps' time alone), 2
// the state warps skip their chunk's work (the helpers' time alone).
#ifndef MAMBAFUSE_RS_DIAGNOSTIC
#define MAMBAFUSE_RS_DIAGNOSTIC 0
#endif
constexpr int kRsDiagnostic = MAMBAFUSE_RS_DIAGNOSTIC;
constexpr int kRsSlots = 3;            // staging slots: the chunk the state warps read, the next, the one landing
constexpr int kRsP = 64;
constexpr int kRsLdx = kRsP + 8;       // x's staging rows (16-bit elements): 8 ldmatrix rows on 8 16-byte segments
constexpr int kRsLdw = kQ + 8;         // W's rows (floats): lanes (g, t) reading W[g][2t, 2t + 1] hit 32 banks
constexpr int kRsExchangeFloats = 8 * 4 * 4 * 32;  // a state warp's 4 tiles for its partner: [warp][tile][e][lane]

__host__ __device__ constexpr int64_t RsLdn(int64_t n) { return n + 8; }
__host__ __device__ constexpr int64_t RegisterStateSharedBytes(int64_t n) {
  return kRsSlots * kQ * (kRsLdx + 2 * RsLdn(n)) * 2 + (2 * kQ * kRsLdw + kRsExchangeFloats + kRsSlots * 4 * kQ) * 4;
}

// float16 I/O: the state enters C·Sᵀ as two float16 parts of a row scaled by a power of two (RsRowScale), on
// m16n8k16 tensor cores with C as it is — half the instructions of the TF32 split and no widening of C.
// MAMBAFUSE_RS_F16_SPLIT=0 builds the TF32 split for float16 too (a comparison). The update uᵀ·B keeps the TF32
// split: its float16 form (u's rows scaled per 16 tokens, each product in a fresh accumulator) needs more than the
// 128 registers a thread has here.
#ifndef MAMBAFUSE_RS_F16_SPLIT
#define MAMBAFUSE_RS_F16_SPLIT 1
#endif

// The powers of two that take a row whose largest magnitude is `m` to [2^14, 2^15) (`down`) and back (`up`): the
// float16 parts of the scaled row keep 22 significant bits of each element, as the TF32 split does, and an element
// under 2^-29 of the row's largest (below float16's normal range once scaled) keeps an absolute 2^-40 of it. The
// exponent is clamped to [2^-112, 2^127], where both factors are normal floats; an infinite or NaN row stays one.
__device__ __forceinline__ void RsRowScale(float m, float& down, float& up) {
  int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu);
  e = e < 15 ? 15 : (e > 254 ? 254 : e);
  down = __uint_as_float(static_cast<uint32_t>(268 - e) << 23);
  up = __uint_as_float(static_cast<uint32_t>(e - 14) << 23);
}

// (v0, v1) as float16 pairs hi + lo: hi the rounding of each to nearest, lo the rounding of the rest.
__device__ __forceinline__ void SplitHalf2(float v0, float v1, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(v0, v1);
  const float2 back = __half22float2(h);
  const __half2 l = __floats2half2_rn(__fsub_rn(v0, back.x), __fsub_rn(v1, back.y));
  memcpy(&hi, &h, 4);
  memcpy(&lo, &l, 4);
}

// The largest of the four lanes' `m` of a row (lanes 4g .. 4g + 3).
__device__ __forceinline__ float RowMax4(float m) {
  m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));
  return fmaxf(m, __shfl_xor_sync(kFull, m, 2));
}

// The partner warp of the other half of N owns token tile j (8 tokens) where this is its half's index.
__device__ __forceinline__ int RsOwner(int j) { return (j ^ (j >> 1)) & 1; }

template <typename T, int kN>
__global__ void __launch_bounds__(kRsThreads, 1) RegisterStateScan(Params p) {
  static_assert(kN == 128 || kN == 64, "RegisterStateScan: N = 128 or 64");
  static_assert(!std::is_same_v<T, float>, "RegisterStateScan: 16-bit types");
  constexpr int kVec = 8;             // 16-bit elements a 16-byte copy moves
  constexpr int kLdn = static_cast<int>(RsLdn(kN));
  constexpr int kHalfN = kN / 2;      // a state warp's columns of S
  constexpr int kN8 = kHalfN / 8;     // its accumulator tiles
  constexpr int kSlotElems = kQ * (kRsLdx + 2 * kLdn);
  constexpr int kCausalTiles = (kQ / 16) * (kQ / 16 + 1) / 2;
  constexpr bool kF16 = std::is_same_v<T, __half> && MAMBAFUSE_RS_F16_SPLIT;
  extern __shared__ __align__(128) float smem[];
  float* const ws = smem;                              // [2][Q][kRsLdw] W by chunk parity
  float* const exchange = ws + 2 * kQ * kRsLdw;        // [8][4][4][32] the state warps' partial sums
  float* const tokens = exchange + kRsExchangeFloats;  // [3][4][Q] by slot: d, cs, exp(cs), exp(cs_end − cs)
  T* const staging = reinterpret_cast<T*>(tokens + kRsSlots * 4 * kQ);  // [3] slots of x [Q][kRsLdx], B, C [Q][kLdn]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int64_t bh = blockIdx.x;
  const int64_t b = bh / p.heads;
  const int h = static_cast<int>(bh % p.heads);
  const int g = h / (p.heads / p.groups);
  const int64_t len = p.length;
  const auto* const x_in = static_cast<const T*>(p.x);
  const auto* const b_in = static_cast<const T*>(p.b);
  const auto* const c_in = static_cast<const T*>(p.c);
  const auto slot_x = [&](int64_t chunk) { return staging + (chunk % kRsSlots) * kSlotElems; };
  const auto slot_b = [&](int64_t chunk) { return slot_x(chunk) + kQ * kRsLdx; };
  const auto slot_c = [&](int64_t chunk) { return slot_b(chunk) + kQ * kLdn; };
  const auto slot_tokens = [&](int64_t chunk) { return tokens + (chunk % kRsSlots) * 4 * kQ; };

  if (warp >= 8) {
    // --- helper warps ---
    const int hid = tid - 8 * 32, hw = warp - 8;
    const int64_t x_row = static_cast<int64_t>(p.heads) * kRsP, bc_row = static_cast<int64_t>(p.groups) * kN;
    // The chunk's prompt rows into its slot, 16 bytes a copy; rows past the prompt zeroed.
    const auto stage = [&](int64_t chunk) {
      const int64_t t0 = chunk * kQ;
      const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
      T* const rx = slot_x(chunk);
      T* const rb = slot_b(chunk);
      T* const rc = slot_c(chunk);
      const T* const x_chunk = x_in + (b * len + t0) * x_row + static_cast<int64_t>(h) * kRsP;
      for (int i = hid; i < kQ * (kRsP / kVec); i += kRsHelperThreads) {
        const int l = i / (kRsP / kVec), v = i % (kRsP / kVec);
        if (l < q) {
          CopyAsync16(rx + l * kRsLdx + v * kVec, x_chunk + l * x_row + v * kVec);
        } else {
          *reinterpret_cast<uint4*>(rx + l * kRsLdx + v * kVec) = make_uint4(0, 0, 0, 0);
        }
      }
      const int64_t bc_chunk = (b * len + t0) * bc_row + static_cast<int64_t>(g) * kN;
      for (int i = hid; i < kQ * (kN / kVec); i += kRsHelperThreads) {
        const int l = i / (kN / kVec), v = i % (kN / kVec);
        if (l < q) {
          const int64_t row = bc_chunk + l * bc_row + v * kVec;
          CopyAsync16(rb + l * kLdn + v * kVec, b_in + row);
          CopyAsync16(rc + l * kLdn + v * kVec, c_in + row);
        } else {
          *reinterpret_cast<uint4*>(rb + l * kLdn + v * kVec) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(rc + l * kLdn + v * kVec) = make_uint4(0, 0, 0, 0);
        }
      }
    };
    const float a_h = p.a[h];
    // Chunk `chunk` (landed in its slot, or landing: this thread waits for its own copies) into W and the per-token
    // arrays of its parity. Called with every helper thread.
    const auto prepare = [&](int64_t chunk) {
      float* const tok = slot_tokens(chunk);  // its time steps are there (the iteration before)
      CopyAsyncWaitGroup<1>();  // this chunk's group; the one after it may stay in flight
      NamedBarrierSync(kRsHelperBarrier, kRsHelperThreads);
      if (hw == 2) ChunkSums(tok[2 * lane], tok[2 * lane + 1], a_h, lane, tok);  // a warp with one C·Bᵀ tile
      // C·Bᵀ on the causal 16 × 16 tiles (s ≤ l), tiles hw and hw + 8, then W from them once the sums are there.
      float w[2][2][4] = {};
      int tile_i[2], tile_j[2];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (hw + 8 * k >= kCausalTiles) continue;
        CausalTile(hw + 8 * k, tile_i[k], tile_j[k]);
        CausalTileProduct<T>(w[k], slot_c(chunk), slot_b(chunk), kLdn, tile_i[k], tile_j[k], kN, lane);
      }
      NamedBarrierSync(kRsHelperBarrier, kRsHelperThreads);  // the cumulative sums
      float* const wc = ws + (chunk & 1) * kQ * kRsLdw;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        if (hw + 8 * k < kCausalTiles) StoreWTile(w[k], tile_i[k], tile_j[k], tok + kQ, tok, wc, kRsLdw, g8, t4);
      }
    };
    // Warps 14 and 15 (one C·Bᵀ tile each) find the time steps two chunks ahead: dt's loads at the start of an
    // iteration, the softplus and the store at its end, off the path of the chunk being prepared.
    const int step_lane = hid - (kRsHelperThreads - kQ);
    const auto load_dt = [&](int64_t chunk) {
      const int64_t t = chunk * kQ + step_lane;
      return step_lane >= 0 && t < len ? LoadDt<T>(p, (b * len + t) * p.heads + h) : 0.f;
    };
    const auto store_time_step = [&](int64_t chunk, float raw) {
      if (step_lane < 0) return;
      slot_tokens(chunk)[step_lane] = chunk * kQ + step_lane < len ? TimeStepOf<T>(p, raw, h) : 0.f;
    };
    stage(0);
    CopyAsyncCommit();
    if (kQ < len) stage(1);
    CopyAsyncCommit();
    store_time_step(0, load_dt(0));
    store_time_step(1, load_dt(1));
    prepare(0);
    NamedBarrierSync(kRsBlockBarrier, kRsThreads);
    for (int64_t chunk = 0; chunk * kQ < len; ++chunk) {
      const float raw = load_dt(chunk + 2);
      if ((chunk + 2) * kQ < len) stage(chunk + 2);
      CopyAsyncCommit();
      if ((chunk + 1) * kQ < len) {
        if constexpr (kRsDiagnostic == 1) {
          CopyAsyncWaitGroup<1>();
        } else {
          prepare(chunk + 1);
        }
      }
      store_time_step(chunk + 2, raw);
      NamedBarrierSync(kRsBlockBarrier, kRsThreads);
    }
    CopyAsyncWaitAll();
    return;
  }

  // --- state warps --- (the body once per side, so that a warp's own tiles are compile-time register indices)
  const auto state_warp = [&](auto side_constant) {
    constexpr int side = decltype(side_constant)::value;
    const int pi = warp >> 1;
    const int p0 = 16 * pi, n_base = kHalfN * side;
    float acc[kN8][4];  // Sᵀ[p0 + g (+ 8)][n_base + 8·k8 + 2t (+ 1)]
    // The head's state element (row, n) is row·row_stride + n·n_stride from its first, in either layout (int
    // offsets from one base: StateIndex's 64-bit products at each of the 64 loads made ptxas spill).
    const int64_t head0 = bh * kRsP * kN;
    const int row_stride = p.state_np ? 1 : kN, n_stride = p.state_np ? kRsP : 1;
#pragma unroll
    for (int k8 = 0; k8 < kN8; ++k8) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = p0 + g8 + 8 * (e >> 1), n = n_base + 8 * k8 + 2 * t4 + (e & 1);
        acc[k8][e] = p.initial_state != nullptr ? LoadFloatOrT<T>(p.initial_state, p.state_is_float,
                                                                  head0 + row * row_stride + n * n_stride)
                                                : 0.f;
      }
    }
    const float skip = p.d != nullptr ? LoadFloatOrT<T>(p.d, p.d_is_float, h) : 0.f;
    bool state_zero = p.initial_state == nullptr;
    float* const mine = exchange + warp * (4 * 4 * 32);
    const float* const partner = exchange + (warp ^ 1) * (4 * 4 * 32);
    NamedBarrierSync(kRsBlockBarrier, kRsThreads);  // the helpers' first chunk
    for (int64_t chunk = 0; chunk * kQ < len; ++chunk) {
      if constexpr (kRsDiagnostic == 2) {
        NamedBarrierSync(kRsBlockBarrier, kRsThreads);
        continue;
      }
      const int64_t t0 = chunk * kQ;
      const int q = static_cast<int>(len - t0 < kQ ? len - t0 : kQ);
      const T* const rx = slot_x(chunk);
      const T* const rb = slot_b(chunk);
      const T* const rc = slot_c(chunk);
      const float* const tok = slot_tokens(chunk);
      const float* const decay_in = tok + 2 * kQ;
      const float* const decay_out = tok + 3 * kQ;
      const float* const wc = ws + (chunk & 1) * kQ * kRsLdw;

      // 1. This half of exp(cs)·C·Sᵀ for the 8 token tiles; the partner's 4 tiles to shared memory, this warp's
      // (tiles 2k + ((k ^ side) & 1)) kept.
      float own[4][4];
      {
        float y[8][4] = {};
        if (!state_zero) {
          float up[2] = {1.f, 1.f};  // the float16 rows' scales back (1: the TF32 split is not scaled)
          if constexpr (kF16) {
            // Rows g and g + 8 of this half scaled into float16's range, split in two parts; Cᵀ's fragments are C's
            // rows as they are (ldmatrix: lane (g, t) gets C[l0 + g][n0 + 2t, + 1]).
            float down[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              float m = 0.f;
#pragma unroll
              for (int k8 = 0; k8 < kN8; ++k8) m = fmaxf(m, fmaxf(fabsf(acc[k8][2 * r]), fabsf(acc[k8][2 * r + 1])));
              RsRowScale(RowMax4(m), down[r], up[r]);
            }
#pragma unroll
            for (int kk = 0; kk < kN8 / 2; ++kk) {
              uint32_t hi[4], lo[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const float* const pair = acc[2 * kk + i / 2] + 2 * (i % 2);
                SplitHalf2(pair[0] * down[i % 2], pair[1] * down[i % 2], hi[i], lo[i]);
              }
#pragma unroll
              for (int jp = 0; jp < 4; ++jp) {
                uint32_t r[4];
                LoadMatrixX4(r, rc + (16 * jp + (lane & 7) + 8 * (lane >> 4)) * kLdn + n_base + 16 * kk +
                                    8 * ((lane >> 3) & 1));
                MmaHalf<T>(y[2 * jp], lo, r[0], r[1]);
                MmaHalf<T>(y[2 * jp], hi, r[0], r[1]);
                MmaHalf<T>(y[2 * jp + 1], lo, r[2], r[3]);
                MmaHalf<T>(y[2 * jp + 1], hi, r[2], r[3]);
              }
            }
          } else {
#pragma unroll
            for (int k8 = 0; k8 < kN8; ++k8) {
              Tf32Operand<4, true> s;
              s.Set(0, acc[k8][0]);
              s.Set(1, acc[k8][2]);
              s.Set(2, acc[k8][1]);
              s.Set(3, acc[k8][3]);
#pragma unroll
              for (int rows = 0; rows < 2; ++rows) {
                // C[l][n_base + 8·k8 + 2t, + 1] for the 4 token tiles from row 32·rows: B fragments of Cᵀ.
                uint32_t r[4];
                LoadMatrixX4(r, rc + (32 * rows + lane) * kLdn + n_base + 8 * k8);
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                  const float2 c = WidenPair<T>(r[jj]);
                  MmaTf32(y[4 * rows + jj], s.lo, __float_as_uint(c.x), __float_as_uint(c.y));
                  MmaTf32(y[4 * rows + jj], s.hi, __float_as_uint(c.x), __float_as_uint(c.y));
                }
              }
            }
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float2 in = *reinterpret_cast<const float2*>(decay_in + 8 * j + 2 * t4);
            y[j][0] = y[j][0] * up[0] * in.x;
            y[j][1] = y[j][1] * up[0] * in.y;
            y[j][2] = y[j][2] * up[1] * in.x;
            y[j][3] = y[j][3] * up[1] * in.y;
          }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const bool first_is_mine = RsOwner(2 * k) == side;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            own[k][e] = first_is_mine ? y[2 * k][e] : y[2 * k + 1][e];
            mine[(k * 4 + e) * 32 + lane] = first_is_mine ? y[2 * k + 1][e] : y[2 * k][e];
          }
        }
      }

      // 2. Over the chunk's 8 k-steps of 8 tokens: x's fragments (xᵀ as A, by ldmatrix.trans: lane (g, t) gets
      // x[s0 + 2t, + 1][p0 + g (+ 8)]), W·x on this warp's tiles at or after the step, and the state update from
      // u = x·d·exp(cs_end − cs) (A) and B (by ldmatrix.trans: B[s0 + 2t, + 1][n + g]).
      const float decay_chunk = decay_in[kQ - 1];
#pragma unroll
      for (int k8 = 0; k8 < kN8; ++k8) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[k8][e] *= decay_chunk;
      }
#pragma unroll
      for (int s16 = 0; s16 < kQ / 16; ++s16) {
        uint32_t xr[4];
        LoadMatrixX4Trans(xr, rx + (16 * s16 + (lane & 7) + 8 * (lane >> 4)) * kRsLdx + p0 + 8 * ((lane >> 3) & 1));
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          const int step = 2 * s16 + sub, s0 = 8 * step;
          const float2 top = WidenPair<T>(xr[2 * sub]), bottom = WidenPair<T>(xr[2 * sub + 1]);
          const float xa[4] = {top.x, bottom.x, top.y, bottom.y};  // p = g, g + 8 at s0 + 2t; the same at s0 + 2t + 1
          uint32_t xf[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) xf[e] = __float_as_uint(xa[e]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const int j = 2 * k + ((k ^ side) & 1);  // this warp's k-th tile
            if (j < step) continue;
            const float2 wp = *reinterpret_cast<const float2*>(wc + (8 * j + g8) * kRsLdw + s0 + 2 * t4);
            Tf32Operand<2, true> wf;
            wf.Set(0, wp.x);
            wf.Set(1, wp.y);
            MmaTf32(own[k], xf, wf.lo[0], wf.lo[1]);
            MmaTf32(own[k], xf, wf.hi[0], wf.hi[1]);
          }
          const float2 d2 = *reinterpret_cast<const float2*>(tok + s0 + 2 * t4);
          const float2 o2 = *reinterpret_cast<const float2*>(decay_out + s0 + 2 * t4);
          Tf32Operand<4, true> u;
          u.Set(0, __fmul_rn(xa[0], d2.x) * o2.x);
          u.Set(1, __fmul_rn(xa[1], d2.x) * o2.x);
          u.Set(2, __fmul_rn(xa[2], d2.y) * o2.y);
          u.Set(3, __fmul_rn(xa[3], d2.y) * o2.y);
#pragma unroll
          for (int n32 = 0; n32 < kN8 / 4; ++n32) {
            uint32_t br[4];
            LoadMatrixX4Trans(br, rb + (s0 + (lane & 7)) * kLdn + n_base + 32 * n32 + 8 * (lane >> 3));
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
              const float2 bp = WidenPair<T>(br[jj]);
              MmaTf32(acc[4 * n32 + jj], u.lo, __float_as_uint(bp.x), __float_as_uint(bp.y));
              MmaTf32(acc[4 * n32 + jj], u.hi, __float_as_uint(bp.x), __float_as_uint(bp.y));
            }
          }
        }
      }

      // 3. The partner's partial sums of this warp's tiles, then out = y + D·x.
      NamedBarrierSync(1 + pi, 64);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int j = 2 * k + ((k ^ side) & 1);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int l = 8 * j + 2 * t4 + (e & 1), row = p0 + g8 + 8 * (e >> 1);
          float v = own[k][e] + partner[(k * 4 + e) * 32 + lane];
          if (p.d != nullptr) v = __fadd_rn(v, __fmul_rn(skip, Widen(rx[l * kRsLdx + row])));
          if (l < q) p.out[((b * len + t0 + l) * p.heads + h) * kRsP + row] = v;
        }
      }
      state_zero = false;
      NamedBarrierSync(kRsBlockBarrier, kRsThreads);  // the next chunk is prepared; this one's buffers are free
    }
#pragma unroll
    for (int k8 = 0; k8 < kN8; ++k8) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = p0 + g8 + 8 * r, n = n_base + 8 * k8 + 2 * t4;
        if (p.state_np) {
          p.final_state[head0 + n * kRsP + row] = acc[k8][2 * r];
          p.final_state[head0 + (n + 1) * kRsP + row] = acc[k8][2 * r + 1];
        } else {
          *reinterpret_cast<float2*>(p.final_state + head0 + row * kN + n) =
              make_float2(acc[k8][2 * r], acc[k8][2 * r + 1]);
        }
      }
    }
  };
  if (warp & 1) {
    state_warp(std::integral_constant<int, 1>{});
  } else {
    state_warp(std::integral_constant<int, 0>{});
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
    s[n] = p.initial_state != nullptr ? LoadFloatOrT<T>(p.initial_state, p.state_is_float, StateIndex(p, bh, row, n))
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
  for (int n = lane; n < N; n += 32) p.final_state[StateIndex(p, bh, row, n)] = s[n];
}

// --- one-token kernels -----------------------------------------------------------------------------------------

// A one-token prompt (a decode step through this op, as a mobius build's cache runs it): the state once through,
// S = exp(a)·S + u ⊗ B and y = S·C + D·x, with no chunk around it (the chunked kernels would pad the token to a
// whole chunk). The step reads and writes the state once, 8·P·N bytes a head against ~4·P·N flops, so it is laid
// out for the state's traffic in each layout: [P, N] a warp per row with the lanes along N, the row's sum a
// shuffle reduction; [N, P] a thread per column vector along P and a slice of N, the slices' sums added in shared
// memory in a fixed order. Both take any P and N (4-element vectors where the contiguous dimension and the
// pointers allow), both give the same bits run after run, and each thread has kStepInFlight state vectors loaded
// before it computes with them (the loads in flight together are what a memory-bound step's speed is).
constexpr int kStepWarps = 4;
constexpr int kStepThreads = kStepWarps * 32;
constexpr int kStepInFlight = 8;
constexpr int kStepColumns = 8;  // [N, P]: the column vectors a block takes; its other threads are slices of N
constexpr int kStepSlices = kStepThreads / kStepColumns;

// kVec consecutive elements of the initial state from element i (zeros without one).
template <typename T, int kVec>
__device__ __forceinline__ void LoadStateVec(const Params& p, int64_t i, float (&v)[kVec]) {
  if (p.initial_state == nullptr) {
    for (int k = 0; k < kVec; ++k) v[k] = 0.f;
    return;
  }
  if constexpr (kVec == 4) {
    if (p.state_is_float) {
      const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(p.initial_state) + i);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
      return;
    }
    if constexpr (!std::is_same_v<T, float>) {  // four 16-bit elements: one 8-byte load
      const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const T*>(p.initial_state) + i);
      T e[4];
      std::memcpy(e, &q, sizeof(q));
      for (int k = 0; k < 4; ++k) v[k] = Widen(e[k]);
      return;
    }
  }
  if constexpr (kVec != 4 || std::is_same_v<T, float>) {
    for (int k = 0; k < kVec; ++k) v[k] = LoadFloatOrT<T>(p.initial_state, p.state_is_float, i + k);
  }
}

template <int kVec>
__device__ __forceinline__ void StoreStateVec(const Params& p, int64_t i, const float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    *reinterpret_cast<float4*>(p.final_state + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int k = 0; k < kVec; ++k) p.final_state[i + k] = v[k];
  }
}

// What one token of head bh needs besides the state: its batch row and group, its time step d and decay exp(a).
struct StepHead {
  int64_t b;
  int g;
  float d, decay, skip;
};

template <typename T>
__device__ __forceinline__ StepHead StepHeadOf(const Params& p, int64_t bh) {
  StepHead head;
  head.b = bh / p.heads;
  const int h = static_cast<int>(bh % p.heads);
  head.g = h / (p.heads / p.groups);
  head.d = TimeStep<T>(p, head.b, h);  // one token: token row b
  head.decay = expf(__fmul_rn(p.a[h], head.d));
  head.skip = p.d != nullptr ? LoadFloatOrT<T>(p.d, p.d_is_float, h) : 0.f;
  return head;
}

// [P, N]: a block of kStepWarps warps, each warp kStepInFlight rows of head blockIdx.x from row
// (blockIdx.y·kStepWarps + warp)·kStepInFlight; the lanes walk N in vectors of kVec (B and C loaded once for the
// warp's rows).
template <typename T, int kVec>
__global__ void __launch_bounds__(kStepThreads) StepScanPN(Params p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = blockIdx.x;
  const int P = p.head_dim, N = p.state_size;
  const int row0 = (static_cast<int>(blockIdx.y) * kStepWarps + warp) * kStepInFlight;
  if (row0 >= P) return;  // a whole warp; no barrier below
  const int rows = P - row0 < kStepInFlight ? P - row0 : kStepInFlight;  // the same in every lane
  // The first vectors' loads go out before the head's time step (a double-precision softplus) is computed.
  float s[kStepInFlight][kVec];
  const auto load_rows = [&](int n) {
    for (int r = 0; r < kStepInFlight; ++r) {
      if (r < rows) LoadStateVec<T, kVec>(p, (bh * P + row0 + r) * N + n, s[r]);
    }
  };
  if (lane * kVec < N) load_rows(lane * kVec);
  const StepHead head = StepHeadOf<T>(p, bh);
  float x[kStepInFlight], u[kStepInFlight], acc[kStepInFlight];
  for (int r = 0; r < kStepInFlight; ++r) {
    x[r] = r < rows ? Load<T>(p.x, bh * P + row0 + r) : 0.f;
    u[r] = __fmul_rn(x[r], head.d);
    acc[r] = 0.f;
  }
  const int64_t bc = (head.b * p.groups + head.g) * N;
  for (int n = lane * kVec; n < N; n += 32 * kVec) {
    float bv[kVec], cv[kVec];
    for (int k = 0; k < kVec; ++k) {
      bv[k] = Load<T>(p.b, bc + n + k);
      cv[k] = Load<T>(p.c, bc + n + k);
    }
    if (n != lane * kVec) load_rows(n);
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < kVec; ++k) {
        s[r][k] = __fadd_rn(__fmul_rn(head.decay, s[r][k]), __fmul_rn(u[r], bv[k]));
        acc[r] = fmaf(cv[k], s[r][k], acc[r]);
      }
      StoreStateVec<kVec>(p, (bh * P + row0 + r) * N + n, s[r]);
    }
  }
  for (int r = 0; r < rows; ++r) {
    float sum = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
    if (lane == 0) p.out[bh * P + row0 + r] = p.d != nullptr ? __fadd_rn(sum, __fmul_rn(head.skip, x[r])) : sum;
  }
}

// [N, P]: a block of kStepThreads threads takes kStepColumns column vectors (kVec columns each) of head blockIdx.x
// from column vector blockIdx.y·kStepColumns; thread t is column vector t % kStepColumns over the rows n of slice
// t / kStepColumns (n ≡ slice mod kStepSlices), kStepInFlight rows at a time. The slices' column sums meet in
// shared memory and are added in slice order.
template <typename T, int kVec>
__global__ void __launch_bounds__(kStepThreads) StepScanNP(Params p) {
  __shared__ float sums[kStepSlices][kStepColumns][kVec];
  const int column = threadIdx.x % kStepColumns, slice = threadIdx.x / kStepColumns;
  const int64_t bh = blockIdx.x;
  const int P = p.head_dim, N = p.state_size;
  const int p0 = (static_cast<int>(blockIdx.y) * kStepColumns + column) * kVec;
  const bool active = p0 < P;  // kVec divides P where it is 4
  // The first rows' loads go out before the head's time step (a double-precision softplus) is computed.
  float s[kStepInFlight][kVec];
  const auto load_rows = [&](int n0) {
    for (int j = 0; j < kStepInFlight; ++j) {
      const int n = n0 + j * kStepSlices;
      if (n < N) LoadStateVec<T, kVec>(p, (bh * N + n) * P + p0, s[j]);
    }
  };
  if (active) load_rows(slice);
  const StepHead head = StepHeadOf<T>(p, bh);
  float x[kVec], u[kVec], acc[kVec] = {};
  for (int k = 0; k < kVec; ++k) {
    x[k] = active ? Load<T>(p.x, bh * P + p0 + k) : 0.f;
    u[k] = __fmul_rn(x[k], head.d);
  }
  const int64_t bc = (head.b * p.groups + head.g) * N;
  if (active) {
    for (int n0 = slice; n0 < N; n0 += kStepInFlight * kStepSlices) {
      if (n0 != slice) load_rows(n0);
      for (int j = 0; j < kStepInFlight; ++j) {
        const int n = n0 + j * kStepSlices;
        if (n >= N) break;
        const float bn = Load<T>(p.b, bc + n), cn = Load<T>(p.c, bc + n);
        for (int k = 0; k < kVec; ++k) {
          s[j][k] = __fadd_rn(__fmul_rn(head.decay, s[j][k]), __fmul_rn(u[k], bn));
          acc[k] = fmaf(cn, s[j][k], acc[k]);
        }
        StoreStateVec<kVec>(p, (bh * N + n) * P + p0, s[j]);
      }
    }
  }
  for (int k = 0; k < kVec; ++k) sums[slice][column][k] = acc[k];
  __syncthreads();
  if (slice == 0 && active) {
    for (int k = 0; k < kVec; ++k) {
      float sum = 0.f;
      for (int j = 0; j < kStepSlices; ++j) sum += sums[j][column][k];
      p.out[bh * P + p0 + k] = p.d != nullptr ? __fadd_rn(sum, __fmul_rn(head.skip, x[k])) : sum;
    }
  }
}

// --- host -------------------------------------------------------------------------------------------------------

int64_t RoundUp16(int64_t v) { return (v + 15) / 16 * 16; }

// How the chunked kernel runs for these arguments: with the staged (asynchronous, 16-byte) loads where P and N
// are whole 16-byte vectors, x, B and C are 16-byte aligned and the staging buffer fits; its shared memory.
struct ChunkedPlan {
  bool staged = false;
  size_t bytes = 0;
  size_t half_bytes = 0;  // the half path's shared memory where it runs (float16 or bfloat16, staged, P = 64 and
                          // N = 128 or 64), else 0
  size_t register_bytes = 0;  // RegisterStateScan's where the half path runs and it fits, else 0
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
  // The output tiles a block carries in registers between its phases: P up to 128.
  if ((kQ / 16) * (p16 / 16) > kMaxOutputTiles) return false;
  const int64_t staged = ChunkedSharedBytesFor(p16, n16, elem, true);
  const int64_t plain = ChunkedSharedBytesFor(p16, n16, elem, false);
  if (vectors && staged <= limit) {
    plan = {true, static_cast<size_t>(staged)};
  } else if (plain <= limit) {
    plan = {false, static_cast<size_t>(plain)};
  } else {
    return false;
  }
  const int64_t half = ChunkedSharedBytesFor(p16, n16, elem, true, true);
  if (plan.staged && args.type != ElemType::kFloat && args.head_dim == 64 &&
      (args.state_size == 128 || args.state_size == 64) && half <= limit) {
    plan.half_bytes = static_cast<size_t>(half);
    const int64_t registers = RegisterStateSharedBytes(args.state_size);
    if (registers <= limit) plan.register_bytes = static_cast<size_t>(registers);
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

// The one-token kernel's vector width: 4 where the state's contiguous dimension (N in [P, N], P in [N, P]) is a
// multiple of 4 and both states are 16-byte aligned, else 1.
int StepVecWidth(const MambaChunkScanCpuArgs& args) {
  const int64_t contiguous = args.state_np ? args.head_dim : args.state_size;
  const bool aligned = Aligned16(args.final_state) && (args.initial_state == nullptr || Aligned16(args.initial_state));
  return contiguous % 4 == 0 && aligned ? 4 : 1;
}

// The one-token kernel's grid: (B·H, the blocks along P).
dim3 StepGrid(const MambaChunkScanCpuArgs& args) {
  const int64_t per_block = args.state_np ? static_cast<int64_t>(kStepColumns) * StepVecWidth(args)
                                          : static_cast<int64_t>(kStepWarps) * kStepInFlight;
  return dim3(static_cast<unsigned>(args.batch * args.heads),
              static_cast<unsigned>((args.head_dim + per_block - 1) / per_block));
}

// Whether the one-token kernels run: a one-token prompt, asked for or by default (kAuto), and P within the
// grid's second dimension.
bool StepRuns(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath requested) {
  return args.length == 1 && (requested == ChunkScanCudaPath::kAuto || requested == ChunkScanCudaPath::kStep) &&
         StepGrid(args).y <= 65535;
}

template <typename T>
cudaError_t LaunchStep(const Params& params, const MambaChunkScanCpuArgs& args, cudaStream_t stream) {
  const bool vec = StepVecWidth(args) == 4;
  void (*kernel)(Params) = args.state_np ? (vec ? &StepScanNP<T, 4> : &StepScanNP<T, 1>)
                                         : (vec ? &StepScanPN<T, 4> : &StepScanPN<T, 1>);
  kernel<<<StepGrid(args), kStepThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

// Launches the one-token kernel where `step`, else the chunked kernel with `chunked`'s plan, or the sequential one
// where it is null.
template <typename T>
cudaError_t LaunchTyped(const Params& params, const MambaChunkScanCpuArgs& args, bool step,
                        const ChunkedPlan* chunked, cudaStream_t stream) {
  if (step) return LaunchStep<T>(params, args, stream);
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
    // 16 warps by default, on the half path where the plan has it (the models' widths in float16 and bfloat16);
    // MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS=8 runs 8 warps and MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS=any the kernel for any
    // widths (a benchmark's or a test's comparison).
    // Where the half path runs, RegisterStateScan (the state in registers) unless
    // MAMBAFUSE_CHUNK_SCAN_CUDA_STATE=shared asks for the half path's kernel with the state in shared memory.
    const char* warps = std::getenv("MAMBAFUSE_CHUNK_SCAN_CUDA_WARPS");
    const char* widths = std::getenv("MAMBAFUSE_CHUNK_SCAN_CUDA_WIDTHS");
    const char* state = std::getenv("MAMBAFUSE_CHUNK_SCAN_CUDA_STATE");
    const bool eight = warps != nullptr && std::strcmp(warps, "8") == 0;
    const bool any = eight || (widths != nullptr && std::strcmp(widths, "any") == 0);
    const bool registers = state == nullptr || std::strcmp(state, "shared") != 0;
    void (*kernel)(Params) = eight ? &ChunkedScan<T, 8, 0, 0> : &ChunkedScan<T, 16, 0, 0>;
    size_t bytes = plan.bytes;
    unsigned threads = (eight ? 8 : 16) * 32;
    if constexpr (!std::is_same_v<T, float>) {
      if (!any && plan.half_bytes != 0) {
        kernel = args.state_size == 128 ? &ChunkedScan<T, 16, 64, 128> : &ChunkedScan<T, 16, 64, 64>;
        bytes = plan.half_bytes;
        if (registers && plan.register_bytes != 0) {
          kernel = args.state_size == 128 ? &RegisterStateScan<T, 128> : &RegisterStateScan<T, 64>;
          bytes = plan.register_bytes;
          threads = kRsThreads;
        }
      }
    }
    if (const cudaError_t error = opt_in(reinterpret_cast<const void*>(kernel), bytes); error != cudaSuccess) {
      return error;
    }
    kernel<<<dim3(static_cast<unsigned>(blocks)), threads, bytes, stream>>>(params);
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
  if (StepRuns(args, requested)) return ChunkScanCudaPath::kStep;
  if (requested == ChunkScanCudaPath::kStep) requested = ChunkScanCudaPath::kAuto;
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
  params.dt_is_float = args.dt_type == ElemType::kFloat;
  params.d_is_float = args.d_type == ElemType::kFloat;
  params.state_is_float = args.state_type == ElemType::kFloat;
  params.softplus = args.dt_softplus;
  params.state_np = args.state_np;
  params.dt_min = args.dt_min;
  params.dt_max = args.dt_max;
  params.p16 = static_cast<int>(RoundUp16(args.head_dim));
  params.n16 = static_cast<int>(RoundUp16(args.state_size));
  const bool step = StepRuns(args, path);
  if (path == ChunkScanCudaPath::kStep) path = ChunkScanCudaPath::kAuto;  // more than one token
  ChunkedPlan plan;
  const ChunkedPlan* chunked = !step && ChunkedPlanFor(args, path, plan) ? &plan : nullptr;
  params.staged = chunked != nullptr && plan.staged;
  switch (args.type) {
    case ElemType::kFloat16:
      return LaunchTyped<__half>(params, args, step, chunked, stream);
    case ElemType::kBFloat16:
      return LaunchTyped<__nv_bfloat16>(params, args, step, chunked, stream);
    default:
      return LaunchTyped<float>(params, args, step, chunked, stream);
  }
}

}  // namespace mambafuse
