// DecodeMatMulNBits' int4 GEMVs and the M > 8 path's dequantization on CUDA (the math is in decode_matmul_launcher.h
// and docs/decode_matmul.md, Kernels). At M <= 8 rows the product is bound by streaming the weight once, so each
// kernel is built around wide weight loads, enough of them in flight to fill HBM, and one pass over the weight. The
// PTX the kernels use (tensor-core products, mbarriers, bulk copies) is in gemv_ptx.cuh, which the host emulation
// (tools/emulate_gemv.sh) replaces.
//
// int4 (B: N rows of packed nibbles along K): both kernels work on groups of 16 output columns n, 128 k per warp
// step, each thread taking 16 bytes (one 32-element block at block_size 32) of rows g and g + 8.
// - Bulk copies (SM 90, the default where every tile's rows are whole 16-byte pieces): one block a multiprocessor,
//   two lanes of 9 warps in it, each lane walking every other group of the block's share tile by tile (16 rows by
//   4096 k and their scales), its producer warp asking the copy engine for each tile as soon as its stage is free
//   (an mbarrier per stage counts the bytes in, another the compute warps done with it); the compute warps' loops
//   are shared-memory reads and arithmetic only.
// - Register loads (other GPUs and layouts; MAMBAFUSE_NBITS_KERNEL=mma): 8, 4, 2 or 1 warps split a group's K, each
//   issuing 4 steps' weight, scale and zero-point loads before it computes.
// At M <= 8 the int4 GEMV's warps mostly wait on their weights' arrival (benchmarks/RESULTS.md), and the per-step
// arithmetic is kept lean so that what they do between waits is short.
// Nibbles become T through the exponent trick (0x6400 | q is 1024 + q in float16, 0x4300 | q is 128 + q in
// bfloat16; float16's odd nibbles stay 4 bits up, 1024 + 16 q, taken down by one FMA), minus the zero point's
// (exact), times the scale (W rounded to T once); the products run on the tensor cores (mma.m16n8k16, float32
// accumulation) with the weight as the 16 x 16 operand and A's M <= 8 rows as the 16 x 8 one. The order of k inside
// a step is free (it is a sum), so each thread's 4 k slots of a step are 4 of its own 32 consecutive nibbles, and
// A's values are permuted in registers to match. A group's warps' sums meet in shared memory in warp order. float32
// A takes a scalar kernel (a warp per column, FMAs in float32).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "decode_matmul_common.cuh"
#include "decode_matmul_launcher.h"
#include "elem_convert.cuh"
#include "gemv_ptx.cuh"

namespace mambafuse {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// int4 GEMV, float16 / bfloat16: tensor cores
// ---------------------------------------------------------------------------------------------------------------

constexpr int kNBitsWarps = 8;
constexpr int kNBitsThreads = kNBitsWarps * 32;
constexpr int kNBitsRows = 16;     // output columns n of a block (the mma's M dimension)
constexpr int kStepK = 128;        // k of one warp step: 4 threads x 32 nibbles
#ifndef MAMBAFUSE_NBITS_UNROLL
#define MAMBAFUSE_NBITS_UNROLL 4
#endif
#ifndef MAMBAFUSE_NBITS_MIN_BLOCKS
#define MAMBAFUSE_NBITS_MIN_BLOCKS 1
#endif
constexpr int kNBitsUnroll = MAMBAFUSE_NBITS_UNROLL;  // warp steps whose loads are in flight together

struct NBitsParams {
  const void* a;
  const uint8_t* b;
  const void* scales;
  const uint8_t* zero_points;
  void* y;
  int m, k, n;
  int block_shift;  // log2(block_size)
  int blocks;       // per row of B
  int row_bytes;    // blocks * block_size / 2
  int zp_row_bytes;
  int group_warps;  // warps that split K for one group of 16 rows (8, 4, 2 or 1); a block holds 8 / group_warps groups
  int contiguous;   // 1: each warp of a group takes one contiguous range of steps; 0: steps kslot, kslot + warps, ...
  int prefetch;     // contiguous only: the steps ahead of its loads that a warp asks L2 to fetch (0: none)
};

template <typename T>
struct HalfTraits;
template <>
struct HalfTraits<__half> {
  using Pair = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024 + q
  static constexpr float kBias = 1024.f;
};
template <>
struct HalfTraits<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // 128 + q
  static constexpr float kBias = 128.f;
};

template <typename P>
__device__ __forceinline__ uint32_t AsBits(P p) {
  return *reinterpret_cast<uint32_t*>(&p);
}
template <typename P>
__device__ __forceinline__ P FromBits(uint32_t u) {
  return *reinterpret_cast<P*>(&u);
}

// 32 nibbles (16 bytes) of one weight row: the 16 bytes, zeros past the row's end.
template <bool kVec16>
__device__ __forceinline__ uint4 LoadPiece(const uint8_t* row, int byte_offset, int row_bytes) {
  uint4 bits = make_uint4(0, 0, 0, 0);
  if constexpr (kVec16) {
    if (byte_offset < row_bytes) bits = __ldg(reinterpret_cast<const uint4*>(row + byte_offset));
  } else {  // rows 8-byte aligned only (block_size 16, an odd number of blocks)
    if (byte_offset < row_bytes) {
      const uint2 lo = __ldg(reinterpret_cast<const uint2*>(row + byte_offset));
      bits.x = lo.x, bits.y = lo.y;
    }
    if (byte_offset + 8 < row_bytes) {
      const uint2 hi = __ldg(reinterpret_cast<const uint2*>(row + byte_offset + 8));
      bits.z = hi.x, bits.w = hi.y;
    }
  }
  return bits;
}

// A[m, k0 .. k0 + 7] of T as 4 words, zeros at and past K (m < M checked by the caller).
template <typename T, bool kAVec>
__device__ __forceinline__ uint4 LoadA8(const T* a_row, int k0, int k) {
  if constexpr (kAVec) {
    if (k0 + 8 <= k) return __ldg(reinterpret_cast<const uint4*>(a_row + k0));
  }
  union {
    uint4 u;
    T t[8];
  } out;
  out.u = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (k0 + i < k) out.t[i] = a_row[k0 + i];
  }
  return out.u;
}

// The zero point of row `row`, block `blk` (two a byte, the even block's in the low nibble).
__device__ __forceinline__ int ZeroPoint(const NBitsParams& p, int row, int blk) {
  const uint8_t byte = __ldg(p.zero_points + static_cast<int64_t>(row) * p.zp_row_bytes + (blk >> 1));
  return (blk & 1) ? (byte >> 4) : (byte & 0x0F);
}

// 1024 + zp (float16) or 128 + zp (bfloat16) as a pair: what the exponent trick's biased nibbles are less.
template <typename T>
__device__ __forceinline__ typename HalfTraits<T>::Pair BiasedZero(int zp) {
  const T z = Narrow<T>(HalfTraits<T>::kBias + static_cast<float>(zp));
  return typename HalfTraits<T>::Pair(z, z);
}

