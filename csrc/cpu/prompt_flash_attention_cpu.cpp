// CPU kernel of lite_boost::prompt_flash_attention: the npu_prompt_flash_attention contract on PyTorch SDPA.
//
// Semantics (sparse_mode 0, no mask tensor): query i of a batch attends to keys j of that batch with
// i - pre_tokens <= j <= i + next_tokens, among its first actual_seq_lengths_kv[b] keys; query rows past
// actual_seq_lengths[b], and rows with no admissible key, are 0. pre/next tokens >= the sequence lengths
// (2147483647) give full bidirectional attention, which runs as one SDPA call with no mask.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common.h"

namespace lite_boost {
namespace {

at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                double scale) {
  const bool gqa = q.size(1) != k.size(1);
  return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, gqa);
}

at::Tensor prompt_flash_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                      at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads,
                                      double scale_value, int64_t pre_tokens, int64_t next_tokens,
                                      c10::string_view input_layout, int64_t num_key_value_heads,
                                      at::OptionalIntArrayRef actual_seq_lengths_kv) {
  PfaProblem p = validate_pfa(query, key, value, actual_seq_lengths, num_heads, scale_value, pre_tokens, next_tokens,
                              input_layout, num_key_value_heads, actual_seq_lengths_kv);
  const int64_t b = p.q.size(0), sq = p.q.size(2), skv = p.k.size(2), dv = p.v.size(3);
  // output in the input layout, viewed as (B, N1, Sq, Dv)
  at::Tensor out, out4;
  if (p.layout == "BNSD") {
    out = at::empty({b, num_heads, sq, dv}, query.options());
    out4 = out;
  } else {
    out = at::empty({b, sq, num_heads, dv}, query.options());
    out4 = out.transpose(1, 2);
    if (p.layout == "BSH") out = out.view({b, sq, num_heads * dv});
  }
  if (out.numel() == 0) return out;
  auto full_band = [&](int64_t lq, int64_t lkv) { return pre_tokens >= lq - 1 && next_tokens >= lkv - 1; };
  bool uniform = true;
  for (int64_t i = 0; i < b; ++i) uniform = uniform && p.q_lens[i] == sq && p.kv_lens[i] == skv;
  if (uniform && full_band(sq, skv)) {
    out4.copy_(sdpa(p.q, p.k, p.v, std::nullopt, scale_value));
    return out;
  }
  out4.zero_();
  for (int64_t i = 0; i < b; ++i) {
    const int64_t lq = p.q_lens[i], lkv = p.kv_lens[i];
    if (lq == 0 || lkv == 0) continue;
    at::Tensor q = p.q[i].narrow(1, 0, lq).unsqueeze(0);
    at::Tensor k = p.k[i].narrow(1, 0, lkv).unsqueeze(0);
    at::Tensor v = p.v[i].narrow(1, 0, lkv).unsqueeze(0);
    if (full_band(lq, lkv)) {
      out4[i].narrow(1, 0, lq).copy_(sdpa(q, k, v, std::nullopt, scale_value)[0]);
      continue;
    }
    const auto opts = at::TensorOptions().dtype(at::kLong);
    at::Tensor qi = at::arange(lq, opts).unsqueeze(1), kj = at::arange(lkv, opts).unsqueeze(0);
    at::Tensor allowed = (kj >= qi - pre_tokens).logical_and_(kj <= qi + next_tokens);  // (lq, lkv)
    at::Tensor any = allowed.any(1);                                                     // rows with a key
    at::Tensor o = sdpa(q, k, v, allowed, scale_value)[0];                              // (N1, lq, Dv)
    o.masked_fill_(any.logical_not().view({1, lq, 1}), 0);
    out4[i].narrow(1, 0, lq).copy_(o);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(lite_boost, CPU, m) { m.impl("prompt_flash_attention", &prompt_flash_attention_cpu); }

}  // namespace lite_boost
