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
// The code is GCC vector extensions of the ISA's width (16 floats for AVX-512, 8 for AVX2, 4 for SSE2,
// NEON and the generic build), with the few instructions a width has that the extensions cannot express
// (half conversions, vscalefps, non-temporal stores) behind small per-ISA helpers. Large outputs (prefill)
// are written with non-temporal stores, and the next group's y and z are prefetched.
//
// silu: sigmoid(z) = 1/(1+t) for z >= 0 and t/(1+t) for z < 0, with t = e^-|z| (never overflows).
// e^x: x = n ln2 + r (|r| <= ln2/2), e^r by a degree-5 minimax polynomial (relative error 1.9e-7 evaluated
// in float32), 2^n applied so that results down to the float subnormals are right; then one division.
// Together h is within ~5e-7 (relative) of the exact product, inside the float32 budget of 2e-6 and inside
// the window that budget_report allows a gated_dtype rounding to fall either way (fusion/reference.py,
// GATED_TIE_WINDOW, 9.5e-7).
//
// Cost (AVX-512, per 16 elements): 13 multiply/FMA instructions and one division. On the machine measured
// (AMD Zen 4: one 512-bit FMA per cycle) that multiply pipe is the bound; see benchmarks/RESULTS.md.
//
// Float32 subnormals (x86): results that underflow cost ~3x an ordinary instruction on the CPUs measured,
// and rows whose values decay into the subnormals would pay that on every element. The x86 variants run
// with MXCSR.FTZ set (results that underflow become 0, fast) and DAZ clear (subnormal inputs are read
// exactly), and read MXCSR's underflow flag after each pass: FTZ changes a result only when it underflows,
// and every such result raises the flag, so a pass that ends without it computed exactly what it computes
// without FTZ. A gate pass that raised it is computed again with y scaled by a power of two 2^k (exact;
// h' = 2^k h, nf' = 2^-k nf with eps 4^k in double, so h' nf' = h nf) or, if that underflows too, without
// FTZ; a norm pass that raised it is computed again without FTZ. The caller's MXCSR is restored on return.
#include <cmath>
#include <cstdint>
#include <cstring>
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

inline VF Splat(float f) { return VF{} + f; }
inline VU SplatU(uint32_t u) { return VU{} + u; }
inline VU Bits(VF v) { return reinterpret_cast<VU>(v); }
inline VF FromBits(VU v) { return reinterpret_cast<VF>(v); }

// --- loads and stores in the element types, widened to / rounded from float -------------------------