// The scale (as a pair) and the zero point's 1024 + zp / 128 + zp (as a pair) of row `row`, block `blk`; a zero
// scale for a row or block out of range, so its (unloaded, zero) nibbles give zero weights.
template <typename T, bool kHasZp>
__device__ __forceinline__ void BlockConstants(const NBitsParams& p, int row, int blk,
                                               typename HalfTraits<T>::Pair& scale,
                                               typename HalfTraits<T>::Pair& zero) {
  using Pair = typename HalfTraits<T>::Pair;
  T s = Narrow<T>(0.f);
  int zp = 8;
  if (row < p.n && blk < p.blocks) {
    s = static_cast<const T*>(p.scales)[static_cast<int64_t>(row) * p.blocks + blk];
    if constexpr (kHasZp) zp = ZeroPoint(p, row, blk);
  }
  scale = Pair(s, s);
  zero = BiasedZero<T>(zp);
}

// The four pairs (k0, k4), (k1, k5), (k2, k6), (k3, k7) of one word's nibbles as W = (q - zp) * s rounded to T.
// float16 leaves the odd nibbles 4 bits up, 1024 + 16 q, and takes q - zp from one FMA by 1/16 minus 64 + zp; every
// step before the scale's product is exact, so W is the same as from (q - zp) * s.
template <typename T>
__device__ __forceinline__ void DequantWord(uint32_t word, typename HalfTraits<T>::Pair scale,
                                            typename HalfTraits<T>::Pair zero, uint32_t (&out)[4]) {
  using Pair = typename HalfTraits<T>::Pair;
  constexpr uint32_t kMagic = HalfTraits<T>::kMagic;
  if constexpr (std::is_same_v<T, __half>) {
    const Pair zero16 = __hsub2(zero, __float2half2_rn(960.f));  // 64 + zp
    const Pair sixteenth = __float2half2_rn(0.0625f);
    const uint32_t high = word >> 8;
    out[0] = AsBits(__hmul2(__hsub2(FromBits<Pair>(MaskOr(word, 0x000F000Fu, kMagic)), zero), scale));
    out[1] = AsBits(__hmul2(__hfma2(FromBits<Pair>(MaskOr(word, 0x00F000F0u, kMagic)), sixteenth, __hneg2(zero16)), scale));
    out[2] = AsBits(__hmul2(__hsub2(FromBits<Pair>(MaskOr(high, 0x000F000Fu, kMagic)), zero), scale));
    out[3] = AsBits(__hmul2(__hfma2(FromBits<Pair>(MaskOr(high, 0x00F000F0u, kMagic)), sixteenth, __hneg2(zero16)), scale));
  } else {  // bfloat16's 7 mantissa bits leave no room for 16 q: one shift a pair
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out[j] = AsBits(__hmul2(__hsub2(FromBits<Pair>(MaskOr(word >> (4 * j), 0x000F000Fu, kMagic)), zero), scale));
    }
  }
}

// Y's values of group `group` (rows group * 16 + g and + 8, tokens 2t and 2t + 1) from `warps` warps' sums, added in
// warp order.
template <typename T>
__device__ __forceinline__ void StoreGroupSums(const NBitsParams& p, const float (*sums)[32][4], int warps,
                                               int group) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  for (int w = 0; w < warps; ++w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] += sums[w][lane][i];
  }
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * t + (i & 1);
    const int row = group * kNBitsRows + g + (i < 2 ? 0 : 8);
    if (m < p.m && row < p.n) y[static_cast<int64_t>(m) * p.n + row] = Narrow<T>(s[i]);
  }
}

