#include "decode_matmul_cuda.h"

#include <dlfcn.h>
#include <library_types.h>

#include <memory>
#include <string>
#include <vector>

#include "cpu/decode_step_common.h"  // OpError, DimsString
#include "decode_matmul_launcher.h"

namespace mambafuse {
namespace {

constexpr const char* kOp = "DecodeMatMul";
constexpr const char* kNBitsOp = "DecodeMatMulNBits";

// cuBLAS is opened at run time, at the first M > 8 call, rather than linked: the library must still load in a
// CPU-only onnxruntime (docs/kernels.md), where there is no libcublas. ORT's CUDA provider links libcublas, so in a
// CUDA session it is already in the process. The four entry points and the enum values used (cublas_api.h,
// library_types.h: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_COMPUTE_32F = 68, CUBLAS_GEMM_DEFAULT = -1,
// CUBLAS_STATUS_SUCCESS = 0).
using CublasHandle = void*;
using CublasCreate = int (*)(CublasHandle*);
using CublasDestroy = int (*)(CublasHandle);
using CublasSetStream = int (*)(CublasHandle, cudaStream_t);
using CublasGemmEx = int (*)(CublasHandle, int, int, int, int, int, const void*, const void*, cudaDataType, int,
                             const void*, cudaDataType, int, const void*, void*, cudaDataType, int, int, int);
constexpr int kCublasOpN = 0;
constexpr int kCublasOpT = 1;
constexpr int kCublasCompute32F = 68;
constexpr int kCublasGemmDefault = -1;

struct Cublas {
  CublasCreate create = nullptr;
  CublasDestroy destroy = nullptr;
  CublasSetStream set_stream = nullptr;
  CublasGemmEx gemm_ex = nullptr;
  std::string error;
};

const Cublas& CublasLibrary() {
  static const Cublas library = [] {
    Cublas c;
    void* handle = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
      handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
    }
    if (handle == nullptr) {
      c.error = "cannot open libcublas (libcublas.so.13 or .12): the M > 8 path needs cuBLAS";
      return c;
    }
    c.create = reinterpret_cast<CublasCreate>(dlsym(handle, "cublasCreate_v2"));
    c.destroy = reinterpret_cast<CublasDestroy>(dlsym(handle, "cublasDestroy_v2"));
    c.set_stream = reinterpret_cast<CublasSetStream>(dlsym(handle, "cublasSetStream_v2"));
    c.gemm_ex = reinterpret_cast<CublasGemmEx>(dlsym(handle, "cublasGemmEx"));
    if (!c.create || !c.destroy || !c.set_stream || !c.gemm_ex) c.error = "libcublas lacks cublasGemmEx";
    return c;
  }();
  return library;
}

std::string TypeName(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    default: return "element type " + std::to_string(static_cast<int>(type));
  }
}

