// Exhaustive check, on the GPU at hand, of the identity that the SelectiveStateUpdate kernels with a half state
// rely on (selective_state_update_kernels.cuh, ChunkProducts<__half, kVec, true>): for every pair of half
// values a and b, the packed half multiply equals the float32 product rounded to half,
//   __hmul2(a, b) == __float2half_rn(__fmul_rn(float(a), float(b)))     (a NaN matching any NaN),
// in both halves of the packed instruction. The float32 product of two half values is exact (11 + 11
// significant bits, exponents within float32's normal range), so both sides are the exact product rounded to
// nearest even; this program shows that the hardware's packed multiply does so for all 2^32 pairs, subnormals,
// infinities and signed zeros included.
//
//   mambafuse_cuda_half_product_check [--quick]   exit status 0 when no pair differs, 1 when one does, 77 without a
//                                                 GPU (--quick, as the self-checks take it, changes nothing: the
//                                                 whole check takes milliseconds)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

__device__ __forceinline__ bool SameHalf(__half got, __half expected) {
  const unsigned short g = __half_as_ushort(got), e = __half_as_ushort(expected);
  if (__hisnan(got) || __hisnan(expected)) return __hisnan(got) && __hisnan(expected);
  return g == e;
}

// Block a: every b, two at a time (b, b + 1) so that both halves of the packed multiply are exercised.
__global__ void CountMismatches(unsigned long long* mismatches, unsigned int* first_pair) {
  const __half a = __ushort_as_half(static_cast<unsigned short>(blockIdx.x));
  const __half2 a2 = __half2half2(a);
  const float a_float = __half2float(a);
  unsigned int count = 0;
  for (unsigned int b = 2 * threadIdx.x; b < 65536u; b += 2 * blockDim.x) {
    const __half b0 = __ushort_as_half(static_cast<unsigned short>(b));
    const __half b1 = __ushort_as_half(static_cast<unsigned short>(b + 1));
    const __half2 product = __hmul2(a2, __halves2half2(b0, b1));
    const __half e0 = __float2half_rn(__fmul_rn(a_float, __half2float(b0)));
    const __half e1 = __float2half_rn(__fmul_rn(a_float, __half2float(b1)));
    const bool ok0 = SameHalf(__low2half(product), e0), ok1 = SameHalf(__high2half(product), e1);
    if (!ok0 || !ok1) {
      count += !ok0 + !ok1;
      atomicCAS(first_pair, 0xFFFFFFFFu, (blockIdx.x << 16) | (ok0 ? b + 1 : b));
    }
  }
  if (count != 0) atomicAdd(mismatches, static_cast<unsigned long long>(count));
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 77;
  }
  unsigned long long* mismatches = nullptr;
  unsigned int* first_pair = nullptr;
  if (cudaMalloc(&mismatches, sizeof(*mismatches)) != cudaSuccess ||
      cudaMalloc(&first_pair, sizeof(*first_pair)) != cudaSuccess ||
      cudaMemset(mismatches, 0, sizeof(*mismatches)) != cudaSuccess ||
      cudaMemset(first_pair, 0xFF, sizeof(*first_pair)) != cudaSuccess) {
    std::fprintf(stderr, "error: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  CountMismatches<<<65536, 256>>>(mismatches, first_pair);
  unsigned long long count = 0;
  unsigned int pair = 0;
  const cudaError_t error = cudaDeviceSynchronize();
  if (error != cudaSuccess || cudaMemcpy(&count, mismatches, sizeof(count), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(&pair, first_pair, sizeof(pair), cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "error: %s\n", cudaGetErrorString(error != cudaSuccess ? error : cudaGetLastError()));
    return 2;
  }
  cudaFree(mismatches);
  cudaFree(first_pair);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (count != 0) {
    std::printf("half products on %s: %llu of 2^32 pairs differ (the first: a = 0x%04x, b = 0x%04x)\n", prop.name,
                count, pair >> 16, pair & 0xFFFFu);
    return 1;
  }
  std::printf("half products on %s: all 2^32 pairs equal (packed half multiply = float32 product rounded)\n",
              prop.name);
  return 0;
}
