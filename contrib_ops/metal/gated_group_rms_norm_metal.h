// The Metal path of GatedGroupRMSNorm (Apple only, built when CMake's MAMBAFUSE_METAL is ON), as plain C++
// declarations so the CPU kernel can call it: no Objective-C or ORT types here.
//
// The CPU-provider kernel hands the op to the GPU when the user asks for it (MAMBAFUSE_METAL=1) and the
// tensor is large enough (MAMBAFUSE_METAL_MIN_ELEMENTS, default 1 << 20 elements); otherwise, and whenever
// the GPU path is unavailable, it computes on the CPU as usual. Off by default: ORT's CPU tensors are not
// Metal buffers, so each call copies its inputs and output through shared memory and waits for the GPU,
// which pays only for large prefill tensors (contrib_ops/APPLE.md). Measure on the Mac before turning it on.
#pragma once

#include <cstdint>
#include <string>

#include "gated_group_rms_norm_impl.h"

namespace mambafuse {

// Whether the CPU kernel should try the GPU for a tensor of `elements` elements (reads the environment
// once: MAMBAFUSE_METAL=1 enables, MAMBAFUSE_METAL_MIN_ELEMENTS sets the size threshold).
bool MetalWanted(int64_t elements);

// Computes the whole op (all rows and groups of `args`, already validated) on the default Metal device and
// waits for it. Returns "" on success, else why the GPU could not do it (nothing usable was written then).
std::string GatedGroupRMSNormMetal(const GatedGroupRMSNormArgs& args);

// The hook for the CPU kernel: true when the GPU computed the result (MetalWanted and success); false
// means "compute on the CPU". The first failure is reported once on stderr (the user asked for Metal).
bool TryGatedGroupRMSNormMetal(const GatedGroupRMSNormArgs& args);

}  // namespace mambafuse