bool IsFloatType(ONNXTensorElementDataType type) {
  return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
         type == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

int64_t ElementSize(ONNXTensorElementDataType type) { return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : 2; }

int64_t Product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

Ort::Status CudaError(const char* op, const char* what, cudaError_t error) {
  return Ort::Status((std::string(op) + ": " + what + " failed: " + cudaGetErrorName(error) + " (" +
                      cudaGetErrorString(error) + ")")
                         .c_str(),
                     ORT_EP_FAIL);
}

// A's rows and the output, shared by both ops: A is (..., K) of a float type; Y is (..., N), allocated here.
struct Rows {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  int64_t m = 0;
  const void* a = nullptr;
  void* y = nullptr;
  int device = 0;
};

Ort::Status ReadRowsAndAllocate(Ort::KernelContext& context, const char* op, int64_t k, int64_t n, Rows& rows) {
  const Ort::ConstValue a = context.GetInput(0);
  const auto info = a.GetTensorTypeAndShapeInfo();
  rows.type = info.GetElementType();
  if (!IsFloatType(rows.type)) {
    return OpError(op, "input A must be float, float16 or bfloat16, got " + TypeName(rows.type));
  }
  const std::vector<int64_t> dims = info.GetShape();
  if (dims.empty()) return OpError(op, "input A must have rank >= 1, got a scalar");
  if (dims.back() != k) {
    return OpError(op, "input A's last dim " + std::to_string(dims.back()) + " must equal K = " + std::to_string(k) +
                           " (A is " + DimsString(dims.data(), dims.size()) + ")");
  }
  rows.m = Product(dims, 0, dims.size() - 1);
  std::vector<int64_t> out = dims;
  out.back() = n;
  rows.a = a.GetTensorRawData();
  rows.y = context.GetOutput(0, out.data(), out.size()).GetTensorMutableRawData();
  rows.device = a.GetTensorMemoryInfo().GetDeviceId();
  return Ort::Status{};
}

// Device memory from ORT's allocator of the input's device, freed at the end of the call (stream-ordered reuse:
// the next user of the block runs on the same stream).
class Scratch {
 public:
  ~Scratch() {
    if (allocator_ != nullptr) {
      if (data_ != nullptr) allocator_->Free(allocator_, data_);
      Ort::GetApi().ReleaseAllocator(allocator_);
    }
  }
  void* Get(Ort::KernelContext& context, int device, size_t bytes) {
    const Ort::MemoryInfo info("Cuda", OrtArenaAllocator, device, OrtMemTypeDefault);
    allocator_ = context.GetAllocator(*info);
    if (allocator_ == nullptr) return nullptr;
    data_ = allocator_->Alloc(allocator_, bytes);
    return data_;
  }

 private:
  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
};

Ort::Status ZeroOutput(const char* op, const Rows& rows, int64_t n, cudaStream_t stream) {
  const size_t bytes = static_cast<size_t>(rows.m * n * ElementSize(rows.type));
  if (bytes == 0) return Ort::Status{};
  if (const cudaError_t e = cudaMemsetAsync(rows.y, 0, bytes, stream); e != cudaSuccess) {
    return CudaError(op, "zeroing Y (K = 0)", e);
  }
  return Ort::Status{};
}

// Shape inference: Y is A's type, A's dims with the last replaced by N (B's last dim, or the attribute N).
OrtStatusPtr InferRowsTimesN(OrtShapeInferContext* context, bool n_from_attribute) {
  return GuardStatus([&]() -> Ort::Status {
    const OrtApi& api = Ort::GetApi();
    OrtTensorTypeAndShapeInfo* a_info = nullptr;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, 0, &a_info));
    if (a_info == nullptr) return Ort::Status{};
    const Ort::ConstTensorTypeAndShapeInfo a_view(a_info);
    const ONNXTensorElementDataType type = a_view.GetElementType();
    if (!IsFloatType(type)) return Ort::Status{};
    std::vector<int64_t> dims = a_view.GetShape();
    std::vector<const char*> names(dims.size(), nullptr);
    if (!dims.empty()) a_view.GetSymbolicDimensions(names.data(), names.size());
    int64_t n = -1;
    const char* n_name = nullptr;
    if (n_from_attribute) {
      const OrtOpAttr* attr = nullptr;
      Ort::ThrowOnError(api.ShapeInferContext_GetAttribute(context, "N", &attr));
      size_t size = 0;
      if (attr == nullptr) return Ort::Status{};
      Ort::ThrowOnError(api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &n, sizeof(n), &size));
    } else {
      OrtTensorTypeAndShapeInfo* b_info = nullptr;
      Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(context, 1, &b_info));
      if (b_info == nullptr) return Ort::Status{};
      const Ort::ConstTensorTypeAndShapeInfo b_view(b_info);
      const std::vector<int64_t> b_dims = b_view.GetShape();
      if (b_dims.size() != 2) return Ort::Status{};
      std::vector<const char*> b_names(2, nullptr);
      b_view.GetSymbolicDimensions(b_names.data(), b_names.size());
      n = b_dims[1];
      n_name = b_names[1];
    }
    if (dims.empty()) return Ort::Status{};
    dims.back() = n;
    names.back() = n_name;
    std::vector<std::string> kept(dims.size());
    std::vector<const char*> name_ptrs(dims.size());
    for (size_t d = 0; d < dims.size(); ++d) {
      kept[d] = names[d] && *names[d] ? names[d] : dims[d] < 0 ? "decode_matmul_dim_" + std::to_string(d) : "";
      name_ptrs[d] = kept[d].c_str();
    }
    OrtTensorTypeAndShapeInfo* raw_out = nullptr;
    Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
    const Ort::TensorTypeAndShapeInfo out_info(raw_out);  // owns raw_out
    Ort::ThrowOnError(api.SetTensorElementType(raw_out, type));
    Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
    Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, name_ptrs.data(), name_ptrs.size()));
    Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(context, 0, raw_out));
    return Ort::Status{};
  });
}

