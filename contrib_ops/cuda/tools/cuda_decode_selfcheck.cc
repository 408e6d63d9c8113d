// Self-check of the decode-step CUDA kernels (SelectiveStateUpdate, CausalConv1dUpdate) against a scalar host
// evaluation of the same math (the launchers' headers), and the driver that compute-sanitizer runs
// (tools/sanitize_decode.sh). No ONNX Runtime.
//
// Covered: every (T, S, D) type combination; optional dt_bias and D present and absent; softplus on and off;
// both SelectiveStateUpdate paths (vector and scalar) and every rows-per-lane variant (1, 2, 4); batch 1 and
// 8, G = 1, G = H and between, odd P and N, N past one warp's 16-byte chunks; misaligned buffers (the
// launcher then takes the scalar path); the conv with K = 4 (unrolled kernel) and other K, S = K - 1 and
// S = K, L = 1 and L > 1, with and without bias and SiLU. Outputs are poisoned with NaN before each launch,
// so an element never written fails.
//
// The host evaluation rounds at the same points; expf/log1pf differ from CUDA's by an ulp or two, which can
// move a T-rounded softplus or sigmoid to the neighbouring value, and the readout sums in another order. The
// tolerances allow for exactly that (one T ulp of d, relative to the magnitudes involved); a wrong index, a
// missed element or a race is off by the values themselves and fails. present_state of the conv is a copy
// and must match bit for bit. The accuracy budget against the op's reference is the pytest suite's job
// (tests/test_kernel_cuda_decode.py).
//
//   mambafuse_cuda_decode_selfcheck [--quick]     exit status 0 when every case matched, 77 without a GPU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "causal_conv1d_update_launcher.h"
#include "selective_state_update_launcher.h"

