// lite_boost operator library: schemas of the two operators and their Meta (fake) kernels.
//
// Device kernels live elsewhere and register themselves with TORCH_LIBRARY_IMPL:
//   csrc/cpu/  CPU kernels (always built)
//   csrc/npu/  Ascend kernels calling aclnn (PrivateUse1; built only where CANN + torch_npu exist)
// The schemas are documented in csrc/README.md; keep the two in step.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "common.h"

namespace lite_boost {
namespace {

// Output shape of rain_fusion_attention: the query's shape with the value head dim. softmax_lse is
// fp32 shaped like the query without its last axis when return_lse, else an empty [0] tensor.
std::tuple<at::Tensor, at::Tensor> rain_fusion_attention_meta(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout,
    c10::string_view kv_input_layout, std::optional<int64_t> num_key_value_heads, int64_t mask_type,
    std::optional<double> scale_value, int64_t inner_precise, int64_t block_size, bool return_lse,
    c10::string_view precision) {
  check_rain_fusion_shapes(query, key, value, q_input_layout, kv_input_layout);
  check_precision(precision);
  return empty_rain_fusion_outputs(query, value, return_lse);
}

at::Tensor prompt_flash_attention_meta(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads, double scale_value, int64_t pre_tokens,
    int64_t next_tokens, c10::string_view input_layout, int64_t num_key_value_heads,
    at::OptionalIntArrayRef actual_seq_lengths_kv) {
  const std::string layout = check_pfa_layout(input_layout);
  TORCH_CHECK_VALUE(query.dim() == (layout == "BSH" ? 3 : 4), "query must be rank ", (layout == "BSH" ? 3 : 4),
                    " for input_layout='", layout, "', got shape ", query.sizes());
  auto sizes = query.sym_sizes().vec();
  if (layout == "BSH") {
    const int64_t kvh = num_key_value_heads > 0 ? num_key_value_heads : num_heads;
    TORCH_CHECK_VALUE(kvh > 0, "num_heads must be positive, got ", num_heads);
    sizes.back() = value.sym_sizes().back() / kvh * num_heads;
  } else {
    sizes.back() = value.sym_sizes().back();
  }
  return at::empty_symint(sizes, query.options());
}

}  // namespace

TORCH_LIBRARY(lite_boost, m) {
  m.def(
      "rain_fusion_attention(Tensor query, Tensor key, Tensor value, Tensor select_idx, Tensor select_num_idx, "
      "int[] block_shape, Tensor? atten_mask=None, int[]? actual_seq_lengths=None, "
      "int[]? actual_seq_lengths_kv=None, Tensor? block_table=None, str q_input_layout=\"TND\", "
      "str kv_input_layout=\"TND\", int? num_key_value_heads=None, int mask_type=0, float? scale_value=None, "
      "int inner_precise=0, int block_size=0, *, bool return_lse=False, str precision=\"auto\") "
      "-> (Tensor attention_out, Tensor softmax_lse)");
  m.def(
      "prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, int[]? actual_seq_lengths=None, "
      "int num_heads=1, float scale_value=1.0, int pre_tokens=2147473647, int next_tokens=0, "
      "str input_layout=\"BSH\", int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(lite_boost, Meta, m) {
  m.impl("rain_fusion_attention", &rain_fusion_attention_meta);
  m.impl("prompt_flash_attention", &prompt_flash_attention_meta);
}

}  // namespace lite_boost
