// Math core of GatedGroupRMSNorm on the CPU: no ONNX Runtime types, so it also builds into standalone
// tests (cross-compiled for aarch64, run under sanitizers) without the ORT headers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mambafuse {

// ONNX TensorProto element-type numbers of the types the op accepts.
enum class ElemType : int32_t { kFloat = 1, kFloat16 = 10, kBFloat16 = 16 };

bool IsSupportedElemType(int64_t onnx_type);
const char* ElemTypeName(int64_t onnx_type);

// One call computes a contiguous range of (row, group) items:
//   item i -> row = i / groups_per_row, group = i % groups_per_row.
struct GatedGroupRMSNormArgs {
  const void* y = nullptr;  // [rows, channels], y_type
  const void* z = nullptr;  // [rows, channels], z_type
  const void* w = nullptr;  // [channels], w_type
  void* out = nullptr;      // [rows, channels], out_storage_type
  ElemType y_type = ElemType::kFloat;
  ElemType z_type = ElemType::kFloat;
  ElemType w_type = ElemType::kFloat;
  ElemType gated_type = ElemType::kFloat;    // rounding point of h = y * silu(z) (gated_dtype; float = none)
  ElemType norm_type = ElemType::kFloat;     // rounding point before the weight multiply
  ElemType out_type = ElemType::kFloat;      // rounding point of the product
  ElemType out_storage_type = ElemType::kFloat;  // type of the output buffer; wider than or equal to out_type
  int64_t rows = 0;
  int64_t channels = 0;
  int64_t group_size = 0;
  float epsilon = 0.f;
  // The caller found no W element a float32 subnormal (HasFloat32Subnormal). On x86 the math core runs a
  // group's norm pass together with the next group's gate pass only then (it reads W under DAZ there).
  bool w_subnormal_free = false;
};

// Whether any of `count` elements of `data` (float32, float16 or bfloat16) is a float32 subnormal once
// widened (never for float16).
bool HasFloat32Subnormal(const void* data, ElemType type, int64_t count);

// Computes items [first_item, last_item). Arguments must already be validated (see ValidateArgs).
void GatedGroupRMSNormCpu(const GatedGroupRMSNormArgs& args, int64_t first_item, int64_t last_item);

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const GatedGroupRMSNormArgs& args);

// Which instruction-set variant GatedGroupRMSNormCpu dispatches to on this machine
// ("avx512", "avx2", "sse2", "neon", "generic"). MAMBAFUSE_CPU_ISA=baseline forces the baseline.
const char* SelectedIsa();

// Returns nullptr when MAMBAFUSE_CPU_ISA is unset or names a known level (baseline; on x86-64 also avx2,
// avx512), else a message naming the variable, its value and the accepted values. A known level the CPU
// lacks falls back to the widest it has; an unknown one is a mistake the library reports.
const char* IsaEnvironmentError();

}  // namespace mambafuse
