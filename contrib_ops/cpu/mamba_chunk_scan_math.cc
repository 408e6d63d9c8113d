// MambaChunkScan, the chunked SSD algorithm of Mamba-2 (docs/mamba_chunk_scan.md), compiled once per
// instruction-set level like the other math cores (CMake passes MAMBAFUSE_ISA_NS, the -m flags, and renames
// Eigen's namespace to Eigen_<level> so that no two levels share a symbol).
//
// Per token t, head h (group g), with d the time step at the contract's rounding points, a = A[h] d and
// u = x d (float32), the recurrence S_t = exp(a_t) S_{t-1} + u_t ⊗ B_t, y_t = S_t C_t + D x_t is evaluated a
// chunk of Q tokens at a time. Within a chunk, with cs the float32 cumulative sum of a from its first token:
//
//   y    = (exp(cs_l - cs_s) [s <= l] ∘ C Bᵀ) u  +  diag(exp(cs)) C S_prevᵀ  +  D x     (q x P)
//   S    = exp(cs_end) S_prev  +  (diag(exp(cs_end - cs)) u)ᵀ B                          (P x N)
//
// C Bᵀ (q x q) depends on the group only: it is formed once per (batch row, group, chunk) and serves every
// head of the work item. The state lives in final_state (float32, [P, N] or with state_layout 1 [N, P]: the same
// products on a column-major map) from the first chunk to the last; per
// thread the scratch is O(Q Q + Q N + Q P). The products are Eigen's (cache-blocked, register-blocked GEMM of
// the level's vector width; the intra-chunk one reads only the causal triangle).
//
// Constraints: T >= 1, H a multiple of G. Non-finite inputs and a positive A are not specified by the contract:
// they give whatever the float32 arithmetic gives (a NaN stays in the heads that read it).
// References: Dao and Gu, "Transformers are SSMs" (2024), section 6 (the SSD algorithm).
// GCC 12's AVX-512 intrinsics start from an undefined vector, which -Wmaybe-uninitialized reports once Eigen's
// packet functions are inlined here (the known false positive of the other cores; before any include, since the
// location reported is in the intrinsics' header).
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define EIGEN_MPL2_ONLY         // only Eigen's MPL2-licensed parts
#define EIGEN_DONT_PARALLELIZE  // ORT's pool splits the work; Eigen runs single-threaded in each item
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "decode_step_vector.h"
#include "mamba_chunk_scan_impl.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

constexpr float kSoftplusThreshold = 20.f;  // torch's: softplus(v) = v above it

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using RowArray = Eigen::Array<float, 1, Eigen::Dynamic>;
using MatrixMap = Eigen::Map<RowMatrix>;
using ColumnMap = Eigen::Map<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>>;
using StridedMap = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;

// `count` elements of type kHalf from `src` (from element `offset` on) widened to float32 in `dst`.
template <int kHalf>
void Widen(const void* src, int64_t offset, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + kWidth <= count; i += kWidth) StoreVector<kNone>(dst, i, LoadVector<kHalf>(src, offset + i));
  for (; i < count; ++i) dst[i] = LoadScalar<kHalf>(src, offset + i);
}

// Per work item: its batch row, group and heads [first_head, end_head).
struct Item {
  int64_t batch_row, group, first_head, end_head;
};

Item ItemOf(const MambaChunkScanCpuArgs& a, int64_t item) {
  const int64_t per_group = a.heads / a.groups;
  const int64_t blocks = (per_group + a.heads_per_block - 1) / a.heads_per_block;
  Item it;
  it.batch_row = item / (a.groups * blocks);
  it.group = item / blocks % a.groups;
  it.first_head = it.group * per_group + item % blocks * a.heads_per_block;
  it.end_head = std::min(it.first_head + a.heads_per_block, (it.group + 1) * per_group);
  return it;
}

