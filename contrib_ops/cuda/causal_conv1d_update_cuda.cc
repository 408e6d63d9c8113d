#include "causal_conv1d_update_cuda.h"

#include <cstring>
#include <memory>
#include <string>

#include "causal_conv1d_update_launcher.h"
#include "cpu/decode_step_common.h"  // TensorDims, OpError, ForwardTypeShape

namespace mambafuse {
namespace {

Ort::Status Invalid(const std::string& message) { return OpError("CausalConv1dUpdate", message); }

}  // namespace

OrtStatusPtr CausalConv1dUpdateCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    const size_t count = context.GetInputCount();
    const char* names[4] = {"x", "conv_state", "weight", "bias"};
    const OrtValue* values[4] = {};
    TensorDims dims[4];
    for (size_t i = 0; i < 4 && i < count; ++i) {
      const Ort::ConstValue value = context.GetInput(i);
      if (!value) continue;
      if (!value.IsTensor()) return Invalid(std::string(names[i]) + " must be a tensor");
      values[i] = value;
      dims[i].Read(value);
    }
    for (size_t i = 0; i < 3; ++i) {
      if (values[i] == nullptr) return Invalid(std::string("input ") + names[i] + " is missing");
    }
    const int64_t type = dims[0].type();
    if (!IsSupportedElemType(type)) {
      return Invalid(std::string("x has element type ") + ElemTypeName(type) + "; supported: float, float16, bfloat16");
    }
    for (size_t i = 1; i < 4; ++i) {
      if (values[i] != nullptr && dims[i].type() != type) {
        return Invalid(std::string(names[i]) + " must have x's type " + ElemTypeName(type) + ", got " +
                       ElemTypeName(dims[i].type()));
      }
    }
    if (dims[0].rank() != 3) return Invalid("x must have shape [B, C, L], got " + dims[0].ToString());
    const int64_t batch = dims[0].data()[0], channels = dims[0].data()[1], length = dims[0].data()[2];
    if (length < 1) return Invalid("x must have at least one new column (L >= 1), got " + dims[0].ToString());
    if (dims[1].rank() != 3 || dims[1].data()[0] != batch || dims[1].data()[1] != channels) {
      return Invalid("conv_state must have shape [B, C, S] with x's B and C (" + dims[0].ToString() + "), got " +
                     dims[1].ToString());
    }
    const int64_t state_len = dims[1].data()[2];
    const TensorDims& w = dims[2];
    const bool w_ok = (w.rank() == 2 || (w.rank() == 3 && w.data()[1] == 1)) && w.data()[0] == channels;
    if (!w_ok) return Invalid("weight must have shape [C, 1, K] or [C, K] with C = " + std::to_string(channels) +
                              ", got " + w.ToString());
    const int64_t kernel_size = w.back();
    if (kernel_size < 1 || state_len < kernel_size - 1) {
      return Invalid("the state length S = " + std::to_string(state_len) + " must be at least K - 1 = " +
                     std::to_string(kernel_size - 1));
    }
    if (values[3] != nullptr && (dims[3].rank() != 1 || dims[3].back() != channels)) {
      return Invalid("bias must have shape [C] = [" + std::to_string(channels) + "], got " + dims[3].ToString());
    }
    Ort::UnownedValue y = context.GetOutput(0, dims[0].data(), dims[0].rank());
    Ort::UnownedValue present = context.GetOutput(1, dims[1].data(), dims[1].rank());
    if (batch * channels == 0) return Ort::Status{};
    CausalConv1dUpdateArgs args;
    args.x = Ort::ConstValue(values[0]).GetTensorRawData();
    args.conv_state = Ort::ConstValue(values[1]).GetTensorRawData();
    args.weight = Ort::ConstValue(values[2]).GetTensorRawData();
    args.bias = values[3] != nullptr ? Ort::ConstValue(values[3]).GetTensorRawData() : nullptr;
    args.y = y.GetTensorMutableRawData();
    args.present_state = present.GetTensorMutableRawData();
    args.type = static_cast<ElemType>(type);
    args.batch = batch;
    args.channels = channels;
    args.length = length;
    args.state_len = state_len;
    args.kernel_size = kernel_size;
    args.silu = silu_;
    if (const char* problem = CheckCausalConv1dUpdateArgs(args)) return Invalid(problem);
    // ORT's compute stream; nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (const cudaError_t error = LaunchCausalConv1dUpdate(args, stream); error != cudaSuccess) {
      return Ort::Status((std::string("CausalConv1dUpdate: CUDA launch failed: ") + cudaGetErrorName(error) + " (" +
                          cudaGetErrorString(error) + ")")
                             .c_str(),
                         ORT_EP_FAIL);
    }
    return Ort::Status{};
  });
}

CausalConv1dUpdateCudaOp::CausalConv1dUpdateCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    // The CPU op's inference: y gets x's type and shape, present_state conv_state's.
    if (OrtStatusPtr status = ForwardTypeShape(context, 0, 0)) return status;
    return ForwardTypeShape(context, 1, 1);
  };
}

OrtStatusPtr CausalConv1dUpdateCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                      void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    std::string activation = "silu";
    const OrtApi& api = Ort::GetApi();
    size_t size = 0;
    if (OrtStatus* status = api.KernelInfoGetAttribute_string(info, "activation", nullptr, &size)) {
      api.ReleaseStatus(status);  // absent: the default
    } else {
      activation.assign(size, '\0');
      Ort::ThrowOnError(api.KernelInfoGetAttribute_string(info, "activation", activation.data(), &size));
      activation.resize(std::strlen(activation.c_str()));
    }
    if (activation != "silu" && activation != "none") {
      return Invalid("activation must be \"silu\" or \"none\", got \"" + activation + "\"");
    }
    *kernel = std::make_unique<CausalConv1dUpdateCudaKernel>(activation == "silu").release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
