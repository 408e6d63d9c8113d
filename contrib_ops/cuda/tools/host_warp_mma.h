// Host emulation of warp_mma.cuh (tools/emulate_prefill.sh copies it in under that name, so the kernel sources
// include it unchanged). Each function is warp-wide as on the GPU: the 32 threads of the warp (host_emulation.h)
// put their operands in their slots, meet, and each computes its own result from every lane's operands by the
// fragment layouts warp_mma.cuh states. The products follow the tensor core where the kernels rely on it: a .tf32
// operand's low 13 bits are ignored, and every product is exact (the sum is taken in double, then rounded once).
// cp.async copies are held by the thread that issued them until its CopyAsyncWaitAll, so a read of a staging buffer
// before the wait sees the 0xff fill, not the data; MAMBAFUSE_EMU_COPY=immediate copies at once instead (a copy
// that lands in a buffer other threads still read then shows).
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "host_emulation.h"

namespace mambafuse {

namespace emu {

inline float Tf32(uint32_t bits) { return __uint_as_float(bits & 0xffffe000u); }

// The 16-bit half `high` (0: the lower address) of `word` as float.
template <typename T>
float Half(uint32_t word, int high) {
  const auto bits = static_cast<uint16_t>(high ? word >> 16 : word & 0xffffu);
  T v;
  std::memcpy(&v, &bits, 2);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else {
    return __bfloat162float(v);
  }
}

struct MmaOperands {
  uint32_t a[4], b[2];
  float c[4];
};

// D = C + A·B for the lane's four outputs (rows g, g + 8; columns 2t, 2t + 1) over k < kK, with A(row, k) and
// B(k, column) read from the warp's slots.
template <int kK, typename AFn, typename BFn>
void MmaLane(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, AFn a_at, BFn b_at) {
  const MmaOperands operands = {{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
  const auto out = EmuWarpWide(operands, [&](EmuWarp& w, unsigned lane) {
    const int g = static_cast<int>(lane / 4), t = static_cast<int>(lane % 4);
    std::array<float, 4> sums;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2), column = 2 * t + e % 2;
      double sum = d[e];
      for (int k = 0; k < kK; ++k) sum += static_cast<double>(a_at(w, row, k)) * static_cast<double>(b_at(w, k, column));
      sums[e] = static_cast<float>(sum);
    }
    return sums;
  });
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

struct PendingCopy {
  void* shared;
  const void* global;
};
// This thread's copies not yet landed: the committed groups, oldest first, and the copies since the last commit.
inline thread_local std::vector<std::vector<PendingCopy>> committed_copies;
inline thread_local std::vector<PendingCopy> pending_copies;

inline void Land(std::vector<PendingCopy>& copies) {
  for (const PendingCopy& copy : copies) std::memcpy(copy.shared, copy.global, 16);
  copies.clear();
}

inline bool CopyAtOnce() {
  const char* mode = std::getenv("MAMBAFUSE_EMU_COPY");
  return mode != nullptr && std::strcmp(mode, "immediate") == 0;
}

}  // namespace emu

// m16n8k8 TF32: A[r][k] is register r / 8 + 2·(k / 4) of lane 4·(r % 8) + k % 4, B[k][n] register k / 4 of lane
// 4·n + k % 4.
inline void MmaTf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::MmaLane<8>(
      d, a, b0, b1,
      [](EmuWarp& w, int r, int k) {
        return emu::Tf32(EmuSlot<emu::MmaOperands>(w, 4 * (r % 8) + k % 4).a[r / 8 + 2 * (k / 4)]);
      },
      [](EmuWarp& w, int k, int n) { return emu::Tf32(EmuSlot<emu::MmaOperands>(w, 4 * n + k % 4).b[k / 4]); });
}

// m16n8k16 float16 / bfloat16: A[r][k] is half k % 2 of register r / 8 + 2·(k / 8) of lane 4·(r % 8) + (k % 8) / 2,
// B[k][n] half k % 2 of register k / 8 of lane 4·n + (k % 8) / 2.
template <typename T>
void MmaHalf(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::MmaLane<16>(
      d, a, b0, b1,
      [](EmuWarp& w, int r, int k) {
        return emu::Half<T>(EmuSlot<emu::MmaOperands>(w, 4 * (r % 8) + (k % 8) / 2).a[r / 8 + 2 * (k / 8)], k % 2);
      },
      [](EmuWarp& w, int k, int n) {
        return emu::Half<T>(EmuSlot<emu::MmaOperands>(w, 4 * n + (k % 8) / 2).b[k / 8], k % 2);
      });
}

// ldmatrix x4: lane i gives the address of row i % 8 of block i / 8; lane L receives in r[j] the 32-bit word
// L % 4 of row L / 4 of block j.
inline void LoadMatrixX4(uint32_t (&r)[4], const void* row_address) {
  const auto words = EmuWarpWide(static_cast<const unsigned char*>(row_address), [](EmuWarp& w, unsigned lane) {
    std::array<uint32_t, 4> loaded;
    for (unsigned j = 0; j < 4; ++j) {
      std::memcpy(&loaded[j], EmuSlot<const unsigned char*>(w, 8 * j + lane / 4) + 4 * (lane % 4), 4);
    }
    return loaded;
  });
  for (unsigned j = 0; j < 4; ++j) r[j] = words[j];
}

inline void CopyAsync16(void* shared, const void* global) {
  if (emu::CopyAtOnce()) {
    std::memcpy(shared, global, 16);
  } else {
    emu::pending_copies.push_back({shared, global});
  }
}
inline void CopyAsyncCommit() {
  emu::committed_copies.push_back(std::move(emu::pending_copies));
  emu::pending_copies.clear();
}
inline void CopyAsyncWaitAll() {
  for (auto& group : emu::committed_copies) emu::Land(group);
  emu::committed_copies.clear();
  emu::Land(emu::pending_copies);
}
// The newest kPending committed groups stay in flight (and the copies not committed: cp.async.wait_group does not
// wait for them); the older ones land.
template <int kPending>
void CopyAsyncWaitGroup() {
  auto& groups = emu::committed_copies;
  while (groups.size() > static_cast<size_t>(kPending)) {
    emu::Land(groups.front());
    groups.erase(groups.begin());
  }
}

// ldmatrix x4 .trans: lane L receives in r[j] the 16-bit elements [2·(L % 4)][L / 4] and [2·(L % 4) + 1][L / 4] of
// block j, whose row r lane 8·j + r addressed.
inline void LoadMatrixX4Trans(uint32_t (&r)[4], const void* row_address) {
  const auto words = EmuWarpWide(static_cast<const unsigned char*>(row_address), [](EmuWarp& w, unsigned lane) {
    std::array<uint32_t, 4> loaded;
    for (unsigned j = 0; j < 4; ++j) {
      uint16_t low, high;
      std::memcpy(&low, EmuSlot<const unsigned char*>(w, 8 * j + 2 * (lane % 4)) + 2 * (lane / 4), 2);
      std::memcpy(&high, EmuSlot<const unsigned char*>(w, 8 * j + 2 * (lane % 4) + 1) + 2 * (lane / 4), 2);
      loaded[j] = static_cast<uint32_t>(low) | static_cast<uint32_t>(high) << 16;
    }
    return loaded;
  });
  for (unsigned j = 0; j < 4; ++j) r[j] = words[j];
}

// bar.sync id, threads: the first thread to arrive makes the barrier with its count, and every later use of the id
// must give the same count (as on the GPU, where a mismatch is undefined).
inline void NamedBarrierSync(int id, int threads) {
  EmuBlock& block = *emu_block;
  std::barrier<>* barrier = nullptr;
  {
    std::lock_guard<std::mutex> lock(block.named_mutex);
    if (!block.named[id]) block.named[id] = std::make_unique<std::barrier<>>(threads);
    barrier = block.named[id].get();
  }
  barrier->arrive_and_wait();
}

}  // namespace mambafuse
