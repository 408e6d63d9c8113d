// Times the CPU math core alone (no ONNX Runtime): GatedGroupRMSNormCpu over one [rows, C] tensor.
//
//   kernel_bench [--rows=N] [--channels=C] [--group-size=G] [--type=f32|f16|bf16] [--gated=f32|f16|bf16]
//                [--norm=f32|f16|bf16] [--out=f32|f16|bf16] [--values=normal|denormal] [--reps=N] [--calls=N]
//
// --norm / --out: norm_dtype / output_dtype (default: --type); an --out other than --type is stored widened
// to float (what ORT's CPU fp16 fallback hands the op in fp16 chains: float inputs, half rounding points).
//
// Prints the selected instruction-set variant and, for `reps` repetitions of `calls` back-to-back calls,
// the minimum and median time per call in microseconds. The data stays in cache between calls at decode
// sizes, as it does in a decode step (the same row buffers every layer). benchmarks/bench_cpu_op.py builds
// and runs it next to the ORT-level numbers. MAMBAFUSE_CPU_ISA picks the variant as in the library.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gated_group_rms_norm_impl.h"

namespace {

using mambafuse::ElemType;

ElemType ParseType(const char* name) {
  if (std::strcmp(name, "f16") == 0) return ElemType::kFloat16;
  if (std::strcmp(name, "bf16") == 0) return ElemType::kBFloat16;
  return ElemType::kFloat;
}

uint16_t ToHalfBits(float f, ElemType type) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (type == ElemType::kBFloat16) return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  // float16 for |f| in the normal half range (the benchmark draws such values): truncating is enough here.
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((u >> 23) & 0xFF) - 127 + 15;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) | ((u >> 13) & 0x3FFu));
}

std::vector<char> Fill(const std::vector<float>& values, ElemType type) {
  std::vector<char> bytes(values.size() * (type == ElemType::kFloat ? 4 : 2));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == ElemType::kFloat) {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t bits = ToHalfBits(values[i], type);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    }
  }
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows = 1, channels = 7680, group_size = 960;
  int reps = 200, calls = 20;
  ElemType type = ElemType::kFloat, gated = ElemType::kFloat;
  const char* norm_name = nullptr;
  const char* out_name = nullptr;
  bool denormal = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&arg](const char* prefix) -> const char* {
      const size_t n = std::strlen(prefix);
      return arg.compare(0, n, prefix) == 0 ? arg.c_str() + n : nullptr;
    };
    if (const char* v = value("--rows=")) {
      rows = std::atoll(v);
    } else if (const char* v2 = value("--channels=")) {
      channels = std::atoll(v2);
    } else if (const char* v3 = value("--group-size=")) {
      group_size = std::atoll(v3);
    } else if (const char* v4 = value("--type=")) {
      type = ParseType(v4);
    } else if (const char* v5 = value("--gated=")) {
      gated = ParseType(v5);
    } else if (const char* v6 = value("--values=")) {
      denormal = std::strcmp(v6, "denormal") == 0;
    } else if (const char* v7 = value("--reps=")) {
      reps = std::atoi(v7);
    } else if (const char* v8 = value("--calls=")) {
      calls = std::atoi(v8);
    } else if (const char* v9 = value("--norm=")) {
      norm_name = v9;
    } else if (const char* v10 = value("--out=")) {
      out_name = v10;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  const size_t count = static_cast<size_t>(rows * channels);
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> y(count), z(count), w(static_cast<size_t>(channels));
  // Denormal rows: what chains fed into each other without residual Adds decay into (|y| ~ 1e-39).
  const float y_scale = denormal ? 1e-39f : 1.f;
  for (auto& v : y) v = normal(rng) * y_scale;
  for (auto& v : z) v = 2.f * normal(rng);
  for (auto& v : w) v = 1.f + 0.5f * normal(rng);
  const ElemType io = denormal ? ElemType::kFloat : type;
  const auto y_bytes = Fill(y, io), z_bytes = Fill(z, io), w_bytes = Fill(w, io);
  // 64-byte aligned, as ONNX Runtime's buffers are (the kernel streams large outputs only when aligned).
  std::vector<char> out_storage(count * 4 + 64);  // room for a widened output
  char* out = out_storage.data() + (64 - reinterpret_cast<uintptr_t>(out_storage.data()) % 64) % 64;

  mambafuse::GatedGroupRMSNormArgs args;
  args.y = y_bytes.data();
  args.z = z_bytes.data();
  args.w = w_bytes.data();
  args.out = out;
  args.y_type = args.z_type = args.w_type = args.norm_type = args.out_type = args.out_storage_type = io;
  if (norm_name != nullptr) args.norm_type = ParseType(norm_name);
  if (out_name != nullptr) {
    args.out_type = ParseType(out_name);
    if (args.out_type != io) args.out_storage_type = ElemType::kFloat;
  }
  args.gated_type = gated;
  args.rows = rows;
  args.channels = channels;
  args.group_size = group_size;
  args.epsilon = 1e-5f;
  // What the kernel knows of a constant-initializer W (the usual case), checked once at its creation.
  args.w_subnormal_free = !mambafuse::HasFloat32Subnormal(args.w, args.w_type, channels);
  if (const char* problem = mambafuse::ValidateArgs(args)) {
    std::fprintf(stderr, "%s\n", problem);
    return 2;
  }
  const int64_t items = rows * (channels / group_size);
  std::vector<double> per_call;
  for (int r = 0; r < reps + 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < calls; ++c) mambafuse::GatedGroupRMSNormCpu(args, 0, items);
    const auto t1 = std::chrono::steady_clock::now();
    if (r >= 5) per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  std::sort(per_call.begin(), per_call.end());
  std::printf("isa %s rows %lld C %lld gs %lld values %s: min %.3f us, median %.3f us per call\n",
              mambafuse::SelectedIsa(), static_cast<long long>(rows), static_cast<long long>(channels),
              static_cast<long long>(group_size), denormal ? "denormal" : "normal", per_call.front(),
              per_call[per_call.size() / 2]);
  return 0;
}