template <typename T, bool kHasZp, bool kVec16, bool kAVec>
__global__ void __launch_bounds__(kNBitsThreads, MAMBAFUSE_NBITS_MIN_BLOCKS) Int4GemvMmaKernel(NBitsParams p) {
  __shared__ float warp_sums[kNBitsWarps][32][4];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int g = lane / 4, t = lane % 4;
  const int group = warp / p.group_warps, kslot = warp % p.group_warps;
  const int n0 = (static_cast<int>(blockIdx.x) * (kNBitsWarps / p.group_warps) + group) * kNBitsRows;
  const int row_lo = n0 + g, row_hi = n0 + g + 8;
  const uint8_t* b_lo = p.b + static_cast<int64_t>(min(row_lo, p.n - 1)) * p.row_bytes;
  const uint8_t* b_hi = p.b + static_cast<int64_t>(min(row_hi, p.n - 1)) * p.row_bytes;
  const bool lo_in = row_lo < p.n, hi_in = row_hi < p.n;
  const T* a_row = static_cast<const T*>(p.a) + static_cast<int64_t>(g) * p.k;  // this thread's row of A: m = g
  const bool a_in = g < p.m;
  const int k_pad = p.blocks << p.block_shift;
  const int steps = (k_pad + kStepK - 1) / kStepK;

  using Pair = typename HalfTraits<T>::Pair;
  const bool two_blocks = p.block_shift == 4;  // block_size 16: a piece's words 0-1 and 2-3 are two blocks
  // The warp's steps: begin, begin + stride, ... below end (a contiguous range, or every group_warps-th step).
  const int per_warp = (steps + p.group_warps - 1) / p.group_warps;
  const int begin = p.contiguous ? kslot * per_warp : kslot;
  const int end = p.contiguous ? min(steps, begin + per_warp) : steps;
  const int stride = p.contiguous ? 1 : p.group_warps;
  // L2 prefetch (contiguous ranges): two lanes a row, each every other 128-byte line of the warp's next steps, and
  // the lines of that row's scales (and zero points) where those steps' blocks start.
  const bool prefetch = p.contiguous && p.prefetch > 0 && (t < 2 ? lo_in : hi_in);
  const uint8_t* prefetch_row = t < 2 ? b_lo : b_hi;
  const int prefetch_n = t < 2 ? row_lo : row_hi;
  const int end_byte = min(end * (kStepK / 2), p.row_bytes);
  auto prefetch_steps = [&](int from, int count) {  // the lines of steps [from, from + count)
    const int first_byte = from * (kStepK / 2), last_byte = min(end_byte, (from + count) * (kStepK / 2));
    for (int byte = (first_byte & ~127) + 128 * (t & 1); byte < last_byte; byte += 256) PrefetchL2(prefetch_row + byte);
    if (first_byte < last_byte) {
      const int blk = (first_byte * 2) >> p.block_shift;
      if ((t & 1) == 0) {
        PrefetchL2(static_cast<const T*>(p.scales) + static_cast<int64_t>(prefetch_n) * p.blocks + blk);
      } else if (kHasZp) {
        PrefetchL2(p.zero_points + static_cast<int64_t>(prefetch_n) * p.zp_row_bytes + (blk >> 1));
      }
    }
  };
  if (prefetch) prefetch_steps(begin, p.prefetch);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  // One batch: the weights' 16-byte pieces of kNBitsUnroll steps and their blocks' scales and zero points.
  struct Batch {
    uint4 w_lo[kNBitsUnroll], w_hi[kNBitsUnroll];
    Pair s_lo[kNBitsUnroll][2], z_lo[kNBitsUnroll][2], s_hi[kNBitsUnroll][2], z_hi[kNBitsUnroll][2];
  };
  const auto load_batch = [&](int first, Batch& batch) {
#pragma unroll
    for (int u = 0; u < kNBitsUnroll; ++u) {
      const int step = first + stride * u;
      const int kk = step * kStepK + 32 * t;  // this thread's 32 k
      const int byte_offset = kk / 2;
      const bool step_in = step < end;
      batch.w_lo[u] = step_in && lo_in ? LoadPiece<kVec16>(b_lo, byte_offset, p.row_bytes) : make_uint4(0, 0, 0, 0);
      batch.w_hi[u] = step_in && hi_in ? LoadPiece<kVec16>(b_hi, byte_offset, p.row_bytes) : make_uint4(0, 0, 0, 0);
      const int blk0 = step_in ? kk >> p.block_shift : p.blocks;  // out of range: a zero scale
      BlockConstants<T, kHasZp>(p, row_lo, blk0, batch.s_lo[u][0], batch.z_lo[u][0]);
      BlockConstants<T, kHasZp>(p, row_hi, blk0, batch.s_hi[u][0], batch.z_hi[u][0]);
      if (two_blocks) {
        BlockConstants<T, kHasZp>(p, row_lo, blk0 + 1, batch.s_lo[u][1], batch.z_lo[u][1]);
        BlockConstants<T, kHasZp>(p, row_hi, blk0 + 1, batch.s_hi[u][1], batch.z_hi[u][1]);
      } else {
        batch.s_lo[u][1] = batch.s_lo[u][0], batch.z_lo[u][1] = batch.z_lo[u][0];
        batch.s_hi[u][1] = batch.s_hi[u][0], batch.z_hi[u][1] = batch.z_hi[u][0];
      }
    }
  };
  const auto compute_batch = [&](int first, const Batch& batch) {
#pragma unroll
    for (int u = 0; u < kNBitsUnroll; ++u) {
      const int step = first + stride * u;
      if (step >= end) break;
      const int kk = step * kStepK + 32 * t;
      const uint32_t lo_words[4] = {batch.w_lo[u].x, batch.w_lo[u].y, batch.w_lo[u].z, batch.w_lo[u].w};
      const uint32_t hi_words[4] = {batch.w_hi[u].x, batch.w_hi[u].y, batch.w_hi[u].z, batch.w_hi[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // A's 8 values h0..h7 of this word (L1 / L2: A is small and every block reads it), in the nibble pairs'
        // order: (h0, h4), (h1, h5), then (h2, h6), (h3, h7).
        const uint4 av = a_in ? LoadA8<T, kAVec>(a_row, kk + 8 * i, p.k) : make_uint4(0, 0, 0, 0);
        uint32_t wl[4], wh[4];
        DequantWord<T>(lo_words[i], batch.s_lo[u][i / 2], batch.z_lo[u][i / 2], wl);
        DequantWord<T>(hi_words[i], batch.s_hi[u][i / 2], batch.z_hi[u][i / 2], wh);
        const uint32_t b04 = __byte_perm(av.x, av.z, 0x5410), b15 = __byte_perm(av.x, av.z, 0x7632);
        const uint32_t b26 = __byte_perm(av.y, av.w, 0x5410), b37 = __byte_perm(av.y, av.w, 0x7632);
        // The A operand's rows g, g + 8, k slots (2t, 2t + 1) and (2t + 8, 2t + 9).
        const uint32_t first_half[4] = {wl[0], wh[0], wl[1], wh[1]};
        Mma16816<T>(d, first_half, b04, b15);
        const uint32_t second_half[4] = {wl[2], wh[2], wl[3], wh[3]};
        Mma16816<T>(d, second_half, b26, b37);
      }
    }
  };
  Batch current;
  if (begin < end) {
    if (prefetch) prefetch_steps(begin + p.prefetch, kNBitsUnroll);
    load_batch(begin, current);
  }
  for (int first = begin; first < end; first += stride * kNBitsUnroll) {
    const int next = first + stride * kNBitsUnroll;
    compute_batch(first, current);
    if (next < end) {
      if (prefetch) prefetch_steps(next + p.prefetch, kNBitsUnroll);
      load_batch(next, current);
    }
  }

#pragma unroll
  for (int j = 0; j < 4; ++j) warp_sums[warp][lane][j] = d[j];
  __syncthreads();
  if (kslot == 0) StoreGroupSums<T>(p, &warp_sums[warp], p.group_warps, n0 / kNBitsRows);  // the group's warps in order
}

// ---------------------------------------------------------------------------------------------------------------
// int4 GEMV, Hopper: bulk copies into a ring of shared-memory stages
// ---------------------------------------------------------------------------------------------------------------
//
// A block owns a contiguous range of groups of 16 output columns, and each of its kBulkLanes lanes every kBulkLanes-th
// group of it, whose tiles (16 rows of B times kBulkChunkK k, with the rows' scales) the lane walks in order. The block
// takes a whole multiprocessor, so no multiprocessor holds more than one group over another's share (with two one-lane
// blocks a multiprocessor, the hardware's placement of blocks decided that). A lane's producer warp asks the copy
// engine for each tile with one bulk copy per row of weights and one per row of scales into a ring of kBulkStages
// stages: a stage's "full" mbarrier counts its bytes in, and its "empty" mbarrier the 8 compute warps done reading it,
// which is all the producer waits for before asking for the next tile there (no block barrier a tile). The bytes in
// flight cost no registers, so a compute warp's loop is shared-memory reads, the dequantisation and the mma only (the
// same products as Int4GemvMmaKernel's). Where a group's last tile is done its 8 warps' sums meet in shared memory in
// warp order (two slots, one barrier of the lane's compute warps a group). The lanes share nothing but the block. Needs
// SM 90, 16-byte aligned B and scales, and a multiple of 8 blocks a row (every tile a whole number of 128-k steps,
// every copy a multiple of 16 bytes).

#ifndef MAMBAFUSE_NBITS_BULK_CHUNK
#define MAMBAFUSE_NBITS_BULK_CHUNK 4096
#endif
#ifndef MAMBAFUSE_NBITS_BULK_STAGES
#define MAMBAFUSE_NBITS_BULK_STAGES 2
#endif
#ifndef MAMBAFUSE_NBITS_BULK_LANES
#define MAMBAFUSE_NBITS_BULK_LANES 2
#endif
#ifndef MAMBAFUSE_NBITS_BULK_WARPS
#define MAMBAFUSE_NBITS_BULK_WARPS 8
#endif
#ifndef MAMBAFUSE_NBITS_STAGED_ZEROS  // 1: the producer warp stages each tile's biased zero points (not yet timed)
#define MAMBAFUSE_NBITS_STAGED_ZEROS 0
#endif
constexpr int kBulkChunkK = MAMBAFUSE_NBITS_BULK_CHUNK;  // k of a tile (a multiple of 128)
constexpr int kBulkStages = MAMBAFUSE_NBITS_BULK_STAGES;
constexpr int kBulkWarps = MAMBAFUSE_NBITS_BULK_WARPS;  // compute warps of a lane; one more asks for its tiles
constexpr int kBulkLaneThreads = (kBulkWarps + 1) * 32;
constexpr int kBulkLanes = MAMBAFUSE_NBITS_BULK_LANES;  // lanes of a block, each its own ring and groups
// With zero points, the producer warp writes each tile's biased zero points into the stage beside its scales while the
// copies are in flight, and the compute warps read them as they read the scales, instead of loading a zero-point byte
// a row in each step (25 of the step loop's 183 instructions on the H100).
constexpr bool kBulkStagedZeros = MAMBAFUSE_NBITS_STAGED_ZEROS != 0;
constexpr int kBulkThreads = kBulkLanes * kBulkLaneThreads;
// A stage's rows of weights start 64 bytes (16 banks) apart past a multiple of 128, so rows g and g + 1 of one
// 16-byte read per thread land in different banks; the scales' rows 16 bytes apart past their largest size.
constexpr int kBulkRowStride = kBulkChunkK / 2 + 64;
constexpr int kBulkScaleStride = kBulkChunkK / 16 * 2 + 16;
// A stage: 16 rows of weights, their scales, then (kBulkStagedZeros) their blocks' biased zero points as T, laid out
// as the scales.
constexpr int kBulkStageBytes = kNBitsRows * (kBulkRowStride + (kBulkStagedZeros ? 2 : 1) * kBulkScaleStride);
constexpr int kBulkSumBytes = 2 * kBulkWarps * 32 * 4 * static_cast<int>(sizeof(float));
// A lane's stages, sums and mbarriers, rounded up to 128 bytes so every lane's rows sit alike in the banks.
constexpr int kBulkLaneBytes = (kBulkStages * kBulkStageBytes + kBulkSumBytes + 2 * kBulkStages * 8 + 127) / 128 * 128;
constexpr int kBulkSharedBytes = kBulkLanes * kBulkLaneBytes;
static_assert(kBulkLanes >= 1 && kBulkLanes <= 4, "named barriers 1..4 are the lanes'");
static_assert(kBulkThreads <= 1024, "a block's threads");
static_assert(kBulkChunkK % kStepK == 0, "a tile is whole steps");
static_assert(kBulkRowStride % 16 == 0 && kBulkScaleStride % 16 == 0 && kBulkStageBytes % 16 == 0,
              "bulk copies land on 16-byte boundaries");

// The copies of one tile into a stage (a whole warp calls it): the weights of rows group * 16 + r, k [k0, k0 +
// chunk_k), at stage + r * row_stride (lanes 0-15) and their scales at stage + 16 * row_stride + r * scale_stride
// (lanes 16-31); lane 0 first arms the mbarrier at `bar` with the bytes to come.
template <typename T>
__device__ __forceinline__ void RequestTile(const NBitsParams& p, int group, int k0, int chunk_k, uint8_t* stage,
                                            int row_stride, int scale_stride, uint32_t bar) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int scale_bytes = static_cast<int>(sizeof(T));
  const int rows = min(kNBitsRows, p.n - group * kNBitsRows);
  const int w_bytes = chunk_k / 2, s_bytes = (chunk_k >> p.block_shift) * scale_bytes;
  if (lane == 0) MbarrierArriveExpectTx(bar, rows * (w_bytes + s_bytes));
  __syncwarp();
  const int r = lane % 16;
  if (r < rows) {
    const int64_t row = static_cast<int64_t>(group) * kNBitsRows + r;
    const void* src;
    uint32_t dst, bytes;
    if (lane < 16) {
      src = p.b + row * p.row_bytes + k0 / 2;
      dst = SharedAddress(stage + r * row_stride), bytes = w_bytes;
    } else {
      src = static_cast<const uint8_t*>(p.scales) + (row * p.blocks + (k0 >> p.block_shift)) * scale_bytes;
      dst = SharedAddress(stage + kNBitsRows * row_stride + r * scale_stride), bytes = s_bytes;
    }
    BulkCopyToShared(dst, src, bytes, bar);
  }
}

