// The Metal kernel compiled as C++ (see msl_emulation.h). Everything this file needs from the standard
// library comes before the shim: after it, `device`, `constant`, `thread`, `threadgroup` and `kernel` are
// macros that expand to nothing.
#include "msl_emulation.h"

#include <cstdint>
#include <string>

#include <metal_stdlib>  // contrib_ops/metal/emulation/metal_stdlib -> msl_shim.h

#include "gated_group_rms_norm.metal"

namespace mambafuse {
namespace msl_emulation {

std::string Run(const GatedGroupRMSNormArgs& args, const Options& options) {
  if (const char* problem = ValidateArgs(args)) return problem;
  const int64_t groups_per_row = args.channels / args.group_size;
  const int64_t items = args.rows * groups_per_row;
  if (items == 0) return {};
  if (items > INT64_C(0xFFFFFFFF) || args.channels > INT64_C(0xFFFFFFFF)) return "too large for 32-bit indices";
  if (options.simd_width <= 0 || (options.simd_width & (options.simd_width - 1)) != 0) {
    return "simd_width must be a power of two";
  }
  // The function constants: what MTLFunctionConstantValues sets on a Mac.
  y_type = static_cast<int>(args.y_type);
  z_type = static_cast<int>(args.z_type);
  w_type = static_cast<int>(args.w_type);
  norm_type = static_cast<int>(args.norm_type);
  out_type = static_cast<int>(args.out_type);
  store_type = static_cast<int>(args.out_storage_type);
  gated_type = static_cast<int>(args.gated_type);

  GatedGroupRMSNormParams params;
  params.channels = static_cast<uint>(args.channels);
  params.group_size = static_cast<uint>(args.group_size);
  params.groups_per_row = static_cast<uint>(groups_per_row);
  params.items = static_cast<uint>(items);
  params.epsilon = args.epsilon;

  const auto simdgroups = static_cast<uint>(options.simdgroups_per_threadgroup);
  const auto threadgroups = static_cast<uint>((items + simdgroups - 1) / simdgroups);
  const auto order = options.sum_order == SumOrder::kTree ? metal::SimdSumOrder::kTree : metal::SimdSumOrder::kLaneOrder;
  const auto* y = static_cast<const uchar*>(args.y);
  const auto* z = static_cast<const uchar*>(args.z);
  const auto* w = static_cast<const uchar*>(args.w);
  auto* out = static_cast<uchar*>(args.out);
  metal::DispatchSimdGroups(threadgroups, simdgroups, options.simd_width, order,
                            [&](uint tg, uint sg, uint sgs, uint lane, uint width) {
                              gated_group_rms_norm(y, z, w, out, params, tg, sg, sgs, lane, width);
                            });
  return {};
}

}  // namespace msl_emulation
}  // namespace mambafuse