namespace {

using mambafuse::ElemType;

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    const cudaError_t error_ = (call);                                                                \
    if (error_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(error_)); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

const char* TypeName(ElemType t) { return t == ElemType::kFloat ? "f32" : t == ElemType::kFloat16 ? "f16" : "bf16"; }
size_t Bytes(ElemType t) { return t == ElemType::kFloat ? 4 : 2; }
int MantissaBits(ElemType t) { return t == ElemType::kFloat ? 23 : t == ElemType::kFloat16 ? 10 : 7; }
int MinExponent(ElemType t) { return t == ElemType::kFloat16 ? -14 : -126; }

float RoundTo(ElemType t, float v) {
  if (t == ElemType::kFloat16) return __half2float(__float2half_rn(v));
  if (t == ElemType::kBFloat16) return __bfloat162float(__float2bfloat16_rn(v));
  return v;
}

// Equal non-finite values (NaN and NaN, Inf and Inf of one sign) match; otherwise |a - e| <= tol.
bool Within(double a, double e, double tol) {
  if (std::isnan(a) || std::isnan(e)) return std::isnan(a) && std::isnan(e);
  if (std::isinf(a) || std::isinf(e)) return a == e;
  return std::fabs(a - e) <= tol;
}

double Ulp(double x, ElemType type) {
  const double mag = std::fabs(x);
  const int exponent =
      mag > 0 ? std::max(static_cast<int>(std::floor(std::log2(mag))), MinExponent(type)) : MinExponent(type);
  return std::ldexp(1.0, exponent - MantissaBits(type));
}

// Host values in a type's storage format, next to their float values (already rounded to the type).
struct HostTensor {
  ElemType type;
  std::vector<float> values;
  std::vector<unsigned char> bytes;
  HostTensor(ElemType t, size_t n) : type(t), values(n), bytes(n * Bytes(t)) {}
  void Set(size_t i, float v) {
    v = RoundTo(type, v);
    values[i] = v;
    if (type == ElemType::kFloat) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else if (type == ElemType::kFloat16) {
      const __half h = __float2half_rn(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(v);
      std::memcpy(&bytes[i * 2], &b, 2);
    }
  }
  float Get(size_t i) const {  // from bytes (device results)
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
};

// A device buffer with a copy of a host tensor at `offset` bytes (0, or off 16-byte alignment).
struct DeviceBuffer {
  void* base = nullptr;
  size_t offset = 0;
  DeviceBuffer(size_t bytes, size_t off) : offset(off) { CHECK_CUDA(cudaMalloc(&base, bytes + 64)); }
  ~DeviceBuffer() { cudaFree(base); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr() const { return static_cast<char*>(base) + offset; }
};

void Upload(const HostTensor& t, const DeviceBuffer& d, cudaStream_t s) {
  CHECK_CUDA(cudaMemcpyAsync(d.ptr(), t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice, s));
}
void Download(HostTensor& t, const DeviceBuffer& d, cudaStream_t s) {
  CHECK_CUDA(cudaMemcpyAsync(t.bytes.data(), d.ptr(), t.bytes.size(), cudaMemcpyDeviceToHost, s));
}

// --- SelectiveStateUpdate ---------------------------------------------------------------------------------

struct SsuCase {
  int64_t batch, heads, head_dim, state_size, groups;
  ElemType t, s, d;
  bool dt_bias, d_skip, softplus;
  bool misalign;
  const char* rows_env;  // MAMBAFUSE_SSU_ROWS, or null
  bool scalar;           // MAMBAFUSE_SSU_PATH=scalar
  int lanes = 0;         // MAMBAFUSE_SSU_LANES, or 0
  int shared_head = -1;  // MAMBAFUSE_SSU_SHARED_HEAD, or -1
};

std::string Describe(const SsuCase& c) {
  char text[256];
  std::snprintf(text, sizeof text,
                "SSU B=%lld H=%lld P=%lld N=%lld G=%lld T=%s S=%s D=%s dt_bias=%d D=%d softplus=%d misalign=%d "
                "rows=%s path=%s lanes=%d shared_head=%d",
                static_cast<long long>(c.batch), static_cast<long long>(c.heads), static_cast<long long>(c.head_dim),
                static_cast<long long>(c.state_size), static_cast<long long>(c.groups), TypeName(c.t), TypeName(c.s),
                TypeName(c.d), c.dt_bias, c.d_skip, c.softplus, c.misalign, c.rows_env ? c.rows_env : "auto",
                c.scalar ? "scalar" : "auto", c.lanes, c.shared_head);
  return text;
}

bool RunSsu(const SsuCase& c, std::mt19937& rng, cudaStream_t stream) {
  const int64_t B = c.batch, H = c.heads, P = c.head_dim, N = c.state_size, G = c.groups;
  const size_t n_state = static_cast<size_t>(B * H * P * N);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  HostTensor state(c.s, n_state), x(c.t, static_cast<size_t>(B * H * P)), dt(c.t, static_cast<size_t>(B * H)),
      dt_bias(c.t, static_cast<size_t>(H)), a(ElemType::kFloat, static_cast<size_t>(H)),
      bm(c.t, static_cast<size_t>(B * G * N)), cm(c.t, static_cast<size_t>(B * G * N)), d(c.d, static_cast<size_t>(H));
  for (size_t i = 0; i < n_state; ++i) state.Set(i, 2.f * normal(rng));
  for (size_t i = 0; i < x.values.size(); ++i) x.Set(i, normal(rng));
  for (size_t i = 0; i < dt.values.size(); ++i) dt.Set(i, c.softplus ? 2.f * normal(rng) - 1.f : 0.5f * uniform(rng));
  if (c.softplus && dt.values.size() > 2) dt.Set(1, 25.f);  // above softplus' threshold
  // Without softplus, d = dt + dt_bias stays >= 0 (dA <= 1), as a step size does.
  for (size_t i = 0; i < dt_bias.values.size(); ++i) {
    dt_bias.Set(i, c.softplus ? 0.5f * normal(rng) : 0.5f * uniform(rng));
  }
  for (size_t i = 0; i < a.values.size(); ++i) a.Set(i, -std::exp(1.5f * normal(rng)));
  for (size_t i = 0; i < bm.values.size(); ++i) {
    bm.Set(i, normal(rng));
    cm.Set(i, normal(rng));
  }
  for (size_t i = 0; i < d.values.size(); ++i) d.Set(i, normal(rng));

  const auto off = [&](ElemType t) { return c.misalign ? Bytes(t) : 0; };
  DeviceBuffer d_state(state.bytes.size(), off(c.s)), d_x(x.bytes.size(), off(c.t)), d_dt(dt.bytes.size(), off(c.t)),
      d_bias(dt_bias.bytes.size(), 0), d_a(a.bytes.size(), 0), d_b(bm.bytes.size(), off(c.t)),
      d_c(cm.bytes.size(), c.misalign ? 2 * Bytes(c.t) : 0), d_d(d.bytes.size(), 0),
      d_out(x.bytes.size(), off(c.t)), d_present(state.bytes.size(), c.misalign ? 3 * Bytes(c.s) : 0);
  Upload(state, d_state, stream);
  Upload(x, d_x, stream);
  Upload(dt, d_dt, stream);
  Upload(dt_bias, d_bias, stream);
  Upload(a, d_a, stream);
  Upload(bm, d_b, stream);
  Upload(cm, d_c, stream);
  Upload(d, d_d, stream);
  CHECK_CUDA(cudaMemsetAsync(d_out.ptr(), 0xFF, x.bytes.size(), stream));  // NaN poison: unwritten shows
  CHECK_CUDA(cudaMemsetAsync(d_present.ptr(), 0xFF, state.bytes.size(), stream));

  mambafuse::SelectiveStateUpdateArgs args;
  args.state = d_state.ptr();
  args.x = d_x.ptr();
  args.dt = d_dt.ptr();
  args.dt_bias = c.dt_bias ? d_bias.ptr() : nullptr;
  args.a = static_cast<const float*>(d_a.ptr());
  args.b = d_b.ptr();
  args.c = d_c.ptr();
  args.d = c.d_skip ? d_d.ptr() : nullptr;
  args.out = d_out.ptr();
  args.present_state = d_present.ptr();
  args.t_type = c.t;
  args.s_type = c.s;
  args.d_type = c.d;
  args.batch = B;
  args.heads = H;
  args.head_dim = P;
  args.state_size = N;
  args.groups = G;
  args.dt_softplus = c.softplus;
  if (c.rows_env) setenv("MAMBAFUSE_SSU_ROWS", c.rows_env, 1);
  if (c.scalar) setenv("MAMBAFUSE_SSU_PATH", "scalar", 1);
  if (c.lanes) setenv("MAMBAFUSE_SSU_LANES", std::to_string(c.lanes).c_str(), 1);
  if (c.shared_head >= 0) setenv("MAMBAFUSE_SSU_SHARED_HEAD", c.shared_head ? "1" : "0", 1);
  const cudaError_t launched = mambafuse::LaunchSelectiveStateUpdate(args, stream);
  unsetenv("MAMBAFUSE_SSU_ROWS");
  unsetenv("MAMBAFUSE_SSU_PATH");
  unsetenv("MAMBAFUSE_SSU_LANES");
  unsetenv("MAMBAFUSE_SSU_SHARED_HEAD");
  CHECK_CUDA(launched);
  HostTensor out(c.t, x.values.size()), present(c.s, n_state);
  Download(out, d_out, stream);
  Download(present, d_present, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));

  // The host evaluation, and the comparison.
  const double rel = std::ldexp(1.0, -MantissaBits(c.t) + 1);  // one T ulp of d, relative, with margin
  size_t bad_state = 0, bad_out = 0;
  double worst = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b * H + h);
      float dv = dt.values[bh];
      if (c.dt_bias) dv = RoundTo(c.t, dv + dt_bias.values[static_cast<size_t>(h)]);
      if (c.softplus) dv = dv > 20.f ? dv : RoundTo(c.t, std::log1p(std::exp(dv)));
      const float da = std::exp(dv * a.values[static_cast<size_t>(h)]);
      const size_t bg = static_cast<size_t>(b * G + h / (H / G));
      for (int64_t p = 0; p < P; ++p) {
        const size_t row = bh * static_cast<size_t>(P) + static_cast<size_t>(p);
        const float xv = x.values[row];
        float acc = 0.f;
        double magnitude = 0;  // sum_n |C| (|state| + 2 |dBx|): the readout's sensitivity
        for (int64_t n = 0; n < N; ++n) {
          const size_t i = row * static_cast<size_t>(N) + static_cast<size_t>(n);
          const size_t bn = bg * static_cast<size_t>(N) + static_cast<size_t>(n);
          const float db = RoundTo(c.t, dv * bm.values[bn]);
          const float dbx = RoundTo(c.t, db * xv);
          const float decayed = state.values[i] * da;
          const float s = RoundTo(c.s, decayed + dbx);
          acc += RoundTo(c.t, s) * cm.values[bn];
          // One T ulp of d moves dA by |d A| ulps, which moves state * dA by at most 0.37 ulps of the state
          // (x e^-x <= 1/e): the bound is relative to the state before the decay.
          const double scale = std::fabs(state.values[i]) + 2 * std::fabs(dbx);
          magnitude += std::fabs(cm.values[bn]) * scale;
          const double got = present.Get(i);
          const double tol = 2 * Ulp(s, c.s) + rel * scale;
          if (!Within(got, s, tol)) {
            if (bad_state++ < 3) {
              std::fprintf(stderr, "  present[%lld,%lld,%lld,%lld] = %.8g, expected %.8g\n", static_cast<long long>(b),
                           static_cast<long long>(h), static_cast<long long>(p), static_cast<long long>(n), got, s);
            }
          }
        }
        float y = RoundTo(c.t, acc);
        double skip = 0;
        if (c.d_skip) {
          const float xd = RoundTo(c.t, xv * d.values[static_cast<size_t>(h)]);
          skip = std::fabs(xd);
          y = RoundTo(c.t, y + xd);
        }
        const double got = out.Get(row);
        const double tol = 2 * Ulp(y, c.t) + (rel + std::ldexp(1.0, -20)) * magnitude + rel * skip;
        const double err = std::fabs(got - y);
        if (!Within(got, y, tol)) {
          if (bad_out++ < 3) {
            std::fprintf(stderr, "  out[%lld,%lld,%lld] = %.8g, expected %.8g (tolerance %.3g)\n",
                         static_cast<long long>(b), static_cast<long long>(h), static_cast<long long>(p), got, y, tol);
          }
        }
        if (tol > 0 && err == err && err / tol > worst) worst = err / tol;
      }
    }
  }
  if (bad_state || bad_out) {
    std::fprintf(stderr, "FAIL %s: %zu state and %zu output elements differ (worst output %.3g x tolerance)\n",
                 Describe(c).c_str(), bad_state, bad_out, worst);
    return false;
  }
  return true;
}

