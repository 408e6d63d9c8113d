// CausalConv1d, the prompt's depthwise causal conv (docs/causal_conv1d.md), compiled once per instruction-set level
// (CMake passes MAMBAFUSE_ISA_NS and the -m flags).
//
//   window[b, c] = [initial_state[b, c, 0..S) (or zeros) | x[b, c, 0..L)]
//   v[t]         = round_T(sum_k w[c, k] window[S - K + 1 + t + k] + bias[c])        float32 sum
//   y[t]         = silu ? round_T(v round_T(sigmoid(v))) : v
//   (round_once: y[t] = round_T(silu ? a sigmoid(a) : a), a the float32 sum)
//   final_state  = window[L .. S + L)
//
// channels_last (x [B, L, C], the in_proj's layout): an item is 64 tokens of one batch row, every channel; the
// channels are the vector lanes (the weight widened to float [K, C], once per kernel where it is constant:
// causal_conv1d.h), the K taps read rows t - K + 1 .. t of x, or of the initial state's last K - 1 columns
// (gathered once per item into [K - 1, C]) before the prompt. channels-first (x [B, C, L]): an item is one channel of one batch row; the tokens are the lanes. The
// item that owns a row's last tokens writes its final state.
#include <cmath>
#include <cstdint>
#include <vector>

#include "causal_conv1d_impl.h"
#include "decode_step_vector.h"
#include "sigmoid_vector.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

template <int kT>
MAMBAFUSE_INLINE VF Activate(VF acc, bool silu, bool round_once) {
  if (round_once) return RoundTo<kT>(silu ? acc * Sigmoid(acc) : acc);  // float32 throughout, one rounding
  const VF v = RoundTo<kT>(acc);
  return silu ? RoundTo<kT>(v * RoundTo<kT>(Sigmoid(v))) : v;
}

// x [B, L, C]: tokens [t0, t1) of batch row b, every channel.
template <int kT>
void ChannelsLast(const CausalConv1dCpuArgs& a, int64_t b, int64_t t0, int64_t t1) {
  const int64_t channels = a.channels, length = a.length, width = a.width, state_len = a.state_len;
  const int64_t history = width - 1;  // columns before the prompt that outputs read
  // The initial state's last K - 1 columns as rows [K - 1, C] (zeros without a state), for tokens t < K - 1.
  std::vector<float> before;
  if (t0 < history) {
    before.assign(static_cast<size_t>(history * channels), 0.f);
    if (a.initial_state != nullptr) {
      for (int64_t c = 0; c < channels; ++c) {
        for (int64_t j = 0; j < history; ++j) {
          before[j * channels + c] = LoadScalar<kT>(a.initial_state, (b * channels + c) * state_len + state_len - history + j);
        }
      }
    }
  }
  const int64_t row = b * length;
  const int64_t vector_end = channels / kWidth * kWidth;
  for (int64_t t = t0; t < t1; ++t) {
    // the K taps' sources: a row of x, or of `before`
    const float* tap_before[kCausalConv1dMaxWidth];
    int64_t tap_row[kCausalConv1dMaxWidth];
    for (int64_t k = 0; k < width; ++k) {
      const int64_t source = t - history + k;
      tap_before[k] = source < 0 ? before.data() + (source + history) * channels : nullptr;
      tap_row[k] = (row + source) * channels;
    }
    for (int64_t c = 0; c < vector_end; c += kWidth) {
      VF acc = LoadVector<kNone>(a.bias_c, c);
      for (int64_t k = 0; k < width; ++k) {
        const VF w = LoadVector<kNone>(a.weight_kc, k * channels + c);
        const VF v = tap_before[k] != nullptr ? LoadVector<kNone>(tap_before[k], c) : LoadVector<kT>(a.x, tap_row[k] + c);
        acc += w * v;
      }
      StoreVector<kT>(a.y, (row + t) * channels + c, Activate<kT>(acc, a.silu, a.round_once));
    }
    for (int64_t c = vector_end; c < channels; ++c) {
      float acc = a.bias_c[c];
      for (int64_t k = 0; k < width; ++k) {
        const float v = tap_before[k] != nullptr ? tap_before[k][c] : LoadScalar<kT>(a.x, tap_row[k] + c);
        acc += a.weight_kc[k * channels + c] * v;
      }
      StoreScalar<kT>(a.y, (row + t) * channels + c, Activate<kT>(VF{} + acc, a.silu, a.round_once)[0]);
    }
  }
  if (t1 == length) {  // the final state: the window's last S columns, channels-first
    for (int64_t c = 0; c < channels; ++c) {
      for (int64_t j = 0; j < state_len; ++j) {
        const int64_t column = length + j;  // in the window [state (S) | x (L)]
        float value = 0.f;
        if (column >= state_len) {
          value = LoadScalar<kT>(a.x, (row + column - state_len) * channels + c);
        } else if (a.initial_state != nullptr) {
          value = LoadScalar<kT>(a.initial_state, (b * channels + c) * state_len + column);
        }
        StoreScalar<kT>(a.final_state, (b * channels + c) * state_len + j, value);
      }
    }
  }
}

