#include "mamba_chunk_scan.h"

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "decode_step_common.h"
#include "mamba_chunk_scan_impl.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "MambaChunkScan";

std::string TypeName(int64_t type) { return ElemTypeName(type); }

// The items the heads are split into: four per hardware thread, so that ORT's pool (whatever its size up to the
// machine's) balances them. It depends on the machine, not on the session's thread count: the same session
// options give the same bits with 1 and with several intra-op threads.
int64_t MinItems() {
  const unsigned hardware = std::thread::hardware_concurrency();
  return 4 * static_cast<int64_t>(hardware > 0 ? hardware : 1);
}

}  // namespace

Ort::Status PrepareMambaChunkScanArgs(Ort::KernelContext& context, const MambaChunkScanAttrs& attrs,
                                      MambaChunkScanCpuArgs& a) {
  if (const size_t count = context.GetInputCount(); count < 6) {
    const std::string expected =
        "expects the inputs x, dt, dt_bias (optional), A, B, C, D (optional), initial_state (optional); got ";
    return OpError(kOp, expected + std::to_string(count));
  }
  const char* names[8] = {"x", "dt", "dt_bias", "A", "B", "C", "D", "initial_state"};
  TensorDims dims[8];
  const void* data[8] = {};
  bool present[8] = {};
  for (size_t i = 0; i < 8; ++i) {
    present[i] = i < context.GetInputCount() && ReadOptionalInput(context, i, dims[i], &data[i]);
    const bool optional = i == 2 || i == 6 || i == 7;
    if (!present[i] && !optional) return OpError(kOp, std::string("input ") + names[i] + " is missing");
  }
  const TensorDims& x = dims[0];
  const int64_t x_type = x.type();
  if (!IsSupportedElemType(x_type)) {
    return OpError(kOp, "x has element type " + TypeName(x_type) + "; supported: float, float16, bfloat16");
  }
  if (x.rank() != 4) return OpError(kOp, "x must be 4-D (B, T, H, P), got shape " + x.ToString());
  const int64_t batch = x.data()[0], length = x.data()[1], heads = x.data()[2], head_dim = x.data()[3];
  if (length < 1) {
    return OpError(kOp, "x: the prompt must have at least one token, got T = " + std::to_string(length) +
                            " (x's shape " + x.ToString() + ")");
  }
  for (size_t i : {4, 5}) {
    const TensorDims& t = dims[i];
    if (t.rank() != 4 || t.data()[0] != batch || t.data()[1] != length) {
      return OpError(kOp, std::string(names[i]) + " must have shape [" + std::to_string(batch) + ", " +
                              std::to_string(length) + ", G, N] (B, T, G, N), got " + t.ToString());
    }
  }
  if (!(dims[4] == dims[5])) {
    return OpError(kOp, "B and C must have the same shape, got " + dims[4].ToString() + " and " + dims[5].ToString());
  }
  const int64_t groups = dims[4].data()[2], state_size = dims[4].data()[3];
  if (groups < 1 || heads % groups != 0) {
    return OpError(kOp, "the heads H = " + std::to_string(heads) + " (x's third axis) must be a multiple of the " +
                            "groups G = " + std::to_string(groups) + " (B's and C's third axis)");
  }
  const auto expect = [&](size_t i, std::initializer_list<int64_t> shape, const char* layout) -> Ort::Status {
    if (!present[i] || HasDims(dims[i], shape)) return Ort::Status{};
    std::vector<int64_t> want(shape);
    return OpError(kOp, std::string(names[i]) + " must have shape " + DimsString(want.data(), want.size()) + " " +
                            layout + ", got " + dims[i].ToString());
  };
  if (Ort::Status s = expect(1, {batch, length, heads}, "(B, T, H)"); !s.IsOK()) return s;
  for (size_t i : {2, 3, 6}) {
    if (Ort::Status s = expect(i, {heads}, "(H)"); !s.IsOK()) return s;
  }
  if (Ort::Status s = attrs.state_np ? expect(7, {batch, heads, state_size, head_dim}, "(B, H, N, P), state_layout 1")
                                     : expect(7, {batch, heads, head_dim, state_size}, "(B, H, P, N)");
      !s.IsOK()) {
    return s;
  }
  for (size_t i : {4, 5}) {
    if (dims[i].type() != x_type) {
      return OpError(
          kOp, std::string(names[i]) + " must have x's type " + TypeName(x_type) + ", got " + TypeName(dims[i].type()));
    }
  }
  const int64_t float_type = static_cast<int64_t>(ElemType::kFloat);
  const int64_t dt_type = dims[1].type();
  if (dt_type != x_type && dt_type != float_type) {
    return OpError(kOp, "dt must have x's type " + TypeName(x_type) + " or be float, got " + TypeName(dt_type));
  }
  if (present[2] && dims[2].type() != dt_type) {
    return OpError(kOp, "dt_bias must have dt's type " + TypeName(dt_type) + ", got " + TypeName(dims[2].type()));
  }
  if (dims[3].type() != float_type) return OpError(kOp, "A must be float, got " + TypeName(dims[3].type()));
  for (size_t i : {6, 7}) {
    if (present[i] && dims[i].type() != float_type && dims[i].type() != x_type) {
      return OpError(kOp, std::string(names[i]) + " must be float or x's type " + TypeName(x_type) + ", got " +
                              TypeName(dims[i].type()));
    }
  }

  a.type = static_cast<ElemType>(x_type);
  a.dt_type = static_cast<ElemType>(dt_type);
  a.d_type = present[6] ? static_cast<ElemType>(dims[6].type()) : ElemType::kFloat;
  a.state_type = present[7] ? static_cast<ElemType>(dims[7].type()) : ElemType::kFloat;
  a.batch = batch;
  a.length = length;
  a.heads = heads;
  a.head_dim = head_dim;
  a.groups = groups;
  a.state_size = state_size;
  a.dt_softplus = attrs.dt_softplus;
  a.state_np = attrs.state_np;
  a.dt_min = attrs.dt_min;
  a.dt_max = attrs.dt_max;
  a.x = data[0];
  a.dt = data[1];
  a.dt_bias = present[2] ? data[2] : nullptr;
  a.A = static_cast<const float*>(data[3]);
  a.B = data[4];
  a.C = data[5];
  a.D = present[6] ? data[6] : nullptr;
  a.initial_state = present[7] ? data[7] : nullptr;
  const int64_t state_dims[4] = {batch, heads, attrs.state_np ? state_size : head_dim,
                                 attrs.state_np ? head_dim : state_size};
  Ort::UnownedValue out = context.GetOutput(0, x.data(), x.rank());
  Ort::UnownedValue final_state = context.GetOutput(1, state_dims, 4);
  TensorDims out_dims, state_out_dims;
  out_dims.Read(out);
  state_out_dims.Read(final_state);
  if (out_dims.type() != float_type || state_out_dims.type() != float_type) {
    return OpError(kOp, "the outputs out and final_state are float, got " + TypeName(out_dims.type()) + " and " +
                            TypeName(state_out_dims.type()));
  }
  a.out = ElementCount(x) > 0 ? out.GetTensorMutableData<float>() : nullptr;
  a.final_state = batch * heads * head_dim * state_size > 0 ? final_state.GetTensorMutableData<float>() : nullptr;
  return Ort::Status{};
}

