// Element helpers of the decode-step math cores (selective_state_update_math.cc,
// causal_conv1d_update_math.cc): float32 <-> float16 / bfloat16 and the rounding of a float32 value to a
// half type (round to nearest even, NaN kept, overflow to Inf), written once for a scalar (float,
// uint32_t) and for a GCC vector of the instruction-set level's width (VF, VU), by integer operations on
// the bits that any level vectorizes. Everything is in the math core's per-ISA namespace (MAMBAFUSE_ISA_NS,
// set by CMake for each compilation of a math core), with internal linkage.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>  // the level's conversions and streaming stores (SSE2 is x86-64's baseline)
#endif

// GCC 12's AVX-512 conversion intrinsics start from an undefined vector, which -Wmaybe-uninitialized
// reports once inlined (a known false positive, as in the gated norm's core).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#ifndef MAMBAFUSE_ISA_NS
#define MAMBAFUSE_ISA_NS isa_generic
#endif

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

#if defined(__AVX512F__)
constexpr int kWidth = 16;
#elif defined(__AVX2__)
constexpr int kWidth = 8;
#else
constexpr int kWidth = 4;
#endif

typedef float VF __attribute__((vector_size(4 * kWidth)));
typedef int32_t VI __attribute__((vector_size(4 * kWidth)));
typedef uint32_t VU __attribute__((vector_size(4 * kWidth)));
typedef uint16_t VH __attribute__((vector_size(2 * kWidth)));

#define MAMBAFUSE_INLINE inline __attribute__((always_inline))

// The unsigned type of a float type's bits: float -> uint32_t, VF -> VU.
template <typename F>
struct BitsOf;
template <>
struct BitsOf<float> {
  using type = uint32_t;
};
template <>
struct BitsOf<VF> {
  using type = VU;
};

