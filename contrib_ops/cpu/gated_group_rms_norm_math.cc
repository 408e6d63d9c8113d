// GatedGroupRMSNorm, the per-group math (docs/op.md), written once for every vector width.
//
//   h[j]  = round(gated_type, f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j]))))
//   nf    = 1 / sqrt(sum_j h[j]^2 / group_size + epsilon)
//   O[j]  = round(out_type, f32(W[col]) * f32(round(norm_type, h[j] * nf)))
//
// This file is compiled once per instruction-set level (CMake passes MAMBAFUSE_ISA_NS and the -m flags);
// the dispatcher in gated_group_rms_norm_impl.cc picks the widest one the CPU supports at run time.
//
// Structure: two passes over each group, both reading their inputs in their own types (the half
// conversions are fused into the loads and stores, no conversion pass over a buffer):
//   1. the gate pass: h = y * silu(z) (rounded to gated_type), into an L1-resident buffer of group_size
//      floats, and the sum of h^2 in vector accumulators;
//   2. the norm pass: out = w * (h * nf), through the rounding points, straight into the output.
// For the common type combinations an ordinary group's norm pass runs in one loop with the next group's
// gate pass (FusedPass; two scratch buffers), so that its loads, multiplies and stores fill the slots the
// gate pass's dependency chains leave idle.
// The code is GCC vector extensions of the ISA's width (16 floats for AVX-512, 8 for AVX2, 4 for SSE2,
// NEON and the generic build), with the few instructions a width has that the extensions cannot express
// (half conversions, vscalefps, non-temporal stores) behind small per-ISA helpers. Large outputs (prefill)
// are written with non-temporal stores, and the next group's y and z are prefetched.
//
// silu: with a vector permute (AVX-512, AVX2, NEON, generic), y silu(z) = y z / (1 + e^-z) for |z| <= 86, e^-z
// from a table of 2^(j/N) and a degree-2 or 3 polynomial, 2^e added to the exponent field with integer
// operations (SiluTable: its comment has the error analysis, <= 1.8e-7 + 2.4e-7 |z|/86 relative for e^-z);
// a group with a larger |z| (or NaN, Inf) is computed again by SiluWide. SiluWide (and SSE2, which has no
// permute): sigmoid(z) = 1/(1+t) for z >= 0 and t/(1+t) for z < 0, with t = e^-|z| (never overflows);
// e^x: x = n ln2 + r (|r| <= ln2/2), e^r by a degree-5 minimax polynomial (relative error 1.9e-7 evaluated
// in float32), 2^n applied so that results down to the float subnormals are right. Then one division.
// Together h is within ~5e-7 (relative) of the exact product, inside the float32 budget of 2e-6 and inside
// the window that budget_report allows a gated_dtype rounding to fall either way (fusion/reference/,
// GATED_TIE_WINDOW, 9.5e-7).
//
// Cost (AVX-512, per 16 elements): 7 multiply/FMA instructions in the gate pass and 2 in the norm pass,
// one division, ~19 vector instructions in the gate pass and 5 in the norm pass. On the machine measured
// (AMD Zen 4: one 512-bit FMA or multiply a cycle; a 512-bit division every 6 cycles, which also takes
// the multiply pipes ~1.2 cycles more than a multiply does: benchmarks/pipe_floor.cc) the multiply pipes
// alone need ~10.2 cycles a vector, 1.33 us per 7680-wide row at 3.67 GHz, and the whole mix ~11, 1.46 us;
// the gate pass's chains (~36 cycles from z's load to the sum of squares) fill the out-of-order window
// first. Measured: 2.39 us with the two passes one after the other, 2.14 us interleaved (FusedPass), 2.11 us
// with y z as the numerator, 2.08 us with the shorter denominator chain (SiluTable), 1.98 us with a group's
// fixed cost cut from ~44 to ~28 ns (GatePass, AnyLane), 1.90 us with a group's finish inline and its sum a
// tree (~22 ns a group: GateFinish, SumOfLanes); see benchmarks/RESULTS.md.
//
// Float32 subnormals (x86): an FP instruction with a subnormal operand (DAZ clear) or a subnormal result
// (FTZ clear) takes a microcode assist on Intel cores (~150 cycles per instruction; AMD's handle most of
// them in hardware), and rows whose values decay into the subnormals would pay that on every vector. So no
// subnormal reaches an FP instruction on the usual paths, and none is made by one:
//   - The gate pass runs with MXCSR.DAZ and FTZ set: a subnormal y or z reads as 0 (fast, and wrong), and
//     the pass notes from the raw bits, with integer operations, whether any was subnormal; a result that
//     underflows becomes 0 and raises MXCSR's underflow flag, read after the pass. A pass with neither
//     computed exactly what it computes without DAZ and FTZ.
//   - A group that had subnormal y (or underflowed) is computed again from y' = 2^k y, built without an FP
//     operation on a subnormal (ScaleByPowerOfTwo, or ScaleSubnormals when all y are subnormal; exact), so
//     h' = 2^k h stays normal; nf' = 2^-k nf with eps 4^k in double, so h' nf' = h nf.
//   - The norm pass of an ordinary group runs with neither DAZ nor FTZ (on ordinary data it makes no
//     subnormal: nothing to assist), or, inside FusedPass, in the gate pass's mode: its h were made under
//     FTZ (never subnormal), its w checked for subnormals by the caller (GatedGroupRMSNormArgs's
//     w_subnormal_free; a W with one, or one not checked, keeps the passes apart), and an output that underflows raises the flag read
//     after the pass, upon which that group's norm pass is computed again without DAZ and FTZ. For a
//     scaled group it runs with FTZ only (w is read exactly), computes 2^64 times its outputs, normal
//     floats, and scales them back (ScaleDownBy64): exact where the output is a normal float; where it or
//     the normalized value is subnormal, rounded at 24 bits before the subnormal's rounding, so within
//     2 x 2^-149 of the formula (far inside the float32 budget's floor).
//   - Whatever still underflows (or overflows, scaled), or a subnormal z, is computed again with neither
//     DAZ nor FTZ: exact, at the assists' cost, off the paths of ordinary and of decayed rows.
// The caller's MXCSR is restored on return. The Arm and generic builds compute every pass as written (the
// Arm cores handle subnormals in hardware).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>
#define MAMBAFUSE_MXCSR 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "gated_group_rms_norm_impl.h"

#ifndef MAMBAFUSE_ISA_NS
#define MAMBAFUSE_ISA_NS isa_generic
#endif

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_ps(), which -Wmaybe-uninitialized
// reports once they are inlined here (a known false positive); nothing here reads an undefined lane.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
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

// The per-vector helpers below are inlined into every loop whatever GCC's size budget for the file says
// (with the two silu variants it stopped inlining the half conversions into the norm pass: a call a vector).
#define MAMBAFUSE_ALWAYS_INLINE inline __attribute__((always_inline))

inline VF Splat(float f) { return VF{} + f; }
inline VU SplatU(uint32_t u) { return VU{} + u; }
inline VU Bits(VF v) { return reinterpret_cast<VU>(v); }
inline VF FromBits(VU v) { return reinterpret_cast<VF>(v); }

// --- loads and stores in the element types, widened to / rounded from float -------------------------

