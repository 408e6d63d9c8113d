// GatedGroupRMSNorm, the per-group math (DESIGN.md §1), written so the compiler vectorizes every loop.
//
//   h[j]  = f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j])))
//   nf    = 1 / sqrt(sum_j h[j]^2 / group_size + epsilon)
//   O[j]  = round(out_type, f32(W[col]) * f32(round(norm_type, h[j] * nf)))
//
// This file is compiled once per instruction-set level (CMake passes MAMBAFUSE_ISA_NS and the -m flags);
// the dispatcher in gated_group_rms_norm_impl.cc picks the widest one the CPU supports at run time.
// Everything here is branch-free per element (selects, not branches) so that the loops vectorize at any
// width: the half-precision conversions are bit manipulations, and exp is a Cody-Waite reduction with a
// polynomial instead of a libm call.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gated_group_rms_norm_impl.h"

#ifndef MAMBAFUSE_ISA_NS
#define MAMBAFUSE_ISA_NS isa_generic
#endif

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

// Storage types: plain 16-bit patterns for the half formats, so nothing depends on compiler support
// for _Float16 / __bf16 and every conversion is explicit and exact.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// --- exact widening -------------------------------------------------------------------------------
inline float Widen(float v) { return v; }
inline float Widen(BF16 v) { return BitsFloat(static_cast<uint32_t>(v.bits) << 16); }
inline float Widen(F16 v) {
  // Move exponent+mantissa into float position and rebias by 112 (= 127 - 15). Subnormal halves are
  // renormalized by an ordinary float subtraction (no float denormals involved, so DAZ/FTZ modes do not
  // change the result); Inf/NaN get the full float exponent.
  const uint32_t sign = (static_cast<uint32_t>(v.bits) & 0x8000u) << 16;
  const uint32_t em = (static_cast<uint32_t>(v.bits) & 0x7FFFu) << 13;
  const uint32_t exp = em & 0x0F800000u;
  const uint32_t normal = em + (112u << 23);
  const float sub = BitsFloat(em + (113u << 23)) - BitsFloat(113u << 23);
  const uint32_t special = em + (224u << 23);  // exponent 31 -> 255
  uint32_t r = exp == 0x0F800000u ? special : normal;
  r = exp == 0 ? FloatBits(sub) : r;
  return BitsFloat(r | sign);
}

// --- round-to-nearest-even narrowing --------------------------------------------------------------
template <typename T>
inline T Narrow(float f);

template <>
inline float Narrow<float>(float f) {
  return f;
}

template <>
inline BF16 Narrow<BF16>(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return BF16{static_cast<uint16_t>(is_nan ? quiet_nan : rounded)};
}

