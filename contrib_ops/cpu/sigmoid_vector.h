// The sigmoid of the conv ops' SiLU (CausalConv1dUpdate, CausalConv1d), in vectors of the instruction-set level's
// width; included by their math cores only (inside the per-ISA namespace there, as decode_step_vector.h is).
//
// sigmoid(v) = 1 / (1 + t) for v >= 0 and t / (1 + t) below, t = e^-|v| (never overflows); e^x for x <= 0:
// x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts so n ln2 is exact), e^r by Cephes' degree-7 polynomial form
// (about 1 float32 ulp), 2^n applied in two normal factors so results down to the float32 subnormals round once.
// Together within a few float32 ulps of the exact sigmoid, inside the budget's allowance of 16 unit roundoffs
// (fusion/reference/_bounds.py).
#pragma once

#include "decode_step_vector.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

// e^x for x <= 0 (NaN -> NaN); below -104 the exact value rounds to 0.
MAMBAFUSE_INLINE VF ExpNonPositive(VF x) {
  const VI is_nan = x != x;
  VF xc = is_nan ? VF{} : x;
  xc = xc < -104.f ? (VF{} - 104.f) : xc;
  const VF magic = VF{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const VF n = (xc * 1.44269504088896341f + magic) - magic;
  VF r = xc - n * 0.693359375f;  // exact: 0.693359375 has 9 significant bits, |n| <= 151
  r = r - n * -2.12194440e-4f;
  VF p = VF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const VF e = p * (r * r) + r + 1.f;
  const VI ni = __builtin_convertvector(n, VI);
  const VI n1 = ni >> 1;  // floor(n / 2) >= -76: both factors are normal floats
  const VI n2 = ni - n1;
  const VF scale1 = FromBits<VF>(VU((n1 + 127) << 23));
  const VF scale2 = FromBits<VF>(VU((n2 + 127) << 23));
  const VF result = (e * scale1) * scale2;
  return is_nan ? x : result;
}

MAMBAFUSE_INLINE VF Sigmoid(VF v) {
  const VF neg_abs = v < 0.f ? v : -v;
  const VF t = ExpNonPositive(neg_abs);
  const VF denominator = 1.f + t;
  return v >= 0.f ? 1.f / denominator : t / denominator;
}

}  // namespace
}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
