#include "selective_state_update.h"

#include <algorithm>
#include <memory>
#include <string>

#include "decode_step_common.h"
#include "selective_state_update_impl.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "SelectiveStateUpdate";

// A chunk covers enough state elements that handing it to another thread pays for the hand-off
// (Nemotron-H-8B: 1 M elements a layer, 32 chunks; one head is 8 K elements).
constexpr int64_t kMinStateElementsPerChunk = 32 * 1024;

struct ParallelWork {
  const SelectiveStateUpdateCpuArgs* args;
  int64_t items;
  int64_t chunks;
};

void RunChunk(void* user_data, size_t chunk) {
  const auto& work = *static_cast<const ParallelWork*>(user_data);
  const auto c = static_cast<int64_t>(chunk);
  SelectiveStateUpdateCpu(*work.args, work.items * c / work.chunks, work.items * (c + 1) / work.chunks);
}

std::string TypeName(int64_t type) { return ElemTypeName(type); }

Ort::Status PrepareArgs(Ort::KernelContext& context, bool dt_softplus, SelectiveStateUpdateCpuArgs& a) {
  if (const size_t count = context.GetInputCount(); count < 7) {
    return OpError(kOp, "expects the inputs state, x, dt, dt_bias (optional), A, B, C, D (optional); got " +
                            std::to_string(count));
  }
  const char* names[8] = {"state", "x", "dt", "dt_bias", "A", "B", "C", "D"};
  TensorDims dims[8];
  const void* data[8] = {};
  bool present[8] = {};
  for (size_t i = 0; i < 8; ++i) {
    present[i] = i < context.GetInputCount() && ReadOptionalInput(context, i, dims[i], &data[i]);
    if (!present[i] && i != 3 && i != 7) return OpError(kOp, std::string("input ") + names[i] + " is missing");
  }
  const TensorDims& state = dims[0];
  if (state.rank() != 4) {
    return OpError(kOp, "state must be 4-D (B, H, P, N), got shape " + state.ToString());
  }
  const int64_t batch = state.data()[0], heads = state.data()[1], head_dim = state.data()[2],
                n_state = state.data()[3];
  const int64_t x_type = dims[1].type();
  if (!IsSupportedElemType(x_type)) {
    return OpError(kOp, "x has element type " + TypeName(x_type) + "; supported: float, float16, bfloat16");
  }
  const auto expect = [&](size_t i, std::initializer_list<int64_t> shape, const char* layout) -> Ort::Status {
    if (!present[i] || HasDims(dims[i], shape)) return Ort::Status{};
    std::vector<int64_t> want(shape);
    return OpError(kOp, std::string(names[i]) + " must have shape " + DimsString(want.data(), want.size()) + " " +
                            layout + ", got " + dims[i].ToString());
  };
  if (Ort::Status s = expect(1, {batch, heads, head_dim}, "(B, H, P)"); !s.IsOK()) return s;
  if (Ort::Status s = expect(2, {batch, heads}, "(B, H)"); !s.IsOK()) return s;
  for (size_t i : {3, 4, 7}) {
    if (Ort::Status s = expect(i, {heads}, "(H)"); !s.IsOK()) return s;
  }
  for (size_t i : {5, 6}) {
    const TensorDims& t = dims[i];
    if (t.rank() != 3 || t.data()[0] != batch || t.data()[2] != n_state) {
      return OpError(kOp, std::string(names[i]) + " must have shape [" + std::to_string(batch) + ", G, " +
                              std::to_string(n_state) + "] (B, G, N), got " + t.ToString());
    }
  }
  if (!(dims[5] == dims[6])) {
    return OpError(kOp, "B and C must have the same shape, got " + dims[5].ToString() + " and " + dims[6].ToString());
  }
  const int64_t groups = dims[5].data()[1];
  if (groups < 1 || heads % groups != 0) {
    return OpError(kOp, "the heads H = " + std::to_string(heads) + " must be a multiple of the groups G = " +
                            std::to_string(groups) + " (B's and C's second axis)");
  }
  for (size_t i : {2, 3, 5, 6}) {
    if (present[i] && dims[i].type() != x_type) {
      return OpError(kOp, std::string(names[i]) + " must have x's type " + TypeName(x_type) + ", got " +
                              TypeName(dims[i].type()));
    }
  }
  const int64_t float_type = static_cast<int64_t>(ElemType::kFloat);
  if (state.type() != float_type && state.type() != x_type) {
    return OpError(kOp, "state must be float or x's type " + TypeName(x_type) + ", got " + TypeName(state.type()));
  }
  if (dims[4].type() != float_type) return OpError(kOp, "A must be float, got " + TypeName(dims[4].type()));
  if (present[7] && dims[7].type() != float_type && dims[7].type() != x_type) {
    return OpError(kOp, "D must be float or x's type " + TypeName(x_type) + ", got " + TypeName(dims[7].type()));
  }

  a.type = static_cast<ElemType>(x_type);
  a.state_type = static_cast<ElemType>(state.type());
  a.d_type = present[7] ? static_cast<ElemType>(dims[7].type()) : ElemType::kFloat;
  a.batch = batch;
  a.heads = heads;
  a.head_dim = head_dim;
  a.state_size = n_state;
  a.groups = groups;
  a.dt_softplus = dt_softplus;
  a.state = data[0];
  a.x = data[1];
  a.dt = data[2];
  a.dt_bias = present[3] ? data[3] : nullptr;
  a.A = static_cast<const float*>(data[4]);
  a.B = data[5];
  a.C = data[6];
  a.D = present[7] ? data[7] : nullptr;
  Ort::UnownedValue out = context.GetOutput(0, dims[1].data(), dims[1].rank());
  Ort::UnownedValue present_state = context.GetOutput(1, state.data(), state.rank());
  // The outputs' element types are the graph's: they must be x's and the state's.
  TensorDims out_dims, state_out_dims;
  out_dims.Read(out);
  state_out_dims.Read(present_state);
  if (out_dims.type() != x_type || state_out_dims.type() != state.type()) {
    return OpError(kOp, "the outputs must have x's type " + TypeName(x_type) + " and the state's type " +
                            TypeName(state.type()) + ", got " + TypeName(out_dims.type()) + " and " +
                            TypeName(state_out_dims.type()));
  }
  a.out = ElementCount(dims[1]) > 0 ? out.GetTensorMutableRawData() : nullptr;
  a.present_state = ElementCount(state) > 0 ? present_state.GetTensorMutableRawData() : nullptr;
  if (const char* problem = ValidateArgs(a)) return OpError(kOp, problem);
  return Ort::Status{};
}

}  // namespace

