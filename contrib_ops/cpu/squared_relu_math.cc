// SquaredRelu, the per-element math (docs/squared_relu.md), compiled once per instruction-set level (CMake passes
// MAMBAFUSE_ISA_NS and the -m flags).
//
//   y = round_T(r * r),  r = max(x, 0) with NaN kept (x > 0 or x is NaN ? x : 0)
//
// In float32: the square of a float16 or bfloat16 value is exact there, so the one rounding is the store's; a
// float32 product is IEEE's correctly rounded one. Vectors of the level's width, then the tail one at a time.
#include <cstdint>

#include "decode_step_vector.h"
#include "squared_relu_impl.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

MAMBAFUSE_INLINE VF SquareOfRelu(VF v) {
  const VF zero = {};
  const VF r = (v > zero) | (v != v) ? v : zero;  // a NaN lane compares false with 0 and stays NaN
  return r * r;
}

MAMBAFUSE_INLINE float SquareOfRelu(float v) {
  const float r = v > 0.f || v != v ? v : 0.f;
  return r * r;
}

template <int kT>
void RunRange(const SquaredReluCpuArgs& a, int64_t first, int64_t last) {
  int64_t i = first;
  for (; i + kWidth <= last; i += kWidth) StoreVector<kT>(a.y, i, SquareOfRelu(LoadVector<kT>(a.x, i)));
  for (; i < last; ++i) StoreScalar<kT>(a.y, i, SquareOfRelu(LoadScalar<kT>(a.x, i)));
}

}  // namespace

void SquaredReluItems(const SquaredReluCpuArgs& args, int64_t first, int64_t last) {
  switch (args.type) {
    case ElemType::kFloat16: RunRange<kF16>(args, first, last); break;
    case ElemType::kBFloat16: RunRange<kBF16>(args, first, last); break;
    default: RunRange<kNone>(args, first, last); break;
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