template <>
inline F16 Narrow<F16>(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // |f| >= 65536 (or Inf/NaN): overflow to Inf, NaN stays a quiet NaN. 65520..65535 overflow through
  // the rounding carry of the normal path below.
  const uint32_t big = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
  // |f| < 2^-14: the half is subnormal. Adding 0.5 puts the value's 2^-24 units into the low mantissa
  // bits of the sum, rounded to nearest even by the FPU.
  const uint32_t tiny = FloatBits(BitsFloat(a) + 0.5f) - FloatBits(0.5f);
  // Normal: rebias the exponent, round the 13 dropped bits to nearest even.
  const uint32_t normal = (a - (112u << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  uint32_t r = a >= 0x47800000u ? big : normal;
  r = a < 0x38800000u ? tiny : r;
  return F16{static_cast<uint16_t>(r | sign)};
}

template <typename T>
inline float RoundThrough(float f) {
  return Widen(Narrow<T>(f));
}

// --- silu -----------------------------------------------------------------------------------------
// exp(x) for x <= 0 (NaN passes through). Cody-Waite: x = n ln2 + r, |r| <= ln2/2, e^r by its degree-7
// Taylor polynomial (truncation error < 6e-9, below half an ulp of 1), 2^n applied in two factors so that
// results down to the float subnormals are right. Below -104 the result rounds to 0 anyway.
inline float ExpNonPositive(float x) {
  x = x < -104.f ? -104.f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // 15 significant bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = x * kLog2e + kRoundMagic;
  const float n = shifted - kRoundMagic;
  const int32_t ni = static_cast<int32_t>(FloatBits(shifted) & 0x7FFFFFu) - 0x400000;  // n, from the mantissa
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t n1 = ni >> 1;  // n in [-150, 0]: both halves stay >= -75, normal floats
  const int32_t n2 = ni - n1;
  const float s1 = BitsFloat(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = BitsFloat(static_cast<uint32_t>(n2 + 127) << 23);
  return p * s1 * s2;
}

// z * sigmoid(z), with sigmoid(z) = 1/(1+e^-z) for z >= 0 and e^z/(1+e^z) for z < 0 (e of a
// non-positive argument never overflows, so both halves are accurate; NaN and +-Inf behave like the
// formula: silu(+Inf) = +Inf, silu(-Inf) = -Inf * 0 = NaN).
inline float Silu(float z) {
  const float t = ExpNonPositive(-std::fabs(z));
  const float inv = 1.f / (1.f + t);
  const float sig = z >= 0.f ? inv : t * inv;
  return z * sig;
}

// --- the two passes over a group ------------------------------------------------------------------
constexpr int kLanes = 16;  // independent partial sums: lets the reduction vectorize without -ffast-math

// h = y * silu(z) into `gated`; returns sum(h^2) in float. Two plain loops rather than one fused loop:
// GCC vectorizes each of them at every ISA level, while the fused form fell back to scalar code behind a
// run-time alias check.
template <typename TY, typename TZ>
float GatePass(const TY* __restrict y, const TZ* __restrict z, float* __restrict gated, int64_t n) {
  for (int64_t j = 0; j < n; ++j) gated[j] = Widen(y[j]) * Silu(Widen(z[j]));
  // kLanes independent partial sums in a fixed order: the same bits from every ISA variant.
  float partial[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += gated[j + l] * gated[j + l];
  }
  for (; j < n; ++j) partial[0] += gated[j] * gated[j];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  return sum;
}

// O = round(TOut, f32(W) * round(TNorm, h * nf)), stored as TStore (TStore is TOut, or float holding
// the TOut-rounded value when ONNX Runtime widened the node's output).
template <typename TW, typename TNorm, typename TOut, typename TStore>
void NormPass(const float* __restrict gated, float inv_rms, const TW* __restrict w, TStore* __restrict out,
              int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float normed = RoundThrough<TNorm>(gated[j] * inv_rms);
    const float product = Widen(w[j]) * normed;
    if constexpr (std::is_same_v<TStore, TOut>) {
      out[j] = Narrow<TOut>(product);
    } else {
      out[j] = RoundThrough<TOut>(product);
    }
  }
}

using GateFn = float (*)(const void*, const void*, float*, int64_t);
using NormFn = void (*)(const float*, float, const void*, void*, int64_t);

template <typename TY, typename TZ>
float GateErased(const void* y, const void* z, float* gated, int64_t n) {
  return GatePass(static_cast<const TY*>(y), static_cast<const TZ*>(z), gated, n);
}
template <typename TW, typename TNorm, typename TOut, typename TStore>
void NormErased(const float* gated, float inv_rms, const void* w, void* out, int64_t n) {
  NormPass<TW, TNorm, TOut, TStore>(gated, inv_rms, static_cast<const TW*>(w), static_cast<TStore*>(out), n);
}

inline int TypeIndex(ElemType t) { return t == ElemType::kFloat ? 0 : t == ElemType::kFloat16 ? 1 : 2; }
inline size_t TypeBytes(ElemType t) { return t == ElemType::kFloat ? 4 : 2; }

template <typename TY>
GateFn PickGate(ElemType z) {
  switch (TypeIndex(z)) {
    case 0: return &GateErased<TY, float>;
    case 1: return &GateErased<TY, F16>;
    default: return &GateErased<TY, BF16>;
  }
}
GateFn PickGate(ElemType y, ElemType z) {
  switch (TypeIndex(y)) {
    case 0: return PickGate<float>(z);
    case 1: return PickGate<F16>(z);
    default: return PickGate<BF16>(z);
  }
}

template <typename TW, typename TNorm, typename TOut>
NormFn PickNormStore(ElemType store, ElemType out) {
  // Storage differs from the rounding type only when ORT widened the output to float.
  if (store != out) return &NormErased<TW, TNorm, TOut, float>;
  return &NormErased<TW, TNorm, TOut, TOut>;
}
template <typename TW, typename TNorm>
NormFn PickNormOut(ElemType out, ElemType store) {
  switch (TypeIndex(out)) {
    case 0: return PickNormStore<TW, TNorm, float>(store, out);
    case 1: return PickNormStore<TW, TNorm, F16>(store, out);
    default: return PickNormStore<TW, TNorm, BF16>(store, out);
  }
}
template <typename TW>
NormFn PickNormNorm(ElemType norm, ElemType out, ElemType store) {
  switch (TypeIndex(norm)) {
    case 0: return PickNormOut<TW, float>(out, store);
    case 1: return PickNormOut<TW, F16>(out, store);
    default: return PickNormOut<TW, BF16>(out, store);
  }
}
NormFn PickNorm(ElemType w, ElemType norm, ElemType out, ElemType store) {
  switch (TypeIndex(w)) {
    case 0: return PickNormNorm<float>(norm, out, store);
    case 1: return PickNormNorm<F16>(norm, out, store);
    default: return PickNormNorm<BF16>(norm, out, store);
  }
}

}  // namespace

void ComputeItems(const GatedGroupRMSNormArgs& a, int64_t first_item, int64_t last_item) {
  const GateFn gate = PickGate(a.y_type, a.z_type);
  const NormFn norm = PickNorm(a.w_type, a.norm_type, a.out_type, a.out_storage_type);
  const int64_t groups_per_row = a.channels / a.group_size;
  const size_t y_bytes = TypeBytes(a.y_type), z_bytes = TypeBytes(a.z_type);
  const size_t w_bytes = TypeBytes(a.w_type), out_bytes = TypeBytes(a.out_storage_type);
  // h of one group; reused across calls on this thread, so steady-state calls do not allocate.
  thread_local std::vector<float> gated;
  if (gated.size() < static_cast<size_t>(a.group_size)) gated.resize(static_cast<size_t>(a.group_size));
  const float group_size = static_cast<float>(a.group_size);
  for (int64_t item = first_item; item < last_item; ++item) {
    const int64_t row = item / groups_per_row;
    const int64_t col = (item % groups_per_row) * a.group_size;
    const size_t offset = static_cast<size_t>(row * a.channels + col);
    const float sum_sq = gate(static_cast<const char*>(a.y) + offset * y_bytes,
                              static_cast<const char*>(a.z) + offset * z_bytes, gated.data(), a.group_size);
    const float inv_rms = 1.f / std::sqrt(sum_sq / group_size + a.epsilon);
    norm(gated.data(), inv_rms, static_cast<const char*>(a.w) + static_cast<size_t>(col) * w_bytes,
         static_cast<char*>(a.out) + offset * out_bytes, a.group_size);
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