MAMBAFUSE_ALWAYS_INLINE VF LoadF32(const void* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

MAMBAFUSE_ALWAYS_INLINE VH LoadHalfBits(const void* p) {
  VH v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

MAMBAFUSE_ALWAYS_INLINE VF BF16ToFloat(VH bits) { return FromBits(__builtin_convertvector(bits, VU) << 16); }

MAMBAFUSE_ALWAYS_INLINE VH FloatToBF16(VF f) {  // round to nearest even; NaN stays a quiet NaN
  const VU u = Bits(f);
  const VU rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const VU quiet_nan = (u >> 16) | 0x0040u;
  const VU result = (u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
  return __builtin_convertvector(result, VH);
}

// Portable float16 <-> float, for the widths without a conversion instruction (SSE2, generic). Exact;
// the subnormal paths use float additions of normal numbers only, so FTZ cannot change them.
[[maybe_unused]] MAMBAFUSE_ALWAYS_INLINE VF F16ToFloatPortable(VH bits) {
  const VU h = __builtin_convertvector(bits, VU);
  const VU sign = (h & 0x8000u) << 16;
  const VU em = (h & 0x7FFFu) << 13;
  const VU exponent = em & 0x0F800000u;
  const VU normal = em + (112u << 23);
  const VU sub = Bits(FromBits(em + (113u << 23)) - Splat(6.103515625e-05f));  // 2^-14 = BitsFloat(113 << 23)
  const VU special = em + (224u << 23);  // exponent 31 -> 255
  VU r = exponent == 0x0F800000u ? special : normal;
  r = exponent == 0u ? sub : r;
  return FromBits(r | sign);
}

[[maybe_unused]] MAMBAFUSE_ALWAYS_INLINE VH FloatToF16Portable(VF f) {  // round to nearest even
  const VU u = Bits(f);
  const VU sign = (u >> 16) & 0x8000u;
  const VU a = u & 0x7FFFFFFFu;
  // |f| >= 65536 (or Inf/NaN): overflow to Inf, NaN stays a quiet NaN. 65520..65535 overflow through the
  // rounding carry of the normal path below.
  const VU big = a > 0x7F800000u ? SplatU(0x7E00u) : SplatU(0x7C00u);
  // |f| < 2^-14: the half is subnormal. Adding 0.5 puts the value's 2^-24 units into the low mantissa
  // bits of the sum, rounded to nearest even by the FPU (a normal result: FTZ does not touch it).
  const VU tiny = Bits(FromBits(a) + 0.5f) - 0x3F000000u;
  const VU normal = (a - (112u << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  VU r = a >= 0x47800000u ? big : normal;
  r = a < 0x38800000u ? tiny : r;
  return __builtin_convertvector(r | sign, VH);
}

MAMBAFUSE_ALWAYS_INLINE VF F16ToFloat(VH bits) {
#if defined(__AVX512F__)
  __m256i raw;
  std::memcpy(&raw, &bits, sizeof raw);
  return reinterpret_cast<VF>(_mm512_cvtph_ps(raw));
#elif defined(__F16C__)
  __m128i raw;
  std::memcpy(&raw, &bits, sizeof raw);
  return reinterpret_cast<VF>(_mm256_cvtph_ps(raw));
#elif defined(__aarch64__)
  uint16x4_t raw;
  std::memcpy(&raw, &bits, sizeof raw);
  return reinterpret_cast<VF>(vcvt_f32_f16(vreinterpret_f16_u16(raw)));
#else
  return F16ToFloatPortable(bits);
#endif
}

MAMBAFUSE_ALWAYS_INLINE VH FloatToF16(VF f) {  // round to nearest even (the conversion instructions ignore FTZ/DAZ)
#if defined(__AVX512F__)
#if defined(__GNUC__) && !defined(__clang__)
  // With {sae} (no MXCSR flags): the instruction ignores FTZ and DAZ, so the underflow flag it raises for
  // a float16 subnormal result says nothing about the FP multiplies whose underflow the passes read from
  // MXCSR; raised, it sent every group with such an output (about half the groups of ordinary rows with
  // a float16 norm_dtype or output_dtype) through the exact pass again. (GCC's intrinsic has no {sae}.)
  __m256i raw;
  __asm__("vcvtps2ph $0x8, %{sae%}, %1, %0" : "=v"(raw) : "v"(reinterpret_cast<__m512>(f)));
#else
  const __m256i raw = _mm512_cvtps_ph(reinterpret_cast<__m512>(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  VH v;
  std::memcpy(&v, &raw, sizeof v);
  return v;
#elif defined(__F16C__)
  const __m128i raw = _mm256_cvtps_ph(reinterpret_cast<__m256>(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VH v;
  std::memcpy(&v, &raw, sizeof v);
  return v;
#elif defined(__aarch64__)
  const uint16x4_t raw = vreinterpret_u16_f16(vcvt_f16_f32(reinterpret_cast<float32x4_t>(f)));
  VH v;
  std::memcpy(&v, &raw, sizeof v);
  return v;
#else
  return FloatToF16Portable(f);
#endif
}

MAMBAFUSE_ALWAYS_INLINE VF Load(const void* p, ElemType type) {
  if (type == ElemType::kFloat16) return F16ToFloat(LoadHalfBits(p));
  if (type == ElemType::kBFloat16) return BF16ToFloat(LoadHalfBits(p));
  return LoadF32(p);
}

// The value rounded to `type` and widened back (exact: the result is representable in float).
MAMBAFUSE_ALWAYS_INLINE VF RoundThrough(VF v, ElemType type) {
  if (type == ElemType::kFloat16) return F16ToFloat(FloatToF16(v));
  if (type == ElemType::kBFloat16) return BF16ToFloat(FloatToBF16(v));
  return v;
}

MAMBAFUSE_ALWAYS_INLINE void Store(void* p, VF v, ElemType type) {
  if (type == ElemType::kFloat16) {
    const VH h = FloatToF16(v);
    std::memcpy(p, &h, sizeof h);
  } else if (type == ElemType::kBFloat16) {
    const VH h = FloatToBF16(v);
    std::memcpy(p, &h, sizeof h);
  } else {
    std::memcpy(p, &v, sizeof v);
  }
}

// Store with a non-temporal hint (x86): the line is written without being read first and without
// evicting the working set, which pays when the output is far larger than the caches (prefill). `p` must
// be aligned to the store's size; the caller fences once after the last one.
MAMBAFUSE_ALWAYS_INLINE void StoreStream(void* p, VF v, ElemType type) {
#if defined(MAMBAFUSE_MXCSR)
  if (type == ElemType::kFloat) {
#if defined(__AVX512F__)
    _mm512_stream_ps(static_cast<float*>(p), reinterpret_cast<__m512>(v));
#elif defined(__AVX2__)
    _mm256_stream_ps(static_cast<float*>(p), reinterpret_cast<__m256>(v));
#else
    _mm_stream_ps(static_cast<float*>(p), reinterpret_cast<__m128>(v));
#endif
    return;
  }
  const VH h = type == ElemType::kFloat16 ? FloatToF16(v) : FloatToBF16(v);
#if defined(__AVX512F__)
  _mm256_stream_si256(static_cast<__m256i*>(p), reinterpret_cast<__m256i>(h));
#elif defined(__AVX2__)
  _mm_stream_si128(static_cast<__m128i*>(p), reinterpret_cast<__m128i>(h));
#else
  long long bits;
  std::memcpy(&bits, &h, sizeof bits);
  _mm_stream_si64(static_cast<long long*>(p), bits);
#endif
#else
  Store(p, v, type);
#endif
}

inline size_t TypeBytes(ElemType t) { return t == ElemType::kFloat ? 4 : 2; }

// A load of the last, partial vector of a group: the remaining elements, zeros after them (a zero y and
// z give h = 0, which adds nothing to the sum of squares).
inline VF LoadPartial(const char* p, ElemType type, int64_t count) {
  alignas(64) char buffer[4 * kWidth] = {};
  std::memcpy(buffer, p, static_cast<size_t>(count) * TypeBytes(type));
  return Load(buffer, type);
}

inline void StorePartial(char* p, VF v, ElemType type, int64_t count) {
  alignas(64) char buffer[4 * kWidth];
  Store(buffer, v, type);
  std::memcpy(p, buffer, static_cast<size_t>(count) * TypeBytes(type));
}

// --- float32 subnormals, kept from the FP instructions (x86; see the file comment) ---------------------

#if defined(MAMBAFUSE_MXCSR)
constexpr bool kSubnormalsAsIntegers = true;
#else
constexpr bool kSubnormalsAsIntegers = false;
#endif

// Per lane, the lowest (|bits| - 1) seen, unsigned: below 0x007FFFFF exactly when some value had |bits| in
// [1, 0x007FFFFF], a subnormal (a zero wraps to the top). Three integer operations a vector.
inline VU NoteSubnormals(VU lowest, VF v) {
  const VU magnitude_less_one = (Bits(v) & 0x7FFFFFFFu) - 1u;
  return magnitude_less_one < lowest ? magnitude_less_one : lowest;
}

// Whether any lane of a comparison's result (0 or all ones) is set: one test, not a branch a lane (a group's
// three checks lane by lane were ~50 scalar instructions; with the state's zeroing, 44 -> 30 ns a group).
MAMBAFUSE_ALWAYS_INLINE bool AnyLane(VI mask) {
#if defined(__AVX512F__)
  const __m512i m = reinterpret_cast<__m512i>(mask);
  return _mm512_test_epi32_mask(m, m) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(mask)) != 0;
#elif defined(MAMBAFUSE_MXCSR)
  return _mm_movemask_ps(reinterpret_cast<__m128>(mask)) != 0;
#elif defined(__aarch64__)
  return vmaxvq_u32(reinterpret_cast<uint32x4_t>(mask)) != 0;
#else
  bool any = false;
  for (int l = 0; l < kWidth; ++l) any |= mask[l] != 0;
  return any;
#endif
}

inline VI SubnormalLanes(VU lowest) { return lowest < 0x007FFFFFu; }
inline bool AnySubnormal(VU lowest) { return AnyLane(SubnormalLanes(lowest)); }
// Lanes whose bits have an exponent bit set (an OR of values' bits: some value was neither zero nor subnormal).
inline VI NormalLanes(VU bits) { return (bits & 0x7F800000u) != 0u; }

// The gate pass's cheaper probe, two integer operations a vector (over the products y * silu(z), see
// GateBlock): per lane the lowest (unsigned) of bits | sign bit, below 0x80800000 when some value was a
// subnormal or a zero. The rare group with a zero is then probed exactly (SubnormalInput).
inline VU NoteZeroOrSubnormal(VU lowest, VF v) {
  const VU negative = Bits(v) | 0x80000000u;
#if defined(MAMBAFUSE_MXCSR) && !defined(__SSE4_1__)
  // SSE2 has no 32-bit minimum (GCC spells one in five instructions): a signed compare (-0 and the
  // negated subnormals are the lowest ints) that clears the lane instead (a 7680-wide row: 14.3 -> 12.5 us).
  return lowest & ~reinterpret_cast<VU>(reinterpret_cast<VI>(negative) < static_cast<int32_t>(0x80800000u));
#else
  return negative < lowest ? negative : lowest;
#endif
}

inline VI ZeroOrSubnormalLanes(VU lowest) { return lowest < 0x80800000u; }
inline bool AnyZeroOrSubnormal(VU lowest) { return AnyLane(ZeroOrSubnormalLanes(lowest)); }

// Only float32 and bfloat16 inputs widen to a float32 subnormal (a float16 subnormal is a normal float).
constexpr bool MayBeSubnormal(ElemType t) { return kSubnormalsAsIntegers && t != ElemType::kFloat16; }

// y * 2^k (k in [0, 127], with max |y| 2^k < 1), exact, and no FP operation reads a subnormal: a
// subnormal lane, m 2^-149, gets the lowest exponent bit set, which makes it the normal 2^-126 + m 2^-149;
// times 2^k (exact) less 2^(k-126) (exact: Sterbenz) that is m 2^(k-149). A lane that this leaves below the
// normals (k too small for it) is flushed to zero by FTZ and raises the underflow flag. A zero keeps its sign.
inline VF ScaleByPowerOfTwo(VF y, float two_to_k, float two_to_k_less_126) {
  const VU bits = Bits(y), sign = bits & 0x80000000u;
  const VI subnormal = (bits & 0x7F800000u) == 0u;  // or zero: 2^k 2^-126 - 2^(k-126) = 0
  const VF lifted = FromBits(bits | (reinterpret_cast<VU>(subnormal) & 0x00800000u));
  const VF offset = FromBits(reinterpret_cast<VU>(subnormal) & (Bits(Splat(two_to_k_less_126)) | sign));
  return FromBits(Bits(lifted * two_to_k - offset) | sign);
}

// y * 2^k for a group whose y are all subnormal or zero (then k >= 126): m 2^-149 becomes m 2^(k-149), the
// integer m converted (exact: m < 2^23) and multiplied by a normal power of two (exact), the sign kept.
// Five vector instructions where ScaleByPowerOfTwo takes nine, with the same bits.
inline VF ScaleSubnormals(VF y, float unit) {
  const VU bits = Bits(y);
  const VF m = __builtin_convertvector(reinterpret_cast<VI>(bits & 0x007FFFFFu), VF);
  return FromBits(Bits(m * unit) | (bits & 0x80000000u));
}

// x * 2^-64, rounded to nearest even, for the outputs of a scaled group's norm pass, where no FP operation
// may make a subnormal. Where the result is normal (|x| >= 2^-62) an FP multiply (exact); below, the
// multiply flushes to +0 (FTZ; it raises the underflow flag, which the caller ignores), and |x| + 2^-62
// rounds |x| to a multiple of 2^-85 (2^-62's ulp) once: the bits of that sum less those of 2^-62 are the
// subnormal's (a carry into 2^-61 gives the smallest normal). The larger of the two as integers is the
// result: for |x| >= 2^-62 the sum is at most 2 |x|, so its bits less 2^-62's are at most those of
// |x| 2^-64; below, the product is 0. Zeros, Inf and NaN stay. (A select on |x| < 2^-62 took one more
// instruction: a decayed 7680-wide row on AVX2, AMD Zen 4, 3.77 -> 3.70 us.)
inline VF ScaleDownBy64(VF x) {
  constexpr float kTwoToMinus62 = 0x1p-62f;
  const VU bits = Bits(x);
  const VF magnitude = FromBits(bits & 0x7FFFFFFFu);
  const VU product = Bits(magnitude * 0x1p-64f);
  const VU tiny = Bits(magnitude + kTwoToMinus62) - Bits(Splat(kTwoToMinus62));
#if defined(MAMBAFUSE_MXCSR) && !defined(__SSE4_1__)
  // SSE2 has no 32-bit unsigned maximum: the select on |x| < 2^-62 (15.65 -> 15.29 us a decayed row).
  const VU larger = magnitude < kTwoToMinus62 ? tiny : product;
#else
  const VU larger = product > tiny ? product : tiny;
#endif
  return FromBits(larger | (bits & 0x80000000u));
}

// Float32 subnormals as signed zeros: what float16 rounds them to (|x| < 2^-126 is far below half of
// float16's smallest subnormal, 2^-25), without handing a subnormal to the conversion instruction.
inline VF SubnormalsToSignedZero(VF x) {
  const VU bits = Bits(x);
  return FromBits((bits & 0x7F800000u) == 0u ? bits & 0x80000000u : bits);
}

// --- silu ---------------------------------------------------------------------------------------------

// a/d for d = 1 + e^-z >= 1 (or NaN): a true division, not a reciprocal estimate refined by Newton steps.
// The divider runs beside the FMA pipes and keeps up with the loop (measured faster than estimate + Newton
// on AVX-512 and AVX2), and a division is exact where the sigmoid saturates: a / 1 is a, so where 1 + e^-z
// rounds to 1 (e^-z below 2^-24) h is y z rounded once, as in the reference (an estimate is off by an ulp
// there, enough to move a product that sits on a gated_dtype rounding tie).
inline VF Divide(VF a, VF d) { return a / d; }

// Degree-5 minimax polynomial of e^r on [-ln2/2, ln2/2] (float32 coefficients; relative error 1.9e-7
// evaluated in float32).
constexpr float kExpC0 = 0x1.000002p+0f, kExpC1 = 0x1.fffff6p-1f, kExpC2 = 0x1.fffd1ap-2f;
constexpr float kExpC3 = 0x1.555a18p-3f, kExpC4 = 0x1.575eeep-5f, kExpC5 = 0x1.0fe5c4p-7f;

// Vectors processed side by side: the silu chain is ~20 dependent instructions, so independent vectors
// interleaved stage by stage keep the pipelines full (the out-of-order window alone does not hold enough
// of them). As many as the register file holds: 32 zmm registers for AVX-512, 16 elsewhere.
constexpr int kUnroll = kWidth == 16 ? 4 : 2;

// silu(z) of kUnroll vectors, in place, for every z (the full range of e^-|z|, down to the subnormals):
// the group's second try when SiluTable saw a z it does not serve, and the only one where there is no
// table lookup (SSE2). Written stage by stage so the instruction stream interleaves them.
__attribute__((always_inline)) inline void SiluWide(VF (&v)[kUnroll]) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  VF x[kUnroll], shifted[kUnroll], n[kUnroll], r[kUnroll], p[kUnroll], t[kUnroll];
  // x = -|z|, clamped to >= -104 (e^-104 rounds to 0; a NaN compares false and stays NaN).
  for (int k = 0; k < kUnroll; ++k) x[k] = FromBits(Bits(v[k]) | 0x80000000u);
  for (int k = 0; k < kUnroll; ++k) x[k] = x[k] < -104.f ? Splat(-104.f) : x[k];
  for (int k = 0; k < kUnroll; ++k) shifted[k] = x[k] * kLog2e + kRoundMagic;
  for (int k = 0; k < kUnroll; ++k) n[k] = shifted[k] - kRoundMagic;  // in [-150, 0]
#if defined(__FMA__)
  // With FMA (these builds contract a - b * c into one instruction) n * ln2 is not rounded, and one
  // constant suffices: float32's ln2 is 1.9e-9 off, so r is off by at most 150 * 1.9e-9 = 2.9e-7, and only
  // where e^x < 2^-100 (n = -150); over the gates of real models (|z| < 20) below 4e-8.
  constexpr float kLn2 = 0.693147180559945309f;
  for (int k = 0; k < kUnroll; ++k) r[k] = x[k] - n[k] * kLn2;
#else
  // Without FMA the product n * ln2 would be rounded (to 4e-6 at n = -115): Cody-Waite's two constants,
  // the first with few enough bits that n * kLn2Hi is exact.
  constexpr float kLn2Hi = 0.693145751953125f;  // 15 significant bits
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  for (int k = 0; k < kUnroll; ++k) r[k] = x[k] - n[k] * kLn2Hi;
  for (int k = 0; k < kUnroll; ++k) r[k] = r[k] - n[k] * kLn2Lo;
#endif
  for (int k = 0; k < kUnroll; ++k) p[k] = r[k] * kExpC5 + kExpC4;
  for (int k = 0; k < kUnroll; ++k) p[k] = p[k] * r[k] + kExpC3;
  for (int k = 0; k < kUnroll; ++k) p[k] = p[k] * r[k] + kExpC2;
  for (int k = 0; k < kUnroll; ++k) p[k] = p[k] * r[k] + kExpC1;
  for (int k = 0; k < kUnroll; ++k) p[k] = p[k] * r[k] + kExpC0;
  for (int k = 0; k < kUnroll; ++k) {
#if defined(__AVX512F__)
    t[k] = reinterpret_cast<VF>(_mm512_scalef_ps(reinterpret_cast<__m512>(p[k]), reinterpret_cast<__m512>(n[k])));
#else
    // 2^(n+64) is a normal float for every n here; the final product by 2^-64 rounds once, into the
    // subnormals where e^x is that small. bits(shifted) = bits(magic) + n, and bits(magic) << 23 wraps to 0.
    const VF scale = FromBits((Bits(shifted[k]) << 23) + (191u << 23));
    t[k] = (p[k] * scale) * 5.42101086242752217e-20f;  // 2^-64
#endif
  }
  // silu(z) = z * num / (1 + t), num = t for z < 0, else 1.
  for (int k = 0; k < kUnroll; ++k) v[k] = v[k] < 0.f ? v[k] * t[k] : v[k];
  for (int k = 0; k < kUnroll; ++k) v[k] = Divide(v[k], 1.f + t[k]);
}

// --- silu with e^-z from a table of 2^(j/N) (every build with a vector permute) ----------------------
//
// For |z| <= 86: y silu(z) = (y z) / (1 + e^-z) directly (e^86 < 2^125: nothing overflows in the
// denominator, and for z < 0 the sum of two positive terms loses no relative accuracy, so h keeps its full
// relative accuracy for z << 0; for z large 1 + e^-z rounds to 1 and h = y z rounded once, as in the
// reference). No select: one product y z, which waits on nothing but the loads, and one division, the last
// step of the chain (z / (1 + t) first and y times it after measured 3.13 -> 2.97 us per 7680-wide row on
// AVX2, 2.15 -> 2.11 on AVX-512, AMD Zen 4: the product after the division lengthened the chain the out-of-
// order window holds). A y z that overflows (|y| > 3.9e36) makes the sum not finite, and such a group is
// computed again with SiluWide, which multiplies y last.
// e^x, x = -z: k = round(x N / ln2), x = k ln2/N + r with |r| <= ln2/(2N); k = N e + j (j in [0, N)) and
// e^x = 2^e 2^(j/N) e^r. 2^(j/N) comes from a table of N entries held in one or two vectors (vpermt2d on
// AVX-512, vpermd on AVX2, tbl on NEON; not the multiply pipes), 2^e is added to its exponent field with
// integer operations (the table holds bits(2^(j/N)) - j 2^(23 - log2 N), so adding
// bits(shifted) << (23 - log2 N) = k 2^(23 - log2 N) leaves bits(2^(j/N)) + e 2^23: a float T 2^e, normal
// for |e| <= 125), and e^r is 1 + p(r), p(r) = r q(r) a small minimax polynomial (evaluated in s = -r:
// s = z + k ln2/N is one FMA). The denominator is then (1 + T) + (T s) q(s): one FMA after q, with 1 + T
// and T s formed beside the polynomial (T + T p and then 1 + that made a chain three instructions longer:
// 2.15 -> 2.08 us per 7680-wide row on AVX-512, 2.97 -> 2.83 on AVX2, AMD Zen 4). Per vector (AVX-512)
// the silu takes 5 multiply/FMA instructions (6 with a degree-3 polynomial) and 14 vector instructions in
// all, the division and the note of a wide z included, where the degree-5 polynomial with vscalefps, the
// clamp, the select and the numerator product took 9 and 15.
//
// N and p per width (minimax for the relative error of e^r on |r| <= ln2/(2N), coefficients rounded to
// float32, the error measured in float64 at 4e5 points):
//   AVX-512 (N = 32, two vectors): q = c1 + c2 r, 5.4e-8 (0.45 float32 ulp of 1, u = 2^-23);
//   AVX2 (N = 8, one vector) and 4 lanes (N = 8, two vectors): q = c1 + c2 r + c3 r^2, 2.7e-8.
// (AVX2 had N = 16 in two vectors: two vpermd, a mask and a blend where one vpermd does now, with the same
// polynomial degree: 2.83 -> 2.47 us per row, AMD Zen 4.)
// Error of D = 1 + e^-z (relative): the table entry rounded to nearest, <= u/2 = 6.0e-8 of T; the
// polynomial, <= 5.4e-8 of e^-z; s: k fl(ln2/N) differs from k ln2/N by |k| 1.9e-9/N <= 2.4e-7 |z|/86 (an
// absolute error of s, hence relative of e^-z), < 5.5e-8 for |z| < 20 (the gates of real models); the
// FMA that forms s rounds at |s|'s scale (< 1e-9); T s rounded, < 1e-9 (|s q| <= 0.011); 1 + T rounded,
// <= u/2 of 1 + T, which is within 1.1 % of D; the final FMA, <= u/2 of D. Total <= 2.4e-7 + 2.4e-7 |z|/86
// of D (the same class as the degree-5 polynomial's 1.9e-7 + 2.9e-7 |z|/104 for e^-z); then y z and the
// division round once each. Measured (SiluTable against long double over 1e7 z, uniform): max relative
// error 4.3e-7 for |z| <= 86 (at z = -84.6) and 2.2e-7 for |z| <= 8 on AVX-512, 3.8e-7 and 1.9e-7 on AVX2,
// each the same as or within 0.2e-7 of the T + T p form's; the outputs' mean error over 5e5 gates of random
// rows moved 0.72 -> 0.76 ulp (AVX-512) and 0.67 -> 0.71 ulp (AVX2), the largest 3.98e-7 and 3.82e-7
// relative. Inside the float32 budget (2e-6) and the gated_dtype tie window (9.5e-7) with the products
// after it (the file comment's ~5e-7 for h holds).
// |k| > 86 N / ln2 (|z| > 86.0065, where 2^e leaves the normals) or an infinite z: those lanes' results are
// not used; the pass keeps the largest |k| (a maximum over the k it computes anyway, and the absolute
// value's mask) and the group is computed again with SiluWide, the full range as before. Such gates
// (|silu(z)| < 1e-35 for z < -86) are far outside what real models produce. A NaN z is not noted: its k
// is NaN, which the maximum passes over, and its silu comes out NaN either way (NaN / (1 + t) for any t),
// as the reference's does.
#if defined(MAMBAFUSE_MXCSR) && !defined(__AVX2__)
constexpr bool kExpTable = false;  // SSE2 has no variable permute: GCC would do the lookup lane by lane
#else
constexpr bool kExpTable = true;
#endif
constexpr int kExpTableSize = kWidth == 8 ? 8 : 2 * kWidth;  // N: one vector of entries on AVX2, else two
constexpr float kMaxTableK = 86.f * kExpTableSize / 0.693147180559945309f;  // |k| above it is not served
// Lanes of SiluTable's largest |k| that it does not serve (a NaN compares false: NaN k are passed over).
inline VI UnservedLanes(VF widest) { return widest > kMaxTableK; }

#if defined(__AVX512F__)
// bits(2^(j/32)) - (j << 18), j = 0..31, 2^(j/32) rounded to nearest float.
alignas(64) constexpr uint32_t kExp2Table[32] = {
    0x3F800000u, 0x3F7ECD87u, 0x3F7DAAC3u, 0x3F7C980Fu, 0x3F7B95C2u, 0x3F7AA43Au, 0x3F79C3D3u, 0x3F78F4F0u,
    0x3F7837F0u, 0x3F778D3Au, 0x3F76F532u, 0x3F767043u, 0x3F75FED7u, 0x3F75A15Bu, 0x3F75583Fu, 0x3F7523F6u,
    0x3F7504F3u, 0x3F74FBAFu, 0x3F7508A4u, 0x3F752C4Du, 0x3F75672Au, 0x3F75B9BEu, 0x3F76248Cu, 0x3F76A81Eu,
    0x3F7744FDu, 0x3F77FBB8u, 0x3F78CCDFu, 0x3F79B907u, 0x3F7AC0C7u, 0x3F7BE4BAu, 0x3F7D257Du, 0x3F7E83B3u};
// e^r = 1 + r (c1 + c2 r), c1 = 0x1.0000f6p+0, c2 = 0x1.fffffep-2; in s = -r: 1 + s (-c1 + c2 s).
constexpr float kQ1 = -0x1.0000f6p+0f, kQ2 = 0x1.fffffep-2f, kQ3 = 0.f;
constexpr int kExpTableDegree = 2;
#else
// bits(2^(j/8)) - (j << 20), j = 0..7 (AVX2: one vector; 4 lanes: two).
alignas(64) constexpr uint32_t kExp2Table[8] = {0x3F800000u, 0x3F7B95C2u, 0x3F7837F0u, 0x3F75FED7u,
                                               0x3F7504F3u, 0x3F75672Au, 0x3F7744FDu, 0x3F7AC0C7u};
// c1 = 1, c2 = 0x1.000886p-1, c3 = 0x1.5548dep-3, in s = -r as above.
constexpr float kQ1 = -1.f, kQ2 = 0x1.000886p-1f, kQ3 = -0x1.5548dep-3f;
constexpr int kExpTableDegree = 3;
#endif
constexpr int kTableVectors = kExpTableSize / kWidth;
static_assert(sizeof kExp2Table == kTableVectors * sizeof(VF), "the table fills one or two vectors");

// max(widest, |n|) for widest >= 0, one instruction where there is one. A NaN n leaves widest as it was, or
// makes it NaN (AVX-512's vrangeps): either way the lane is not noted (see above).
MAMBAFUSE_ALWAYS_INLINE VF LargerMagnitude(VF widest, VF n) {
#if defined(__AVX512DQ__)
  return reinterpret_cast<VF>(_mm512_range_ps(reinterpret_cast<__m512>(n), reinterpret_cast<__m512>(widest), 0x0B));
#else
  const VF magnitude = FromBits(Bits(n) & 0x7FFFFFFFu);
#if defined(__AVX__)
  return reinterpret_cast<VF>(_mm256_max_ps(reinterpret_cast<__m256>(magnitude), reinterpret_cast<__m256>(widest)));
#else
  return magnitude > widest ? magnitude : widest;  // a NaN compares false
#endif
#endif
}

// num / (1 + e^-z) of kUnroll vectors (num = y z: y silu(z)), into v, which holds z, for |z| <= 86;
// `widest` keeps the largest |k| (NaN k passed over) for the caller's check against kMaxTableK.
__attribute__((always_inline)) inline void SiluTable(VF (&v)[kUnroll], const VF (&num)[kUnroll], VF& widest) {
  constexpr int kShift = 23 - (kExpTableSize == 32 ? 5 : kExpTableSize == 16 ? 4 : 3);
  constexpr float kMinusNLog2e = -1.44269504088896341f * kExpTableSize;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  VU table[kTableVectors];
  std::memcpy(table, kExp2Table, sizeof table);
  VF shifted[kUnroll], n[kUnroll], s[kUnroll], q[kUnroll], t[kUnroll];
  for (int k = 0; k < kUnroll; ++k) shifted[k] = v[k] * kMinusNLog2e + kRoundMagic;
  for (int k = 0; k < kUnroll; ++k) n[k] = shifted[k] - kRoundMagic;  // k = round(-z N / ln2), |k| <= 3970
  for (int k = 0; k < kUnroll; ++k) widest = LargerMagnitude(widest, n[k]);
#if defined(__FMA__)
  constexpr float kLn2OverN = 0.693147180559945309f / kExpTableSize;  // exact division by a power of two
  for (int k = 0; k < kUnroll; ++k) s[k] = v[k] + n[k] * kLn2OverN;    // s = -r
#else
  // Cody-Waite: the first constant has 12 significant bits, so n * kLn2Hi (|n| < 2^10 here) is exact.
  constexpr float kLn2Hi = 0x1.62ep-1f / kExpTableSize;
  constexpr float kLn2Lo = static_cast<float>((0.693147180559945309417 - 0x1.62ep-1) / kExpTableSize);
  for (int k = 0; k < kUnroll; ++k) s[k] = v[k] + n[k] * kLn2Hi;
  for (int k = 0; k < kUnroll; ++k) s[k] = s[k] + n[k] * kLn2Lo;
#endif
  // T 2^e: the permute reads the low log2(N) bits of bits(shifted), k mod N (bits(magic) has none below
  // bit 22; two's complement), and bits(shifted) << kShift is k << kShift (bits(magic) shifts out).
  for (int k = 0; k < kUnroll; ++k) {
    const VU index = Bits(shifted[k]);
    if constexpr (kTableVectors == 1) {
      t[k] = FromBits(__builtin_shuffle(table[0], index) + (index << kShift));
    } else {
      t[k] = FromBits(__builtin_shuffle(table[0], table[kTableVectors - 1], index) + (index << kShift));
    }
  }
  if constexpr (kExpTableDegree == 2) {
    for (int k = 0; k < kUnroll; ++k) q[k] = s[k] * kQ2 + kQ1;
  } else {
    for (int k = 0; k < kUnroll; ++k) q[k] = s[k] * kQ3 + kQ2;
    for (int k = 0; k < kUnroll; ++k) q[k] = q[k] * s[k] + kQ1;
  }
  VF ts[kUnroll], one_t[kUnroll];
  for (int k = 0; k < kUnroll; ++k) ts[k] = t[k] * s[k];
  for (int k = 0; k < kUnroll; ++k) one_t[k] = 1.f + t[k];
  for (int k = 0; k < kUnroll; ++k) v[k] = Divide(num[k], ts[k] * q[k] + one_t[k]);  // 1 + e^-z
}

// --- the two passes -----------------------------------------------------------------------------------

template <ElemType T>
struct Type {
  static constexpr ElemType value = T;
  static constexpr size_t bytes = T == ElemType::kFloat ? 4 : 2;
};

// Calls f(Type<t>{}) with t as a compile-time constant (a switch, not an indirect call).
template <class F>
inline auto WithType(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kFloat16: return f(Type<ElemType::kFloat16>{});
    case ElemType::kBFloat16: return f(Type<ElemType::kBFloat16>{});
    case ElemType::kFloat: break;
  }
  return f(Type<ElemType::kFloat>{});
}

// How the gate pass takes y: as it is, scaled by 2^k (ScaleByPowerOfTwo), or scaled by 2^k when every y
// of the group is subnormal or zero (ScaleSubnormals; the pass checks that it is, see GateSums::misfit_y).
enum class YScaling { kNone, kAny, kSubnormal };

// Whether an input of the group is a float32 subnormal: y (unless kScaled: its scaled form is never read
// as a subnormal, see ScaleByPowerOfTwo) or z.
template <ElemType Y, ElemType Z, YScaling kScaled>
__attribute__((noinline)) bool SubnormalInput(const char* y, const char* z, int64_t n) {
  constexpr size_t yb = Type<Y>::bytes, zb = Type<Z>::bytes;
  constexpr bool kProbeY = MayBeSubnormal(Y) && kScaled == YScaling::kNone;
  VU lowest = ~VU{};
  for (int64_t j = 0; j < n; j += kWidth) {
    const int64_t count = n - j < kWidth ? n - j : kWidth;
    if (kProbeY) {
      lowest = NoteSubnormals(lowest, count == kWidth ? Load(y + j * yb, Y) : LoadPartial(y + j * yb, Y, count));
    }
    if (MayBeSubnormal(Z)) {
      lowest = NoteSubnormals(lowest, count == kWidth ? Load(z + j * zb, Z) : LoadPartial(z + j * zb, Z, count));
    }
  }
  return AnySubnormal(lowest);
}

struct GateSums {
  float sum_sq;          // sum(h^2)
  bool subnormal_input;  // a y or z was a float32 subnormal (x86: read as 0 under DAZ)
  bool wide_z = false;   // SiluTable saw a z it does not serve (|z| > 86.0065, Inf): h is not to be used
  bool misfit_y = false;  // YScaling::kSubnormal: not every y subnormal or zero: h is not to be used
};

// y * 2^k for the scaled gate pass: the two powers of two ScaleByPowerOfTwo takes (k in [0, 127]), and
// 2^(k-149) for ScaleSubnormals (normal for k >= 23, the only k it is used with).
struct YScale {
  float two_to_k = 1.f;
  float two_to_k_less_126 = 0x1p-126f;
  float subnormal_unit = 0x1p-149f * 0x1p+23f;
  static YScale Of(int k) {
    YScale scale;
    const auto two_to_k = static_cast<uint32_t>(127 + k) << 23, less_126 = static_cast<uint32_t>(1 + k) << 23;
    std::memcpy(&scale.two_to_k, &two_to_k, sizeof two_to_k);
    std::memcpy(&scale.two_to_k_less_126, &less_126, sizeof less_126);
    if (k >= 23) {
      const auto unit = static_cast<uint32_t>(k - 22) << 23;
      std::memcpy(&scale.subnormal_unit, &unit, sizeof unit);
    }
    return scale;
  }
};

// The bits of y ORed, noted by the gate pass with YScaling::kSubnormal only (a member in every pass's
// state made GCC keep or spill one more register in the interleaved loop: 2.47 -> 2.68 us per AVX2 row).
template <YScaling kScaled>
struct NotedYBits {};
template <>
struct NotedYBits<YScaling::kSubnormal> {
  VU y_bits = VU{};  // an exponent bit: a y ScaleSubnormals misreads
};

// The gate pass's running state over one group: the sums of h^2 per unrolled vector and the probes.
template <YScaling kScaled = YScaling::kNone>
struct GateState : NotedYBits<kScaled> {
  VF acc[kUnroll] = {};
  VU lowest = ~VU{};        // NoteZeroOrSubnormal's running minimum over the products y * silu(z)
  VU exact_lowest = ~VU{};  // NoteSubnormals' over the zero-padded last vector
  VF widest = VF{};         // SiluTable's largest |k|
};

// y and z two groups (at least 2048 elements) ahead of block j, into L2 (the next items are contiguous in
// memory): in prefill memory then streams while this group computes, instead of waiting between the
// compute phases (measured: 60 -> 75 % of ORT's Add bandwidth at 2048 x 8192 fp32, one thread; one group
// ahead into L1 was the 60 %). Past the end of the tensor a prefetch is only a hint, never a fault.
template <ElemType Y, ElemType Z>
MAMBAFUSE_ALWAYS_INLINE void PrefetchAhead(const char* y, const char* z, int64_t n, int64_t j) {
  constexpr size_t yb = Type<Y>::bytes, zb = Type<Z>::bytes, step = kWidth * kUnroll;
  const int64_t ahead = 2 * n > 2048 ? 2 * n : 2048;
  for (size_t line = 0; line < step * yb; line += 64) __builtin_prefetch(y + (ahead + j) * yb + line, 0, 1);
  for (size_t line = 0; line < step * zb; line += 64) __builtin_prefetch(z + (ahead + j) * zb + line, 0, 1);
}

// y silu(z) of kUnroll vectors, into v (which holds z): by SiluWide and then the product with y (kWide), or
// by SiluTable from y z.
template <bool kWide, class State>
MAMBAFUSE_ALWAYS_INLINE void GatedSilu(VF (&v)[kUnroll], const VF (&y)[kUnroll], State& state) {
  if constexpr (kWide) {
    SiluWide(v);
    for (int k = 0; k < kUnroll; ++k) v[k] = y[k] * v[k];
  } else {
    VF num[kUnroll];
    for (int k = 0; k < kUnroll; ++k) num[k] = y[k] * v[k];
    SiluTable(v, num, state.widest);
  }
}

// y as the gate pass takes it (see YScaling).
template <YScaling kScaled>
MAMBAFUSE_ALWAYS_INLINE VF ScaleY(VF y, const YScale& scale) {
  if constexpr (kScaled == YScaling::kAny) return ScaleByPowerOfTwo(y, scale.two_to_k, scale.two_to_k_less_126);
  if constexpr (kScaled == YScaling::kSubnormal) return ScaleSubnormals(y, scale.subnormal_unit);
  return y;
}

// One block of kUnroll full vectors at element j: h = round(G, y * silu(z)) into `gated`, h^2 summed.
// kScaled: y is scaled by 2^k first (see ScaleByPowerOfTwo). kWide: silu by SiluWide (every z), else by
// SiluTable (then the state's widest says whether the result stands).
template <ElemType Y, ElemType Z, ElemType G, YScaling kScaled, bool kWide>
MAMBAFUSE_ALWAYS_INLINE void GateBlock(const char* y, const char* z, float* __restrict gated, int64_t j,
                                       YScale scale, GateState<kScaled>& state) {
  constexpr size_t yb = Type<Y>::bytes, zb = Type<Z>::bytes;
  // Under DAZ a subnormal y or z reads as 0, and the product y * silu(z) comes out +-0 (or NaN, for an
  // infinite other factor: GateFinish looks at a sum that is not finite too); so the product is probed,
  // one probe for both inputs.
  constexpr bool kProbe = (MayBeSubnormal(Y) && kScaled == YScaling::kNone) || MayBeSubnormal(Z);
  VF v[kUnroll], yv[kUnroll];
  for (int k = 0; k < kUnroll; ++k) v[k] = Load(z + (j + k * kWidth) * zb, Z);
  for (int k = 0; k < kUnroll; ++k) {
    yv[k] = Load(y + (j + k * kWidth) * yb, Y);
    if constexpr (kScaled == YScaling::kSubnormal) state.y_bits |= Bits(yv[k]);
    yv[k] = ScaleY<kScaled>(yv[k], scale);
  }
  GatedSilu<kWide>(v, yv, state);
  for (int k = 0; k < kUnroll; ++k) {
    if (kProbe) state.lowest = NoteZeroOrSubnormal(state.lowest, v[k]);
    const VF h = RoundThrough(v[k], G);  // rounding point 0
    std::memcpy(gated + j + k * kWidth, &h, sizeof h);
    state.acc[k] += h * h;
  }
}

// The elements [j, n) after the last full block, one (possibly partial) vector at a time.
template <ElemType Y, ElemType Z, ElemType G, YScaling kScaled, bool kWide>
void GateRest(const char* y, const char* z, float* __restrict gated, int64_t j, int64_t n, YScale scale,
              GateState<kScaled>& state) {
  constexpr size_t yb = Type<Y>::bytes, zb = Type<Z>::bytes;
  constexpr bool kProbeY = MayBeSubnormal(Y) && kScaled == YScaling::kNone;
  for (; j < n; j += kWidth) {
    const int64_t count = n - j < kWidth ? n - j : kWidth;
    VF v[kUnroll] = {}, yv[kUnroll] = {};
    v[0] = count == kWidth ? Load(z + j * zb, Z) : LoadPartial(z + j * zb, Z, count);
    if (MayBeSubnormal(Z)) state.exact_lowest = NoteSubnormals(state.exact_lowest, v[0]);
    yv[0] = count == kWidth ? Load(y + j * yb, Y) : LoadPartial(y + j * yb, Y, count);
    if (kProbeY) state.exact_lowest = NoteSubnormals(state.exact_lowest, yv[0]);
    if constexpr (kScaled == YScaling::kSubnormal) state.y_bits |= Bits(yv[0]);  // zero padded
    yv[0] = ScaleY<kScaled>(yv[0], scale);
    GatedSilu<kWide>(v, yv, state);
    const VF h = RoundThrough(v[0], G);
    std::memcpy(gated + j, &h, static_cast<size_t>(count) * sizeof(float));
    state.acc[0] += h * h;
  }
}

// The sum of every lane of the kUnroll accumulators as a tree, the vectors pairwise and then halves of
// the width: ~6 dependent additions where a sum lane by lane took kUnroll - 1 + kWidth (18 on AVX-512),
// on the path from a group's last vector to the next group's 1/rms (and to the checks below).
MAMBAFUSE_ALWAYS_INLINE float SumOfLanes(const VF (&acc)[kUnroll]) {
  VF v[kUnroll];
  for (int k = 0; k < kUnroll; ++k) v[k] = acc[k];
  for (int half = kUnroll / 2; half >= 1; half /= 2) {
    for (int k = 0; k < half; ++k) v[k] += v[k + half];
  }
#if defined(MAMBAFUSE_MXCSR)
#if defined(__AVX512F__)
  const __m512 whole = reinterpret_cast<__m512>(v[0]);
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(whole),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(whole), 1)));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
#elif defined(__AVX2__)
  const __m256 whole = reinterpret_cast<__m256>(v[0]);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(whole), _mm256_extractf128_ps(whole, 1));
#else
  const __m128 four = reinterpret_cast<__m128>(v[0]);
#endif
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
#elif defined(__aarch64__)
  return vaddvq_f32(reinterpret_cast<float32x4_t>(v[0]));
#else
  float sum = 0.f;
  for (int l = 0; l < kWidth; ++l) sum += v[0][l];
  return sum;
#endif
}

// What the probes found, given the group's sum of h^2 (GateFinish): called where a probe saw something.
template <ElemType Y, ElemType Z, YScaling kScaled, bool kWide>
__attribute__((noinline)) GateSums GateChecks(const char* y, const char* z, int64_t n, GateState<kScaled>& state,
                                              float sum) {
  if constexpr (kScaled == YScaling::kSubnormal) {
    if (AnyLane(NormalLanes(state.y_bits))) return {sum, false, false, true};
  }
  if constexpr (!kWide) {
    const bool wide_z = AnyLane(UnservedLanes(state.widest));
    // A sum that is not finite: y z may have overflowed where y silu(z) does not; SiluWide's order decides.
    if (wide_z || !std::isfinite(sum)) return {sum, false, true};
  }
  if (!kSubnormalsAsIntegers) return {sum, false};
  const bool maybe = AnyZeroOrSubnormal(state.lowest) || !std::isfinite(sum);
  const bool subnormal = AnySubnormal(state.exact_lowest) || (maybe && SubnormalInput<Y, Z, kScaled>(y, z, n));
  return {sum, subnormal};
}

// The group's sum of h^2 and what the probes found. Where none found anything (nearly always: a group that
// stands) one vector test says so, inline: the calls of GateChecks for every group and their checks one
// after another were ~13 ns of a group's ~29 (AVX-512, Zen 4).
template <ElemType Y, ElemType Z, YScaling kScaled, bool kWide>
MAMBAFUSE_ALWAYS_INLINE GateSums GateFinish(const char* y, const char* z, int64_t n, GateState<kScaled>& state) {
  const float sum = SumOfLanes(state.acc);
  VI found = VI{};
  if constexpr (kScaled == YScaling::kSubnormal) found |= NormalLanes(state.y_bits);
  if constexpr (!kWide) found |= UnservedLanes(state.widest);
  if constexpr (kSubnormalsAsIntegers) found |= ZeroOrSubnormalLanes(state.lowest) | SubnormalLanes(state.exact_lowest);
  if (__builtin_expect(!AnyLane(found) && std::isfinite(sum), 1)) return {sum, false};
  return GateChecks<Y, Z, kScaled, kWide>(y, z, n, state, sum);
}

// h = round(G, y * silu(z)) into `gated`, and the sum of h^2 (see GateBlock for kScaled and kWide). Not
// inlined: RunItems calls it in three places, and inlined there it measured 7 % slower (AVX-512, Zen 4)
// than called.
template <ElemType Y, ElemType Z, ElemType G, YScaling kScaled = YScaling::kNone, bool kWide = !kExpTable>
__attribute__((noinline)) GateSums GatePass(const char* y, const char* z, float* __restrict gated, int64_t n,
                                            YScale scale = {}) {
  constexpr int64_t step = kWidth * kUnroll;
  int64_t j = 0;
  GateState<kScaled> live;  // does not escape: GCC keeps it in registers through the loop (state would be spilled)
  for (; j + step <= n; j += step) {
    PrefetchAhead<Y, Z>(y, z, n, j);
    GateBlock<Y, Z, G, kScaled, kWide>(y, z, gated, j, scale, live);
  }
  // A copy for the calls below, made once here (declared before the loop, it was zeroed every call: rep stos).
  GateState<kScaled> state = live;
  if (j < n) GateRest<Y, Z, G, kScaled, kWide>(y, z, gated, j, n, scale, state);
  return GateFinish<Y, Z, kScaled, kWide>(y, z, n, state);
}

// The bits of max |y| over a group, as integers (no FP operation reads a subnormal: under DAZ it would read
// 0; the same order as the floats'; a NaN counts as larger than Inf, its group is NaN anyway), four
// independent accumulators (one would wait on its own latency every vector).
template <ElemType Y>
uint32_t MaxAbsBits(const char* y, int64_t n) {
  const auto fold = [](VU m, VF v) {
    const VU bits = Bits(v) & 0x7FFFFFFFu;
    return bits > m ? bits : m;
  };
  VU m[4] = {};
  int64_t j = 0;
  for (; j + 4 * kWidth <= n; j += 4 * kWidth) {
    for (int k = 0; k < 4; ++k) m[k] = fold(m[k], Load(y + (j + k * kWidth) * Type<Y>::bytes, Y));
  }
  for (; j < n; j += kWidth) {
    const int64_t count = n - j < kWidth ? n - j : kWidth;
    m[0] = fold(m[0], LoadPartial(y + j * Type<Y>::bytes, Y, count));
  }
  for (int k = 1; k < 4; ++k) m[0] = m[k] > m[0] ? m[k] : m[0];
  uint32_t result = 0;
  for (int l = 0; l < kWidth; ++l) result = m[0][l] > result ? m[0][l] : result;
  return result;
}

// out = round(O, w * round(N, h * nf)) for one vector, as stored in S (O, or float holding values rounded
// to O). kScaledDown (N float only): h * nf is 2^64 times the value, and the product is scaled back by
// ScaleDownBy64 before the rounding to O.
template <ElemType N, ElemType O, ElemType S, bool kScaledDown = false>
MAMBAFUSE_ALWAYS_INLINE VF NormValue(VF h, VF weight, float inv_rms) {
  static_assert(!kScaledDown || N == ElemType::kFloat, "a norm_dtype rounding needs the value at its own scale");
  const VF normed = RoundThrough(h * inv_rms, N);  // rounding point 1: norm_dtype
  VF product = weight * normed;
  if (kScaledDown) {
    // Both rounding points at 24 bits, 2^64 too large; a subnormal output is rounded again in
    // ScaleDownBy64. Rounding normed and the product on the subnormals' grid as the formula does (|a b| +
    // 2^-62 by FMA, less 2^-62) measured 4.0 -> 5.2 us per decayed 7680-wide row (AVX-512), past the 1.5x
    // of an ordinary row; the double rounding stays within 2 ulps of 2^-149 (the budget's floor is
    // 2e-6 x 2^-126).
    product = ScaleDownBy64(product);
    if (O == ElemType::kFloat16) product = SubnormalsToSignedZero(product);
  }
  return S == O ? product : RoundThrough(product, O);  // rounding point 2, when stored widened
}

// NormValue over the elements [0, n) of a group, straight into `out`.
template <ElemType W, ElemType N, ElemType O, ElemType S, bool kScaledDown = false>
void NormPass(const float* __restrict gated, float inv_rms, const char* w, char* out, int64_t n, bool stream) {
  constexpr size_t wb = Type<W>::bytes, ob = Type<S>::bytes;
  const auto value = [inv_rms](VF h, VF weight) { return NormValue<N, O, S, kScaledDown>(h, weight, inv_rms); };
  int64_t j = 0;
  if (stream) {
    for (; j + kWidth <= n; j += kWidth) {
      StoreStream(out + j * ob, value(LoadF32(gated + j), Load(w + j * wb, W)), S);
    }
  }
  for (; j + kWidth <= n; j += kWidth) {
    Store(out + j * ob, value(LoadF32(gated + j), Load(w + j * wb, W)), S);
  }
  if (j < n) {
    const int64_t count = n - j;
    alignas(64) float tail[kWidth] = {};
    std::memcpy(tail, gated + j, static_cast<size_t>(count) * sizeof(float));
    StorePartial(out + j * ob, value(LoadF32(tail), LoadPartial(w + j * wb, W, count)), S, count);
  }
}

// The norm pass of one group (its h in `prev`, its 1/rms, w and out) interleaved, block by block, with
// the gate pass of the next group (y, z, into `gated`): one loop over both, so that the norm pass's loads,
// multiplies and stores fill the slots the gate pass's long dependency chains leave idle (measured on
// AMD Zen 4, AVX-512: 2.39 -> 2.14 us per 7680-wide fp32 row; the same two passes one after the other
// in the same order gained nothing). The gate part is GateBlock / GateRest as in GatePass, the norm part
// NormValue as in NormPass, so each computes the same bits as it does alone. Never with kScaled or a
// scaled-down norm pass (those groups take RunItems's other paths).
template <ElemType Y, ElemType Z, ElemType G, ElemType W, ElemType N, ElemType O, ElemType S>
__attribute__((noinline)) GateSums FusedPass(const char* y, const char* z, float* __restrict gated, int64_t n,
                                             const float* __restrict prev, float inv_rms, const char* w, char* out,
                                             bool stream) {
  constexpr int64_t step = kWidth * kUnroll;
  constexpr size_t wb = Type<W>::bytes, ob = Type<S>::bytes;
  int64_t j = 0;
  GateState<> live;  // in registers through the loop, as in GatePass
  for (; j + step <= n; j += step) {
    PrefetchAhead<Y, Z>(y, z, n, j);
    GateBlock<Y, Z, G, YScaling::kNone, !kExpTable>(y, z, gated, j, {}, live);
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = j + k * kWidth;
      const VF o = NormValue<N, O, S>(LoadF32(prev + i), Load(w + i * wb, W), inv_rms);
      if (stream) {
        StoreStream(out + i * ob, o, S);
      } else {
        Store(out + i * ob, o, S);
      }
    }
  }
  GateState<> state = live;  // as in GatePass
  if (j < n) GateRest<Y, Z, G, YScaling::kNone, !kExpTable>(y, z, gated, j, n, {}, state);
  if (j < n) NormPass<W, N, O, S>(prev + j, inv_rms, w + j * wb, out + j * ob, n - j, stream);
  return GateFinish<Y, Z, YScaling::kNone, !kExpTable>(y, z, n, state);
}

// The norm pass for the run-time types: nested switches down to a direct call of one instantiation.
// scaled_down (norm float only): the outputs are computed 2^64 too large and scaled back.
#if defined(MAMBAFUSE_MXCSR) && !defined(__AVX2__)
// Called, not inlined, in the SSE2 build: inlined into RunItems's two call sites the portable float16
// conversions measured 45.0 us per 7680-wide float16 row against 41.7 called (AMD Zen 4). In the AVX2 and
// AVX-512 builds inlining measured the same or faster.
__attribute__((noinline))
#endif
void NormPassFor(ElemType w_type, ElemType norm, ElemType out_type, ElemType store, const float* gated,
                 float inv_rms, const char* w, char* out, int64_t n, bool stream, bool scaled_down = false) {
  WithType(w_type, [&](auto wt) {
    WithType(norm, [&](auto nt) {
      WithType(out_type, [&](auto ot) {
        constexpr ElemType kW = decltype(wt)::value, kN = decltype(nt)::value, kO = decltype(ot)::value;
        if constexpr (kN == ElemType::kFloat && kSubnormalsAsIntegers) {
          if (scaled_down) {
            if (store == kO) {
              NormPass<kW, kN, kO, kO, true>(gated, inv_rms, w, out, n, stream);
            } else {
              NormPass<kW, kN, kO, ElemType::kFloat, true>(gated, inv_rms, w, out, n, stream);
            }
            return;
          }
        }
        if (store == kO) {
          NormPass<kW, kN, kO, kO>(gated, inv_rms, w, out, n, stream);
        } else {
          NormPass<kW, kN, kO, ElemType::kFloat>(gated, inv_rms, w, out, n, stream);
        }
      });
    });
  });
}

// --- MXCSR: flush-to-zero and denormals-are-zero with detection (see the file comment) -----------------

#if defined(MAMBAFUSE_MXCSR)
constexpr uint32_t kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
constexpr uint32_t kUnderflowFlag = 1u << 4, kOverflowFlag = 1u << 3, kExceptionFlags = 0x3Fu;

inline uint32_t ReadCsr() {
  uint32_t csr;
  __asm__ __volatile__("stmxcsr %0" : "=m"(csr) : : "memory");
  return csr;
}
inline void WriteCsr(uint32_t csr) { __asm__ __volatile__("ldmxcsr %0" : : "m"(csr) : "memory"); }

// Sets the mode of each pass (and clears the flags), restores the caller's MXCSR when it ends.
class FlushScope {
 public:
  FlushScope() : saved_(ReadCsr()) {}
  ~FlushScope() { WriteCsr(saved_); }
  FlushScope(const FlushScope&) = delete;
  FlushScope& operator=(const FlushScope&) = delete;
  void Gate() const { WriteCsr(Mode(kFlushToZero | kDenormalsAreZero)); }  // inputs noted from their bits
  void Norm() const { WriteCsr(Mode(kFlushToZero)); }                      // w read exactly
  void Exact() const { WriteCsr(Mode(0)); }
  // Whether any of `flags` was raised since the mode was set. `value` ties the read to the computation of
  // a register result: the asm takes it as an input, so it cannot move before it.
  static bool Raised(float value, uint32_t flags = kUnderflowFlag) {
    __asm__ __volatile__("" : : "x"(value) : "memory");
    return (ReadCsr() & flags) != 0;
  }

 private:
  uint32_t Mode(uint32_t bits) const {
    return (saved_ & ~(kFlushToZero | kDenormalsAreZero | kExceptionFlags)) | bits;
  }
  uint32_t saved_;
};
#endif

// The gate pass with SiluTable, and again with SiluWide where a z needs the full range (|z| > 86, NaN,
// Inf): the second pass overwrites all of h and starts from the MXCSR flags the first one found (the
// first one's unused lanes may have raised any of them).
template <ElemType Y, ElemType Z, ElemType G, YScaling kScaled = YScaling::kNone>
GateSums Gate(const char* y, const char* z, float* __restrict gated, int64_t n, YScale scale = {}) {
  if constexpr (kExpTable) {
#if defined(MAMBAFUSE_MXCSR)
    const uint32_t csr = ReadCsr();
#endif
    const GateSums sums = GatePass<Y, Z, G, kScaled, false>(y, z, gated, n, scale);
    if (__builtin_expect(!sums.wide_z, 1)) return sums;
#if defined(MAMBAFUSE_MXCSR)
    WriteCsr(csr);
#endif
  }
  return GatePass<Y, Z, G, kScaled, true>(y, z, gated, n, scale);
}

// Scratch for h: on the stack for the group sizes of real models, else a per-thread buffer, released
// after the call when it is large (a huge group_size must not leave its buffer held by a pool thread).
constexpr int64_t kStackGroup = 4096;
constexpr size_t kKeptScratch = 1 << 16;  // floats (256 KB) kept per thread between calls
constexpr size_t kStreamBytes = size_t{16} << 20;  // outputs from 16 MB (past a desktop L3) are streamed

}  // namespace