// The biased zero points (1024 + zp in float16, 128 + zp in bfloat16: what the dequantisation subtracts) of a tile's
// rows and blocks, as T at `zeros` + r * scale_stride (a whole warp calls it, after asking for the tile's copies): two
// blocks a byte, so each 32-bit store takes one zero-point byte. A tile starts at an even block and holds whole
// pairs of blocks (k0 a multiple of kBulkChunkK, chunk_k a multiple of 8 blocks). Rows past N get zero point 8.
template <typename T>
__device__ __forceinline__ void StageZeroPoints(const NBitsParams& p, int group, int k0, int chunk_k, uint8_t* zeros,
                                                int scale_stride) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int rows = min(kNBitsRows, p.n - group * kNBitsRows);
  const int row_bytes = (chunk_k >> p.block_shift) / 2;
  const uint8_t* src =
      p.zero_points + static_cast<int64_t>(group) * kNBitsRows * p.zp_row_bytes + (k0 >> p.block_shift) / 2;
  for (int i = lane; i < kNBitsRows * row_bytes; i += 32) {
    const int r = i / row_bytes, c = i - r * row_bytes;
    const uint32_t byte = r < rows ? __ldg(src + static_cast<int64_t>(r) * p.zp_row_bytes + c) : 0x88u;
    const uint32_t pair = HalfTraits<T>::kMagic | (byte & 0x0Fu) | ((byte >> 4) << 16);
    *reinterpret_cast<uint32_t*>(zeros + r * scale_stride + 4 * c) = pair;
  }
}

// One tile of 16 rows in shared memory: the rows g and g + 8 of this thread's weights, scales and (kBulkStagedZeros)
// biased zero points.
template <typename T>
struct TileView {
  const uint8_t* w_lo;
  const uint8_t* w_hi;
  const T* s_lo;
  const T* s_hi;
  const T* z_lo;
  const T* z_hi;
};

