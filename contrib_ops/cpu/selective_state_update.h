// ONNX Runtime-facing SelectiveStateUpdate for the CPU execution provider (docs/selective_state_update.md):
// attribute and input validation, output allocation, and the split of (batch, head) items over ORT's
// thread pool. The math lives in selective_state_update_impl.h (no ORT types).
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class SelectiveStateUpdateCpuKernel {
 public:
  explicit SelectiveStateUpdateCpuKernel(bool dt_softplus) : dt_softplus_(dt_softplus) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  bool dt_softplus_;
};

struct SelectiveStateUpdateCpuOp
    : Ort::CustomOpBase<SelectiveStateUpdateCpuOp, SelectiveStateUpdateCpuKernel, /*WithStatus=*/true> {
  SelectiveStateUpdateCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "SelectiveStateUpdate"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // state, x, dt, dt_bias (optional), A, B, C, D (optional). Any element type: the kernel dispatches on the
  // actual types and rejects unsupported ones with a message naming the input.
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 || index == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // out, present_state
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