// x [B, C, L]: the whole prompt of channel c of batch row b.
template <int kT>
void ChannelsFirst(const CausalConv1dCpuArgs& a, int64_t item) {
  const int64_t c = item % a.channels, length = a.length, width = a.width, state_len = a.state_len;
  const int64_t history = width - 1;
  const int64_t base = item * length;
  float w[kCausalConv1dMaxWidth];
  for (int64_t k = 0; k < width; ++k) w[k] = LoadScalar<kT>(a.weight, c * width + k);
  const float bias = a.bias != nullptr ? LoadScalar<kT>(a.bias, c) : 0.f;
  const auto window = [&](int64_t column) {  // column of the window [state (S) | x (L)]
    if (column >= state_len) return LoadScalar<kT>(a.x, base + column - state_len);
    return a.initial_state != nullptr ? LoadScalar<kT>(a.initial_state, item * state_len + column) : 0.f;
  };
  // tokens whose taps reach into the state, one at a time; then vectors of tokens read only x
  const int64_t head = history < length ? history : length;
  for (int64_t t = 0; t < head; ++t) {
    float acc = bias;
    for (int64_t k = 0; k < width; ++k) acc += w[k] * window(state_len - history + t + k);
    StoreScalar<kT>(a.y, base + t, Activate<kT>(VF{} + acc, a.silu, a.round_once)[0]);
  }
  int64_t t = head;
  for (; t + kWidth <= length; t += kWidth) {
    VF acc = VF{} + bias;
    for (int64_t k = 0; k < width; ++k) acc += w[k] * LoadVector<kT>(a.x, base + t - history + k);
    StoreVector<kT>(a.y, base + t, Activate<kT>(acc, a.silu, a.round_once));
  }
  for (; t < length; ++t) {
    float acc = bias;
    for (int64_t k = 0; k < width; ++k) acc += w[k] * LoadScalar<kT>(a.x, base + t - history + k);
    StoreScalar<kT>(a.y, base + t, Activate<kT>(VF{} + acc, a.silu, a.round_once)[0]);
  }
  for (int64_t j = 0; j < state_len; ++j) StoreScalar<kT>(a.final_state, item * state_len + j, window(length + j));
}

template <int kT>
void Run(const CausalConv1dCpuArgs& a, int64_t first_item, int64_t last_item) {
  if (!a.channels_last) {
    for (int64_t item = first_item; item < last_item; ++item) ChannelsFirst<kT>(a, item);
    return;
  }
  const int64_t blocks = (a.length + kCausalConv1dTokenBlock - 1) / kCausalConv1dTokenBlock;
  for (int64_t item = first_item; item < last_item; ++item) {
    const int64_t b = item / blocks, t0 = item % blocks * kCausalConv1dTokenBlock;
    const int64_t t1 = t0 + kCausalConv1dTokenBlock < a.length ? t0 + kCausalConv1dTokenBlock : a.length;
    ChannelsLast<kT>(a, b, t0, t1);
  }
}

}  // namespace

void CausalConv1dItems(const CausalConv1dCpuArgs& a, int64_t first_item, int64_t last_item) {
  switch (a.type) {
    case ElemType::kFloat16: Run<kF16>(a, first_item, last_item); break;
    case ElemType::kBFloat16: Run<kBF16>(a, first_item, last_item); break;
    default: Run<kNone>(a, first_item, last_item); break;
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
