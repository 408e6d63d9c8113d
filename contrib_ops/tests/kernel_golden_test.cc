// Standalone golden test of GatedGroupRMSNorm's kernels, without ONNX Runtime.
//
//   kernel_golden_test [--backend=cpu|msl-emulation|metal] [--simd-width=N] [--simdgroups=N]
//                      [--sum-order=tree|sequential] [--out=OUTDIR] DIR
//
// DIR holds cases.txt and the raw inputs/expected outputs that contrib_ops/tests/golden.py wrote from
// fusion/reference.py. For every case the program runs the chosen backend, writes OUTDIR/<name>.out (the
// output buffer as the kernel left it; OUTDIR defaults to DIR) and checks it coarsely: NaN/Inf exactly where expected, every
// element within the case's ulp bound. The accuracy-budget verdict of docs/op.md is made in Python
// (golden.check_case) on the .out files; this check makes the program useful on its own (under
// sanitizers, on a Mac). Exit status: 0 when every case passes, 1 otherwise, 2 for bad usage or files.
//
// Backends: cpu — the math core behind the CPU kernel (GatedGroupRMSNormCpu), the case's item range split
// into `chunks` calls on as many threads; msl-emulation — contrib_ops/metal/gated_group_rms_norm.metal
// compiled as C++ against msl_shim.h (built with MAMBAFUSE_MSL_EMULATION); metal — the real Metal kernel
// on an Apple GPU (built with MAMBAFUSE_WITH_METAL).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gated_group_rms_norm_impl.h"
#if defined(MAMBAFUSE_MSL_EMULATION)
#include "msl_emulation.h"
#endif
#if defined(MAMBAFUSE_WITH_METAL)
#include "metal/gated_group_rms_norm_metal.h"
#endif

