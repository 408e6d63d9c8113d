// The throughput floor of the CPU kernel's instruction mix (x86, AVX-512 and AVX2): how fast this core runs
// the instructions the interleaved loop (FusedPass in contrib_ops/cpu/gated_group_rms_norm_math.cc) issues
// for one vector, when none of them waits on another. The real loop cannot beat it; the gap between the two
// is what its dependency chains cost.
//
//   g++ -O2 -mavx512f -mavx512dq benchmarks/pipe_floor.cc -o /tmp/pipe_floor && taskset -c 0 /tmp/pipe_floor
//
// (An argument sets the loop iterations per run, 1000000 by default.)
//
// Each test repeats one vector's instructions 16 times per loop iteration, every result in a register that
// no instruction of the same copy reads (the loads read a small buffer in L1). Reported: ns per vector
// (lowest of 5 runs), and a 7680-wide float32 row's floor (480 vectors of 16, 960 of 8).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

alignas(64) float g_in[64];
alignas(64) float g_out[64];

// The AVX-512 loop's instructions for one vector of 16: the gate pass (y z, k, its rounding, the largest
// |k|, s, the table lookup and the exponent, q, T s, 1 + T, the denominator, the division, the sum of
// squares, the zero/subnormal probe, h stored) and the previous group's norm pass (h and w loaded, two
// multiplies, the output stored).
#define MAMBAFUSE_GATE_512(DIVIDE)                                                                   \
  "vmovups (%0), %%zmm0\n vmovups 64(%0), %%zmm1\n"                                                  \
  "vmulps %%zmm0, %%zmm1, %%zmm2\n vfmadd213ps %%zmm20, %%zmm21, %%zmm3\n"                           \
  "vaddps %%zmm22, %%zmm3, %%zmm4\n vrangeps $11, %%zmm4, %%zmm23, %%zmm5\n"                         \
  "vfmadd213ps %%zmm20, %%zmm21, %%zmm6\n vmovdqa32 %%zmm24, %%zmm7\n vpermt2d %%zmm25, %%zmm1, %%zmm7\n" \
  "vpslld $18, %%zmm0, %%zmm8\n vpaddd %%zmm0, %%zmm1, %%zmm9\n"                                     \
  "vfmadd213ps %%zmm20, %%zmm21, %%zmm10\n vmulps %%zmm0, %%zmm1, %%zmm11\n"                         \
  "vaddps %%zmm22, %%zmm1, %%zmm12\n vfmadd213ps %%zmm20, %%zmm21, %%zmm13\n"                        \
  DIVIDE " %%zmm0, %%zmm1, %%zmm14\n vfmadd213ps %%zmm20, %%zmm21, %%zmm15\n"                        \
  "vorps %%zmm0, %%zmm23, %%zmm16\n vpminud %%zmm0, %%zmm1, %%zmm17\n vmovups %%zmm2, (%1)\n"        \
  "vmovups 128(%0), %%zmm18\n vmulps %%zmm20, %%zmm18, %%zmm19\n vmulps 192(%0), %%zmm19, %%zmm26\n" \
  "vmovups %%zmm26, 64(%1)\n"

// AVX2, one vector of 8: the same gate pass with the table in one vector (vpermd), the largest |k| as
// and + max, and the norm pass.
#define MAMBAFUSE_GATE_256(DIVIDE)                                                               \
  "vmovups (%0), %%ymm0\n vmovups 32(%0), %%ymm1\n"                                              \
  "vmulps %%ymm0, %%ymm1, %%ymm2\n vfmadd213ps %%ymm14, %%ymm15, %%ymm3\n"                       \
  "vaddps %%ymm13, %%ymm3, %%ymm4\n vandps %%ymm13, %%ymm4, %%ymm5\n vmaxps %%ymm5, %%ymm13, %%ymm5\n" \
  "vfmadd213ps %%ymm14, %%ymm15, %%ymm6\n vpermd %%ymm12, %%ymm1, %%ymm7\n"                      \
  "vpslld $20, %%ymm0, %%ymm8\n vpaddd %%ymm0, %%ymm1, %%ymm9\n"                                 \
  "vfmadd213ps %%ymm14, %%ymm15, %%ymm10\n vfmadd213ps %%ymm14, %%ymm15, %%ymm10\n"              \
  "vmulps %%ymm0, %%ymm1, %%ymm11\n vaddps %%ymm13, %%ymm1, %%ymm4\n"                            \
  "vfmadd213ps %%ymm14, %%ymm15, %%ymm3\n" DIVIDE " %%ymm0, %%ymm1, %%ymm5\n"                     \
  "vfmadd213ps %%ymm14, %%ymm15, %%ymm6\n vorps %%ymm0, %%ymm13, %%ymm7\n"                       \
  "vpminud %%ymm0, %%ymm1, %%ymm8\n vmovups %%ymm2, (%1)\n"                                      \
  "vmovups 64(%0), %%ymm9\n vmulps %%ymm14, %%ymm9, %%ymm11\n vmulps 96(%0), %%ymm11, %%ymm2\n"  \
  "vmovups %%ymm2, 32(%1)\n"