// The time step of token row `token` (its (b, t) row times H, plus h) and head h at the contract's rounding
// points, in dt's type kDt (x's T, or float: no rounding); lo and hi are the limits rounded to kDt.
template <int kDt>
float TimeStep(const MambaChunkScanCpuArgs& a, int64_t token, int64_t h, float lo, float hi) {
  float step = LoadScalar<kDt>(a.dt, token);
  if (a.dt_bias != nullptr) step = RoundTo<kDt>(step + LoadScalar<kDt>(a.dt_bias, h));
  if (a.dt_softplus && !(step > kSoftplusThreshold)) step = RoundTo<kDt>(std::log1p(std::exp(step)));
  return std::min(std::max(step, lo), hi);
}

// kVectors vectors of columns [p, p + kVectors·kWidth) of a decode step's (N, P) state, every row n, with their
// outputs y in registers: S[n][cols] = decay S[n][cols] + B[n] u[cols], y[cols] += C[n] S[n][cols].
template <int kVectors>
MAMBAFUSE_INLINE void NpColumns(float* state, int64_t head_dim, int64_t n_state, int64_t p, VF decay,
                                const float* b_row, const float* c_row, const float* u, float* y) {
  VF acc[kVectors], uv[kVectors];
  for (int j = 0; j < kVectors; ++j) {
    acc[j] = LoadVector<kNone>(y, p + j * kWidth);
    uv[j] = LoadVector<kNone>(u, p + j * kWidth);
  }
  for (int64_t n = 0; n < n_state; ++n) {
    float* const row = state + n * head_dim + p;
    const VF bn = VF{} + b_row[n], cn = VF{} + c_row[n];
    for (int j = 0; j < kVectors; ++j) {
      const VF v = LoadVector<kNone>(row, j * kWidth) * decay + uv[j] * bn;
      StoreVector<kNone>(row, j * kWidth, v);
      acc[j] += v * cn;
    }
  }
  for (int j = 0; j < kVectors; ++j) StoreVector<kNone>(y, p + j * kWidth, acc[j]);
}

// One token (a decode step): the recurrence's step, S = exp(a) S + u ⊗ B and y = S C + D x, in one pass over each
// head's state (the chunked path's products would read it three times), vectorized along the state's rows. The
// state is already in final_state. Scratch: b_row and c_row N floats, u P floats.
template <int kT, int kD>
void DecodeStep(const MambaChunkScanCpuArgs& a, const Item& item, float lo, float hi, float* b_row, float* c_row,
                float* u) {
  const int64_t b = item.batch_row, heads = a.heads, head_dim = a.head_dim, n_state = a.state_size;
  const int64_t bc_row = (b * a.groups + item.group) * n_state;  // token 0 of batch row b
  Widen<kT>(a.B, bc_row, n_state, b_row);
  Widen<kT>(a.C, bc_row, n_state, c_row);
  for (int64_t h = item.first_head; h < item.end_head; ++h) {
    const int64_t token = b * heads + h;
    const float step = a.dt_type == ElemType::kFloat ? TimeStep<kNone>(a, token, h, lo, hi)
                                                     : TimeStep<kT>(a, token, h, lo, hi);
    const float decay = std::exp(a.A[h] * step);
    const VF decay_v = VF{} + decay;
    float* const y = a.out + token * head_dim;
    const float skip = a.D != nullptr ? LoadScalar<kD>(a.D, h) : 0.f;
    for (int64_t p = 0; p < head_dim; ++p) {
      const float x = LoadScalar<kT>(a.x, token * head_dim + p);
      u[p] = x * step;
      y[p] = a.D != nullptr ? x * skip : 0.f;
    }
    float* const state = a.final_state + token * head_dim * n_state;
    if (a.state_np) {  // rows n of P: S[n] = exp(a) S[n] + B[n] u, y += C[n] S[n], by blocks of P's columns
      int64_t p = 0;
      for (; p + 4 * kWidth <= head_dim; p += 4 * kWidth) {
        NpColumns<4>(state, head_dim, n_state, p, decay_v, b_row, c_row, u, y);
      }
      for (; p + kWidth <= head_dim; p += kWidth) {
        NpColumns<1>(state, head_dim, n_state, p, decay_v, b_row, c_row, u, y);
      }
      for (; p < head_dim; ++p) {
        for (int64_t n = 0; n < n_state; ++n) {
          float* const s = state + n * head_dim + p;
          *s = *s * decay + u[p] * b_row[n];
          y[p] += *s * c_row[n];
        }
      }
    } else {  // rows p of N: S[p] = exp(a) S[p] + u[p] B, y[p] += S[p] · C
      for (int64_t p = 0; p < head_dim; ++p) {
        float* const row = state + p * n_state;
        const VF u_v = VF{} + u[p];
        VF acc = VF{};
        int64_t n = 0;
        for (; n + kWidth <= n_state; n += kWidth) {
          const VF v = LoadVector<kNone>(row, n) * decay_v + LoadVector<kNone>(b_row, n) * u_v;
          StoreVector<kNone>(row, n, v);
          acc += v * LoadVector<kNone>(c_row, n);
        }
        float sum = SumLanes(acc);
        for (; n < n_state; ++n) {
          const float v = row[n] * decay + b_row[n] * u[p];
          row[n] = v;
          sum += v * c_row[n];
        }
        y[p] += sum;
      }
    }
  }
}

