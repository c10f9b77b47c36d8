// Test double of the aclnn entry points lite_boost's Ascend kernels call, for running the Ascend C++
// translation (csrc/npu/aclnn_translate.cpp) on CPU. Test-only: built by tests/_aclnn_double.py.
//
// The entry points have the documented signatures (csrc/npu/aclnn_api.h). Phase one validates every
// argument against the operator documents (aclnnRainFusionAttention, aclnnPromptFlashAttentionV3) and
// returns their status codes with a message for aclGetRecentErrMsg; phase two checks the protocol
// (executor from phase one, used once; the workspace size phase one asked for; the stream of the glue;
// argument handles still alive) and computes the documented result with a plain ATen reference in fp32.
// Outputs the documents leave unspecified (rows that select no block, rows past the actual lengths)
// are written as NaN, so the translation must define them itself.
//
// The translated kernels are registered as torch.ops.lite_boost_aclnn_double.* (CPU), next to hooks for
// the tests: the event log, the count of live acl handles and failure injection.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "npu/aclnn_api.h"
#include "npu/aclnn_translate.h"

namespace {
constexpr uint32_t kTensorMagic = 0x7e5a0001, kArrayMagic = 0x7e5a0002, kExecMagic = 0x7e5a0003;
}

struct aclTensor {
  uint32_t magic = kTensorMagic;
  std::vector<int64_t> view, strides, storage;
  int64_t offset = 0;
  aclDataType dtype = ACL_DT_UNDEFINED;
  aclFormat format = ACL_FORMAT_UNDEFINED;
  void* data = nullptr;
};

struct aclIntArray {
  uint32_t magic = kArrayMagic;
  std::vector<int64_t> values;
};

struct aclOpExecutor {
  uint32_t magic = kExecMagic;
  std::string op;  // the launch entry this executor belongs to
  uint64_t workspace = 0;
  std::vector<const aclTensor*> handles;  // must still be alive at launch
  // rain fusion
  const aclTensor *q = nullptr, *k = nullptr, *v = nullptr, *idx = nullptr, *num = nullptr, *out = nullptr;
  std::vector<int64_t> q_lens, kv_lens, block;
  std::string q_layout, kv_layout, layout;
  double scale = 1.0;
  int64_t inner_precise = 0, num_heads = 0, num_kv_heads = 0;
};

