#include "squared_relu.h"

#include <algorithm>
#include <memory>
#include <string>

#include "decode_step_common.h"
#include "squared_relu_impl.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "SquaredRelu";

// A chunk covers enough elements that handing it to another thread pays for the hand-off (a decode step's
// 21504-element activation stays on the calling thread; a 2048-token prompt's is 672 chunks).
constexpr int64_t kMinElementsPerChunk = 1 << 16;

Ort::Status PrepareArgs(Ort::KernelContext& context, SquaredReluCpuArgs& a) {
  if (context.GetInputCount() != 1) {
    return OpError(kOp, "expects one input X; got " + std::to_string(context.GetInputCount()));
  }
  TensorDims dims;
  const void* x = nullptr;
  if (!ReadOptionalInput(context, 0, dims, &x)) return OpError(kOp, "input X is missing");
  const int64_t type = dims.type();
  if (!IsSupportedElemType(type)) {
    return OpError(kOp, std::string("X has element type ") + ElemTypeName(type) + "; supported: float, float16, bfloat16");
  }
  Ort::UnownedValue y = context.GetOutput(0, dims.data(), dims.rank());
  TensorDims y_dims;
  y_dims.Read(y);
  if (y_dims.type() != type) {
    return OpError(kOp, std::string("Y must have X's type ") + ElemTypeName(type) + ", got " +
                            ElemTypeName(y_dims.type()));
  }
  a.type = static_cast<ElemType>(type);
  a.count = ElementCount(dims);
  a.x = x;
  a.y = a.count > 0 ? y.GetTensorMutableRawData() : nullptr;
  if (const char* problem = ValidateArgs(a)) return OpError(kOp, problem);
  return Ort::Status{};
}

}  // namespace

OrtStatusPtr SquaredReluCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    SquaredReluCpuArgs args;
    if (Ort::Status status = PrepareArgs(context, args); !status.IsOK()) return status;
    if (args.count == 0) return Ort::Status{};
    const int64_t chunks = std::max<int64_t>(args.count / kMinElementsPerChunk, 1);
    RunInChunks(context, &SquaredReluCpu, args, args.count, chunks);
    return Ort::Status{};
  });
}

SquaredReluCpuOp::SquaredReluCpuOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return ForwardTypeShape(context, 0, 0);  // Y: X's type and shape
  };
}

OrtStatusPtr SquaredReluCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* /*info*/,
                                              void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    *kernel = std::make_unique<SquaredReluCpuKernel>().release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
