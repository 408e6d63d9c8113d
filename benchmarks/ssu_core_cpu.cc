// SelectiveStateUpdate's CPU math core alone (no ONNX Runtime): every head of one batch row against a memcpy
// of the state's bytes, interleaved, at the real widths of benchmarks/bench_selective_state_update_cpu.py.
// --threads N splits both over N threads as the ONNX Runtime kernel splits its heads (contiguous ranges of
// whole heads; the copy in as many contiguous parts), on threads that spin between calls, so that a call
// does not pay for waking them (on a host whose CPUs are taken by other jobs, spinning makes it worse).
// With --pipes (x86-64 with AVX-512 only): the throughput of the instructions a float16 state element
// needs, which bounds what the float16 update can reach.
//
//   cmake -S contrib_ops -B build/core -G Ninja -DMAMBAFUSE_CUDA=OFF && cmake --build build/core
//   g++ -O2 -std=c++17 -pthread -Icontrib_ops/cpu -o build/core/ssu_core_cpu benchmarks/ssu_core_cpu.cc
//       build/core/libmambafuse_cpu_core.a   (one command)
//   MAMBAFUSE_CPU_ISA=avx512 build/core/ssu_core_cpu [--cold] [--repeats 500] [--threads 1] [--pipes]
//
// --cold reads a 96 MiB buffer before every timed call (the kernel's and the copy's), so both start from
// memory. Cycles are core cycles, from a chain of dependent integer adds (one cycle each on x86-64 cores)
// timed in the same process: wrong where a virtual machine's clock or the core does otherwise (check the
// printed clock); on a shared host take the mins of several runs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "selective_state_update_impl.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Buffer {  // 64-byte aligned, as ONNX Runtime's allocator places tensors
  explicit Buffer(size_t bytes) : size(bytes), data(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64))) {}
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  size_t size;
  char* data;
};

uint16_t HalfBits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

void Fill(Buffer& b, bool half, std::mt19937& rng, float scale, float offset) {
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t n = b.size / (half ? 2 : 4);
  for (size_t i = 0; i < n; ++i) {
    const float v = scale * normal(rng) + offset;
    if (half) {
      const uint16_t h = HalfBits(v);
      std::memcpy(b.data + 2 * i, &h, 2);
    } else {
      std::memcpy(b.data + 4 * i, &v, 4);
    }
  }
}

#if defined(__x86_64__)
__attribute__((noinline)) void AddChain(long n) {
  long x = 0;
  for (long i = 0; i < n; ++i) {
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                 "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                 : "+r"(x));
  }
}

// Nanoseconds per core cycle: the fastest of 20 timings of 8 M dependent adds.
double NsPerCycle() {
  double best = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = Clock::now();
    AddChain(1000000);
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / 8e6);
  }
  return best;
}
#else
double NsPerCycle() { return 0.0; }
#endif

// Threads 1 .. n-1 spin on a generation counter; Run(f) calls f(0) here and f(t) on thread t, and returns
// when all are done.
class SpinPool {
 public:
  explicit SpinPool(int n) : n_(n) {
    for (int t = 1; t < n; ++t) {
      workers_.emplace_back([this, t] {
        uint64_t seen = 0;
        for (;;) {
          uint64_t g;
          while ((g = generation_.load(std::memory_order_acquire)) == seen) {
          }
          seen = g;
          if (stop_.load(std::memory_order_acquire)) return;
          (*task_)(t);
          done_.fetch_add(1, std::memory_order_acq_rel);
        }
      });
    }
  }
  ~SpinPool() {
    stop_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    for (std::thread& w : workers_) w.join();
  }
  SpinPool(const SpinPool&) = delete;
  SpinPool& operator=(const SpinPool&) = delete;
  int size() const { return n_; }
  void Run(const std::function<void(int)>& f) {
    task_ = &f;
    done_.store(0, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_acq_rel);
    f(0);
    while (done_.load(std::memory_order_acquire) != n_ - 1) {
    }
  }

 private:
  int n_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
};

struct Shape {
  const char* name;
  int64_t heads, head_dim, state_size, groups;
};

