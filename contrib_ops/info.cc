// Introspection for tests and benchmarks: which CPU code path this process runs. Plain C ABI, so Python
// reads it through ctypes without ONNX Runtime.
#include "cpu/gated_group_rms_norm_impl.h"

#if defined(_WIN32)
#define MAMBAFUSE_EXPORT __declspec(dllexport)
#else
#define MAMBAFUSE_EXPORT __attribute__((visibility("default")))
#endif

extern "C" MAMBAFUSE_EXPORT const char* MambafuseCpuIsa() { return mambafuse::SelectedIsa(); }

// 1 when the library holds the CUDA kernels (built with MAMBAFUSE_CUDA), else 0.
extern "C" MAMBAFUSE_EXPORT int MambafuseCudaKernels() {
#if defined(MAMBAFUSE_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}
