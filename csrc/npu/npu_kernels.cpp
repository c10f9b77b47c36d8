// Ascend (PrivateUse1) kernels of lite_boost::rain_fusion_attention and lite_boost::prompt_flash_attention.
//
// Only the device glue lives here: the current NPU stream, the workspace from torch_npu's caching
// allocator, and the launch through torch_npu's OpCommand task queue (the way torch_npu's own aclnn
// operators are launched). Everything else - argument checks, aclTensor arguments, the two-phase
// call - is aclnn_translate.cpp, which the tests run on CPU against the aclnn test double.
//
// Built only where CANN and torch_npu are found (lite_boost/ops/_ext_npu.py); never includes
// aclnn_api.h, whose C declarations would clash with torch_npu's copies of the CANN headers.
#include <torch/library.h>

#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "aclnn_translate.h"

namespace lite_boost {
namespace npu {
namespace {

class TorchNpuGlue final : public DeviceGlue {
 public:
  void* stream(const at::Tensor& like) override {
    return c10_npu::getCurrentNPUStream(like.device().index()).stream(false);
  }
  at::Tensor workspace(uint64_t bytes, const at::Tensor& like) override {
    // at::empty on the NPU device goes through torch_npu's caching allocator, in the current stream.
    return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  }
  void launch(const char* op_name, std::function<int()> fn) override {
    at_npu::native::OpCommand cmd;
    cmd.Name(op_name);
    cmd.SetCustomHandler(std::move(fn));
    cmd.Run();
  }
};

std::tuple<at::Tensor, at::Tensor> rain_fusion_attention_npu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout, c10::string_view kv_input_layout,
    std::optional<int64_t> num_key_value_heads, int64_t mask_type, std::optional<double> scale_value,
    int64_t inner_precise, int64_t block_size, bool return_lse, c10::string_view precision) {
  TorchNpuGlue glue;
  return rain_fusion_attention(aclnn_api_from_cann(), glue, /*check=*/true, query, key, value, select_idx,
                               select_num_idx, block_shape, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
                               block_table, q_input_layout, kv_input_layout, num_key_value_heads, mask_type,
                               scale_value, inner_precise, block_size, return_lse, precision);
}

at::Tensor prompt_flash_attention_npu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads,
                                      double scale_value, int64_t pre_tokens, int64_t next_tokens,
                                      c10::string_view input_layout, int64_t num_key_value_heads,
                                      at::OptionalIntArrayRef actual_seq_lengths_kv) {
  TorchNpuGlue glue;
  return prompt_flash_attention(aclnn_api_from_cann(), glue, /*check=*/true, query, key, value, actual_seq_lengths,
                                num_heads, scale_value, pre_tokens, next_tokens, input_layout, num_key_value_heads,
                                actual_seq_lengths_kv);
}

}  // namespace

TORCH_LIBRARY_IMPL(lite_boost, PrivateUse1, m) {
  m.impl("rain_fusion_attention", &rain_fusion_attention_npu);
  m.impl("prompt_flash_attention", &prompt_flash_attention_npu);
}

}  // namespace npu
}  // namespace lite_boost
