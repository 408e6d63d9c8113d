#include "causal_conv1d_update.h"

#include <algorithm>
#include <memory>
#include <string>

#include "causal_conv1d_update_impl.h"
#include "decode_step_common.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "CausalConv1dUpdate";

// A chunk covers enough channels that handing it to another thread pays for the hand-off
// (Nemotron-H-8B decode: 10240 channels, 2 chunks).
constexpr int64_t kMinChannelsPerChunk = 4096;

Ort::Status PrepareArgs(Ort::KernelContext& context, bool silu, CausalConv1dUpdateCpuArgs& a) {
  const size_t count = context.GetInputCount();
  if (count < 3) {
    return OpError(kOp, "expects the inputs x, conv_state, weight, bias (optional); got " + std::to_string(count));
  }
  const char* names[4] = {"x", "conv_state", "weight", "bias"};
  TensorDims dims[4];
  const void* data[4] = {};
  bool present[4] = {};
  for (size_t i = 0; i < 4; ++i) {
    present[i] = i < count && ReadOptionalInput(context, i, dims[i], &data[i]);
    if (!present[i] && i != 3) return OpError(kOp, std::string("input ") + names[i] + " is missing");
  }
  const int64_t type = dims[0].type();
  if (!IsSupportedElemType(type)) {
    return OpError(kOp, std::string("x has element type ") + ElemTypeName(type) +
                            "; supported: float, float16, bfloat16");
  }
  for (size_t i = 1; i < 4; ++i) {
    if (present[i] && dims[i].type() != type) {
      return OpError(kOp, std::string(names[i]) + " must have x's type " + ElemTypeName(type) + ", got " +
                              ElemTypeName(dims[i].type()));
    }
  }
  if (dims[0].rank() != 3) return OpError(kOp, "x must be 3-D (B, C, L), got shape " + dims[0].ToString());
  const int64_t batch = dims[0].data()[0], channels = dims[0].data()[1], new_cols = dims[0].data()[2];
  if (new_cols < 1) return OpError(kOp, "x must have at least one new column (L >= 1), got " + dims[0].ToString());
  const TensorDims& state = dims[1];
  if (state.rank() != 3 || state.data()[0] != batch || state.data()[1] != channels) {
    return OpError(kOp, "conv_state must have shape [" + std::to_string(batch) + ", " + std::to_string(channels) +
                            ", S] (B, C, S), got " + state.ToString());
  }
  const TensorDims& w = dims[2];
  const bool w_ok = (w.rank() == 2 || (w.rank() == 3 && w.data()[1] == 1)) && w.data()[0] == channels && w.back() >= 1;
  if (!w_ok) {
    return OpError(kOp, "weight must have shape [" + std::to_string(channels) + ", 1, K] or [" +
                            std::to_string(channels) + ", K] with K >= 1, got " + w.ToString());
  }
  const int64_t width = w.back(), state_len = state.data()[2];
  if (state_len < width - 1) {
    return OpError(kOp, "conv_state holds S = " + std::to_string(state_len) + " columns, fewer than K - 1 = " +
                            std::to_string(width - 1) + " (the kernel width K = " + std::to_string(width) +
                            " comes from weight)");
  }
  if (present[3] && !HasDims(dims[3], {channels})) {
    return OpError(kOp, "bias must have shape [" + std::to_string(channels) + "], got " + dims[3].ToString());
  }
  a.type = static_cast<ElemType>(type);
  a.batch = batch;
  a.channels = channels;
  a.new_columns = new_cols;
  a.state_len = state_len;
  a.width = width;
  a.silu = silu;
  a.x = data[0];
  a.conv_state = data[1];
  a.weight = data[2];
  a.bias = present[3] ? data[3] : nullptr;
  Ort::UnownedValue y = context.GetOutput(0, dims[0].data(), dims[0].rank());
  Ort::UnownedValue present_state = context.GetOutput(1, state.data(), state.rank());
  TensorDims y_dims, state_out_dims;
  y_dims.Read(y);
  state_out_dims.Read(present_state);
  if (y_dims.type() != type || state_out_dims.type() != type) {
    return OpError(kOp, std::string("the outputs must have x's type ") + ElemTypeName(type) + ", got " +
                            ElemTypeName(y_dims.type()) + " and " + ElemTypeName(state_out_dims.type()));
  }
  a.y = ElementCount(dims[0]) > 0 ? y.GetTensorMutableRawData() : nullptr;
  a.present_state = ElementCount(state) > 0 ? present_state.GetTensorMutableRawData() : nullptr;
  if (const char* problem = ValidateArgs(a)) return OpError(kOp, problem);
  return Ort::Status{};
}

}  // namespace

OrtStatusPtr CausalConv1dUpdateCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    CausalConv1dUpdateCpuArgs args;
    if (Ort::Status status = PrepareArgs(context, silu_, args); !status.IsOK()) return status;
    const int64_t items = args.batch * args.channels;
    if (items == 0) return Ort::Status{};
    const int64_t chunks = std::clamp<int64_t>(items / kMinChannelsPerChunk, 1, items);
    RunInChunks(context, &CausalConv1dUpdateCpu, args, items, chunks);
    return Ort::Status{};
  });
}

CausalConv1dUpdateCpuOp::CausalConv1dUpdateCpuOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    // y: x's type and shape; present_state: conv_state's.
    if (OrtStatusPtr status = ForwardTypeShape(context, 0, 0)) return status;
    return ForwardTypeShape(context, 1, 1);
  };
}

OrtStatusPtr CausalConv1dUpdateCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                     void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    bool silu = true;
    if (Ort::Status status = ReadSiluActivation(info, kOp, silu); !status.IsOK()) return status;
    *kernel = std::make_unique<CausalConv1dUpdateCpuKernel>(silu).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
