// Launcher of the SquaredRelu CUDA kernel (docs/squared_relu.md): plain C++ and the CUDA runtime types only,
// because ONNX Runtime's C++ headers do not compile under nvcc 13.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cpu/squared_relu_impl.h"  // SquaredReluCpuArgs: the pointers, type and element count, no ORT types

namespace mambafuse {

// y[i] = round_T(r * r) with r = max(x[i], 0), NaN kept, for i < count; x and y device pointers of type T (float,
// float16, bfloat16), dense; y must not overlap x.
//
// Null when the arguments can be launched, else what is wrong.
const char* CheckSquaredReluArgs(const SquaredReluCpuArgs& args);

// Enqueues the op on `stream` (16 bytes a thread where x and y are 16-byte aligned, else one element a thread): no
// host synchronization, no allocation, safe under CUDA-graph capture. Returns the
// launch error, cudaErrorInvalidValue for arguments CheckSquaredReluArgs rejects, and cudaSuccess with nothing
// launched for an empty tensor.
cudaError_t LaunchSquaredRelu(const SquaredReluCpuArgs& args, cudaStream_t stream);

}  // namespace mambafuse
