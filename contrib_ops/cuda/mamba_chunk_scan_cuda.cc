#include "mamba_chunk_scan_cuda.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "cpu/decode_step_common.h"  // OpError
#include "mamba_chunk_scan_launcher.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "MambaChunkScan";

// MAMBAFUSE_CHUNK_SCAN_CUDA picks the kernel (tests and benchmarks): "chunked", "sequential", "step" (a one-token
// prompt; longer ones as "auto"), or unset / "auto".
bool RequestedPath(ChunkScanCudaPath& path) {
  const char* value = std::getenv("MAMBAFUSE_CHUNK_SCAN_CUDA");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) {
    path = ChunkScanCudaPath::kAuto;
  } else if (std::strcmp(value, "chunked") == 0) {
    path = ChunkScanCudaPath::kChunked;
  } else if (std::strcmp(value, "sequential") == 0) {
    path = ChunkScanCudaPath::kSequential;
  } else if (std::strcmp(value, "step") == 0) {
    path = ChunkScanCudaPath::kStep;
  } else {
    return false;
  }
  return true;
}

}  // namespace

OrtStatusPtr MambaChunkScanCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    MambaChunkScanCpuArgs args;
    if (Ort::Status status = PrepareMambaChunkScanArgs(context, attrs_, args); !status.IsOK()) return status;
    if (const char* problem = CheckMambaChunkScanCudaArgs(args)) return OpError(kOp, problem);
    ChunkScanCudaPath path;
    if (!RequestedPath(path)) {
      return OpError(kOp,
                     "MAMBAFUSE_CHUNK_SCAN_CUDA must be \"chunked\", \"sequential\", \"step\" or \"auto\" (or unset)");
    }
    // ORT's compute stream; nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (const cudaError_t error = LaunchMambaChunkScan(args, path, stream); error != cudaSuccess) {
      return Ort::Status((std::string("MambaChunkScan: CUDA launch failed: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")")
                             .c_str(),
                         ORT_EP_FAIL);
    }
    return Ort::Status{};
  });
}

MambaChunkScanCudaOp::MambaChunkScanCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferMambaChunkScanShapes(context);
  };
}

OrtStatusPtr MambaChunkScanCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                  void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    MambaChunkScanAttrs attrs;
    if (Ort::Status status = ReadMambaChunkScanAttrs(info, attrs); !status.IsOK()) return status;
    *kernel = std::make_unique<MambaChunkScanCudaKernel>(attrs).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