Ort::Status ReadIntAttribute(const OrtKernelInfo* info, const char* op, const char* name, int64_t& value,
                             bool required) {
  const OrtApi& api = Ort::GetApi();
  if (OrtStatus* status = api.KernelInfoGetAttribute_int64(info, name, &value)) {
    api.ReleaseStatus(status);
    if (required) return OpError(op, std::string("the attribute ") + name + " is required");
  }
  return Ort::Status{};
}

}  // namespace

CublasGemm::~CublasGemm() {
  if (handle_ != nullptr) CublasLibrary().destroy(handle_);
}

std::string CublasGemm::RowMajor(int64_t type, int64_t m, int64_t k, int64_t n, const void* a, const void* b,
                                 int64_t b_row_stride, void* y, void* stream) {
  const Cublas& cublas = CublasLibrary();
  if (!cublas.error.empty()) return cublas.error;
  if (m > INT32_MAX || k > INT32_MAX || n > INT32_MAX || b_row_stride > INT32_MAX) {
    return "M, K and N must be below 2^31 for cuBLAS";
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (handle_ == nullptr) {
    // Created at the first M > 8 call; a session capturing a CUDA graph makes that call uncaptured first.
    if (const int status = cublas.create(&handle_); status != 0) {
      handle_ = nullptr;
      return "cublasCreate failed (status " + std::to_string(status) + ")";
    }
  }
  if (const int status = cublas.set_stream(handle_, static_cast<cudaStream_t>(stream)); status != 0) {
    return "cublasSetStream failed (status " + std::to_string(status) + ")";
  }
  const cudaDataType data_type = type == kGemvFloat ? CUDA_R_32F : type == kGemvFloat16 ? CUDA_R_16F : CUDA_R_16BF;
  const float alpha = 1.f, beta = 0.f;
  // Row-major Y = A B is column-major Y^T (N x M) = B^T (N x K) A^T (K x M). B (K, N) row-major is B^T column-major
  // (leading dim N, no transpose); B stored as rows of n (row-major (N, stride)) is column-major (stride x N), whose
  // transpose's first K columns are B^T.
  const bool rows_of_n = b_row_stride != 0;
  const int status = cublas.gemm_ex(handle_, rows_of_n ? kCublasOpT : kCublasOpN, kCublasOpN, static_cast<int>(n),
                                    static_cast<int>(m), static_cast<int>(k), &alpha, b, data_type,
                                    static_cast<int>(rows_of_n ? b_row_stride : n), a, data_type, static_cast<int>(k),
                                    &beta, y, data_type, static_cast<int>(n), kCublasCompute32F, kCublasGemmDefault);
  if (status != 0) return "cublasGemmEx failed (status " + std::to_string(status) + ")";
  return {};
}

OrtStatusPtr DecodeMatMulCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    const Ort::ConstValue b = context.GetInput(1);
    const auto b_info = b.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> b_dims = b_info.GetShape();
    if (b_dims.size() != 2) {
      return OpError(kOp, "input B must be a 2-D (K, N) weight, got " + DimsString(b_dims.data(), b_dims.size()));
    }
    const int64_t k = b_dims[0], n = b_dims[1];
    Rows rows;
    if (Ort::Status status = ReadRowsAndAllocate(context, kOp, k, n, rows); !status.IsOK()) return status;
    if (b_info.GetElementType() != rows.type) {
      return OpError(kOp, "input B must have A's type " + TypeName(rows.type) + ", got " +
                              TypeName(b_info.GetElementType()));
    }
    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (rows.m == 0 || n == 0) return Ort::Status{};
    if (k == 0) return ZeroOutput(kOp, rows, n, stream);
    if (rows.m <= kDecodeGemvMaxRows) {
      DecodeMatMulArgs args;
      args.type = rows.type, args.m = rows.m, args.k = k, args.n = n;
      args.a = rows.a, args.b = b.GetTensorRawData(), args.y = rows.y;
      if (const char* problem = CheckDecodeMatMulGemvArgs(args)) return OpError(kOp, problem);
      if (const cudaError_t e = LaunchDecodeMatMulGemv(args, stream); e != cudaSuccess) {
        return CudaError(kOp, "the GEMV launch", e);
      }
      return Ort::Status{};
    }
    const std::string problem =
        gemm_.RowMajor(rows.type, rows.m, k, n, rows.a, b.GetTensorRawData(), /*b_row_stride=*/0, rows.y, stream);
    if (!problem.empty()) return Ort::Status((std::string(kOp) + ": " + problem).c_str(), ORT_EP_FAIL);
    return Ort::Status{};
  });
}

