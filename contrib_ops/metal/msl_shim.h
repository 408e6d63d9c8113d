// The subset of Metal Shading Language that gated_group_rms_norm.metal uses, in C++17, so the kernel's
// logic can be compiled and run on a machine without Metal. Emulates, does not imitate performance:
//
// - address-space qualifiers (device, constant, thread, threadgroup) and `kernel` expand to nothing;
//   [[buffer(n)]], [[function_constant(n)]] and the thread-position attributes are left to the compiler,
//   which ignores attributes it does not know (the warning is silenced below);
// - half and bfloat are 16-bit storage types with exact round-to-nearest-even conversions from float
//   (computed in double, independently of the CPU kernel's bit manipulation) and exact widening;
// - simd_sum combines the lanes of one emulated SIMD group; each lane is a std::thread, the lanes meet at a
//   barrier, and every lane reduces the same snapshot in the same order, so all lanes get one value, as on
//   the GPU. The order is selectable (a butterfly tree, like shuffle-xor reductions, or lane order): the
//   kernel must be within budget for any order, since Apple does not document the hardware's;
// - DispatchSimdGroups runs a kernel over threadgroups x SIMD groups x lanes and reports simd_sum calls
//   that diverge between the lanes of a SIMD group (which deadlock or misbehave on a GPU) instead of hanging.
//
// Include through contrib_ops/metal/emulation/metal_stdlib (so the kernel's `#include <metal_stdlib>`
// resolves here) and include nothing after the kernel source that uses the words defined away below.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace metal {

using uchar = unsigned char;
using ushort = unsigned short;
using uint = unsigned int;
using ulong = unsigned long;
static_assert(sizeof(ulong) == 8, "MSL's ulong is 64-bit");

namespace shim_detail {

// float -> binary16 bits, round to nearest even; overflow to Inf, NaN to a quiet NaN.
inline uint16_t FloatToHalfBits(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7E00);
  const double a = std::fabs(static_cast<double>(value));
  if (a >= 65520.0) return static_cast<uint16_t>(sign | 0x7C00);  // rounds past 65504
  if (a < 0x1p-14) {
    // Subnormal range: a count of 2^-24 units, rounded to nearest even (the default rounding mode); a
    // count of 1024 is the smallest normal, whose bits are the same number.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p24)));
  }
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  double q = std::nearbyint(std::ldexp(a, 11 - e));  // 11 significant bits: q in [1024, 2048]
  if (q == 2048.0) {
    q = 1024.0;
    ++e;
  }
  return static_cast<uint16_t>(sign | ((e - 1 + 15) << 10) | (static_cast<int>(q) - 1024));
}

inline float HalfBitsToFloat(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 31) return mantissa ? std::nanf("") : static_cast<float>(sign * HUGE_VAL);
  if (exponent == 0) return static_cast<float>(sign * std::ldexp(mantissa, -24));
  return static_cast<float>(sign * std::ldexp(1024 + mantissa, exponent - 25));
}

// float -> bfloat16 bits, round to nearest even; NaN to a quiet NaN.
inline uint16_t FloatToBFloatBits(float value) {
  const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
  if (std::isnan(value)) return static_cast<uint16_t>(sign | 0x7FC0);
  const double a = std::fabs(static_cast<double>(value));
  // 0x1.ffp127 is halfway between the largest bfloat 0x1.fep127 (odd mantissa) and 2^128: ties go to Inf.
  if (a >= 0x1.ffp127) return static_cast<uint16_t>(sign | 0x7F80);
  if (a < 0x1p-126) return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(a * 0x1p133)));
  int e = 0;
  std::frexp(a, &e);
  double q = std::nearbyint(std::ldexp(a, 8 - e));  // 8 significant bits: q in [128, 256]
  if (q == 256.0) {
    q = 128.0;
    ++e;
  }
  return static_cast<uint16_t>(sign | ((e - 1 + 127) << 7) | (static_cast<int>(q) - 128));
}

inline float BFloatBitsToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace shim_detail

struct half {
  uint16_t bits;
  half() = default;
  explicit half(float value) : bits(shim_detail::FloatToHalfBits(value)) {}
  explicit operator float() const { return shim_detail::HalfBitsToFloat(bits); }
};
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float value) : bits(shim_detail::FloatToBFloatBits(value)) {}
  explicit operator float() const { return shim_detail::BFloatBitsToFloat(bits); }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2, "16-bit storage types");