namespace {

struct DoubleState {
  std::mutex mu;
  std::set<const void*> live;  // aclTensor / aclIntArray handles not yet destroyed
  std::vector<std::string> events;
  std::string fail_entry;  // failure injection: next call of this entry returns fail_status
  int64_t fail_status = 0;
  int stream_token = 0;  // the address is the glue's aclrtStream
  bool deferred = false;  // launches queued (like torch_npu's task queue) until run_deferred()
  std::vector<std::function<int()>> queue;
};

DoubleState& state() {
  static DoubleState s;
  return s;
}

thread_local std::string g_recent_error;

void log_event(const std::string& e) {
  std::lock_guard<std::mutex> g(state().mu);
  state().events.push_back(e);
}

bool is_live(const void* h) {
  std::lock_guard<std::mutex> g(state().mu);
  return state().live.count(h) != 0;
}

aclnnStatus error(aclnnStatus status, const std::string& msg) {
  g_recent_error = msg;
  return status;
}

bool injected(const char* entry, aclnnStatus* status) {
  std::lock_guard<std::mutex> g(state().mu);
  if (state().fail_entry != entry) return false;
  state().fail_entry.clear();
  *status = static_cast<aclnnStatus>(state().fail_status);
  g_recent_error = std::string("injected failure of ") + entry;
  return true;
}

at::ScalarType scalar_type(aclDataType dt) {
  switch (dt) {
    case ACL_FLOAT: return at::kFloat;
    case ACL_FLOAT16: return at::kHalf;
    case ACL_BF16: return at::kBFloat16;
    case ACL_INT64: return at::kLong;
    case ACL_INT32: return at::kInt;
    case ACL_INT8: return at::kChar;
    case ACL_UINT8: return at::kByte;
    case ACL_BOOL: return at::kBool;
    case ACL_DOUBLE: return at::kDouble;
    default: return at::ScalarType::Undefined;
  }
}

// The tensor an aclTensor describes (no copy): the view over its storage.
at::Tensor as_tensor(const aclTensor* t) {
  at::Tensor storage = at::from_blob(t->data, {t->storage[0]}, at::TensorOptions().dtype(scalar_type(t->dtype)));
  return storage.as_strided(t->view, t->strides, t->offset);
}

bool is_contiguous(const aclTensor* t) {
  int64_t expected = 1;
  for (int64_t i = static_cast<int64_t>(t->view.size()) - 1; i >= 0; --i) {
    if (t->view[i] != 1 && t->strides[i] != expected) return false;
    expected *= t->view[i];
  }
  return true;
}

// Common handle checks: null -> ACLNN_ERR_PARAM_NULLPTR, not from aclCreateTensor / destroyed -> INVALID.
aclnnStatus check_handle(const aclTensor* t, const char* name, bool required) {
  if (t == nullptr) {
    return required ? error(ACLNN_ERR_PARAM_NULLPTR, std::string(name) + " is a null pointer") : ACLNN_SUCCESS;
  }
  if (!is_live(t) || t->magic != kTensorMagic) {
    return error(ACLNN_ERR_PARAM_INVALID, std::string(name) + " is not a live aclTensor");
  }
  if (t->format != ACL_FORMAT_ND) return error(ACLNN_ERR_PARAM_INVALID, std::string(name) + " format must be ND");
  return ACLNN_SUCCESS;
}

std::string dt_name(aclDataType dt) {
  switch (dt) {
    case ACL_FLOAT16: return "FLOAT16";
    case ACL_BF16: return "BFLOAT16";
    case ACL_FLOAT: return "FLOAT";
    case ACL_INT64: return "INT64";
    case ACL_INT32: return "INT32";
    default: return "dtype " + std::to_string(static_cast<int>(dt));
  }
}

std::string vec_str(const std::vector<int64_t>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

#define RETURN_IF(cond, status, msg)              \
  do {                                            \
    if (cond) {                                   \
      std::ostringstream _o;                      \
      _o << msg;                                  \
      return error((status), _o.str());           \
    }                                             \
  } while (0)
#define RETURN_IF_ERR(expr)                       \
  do {                                            \
    aclnnStatus _s = (expr);                      \
    if (_s != ACLNN_SUCCESS) return _s;           \
  } while (0)

aclOpExecutor* new_executor(const char* op, uint64_t workspace) {
  auto* e = new aclOpExecutor();
  e->op = op;
  e->workspace = workspace;
  return e;
}

// Phase-two protocol shared by both operators. Consumes the executor.
aclnnStatus check_launch(const char* entry, void* workspace, uint64_t workspace_size, aclOpExecutor* executor,
                         aclrtStream stream) {
  RETURN_IF(executor == nullptr, ACLNN_ERR_PARAM_NULLPTR, entry << ": executor is a null pointer");
  RETURN_IF(executor->magic != kExecMagic, ACLNN_ERR_PARAM_INVALID,
            entry << ": executor is not from GetWorkspaceSize or was already used");
  RETURN_IF(executor->op != entry, ACLNN_ERR_PARAM_INVALID,
            entry << ": executor belongs to " << executor->op);
  RETURN_IF(workspace_size != executor->workspace, ACLNN_ERR_PARAM_INVALID,
            entry << ": workspaceSize " << workspace_size << " differs from the " << executor->workspace
                  << " bytes GetWorkspaceSize returned");
  RETURN_IF(executor->workspace > 0 && workspace == nullptr, ACLNN_ERR_PARAM_NULLPTR,
            entry << ": workspace is null but " << executor->workspace << " bytes were asked for");
  RETURN_IF(stream != static_cast<void*>(&state().stream_token), ACLNN_ERR_PARAM_INVALID,
            entry << ": not launched on the current stream");
  for (const aclTensor* h : executor->handles) {
    RETURN_IF(!is_live(h), ACLNN_ERR_PARAM_INVALID, entry << ": an argument aclTensor was destroyed before launch");
  }
  if (workspace_size > 0) std::memset(workspace, 0xA5, workspace_size);  // the operator owns it during the launch
  return ACLNN_SUCCESS;
}

// fp32 softmax attention of q (Lq, D) over k, v (Lk, D); innerPrecise 1 rounds the probabilities to fp16.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool fp16_softmax) {
  at::Tensor s = at::matmul(q.to(at::kFloat), k.to(at::kFloat).t()) * scale;
  at::Tensor p = at::softmax(s, -1);
  if (fp16_softmax) p = p.to(at::kHalf).to(at::kFloat);
  return at::matmul(p, v.to(at::kFloat));
}

}  // namespace

// ------------------------------------------------------------------------------------------------ //
// aclnn base API                                                                                    //
// ------------------------------------------------------------------------------------------------ //

extern "C" {

aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t* stride,
                           int64_t offset, aclFormat format, const int64_t* storageDims, uint64_t storageDimsNum,
                           void* tensorData) {
  if ((viewDimsNum && (viewDims == nullptr || stride == nullptr)) || storageDimsNum != 1 || storageDims == nullptr ||
      scalar_type(dataType) == at::ScalarType::Undefined) {
    return nullptr;
  }
  auto* t = new aclTensor();
  t->view.assign(viewDims, viewDims + viewDimsNum);
  t->strides.assign(stride, stride + viewDimsNum);
  t->storage.assign(storageDims, storageDims + storageDimsNum);
  t->offset = offset;
  t->dtype = dataType;
  t->format = format;
  t->data = tensorData;
  // the view must lie inside the storage
  int64_t last = offset;
  bool empty = false;
  for (uint64_t i = 0; i < viewDimsNum; ++i) {
    empty = empty || viewDims[i] == 0;
    last += (viewDims[i] - 1) * stride[i];
  }
  if (!empty && (offset < 0 || last >= storageDims[0] || tensorData == nullptr)) {
    delete t;
    return nullptr;
  }
  {
    std::lock_guard<std::mutex> g(state().mu);
    state().live.insert(t);
    state().events.push_back("aclCreateTensor");
  }
  return t;
}

aclIntArray* aclCreateIntArray(const int64_t* value, uint64_t size) {
  if (size && value == nullptr) return nullptr;
  auto* a = new aclIntArray();
  a->values.assign(value, value + size);
  std::lock_guard<std::mutex> g(state().mu);
  state().live.insert(a);
  state().events.push_back("aclCreateIntArray");
  return a;
}

aclnnStatus aclDestroyTensor(const aclTensor* tensor) {
  if (tensor == nullptr) return ACLNN_SUCCESS;
  {
    std::lock_guard<std::mutex> g(state().mu);
    if (!state().live.erase(tensor)) return ACLNN_ERR_PARAM_INVALID;  // double free
    state().events.push_back("aclDestroyTensor");
  }
  delete tensor;
  return ACLNN_SUCCESS;
}

