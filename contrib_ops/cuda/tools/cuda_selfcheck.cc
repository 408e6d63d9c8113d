// Self-check of the CUDA kernels against the CPU math core, and the small driver that compute-sanitizer runs
// (tools/sanitize.sh). Every (Y, Z, W) load type x (norm, output, storage) epilogue on both paths, each with
// one of the three gated_dtype roundings (none, float16, bfloat16, in turn), the test shapes with every
// gated_dtype, unaligned buffers (each input and the output one element off 16 bytes) and NaN/zero groups.
// The accuracy budget against the float64 reference is the pytest suite's job (tests/test_kernel_cuda.py);
// here a difference beyond two output ulps (plus one norm-type ulp times |w| where the norm type is coarser)
// means a wrong index, a missed element or a race, and fails. With a gated_dtype rounding, CPU and GPU may round
// a tie-close h to neighbouring half values (their float32 h differ by a few ulps): one gated-type ulp of
// the value on top.
//
//   mambafuse_cuda_selfcheck [--quick]     exit status 0 when every case matched
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cpu/gated_group_rms_norm_impl.h"
#include "gated_group_rms_norm_launcher.h"

namespace {

using mambafuse::CudaPath;
using mambafuse::ElemType;

constexpr ElemType kTypes[] = {ElemType::kFloat, ElemType::kFloat16, ElemType::kBFloat16};

const char* TypeName(ElemType t) { return t == ElemType::kFloat ? "f32" : t == ElemType::kFloat16 ? "f16" : "bf16"; }
size_t Bytes(ElemType t) { return t == ElemType::kFloat ? 4 : 2; }
int MantissaBits(ElemType t) { return t == ElemType::kFloat ? 23 : t == ElemType::kFloat16 ? 10 : 7; }
int MinExponent(ElemType t) { return t == ElemType::kFloat16 ? -14 : -126; }

#define CHECK_CUDA(call)                                                                                \
  do {                                                                                                  \
    const cudaError_t error_ = (call);                                                                  \
    if (error_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(error_));   \
      std::exit(2);                                                                                     \
    }                                                                                                   \
  } while (0)

// Host values in the storage format of `type`.
void Store(ElemType type, std::vector<unsigned char>& bytes, size_t i, float value) {
  if (type == ElemType::kFloat) {
    std::memcpy(&bytes[i * 4], &value, 4);
  } else if (type == ElemType::kFloat16) {
    const __half h = __float2half_rn(value);
    std::memcpy(&bytes[i * 2], &h, 2);
  } else {
    const __nv_bfloat16 b = __float2bfloat16_rn(value);
    std::memcpy(&bytes[i * 2], &b, 2);
  }
}

float Load(ElemType type, const std::vector<unsigned char>& bytes, size_t i) {
  if (type == ElemType::kFloat) {
    float f;
    std::memcpy(&f, &bytes[i * 4], 4);
    return f;
  }
  if (type == ElemType::kFloat16) {
    __half h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return __half2float(h);
  }
  __nv_bfloat16 b;
  std::memcpy(&b, &bytes[i * 2], 2);
  return __bfloat162float(b);
}

double Ulp(double x, ElemType type) {
  const double mag = std::fabs(x);
  const int exponent = mag > 0 ? std::max(static_cast<int>(std::floor(std::log2(mag))), MinExponent(type)) : MinExponent(type);
  return std::ldexp(1.0, exponent - MantissaBits(type));
}

struct Case {
  int64_t rows, channels, group_size;
  ElemType y, z, w, norm, out, store;
  CudaPath path;
  ElemType gated;  // kFloat: no rounding of h
  int misalign;  // elements: 0, or 1 = every buffer off 16-byte alignment, 2 = only the gate
  bool specials;
};

// Device buffer with room for a misaligned view.
struct DeviceBuffer {
  void* base = nullptr;
  explicit DeviceBuffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&base, bytes + 64)); }
  ~DeviceBuffer() { cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* at(size_t offset_bytes) const { return static_cast<char*>(base) + offset_bytes; }
};

