// Validation and instruction-set dispatch of SelectiveStateUpdate's CPU math core. The level is the one
// the gated norm's dispatcher chose (SelectedIsa: the CPU's widest, or MAMBAFUSE_CPU_ISA's), so every op of
// the library runs on one level in a process.
#include <cstring>

#include "selective_state_update_impl.h"

namespace mambafuse {

#define MAMBAFUSE_DECLARE_ISA(ns) \
  namespace ns {                  \
  void SelectiveStateUpdateItems(const SelectiveStateUpdateCpuArgs& a, int64_t first_item, int64_t last_item); \
  }
MAMBAFUSE_DECLARE_ISA(isa_generic)
#if defined(MAMBAFUSE_X86_DISPATCH)
MAMBAFUSE_DECLARE_ISA(isa_avx2)
MAMBAFUSE_DECLARE_ISA(isa_avx512)
#endif
#undef MAMBAFUSE_DECLARE_ISA

namespace {

using ItemsFn = void (*)(const SelectiveStateUpdateCpuArgs&, int64_t, int64_t);

ItemsFn Choose() {
#if defined(MAMBAFUSE_X86_DISPATCH)
  const char* isa = SelectedIsa();
  if (std::strcmp(isa, "avx512") == 0) return &isa_avx512::SelectiveStateUpdateItems;
  if (std::strcmp(isa, "avx2") == 0) return &isa_avx2::SelectiveStateUpdateItems;
#endif
  return &isa_generic::SelectiveStateUpdateItems;
}

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
  static const ItemsFn fn = Choose();
  fn(args, first_item, last_item);
}

}  // namespace mambafuse
