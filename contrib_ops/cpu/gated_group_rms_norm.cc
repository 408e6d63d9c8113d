#include "gated_group_rms_norm.h"

#if defined(MAMBAFUSE_WITH_METAL)
#include "metal/gated_group_rms_norm_metal.h"
#endif

#include <algorithm>
#include <sstream>
#include <vector>

#include "decode_step_common.h"  // InferAttrInt

namespace mambafuse {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

std::string NodeName(const OrtKernelInfo* info) {
  size_t size = 0;
  const OrtApi& api = Ort::GetApi();
  if (OrtStatus* status = api.KernelInfo_GetNodeName(info, nullptr, &size)) {
    api.ReleaseStatus(status);
    return {};
  }
  std::string name(size, '\0');
  if (OrtStatus* status = api.KernelInfo_GetNodeName(info, name.data(), &size)) {
    api.ReleaseStatus(status);
    return {};
  }
  name.resize(size > 0 ? size - 1 : 0);  // size counts the terminating null
  return name;
}

Ort::Status CheckDtypeAttr(const char* attr, int64_t value) {
  if (value == 0 || IsSupportedElemType(value)) return Ort::Status{};
  return InvalidArgument(std::string(attr) + " = " + std::to_string(value) + " (" + ElemTypeName(value) +
                         ") is not a supported type; use 1 (float), 10 (float16) or 16 (bfloat16)");
}

// Work items are (row, group) pairs. A chunk covers enough elements that handing it to another thread
// pays for the hand-off; a decode row (a few thousand elements) stays on the calling thread.
constexpr int64_t kMinElementsPerChunk = 16 * 1024;

struct ParallelWork {
  const GatedGroupRMSNormArgs* args;
  int64_t items;
  int64_t chunks;
};

void RunChunk(void* user_data, size_t chunk) {
  const auto& work = *static_cast<const ParallelWork*>(user_data);
  const int64_t c = static_cast<int64_t>(chunk);
  const int64_t first = work.items * c / work.chunks;
  const int64_t last = work.items * (c + 1) / work.chunks;
  GatedGroupRMSNormCpu(*work.args, first, last);
}

}  // namespace

void TensorDims::Read(const OrtValue* value) {
  const OrtApi& api = Ort::GetApi();
  OrtTensorTypeAndShapeInfo* raw = nullptr;
  Ort::ThrowOnError(api.GetTensorTypeAndShape(value, &raw));
  const Ort::TensorTypeAndShapeInfo info(raw);  // owns raw (released on every path)
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  Ort::ThrowOnError(api.GetTensorElementType(raw, &type));
  type_ = static_cast<int64_t>(type);
  Ort::ThrowOnError(api.GetDimensionsCount(raw, &rank_));
  int64_t* dims = inline_;
  if (rank_ > kInlineRank) {
    heap_.resize(rank_);
    dims = heap_.data();
  }
  Ort::ThrowOnError(api.GetDimensions(raw, dims, rank_));
}

bool TensorDims::operator==(const TensorDims& other) const {
  return rank_ == other.rank_ && std::equal(data(), data() + rank_, other.data());
}

std::string TensorDims::ToString() const { return ShapeString(std::vector<int64_t>(data(), data() + rank_)); }

