// Launchers of the DecodeMatMul / DecodeMatMulNBits CUDA kernels (docs/decode_matmul.md, Kernels): plain C++ and the
// CUDA runtime types only, because ONNX Runtime's C++ headers do not compile under nvcc 13.
//
//   DecodeMatMul:      Y[m, n] = round_T(sum_k A[m, k] B[k, n])                      B (K, N) row-major
//   DecodeMatMulNBits: W[k, n] = round_T((q[n, k] - zp[n, b]) * scales[n, b]),  b = k / block_size
//                      Y[m, n] = round_T(sum_k A[m, k] W[k, n])
// with float32 sums. q is the nibble of byte B[n * row_bytes + k / 2] (low for even k), row_bytes = blocks *
// block_size / 2; zp the nibble b % 2 of byte zero_points[n * ceil(blocks / 2) + b / 2], 8 without zero points.
// Every kernel here rounds the int4 weight to T before the product (as ONNX Runtime's MatMulNBits does).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mambafuse {

// The most rows of A the GEMV kernels take; larger M goes to cuBLAS (the ORT wrapper does that).
constexpr int64_t kDecodeGemvMaxRows = 8;

// ONNX element types of A, B (DecodeMatMul), scales and Y.
constexpr int64_t kGemvFloat = 1;
constexpr int64_t kGemvFloat16 = 10;
constexpr int64_t kGemvBFloat16 = 16;

struct DecodeMatMulArgs {
  int64_t type = 0;  // ONNX element type of A, B and Y
  int64_t m = 0;     // rows of A (the product of its leading dims)
  int64_t k = 0;
  int64_t n = 0;
  const void* a = nullptr;  // (M, K) row-major, device
  const void* b = nullptr;  // (K, N) row-major, device
  void* y = nullptr;        // (M, N) row-major, device
};

struct DecodeMatMulNBitsArgs {
  int64_t type = 0;  // ONNX element type of A, scales and Y
  int64_t m = 0;
  int64_t k = 0;
  int64_t n = 0;
  int64_t block_size = 0;                // power of two >= 16
  const void* a = nullptr;               // (M, K)
  const uint8_t* b = nullptr;            // N rows of blocks * block_size / 2 bytes
  const void* scales = nullptr;          // N * blocks values of T
  const uint8_t* zero_points = nullptr;  // N * ceil(blocks / 2) bytes, or null (zero point 8)
  void* y = nullptr;                     // (M, N)
};

// Null when the arguments can be launched (dims within int range, 1 <= m <= kDecodeGemvMaxRows for the GEMVs, a
// supported type), else what is wrong.
const char* CheckDecodeMatMulGemvArgs(const DecodeMatMulArgs& args);
const char* CheckDecodeMatMulNBitsArgs(const DecodeMatMulNBitsArgs& args, bool gemv);

// The GEMV for 1 <= M <= 8, enqueued on `stream`: no allocation, no host synchronization, safe under CUDA-graph
// capture (host-side occupancy and device-attribute queries only). cudaErrorInvalidValue for arguments the checks
// reject; cudaSuccess with nothing launched when N == 0. K == 0 writes zeros.
cudaError_t LaunchDecodeMatMulGemv(const DecodeMatMulArgs& args, cudaStream_t stream);
cudaError_t LaunchDecodeMatMulNBitsGemv(const DecodeMatMulNBitsArgs& args, cudaStream_t stream);

// Writes W in T to `w` with B's layout, N rows of blocks * block_size values (K padded to whole blocks; the padding
// is dequantized too): the weight cuBLAS multiplies for M > 8, as B^T.
cudaError_t LaunchDequantizeInt4(const DecodeMatMulNBitsArgs& args, void* w, cudaStream_t stream);

}  // namespace mambafuse
