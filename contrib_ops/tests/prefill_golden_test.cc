// Runs the prefill CPU math cores (MambaChunkScan, CausalConv1d) without ONNX Runtime on raw inputs, for
// tests/test_prefill_arm64.py (cross-compiled for AArch64, run under qemu; the scan core needs Eigen's headers).
//
//   prefill_golden_test scan <dir>   meta.txt: T D_type S_type B L H P G N dt_softplus has_dt_bias has_D has_state
//                                               chunk_size min_items
//                                     inputs x dt [dt_bias] A B C [D] [initial_state] dt_limits (float32 min, max)
//                                     -> out, final_state (float32)
//   prefill_golden_test conv <dir>   meta.txt: T B C L S K silu has_bias has_state channels_last calls
//                                     inputs x weight [bias] [initial_state] -> y, final_state
// The files: contrib_ops/tests/raw_tensor_files.h. Every work item runs in its own call, as the ops' thread pools
// run them (scan), or the items are split into `calls` ranges (conv), so that range boundaries are exercised.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "causal_conv1d_impl.h"
#include "mamba_chunk_scan_impl.h"
#include "raw_tensor_files.h"

namespace {

using mambafuse::golden::ElementBytes;
using mambafuse::golden::ReadTensor;
using mambafuse::golden::WriteTensor;

int Refuse(const char* problem) {
  std::fprintf(stderr, "invalid arguments: %s\n", problem);
  return 2;
}

const void* DataOrNull(const std::vector<char>& data, bool present) { return present ? data.data() : nullptr; }

int RunChunkScan(const std::string& dir) {
  std::ifstream meta(dir + "/meta.txt");
  int64_t t, d, s, batch, length, heads, head_dim, groups, n_state, softplus, has_bias, has_d, has_state, chunk_size,
      min_items;
  meta >> t >> d >> s >> batch >> length >> heads >> head_dim >> groups >> n_state >> softplus >> has_bias >> has_d >>
      has_state >> chunk_size >> min_items;
  if (!meta) return Refuse("meta.txt is incomplete");
  const auto x = ReadTensor(dir, "x"), dt = ReadTensor(dir, "dt"), dt_bias = ReadTensor(dir, "dt_bias"),
             A = ReadTensor(dir, "A"), B = ReadTensor(dir, "B"), C = ReadTensor(dir, "C"), D = ReadTensor(dir, "D"),
             initial_state = ReadTensor(dir, "initial_state"), limits = ReadTensor(dir, "dt_limits");
  if (limits.size() != 2 * sizeof(float)) return Refuse("dt_limits.bin must hold two floats");
  mambafuse::MambaChunkScanCpuArgs a;
  a.type = static_cast<mambafuse::ElemType>(t);
  a.dt_type = a.type;  // the golden cases give dt in x's type
  a.d_type = static_cast<mambafuse::ElemType>(d);
  a.state_type = static_cast<mambafuse::ElemType>(s);
  a.batch = batch;
  a.length = length;
  a.heads = heads;
  a.head_dim = head_dim;
  a.groups = groups;
  a.state_size = n_state;
  a.dt_softplus = softplus != 0;
  a.dt_min = reinterpret_cast<const float*>(limits.data())[0];
  a.dt_max = reinterpret_cast<const float*>(limits.data())[1];
  a.chunk_size = chunk_size;
  a.heads_per_block = mambafuse::ChunkScanHeadsPerBlock(a, min_items);
  std::vector<float> out(static_cast<size_t>(batch * length * heads * head_dim));
  std::vector<float> final_state(static_cast<size_t>(batch * heads * head_dim * n_state));
  a.x = x.data();
  a.dt = dt.data();
  a.dt_bias = DataOrNull(dt_bias, has_bias != 0);
  a.A = reinterpret_cast<const float*>(A.data());
  a.B = B.data();
  a.C = C.data();
  a.D = DataOrNull(D, has_d != 0);
  a.initial_state = DataOrNull(initial_state, has_state != 0);
  a.out = out.data();
  a.final_state = final_state.data();
  if (const char* problem = mambafuse::ValidateArgs(a)) return Refuse(problem);
  const int64_t items = mambafuse::ChunkScanItemCount(a);
  for (int64_t i = 0; i < items; ++i) mambafuse::MambaChunkScanCpu(a, i, i + 1);
  std::printf("items %lld heads_per_block %lld\n", static_cast<long long>(items),
              static_cast<long long>(a.heads_per_block));
  const auto bytes = [](const std::vector<float>& v) {
    const auto* p = reinterpret_cast<const char*>(v.data());
    return std::vector<char>(p, p + v.size() * sizeof(float));
  };
  WriteTensor(dir, "out", bytes(out));
  WriteTensor(dir, "final_state", bytes(final_state));
  return 0;
}

int RunConv(const std::string& dir) {
  std::ifstream meta(dir + "/meta.txt");
  int64_t t, batch, channels, length, state_len, width, silu, has_bias, has_state, channels_last, calls;
  meta >> t >> batch >> channels >> length >> state_len >> width >> silu >> has_bias >> has_state >> channels_last >>
      calls;
  if (!meta) return Refuse("meta.txt is incomplete");
  const auto x = ReadTensor(dir, "x"), weight = ReadTensor(dir, "weight"), bias = ReadTensor(dir, "bias"),
             initial_state = ReadTensor(dir, "initial_state");
  mambafuse::CausalConv1dCpuArgs a;
  a.type = static_cast<mambafuse::ElemType>(t);
  a.batch = batch;
  a.channels = channels;
  a.length = length;
  a.state_len = state_len;
  a.width = width;
  a.silu = silu != 0;
  a.channels_last = channels_last != 0;
  std::vector<char> y(x.size()), final_state(static_cast<size_t>(batch * channels * state_len) * ElementBytes(t));
  a.x = x.data();
  a.weight = weight.data();
  a.bias = DataOrNull(bias, has_bias != 0);
  a.initial_state = DataOrNull(initial_state, has_state != 0);
  a.y = y.data();
  a.final_state = final_state.data();
  std::vector<float> weight_kc, bias_c;
  if (a.channels_last && channels > 0 && width > 0) {
    weight_kc.resize(static_cast<size_t>(width * channels));
    bias_c.resize(static_cast<size_t>(channels));
    a.weight_kc = weight_kc.data();
    a.bias_c = bias_c.data();
  }
  if (const char* problem = mambafuse::ValidateArgs(a)) return Refuse(problem);
  if (a.channels_last && channels > 0) mambafuse::PrepareChannelsLast(a, weight_kc.data(), bias_c.data());
  const int64_t items = mambafuse::CausalConv1dItems(a);
  const int64_t parts = calls < 1 ? 1 : calls;
  for (int64_t c = 0; c < parts; ++c) mambafuse::CausalConv1dCpu(a, items * c / parts, items * (c + 1) / parts);
  std::printf("items %lld\n", static_cast<long long>(items));
  WriteTensor(dir, "y", y);
  WriteTensor(dir, "final_state", final_state);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string op = argc == 3 ? argv[1] : "";
  if (op != "scan" && op != "conv") {
    std::fprintf(stderr, "usage: %s scan|conv <dir>\n", argv[0]);
    return 2;
  }
  std::printf("isa %s\n", mambafuse::SelectedIsa());
  return op == "scan" ? RunChunkScan(argv[2]) : RunConv(argv[2]);
}
