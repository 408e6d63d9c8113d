// ONNX Runtime-facing MambaChunkScan for the CPU execution provider (docs/mamba_chunk_scan.md): attribute and
// input validation, output allocation, and the split of (batch row, group, block of heads) items over ORT's
// thread pool. The math lives in mamba_chunk_scan_impl.h (no ORT types).
#pragma once

#include "common/ort_api.h"

namespace mambafuse {

struct MambaChunkScanAttrs {
  bool dt_softplus = true;
  float dt_min = 0.f;
  float dt_max = 0.f;  // +Inf unless the node sets it
};

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
