// C entry points to the prefill CUDA launchers (MambaChunkScan, CausalConv1d), for benchmarks that drive the kernels directly
// (ctypes, with buffers and a stream from PyTorch, inside PyTorch's CUDA graphs, next to other libraries' kernels
// timed the same way). Built only with MAMBAFUSE_CUDA_TOOLS=ON; not part of the shipped library. Types are ONNX
// element type numbers (1 float, 10 float16, 16 bfloat16).
#include <cstdint>

#include "causal_conv1d_launcher.h"
#include "mamba_chunk_scan_launcher.h"

#define MAMBAFUSE_BENCH_EXPORT extern "C" __attribute__((visibility("default")))

// MambaChunkScan on `stream` with dt (and dt_bias) of type dt_type (x's type or float) and the states in the
// layout state_layout names (0 [B, H, P, N], 1 [B, H, N, P]). dt_bias, d and initial_state may be null. path: 0
// auto, 1 chunked, 2 sequential, 3 step (a one-token prompt). Returns a cudaError_t (0 = success), or -1 when CheckMambaChunkScanCudaArgs
// rejects the arguments.
MAMBAFUSE_BENCH_EXPORT int mambafuse_chunk_scan_launch_layout(
    const void* x, const void* dt, const void* dt_bias, const float* a, const void* b, const void* c, const void* d,
    const void* initial_state, float* out, float* final_state, int type, int dt_type, int d_type, int state_type,
    int64_t batch, int64_t length, int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size, int softplus,
    float dt_min, float dt_max, int state_layout, int path, void* stream) {
  using mambafuse::ElemType;
  mambafuse::MambaChunkScanCpuArgs args;
  args.x = x;
  args.dt = dt;
  args.dt_bias = dt_bias;
  args.A = a;
  args.B = b;
  args.C = c;
  args.D = d;
  args.initial_state = initial_state;
  args.out = out;
  args.final_state = final_state;
  args.type = static_cast<ElemType>(type);
  args.dt_type = static_cast<ElemType>(dt_type);
  args.d_type = static_cast<ElemType>(d_type);
  args.state_type = static_cast<ElemType>(state_type);
  args.batch = batch;
  args.length = length;
  args.heads = heads;
  args.head_dim = head_dim;
  args.groups = groups;
  args.state_size = state_size;
  args.dt_softplus = softplus != 0;
  args.state_np = state_layout == 1;
  args.dt_min = dt_min;
  args.dt_max = dt_max;
  if (mambafuse::CheckMambaChunkScanCudaArgs(args) != nullptr) return -1;
  const auto chosen = path == 1   ? mambafuse::ChunkScanCudaPath::kChunked
                      : path == 2 ? mambafuse::ChunkScanCudaPath::kSequential
                      : path == 3 ? mambafuse::ChunkScanCudaPath::kStep
                                  : mambafuse::ChunkScanCudaPath::kAuto;
  return static_cast<int>(mambafuse::LaunchMambaChunkScan(args, chosen, static_cast<cudaStream_t>(stream)));
}

// The same with the states as [B, H, P, N].
MAMBAFUSE_BENCH_EXPORT int mambafuse_chunk_scan_launch_dt(const void* x, const void* dt, const void* dt_bias,
                                                          const float* a, const void* b, const void* c, const void* d,
                                                          const void* initial_state, float* out, float* final_state,
                                                          int type, int dt_type, int d_type, int state_type,
                                                          int64_t batch, int64_t length, int64_t heads,
                                                          int64_t head_dim, int64_t groups, int64_t state_size,
                                                          int softplus, float dt_min, float dt_max, int path,
                                                          void* stream) {
  return mambafuse_chunk_scan_launch_layout(x, dt, dt_bias, a, b, c, d, initial_state, out, final_state, type,
                                            dt_type, d_type, state_type, batch, length, heads, head_dim, groups,
                                            state_size, softplus, dt_min, dt_max, 0, path, stream);
}

// The same with dt in x's type.
MAMBAFUSE_BENCH_EXPORT int mambafuse_chunk_scan_launch(const void* x, const void* dt, const void* dt_bias,
                                                       const float* a, const void* b, const void* c, const void* d,
                                                       const void* initial_state, float* out, float* final_state,
                                                       int type, int d_type, int state_type, int64_t batch,
                                                       int64_t length, int64_t heads, int64_t head_dim,
                                                       int64_t groups, int64_t state_size, int softplus,
                                                       float dt_min, float dt_max, int path, void* stream) {
  return mambafuse_chunk_scan_launch_dt(x, dt, dt_bias, a, b, c, d, initial_state, out, final_state, type, type,
                                        d_type, state_type, batch, length, heads, head_dim, groups, state_size,
                                        softplus, dt_min, dt_max, path, stream);
}

