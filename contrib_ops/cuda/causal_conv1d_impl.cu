// CausalConv1d on CUDA (the math is in causal_conv1d_launcher.h and docs/causal_conv1d.md, CUDA kernel).
//
// The op moves x in and y out once, so the kernels aim at a copy's pace: each reads x in wide coalesced loads, keeps
// what neighbouring tokens' K taps share in registers, and spends few instructions per output.
//
// Channels-last (x [B, L, C], the in_proj's layout; K = 4): a thread owns V channels (V = 8 bytes of T: 4 float16 or
// bfloat16, 2 float; V = 1 where C is not a multiple of it or x or y is not 8-byte aligned), a block 128 threads
// (128 V channels) of one batch row and one tile of tokens. The thread loads the K - 1 halo rows before its tile
// (from x, or from the initial state's last K - 1 columns for the first tile) and walks the tile 4 tokens at a time:
// four loads of x in flight, then four outputs from the register window of the last K + 3 rows, then the window
// slides. A warp's load of one row is 256 contiguous bytes. 8 bytes rather than 16: the kernel waits on its loads
// with few warps to switch to (Nsight Compute, H100: half the issue slots idle, mostly on loads in flight), and
// at 8 bytes a thread needs ~80 registers, so a multiprocessor holds 6 blocks (24 warps) instead of 4 (16 warps at
// 128 registers); staging the loads through shared memory with cp.async, or loading the next step before this
// step's arithmetic, measured slower (benchmarks/RESULTS.md). The tile length is picked so that the grid fills the
// GPU's resident blocks once (at least 16 tokens, so the halo rows are at most (K - 1) / 16 more reads, most of them
// from L2): at C = 10240, L = 2048, float16, batch 1, 20 channel blocks times 37 tiles of 56 tokens on 132
// multiprocessors holding 6 each. The block holding a row's last tokens writes the final state of its channels.
//
// Channels-first (x [B, C, L]; K = 4): a thread owns V consecutive tokens of one channel (V = 16 bytes of T where L
// is a multiple of it, else 1), threads numbered along the rows, so a warp reads 512 contiguous bytes. Its K - 1
// earlier inputs are scalar loads of the previous thread's bytes (L1) or of the initial state. The thread holding a
// row's last token writes that row's final state.
//
// A prompt of at most kStepTokens tokens (a decode step through the op, as a mobius build runs its cache; K = 4),
// either layout: one thread per (batch row, channel), which loads the last K - 1 state columns, its tokens and its
// taps at once, writes its outputs and then the final state. The tiled kernel would give such a prompt one tile: a
// thread per V channels, a quarter of the threads at 16-bit types, each waiting on its loads in turn.
//
// Any other K, either layout: one thread per output, reading its K taps from memory, and a second kernel for the
// final state (real models have K = 4; this path is for completeness).
//
// Rounding (the contract's): the K products and their sum in float32, in k order, as separate multiplies and adds
// (no FMA: the exported Conv's arithmetic, and CausalConv1dUpdate's CUDA kernel's), the bias added last, one
// rounding to T; SiLU as the exported Sigmoid then Mul, each rounded to T (for float16 and bfloat16 the Mul is one
// packed multiply of the two rounded pairs, which gives the float32 product's rounding). The sigmoid
// (SigmoidModerate) takes 7 instructions, within 10 float32 unit roundoffs where the budget allows 16; the
// arithmetic per output and the loads' latency are what bound the kernel's pace next to a copy's
// (docs/causal_conv1d.md, CUDA kernel). The final state is a copy of T's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "approx_math.cuh"
#include "causal_conv1d_launcher.h"
#include "elem_convert.cuh"

