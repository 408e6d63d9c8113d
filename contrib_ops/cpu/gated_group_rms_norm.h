// ONNX Runtime-facing GatedGroupRMSNorm for the CPU execution provider: attribute and input validation,
// output allocation, and the split of (row, group) items over ORT's thread pool. The math lives in
// gated_group_rms_norm_impl.h (no ORT types).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/ort_api.h"
#include "gated_group_rms_norm_impl.h"

namespace mambafuse {

// Attributes, read and checked once per kernel instance (docs/op.md).
struct GatedGroupRMSNormAttrs {
  float epsilon = 0.f;
  int64_t group_size = 0;
  int64_t norm_dtype = 0;    // 0: same as Y
  int64_t output_dtype = 0;  // 0: same as Y
  int64_t gated_dtype = 0;   // 0 or FLOAT: h = y * silu(z) is not rounded

  // Reads the attributes of a node; the error names the node and the attribute.
  static Ort::Status Read(const OrtKernelInfo* info, GatedGroupRMSNormAttrs& attrs);
};

// A tensor's element type and shape from one type-and-shape query, the dims in fixed storage: no heap
// allocation for ranks up to kInlineRank (every decode and prefill tensor), a vector beyond. (A decode
// step's node computes for ~3 us; the shape vectors and repeated queries of the general API showed.)
class TensorDims {
 public:
  static constexpr size_t kInlineRank = 8;

  void Read(const OrtValue* value);
  int64_t type() const { return type_; }
  size_t rank() const { return rank_; }
  const int64_t* data() const { return rank_ > kInlineRank ? heap_.data() : inline_; }
  int64_t back() const { return data()[rank_ - 1]; }
  bool operator==(const TensorDims& other) const;
  std::string ToString() const;  // "[2, 16]"

 private:
  int64_t type_ = 0;
  size_t rank_ = 0;
  int64_t inline_[kInlineRank] = {};
  std::vector<int64_t> heap_;
};

// What cannot change between Runs of one node, read at kernel creation (CPU kernel).
struct GatedGroupRMSNormStatic {
  int64_t out_type = 0;     // the output's element type in the graph; 0: unknown, queried every Run
  bool w_constant = false;  // W is a constant initializer: its type and shape are `w`
  bool w_subnormal_free = false;  // a constant W none of whose elements is a float32 subnormal
  TensorDims w;

  static Ort::Status Read(const OrtKernelInfo* info, GatedGroupRMSNormStatic& known);
};

// Input shapes/types -> the args of the math core, with an error message that names the offending
// value when they do not fit the op's contract. Shared by the CPU and CUDA kernels; `known` (optional)
// skips the queries of what kernel creation already read.
Ort::Status PrepareArgs(const GatedGroupRMSNormAttrs& attrs, Ort::KernelContext& context,
                        GatedGroupRMSNormArgs& args, const GatedGroupRMSNormStatic* known = nullptr);

class GatedGroupRMSNormCpuKernel {
 public:
  GatedGroupRMSNormCpuKernel(GatedGroupRMSNormAttrs attrs, GatedGroupRMSNormStatic known)
      : attrs_(attrs), known_(std::move(known)) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  GatedGroupRMSNormAttrs attrs_;
  GatedGroupRMSNormStatic known_;
};

struct GatedGroupRMSNormCpuOp
    : Ort::CustomOpBase<GatedGroupRMSNormCpuOp, GatedGroupRMSNormCpuKernel, /*WithStatus=*/true> {
  GatedGroupRMSNormCpuOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "GatedGroupRMSNorm"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  // One registration serves every supported type combination: the inputs accept any element type and
  // the kernel dispatches on the actual types, rejecting unsupported ones with a clear message (also at
  // session creation, from the type/shape inference below).
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

// What is known about an input before run time (from the graph): element type (0 = unknown) and shape
// (negative dims unknown; has_shape false when not even the rank is known).
struct StaticInput {
  int64_t elem_type = 0;
  std::vector<int64_t> shape;
  bool has_shape = false;
};

// Checks the types and the known dimensions of the inputs against the op's contract.
Ort::Status CheckStaticSignature(const StaticInput (&inputs)[3], int64_t group_size);

// Reads the static input types and shapes of a node at kernel creation.
Ort::Status ReadStaticInputs(const OrtKernelInfo* info, StaticInput (&inputs)[3]);

// What every provider's kernel creation does: read the attributes and check the static signature and
// the output's type, so a bad graph fails when the session is created. The error names the node.
Ort::Status ReadNode(const OrtKernelInfo* info, GatedGroupRMSNormAttrs& attrs);

// The output's element type in the graph against output_dtype (default Y's type): the same, float (the
// widened storage of docs/op.md) or unknown serve; any other type is the error, saying why when neither Y
// nor Z has a known rank (InferGatedGroupRMSNorm cannot type the output then).
Ort::Status CheckOutputType(const OrtKernelInfo* info, const GatedGroupRMSNormAttrs& attrs,
                            const StaticInput (&inputs)[3]);

// Points an op's shape inference at InferGatedGroupRMSNorm (shared by the CPU and CUDA ops).
void UseGatedGroupRMSNormInference(OrtCustomOp& op);

// Type and shape inference for the op: output = Y's shape, element type = output_dtype (default Y's).
// Leaves the output unset for inputs the op rejects (the kernel-creation check reports them), and when
// neither Y nor Z has a known rank (ONNX Runtime cannot take a type without a shape).
OrtStatusPtr InferGatedGroupRMSNorm(OrtShapeInferContext* context);

}  // namespace mambafuse
