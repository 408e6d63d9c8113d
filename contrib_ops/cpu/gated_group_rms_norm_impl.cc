// Validation and run-time instruction-set dispatch for the CPU math core.
//
// The shipped library must run on any x86-64 (baseline SSE2) and on Arm, so nothing is built with
// -march=native. On x86-64 the math core is compiled three times (baseline, x86-64-v3 = AVX2+FMA+F16C,
// x86-64-v4 = AVX-512) and the widest variant the CPU reports is chosen once.
#include <cstdlib>
#include <cstring>
#include <string>

#include "gated_group_rms_norm_impl.h"
#include "isa_dispatch.h"  // MAMBAFUSE_DECLARE_ISA_ITEMS; the other cores follow the level chosen here

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(GatedGroupRMSNormArgs, ComputeItems)

namespace {

using ComputeFn = void (*)(const GatedGroupRMSNormArgs&, int64_t, int64_t);

struct IsaChoice {
  ComputeFn fn;
  const char* name;
};

IsaChoice ChooseIsa() {
#if defined(__aarch64__)
  const char* baseline = "neon";
#elif defined(__x86_64__) || defined(_M_X64)
  const char* baseline = "sse2";
#else
  const char* baseline = "generic";
#endif
  const char* forced = std::getenv("MAMBAFUSE_CPU_ISA");
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return {&isa_generic::ComputeItems, baseline};
#if defined(MAMBAFUSE_X86_DISPATCH)
  __builtin_cpu_init();
  const bool allow_avx512 = forced == nullptr || std::strcmp(forced, "avx512") == 0;
  const bool allow_avx2 = allow_avx512 || std::strcmp(forced, "avx2") == 0;
  if (allow_avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return {&isa_avx512::ComputeItems, "avx512"};
  }
  if (allow_avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2")) {
    return {&isa_avx2::ComputeItems, "avx2"};
  }
#endif
  return {&isa_generic::ComputeItems, baseline};
}

const IsaChoice& Isa() {
  static const IsaChoice choice = ChooseIsa();
  return choice;
}

}  // namespace

bool IsSupportedElemType(int64_t onnx_type) {
  return onnx_type == static_cast<int64_t>(ElemType::kFloat) ||
         onnx_type == static_cast<int64_t>(ElemType::kFloat16) ||
         onnx_type == static_cast<int64_t>(ElemType::kBFloat16);
}

const char* ElemTypeName(int64_t onnx_type) {
  switch (onnx_type) {
    case 1: return "float";
    case 2: return "uint8";
    case 3: return "int8";
    case 4: return "uint16";
    case 5: return "int16";
    case 6: return "int32";
    case 7: return "int64";
    case 8: return "string";
    case 9: return "bool";
    case 10: return "float16";
    case 11: return "double";
    case 12: return "uint32";
    case 13: return "uint64";
    case 16: return "bfloat16";
    default: return "an unsupported element type";
  }
}

const char* ValidateArgs(const GatedGroupRMSNormArgs& a) {
  if (a.group_size <= 0) return "group_size must be > 0";
  if (a.channels % a.group_size != 0) return "the last axis C is not divisible by group_size";
  if (a.rows < 0 || a.channels < 0) return "negative dimension";
  const auto supported = [](ElemType t) { return IsSupportedElemType(static_cast<int64_t>(t)); };
  if (!supported(a.y_type) || !supported(a.z_type) || !supported(a.w_type) || !supported(a.norm_type) ||
      !supported(a.gated_type) ||
      !supported(a.out_type) || !supported(a.out_storage_type)) {
    return "unsupported element type";
  }
  if (a.out_storage_type != a.out_type && a.out_storage_type != ElemType::kFloat) {
    return "the output tensor's type differs from output_dtype and is not float";
  }
  if (a.rows * a.channels > 0 && (a.y == nullptr || a.z == nullptr || a.w == nullptr || a.out == nullptr)) {
    return "null data pointer";
  }
  return nullptr;
}

bool HasFloat32Subnormal(const void* data, ElemType type, int64_t count) {
  if (type == ElemType::kFloat16) return false;  // a float16 subnormal widens to a normal float
  // Branch-free loops over the bits (the compiler vectorizes them): |bits| - 1 below 0x007FFFFF exactly for
  // a subnormal (a zero wraps to the top). bfloat16 is the high half of a float32.
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t lowest = ~0u;
  if (type == ElemType::kFloat) {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t bits = 0;
      std::memcpy(&bits, bytes + 4 * i, 4);
      const uint32_t magnitude_less_one = (bits & 0x7FFFFFFFu) - 1u;
      lowest = magnitude_less_one < lowest ? magnitude_less_one : lowest;
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t half = 0;
      std::memcpy(&half, bytes + 2 * i, 2);
      const uint32_t magnitude_less_one = ((static_cast<uint32_t>(half) << 16) & 0x7FFFFFFFu) - 1u;
      lowest = magnitude_less_one < lowest ? magnitude_less_one : lowest;
    }
  }
  return lowest < 0x007FFFFFu;
}

void GatedGroupRMSNormCpu(const GatedGroupRMSNormArgs& args, int64_t first_item, int64_t last_item) {
  Isa().fn(args, first_item, last_item);
}

const char* SelectedIsa() { return Isa().name; }

const char* IsaEnvironmentError() {
  static const std::string message = []() -> std::string {
    const char* forced = std::getenv("MAMBAFUSE_CPU_ISA");
    if (forced == nullptr) return {};
#if defined(MAMBAFUSE_X86_DISPATCH)
    const char* accepted[] = {"baseline", "avx2", "avx512"};
    const char* accepted_text = "baseline, avx2 or avx512";
#else
    const char* accepted[] = {"baseline"};
    const char* accepted_text = "baseline (the only level of this build)";
#endif
    for (const char* name : accepted) {
      if (std::strcmp(forced, name) == 0) return {};
    }
    return std::string("MAMBAFUSE_CPU_ISA='") + forced + "' is not an instruction-set level of this library; use " +
           accepted_text + ", or unset it for the widest this CPU has";
  }();
  return message.empty() ? nullptr : message.c_str();
}

}  // namespace mambafuse