namespace {

// k such that max|y| * 2^k lies in [1/2, 1), within [0, 127] (0: y needs no scaling), from the bits of
// max|y| (an FP operation on a subnormal would read 0 under DAZ).
inline int ScaleExponent(uint32_t max_abs_bits) {
  const int exponent = static_cast<int>(max_abs_bits >> 23);
  if (max_abs_bits == 0 || exponent == 255) return 0;
  // floor(log2 |y|): from the exponent field, or for a subnormal m 2^-149 from the highest bit of m.
  const int log2 = exponent > 0 ? exponent - 127 : 31 - __builtin_clz(max_abs_bits) - 149;
  const int k = -log2 - 1;
  return k < 0 ? 0 : k > 127 ? 127 : k;
}

// The norm pass's types (W, norm, output, stored output) of the combinations RunItems pipelines through
// FusedPass; NoFusedPass for the rest.
template <ElemType W, ElemType N, ElemType O, ElemType S>
struct NormTypes {};
struct NoFusedPass {};

template <ElemType Y, ElemType Z, ElemType G, ElemType W, ElemType N, ElemType O, ElemType S>
GateSums CallFusedPass(NormTypes<W, N, O, S>, const char* y, const char* z, float* gated, int64_t n,
                       const float* prev, float inv_rms, const char* w, char* out, bool stream) {
  return FusedPass<Y, Z, G, W, N, O, S>(y, z, gated, n, prev, inv_rms, w, out, stream);
}
template <ElemType Y, ElemType Z, ElemType G>
GateSums CallFusedPass(NoFusedPass, const char*, const char*, float*, int64_t, const float*, float, const char*,
                       char*, bool) {
  return {};  // never called: RunItems<..., NoFusedPass> pipelines nothing
}

// All items of one call, with the gate pass's types fixed at compile time. Fused: NormTypes of the norm
// pass when the call's types are a combination FusedPass serves (then an ordinary group's norm pass runs
// together with the next group's gate pass), or NoFusedPass.
template <ElemType Y, ElemType Z, ElemType G, class Fused>
void RunItems(const GatedGroupRMSNormArgs& a, int64_t first_item, int64_t last_item) {
  const int64_t gs = a.group_size;
  const int64_t groups_per_row = a.channels / gs;
  const size_t w_bytes = TypeBytes(a.w_type), out_bytes = TypeBytes(a.out_storage_type);
  const float group_size = static_cast<float>(gs);
  const auto inv_rms_of = [&](float sum_sq) { return 1.f / std::sqrt(sum_sq / group_size + a.epsilon); };

  // Two scratch buffers for h: the group whose norm pass waits for the next one's gate pass keeps its own.
  alignas(64) float stack_buffer[2 * kStackGroup];
  thread_local std::vector<float> heap_buffer;
  float* scratch[2] = {stack_buffer, stack_buffer + kStackGroup};
  if (gs > kStackGroup) {
    if (heap_buffer.size() < 2 * static_cast<size_t>(gs)) heap_buffer.resize(2 * static_cast<size_t>(gs));
    scratch[0] = heap_buffer.data();
    scratch[1] = heap_buffer.data() + gs;
  }
  // Non-temporal stores when the output is far larger than the caches and the groups' starts are aligned
  // to the vector stores (ORT's buffers are 64-byte aligned; group_size a multiple of the width).
  const size_t store_bytes = static_cast<size_t>(kWidth) * (a.out_storage_type == ElemType::kFloat ? 4 : 2);
  const bool stream = static_cast<size_t>(a.rows * a.channels) * out_bytes >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(a.out) % store_bytes == 0 && gs % kWidth == 0;
  // FusedPass reads w in the gate pass's MXCSR mode (DAZ: a subnormal w would read as 0), so on x86 only
  // with a W the caller found free of subnormals.
  constexpr bool kFused = !std::is_same_v<Fused, NoFusedPass>;
  const bool fuse = kFused && (!kSubnormalsAsIntegers || a.w_subnormal_free);
  // The ordinary group whose norm pass is still to run (into FusedPass with the next group's gate pass).
  struct Pending {
    const float* gated = nullptr;
    float inv_rms = 0.f;
    const char* w = nullptr;
    char* out = nullptr;
  } pending;
  bool has_pending = false;
  int next_scratch = 0;
#if defined(MAMBAFUSE_MXCSR)
  FlushScope flush;
  thread_local bool scaled_hint = false;
#endif
  for (int64_t item = first_item; item < last_item; ++item) {
    const int64_t row = item / groups_per_row;
    const int64_t col = (item % groups_per_row) * gs;
    const auto offset = static_cast<size_t>(row * a.channels + col);
    const char* y = static_cast<const char*>(a.y) + offset * Type<Y>::bytes;
    const char* z = static_cast<const char*>(a.z) + offset * Type<Z>::bytes;
    const char* w = static_cast<const char*>(a.w) + static_cast<size_t>(col) * w_bytes;
    char* out = static_cast<char*>(a.out) + offset * out_bytes;
    float* gated = scratch[next_scratch];
    float inv_rms = 0.f;
    bool done = false;
    if constexpr (kFused) {
      if (has_pending) {
        // This group's gate pass on the fast path (as below) with the pending group's norm pass. An
        // underflow may be either's: the pending group's outputs are computed again exactly, and this
        // group takes the usual way below, as does one whose gate pass did not stand.
#if defined(MAMBAFUSE_MXCSR)
        flush.Gate();
#endif
        const GateSums gate = CallFusedPass<Y, Z, G>(Fused{}, y, z, gated, gs, pending.gated, pending.inv_rms,
                                                     pending.w, pending.out, stream);
        has_pending = false;
#if defined(MAMBAFUSE_MXCSR)
        const bool underflow = FlushScope::Raised(gate.sum_sq);
        if (underflow) {  // the pending group's outputs again, exactly
          flush.Exact();
          NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, pending.gated, pending.inv_rms,
                      pending.w, pending.out, gs, stream);
        }
        done = !underflow && !gate.subnormal_input && !gate.wide_z;
#else
        done = !gate.wide_z;
#endif
        if (done) inv_rms = inv_rms_of(gate.sum_sq);
      }
    }
    bool exact = false;
    int scaled_by = 0;  // k of y' = 2^k y
#if defined(MAMBAFUSE_MXCSR)
    // y scaled by 2^k (exact) so that the products stay normal floats: h' = 2^k h, and
    // nf' = 1 / sqrt(sum h'^2 / gs + eps 4^k) = 2^-k nf (in double: eps 4^k may exceed float's range), so
    // h' nf' = h nf. Only where a gated_dtype does not round h at its own scale. Both ways of scaling give
    // the same y'. Where no product, sum or 1/rms leaves the normal floats (else this returns false), every
    // k gives the same h' nf' and the same outputs: powers of two scale the roundings exactly.
    const auto scaled_pass = [&](int k_, bool all_subnormal) {
      flush.Gate();
      const GateSums gate = all_subnormal ? Gate<Y, Z, G, YScaling::kSubnormal>(y, z, gated, gs, YScale::Of(k_))
                                          : Gate<Y, Z, G, YScaling::kAny>(y, z, gated, gs, YScale::Of(k_));
      const double denominator = static_cast<double>(gate.sum_sq) / static_cast<double>(gs) +
                                 static_cast<double>(a.epsilon) * std::ldexp(1.0, 2 * k_);
      inv_rms = static_cast<float>(1.0 / std::sqrt(denominator));
      return !gate.misfit_y && !gate.subnormal_input && !FlushScope::Raised(gate.sum_sq) && std::isnormal(inv_rms);
    };
    // The fast pass, unless the previous group needed y scaled (rows decayed into the subnormals tend to
    // stay there): then first the scaled pass for y all subnormal or zero, with k = 126 (ScaleSubnormals
    // puts every such y, m 2^-149, at m 2^-23, a normal float or zero below 1); the pass checks that the y
    // are such (misfit_y), so y is read once, not first for its largest magnitude (7680-wide decayed row,
    // AMD Zen 4: 3.99 -> 3.77 us on AVX2, 3.02 -> 2.87 on AVX-512). Where it stands, the result is the one
    // without the hint: if some y is not zero, the fast pass fails (it notes the subnormal y) and the
    // scaled pass with the k below (126 or 127) gives the same outputs (see above); if every y is zero, every
    // h and output is the zero the fast pass gives (and a NaN or infinite z makes 1/rms NaN, which this
    // pass does not let stand). Where it does not stand, the usual way follows. So a group's result never
    // depends on the groups before it (with -ffp-contract=fast the fast and the scaled pass need not round
    // alike, so a guess must not choose between them).
    constexpr int kSubnormalScale = 126;
    int k = 0;
    uint32_t max_abs_bits = 0;
    if (!done && G == ElemType::kFloat && scaled_hint && scaled_pass(kSubnormalScale, true)) {
      done = true;
      k = scaled_by = kSubnormalScale;
    }
    if (!done) {
      flush.Gate();
      const GateSums gate = Gate<Y, Z, G>(y, z, gated, gs);
      done = !gate.subnormal_input && !FlushScope::Raised(gate.sum_sq);
      if (done) {
        inv_rms = inv_rms_of(gate.sum_sq);
      } else if (G == ElemType::kFloat) {
        max_abs_bits = MaxAbsBits<Y>(y, gs);
        k = ScaleExponent(max_abs_bits);
      }
    }
    if (!done && k > 0) {
      done = scaled_pass(k, max_abs_bits < 0x00800000u);
      if (done) scaled_by = k;
    }
    scaled_hint = k > 0;
    if (!done) {
      flush.Exact();
      exact = true;
      inv_rms = inv_rms_of(Gate<Y, Z, G>(y, z, gated, gs).sum_sq);
    }
#else
    if (!done) {
      inv_rms = inv_rms_of(Gate<Y, Z, G>(y, z, gated, gs).sum_sq);
    }
#endif
    // An ordinary group's norm pass waits for the next group's gate pass (FusedPass), within this call: never
    // the call's last group's, so that no norm pass is left waiting when the loop ends.
    if (fuse && !exact && scaled_by == 0 && item + 1 < last_item) {
      pending = {gated, inv_rms, w, out};
      has_pending = true;
      next_scratch ^= 1;
      continue;
    }
#if defined(MAMBAFUSE_MXCSR)
    // A scaled group's outputs are mostly tiny (O = w h nf with h ~ y), many of them subnormal: computed
    // 2^64 too large with FTZ and scaled back by ScaleDownBy64 (norm_dtype float; its underflow flag is
    // expected, an overflow is not). Any other group: without FTZ at once. (An FTZ pass, redone without FTZ
    // where MXCSR's underflow flag came up, gave the same bits, at one more MXCSR read; and the float16
    // conversions raise that flag for every float16 subnormal result, which sent about half the groups of
    // ordinary rows with a float16 norm_dtype or output_dtype through a second pass.)
    const float scaled_inv_rms = inv_rms * 0x1p64f;  // exact (inv_rms is normal here), or Inf
    const bool scale_down = scaled_by > 0 && a.norm_type == ElemType::kFloat && std::isfinite(scaled_inv_rms);
    if (!exact && scale_down) {
      flush.Norm();
      NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, gated, scaled_inv_rms, w, out, gs, stream,
                  true);
      if (!FlushScope::Raised(inv_rms, kOverflowFlag)) continue;
      // Overflowed at 2^64 times the outputs: computed again below, exactly (without FTZ).
    }
    if (!exact) flush.Exact();
#endif
    NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, gated, inv_rms, w, out, gs, stream);
  }
  if (heap_buffer.capacity() > kKeptScratch) std::vector<float>().swap(heap_buffer);