template <typename F>
MAMBAFUSE_INLINE typename BitsOf<F>::type ToBits(F f) {
  typename BitsOf<F>::type u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

template <typename F, typename U>
MAMBAFUSE_INLINE F FromBits(U u) {
  F f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A condition of the same kind as U: a bool for a scalar, a lane mask for a vector; Select picks per lane.
MAMBAFUSE_INLINE uint32_t Select(bool c, uint32_t a, uint32_t b) { return c ? a : b; }
MAMBAFUSE_INLINE VU Select(VI c, VU a, VU b) { return c ? a : b; }

// float32 -> the nearest bfloat16, widened back (bits of a float32 whose low 16 bits are 0).
template <typename F>
MAMBAFUSE_INLINE typename BitsOf<F>::type RoundBF16Bits(F f) {
  using U = typename BitsOf<F>::type;
  const U u = ToBits(f);
  const U rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const U quiet_nan = (u | 0x00400000u) & 0xFFFF0000u;
  return Select((u & 0x7FFFFFFFu) > 0x7F800000u, quiet_nan, rounded);
}

// float32 -> the nearest float16, widened back, as float32 bits. Normal halves: the mantissa rounded at
// bit 13 (a carry into the exponent is the right result); |f| >= 65520 (half of float16's last step past
// 65504): Inf; |f| < 2^-14 (a float16 subnormal): the value rounded to a multiple of 2^-24 by adding and
// subtracting 0.5, whose float32 spacing is 2^-24 (exact float arithmetic on normal numbers).
template <typename F>
MAMBAFUSE_INLINE typename BitsOf<F>::type RoundF16Bits(F f) {
  using U = typename BitsOf<F>::type;
  const U u = ToBits(f);
  const U sign = u & 0x80000000u;
  const U a = u & 0x7FFFFFFFu;
  const U normal = (a + 0x0FFFu + ((a >> 13) & 1u)) & 0xFFFFE000u;
  const F magnitude = FromBits<F>(a);
  const U tiny = ToBits(F((magnitude + 0.5f) - 0.5f));
  U r = Select(a < 0x38800000u, tiny, normal);
  r = Select(a >= 0x477FF000u, a > 0x7F800000u ? U(a | 0x00400000u) : U(0x7F800000u), r);
  return r | sign;
}

// Specialised for the vector: the nested select above is a scalar ternary.
template <>
MAMBAFUSE_INLINE VU RoundF16Bits<VF>(VF f) {
  const VU u = ToBits(f);
  const VU sign = u & 0x80000000u;
  const VU a = u & 0x7FFFFFFFu;
  const VU normal = (a + 0x0FFFu + ((a >> 13) & 1u)) & 0xFFFFE000u;
  const VF magnitude = FromBits<VF>(a);
  const VU tiny = ToBits(VF((magnitude + 0.5f) - 0.5f));
  VU r = a < 0x38800000u ? tiny : normal;
  const VU big = a > 0x7F800000u ? (a | 0x00400000u) : (VU{} + 0x7F800000u);
  r = a >= 0x477FF000u ? big : r;
  return r | sign;
}

// float16 <-> float32 by the conversion instructions where the level has them (F16C in x86-64-v3 and v4:
// one instruction where the bit operations take about ten; round to nearest even, NaN kept quiet).
#if defined(__AVX512F__) || defined(__F16C__)
#define MAMBAFUSE_HW_F16 1
MAMBAFUSE_INLINE VH F16FromFloatHw(VF v) {
#if defined(__AVX512F__)
  const __m256i raw = _mm512_cvtps_ph(reinterpret_cast<__m512>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const __m128i raw = _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  VH h;
  std::memcpy(&h, &raw, sizeof h);
  return h;
}

MAMBAFUSE_INLINE VF FloatFromF16Hw(VH h) {
#if defined(__AVX512F__)
  __m256i raw;
  std::memcpy(&raw, &h, sizeof raw);
  return reinterpret_cast<VF>(_mm512_cvtph_ps(raw));
#else
  __m128i raw;
  std::memcpy(&raw, &h, sizeof raw);
  return reinterpret_cast<VF>(_mm256_cvtph_ps(raw));
#endif
}
#endif

// The value rounded to float16 (kHalf == 1), bfloat16 (2) or not at all (0), as a float.
enum HalfKind : int { kNone = 0, kF16 = 1, kBF16 = 2 };

template <int kHalf, typename F>
MAMBAFUSE_INLINE F RoundTo(F f) {
  if constexpr (kHalf == kF16) {
#if defined(MAMBAFUSE_HW_F16)
    if constexpr (std::is_same_v<F, VF>) {
      return FloatFromF16Hw(F16FromFloatHw(f));
    } else {
      return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    return FromBits<F>(RoundF16Bits(f));
  } else if constexpr (kHalf == kBF16) {
    return FromBits<F>(RoundBF16Bits(f));
  } else {
    return f;
  }
}

// float16 bits (widened to 32) -> float32 bits. Exact: subnormal halves through one float subtraction of
// normal numbers (2^-14 (1 + m 2^-10) - 2^-14), which FTZ cannot change.
template <typename U>
MAMBAFUSE_INLINE U F16BitsToFloatBits(U h) {
  const U sign = (h & 0x8000u) << 16;
  const U em = (h & 0x7FFFu) << 13;
  const U exponent = em & 0x0F800000u;
  const U normal = em + (112u << 23);
  using F = std::conditional_t<std::is_same_v<U, uint32_t>, float, VF>;
  const U sub = ToBits(F(FromBits<F>(U(em + (113u << 23))) - 6.103515625e-05f));
  const U special = em + (224u << 23);
  U r = Select(exponent == 0x0F800000u, special, normal);
  r = Select(exponent == 0u, sub, r);
  return r | sign;
}

template <>
MAMBAFUSE_INLINE VU F16BitsToFloatBits<VU>(VU h) {
  const VU sign = (h & 0x8000u) << 16;
  const VU em = (h & 0x7FFFu) << 13;
  const VU exponent = em & 0x0F800000u;
  const VU normal = em + (112u << 23);
  const VU sub = ToBits(VF(FromBits<VF>(VU(em + (113u << 23))) - 6.103515625e-05f));
  const VU special = em + (224u << 23);
  VU r = exponent == 0x0F800000u ? special : normal;
  r = exponent == 0u ? sub : r;
  return r | sign;
}

// Loads and stores of element type kHalf (0: float32) from/to float32.
template <int kHalf>
MAMBAFUSE_INLINE float LoadScalar(const void* p, int64_t i) {
  if constexpr (kHalf == kNone) {
    float f;
    std::memcpy(&f, static_cast<const char*>(p) + 4 * i, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
#if defined(MAMBAFUSE_HW_F16)
    if constexpr (kHalf == kF16) return _cvtsh_ss(h);
#endif
    const uint32_t wide = h;
    return FromBits<float>(kHalf == kBF16 ? wide << 16 : F16BitsToFloatBits(wide));
  }
}

template <int kHalf>
MAMBAFUSE_INLINE void StoreScalar(void* p, int64_t i, float f) {
  if constexpr (kHalf == kNone) {
    std::memcpy(static_cast<char*>(p) + 4 * i, &f, 4);
  } else {
#if defined(MAMBAFUSE_HW_F16)
    if constexpr (kHalf == kF16) {
      const uint16_t hw = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      std::memcpy(static_cast<char*>(p) + 2 * i, &hw, 2);
      return;
    }
#endif
    const uint16_t h = kHalf == kBF16 ? static_cast<uint16_t>(RoundBF16Bits(f) >> 16) : [&] {
      // float32 bits of a float16 value -> float16 bits (exact: the value is representable).
      const uint32_t b = RoundF16Bits(f);
      const uint32_t sign = (b >> 16) & 0x8000u;
      const uint32_t a = b & 0x7FFFFFFFu;
      uint32_t half;
      if (a >= 0x7F800000u) {
        half = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
      } else if (a < 0x38800000u) {  // subnormal half: a multiple of 2^-24
        half = static_cast<uint32_t>(FromBits<float>(a) * 16777216.0f);
      } else {
        half = (a - (112u << 23)) >> 13;
      }
      return static_cast<uint16_t>(half | sign);
    }();
    std::memcpy(static_cast<char*>(p) + 2 * i, &h, 2);
  }
}

// Writes `value`'s bytes at `dst`. With kStream, past the caches where the level has a streaming store of
// that size (x86-64: 16 bytes from SSE2, 32 with AVX, 64 with AVX-512), `dst` then aligned to the size; the
// thread calls StreamFence before the data is handed on. For the state update's present state: written once
// and read at the next token, after the whole model's weights have gone through the caches, so caching it
// only costs its lines' reads for ownership (a third of the traffic a cached update moves).
template <bool kStream, typename V>
MAMBAFUSE_INLINE void Put(char* dst, const V& value) {
#if defined(__SSE2__)
  if constexpr (kStream && sizeof(V) == 16) {
    __m128i v;
    std::memcpy(&v, &value, sizeof v);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
    return;
  }
#endif
#if defined(__AVX__)
  if constexpr (kStream && sizeof(V) == 32) {
    __m256i v;
    std::memcpy(&v, &value, sizeof v);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
    return;
  }
#endif
#if defined(__AVX512F__)
  if constexpr (kStream && sizeof(V) == 64) {
    __m512i v;
    std::memcpy(&v, &value, sizeof v);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
    return;
  }
#endif
  std::memcpy(dst, &value, sizeof value);
}

// Orders this thread's streaming stores before its later stores (the thread pool's completion signal).
MAMBAFUSE_INLINE void StreamFence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Whether Put<true> streams a vector of `bytes` bytes at this level.
constexpr bool StreamsVector(int bytes) {
#if defined(__AVX512F__)
  return bytes == 16 || bytes == 32 || bytes == 64;
#elif defined(__AVX__)
  return bytes == 16 || bytes == 32;
#elif defined(__SSE2__)
  return bytes == 16;
#else
  return bytes < 0;
#endif
}

template <int kHalf>
MAMBAFUSE_INLINE VF LoadVector(const void* p, int64_t i) {
  if constexpr (kHalf == kNone) {
    VF v;
    std::memcpy(&v, static_cast<const char*>(p) + 4 * i, sizeof v);
    return v;
  } else {
    VH h;
    std::memcpy(&h, static_cast<const char*>(p) + 2 * i, sizeof h);
#if defined(MAMBAFUSE_HW_F16)
    if constexpr (kHalf == kF16) return FloatFromF16Hw(h);
#endif
    const VU wide = __builtin_convertvector(h, VU);
    return FromBits<VF>(kHalf == kBF16 ? VU(wide << 16) : F16BitsToFloatBits(wide));
  }
}

template <int kHalf, bool kStream = false>
MAMBAFUSE_INLINE void StoreVector(void* p, int64_t i, VF v) {
  if constexpr (kHalf == kNone) {
    Put<kStream>(static_cast<char*>(p) + 4 * i, v);
  } else if constexpr (kHalf == kBF16) {
    const VH h = __builtin_convertvector(RoundBF16Bits(v) >> 16, VH);
    Put<kStream>(static_cast<char*>(p) + 2 * i, h);
  } else {
#if defined(MAMBAFUSE_HW_F16)
    const VH hw = F16FromFloatHw(v);
    Put<kStream>(static_cast<char*>(p) + 2 * i, hw);
    return;
#endif
    const VU b = RoundF16Bits(v);
    const VU sign = (b >> 16) & 0x8000u;
    const VU a = b & 0x7FFFFFFFu;
    const VU sub = __builtin_convertvector(FromBits<VF>(a) * 16777216.0f, VU);
    VU half = (a - (112u << 23)) >> 13;
    half = a < 0x38800000u ? sub : half;
    half = a >= 0x7F800000u ? (a > 0x7F800000u ? (VU{} + 0x7E00u) : (VU{} + 0x7C00u)) : half;
    const VH h = __builtin_convertvector(half | sign, VH);
    Put<kStream>(static_cast<char*>(p) + 2 * i, h);
  }
}

// Stores v rounded to kHalf and returns the stored value widened back (one conversion for both).
template <int kHalf, bool kStream = false>
MAMBAFUSE_INLINE VF StoreRounded(void* p, int64_t i, VF v) {
#if defined(MAMBAFUSE_HW_F16)
  if constexpr (kHalf == kF16) {
    const VH h = F16FromFloatHw(v);
    Put<kStream>(static_cast<char*>(p) + 2 * i, h);
    return FloatFromF16Hw(h);
  }
#endif
  const VF rounded = RoundTo<kHalf>(v);
  StoreVector<kHalf, kStream>(p, i, rounded);
  return rounded;
}

// The lanes' sum as a tree of halves: the upper half of the lanes added to the lower, down to one lane
// (4 dependent adds for 16 lanes, where a lane-by-lane sum has 15: a decode row of N = 64 is only 4
// vectors). Each step adds lane i + half to lane i, in registers: shuffles, not a copy to memory, which
// would keep the vector being summed in memory for the whole loop that produces it.
template <typename V, size_t... kLo>
MAMBAFUSE_INLINE float SumHalves(V v, std::index_sequence<kLo...>) {
  constexpr size_t kHalf = sizeof...(kLo);
  if constexpr (kHalf == 1) {
    return v[0] + v[1];
  } else {
    const auto lo = __builtin_shufflevector(v, v, kLo...);
    const auto hi = __builtin_shufflevector(v, v, (kLo + kHalf)...);
    return SumHalves(lo + hi, std::make_index_sequence<kHalf / 2>{});
  }
}

MAMBAFUSE_INLINE float SumLanes(VF v) { return SumHalves(v, std::make_index_sequence<kWidth / 2>{}); }

// The HalfKind of an ONNX element type number (1 float, 10 float16, 16 bfloat16).
constexpr int HalfOf(int32_t onnx_type) { return onnx_type == 10 ? kF16 : onnx_type == 16 ? kBF16 : kNone; }

}  // namespace
}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
