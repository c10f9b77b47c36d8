// The slice of the CANN acl / aclnn C API that lite_boost's Ascend kernels use, declared from the
// public operator documents (aclCreateTensor & co. of the aclnn base API, the two-phase entries of
// aclnnRainFusionAttention and aclnnPromptFlashAttentionV3). Written here instead of including the
// CANN headers so that the translation (aclnn_translate.cpp) compiles on any machine: on an Ascend
// host the entry points are resolved from CANN's libopapi.so / libnnopbase.so at run time
// (opapi_loader.cpp), and on CPU the test double (tests/aclnn_double) defines them.
//
// Do not include this header in a translation unit that also includes torch_npu or CANN headers:
// they declare the same C functions with their own types. The device glue (npu_kernels.cpp) only
// sees device_glue.h.
#pragma once

#include <cstdint>

extern "C" {

typedef struct aclTensor aclTensor;
typedef struct aclIntArray aclIntArray;
typedef struct aclOpExecutor aclOpExecutor;
typedef void* aclrtStream;
typedef int32_t aclnnStatus;

// Values as in CANN's acl_base.h.
typedef enum {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT8 = 2,
  ACL_INT32 = 3,
  ACL_UINT8 = 4,
  ACL_INT16 = 6,
  ACL_UINT16 = 7,
  ACL_UINT32 = 8,
  ACL_INT64 = 9,
  ACL_UINT64 = 10,
  ACL_DOUBLE = 11,
  ACL_BOOL = 12,
  ACL_BF16 = 27,
} aclDataType;

typedef enum {
  ACL_FORMAT_UNDEFINED = -1,
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_NHWC = 1,
  ACL_FORMAT_ND = 2,
} aclFormat;

// Return codes documented for the GetWorkspaceSize phase.
#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001

// aclnn base API (libnnopbase).
aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType,
                           const int64_t* stride, int64_t offset, aclFormat format,
                           const int64_t* storageDims, uint64_t storageDimsNum, void* tensorData);
aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size);
aclnnStatus aclDestroyTensor(const aclTensor* tensor);
aclnnStatus aclDestroyIntArray(const aclIntArray* array);
const char* aclGetRecentErrMsg();

// aclnnRainFusionAttention (ops-transformer, attention/rain_fusion_attention).
aclnnStatus aclnnRainFusionAttentionGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* selectIdx,
    const aclTensor* selectNumIdx, const aclIntArray* blockShape, const aclTensor* attenMaskOptional,
    const aclIntArray* actualSeqLengthsOptional, const aclIntArray* actualSeqLengthsKvOptional,
    const aclTensor* blockTableOptional, char* qInputLayout, char* kvInputLayout, int64_t numKeyValueHeads,
    int64_t maskType, double scaleValue, int64_t innerPrecise, int64_t blockSize, const aclTensor* attentionOut,
    const aclTensor* softmaxLseOptional, uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnRainFusionAttention(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                     aclrtStream stream);

// aclnnPromptFlashAttentionV3: the entry torch_npu.npu_prompt_flash_attention calls.
aclnnStatus aclnnPromptFlashAttentionV3GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* pseShift,
    const aclTensor* attenMask, const aclIntArray* actualSeqLengths, const aclIntArray* actualSeqLengthsKv,
    const aclTensor* deqScale1, const aclTensor* quantScale1, const aclTensor* deqScale2,
    const aclTensor* quantScale2, const aclTensor* quantOffset2, int64_t numHeads, double scaleValue,
    int64_t preTokens, int64_t nextTokens, char* inputLayout, int64_t numKeyValueHeads, int64_t sparseMode,
    int64_t innerPrecise, const aclTensor* attentionOut, uint64_t* workspaceSize, aclOpExecutor** executor);
aclnnStatus aclnnPromptFlashAttentionV3(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                        aclrtStream stream);

}  // extern "C"

namespace lite_boost {
namespace npu {

// The entry points the translation calls, as a table: filled from CANN's libraries on an Ascend host
// (opapi_loader.cpp) or with the test double's definitions on CPU. A null entry means the installed
// CANN lacks it; the translation then raises naming the entry and the library.
struct AclnnApi {
  decltype(&aclCreateTensor) createTensor = nullptr;
  decltype(&aclCreateIntArray) createIntArray = nullptr;
  decltype(&aclDestroyTensor) destroyTensor = nullptr;
  decltype(&aclDestroyIntArray) destroyIntArray = nullptr;
  decltype(&aclGetRecentErrMsg) recentErrMsg = nullptr;  // optional
  decltype(&aclnnRainFusionAttentionGetWorkspaceSize) rainFusionGetWorkspaceSize = nullptr;
  decltype(&aclnnRainFusionAttention) rainFusion = nullptr;
  decltype(&aclnnPromptFlashAttentionV3GetWorkspaceSize) pfaGetWorkspaceSize = nullptr;
  decltype(&aclnnPromptFlashAttentionV3) pfa = nullptr;
  const char* origin = "";  // where the entries came from, for error messages
};

// Entries resolved with dlopen/dlsym from libopapi.so and libnnopbase.so (as torch_npu does);
// missing libraries or symbols leave null entries. Resolved once, thread-safe.
const AclnnApi& aclnn_api_from_cann();

}  // namespace npu
}  // namespace lite_boost