void RunShape(const Shape& s, bool half, bool cold, int repeats, double ns_per_cycle, SpinPool& pool) {
  using mambafuse::ElemType;
  const size_t es = half ? 2 : 4;
  const size_t elements = static_cast<size_t>(s.heads * s.head_dim * s.state_size);
  std::mt19937 rng(0);
  Buffer state(elements * es), x(s.heads * s.head_dim * es), dt(s.heads * es), dt_bias(s.heads * es),
      B(s.groups * s.state_size * es), C(s.groups * s.state_size * es), D(s.heads * es), out(s.heads * s.head_dim * es),
      present(elements * es), copy(elements * es), evict(cold ? size_t(96) << 20 : 64);
  Fill(state, half, rng, 0.5f, 0.f);
  Fill(x, half, rng, 0.5f, 0.f);
  Fill(dt, half, rng, 1.f, -2.f);
  Fill(dt_bias, half, rng, 0.5f, 0.f);
  Fill(B, half, rng, 0.5f, 0.f);
  Fill(C, half, rng, 0.5f, 0.f);
  Fill(D, half, rng, 0.5f, 0.f);
  std::memset(evict.data, 1, evict.size);
  std::vector<float> A(s.heads);
  std::uniform_real_distribution<float> uniform(-1.f, 2.f);
  for (float& a : A) a = -std::exp(uniform(rng));
  mambafuse::SelectiveStateUpdateCpuArgs a;
  a.state = state.data;
  a.x = x.data;
  a.dt = dt.data;
  a.dt_bias = dt_bias.data;
  a.A = A.data();
  a.B = B.data;
  a.C = C.data;
  a.D = D.data;
  a.out = out.data;
  a.present_state = present.data;
  a.type = a.state_type = a.d_type = half ? ElemType::kFloat16 : ElemType::kFloat;
  a.batch = 1;
  a.heads = s.heads;
  a.head_dim = s.head_dim;
  a.state_size = s.state_size;
  a.groups = s.groups;
  volatile uint64_t sink = 0;
  const auto flush = [&] {
    if (!cold) return;
    uint64_t sum = 0;
    for (size_t i = 0; i < evict.size; i += 64) sum += static_cast<unsigned char>(evict.data[i]);
    sink = sink + sum;
  };
  const int64_t threads = pool.size();
  const std::function<void(int)> update = [&](int t) {
    mambafuse::SelectiveStateUpdateCpu(a, s.heads * t / threads, s.heads * (t + 1) / threads);
  };
  const std::function<void(int)> copy_part = [&](int t) {
    const size_t lines = state.size / 64, first = lines * t / threads * 64, last = lines * (t + 1) / threads * 64;
    std::memcpy(copy.data + first, state.data + first, (t + 1 == threads ? state.size : last) - first);
  };
  std::vector<double> kernel, memcpy_us;
  for (int r = 0; r < repeats + 5; ++r) {
    flush();
    const auto t0 = Clock::now();
    pool.Run(update);
    const auto t1 = Clock::now();
    flush();
    const auto t2 = Clock::now();
    pool.Run(copy_part);
    const auto t3 = Clock::now();
    if (r < 5) continue;  // warm-up
    kernel.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    memcpy_us.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
  }
  std::sort(kernel.begin(), kernel.end());
  std::sort(memcpy_us.begin(), memcpy_us.end());
  const double vectors = static_cast<double>(elements) / 16.0;
  const auto cycles = [&](double us) { return ns_per_cycle > 0 ? us * 1e3 / ns_per_cycle / vectors : 0.0; };
  std::printf("| %s | %s | %lld | %s | %.1f | %.1f | %.1f | %.1f | %.0f%% | %.2f | %.2f |\n", s.name, half ? "fp16" : "fp32",
              static_cast<long long>(threads), cold ? "cold" : "warm", kernel[0], kernel[kernel.size() / 2], memcpy_us[0], memcpy_us[memcpy_us.size() / 2],
              100 * memcpy_us[0] / kernel[0], cycles(kernel[0]), cycles(memcpy_us[0]));
}