namespace mambafuse {
namespace {

// The channels-last kernel's compile-time settings (benchmarks/sweep_cuda_conv.py builds and times other values):
// the tokens of a step, the resident blocks a multiprocessor is asked to hold (__launch_bounds__'s second argument),
// the bytes of a thread's vector of channels, the sum's products by FMA (a different rounding, within the budget;
// for measurements) and SiLU's product as a packed multiply of 16-bit pairs (the same bits).
#ifndef MAMBAFUSE_CONV_UNROLL
#define MAMBAFUSE_CONV_UNROLL 4
#endif
#ifndef MAMBAFUSE_CONV_MIN_BLOCKS
#define MAMBAFUSE_CONV_MIN_BLOCKS 4
#endif
#ifndef MAMBAFUSE_CONV_VECTOR_BYTES
#define MAMBAFUSE_CONV_VECTOR_BYTES 8
#endif
#ifndef MAMBAFUSE_CONV_FUSED_SUM
#define MAMBAFUSE_CONV_FUSED_SUM 0
#endif
#ifndef MAMBAFUSE_CONV_HALF_PRODUCT
#define MAMBAFUSE_CONV_HALF_PRODUCT 1
#endif

constexpr int kThreads = 128;
constexpr int kUnroll = MAMBAFUSE_CONV_UNROLL;  // tokens of a channels-last step
constexpr int kVectorBytes = MAMBAFUSE_CONV_VECTOR_BYTES;
constexpr bool kFusedSum = MAMBAFUSE_CONV_FUSED_SUM != 0;  // the channels-last sum's products by FMA (a diagnostic)
constexpr bool kHalfProduct = MAMBAFUSE_CONV_HALF_PRODUCT != 0;  // SiLU's product of 16-bit pairs in T (Activate)
constexpr int kMinTile = 16;  // fewest tokens a channels-last block walks
constexpr int kFastWidth = 4;
constexpr int kStepTokens = 4;  // the longest prompt ConvStepKernel takes
static_assert(kUnroll >= 1 && kMinTile % kUnroll == 0, "a tile is a whole number of steps");
static_assert(kVectorBytes == 4 || kVectorBytes == 8 || kVectorBytes == 16, "vectors of 4, 8 or 16 bytes");

struct Params {
  const void* x;
  const void* weight;
  const void* bias;           // null: no bias
  const void* initial_state;  // null: zeros
  void* y;
  void* final_state;
  int64_t batch;
  int64_t channels;
  int length;
  int state_len;
  int width;
  int silu;
  int round_once;  // v and the sigmoid in float32, y the one rounding to T (ORT's CausalConvWithState)
  int channels_last;  // the layout, for WindowAt
  int tile;           // ChannelsLastKernel: tokens per block
};

// Below this |v| the sigmoid takes SigmoidModerate: e^|v| < 2^116, so nothing it computes is subnormal or infinite.
constexpr float kModerate = 80.f;

// sigmoid(v) = 1 / (1 + e^-v) for |v| < 80 (or NaN), in 7 instructions: e^-v = 2^t e^d with t = -v log2(e) rounded
// and d = -v - t ln2 (tiny: t's rounding; two FMAs with ln2 in two parts keep it exact to float32), taken as
// 2^t (1 + d) (the d^2 / 2 dropped is below 2^-35). With MUFU.EX2's 2 ulps, the sum's and the FMA's roundings and
// MUFU.RCP's 1 ulp: within 10 float32 unit roundoffs of sigmoid(v) (a float64 model of the steps with each
// approximation at its bound gives 9.2), where the budget allows 16.
__device__ __forceinline__ float SigmoidModerate(float v) {
  constexpr float kLog2e = 1.44269504f;          // float(log2(e))
  constexpr float kLn2High = 0.693147182f;       // float(ln 2)
  constexpr float kLn2Low = -1.90465421e-09f;    // ln 2 - kLn2High, rounded
  const float t = __fmul_rn(v, -kLog2e);
  float d = __fmaf_rn(t, -kLn2High, -v);
  d = __fmaf_rn(t, -kLn2Low, d);
  const float power = ApproxExp2(t);
  const float e = __fmaf_rn(power, d, power);
  return ApproxReciprocal(__fadd_rn(1.f, e));
}

// sigmoid(v) for every v: 1 / (1 + e) for v >= 0, e / (1 + e) below, e = e^-|v| by CUDA's expf (2 ulps, subnormal
// results kept; never overflows). Within 8 float32 unit roundoffs. For the rare |v| >= 80 (and infinities), where
// SigmoidModerate's e^-v would overflow or its result be subnormal.
__device__ __forceinline__ float SigmoidAnyValue(float v) {
  const float e = expf(-fabsf(v));
  const float r = ApproxReciprocal(__fadd_rn(1.f, e));
  return __fmul_rn(v >= 0.f ? 1.f : e, r);
}

// V elements of T in one aligned load or store.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> LoadPack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void StorePack(T* p, const Pack<T, V>& value) {
  *reinterpret_cast<Pack<T, V>*>(p) = value;
}

// The pair type of a 16-bit T, and a pair of floats rounded to it (one packed conversion, each element rounded to
// nearest even).
template <typename T>
using PairOf = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
template <typename T>
__device__ __forceinline__ PairOf<T> RoundPair(float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    return __floats2half2_rn(a, b);
  } else {
    return __floats2bfloat162_rn(a, b);
  }
}
template <typename T>
__device__ __forceinline__ float2 WidenPair(PairOf<T> pair) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(pair);
  } else {
    return __bfloat1622float2(pair);
  }
}

