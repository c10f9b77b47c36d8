// CPU kernel of lite_boost::rain_fusion_attention: flash-style block-sparse attention.
//
// Work item = (batch, query head, query block). For each item the selected KV blocks are walked in
// ascending order and grouped into tiles of up to kMaxKvTile tokens: the K rows of one run of consecutive
// blocks are read in place, those of several runs are copied into a per-thread tile buffer (256 KiB at
// most), so each tile costs one S GEMM and one softmax pass. Per tile: S = scale * Q K^T (BLAS, fp32
// output), online softmax update of the running row max / sum (vectorised with at::vec), O = O * correction
// + P V with one accumulating GEMM per run that reads V in place (V is never copied: BLAS streams it
// unpacked anyway, and copying it cost ~6% of the sparse kernel's time at S = 32,760; the K copy
// prefetches ahead, see copy_rows_prefetched). Nothing of size S x S and no gathered copy of K/V exists;
// fp16/bf16 go through MKL's 16-bit GEMMs in place (or are widened into small per-thread buffers where those are missing). Items are handed out dynamically (atomic counter) to
// at::parallel_for's threads, because rows select different numbers of blocks.
//
// precision="int8" (see run_cpu's `lowp`): S = Q K^T on oneDNN's u8 x s8 brgemm from int8 K^T smoothed by its
// per-head mean (per-KV-block scales, made once per (batch, KV head) in one fused pass) and u8 query rows (per-row
// scales), the softmax in fp32, P V on the bf16 brgemm against a bf16 VNNI copy of V; the lse adds back the
// smoothing's shift. Dense int8 attention is this kernel with every block selected.
#include "vec_config.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../common.h"
#include "blas.h"

namespace lite_boost {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kMaxKvTile = 512;  // tokens per merged KV tile (S tile = block_q x 512 fp32)

// Strided view of one operand: element (batch b, head h, token t, feature d) at
// base + batch_off[b] + h * head_stride + t * tok_stride + d.
template <typename T>
struct Operand {
  const T* base;
  std::vector<int64_t> batch_off;
  int64_t head_stride, tok_stride;
  const T* at(int64_t b, int64_t h, int64_t t) const { return base + batch_off[b] + h * head_stride + t * tok_stride; }
};

template <typename T>
Operand<T> make_operand(const at::Tensor& x, const std::string& layout, const std::vector<int64_t>& lens) {
  Operand<T> o{x.const_data_ptr<T>(), {}, 0, 0};
  if (layout == "BNSD") {
    for (size_t b = 0; b < lens.size(); ++b) o.batch_off.push_back(static_cast<int64_t>(b) * x.stride(0));
    o.head_stride = x.stride(1);
    o.tok_stride = x.stride(2);
  } else {
    int64_t start = 0;
    for (auto n : lens) {
      o.batch_off.push_back(start * x.stride(0));
      start += n;
    }
    o.head_stride = x.stride(1);
    o.tok_stride = x.stride(0);
  }
  return o;
}

// n 16-bit values -> fp32 and back, vectorised (at::vec::convert's generic form is a scalar loop).
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  using VT = at::vec::Vectorized<T>;
  int64_t i = 0;
  for (; i + VT::size() <= n; i += VT::size()) {
    auto [lo, hi] = at::vec::convert_to_float<T>(VT::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + Vec::size());
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  using VT = at::vec::Vectorized<T>;
  int64_t i = 0;
  for (; i + VT::size() <= n; i += VT::size()) {
    at::vec::convert_from_float<T>(Vec::loadu(src + i), Vec::loadu(src + i + Vec::size())).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// rows x cols (row stride ld_src) of T -> fp32 (row stride ld_dst).
template <typename T>
inline void widen(const T* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst + r * ld_dst, src + r * ld_src, cols * sizeof(float));
    } else {
      to_float(src + r * ld_src, dst + r * ld_dst, cols);
    }
  }
}

// rows x cols of T (row stride ld_src) -> dst (row stride ld_dst), prefetching a few KiB in front of the
// copy. The K rows of a selected block are one contiguous 64 KiB run far from the previous block; a plain
// row-by-row memcpy waits on L3 at every 4 KiB page (the hardware streamer does not cross pages), which
// made this copy ~10% of the fp32 kernel's time at S = 32,760 (perf); prefetching cut it to a third.
template <typename T>
void copy_rows_prefetched(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int64_t rows, int64_t cols,
                          int64_t ahead_bytes) {
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(T));
  const int64_t ahead = (ahead_bytes + row_bytes - 1) / row_bytes;
  auto prefetch_row = [&](int64_t r) {
    const char* p = reinterpret_cast<const char*>(src + r * ld_src);
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
  };
  for (int64_t r = 0; r < std::min(ahead, rows); ++r) prefetch_row(r);
  for (int64_t r = 0; r < rows; ++r) {
    if (r + ahead < rows) prefetch_row(r + ahead);
    std::memcpy(dst + r * ld_dst, src + r * ld_src, row_bytes);
  }
}

// Whether /proc/cpuinfo lists `flag` (Linux x86; false elsewhere), read once.
bool cpu_has_flag(const std::string& flag) {
  static const std::string flags = [] {
    std::ifstream f("/proc/cpuinfo");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("flags", 0) == 0) return line + " ";
    }
    return std::string();
  }();
  return flags.find(" " + flag + " ") != std::string::npos;
}