// The steps first, first + stride, ... of a tile in shared memory (group `group`, k [k0, k0 + chunk_k)) added into
// d0 and d1: each thread's 16 bytes of rows g and g + 8, their blocks' scales (and zero points, from the stage or
// from global memory) and A's 32 values, as in Int4GemvMmaKernel. Lean where it can be: a tile away from N's and K's
// ends takes no bounds checks, block sizes from 32 up read one scale a row, and a thread whose token g is past M reads
// A's last row instead of zeros (its columns of the product are computed and never stored), so no load is predicated.
template <typename T, bool kHasZp, bool kAVec>
__device__ __forceinline__ void SharedTileSteps(const NBitsParams& p, const TileView<T>& tile, int group, int k0,
                                                int chunk_k, int first, int stride, float (&d0)[4], float (&d1)[4]) {
  using Pair = typename HalfTraits<T>::Pair;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_lo = group * kNBitsRows + g, row_hi = row_lo + 8;
  const bool lo_in = row_lo < p.n, hi_in = row_hi < p.n;
  const T* a_row = static_cast<const T*>(p.a) + static_cast<int64_t>(min(g, p.m - 1)) * p.k;
  const int steps = chunk_k / kStepK;
  const int first_local = first * kStepK + 32 * t;  // this thread's first 32 k inside the tile
  const auto run_steps = [&](auto rows_full, auto a_full, auto two_blocks) {
    constexpr bool kRowsFull = decltype(rows_full)::value, kAFull = decltype(a_full)::value;
    constexpr bool kTwoBlocks = decltype(two_blocks)::value;  // block_size 16: words 0-1 and 2-3 are two blocks
    const bool lo = kRowsFull || lo_in, hi = kRowsFull || hi_in;
    const uint8_t* w_lo = tile.w_lo + first_local / 2;
    const uint8_t* w_hi = tile.w_hi + first_local / 2;
    int local = first_local;
    for (int step = first; step < steps; step += stride, local += stride * kStepK) {
      const int kk = k0 + local;
      const uint4 w_lo4 = lo ? *reinterpret_cast<const uint4*>(w_lo) : make_uint4(0, 0, 0, 0);
      const uint4 w_hi4 = hi ? *reinterpret_cast<const uint4*>(w_hi) : make_uint4(0, 0, 0, 0);
      w_lo += stride * kStepK / 2, w_hi += stride * kStepK / 2;
      const int blk = local >> p.block_shift;
      const T zero_scale = Narrow<T>(0.f);
      Pair sc_lo[2], sc_hi[2], z_lo[2], z_hi[2];
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        if (b == 1 && !kTwoBlocks) {
          sc_lo[1] = sc_lo[0], sc_hi[1] = sc_hi[0], z_lo[1] = z_lo[0], z_hi[1] = z_hi[0];
          break;
        }
        const T sl = lo ? tile.s_lo[blk + b] : zero_scale, sh = hi ? tile.s_hi[blk + b] : zero_scale;
        sc_lo[b] = Pair(sl, sl), sc_hi[b] = Pair(sh, sh);
        if constexpr (kHasZp && kBulkStagedZeros) {  // rows past N hold zero point 8 in the stage
          const T zl = tile.z_lo[blk + b], zh = tile.z_hi[blk + b];
          z_lo[b] = Pair(zl, zl), z_hi[b] = Pair(zh, zh);
        } else {
          int zl = 8, zh = 8;
          if constexpr (kHasZp) {
            const int gblk = (kk >> p.block_shift) + b;
            if (lo) zl = ZeroPoint(p, row_lo, gblk);
            if (hi) zh = ZeroPoint(p, row_hi, gblk);
          }
          z_lo[b] = BiasedZero<T>(zl), z_hi[b] = BiasedZero<T>(zh);
        }
      }
      uint4 av[4];
      if constexpr (kAFull) {  // the tile lies inside K and A's rows are 16-byte aligned
        const uint4* a4 = reinterpret_cast<const uint4*>(a_row + kk);
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = __ldg(a4 + i);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) av[i] = LoadA8<T, kAVec>(a_row, kk + 8 * i, p.k);
      }
      const uint32_t lo_words[4] = {w_lo4.x, w_lo4.y, w_lo4.z, w_lo4.w};
      const uint32_t hi_words[4] = {w_hi4.x, w_hi4.y, w_hi4.z, w_hi4.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t wl[4], wh[4];
        DequantWord<T>(lo_words[i], sc_lo[i / 2], z_lo[i / 2], wl);
        DequantWord<T>(hi_words[i], sc_hi[i / 2], z_hi[i / 2], wh);
        const uint32_t b04 = __byte_perm(av[i].x, av[i].z, 0x5410), b15 = __byte_perm(av[i].x, av[i].z, 0x7632);
        const uint32_t b26 = __byte_perm(av[i].y, av[i].w, 0x5410), b37 = __byte_perm(av[i].y, av[i].w, 0x7632);
        const uint32_t first_half[4] = {wl[0], wh[0], wl[1], wh[1]};
        Mma16816<T>(d0, first_half, b04, b15);
        const uint32_t second_half[4] = {wl[2], wh[2], wl[3], wh[3]};
        Mma16816<T>(d1, second_half, b26, b37);
      }
    }
  };
  const bool rows_full = (group + 1) * kNBitsRows <= p.n;
  const bool a_full = kAVec && k0 + chunk_k <= p.k;
  if (p.block_shift == 4) {
    run_steps(std::false_type{}, std::false_type{}, std::true_type{});
  } else if (rows_full && a_full) {
    run_steps(std::true_type{}, std::true_type{}, std::false_type{});
  } else if (rows_full) {
    run_steps(std::true_type{}, std::false_type{}, std::false_type{});
  } else {
    run_steps(std::false_type{}, std::false_type{}, std::false_type{});
  }
}

// A lane's tiles in order: each of its `groups` groups (first_group, + kBulkLanes, ...) in chunks of kBulkChunkK k.
struct LaneTiles {
  struct Tile {
    int group, k0, chunk_k, ordinal;  // ordinal: the group's place in the lane
    bool last;                        // the group's last tile
  };
  int first_group, chunks, k_pad, count;

  __device__ LaneTiles(const NBitsParams& p, int first, int groups) {
    first_group = first;
    k_pad = p.blocks << p.block_shift;
    chunks = (k_pad + kBulkChunkK - 1) / kBulkChunkK;
    count = groups * chunks;
  }

  __device__ Tile At(int j) const {
    const int ordinal = j / chunks, chunk = j % chunks, k0 = chunk * kBulkChunkK;
    return {first_group + kBulkLanes * ordinal, k0, min(kBulkChunkK, k_pad - k0), ordinal, chunk == chunks - 1};
  }
};

