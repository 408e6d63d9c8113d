// ONNX Runtime-facing SquaredRelu for the CPU execution provider (docs/squared_relu.md): input validation,
// output allocation, and the split of the elements over ORT's thread pool. The math lives in squared_relu_impl.h
// (no ORT types).
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

class SquaredReluCpuKernel {
 public:
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

struct SquaredReluCpuOp : Ort::CustomOpBase<SquaredReluCpuOp, SquaredReluCpuKernel, /*WithStatus=*/true> {
  SquaredReluCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "SquaredRelu"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // X; any element type, checked by the kernel.
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }  // Y
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
