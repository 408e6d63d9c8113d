// The one include of ONNX Runtime's C++ API in this library. The library is not linked to
// libonnxruntime: the API table comes from the OrtApiBase handed to RegisterCustomOps.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <exception>
#include <string>

namespace mambafuse {

// Runs `body` (returning Ort::Status) and converts any C++ exception into an OrtStatus, so that no
// exception crosses the C boundary back into ONNX Runtime.
template <typename Body>
OrtStatusPtr GuardStatus(Body&& body) noexcept {
  try {
    Ort::Status status = body();
    return status.release();
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  } catch (...) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, "mambafuse: unknown error (an exception of no standard type)");
  }
}

inline Ort::Status InvalidArgument(const std::string& message) {
  return Ort::Status(("GatedGroupRMSNorm: " + message).c_str(), ORT_INVALID_ARGUMENT);
}

}  // namespace mambafuse
