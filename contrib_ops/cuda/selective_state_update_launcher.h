// Launcher of the SelectiveStateUpdate CUDA kernels (docs/selective_state_update.md): plain C++ and the CUDA
// runtime types only, because ONNX Runtime's C++ headers do not compile under nvcc 13. The ORT-facing kernel
// (selective_state_update_cuda.cc), the self-check (tools/cuda_decode_selfcheck.cc) and the benchmark entry
// points (tools/cuda_decode_bench_launch.cc) fill the arguments; selective_state_update_impl.cu launches.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cpu/gated_group_rms_norm_impl.h"  // ElemType (ONNX element type numbers): no ORT types

namespace mambafuse {

// One decode step of the Mamba-2 selective state update, for every (batch b, head h, row p, state column n):
//   d1  = round_T(dt[b,h] + dt_bias[h])                 (d1 = dt[b,h] without dt_bias)
//   d   = dt_softplus ? (d1 > 20 ? d1 : round_T(log1p(exp(d1)))) : d1
//   dA  = exp(d * A[h])                                 (float32)
//   dBx = round_T(round_T(d * B[b,g,n]) * x[b,h,p])     (g = h / (heads / groups))
//   present[b,h,p,n] = round_S(state[b,h,p,n] * dA + dBx)   (a float32 multiply, then an add: no FMA)
//   y   = round_T(sum_n round_T(present[b,h,p,n]) * C[b,g,n])
//   out[b,h,p] = D ? round_T(y + round_T(x[b,h,p] * D[h])) : y
// T is the activation type (x, dt, dt_bias, B, C, out), S the state type (float or T), D float or T, A float.
// Every tensor is dense, row-major, in the shapes of the op (state and present (B, H, P, N), x and out
// (B, H, P), dt (B, H), B and C (B, G, N)); present must not overlap state.
struct SelectiveStateUpdateArgs {
  const void* state = nullptr;
  const void* x = nullptr;
  const void* dt = nullptr;
  const void* dt_bias = nullptr;  // optional
  const float* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;
  const void* d = nullptr;        // optional
  void* out = nullptr;
  void* present_state = nullptr;
  ElemType t_type = ElemType::kFloat;  // x, dt, dt_bias, B, C, out
  ElemType s_type = ElemType::kFloat;  // state, present_state: float or t_type
  ElemType d_type = ElemType::kFloat;  // D: float or t_type
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;    // P
  int64_t state_size = 0;  // N
  int64_t groups = 0;      // G, divides heads
  bool dt_softplus = true;
};

// The kernel's configuration, chosen on the host (ChooseSelectiveStateUpdateLaunch).
struct SelectiveStateUpdateLaunch {
  bool vector = false;     // 16-byte state loads (else one element per lane, any N and alignment)
  int vec = 1;             // state elements per lane and load: 16 / sizeof(S) on the vector path
  int lanes_per_row = 32;  // lanes that share one (b, h, p) row, a power of two <= 32
  int chunks = 1;          // vec-element chunks per lane and row: 1 or 2 on the vector path
  int rows_per_lane = 4;   // rows each lane updates with all their loads in flight: 1, 2 or 4
  int rows_per_block = 0;  // (block threads / lanes_per_row) * rows_per_lane
  int64_t blocks = 0;      // grid size
  bool shared_head = false;  // vector path: one warp runs the per-head softplus/exp chain, the block shares it
};

// Null when the arguments can be launched, else what is wrong (shape limits of the grid, types).
const char* CheckSelectiveStateUpdateArgs(const SelectiveStateUpdateArgs& args);

// Path and block shape for `args` on a device of `multiprocessors` SMs. Environment overrides for tuning and
// tests: MAMBAFUSE_SSU_PATH=scalar (the one-element path), MAMBAFUSE_SSU_ROWS=1|2|4 (rows per lane),
// MAMBAFUSE_SSU_LANES=2^k (fewer lanes a row on the vector path, as long as a lane has at most 2 chunks),
// MAMBAFUSE_SSU_SHARED_HEAD=0|1 (the vector path's per-head chain in every thread, or in one warp a block).
SelectiveStateUpdateLaunch ChooseSelectiveStateUpdateLaunch(const SelectiveStateUpdateArgs& args, int multiprocessors);

// Enqueues the op on `stream`: no host synchronization, no allocation, safe under CUDA-graph capture.
// Returns the launch error, cudaErrorInvalidValue for arguments CheckSelectiveStateUpdateArgs rejects, and
// cudaSuccess with nothing launched for an empty tensor.
cudaError_t LaunchSelectiveStateUpdate(const SelectiveStateUpdateArgs& args, cudaStream_t stream);

}  // namespace mambafuse
