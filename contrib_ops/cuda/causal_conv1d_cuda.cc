#include "causal_conv1d_cuda.h"

#include <memory>
#include <string>

#include "causal_conv1d_launcher.h"
#include "cpu/decode_step_common.h"  // OpError

namespace mambafuse {
namespace {

constexpr const char* kOp = "CausalConv1d";

}  // namespace

OrtStatusPtr CausalConv1dCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    CausalConv1dCpuArgs args;
    if (Ort::Status status = PrepareCausalConv1dArgs(context, attrs_, args); !status.IsOK()) return status;
    if (const char* problem = CheckCausalConv1dCudaArgs(args)) return OpError(kOp, problem);
    // ORT's compute stream; nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (const cudaError_t error = LaunchCausalConv1d(args, stream); error != cudaSuccess) {
      return Ort::Status((std::string(kOp) + ": CUDA launch failed: " + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")")
                             .c_str(),
                         ORT_EP_FAIL);
    }
    return Ort::Status{};
  });
}

CausalConv1dCudaOp::CausalConv1dCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferCausalConv1dShapes(context);
  };
}

OrtStatusPtr CausalConv1dCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    CausalConv1dAttrs attrs;
    if (Ort::Status status = ReadCausalConv1dAttrs(info, attrs); !status.IsOK()) return status;
    *kernel = std::make_unique<CausalConv1dCudaKernel>(attrs).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
