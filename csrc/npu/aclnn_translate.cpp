// See aclnn_translate.h. Only ATen and aclnn_api.h here: no torch_npu, no CANN header.
#include "aclnn_translate.h"

#include "aclnn_api.h"

#include "../common.h"

#include <cmath>
#include <list>
#include <memory>

#include <ATen/ATen.h>

namespace lite_boost {
namespace npu {
namespace {

aclDataType acl_dtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat: return ACL_FLOAT;
    case at::kHalf: return ACL_FLOAT16;
    case at::kBFloat16: return ACL_BF16;
    case at::kDouble: return ACL_DOUBLE;
    case at::kLong: return ACL_INT64;
    case at::kInt: return ACL_INT32;
    case at::kShort: return ACL_INT16;
    case at::kChar: return ACL_INT8;
    case at::kByte: return ACL_UINT8;
    case at::kBool: return ACL_BOOL;
    default: return ACL_DT_UNDEFINED;
  }
}

const char* status_name(aclnnStatus s) {
  switch (s) {
    case ACLNN_ERR_PARAM_NULLPTR: return "ACLNN_ERR_PARAM_NULLPTR";
    case ACLNN_ERR_PARAM_INVALID: return "ACLNN_ERR_PARAM_INVALID";
    case ACLNN_ERR_RUNTIME_ERROR: return "ACLNN_ERR_RUNTIME_ERROR";
    default: return "aclnn error";
  }
}

[[noreturn]] void fail_status(const AclnnApi& api, const char* entry, aclnnStatus status) {
  const char* msg = api.recentErrMsg ? api.recentErrMsg() : nullptr;
  TORCH_CHECK(false, entry, " returned ", status, " (", status_name(status), ")",
              (msg && *msg) ? ": " : "", (msg && *msg) ? msg : "");
}

// The acl objects of one call and everything they point into. Shared with the launch closure so that
// the aclTensors, their storages, the layout strings and the workspace outlive an asynchronous launch;
// destroyed (aclDestroy*) when the last owner goes, on every path, error paths included.
class AclArgs {
 public:
  explicit AclArgs(const AclnnApi& api) : api_(api) {}
  AclArgs(const AclArgs&) = delete;
  AclArgs& operator=(const AclArgs&) = delete;
  ~AclArgs() {
    for (auto* t : tensors_) api_.destroyTensor(t);
    for (auto* a : arrays_) api_.destroyIntArray(a);
  }

  // Same view (sizes, strides, offset) over the whole storage, format ND, as torch_npu converts tensors.
  const aclTensor* tensor(const at::Tensor& t, const char* name) {
    aclDataType dt = acl_dtype(t.scalar_type());
    TORCH_CHECK(dt != ACL_DT_UNDEFINED, name, ": dtype ", lite_boost::dtype_name(t.scalar_type()), " has no aclDataType");
    std::vector<int64_t> storage_dims{static_cast<int64_t>(t.storage().nbytes() / t.itemsize())};
    const aclTensor* h = api_.createTensor(t.sizes().data(), t.dim(), dt, t.strides().data(), t.storage_offset(),
                                           ACL_FORMAT_ND, storage_dims.data(), storage_dims.size(),
                                           const_cast<void*>(t.storage().data()));
    TORCH_CHECK(h != nullptr, "aclCreateTensor failed for ", name);
    tensors_.push_back(h);
    keep_.push_back(t);
    return h;
  }
  const aclTensor* optional_tensor(const std::optional<at::Tensor>& t, const char* name) {
    return (t.has_value() && t->defined()) ? tensor(*t, name) : nullptr;
  }
  const aclIntArray* int_array(const std::vector<int64_t>& v, const char* name) {
    const aclIntArray* h = api_.createIntArray(v.data(), v.size());
    TORCH_CHECK(h != nullptr, "aclCreateIntArray failed for ", name);
    arrays_.push_back(h);
    return h;
  }
  const aclIntArray* optional_int_array(const std::optional<std::vector<int64_t>>& v, const char* name) {
    return v.has_value() ? int_array(*v, name) : nullptr;
  }
  char* string(const std::string& s) {
    strings_.push_back(s);
    return &strings_.back()[0];
  }
  void keep(const at::Tensor& t) { keep_.push_back(t); }