// The kernel the launcher runs for a prompt of `length` tokens at these sizes on the current device (path as in
// the launch): 1 chunked, 2 sequential, 3 step.
MAMBAFUSE_BENCH_EXPORT int mambafuse_chunk_scan_resolve(int64_t head_dim, int64_t state_size, int64_t length,
                                                        int path) {
  mambafuse::MambaChunkScanCpuArgs args;
  args.head_dim = head_dim;
  args.state_size = state_size;
  args.length = length;
  const auto requested = path == 1   ? mambafuse::ChunkScanCudaPath::kChunked
                         : path == 2 ? mambafuse::ChunkScanCudaPath::kSequential
                         : path == 3 ? mambafuse::ChunkScanCudaPath::kStep
                                     : mambafuse::ChunkScanCudaPath::kAuto;
  switch (mambafuse::ResolveChunkScanCudaPath(args, requested)) {
    case mambafuse::ChunkScanCudaPath::kChunked:
      return 1;
    case mambafuse::ChunkScanCudaPath::kStep:
      return 3;
    default:
      return 2;
  }
}

// The same for a prompt longer than one token: 1 chunked, 2 sequential.
MAMBAFUSE_BENCH_EXPORT int mambafuse_chunk_scan_path(int64_t head_dim, int64_t state_size, int path) {
  return mambafuse_chunk_scan_resolve(head_dim, state_size, 2, path);
}

// CausalConv1d on `stream`: x and y [B, L, C] (channels_last) or [B, C, L], weight [C, K], bias and initial_state
// optional (null), final_state [B, C, S]; round_once: the attribute. Returns a cudaError_t (0 = success), or -1 when
// CheckCausalConv1dCudaArgs rejects the arguments.
MAMBAFUSE_BENCH_EXPORT int mambafuse_causal_conv1d_launch_rounding(const void* x, const void* weight,
                                                                   const void* bias, const void* initial_state,
                                                                   void* y, void* final_state, int type,
                                                                   int64_t batch, int64_t channels, int64_t length,
                                                                   int64_t state_len, int64_t width, int silu,
                                                                   int channels_last, int round_once, void* stream) {
  mambafuse::CausalConv1dCpuArgs args;
  args.x = x;
  args.weight = weight;
  args.bias = bias;
  args.initial_state = initial_state;
  args.y = y;
  args.final_state = final_state;
  args.type = static_cast<mambafuse::ElemType>(type);
  args.batch = batch;
  args.channels = channels;
  args.length = length;
  args.state_len = state_len;
  args.width = width;
  args.silu = silu != 0;
  args.channels_last = channels_last != 0;
  args.round_once = round_once != 0;
  if (mambafuse::CheckCausalConv1dCudaArgs(args) != nullptr) return -1;
  return static_cast<int>(mambafuse::LaunchCausalConv1d(args, static_cast<cudaStream_t>(stream)));
}

// The same with the default rounding (each step rounded to T).
MAMBAFUSE_BENCH_EXPORT int mambafuse_causal_conv1d_launch(const void* x, const void* weight, const void* bias,
                                                          const void* initial_state, void* y, void* final_state,
                                                          int type, int64_t batch, int64_t channels, int64_t length,
                                                          int64_t state_len, int64_t width, int silu,
                                                          int channels_last, void* stream) {
  return mambafuse_causal_conv1d_launch_rounding(x, weight, bias, initial_state, y, final_state, type, batch,
                                                 channels, length, state_len, width, silu, channels_last, 0, stream);
}

// The kernel LaunchCausalConv1d runs for a prompt of `length` tokens, kernel width `width`, in `channels_last` or not:
// 1 tiled channels-last, 2 vector channels-first, 3 step (a prompt of a few tokens), 4 any width.
MAMBAFUSE_BENCH_EXPORT int mambafuse_causal_conv1d_path(int64_t width, int64_t length, int channels_last) {
  mambafuse::CausalConv1dCpuArgs args;
  args.width = width;
  args.length = length;
  args.channels_last = channels_last != 0;
  switch (mambafuse::ChooseCausalConv1dCudaPath(args)) {
    case mambafuse::CausalConv1dCudaPath::kTiledChannelsLast:
      return 1;
    case mambafuse::CausalConv1dCudaPath::kVectorChannelsFirst:
      return 2;
    case mambafuse::CausalConv1dCudaPath::kStep:
      return 3;
    default:
      return 4;
  }
}
