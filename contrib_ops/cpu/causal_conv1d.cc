#include "causal_conv1d.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "causal_conv1d_impl.h"
#include "decode_step_common.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "CausalConv1d";

// An item is worth handing to another thread from about this many outputs (a 64-token block of 10240 channels is
// 655360; a channels-first item is one channel's prompt).
constexpr int64_t kMinOutputsPerChunk = 1 << 16;

}  // namespace

Ort::Status PrepareCausalConv1dArgs(Ort::KernelContext& context, const CausalConv1dAttrs& attrs,
                                    CausalConv1dCpuArgs& a) {
  const int64_t state_width = attrs.state_width;
  const bool channels_last = attrs.channels_last;
  const size_t count = context.GetInputCount();
  if (count < 2) {
    return OpError(kOp, "expects the inputs x, weight, bias (optional), initial_state (optional); got " +
                            std::to_string(count));
  }
  const char* names[4] = {"x", "weight", "bias", "initial_state"};
  TensorDims dims[4];
  const void* data[4] = {};
  bool present[4] = {};
  for (size_t i = 0; i < 4; ++i) {
    present[i] = i < count && ReadOptionalInput(context, i, dims[i], &data[i]);
    if (!present[i] && i < 2) return OpError(kOp, std::string("input ") + names[i] + " is missing");
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
  const char* layout = channels_last ? "(B, L, C)" : "(B, C, L)";
  if (dims[0].rank() != 3) return OpError(kOp, std::string("x must be 3-D ") + layout + ", got " + dims[0].ToString());
  const int64_t batch = dims[0].data()[0];
  const int64_t channels = channels_last ? dims[0].data()[2] : dims[0].data()[1];
  const int64_t length = channels_last ? dims[0].data()[1] : dims[0].data()[2];
  if (length < 1) {
    return OpError(kOp, "the prompt must have at least one token (L >= 1), x is " + dims[0].ToString());
  }
  const TensorDims& w = dims[1];
  const bool w_ok = (w.rank() == 2 || (w.rank() == 3 && w.data()[1] == 1)) && w.data()[0] == channels && w.back() >= 1;
  if (!w_ok) {
    return OpError(kOp, "weight must have shape [" + std::to_string(channels) + ", 1, K] or [" +
                            std::to_string(channels) + ", K] with K >= 1, got " + w.ToString());
  }
  const int64_t width = w.back();
  if (state_width < width - 1) {
    return OpError(kOp, "state_width must be at least K - 1 = " + std::to_string(width - 1) + " (the kernel width K = " +
                            std::to_string(width) + " comes from weight), got " + std::to_string(state_width));
  }
  if (present[2] && !HasDims(dims[2], {channels})) {
    return OpError(kOp, "bias must have shape [" + std::to_string(channels) + "], got " + dims[2].ToString());
  }
  if (present[3] && !HasDims(dims[3], {batch, channels, state_width})) {
    return OpError(kOp, "initial_state must have shape [" + std::to_string(batch) + ", " + std::to_string(channels) +
                            ", " + std::to_string(state_width) + "] (B, C, state_width), got " + dims[3].ToString());
  }
  a.type = static_cast<ElemType>(type);
  a.batch = batch;
  a.channels = channels;
  a.length = length;
  a.state_len = state_width;
  a.width = width;
  a.silu = attrs.silu;
  a.channels_last = channels_last;
  a.round_once = attrs.round_once;
  a.x = data[0];
  a.weight = data[1];
  a.bias = present[2] ? data[2] : nullptr;
  a.initial_state = present[3] ? data[3] : nullptr;
  const std::vector<int64_t> state_dims = {batch, channels, state_width};
  Ort::UnownedValue y = context.GetOutput(0, dims[0].data(), dims[0].rank());
  Ort::UnownedValue final_state = context.GetOutput(1, state_dims.data(), state_dims.size());
  TensorDims y_dims, state_out_dims;
  y_dims.Read(y);
  state_out_dims.Read(final_state);
  if (y_dims.type() != type || state_out_dims.type() != type) {
    return OpError(kOp, std::string("the outputs must have x's type ") + ElemTypeName(type) + ", got " +
                            ElemTypeName(y_dims.type()) + " and " + ElemTypeName(state_out_dims.type()));
  }
  a.y = ElementCount(dims[0]) > 0 ? y.GetTensorMutableRawData() : nullptr;
  a.final_state = batch * channels * state_width > 0 ? final_state.GetTensorMutableRawData() : nullptr;
  return Ort::Status{};
}

OrtStatusPtr CausalConv1dCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    CausalConv1dCpuArgs args;
    if (Ort::Status status = PrepareCausalConv1dArgs(context, attrs_, args); !status.IsOK()) {
      return status;
    }
    if (args.width > kCausalConv1dMaxWidth) {
      return OpError(kOp, "the kernel width K = " + std::to_string(args.width) + " is more than the CPU kernel's " +
                              std::to_string(kCausalConv1dMaxWidth));
    }
    std::vector<float> weight_kc, bias_c;
    if (args.channels_last && args.channels > 0 && prepared_.Fits(args)) {
      args.weight_kc = prepared_.weight_kc.data();
      args.bias_c = prepared_.bias_c.data();
    } else if (args.channels_last && args.channels > 0) {
      weight_kc.resize(static_cast<size_t>(args.width * args.channels));
      bias_c.resize(static_cast<size_t>(args.channels));
      PrepareChannelsLast(args, weight_kc.data(), bias_c.data());
      args.weight_kc = weight_kc.data();
      args.bias_c = bias_c.data();
    }
    if (const char* problem = ValidateArgs(args)) return OpError(kOp, problem);
    const int64_t items = CausalConv1dItems(args);
    if (items == 0) return Ort::Status{};
    const int64_t outputs_per_item = args.channels_last ? args.channels * kCausalConv1dTokenBlock : args.length;
    const int64_t chunks = std::clamp<int64_t>(items * outputs_per_item / kMinOutputsPerChunk, 1, items);
    RunInChunks(context, &CausalConv1dCpu, args, items, chunks);
    return Ort::Status{};
  });
}

