// SelectiveStateUpdate, the per-head math (docs/selective_state_update.md), compiled once per
// instruction-set level like the gated norm's core (CMake passes MAMBAFUSE_ISA_NS and the -m flags).
//
//   d   = softplus(round_T(dt + dt_bias)) rounded to T       (once per (b, h): A is per head)
//   dA  = exp(d * A[h])                                      (once per (b, h))
//   dB  = round_T(d * B[b, g, n])                            (once per (b, h), N values)
//   s   = round_S(state * dA + round_T(dB * x[p]))           (each state element read once, written once)
//   out = round_T(sum_n round_T(s) C[b, g, n]) (+ round_T(x D))
//
// The state update is bandwidth-bound (Nemotron-H-8B: 128 x 64 x 128 float32 = 4 MB read and 4 MB written
// per layer and token), so the loop over n streams the state once, in vectors of the level's width, and
// everything per head is computed before it. This file is compiled with -ffp-contract=off at every level
// (CMakeLists.txt), so state * dA + dBx is two roundings everywhere and present_state has the same bits at
// every level. Per row (b, h, p) only the readout's lane sum and the output's scalar work remain: at
// Zamba2-1.2B width (N = 64) a row is 4 AVX-512 vectors, so that sum runs in registers (SumLanes).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "decode_step_vector.h"
#include "selective_state_update_impl.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

constexpr float kSoftplusThreshold = 20.f;  // torch's: softplus(v) = v above it
// A float32 present_state is written with streaming stores (decode_step_vector.h's Put) from this size up: a
// real model's per-layer state (Zamba2-1.2B: 1 MiB, Nemotron-H-8B: 4 MiB) is read back only at the next
// token, after gigabytes of weights; a small model's may still be in a core's cache by then. Measured with
// benchmarks/ssu_core_cpu --cold on one AMD EPYC core: Nemotron-H-8B 88 % -> 106-122 % of a memcpy of the
// same bytes, Zamba2-1.2B 79-83 % -> 96 %. A half state is bound by its conversions instead (see
// benchmarks/RESULTS.md), and streaming it measured no gain (Nemotron-H-8B 136-159 us -> 154-162 us), so it
// stays cached.
constexpr int64_t kStreamBytes = int64_t{256} << 10;

template <int kT, int kS, int kD, bool kStream>
void RunHeads(const SelectiveStateUpdateCpuArgs& a, int64_t first_item, int64_t last_item) {
  const int64_t heads = a.heads, head_dim = a.head_dim, n_state = a.state_size;
  const int64_t heads_per_group = heads / a.groups;
  // The pointers in locals: the stores through present_state may alias `a` as far as the compiler knows,
  // which would reload them for every vector.
  const void* const state = a.state;
  const void* const x = a.x;
  const void* const B = a.B;
  const void* const C = a.C;
  const void* const D = a.D;
  void* const present_state = a.present_state;
  void* const out = a.out;
  // dB (rounded to T) and C widened to float, per head: read P times each in the loop over p.
  std::vector<float> scratch(2 * static_cast<size_t>(n_state));
  float* const dB = scratch.data();
  float* const c = dB + n_state;
  const int64_t n_vector_end = n_state - n_state % kWidth;
  for (int64_t item = first_item; item < last_item; ++item) {
    const int64_t b = item / heads, h = item % heads, g = h / heads_per_group;
    float d = LoadScalar<kT>(a.dt, item);
    if (a.dt_bias != nullptr) d = RoundTo<kT>(d + LoadScalar<kT>(a.dt_bias, h));
    if (a.dt_softplus && !(d > kSoftplusThreshold)) d = RoundTo<kT>(std::log1p(std::exp(d)));
    const float dA = std::exp(d * a.A[h]);
    const int64_t group_base = (b * a.groups + g) * n_state;
    const VF d_v = VF{} + d;
    for (int64_t n = 0; n < n_vector_end; n += kWidth) {
      StoreVector<kNone>(dB, n, RoundTo<kT>(d_v * LoadVector<kT>(B, group_base + n)));
      StoreVector<kNone>(c, n, LoadVector<kT>(C, group_base + n));
    }
    for (int64_t n = n_vector_end; n < n_state; ++n) {
      dB[n] = RoundTo<kT>(d * LoadScalar<kT>(B, group_base + n));
      c[n] = LoadScalar<kT>(C, group_base + n);
    }
    const float d_skip = D != nullptr ? LoadScalar<kD>(D, h) : 0.f;
    const VF dA_v = VF{} + dA;
    // Row p's state update and its readout's sum over n, before the rounding to T.
    const auto row_sum = [&](int64_t row, float xp) {
      const int64_t base = row * n_state;
      const VF x_v = VF{} + xp;
      VF acc = VF{};
      for (int64_t n = 0; n < n_vector_end; n += kWidth) {
        const VF dbx = RoundTo<kT>(LoadVector<kNone>(dB, n) * x_v);
        const VF s =
            StoreRounded<kS, kStream>(present_state, base + n, LoadVector<kS>(state, base + n) * dA_v + dbx);
        acc += (kS == kT ? s : RoundTo<kT>(s)) * LoadVector<kNone>(c, n);  // s is in T already if S is T
      }
      float tail = 0.f;
      for (int64_t n = n_vector_end; n < n_state; ++n) {
        const float dbx = RoundTo<kT>(dB[n] * xp);
        const float s = RoundTo<kS>(LoadScalar<kS>(state, base + n) * dA + dbx);
        StoreScalar<kS>(present_state, base + n, s);
        tail += RoundTo<kT>(s) * c[n];
      }
      return SumLanes(acc) + tail;
    };
    // The output's roundings and skip for kWidth rows at once: per row they were as many scalar
    // conversions as a short row (N = 64) has vector ones.
    const int64_t first_row = item * head_dim;
    int64_t p = 0;
    for (; p + kWidth <= head_dim; p += kWidth) {
      const VF x_v = LoadVector<kT>(x, first_row + p);
      VF sums;
      for (int r = 0; r < kWidth; ++r) sums[r] = row_sum(first_row + p + r, x_v[r]);
      VF y = RoundTo<kT>(sums);
      if (D != nullptr) y = RoundTo<kT>(y + RoundTo<kT>(x_v * d_skip));
      StoreVector<kT>(out, first_row + p, y);
    }
    for (; p < head_dim; ++p) {
      const float xp = LoadScalar<kT>(x, first_row + p);
      float y = RoundTo<kT>(row_sum(first_row + p, xp));
      if (D != nullptr) y = RoundTo<kT>(y + RoundTo<kT>(xp * d_skip));
      StoreScalar<kT>(out, first_row + p, y);
    }
  }
  if constexpr (kStream) StreamFence();
}

