// Math core of SelectiveStateUpdate on the CPU (docs/selective_state_update.md): no ONNX Runtime types,
// so it also builds into standalone tests.
#pragma once

#include <cstdint>

#include "gated_group_rms_norm_impl.h"  // ElemType, IsSupportedElemType, ElemTypeName, SelectedIsa

namespace mambafuse {

// One call computes a contiguous range of items: item i -> batch row i / heads, head i % heads, all of
// that head's P x N state elements.
struct SelectiveStateUpdateCpuArgs {
  const void* state = nullptr;    // [B, H, P, N], state_type
  const void* x = nullptr;        // [B, H, P], type
  const void* dt = nullptr;       // [B, H], type
  const void* dt_bias = nullptr;  // [H], type; optional (nullptr)
  const float* A = nullptr;       // [H]
  const void* B = nullptr;        // [B, G, N], type
  const void* C = nullptr;        // [B, G, N], type
  const void* D = nullptr;        // [H], d_type; optional (nullptr)
  void* out = nullptr;            // [B, H, P], type
  void* present_state = nullptr;  // [B, H, P, N], state_type
  ElemType type = ElemType::kFloat;        // T
  ElemType state_type = ElemType::kFloat;  // S: float or T
  ElemType d_type = ElemType::kFloat;      // float or T
  int64_t batch = 0, heads = 0, head_dim = 0, state_size = 0, groups = 1;
  bool dt_softplus = true;
};

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const SelectiveStateUpdateCpuArgs& args);

// Computes items [first_item, last_item) on the instruction-set level SelectedIsa() names.
void SelectiveStateUpdateCpu(const SelectiveStateUpdateCpuArgs& args, int64_t first_item, int64_t last_item);

}  // namespace mambafuse
