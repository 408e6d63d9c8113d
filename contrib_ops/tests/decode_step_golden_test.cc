// Runs the decode-step CPU math cores (SelectiveStateUpdate, CausalConv1dUpdate) without ONNX Runtime on
// raw inputs, for tests/test_decode_step_arm64.py (cross-compiled for AArch64, run under qemu).
//
//   decode_step_golden_test ssu  <dir>   meta.txt: T S D_type B H P N G dt_softplus has_dt_bias has_D
//                                         inputs state x dt [dt_bias] A B C [D] -> out, present_state
//   decode_step_golden_test conv <dir>   meta.txt: T B C L S K silu has_bias
//                                         inputs x conv_state weight [bias]     -> y, present_state
// The files: contrib_ops/tests/raw_tensor_files.h.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "causal_conv1d_update_impl.h"
#include "raw_tensor_files.h"
#include "selective_state_update_impl.h"

namespace {

using mambafuse::golden::ElementBytes;
using mambafuse::golden::ReadTensor;
using mambafuse::golden::WriteTensor;

int RunStateUpdate(const std::string& dir) {
  std::ifstream meta(dir + "/meta.txt");
  int64_t t, s, d, batch, heads, head_dim, n_state, groups, softplus, has_bias, has_d;
  meta >> t >> s >> d >> batch >> heads >> head_dim >> n_state >> groups >> softplus >> has_bias >> has_d;
  const auto state = ReadTensor(dir, "state"), x = ReadTensor(dir, "x"), dt = ReadTensor(dir, "dt"),
             dt_bias = ReadTensor(dir, "dt_bias"), A = ReadTensor(dir, "A"), B = ReadTensor(dir, "B"),
             C = ReadTensor(dir, "C"), D = ReadTensor(dir, "D");
  mambafuse::SelectiveStateUpdateCpuArgs a;
  a.type = static_cast<mambafuse::ElemType>(t);
  a.state_type = static_cast<mambafuse::ElemType>(s);
  a.d_type = static_cast<mambafuse::ElemType>(d);
  a.batch = batch;
  a.heads = heads;
  a.head_dim = head_dim;
  a.state_size = n_state;
  a.groups = groups;
  a.dt_softplus = softplus != 0;
  std::vector<char> out(static_cast<size_t>(batch * heads * head_dim) * ElementBytes(t));
  std::vector<char> present(state.size());
  a.state = state.data();
  a.x = x.data();
  a.dt = dt.data();
  a.dt_bias = has_bias ? dt_bias.data() : nullptr;
  a.A = reinterpret_cast<const float*>(A.data());
  a.B = B.data();
  a.C = C.data();
  a.D = has_d ? D.data() : nullptr;
  a.out = out.data();
  a.present_state = present.data();
  if (const char* problem = mambafuse::ValidateArgs(a)) {
    std::fprintf(stderr, "%s\n", problem);
    return 2;
  }
  mambafuse::SelectiveStateUpdateCpu(a, 0, batch * heads);
  WriteTensor(dir, "out", out);
  WriteTensor(dir, "present_state", present);
  return 0;
}

int RunConvUpdate(const std::string& dir) {
  std::ifstream meta(dir + "/meta.txt");
  int64_t t, batch, channels, cols, state_len, width, silu, has_bias;
  meta >> t >> batch >> channels >> cols >> state_len >> width >> silu >> has_bias;
  const auto x = ReadTensor(dir, "x"), state = ReadTensor(dir, "conv_state"), weight = ReadTensor(dir, "weight"),
             bias = ReadTensor(dir, "bias");
  mambafuse::CausalConv1dUpdateCpuArgs a;
  a.type = static_cast<mambafuse::ElemType>(t);
  a.batch = batch;
  a.channels = channels;
  a.new_columns = cols;
  a.state_len = state_len;
  a.width = width;
  a.silu = silu != 0;
  std::vector<char> y(x.size()), present(state.size());
  a.x = x.data();
  a.conv_state = state.data();
  a.weight = weight.data();
  a.bias = has_bias ? bias.data() : nullptr;
  a.y = y.data();
  a.present_state = present.data();
  if (const char* problem = mambafuse::ValidateArgs(a)) {
    std::fprintf(stderr, "%s\n", problem);
    return 2;
  }
  mambafuse::CausalConv1dUpdateCpu(a, 0, batch * channels);
  WriteTensor(dir, "y", y);
  WriteTensor(dir, "present_state", present);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s ssu|conv <dir>\n", argv[0]);
    return 2;
  }
  const std::string op = argv[1];
  std::printf("isa %s\n", mambafuse::SelectedIsa());
  return op == "ssu" ? RunStateUpdate(argv[2]) : RunConvUpdate(argv[2]);
}
