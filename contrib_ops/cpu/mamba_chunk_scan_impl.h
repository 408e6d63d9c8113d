// Math core of MambaChunkScan on the CPU (docs/mamba_chunk_scan.md): no ONNX Runtime types, so it also builds
// into standalone tests.
#pragma once

#include <cstdint>

#include "gated_group_rms_norm_impl.h"  // ElemType, IsSupportedElemType, ElemTypeName, SelectedIsa

namespace mambafuse {

// One call computes a contiguous range of work items. Item i -> batch row b, group g and a block of that
// group's heads (heads_per_block of them, the last block of a group possibly shorter):
//   blocks = ceil((H / G) / heads_per_block), b = i / (G * blocks), g = i / blocks % G, block = i % blocks.
// An item owns its heads' rows of `out` and their final_state, which also carries the state chunk to chunk.
struct MambaChunkScanCpuArgs {
  const void* x = nullptr;                 // [B, T, H, P], type
  const void* dt = nullptr;                // [B, T, H], dt_type
  const void* dt_bias = nullptr;           // [H], dt_type; optional (nullptr)
  const float* A = nullptr;                // [H]
  const void* B = nullptr;                 // [B, T, G, N], type
  const void* C = nullptr;                 // [B, T, G, N], type
  const void* D = nullptr;                 // [H], d_type; optional (nullptr)
  const void* initial_state = nullptr;     // [B, H, P, N] (state_np: [B, H, N, P]), state_type; optional (zeros)
  float* out = nullptr;                    // [B, T, H, P]
  float* final_state = nullptr;            // [B, H, P, N] (state_np: [B, H, N, P])
  ElemType type = ElemType::kFloat;        // T
  ElemType dt_type = ElemType::kFloat;     // T or float: the time step's rounding points are in it
  ElemType d_type = ElemType::kFloat;      // float or T
  ElemType state_type = ElemType::kFloat;  // float or T
  int64_t batch = 0, length = 0, heads = 0, head_dim = 0, groups = 1, state_size = 0;
  bool dt_softplus = true;
  bool state_np = false;  // the state_layout attribute: false (0) the states as [B, H, P, N], true (1) as [B, H, N, P]
  float dt_min = 0.f, dt_max = 0.f;  // the time step's limits as the attributes give them (rounded to dt_type)
  int64_t chunk_size = 0;            // Q: tokens per chunk, >= 1
  int64_t heads_per_block = 1;       // heads of one group that one item owns, >= 1
};

// The chunk size the kernel runs: kDefaultChunkSize, or MAMBAFUSE_CHUNK_SCAN_CHUNK's value (read per call, a
// positive integer; benchmarks and tests set it). 0 when that variable is set to anything else.
inline constexpr int64_t kDefaultChunkSize = 64;
int64_t ChunkScanChunkSize();

// Heads per work item for these dimensions (after chunk_size is set): a group's heads split into blocks so that
// there are at least `min_items` items, but no block so small that recomputing C·Bᵀ for it costs more than an
// eighth of its heads' own work.
int64_t ChunkScanHeadsPerBlock(const MambaChunkScanCpuArgs& args, int64_t min_items);

// The number of work items of these arguments.
int64_t ChunkScanItemCount(const MambaChunkScanCpuArgs& args);

// Returns nullptr when the arguments are consistent, else a static description of the problem.
const char* ValidateArgs(const MambaChunkScanCpuArgs& args);

// Computes items [first_item, last_item) on the instruction-set level SelectedIsa() names.
void MambaChunkScanCpu(const MambaChunkScanCpuArgs& args, int64_t first_item, int64_t last_item);

}  // namespace mambafuse