aclnnStatus aclDestroyIntArray(const aclIntArray* array) {
  if (array == nullptr) return ACLNN_SUCCESS;
  {
    std::lock_guard<std::mutex> g(state().mu);
    if (!state().live.erase(array)) return ACLNN_ERR_PARAM_INVALID;
    state().events.push_back("aclDestroyIntArray");
  }
  delete array;
  return ACLNN_SUCCESS;
}

const char* aclGetRecentErrMsg() { return g_recent_error.c_str(); }

// ------------------------------------------------------------------------------------------------ //
// aclnnRainFusionAttention                                                                          //
// ------------------------------------------------------------------------------------------------ //

aclnnStatus aclnnRainFusionAttentionGetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* selectIdx,
    const aclTensor* selectNumIdx, const aclIntArray* blockShape, const aclTensor* attenMaskOptional,
    const aclIntArray* actualSeqLengthsOptional, const aclIntArray* actualSeqLengthsKvOptional,
    const aclTensor* blockTableOptional, char* qInputLayout, char* kvInputLayout, int64_t numKeyValueHeads,
    int64_t maskType, double scaleValue, int64_t innerPrecise, int64_t blockSize, const aclTensor* attentionOut,
    const aclTensor* softmaxLseOptional, uint64_t* workspaceSize, aclOpExecutor** executor) {
  static const char* kEntry = "aclnnRainFusionAttentionGetWorkspaceSize";
  log_event(kEntry);
  aclnnStatus injected_status;
  if (injected(kEntry, &injected_status)) return injected_status;
  RETURN_IF(workspaceSize == nullptr || executor == nullptr, ACLNN_ERR_PARAM_NULLPTR,
            "workspaceSize / executor out-pointers are null");
  RETURN_IF_ERR(check_handle(query, "query", true));
  RETURN_IF_ERR(check_handle(key, "key", true));
  RETURN_IF_ERR(check_handle(value, "value", true));
  RETURN_IF_ERR(check_handle(selectIdx, "selectIdx", true));
  RETURN_IF_ERR(check_handle(selectNumIdx, "selectNumIdx", true));
  RETURN_IF_ERR(check_handle(attentionOut, "attentionOut", true));
  RETURN_IF(blockShape == nullptr, ACLNN_ERR_PARAM_NULLPTR, "blockShape is a null pointer");
  RETURN_IF(qInputLayout == nullptr || kvInputLayout == nullptr, ACLNN_ERR_PARAM_NULLPTR, "layout is a null pointer");
  // dtypes: FLOAT16 / BFLOAT16, one for q, k, v and attentionOut
  RETURN_IF(query->dtype != ACL_FLOAT16 && query->dtype != ACL_BF16, ACLNN_ERR_PARAM_INVALID,
            "query dtype must be FLOAT16 or BFLOAT16, got " << dt_name(query->dtype));
  RETURN_IF(key->dtype != query->dtype || value->dtype != query->dtype || attentionOut->dtype != query->dtype,
            ACLNN_ERR_PARAM_INVALID, "query, key, value and attentionOut must have one dtype");
  const std::string ql(qInputLayout), kl(kvInputLayout);
  RETURN_IF(ql != "TND" && ql != "BNSD", ACLNN_ERR_PARAM_INVALID, "qInputLayout must be TND or BNSD, got " << ql);
  RETURN_IF(kl != "TND" && kl != "BNSD", ACLNN_ERR_PARAM_INVALID, "kvInputLayout must be TND or BNSD, got " << kl);
  const size_t qr = ql == "TND" ? 3 : 4, kr = kl == "TND" ? 3 : 4;
  RETURN_IF(query->view.size() != qr, ACLNN_ERR_PARAM_INVALID, "query rank must be " << qr << " for " << ql);
  RETURN_IF(key->view.size() != kr || value->view != key->view, ACLNN_ERR_PARAM_INVALID,
            "key/value must be rank " << kr << " for " << kl << " and of one shape");
  RETURN_IF(attentionOut->view != query->view, ACLNN_ERR_PARAM_INVALID, "attentionOut must have the query's shape");
  RETURN_IF(!is_contiguous(attentionOut), ACLNN_ERR_PARAM_INVALID, "attentionOut must be contiguous");
  RETURN_IF(query->view.back() != key->view.back(), ACLNN_ERR_PARAM_INVALID, "head dims of query and key differ");
  // blockShape: at least two elements, each > 0
  const auto& bs = blockShape->values;
  RETURN_IF(bs.size() < 2 || bs[0] <= 0 || bs[1] <= 0, ACLNN_ERR_PARAM_INVALID,
            "blockShape must hold at least [X > 0, Y > 0], got " << vec_str(bs));
  // innerPrecise 0 / 1; BFLOAT16 only 0
  RETURN_IF(innerPrecise != 0 && innerPrecise != 1, ACLNN_ERR_PARAM_INVALID, "innerPrecise must be 0 or 1");
  RETURN_IF(query->dtype == ACL_BF16 && innerPrecise != 0, ACLNN_ERR_PARAM_INVALID,
            "innerPrecise must be 0 for BFLOAT16");
  // unsupported: attenMask, blockTable, softmaxLse; maskType 0; no paged attention
  RETURN_IF(attenMaskOptional != nullptr, ACLNN_ERR_PARAM_INVALID, "attenMask is not supported: pass nullptr");
  RETURN_IF(blockTableOptional != nullptr, ACLNN_ERR_PARAM_INVALID, "blockTable is not supported: pass nullptr");
  RETURN_IF(softmaxLseOptional != nullptr, ACLNN_ERR_PARAM_INVALID, "softmaxLse is not supported: pass nullptr");
  RETURN_IF(maskType != 0, ACLNN_ERR_PARAM_INVALID, "maskType must be 0 (no mask)");
  RETURN_IF(blockSize != 0, ACLNN_ERR_PARAM_INVALID, "blockSize must be 0 without blockTable");
  // selectIdx / selectNumIdx INT64
  RETURN_IF(selectIdx->dtype != ACL_INT64 || selectNumIdx->dtype != ACL_INT64, ACLNN_ERR_PARAM_INVALID,
            "selectIdx / selectNumIdx must be INT64");
  RETURN_IF(selectIdx->view.size() != 3 || selectNumIdx->view.size() != 2, ACLNN_ERR_PARAM_INVALID,
            "selectIdx must be 3-D and selectNumIdx 2-D");
  // qSeqlen / kvSeqlen: required for TND and BNSD, per batch (not cumulative)
  RETURN_IF(actualSeqLengthsOptional == nullptr || actualSeqLengthsKvOptional == nullptr, ACLNN_ERR_PARAM_NULLPTR,
            "actualSeqLengths and actualSeqLengthsKv are required for TND and BNSD");
  RETURN_IF(!is_live(actualSeqLengthsOptional) || !is_live(actualSeqLengthsKvOptional), ACLNN_ERR_PARAM_INVALID,
            "actual sequence lengths are not live aclIntArrays");
  const auto& q_lens = actualSeqLengthsOptional->values;
  const auto& kv_lens = actualSeqLengthsKvOptional->values;
  RETURN_IF(q_lens.size() != kv_lens.size() || q_lens.empty(), ACLNN_ERR_PARAM_INVALID,
            "actualSeqLengths and actualSeqLengthsKv must have one entry per batch");
  auto check_lens = [&](const std::vector<int64_t>& lens, const std::string& layout, const aclTensor* t,
                        const char* name) -> aclnnStatus {
    int64_t sum = 0;
    for (int64_t x : lens) {
      RETURN_IF(x < 0, ACLNN_ERR_PARAM_INVALID, name << " must be non-negative");
      sum += x;
    }
    if (layout == "TND") {
      RETURN_IF(sum != t->view[0], ACLNN_ERR_PARAM_INVALID,
                name << " must be per-batch lengths summing to T=" << t->view[0] << ", got " << vec_str(lens));
    } else {
      RETURN_IF(static_cast<int64_t>(lens.size()) != t->view[0], ACLNN_ERR_PARAM_INVALID,
                name << " must have B=" << t->view[0] << " entries");
      for (int64_t x : lens) RETURN_IF(x > t->view[2], ACLNN_ERR_PARAM_INVALID, name << " exceeds S");
    }
    return ACLNN_SUCCESS;
  };
  RETURN_IF_ERR(check_lens(q_lens, ql, query, "actualSeqLengths"));
  RETURN_IF_ERR(check_lens(kv_lens, kl, key, "actualSeqLengthsKv"));
  // heads: N1 >= N2, N1 % N2 == 0, numKeyValueHeads = N2, G < 128 and 128 % G == 0
  const int64_t n1 = query->view[1], n2 = key->view[1];
  RETURN_IF(numKeyValueHeads != n2, ACLNN_ERR_PARAM_INVALID,
            "numKeyValueHeads " << numKeyValueHeads << " differs from the key's " << n2 << " heads");
  RETURN_IF(n2 <= 0 || n1 < n2 || n1 % n2 != 0, ACLNN_ERR_PARAM_INVALID, "N1 must be a multiple of N2");
  const int64_t g = n1 / n2;
  RETURN_IF(!(g < 128 && 128 % g == 0), ACLNN_ERR_PARAM_INVALID, "G = N1 / N2 must be < 128 and divide 128");
  // selectIdx [QBlockNum over all batches, N1, maxKvBlockNum], selectNumIdx [QBlockNum, N1]
  const int64_t bx = bs[0], by = bs[1];
  int64_t q_blocks = 0;
  std::vector<int64_t> row_limit;
  for (size_t b = 0; b < q_lens.size(); ++b) {
    const int64_t nqb = (q_lens[b] + bx - 1) / bx;
    q_blocks += nqb;
    row_limit.insert(row_limit.end(), nqb, (kv_lens[b] + by - 1) / by);
  }
  RETURN_IF(selectIdx->view[0] != q_blocks || selectIdx->view[1] != n1, ACLNN_ERR_PARAM_INVALID,
            "selectIdx shape must be [" << q_blocks << ", " << n1 << ", maxKvBlockNum]");
  RETURN_IF(selectNumIdx->view[0] != q_blocks || selectNumIdx->view[1] != n1, ACLNN_ERR_PARAM_INVALID,
            "selectNumIdx shape must be [" << q_blocks << ", " << n1 << "]");
  // indices: valid ones first, ascending, in range; then -1
  {
    at::Tensor idx = as_tensor(selectIdx), num = as_tensor(selectNumIdx);
    const int64_t m = selectIdx->view[2];
    for (int64_t r = 0; r < q_blocks; ++r) {
      for (int64_t h = 0; h < n1; ++h) {
        const int64_t cnt = num[r][h].item<int64_t>();
        RETURN_IF(cnt < 0 || cnt > m, ACLNN_ERR_PARAM_INVALID, "selectNumIdx[" << r << ", " << h << "] out of range");
        for (int64_t j = 0; j < m; ++j) {
          const int64_t x = idx[r][h][j].item<int64_t>();
          if (j < cnt) {
            RETURN_IF(x < 0 || x >= row_limit[r], ACLNN_ERR_PARAM_INVALID,
                      "selectIdx[" << r << ", " << h << ", " << j << "] = " << x << " out of range");
            RETURN_IF(j > 0 && x <= idx[r][h][j - 1].item<int64_t>(), ACLNN_ERR_PARAM_INVALID,
                      "selectIdx row [" << r << ", " << h << "] not ascending");
          } else {
            RETURN_IF(x != -1, ACLNN_ERR_PARAM_INVALID, "selectIdx padding must be -1");
          }
        }
      }
    }
  }
  // The double's workspace: 1 KiB + 16 bytes per (query block, head).
  auto* e = new_executor("aclnnRainFusionAttention", 1024 + 16 * static_cast<uint64_t>(q_blocks * n1));
  e->handles = {query, key, value, selectIdx, selectNumIdx, attentionOut};
  e->q = query, e->k = key, e->v = value, e->idx = selectIdx, e->num = selectNumIdx, e->out = attentionOut;
  e->q_lens = q_lens, e->kv_lens = kv_lens, e->block = {bx, by};
  e->q_layout = ql, e->kv_layout = kl, e->scale = scaleValue, e->inner_precise = innerPrecise;
  e->num_heads = n1, e->num_kv_heads = n2;
  *workspaceSize = e->workspace;
  *executor = e;
  log_event(std::string(kEntry) + " -> " + std::to_string(e->workspace));
  return ACLNN_SUCCESS;
}