template <typename T, bool kHasZp, bool kAVec>
__global__ void __launch_bounds__(kBulkThreads) Int4GemvBulkKernel(NBitsParams p) {
#if MAMBAFUSE_BULK_COPY_ARCH
  extern __shared__ __align__(128) uint8_t smem[];
  // Lane `lane_id` of the block: its 9 warps, its share of shared memory and of the block's groups (every
  // kBulkLanes-th, so the lanes' counts differ by at most one and each multiprocessor's by at most one group).
  const int lane_id = static_cast<int>(threadIdx.x) / kBulkLaneThreads;
  uint8_t* stages = smem + lane_id * kBulkLaneBytes;
  float(*warp_sums)[kBulkWarps][32][4] =
      reinterpret_cast<float(*)[kBulkWarps][32][4]>(stages + kBulkStages * kBulkStageBytes);  // two slots
  uint64_t* full = reinterpret_cast<uint64_t*>(stages + kBulkStages * kBulkStageBytes + kBulkSumBytes);
  uint64_t* empty = full + kBulkStages;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) % kBulkLaneThreads / 32;
  const int g = lane / 4;
  const int groups = (p.n + kNBitsRows - 1) / kNBitsRows;
  const int block_first = static_cast<int>(static_cast<int64_t>(groups) * blockIdx.x / gridDim.x);
  const int block_last = static_cast<int>(static_cast<int64_t>(groups) * (blockIdx.x + 1) / gridDim.x);
  const int first_group = block_first + lane_id;  // then every kBulkLanes-th group up to block_last
  const LaneTiles lane_tiles(p, first_group, max(0, (block_last - first_group + kBulkLanes - 1) / kBulkLanes));
  const int tiles = lane_tiles.count;
  if (threadIdx.x % kBulkLaneThreads == 0) {
    for (int s = 0; s < kBulkStages; ++s) {
      MbarrierInit(SharedAddress(&full[s]), kHasZp && kBulkStagedZeros ? 2 : 1);  // the copies, the zero points
      MbarrierInit(SharedAddress(&empty[s]), kBulkWarps);
    }
    FenceMbarrierInit();
  }
  __syncthreads();
  if (warp == kBulkWarps) {  // the producer: tile j into stage j % kBulkStages once the compute warps left it
    for (int j = 0; j < tiles; ++j) {
      const int stage = j % kBulkStages;
      if (j >= kBulkStages) {
        WaitParity(SharedAddress(&empty[stage]), (j / kBulkStages - 1) & 1);
        FenceProxyAsync();  // their reads before the copy's writes
      }
      const LaneTiles::Tile t = lane_tiles.At(j);
      uint8_t* stage_base = stages + stage * kBulkStageBytes;
      RequestTile<T>(p, t.group, t.k0, t.chunk_k, stage_base, kBulkRowStride, kBulkScaleStride,
                     SharedAddress(&full[stage]));
      if constexpr (kHasZp && kBulkStagedZeros) {  // while the copies fly; the arrival releases the stores
        StageZeroPoints<T>(p, t.group, t.k0, t.chunk_k,
                           stage_base + kNBitsRows * (kBulkRowStride + kBulkScaleStride), kBulkScaleStride);
        __syncwarp();
        if (threadIdx.x % 32 == 0) MbarrierArrive(SharedAddress(&full[stage]));
      }
    }
    return;
  }

  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // two accumulators: two mma chains
  for (int j = 0; j < tiles; ++j) {
    const int stage = j % kBulkStages;
    const LaneTiles::Tile t = lane_tiles.At(j);
    const uint8_t* stage_base = stages + stage * kBulkStageBytes;
    const uint8_t* w_lo = stage_base + g * kBulkRowStride;
    const T* s_lo = reinterpret_cast<const T*>(stage_base + kNBitsRows * kBulkRowStride + g * kBulkScaleStride);
    const T* z_lo = reinterpret_cast<const T*>(reinterpret_cast<const uint8_t*>(s_lo) + kNBitsRows * kBulkScaleStride);
    const TileView<T> tile{w_lo,
                           w_lo + 8 * kBulkRowStride,
                           s_lo,
                           reinterpret_cast<const T*>(reinterpret_cast<const uint8_t*>(s_lo) + 8 * kBulkScaleStride),
                           z_lo,
                           reinterpret_cast<const T*>(reinterpret_cast<const uint8_t*>(z_lo) + 8 * kBulkScaleStride)};
    WaitParity(SharedAddress(&full[stage]), (j / kBulkStages) & 1);
#if defined(MAMBAFUSE_NBITS_TRAFFIC_FLOOR)  // a reference build for benchmarks: the copies and waits, no arithmetic
    (void)tile;
#else
    SharedTileSteps<T, kHasZp, kAVec>(p, tile, t.group, t.k0, t.chunk_k, warp, kBulkWarps, d0, d1);
#endif
    __syncwarp();  // every lane is done with the stage
    if (lane == 0) MbarrierArrive(SharedAddress(&empty[stage]));
    if (t.last) {  // the group's last tile: its warps' sums, in warp order
      const int slot = t.ordinal & 1;  // the next group's sums go to the other slot while warp 0 reads this one
#pragma unroll
      for (int i = 0; i < 4; ++i) warp_sums[slot][warp][lane][i] = d0[i] + d1[i], d0[i] = 0.f, d1[i] = 0.f;
      BarSyncAligned(1 + lane_id, kBulkWarps * 32);  // the lane's compute warps
      if (warp == 0) StoreGroupSums<T>(p, warp_sums[slot], kBulkWarps, t.group);
    }
  }
#else
  (void)p;
  __trap();
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// int4 GEMV, float32: a warp per column, float32 FMAs
// ---------------------------------------------------------------------------------------------------------------

template <bool kHasZp>
__device__ __forceinline__ void ScalarBlockConstants(const NBitsParams& p, int row, int blk, float& scale,
                                                     float& zero) {
  scale = static_cast<const float*>(p.scales)[static_cast<int64_t>(row) * p.blocks + blk];
  zero = 8.f;
  if constexpr (kHasZp) zero = static_cast<float>(ZeroPoint(p, row, blk));
}

template <int M, bool kHasZp>
__global__ void __launch_bounds__(256) Int4GemvFloatKernel(NBitsParams p) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row = static_cast<int>(blockIdx.x) * 8 + static_cast<int>(threadIdx.x) / 32;
  if (row >= p.n) return;
  const uint8_t* b_row = p.b + static_cast<int64_t>(row) * p.row_bytes;
  const float* a = static_cast<const float*>(p.a);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int k0 = 8 * lane; k0 < p.k; k0 += 256) {  // one 4-byte word (8 k, one block) per lane and step
    const uint32_t word = *reinterpret_cast<const uint32_t*>(b_row + k0 / 2);
    float scale, zero;
    ScalarBlockConstants<kHasZp>(p, row, k0 >> p.block_shift, scale, zero);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (k0 + i >= p.k) break;
      const float w = (static_cast<float>((word >> (4 * i)) & 0xFu) - zero) * scale;
#pragma unroll
      for (int m = 0; m < M; ++m) acc[m] = fmaf(a[static_cast<int64_t>(m) * p.k + k0 + i], w, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float s = acc[m];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) static_cast<float*>(p.y)[static_cast<int64_t>(m) * p.n + row] = s;
  }
}