// a[i] = round_T(a[i]) as float; float16 and bfloat16 two at a time (one packed conversion a pair, the same
// round-to-nearest-even of each element).
template <typename T, int V>
__device__ __forceinline__ void RoundVector(float (&a)[V]) {
  if constexpr (std::is_same_v<T, float>) {
    return;
  } else if constexpr (V % 2 == 0) {
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      const float2 pair = WidenPair<T>(RoundPair<T>(a[i], a[i + 1]));
      a[i] = pair.x;
      a[i + 1] = pair.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) a[i] = RoundTo<T>(a[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void NarrowVector(const float (&a)[V], Pack<T, V>& out) {
  if constexpr (V % 2 == 0 && !std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      const PairOf<T> pair = RoundPair<T>(a[i], a[i + 1]);
      out.v[i] = pair.x;
      out.v[i + 1] = pair.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out.v[i] = Narrow<T>(a[i]);
  }
}

// sigmoid(v[i]) for V values: SigmoidModerate where every |v| is below kModerate (or NaN), else SigmoidAnyValue.
template <int V>
__device__ __forceinline__ void SigmoidVector(const float (&v)[V], float (&sigmoid)[V]) {
  float largest = 0.f;  // of |v|; fmaxf skips a NaN, which stays NaN on either path
#pragma unroll
  for (int i = 0; i < V; ++i) largest = fmaxf(largest, fabsf(v[i]));
  if (largest < kModerate) {
#pragma unroll
    for (int i = 0; i < V; ++i) sigmoid[i] = SigmoidModerate(v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) sigmoid[i] = SigmoidAnyValue(v[i]);
  }
}

// The outputs of V float32 sums: v = round_T(sum), then SiLU as Sigmoid and Mul, each rounded to T; with
// round_once the sum, the sigmoid and their product in float32 and one rounding to T.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> Activate(float (&sum)[V], int silu, int round_once) {
  Pack<T, V> out;
  if (round_once) {
    if (silu) {
      float sigmoid[V];
      SigmoidVector<V>(sum, sigmoid);
#pragma unroll
      for (int i = 0; i < V; ++i) sum[i] = __fmul_rn(sum[i], sigmoid[i]);
    }
    NarrowVector<T, V>(sum, out);
    return out;
  }
  if constexpr (kHalfProduct && !std::is_same_v<T, float> && V % 2 == 0) {
    if (silu) {
      // v and sigmoid(v) rounded to T in pairs; their product by one packed multiply of T, which rounds the exact
      // product as a float32 product narrowed to T does (at most 11 significant bits each, 8 in bfloat16, so the
      // float32 product is exact): the same bits in a quarter of the instructions.
      PairOf<T> v_pairs[V / 2];
#pragma unroll
      for (int i = 0; i < V; i += 2) {
        v_pairs[i / 2] = RoundPair<T>(sum[i], sum[i + 1]);
        const float2 v = WidenPair<T>(v_pairs[i / 2]);
        sum[i] = v.x;
        sum[i + 1] = v.y;
      }
      float sigmoid[V];
      SigmoidVector<V>(sum, sigmoid);
#pragma unroll
      for (int i = 0; i < V; i += 2) {
        const PairOf<T> y = __hmul2(v_pairs[i / 2], RoundPair<T>(sigmoid[i], sigmoid[i + 1]));
        out.v[i] = y.x;
        out.v[i + 1] = y.y;
      }
      return out;
    }
  }
  if (silu) {
    RoundVector<T, V>(sum);
    float sigmoid[V];
    SigmoidVector<V>(sum, sigmoid);
    RoundVector<T, V>(sigmoid);
#pragma unroll
    for (int i = 0; i < V; ++i) sum[i] = __fmul_rn(sum[i], sigmoid[i]);
  }
  NarrowVector<T, V>(sum, out);
  return out;
}

// x [B, L, C]: block (channel block, token tile, batch row); thread: channels c0 .. c0 + V, tokens t0 .. t1.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads, MAMBAFUSE_CONV_MIN_BLOCKS) ChannelsLastKernel(const Params p) {
  constexpr int kK = kFastWidth;
  constexpr int kHalo = kK - 1;
  const int64_t channels = p.channels;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * V;
  if (c0 >= channels) return;  // V divides C where V > 1
  const int64_t b = blockIdx.z;
  const int length = p.length, state_len = p.state_len;
  const int t0 = static_cast<int>(blockIdx.y) * p.tile;
  const int t1 = min(t0 + p.tile, length);
  const T* x = static_cast<const T*>(p.x) + b * length * channels + c0;  // token t at x + t * C
  T* y = static_cast<T*>(p.y) + b * length * channels + c0;
  const T* state = static_cast<const T*>(p.initial_state);
  const int64_t state_row = (b * channels + c0) * state_len;  // channel c0 + v at state_row + v * S

  const bool has_bias = p.bias != nullptr;
  float w[kK][V], bias[V];
  const T* weight = static_cast<const T*>(p.weight) + c0 * kK;
#pragma unroll
  for (int v = 0; v < V; ++v) {
#pragma unroll
    for (int k = 0; k < kK; ++k) w[k][v] = Widen(weight[v * kK + k]);
    bias[v] = has_bias ? Widen(static_cast<const T*>(p.bias)[c0 + v]) : 0.f;
  }

  // Rows t - K + 1 .. t + kUnroll - 1 of the window (in x's rows; a row before 0 is the state's column S + row).
  float window[kHalo + kUnroll][V];
#pragma unroll
  for (int j = 0; j < kHalo; ++j) {
    const int row = t0 - kHalo + j;
    if (row >= 0) {
      const Pack<T, V> raw = LoadPack<T, V>(x + static_cast<int64_t>(row) * channels);
#pragma unroll
      for (int v = 0; v < V; ++v) window[j][v] = Widen(raw.v[v]);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        window[j][v] = state != nullptr ? Widen(state[state_row + v * state_len + state_len + row]) : 0.f;
      }
    }
  }

  // Tokens t .. t + kUnroll (with kPartial, those below t1): the loads first, then the outputs, then the window
  // slides by kUnroll rows.
  const auto step = [&](int t, auto partial) {
    constexpr bool kPartial = decltype(partial)::value;
    Pack<T, V> raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!kPartial || t + u < t1) {
        raw[u] = LoadPack<T, V>(x + static_cast<int64_t>(t + u) * channels);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) raw[u].v[v] = Narrow<T>(0.f);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int v = 0; v < V; ++v) window[kHalo + u][v] = Widen(raw[u].v[v]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!kPartial || t + u < t1) {
        float sum[V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          sum[v] = __fmul_rn(w[0][v], window[u][v]);
#pragma unroll
          for (int k = 1; k < kK; ++k) {
            sum[v] = kFusedSum ? __fmaf_rn(w[k][v], window[u + k][v], sum[v])
                               : __fadd_rn(sum[v], __fmul_rn(w[k][v], window[u + k][v]));
          }
          if (has_bias) sum[v] = __fadd_rn(sum[v], bias[v]);
        }
        StorePack<T, V>(y + static_cast<int64_t>(t + u) * channels, Activate<T, V>(sum, p.silu, p.round_once));
      }
    }
