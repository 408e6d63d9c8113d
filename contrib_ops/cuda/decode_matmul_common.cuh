// What the DecodeMatMul and DecodeMatMulNBits kernel files share: the multiprocessor count their grids are sized by
// and the element types they take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "decode_matmul_launcher.h"

namespace mambafuse {

// The current device's multiprocessors (132, an H100's or H200's, where the runtime does not say).
inline int MultiprocessorCount() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    return 132;
  }
  return count;
}

inline bool SupportedType(int64_t type) {
  return type == kGemvFloat || type == kGemvFloat16 || type == kGemvBFloat16;
}

}  // namespace mambafuse
