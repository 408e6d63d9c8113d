// The instruction-set dispatch every math core shares. A core's entry point
//   void <Items>(const <Args>& args, int64_t first_item, int64_t last_item)
// is compiled once per level, in namespace mambafuse::isa_<level> (contrib_ops/CMakeLists.txt, _isa_variants:
// generic everywhere, plus AVX2 and AVX-512 on x86-64, where MAMBAFUSE_X86_DISPATCH is defined). The level is
// the one SelectedIsa() names, chosen once by the gated norm's dispatcher, so every op of the library runs on one
// level in a process. In an <op>_impl.cc, inside namespace mambafuse:
//
//   MAMBAFUSE_DECLARE_ISA_ITEMS(MyOpCpuArgs, MyOpItems)
//   void MyOpCpu(const MyOpCpuArgs& args, int64_t first_item, int64_t last_item) {
//     static const auto items = ForSelectedIsa(MAMBAFUSE_ISA_ITEMS(MyOpItems));
//     items(args, first_item, last_item);
//   }
#pragma once

#include <cstdint>
#include <cstring>

#include "gated_group_rms_norm_impl.h"  // SelectedIsa

namespace mambafuse {

// Declares the entry point `items_fn` of every level (a macro: each level is a namespace of its own), and lists
// them, generic first, as ForSelectedIsa's arguments.
#define MAMBAFUSE_DECLARE_ISA_ITEMS_IN(ns, Args, items_fn)              \
  namespace ns {                                                         \
  void items_fn(const Args& args, int64_t first_item, int64_t last_item); \
  }
#if defined(MAMBAFUSE_X86_DISPATCH)
#define MAMBAFUSE_DECLARE_ISA_ITEMS(Args, items_fn)             \
  MAMBAFUSE_DECLARE_ISA_ITEMS_IN(isa_generic, Args, items_fn) \
  MAMBAFUSE_DECLARE_ISA_ITEMS_IN(isa_avx2, Args, items_fn)    \
  MAMBAFUSE_DECLARE_ISA_ITEMS_IN(isa_avx512, Args, items_fn)
#define MAMBAFUSE_ISA_ITEMS(items_fn) &isa_generic::items_fn, &isa_avx2::items_fn, &isa_avx512::items_fn
#else
#define MAMBAFUSE_DECLARE_ISA_ITEMS(Args, items_fn) MAMBAFUSE_DECLARE_ISA_ITEMS_IN(isa_generic, Args, items_fn)
#define MAMBAFUSE_ISA_ITEMS(items_fn) &isa_generic::items_fn
#endif

// Returns the entry point of the level SelectedIsa() names: `avx512` or `avx2` where this build has them (x86-64),
// else `generic` (the baseline: SSE2 on x86-64, NEON on AArch64).
template <typename ItemsFn>
ItemsFn ForSelectedIsa(ItemsFn generic, ItemsFn avx2 = nullptr, ItemsFn avx512 = nullptr) {
  const char* isa = SelectedIsa();
  if (avx512 != nullptr && std::strcmp(isa, "avx512") == 0) return avx512;
  if (avx2 != nullptr && std::strcmp(isa, "avx2") == 0) return avx2;
  return generic;
}

}  // namespace mambafuse