Ort::Status GatedGroupRMSNormAttrs::Read(const OrtKernelInfo* info, GatedGroupRMSNormAttrs& attrs) {
  const OrtApi& api = Ort::GetApi();
  const std::string where = "node '" + NodeName(info) + "': ";
  if (OrtStatus* status = api.KernelInfoGetAttribute_float(info, "epsilon", &attrs.epsilon)) {
    api.ReleaseStatus(status);
    return InvalidArgument(where + "required attribute 'epsilon' (float) is missing");
  }
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, "group_size", &attrs.group_size)) {
    api.ReleaseStatus(status);
    return InvalidArgument(where + "required attribute 'group_size' (int) is missing");
  }
  if (attrs.group_size <= 0) {
    return InvalidArgument(where + "group_size must be > 0, got " + std::to_string(attrs.group_size));
  }
  if (!(attrs.epsilon >= 0.f)) {
    return InvalidArgument(where + "epsilon must be >= 0, got " + std::to_string(attrs.epsilon));
  }
  for (auto [name, field] : {std::pair{"norm_dtype", &attrs.norm_dtype}, {"output_dtype", &attrs.output_dtype}}) {
    if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, field)) {
      api.ReleaseStatus(status);  // optional: absent means "same as Y"
      *field = 0;
    }
    if (Ort::Status bad = CheckDtypeAttr(name, *field); !bad.IsOK()) {
      return InvalidArgument(where + bad.GetErrorMessage().substr(sizeof("GatedGroupRMSNorm: ") - 1));
    }
  }
  // Why an optional attribute and still opset version 1: builders (Microsoft's mobius) round the gated
  // product y * silu(z) to the model's half type before the norm, a third rounding point. Absent (or 0, or
  // FLOAT) means no rounding, which is what every model fused before this attribute existed computes.
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, "gated_dtype", &attrs.gated_dtype)) {
    api.ReleaseStatus(status);
    attrs.gated_dtype = 0;
  }
  if (Ort::Status bad = CheckDtypeAttr("gated_dtype", attrs.gated_dtype); !bad.IsOK()) {
    return InvalidArgument(where + bad.GetErrorMessage().substr(sizeof("GatedGroupRMSNorm: ") - 1));
  }
  return Ort::Status{};
}

Ort::Status PrepareArgs(const GatedGroupRMSNormAttrs& attrs, Ort::KernelContext& context,
                        GatedGroupRMSNormArgs& args, const GatedGroupRMSNormStatic* known) {
  if (const size_t count = context.GetInputCount(); count != 3) {
    return InvalidArgument("expects 3 inputs (Y, Z, W), got " + std::to_string(count));
  }
  const char* names[] = {"Y", "Z", "W"};
  const OrtValue* values[3];
  TensorDims read[3];
  const TensorDims* dims[3] = {&read[0], &read[1], &read[2]};
  for (size_t i = 0; i < 3; ++i) {
    const Ort::ConstValue value = context.GetInput(i);
    if (!value || !value.IsTensor()) return InvalidArgument(std::string(names[i]) + " must be a tensor");
    values[i] = value;
    if (i == 2 && known != nullptr && known->w_constant) {
      dims[2] = &known->w;  // a constant initializer: its type and shape were read at kernel creation
    } else {
      read[i].Read(value);
    }
    if (!IsSupportedElemType(dims[i]->type())) {
      return InvalidArgument(std::string(names[i]) + " has element type " + ElemTypeName(dims[i]->type()) +
                             "; supported: float, float16, bfloat16");
    }
  }
  const TensorDims& y_shape = *dims[0];
  if (y_shape.rank() == 0) return InvalidArgument("Y must have at least one axis, got a scalar");
  if (!(*dims[1] == y_shape)) {
    return InvalidArgument("Z must have Y's shape " + y_shape.ToString() + ", got " + dims[1]->ToString());
  }
  const int64_t channels = y_shape.back();
  if (dims[2]->rank() != 1 || dims[2]->back() != channels) {
    return InvalidArgument("W must have shape [C] = [" + std::to_string(channels) + "], got " + dims[2]->ToString());
  }
  if (channels % attrs.group_size != 0) {
    return InvalidArgument("C = " + std::to_string(channels) + " (last axis of Y) is not divisible by group_size = " +
                           std::to_string(attrs.group_size));
  }
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < y_shape.rank(); ++i) rows *= y_shape.data()[i];

  const auto y_type = static_cast<ElemType>(dims[0]->type());
  args.y_type = y_type;
  args.z_type = static_cast<ElemType>(dims[1]->type());
  args.w_type = static_cast<ElemType>(dims[2]->type());
  args.norm_type = attrs.norm_dtype ? static_cast<ElemType>(attrs.norm_dtype) : y_type;
  args.out_type = attrs.output_dtype ? static_cast<ElemType>(attrs.output_dtype) : y_type;
  args.gated_type = attrs.gated_dtype ? static_cast<ElemType>(attrs.gated_dtype) : ElemType::kFloat;
  args.rows = rows;
  args.channels = channels;
  args.group_size = attrs.group_size;
  args.epsilon = attrs.epsilon;
  args.w_subnormal_free = known != nullptr && known->w_subnormal_free;

  Ort::UnownedValue out = context.GetOutput(0, y_shape.data(), y_shape.rank());
  int64_t out_type = known != nullptr ? known->out_type : 0;
  if (out_type == 0) {
    TensorDims out_dims;
    out_dims.Read(out);
    out_type = out_dims.type();
  }
  // ONNX Runtime's CPU fp16 handling may retype a node's fp16 output to float (it inserts Casts around
  // nodes without fp16 kernels). The value is still rounded to output_dtype, then stored widened, which
  // is exact; any other mismatch is a graph the op cannot serve.
  if (out_type != static_cast<int64_t>(args.out_type) && out_type != static_cast<int64_t>(ElemType::kFloat)) {
    return InvalidArgument(std::string("the output tensor has type ") + ElemTypeName(out_type) +
                           " but output_dtype is " + ElemTypeName(static_cast<int64_t>(args.out_type)));
  }
  args.out_storage_type = static_cast<ElemType>(out_type);
  if (rows * channels == 0) {
    args.y = args.z = args.w = nullptr;
    args.out = nullptr;
    return Ort::Status{};
  }
  args.y = Ort::ConstValue(values[0]).GetTensorRawData();
  args.z = Ort::ConstValue(values[1]).GetTensorRawData();
  args.w = Ort::ConstValue(values[2]).GetTensorRawData();
  args.out = out.GetTensorMutableRawData();
  if (const char* problem = ValidateArgs(args)) return InvalidArgument(problem);
  return Ort::Status{};
}

