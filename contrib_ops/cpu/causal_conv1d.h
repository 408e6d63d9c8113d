// ONNX Runtime-facing CausalConv1d for the CPU execution provider (docs/causal_conv1d.md): attribute and input
// validation, output allocation, and the split of the prompt over ORT's thread pool. The math lives in
// causal_conv1d_impl.h (no ORT types). The attributes, the input validation and the shape inference are shared with
// the CUDA op (contrib_ops/cuda/causal_conv1d_cuda.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "causal_conv1d_impl.h"
#include "common/ort_api.h"

namespace mambafuse {

struct CausalConv1dAttrs {
  int64_t state_width = -1;  // S
  bool silu = true;
  bool channels_last = true;
  bool round_once = false;  // the sum and SiLU in float32, y rounded once to T (ORT's CausalConvWithState)
};

// Reads state_width (required), activation (absent: "silu"), channels_last (absent: 1) and round_once (absent: 0);
// an error names a bad or missing value and the node.
Ort::Status ReadCausalConv1dAttrs(const OrtKernelInfo* info, CausalConv1dAttrs& attrs);

// Checks the inputs' presence, types and shapes against the attributes (an error names the input), allocates both
// outputs and fills `args` with the dims, type, attributes and data pointers (device pointers on a GPU provider).
// Leaves the CPU kernel's weight_kc and bias_c alone.
Ort::Status PrepareCausalConv1dArgs(Ort::KernelContext& context, const CausalConv1dAttrs& attrs,
                                    CausalConv1dCpuArgs& args);

// Shape inference: y gets x's type and shape; final_state initial_state's, where the node has one.
OrtStatusPtr InferCausalConv1dShapes(OrtShapeInferContext* context);

// A channels_last node's weight (and bias) as PrepareChannelsLast lays them out, made once when the kernel is created
// from constant initializers, instead of on every call (a decode step's one-token call spends as much on that as on
// its conv).
struct CausalConv1dPrepared {
  std::vector<float> weight_kc, bias_c;
  int64_t channels = -1, width = -1;
  ElemType type = ElemType::kFloat;
  bool ready = false;

  // Fills it where the node is channels_last, its weight a constant [C, K] or [C, 1, K] of a supported type and its
  // bias absent or a constant [C] of that type; else leaves it not ready (each call prepares its own).
  void Read(const OrtKernelInfo* info, const CausalConv1dAttrs& attrs);
  // Whether it holds this call's weight and bias (the dims and type the call's checks accepted).
  bool Fits(const CausalConv1dCpuArgs& args) const {
    return ready && args.channels == channels && args.width == width && args.type == type;
  }
};

class CausalConv1dCpuKernel {
 public:
  CausalConv1dCpuKernel(const CausalConv1dAttrs& attrs, const OrtKernelInfo* info) : attrs_(attrs) {
    prepared_.Read(info, attrs);
  }
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  CausalConv1dAttrs attrs_;
  CausalConv1dPrepared prepared_;
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