// Why the int8 mode cannot run here ("" when it can): it needs oneDNN's u8 x s8 brgemm, which runs on int8 dot
// product units (AVX512-VNNI, AVX-VNNI or AMX-INT8).
std::string int8_reason() {
  if (!at::hasMKLDNN()) return "PyTorch was built without oneDNN (mkldnn), whose brgemm runs the int8 GEMMs";
  if (!(cpu_has_flag("avx512_vnni") || cpu_has_flag("avx_vnni") || cpu_has_flag("amx_int8"))) {
    return "the CPU has no int8 dot-product instructions (avx512_vnni, avx_vnni or amx_int8)";
  }
  return "";
}

struct Scratch {
  std::vector<float> q, k, v, s, acc, m, l;
  std::vector<uint8_t> q8;        // int8 mode: quantized query rows (u8 = s8 + 128), row stride dp
  std::vector<float> qs, qm;      // int8 mode: per-row query scale, q . mean(K) of the head (for the lse)
  std::vector<int32_t> si;        // int8 mode: S tile in int32
  std::vector<at::BFloat16> p16;  // int8 mode: P tile in bf16
};

// dst[c] = float(si[c]) * ksc[c] - kcs[c] (dequantized S row of one segment); returns max(dst).
inline float dequant_row(const int32_t* si, const float* ksc, const float* kcs, float* dst, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t c = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(mx);
  for (; c + 16 <= n; c += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(si + c)), _mm512_loadu_ps(ksc + c),
                                     _mm512_loadu_ps(kcs + c));
    _mm512_storeu_ps(dst + c, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  mx = _mm512_reduce_max_ps(vmax);
#endif
  for (; c < n; ++c) {
    dst[c] = static_cast<float>(si[c]) * ksc[c] - kcs[c];
    mx = std::max(mx, dst[c]);
  }
  return mx;
}

// The int8 mode's per-(batch, KV head) operands, filled once before that head's work items run and read by
// every query block. K is smoothed by its mean over the head's tokens (K - mean(K) shifts every score of a query
// row by the same q . mean(K), so the softmax is unchanged; the lse gets q . mean(K) * scale back), then quantized
// to int8 with one scale per KV block (max |K - mean| / 127) and stored as K^T in oneDNN's VNNI layout for u8 x s8
// (dp / 4, kt_ld, 4): the query side is u8 = s8 + 128, compensated per key by 128 * sum_d k8 (kcs, pre-multiplied
// by the block scale). V is stored in bf16 VNNI layout (pairs of tokens), each KV block padded to an even length.
struct Int8Head {
  std::vector<int8_t> kq;         // (dp / 4, kt_ld, 4)
  std::vector<float> ksc, kcs;    // per key token: block scale, 128 * sum_d k8 * block scale
  std::vector<float> kmean;       // (dp), zero past d
  std::vector<at::BFloat16> vq;   // (blocks * bkp / 2, dv, 2)
  bool has_mean = false;
};

// One query row -> u8 (s8 + 128, scale amax / 127; columns d..dp at 128); returns (scale, q . km).
inline std::pair<float, float> quantize_row(const float* qf, const float* km, uint8_t* q8, int64_t d, int64_t dp) {
  float amax = 0.f, dot = 0.f;
  int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 vmax = _mm512_setzero_ps(), vdot = _mm512_setzero_ps();
  for (; c + 16 <= d; c += 16) {
    const __m512 x = _mm512_loadu_ps(qf + c);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(x));
    vdot = _mm512_fmadd_ps(x, _mm512_loadu_ps(km + c), vdot);
  }
  amax = _mm512_reduce_max_ps(vmax);
  dot = _mm512_reduce_add_ps(vdot);
#endif
  for (; c < d; ++c) {
    amax = std::max(amax, std::abs(qf[c]));
    dot += qf[c] * km[c];
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i off = _mm512_set1_epi32(128);
  for (; c + 16 <= d; c += 16) {  // round to nearest even (MXCSR default), as std::nearbyint
    const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qf + c), vinv)), off);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + c), _mm512_cvtepi32_epi8(qi));
  }
#endif
  for (; c < d; ++c) q8[c] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(qf[c] * inv)) + 128);
  for (c = d; c < dp; ++c) q8[c] = 128;
  return {amax / 127.f, dot};
}