aclnnStatus aclnnRainFusionAttention(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                     aclrtStream stream) {
  static const char* kEntry = "aclnnRainFusionAttention";
  log_event(std::string(kEntry) + " workspace=" + std::to_string(workspaceSize));
  RETURN_IF_ERR(check_launch(kEntry, workspace, workspaceSize, executor, stream));
  std::unique_ptr<aclOpExecutor> e(executor);
  e->magic = 0;
  aclnnStatus injected_status;
  if (injected(kEntry, &injected_status)) return injected_status;
  at::Tensor q = as_tensor(e->q), k = as_tensor(e->k), v = as_tensor(e->v);
  at::Tensor idx = as_tensor(e->idx), num = as_tensor(e->num), out = as_tensor(e->out);
  const int64_t bx = e->block[0], by = e->block[1], g = e->num_heads / e->num_kv_heads;
  // (N, L, D) views of one batch
  auto seq = [](const at::Tensor& t, const std::string& layout, const std::vector<int64_t>& lens, size_t b) {
    if (layout == "BNSD") return t[b].narrow(1, 0, lens[b]);
    int64_t start = 0;
    for (size_t i = 0; i < b; ++i) start += lens[i];
    return t.narrow(0, start, lens[b]).transpose(0, 1);
  };
  out.fill_(std::numeric_limits<float>::quiet_NaN());  // unspecified rows stay NaN
  int64_t row = 0;
  for (size_t b = 0; b < e->q_lens.size(); ++b) {
    at::Tensor qb = seq(q, e->q_layout, e->q_lens, b), ob = seq(out, e->q_layout, e->q_lens, b);
    at::Tensor kb = seq(k, e->kv_layout, e->kv_lens, b), vb = seq(v, e->kv_layout, e->kv_lens, b);
    const int64_t lq = e->q_lens[b], lkv = e->kv_lens[b];
    for (int64_t i = 0; i * bx < lq; ++i, ++row) {
      const int64_t r0 = i * bx, rn = std::min(bx, lq - r0);
      for (int64_t h = 0; h < e->num_heads; ++h) {
        const int64_t cnt = num[row][h].item<int64_t>();
        if (cnt == 0) continue;
        std::vector<at::Tensor> cols;
        for (int64_t j = 0; j < cnt; ++j) {
          const int64_t blk = idx[row][h][j].item<int64_t>();
          cols.push_back(at::arange(blk * by, std::min((blk + 1) * by, lkv), at::kLong));
        }
        at::Tensor c = at::cat(cols);
        at::Tensor o = attend(qb[h].narrow(0, r0, rn), kb[h / g].index_select(0, c), vb[h / g].index_select(0, c),
                              e->scale, e->inner_precise == 1);
        ob[h].narrow(0, r0, rn).copy_(o);
      }
    }
  }
  log_event(std::string(kEntry) + " done");
  return ACLNN_SUCCESS;
}

