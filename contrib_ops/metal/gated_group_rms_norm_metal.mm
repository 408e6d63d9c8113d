// Host side of the Metal kernel (gated_group_rms_norm.metal): compiles the MSL source once at run time (no
// Xcode `metal` tool needed at build time; the source is embedded by embed_msl.cmake), keeps one pipeline
// per type combination (function constants), stages ORT's CPU tensors through shared buffers that are
// reused across calls, and waits for the GPU (the CPU execution provider expects the output on return).
//
// Objective-C++ with ARC (-fobjc-arc). Built only on Apple; see contrib_ops/APPLE.md.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gated_group_rms_norm_metal.h"
#include "gated_group_rms_norm_metal_source.h"  // generated: kGatedGroupRMSNormMsl

namespace mambafuse {
namespace {

// Mirrors GatedGroupRMSNormParams in gated_group_rms_norm.metal; keep both in step.
struct KernelParams {
  uint32_t channels;
  uint32_t group_size;
  uint32_t groups_per_row;
  uint32_t items;
  float epsilon;
};
static_assert(sizeof(KernelParams) == 20, "the layout of GatedGroupRMSNormParams in the .metal file");

constexpr NSUInteger kMaxSimdgroupsPerThreadgroup = 8;

std::string Describe(NSError* error) {
  return error != nil ? std::string(error.localizedDescription.UTF8String) : std::string("unknown error");
}

size_t ElementBytes(ElemType type) { return type == ElemType::kFloat ? 4 : 2; }

class MetalRunner {
 public:
  static MetalRunner& Instance() {
    static MetalRunner runner;  // thread-safe one-time initialization (device, queue, compiled library)
    return runner;
  }

  std::string Run(const GatedGroupRMSNormArgs& args);

 private:
  MetalRunner();
  id<MTLComputePipelineState> Pipeline(const GatedGroupRMSNormArgs& args, std::string& error);
  id<MTLBuffer> Staging(size_t slot, size_t bytes);