template <typename T>
void run_cpu(const RainFusionProblem& p, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
             const at::Tensor& select_idx, const at::Tensor& select_num, at::Tensor& out, float* lse, bool lowp) {
  const int64_t d = query.size(-1), dv = value.size(-1);
  const int64_t bq = p.block_q, bk = p.block_kv, n1 = p.n1, g = p.n1 / p.n2;
  const int64_t m_sel = select_idx.size(2);
  const auto Q = make_operand<T>(query, p.q_layout, p.q_lens);
  const auto K = make_operand<T>(key, p.kv_layout, p.kv_lens);
  const auto V = make_operand<T>(value, p.kv_layout, p.kv_lens);
  // out has the query's layout and is contiguous; lse (if any) is contiguous query.shape[:-1].
  T* out_base = out.data_ptr<T>();
  std::vector<int64_t> out_off, lse_off;
  int64_t out_head, out_tok, lse_head, lse_tok;
  {
    const int64_t nb = static_cast<int64_t>(p.q_lens.size());
    int64_t start = 0;
    for (int64_t b = 0; b < nb; ++b) {
      if (p.q_layout == "BNSD") {
        out_off.push_back(b * out.stride(0));
        lse_off.push_back(b * n1 * query.size(2));
      } else {
        out_off.push_back(start * out.stride(0));
        lse_off.push_back(start * n1);
        start += p.q_lens[b];
      }
    }
    if (p.q_layout == "BNSD") {
      out_head = out.stride(1); out_tok = out.stride(2); lse_head = query.size(2); lse_tok = 1;
    } else {
      out_head = out.stride(1); out_tok = out.stride(0); lse_head = 1; lse_tok = n1;
    }
  }
  // Work items: per batch n1 * ceil(q_blocks / pair), h-major so consecutive items share K/V of one head. An
  // item is `pair` consecutive query blocks (2 by default): the KV blocks both of them selected run once with
  // both blocks' rows as one query tile (M = 2 * block_q rows), the others with each block's own rows. Taller
  // tiles halve BLAS's packing per computed block: with every block selected the kernel went from 1.12-1.15x
  // SDPA's time to ~1.0x at S = 16,384 (SDPA itself uses 256-row query tiles there).
  int64_t pair = 2;
  if (const char* e = std::getenv("LITE_BOOST_RF_PAIR")) pair = std::string(e) == "0" ? 1 : 2;
  std::vector<int64_t> item_start{0}, row_start{0}, per_head;
  for (size_t b = 0; b < p.q_lens.size(); ++b) {
    per_head.push_back((p.q_blocks[b] + pair - 1) / pair);
    item_start.push_back(item_start.back() + n1 * per_head.back());
    row_start.push_back(row_start.back() + p.q_blocks[b]);
  }
  const int64_t total = item_start.back();
  const int64_t* idx_all = select_idx.const_data_ptr<int64_t>();
  const int64_t* num_all = select_num.const_data_ptr<int64_t>();
  const float scale = static_cast<float>(p.scale);
  constexpr bool kF32 = std::is_same_v<T, float>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  int64_t max_tile = kMaxKvTile;
  if (const char* e = std::getenv("LITE_BOOST_RF_KV_TILE")) max_tile = std::max<int64_t>(std::atoll(e), 1);
  const int64_t kv_tile = std::max<int64_t>(max_tile / bk, 1) * bk;
  const int64_t mq = pair * bq;  // most query rows of one tile
  // fp16/bf16: MKL's 16-bit GEMMs read the inputs in place (P is rounded to the input dtype before P V, as
  // PyTorch's own CPU flash attention does) where the CPU has 16-bit matrix units (AMX-BF16 / AMX-FP16);
  // elsewhere the tiles are widened to fp32 for the fp32 GEMMs below: on an AMD EPYC (Zen 4) MKL's 16-bit
  // GEMMs made the whole sparse call 1.85x slower than widening (S = 16,384, 2 heads, s = 0.8).
  // LITE_BOOST_RF_HALF_GEMM=1 / 0 forces either.
  bool half_mode = false;
  if constexpr (!std::is_same_v<T, float>) {
    bool prefer = cpu_has_flag(std::is_same_v<T, at::BFloat16> ? "amx_bf16" : "amx_fp16");
    if (const char* e = std::getenv("LITE_BOOST_RF_HALF_GEMM")) prefer = std::string(e) != "0";
    half_mode = have_half_gemm<T>() && prefer;
  }
  // How far the K tile copy prefetches ahead (bytes; LITE_BOOST_RF_PREFETCH=0 turns it off, for comparisons).
  int64_t prefetch_bytes = 8192;
  if (const char* e = std::getenv("LITE_BOOST_RF_PREFETCH")) prefetch_bytes = std::max<int64_t>(std::atoll(e), 0);
  // fp32: GEMMs on oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm; C (+)= A B, no transpose, no alpha)
  // rather than the BLAS sgemm. On AMD EPYC (Zen 4, AVX-512) MKL takes its AVX2 path: 88-92 GFLOP/s per core at
  // this kernel's tile shapes against oneDNN's 185-206. S = Q K^T reads K^T: a transposed copy of the K of one
  // (batch, KV head) at a time, so every tile's segments are read in place. The scale moves from the GEMM's
  // alpha into the softmax's exponent. LITE_BOOST_RF_GEMM=blas keeps the sgemm path.
  // 16-bit inputs widened to fp32 (no 16-bit GEMM, or LITE_BOOST_RF_HALF_GEMM=0) take the same path on
  // widened Q / K^T / V tiles.
  bool brg = false;
  if (kF32 || !half_mode) {
    const char* e = std::getenv("LITE_BOOST_RF_GEMM");
    brg = at::hasMKLDNN() && !(e && std::string(e) == "blas");
  }
  // int8 mode (precision="int8"): S = Q K^T on oneDNN's u8 x s8 brgemm (AVX512-VNNI / AMX-INT8), the softmax in
  // fp32, P V on the bf16 brgemm (AVX512-BF16 / AMX-BF16) or, on CPUs without bf16 dot products, as the fp32 path
  // does (LITE_BOOST_RF_INT8_PV=bf16 / fp32 forces either). Per-row query scales (u8 rows made once per work item;
  // each query row belongs to one item), per-block key scales made once per (batch, KV head).
  bool pv16 = false;
  const int64_t dp = (d + 3) / 4 * 4, bkp = (bk + 1) / 2 * 2;
  if (lowp) {
    half_mode = false;
    brg = true;
    pv16 = cpu_has_flag("avx512_bf16") || cpu_has_flag("amx_bf16");
    if (const char* e = std::getenv("LITE_BOOST_RF_INT8_PV")) pv16 = std::string(e) == "bf16";
  }
  Int8Head ih;
  // brg: K^T of one (batch, KV head) at a time, D x kv_len (row stride kt_ld), refilled before the work items of
  // that head run (items are h-major, so they are one contiguous range): the extra memory is one head's K.
  at::Tensor kt_buf;
  const float* kt_cur = nullptr;
  int64_t kt_ld = 0;
  if (brg) {
    kt_ld = std::max<int64_t>(*std::max_element(p.kv_lens.begin(), p.kv_lens.end()), 1);
  }
  if (brg && !lowp) {
    kt_buf = at::empty({d, kt_ld}, key.options().dtype(at::kFloat));
    kt_cur = kt_buf.const_data_ptr<float>();
  }
  if (lowp) {
    const int64_t nb_max = (kt_ld + bk - 1) / bk;
    ih.kq.assign(dp * kt_ld, 0);
    ih.ksc.resize(kt_ld);
    ih.kcs.resize(kt_ld);
    ih.kmean.assign(dp, 0.f);
    if (pv16) ih.vq.assign(nb_max * bkp * dv, at::BFloat16(0.f));
  }
  auto fill_kt = [&](int64_t b, int64_t kvh) {
    const int64_t n = p.kv_lens[b];
    const at::Tensor rows = at::from_blob(const_cast<T*>(K.at(b, kvh, 0)), {n, d}, {K.tok_stride, 1},
                                          key.options());  // (n, D) of K, either layout
    if (!lowp) {
      kt_buf.narrow(1, 0, n).copy_(rows.t());
      return;
    }
    if (n == 0) {
      ih.has_mean = false;
      return;
    }
    // (1) mean over the tokens, per channel: partial sums over token chunks, then their sum
    const int64_t nb = (n + bk - 1) / bk;
    const int64_t chunk = 512, nchunk = (n + chunk - 1) / chunk;
    std::vector<float> part(nchunk * d, 0.f);
    at::parallel_for(0, nchunk, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> row(d);
      for (int64_t ci = c0; ci < c1; ++ci) {
        float* acc = part.data() + ci * d;
        for (int64_t t = ci * chunk; t < std::min(n, (ci + 1) * chunk); ++t) {
          widen(K.at(b, kvh, t), K.tok_stride, row.data(), d, 1, d);
          for (int64_t c = 0; c < d; ++c) acc[c] += row[c];
        }
      }
    });
    for (int64_t c = 0; c < d; ++c) {
      double sum = 0.0;
      for (int64_t ci = 0; ci < nchunk; ++ci) sum += part[ci * d + c];
      ih.kmean[c] = static_cast<float>(sum / static_cast<double>(n));
    }
    ih.has_mean = true;
    // (2) per KV block: scale of K - mean, int8 values into the VNNI K^T layout, per-token compensation; V of the
    // block into the bf16 VNNI layout (pairs of tokens; an odd block's last pair padded with zero)
    const float* km = ih.kmean.data();
    at::parallel_for(0, nb, 1, [&](int64_t j0, int64_t j1) {
      std::vector<float> rows(bk * d), vrow(dv);
      for (int64_t j = j0; j < j1; ++j) {
        const int64_t t0 = j * bk, len = std::min(bk, n - t0);
        float amax = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          float* r = rows.data() + t * d;
          widen(K.at(b, kvh, t0 + t), K.tok_stride, r, d, 1, d);
          for (int64_t c = 0; c < d; ++c) {
            r[c] -= km[c];
            amax = std::max(amax, std::abs(r[c]));
          }
        }
        const float scale = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / scale;
        for (int64_t t = 0; t < len; ++t) {
          const float* r = rows.data() + t * d;
          int32_t sum = 0;
          for (int64_t c4 = 0; c4 < dp; c4 += 4) {
            int8_t v4[4] = {0, 0, 0, 0};
            for (int64_t e = 0; e < 4 && c4 + e < d; ++e) {
              const int32_t qv = std::clamp(static_cast<int32_t>(std::nearbyint(r[c4 + e] * inv)), -127, 127);
              v4[e] = static_cast<int8_t>(qv);
              sum += qv;
            }
            std::memcpy(ih.kq.data() + (c4 / 4) * kt_ld * 4 + (t0 + t) * 4, v4, 4);
          }
          ih.ksc[t0 + t] = scale;
          ih.kcs[t0 + t] = 128.f * static_cast<float>(sum) * scale;
        }
        if (pv16) {
          at::BFloat16* vb = ih.vq.data() + j * bkp * dv;  // token pair p of this block: vb + p * dv * 2
          for (int64_t t = 0; t < len; ++t) {
            widen(V.at(b, kvh, t0 + t), V.tok_stride, vrow.data(), dv, 1, dv);
            at::BFloat16* dst = vb + (t / 2) * dv * 2 + (t % 2);
            for (int64_t c = 0; c < dv; ++c) dst[c * 2] = at::BFloat16(vrow[c]);
          }
          if (len % 2) {
            at::BFloat16* dst = vb + (len / 2) * dv * 2 + 1;
            for (int64_t c = 0; c < dv; ++c) dst[c * 2] = at::BFloat16(0.f);
          }
        }
      }
    });
  };
  const int8_t* kq_ptr = lowp ? ih.kq.data() : nullptr;
  const float* ksc_ptr = lowp ? ih.ksc.data() : nullptr;
  const float* kcs_ptr = lowp ? ih.kcs.data() : nullptr;
  std::atomic<int64_t> next{0};
  // the work items [lo, hi), handed out dynamically to ATen's threads
  auto run_items = [&](int64_t lo, int64_t hi) {
  next = lo;
  const int64_t nthreads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(hi - lo, 1));
  at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tid = t0; tid < t1; ++tid) {
      Scratch w;
      w.s.resize(mq * kv_tile);
      w.acc.resize(mq * dv);
      w.m.resize(mq);
      w.l.resize(mq);
      std::vector<T> p16, k_buf16;
      std::vector<int64_t> seg_tok(kv_tile / bk + 1), seg_len(kv_tile / bk + 1);
      std::vector<int64_t> both(m_sel), only0(m_sel), only1(m_sel);  // a pair's shared / own selections
      if (lowp) {
        w.q8.resize(mq * dp);
        w.qs.resize(mq);
        w.qm.resize(mq);
        w.si.resize(mq * kv_tile);
        if (pv16) w.p16.resize(mq * (kv_tile + 1));  // rows of an even stride (see the P V brgemm below)
        if (!pv16 && !kF32) w.v.resize(kv_tile * dv);
        w.q.resize(d);
      } else if (half_mode) {
        p16.resize(mq * kv_tile);
        k_buf16.resize(kv_tile * d);
      } else {
        if (!brg) w.k.resize(kv_tile * d);
        if (!kF32) w.v.resize(kv_tile * dv);
        if (!kF32) w.q.resize(mq * d);
      }
      // The selected blocks `sel` (n_sel > 0, ascending) for the query rows [tok0, tok0 + rows) of (b, h); the
      // running max / sum / accumulator are rows [st, st + rows) of w.m / w.l / w.acc. first: nothing
      // accumulated there yet. q_tile / ldq: those rows (fp32 path: in place; widened: from w.q).
      auto run_list = [&](int64_t b, int64_t h, const int64_t* sel, int64_t n_sel, int64_t tok0, int64_t rows,
                          int64_t st, bool first, const float* q_tile, int64_t ldq) {
        const int64_t kvh = h / g;
        const int64_t kv_len = p.kv_lens[b];
        float* acc = w.acc.data() + st * dv;
        float* mrow = w.m.data() + st;
        float* lrow = w.l.data() + st;
        for (int64_t j = 0; j < n_sel;) {
          // One tile = up to kv_tile tokens of selected blocks, as segments (runs of consecutive blocks).
          int64_t nseg = 0, kn = 0;
          while (j < n_sel) {
            const int64_t start = sel[j];
            if (kn > 0 && kn + std::min((start + 1) * bk, kv_len) - start * bk > kv_tile) break;
            int64_t stop = start + 1;
            ++j;
            while (j < n_sel && sel[j] == stop && kn + std::min((stop + 1) * bk, kv_len) - start * bk <= kv_tile) {
              ++stop;
              ++j;
            }
            seg_tok[nseg] = start * bk;
            seg_len[nseg] = std::min(stop * bk, kv_len) - start * bk;
            kn += seg_len[nseg++];
          }
          // K: a single segment is read in place; several are copied into the per-thread tile buffer, so
          // that S = Q K^T is one GEMM and the softmax one pass per tile, not one per block. V is always read
          // in place (fp32 / 16-bit GEMM): P V is one GEMM per segment accumulating into acc, which costs no
          // more than one GEMM over the tile (BLAS reads V unpacked either way) and saves copying V.
          const bool in_place = kF32 || half_mode;  // V (and a single-segment K) read through their strides
          const float* k_tile = nullptr;
          const T* k16 = nullptr;
          int64_t ldk = d;
          if (lowp) {
            // int8 K^T and (pv16) bf16 V of this head are read in place; fp32 P V on 16-bit inputs: V widened
            if constexpr (!kF32) {
              if (!pv16) {
                for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
                  widen(V.at(b, kvh, seg_tok[sg]), V.tok_stride, w.v.data() + off * dv, dv, seg_len[sg], dv);
                }
              }
            }
          } else if (brg) {
            // every segment's K^T columns are read in place below; widened inputs: V into the tile buffer
            if constexpr (!kF32) {
              for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
                widen(V.at(b, kvh, seg_tok[sg]), V.tok_stride, w.v.data() + off * dv, dv, seg_len[sg], dv);
              }
            }
          } else if (in_place && nseg == 1) {
            k16 = K.at(b, kvh, seg_tok[0]);
            ldk = K.tok_stride;
            if constexpr (kF32) k_tile = k16;
          } else if (half_mode) {
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              copy_rows_prefetched(K.at(b, kvh, seg_tok[sg]), K.tok_stride, k_buf16.data() + off * d, d, seg_len[sg], d,
                                   prefetch_bytes);
            }
            k16 = k_buf16.data();
          } else {
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              if constexpr (kF32) {
                copy_rows_prefetched(K.at(b, kvh, seg_tok[sg]), K.tok_stride, w.k.data() + off * d, d, seg_len[sg], d,
                                     prefetch_bytes);
              } else {
                widen(K.at(b, kvh, seg_tok[sg]), K.tok_stride, w.k.data() + off * d, d, seg_len[sg], d);
              }
              if (!in_place) widen(V.at(b, kvh, seg_tok[sg]), V.tok_stride, w.v.data() + off * dv, dv, seg_len[sg], dv);
            }
            k_tile = w.k.data();
          }
          float* s = w.s.data();
          // S (rows x kn, row stride kn) = scale * Q K^T
          // brg: S (rows x kn) = Q K^T unscaled, one brgemm per segment
          if (lowp) {
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              at::native::cpublas::brgemm(rows, seg_len[sg], dp, dp, kt_ld, kn, false, w.q8.data() + st * dp,
                                          kq_ptr + seg_tok[sg] * 4, w.si.data() + off, true);
            }
          } else if (brg) {
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              at::native::cpublas::brgemm(rows, seg_len[sg], d, ldq, kt_ld, kn, false, q_tile, kt_cur + seg_tok[sg],
                                          s + off, false);
            }
          } else if (half_mode) {
            if constexpr (!kF32) half_gemm<T>(true, rows, kn, d, scale, Q.at(b, h, tok0), Q.tok_stride, k16, ldk, 0.f, s, kn);
          } else {
            gemm_nt(rows, kn, d, scale, q_tile, ldq, k_tile, ldk, 0.f, s, kn);
          }
          // online softmax
          for (int64_t r = 0; r < rows; ++r) {
            float* sr = s + r * kn;
            float mx;
            float sc = scale;
            if (lowp) {
              // dequantize the int32 row (K scale and compensation per key); the query row's scale joins the
              // softmax scale (a zero query row has scale 0: all scores 0, as they are)
              float m0 = kNegInf;
              for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
                m0 = std::max(m0, dequant_row(w.si.data() + r * kn + off, ksc_ptr + seg_tok[sg], kcs_ptr + seg_tok[sg],
                                              sr + off, seg_len[sg]));
              }
              sc = scale * w.qs[st + r];
              mx = sc * m0;
            } else {
              sc = brg ? scale : 1.f;
              // the row max of sc * s (sc = 1 where the GEMM applied the scale; validation admits scale > 0 only)
              mx = sc * at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, sr, kn);
            }
            const float m_old = mrow[r];
            const float m_new = std::max(m_old, mx);
            // exp(sc * s - m_new) in place and its sum
            Vec vsum(0.f);
            const Vec vm(-m_new), vsc(sc);
            int64_t c = 0;
            // int8 mode with bf16 P V: P goes straight to its bf16 row (AVX512-BF16), else through the fp32 row
            at::BFloat16* p16row = lowp && pv16 ? w.p16.data() + r * (kn + (kn & 1)) : nullptr;
            int64_t conv_from = 0;  // P's columns [conv_from, kn) still to be converted to bf16
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
            if (p16row) {
              for (; c + Vec::size() <= kn; c += Vec::size()) {
                Vec x = at::vec::fmadd(Vec::loadu(sr + c), vsc, vm).exp_u20();
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16row + c), (__m256i)_mm512_cvtneps_pbh(__m512(x)));
                vsum = vsum + x;
              }
              conv_from = c;
            }