OrtStatusPtr SelectiveStateUpdateCpuKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    SelectiveStateUpdateCpuArgs args;
    if (Ort::Status status = PrepareArgs(context, dt_softplus_, args); !status.IsOK()) return status;
    const int64_t items = args.batch * args.heads;
    if (items == 0 || args.head_dim == 0) return Ort::Status{};
    const int64_t elements = items * args.head_dim * std::max<int64_t>(args.state_size, 1);
    const int64_t chunks = std::clamp<int64_t>(elements / kMinStateElementsPerChunk, 1, items);
    if (chunks == 1) {
      SelectiveStateUpdateCpu(args, 0, items);
      return Ort::Status{};
    }
    ParallelWork work{&args, items, chunks};
    context.ParallelFor(&RunChunk, static_cast<size_t>(chunks), static_cast<size_t>(chunks), &work);
    return Ort::Status{};
  });
}

SelectiveStateUpdateCpuOp::SelectiveStateUpdateCpuOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    // out: x's type and shape; present_state: the state's. ORT ignores a status returned from here; the
    // kernel's checks report bad inputs.
    if (OrtStatusPtr status = ForwardTypeShape(context, 1, 0)) return status;
    return ForwardTypeShape(context, 0, 1);
  };
}

OrtStatusPtr SelectiveStateUpdateCpuOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                       void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    bool dt_softplus = true;
    if (Ort::Status status = ReadFlagAttribute(info, kOp, "dt_softplus", true, dt_softplus); !status.IsOK()) {
      return status;
    }
    *kernel = std::make_unique<SelectiveStateUpdateCpuKernel>(dt_softplus).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
