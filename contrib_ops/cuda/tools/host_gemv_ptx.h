// Host emulation of gemv_ptx.cuh (tools/emulate_gemv.sh copies it in under that name, so the int4 GEMV kernels
// include it unchanged). The product is host_warp_mma.h's MmaHalf (warp-wide, exact products, one rounding of the
// sum). The bulk-copy kernel's mbarriers live in a table beside the emulated shared memory, keyed by their offset in
// it: arrivals count down, and a bulk copy is held with its mbarrier until a thread waits on that mbarrier after the
// phase's arrivals are all in, and only then lands and counts its bytes in, so a read of a stage before its wait sees
// the 0xff fill or the previous tile, not the tile asked for; with MAMBAFUSE_EMU_COPY=immediate it lands at once, in
// the thread that asked for it (a copy into a stage that other threads still read then races with their reads, which
// ThreadSanitizer reports). A phase completes when its arrivals are in and its bytes have landed; WaitParity blocks
// (on a condition variable) until the phase of the given parity has completed.
// Fences and the L2 prefetch do nothing. Not the memory model: compute-sanitizer's racecheck on a GPU is that check.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "host_emulation.h"
#include "host_warp_mma.h"

#define MAMBAFUSE_BULK_COPY_ARCH 1

// a·b + c of each half, in double (exact for the kernels' operands: a nibble times 1/16 less 64 + zp), rounded once
// to float16 (the CUDA headers give no host __hfma2).
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  const float2 x = __half22float2(a), y = __half22float2(b), z = __half22float2(c);
  return __halves2half2(__double2half(std::fma(static_cast<double>(x.x), static_cast<double>(y.x), static_cast<double>(z.x))),
                        __double2half(std::fma(static_cast<double>(x.y), static_cast<double>(y.y), static_cast<double>(z.y))));
}

namespace mambafuse {

template <typename T>
void Mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  MmaHalf<T>(d, a, b0, b1);
}

inline uint32_t MaskOr(uint32_t a, uint32_t mask, uint32_t bits) { return (a & mask) | bits; }

inline void PrefetchL2(const void*) {}

namespace emu {

struct BulkCopy {
  unsigned char* dst;
  const void* src;
  uint32_t bytes;
};

struct Mbarrier {
  int expected = 0;  // arrivals a phase
  int pending = 0;   // arrivals still to come in this phase
  int64_t tx = 0;    // bytes this phase still waits for
  uint32_t phase = 0;
  std::vector<BulkCopy> copies;  // asked for in this phase, not landed
};

struct MbarrierTable {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<uint32_t, Mbarrier> barriers;
};

inline MbarrierTable& Mbarriers() {
  static MbarrierTable table;
  return table;
}

[[noreturn]] inline void MbarrierMisuse(const char* what, uint32_t bar) {
  std::fprintf(stderr, "host_gemv_ptx: %s (mbarrier at shared offset %u)\n", what, bar);
  std::abort();
}

inline Mbarrier& Find(MbarrierTable& table, uint32_t bar) {
  const auto it = table.barriers.find(bar);
  if (it == table.barriers.end()) MbarrierMisuse("used before its init", bar);
  return it->second;
}

// Completes the phase where its arrivals are in and its bytes have landed (the caller holds the table's lock).
inline void CompleteIfDone(MbarrierTable& table, Mbarrier& b) {
  if (b.pending == 0 && b.tx == 0) {
    b.phase += 1;
    b.pending = b.expected;
    table.changed.notify_all();
  }
}

}  // namespace emu

// The offset of a pointer into the block's emulated dynamic shared memory.
inline uint32_t SharedAddress(const void* p) {
  const auto* base = reinterpret_cast<const unsigned char*>(emu_block->shared.data());
  const auto* at = static_cast<const unsigned char*>(p);
  if (at < base || at >= base + emu_block->shared.size() * sizeof(EmuBlock::Line)) {
    std::fputs("host_gemv_ptx: SharedAddress of a pointer outside the dynamic shared memory\n", stderr);
    std::abort();
  }
  return static_cast<uint32_t>(at - base);
}

inline void MbarrierInit(uint32_t bar, int count) {
  emu::MbarrierTable& table = emu::Mbarriers();
  std::lock_guard<std::mutex> lock(table.mutex);
  emu::Mbarrier& b = table.barriers[bar];
  b = emu::Mbarrier{};
  b.expected = b.pending = count;
}

inline void FenceMbarrierInit() {}
inline void FenceProxyAsync() {}

inline void MbarrierArriveExpectTx(uint32_t bar, int bytes) {
  emu::MbarrierTable& table = emu::Mbarriers();
  std::lock_guard<std::mutex> lock(table.mutex);
  emu::Mbarrier& b = emu::Find(table, bar);
  if (b.pending <= 0) emu::MbarrierMisuse("more arrivals than its count", bar);
  b.tx += bytes;
  b.pending -= 1;
  emu::CompleteIfDone(table, b);
}

inline void MbarrierArrive(uint32_t bar) {
  emu::MbarrierTable& table = emu::Mbarriers();
  std::lock_guard<std::mutex> lock(table.mutex);
  emu::Mbarrier& b = emu::Find(table, bar);
  if (b.pending <= 0) emu::MbarrierMisuse("more arrivals than its count", bar);
  b.pending -= 1;
  emu::CompleteIfDone(table, b);
}

inline void BulkCopyToShared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  if (dst % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 || bytes % 16 != 0) {
    emu::MbarrierMisuse("a bulk copy not in whole, aligned 16-byte pieces", bar);
  }
  unsigned char* shared = reinterpret_cast<unsigned char*>(emu_block->shared.data());
  if (dst + bytes > emu_block->shared.size() * sizeof(EmuBlock::Line)) {
    emu::MbarrierMisuse("a bulk copy past the dynamic shared memory", bar);
  }
  emu::MbarrierTable& table = emu::Mbarriers();
  if (emu::CopyAtOnce()) {  // the bytes land now, in this thread, and are counted in
    std::memcpy(shared + dst, src, bytes);
    std::lock_guard<std::mutex> lock(table.mutex);
    emu::Mbarrier& b = emu::Find(table, bar);
    b.tx -= bytes;
    emu::CompleteIfDone(table, b);
    return;
  }
  std::lock_guard<std::mutex> lock(table.mutex);
  emu::Find(table, bar).copies.push_back({shared + dst, src, bytes});
  table.changed.notify_all();
}

inline void WaitParity(uint32_t bar, uint32_t parity) {
  emu::MbarrierTable& table = emu::Mbarriers();
  std::unique_lock<std::mutex> lock(table.mutex);
  for (;;) {
    emu::Mbarrier& b = emu::Find(table, bar);
    if (b.pending == 0 && !b.copies.empty()) {  // the phase's arrivals are in: its copies land now
      for (const emu::BulkCopy& copy : b.copies) {
        std::memcpy(copy.dst, copy.src, copy.bytes);
        b.tx -= copy.bytes;
      }
      b.copies.clear();
      if (b.tx < 0) emu::MbarrierMisuse("more bytes landed than the phase expected", bar);
      emu::CompleteIfDone(table, b);
    }
    if ((b.phase & 1u) != parity) return;  // the phase of this parity has completed
    table.changed.wait(lock);
  }
}

inline void BarSyncAligned(int id, int threads) { NamedBarrierSync(id, threads); }

}  // namespace mambafuse
