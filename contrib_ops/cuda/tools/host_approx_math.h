// Host emulation of approx_math.cuh (tools/emulate_prefill.sh copies it in under that name): the correctly rounded
// reciprocal and glibc's exp2f, within the GPU instructions' 1 and 2 ulps of the exact values.
#pragma once

#include <cmath>

namespace mambafuse {

inline float ApproxReciprocal(float d) { return 1.f / d; }
inline float ApproxExp2(float t) { return std::exp2(t); }

}  // namespace mambafuse
