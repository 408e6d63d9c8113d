// C entry points to the DecodeMatMul / DecodeMatMulNBits GEMV launchers (M <= 8), for benchmarks and the sanitizer
// driver that launch the kernels directly (ctypes, with buffers and a stream from PyTorch, inside PyTorch's CUDA
// graphs, next to cuBLAS timed the same way). Built only with MAMBAFUSE_CUDA_TOOLS=ON; not part of the shipped
// library. Types are ONNX element type numbers (1 float, 10 float16, 16 bfloat16).
#include <cstdint>

#include "decode_matmul_launcher.h"

#define MAMBAFUSE_BENCH_EXPORT extern "C" __attribute__((visibility("default")))

// Y (M, N) = A (M, K) @ B (K, N) on `stream`. Returns a cudaError_t (0 = success), or -1 for arguments the check
// rejects.
MAMBAFUSE_BENCH_EXPORT int mambafuse_decode_matmul_launch(int type, int64_t m, int64_t k, int64_t n, const void* a,
                                                          const void* b, void* y, void* stream) {
  mambafuse::DecodeMatMulArgs args;
  args.type = type, args.m = m, args.k = k, args.n = n, args.a = a, args.b = b, args.y = y;
  if (mambafuse::CheckDecodeMatMulGemvArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchDecodeMatMulGemv(args, static_cast<cudaStream_t>(stream)));
}

// Y (M, N) = A (M, K) @ W, W from MatMulNBits' 4-bit blocks; zero_points may be null.
MAMBAFUSE_BENCH_EXPORT int mambafuse_decode_matmul_nbits_launch(int type, int64_t m, int64_t k, int64_t n,
                                                                int64_t block_size, const void* a, const void* b,
                                                                const void* scales, const void* zero_points, void* y,
                                                                void* stream) {
  mambafuse::DecodeMatMulNBitsArgs args;
  args.type = type, args.m = m, args.k = k, args.n = n, args.block_size = block_size, args.a = a;
  args.b = static_cast<const uint8_t*>(b), args.scales = scales;
  args.zero_points = static_cast<const uint8_t*>(zero_points), args.y = y;
  if (mambafuse::CheckDecodeMatMulNBitsArgs(args, /*gemv=*/true) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchDecodeMatMulNBitsGemv(args, static_cast<cudaStream_t>(stream)));
}

// W (N, K padded to whole blocks) in T from the 4-bit blocks: the M > 8 path's first half.
MAMBAFUSE_BENCH_EXPORT int mambafuse_dequantize_int4_launch(int type, int64_t k, int64_t n, int64_t block_size,
                                                            const void* b, const void* scales,
                                                            const void* zero_points, void* w, void* stream) {
  mambafuse::DecodeMatMulNBitsArgs args;
  args.type = type, args.m = 1, args.k = k, args.n = n, args.block_size = block_size;
  args.b = static_cast<const uint8_t*>(b), args.scales = scales;
  args.zero_points = static_cast<const uint8_t*>(zero_points);
  if (mambafuse::CheckDecodeMatMulNBitsArgs(args, /*gemv=*/false) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchDequantizeInt4(args, w, static_cast<cudaStream_t>(stream)));
}