NBitsParams MakeNBitsParams(const DecodeMatMulNBitsArgs& args) {
  NBitsParams p{};
  p.a = args.a, p.b = args.b, p.scales = args.scales, p.zero_points = args.zero_points, p.y = args.y;
  p.m = static_cast<int>(args.m), p.k = static_cast<int>(args.k), p.n = static_cast<int>(args.n);
  int shift = 0;
  while ((int64_t{1} << shift) < args.block_size) ++shift;
  p.block_shift = shift;
  p.blocks = static_cast<int>((args.k + args.block_size - 1) / args.block_size);
  p.row_bytes = static_cast<int>(p.blocks * args.block_size / 2);
  p.zp_row_bytes = (p.blocks + 1) / 2;
  return p;
}

template <typename T, bool kHasZp, bool kVec16>
cudaError_t LaunchMmaA(const NBitsParams& p, bool a_vec, cudaStream_t stream) {
  const int rows_per_block = kNBitsRows * (kNBitsWarps / p.group_warps);
  const dim3 grid(static_cast<unsigned>((p.n + rows_per_block - 1) / rows_per_block));
  if (a_vec) {
    Int4GemvMmaKernel<T, kHasZp, kVec16, true><<<grid, kNBitsThreads, 0, stream>>>(p);
  } else {
    Int4GemvMmaKernel<T, kHasZp, kVec16, false><<<grid, kNBitsThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// The resident blocks of the int4 kernel on the device (its occupancy times the multiprocessors).
template <typename T>
int64_t MmaSlots() {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Int4GemvMmaKernel<T, true, true, true>, kNBitsThreads,
                                                    0) != cudaSuccess ||
      per_sm < 1) {
    per_sm = 1;
  }
  return static_cast<int64_t>(MultiprocessorCount()) * per_sm;
}

// Every tile's rows of B and of scales in whole 16-byte pieces at 16-byte boundaries, as bulk copies need (a multiple
// of 8 blocks a row, at least 8 blocks a tile).
bool BulkLayout(const NBitsParams& p) {
  return p.blocks % 8 == 0 && (kBulkChunkK >> p.block_shift) % 8 == 0 && reinterpret_cast<uintptr_t>(p.b) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.scales) % 16 == 0;
}

// The blocks of a bulk kernel one multiprocessor holds, its shared-memory opt-in done: asked once per device (at the
// first launch, before any capture); 0 below SM 90 or where the device refuses the opt-in (less shared memory than a
// block needs).
template <typename T, bool kHasZp, bool kAVec>
int BulkBlocksPerSm(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};  // blocks + 1; 0: not asked yet
  if (device >= 0 && device < kDevices) {
    const int cached = known[device].load(std::memory_order_relaxed);
    if (cached > 0) return cached - 1;
  }
  const auto kernel = Int4GemvBulkKernel<T, kHasZp, kAVec>;
  int per_sm = 0, major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9 ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSharedBytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBulkThreads, kBulkSharedBytes) != cudaSuccess) {
    (void)cudaGetLastError();  // a refusal here is not the caller's error
    per_sm = 0;
  }
  if (device >= 0 && device < kDevices) known[device].store(per_sm + 1, std::memory_order_relaxed);
  return per_sm;
}

// cudaErrorNotSupported where the device cannot run it (nothing launched; the caller runs the other kernel).
template <typename T, bool kHasZp, bool kAVec>
cudaError_t LaunchBulkKernel(const NBitsParams& p, int device, cudaStream_t stream) {
  const int per_sm = BulkBlocksPerSm<T, kHasZp, kAVec>(device);
  if (per_sm < 1) return cudaErrorNotSupported;
  // As many blocks as fit at once (each then walks its share of the groups), or one per group.
  const int64_t groups = (p.n + kNBitsRows - 1) / kNBitsRows;
  const int64_t slots = static_cast<int64_t>(MultiprocessorCount()) * per_sm;
  const dim3 grid(static_cast<unsigned>(std::min(groups, slots)));
  Int4GemvBulkKernel<T, kHasZp, kAVec><<<grid, kBulkThreads, kBulkSharedBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchBulk(const NBitsParams& p, bool a_vec, cudaStream_t stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaErrorNotSupported;
  }
  if (p.zero_points != nullptr) {
    return a_vec ? LaunchBulkKernel<T, true, true>(p, device, stream)
                 : LaunchBulkKernel<T, true, false>(p, device, stream);
  }
  return a_vec ? LaunchBulkKernel<T, false, true>(p, device, stream)
               : LaunchBulkKernel<T, false, false>(p, device, stream);
}

template <typename T>
cudaError_t LaunchMma(NBitsParams p, cudaStream_t stream) {
  // The bulk-copy kernel where it applies; MAMBAFUSE_NBITS_KERNEL=mma (read per launch) keeps the register-load
  // kernel below, whose launch knobs follow, for comparisons.
  const char* kernel_choice = std::getenv("MAMBAFUSE_NBITS_KERNEL");
  const bool mma_only = kernel_choice != nullptr && std::strcmp(kernel_choice, "mma") == 0;
  const bool a_vec = p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.a) % 16 == 0;
  if (!mma_only && BulkLayout(p)) {
    const cudaError_t status = LaunchBulk<T>(p, a_vec, stream);
    if (status != cudaErrorNotSupported) return status;  // NotSupported: below SM 90, or too little shared memory
  }
  const int64_t groups = (p.n + kNBitsRows - 1) / kNBitsRows;
  const char* grid_mode = std::getenv("MAMBAFUSE_NBITS_GRID");  // read per launch: benchmarks switch it in-process
  p.group_warps = kNBitsWarps;
  if (grid_mode != nullptr && std::strcmp(grid_mode, "waves") == 0) {
    // The split with the least estimated time: waves of resident blocks times each warp's batches of steps plus
    // about one batch of fixed cost (the first loads' latency, the reduction).
    const int64_t slots = MmaSlots<T>();
    const int64_t steps = ((int64_t{p.blocks} << p.block_shift) + kStepK - 1) / kStepK;
    double best = 0.0;
    for (int warps = kNBitsWarps; warps >= 1; warps /= 2) {
      const int64_t blocks = (groups + kNBitsWarps / warps - 1) / (kNBitsWarps / warps);
      const int64_t waves = (blocks + slots - 1) / slots;
      const int64_t batches = ((steps + warps - 1) / warps + kNBitsUnroll - 1) / kNBitsUnroll;
      const double fill = std::min(1.0, static_cast<double>(blocks) / static_cast<double>(slots));
      const double cost = static_cast<double>(waves) * (static_cast<double>(batches) + 1.0) / fill;
      if (warps == kNBitsWarps || cost < best) best = cost, p.group_warps = warps;
    }
  } else {
    // Fewer warps per group of 16 rows (longer K loops, fewer block ends) while the grid still holds about two
    // waves of 16 warps per multiprocessor.
    const int64_t enough = static_cast<int64_t>(MultiprocessorCount()) * 16 * 2;
    while (p.group_warps > 1 && groups * (p.group_warps / 2) >= enough) p.group_warps /= 2;
  }
  if (const char* forced = std::getenv("MAMBAFUSE_NBITS_GROUP_WARPS")) {
    const int warps = std::atoi(forced);
    if (warps == 1 || warps == 2 || warps == 4 || warps == 8) p.group_warps = warps;
  }
  const char* order = std::getenv("MAMBAFUSE_NBITS_ORDER");
  p.contiguous = order != nullptr && std::strcmp(order, "contiguous") == 0 ? 1 : 0;
  p.prefetch = 0;
  if (const char* ahead = std::getenv("MAMBAFUSE_NBITS_PREFETCH")) p.prefetch = std::max(0, std::atoi(ahead));
  const bool vec16 = p.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.b) % 16 == 0;
  const bool zp = p.zero_points != nullptr;
  if (zp) {
    return vec16 ? LaunchMmaA<T, true, true>(p, a_vec, stream)
                 : LaunchMmaA<T, true, false>(p, a_vec, stream);
  }
  return vec16 ? LaunchMmaA<T, false, true>(p, a_vec, stream)
               : LaunchMmaA<T, false, false>(p, a_vec, stream);
}

