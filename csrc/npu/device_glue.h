// What the aclnn translation needs from the device runtime, and nothing else: the current stream,
// a workspace from the caching allocator, and a way to launch the second phase. On an Ascend host
// npu_kernels.cpp implements it with torch_npu (current NPU stream, NPU caching allocator, the
// OpCommand task queue); the CPU test double implements it with a fake stream and CPU tensors and
// records what it was asked for. No acl or torch_npu type appears here.
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

namespace lite_boost {
namespace npu {

class DeviceGlue {
 public:
  virtual ~DeviceGlue() = default;
  // The aclrtStream the launch must run on (the current stream of like's device).
  virtual void* stream(const at::Tensor& like) = 0;
  // Workspace of exactly `bytes` bytes on like's device, from the caching allocator; kept alive by the
  // returned tensor. Not called when the first phase asks for 0 bytes.
  virtual at::Tensor workspace(uint64_t bytes, const at::Tensor& like) = 0;
  // Run `launch` (the second phase; returns an aclnnStatus) in stream order. May run it later, on another
  // thread (torch_npu's task queue): everything it uses must be captured by value.
  virtual void launch(const char* op_name, std::function<int()> launch) = 0;
};

}  // namespace npu
}  // namespace lite_boost