Ort::Status GatedGroupRMSNormStatic::Read(const OrtKernelInfo* info, GatedGroupRMSNormStatic& known) {
  const OrtApi& api = Ort::GetApi();
  // The output's element type is the graph's (ONNX Runtime allocates the output with its node arg's type,
  // final once kernels are created): read once here instead of a type-and-shape query every Run. Unknown
  // or not a tensor: 0, queried per Run.
  OrtTypeInfo* raw = nullptr;
  Ort::ThrowOnError(api.KernelInfo_GetOutputTypeInfo(info, 0, &raw));
  const Ort::TypeInfo type_info(raw);  // owned by us
  known.out_type = 0;
  if (type_info.GetONNXType() == ONNX_TYPE_TENSOR) {
    const int64_t type = type_info.GetTensorTypeAndShapeInfo().GetElementType();
    if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED) known.out_type = type;
  }
  // W as a constant initializer (the usual case: the norm's weight) cannot change between Runs.
  int is_constant = 0;
  const OrtValue* w = nullptr;
  known.w_constant = known.w_subnormal_free = false;
  if (OrtStatus* status = api.KernelInfoGetConstantInput_tensor(info, 2, &is_constant, &w)) {
    api.ReleaseStatus(status);
    return Ort::Status{};
  }
  if (is_constant != 0 && w != nullptr && Ort::ConstValue(w).IsTensor()) {
    known.w.Read(w);
    known.w_constant = true;
    if (IsSupportedElemType(known.w.type()) && known.w.rank() == 1) {
      known.w_subnormal_free = !HasFloat32Subnormal(Ort::ConstValue(w).GetTensorRawData(),
                                                    static_cast<ElemType>(known.w.type()), known.w.back());
    }
  }
  return Ort::Status{};
}

OrtStatusPtr GatedGroupRMSNormCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    GatedGroupRMSNormArgs args;
    if (Ort::Status status = PrepareArgs(attrs_, context, args, &known_); !status.IsOK()) return status;
    const int64_t items = args.rows * (args.channels / args.group_size);
    if (items == 0 || args.channels == 0) return Ort::Status{};