template <int M>
cudaError_t LaunchFloatRows(const NBitsParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.n + 7) / 8));
  if (p.zero_points != nullptr) {
    Int4GemvFloatKernel<M, true><<<grid, 256, 0, stream>>>(p);
  } else {
    Int4GemvFloatKernel<M, false><<<grid, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t LaunchFloat(const NBitsParams& p, cudaStream_t stream) {
  switch (p.m) {
    case 1: return LaunchFloatRows<1>(p, stream);
    case 2: return LaunchFloatRows<2>(p, stream);
    case 3: return LaunchFloatRows<3>(p, stream);
    case 4: return LaunchFloatRows<4>(p, stream);
    case 5: return LaunchFloatRows<5>(p, stream);
    case 6: return LaunchFloatRows<6>(p, stream);
    case 7: return LaunchFloatRows<7>(p, stream);
    case 8: return LaunchFloatRows<8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// int4 -> T (N, K padded to whole blocks), for cuBLAS
// ---------------------------------------------------------------------------------------------------------------

// W keeps B's layout, one row of T per output column n, k 0 .. blocks * block_size - 1 (the padding past K is
// dequantized too and never read: cuBLAS takes K of each row). A block takes one row; a thread 8 bytes of it at a
// time (16 k of one block, since blocks are 16 k or more and start on 8-byte boundaries) and writes their 16 values:
// whole sectors read and written, consecutive threads on consecutive pieces, no shared memory.
constexpr int kDequantThreads = 128;

template <typename T, bool kHasZp>
__global__ void __launch_bounds__(kDequantThreads) DequantizeInt4Kernel(NBitsParams p, T* __restrict__ w) {
  const int row = static_cast<int>(blockIdx.x);
  const int pieces = p.row_bytes / 8;
  const uint2* b_row = reinterpret_cast<const uint2*>(p.b + static_cast<int64_t>(row) * p.row_bytes);
  const T* scales = static_cast<const T*>(p.scales) + static_cast<int64_t>(row) * p.blocks;
  uint4* w_row = reinterpret_cast<uint4*>(w + static_cast<int64_t>(row) * p.row_bytes * 2);
  constexpr int kVectors = 16 * static_cast<int>(sizeof(T)) / 16;  // 16-byte stores of a piece's 16 values
  for (int i = static_cast<int>(threadIdx.x); i < pieces; i += kDequantThreads) {
    const uint2 bits = b_row[i];
    const int blk = (16 * i) >> p.block_shift;
    const float scale = Widen(scales[blk]);
    const int zp = kHasZp ? ZeroPoint(p, row, blk) : 8;
    union {
      T values[16];
      uint4 vectors[kVectors];
    } out;
    const uint32_t words[2] = {bits.x, bits.y};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      // (q - zp) is exact; one rounding of its product with the scale, as the GEMV's half multiply does.
      const int q = static_cast<int>((words[j / 8] >> (4 * (j % 8))) & 0xFu);
      out.values[j] = Narrow<T>(static_cast<float>(q - zp) * scale);
    }
#pragma unroll
    for (int v = 0; v < kVectors; ++v) w_row[kVectors * i + v] = out.vectors[v];
  }
}

template <typename T>
cudaError_t LaunchDequantizeType(const NBitsParams& p, void* w, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.n));
  if (p.zero_points != nullptr) {
    DequantizeInt4Kernel<T, true><<<grid, kDequantThreads, 0, stream>>>(p, static_cast<T*>(w));
  } else {
    DequantizeInt4Kernel<T, false><<<grid, kDequantThreads, 0, stream>>>(p, static_cast<T*>(w));
  }
  return cudaGetLastError();
}

}  // namespace

const char* CheckDecodeMatMulNBitsArgs(const DecodeMatMulNBitsArgs& args, bool gemv) {
  if (!SupportedType(args.type)) return "the element type must be float, float16 or bfloat16";
  if (gemv && (args.m < 1 || args.m > kDecodeGemvMaxRows)) return "the GEMV takes 1 to 8 rows of A";
  if (args.block_size < 16 || (args.block_size & (args.block_size - 1)) != 0) {
    return "block_size must be a power of two >= 16";
  }
  if (args.k < 1 || args.n < 1 || args.k > INT_MAX / 4 || args.n > INT_MAX / 2) return "K and N must be in [1, 2^29)";
  if (reinterpret_cast<uintptr_t>(args.b) % 8 != 0) return "B must be 8-byte aligned";
  return nullptr;
}

cudaError_t LaunchDecodeMatMulNBitsGemv(const DecodeMatMulNBitsArgs& args, cudaStream_t stream) {
  if (CheckDecodeMatMulNBitsArgs(args, /*gemv=*/true) != nullptr) return cudaErrorInvalidValue;
  const NBitsParams p = MakeNBitsParams(args);
  switch (args.type) {
    case kGemvFloat: return LaunchFloat(p, stream);
    case kGemvFloat16: return LaunchMma<__half>(p, stream);
    default: return LaunchMma<__nv_bfloat16>(p, stream);
  }
}

cudaError_t LaunchDequantizeInt4(const DecodeMatMulNBitsArgs& args, void* w, cudaStream_t stream) {
  if (CheckDecodeMatMulNBitsArgs(args, /*gemv=*/false) != nullptr) return cudaErrorInvalidValue;
  const NBitsParams p = MakeNBitsParams(args);
  switch (args.type) {
    case kGemvFloat: return LaunchDequantizeType<float>(p, w, stream);
    case kGemvFloat16: return LaunchDequantizeType<__half>(p, w, stream);
    default: return LaunchDequantizeType<__nv_bfloat16>(p, w, stream);
  }
}

}  // namespace mambafuse
