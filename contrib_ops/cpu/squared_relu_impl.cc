// Validation and instruction-set dispatch of SquaredRelu's CPU math core (isa_dispatch.h).
#include "squared_relu_impl.h"

#include "isa_dispatch.h"

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(SquaredReluCpuArgs, SquaredReluItems)

const char* ValidateArgs(const SquaredReluCpuArgs& a) {
  if (!IsSupportedElemType(static_cast<int64_t>(a.type))) return "unsupported element type";
  if (a.count < 0) return "negative element count";
  if (a.count > 0 && (a.x == nullptr || a.y == nullptr)) return "null data pointer";
  return nullptr;
}

void SquaredReluCpu(const SquaredReluCpuArgs& args, int64_t first, int64_t last) {
  static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(SquaredReluItems));
  items(args, first, last);
}

}  // namespace mambafuse