#if defined(__x86_64__)
// Eight independent instructions a line, sources never written: throughput, not latency.
#define MAMBAFUSE_X8(op) op(1) op(3) op(5) op(7) op(9) op(11) op(13) op(15)
#define PS2PH(d) "vcvtps2ph $8, %%zmm0, %%ymm" #d "\n\t"
#define PH2PS(d) "vcvtph2ps %%ymm2, %%zmm" #d "\n\t"
#define MULPS(d) "vmulps %%zmm4, %%zmm4, %%zmm" #d "\n\t"
#define CLOBBERS "xmm1", "xmm3", "xmm5", "xmm7", "xmm9", "xmm11", "xmm13", "xmm15"
// One 16-element float16 state vector's instructions (3 widenings: state, dBx, the readout's s; 2 roundings:
// dBx, the stored s; 3 multiplies, 2 adds), twice, independent.
#define F16_VECTOR(a, b, c, d)                                                                                   \
  "vcvtph2ps %%ymm2, %%zmm" a "\n\tvmulps %%zmm4, %%zmm4, %%zmm" b "\n\tvcvtps2ph $8, %%zmm0, %%ymm" c         \
  "\n\tvcvtph2ps %%ymm2, %%zmm" d "\n\tvaddps %%zmm6, %%zmm6, %%zmm" a "\n\tvcvtps2ph $8, %%zmm6, %%ymm" b     \
  "\n\tvcvtph2ps %%ymm2, %%zmm" c "\n\tvmulps %%zmm4, %%zmm6, %%zmm" d "\n\tvmulps %%zmm6, %%zmm4, %%zmm" a \
  "\n\tvaddps %%zmm4, %%zmm6, %%zmm" b "\n\t"

__attribute__((target("avx512f"), noinline)) void Ps2ph(long n) {
  for (long i = 0; i < n; ++i) asm volatile(MAMBAFUSE_X8(PS2PH)::: CLOBBERS);
}
__attribute__((target("avx512f"), noinline)) void Ph2ps(long n) {
  for (long i = 0; i < n; ++i) asm volatile(MAMBAFUSE_X8(PH2PS)::: CLOBBERS);
}
__attribute__((target("avx512f"), noinline)) void Mulps(long n) {
  for (long i = 0; i < n; ++i) asm volatile(MAMBAFUSE_X8(MULPS)::: CLOBBERS);
}
__attribute__((target("avx512f"), noinline)) void F16Vectors(long n) {
  for (long i = 0; i < n; ++i) asm volatile(F16_VECTOR("1", "3", "5", "7") F16_VECTOR("9", "11", "13", "15")::: CLOBBERS);
}

// Core cycles per call of f(n) / per_call, the fastest of 15.
double CyclesEach(void (*f)(long), double per_call, double ns_per_cycle) {
  double best = 1e30;
  const long n = 2000000;
  for (int r = 0; r < 15; ++r) {
    const auto t0 = Clock::now();
    f(n);
    best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
  }
  return best / ns_per_cycle / (n * per_call);
}

void Pipes(double ns_per_cycle) {
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("--pipes needs AVX-512\n");
    return;
  }
  std::printf("cycles per instruction (throughput): vcvtps2ph zmm %.2f, vcvtph2ps zmm %.2f, vmulps zmm %.2f\n",
              CyclesEach(&Ps2ph, 8, ns_per_cycle), CyclesEach(&Ph2ps, 8, ns_per_cycle),
              CyclesEach(&Mulps, 8, ns_per_cycle));
  std::printf("cycles per 16-element float16 state vector (5 conversions, 3 multiplies, 2 adds, no memory): %.2f\n",
              CyclesEach(&F16Vectors, 2, ns_per_cycle));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool cold = false, pipes = false;
  int repeats = 500, threads = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--cold") == 0) {
      cold = true;
    } else if (std::strcmp(argv[i], "--pipes") == 0) {
      pipes = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--repeats") == 0 && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--cold] [--repeats N] [--threads N] [--pipes]\n", argv[0]);
      return 2;
    }
  }
  const double ns_per_cycle = NsPerCycle();
  std::printf("core clock %.2f GHz (dependent adds); kernel variant %s; %d repeats, min and median in us\n",
              ns_per_cycle > 0 ? 1 / ns_per_cycle : 0.0, mambafuse::SelectedIsa(), repeats);
#if defined(__x86_64__)
  if (pipes) Pipes(ns_per_cycle);
#endif
  std::printf("\n| width | type | threads | caches | kernel min | median | memcpy min | median | share (min) | kernel cycles / 16 "
              "elements | memcpy cycles / 16 elements |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  SpinPool pool(threads);
  const Shape shapes[] = {{"Nemotron-H-8B", 128, 64, 128, 8}, {"Zamba2-1.2B", 64, 64, 64, 1}};
  for (const Shape& s : shapes) {
    for (bool half : {false, true}) RunShape(s, half, cold, repeats, ns_per_cycle, pool);
  }
  return 0;
}