DecodeMatMulCudaOp::DecodeMatMulCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferRowsTimesN(context, /*n_from_attribute=*/false);
  };
}

OrtStatusPtr DecodeMatMulCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* /*info*/,
                                                void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    *kernel = std::make_unique<DecodeMatMulCudaKernel>().release();
    return Ort::Status{};
  });
}

OrtStatusPtr DecodeMatMulNBitsCudaKernel::ComputeV2(OrtKernelContext* raw_context) {
  return GuardStatus([&]() -> Ort::Status {
    Ort::KernelContext context(raw_context);
    const int64_t k = attrs_.k, n = attrs_.n, block_size = attrs_.block_size;
    const int64_t blocks = (k + block_size - 1) / block_size;
    Rows rows;
    if (Ort::Status status = ReadRowsAndAllocate(context, kNBitsOp, k, n, rows); !status.IsOK()) return status;

    const Ort::ConstValue b = context.GetInput(1);
    const auto b_info = b.GetTensorTypeAndShapeInfo();
    if (b_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
      return OpError(kNBitsOp, "input B must be uint8, got " + TypeName(b_info.GetElementType()));
    }
    const int64_t b_bytes = n * blocks * (block_size / 2);
    if (static_cast<int64_t>(b_info.GetElementCount()) != b_bytes) {
      const std::vector<int64_t> dims = b_info.GetShape();
      return OpError(kNBitsOp, "input B must hold N * ceil(K / block_size) * block_size / 2 = " +
                                   std::to_string(b_bytes) + " bytes ((N, blocks, block_size / 2) = (" +
                                   std::to_string(n) + ", " + std::to_string(blocks) + ", " +
                                   std::to_string(block_size / 2) + ")), got " + DimsString(dims.data(), dims.size()));
    }
    const Ort::ConstValue scales = context.GetInput(2);
    const auto scales_info = scales.GetTensorTypeAndShapeInfo();
    if (scales_info.GetElementType() != rows.type) {
      return OpError(kNBitsOp, "input scales must have A's type " + TypeName(rows.type) + ", got " +
                                   TypeName(scales_info.GetElementType()));
    }
    if (static_cast<int64_t>(scales_info.GetElementCount()) != n * blocks) {
      return OpError(kNBitsOp, "input scales must hold N * ceil(K / block_size) = " + std::to_string(n * blocks) +
                                   " values, got " + std::to_string(scales_info.GetElementCount()));
    }
    const uint8_t* zero_points = nullptr;
    if (const Ort::ConstValue zp = context.GetInput(3); zp) {
      const auto zp_info = zp.GetTensorTypeAndShapeInfo();
      if (zp_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
        return OpError(kNBitsOp, "input zero_points must be packed uint8 (unpacked zero points of type " +
                                     TypeName(zp_info.GetElementType()) + " are not supported)");
      }
      const int64_t zp_bytes = n * ((blocks + 1) / 2);
      if (static_cast<int64_t>(zp_info.GetElementCount()) != zp_bytes) {
        return OpError(kNBitsOp, "input zero_points must hold N * ceil(blocks / 2) = " + std::to_string(zp_bytes) +
                                     " bytes, got " + std::to_string(zp_info.GetElementCount()));
      }
      zero_points = static_cast<const uint8_t*>(zp.GetTensorRawData());
    }

    auto* stream = static_cast<cudaStream_t>(context.GetGPUComputeStream());
    if (rows.m == 0) return Ort::Status{};
    DecodeMatMulNBitsArgs args;
    args.type = rows.type, args.m = rows.m, args.k = k, args.n = n, args.block_size = block_size;
    args.a = rows.a, args.b = static_cast<const uint8_t*>(b.GetTensorRawData());
    args.scales = scales.GetTensorRawData(), args.zero_points = zero_points, args.y = rows.y;
    const bool gemv = rows.m <= kDecodeGemvMaxRows;
    if (const char* problem = CheckDecodeMatMulNBitsArgs(args, gemv)) return OpError(kNBitsOp, problem);
    if (gemv) {
      if (const cudaError_t e = LaunchDecodeMatMulNBitsGemv(args, stream); e != cudaSuccess) {
        return CudaError(kNBitsOp, "the GEMV launch", e);
      }
      return Ort::Status{};
    }
    // M > 8: W in T with B's layout (N rows of the padded K), then cuBLAS (what ORT's MatMulNBits does for large M).
    const int64_t k_padded = blocks * block_size;
    Scratch scratch;
    void* w = scratch.Get(context, rows.device, static_cast<size_t>(n * k_padded * ElementSize(rows.type)));
    if (w == nullptr) return Ort::Status((std::string(kNBitsOp) + ": no scratch memory for W").c_str(), ORT_EP_FAIL);
    if (const cudaError_t e = LaunchDequantizeInt4(args, w, stream); e != cudaSuccess) {
      return CudaError(kNBitsOp, "the dequantization launch", e);
    }
    const std::string problem = gemm_.RowMajor(rows.type, rows.m, k, n, rows.a, w, k_padded, rows.y, stream);
    if (!problem.empty()) return Ort::Status((std::string(kNBitsOp) + ": " + problem).c_str(), ORT_EP_FAIL);
    return Ort::Status{};
  });
}

