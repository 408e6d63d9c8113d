// Entry point of the mambafuse custom-op library: one domain (ai.mambafuse), its ops (GatedGroupRMSNorm,
// CausalConv1dUpdate, SelectiveStateUpdate, MambaChunkScan, CausalConv1d, SquaredRelu; on CUDA also DecodeMatMul
// and DecodeMatMulNBits), one kernel per op and execution provider. Loaded by ONNX Runtime through
// SessionOptions.register_custom_ops_library; the library does not link libonnxruntime.
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/ort_api.h"
#include "cpu/causal_conv1d.h"
#include "cpu/causal_conv1d_update.h"
#include "cpu/gated_group_rms_norm.h"
#include "cpu/mamba_chunk_scan.h"
#include "cpu/selective_state_update.h"
#include "cpu/squared_relu.h"
#if defined(MAMBAFUSE_WITH_CUDA)
#include "cuda/causal_conv1d_cuda.h"
#include "cuda/causal_conv1d_update_cuda.h"
#include "cuda/decode_matmul_cuda.h"
#include "cuda/gated_group_rms_norm_cuda.h"
#include "cuda/mamba_chunk_scan_cuda.h"
#include "cuda/selective_state_update_cuda.h"
#include "cuda/squared_relu_cuda.h"
#endif

#if defined(_WIN32)
#define MAMBAFUSE_EXPORT __declspec(dllexport)
#else
#define MAMBAFUSE_EXPORT __attribute__((visibility("default")))
#endif

namespace {

constexpr const char* kDomain = "ai.mambafuse";

// Ops and the domain must outlive every session that uses them: ORT keeps raw pointers to both.
struct Registry {
  mambafuse::GatedGroupRMSNormCpuOp cpu_op;
  mambafuse::CausalConv1dUpdateCpuOp conv_update_op;
  mambafuse::SelectiveStateUpdateCpuOp state_update_op;
  mambafuse::MambaChunkScanCpuOp chunk_scan_op;
  mambafuse::CausalConv1dCpuOp conv_op;
  mambafuse::SquaredReluCpuOp squared_relu_op;
#if defined(MAMBAFUSE_WITH_CUDA)
  mambafuse::GatedGroupRMSNormCudaOp cuda_op;
  mambafuse::CausalConv1dUpdateCudaOp conv_update_cuda_op;
  mambafuse::SelectiveStateUpdateCudaOp state_update_cuda_op;
  mambafuse::MambaChunkScanCudaOp chunk_scan_cuda_op;
  mambafuse::CausalConv1dCudaOp conv_cuda_op;
  mambafuse::SquaredReluCudaOp squared_relu_cuda_op;
  // CUDA only: on the CPU ORT inlines their model-local functions (MatMul / MatMulNBits).
  mambafuse::DecodeMatMulCudaOp matmul_cuda_op;
  mambafuse::DecodeMatMulNBitsCudaOp matmul_nbits_cuda_op;
#endif
};

Registry& Ops() {
  static Registry registry;
  return registry;
}

// The session config entry that turns the prefill ops' CPU kernels off ("0"); absent or any other value: on.
constexpr const char* kPrefillCpuKernelsKey = "mambafuse.prefill_cpu_kernels";

bool PrefillCpuKernelsWanted(const OrtSessionOptions* options) {
  const OrtApi& api = Ort::GetApi();
  int has = 0;
  Ort::ThrowOnError(api.HasSessionConfigEntry(options, kPrefillCpuKernelsKey, &has));
  if (!has) return true;
  char value[8] = {};
  size_t size = sizeof(value);
  if (OrtStatus* status = api.GetSessionConfigEntry(options, kPrefillCpuKernelsKey, value, &size)) {
    api.ReleaseStatus(status);  // longer than any value that turns them off
    return true;
  }
  return std::string(value) != "0";
}

}  // namespace

extern "C" MAMBAFUSE_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                      const OrtApiBase* api_base) {
  if (api_base == nullptr) return nullptr;  // nothing to report the error through
  // The library is built against ORT_API_VERSION (1.23); a runtime older than that returns no table.
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    const OrtApi* oldest = api_base->GetApi(1);
    if (oldest == nullptr) return nullptr;
    std::string message = std::string("mambafuse: this library needs ONNX Runtime API version ") +
                          std::to_string(ORT_API_VERSION) + " (onnxruntime >= 1." +
                          std::to_string(ORT_API_VERSION) + "); the runtime is " + api_base->GetVersionString();
    return oldest->CreateStatus(ORT_FAIL, message.c_str());
  }
  Ort::InitApi(api);
  return mambafuse::GuardStatus([&]() -> Ort::Status {
    // A mistyped MAMBAFUSE_CPU_ISA would otherwise run the baseline kernel without a word.
    if (const char* problem = mambafuse::IsaEnvironmentError()) return mambafuse::InvalidArgument(problem);
    // ORT keeps a raw pointer to each domain added to session options and never frees it, so each
    // registration's domain is kept for the library's lifetime.
    static std::vector<Ort::CustomOpDomain> domains;
    static std::mutex domains_mutex;
    Ort::CustomOpDomain domain{kDomain};
    domain.Add(&Ops().cpu_op);
    domain.Add(&Ops().conv_update_op);
    domain.Add(&Ops().state_update_op);
    domain.Add(&Ops().squared_relu_op);
    // A session whose preferred provider is a GPU sets "mambafuse.prefill_cpu_kernels" = "0" (contrib_ops.session
    // does): ORT would otherwise place a prefill node its GPU provider has no kernel for on the CPU kernel and copy
    // the prompt's tensors across. On CUDA the library's own prefill kernels take the nodes.
    if (PrefillCpuKernelsWanted(options)) {
      domain.Add(&Ops().chunk_scan_op);
      domain.Add(&Ops().conv_op);
    }
#if defined(MAMBAFUSE_WITH_CUDA)
    domain.Add(&Ops().cuda_op);
    domain.Add(&Ops().conv_update_cuda_op);
    domain.Add(&Ops().state_update_cuda_op);
    domain.Add(&Ops().chunk_scan_cuda_op);
    domain.Add(&Ops().conv_cuda_op);
    domain.Add(&Ops().squared_relu_cuda_op);
    // The weight products have no CPU kernel (ORT's MLAS is the CPU's): declared to a CPU session, a node of theirs
    // would find no kernel and fail instead of inlining its function (MatMul / MatMulNBits). So only a session that
    // says it prefers a GPU (the setting above) gets them.
    if (!PrefillCpuKernelsWanted(options)) {
      domain.Add(&Ops().matmul_cuda_op);
      domain.Add(&Ops().matmul_nbits_cuda_op);
    }
#endif
    Ort::UnownedSessionOptions session_options(options);
    session_options.Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
    return Ort::Status{};
  });
}
