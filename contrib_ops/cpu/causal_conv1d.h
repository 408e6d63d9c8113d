// ONNX Runtime-facing CausalConv1d for the CPU execution provider (docs/causal_conv1d.md): attribute and input
// validation, output allocation, and the split of the prompt over ORT's thread pool. The math lives in
// causal_conv1d_impl.h (no ORT types). The attributes, the input validation and the shape inference are shared with
// the CUDA op (contrib_ops/cuda/causal_conv1d_cuda.cc).
#pragma once

#include <cstdint>

#include "causal_conv1d_impl.h"
#include "common/ort_api.h"

namespace mambafuse {

struct CausalConv1dAttrs {
  int64_t state_width = -1;  // S
  bool silu = true;
  bool channels_last = true;
};

// Reads state_width (required), activation (absent: "silu") and channels_last (absent: 1); an error names a bad
// or missing value and the node.
Ort::Status ReadCausalConv1dAttrs(const OrtKernelInfo* info, CausalConv1dAttrs& attrs);

// Checks the inputs' presence, types and shapes against the attributes (an error names the input), allocates both
// outputs and fills `args` with the dims, type, attributes and data pointers (device pointers on a GPU provider).
// Leaves the CPU kernel's weight_kc and bias_c alone.
Ort::Status PrepareCausalConv1dArgs(Ort::KernelContext& context, const CausalConv1dAttrs& attrs,
                                    CausalConv1dCpuArgs& args);

// Shape inference: y gets x's type and shape; final_state initial_state's, where the node has one.
OrtStatusPtr InferCausalConv1dShapes(OrtShapeInferContext* context);

class CausalConv1dCpuKernel {
 public:
  explicit CausalConv1dCpuKernel(const CausalConv1dAttrs& attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  CausalConv1dAttrs attrs_;
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