OrtStatusPtr InferMambaChunkScanShapes(OrtShapeInferContext* context) {
  return GuardStatus([&]() -> Ort::Status {
    const OrtApi& api = Ort::GetApi();
    size_t count = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(context, &count));
    if (count < 6) return Ort::Status{};
    // The dims and their names of input `index`; false when its rank is unknown or not `rank`.
    const auto read = [&](size_t index, size_t rank, std::vector<int64_t>& dims, std::vector<std::string>& names) {
      OrtTensorTypeAndShapeInfo* info = nullptr;  // belongs to the context
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, index, &info));
      if (info == nullptr) return false;
      const Ort::ConstTensorTypeAndShapeInfo view(info);
      dims = view.GetShape();
      if (dims.size() != rank) return false;
      std::vector<const char*> raw(rank, nullptr);
      view.GetSymbolicDimensions(raw.data(), raw.size());
      names.assign(rank, "");
      for (size_t d = 0; d < rank; ++d) names[d] = raw[d] ? raw[d] : "";
      return true;
    };
    const auto write = [&](size_t index, const std::vector<int64_t>& dims, const std::vector<std::string>& names) {
      OrtTensorTypeAndShapeInfo* raw_out = nullptr;
      Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
      const Ort::TensorTypeAndShapeInfo out_info(raw_out);  // owns raw_out
      Ort::ThrowOnError(api.SetTensorElementType(raw_out, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT));
      std::vector<std::string> kept(dims.size());
      std::vector<const char*> pointers(dims.size());
      for (size_t d = 0; d < dims.size(); ++d) {
        // An unnamed unknown dim gets a name: ORT writes it as the value -1 otherwise.
        kept[d] = !names[d].empty() ? names[d] : dims[d] < 0 ? "chunk_scan_dim_" + std::to_string(index * 4 + d) : "";
        pointers[d] = kept[d].c_str();
      }
      Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
      Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, pointers.data(), pointers.size()));
      Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(context, index, raw_out));
    };
    std::vector<int64_t> x_dims, b_dims;
    std::vector<std::string> x_names, b_names;
    if (!read(0, 4, x_dims, x_names)) return Ort::Status{};
    write(0, x_dims, x_names);
    if (!read(4, 4, b_dims, b_names)) return Ort::Status{};
    bool present = false;
    if (InferAttrInt(context, "state_layout", 0, &present) == 1) {
      write(1, {x_dims[0], x_dims[2], b_dims[3], x_dims[3]}, {x_names[0], x_names[2], b_names[3], x_names[3]});
    } else {
      write(1, {x_dims[0], x_dims[2], x_dims[3], b_dims[3]}, {x_names[0], x_names[2], x_names[3], b_names[3]});
    }
    return Ort::Status{};
  });
}

