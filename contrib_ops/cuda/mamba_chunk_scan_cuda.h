// ONNX Runtime-facing MambaChunkScan for the CUDA execution provider (docs/mamba_chunk_scan.md, Kernel): the CPU
// op's validation, attributes and shape inference (cpu/mamba_chunk_scan.h), output allocation, and the launch on
// ORT's compute stream. The kernels are behind the plain launcher (mamba_chunk_scan_launcher.h), because ORT's
// headers do not compile under nvcc.
#pragma once

#include "common/ort_api.h"
#include "cpu/mamba_chunk_scan.h"  // MambaChunkScanAttrs

namespace mambafuse {

class MambaChunkScanCudaKernel {
 public:
  explicit MambaChunkScanCudaKernel(MambaChunkScanAttrs attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  MambaChunkScanAttrs attrs_;
};

struct MambaChunkScanCudaOp
    : Ort::CustomOpBase<MambaChunkScanCudaOp, MambaChunkScanCudaKernel, /*WithStatus=*/true> {
  MambaChunkScanCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "MambaChunkScan"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  // x, dt, dt_bias (optional), A, B, C, D (optional), initial_state (optional), as the CPU op.
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 2 || index == 6 || index == 7 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // out, final_state: float32
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace mambafuse
