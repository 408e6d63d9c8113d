#include "squared_relu_cuda.h"

#include <memory>
#include <string>

#include "cpu/decode_step_common.h"  // TensorDims, OpError, ForwardTypeShape, ElementCount
#include "squared_relu_launcher.h"

namespace mambafuse {
namespace {

Ort::Status Invalid(const std::string& message) { return OpError("SquaredRelu", message); }

}  // namespace

OrtStatusPtr SquaredReluCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    if (context.GetInputCount() != 1) return Invalid("expects one input X; got " + std::to_string(context.GetInputCount()));
    const Ort::ConstValue x = context.GetInput(0);
    if (!x) return Invalid("input X is missing");
    if (!x.IsTensor()) return Invalid("X must be a tensor");
    TensorDims dims;
    dims.Read(x);
    const int64_t type = dims.type();
    if (!IsSupportedElemType(type)) {
      return Invalid(std::string("X has element type ") + ElemTypeName(type) + "; supported: float, float16, bfloat16");
    }
    Ort::UnownedValue y = context.GetOutput(0, dims.data(), dims.rank());
    SquaredReluCpuArgs args;
    args.type = static_cast<ElemType>(type);
    args.count = ElementCount(dims);
    if (args.count == 0) return Ort::Status{};
    args.x = x.GetTensorRawData();
    args.y = y.GetTensorMutableRawData();
    if (const char* problem = CheckSquaredReluArgs(args)) return Invalid(problem);
    // ORT's compute stream; nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (const cudaError_t error = LaunchSquaredRelu(args, stream); error != cudaSuccess) {
      return Ort::Status((std::string("SquaredRelu: CUDA launch failed: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")")
                             .c_str(),
                         ORT_EP_FAIL);
    }
    return Ort::Status{};
  });
}

SquaredReluCudaOp::SquaredReluCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return ForwardTypeShape(context, 0, 0);  // Y: X's type and shape
  };
}

OrtStatusPtr SquaredReluCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* /*info*/,
                                               void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    *kernel = std::make_unique<SquaredReluCudaKernel>().release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
