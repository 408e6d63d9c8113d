// ONNX Runtime-facing DecodeMatMul and DecodeMatMulNBits for the CUDA execution provider (docs/decode_matmul.md,
// Kernels): input validation with errors that name the input, output allocation, and the choice of kernel by the
// rows M of A: the GEMVs of decode_matmul_launcher.h for M <= 8, cuBLAS (GemmEx, float32 compute) for larger M, after
// dequantizing the int4 weight into a scratch buffer of T from ORT's allocator, B's layout (N rows of K padded to
// whole blocks). Everything runs on ORT's compute stream. There are no CPU kernels: on the CPU ORT inlines the op's
// model-local function (MatMul / MatMulNBits).
#pragma once

#include <mutex>
#include <string>

#include "common/ort_api.h"

namespace mambafuse {

// A cuBLAS handle created at the kernel's first call with M > 8 (never for decode-only nodes: a handle holds device
// memory), bound to the call's stream under a lock.
class CublasGemm {
 public:
  CublasGemm() = default;
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;
  ~CublasGemm();
  // Y (M, N) = A (M, K) @ B, all row-major T (ONNX element type), float32 compute. B is (K, N) where b_row_stride
  // is 0, else B^T stored as N rows b_row_stride (>= K) apart, of which each row's first K are read. Empty on
  // success, else what failed.
  std::string RowMajor(int64_t type, int64_t m, int64_t k, int64_t n, const void* a, const void* b,
                       int64_t b_row_stride, void* y, void* stream);

 private:
  std::mutex mutex_;
  void* handle_ = nullptr;  // cublasHandle_t
};

class DecodeMatMulCudaKernel {
 public:
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  CublasGemm gemm_;
};

struct DecodeMatMulCudaOp : Ort::CustomOpBase<DecodeMatMulCudaOp, DecodeMatMulCudaKernel, /*WithStatus=*/true> {
  DecodeMatMulCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "DecodeMatMul"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 2; }  // A, B; any element type, checked by the kernel
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

struct DecodeMatMulNBitsAttrs {
  int64_t k = 0;
  int64_t n = 0;
  int64_t block_size = 0;
};

class DecodeMatMulNBitsCudaKernel {
 public:
  explicit DecodeMatMulNBitsCudaKernel(const DecodeMatMulNBitsAttrs& attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  DecodeMatMulNBitsAttrs attrs_;
  CublasGemm gemm_;
};

struct DecodeMatMulNBitsCudaOp
    : Ort::CustomOpBase<DecodeMatMulNBitsCudaOp, DecodeMatMulNBitsCudaKernel, /*WithStatus=*/true> {
  DecodeMatMulNBitsCudaOp();

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return "DecodeMatMulNBits"; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }  // A, B, scales, zero_points (optional)
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

}  // namespace mambafuse