// ------------------------------------------------------------------------------------------------ //
// aclnnPromptFlashAttentionV3                                                                       //
// ------------------------------------------------------------------------------------------------ //

aclnnStatus aclnnPromptFlashAttentionV3GetWorkspaceSize(
    const aclTensor* query, const aclTensor* key, const aclTensor* value, const aclTensor* pseShift,
    const aclTensor* attenMask, const aclIntArray* actualSeqLengths, const aclIntArray* actualSeqLengthsKv,
    const aclTensor* deqScale1, const aclTensor* quantScale1, const aclTensor* deqScale2, const aclTensor* quantScale2,
    const aclTensor* quantOffset2, int64_t numHeads, double scaleValue, int64_t preTokens, int64_t nextTokens,
    char* inputLayout, int64_t numKeyValueHeads, int64_t sparseMode, int64_t innerPrecise,
    const aclTensor* attentionOut, uint64_t* workspaceSize, aclOpExecutor** executor) {
  static const char* kEntry = "aclnnPromptFlashAttentionV3GetWorkspaceSize";
  log_event(kEntry);
  aclnnStatus injected_status;
  if (injected(kEntry, &injected_status)) return injected_status;
  RETURN_IF(workspaceSize == nullptr || executor == nullptr, ACLNN_ERR_PARAM_NULLPTR,
            "workspaceSize / executor out-pointers are null");
  RETURN_IF_ERR(check_handle(query, "query", true));
  RETURN_IF_ERR(check_handle(key, "key", true));
  RETURN_IF_ERR(check_handle(value, "value", true));
  RETURN_IF_ERR(check_handle(attentionOut, "attentionOut", true));
  RETURN_IF(inputLayout == nullptr, ACLNN_ERR_PARAM_NULLPTR, "inputLayout is a null pointer");
  // What the double models: no pse, no mask, no quantisation (all legal nullptr in the document).
  RETURN_IF(pseShift || attenMask, ACLNN_ERR_PARAM_INVALID, "pseShift / attenMask are not modelled by the double");
  RETURN_IF(deqScale1 || quantScale1 || deqScale2 || quantScale2 || quantOffset2, ACLNN_ERR_PARAM_INVALID,
            "quantisation arguments are not modelled by the double");
  RETURN_IF(query->dtype != ACL_FLOAT16 && query->dtype != ACL_BF16, ACLNN_ERR_PARAM_INVALID,
            "query dtype must be FLOAT16 or BFLOAT16 without quantisation arguments, got " << dt_name(query->dtype));
  RETURN_IF(key->dtype != query->dtype || value->dtype != query->dtype || attentionOut->dtype != query->dtype,
            ACLNN_ERR_PARAM_INVALID, "query, key, value and attentionOut must have one dtype");
  for (const aclTensor* t : {query, key, value, attentionOut}) {
    RETURN_IF(!is_contiguous(t), ACLNN_ERR_PARAM_INVALID, "non-contiguous tensors are not supported");
  }
  const std::string layout(inputLayout);
  RETURN_IF(layout != "BSH" && layout != "BSND" && layout != "BNSD", ACLNN_ERR_PARAM_INVALID,
            "inputLayout " << layout << " is not modelled (BSH, BSND, BNSD)");
  const size_t rank = layout == "BSH" ? 3 : 4;
  RETURN_IF(query->view.size() != rank || key->view.size() != rank || value->view.size() != rank,
            ACLNN_ERR_PARAM_INVALID, "query/key/value must be rank " << rank << " for " << layout);
  RETURN_IF(key->view != value->view, ACLNN_ERR_PARAM_INVALID, "key and value must have one shape");
  RETURN_IF(attentionOut->view != query->view, ACLNN_ERR_PARAM_INVALID, "attentionOut must have the query's shape");
  RETURN_IF(numHeads <= 0, ACLNN_ERR_PARAM_INVALID, "numHeads must be > 0");
  RETURN_IF(numKeyValueHeads < 0, ACLNN_ERR_PARAM_INVALID, "numKeyValueHeads must be >= 0");
  const int64_t kvh = numKeyValueHeads == 0 ? numHeads : numKeyValueHeads;
  int64_t b = query->view[0], n, s, d, sk;
  if (layout == "BSH") {
    RETURN_IF(query->view[2] % numHeads != 0, ACLNN_ERR_PARAM_INVALID, "H must be a multiple of numHeads");
    n = numHeads, s = query->view[1], d = query->view[2] / numHeads, sk = key->view[1];
    RETURN_IF(key->view[2] != kvh * d, ACLNN_ERR_PARAM_INVALID, "key H must be numKeyValueHeads x D");
  } else {
    const bool bsnd = layout == "BSND";
    n = query->view[bsnd ? 2 : 1], s = query->view[bsnd ? 1 : 2], d = query->view[3], sk = key->view[bsnd ? 1 : 2];
    RETURN_IF(n != numHeads, ACLNN_ERR_PARAM_INVALID, "numHeads differs from the query's N");
    RETURN_IF(key->view[bsnd ? 2 : 1] != kvh, ACLNN_ERR_PARAM_INVALID,
              "numKeyValueHeads must equal the key/value N for " << layout);
    RETURN_IF(key->view[3] != d, ACLNN_ERR_PARAM_INVALID, "key D differs from the query's");
  }
  RETURN_IF(key->view[0] != b, ACLNN_ERR_PARAM_INVALID, "batch sizes differ");
  RETURN_IF(numHeads % kvh != 0 || numHeads / kvh > 64, ACLNN_ERR_PARAM_INVALID,
            "numHeads must be a multiple of numKeyValueHeads, at most 64 times");
  RETURN_IF(b > 65536 || n > 256 || d > 512, ACLNN_ERR_PARAM_INVALID, "B <= 65536, N <= 256, D <= 512");
  RETURN_IF(layout != "BNSD" && n * d >= 65535, ACLNN_ERR_PARAM_INVALID, "N * D must be < 65535 for " << layout);
  auto lens = [&](const aclIntArray* a, int64_t full, const char* name, std::vector<int64_t>* out) -> aclnnStatus {
    out->assign(b, full);
    if (a == nullptr) return ACLNN_SUCCESS;
    RETURN_IF(!is_live(a), ACLNN_ERR_PARAM_INVALID, name << " is not a live aclIntArray");
    const auto& v = a->values;
    RETURN_IF(v.size() != 1 && static_cast<int64_t>(v.size()) < b, ACLNN_ERR_PARAM_INVALID,
              name << " must have 1 or at least B entries");
    for (int64_t i = 0; i < b; ++i) {
      const int64_t x = v.size() == 1 ? v[0] : v[i];
      RETURN_IF(x < 0 || x > full, ACLNN_ERR_PARAM_INVALID, name << " entries must be in [0, " << full << "]");
      (*out)[i] = x;
    }
    return ACLNN_SUCCESS;
  };
  std::vector<int64_t> q_lens, kv_lens;
  RETURN_IF_ERR(lens(actualSeqLengths, s, "actualSeqLengths", &q_lens));
  RETURN_IF_ERR(lens(actualSeqLengthsKv, sk, "actualSeqLengthsKv", &kv_lens));
  RETURN_IF(sparseMode != 0, ACLNN_ERR_PARAM_INVALID, "sparseMode " << sparseMode << " needs attenMask");
  RETURN_IF(innerPrecise < 0 || innerPrecise > 3, ACLNN_ERR_PARAM_INVALID, "innerPrecise must be in 0..3");
  (void)preTokens, (void)nextTokens;  // sparseMode 0 without attenMask: ignored (documented)
  // The double's workspace: none for one batch, 256 bytes per batch otherwise (both paths get exercised).
  auto* e = new_executor("aclnnPromptFlashAttentionV3", b == 1 ? 0 : 256 * static_cast<uint64_t>(b));
  e->handles = {query, key, value, attentionOut};
  e->q = query, e->k = key, e->v = value, e->out = attentionOut;
  e->q_lens = q_lens, e->kv_lens = kv_lens, e->layout = layout, e->scale = scaleValue;
  e->num_heads = numHeads, e->num_kv_heads = kvh, e->inner_precise = innerPrecise;
  *workspaceSize = e->workspace;
  *executor = e;
  log_event(std::string(kEntry) + " -> " + std::to_string(e->workspace));
  return ACLNN_SUCCESS;
}

