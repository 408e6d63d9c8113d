// DecodeMatMul's GEMV on CUDA (the math is in decode_matmul_launcher.h and docs/decode_matmul.md, Kernels; the
// int4 kernels of DecodeMatMulNBits are in decode_matmul_nbits_impl.cu). At M <= 8 rows the product is bound by
// streaming the weight once, so the kernel is built around wide coalesced weight loads, enough of them in flight to
// fill HBM, and one pass over the weight.
//
// Dense (B (K, N) row-major): a thread owns V = 16 bytes of consecutive columns (8 float16 / bfloat16, 4 float) and
// walks rows of K; a block is 8 column threads (one 128-byte line of a weight row) times 32 row threads. Each thread
// keeps two batches of 4-8 weight rows in flight (the next batch's 16-byte loads are issued before this batch's
// FMAs) and reads A's values where it uses them (a few KB that every block reads: L1 and L2 hits); M * V float32
// FMAs per 16-byte load. K is split twice: over the block's 32 row threads (a shared-memory sum in a fixed order)
// and over the S blocks of a thread-block cluster (S <= 8, picked by an estimate of waves times rows per thread),
// whose partial sums meet in distributed shared memory: rank r adds the S partials of its share of the columns in
// rank order. One kernel, no workspace, the same sums in the same order on every call (deterministic).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "decode_matmul_common.cuh"
#include "decode_matmul_launcher.h"
#include "elem_convert.cuh"

namespace mambafuse {
namespace {

namespace cg = cooperative_groups;

// ---------------------------------------------------------------------------------------------------------------
// Dense GEMV
// ---------------------------------------------------------------------------------------------------------------

constexpr int kDenseThreads = 256;
constexpr int kDenseTx = 8;                          // column threads of a block
constexpr int kDenseTy = kDenseThreads / kDenseTx;  // row threads of a block
constexpr int kMaxCluster = 8;                       // portable cluster size

template <int M, bool kAligned>
constexpr int DenseUnroll() {  // weight rows a thread has in flight per batch (two batches overlap)
  return kAligned ? (M == 1 ? 8 : 4) : (M <= 2 ? 4 : 2);
}

template <typename T, int V>
struct alignas(16) WeightVec {
  T v[V];
};

// The weight rows base + ty + kDenseTy u (u < U) of the thread's V columns; zeros past k_end or N.
template <typename T, int V, int U, bool kAligned>
__device__ __forceinline__ void LoadWeightRows(const T* __restrict__ b, int base, int ty, int k_end, int n,
                                               int col0, WeightVec<T, V> (&w)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int row = base + ty + kDenseTy * u;
    const T* src = b + static_cast<int64_t>(row) * n + col0;
    if constexpr (kAligned) {
      if (row < k_end && col0 < n) {
        const uint4 bits = __ldg(reinterpret_cast<const uint4*>(src));
        w[u] = *reinterpret_cast<const WeightVec<T, V>*>(&bits);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) w[u].v[v] = Narrow<T>(0.f);
      }
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) w[u].v[v] = (row < k_end && col0 + v < n) ? src[v] : Narrow<T>(0.f);
    }
  }
}

// y[m, n] for the columns [col_base, col_base + kCols) of one block; K rows [k_begin, k_end) of the cluster rank.
template <typename T, int M, bool kAligned>
__global__ void __launch_bounds__(kDenseThreads, 2)
    DenseGemvKernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ y, int k, int n,
                    int rows_per_rank) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int kCols = kDenseTx * V;
  constexpr int kUnroll = DenseUnroll<M, kAligned>();
  constexpr int kChunk = kDenseTy * kUnroll;
  __shared__ float partial[kDenseTy][kCols + 1];
  __shared__ float block_sum[M * kCols];

  const int tx = static_cast<int>(threadIdx.x) % kDenseTx;
  const int ty = static_cast<int>(threadIdx.x) / kDenseTx;
  const int col_base = static_cast<int>(blockIdx.x) * kCols;
  const int col0 = col_base + tx * V;
  const int rank = static_cast<int>(blockIdx.y);
  const int k_begin = rank * rows_per_rank;
  const int k_end = min(k, k_begin + rows_per_rank);

  float acc[M][V];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int v = 0; v < V; ++v) acc[m][v] = 0.f;
  }

  // Two batches of kUnroll rows in flight: the next batch's loads are issued before this one's FMAs. A's values
  // are read where they are used (a few KB, the same for every block: L1 and L2 hits).
  WeightVec<T, V> w[kUnroll];
  LoadWeightRows<T, V, kUnroll, kAligned>(b, k_begin, ty, k_end, n, col0, w);
  for (int base = k_begin; base < k_end; base += kChunk) {
    WeightVec<T, V> next[kUnroll];
    LoadWeightRows<T, V, kUnroll, kAligned>(b, base + kChunk, ty, k_end, n, col0, next);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int row = base + ty + kDenseTy * u;
      if (row < k_end) {
        float wf[V];
#pragma unroll
        for (int v = 0; v < V; ++v) wf[v] = Widen(w[u].v[v]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float av = Widen(a[static_cast<int64_t>(m) * k + row]);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[m][v] = fmaf(av, wf[v], acc[m][v]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) w[u] = next[u];
  }

  // The block's 32 row threads, summed in row-thread order, one row of A at a time.
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int v = 0; v < V; ++v) partial[ty][tx * V + v] = acc[m][v];
    __syncthreads();
    if (threadIdx.x < kCols) {
      float s = 0.f;
#pragma unroll 8
      for (int j = 0; j < kDenseTy; ++j) s += partial[j][threadIdx.x];
      block_sum[m * kCols + threadIdx.x] = s;
    }
    __syncthreads();
  }

  // The cluster's ranks, summed in rank order; rank r writes every ranks-th of the block's M * kCols outputs.
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  if (ranks > 1) cluster.sync();
  for (int i = rank + ranks * static_cast<int>(threadIdx.x); i < M * kCols; i += ranks * kDenseThreads) {
    const int m = i / kCols, c = i % kCols;
    float s = 0.f;
    for (int q = 0; q < ranks; ++q) s += ranks > 1 ? cluster.map_shared_rank(block_sum, q)[i] : block_sum[i];
    if (col_base + c < n) y[static_cast<int64_t>(m) * n + col_base + c] = Narrow<T>(s);
  }
  if (ranks > 1) cluster.sync();  // no block leaves while another reads its shared memory
}