 private:
  const AclnnApi& api_;
  std::vector<const aclTensor*> tensors_;
  std::vector<const aclIntArray*> arrays_;
  std::list<std::string> strings_;
  std::vector<at::Tensor> keep_;
};

using LaunchFn = aclnnStatus (*)(void*, uint64_t, aclOpExecutor*, aclrtStream);

// Phase two: workspace of the size phase one asked for, on the current stream, through the glue.
void launch_phase_two(const AclnnApi& api, DeviceGlue& glue, const char* entry, LaunchFn fn,
                      std::shared_ptr<AclArgs> args, aclOpExecutor* executor, uint64_t workspace_size,
                      const at::Tensor& like) {
  TORCH_CHECK(executor != nullptr, entry, "GetWorkspaceSize succeeded but returned no executor");
  void* workspace_ptr = nullptr;
  if (workspace_size > 0) {
    at::Tensor ws = glue.workspace(workspace_size, like);
    TORCH_CHECK(ws.defined() && ws.nbytes() >= workspace_size, "workspace allocation for ", entry, " returned ",
                ws.defined() ? ws.nbytes() : 0, " bytes, ", workspace_size, " needed");
    workspace_ptr = ws.data_ptr();
    args->keep(ws);
  }
  void* stream = glue.stream(like);
  const AclnnApi* api_ptr = &api;
  glue.launch(entry, [args, fn, workspace_ptr, workspace_size, executor, stream, entry, api_ptr]() -> int {
    aclnnStatus status = fn(workspace_ptr, workspace_size, executor, stream);
    if (status != ACLNN_SUCCESS) fail_status(*api_ptr, entry, status);
    return status;
  });
}

}  // namespace


void check_rain_fusion_contract(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                int64_t inner_precise, bool return_lse) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
                   "aclnnRainFusionAttention accepts float16/bfloat16 inputs only, got ",
                   lite_boost::dtype_name(query.scalar_type()));
  TORCH_CHECK_VALUE(!(query.scalar_type() == at::kBFloat16 && inner_precise != 0),
                    "inner_precise must be 0 (fp32 softmax) for bfloat16 inputs on Ascend");
  const int64_t g = query.size(1) / key.size(1);
  TORCH_CHECK_VALUE(g < 128 && 128 % g == 0, "query heads / key-value heads = ", g,
                    " must be < 128 and divide 128 on Ascend");
  TORCH_CHECK_VALUE(value.size(-1) == query.size(-1), "value head dim (", value.size(-1),
                    ") must equal the query's (", query.size(-1), ") on Ascend: attentionOut has the query's shape");
  TORCH_CHECK_VALUE(!return_lse, "return_lse=True is not supported on Ascend: aclnnRainFusionAttention does not "
                    "produce softmax_lse (softmaxLseOptional must be null)");
}