#endif
            for (; c + Vec::size() <= kn; c += Vec::size()) {
              Vec x = at::vec::fmadd(Vec::loadu(sr + c), vsc, vm).exp_u20();
              x.store(sr + c);
              vsum = vsum + x;
            }
            float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
            for (; c < kn; ++c) {
              sr[c] = std::exp(sr[c] * sc - m_new);
              sum += sr[c];
            }
            if (p16row) from_float(sr + conv_from, p16row + conv_from, kn - conv_from);  // the rest, while in L1
            const float corr = first ? 0.f : std::exp(m_old - m_new);
            lrow[r] = lrow[r] * corr + sum;
            mrow[r] = m_new;
            if (!first && corr != 1.f) {
              float* ar = acc + r * dv;
              at::vec::map([corr](Vec x) { return x * Vec(corr); }, ar, ar, dv);
            }
          }
          // acc (rows x dv) (+)= P V
          if (lowp && pv16) {
            // P in bf16 against the head's bf16 VNNI V: one brgemm per run of consecutive blocks where blocks
            // have an even token count (the padded layout is then contiguous), else one per block.
            // The reduction length is always rounded up to even: oneDNN's AMX-BF16 micro-kernel faults (SIGILL)
            // on an odd K. The extra term is exact: it meets the zero pad row of the block's V pairs, times a
            // finite P entry (the next column, or the zero / finite pad column of P's even row stride).
            const at::BFloat16* vq = ih.vq.data();
            const int64_t ldp = kn + (kn & 1);
            auto even = [](int64_t x) { return x + (x & 1); };
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              if (bkp == bk) {
                at::native::cpublas::brgemm(rows, dv, even(seg_len[sg]), ldp, dv, dv, !(first && sg == 0),
                                            w.p16.data() + off, vq + seg_tok[sg] * dv, acc, true);
              } else {
                for (int64_t t = 0; t < seg_len[sg]; t += bk) {
                  const int64_t blk = (seg_tok[sg] + t) / bk;
                  at::native::cpublas::brgemm(rows, dv, even(std::min(bk, seg_len[sg] - t)), ldp, dv, dv,
                                              !(first && sg == 0 && t == 0), w.p16.data() + off + t,
                                              vq + blk * bkp * dv, acc, true);
                }
              }
            }
          } else if (in_place) {
            if constexpr (!kF32) from_float(s, p16.data(), rows * kn);
            for (int64_t sg = 0, off = 0; sg < nseg; off += seg_len[sg++]) {
              const float beta = first && sg == 0 ? 0.f : 1.f;
              const T* v_seg = V.at(b, kvh, seg_tok[sg]);
              if constexpr (kF32) {
                if (brg) {
                  at::native::cpublas::brgemm(rows, dv, seg_len[sg], kn, V.tok_stride, dv, beta != 0.f, s + off, v_seg, acc,
                                              false);
                } else {
                  gemm_nn(rows, dv, seg_len[sg], 1.f, s + off, kn, v_seg, V.tok_stride, beta, acc, dv);
                }
              } else {
                half_gemm<T>(false, rows, dv, seg_len[sg], 1.f, p16.data() + off, kn, v_seg, V.tok_stride, beta, acc, dv);
              }
            }
          } else if (brg) {
            at::native::cpublas::brgemm(rows, dv, kn, kn, dv, dv, !first, s, w.v.data(), acc, false);
          } else {
            gemm_nn(rows, dv, kn, 1.f, s, kn, w.v.data(), dv, first ? 0.f : 1.f, acc, dv);
          }
          first = false;
        }
      };
      for (int64_t item = next.fetch_add(1); item < hi; item = next.fetch_add(1)) {
        int64_t b = 0;
        while (item >= item_start[b + 1]) ++b;
        const int64_t local = item - item_start[b];
        const int64_t h = local / per_head[b];
        const int64_t i0 = (local % per_head[b]) * pair;
        const int64_t nblk = std::min(pair, p.q_blocks[b] - i0);  // query blocks of this item (1 or 2)
        const int64_t tok0 = i0 * bq;
        const int64_t rows_all = std::min(nblk * bq, p.q_lens[b] - tok0);
        T* o_ptr = out_base + out_off[b] + h * out_head + tok0 * out_tok;
        float* l_ptr = lse ? lse + lse_off[b] + h * lse_head + tok0 * lse_tok : nullptr;
        const int64_t* sel_of[2];
        int64_t num_of[2] = {0, 0};
        for (int64_t k2 = 0; k2 < nblk; ++k2) {
          const int64_t row = row_start[b] + i0 + k2;
          num_of[k2] = num_all[row * n1 + h];
          sel_of[k2] = idx_all + (row * n1 + h) * m_sel;
        }
        // query rows (widened once per item where the GEMMs run in fp32 on 16-bit inputs)
        const float* q_all = nullptr;
        int64_t ldq = 0;
        if (lowp) {
          // u8 query rows (s8 + 128, one scale per row), and q . mean(K) for the lse
          for (int64_t r = 0; r < rows_all; ++r) {
            float* qf = w.q.data();
            widen(Q.at(b, h, tok0 + r), Q.tok_stride, qf, d, 1, d);
            std::tie(w.qs[r], w.qm[r]) = quantize_row(qf, ih.kmean.data(), w.q8.data() + r * dp, d, dp);
          }
        } else if constexpr (kF32) {
          q_all = Q.at(b, h, tok0);
          ldq = Q.tok_stride;
        } else if (!half_mode) {
          widen(Q.at(b, h, tok0), Q.tok_stride, w.q.data(), d, rows_all, d);
          q_all = w.q.data();
          ldq = d;
        }
        std::fill(w.m.begin(), w.m.begin() + rows_all, kNegInf);
        std::fill(w.l.begin(), w.l.begin() + rows_all, 0.f);
        bool done[2] = {false, false};  // something accumulated for block k2
        bool paired = false;
        if (nblk == 2 && num_of[0] > 0 && num_of[1] > 0) {
          // split the two ascending lists into shared and own blocks (linear merge)
          int64_t n_both = 0, n_own0 = 0, n_own1 = 0, a = 0, c = 0;
          const int64_t* sa = sel_of[0];
          const int64_t* sc = sel_of[1];
          while (a < num_of[0] && c < num_of[1]) {
            if (sa[a] == sc[c]) { both[n_both++] = sa[a]; ++a; ++c; }
            else if (sa[a] < sc[c]) only0[n_own0++] = sa[a++];
            else only1[n_own1++] = sc[c++];
          }
          while (a < num_of[0]) only0[n_own0++] = sa[a++];
          while (c < num_of[1]) only1[n_own1++] = sc[c++];
          // Shared tiles only pay when they are most of the work: at 20% overlap (random masks) splitting the
          // lists cost as much as the taller tiles saved; at 75-100% overlap of scattered blocks they saved 3-6%,
          // with every block selected ~10% (neighbouring query blocks of real video should sit in between).
          paired = 4 * n_both >= 3 * std::max(num_of[0], num_of[1]);
          if (paired) {
            run_list(b, h, both.data(), n_both, tok0, rows_all, 0, true, q_all, ldq);
            const int64_t rows1 = rows_all - bq;
            if (n_own0 > 0) run_list(b, h, only0.data(), n_own0, tok0, bq, 0, false, q_all, ldq);
            if (n_own1 > 0) run_list(b, h, only1.data(), n_own1, tok0 + bq, rows1, bq, false,
                                  q_all ? q_all + bq * ldq : nullptr, ldq);
            done[0] = done[1] = true;
          }
        }
        if (!paired) {
          for (int64_t k2 = 0; k2 < nblk; ++k2) {
            if (num_of[k2] == 0) continue;
            const int64_t rows = std::min(bq, rows_all - k2 * bq);
            run_list(b, h, sel_of[k2], num_of[k2], tok0 + k2 * bq, rows, k2 * bq, true,
                     q_all ? q_all + k2 * bq * ldq : nullptr, ldq);
            done[k2] = true;
          }
        }
        // normalise and store (a block that selected nothing: zeros, lse -inf)
        for (int64_t r = 0; r < rows_all; ++r) {
          T* orow = o_ptr + r * out_tok;
          if (!done[r / bq]) {
            std::fill(orow, orow + dv, T(0));
            if (l_ptr) l_ptr[r * lse_tok] = kNegInf;
            continue;
          }
          const float inv = 1.f / w.l[r];
          const float* ar = w.acc.data() + r * dv;
          if constexpr (kF32) {
            at::vec::map([inv](Vec x) { return x * Vec(inv); }, orow, ar, dv);
          } else {
            float tmp[1024];
            for (int64_t c0 = 0; c0 < dv; c0 += 1024) {
              const int64_t cn = std::min<int64_t>(1024, dv - c0);
              at::vec::map([inv](Vec x) { return x * Vec(inv); }, tmp, ar + c0, cn);
              from_float(tmp, orow + c0, cn);
            }
          }
          if (l_ptr) l_ptr[r * lse_tok] = w.m[r] + std::log(w.l[r]) + (lowp ? scale * w.qm[r] : 0.f);
        }
      }
      if (lowp) at::native::cpublas::brgemm_release(true);
    }
  });
  };
  if (!brg) {
    run_items(0, total);
    return;
  }
  for (size_t b = 0; b < p.q_lens.size(); ++b) {
    for (int64_t kvh = 0; kvh < p.n2; ++kvh) {
      fill_kt(static_cast<int64_t>(b), kvh);
      const int64_t lo = item_start[b] + kvh * g * per_head[b];
      run_items(lo, lo + g * per_head[b]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rain_fusion_attention_cpu(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& select_idx,
    const at::Tensor& select_num_idx, at::IntArrayRef block_shape, const std::optional<at::Tensor>& atten_mask,
    at::OptionalIntArrayRef actual_seq_lengths, at::OptionalIntArrayRef actual_seq_lengths_kv,
    const std::optional<at::Tensor>& block_table, c10::string_view q_input_layout,
    c10::string_view kv_input_layout, std::optional<int64_t> num_key_value_heads, int64_t mask_type,
    std::optional<double> scale_value, int64_t inner_precise, int64_t block_size, bool return_lse,
    c10::string_view precision) {
  const std::string prec = check_precision(precision);
  TORCH_CHECK_VALUE(prec != "fp8", "precision='fp8' is not supported by the CPU kernel (no fp8 dot products on "
                    "this CPU path); use 'auto' or 'int8'");
  const bool lowp = prec == "int8";
  if (lowp) {
    TORCH_CHECK_VALUE(int8_reason().empty(), "precision='int8' cannot run on this CPU: ", int8_reason());
  }
  const RainFusionProblem p = validate_rain_fusion(
      query, key, value, select_idx, select_num_idx, block_shape, atten_mask, actual_seq_lengths,
      actual_seq_lengths_kv, block_table, q_input_layout, kv_input_layout, num_key_value_heads, mask_type,
      scale_value, inner_precise, block_size, /*check_select=*/true);
  auto last_dim_unit = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_dim_unit(query), k = last_dim_unit(key), v = last_dim_unit(value);
  const at::Tensor idx = select_idx.to(at::kLong).contiguous();
  const at::Tensor num = select_num_idx.to(at::kLong).contiguous();
  at::Tensor out, lse;
  std::tie(out, lse) = empty_rain_fusion_outputs(query, value, return_lse);
  if (out.numel() == 0) return {out, lse};
  if (idx.size(2) == 0) {  // no row selects anything
    out.zero_();
    if (return_lse) lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  float* lse_ptr = return_lse ? lse.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {  // validate_rain_fusion admitted exactly these three
    case at::kFloat: run_cpu<float>(p, q, k, v, idx, num, out, lse_ptr, lowp); break;
    case at::kBFloat16: run_cpu<at::BFloat16>(p, q, k, v, idx, num, out, lse_ptr, lowp); break;
    case at::kHalf: run_cpu<at::Half>(p, q, k, v, idx, num, out, lse_ptr, lowp); break;
    default: TORCH_CHECK(false, "unreachable dtype ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(lite_boost, CPU, m) { m.impl("rain_fusion_attention", &rain_fusion_attention_cpu); }

}  // namespace lite_boost
