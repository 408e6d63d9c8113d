// ONNX Runtime-facing SelectiveStateUpdate for the CUDA execution provider (docs/selective_state_update.md):
// attribute and input validation, output allocation, and the launch on ORT's compute stream. The kernels
// are behind the plain launcher (selective_state_update_launcher.h), because ORT's headers do not compile
// under nvcc.
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class SelectiveStateUpdateCudaKernel {
 public:
  explicit SelectiveStateUpdateCudaKernel(bool dt_softplus) : dt_softplus_(dt_softplus) {}
  // Enqueues the op on ORT's compute stream; returns without waiting for the GPU.
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  bool dt_softplus_;
};

// Inputs: state, x, dt, dt_bias (optional), A, B, C, D (optional); outputs: out, present_state.
struct SelectiveStateUpdateCudaOp
    : Ort::CustomOpBase<SelectiveStateUpdateCudaOp, SelectiveStateUpdateCudaKernel, /*WithStatus=*/true> {
  SelectiveStateUpdateCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "SelectiveStateUpdate"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  // Any element type, checked at run time against the op's type rules.
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 3 || index == 7 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                                    : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
