// ONNX Runtime-facing CausalConv1dUpdate for the CPU execution provider (docs/causal_conv1d_update.md):
// attribute and input validation, output allocation, and the split of (batch, channel) items over ORT's
// thread pool. The math lives in causal_conv1d_update_impl.h (no ORT types).
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class CausalConv1dUpdateCpuKernel {
 public:
  explicit CausalConv1dUpdateCpuKernel(bool silu) : silu_(silu) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  bool silu_;
};

struct CausalConv1dUpdateCpuOp
    : Ort::CustomOpBase<CausalConv1dUpdateCpuOp, CausalConv1dUpdateCpuKernel, /*WithStatus=*/true> {
  CausalConv1dUpdateCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "CausalConv1dUpdate"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, conv_state, weight, bias (optional); any element type, checked by the kernel.
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // y, present_state
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
