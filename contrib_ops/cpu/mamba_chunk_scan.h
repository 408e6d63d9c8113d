// ONNX Runtime-facing MambaChunkScan for the CPU execution provider (docs/mamba_chunk_scan.md): attribute and
// input validation, output allocation, and the split of (batch row, group, block of heads) items over ORT's
// thread pool. The math lives in mamba_chunk_scan_impl.h (no ORT types). The validation, the attributes and the
// shape inference are shared with the CUDA op (contrib_ops/cuda/mamba_chunk_scan_cuda.cc).
#pragma once

#include "common/ort_api.h"
#include "mamba_chunk_scan_impl.h"

namespace mambafuse {

struct MambaChunkScanAttrs {
  bool dt_softplus = true;
  bool state_np = false;  // state_layout = 1: initial_state and final_state as [B, H, N, P]
  float dt_min = 0.f;
  float dt_max = 0.f;  // +Inf unless the node sets it
};

// Reads dt_softplus, state_layout, dt_min and dt_max (absent: 1, 0, 0, +Inf); an error names a bad value and the
// node.
Ort::Status ReadMambaChunkScanAttrs(const OrtKernelInfo* info, MambaChunkScanAttrs& attrs);

// Checks the inputs' presence, types and shapes (an error names the input), allocates both outputs and fills
// `args` with the dims, types, attributes and data pointers (device pointers on a GPU provider). Leaves the CPU
// kernel's chunk_size and heads_per_block alone.
Ort::Status PrepareMambaChunkScanArgs(Ort::KernelContext& context, const MambaChunkScanAttrs& attrs,
                                      MambaChunkScanCpuArgs& args);

// Shape inference: out is float with x's shape; final_state float [B, H, P, N] (state_layout 1: [B, H, N, P]) from
// x's and B's dims (names kept).
OrtStatusPtr InferMambaChunkScanShapes(OrtShapeInferContext* context);

class MambaChunkScanCpuKernel {
 public:
  explicit MambaChunkScanCpuKernel(MambaChunkScanAttrs attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  MambaChunkScanAttrs attrs_;
};

struct MambaChunkScanCpuOp : Ort::CustomOpBase<MambaChunkScanCpuOp, MambaChunkScanCpuKernel, /*WithStatus=*/true> {
  MambaChunkScanCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "MambaChunkScan"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  // x, dt, dt_bias (optional), A, B, C, D (optional), initial_state (optional). Any element type: the kernel
  // dispatches on the actual types and rejects unsupported ones with a message naming the input.
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 2 || index == 6 || index == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // out, final_state: float32
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace mambafuse