namespace {

using mambafuse::ElemType;

struct Case {
  std::string name;
  int64_t types[7] = {};  // y, z, w, norm, out, storage, gated (ONNX element types)
  int64_t rows = 0;
  int64_t channels = 0;
  int64_t group_size = 0;
  double epsilon = 0.0;
  int64_t chunks = 1;
  double ulp_limit = 0.0;
};

struct Options {
  std::string backend = "cpu";
  std::string directory;
  std::string output_directory;
  int simd_width = 32;
  int simdgroups = 4;
  bool sequential_sum = false;
};

size_t TypeBytes(int64_t type) { return type == 1 ? 4 : 2; }

bool ReadFile(const std::string& path, std::vector<char>& bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

bool WriteFile(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  return static_cast<bool>(out);
}

bool ReadCases(const std::string& path, std::vector<Case>& cases, std::string& error) {
  std::ifstream in(path);
  if (!in) {
    error = "cannot open " + path;
    return false;
  }
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    Case c;
    fields >> c.name;
    for (int64_t& t : c.types) fields >> t;
    fields >> c.rows >> c.channels >> c.group_size >> c.epsilon >> c.chunks >> c.ulp_limit;
    if (!fields || c.chunks < 1) {
      error = path + ":" + std::to_string(number) + ": malformed case line";
      return false;
    }
    cases.push_back(c);
  }
  return true;
}

// The value of one stored element, widened exactly to double (the coarse check below works on values).
double Decode(const char* data, size_t index, int64_t type) {
  if (type == 1) {
    float f;
    std::memcpy(&f, data + 4 * index, 4);
    return f;
  }
  uint16_t bits;
  std::memcpy(&bits, data + 2 * index, 2);
  const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
  if (type == 16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const int exponent = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent == 31) return mantissa ? std::nan("") : sign * HUGE_VAL;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// The spacing of the output type at |value| (subnormal range included).
double UlpOf(double value, int64_t type) {
  const int mantissa_bits = type == 1 ? 23 : type == 10 ? 10 : 7;
  const int min_exponent = type == 10 ? -14 : -126;
  int exponent = min_exponent;
  if (value != 0.0) {
    int e = 0;
    std::frexp(value, &e);  // value = m * 2^e, m in [0.5, 1)
    exponent = e - 1 > min_exponent ? e - 1 : min_exponent;
  }
  return std::ldexp(1.0, exponent - mantissa_bits);
}

struct Comparison {
  size_t special_mismatches = 0;
  size_t over_limit = 0;
  double worst_ulps = 0.0;
};

Comparison Compare(const Case& c, const std::vector<char>& actual, const std::vector<char>& expected) {
  Comparison result;
  const size_t count = static_cast<size_t>(c.rows * c.channels);
  for (size_t i = 0; i < count; ++i) {
    const double a = Decode(actual.data(), i, c.types[5]);
    const double e = Decode(expected.data(), i, c.types[4]);
    if (std::isnan(e) || std::isinf(e) || std::isnan(a) || std::isinf(a)) {
      const bool same = (std::isnan(e) && std::isnan(a)) || a == e;
      result.special_mismatches += same ? 0 : 1;
      continue;
    }
    const double error = std::fabs(a - e);
    const double ulps = error / UlpOf(e, c.types[4]);
    if (ulps > result.worst_ulps) result.worst_ulps = ulps;
    // float32 outputs get the budget's absolute floor too (the smallest normal float): results in the
    // float subnormal range (gates deep in exp's underflow) carry absolute, not relative, error.
    const double floor = c.types[4] == 1 ? static_cast<double>(FLT_MIN) : 0.0;
    if (ulps > c.ulp_limit && error > floor) ++result.over_limit;
  }
  return result;
}

mambafuse::GatedGroupRMSNormArgs MakeArgs(const Case& c, const std::vector<char>& y, const std::vector<char>& z,
                                          const std::vector<char>& w, std::vector<char>& out) {
  mambafuse::GatedGroupRMSNormArgs args;
  args.y = y.data();
  args.z = z.data();
  args.w = w.data();
  args.out = out.data();
  args.y_type = static_cast<ElemType>(c.types[0]);
  args.z_type = static_cast<ElemType>(c.types[1]);
  args.w_type = static_cast<ElemType>(c.types[2]);
  args.norm_type = static_cast<ElemType>(c.types[3]);
  args.out_type = static_cast<ElemType>(c.types[4]);
  args.out_storage_type = static_cast<ElemType>(c.types[5]);
  args.gated_type = static_cast<ElemType>(c.types[6]);
  args.rows = c.rows;
  args.channels = c.channels;
  args.group_size = c.group_size;
  args.epsilon = static_cast<float>(c.epsilon);
  // As the kernel does for a constant W (at its creation).
  args.w_subnormal_free = !mambafuse::HasFloat32Subnormal(w.data(), args.w_type, c.channels);
  return args;
}

// Runs one case on the chosen backend; returns "" or why it could not run.
std::string RunBackend(const Options& options, const Case& c, const mambafuse::GatedGroupRMSNormArgs& args) {
  if (const char* problem = mambafuse::ValidateArgs(args)) return std::string("ValidateArgs: ") + problem;
  const int64_t items = c.channels == 0 ? 0 : c.rows * (c.channels / c.group_size);
  if (options.backend == "cpu") {
    // Split as the ORT kernel's ParallelFor does: contiguous item ranges, each on its own thread.
    std::vector<std::thread> threads;
    for (int64_t chunk = 0; chunk < c.chunks; ++chunk) {
      const int64_t first = items * chunk / c.chunks;
      const int64_t last = items * (chunk + 1) / c.chunks;
      threads.emplace_back([&args, first, last] { mambafuse::GatedGroupRMSNormCpu(args, first, last); });
    }
    for (auto& t : threads) t.join();
    return {};
  }
#if defined(MAMBAFUSE_MSL_EMULATION)
  if (options.backend == "msl-emulation") {
    mambafuse::msl_emulation::Options emulation;
    emulation.simd_width = options.simd_width;
    emulation.simdgroups_per_threadgroup = options.simdgroups;
    emulation.sum_order = options.sequential_sum ? mambafuse::msl_emulation::SumOrder::kSequential
                                                 : mambafuse::msl_emulation::SumOrder::kTree;
    return mambafuse::msl_emulation::Run(args, emulation);
  }
#endif
#if defined(MAMBAFUSE_WITH_METAL)
  if (options.backend == "metal") return mambafuse::GatedGroupRMSNormMetal(args);
#endif
  return "backend '" + options.backend + "' is not built into this program";
}

// ValidateArgs must name every inconsistency (the ORT kernel relies on it before any computation).
int CheckValidateArgs() {
  float buffer[8] = {};
  mambafuse::GatedGroupRMSNormArgs good;
  good.y = good.z = good.w = buffer;
  good.out = buffer;
  good.rows = 1;
  good.channels = 8;
  good.group_size = 4;
  int failed = 0;
  const auto expect = [&failed](bool ok, const char* what) {
    if (!ok) {
      std::printf("validate_args: FAILED: %s\n", what);
      ++failed;
    }
  };
  expect(mambafuse::ValidateArgs(good) == nullptr, "consistent arguments are accepted");
  auto bad = good;
  bad.group_size = 0;
  expect(mambafuse::ValidateArgs(bad) != nullptr, "group_size 0 is rejected");
  bad = good;
  bad.group_size = 3;
  expect(mambafuse::ValidateArgs(bad) != nullptr, "C not divisible by group_size is rejected");
  bad = good;
  bad.norm_type = static_cast<ElemType>(11);
  expect(mambafuse::ValidateArgs(bad) != nullptr, "double norm_type is rejected");
  bad = good;
  bad.gated_type = static_cast<ElemType>(11);
  expect(mambafuse::ValidateArgs(bad) != nullptr, "double gated_type is rejected");
  bad = good;
  bad.out_type = ElemType::kFloat16;
  bad.out_storage_type = ElemType::kBFloat16;
  expect(mambafuse::ValidateArgs(bad) != nullptr, "a storage type other than out_type or float is rejected");
  bad = good;
  bad.y = nullptr;
  expect(mambafuse::ValidateArgs(bad) != nullptr, "a null input is rejected");
  if (failed == 0) std::printf("validate_args: ok\n");
  return failed;
}

bool ParseOptions(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&arg](const char* prefix) -> const char* {
      const size_t n = std::strlen(prefix);
      return arg.compare(0, n, prefix) == 0 ? arg.c_str() + n : nullptr;
    };
    const char* backend = value("--backend=");
    const char* simd_width = value("--simd-width=");
    const char* simdgroups = value("--simdgroups=");
    const char* sum_order = value("--sum-order=");
    const char* out = value("--out=");
    if (out != nullptr) {
      options.output_directory = out;
    } else if (backend != nullptr) {
      options.backend = backend;
    } else if (simd_width != nullptr) {
      options.simd_width = std::atoi(simd_width);
    } else if (simdgroups != nullptr) {
      options.simdgroups = std::atoi(simdgroups);
    } else if (sum_order != nullptr) {
      options.sequential_sum = std::strcmp(sum_order, "sequential") == 0;
      if (!options.sequential_sum && std::strcmp(sum_order, "tree") != 0) return false;
    } else if (arg.compare(0, 2, "--") == 0 || !options.directory.empty()) {
      return false;
    } else {
      options.directory = arg;
    }
  }
  return !options.directory.empty() && options.simd_width > 0 && options.simdgroups > 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, options)) {
    std::fprintf(stderr,
                 "usage: %s [--backend=cpu|msl-emulation|metal] [--simd-width=N] [--simdgroups=N] "
                 "[--sum-order=tree|sequential] [--out=OUTDIR] DIR\n",
                 argv[0]);
    return 2;
  }
  if (options.output_directory.empty()) options.output_directory = options.directory;
  std::printf("isa: %s\nbackend: %s\n", mambafuse::SelectedIsa(), options.backend.c_str());
  int failed = CheckValidateArgs();
  std::vector<Case> cases;
  std::string error;
  if (!ReadCases(options.directory + "/cases.txt", cases, error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return 2;
  }
  for (const Case& c : cases) {
    const std::string stem = options.directory + "/" + c.name;
    std::vector<char> y, z, w, expected;
    const size_t count = static_cast<size_t>(c.rows * c.channels);
    if (!ReadFile(stem + ".y", y) || !ReadFile(stem + ".z", z) || !ReadFile(stem + ".w", w) ||
        !ReadFile(stem + ".expected", expected) || y.size() != count * TypeBytes(c.types[0]) ||
        z.size() != count * TypeBytes(c.types[1]) || w.size() != static_cast<size_t>(c.channels) * TypeBytes(c.types[2]) ||
        expected.size() != count * TypeBytes(c.types[4])) {
      std::fprintf(stderr, "%s: missing or wrongly sized input files\n", c.name.c_str());
      return 2;
    }
    // Poisoned output: an element the kernel fails to write shows up as a mismatch.
    std::vector<char> out(count * TypeBytes(c.types[5]), static_cast<char>(0x7F));
    const auto args = MakeArgs(c, y, z, w, out);
    const std::string problem = RunBackend(options, c, args);
    if (!problem.empty()) {
      std::printf("case %s: ERROR %s\n", c.name.c_str(), problem.c_str());
      ++failed;
      continue;
    }
    const std::string out_path = options.output_directory + "/" + c.name + ".out";
    if (!WriteFile(out_path, out.data(), out.size())) {
      std::fprintf(stderr, "%s: cannot write %s\n", c.name.c_str(), out_path.c_str());
      return 2;
    }
    const Comparison cmp = Compare(c, out, expected);
    const bool ok = cmp.special_mismatches == 0 && cmp.over_limit == 0;
    failed += ok ? 0 : 1;
    std::printf("case %s: %s worst %.3g ulp (limit %.0f), %zu over, %zu NaN/Inf mismatches\n", c.name.c_str(),
                ok ? "ok" : "FAILED", cmp.worst_ulps, c.ulp_limit, cmp.over_limit, cmp.special_mismatches);
  }
  std::printf("%zu cases, %d failures\n", cases.size(), failed);
  return failed == 0 ? 0 : 1;
}
