// Whether compute-sanitizer's racecheck takes barrier.arrive → barrier.sync as ordering shared-memory accesses, the
// hand-off RegisterStateScan's roles use. A producer warp writes a shared array and arrives at named barrier 1; a
// consumer warp waits there, reads it and arrives at barrier 2, where the producer waits before writing again. Under
// the PTX memory model an arrive synchronizes with the sync that completes its barrier, so this is race-free;
// `sync` as the argument makes both sides wait (barrier.sync only), the control.
//
// `roles` runs RegisterStateScan's synchronization alone, barrier.sync only: 8 "state" warps and 8 "helper" warps
// of a 512-thread block meet once a chunk at barrier 0 (from their own code, so not .aligned); the helpers write a
// chunk's W into one of two buffers by chunk parity while the state warps read the other, between two syncs of
// helper barrier 5 (256 threads), and the state warps' pairs meet at barriers 1-4 (64 threads) in between. Every
// read of W is ordered after its chunk's writes and before the next writes to its buffer by a barrier 0 that all
// 512 threads sync, so this is race-free too; the kernel checks what it read.
//
//   nvcc -arch=sm_90 contrib_ops/cuda/tools/racecheck_handoff.cu -o /tmp/handoff
//   compute-sanitizer --tool racecheck /tmp/handoff; compute-sanitizer --tool racecheck /tmp/handoff sync
//   compute-sanitizer --tool racecheck /tmp/handoff roles         # roles-plain: without barriers 1-5
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

constexpr int kChunks = 32;
constexpr int kRows = 64, kLd = 72;

__device__ __forceinline__ void Sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// W of chunk c at row l, column s: a value the state warps can check.
__device__ __forceinline__ float WValue(int c, int l, int s) { return static_cast<float>(c * 8192 + l * 64 + s); }

__global__ void __launch_bounds__(512, 1) Roles(int* bad, bool partial) {
  __shared__ float w[2][kRows * kLd];
  __shared__ float exchange[8][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp >= 8) {  // helpers: chunk c's W (all 64 x 64), then the chunk barrier
    const int hid = threadIdx.x - 256;
    const auto prepare = [&](int c) {
      if (partial) Sync(5, 256);
      float* const wc = w[c & 1];
      if (partial) Sync(5, 256);
      for (int i = hid; i < kRows * 64; i += 256) wc[(i / 64) * kLd + i % 64] = WValue(c, i / 64, i % 64);
    };
    prepare(0);
    Sync(0, 512);
    for (int c = 0; c < kChunks; ++c) {
      if (c + 1 < kChunks) prepare(c + 1);
      Sync(0, 512);
    }
    return;
  }
  // state warps: read chunk c's W (a row per lane pair, with some arithmetic between), exchange with the partner
  int wrong = 0;
  Sync(0, 512);
  for (int c = 0; c < kChunks; ++c) {
    const float* const wc = w[c & 1];
    float acc = 0.f;
    for (int k = 0; k < 64; ++k) {
      const int l = (warp * 8 + k / 8) % kRows, s = (lane * 2 + k) % 64;
      const float v = wc[l * kLd + s];
      wrong += v != WValue(c, l, s);
      acc = fmaf(acc, 0.5f, v);
    }
    if (partial) {
      exchange[warp][lane] = acc;
      Sync(1 + warp / 2, 64);
      acc += exchange[warp ^ 1][lane];  // rewritten next chunk, after barrier 0
    }
    wrong += !(acc == acc);
    Sync(0, 512);
  }
  if (wrong) atomicAdd(bad, wrong);
}

int RunRoles(bool partial) {
  int* bad = nullptr;
  cudaMalloc(&bad, sizeof(int));
  cudaMemset(bad, 0, sizeof(int));
  Roles<<<264, 512>>>(bad, partial);  // two waves on 132 multiprocessors
  int host = -1;
  cudaMemcpy(&host, bad, sizeof host, cudaMemcpyDeviceToHost);
  std::printf("roles%s: %d wrong reads of W\n", partial ? "" : "-plain", host);
  return host == 0 && cudaGetLastError() == cudaSuccess ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "roles") == 0) return RunRoles(true);
  if (argc > 1 && std::strcmp(argv[1], "roles-plain") == 0) return RunRoles(false);
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