OrtStatusPtr MambaChunkScanCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    MambaChunkScanCpuArgs args;
    if (Ort::Status status = PrepareMambaChunkScanArgs(context, attrs_, args); !status.IsOK()) return status;
    args.chunk_size = ChunkScanChunkSize();
    if (args.chunk_size < 1) {
      return OpError(kOp, "MAMBAFUSE_CHUNK_SCAN_CHUNK must be a whole number of tokens from 1 to 4096 (or unset)");
    }
    args.heads_per_block = ChunkScanHeadsPerBlock(args, MinItems());
    if (const char* problem = ValidateArgs(args)) return OpError(kOp, problem);
    if (args.batch * args.heads == 0) return Ort::Status{};
    const int64_t items = ChunkScanItemCount(args);
    RunInChunks(context, &MambaChunkScanCpu, args, items, items);  // one item a task
    return Ort::Status{};
  });
}

MambaChunkScanCpuOp::MambaChunkScanCpuOp() {
  // ORT ignores a status returned from here; the kernel's checks report bad inputs.
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferMambaChunkScanShapes(context);
  };
}

Ort::Status ReadMambaChunkScanAttrs(const OrtKernelInfo* info, MambaChunkScanAttrs& attrs) {
  const Ort::ConstKernelInfo kernel_info(info);
  const std::string where = "node '" + kernel_info.GetNodeName() + "': ";
  const OrtApi& ort = Ort::GetApi();
  if (Ort::Status status = ReadFlagAttribute(info, kOp, "dt_softplus", true, attrs.dt_softplus); !status.IsOK()) {
    return status;
  }
  if (Ort::Status status = ReadFlagAttribute(info, kOp, "state_layout", false, attrs.state_np); !status.IsOK()) {
    return status;
  }
  attrs.dt_max = INFINITY;
  for (auto [name, value] : {std::pair<const char*, float*>{"dt_min", &attrs.dt_min}, {"dt_max", &attrs.dt_max}}) {
    if (OrtStatus* status = ort.KernelInfoGetAttribute_float(info, name, value)) {
      ort.ReleaseStatus(status);  // optional: the default stays
    }
    if (std::isnan(*value)) return OpError(kOp, where + name + " must be a number, got NaN");
  }
  return Ort::Status{};
}

OrtStatusPtr MambaChunkScanCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                 void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    MambaChunkScanAttrs attrs;
    if (Ort::Status status = ReadMambaChunkScanAttrs(info, attrs); !status.IsOK()) return status;
    *kernel = std::make_unique<MambaChunkScanCpuKernel>(attrs).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