DecodeMatMulNBitsCudaOp::DecodeMatMulNBitsCudaOp() {
  InferOutputShapeFn = [](const OrtCustomOp*, OrtShapeInferContext* context) -> OrtStatusPtr {
    return InferRowsTimesN(context, /*n_from_attribute=*/true);
  };
}

OrtStatusPtr DecodeMatMulNBitsCudaOp::CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info,
                                                     void** kernel) const {
  return GuardStatus([&]() -> Ort::Status {
    DecodeMatMulNBitsAttrs attrs;
    int64_t bits = 4, accuracy_level = 0;
    if (Ort::Status s = ReadIntAttribute(info, kNBitsOp, "K", attrs.k, true); !s.IsOK()) return s;
    if (Ort::Status s = ReadIntAttribute(info, kNBitsOp, "N", attrs.n, true); !s.IsOK()) return s;
    if (Ort::Status s = ReadIntAttribute(info, kNBitsOp, "block_size", attrs.block_size, true); !s.IsOK()) return s;
    if (Ort::Status s = ReadIntAttribute(info, kNBitsOp, "bits", bits, false); !s.IsOK()) return s;
    if (Ort::Status s = ReadIntAttribute(info, kNBitsOp, "accuracy_level", accuracy_level, false); !s.IsOK()) {
      return s;
    }
    if (bits != 4) return OpError(kNBitsOp, "the attribute bits must be 4, got " + std::to_string(bits));
    if (attrs.block_size < 16 || (attrs.block_size & (attrs.block_size - 1)) != 0) {
      return OpError(kNBitsOp,
                     "the attribute block_size must be a power of two >= 16, got " + std::to_string(attrs.block_size));
    }
    if (attrs.k < 1 || attrs.n < 1) {
      return OpError(kNBitsOp, "the attributes K and N must be positive, got K = " + std::to_string(attrs.k) +
                                   ", N = " + std::to_string(attrs.n));
    }
    *kernel = std::make_unique<DecodeMatMulNBitsCudaKernel>(attrs).release();
    return Ort::Status{};
  });
}

}  // namespace mambafuse