#if defined(MAMBAFUSE_WITH_METAL)
    // Opt-in GPU path on Apple (MAMBAFUSE_METAL=1, large tensors only); false means "not taken".
    if (TryGatedGroupRMSNormMetal(args)) return Ort::Status{};
#endif
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
    // A W that is not a constant initializer: checked once per Run (see GatedGroupRMSNormArgs).
    if (!args.w_subnormal_free) args.w_subnormal_free = !HasFloat32Subnormal(args.w, args.w_type, args.channels);
#endif
    const int64_t elements = args.rows * args.channels;
    const int64_t chunks = std::clamp<int64_t>(elements / kMinElementsPerChunk, 1, items);
    if (chunks == 1) {
      GatedGroupRMSNormCpu(args, 0, items);
      return Ort::Status{};
    }
    ParallelWork work{&args, items, chunks};
    context.ParallelFor(&RunChunk, static_cast<size_t>(chunks), static_cast<size_t>(chunks), &work);
    return Ort::Status{};
  });
}

Ort::Status ReadNode(const OrtKernelInfo* info, GatedGroupRMSNormAttrs& attrs) {
  if (Ort::Status status = GatedGroupRMSNormAttrs::Read(info, attrs); !status.IsOK()) return status;
  StaticInput inputs[3];
  if (Ort::Status status = ReadStaticInputs(info, inputs); !status.IsOK()) return status;
  if (Ort::Status status = CheckStaticSignature(inputs, attrs.group_size); !status.IsOK()) {
    return InvalidArgument("node '" + NodeName(info) + "': " +
                           status.GetErrorMessage().substr(sizeof("GatedGroupRMSNorm: ") - 1));
  }
  return CheckOutputType(info, attrs, inputs);
}

Ort::Status CheckOutputType(const OrtKernelInfo* info, const GatedGroupRMSNormAttrs& attrs,
                            const StaticInput (&inputs)[3]) {
  const int64_t output_dtype = attrs.output_dtype != 0 ? attrs.output_dtype : inputs[0].elem_type;
  OrtTypeInfo* raw = nullptr;
  Ort::ThrowOnError(Ort::GetApi().KernelInfo_GetOutputTypeInfo(info, 0, &raw));
  const Ort::TypeInfo type_info(raw);  // owned by us
  if (output_dtype == 0 || type_info.GetONNXType() != ONNX_TYPE_TENSOR) return Ort::Status{};
  const int64_t out_type = type_info.GetTensorTypeAndShapeInfo().GetElementType();
  // Unknown, output_dtype, or float (values rounded to output_dtype, stored widened: docs/op.md) serve.
  if (out_type == 0 || out_type == output_dtype || out_type == static_cast<int64_t>(ElemType::kFloat)) {
    return Ort::Status{};
  }
  std::string message = "node '" + NodeName(info) + "': ONNX Runtime typed the output as " +
                        ElemTypeName(out_type) + ", but output_dtype is " + ElemTypeName(output_dtype);
  if (!inputs[0].has_shape && !inputs[1].has_shape) {
    // See InferGatedGroupRMSNorm: without a rank the library cannot set the output's type.
    message += ": neither Y nor Z has a known rank, and ONNX Runtime lets a custom op set its output's type only "
               "with a shape; declare Y's or Z's shape (its rank at least) in the model";
  }
  return InvalidArgument(message);
}

void UseGatedGroupRMSNormInference(OrtCustomOp& op) {
  op.InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferGatedGroupRMSNorm(context);
  };
}

GatedGroupRMSNormCpuOp::GatedGroupRMSNormCpuOp() { UseGatedGroupRMSNormInference(*this); }

OrtStatusPtr GatedGroupRMSNormCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                    void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    GatedGroupRMSNormAttrs attrs;
    if (Ort::Status status = ReadNode(info, attrs); !status.IsOK()) return status;
    GatedGroupRMSNormStatic known;
    if (Ort::Status status = GatedGroupRMSNormStatic::Read(info, known); !status.IsOK()) return status;
    *kernel = std::make_unique<GatedGroupRMSNormCpuKernel>(attrs, std::move(known)).release();
    return Ort::Status{};
  });
}