#pragma unroll
    for (int j = 0; j < kHalo; ++j) {
#pragma unroll
      for (int v = 0; v < V; ++v) window[j][v] = window[kUnroll + j][v];
    }
  };
  int t = t0;
  for (; t + kUnroll <= t1; t += kUnroll) step(t, std::false_type{});
  if (t < t1) step(t, std::true_type{});

  if (t1 == length) {  // final_state[b, c, j] = window column L + j: x's row L + j - S, or the state's column
    T* final_state = static_cast<T*>(p.final_state) + state_row;
    for (int j = 0; j < state_len; ++j) {
      const int column = length + j;
      if (column >= state_len) {
        const Pack<T, V> raw = LoadPack<T, V>(x + static_cast<int64_t>(column - state_len) * channels);
#pragma unroll
        for (int v = 0; v < V; ++v) final_state[v * state_len + j] = raw.v[v];
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          final_state[v * state_len + j] =
              state != nullptr ? state[state_row + v * state_len + column] : Narrow<T>(0.f);
        }
      }
    }
  }
}

// x [B, C, L]: thread i holds tokens V (i % (L / V)) .. + V of row i / (L / V) (row = b C + c). Index: the type of
// the flat thread number (32 bits where the call's vectors fit).
template <typename T, int V, typename Index>
__global__ void __launch_bounds__(kThreads) ChannelsFirstKernel(const Params p) {
  constexpr int kK = kFastWidth;
  constexpr int kHalo = kK - 1;
  const Index vectors_per_row = static_cast<Index>(p.length / V);
  const Index i = static_cast<Index>(blockIdx.x) * kThreads + threadIdx.x;
  const Index rows = static_cast<Index>(p.batch * p.channels);
  const Index row = i / vectors_per_row;
  if (row >= rows) return;
  const int t = static_cast<int>(i - row * vectors_per_row) * V;
  const int64_t c = static_cast<int64_t>(row % static_cast<Index>(p.channels));
  const int length = p.length, state_len = p.state_len;
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(row) * length;
  const T* state = p.initial_state != nullptr
                       ? static_cast<const T*>(p.initial_state) + static_cast<int64_t>(row) * state_len
                       : nullptr;

  float w[kK];
  const T* weight = static_cast<const T*>(p.weight) + c * kK;
#pragma unroll
  for (int k = 0; k < kK; ++k) w[k] = Widen(weight[k]);
  const float bias = p.bias != nullptr ? Widen(static_cast<const T*>(p.bias)[c]) : 0.f;

  float window[kHalo + V];  // tokens t - K + 1 .. t + V - 1
#pragma unroll
  for (int j = 0; j < kHalo; ++j) {
    const int token = t - kHalo + j;
    if (token >= 0) {
      window[j] = Widen(x[token]);
    } else {
      window[j] = state != nullptr ? Widen(state[state_len + token]) : 0.f;
    }
  }
  const Pack<T, V> raw = LoadPack<T, V>(x + t);
#pragma unroll
  for (int v = 0; v < V; ++v) window[kHalo + v] = Widen(raw.v[v]);
  float sum[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    sum[v] = __fmul_rn(w[0], window[v]);
#pragma unroll
    for (int k = 1; k < kK; ++k) sum[v] = __fadd_rn(sum[v], __fmul_rn(w[k], window[v + k]));
    if (p.bias != nullptr) sum[v] = __fadd_rn(sum[v], bias);
  }
  StorePack<T, V>(static_cast<T*>(p.y) + static_cast<int64_t>(row) * length + t,
                  Activate<T, V>(sum, p.silu, p.round_once));

  if (t + V == length) {  // final_state[row, j] = window column L + j
    T* final_state = static_cast<T*>(p.final_state) + static_cast<int64_t>(row) * state_len;
    for (int j = 0; j < state_len; ++j) {
      const int column = length + j;
      if (column >= state_len) {
        final_state[j] = x[column - state_len];
      } else {
        final_state[j] = state != nullptr ? state[column] : Narrow<T>(0.f);
      }
    }
  }
}

