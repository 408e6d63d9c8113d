// Whether compute-sanitizer's racecheck takes barrier.arrive → barrier.sync as ordering shared-memory accesses, the
// hand-off RegisterStateScan's roles use. A producer warp writes a shared array and arrives at named barrier 1; a
// consumer warp waits there, reads it and arrives at barrier 2, where the producer waits before writing again. Under
// the PTX memory model an arrive synchronizes with the sync that completes its barrier, so this is race-free;
// `sync` as the argument makes both sides wait (barrier.sync only), the control.
//
//   nvcc -arch=sm_90 contrib_ops/cuda/tools/racecheck_handoff.cu -o /tmp/handoff
//   compute-sanitizer --tool racecheck /tmp/handoff; compute-sanitizer --tool racecheck /tmp/handoff sync
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

__global__ void Handoff(float* out, int rounds, bool both_wait) {
  __shared__ float slot[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int r = 0; r < rounds; ++r) {
    if (warp == 1) {
      if (r > 0) asm volatile("barrier.sync 2, 64;\n" ::: "memory");
      slot[lane] = static_cast<float>(r + lane);
      if (both_wait) {
        asm volatile("barrier.sync 1, 64;\n" ::: "memory");
      } else {
        asm volatile("barrier.arrive 1, 64;\n" ::: "memory");
      }
    } else {
      asm volatile("barrier.sync 1, 64;\n" ::: "memory");
      sum += slot[(lane + 1) % 32];
      if (r + 1 < rounds) {
        if (both_wait) {
          asm volatile("barrier.sync 2, 64;\n" ::: "memory");
        } else {
          asm volatile("barrier.arrive 2, 64;\n" ::: "memory");
        }
      }
    }
  }
  if (warp == 0) out[lane] = sum;
}

int main(int argc, char** argv) {
  const bool both_wait = argc > 1 && std::strcmp(argv[1], "sync") == 0;
  constexpr int kRounds = 4;
  float* out = nullptr;
  cudaMalloc(&out, 32 * sizeof(float));
  Handoff<<<1, 64>>>(out, kRounds, both_wait);
  float host[32];
  cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
  const float expected = kRounds * 1.f + kRounds * (kRounds - 1) / 2.f;  // lane 0 reads lane 1: sum of r + 1
  std::printf("%s: lane 0 read %g, expected %g\n", both_wait ? "sync/sync" : "arrive/sync", host[0], expected);
  return host[0] == expected && cudaGetLastError() == cudaSuccess ? 0 : 1;
}