Ort::Status CheckStaticSignature(const StaticInput (&inputs)[3], int64_t group_size) {
  const char* names[] = {"Y", "Z", "W"};
  for (int i = 0; i < 3; ++i) {
    const int64_t type = inputs[i].elem_type;
    if (type != 0 && !IsSupportedElemType(type)) {
      return InvalidArgument(std::string("input ") + names[i] + " has element type " + ElemTypeName(type) +
                             "; supported: float, float16, bfloat16");
    }
  }
  // Only known ranks and dimensions are checked (unknown dims are negative).
  const auto& y = inputs[0];
  const auto& z = inputs[1];
  const auto& w = inputs[2];
  if (w.has_shape && w.shape.size() != 1) {
    return InvalidArgument("W must be 1-D [C], got shape " + ShapeString(w.shape));
  }
  if (y.has_shape && y.shape.empty()) return InvalidArgument("Y must have at least one axis, got a scalar");
  if (y.has_shape && z.has_shape) {
    bool same = y.shape.size() == z.shape.size();
    for (size_t d = 0; same && d < y.shape.size(); ++d) {
      same = y.shape[d] < 0 || z.shape[d] < 0 || y.shape[d] == z.shape[d];
    }
    if (!same) return InvalidArgument("Z must have Y's shape " + ShapeString(y.shape) + ", got " + ShapeString(z.shape));
  }
  if (y.has_shape && !y.shape.empty() && y.shape.back() >= 0) {
    const int64_t channels = y.shape.back();
    if (group_size > 0 && channels % group_size != 0) {
      return InvalidArgument("C = " + std::to_string(channels) +
                             " (last axis of Y) is not divisible by group_size = " + std::to_string(group_size));
    }
    if (w.has_shape && w.shape.size() == 1 && w.shape[0] >= 0 && w.shape[0] != channels) {
      return InvalidArgument("W must have shape [C] = [" + std::to_string(channels) + "], got " + ShapeString(w.shape));
    }
  }
  return Ort::Status{};
}

Ort::Status ReadStaticInputs(const OrtKernelInfo* info, StaticInput (&inputs)[3]) {
  const OrtApi& api = Ort::GetApi();
  size_t count = 0;
  Ort::ThrowOnError(api.KernelInfo_GetInputCount(info, &count));
  if (count != 3) return InvalidArgument("expects 3 inputs (Y, Z, W), got " + std::to_string(count));
  for (size_t i = 0; i < 3; ++i) {
    OrtTypeInfo* raw = nullptr;
    Ort::ThrowOnError(api.KernelInfo_GetInputTypeInfo(info, i, &raw));
    const Ort::TypeInfo type_info(raw);  // owned by us (KernelInfo hands out a copy)
    if (type_info.GetONNXType() != ONNX_TYPE_TENSOR) return InvalidArgument("every input must be a tensor");
    const auto tensor = type_info.GetTensorTypeAndShapeInfo();
    inputs[i].elem_type = tensor.GetElementType();
    inputs[i].shape = tensor.GetShape();
    // The type info of a graph input without a shape reports rank 0: no rank check then.
    inputs[i].has_shape = !inputs[i].shape.empty();
  }
  return Ort::Status{};
}