template <int kT, int kD, int kS>
void RunItems(const MambaChunkScanCpuArgs& a, int64_t first_item, int64_t last_item) {
  const int64_t length = a.length, heads = a.heads, head_dim = a.head_dim, n_state = a.state_size;
  const int64_t groups = a.groups;
  const int64_t q_max = std::min(a.chunk_size, length);
  const bool dt_float = a.dt_type == ElemType::kFloat;  // else x's T
  const float lo = dt_float ? a.dt_min : RoundTo<kT>(a.dt_min);  // the limits in dt's type
  const float hi = dt_float ? a.dt_max : RoundTo<kT>(a.dt_max);
  const int64_t state_elements = head_dim * n_state;
  // Scratch of one thread, for the whole range of items.
  RowMatrix b_chunk(q_max, n_state), c_chunk(q_max, n_state), c_scaled(q_max, n_state);
  RowMatrix scores(q_max, q_max), mixed(q_max, q_max);
  RowMatrix u(q_max, head_dim), u_to_end(q_max, head_dim), x_row(1, head_dim);
  RowArray cs(q_max), d(q_max), decay(q_max);
  for (int64_t index = first_item; index < last_item; ++index) {
    const Item item = ItemOf(a, index);
    const int64_t b = item.batch_row;
    for (int64_t h = item.first_head; h < item.end_head; ++h) {
      float* const state = a.final_state + (b * heads + h) * state_elements;
      if (a.initial_state != nullptr) {
        Widen<kS>(a.initial_state, (b * heads + h) * state_elements, state_elements, state);
      } else {
        std::fill(state, state + state_elements, 0.f);
      }
    }
    if (n_state == 0 || head_dim == 0) {
      // No state (N = 0): the output is the skip alone. Eigen's blocked products divide by an empty inner
      // dimension, so they are not reached with one.
      for (int64_t t = 0; t < length && head_dim > 0; ++t) {
        for (int64_t h = item.first_head; h < item.end_head; ++h) {
          const int64_t row = ((b * length + t) * heads + h) * head_dim;
          Widen<kT>(a.x, row, head_dim, x_row.data());
          const float skip = a.D != nullptr ? LoadScalar<kD>(a.D, h) : 0.f;
          for (int64_t p = 0; p < head_dim; ++p) a.out[row + p] = x_row(0, p) * skip;
        }
      }
      continue;
    }
    if (length == 1) {
      DecodeStep<kT, kD>(a, item, lo, hi, b_chunk.data(), c_chunk.data(), u.data());
      continue;
    }
    for (int64_t t0 = 0; t0 < length; t0 += q_max) {
      const int64_t q = std::min(q_max, length - t0);
      for (int64_t r = 0; r < q; ++r) {
        const int64_t row = ((b * length + t0 + r) * groups + item.group) * n_state;
        Widen<kT>(a.B, row, n_state, b_chunk.row(r).data());
        Widen<kT>(a.C, row, n_state, c_chunk.row(r).data());
      }
      const auto b_q = b_chunk.topRows(q);
      const auto c_q = c_chunk.topRows(q);
      // C Bᵀ of the chunk: only its causal triangle (s <= l) is read.
      scores.topLeftCorner(q, q).template triangularView<Eigen::Lower>() = c_q * b_q.transpose();
      for (int64_t h = item.first_head; h < item.end_head; ++h) {
        // The time step at the contract's rounding points, and the decay's cumulative sum in float32.
        float cumulative = 0.f;
        for (int64_t r = 0; r < q; ++r) {
          const int64_t token = (b * length + t0 + r) * heads + h;
          const float step = dt_float ? TimeStep<kNone>(a, token, h, lo, hi) : TimeStep<kT>(a, token, h, lo, hi);
          d(r) = step;
          cumulative += a.A[h] * step;
          cs(r) = cumulative;
        }
        // u = x d; the output rows start as the skip D x (float32), or zeros.
        const float skip = a.D != nullptr ? LoadScalar<kD>(a.D, h) : 0.f;
        float* const out_first = a.out + ((b * length + t0) * heads + h) * head_dim;
        StridedMap y(out_first, q, head_dim, Eigen::OuterStride<>(heads * head_dim));
        for (int64_t r = 0; r < q; ++r) {
          Widen<kT>(a.x, ((b * length + t0 + r) * heads + h) * head_dim, head_dim, x_row.data());
          u.row(r) = x_row * d(r);
          if (a.D != nullptr) {
            y.row(r) = x_row * skip;
          } else {
            y.row(r).setZero();
          }
        }
        const auto u_q = u.topRows(q);
        // Intra-chunk: decay exp(cs_l - cs_s) on the causal triangle of C Bᵀ.
        for (int64_t l = 0; l < q; ++l) {
          mixed.row(l).head(l + 1).array() = (cs(l) - cs.head(l + 1)).exp() * scores.row(l).head(l + 1).array();
        }
        y.noalias() += mixed.topLeftCorner(q, q).template triangularView<Eigen::Lower>() * u_q;
        // (exp evaluated into an array first: a diagonal of an expression would evaluate it per coefficient.)
        decay.head(q) = cs.head(q).exp();
        for (int64_t r = 0; r < q; ++r) c_scaled.row(r) = c_q.row(r) * decay(r);
        const float to_end = cs(q - 1);
        // Inter-chunk: the carried state read out by C, decayed to each token; then the chunk's state, the carried
        // one decayed over the chunk plus each token's u B decayed to its end.
        const auto carry = [&](auto state) {
          y.noalias() += c_scaled.topRows(q) * state.transpose();
          decay.head(q) = (to_end - cs.head(q)).exp();
          for (int64_t r = 0; r < q; ++r) u_to_end.row(r) = u_q.row(r) * decay(r);
          state *= std::exp(to_end);
          state.noalias() += u_to_end.topRows(q).transpose() * b_q;
        };
        // The state as P x N: row-major, or column-major over state_layout 1's [N, P] rows.
        float* const state = a.final_state + (b * heads + h) * state_elements;
        if (a.state_np) {
          carry(ColumnMap(state, head_dim, n_state));
        } else {
          carry(MatrixMap(state, head_dim, n_state));
        }
      }
    }
  }
}

template <int kT, int kD>
void WithState(const MambaChunkScanCpuArgs& a, int64_t first, int64_t last) {
  if (a.state_type == ElemType::kFloat) {
    RunItems<kT, kD, kNone>(a, first, last);
  } else {
    RunItems<kT, kD, kT>(a, first, last);
  }
}

template <int kT>
void WithD(const MambaChunkScanCpuArgs& a, int64_t first, int64_t last) {
  if (a.d_type == ElemType::kFloat) {
    WithState<kT, kNone>(a, first, last);
  } else {
    WithState<kT, kT>(a, first, last);
  }
}

}  // namespace

void MambaChunkScanItems(const MambaChunkScanCpuArgs& a, int64_t first_item, int64_t last_item) {
  switch (a.type) {
    case ElemType::kFloat16: WithD<kF16>(a, first_item, last_item); break;
    case ElemType::kBFloat16: WithD<kBF16>(a, first_item, last_item); break;
    default: WithD<kNone>(a, first_item, last_item); break;
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
