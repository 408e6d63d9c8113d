// Runs contrib_ops/metal/gated_group_rms_norm.metal, compiled as C++ against msl_shim.h, on the CPU: the
// kernel's logic (indexing, the SIMD-group reduction, rounding points) tested without a Mac.
#pragma once

#include <string>

#include "gated_group_rms_norm_impl.h"

namespace mambafuse {
namespace msl_emulation {

enum class SumOrder { kTree, kSequential };

struct Options {
  int simd_width = 32;                 // Apple GPUs: 32; the kernel must not depend on it
  int simdgroups_per_threadgroup = 4;  // the host's choice; the last threadgroup may be partly idle
  SumOrder sum_order = SumOrder::kTree;
};

// Computes the whole op as the Metal host would dispatch it; returns "" or why it could not run.
std::string Run(const GatedGroupRMSNormArgs& args, const Options& options);

}  // namespace msl_emulation
}  // namespace mambafuse
