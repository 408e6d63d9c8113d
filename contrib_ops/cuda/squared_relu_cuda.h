// ONNX Runtime-facing SquaredRelu for the CUDA execution provider (docs/squared_relu.md): input validation, output
// allocation, and the launch on ORT's compute stream. The kernel is behind the plain launcher
// (squared_relu_launcher.h), because ORT's headers do not compile under nvcc.
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class SquaredReluCudaKernel {
 public:
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

// Input: X; output: Y.
struct SquaredReluCudaOp : Ort::CustomOpBase<SquaredReluCudaOp, SquaredReluCudaKernel, /*WithStatus=*/true> {
  SquaredReluCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "SquaredRelu"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
