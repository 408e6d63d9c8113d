// The file format of the standalone op programs (decode_step_golden_test.cc, prefill_golden_test.cc): each
// tensor is <dir>/<name>.bin, its raw little-endian elements (bfloat16 / float16 as 16-bit patterns); the
// dimensions and attributes are in <dir>/meta.txt, read by the program.
#pragma once

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace mambafuse {
namespace golden {

// The bytes of <dir>/<name>.bin; empty when there is no such file (an absent optional input).
inline std::vector<char> ReadTensor(const std::string& dir, const char* name) {
  std::ifstream in(dir + "/" + name + ".bin", std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

inline void WriteTensor(const std::string& dir, const char* name, const std::vector<char>& data) {
  std::ofstream out(dir + "/" + name + ".bin", std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// Bytes per element of an ONNX element type the ops take (float: 4; float16, bfloat16: 2).
inline size_t ElementBytes(int64_t onnx_type) { return onnx_type == 1 ? 4 : 2; }

}  // namespace golden
}  // namespace mambafuse
