// ONNX Runtime-facing helpers shared by the CPU ops of the Mamba-2 mixer (the decode steps CausalConv1dUpdate and
// SelectiveStateUpdate, the prefill ops CausalConv1d and MambaChunkScan): errors that name the op, an input's dims
// in one query, an output's type and shape copied from an input in type and shape inference, the convs'
// activation attribute, and a work split over ORT's thread pool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/ort_api.h"
#include "gated_group_rms_norm.h"  // TensorDims
#include "gated_group_rms_norm_impl.h"

namespace mambafuse {

inline Ort::Status OpError(const char* op, const std::string& message) {
  return Ort::Status((std::string(op) + ": " + message).c_str(), ORT_INVALID_ARGUMENT);
}

// "[2, 16]"
inline std::string DimsString(const int64_t* dims, size_t rank) {
  std::string out = "[";
  for (size_t i = 0; i < rank; ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

inline bool HasDims(const TensorDims& t, std::initializer_list<int64_t> expected) {
  if (t.rank() != expected.size()) return false;
  size_t i = 0;
  for (int64_t d : expected) {
    if (t.data()[i++] != d) return false;
  }
  return true;
}

inline int64_t ElementCount(const TensorDims& t) {
  int64_t count = 1;
  for (size_t i = 0; i < t.rank(); ++i) count *= t.data()[i];
  return count;
}

// Reads an input that may be absent (an optional input left empty): false when it is.
inline bool ReadOptionalInput(Ort::KernelContext& context, size_t index, TensorDims& dims, const void** data) {
  const Ort::ConstValue value = context.GetInput(index);
  if (!value) return false;
  dims.Read(value);
  *data = value.GetTensorRawData();
  return true;
}

// Shape inference: output `out` gets input `in`'s element type and shape (dims and their names). An
// input of unknown rank leaves the output to the graph.
inline OrtStatusPtr ForwardTypeShape(OrtShapeInferContext* context, size_t in, size_t out) {
  return GuardStatus([&]() -> Ort::Status {
    const OrtApi& api = Ort::GetApi();
    size_t count = 0;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputCount(context, &count));
    if (in >= count) return Ort::Status{};
    OrtTensorTypeAndShapeInfo* info = nullptr;  // belongs to the context
    Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, in, &info));
    if (info == nullptr) return Ort::Status{};
    const Ort::ConstTensorTypeAndShapeInfo view(info);
    const int64_t type = view.GetElementType();
    if (!IsSupportedElemType(type)) return Ort::Status{};
    std::vector<int64_t> dims = view.GetShape();
    OrtTensorTypeAndShapeInfo* raw_out = nullptr;
    Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
    const Ort::TensorTypeAndShapeInfo out_info(raw_out);  // owns raw_out
    Ort::ThrowOnError(api.SetTensorElementType(raw_out, static_cast<ONNXTensorElementDataType>(type)));
    if (!dims.empty()) {
      std::vector<const char*> names(dims.size(), nullptr);
      view.GetSymbolicDimensions(names.data(), names.size());
      std::vector<std::string> kept(dims.size());
      std::vector<const char*> name_ptrs(dims.size());
      for (size_t d = 0; d < dims.size(); ++d) {
        // An unnamed unknown dim gets a name: ORT writes it as the value -1 otherwise.
        kept[d] = names[d] && *names[d] ? names[d] : dims[d] < 0 ? "decode_step_dim_" + std::to_string(d) : "";
        name_ptrs[d] = kept[d].c_str();
      }
      Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
      Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, name_ptrs.data(), name_ptrs.size()));
    }
    Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(context, out, raw_out));
    return Ort::Status{};
  });
}

// Reads the optional 0/1 int attribute `name` as `flag` (absent: `fallback`). Any other value is an error naming the
// node, the attribute and the value.
inline Ort::Status ReadFlagAttribute(const OrtKernelInfo* info, const char* op, const char* name, bool fallback,
                                     bool& flag) {
  const OrtApi& ort = Ort::GetApi();
  int64_t value = fallback ? 1 : 0;
  if (OrtStatus* status = ort.KernelInfoGetAttribute_int64(info, name, &value)) {
    ort.ReleaseStatus(status);  // optional: absent means the fallback
    value = fallback ? 1 : 0;
  }
  if (value != 0 && value != 1) {
    const Ort::ConstKernelInfo kernel_info(info);
    return OpError(op, "node '" + kernel_info.GetNodeName() + "': " + name + " must be 0 or 1, got " +
                           std::to_string(value));
  }
  flag = value == 1;
  return Ort::Status{};
}

// Reads an optional int attribute during shape inference: absent (or unreadable) gives `fallback`, and `present`
// says which.
inline int64_t InferAttrInt(const OrtShapeInferContext* context, const char* name, int64_t fallback, bool* present) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  *present = false;
  if (OrtStatus* status = api.ShapeInferContext_GetAttribute(context, name, &attr)) {
    api.ReleaseStatus(status);
    return fallback;
  }
  if (attr == nullptr) return fallback;
  int64_t value = 0;
  size_t written = 0;
  if (OrtStatus* status = api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &value, sizeof value, &written)) {
    api.ReleaseStatus(status);
    return fallback;
  }
  *present = true;
  return value;
}

// Reads the optional attribute `activation` of the causal convs: "silu" (also when absent) or "none", as `silu`.
// Any other value is an error naming the node.
inline Ort::Status ReadSiluActivation(const OrtKernelInfo* info, const char* op, bool& silu) {
  const Ort::ConstKernelInfo kernel_info(info);
  const OrtApi& ort = Ort::GetApi();
  std::string activation = "silu";
  size_t size = 0;
  if (OrtStatus* status = ort.KernelInfoGetAttribute_string(info, "activation", nullptr, &size)) {
    ort.ReleaseStatus(status);  // optional: absent means silu
  } else {
    activation = kernel_info.GetAttribute<std::string>("activation");
  }
  if (activation != "silu" && activation != "none") {
    return OpError(op, "node '" + kernel_info.GetNodeName() + "': activation must be \"silu\" or \"none\", got \"" +
                           activation + "\"");
  }
  silu = activation == "silu";
  return Ort::Status{};
}

// Runs compute(args, first, last) over the items [0, items) as `chunks` contiguous ranges of nearly equal size
// (chunk c: [items c / chunks, items (c + 1) / chunks)): on this thread when chunks <= 1, else one range per task
// of ORT's intra-op thread pool. Every item is computed by one call, whatever the split.
template <typename Args>
void RunInChunks(const Ort::KernelContext& context, void (*compute)(const Args&, int64_t, int64_t), const Args& args,
                 int64_t items, int64_t chunks) {
  if (chunks <= 1) {
    compute(args, 0, items);
    return;
  }
  struct Work {
    void (*compute)(const Args&, int64_t, int64_t);
    const Args* args;
    int64_t items;
    int64_t chunks;
  };
  Work work{compute, &args, items, chunks};
  const auto run_chunk = [](void* user_data, size_t chunk) {
    const Work& w = *static_cast<const Work*>(user_data);
    const auto c = static_cast<int64_t>(chunk);
    w.compute(*w.args, w.items * c / w.chunks, w.items * (c + 1) / w.chunks);
  };
  context.ParallelFor(run_chunk, static_cast<size_t>(chunks), static_cast<size_t>(chunks), &work);
}

}  // namespace mambafuse