inline VF LoadF32(const void* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline VH LoadHalfBits(const void* p) {
  VH v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline VF BF16ToFloat(VH bits) { return FromBits(__builtin_convertvector(bits, VU) << 16); }

inline VH FloatToBF16(VF f) {  // round to nearest even; NaN stays a quiet NaN
  const VU u = Bits(f);
  const VU rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const VU quiet_nan = (u >> 16) | 0x0040u;
  const VU result = (u & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded;
  return __builtin_convertvector(result, VH);
}

// Portable float16 <-> float, for the widths without a conversion instruction (SSE2, generic). Exact;
// the subnormal paths use float additions of normal numbers only, so FTZ cannot change them.
[[maybe_unused]] inline VF F16ToFloatPortable(VH bits) {
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

[[maybe_unused]] inline VH FloatToF16Portable(VF f) {  // round to nearest even
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

inline VF F16ToFloat(VH bits) {
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

inline VH FloatToF16(VF f) {  // round to nearest even (the conversion instructions ignore FTZ/DAZ)
#if defined(__AVX512F__)
  const __m256i raw = _mm512_cvtps_ph(reinterpret_cast<__m512>(f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

inline VF Load(const void* p, ElemType type) {
  if (type == ElemType::kFloat16) return F16ToFloat(LoadHalfBits(p));
  if (type == ElemType::kBFloat16) return BF16ToFloat(LoadHalfBits(p));
  return LoadF32(p);
}

// The value rounded to `type` and widened back (exact: the result is representable in float).
inline VF RoundThrough(VF v, ElemType type) {
  if (type == ElemType::kFloat16) return F16ToFloat(FloatToF16(v));
  if (type == ElemType::kBFloat16) return BF16ToFloat(FloatToBF16(v));
  return v;
}

inline void Store(void* p, VF v, ElemType type) {
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
inline void StoreStream(void* p, VF v, ElemType type) {
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

// --- silu ---------------------------------------------------------------------------------------------

// a/d for d in [1, 2] (or NaN): a true division, not a reciprocal estimate refined by Newton steps. The
// divider runs beside the FMA pipes and keeps up with the loop (measured faster than estimate + Newton on
// AVX-512 and AVX2), and a division is exact where the sigmoid saturates: 1/(1 + t) is exactly 1 for
// t < 2^-24, so silu(z) = z exactly for large z, as in the reference (an estimate is off by an ulp there,
// enough to move a product that sits on a gated_dtype rounding tie).
inline VF Divide(VF a, VF d) { return a / d; }

// Degree-5 minimax polynomial of e^r on [-ln2/2, ln2/2] (float32 coefficients; relative error 1.9e-7
// evaluated in float32).
constexpr float kExpC0 = 0x1.000002p+0f, kExpC1 = 0x1.fffff6p-1f, kExpC2 = 0x1.fffd1ap-2f;
constexpr float kExpC3 = 0x1.555a18p-3f, kExpC4 = 0x1.575eeep-5f, kExpC5 = 0x1.0fe5c4p-7f;

// Vectors processed side by side: the silu chain is ~20 dependent instructions, so independent vectors
// interleaved stage by stage keep the pipelines full (the out-of-order window alone does not hold enough
// of them). As many as the register file holds: 32 zmm registers for AVX-512, 16 elsewhere.
constexpr int kUnroll = kWidth == 16 ? 4 : 2;

// silu(z) of kUnroll vectors, in place. Written stage by stage so the instruction stream interleaves them.
__attribute__((always_inline)) inline void Silu(VF (&v)[kUnroll]) {
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

// h = round(G, y * silu(z)) into `gated`; returns sum(h^2). kScaled: y is multiplied by y_scale first (a
// power of two, see ScaledGroup).
template <ElemType Y, ElemType Z, ElemType G, bool kScaled = false>
float GatePass(const char* y, const char* z, float* __restrict gated, int64_t n, float y_scale = 1.f) {
  constexpr size_t yb = Type<Y>::bytes, zb = Type<Z>::bytes;
  constexpr int64_t step = kWidth * kUnroll;
  const int64_t ahead = 2 * n > 2048 ? 2 * n : 2048;
  VF acc[kUnroll] = {};
  int64_t j = 0;
  for (; j + step <= n; j += step) {
    // y and z two groups (at least 2048 elements) ahead, into L2 (the next items are contiguous in
    // memory): in prefill memory then streams while this group computes, instead of waiting between the
    // compute phases (measured: 60 -> 75 % of ORT's Add bandwidth at 2048 x 8192 fp32, one thread; one
    // group ahead into L1 was the 60 %). Past the end of the tensor a prefetch is only a hint, never a fault.
    for (size_t line = 0; line < step * yb; line += 64) __builtin_prefetch(y + (ahead + j) * yb + line, 0, 1);
    for (size_t line = 0; line < step * zb; line += 64) __builtin_prefetch(z + (ahead + j) * zb + line, 0, 1);
    VF v[kUnroll];
    for (int k = 0; k < kUnroll; ++k) v[k] = Load(z + (j + k * kWidth) * zb, Z);
    Silu(v);
    for (int k = 0; k < kUnroll; ++k) {
      VF yv = Load(y + (j + k * kWidth) * yb, Y);
      if (kScaled) yv *= y_scale;
      const VF h = RoundThrough(yv * v[k], G);  // rounding point 0
      std::memcpy(gated + j + k * kWidth, &h, sizeof h);
      acc[k] += h * h;
    }
  }
  for (; j < n; j += kWidth) {  // the rest, one (possibly partial) vector at a time
    const int64_t count = n - j < kWidth ? n - j : kWidth;
    VF v[kUnroll] = {};
    v[0] = count == kWidth ? Load(z + j * zb, Z) : LoadPartial(z + j * zb, Z, count);
    Silu(v);
    VF yv = count == kWidth ? Load(y + j * yb, Y) : LoadPartial(y + j * yb, Y, count);
    if (kScaled) yv *= y_scale;
    const VF h = RoundThrough(yv * v[0], G);
    std::memcpy(gated + j, &h, static_cast<size_t>(count) * sizeof(float));
    acc[0] += h * h;
  }
  for (int k = 1; k < kUnroll; ++k) acc[0] += acc[k];
  float sum = 0.f;
  for (int l = 0; l < kWidth; ++l) sum += acc[0][l];
  return sum;
}

// max |y| over a group (NaN ignored).
template <ElemType Y>
float MaxAbs(const char* y, int64_t n) {
  VF m = {};
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    const VF a = FromBits(Bits(Load(y + j * Type<Y>::bytes, Y)) & 0x7FFFFFFFu);
    m = a > m ? a : m;
  }
  float result = 0.f;
  for (int l = 0; l < kWidth; ++l) result = m[l] > result ? m[l] : result;
  for (; j < n; ++j) {
    const float a = std::fabs(LoadPartial(y + j * Type<Y>::bytes, Y, 1)[0]);
    result = a > result ? a : result;
  }
  return result;
}

// out = round(O, w * round(N, h * nf)), stored as S (O, or float holding values rounded to O).
template <ElemType W, ElemType N, ElemType O, ElemType S>
void NormPass(const float* __restrict gated, float inv_rms, const char* w, char* out, int64_t n, bool stream) {
  constexpr size_t wb = Type<W>::bytes, ob = Type<S>::bytes;
  const auto value = [inv_rms](VF h, VF weight) {
    const VF normed = RoundThrough(h * inv_rms, N);  // rounding point 1: norm_dtype
    const VF product = weight * normed;
    return S == O ? product : RoundThrough(product, O);  // rounding point 2, when stored widened
  };
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

// The norm pass for the run-time types: nested switches down to a direct call of one instantiation.
void NormPassFor(ElemType w_type, ElemType norm, ElemType out_type, ElemType store, const float* gated,
                 float inv_rms, const char* w, char* out, int64_t n, bool stream) {
  WithType(w_type, [&](auto wt) {
    WithType(norm, [&](auto nt) {
      WithType(out_type, [&](auto ot) {
        constexpr ElemType kW = decltype(wt)::value, kN = decltype(nt)::value, kO = decltype(ot)::value;
        if (store == kO) {
          NormPass<kW, kN, kO, kO>(gated, inv_rms, w, out, n, stream);
        } else {
          NormPass<kW, kN, kO, ElemType::kFloat>(gated, inv_rms, w, out, n, stream);
        }
      });
    });
  });
}

// --- MXCSR: flush-to-zero with underflow detection (see the file comment) ------------------------------

#if defined(MAMBAFUSE_MXCSR)
constexpr uint32_t kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6, kUnderflowFlag = 1u << 4;
constexpr uint32_t kExceptionFlags = 0x3Fu;

inline uint32_t ReadCsr() {
  uint32_t csr;
  __asm__ __volatile__("stmxcsr %0" : "=m"(csr) : : "memory");
  return csr;
}
inline void WriteCsr(uint32_t csr) { __asm__ __volatile__("ldmxcsr %0" : : "m"(csr) : "memory"); }

// Sets FTZ (and clears DAZ and the flags) for its lifetime; restores the caller's MXCSR after.
class FlushScope {
 public:
  FlushScope() : saved_(ReadCsr()) { WriteCsr(Fast()); }
  ~FlushScope() { WriteCsr(saved_); }
  FlushScope(const FlushScope&) = delete;
  FlushScope& operator=(const FlushScope&) = delete;
  // Whether anything underflowed since the last call (and clears the flag). `value` ties the read to
  // the computation of a register result: the asm takes it as an input, so it cannot move before it.
  static bool Underflowed(float value) {
    __asm__ __volatile__("" : : "x"(value) : "memory");
    const uint32_t csr = ReadCsr();
    if ((csr & kUnderflowFlag) == 0) return false;
    WriteCsr(csr & ~kExceptionFlags);
    return true;
  }
  void Exact() const { WriteCsr(saved_ & ~(kFlushToZero | kDenormalsAreZero | kExceptionFlags)); }
  void Resume() const { WriteCsr(Fast()); }

 private:
  uint32_t Fast() const { return (saved_ | kFlushToZero) & ~(kDenormalsAreZero | kExceptionFlags); }
  uint32_t saved_;
};
#endif

// Scratch for h: on the stack for the group sizes of real models, else a per-thread buffer, released
// after the call when it is large (a huge group_size must not leave its buffer held by a pool thread).
constexpr int64_t kStackGroup = 4096;
constexpr size_t kKeptScratch = 1 << 16;  // floats (256 KB) kept per thread between calls
constexpr size_t kStreamBytes = size_t{16} << 20;  // outputs from 16 MB (past a desktop L3) are streamed

}  // namespace

namespace {

// k such that max|y| * 2^k lies in [1/2, 1), within [0, 127] (0: y needs no scaling).
inline int ScaleExponent(float max_abs) {
  if (!(max_abs > 0.f) || !std::isfinite(max_abs)) return 0;
  const int k = -std::ilogb(max_abs) - 1;
  return k < 0 ? 0 : k > 127 ? 127 : k;
}

// All items of one call, with the gate pass's types fixed at compile time.
template <ElemType Y, ElemType Z, ElemType G>
void RunItems(const GatedGroupRMSNormArgs& a, int64_t first_item, int64_t last_item) {
  const int64_t gs = a.group_size;
  const int64_t groups_per_row = a.channels / gs;
  const size_t w_bytes = TypeBytes(a.w_type), out_bytes = TypeBytes(a.out_storage_type);
  const float group_size = static_cast<float>(gs);

  alignas(64) float stack_buffer[kStackGroup];
  thread_local std::vector<float> heap_buffer;
  float* gated = stack_buffer;
  if (gs > kStackGroup) {
    if (heap_buffer.size() < static_cast<size_t>(gs)) heap_buffer.resize(static_cast<size_t>(gs));
    gated = heap_buffer.data();
  }
  // Non-temporal stores when the output is far larger than the caches and the groups' starts are aligned
  // to the vector stores (ORT's buffers are 64-byte aligned; group_size a multiple of the width).
  const size_t store_bytes = static_cast<size_t>(kWidth) * (a.out_storage_type == ElemType::kFloat ? 4 : 2);
  const bool stream = static_cast<size_t>(a.rows * a.channels) * out_bytes >= kStreamBytes &&
                      reinterpret_cast<uintptr_t>(a.out) % store_bytes == 0 && gs % kWidth == 0;
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
    float inv_rms = 0.f;
#if defined(MAMBAFUSE_MXCSR)
    // The fast pass, unless the previous group needed y scaled (rows decayed into the subnormals tend to
    // stay there): then straight to the scaled pass.
    bool done = false, exact = false;
    if (!scaled_hint) {
      const float sum_sq = GatePass<Y, Z, G>(y, z, gated, gs);
      done = !FlushScope::Underflowed(sum_sq);
      if (done) inv_rms = 1.f / std::sqrt(sum_sq / group_size + a.epsilon);
    }
    if (!done && G == ElemType::kFloat) {
      // y scaled by 2^k (exact) so that the products stay normal floats: h' = 2^k h, and
      // nf' = 1 / sqrt(sum h'^2 / gs + eps 4^k) = 2^-k nf (in double: eps 4^k may exceed float's range),
      // so h' nf' = h nf. Only where a gated_dtype does not round h at its own scale.
      const int k = ScaleExponent(MaxAbs<Y>(y, gs));
      const float scale = std::ldexp(1.f, k);
      const float sum_sq = GatePass<Y, Z, G, true>(y, z, gated, gs, scale);
      if (k == 0) {
        // Not scaled after all (a guess from the previous group): the fast pass's own arithmetic, so that
        // a group's result never depends on the groups before it.
        inv_rms = 1.f / std::sqrt(sum_sq / group_size + a.epsilon);
      } else {
        const double denominator = static_cast<double>(sum_sq) / static_cast<double>(gs) +
                                   static_cast<double>(a.epsilon) * std::ldexp(1.0, 2 * k);
        inv_rms = static_cast<float>(1.0 / std::sqrt(denominator));
      }
      done = !FlushScope::Underflowed(sum_sq) && std::isnormal(inv_rms);
      scaled_hint = k > 0;
    }
    if (!done) {
      flush.Exact();
      exact = true;
      const float sum_sq = GatePass<Y, Z, G>(y, z, gated, gs);
      inv_rms = 1.f / std::sqrt(sum_sq / group_size + a.epsilon);
    }
    // A scaled group's outputs are mostly tiny (O = w h nf with h ~ y): many underflow, and the pass would
    // have to run again without FTZ. Run it so at once.
    if (!exact && scaled_hint) {
      flush.Exact();
      exact = true;
    }
    NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, gated, inv_rms, w, out, gs, stream);
    if (exact) {
      flush.Resume();
    } else if (FlushScope::Underflowed(inv_rms)) {
      flush.Exact();
      NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, gated, inv_rms, w, out, gs, stream);
      flush.Resume();
    }
#else
    const float sum_sq = GatePass<Y, Z, G>(y, z, gated, gs);
    inv_rms = 1.f / std::sqrt(sum_sq / group_size + a.epsilon);
    NormPassFor(a.w_type, a.norm_type, a.out_type, a.out_storage_type, gated, inv_rms, w, out, gs, stream);
#endif
  }
  if (heap_buffer.capacity() > kKeptScratch) std::vector<float>().swap(heap_buffer);
#if defined(MAMBAFUSE_MXCSR)
  if (stream) _mm_sfence();  // the streamed stores are visible before the caller hands the output on
#endif
}

}  // namespace

void ComputeItems(const GatedGroupRMSNormArgs& a, int64_t first_item, int64_t last_item) {
  WithType(a.y_type, [&](auto yt) {
    WithType(a.z_type, [&](auto zt) {
      WithType(a.gated_type, [&](auto gt) {
        RunItems<decltype(yt)::value, decltype(zt)::value, decltype(gt)::value>(a, first_item, last_item);
      });
    });
  });
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