template <typename T, int M, bool kAligned>
cudaError_t LaunchDense(const DecodeMatMulArgs& args, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  constexpr int kCols = kDenseTx * V;
  auto kernel = DenseGemvKernel<T, M, kAligned>;
  int per_sm = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kDenseThreads, 0);
      e != cudaSuccess) {
    return e;
  }
  const int64_t slots = static_cast<int64_t>(MultiprocessorCount()) * (per_sm > 0 ? per_sm : 1);
  const int64_t col_blocks = (args.n + kCols - 1) / kCols;
  // The split with the least estimated time: waves of resident blocks times each block's rows per thread plus a
  // fixed cost (the first loads' latency and the reductions, about 16 rows' worth).
  int split = 1;
  double best = 0.0;
  for (int s = 1; s <= kMaxCluster; ++s) {
    const int64_t rows = (args.k + s - 1) / s;
    if (s > 1 && rows < kDenseTy) break;
    const int64_t waves = (col_blocks * s + slots - 1) / slots;
    // A grid smaller than the resident slots leaves bandwidth unused: its cost grows by slots / blocks.
    const double fill = std::min(1.0, static_cast<double>(col_blocks * s) / static_cast<double>(slots));
    const double cost =
        static_cast<double>(waves) * (static_cast<double>((rows + kDenseTy - 1) / kDenseTy) + 16.0) / fill;
    if (s == 1 || cost < best) best = cost, split = s;
  }
  int64_t rows_per_rank = (args.k + split - 1) / split;
  rows_per_rank = (rows_per_rank + kDenseTy - 1) / kDenseTy * kDenseTy;
  if (args.k > 0) split = static_cast<int>((args.k + rows_per_rank - 1) / rows_per_rank);
  if (split < 1) split = 1;

  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(split), 1);
  config.blockDim = dim3(kDenseThreads, 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = static_cast<unsigned>(split);
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(args.a), static_cast<const T*>(args.b),
                            static_cast<T*>(args.y), static_cast<int>(args.k), static_cast<int>(args.n),
                            static_cast<int>(rows_per_rank));
}

template <typename T, int M>
cudaError_t LaunchDenseRows(const DecodeMatMulArgs& args, cudaStream_t stream) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const bool aligned = args.n % V == 0 && reinterpret_cast<uintptr_t>(args.b) % 16 == 0;
  return aligned ? LaunchDense<T, M, true>(args, stream) : LaunchDense<T, M, false>(args, stream);
}

template <typename T>
cudaError_t LaunchDenseType(const DecodeMatMulArgs& args, cudaStream_t stream) {
  switch (args.m) {
    case 1: return LaunchDenseRows<T, 1>(args, stream);
    case 2: return LaunchDenseRows<T, 2>(args, stream);
    case 3: return LaunchDenseRows<T, 3>(args, stream);
    case 4: return LaunchDenseRows<T, 4>(args, stream);
    case 5: return LaunchDenseRows<T, 5>(args, stream);
    case 6: return LaunchDenseRows<T, 6>(args, stream);
    case 7: return LaunchDenseRows<T, 7>(args, stream);
    case 8: return LaunchDenseRows<T, 8>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

const char* CheckDecodeMatMulGemvArgs(const DecodeMatMulArgs& args) {
  if (!SupportedType(args.type)) return "the element type must be float, float16 or bfloat16";
  if (args.m < 1 || args.m > kDecodeGemvMaxRows) return "the GEMV takes 1 to 8 rows of A";
  if (args.k < 0 || args.n < 0 || args.k > INT_MAX / 2 || args.n > INT_MAX / 2) return "K and N must be in [0, 2^30)";
  if (args.k * args.n > (int64_t{1} << 40)) return "the weight is too large";
  return nullptr;
}

cudaError_t LaunchDecodeMatMulGemv(const DecodeMatMulArgs& args, cudaStream_t stream) {
  if (CheckDecodeMatMulGemvArgs(args) != nullptr) return cudaErrorInvalidValue;
  if (args.n == 0) return cudaSuccess;
  if (args.k == 0) {
    const int64_t size = args.type == kGemvFloat ? 4 : 2;
    return cudaMemsetAsync(args.y, 0, static_cast<size_t>(args.m * args.n * size), stream);
  }
  switch (args.type) {
    case kGemvFloat: return LaunchDenseType<float>(args, stream);
    case kGemvFloat16: return LaunchDenseType<__half>(args, stream);
    default: return LaunchDenseType<__nv_bfloat16>(args, stream);
  }
}

}  // namespace mambafuse