#if defined(MAMBAFUSE_MXCSR)
  if (stream) _mm_sfence();  // the streamed stores are visible before the caller hands the output on
#endif
}

// The call's types among those FusedPass serves: float32 throughout (fp32 models); float32 inputs and
// weights with half rounding points stored as float (ONNX Runtime's CPU fallback for fp16 / bf16 models
// hands the op float tensors); one half type throughout (h rounded to it, or not). Half rounding points
// through the AVX2 conversion
// instructions stay out: they raise MXCSR's underflow flag for every half subnormal result (AVX-512's
// carry {sae}), which would send such groups through an exact norm pass again.
template <ElemType Y, ElemType Z, ElemType G, class F>
void WithFusedTypes(const GatedGroupRMSNormArgs& a, F&& f) {
  constexpr ElemType kF = ElemType::kFloat, kH = ElemType::kFloat16, kB = ElemType::kBFloat16;
#if defined(MAMBAFUSE_MXCSR) && !defined(__AVX512F__)
  constexpr bool kHalfRounding = false;
#else
  constexpr bool kHalfRounding = true;
#endif
  const auto norm_is = [&a](ElemType w, ElemType n, ElemType o, ElemType s) {
    return a.w_type == w && a.norm_type == n && a.out_type == o && a.out_storage_type == s;
  };
  if constexpr (Y == kF && Z == kF) {
    if (norm_is(kF, kF, kF, kF)) return f(NormTypes<kF, kF, kF, kF>{});
    if constexpr (kHalfRounding && G != kB) {
      if (norm_is(kF, kH, kH, kF)) return f(NormTypes<kF, kH, kH, kF>{});
    }
    if constexpr (G != kH) {
      if (norm_is(kF, kB, kB, kF)) return f(NormTypes<kF, kB, kB, kF>{});
    }
  } else if constexpr (Y == Z && (G == Y || G == kF) && (Y != kH || kHalfRounding)) {
    if (norm_is(Y, Y, Y, Y)) return f(NormTypes<Y, Y, Y, Y>{});
  }
  f(NoFusedPass{});
}

}  // namespace

void ComputeItems(const GatedGroupRMSNormArgs& a, int64_t first_item, int64_t last_item) {
  WithType(a.y_type, [&](auto yt) {
    WithType(a.z_type, [&](auto zt) {
      WithType(a.gated_type, [&](auto gt) {
        constexpr ElemType kY = decltype(yt)::value, kZ = decltype(zt)::value, kG = decltype(gt)::value;
        WithFusedTypes<kY, kZ, kG>(a, [&](auto fused) { RunItems<kY, kZ, kG, decltype(fused)>(a, first_item, last_item); });
      });
    });
  });
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