// --- CausalConv1dUpdate ------------------------------------------------------------------------------------

struct ConvCase {
  int64_t batch, channels, length, state_len, kernel_size;
  ElemType t;
  bool bias, silu;
};

std::string Describe(const ConvCase& c) {
  char text[200];
  std::snprintf(text, sizeof text, "CONV B=%lld C=%lld L=%lld S=%lld K=%lld T=%s bias=%d silu=%d",
                static_cast<long long>(c.batch), static_cast<long long>(c.channels), static_cast<long long>(c.length),
                static_cast<long long>(c.state_len), static_cast<long long>(c.kernel_size), TypeName(c.t), c.bias,
                c.silu);
  return text;
}

bool RunConv(const ConvCase& c, std::mt19937& rng, cudaStream_t stream) {
  const int64_t B = c.batch, C = c.channels, L = c.length, S = c.state_len, K = c.kernel_size;
  std::normal_distribution<float> normal(0.f, 1.f);
  HostTensor x(c.t, static_cast<size_t>(B * C * L)), state(c.t, static_cast<size_t>(B * C * S)),
      w(c.t, static_cast<size_t>(C * K)), bias(c.t, static_cast<size_t>(C));
  for (auto* t : {&x, &state, &w, &bias}) {
    for (size_t i = 0; i < t->values.size(); ++i) t->Set(i, normal(rng));
  }
  DeviceBuffer d_x(x.bytes.size(), 0), d_state(state.bytes.size(), 0), d_w(w.bytes.size(), 0),
      d_bias(bias.bytes.size(), 0), d_y(x.bytes.size(), 0), d_present(state.bytes.size(), 0);
  Upload(x, d_x, stream);
  Upload(state, d_state, stream);
  Upload(w, d_w, stream);
  Upload(bias, d_bias, stream);
  CHECK_CUDA(cudaMemsetAsync(d_y.ptr(), 0xFF, x.bytes.size(), stream));
  CHECK_CUDA(cudaMemsetAsync(d_present.ptr(), 0xFF, state.bytes.size(), stream));
  mambafuse::CausalConv1dUpdateArgs args;
  args.x = d_x.ptr();
  args.conv_state = d_state.ptr();
  args.weight = d_w.ptr();
  args.bias = c.bias ? d_bias.ptr() : nullptr;
  args.y = d_y.ptr();
  args.present_state = d_present.ptr();
  args.type = c.t;
  args.batch = B;
  args.channels = C;
  args.length = L;
  args.state_len = S;
  args.kernel_size = K;
  args.silu = c.silu;
  CHECK_CUDA(mambafuse::LaunchCausalConv1dUpdate(args, stream));
  HostTensor y(c.t, x.values.size()), present(c.t, state.values.size());
  Download(y, d_y, stream);
  Download(present, d_present, stream);
  CHECK_CUDA(cudaStreamSynchronize(stream));

  size_t bad = 0;
  for (int64_t row = 0; row < B * C; ++row) {
    const int64_t ch = row % C;
    const auto window = [&](int64_t i) {
      return i < S ? state.values[static_cast<size_t>(row * S + i)] : x.values[static_cast<size_t>(row * L + i - S)];
    };
    for (int64_t j = 0; j < S; ++j) {  // a copy: bit for bit
      const size_t i = static_cast<size_t>(row * S + j);
      const size_t from = static_cast<size_t>(L + j < S ? row * S + L + j : row * L + L + j - S);
      const auto& source = L + j < S ? state.bytes : x.bytes;
      if (std::memcmp(&present.bytes[i * Bytes(c.t)], &source[from * Bytes(c.t)], Bytes(c.t)) != 0 && bad++ < 3) {
        std::fprintf(stderr, "  present[%lld, %lld] is not window[%lld]\n", static_cast<long long>(row),
                     static_cast<long long>(j), static_cast<long long>(L + j));
      }
    }
    for (int64_t t = 0; t < L; ++t) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w.values[static_cast<size_t>(ch * K + k)] * window(S - K + 1 + t + k);
      if (c.bias) acc += bias.values[static_cast<size_t>(ch)];
      const float v = RoundTo(c.t, acc);
      float expected = v;
      if (c.silu) expected = RoundTo(c.t, v * RoundTo(c.t, 1.f / (1.f + std::exp(-v))));
      const double got = y.Get(static_cast<size_t>(row * L + t));
      const double tol = 2 * Ulp(expected, c.t) + std::ldexp(std::fabs(v), -MantissaBits(c.t));
      if (!Within(got, expected, tol) && bad++ < 3) {
        std::fprintf(stderr, "  y[%lld, %lld] = %.8g, expected %.8g\n", static_cast<long long>(row),
                     static_cast<long long>(t), got, expected);
      }
    }
  }
  if (bad != 0) {
    std::fprintf(stderr, "FAIL %s: %zu elements differ\n", Describe(c).c_str(), bad);
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
  std::mt19937 rng(20261201);
  const ElemType kTypes[] = {ElemType::kFloat, ElemType::kFloat16, ElemType::kBFloat16};

  std::vector<SsuCase> ssu;
  struct Shape {
    int64_t batch, heads, head_dim, state_size, groups;
  };
  // (B, H, P, N, G): G = 1, G = H and between; odd P and N; N = 256 and 512 (two chunks a lane, and past
  // the vector path for float state); Nemotron-H-8B's width at batch 1.
  const Shape shapes[] = {{1, 4, 8, 16, 1},   {2, 6, 5, 24, 3},  {3, 8, 16, 128, 8},  {8, 16, 64, 64, 1},
                          {2, 4, 7, 256, 2},  {1, 3, 3, 33, 1},  {1, 2, 64, 512, 1},  {8, 12, 17, 128, 4},
                          {1, 128, 64, 128, 8}};
  int turn = 0;
  for (ElemType t : kTypes) {
    for (ElemType s : {ElemType::kFloat, t}) {
      for (ElemType d : {t, ElemType::kFloat}) {
        for (const Shape& sh : shapes) {
          if (quick && sh.heads * sh.head_dim * sh.state_size > 20000) continue;
          const int v = turn++;
          ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, d, v % 2 == 0, v % 3 != 2,
                         v % 5 != 4, false, nullptr, false});
        }
        if (d == t && t == ElemType::kFloat) break;  // D float is D of type T
      }
      if (s == t) break;  // S = T is S = float for T = float
    }
  }
  // Every path and rows-per-lane variant, and misaligned buffers, per type pair on three shapes (N = 16: rows
  // wider than a half state's two lanes, whose readout is lane 0's alone).
  for (ElemType t : kTypes) {
    for (ElemType s : {ElemType::kFloat, t}) {
      for (const Shape& sh : {shapes[0], shapes[2], shapes[4]}) {
        for (const char* rows : {"1", "2", "4"}) {
          for (bool scalar : {false, true}) {
            if (quick && rows[0] != '4' && scalar) continue;
            ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, t, true, true, true, false,
                           rows, scalar});
          }
        }
        ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, t, true, true, true, true,
                       nullptr, false});
      }
      // Half the vector path's lanes a row, two chunks a lane (N = 64 and 128; N = 256 with a half state).
      for (const Shape& sh : {shapes[2], shapes[3], shapes[4]}) {
        const int64_t chunks = sh.state_size * static_cast<int64_t>(Bytes(s)) / 16;
        int own = 1;
        while (own < chunks && own < 32) own *= 2;
        if (own < 2 || own / 2 * 2 < chunks) continue;
        for (const char* rows : {"1", "2", "4"}) {
          if (quick && rows[0] != '2') continue;
          ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, t, true, true, true, false,
                         rows, false, own / 2});
        }
      }
      // The per-head chain shared through shared memory, and not shared where the launcher would share it.
      for (const Shape& sh : {shapes[0], shapes[1], shapes[3], shapes[4], shapes[7]}) {
        for (const char* rows : {"1", "2", "4"}) {
          if (quick && rows[0] == '1') continue;
          ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, t, rows[0] != '2', true,
                         rows[0] != '1', false, rows, false, 0, 1});
        }
        if (s == t) {
          ssu.push_back({sh.batch, sh.heads, sh.head_dim, sh.state_size, sh.groups, t, s, t, true, true, true, false,
                         "4", false, 0, 0});
        }
      }
      if (s == t) break;
    }
  }

  std::vector<ConvCase> conv;
  struct ConvShape {
    int64_t batch, channels, length, state_len, kernel_size;
  };
  const ConvShape conv_shapes[] = {{1, 10240, 1, 3, 4}, {8, 300, 1, 4, 4}, {2, 129, 1, 3, 4}, {3, 70, 5, 3, 4},
                                   {2, 64, 1, 2, 3},    {1, 33, 4, 5, 2},  {2, 17, 1, 7, 6},  {1, 5, 2, 0, 1},
                                   {2, 40, 1, 6, 4}};
  turn = 0;
  for (ElemType t : kTypes) {
    for (const ConvShape& sh : conv_shapes) {
      const int v = turn++;
      conv.push_back({sh.batch, sh.channels, sh.length, sh.state_len, sh.kernel_size, t, v % 2 == 0, v % 3 != 1});
      if (!quick) conv.push_back({sh.batch, sh.channels, sh.length, sh.state_len, sh.kernel_size, t, v % 2 != 0, true});
    }
  }

  int failed = 0;
  for (const SsuCase& c : ssu) failed += !RunSsu(c, rng, stream);
  for (const ConvCase& c : conv) failed += !RunConv(c, rng, stream);
  CHECK_CUDA(cudaStreamDestroy(stream));
  std::printf("cuda decode selfcheck: %zu SelectiveStateUpdate and %zu CausalConv1dUpdate cases, %d failed\n",
              ssu.size(), conv.size(), failed);
  return failed == 0 ? 0 : 1;
}
