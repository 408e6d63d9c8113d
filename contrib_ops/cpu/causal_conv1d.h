// ONNX Runtime-facing CausalConv1d for the CPU execution provider (docs/causal_conv1d.md): attribute and input
// validation, output allocation, and the split of the prompt over ORT's thread pool. The math lives in
// causal_conv1d_impl.h (no ORT types).
#pragma once

#include <cstdint>

#include "common/ort_api.h"

namespace mambafuse {

class CausalConv1dCpuKernel {
 public:
  CausalConv1dCpuKernel(int64_t state_width, bool silu, bool channels_last)
      : state_width_(state_width), silu_(silu), channels_last_(channels_last) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  int64_t state_width_;
  bool silu_;
  bool channels_last_;
};

struct CausalConv1dCpuOp : Ort::CustomOpBase<CausalConv1dCpuOp, CausalConv1dCpuKernel, /*WithStatus=*/true> {
  CausalConv1dCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "CausalConv1d"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, weight, bias (optional), initial_state (optional); any element type, checked by the kernel.
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // y, final_state
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
