#include "selective_state_update_cuda.h"

#include <memory>
#include <string>
#include <vector>

#include "cpu/decode_step_common.h"  // TensorDims, OpError, HasDims, ForwardTypeShape
#include "selective_state_update_launcher.h"

namespace mambafuse {
namespace {

Ort::Status Invalid(const std::string& message) { return OpError("SelectiveStateUpdate", message); }

std::string Dims(std::initializer_list<int64_t> dims) { return DimsString(dims.begin(), dims.size()); }

// Reads an optional int attribute of the node; absent -> fallback.
int64_t OptionalInt(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  const OrtApi& api = Ort::GetApi();
  int64_t value = fallback;
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, &value)) {
    api.ReleaseStatus(status);
    return fallback;
  }
  return value;
}

Ort::Status LaunchError(const char* op, cudaError_t error) {
  return Ort::Status((std::string(op) + ": CUDA launch failed: " + cudaGetErrorName(error) + " (" +
                      cudaGetErrorString(error) + ")")
                         .c_str(),
                     ORT_EP_FAIL);
}

}  // namespace

OrtStatusPtr SelectiveStateUpdateCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    const size_t count = context.GetInputCount();
    const char* names[8] = {"state", "x", "dt", "dt_bias", "A", "B", "C", "D"};
    const OrtValue* values[8] = {};
    TensorDims dims[8];
    for (size_t i = 0; i < 8 && i < count; ++i) {
      const Ort::ConstValue value = context.GetInput(i);
      if (!value) continue;
      if (!value.IsTensor()) return Invalid(std::string(names[i]) + " must be a tensor");
      values[i] = value;
      dims[i].Read(value);
    }
    for (size_t i : {0, 1, 2, 4, 5, 6}) {
      if (values[i] == nullptr) return Invalid(std::string("input ") + names[i] + " is missing");
    }
    const int64_t t_type = dims[1].type();
    if (!IsSupportedElemType(t_type)) {
      return Invalid(std::string("x has element type ") + ElemTypeName(t_type) + "; supported: float, float16, bfloat16");
    }
    const auto type_is = [&](size_t i, bool float_allowed) {
      return dims[i].type() == t_type || (float_allowed && dims[i].type() == static_cast<int64_t>(ElemType::kFloat));
    };
    const std::string t_name = ElemTypeName(t_type);
    if (!type_is(0, true)) return Invalid("state must be float or " + t_name + ", got " + ElemTypeName(dims[0].type()));
    for (size_t i : {2, 3, 5, 6}) {
      if (values[i] != nullptr && !type_is(i, false)) {
        return Invalid(std::string(names[i]) + " must have x's type " + t_name + ", got " + ElemTypeName(dims[i].type()));
      }
    }
    if (dims[4].type() != static_cast<int64_t>(ElemType::kFloat)) {
      return Invalid(std::string("A must be float, got ") + ElemTypeName(dims[4].type()));
    }
    if (values[7] != nullptr && !type_is(7, true)) {
      return Invalid("D must be float or " + t_name + ", got " + ElemTypeName(dims[7].type()));
    }
    if (dims[0].rank() != 4) return Invalid("state must have shape [B, H, P, N], got " + dims[0].ToString());
    const int64_t batch = dims[0].data()[0], heads = dims[0].data()[1], head_dim = dims[0].data()[2],
                  state_size = dims[0].data()[3];
    if (!HasDims(dims[1], {batch, heads, head_dim})) {
      return Invalid("x must have shape [B, H, P] = " + Dims({batch, heads, head_dim}) + ", got " + dims[1].ToString());
    }
    if (!HasDims(dims[2], {batch, heads})) {
      return Invalid("dt must have shape [B, H] = " + Dims({batch, heads}) + ", got " + dims[2].ToString());
    }
    if (values[3] != nullptr && !HasDims(dims[3], {heads})) {
      return Invalid("dt_bias must have shape [H] = " + Dims({heads}) + ", got " + dims[3].ToString());
    }
    if (!HasDims(dims[4], {heads})) return Invalid("A must have shape [H] = " + Dims({heads}) + ", got " + dims[4].ToString());
    if (values[7] != nullptr && !HasDims(dims[7], {heads})) {
      return Invalid("D must have shape [H] = " + Dims({heads}) + ", got " + dims[7].ToString());
    }
    const int64_t groups = dims[5].rank() == 3 ? dims[5].data()[1] : 0;
    if (!HasDims(dims[5], {batch, groups, state_size}) || groups <= 0 || heads % groups != 0) {
      return Invalid("B must have shape [B, G, N] with G dividing H = " + std::to_string(heads) + " and N = " +
                     std::to_string(state_size) + ", got " + dims[5].ToString());
    }
    if (!(dims[6] == dims[5])) return Invalid("C must have B's shape " + dims[5].ToString() + ", got " + dims[6].ToString());

    Ort::UnownedValue out = context.GetOutput(0, dims[1].data(), dims[1].rank());
    Ort::UnownedValue present = context.GetOutput(1, dims[0].data(), dims[0].rank());
    if (batch * heads * head_dim == 0) return Ort::Status{};
    SelectiveStateUpdateArgs args;
    args.state = Ort::ConstValue(values[0]).GetTensorRawData();
    args.x = Ort::ConstValue(values[1]).GetTensorRawData();
    args.dt = Ort::ConstValue(values[2]).GetTensorRawData();
    args.dt_bias = values[3] != nullptr ? Ort::ConstValue(values[3]).GetTensorRawData() : nullptr;
    args.a = static_cast<const float*>(Ort::ConstValue(values[4]).GetTensorRawData());
    args.b = Ort::ConstValue(values[5]).GetTensorRawData();
    args.c = Ort::ConstValue(values[6]).GetTensorRawData();
    args.d = values[7] != nullptr ? Ort::ConstValue(values[7]).GetTensorRawData() : nullptr;
    args.out = out.GetTensorMutableRawData();
    args.present_state = present.GetTensorMutableRawData();
    args.t_type = static_cast<ElemType>(t_type);
    args.s_type = static_cast<ElemType>(dims[0].type());
    args.d_type = values[7] != nullptr ? static_cast<ElemType>(dims[7].type()) : args.t_type;
    args.batch = batch;
    args.heads = heads;
    args.head_dim = head_dim;
    args.state_size = state_size;
    args.groups = groups;
    args.dt_softplus = dt_softplus_;
    if (const char* problem = CheckSelectiveStateUpdateArgs(args)) return Invalid(problem);
    // ORT's compute stream: the launch is ordered with the node's neighbours and captured with them when
    // ORT records a CUDA graph. Nothing here waits for the GPU or allocates.
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (const cudaError_t error = LaunchSelectiveStateUpdate(args, stream); error != cudaSuccess) {
      return LaunchError("SelectiveStateUpdate", error);
    }
    return Ort::Status{};
  });
}

SelectiveStateUpdateCudaOp::SelectiveStateUpdateCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    // The CPU op's inference (ORT takes the schema's from the first op of a name): out gets x's type and
    // shape, present_state the state's.
    if (OrtStatusPtr status = ForwardTypeShape(context, 1, 0)) return status;
    return ForwardTypeShape(context, 0, 1);
  };
}

OrtStatusPtr SelectiveStateUpdateCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                        void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    const int64_t softplus = OptionalInt(info, "dt_softplus", 1);
    if (softplus != 0 && softplus != 1) return Invalid("dt_softplus must be 0 or 1, got " + std::to_string(softplus));
    *kernel = std::make_unique<SelectiveStateUpdateCudaKernel>(softplus == 1).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
