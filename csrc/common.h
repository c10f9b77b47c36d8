// Argument validation shared by the Meta, CPU and NPU kernels of the lite_boost operators.
//
// The messages are those of the Python API (lite_boost/ops/rain_fusion.py `_validate` and
// `_check_select`) so a caller sees the same error whichever entry point it used. TORCH_CHECK_VALUE
// raises ValueError and TORCH_CHECK_TYPE raises TypeError in Python.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace lite_boost {

// A validated rain_fusion_attention call.
struct RainFusionProblem {
  std::string q_layout;          // "TND" or "BNSD"
  std::string kv_layout;
  std::vector<int64_t> q_lens;   // per batch
  std::vector<int64_t> kv_lens;  // per batch
  std::vector<int64_t> q_blocks;   // query blocks per batch (ceil(q_len / block_shape[0]))
  std::vector<int64_t> kv_blocks;  // kv blocks per batch
  int64_t n1 = 0;                // query heads
  int64_t n2 = 0;                // key/value heads
  int64_t block_q = 0;
  int64_t block_kv = 0;
  double scale = 1.0;
  int64_t inner_precise = 0;
};

// Layout, rank, dtype and head checks that need no tensor data (safe on Meta / fake tensors).
// Uninitialised outputs of rain_fusion_attention: the query's shape with the value head dim, and the
// fp32 softmax_lse shaped like the query without its last axis (an empty [0] tensor unless return_lse).
// Symbolic sizes, so the Meta kernel and the device kernels share it.
std::tuple<at::Tensor, at::Tensor> empty_rain_fusion_outputs(const at::Tensor& query, const at::Tensor& value,
                                                             bool return_lse);

void check_rain_fusion_shapes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              c10::string_view q_input_layout, c10::string_view kv_input_layout);

// Every argument of the schema, in the order of the Python API's checks. When check_select is true the
// select arrays are also checked entry by entry (they must then be readable on the host).
RainFusionProblem validate_rain_fusion(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout,
    c10::string_view kv_input_layout, std::optional<int64_t> num_key_value_heads, int64_t mask_type,
    std::optional<double> scale_value, int64_t inner_precise, int64_t block_size, bool check_select);

// Entry-by-entry checks of select_idx / select_num_idx (host tensors, int64 or int32): counts within the
// row width, indices in range for their batch, -1 padding, strictly ascending.
void check_select(const at::Tensor& select_idx, const at::Tensor& select_num_idx,
                  const std::vector<int64_t>& q_blocks, const std::vector<int64_t>& kv_blocks);

// rain_fusion_attention's `precision`: "auto" (the input dtype's GEMMs), "int8" (int8 Q K^T after smoothing K,
// 16-bit P V) or "fp8"; anything else is a ValueError naming the allowed values. Returns the lower-cased value.
std::string check_precision(c10::string_view precision);

// prompt_flash_attention: "BSH", "BSND" or "BNSD" (upper-cased), else ValueError.
std::string check_pfa_layout(c10::string_view input_layout);

// A validated prompt_flash_attention call, as (B, N, S, D) views.
struct PfaProblem {
  at::Tensor q, k, v;  // (B, N1, Sq, D), (B, N2, Skv, D), (B, N2, Skv, Dv) views of the inputs
  std::string layout;
  std::vector<int64_t> q_lens, kv_lens;  // per batch (default: full lengths)
  int64_t num_heads = 0, num_kv_heads = 0;
};

PfaProblem validate_pfa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads, double scale_value,
                        int64_t pre_tokens, int64_t next_tokens, c10::string_view input_layout,
                        int64_t num_key_value_heads, at::OptionalIntArrayRef actual_seq_lengths_kv);

// Python-style reprs used in messages: (2, 3) for shapes, [1, 2] for lists, 'x' for strings.
std::string shape_repr(at::IntArrayRef s);
std::string list_repr(at::IntArrayRef s);
std::string dtype_name(at::ScalarType t);

}  // namespace lite_boost
