// Validation and instruction-set dispatch of CausalConv1dUpdate's CPU math core (the level SelectedIsa()
// names, as for every op of the library).
#include <cstring>

#include "causal_conv1d_update_impl.h"

namespace mambafuse {

#define MAMBAFUSE_DECLARE_ISA(ns) \
  namespace ns {                  \
  void CausalConv1dUpdateItems(const CausalConv1dUpdateCpuArgs& a, int64_t first_item, int64_t last_item); \
  }
MAMBAFUSE_DECLARE_ISA(isa_generic)
#if defined(MAMBAFUSE_X86_DISPATCH)
MAMBAFUSE_DECLARE_ISA(isa_avx2)
MAMBAFUSE_DECLARE_ISA(isa_avx512)
#endif
#undef MAMBAFUSE_DECLARE_ISA

namespace {

using ItemsFn = void (*)(const CausalConv1dUpdateCpuArgs&, int64_t, int64_t);

ItemsFn Choose() {
#if defined(MAMBAFUSE_X86_DISPATCH)
  const char* isa = SelectedIsa();
  if (std::strcmp(isa, "avx512") == 0) return &isa_avx512::CausalConv1dUpdateItems;
  if (std::strcmp(isa, "avx2") == 0) return &isa_avx2::CausalConv1dUpdateItems;
#endif
  return &isa_generic::CausalConv1dUpdateItems;
}

}  // namespace

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
  static const ItemsFn fn = Choose();
  fn(args, first_item, last_item);
}

}  // namespace mambafuse