OrtStatusPtr InferGatedGroupRMSNorm(OrtShapeInferContext* context) {
  // ONNX Runtime ignores (and leaks) a status returned from here, so inference never reports errors:
  // the same checks run at kernel creation (CreateKernelV2), where they fail the session with a message.
  return GuardStatus([&]() -> Ort::Status {
    const OrtApi& api = Ort::GetApi();
    size_t input_count = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(context, &input_count));
    if (input_count != 3) return Ort::Status{};
    StaticInput inputs[3];
    std::vector<const char*> symbols[2];  // of Y and Z; the strings belong to the context
    for (size_t i = 0; i < 3; ++i) {
      // The info belongs to the context: wrapping it in an owning Ort object would free it twice.
      OrtTensorTypeAndShapeInfo* info = nullptr;
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, i, &info));
      const Ort::ConstTensorTypeAndShapeInfo view(info);
      inputs[i].elem_type = view.GetElementType();
      inputs[i].shape = view.GetShape();
      inputs[i].has_shape = !inputs[i].shape.empty();
      if (i < 2 && !inputs[i].shape.empty()) {
        symbols[i].assign(inputs[i].shape.size(), nullptr);
        view.GetSymbolicDimensions(symbols[i].data(), symbols[i].size());
      }
    }
    bool present = false;
    const int64_t group_size = InferAttrInt(context, "group_size", 0, &present);
    if (!present || group_size <= 0 || !CheckStaticSignature(inputs, group_size).IsOK()) return Ort::Status{};
    int64_t output_dtype = InferAttrInt(context, "output_dtype", inputs[0].elem_type, &present);
    if (!IsSupportedElemType(output_dtype)) return Ort::Status{};
    // ONNX Runtime's CPU fp16 fallback (InsertCastTransformer) may widen every fp16 input of an "isolated"
    // fp16 node to float32 and then expects the node's output to be float32 as well. So: when Y, Z and W
    // are all float32, the output is float32, holding values rounded to output_dtype (exact). The
    // rewriter never emits all-float32 inputs with a half output_dtype (it keeps the Cast instead), so
    // for fused models this is exactly docs/op.md.
    const auto is_float = [](const StaticInput& in) { return in.elem_type == static_cast<int64_t>(ElemType::kFloat); };
    if (is_float(inputs[0]) && is_float(inputs[1]) && is_float(inputs[2])) {
      output_dtype = static_cast<int64_t>(ElemType::kFloat);
    }

    // Rank unknown: nothing can be said. ONNX Runtime sets an output's element type only together with a
    // shape (ShapeInferContext_SetOutputTypeShape), and a shape without dims is a scalar, which its
    // constant folding then takes literally (Shape(output) folds to [], measured with 1.32). So the type
    // is left to ONNX Runtime too (the last input's type, W's); where that is not the output's type,
    // ReadNode fails the session with a message saying so.
    if (!inputs[0].has_shape && !inputs[1].has_shape) return Ort::Status{};
    // Output: Y's shape, which is Z's (the op does not broadcast): per dim, a size either of them knows,
    // else a name either of them has. A dim neither knows gets a fresh name: ORT writes an unnamed
    // unknown dim as the value -1, which the ops downstream would then take literally.
    const auto& y_shape = inputs[0].has_shape ? inputs[0].shape : inputs[1].shape;
    const bool z_matches = inputs[1].shape.size() == y_shape.size();
    std::vector<int64_t> dims(y_shape.size());
    std::vector<std::string> names(y_shape.size());
    for (size_t d = 0; d < y_shape.size(); ++d) {
      const int64_t z_dim = z_matches ? inputs[1].shape[d] : -1;
      dims[d] = y_shape[d] >= 0 ? y_shape[d] : z_dim;
      if (dims[d] >= 0) continue;
      const char* y_name = d < symbols[0].size() ? symbols[0][d] : nullptr;
      const char* z_name = z_matches && d < symbols[1].size() ? symbols[1][d] : nullptr;
      names[d] = y_name && *y_name ? y_name : z_name && *z_name ? z_name : "gated_norm_dim_" + std::to_string(d);
    }
    std::vector<const char*> name_ptrs(dims.size());
    for (size_t d = 0; d < dims.size(); ++d) name_ptrs[d] = names[d].c_str();
    OrtTensorTypeAndShapeInfo* raw_out = nullptr;
    Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
    const Ort::TensorTypeAndShapeInfo out_info(raw_out);  // owns raw_out
    Ort::ThrowOnError(api.SetTensorElementType(raw_out, static_cast<ONNXTensorElementDataType>(output_dtype)));
    Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
    Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, name_ptrs.data(), name_ptrs.size()));
    Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(context, 0, raw_out));
    return Ort::Status{};
  });
}

}  // namespace mambafuse