// A prompt of L <= kStepTokens tokens, K = 4, either layout: thread i = b C + c.
template <typename T>
__global__ void __launch_bounds__(kThreads) ConvStepKernel(const Params p) {
  constexpr int kK = kFastWidth;
  constexpr int kHalo = kK - 1;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t channels = p.channels;
  if (i >= p.batch * channels) return;
  const int64_t c = i % channels;
  const int length = p.length, state_len = p.state_len;
  // Token t of this (b, c) in x and y: channels-last [B, L, C] at (b L + t) C + c, channels-first [B, C, L] at
  // i L + t.
  const int64_t first = p.channels_last ? (i - c) * length + c : i * length;
  const int64_t stride = p.channels_last ? channels : 1;
  const T* x = static_cast<const T*>(p.x) + first;
  const T* state =
      p.initial_state != nullptr ? static_cast<const T*>(p.initial_state) + i * state_len : nullptr;
  const T* weight = static_cast<const T*>(p.weight) + c * kK;

  // Every load before any arithmetic: the taps, the bias, the state's last K - 1 columns and the tokens.
  T raw_w[kK], raw_window[kHalo + kStepTokens];
#pragma unroll
  for (int k = 0; k < kK; ++k) raw_w[k] = weight[k];
  const T raw_bias = p.bias != nullptr ? static_cast<const T*>(p.bias)[c] : Narrow<T>(0.f);
#pragma unroll
  for (int j = 0; j < kHalo; ++j) raw_window[j] = state != nullptr ? state[state_len - kHalo + j] : Narrow<T>(0.f);
#pragma unroll
  for (int t = 0; t < kStepTokens; ++t) raw_window[kHalo + t] = t < length ? x[t * stride] : Narrow<T>(0.f);

  T* y = static_cast<T*>(p.y) + first;
#pragma unroll
  for (int t = 0; t < kStepTokens; ++t) {
    if (t >= length) break;
    float sum[1] = {__fmul_rn(Widen(raw_w[0]), Widen(raw_window[t]))};
#pragma unroll
    for (int k = 1; k < kK; ++k) sum[0] = __fadd_rn(sum[0], __fmul_rn(Widen(raw_w[k]), Widen(raw_window[t + k])));
    if (p.bias != nullptr) sum[0] = __fadd_rn(sum[0], Widen(raw_bias));
    y[t * stride] = Activate<T, 1>(sum, p.silu, p.round_once).v[0];
  }

  // final_state[b, c, j] = window column L + j. The registers hold columns S - K + 1 .. S + L - 1 (the state's last
  // K - 1, then x's tokens): window register w is final_state[w + shift]; the columns before them (a state wider
  // than K - 1 and a prompt shorter than its extra columns) are read again from the state.
  T* final_state = static_cast<T*>(p.final_state) + i * state_len;
  const int shift = state_len - kHalo - length;
#pragma unroll
  for (int w = 0; w < kHalo + kStepTokens; ++w) {
    if (w < kHalo + length && w + shift >= 0) final_state[w + shift] = raw_window[w];
  }
  for (int j = 0; j < shift; ++j) final_state[j] = state != nullptr ? state[length + j] : Narrow<T>(0.f);
}

