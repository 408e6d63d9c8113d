#include "selective_state_update_cuda.h"

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "cpu/gated_group_rms_norm.h"  // TensorDims, ElemTypeName
#include "selective_state_update_launcher.h"

namespace mambafuse {
namespace {

Ort::Status Invalid(const std::string& message) {
  return Ort::Status(("SelectiveStateUpdate: " + message).c_str(), ORT_INVALID_ARGUMENT);
}

std::string Dims(std::initializer_list<int64_t> dims) {
  std::string text = "[";
  for (int64_t d : dims) text += (text.size() > 1 ? ", " : "") + std::to_string(d);
  return text + "]";
}

bool Matches(const TensorDims& t, std::initializer_list<int64_t> dims) {
  if (t.rank() != dims.size()) return false;
  size_t i = 0;
  for (int64_t d : dims) {
    if (t.data()[i++] != d) return false;
  }
  return true;
}

// Reads an optional attribute of the node; absent -> fallback.
template <typename V>
V OptionalAttribute(const OrtKernelInfo* info, const char* name, V fallback) {
  const OrtApi& api = Ort::GetApi();
  V value = fallback;
  OrtStatus* status = nullptr;
  if constexpr (std::is_same_v<V, float>) {
    status = api.KernelInfoGetAttribute_float(info, name, &value);
  } else {
    status = api.KernelInfoGetAttribute_int64(info, name, &value);
  }
  if (status != nullptr) {
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

OrtStatusPtr InferPassThrough(OrtShapeInferContext* context, const size_t (&pairs)[2][2]) {
  return GuardStatus([&]() -> Ort::Status {
    const OrtApi& api = Ort::GetApi();
    size_t input_count = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(context, &input_count));
    for (const auto& pair : pairs) {
      if (pair[0] >= input_count) continue;
      // The info belongs to the context: wrapping it in an owning Ort object would free it twice.
      OrtTensorTypeAndShapeInfo* info = nullptr;
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, pair[0], &info));
      if (info == nullptr) continue;
      const Ort::ConstTensorTypeAndShapeInfo view(info);
      const auto type = view.GetElementType();
      if (!IsSupportedElemType(type)) continue;
      const std::vector<int64_t> dims = view.GetShape();
      std::vector<const char*> symbols(dims.size(), nullptr);
      if (!dims.empty()) view.GetSymbolicDimensions(symbols.data(), symbols.size());
      std::vector<std::string> names(dims.size());
      std::vector<const char*> name_ptrs(dims.size());
      for (size_t d = 0; d < dims.size(); ++d) {
        // An unnamed unknown dim gets a fresh name: ORT would write it as -1, which ops downstream take literally.
        if (dims[d] < 0) {
          names[d] = symbols[d] && *symbols[d] ? symbols[d] : "decode_dim_" + std::to_string(pair[1]) + "_" +
                                                                   std::to_string(d);
        }
        name_ptrs[d] = names[d].c_str();
      }
      OrtTensorTypeAndShapeInfo* raw_out = nullptr;
      Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
      const Ort::TensorTypeAndShapeInfo out_info(raw_out);  // owns raw_out
      Ort::ThrowOnError(api.SetTensorElementType(raw_out, type));
      if (!dims.empty() || view.GetDimensionsCount() == 0) {
        Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
        Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, name_ptrs.data(), name_ptrs.size()));
      }
      Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(context, pair[1], raw_out));
    }
    return Ort::Status{};
  });
}

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
    if (!Matches(dims[1], {batch, heads, head_dim})) {
      return Invalid("x must have shape [B, H, P] = " + Dims({batch, heads, head_dim}) + ", got " + dims[1].ToString());
    }
    if (!Matches(dims[2], {batch, heads})) {
      return Invalid("dt must have shape [B, H] = " + Dims({batch, heads}) + ", got " + dims[2].ToString());
    }
    if (values[3] != nullptr && !Matches(dims[3], {heads})) {
      return Invalid("dt_bias must have shape [H] = " + Dims({heads}) + ", got " + dims[3].ToString());
    }
    if (!Matches(dims[4], {heads})) return Invalid("A must have shape [H] = " + Dims({heads}) + ", got " + dims[4].ToString());
    if (values[7] != nullptr && !Matches(dims[7], {heads})) {
      return Invalid("D must have shape [H] = " + Dims({heads}) + ", got " + dims[7].ToString());
    }
    const int64_t groups = dims[5].rank() == 3 ? dims[5].data()[1] : 0;
    if (!Matches(dims[5], {batch, groups, state_size}) || groups <= 0 || heads % groups != 0) {
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
    args.dt_min = dt_min_;
    args.dt_max = dt_max_;
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
    static constexpr size_t kPairs[2][2] = {{1, 0}, {0, 1}};  // out: x's type and shape; present: state's
    return InferPassThrough(context, kPairs);
  };
}

OrtStatusPtr SelectiveStateUpdateCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                        void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    const int64_t softplus = OptionalAttribute<int64_t>(info, "dt_softplus", 1);
    if (softplus != 0 && softplus != 1) return Invalid("dt_softplus must be 0 or 1, got " + std::to_string(softplus));
    const float dt_min = OptionalAttribute<float>(info, "dt_min", -INFINITY);
    const float dt_max = OptionalAttribute<float>(info, "dt_max", INFINITY);
    if (!(dt_min <= dt_max)) return Invalid("dt_min must not exceed dt_max");
    *kernel = std::make_unique<SelectiveStateUpdateCudaKernel>(softplus == 1, dt_min, dt_max).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
