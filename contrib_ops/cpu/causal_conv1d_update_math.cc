// CausalConv1dUpdate, the per-channel math (docs/causal_conv1d_update.md), compiled once per
// instruction-set level (CMake passes MAMBAFUSE_ISA_NS and the -m flags).
//
//   window  = [conv_state[b, c, 0..S) | x[b, c, 0..L)]
//   present = window[L .. S + L)
//   v[t]    = round_T(sum_k w[c, k] window[S - K + 1 + t + k] + bias[c])
//   y[t]    = silu ? round_T(v round_T(sigmoid(v))) : v
//
// A block of channels at a time: the convolution per channel (K products, the state shifted by L
// columns into present_state), the values into a float buffer, then the sigmoid (sigmoid_vector.h) over the
// buffer in vectors of the level's width.
#include <cmath>
#include <cstdint>

#include "causal_conv1d_update_impl.h"
#include "decode_step_vector.h"
#include "sigmoid_vector.h"

namespace mambafuse {
namespace MAMBAFUSE_ISA_NS {
namespace {

constexpr int64_t kBlock = 64;  // float values per sigmoid pass (a multiple of every level's width)

template <int kT>
void RunChannels(const CausalConv1dUpdateCpuArgs& a, int64_t first_item, int64_t last_item) {
  const int64_t channels = a.channels, new_cols = a.new_columns, state_len = a.state_len, width = a.width;
  const int64_t first_tap = state_len - width + 1;  // window column of output 0's first tap
  alignas(64) float values[kBlock];
  const int64_t per_block = new_cols <= kBlock ? kBlock / new_cols : 1;
  for (int64_t block = first_item; block < last_item; block += per_block) {
    const int64_t block_end = block + per_block < last_item ? block + per_block : last_item;
    int64_t count = 0;  // values computed in this block
    for (int64_t item = block; item < block_end; ++item) {
      const int64_t c = item % channels;
      const auto window = [&](int64_t j) {
        return j < state_len ? LoadScalar<kT>(a.conv_state, item * state_len + j)
                             : LoadScalar<kT>(a.x, item * new_cols + (j - state_len));
      };
      const float bias = a.bias != nullptr ? LoadScalar<kT>(a.bias, c) : 0.f;
      for (int64_t t = 0; t < new_cols; ++t) {
        float acc = 0.f;
        for (int64_t k = 0; k < width; ++k) acc += LoadScalar<kT>(a.weight, c * width + k) * window(first_tap + t + k);
        const float v = RoundTo<kT>(acc + bias);
        if (new_cols <= kBlock) {
          values[count++] = v;
        } else {  // a prefill-length L: no buffer, scalar sigmoid
          float y = v;
          if (a.silu) {
            VF one = VF{} + v;
            y = RoundTo<kT>(v * RoundTo<kT>(Sigmoid(one)[0]));
          }
          StoreScalar<kT>(a.y, item * new_cols + t, y);
        }
      }
      for (int64_t j = 0; j < state_len; ++j) {
        StoreScalar<kT>(a.present_state, item * state_len + j, window(j + new_cols));
      }
    }
    if (new_cols > kBlock) continue;
    for (int64_t i = count; i < (count + kWidth - 1) / kWidth * kWidth; ++i) values[i] = 0.f;
    for (int64_t i = 0; i < count; i += kWidth) {
      VF v = LoadVector<kNone>(values, i);
      if (a.silu) v = RoundTo<kT>(v * RoundTo<kT>(Sigmoid(v)));
      StoreVector<kNone>(values, i, v);
    }
    for (int64_t i = 0; i < count; ++i) StoreScalar<kT>(a.y, block * new_cols + i, values[i]);
  }
}

}  // namespace

void CausalConv1dUpdateItems(const CausalConv1dUpdateCpuArgs& a, int64_t first_item, int64_t last_item) {
  switch (a.type) {
    case ElemType::kFloat16: RunChannels<kF16>(a, first_item, last_item); break;
    case ElemType::kBFloat16: RunChannels<kBF16>(a, first_item, last_item); break;
    default: RunChannels<kNone>(a, first_item, last_item); break;
  }
}

}  // namespace MAMBAFUSE_ISA_NS
}  // namespace mambafuse
