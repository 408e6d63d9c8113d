// How fast one multiprocessor issues the tensor-core products the chunked scan kernels use: mma.sync m16n8k8 TF32
// and m16n8k16 float16 (both float32 accumulation), with kChains independent accumulators a warp and 1-16 warps a
// block, one block a multiprocessor (132 blocks on an H100). Prints products a cycle a multiprocessor and TFLOP/s at
// the measured clock. The scan kernels issue a fixed number of these per chunk, so this rate bounds their time.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 benchmarks/mma_rate.cu -o /tmp/mma_rate && /tmp/mma_rate
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kChains = 8;
constexpr int kSteps = 4096;

template <bool kTf32>
__global__ void Products(float* out, long long* cycles) {
  float d[kChains][4] = {};
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = 0x3f800000u ^ (threadIdx.x + i);  // values do not matter for the rate
  for (int i = 0; i < 2; ++i) b[i] = 0x3f800000u ^ (threadIdx.x * 3 + i);
  __syncthreads();
  const long long start = clock64();
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (kTf32) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      }
    }
  }
  __syncthreads();
  const long long stop = clock64();
  float sum = 0.f;
  for (int c = 0; c < kChains; ++c) sum += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  float* out = nullptr;
  long long* cycles = nullptr;
  cudaMalloc(&out, sms * 1024 * sizeof(float));
  cudaMalloc(&cycles, sms * sizeof(long long));
  std::printf("%s, %d multiprocessors; %d chains a warp, %d steps\n", prop.name, sms, kChains, kSteps);
  std::printf(
      "| product | warps a block | cycles a product a multiprocessor | products a cycle a scheduler | "
      "TFLOP/s (all SMs, wall clock) |\n|---|---|---|---|---|\n");
  for (int tf32 = 1; tf32 >= 0; --tf32) {
    for (int warps : {1, 2, 4, 8, 16}) {
      auto kernel = tf32 ? Products<true> : Products<false>;
      kernel<<<sms, warps * 32>>>(out, cycles);  // warm-up
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      cudaEventRecord(e0);
      kernel<<<sms, warps * 32>>>(out, cycles);
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, e0, e1);
      long long c = 0;
      cudaMemcpy(&c, cycles, sizeof c, cudaMemcpyDeviceToHost);
      const double products = static_cast<double>(warps) * kChains * kSteps;  // a multiprocessor
      const double flop = 2.0 * 16 * 8 * (tf32 ? 8 : 16) * products * sms;
      std::printf("| %s | %d | %.2f | %.3f | %.1f |\n", tf32 ? "m16n8k8 TF32" : "m16n8k16 f16", warps,
                  static_cast<double>(c) / products, products / static_cast<double>(c) / 4, flop / (ms * 1e-3) / 1e12);
    }
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) std::printf("CUDA error: %s\n", cudaGetErrorString(error));
  return error == cudaSuccess ? 0 : 1;
}
