// Validation and instruction-set dispatch of SelectiveStateUpdate's CPU math core (isa_dispatch.h).
#include "isa_dispatch.h"
#include "selective_state_update_impl.h"

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(SelectiveStateUpdateCpuArgs, SelectiveStateUpdateItems)

namespace {

bool IsFloatOr(ElemType t, ElemType other) { return t == ElemType::kFloat || t == other; }

}  // namespace

const char* ValidateArgs(const SelectiveStateUpdateCpuArgs& a) {
  if (!IsSupportedElemType(static_cast<int64_t>(a.type))) return "unsupported element type of x";
  if (!IsFloatOr(a.state_type, a.type)) return "the state's type must be float or x's type";
  if (!IsFloatOr(a.d_type, a.type)) return "D's type must be float or x's type";
  if (a.batch < 0 || a.heads < 0 || a.head_dim < 0 || a.state_size < 0) return "negative dimension";
  if (a.groups < 1 || a.heads % a.groups != 0) return "the heads H must be a multiple of the groups G >= 1";
  const bool any = a.batch * a.heads > 0;
  if (any && (a.dt == nullptr || a.A == nullptr || a.out == nullptr)) return "null data pointer";
  if (any && a.head_dim * a.state_size > 0 &&
      (a.state == nullptr || a.x == nullptr || a.present_state == nullptr || a.B == nullptr || a.C == nullptr)) {
    return "null data pointer";
  }
  return nullptr;
}

void SelectiveStateUpdateCpu(const SelectiveStateUpdateCpuArgs& args, int64_t first_item, int64_t last_item) {
  static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(SelectiveStateUpdateItems));
  items(args, first_item, last_item);
}

}  // namespace mambafuse