  std::string init_error_;
  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLLibrary> library_ = nil;
  // One op at a time: the staging buffers and the pipeline cache are shared by every caller.
  std::mutex mutex_;
  std::unordered_map<uint64_t, id<MTLComputePipelineState>> pipelines_;
  id<MTLBuffer> staging_[4] = {nil, nil, nil, nil};  // y, z, w, out
};

MetalRunner::MetalRunner() {
  @autoreleasepool {
    device_ = MTLCreateSystemDefaultDevice();
    if (device_ == nil) {
      init_error_ = "no Metal device";
      return;
    }
    if (@available(macOS 14.0, iOS 17.0, *)) {
      MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
      options.languageVersion = MTLLanguageVersion3_1;  // bfloat
      // IEEE semantics: the contract's NaN/Inf propagation and the kernel's exp depend on them (fast math
      // may assume no NaN and reassociate).
      if (@available(macOS 15.0, iOS 18.0, *)) {
        options.mathMode = MTLMathModeSafe;
        options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
      } else {
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
        options.fastMathEnabled = NO;
#pragma clang diagnostic pop
      }
      NSError* error = nil;
      NSString* source = [NSString stringWithUTF8String:kGatedGroupRMSNormMsl];
      library_ = [device_ newLibraryWithSource:source options:options error:&error];
      if (library_ == nil) {
        init_error_ = "compiling gated_group_rms_norm.metal failed: " + Describe(error);
        return;
      }
    } else {
      init_error_ = "the Metal kernel needs MSL 3.1 (macOS 14 or later) for bfloat";
      return;
    }
    queue_ = [device_ newCommandQueue];
    if (queue_ == nil) init_error_ = "cannot create a Metal command queue";
  }
}

id<MTLComputePipelineState> MetalRunner::Pipeline(const GatedGroupRMSNormArgs& args, std::string& error) {
  // Function constants 0..6 of the kernel: y, z, w, norm, out, storage, gated types (ONNX TensorProto
  // numbers).
  const int types[7] = {static_cast<int>(args.y_type),    static_cast<int>(args.z_type),
                        static_cast<int>(args.w_type),    static_cast<int>(args.norm_type),
                        static_cast<int>(args.out_type),  static_cast<int>(args.out_storage_type),
                        static_cast<int>(args.gated_type)};
  uint64_t key = 0;
  for (int type : types) key = key * 32u + static_cast<uint64_t>(type);
  const auto found = pipelines_.find(key);
  if (found != pipelines_.end()) return found->second;

  MTLFunctionConstantValues* values = [[MTLFunctionConstantValues alloc] init];
  for (NSUInteger i = 0; i < 7; ++i) [values setConstantValue:&types[i] type:MTLDataTypeInt atIndex:i];
  NSError* ns_error = nil;
  id<MTLFunction> function = [library_ newFunctionWithName:@"gated_group_rms_norm"
                                            constantValues:values
                                                     error:&ns_error];
  if (function == nil) {
    error = "specializing gated_group_rms_norm failed: " + Describe(ns_error);
    return nil;
  }
  id<MTLComputePipelineState> pipeline = [device_ newComputePipelineStateWithFunction:function error:&ns_error];
  if (pipeline == nil) {
    error = "creating the compute pipeline failed: " + Describe(ns_error);
    return nil;
  }
  pipelines_.emplace(key, pipeline);
  return pipeline;
}

id<MTLBuffer> MetalRunner::Staging(size_t slot, size_t bytes) {
  bytes = std::max<size_t>(bytes, 16);
  if (staging_[slot] == nil || staging_[slot].length < bytes) {
    staging_[slot] = [device_ newBufferWithLength:bytes options:MTLResourceStorageModeShared];
  }
  return staging_[slot];
}

std::string MetalRunner::Run(const GatedGroupRMSNormArgs& args) {
  if (!init_error_.empty()) return init_error_;
  if (const char* problem = ValidateArgs(args)) return problem;
  const int64_t groups_per_row = args.channels / args.group_size;
  const int64_t items = args.rows * groups_per_row;
  if (items == 0) return {};
  if (items > INT64_C(0xFFFFFFFF) || args.channels > INT64_C(0xFFFFFFFF)) {
    return "tensor too large for the Metal kernel's 32-bit item indices";
  }
  const auto elements = static_cast<size_t>(args.rows * args.channels);
  const size_t bytes[4] = {elements * ElementBytes(args.y_type), elements * ElementBytes(args.z_type),
                           static_cast<size_t>(args.channels) * ElementBytes(args.w_type),
                           elements * ElementBytes(args.out_storage_type)};
  const void* inputs[3] = {args.y, args.z, args.w};

  std::lock_guard<std::mutex> lock(mutex_);
  @autoreleasepool {
    std::string error;
    id<MTLComputePipelineState> pipeline = Pipeline(args, error);
    if (pipeline == nil) return error;
    for (size_t i = 0; i < 4; ++i) {
      if (Staging(i, bytes[i]) == nil) return "cannot allocate a Metal buffer of " + std::to_string(bytes[i]) + " bytes";
    }
    for (size_t i = 0; i < 3; ++i) std::memcpy(staging_[i].contents, inputs[i], bytes[i]);

    KernelParams params;
    params.channels = static_cast<uint32_t>(args.channels);
    params.group_size = static_cast<uint32_t>(args.group_size);
    params.groups_per_row = static_cast<uint32_t>(groups_per_row);
    params.items = static_cast<uint32_t>(items);
    params.epsilon = args.epsilon;

    // Whole SIMD groups per threadgroup, so every simd_sum in the kernel sees full SIMD groups.
    const NSUInteger width = pipeline.threadExecutionWidth;
    const NSUInteger simdgroups =
        std::min<NSUInteger>(kMaxSimdgroupsPerThreadgroup, pipeline.maxTotalThreadsPerThreadgroup / width);
    if (width == 0 || simdgroups == 0) return "the pipeline allows no full SIMD group per threadgroup";
    const NSUInteger threadgroups = (static_cast<NSUInteger>(items) + simdgroups - 1) / simdgroups;

    id<MTLCommandBuffer> command_buffer = [queue_ commandBuffer];
    id<MTLComputeCommandEncoder> encoder = [command_buffer computeCommandEncoder];
    [encoder setComputePipelineState:pipeline];
    for (NSUInteger i = 0; i < 4; ++i) [encoder setBuffer:staging_[i] offset:0 atIndex:i];
    [encoder setBytes:&params length:sizeof params atIndex:4];
    [encoder dispatchThreadgroups:MTLSizeMake(threadgroups, 1, 1)
            threadsPerThreadgroup:MTLSizeMake(width * simdgroups, 1, 1)];
    [encoder endEncoding];
    [command_buffer commit];
    [command_buffer waitUntilCompleted];
    if (command_buffer.status != MTLCommandBufferStatusCompleted) {
      return "the Metal command buffer failed: " + Describe(command_buffer.error);
    }
    std::memcpy(args.out, staging_[3].contents, bytes[3]);
  }
  return {};
}

}  // namespace

bool MetalWanted(int64_t elements) {
  static const int64_t threshold = []() -> int64_t {
    const char* enabled = std::getenv("MAMBAFUSE_METAL");
    if (enabled == nullptr || std::strcmp(enabled, "1") != 0) return -1;
    const char* minimum = std::getenv("MAMBAFUSE_METAL_MIN_ELEMENTS");
    return minimum != nullptr ? std::max<int64_t>(0, std::strtoll(minimum, nullptr, 10)) : int64_t{1} << 20;
  }();
  return threshold >= 0 && elements >= threshold;
}

std::string GatedGroupRMSNormMetal(const GatedGroupRMSNormArgs& args) { return MetalRunner::Instance().Run(args); }

bool TryGatedGroupRMSNormMetal(const GatedGroupRMSNormArgs& args) {
  if (!MetalWanted(args.rows * args.channels)) return false;
  const std::string error = GatedGroupRMSNormMetal(args);
  if (error.empty()) return true;
  static std::once_flag reported;
  std::call_once(reported, [&error] {
    std::fprintf(stderr, "mambafuse: MAMBAFUSE_METAL=1, but the Metal path failed (%s); computing on the CPU\n",
                 error.c_str());
  });
  return false;
}

}  // namespace mambafuse
