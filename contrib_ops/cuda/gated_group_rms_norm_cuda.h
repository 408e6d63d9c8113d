// ONNX Runtime-facing GatedGroupRMSNorm for the CUDA execution provider. Validation, output allocation and
// the static checks are the CPU op's (contrib_ops/cpu/gated_group_rms_norm.h); the kernels are behind the
// plain launcher in gated_group_rms_norm_launcher.h, because ORT's headers do not compile under nvcc.
#pragma once

#include "common/ort_api.h"
#include "cpu/gated_group_rms_norm.h"

namespace mambafuse {

class GatedGroupRMSNormCudaKernel {
 public:
  explicit GatedGroupRMSNormCudaKernel(GatedGroupRMSNormAttrs attrs) : attrs_(attrs) {}
  // Enqueues the op on ORT's compute stream; returns without waiting for the GPU.
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  GatedGroupRMSNormAttrs attrs_;
};

struct GatedGroupRMSNormCudaOp
    : Ort::CustomOpBase<GatedGroupRMSNormCudaOp, GatedGroupRMSNormCudaKernel, /*WithStatus=*/true> {
  GatedGroupRMSNormCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "GatedGroupRMSNorm"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  // Same registration as the CPU op: any element type, checked at kernel creation and at run time.
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