OrtStatusPtr InferCausalConv1dShapes(OrtShapeInferContext* context) {
  // y: x's type and shape; final_state: initial_state's, where the node has one (the rules always pass it).
  if (OrtStatusPtr status = ForwardTypeShape(context, 0, 0)) return status;
  return ForwardTypeShape(context, 3, 1);
}

CausalConv1dCpuOp::CausalConv1dCpuOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferCausalConv1dShapes(context);
  };
}

Ort::Status ReadCausalConv1dAttrs(const OrtKernelInfo* info, CausalConv1dAttrs& attrs) {
  const Ort::ConstKernelInfo kernel_info(info);
  const std::string where = "node '" + kernel_info.GetNodeName() + "': ";
  const OrtApi& ort = Ort::GetApi();
  int64_t state_width = -1;
  if (OrtStatus* status = ort.KernelInfoGetAttribute_int64(info, "state_width", &state_width)) {
    ort.ReleaseStatus(status);
    return OpError(kOp, where + "the attribute state_width (the conv state's columns, K - 1 or more) is required");
  }
  bool channels_last = true, round_once = false, silu = true;
  if (Ort::Status status = ReadFlagAttribute(info, kOp, "channels_last", true, channels_last); !status.IsOK()) {
    return status;
  }
  if (Ort::Status status = ReadFlagAttribute(info, kOp, "round_once", false, round_once); !status.IsOK()) {
    return status;
  }
  if (Ort::Status status = ReadSiluActivation(info, kOp, silu); !status.IsOK()) return status;
  attrs.state_width = state_width;
  attrs.silu = silu;
  attrs.channels_last = channels_last;
  attrs.round_once = round_once;
  return Ort::Status{};
}

void CausalConv1dPrepared::Read(const OrtKernelInfo* info, const CausalConv1dAttrs& attrs) {
  ready = false;
  if (!attrs.channels_last) return;
  const Ort::ConstKernelInfo kernel_info(info);
  const size_t inputs = kernel_info.GetInputCount();
  // A constant input of the node, or null (absent, or computed in the graph).
  const auto constant = [&](size_t index) -> const OrtValue* {
    if (index >= inputs) return nullptr;
    int is_constant = 0;
    const OrtValue* value = nullptr;
    if (OrtStatus* status = Ort::GetApi().KernelInfoGetConstantInput_tensor(info, index, &is_constant, &value)) {
      Ort::GetApi().ReleaseStatus(status);
      return nullptr;
    }
    return is_constant != 0 && value != nullptr && Ort::ConstValue(value).IsTensor() ? value : nullptr;
  };
  const OrtValue* weight = constant(1);
  if (weight == nullptr) return;
  TensorDims w;
  w.Read(weight);
  if (!IsSupportedElemType(w.type()) || !(w.rank() == 2 || (w.rank() == 3 && w.data()[1] == 1))) return;
  if (w.data()[0] < 1 || w.back() < 1 || w.back() > kCausalConv1dMaxWidth) return;
  const bool has_bias = inputs > 2 && !kernel_info.GetInputName(2).empty();
  const OrtValue* bias = has_bias ? constant(2) : nullptr;
  if (has_bias && bias == nullptr) return;  // a bias computed in the graph: each call prepares both
  TensorDims b;
  if (bias != nullptr) {
    b.Read(bias);
    if (b.type() != w.type() || b.rank() != 1 || b.data()[0] != w.data()[0]) return;
  }
  CausalConv1dCpuArgs args;
  args.type = static_cast<ElemType>(w.type());
  args.channels = w.data()[0];
  args.width = w.back();
  args.weight = Ort::ConstValue(weight).GetTensorRawData();
  args.bias = bias != nullptr ? Ort::ConstValue(bias).GetTensorRawData() : nullptr;
  weight_kc.resize(static_cast<size_t>(args.width * args.channels));
  bias_c.resize(static_cast<size_t>(args.channels));
  PrepareChannelsLast(args, weight_kc.data(), bias_c.data());
  channels = args.channels;
  width = args.width;
  type = args.type;
  ready = true;
}

OrtStatusPtr CausalConv1dCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    CausalConv1dAttrs attrs;
    if (Ort::Status status = ReadCausalConv1dAttrs(info, attrs); !status.IsOK()) return status;
    *kernel = std::make_unique<CausalConv1dCpuKernel>(attrs, info).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
