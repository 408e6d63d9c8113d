// Validation and instruction-set dispatch of CausalConv1dUpdate's CPU math core (isa_dispatch.h).
#include "causal_conv1d_update_impl.h"
#include "isa_dispatch.h"

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(CausalConv1dUpdateCpuArgs, CausalConv1dUpdateItems)

const char* ValidateArgs(const CausalConv1dUpdateCpuArgs& a) {
  if (!IsSupportedElemType(static_cast<int64_t>(a.type))) return "unsupported element type";
  if (a.batch < 0 || a.channels < 0 || a.state_len < 0) return "negative dimension";
  if (a.new_columns < 1) return "x must have at least one new column (L >= 1)";
  if (a.width < 1) return "the kernel width K must be >= 1";
  if (a.state_len < a.width - 1) return "conv_state must hold at least K - 1 columns";
  if (a.batch * a.channels > 0 && (a.x == nullptr || a.weight == nullptr || a.y == nullptr)) {
    return "null data pointer";
  }
  if (a.batch * a.channels * a.state_len > 0 && (a.conv_state == nullptr || a.present_state == nullptr)) {
    return "null data pointer";
  }
  return nullptr;
}

void CausalConv1dUpdateCpu(const CausalConv1dUpdateCpuArgs& args, int64_t first_item, int64_t last_item) {
  static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(CausalConv1dUpdateItems));
  items(args, first_item, last_item);
}

}  // namespace mambafuse