template <typename To, typename From>
inline To as_type(From value) {
  static_assert(sizeof(To) == sizeof(From), "as_type reinterprets bits of the same size");
  To result;
  std::memcpy(&result, &value, sizeof result);
  return result;
}

using std::fabs;
using std::fma;
using std::rint;
using std::sqrt;

// --- SIMD-group emulation -------------------------------------------------------------------------

enum class SimdSumOrder { kTree, kLaneOrder };

namespace shim_detail {

class SimdGroup {
 public:
  SimdGroup(int width, SimdSumOrder order) : width_(width), order_(order), slots_(static_cast<size_t>(width)) {}

  float Sum(int lane, float value) {
    slots_[static_cast<size_t>(lane)] = value;
    Arrive();  // every lane has written its value
    const float total = Reduce(lane);
    Arrive();  // every lane has read the snapshot before anyone overwrites a slot
    return total;
  }

  // A lane ran out of kernel invocations; a lane still waiting in Sum then had a simd_sum the others
  // never reach: report it instead of deadlocking.
  void Finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished_;
    changed_.notify_all();
  }

 private:
  void Arrive() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == width_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return;
    }
    changed_.wait(lock, [&] { return generation_ != generation || finished_ > 0; });
    if (generation_ == generation) {
      std::fprintf(stderr, "msl_shim: simd_sum reached by only some lanes of a SIMD group (divergent control flow)\n");
      std::abort();
    }
  }

  float Reduce(int lane) const {
    if (order_ == SimdSumOrder::kLaneOrder) {
      float sum = 0.0f;
      for (float v : slots_) sum += v;
      return sum;
    }
    // Butterfly: at each step lane i adds lane i ^ offset, as shuffle-xor reductions do. Commutative
    // pairs make every lane's result bit-identical.
    std::vector<float> values(slots_);
    std::vector<float> next(values.size());
    for (int offset = width_ / 2; offset > 0; offset /= 2) {
      for (int i = 0; i < width_; ++i) {
        next[static_cast<size_t>(i)] = values[static_cast<size_t>(i)] + values[static_cast<size_t>(i ^ offset)];
      }
      values.swap(next);
    }
    return values[static_cast<size_t>(lane)];
  }

  const int width_;
  const SimdSumOrder order_;
  std::vector<float> slots_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  int finished_ = 0;
  uint64_t generation_ = 0;
};

struct LaneContext {
  SimdGroup* group = nullptr;
  int lane = 0;
};
inline thread_local LaneContext current_lane;

}  // namespace shim_detail

inline float simd_sum(float value) {
  auto& context = shim_detail::current_lane;
  return context.group->Sum(context.lane, value);
}

// Runs `invocation(threadgroup, simdgroup, simdgroups_per_threadgroup, lane, width)` for every lane of every
// SIMD group of a 1-D grid of `threadgroups` threadgroups. The SIMD groups run one after another (their
// order is unspecified on a GPU too); the lanes of one run concurrently, one std::thread each. `width`
// must be a power of two for the tree order.
template <typename Invocation>
void DispatchSimdGroups(uint threadgroups, uint simdgroups_per_threadgroup, int width, SimdSumOrder order,
                        Invocation invocation) {
  shim_detail::SimdGroup group(width, order);
  std::vector<std::thread> lanes;
  lanes.reserve(static_cast<size_t>(width));
  for (int lane = 0; lane < width; ++lane) {
    lanes.emplace_back([&, lane] {
      shim_detail::current_lane = {&group, lane};
      for (uint tg = 0; tg < threadgroups; ++tg) {
        for (uint sg = 0; sg < simdgroups_per_threadgroup; ++sg) {
          invocation(tg, sg, simdgroups_per_threadgroup, static_cast<uint>(lane), static_cast<uint>(width));
        }
      }
      group.Finish();
    });
  }
  for (auto& lane : lanes) lane.join();
}

}  // namespace metal

// MSL keywords with no C++ meaning here. Defined last: the headers above use none of these words, and
// nothing after the kernel source may use them either (std::thread is already declared).
#define kernel
#define device
#define constant
#define thread
#define threadgroup

#if defined(__clang__)
#pragma clang diagnostic ignored "-Wunknown-attributes"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wattributes"
#endif
