// GatedGroupRMSNorm on Apple GPUs (docs/op.md), in Metal Shading Language 3.1.
//
//   h[j]  = round(gated_type, f32(Y[j]) * (f32(Z[j]) * sigmoid(f32(Z[j]))))
//   nf    = 1 / sqrt(sum_j h[j]^2 / group_size + epsilon)
//   O[j]  = round(out_type, f32(W[col]) * f32(round(norm_type, h[j] * nf)))
//
// One SIMD group per (row, group) item; its lanes stride the group (any group_size, multiple of the SIMD
// width or not), keep fp32 partial sums of h^2 and combine them with simd_sum. No threadgroup memory, no
// barrier: a SIMD group never waits for another. The second pass recomputes h instead of keeping it (the
// group's values would need threadgroup memory or a register array sized at compile time); the re-read of
// y and z hits the cache, and at decode sizes the dispatch, not the arithmetic, is the cost.
//
// Width-agnostic: the stride is threads_per_simdgroup (32 on every Apple GPU so far) and the host makes
// threadgroups a whole number of SIMD groups, so every simd_sum sees full SIMD groups.
//
// Types: function constants (one pipeline per type combination, specialized when the host creates it)
// select float / half / bfloat loads and the rounding points; values are ONNX TensorProto numbers.
// half and bfloat conversions are the language's (float -> half/bfloat rounds to nearest even);
// bfloat needs MSL 3.1 (macOS 14). The host compiles this file with fast math off: the NaN/Inf
// propagation of the contract and the exp below depend on IEEE semantics.
//
// The same file compiles as C++ against contrib_ops/metal/msl_shim.h, which is how it is tested on Linux
// (tests/test_kernel_metal_emulation.py). Keep to the MSL subset the shim provides.
#include <metal_stdlib>
using namespace metal;

enum ElemCode : int { kFloat = 1, kFloat16 = 10, kBFloat16 = 16 };

constant int y_type [[function_constant(0)]];
constant int z_type [[function_constant(1)]];
constant int w_type [[function_constant(2)]];
constant int norm_type [[function_constant(3)]];  // rounding point before the weight multiply
constant int out_type [[function_constant(4)]];   // rounding point of the product
constant int store_type [[function_constant(5)]]; // output buffer type: out_type, or float (widened output)
constant int gated_type [[function_constant(6)]]; // rounding point of h = y * silu(z) (float: none)

// Mirrored by the host (gated_group_rms_norm_metal.mm); keep both in step.
struct GatedGroupRMSNormParams {
  uint channels;
  uint group_size;
  uint groups_per_row;
  uint items;  // rows * groups_per_row
  float epsilon;
};

inline float load_value(device const uchar* base, ulong index, int type) {
  if (type == kFloat16) return float(((device const half*)base)[index]);
  if (type == kBFloat16) return float(((device const bfloat*)base)[index]);
  return ((device const float*)base)[index];
}

// The value rounded to `type` and widened back (exact).
inline float round_through(float value, int type) {
  if (type == kFloat16) return float(half(value));
  if (type == kBFloat16) return float(bfloat(value));
  return value;
}

inline void store_value(device uchar* base, ulong index, int type, float value) {
  if (type == kFloat16) {
    ((device half*)base)[index] = half(value);
  } else if (type == kBFloat16) {
    ((device bfloat*)base)[index] = bfloat(value);
  } else {
    ((device float*)base)[index] = value;
  }
}

// e^x for x <= 0 (NaN passes through), independent of the library exp's accuracy: x = n ln2 + r with
// |r| <= ln2/2 (Cody-Waite, ln2 split so that n * ln2_hi is exact), e^r by its degree-7 Taylor polynomial
// (truncation < 6e-9), 2^n applied as two normal-float factors so results down to the float subnormals
// come out right. fma everywhere: the same bits whether or not the compiler would contract a*b+c.
inline float exp_non_positive(float x) {
  x = x < -104.0f ? -104.0f : x;  // e^-104 rounds to 0; a comparison keeps NaN (max() would drop it)
  const float n = rint(x * 1.44269504088896341f);
  const float r = fma(-n, 1.42860682030941723212e-6f, fma(-n, 0.693145751953125f, x));
  float p = 1.0f / 5040.0f;
  p = fma(p, r, 1.0f / 720.0f);
  p = fma(p, r, 1.0f / 120.0f);
  p = fma(p, r, 1.0f / 24.0f);
  p = fma(p, r, 1.0f / 6.0f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  const int ni = x == x ? int(n) : 0;  // n in [-150, 0]; NaN leaves p NaN anyway
  const int n1 = ni / 2;
  const int n2 = ni - n1;
  const float s1 = as_type<float>(uint(n1 + 127) << 23);
  const float s2 = as_type<float>(uint(n2 + 127) << 23);
  return p * s1 * s2;
}

// h = y * (z * sigmoid(z)), sigmoid from e^-|z| on both sides (never overflows; silu(+Inf) = +Inf,
// silu(-Inf) = -Inf * 0 = NaN, as the formula says).
inline float gated_value(device const uchar* y, device const uchar* z, ulong index) {
  const float gate = load_value(z, index, z_type);
  const float t = exp_non_positive(-fabs(gate));
  const float inv = 1.0f / (1.0f + t);
  const float sigmoid = gate >= 0.0f ? inv : t * inv;
  return round_through(load_value(y, index, y_type) * (gate * sigmoid), gated_type);  // rounding point 0
}

kernel void gated_group_rms_norm(device const uchar* y [[buffer(0)]],
                                 device const uchar* z [[buffer(1)]],
                                 device const uchar* w [[buffer(2)]],
                                 device uchar* out [[buffer(3)]],
                                 constant GatedGroupRMSNormParams& params [[buffer(4)]],
                                 uint threadgroup_index [[threadgroup_position_in_grid]],
                                 uint simdgroup_index [[simdgroup_index_in_threadgroup]],
                                 uint simdgroups [[simdgroups_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]],
                                 uint width [[threads_per_simdgroup]]) {
  const uint item = threadgroup_index * simdgroups + simdgroup_index;
  // Uniform over the SIMD group (item depends on no lane index): simd_sum below always sees every lane.
  if (item >= params.items) return;
  const uint row = item / params.groups_per_row;
  const uint column = (item % params.groups_per_row) * params.group_size;
  const ulong first = ulong(row) * ulong(params.channels) + ulong(column);

  float sum_sq = 0.0f;
  for (uint j = lane; j < params.group_size; j += width) {
    const float h = gated_value(y, z, first + j);
    sum_sq = fma(h, h, sum_sq);
  }
  const float total = simd_sum(sum_sq);
  const float inv_rms = 1.0f / sqrt(total / float(params.group_size) + params.epsilon);

  for (uint j = lane; j < params.group_size; j += width) {
    const float h = gated_value(y, z, first + j);
    const float normed = round_through(h * inv_rms, norm_type);            // rounding point 1
    const float product = load_value(w, ulong(column + j), w_type) * normed;
    store_value(out, first + j, store_type, round_through(product, out_type));  // rounding point 2
  }
}