aclnnStatus aclnnPromptFlashAttentionV3(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor,
                                        aclrtStream stream) {
  static const char* kEntry = "aclnnPromptFlashAttentionV3";
  log_event(std::string(kEntry) + " workspace=" + std::to_string(workspaceSize));
  RETURN_IF_ERR(check_launch(kEntry, workspace, workspaceSize, executor, stream));
  std::unique_ptr<aclOpExecutor> e(executor);
  e->magic = 0;
  aclnnStatus injected_status;
  if (injected(kEntry, &injected_status)) return injected_status;
  // (B, N, S, D) views
  auto bnsd = [&](const aclTensor* t, int64_t heads) {
    at::Tensor x = as_tensor(t);
    if (e->layout == "BNSD") return x;
    if (e->layout == "BSH") x = x.unflatten(2, {heads, x.size(2) / heads});
    return x.transpose(1, 2);
  };
  at::Tensor q = bnsd(e->q, e->num_heads), k = bnsd(e->k, e->num_kv_heads), v = bnsd(e->v, e->num_kv_heads);
  at::Tensor out = bnsd(e->out, e->num_heads);
  const int64_t g = e->num_heads / e->num_kv_heads;
  out.fill_(std::numeric_limits<float>::quiet_NaN());  // rows past the actual lengths: unspecified
  if (k.size(2) == 0) out.zero_();                     // documented: empty key/value -> zeros
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t lq = e->q_lens[b], lkv = e->kv_lens[b];
    if (lq == 0 || lkv == 0) continue;
    for (int64_t h = 0; h < e->num_heads; ++h) {
      at::Tensor o = attend(q[b][h].narrow(0, 0, lq), k[b][h / g].narrow(0, 0, lkv), v[b][h / g].narrow(0, 0, lkv),
                            e->scale, false);
      out[b][h].narrow(0, 0, lq).copy_(o);
    }
  }
  log_event(std::string(kEntry) + " done");
  return ACLNN_SUCCESS;
}

}  // extern "C"

