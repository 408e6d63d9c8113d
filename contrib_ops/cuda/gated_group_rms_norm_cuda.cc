#include "gated_group_rms_norm_cuda.h"

#include <memory>
#include <string>

#include "gated_group_rms_norm_launcher.h"

namespace mambafuse {

OrtStatusPtr GatedGroupRMSNormCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    GatedGroupRMSNormArgs args;
    if (Ort::Status status = PrepareArgs(attrs_, context, args); !status.IsOK()) return status;
    if (args.rows == 0 || args.channels == 0) return Ort::Status{};
    // ORT's compute stream: the launch is ordered with the node's neighbours and captured with them when
    // ORT records a CUDA graph. Nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    const cudaError_t error = LaunchGatedGroupRMSNorm(args, stream);
    if (error != cudaSuccess) {
      return Ort::Status((std::string("GatedGroupRMSNorm: CUDA launch failed: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")")
                             .c_str(),
                         ORT_EP_FAIL);
    }
    return Ort::Status{};
  });
}

GatedGroupRMSNormCudaOp::GatedGroupRMSNormCudaOp() { UseGatedGroupRMSNormInference(*this); }

OrtStatusPtr GatedGroupRMSNormCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                     void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    GatedGroupRMSNormAttrs attrs;
    if (Ort::Status status = ReadNode(info, attrs); !status.IsOK()) return status;
    *kernel = std::make_unique<GatedGroupRMSNormCudaKernel>(attrs).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