#define MAMBAFUSE_CLOBBER_512                                                                             \
  "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
      "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm26"
#define MAMBAFUSE_CLOBBER_256                                                                             \
  "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11"

enum class Mix { kFma8, kGate512, kGate512Multiply, kGate256, kGate256Multiply };

template <Mix kMix>
void Body() {
  if constexpr (kMix == Mix::kFma8) {
    __asm__ volatile(
        ".rept 16\n"
        "vmulps %%zmm20, %%zmm21, %%zmm2\n vfmadd213ps %%zmm20, %%zmm21, %%zmm3\n"
        "vfmadd213ps %%zmm20, %%zmm21, %%zmm4\n vfmadd213ps %%zmm20, %%zmm21, %%zmm5\n"
        "vmulps %%zmm20, %%zmm21, %%zmm6\n vfmadd213ps %%zmm20, %%zmm21, %%zmm7\n"
        "vmulps %%zmm20, %%zmm21, %%zmm8\n vfmadd213ps %%zmm20, %%zmm21, %%zmm9\n"
        ".endr\n" ::
            : "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9");
  } else if constexpr (kMix == Mix::kGate512) {
    __asm__ volatile(".rept 16\n" MAMBAFUSE_GATE_512("vdivps") ".endr\n" ::"r"(g_in), "r"(g_out) : MAMBAFUSE_CLOBBER_512);
  } else if constexpr (kMix == Mix::kGate512Multiply) {
    __asm__ volatile(".rept 16\n" MAMBAFUSE_GATE_512("vmulps") ".endr\n" ::"r"(g_in), "r"(g_out) : MAMBAFUSE_CLOBBER_512);
  } else if constexpr (kMix == Mix::kGate256) {
    __asm__ volatile(".rept 16\n" MAMBAFUSE_GATE_256("vdivps") ".endr\n" ::"r"(g_in), "r"(g_out) : MAMBAFUSE_CLOBBER_256);
  } else {
    __asm__ volatile(".rept 16\n" MAMBAFUSE_GATE_256("vmulps") ".endr\n" ::"r"(g_in), "r"(g_out) : MAMBAFUSE_CLOBBER_256);
  }
}

// ns per vector, lowest of 5 runs of `iterations` loop iterations.
template <Mix kMix>
double NsPerVector(long iterations) {
  double best = 1e30;
  for (int run = 0; run < 5; ++run) {
    const auto start = std::chrono::steady_clock::now();
    for (long i = 0; i < iterations; ++i) Body<kMix>();
    const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
    best = std::min(best, elapsed.count() / (16.0 * static_cast<double>(iterations)));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 0; i < 64; ++i) g_in[i] = 1.0f + static_cast<float>(i) * 1e-3f;
  // Constants the tests read (finite, normal: no instruction takes a microcode assist).
  __asm__ volatile(
      "vbroadcastss %0, %%zmm20\n vbroadcastss %0, %%zmm21\n vbroadcastss %0, %%zmm22\n vbroadcastss %0, %%zmm23\n"
      "vbroadcastss %0, %%zmm24\n vbroadcastss %0, %%zmm25\n"
      "vbroadcastss %0, %%ymm12\n vbroadcastss %0, %%ymm13\n vbroadcastss %0, %%ymm14\n vbroadcastss %0, %%ymm15\n" ::"m"(
          g_in[3])
      : "xmm12", "xmm13", "xmm14", "xmm15", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24", "xmm25");
  const long kIterations = argc > 1 ? std::max(1L, std::atol(argv[1])) : 1000000;
  const double fma8 = NsPerVector<Mix::kFma8>(kIterations);
  const double gate512 = NsPerVector<Mix::kGate512>(kIterations);
  const double gate512_mul = NsPerVector<Mix::kGate512Multiply>(kIterations);
  const double gate256 = NsPerVector<Mix::kGate256>(kIterations);
  const double gate256_mul = NsPerVector<Mix::kGate256Multiply>(kIterations);
  std::printf("8 independent 512-bit multiply/FMA:              %.3f ns (%.2f a ns)\n", fma8, 8.0 / fma8);
  std::printf("AVX-512 loop, one vector of 16, no chains:       %.3f ns -> 7680-wide row >= %.2f us\n", gate512,
              480 * gate512 / 1000);
  std::printf("  the same with a multiply for the division:     %.3f ns (the division costs %.3f ns)\n", gate512_mul,
              gate512 - gate512_mul);
  std::printf("AVX2 loop, one vector of 8, no chains:           %.3f ns -> 7680-wide row >= %.2f us\n", gate256,
              960 * gate256 / 1000);
  std::printf("  the same with a multiply for the division:     %.3f ns (the division costs %.3f ns)\n", gate256_mul,
              gate256 - gate256_mul);
}