void check_prompt_flash_contract(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                 const std::string& layout, int64_t num_heads, int64_t num_kv_heads,
                                 const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens,
                                 int64_t pre_tokens, int64_t next_tokens) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
                   "aclnnPromptFlashAttentionV3 accepts float16/bfloat16 inputs here (int8 needs quantisation "
                   "arguments this op does not take), got ", lite_boost::dtype_name(query.scalar_type()));
  const int64_t d = layout == "BSH" ? query.size(2) / num_heads : query.size(3);
  const int64_t dv = layout == "BSH" ? value.size(2) / num_kv_heads : value.size(3);
  TORCH_CHECK_VALUE(dv == d, "value head dim (", dv, ") must equal the query's (", d,
                    ") on Ascend: attentionOut has the query's shape");
  TORCH_CHECK_VALUE(num_heads / num_kv_heads <= 64, "num_heads / num_key_value_heads = ", num_heads / num_kv_heads,
                    " must be <= 64 for aclnnPromptFlashAttentionV3");
  TORCH_CHECK_VALUE(query.size(0) <= 65536, "batch size ", query.size(0),
                    " must be <= 65536 for aclnnPromptFlashAttentionV3");
  TORCH_CHECK_VALUE(num_heads <= 256, "num_heads=", num_heads, " must be <= 256 for aclnnPromptFlashAttentionV3");
  TORCH_CHECK_VALUE(d <= 512, "head dim ", d, " must be <= 512 for aclnnPromptFlashAttentionV3");
  if (layout != "BNSD") {
    TORCH_CHECK_VALUE(num_heads * d < 65535, "num_heads x head dim = ", num_heads * d,
                      " must be < 65535 for aclnnPromptFlashAttentionV3 with input_layout '", layout, "'");
  }
  // sparse_mode 0 without a mask: the operator ignores pre/next tokens (full attention). A narrower band
  // would need a mask this kernel does not build, so refuse it rather than answer differently from the CPU.
  for (size_t b = 0; b < q_lens.size(); ++b) {
    if (q_lens[b] == 0 || kv_lens[b] == 0) continue;
    TORCH_CHECK_VALUE(pre_tokens >= q_lens[b] - 1 && next_tokens >= kv_lens[b] - 1, "pre_tokens=", pre_tokens,
                      " / next_tokens=", next_tokens, " limit attention to a band of batch ", b, " (", q_lens[b],
                      " queries, ", kv_lens[b], " keys); on Ascend this op runs aclnnPromptFlashAttentionV3 without "
                      "a mask, which ignores them: pass pre_tokens=next_tokens=2147483647 for full attention");
  }
}

