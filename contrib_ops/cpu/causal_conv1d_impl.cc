// Validation, preparation and instruction-set dispatch of CausalConv1d's CPU math core (isa_dispatch.h).
#include "causal_conv1d_impl.h"
#include "decode_step_vector.h"  // LoadScalar
#include "isa_dispatch.h"

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(CausalConv1dCpuArgs, CausalConv1dItems)

namespace {

template <int kT>
void Widen(const CausalConv1dCpuArgs& a, float* weight_kc, float* bias_c) {
  for (int64_t c = 0; c < a.channels; ++c) {
    for (int64_t k = 0; k < a.width; ++k) {
      weight_kc[k * a.channels + c] = isa_generic::LoadScalar<kT>(a.weight, c * a.width + k);
    }
    bias_c[c] = a.bias != nullptr ? isa_generic::LoadScalar<kT>(a.bias, c) : 0.f;
  }
}

}  // namespace

const char* ValidateArgs(const CausalConv1dCpuArgs& a) {
  if (!IsSupportedElemType(static_cast<int64_t>(a.type))) return "unsupported element type";
  if (a.batch < 0 || a.channels < 0 || a.state_len < 0) return "negative dimension";
  if (a.length < 1) return "the prompt must have at least one token (L >= 1)";
  if (a.width < 1) return "the kernel width K must be >= 1";
  if (a.width > kCausalConv1dMaxWidth) return "the kernel width K must be at most 16 on the CPU";
  if (a.state_len < a.width - 1) return "state_width must be at least K - 1";
  if (a.batch * a.channels > 0 && (a.x == nullptr || a.weight == nullptr || a.y == nullptr)) {
    return "null data pointer";
  }
  if (a.batch * a.channels * a.state_len > 0 && a.final_state == nullptr) return "null data pointer";
  if (a.channels_last && a.batch * a.channels > 0 && (a.weight_kc == nullptr || a.bias_c == nullptr)) {
    return "channels_last needs the prepared weight";
  }
  return nullptr;
}

int64_t CausalConv1dItems(const CausalConv1dCpuArgs& a) {
  if (!a.channels_last) return a.batch * a.channels;
  const int64_t blocks = (a.length + kCausalConv1dTokenBlock - 1) / kCausalConv1dTokenBlock;
  return a.channels > 0 ? a.batch * blocks : 0;
}

void PrepareChannelsLast(const CausalConv1dCpuArgs& a, float* weight_kc, float* bias_c) {
  switch (a.type) {
    case ElemType::kFloat16: Widen<isa_generic::kF16>(a, weight_kc, bias_c); break;
    case ElemType::kBFloat16: Widen<isa_generic::kBF16>(a, weight_kc, bias_c); break;
    default: Widen<isa_generic::kNone>(a, weight_kc, bias_c); break;
  }
}

void CausalConv1dCpu(const CausalConv1dCpuArgs& args, int64_t first_item, int64_t last_item) {
  static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(CausalConv1dItems));
  items(args, first_item, last_item);
}

}  // namespace mambafuse
