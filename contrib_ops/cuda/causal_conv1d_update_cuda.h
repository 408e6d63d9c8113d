// ONNX Runtime-facing CausalConv1dUpdate for the CUDA execution provider (docs/causal_conv1d_update.md):
// attribute and input validation, output allocation, and the launch on ORT's compute stream. The kernel is
// behind the plain launcher (causal_conv1d_update_launcher.h), because ORT's headers do not compile under nvcc.
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class CausalConv1dUpdateCudaKernel {
 public:
  explicit CausalConv1dUpdateCudaKernel(bool silu) : silu_(silu) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  bool silu_;
};

// Inputs: x, conv_state, weight, bias (optional); outputs: y, present_state.
struct CausalConv1dUpdateCudaOp
    : Ort::CustomOpBase<CausalConv1dUpdateCudaOp, CausalConv1dUpdateCudaKernel, /*WithStatus=*/true> {
  CausalConv1dUpdateCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "CausalConv1dUpdate"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