// Window column `column` (of [state (S) | x (L)]) of (batch row b, channel c), either layout.
template <typename T>
__device__ __forceinline__ T WindowAt(const Params& p, int64_t b, int64_t c, int column) {
  if (column >= p.state_len) {
    const int64_t t = column - p.state_len;
    const int64_t offset = p.channels_last ? (b * p.length + t) * p.channels + c : (b * p.channels + c) * p.length + t;
    return static_cast<const T*>(p.x)[offset];
  }
  if (p.initial_state == nullptr) return Narrow<T>(0.f);
  return static_cast<const T*>(p.initial_state)[(b * p.channels + c) * p.state_len + column];
}

// Any K, either layout: one thread per output, numbered in y's memory order.
template <typename T>
__global__ void __launch_bounds__(kThreads) AnyWidthKernel(const Params p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t channels = p.channels, length = p.length;
  if (i >= p.batch * channels * length) return;
  int64_t b, c, t;
  if (p.channels_last) {
    c = i % channels;
    t = (i / channels) % length;
    b = i / (channels * length);
  } else {
    t = i % length;
    c = (i / length) % channels;
    b = i / (channels * length);
  }
  const T* weight = static_cast<const T*>(p.weight) + c * p.width;
  const int first = p.state_len - p.width + 1 + static_cast<int>(t);
  float sum[1] = {__fmul_rn(Widen(weight[0]), Widen(WindowAt<T>(p, b, c, first)))};
  for (int k = 1; k < p.width; ++k) {
    sum[0] = __fadd_rn(sum[0], __fmul_rn(Widen(weight[k]), Widen(WindowAt<T>(p, b, c, first + k))));
  }
  if (p.bias != nullptr) sum[0] = __fadd_rn(sum[0], Widen(static_cast<const T*>(p.bias)[c]));
  static_cast<T*>(p.y)[i] = Activate<T, 1>(sum, p.silu, p.round_once).v[0];
}

