#include "common.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <numeric>
#include <sstream>

namespace lite_boost {

std::string shape_repr(at::IntArrayRef s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  if (s.size() == 1) o << ",";
  o << ")";
  return o.str();
}

std::string list_repr(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

std::string check_precision(c10::string_view precision) {
  std::string s(precision.data(), precision.size());
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  TORCH_CHECK_VALUE(s == "auto" || s == "int8" || s == "fp8", "precision must be one of ['auto', 'int8', 'fp8'], got '",
                    std::string(precision.data(), precision.size()), "'");
  return s;
}

namespace {

std::string upper(c10::string_view v) {
  std::string s(v.data(), v.size());
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string check_layout(const char* name, c10::string_view value) {
  const std::string u = upper(value);
  TORCH_CHECK_VALUE(u == "TND" || u == "BNSD", name, " must be one of ['TND', 'BNSD'], got '",
                    std::string(value.data(), value.size()), "'");
  return u;
}

bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// `_check_lengths` of the Python API. layout "TND": sum must equal total; "BNSD": one per batch, all == seq.
std::optional<std::vector<int64_t>> check_lengths(const char* name, at::OptionalIntArrayRef value, int64_t batch,
                                                  int64_t total, const std::string& layout, int64_t seq) {
  if (!value.has_value()) return std::nullopt;
  at::IntArrayRef v = *value;
  for (auto x : v) {
    TORCH_CHECK_VALUE(x >= 0, name, " must be a list of non-negative ints (per-batch lengths), got ", list_repr(v));
  }
  if (layout == "TND") {
    const int64_t s = std::accumulate(v.begin(), v.end(), int64_t{0});
    TORCH_CHECK_VALUE(s == total, name, " must sum to the TND token count ", total, " (per-batch lengths), got sum ", s);
  } else {
    TORCH_CHECK_VALUE(static_cast<int64_t>(v.size()) == batch, name, " must have one entry per batch (", batch,
                      "), got ", v.size());
    for (auto x : v) {
      TORCH_CHECK_VALUE(x == seq, name, " must equal the BNSD sequence length ", seq,
                        " for every batch; use layout 'TND' for variable lengths, got ", list_repr(v));
    }
  }
  return std::vector<int64_t>(v.begin(), v.end());
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// query / key / value: floating dtypes (float32, float16, bfloat16), one dtype, one device.
void check_qkv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  const std::pair<const char*, const at::Tensor*> qkv[] = {{"query", &query}, {"key", &key}, {"value", &value}};
  for (const auto& [name, t] : qkv) {
    TORCH_CHECK_TYPE(is_float_dtype(t->scalar_type()), name, " dtype must be one of float32, float16, bfloat16, got ",
                     dtype_name(t->scalar_type()));
  }
  TORCH_CHECK_TYPE(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
                   "query, key and value must share one dtype, got ", dtype_name(query.scalar_type()), ", ",
                   dtype_name(key.scalar_type()), ", ", dtype_name(value.scalar_type()));
  TORCH_CHECK_VALUE(query.device() == key.device() && key.device() == value.device(),
                    "query, key and value must be on one device, got ", query.device(), ", ", key.device(), ", ",
                    value.device());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> empty_rain_fusion_outputs(const at::Tensor& query, const at::Tensor& value,
                                                             bool return_lse) {
  auto sizes = query.sym_sizes().vec();
  sizes.back() = value.sym_sizes().back();
  at::Tensor out = at::empty_symint(sizes, query.options());
  if (!return_lse) return {out, at::empty({0}, query.options().dtype(at::kFloat))};
  auto lse_sizes = query.sym_sizes().vec();
  lse_sizes.pop_back();
  return {out, at::empty_symint(lse_sizes, query.options().dtype(at::kFloat))};
}

void check_rain_fusion_shapes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              c10::string_view q_input_layout, c10::string_view kv_input_layout) {
  check_qkv(query, key, value);
  const std::string ql = check_layout("q_input_layout", q_input_layout);
  const std::string kl = check_layout("kv_input_layout", kv_input_layout);
  const int64_t qr = ql == "TND" ? 3 : 4, kr = kl == "TND" ? 3 : 4;
  TORCH_CHECK_VALUE(query.dim() == qr, "query must be rank ", qr, " for q_input_layout='", ql, "', got shape ",
                    shape_repr(query.sizes()));
  TORCH_CHECK_VALUE(key.dim() == kr, "key must be rank ", kr, " for kv_input_layout='", kl, "', got shape ",
                    shape_repr(key.sizes()));
  TORCH_CHECK_VALUE(value.dim() == kr, "value must be rank ", kr, " for kv_input_layout='", kl, "', got shape ",
                    shape_repr(value.sizes()));
  TORCH_CHECK_VALUE(key.sizes().slice(0, kr - 1) == value.sizes().slice(0, kr - 1),
                    "key and value must match except in the last axis, got ", shape_repr(key.sizes()), " and ",
                    shape_repr(value.sizes()));
  TORCH_CHECK_VALUE(query.size(-1) == key.size(-1), "query and key head dims differ: ", query.size(-1), " vs ",
                    key.size(-1));
  const int64_t n1 = query.size(1), n2 = key.size(1);
  TORCH_CHECK_VALUE(n1 != 0 && n2 != 0 && n1 % n2 == 0, "query heads (", n1,
                    ") must be a positive multiple of key/value heads (", n2, ")");
}

void check_select(const at::Tensor& select_idx_in, const at::Tensor& select_num_in,
                  const std::vector<int64_t>& q_blocks, const std::vector<int64_t>& kv_blocks) {
  const at::Tensor idx_t = select_idx_in.to(at::kLong).contiguous();
  const at::Tensor num_t = select_num_in.to(at::kLong).contiguous();
  const int64_t rows = idx_t.size(0), heads = idx_t.size(1), m = idx_t.size(2);
  if (idx_t.numel() == 0) return;
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  const int64_t* num = num_t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t n = num[r * heads + h];
      TORCH_CHECK_VALUE(n >= 0 && n <= m, "select_num_idx values must be in [0, ", m, "]; select_num_idx[", r, ", ",
                        h, "] = ", n);
    }
  std::vector<int64_t> limit(rows);
  {
    int64_t r = 0;
    for (size_t b = 0; b < q_blocks.size(); ++b)
      for (int64_t i = 0; i < q_blocks[b]; ++i) limit[r++] = kv_blocks[b];
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t n = num[r * heads + h];
      const int64_t* row = idx + (r * heads + h) * m;
      for (int64_t j = 0; j < n; ++j) {
        TORCH_CHECK_VALUE(row[j] >= 0 && row[j] < limit[r], "select_idx[", r, ", ", h, ", ", j, "] = ", row[j],
                          " is out of range: KV block indices of this batch must be in [0, ", limit[r], ")");
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t n = num[r * heads + h];
      const int64_t* row = idx + (r * heads + h) * m;
      for (int64_t j = n; j < m; ++j) {
        TORCH_CHECK_VALUE(row[j] == -1, "select_idx[", r, ", ", h, ", ", j, "] = ", row[j],
                          " must be -1: entries past select_num_idx[", r, ", ", h, "] = ", n, " are padding");
      }
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t n = num[r * heads + h];
      const int64_t* row = idx + (r * heads + h) * m;
      for (int64_t j = 0; j + 1 < n; ++j) {
        TORCH_CHECK_VALUE(row[j + 1] > row[j], "select_idx row [", r, ", ", h,
                          "] must be strictly ascending before the -1 padding, got ", row[j], " then ", row[j + 1]);
      }
    }
}

RainFusionProblem validate_rain_fusion(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout,
    c10::string_view kv_input_layout, std::optional<int64_t> num_key_value_heads, int64_t mask_type,
    std::optional<double> scale_value, int64_t inner_precise, int64_t block_size, bool check_select_entries) {
  check_rain_fusion_shapes(query, key, value, q_input_layout, kv_input_layout);
  RainFusionProblem p;
  p.q_layout = upper(q_input_layout);
  p.kv_layout = upper(kv_input_layout);
  p.n1 = query.size(1);
  p.n2 = key.size(1);
  TORCH_CHECK_VALUE(!num_key_value_heads.has_value() || *num_key_value_heads == p.n2,
                    "num_key_value_heads=", num_key_value_heads.value_or(0), " does not match the key/value tensors (",
                    p.n2, " heads)");
  // per-batch sequence lengths
  if (p.q_layout == "BNSD") {
    const int64_t qb = query.size(0);
    auto v = check_lengths("actual_seq_lengths", actual_seq_lengths, qb, 0, "BNSD", query.size(2));
    p.q_lens = v ? *v : std::vector<int64_t>(qb, query.size(2));
  } else {
    auto v = check_lengths("actual_seq_lengths", actual_seq_lengths, 0, query.size(0), "TND", 0);
    p.q_lens = v ? *v : std::vector<int64_t>{query.size(0)};
  }
  if (p.kv_layout == "BNSD") {
    const int64_t kb = key.size(0);
    auto v = check_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, kb, 0, "BNSD", key.size(2));
    p.kv_lens = v ? *v : std::vector<int64_t>(kb, key.size(2));
  } else {
    at::OptionalIntArrayRef given = actual_seq_lengths_kv;
    if (!given.has_value() && p.q_layout == "TND" && actual_seq_lengths.has_value()) {
      const auto& a = *actual_seq_lengths;
      if (std::accumulate(a.begin(), a.end(), int64_t{0}) == key.size(0)) given = actual_seq_lengths;
    }
    auto v = check_lengths("actual_seq_lengths_kv", given, 0, key.size(0), "TND", 0);
    p.kv_lens = v ? *v : std::vector<int64_t>{key.size(0)};
  }
  TORCH_CHECK_VALUE(p.q_lens.size() == p.kv_lens.size(), "query has ", p.q_lens.size(), " batches but key/value have ",
                    p.kv_lens.size());
  bool block_ok = block_shape.size() == 2;
  for (auto x : block_shape) block_ok = block_ok && x > 0;
  TORCH_CHECK_VALUE(block_ok, "block_shape must be two positive ints [q_block, kv_block], got ", list_repr(block_shape));
  p.block_q = block_shape[0];
  p.block_kv = block_shape[1];
  TORCH_CHECK_VALUE(!atten_mask.has_value(), "attn_mask is not supported by aclnnRainFusionAttention; pass None");
  TORCH_CHECK_VALUE(!block_table.has_value() && block_size == 0,
                    "paged attention is not supported: block_table must be None and block_size 0, got block_table=",
                    block_table.has_value() ? "a tensor" : "None", ", block_size=", block_size);
  TORCH_CHECK_VALUE(mask_type == 0, "mask_type must be 0 (no mask), got ", mask_type);
  TORCH_CHECK_VALUE(inner_precise == 0 || inner_precise == 1,
                    "inner_precise must be 0 (fp32 softmax) or 1 (fp16 softmax), got ", inner_precise);
  p.inner_precise = inner_precise;
  if (!scale_value.has_value()) {
    p.scale = 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  } else {
    const double s = *scale_value;
    TORCH_CHECK_VALUE(std::isfinite(s) && s > 0,
                      "scale_value must be a positive finite number or None (= head_dim ** -0.5), got ", s);
    p.scale = s;
  }
  // select arrays
  int64_t rows = 0;
  for (size_t b = 0; b < p.q_lens.size(); ++b) {
    p.q_blocks.push_back(ceil_div(p.q_lens[b], p.block_q));
    p.kv_blocks.push_back(ceil_div(p.kv_lens[b], p.block_kv));
    rows += p.q_blocks.back();
  }
  const std::tuple<const char*, const at::Tensor*, int64_t> sel[] = {{"select_idx", &select_idx, 3},
                                                                     {"select_num_idx", &select_num_idx, 2}};
  for (const auto& [name, t, rank] : sel) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong || t->scalar_type() == at::kInt, name,
                     " must be an int64 (or int32) tensor, got ", dtype_name(t->scalar_type()));
    TORCH_CHECK_VALUE(t->dim() == rank, name, " must be rank ", rank, ", got shape ", shape_repr(t->sizes()));
    TORCH_CHECK_VALUE(t->device() == query.device(), name, " must be on the query's device ", query.device(), ", got ",
                      t->device());
  }
  TORCH_CHECK_VALUE(select_idx.size(0) == rows && select_idx.size(1) == p.n1,
                    "select_idx must have shape [total query blocks=", rows, ", heads=", p.n1,
                    ", max kv blocks], got ", shape_repr(select_idx.sizes()), " (query blocks per batch: ",
                    list_repr(p.q_blocks), " for block_shape[0]=", p.block_q, ")");
  TORCH_CHECK_VALUE(select_num_idx.size(0) == rows && select_num_idx.size(1) == p.n1,
                    "select_num_idx must have shape [", rows, ", ", p.n1, "], got ", shape_repr(select_num_idx.sizes()));
  if (check_select_entries && select_idx.numel()) check_select(select_idx, select_num_idx, p.q_blocks, p.kv_blocks);
  return p;
}

std::string check_pfa_layout(c10::string_view input_layout) {
  const std::string u = upper(input_layout);
  TORCH_CHECK_VALUE(u == "BSH" || u == "BSND" || u == "BNSD", "input_layout must be one of ['BSH', 'BSND', 'BNSD'], got '",
                    std::string(input_layout.data(), input_layout.size()), "'");
  return u;
}

PfaProblem validate_pfa(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads, double scale_value,
                        int64_t pre_tokens, int64_t next_tokens, c10::string_view input_layout,
                        int64_t num_key_value_heads, at::OptionalIntArrayRef actual_seq_lengths_kv) {
  check_qkv(query, key, value);
  PfaProblem p;
  p.layout = check_pfa_layout(input_layout);
  const int64_t rank = p.layout == "BSH" ? 3 : 4;
  const std::pair<const char*, const at::Tensor*> named[] = {{"query", &query}, {"key", &key}, {"value", &value}};
  for (const auto& [name, t] : named) {
    TORCH_CHECK_VALUE(t->dim() == rank, name, " must be rank ", rank, " for input_layout='", p.layout, "', got shape ",
                      shape_repr(t->sizes()));
  }
  TORCH_CHECK_VALUE(num_heads > 0, "num_heads must be positive, got ", num_heads);
  TORCH_CHECK_VALUE(num_key_value_heads >= 0, "num_key_value_heads must be >= 0 (0 = num_heads), got ",
                    num_key_value_heads);
  const int64_t kvh = num_key_value_heads ? num_key_value_heads : num_heads;
  if (p.layout == "BSH") {
    TORCH_CHECK_VALUE(query.size(2) % num_heads == 0, "query hidden size ", query.size(2),
                      " is not divisible by num_heads=", num_heads);
    TORCH_CHECK_VALUE(key.size(2) % kvh == 0 && value.size(2) % kvh == 0, "key/value hidden sizes ", key.size(2), ", ",
                      value.size(2), " are not divisible by num_key_value_heads=", kvh);
    p.q = query.unflatten(2, {num_heads, query.size(2) / num_heads}).transpose(1, 2);
    p.k = key.unflatten(2, {kvh, key.size(2) / kvh}).transpose(1, 2);
    p.v = value.unflatten(2, {kvh, value.size(2) / kvh}).transpose(1, 2);
  } else if (p.layout == "BSND") {
    p.q = query.transpose(1, 2);
    p.k = key.transpose(1, 2);
    p.v = value.transpose(1, 2);
  } else {
    p.q = query;
    p.k = key;
    p.v = value;
  }
  TORCH_CHECK_VALUE(p.q.size(1) == num_heads, "num_heads=", num_heads, " does not match the query's ", p.q.size(1),
                    " heads");
  TORCH_CHECK_VALUE(p.k.size(1) == kvh && num_heads % kvh == 0, "num_key_value_heads=", num_key_value_heads,
                    " does not match key heads ", p.k.size(1), " (num_heads must be a multiple of it)");
  TORCH_CHECK_VALUE(p.k.sizes().slice(0, 3) == p.v.sizes().slice(0, 3),
                    "key and value must match except in the last axis, got ", shape_repr(key.sizes()), " and ",
                    shape_repr(value.sizes()));
  TORCH_CHECK_VALUE(p.q.size(0) == p.k.size(0), "query has ", p.q.size(0), " batches but key/value have ", p.k.size(0));
  TORCH_CHECK_VALUE(p.q.size(3) == p.k.size(3), "query and key head dims differ: ", p.q.size(3), " vs ", p.k.size(3));
  TORCH_CHECK_VALUE(std::isfinite(scale_value), "scale_value must be finite, got ", scale_value);
  const int64_t b = p.q.size(0);
  auto lens = [&](const char* name, at::OptionalIntArrayRef v, int64_t full) {
    if (!v.has_value()) return std::vector<int64_t>(b, full);
    TORCH_CHECK_VALUE(static_cast<int64_t>(v->size()) == b, name, " must have one entry per batch (", b, "), got ",
                      v->size());
    for (auto x : *v) {
      TORCH_CHECK_VALUE(x >= 0 && x <= full, name, " entries must be in [0, ", full, "], got ", list_repr(*v));
    }
    return std::vector<int64_t>(v->begin(), v->end());
  };
  p.q_lens = lens("actual_seq_lengths", actual_seq_lengths, p.q.size(2));
  p.kv_lens = lens("actual_seq_lengths_kv", actual_seq_lengths_kv, p.k.size(2));
  p.num_heads = num_heads;
  p.num_kv_heads = kvh;
  return p;
}

}  // namespace lite_boost