namespace {

// Rows the contract defines as 0 but the aclnn operators leave unspecified: query rows that select no KV
// block (rain fusion). One host->device copy of a row mask and one fill, only when such rows exist.
void zero_empty_rows(at::Tensor& out, const lite_boost::RainFusionProblem& p, const at::Tensor& select_num_host) {
  at::Tensor empty = select_num_host.to(at::kLong).eq(0);  // [rows, N1]
  if (!empty.any().item<bool>()) return;
  std::vector<at::Tensor> per_batch;
  int64_t row = 0;
  for (size_t b = 0; b < p.q_lens.size(); ++b) {
    const int64_t nb = p.q_blocks[b];
    // [nb, N1] -> token rows [len, N1]
    at::Tensor m = empty.narrow(0, row, nb).repeat_interleave(p.block_q, 0).narrow(0, 0, p.q_lens[b]);
    per_batch.push_back(m);
    row += nb;
  }
  at::Tensor mask;
  if (p.q_layout == "TND") {
    mask = at::cat(per_batch, 0).unsqueeze(-1);  // (T, N1, 1)
  } else {
    mask = at::stack(per_batch, 0).transpose(1, 2).unsqueeze(-1);  // (B, N1, S, 1)
  }
  out.masked_fill_(mask.to(out.device(), /*non_blocking=*/true), 0);
}

// Rows past actual_seq_lengths, and rows of batches without keys: 0 as on the CPU kernel.
void zero_padding_rows(at::Tensor& out4, const std::vector<int64_t>& q_lens, const std::vector<int64_t>& kv_lens) {
  const int64_t sq = out4.size(2);
  for (size_t b = 0; b < q_lens.size(); ++b) {
    const int64_t from = kv_lens[b] == 0 ? 0 : q_lens[b];
    if (from < sq) out4[b].narrow(1, from, sq - from).zero_();
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rain_fusion_attention(
    const AclnnApi& api, DeviceGlue& glue, bool check, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& select_idx, const at::Tensor& select_num_idx,
    at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout, c10::string_view kv_input_layout,
    std::optional<int64_t> num_key_value_heads, int64_t mask_type, std::optional<double> scale_value,
    int64_t inner_precise, int64_t block_size, bool return_lse, c10::string_view precision) {
  static constexpr const char* kEntry = "aclnnRainFusionAttention";
  TORCH_CHECK_VALUE(lite_boost::check_precision(precision) == "auto", "precision='",
                    std::string(precision.data(), precision.size()),
                    "' is not supported by aclnnRainFusionAttention (it runs in the input dtype); use 'auto'");
  lite_boost::RainFusionProblem p;
  at::Tensor select_num_host;
  std::vector<int64_t> q_lens, kv_lens;
  std::string q_layout(q_input_layout.data(), q_input_layout.size());
  std::string kv_layout(kv_input_layout.data(), kv_input_layout.size());
  int64_t num_kv_heads = num_key_value_heads.value_or(key.defined() && key.dim() > 1 ? key.size(1) : 0);
  double scale = scale_value.value_or(1.0);
  if (check) {
    // The operator's validation (same messages as the Python API), then what aclnn adds. The index
    // contents are checked on a host copy (one device->host transfer; a no-op on CPU).
    p = lite_boost::validate_rain_fusion(query, key, value, select_idx, select_num_idx, block_shape, atten_mask,
                                         actual_seq_lengths, actual_seq_lengths_kv, block_table, q_input_layout,
                                         kv_input_layout, num_key_value_heads, mask_type, scale_value, inner_precise,
                                         block_size, /*check_select=*/false);
    check_rain_fusion_contract(query, key, value, inner_precise, return_lse);
    select_num_host = select_num_idx.cpu();
    if (select_idx.numel()) lite_boost::check_select(select_idx.cpu(), select_num_host, p.q_blocks, p.kv_blocks);
    q_lens = p.q_lens;  // the contract wants per-batch lengths for both layouts, defaults filled in
    kv_lens = p.kv_lens;
    q_layout = p.q_layout;
    kv_layout = p.kv_layout;
    num_kv_heads = p.n2;
    scale = p.scale;
  } else {
    if (actual_seq_lengths.has_value()) q_lens = actual_seq_lengths->vec();
    if (actual_seq_lengths_kv.has_value()) kv_lens = actual_seq_lengths_kv->vec();
  }
  TORCH_CHECK(api.createTensor && api.createIntArray && api.destroyTensor && api.destroyIntArray &&
                  api.rainFusionGetWorkspaceSize && api.rainFusion,
              kEntry, " is not available from ", api.origin,
              " (needs a CANN with the ops-transformer RainFusionAttention operator)");

  auto args = std::make_shared<AclArgs>(api);
  // aclnn wants INT64 indices; the Python API also accepts int32.
  at::Tensor idx = select_idx.defined() ? select_idx.to(at::kLong) : select_idx;
  at::Tensor num = select_num_idx.defined() ? select_num_idx.to(at::kLong) : select_num_idx;
  at::Tensor out = at::empty(query.sizes(), query.options());
  const bool pass_q_lens = check || actual_seq_lengths.has_value();
  const bool pass_kv_lens = check || actual_seq_lengths_kv.has_value();
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status = api.rainFusionGetWorkspaceSize(
      args->tensor(query, "query"), args->tensor(key, "key"), args->tensor(value, "value"),
      args->tensor(idx, "select_idx"), args->tensor(num, "select_num_idx"),
      args->int_array(block_shape.vec(), "block_shape"), args->optional_tensor(atten_mask, "atten_mask"),
      pass_q_lens ? args->int_array(q_lens, "actual_seq_lengths") : nullptr,
      pass_kv_lens ? args->int_array(kv_lens, "actual_seq_lengths_kv") : nullptr,
      args->optional_tensor(block_table, "block_table"), args->string(q_layout), args->string(kv_layout),
      num_kv_heads, mask_type, scale, inner_precise, block_size, args->tensor(out, "attentionOut"),
      /*softmaxLseOptional=*/nullptr, &workspace_size, &executor);
  if (status != ACLNN_SUCCESS) fail_status(api, "aclnnRainFusionAttentionGetWorkspaceSize", status);
  launch_phase_two(api, glue, kEntry, api.rainFusion, std::move(args), executor, workspace_size, query);
  if (check) zero_empty_rows(out, p, select_num_host);
  return {out, at::empty({0}, query.options().dtype(at::kFloat))};
}

at::Tensor prompt_flash_attention(const AclnnApi& api, DeviceGlue& glue, bool check, const at::Tensor& query,
                                  const at::Tensor& key, const at::Tensor& value,
                                  at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads, double scale_value,
                                  int64_t pre_tokens, int64_t next_tokens, c10::string_view input_layout,
                                  int64_t num_key_value_heads, at::OptionalIntArrayRef actual_seq_lengths_kv) {
  static constexpr const char* kEntry = "aclnnPromptFlashAttentionV3";
  std::string layout(input_layout.data(), input_layout.size());
  lite_boost::PfaProblem p;
  if (check) {
    p = lite_boost::validate_pfa(query, key, value, actual_seq_lengths, num_heads, scale_value, pre_tokens,
                                 next_tokens, input_layout, num_key_value_heads, actual_seq_lengths_kv);
    check_prompt_flash_contract(query, key, value, p.layout, num_heads, p.num_kv_heads, p.q_lens, p.kv_lens,
                                pre_tokens, next_tokens);
    layout = p.layout;
  }
  TORCH_CHECK(api.createTensor && api.createIntArray && api.destroyTensor && api.destroyIntArray &&
                  api.pfaGetWorkspaceSize && api.pfa,
              kEntry, " is not available from ", api.origin);
  auto args = std::make_shared<AclArgs>(api);
  // The operator does not take non-contiguous tensors (documented); copies only when needed.
  at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  auto lens = [&](at::OptionalIntArrayRef l) {
    return l.has_value() ? std::optional<std::vector<int64_t>>(l->vec()) : std::nullopt;
  };
  // As torch_npu passes them for sparse_mode 0: no mask, innerPrecise 1 (its default).
  const int64_t sparse_mode = 0, inner_precise = 1;
  uint64_t workspace_size = 0;
  aclOpExecutor* executor = nullptr;
  aclnnStatus status = api.pfaGetWorkspaceSize(
      args->tensor(q, "query"), args->tensor(k, "key"), args->tensor(v, "value"), /*pseShift=*/nullptr,
      /*attenMask=*/nullptr, args->optional_int_array(lens(actual_seq_lengths), "actual_seq_lengths"),
      args->optional_int_array(lens(actual_seq_lengths_kv), "actual_seq_lengths_kv"), /*deqScale1=*/nullptr,
      /*quantScale1=*/nullptr, /*deqScale2=*/nullptr, /*quantScale2=*/nullptr, /*quantOffset2=*/nullptr, num_heads,
      scale_value, pre_tokens, next_tokens, args->string(layout), num_key_value_heads, sparse_mode, inner_precise,
      args->tensor(out, "attentionOut"), &workspace_size, &executor);
  if (status != ACLNN_SUCCESS) fail_status(api, "aclnnPromptFlashAttentionV3GetWorkspaceSize", status);
  launch_phase_two(api, glue, kEntry, api.pfa, std::move(args), executor, workspace_size, query);
  if (check) {
    bool padded = false;
    for (size_t b = 0; b < p.q_lens.size(); ++b) padded = padded || p.q_lens[b] < p.q.size(2) || p.kv_lens[b] == 0;
    if (padded) {
      at::Tensor out4 = layout == "BNSD" ? out
                        : layout == "BSND"
                            ? out.transpose(1, 2)
                            : out.unflatten(2, {num_heads, out.size(2) / num_heads}).transpose(1, 2);
      zero_padding_rows(out4, p.q_lens, p.kv_lens);
    }
  }
  return out;
}

}  // namespace npu
}  // namespace lite_boost
