// The GPU's approximate reciprocal and base-2 exponential (MUFU.RCP and MUFU.EX2), as CausalConv1d's sigmoid uses
// them. tools/host_approx_math.h gives the same functions on the host (tools/emulate_prefill.sh).
#pragma once

namespace mambafuse {

// 1 / d within 1 float32 ulp (MUFU.RCP). Callers pass d = 1 + e in [1, 2^116) or NaN: no subnormal in or out.
__device__ __forceinline__ float ApproxReciprocal(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return r;
}

// 2^t within 2 float32 ulps (MUFU.EX2) for |t| <= 126 (a subnormal result would be flushed to zero).
__device__ __forceinline__ float ApproxExp2(float t) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(t));
  return r;
}

}  // namespace mambafuse
