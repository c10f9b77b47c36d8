// Declaration-only stand-in for torch_npu's NPUStream.h: the part of its API csrc/npu/npu_kernels.cpp
// uses, as torch_npu declares it. Lets the tests compile the device glue (-fsyntax-only) without torch_npu.
// It also pulls in an acl type the way the real header does (via CANN's acl headers), so that a clash
// with csrc/npu/aclnn_api.h's declarations would show.
#pragma once
#include <c10/core/Device.h>

extern "C" {
typedef void* aclrtStream;
typedef struct aclTensor aclTensor;
struct aclTensor* aclCreateTensor(const long* viewDims, unsigned long viewDimsNum, int dataType, const long* stride,
                                  long offset, int format, const long* storageDims, unsigned long storageDimsNum,
                                  void* tensorData);  // deliberately CANN-typed differently
}

namespace c10_npu {
class NPUStream {
 public:
  aclrtStream stream(const bool need_empty = true) const;
};
NPUStream getCurrentNPUStream(c10::DeviceIndex device_index = -1);
}  // namespace c10_npu
