// Validation, work split and instruction-set dispatch of MambaChunkScan's CPU math core (isa_dispatch.h).
#include "mamba_chunk_scan_impl.h"

#include <algorithm>
#include <cstdlib>

#include "isa_dispatch.h"

namespace mambafuse {

MAMBAFUSE_DECLARE_ISA_ITEMS(MambaChunkScanCpuArgs, MambaChunkScanItems)

namespace {

bool IsFloatOr(ElemType t, ElemType other) { return t == ElemType::kFloat || t == other; }

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int64_t ChunkScanChunkSize() {
  const char* forced = std::getenv("MAMBAFUSE_CHUNK_SCAN_CHUNK");  // per call: tests switch it in-process
  if (forced == nullptr || *forced == '\0') return kDefaultChunkSize;
  char* end = nullptr;
  const long long value = std::strtoll(forced, &end, 10);
  return *end == '\0' && value >= 1 && value <= 4096 ? static_cast<int64_t>(value) : 0;
}

int64_t ChunkScanHeadsPerBlock(const MambaChunkScanCpuArgs& a, int64_t min_items) {
  const int64_t per_group = a.groups > 0 ? a.heads / a.groups : 0;
  if (per_group <= 1) return 1;
  // Per token, C·Bᵀ costs 2 Q N flops for the block; each head 2 Q P (intra-chunk) + 4 N P (readout of the
  // carried state, and the chunk's state). A block of at least `floor` heads spends at most 1/8 on C·Bᵀ.
  const int64_t q = std::max<int64_t>(std::min(a.chunk_size, a.length), 1);
  const int64_t shared = q * a.state_size;
  const int64_t own = std::max<int64_t>(q * a.head_dim + 2 * a.state_size * a.head_dim, 1);
  const int64_t floor = std::clamp<int64_t>(CeilDiv(8 * shared, own), 1, per_group);
  const int64_t rows = a.batch * a.groups;  // items with whole groups
  if (rows <= 0 || rows >= min_items) return per_group;
  const int64_t blocks = std::min(CeilDiv(min_items, rows), per_group);
  return std::max(floor, CeilDiv(per_group, blocks));
}

int64_t ChunkScanItemCount(const MambaChunkScanCpuArgs& a) {
  if (a.groups < 1 || a.heads_per_block < 1) return 0;
  return a.batch * a.groups * CeilDiv(a.heads / a.groups, a.heads_per_block);
}

const char* ValidateArgs(const MambaChunkScanCpuArgs& a) {
  if (!IsSupportedElemType(static_cast<int64_t>(a.type))) return "unsupported element type of x";
  if (!IsFloatOr(a.dt_type, a.type)) return "dt's type must be float or x's type";
  if (!IsFloatOr(a.d_type, a.type)) return "D's type must be float or x's type";
  if (!IsFloatOr(a.state_type, a.type)) return "initial_state's type must be float or x's type";
  if (a.batch < 0 || a.heads < 0 || a.head_dim < 0 || a.state_size < 0) return "negative dimension";
  if (a.length < 1) return "the prompt must have at least one token";
  if (a.groups < 1 || a.heads % a.groups != 0) return "the heads H must be a multiple of the groups G >= 1";
  if (a.chunk_size < 1) return "the chunk size must be at least 1";
  if (a.heads_per_block < 1) return "heads_per_block must be at least 1";
  if (a.batch * a.heads == 0) return nullptr;
  if (a.dt == nullptr || a.A == nullptr) return "null data pointer";
  if (a.state_size > 0 && (a.B == nullptr || a.C == nullptr)) return "null data pointer";
  if (a.head_dim > 0 && (a.x == nullptr || a.out == nullptr)) return "null data pointer";
  if (a.head_dim * a.state_size > 0 && a.final_state == nullptr) return "null data pointer";
  return nullptr;
}

void MambaChunkScanCpu(const MambaChunkScanCpuArgs& args, int64_t first_item, int64_t last_item) {
  static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(MambaChunkScanItems));
  items(args, first_item, last_item);
}

}  // namespace mambafuse