std::string Describe(const Case& c) {
  char text[256];
  std::snprintf(text, sizeof text,
                "[%lld x %lld / %lld] y=%s z=%s w=%s norm=%s out=%s store=%s gated=%s path=%s misalign=%d%s",
                static_cast<long long>(c.rows), static_cast<long long>(c.channels), static_cast<long long>(c.group_size),
                TypeName(c.y), TypeName(c.z), TypeName(c.w), TypeName(c.norm), TypeName(c.out), TypeName(c.store),
                TypeName(c.gated), c.path == CudaPath::kWarp ? "warp" : c.path == CudaPath::kVector ? "vector" : "auto",
                c.misalign, c.specials ? " specials" : "");
  return text;
}

bool RunCase(const Case& c, std::mt19937& rng, cudaStream_t stream) {
  const size_t n = static_cast<size_t>(c.rows * c.channels);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<unsigned char> y(n * Bytes(c.y)), z(n * Bytes(c.z)), w(static_cast<size_t>(c.channels) * Bytes(c.w));
  for (size_t i = 0; i < n; ++i) {
    Store(c.y, y, i, normal(rng));
    Store(c.z, z, i, 2.f * normal(rng));
  }
  for (size_t i = 0; i < static_cast<size_t>(c.channels); ++i) Store(c.w, w, i, 1.f + 0.5f * normal(rng));
  if (c.specials && c.channels / c.group_size >= 4 && c.rows >= 2) {
    const size_t gs = static_cast<size_t>(c.group_size);
    for (size_t j = 0; j < gs; ++j) Store(c.y, y, j, 0.f);            // row 0, group 0: zeros
    for (size_t j = 0; j < gs; ++j) Store(c.z, z, gs + j, 0.f);       // row 0, group 1: zero gate
    Store(c.y, y, static_cast<size_t>(c.channels) + 2 * gs + 1, NAN);  // row 1, group 2: NaN
    Store(c.z, z, static_cast<size_t>(c.channels) + 3 * gs, INFINITY); // row 1, group 3: +Inf gate
  }
  const size_t off_y = c.misalign == 1 ? Bytes(c.y) : 0, off_z = c.misalign ? Bytes(c.z) : 0;
  const size_t off_w = c.misalign == 1 ? Bytes(c.w) : 0, off_o = c.misalign == 1 ? Bytes(c.store) : 0;
  DeviceBuffer dy(y.size()), dz(z.size()), dw(w.size()), dout(n * Bytes(c.store));
  CHECK_CUDA(cudaMemcpyAsync(dy.at(off_y), y.data(), y.size(), cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaMemcpyAsync(dz.at(off_z), z.data(), z.size(), cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaMemcpyAsync(dw.at(off_w), w.data(), w.size(), cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaMemsetAsync(dout.at(off_o), 0xFF, n * Bytes(c.store), stream));  // NaN poison: unwritten shows

  mambafuse::GatedGroupRMSNormArgs args;
  args.y_type = c.y;
  args.z_type = c.z;
  args.w_type = c.w;
  args.norm_type = c.norm;
  args.out_type = c.out;
  args.out_storage_type = c.store;
  args.gated_type = c.gated;
  args.rows = c.rows;
  args.channels = c.channels;
  args.group_size = c.group_size;
  args.epsilon = 1e-5f;
  args.y = dy.at(off_y);
  args.z = dz.at(off_z);
  args.w = dw.at(off_w);
  args.out = dout.at(off_o);
  if (const char* problem = mambafuse::ValidateArgs(args)) {
    std::fprintf(stderr, "FAIL %s: invalid args: %s\n", Describe(c).c_str(), problem);
    return false;
  }
  CHECK_CUDA(mambafuse::LaunchGatedGroupRMSNorm(args, stream, c.path));
  std::vector<unsigned char> out(n * Bytes(c.store)), expected(n * Bytes(c.store));
  CHECK_CUDA(cudaMemcpyAsync(out.data(), dout.at(off_o), out.size(), cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));

  args.y = y.data();
  args.z = z.data();
  args.w = w.data();
  args.out = expected.data();
  mambafuse::GatedGroupRMSNormCpu(args, 0, c.rows * (c.channels / c.group_size));

  const bool coarser_norm = MantissaBits(c.norm) < MantissaBits(c.out);
  size_t bad = 0;
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double a = Load(c.store, out, i), e = Load(c.store, expected, i);
    if (std::isnan(e) || std::isnan(a)) {
      bad += std::isnan(e) != std::isnan(a);
      continue;
    }
    if (std::isinf(e) || std::isinf(a)) {
      bad += a != e;
      continue;
    }
    const double wv = std::fabs(Load(c.w, w, i % static_cast<size_t>(c.channels)));
    // float outputs: both kernels are within 2e-6 of the exact value (docs/op.md), so within 4e-6 of each other.
    double tol = c.out == ElemType::kFloat ? std::max(2 * Ulp(e, c.out), 4e-6 * std::fabs(e)) : 2 * Ulp(e, c.out);
    if (coarser_norm) tol += wv * Ulp(wv > 0 ? e / wv : 0.0, c.norm);
    if (c.gated != ElemType::kFloat) tol += std::ldexp(std::fabs(e), -MantissaBits(c.gated)) + Ulp(e, c.out);
    const double err = std::fabs(a - e);
    if (err > tol) ++bad;
    if (tol > 0 && err / tol > worst) worst = err / tol;
  }
  if (bad != 0) {
    std::fprintf(stderr, "FAIL %s: %zu of %zu elements differ from the CPU kernel (worst %.3g x tolerance)\n",
                 Describe(c).c_str(), bad, n, worst);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 77;
  }
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::mt19937 rng(20240611);
  std::vector<Case> cases;
  const CudaPath paths[] = {CudaPath::kWarp, CudaPath::kVector};
  // Every load-type x epilogue combination, both paths (the storage type is float or the output type).
  int combination = 0;
  for (ElemType y : kTypes)
    for (ElemType z : kTypes)
      for (ElemType w : kTypes)
        for (ElemType norm : kTypes)
          for (ElemType out : kTypes)
            for (ElemType store : {out, ElemType::kFloat}) {
              const ElemType gated = kTypes[combination++ % 3];
              for (CudaPath path : paths) {
                if (quick && (y != z || z != w)) continue;
                cases.push_back({3, 96, 48, y, z, w, norm, out, store, path, gated, 0, false});
              }
              if (out == ElemType::kFloat) break;  // {out, float} is one storage type for float outputs
            }
  // Shapes of the test suite, per uniform type, both paths, aligned and misaligned, with special values.
  struct Shape {
    int64_t rows, channels, group_size;
  };
  const Shape shapes[] = {{1, 7680, 960}, {15, 96, 48}, {4, 120, 40}, {6, 64, 64},  {64, 8192, 1024},
                          {5, 24, 1},     {2, 100, 25}, {3, 8192, 8192}, {2, 16384, 16384}, {7, 256, 8}};
  for (const Shape& s : shapes)
    for (ElemType t : kTypes)
      for (CudaPath path : {CudaPath::kAuto, CudaPath::kWarp, CudaPath::kVector})
        for (int misalign : {0, 1, 2})
          for (ElemType gated : kTypes) {
            if (quick && (misalign == 2 || path == CudaPath::kAuto || gated != ElemType::kFloat)) continue;
            if (gated != ElemType::kFloat && misalign == 2) continue;  // the gate-only misalignment: no rounding
            cases.push_back({s.rows, s.channels, s.group_size, t, t, t, t, t, t, path, gated, misalign,
                             s.channels / s.group_size >= 4});
          }
  // The exporters' half prefill form B (float32 Y and W, half gate and output), which has specialized kernels.
  for (const Shape& s : shapes)
    for (ElemType gate : {ElemType::kFloat16, ElemType::kBFloat16})
      for (CudaPath path : {CudaPath::kAuto, CudaPath::kVector})
        for (int misalign : {0, 1}) {
          if (quick && (misalign == 1 || path == CudaPath::kAuto)) continue;
          cases.push_back({s.rows, s.channels, s.group_size, ElemType::kFloat, gate, ElemType::kFloat, ElemType::kFloat,
                           gate, gate, path, ElemType::kFloat, misalign, s.channels / s.group_size >= 4});
        }
  int failed = 0;
  for (const Case& c : cases) failed += !RunCase(c, rng, stream);
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("cuda selfcheck: %zu cases, %d failed\n", cases.size(), failed);
  return failed == 0 ? 0 : 1;
}