// final_state [B, C, S] for AnyWidthKernel: one thread per element.
template <typename T>
__global__ void __launch_bounds__(kThreads) FinalStateKernel(const Params p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= p.batch * p.channels * p.state_len) return;
  const int j = static_cast<int>(i % p.state_len);
  const int64_t c = (i / p.state_len) % p.channels;
  const int64_t b = i / (p.state_len * p.channels);
  static_cast<T*>(p.final_state)[i] = WindowAt<T>(p, b, c, p.length + j);
}

bool Aligned(const void* pointer, int bytes) { return reinterpret_cast<uintptr_t>(pointer) % bytes == 0; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of `kernel` one multiprocessor holds at once, asked once per kernel.
template <typename Kernel>
cudaError_t ResidentBlocksPerSm(Kernel kernel, std::atomic<int>& cached, int& blocks) {
  blocks = cached.load(std::memory_order_relaxed);
  if (blocks > 0) return cudaSuccess;
  if (const cudaError_t error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0);
      error != cudaSuccess) {
    return error;
  }
  blocks = blocks > 0 ? blocks : 1;
  cached.store(blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

template <typename T, int V>
cudaError_t LaunchChannelsLast(Params p, cudaStream_t stream) {
  static std::atomic<int> cached_blocks{0};
  int per_sm = 0, device = 0, sms = 0;
  if (const cudaError_t error = ResidentBlocksPerSm(ChannelsLastKernel<T, V>, cached_blocks, per_sm);
      error != cudaSuccess) {
    return error;
  }
  if (const cudaError_t error = cudaGetDevice(&device); error != cudaSuccess) return error;
  if (const cudaError_t error = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      error != cudaSuccess) {
    return error;
  }
  // Token tiles per (batch row, channel block) so that the grid is at most one round of resident blocks (the tile
  // count rounded down: rounded up, C = 10240, 2048 tokens, batch 4 asked for 560 blocks where 528 fit, and the last
  // 32 could start only as the first round ended, then ran with the GPU mostly idle); at least one tile, kMinTile
  // tokens a tile, a whole number of kUnroll steps, and at most 65535 tiles (the grid's y).
  const int64_t channel_blocks = CeilDiv(p.channels, static_cast<int64_t>(V) * kThreads);
  const int64_t tiles_fitting = static_cast<int64_t>(sms) * per_sm / (channel_blocks * p.batch);
  const int64_t tiles_wanted = tiles_fitting > 0 ? tiles_fitting : 1;
  int64_t tile = CeilDiv(CeilDiv(p.length, tiles_wanted), kUnroll) * kUnroll;
  if (tile < kMinTile) tile = kMinTile;
  if (tile < CeilDiv(p.length, 65535)) tile = CeilDiv(CeilDiv(p.length, 65535), kUnroll) * kUnroll;
  p.tile = static_cast<int>(tile);
  const dim3 grid(static_cast<unsigned>(channel_blocks), static_cast<unsigned>(CeilDiv(p.length, tile)),
                  static_cast<unsigned>(p.batch));
  ChannelsLastKernel<T, V><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int V>
cudaError_t LaunchChannelsFirst(const Params& p, cudaStream_t stream) {
  const int64_t threads = p.batch * p.channels * (p.length / V);
  const dim3 grid(static_cast<unsigned>(CeilDiv(threads, kThreads)));
  if (threads + kThreads <= static_cast<int64_t>(UINT32_MAX)) {
    ChannelsFirstKernel<T, V, uint32_t><<<grid, kThreads, 0, stream>>>(p);
  } else {
    ChannelsFirstKernel<T, V, uint64_t><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchStep(const Params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.batch * p.channels, kThreads)));
  ConvStepKernel<T><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchAnyWidth(const Params& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(CeilDiv(p.batch * p.channels * p.length, kThreads)));
  AnyWidthKernel<T><<<grid, kThreads, 0, stream>>>(p);
  if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) return error;
  const int64_t state_elements = p.batch * p.channels * p.state_len;
  if (state_elements == 0) return cudaSuccess;
  const dim3 state_grid(static_cast<unsigned>(CeilDiv(state_elements, kThreads)));
  FinalStateKernel<T><<<state_grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Whether a vector of `bytes` bytes of T fits: the layout's contiguous dimension a multiple of it and both pointers
// aligned to it.
bool VectorFits(const CausalConv1dCpuArgs& a, int element_bytes, int bytes) {
  const int64_t contiguous = a.channels_last ? a.channels : a.length;
  return contiguous % (bytes / element_bytes) == 0 && Aligned(a.x, bytes) && Aligned(a.y, bytes);
}

template <typename T>
cudaError_t LaunchTyped(const CausalConv1dCpuArgs& a, const Params& p, cudaStream_t stream) {
  constexpr int kV = 16 / sizeof(T);
  constexpr int kLastV = kVectorBytes / sizeof(T);
  switch (ChooseCausalConv1dCudaPath(a)) {
    case CausalConv1dCudaPath::kTiledChannelsLast:
      return VectorFits(a, sizeof(T), kVectorBytes) ? LaunchChannelsLast<T, kLastV>(p, stream)
                                                    : LaunchChannelsLast<T, 1>(p, stream);
    case CausalConv1dCudaPath::kVectorChannelsFirst:
      return VectorFits(a, sizeof(T), 16) ? LaunchChannelsFirst<T, kV>(p, stream)
                                          : LaunchChannelsFirst<T, 1>(p, stream);
    case CausalConv1dCudaPath::kStep:
      return LaunchStep<T>(p, stream);
    default: return LaunchAnyWidth<T>(p, stream);
  }
}

}  // namespace

CausalConv1dCudaPath ChooseCausalConv1dCudaPath(const CausalConv1dCpuArgs& a) {
  if (a.width != kFastWidth) return CausalConv1dCudaPath::kAnyWidth;
  if (a.length <= kStepTokens) return CausalConv1dCudaPath::kStep;
  return a.channels_last ? CausalConv1dCudaPath::kTiledChannelsLast : CausalConv1dCudaPath::kVectorChannelsFirst;
}

const char* CheckCausalConv1dCudaArgs(const CausalConv1dCpuArgs& a) {
  if (a.type != ElemType::kFloat && a.type != ElemType::kFloat16 && a.type != ElemType::kBFloat16) {
    return "the type is not float, float16 or bfloat16";
  }
  if (a.batch < 0 || a.channels < 0 || a.length < 1 || a.width < 1 || a.state_len < a.width - 1) {
    return "negative sizes, an empty prompt, a kernel width below 1 or a state narrower than K - 1";
  }
  // int token and column indices; the grid's z (channels-last batch rows) and x (blocks of outputs) limits
  if (a.length > INT_MAX / 2 || a.state_len > INT_MAX / 2 || a.width > INT_MAX / 2 || a.batch > 65535 ||
      a.channels > INT64_MAX / (a.length + a.state_len) / (a.batch > 0 ? a.batch : 1) ||
      a.batch * a.channels * a.length / kThreads >= INT_MAX ||
      a.batch * a.channels * a.state_len / kThreads >= INT_MAX) {
    return "a dimension is beyond the kernels' grid (batch <= 65535, fewer than 2^31 blocks of 128 outputs)";
  }
  if (a.batch * a.channels > 0 &&
      (a.x == nullptr || a.weight == nullptr || a.y == nullptr || (a.state_len > 0 && a.final_state == nullptr))) {
    return "null data pointer";
  }
  return nullptr;
}

cudaError_t LaunchCausalConv1d(const CausalConv1dCpuArgs& a, cudaStream_t stream) {
  if (CheckCausalConv1dCudaArgs(a) != nullptr) return cudaErrorInvalidValue;
  if (a.batch == 0 || a.channels == 0) return cudaSuccess;
  Params p{};
  p.x = a.x;
  p.weight = a.weight;
  p.bias = a.bias;
  p.initial_state = a.initial_state;
  p.y = a.y;
  p.final_state = a.final_state;
  p.batch = a.batch;
  p.channels = a.channels;
  p.length = static_cast<int>(a.length);
  p.state_len = static_cast<int>(a.state_len);
  p.width = static_cast<int>(a.width);
  p.silu = a.silu ? 1 : 0;
  p.round_once = a.round_once ? 1 : 0;
  p.channels_last = a.channels_last ? 1 : 0;
  switch (a.type) {
    case ElemType::kFloat: return LaunchTyped<float>(a, p, stream);
    case ElemType::kFloat16: return LaunchTyped<__half>(a, p, stream);
    default: return LaunchTyped<__nv_bfloat16>(a, p, stream);
  }
}

}  // namespace mambafuse