// Whether present_state is written with streaming stores: a float32 state of kStreamBytes or more, every
// vector store aligned to its size (the tensor's address, and rows of whole vectors), a level with such a store.
// MAMBAFUSE_SSU_STORES=stream|cached overrides the size rule (tests run both paths; benchmarks compare).
template <int kS>
bool StreamsPresent(const SelectiveStateUpdateCpuArgs& a) {
  static_assert(kS == kNone, "only a float32 state streams");
  constexpr int kBytes = 4 * kWidth;
  if (!StreamsVector(kBytes) || a.state_size % kWidth != 0) return false;
  if (reinterpret_cast<uintptr_t>(a.present_state) % kBytes != 0) return false;
  const char* forced = std::getenv("MAMBAFUSE_SSU_STORES");  // read per call: tests switch it in-process
  if (forced != nullptr && std::strcmp(forced, "stream") == 0) return true;
  if (forced != nullptr && std::strcmp(forced, "cached") == 0) return false;
  return a.batch * a.heads * a.head_dim * a.state_size * 4 >= kStreamBytes;
}

template <int kT, int kS, int kD>
void WithStores(const SelectiveStateUpdateCpuArgs& a, int64_t first, int64_t last) {
  if constexpr (kS == kNone) {
    if (StreamsPresent<kS>(a)) return RunHeads<kT, kS, kD, true>(a, first, last);
  }
  RunHeads<kT, kS, kD, false>(a, first, last);
}

template <int kT, int kS>
void WithD(const SelectiveStateUpdateCpuArgs& a, int64_t first, int64_t last) {
  if (a.d_type == ElemType::kFloat) {
    WithStores<kT, kS, kNone>(a, first, last);
  } else {
    WithStores<kT, kS, kT>(a, first, last);
  }
}

template <int kT>
void WithState(const SelectiveStateUpdateCpuArgs& a, int64_t first, int64_t last) {
  if (a.state_type == ElemType::kFloat) {
    WithD<kT, kNone>(a, first, last);
  } else {
    WithD<kT, kT>(a, first, last);
  }
}

}  // namespace

void SelectiveStateUpdateItems(const SelectiveStateUpdateCpuArgs& a, int64_t first_item, int64_t last_item) {
  switch (a.type) {
    case ElemType::kFloat16: WithState<kF16>(a, first_item, last_item); break;
    case ElemType::kBFloat16: WithState<kBF16>(a, first_item, last_item); break;
    default: WithState<kNone>(a, first_item, last_item); break;
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