// ------------------------------------------------------------------------------------------------ //
// The translated kernels on CPU, with a glue that records what it is asked for                     //
// ------------------------------------------------------------------------------------------------ //

namespace {

using lite_boost::npu::AclnnApi;
using lite_boost::npu::DeviceGlue;

const AclnnApi& double_api() {
  static const AclnnApi api = [] {
    AclnnApi a;
    a.createTensor = &aclCreateTensor;
    a.createIntArray = &aclCreateIntArray;
    a.destroyTensor = &aclDestroyTensor;
    a.destroyIntArray = &aclDestroyIntArray;
    a.recentErrMsg = &aclGetRecentErrMsg;
    a.rainFusionGetWorkspaceSize = &aclnnRainFusionAttentionGetWorkspaceSize;
    a.rainFusion = &aclnnRainFusionAttention;
    a.pfaGetWorkspaceSize = &aclnnPromptFlashAttentionV3GetWorkspaceSize;
    a.pfa = &aclnnPromptFlashAttentionV3;
    a.origin = "the aclnn test double";
    return a;
  }();
  return api;
}

class RecordingGlue final : public DeviceGlue {
 public:
  void* stream(const at::Tensor&) override {
    log_event("glue.stream");
    return &state().stream_token;
  }
  at::Tensor workspace(uint64_t bytes, const at::Tensor& like) override {
    log_event("glue.workspace " + std::to_string(bytes));
    return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  }
  void launch(const char* op_name, std::function<int()> fn) override {
    log_event(std::string("glue.launch ") + op_name);
    {
      std::lock_guard<std::mutex> g(state().mu);
      if (state().deferred) {
        state().queue.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }
};

template <bool kCheck>
std::tuple<at::Tensor, at::Tensor> rain_fusion_attention_double(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout, c10::string_view kv_input_layout,
    std::optional<int64_t> num_key_value_heads, int64_t mask_type, std::optional<double> scale_value,
    int64_t inner_precise, int64_t block_size, bool return_lse, c10::string_view precision) {
  RecordingGlue glue;
  return lite_boost::npu::rain_fusion_attention(double_api(), glue, kCheck, query, key, value, select_idx,
                                                select_num_idx, block_shape, atten_mask, actual_seq_lengths,
                                                actual_seq_lengths_kv, block_table, q_input_layout, kv_input_layout,
                                                num_key_value_heads, mask_type, scale_value, inner_precise, block_size,
                                                return_lse, precision);
}

template <bool kCheck>
at::Tensor prompt_flash_attention_double(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                         at::OptionalIntArrayRef actual_seq_lengths, int64_t num_heads,
                                         double scale_value, int64_t pre_tokens, int64_t next_tokens,
                                         c10::string_view input_layout, int64_t num_key_value_heads,
                                         at::OptionalIntArrayRef actual_seq_lengths_kv) {
  RecordingGlue glue;
  return lite_boost::npu::prompt_flash_attention(double_api(), glue, kCheck, query, key, value, actual_seq_lengths,
                                                 num_heads, scale_value, pre_tokens, next_tokens, input_layout,
                                                 num_key_value_heads, actual_seq_lengths_kv);
}

std::vector<std::string> events() {
  std::lock_guard<std::mutex> g(state().mu);
  return state().events;
}

void clear_events() {
  std::lock_guard<std::mutex> g(state().mu);
  state().events.clear();
}

int64_t live_handles() {
  std::lock_guard<std::mutex> g(state().mu);
  return static_cast<int64_t>(state().live.size());
}

void set_deferred(bool deferred) {
  std::lock_guard<std::mutex> g(state().mu);
  state().deferred = deferred;
}

// Runs the queued launches on another thread, as torch_npu's task queue would; returns how many ran.
int64_t run_deferred() {
  std::vector<std::function<int()>> queue;
  {
    std::lock_guard<std::mutex> g(state().mu);
    queue.swap(state().queue);
  }
  const int64_t count = static_cast<int64_t>(queue.size());
  std::exception_ptr error;
  std::thread worker([&] {
    try {
      for (auto& fn : queue) fn();
    } catch (...) {
      error = std::current_exception();
    }
    queue.clear();  // the closures (and the acl objects they own) go here, after their launch
  });
  worker.join();
  if (error) std::rethrow_exception(error);
  return count;
}

void fail_next(c10::string_view entry, int64_t status) {
  std::lock_guard<std::mutex> g(state().mu);
  state().fail_entry = std::string(entry.data(), entry.size());
  state().fail_status = status;
}

// Argument lists of the lite_boost schemas (csrc/ops.cpp); the tests check they stay identical.
constexpr const char* kRainFusionArgs =
    "(Tensor query, Tensor key, Tensor value, Tensor select_idx, Tensor select_num_idx, "
    "int[] block_shape, Tensor? atten_mask=None, int[]? actual_seq_lengths=None, "
    "int[]? actual_seq_lengths_kv=None, Tensor? block_table=None, str q_input_layout=\"TND\", "
    "str kv_input_layout=\"TND\", int? num_key_value_heads=None, int mask_type=0, float? scale_value=None, "
    "int inner_precise=0, int block_size=0, *, bool return_lse=False, str precision=\"auto\") "
    "-> (Tensor attention_out, Tensor softmax_lse)";
constexpr const char* kPromptFlashArgs =
    "(Tensor query, Tensor key, Tensor value, *, int[]? actual_seq_lengths=None, "
    "int num_heads=1, float scale_value=1.0, int pre_tokens=2147473647, int next_tokens=0, "
    "str input_layout=\"BSH\", int num_key_value_heads=0, int[]? actual_seq_lengths_kv=None) -> Tensor";

}  // namespace

TORCH_LIBRARY(lite_boost_aclnn_double, m) {
  m.def((std::string("rain_fusion_attention") + kRainFusionArgs).c_str());
  m.def((std::string("rain_fusion_attention_unchecked") + kRainFusionArgs).c_str());
  m.def((std::string("prompt_flash_attention") + kPromptFlashArgs).c_str());
  m.def((std::string("prompt_flash_attention_unchecked") + kPromptFlashArgs).c_str());
  m.def("events() -> str[]", &events);
  m.def("clear_events() -> ()", &clear_events);
  m.def("live_handles() -> int", &live_handles);
  m.def("fail_next(str entry, int status) -> ()", &fail_next);
  m.def("set_deferred(bool deferred) -> ()", &set_deferred);
  m.def("run_deferred() -> int", &run_deferred);
}

TORCH_LIBRARY_IMPL(lite_boost_aclnn_double, CPU, m) {
  m.impl("rain_fusion_attention", &rain_fusion_attention_double<true>);
  m.impl("rain_fusion_attention_unchecked", &rain_fusion_attention_double<false>);
  m.impl("prompt_flash_attention", &prompt_flash_attention_double<true>);
  m.impl("prompt_flash_attention_unchecked", &prompt_flash_attention_double<false>);
}
