// C entry points to the decode-step CUDA launchers (SelectiveStateUpdate, CausalConv1dUpdate), for benchmarks
// and tests that drive the kernels directly (ctypes, with buffers and a stream from PyTorch): the kernels
// alone, without an ONNX Runtime session around them. Built only with MAMBAFUSE_CUDA_TOOLS=ON; not part of
// the shipped library. Types are ONNX element type numbers (1 float, 10 float16, 16 bfloat16).
#include <cstdint>
#include <cstdio>

#include "causal_conv1d_update_launcher.h"
#include "selective_state_update_launcher.h"

#define MAMBAFUSE_BENCH_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

mambafuse::SelectiveStateUpdateArgs SsuArgs(const void* state, const void* x, const void* dt, const void* dt_bias,
                                            const float* a, const void* b, const void* c, const void* d, void* out,
                                            void* present, int t_type, int s_type, int d_type, int64_t batch,
                                            int64_t heads, int64_t head_dim, int64_t state_size, int64_t groups,
                                            int softplus) {
  using mambafuse::ElemType;
  mambafuse::SelectiveStateUpdateArgs args;
  args.state = state;
  args.x = x;
  args.dt = dt;
  args.dt_bias = dt_bias;
  args.a = a;
  args.b = b;
  args.c = c;
  args.d = d;
  args.out = out;
  args.present_state = present;
  args.t_type = static_cast<ElemType>(t_type);
  args.s_type = static_cast<ElemType>(s_type);
  args.d_type = static_cast<ElemType>(d_type);
  args.batch = batch;
  args.heads = heads;
  args.head_dim = head_dim;
  args.state_size = state_size;
  args.groups = groups;
  args.dt_softplus = softplus != 0;
  return args;
}

}  // namespace

// SelectiveStateUpdate on `stream`. dt_bias and d may be null. Returns a cudaError_t (0 = success), or -1
// when CheckSelectiveStateUpdateArgs rejects the arguments.
MAMBAFUSE_BENCH_EXPORT int mambafuse_ssu_launch(const void* state, const void* x, const void* dt, const void* dt_bias,
                                                const float* a, const void* b, const void* c, const void* d, void* out,
                                                void* present, int t_type, int s_type, int d_type, int64_t batch,
                                                int64_t heads, int64_t head_dim, int64_t state_size, int64_t groups,
                                                int softplus, void* stream) {
  const auto args = SsuArgs(state, x, dt, dt_bias, a, b, c, d, out, present, t_type, s_type, d_type, batch, heads,
                            head_dim, state_size, groups, softplus);
  if (mambafuse::CheckSelectiveStateUpdateArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchSelectiveStateUpdate(args, static_cast<cudaStream_t>(stream)));
}

// The launch configuration the launcher picks for these sizes (16-byte aligned buffers), as one line of text.
MAMBAFUSE_BENCH_EXPORT int mambafuse_ssu_describe(int t_type, int s_type, int64_t batch, int64_t heads,
                                                  int64_t head_dim, int64_t state_size, int64_t groups,
                                                  char* text, int64_t capacity) {
  alignas(16) static char aligned[16];
  const auto args = SsuArgs(aligned, aligned, aligned, nullptr, nullptr, aligned, aligned, nullptr, aligned, aligned,
                            t_type, s_type, t_type, batch, heads, head_dim, state_size, groups, 1);
  int device = 0;
  int multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return -1;
  }
  const auto launch = mambafuse::ChooseSelectiveStateUpdateLaunch(args, multiprocessors);
#if defined(MAMBAFUSE_SSU_TRAFFIC_FLOOR)
  const char* const kind = "TRAFFIC FLOOR (no arithmetic), ";
#else
  const char* const kind = "";
#endif
  std::snprintf(text, static_cast<size_t>(capacity),
                "%s%s path, %d lanes a row x %d chunk(s) of %d, %d rows a lane, %d rows a block, %lld blocks of 128%s",
                kind, launch.vector ? "vector" : "scalar", launch.lanes_per_row, launch.chunks, launch.vec,
                launch.rows_per_lane, launch.rows_per_block, static_cast<long long>(launch.blocks),
                launch.shared_head ? ", per-head chain shared" : "");
  return 0;
}

// CausalConv1dUpdate on `stream`; bias may be null. Returns a cudaError_t, or -1 for rejected arguments.
MAMBAFUSE_BENCH_EXPORT int mambafuse_conv_update_launch(const void* x, const void* conv_state, const void* weight,
                                                        const void* bias, void* y, void* present, int type,
                                                        int64_t batch, int64_t channels, int64_t length,
                                                        int64_t state_len, int64_t kernel_size, int silu,
                                                        void* stream) {
  mambafuse::CausalConv1dUpdateArgs args;
  args.x = x;
  args.conv_state = conv_state;
  args.weight = weight;
  args.bias = bias;
  args.y = y;
  args.present_state = present;
  args.type = static_cast<mambafuse::ElemType>(type);
  args.batch = batch;
  args.channels = channels;
  args.length = length;
  args.state_len = state_len;
  args.kernel_size = kernel_size;
  args.silu = silu != 0;
  if (mambafuse::CheckCausalConv1dUpdateArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchCausalConv1dUpdate(args, static_cast<cudaStream_t>(stream)));
}
