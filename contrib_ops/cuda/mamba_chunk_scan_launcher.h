// Launcher of the MambaChunkScan CUDA kernels (docs/mamba_chunk_scan.md, Kernel): plain C++ and the CUDA runtime
// types only, because ONNX Runtime's C++ headers do not compile under nvcc 13.
#pragma once

#include <cuda_runtime_api.h>

#include "cpu/mamba_chunk_scan_impl.h"  // MambaChunkScanCpuArgs: the op's dims, types and pointers, no ORT types

namespace mambafuse {

// The two kernels. Chunked: the SSD algorithm in chunks of kCudaChunkSize tokens, its products on tensor cores in
// TF32 with the float32 operands split in two TF32 parts (so the products keep float32 accuracy), one block a
// (batch row, head) carrying the state from chunk to chunk in shared memory. Sequential: the recurrence token by
// token, one warp a head channel p; it takes any P and N. Step: a one-token prompt (a decode step) over the state
// once; any P and N.
enum class ChunkScanCudaPath { kAuto, kChunked, kSequential, kStep };

inline constexpr int kCudaChunkSize = 64;

// The path `requested` resolves to for these dims on the current device: kAuto is the step kernel for a one-token
// prompt, else the chunked kernel where P is at most 128 (its output tiles live in registers) and its shared memory
// fits (P and N up to 128 each), else the sequential one; kChunked where it does not fit is answered with
// kSequential too, and kStep for a longer prompt as kAuto is. Reads the device's
// shared-memory limit (no synchronization).
ChunkScanCudaPath ResolveChunkScanCudaPath(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath requested);

// Null when the arguments can be launched (pointers on the device), else what is wrong.
const char* CheckMambaChunkScanCudaArgs(const MambaChunkScanCpuArgs& args);

// Enqueues the op on `stream`: no host synchronization, no allocation, safe under CUDA-graph capture. Returns the
// launch error, cudaErrorInvalidValue for arguments CheckMambaChunkScanCudaArgs rejects, and cudaSuccess with
// nothing launched for an empty batch or no heads.
cudaError_t LaunchMambaChunkScan(const MambaChunkScanCpuArgs& args, ChunkScanCudaPath path, cudaStream_t stream);

}  // namespace mambafuse
