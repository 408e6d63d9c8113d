// ONNX Runtime-facing CausalConv1d for the CUDA execution provider (docs/causal_conv1d.md, CUDA kernel): the CPU
// op's attribute and input validation (contrib_ops/cpu/causal_conv1d.h), output allocation, and the launch on ORT's
// compute stream. The kernels are behind the plain launcher (causal_conv1d_launcher.h), because ORT's headers do not
// compile under nvcc.
#pragma once

#include "common/ort_api.h"
#include "cpu/causal_conv1d.h"  // CausalConv1dAttrs

namespace mambafuse {

class CausalConv1dCudaKernel {
 public:
  explicit CausalConv1dCudaKernel(const CausalConv1dAttrs& attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  CausalConv1dAttrs attrs_;
};

struct CausalConv1dCudaOp : Ort::CustomOpBase<CausalConv1dCudaOp, CausalConv1dCudaKernel, /*WithStatus=*/true> {
  CausalConv1dCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "CausalConv1d"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
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
