// Translation of lite_boost's two operators into their aclnn calls: argument checks (the documented
// error conditions, raised as ValueError/TypeError naming the argument before anything is created
// or launched), the aclTensor / aclIntArray arguments, and the two-phase call (GetWorkspaceSize,
// workspace, launch on the stream). Device independent: the entry points come from an AclnnApi
// table and the device from a DeviceGlue, so the same code runs on an Ascend host (CANN + torch_npu)
// and on CPU against the aclnn test double (tests/aclnn_double).
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "device_glue.h"

namespace lite_boost {
namespace npu {

// The aclnn entry points (aclnn_api.h). Only declared here: this header is also included next to
// torch_npu's copies of the CANN headers (npu_kernels.cpp), where aclnn_api.h's C declarations would clash.
struct AclnnApi;
const AclnnApi& aclnn_api_from_cann();

// The aclnn-specific conditions on top of the operator's own validation (csrc/common.h): what the
// CANN operators document beyond lite_boost's API. Raise ValueError/TypeError naming the argument.
void check_rain_fusion_contract(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                int64_t inner_precise, bool return_lse);
void check_prompt_flash_contract(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const std::string& layout, int64_t num_heads, int64_t num_kv_heads,
                                 const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
                                 int64_t pre_tokens, int64_t next_tokens);

// The whole call, arguments as in the schemas of csrc/ops.cpp: checks (the operator's validation, then
// the aclnn contract; `check == false` is a test hook that passes the arguments through untouched so
// that the double's own validation is exercised), output allocation, the aclnn arguments,
// GetWorkspaceSize, workspace, launch. Nothing is created or launched when a check fails.
std::tuple<at::Tensor, at::Tensor> rain_fusion_attention(
    const AclnnApi& api, DeviceGlue& glue, bool check, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& select_idx, const at::Tensor& select_num_idx,
    at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout, c10::string_view kv_input_layout,
    std::optional<int64_t> num_key_value_heads, int64_t mask_type, std::optional<double> scale_value,
    int64_t inner_precise, int64_t block_size, bool return_lse, c10::string_view precision);

at::Tensor prompt_flash_attention(const AclnnApi& api, DeviceGlue& glue, bool check, const at::Tensor& query,
                                  const at::Tensor& key, const at::Tensor& value,
                                  at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads, double scale_value,
                                  int64_t pre_tokens, int64_t next_tokens, c10::string_view input_layout,
                                  int64_t num_key_value_heads, at::OptionalIntArrayRef actual_seq_lengths_kv);

}  // namespace npu
}  // namespace lite_boost
