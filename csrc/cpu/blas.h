// Row-major fp32 GEMMs for the CPU kernels on the BLAS that libtorch itself links (MKL / OpenBLAS
// export the Fortran `sgemm_`). Declared weak: a torch built without an external BLAS still loads the
// library and the kernels fall back to at::addmm_ on borrowed buffers (correct, slower).
#pragma once

#include <ATen/ATen.h>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));
// MKL's mixed-precision GEMMs (16-bit inputs, fp32 accumulation and output), exported by x86 libtorch.
extern "C" void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                       const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                       int ldc) __attribute__((weak));
extern "C" void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                                     const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                                     int ldc) __attribute__((weak));

namespace lite_boost {

inline bool have_blas() { return sgemm_ != nullptr; }

// C (m x n, ldc) = alpha * A (m x k, lda) * B^T (B: n x k, ldb) + beta * C
inline void gemm_nt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                    int64_t ldb, float beta, float* c, int64_t ldc) {
  if (have_blas()) {
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
    sgemm_("T", "N", &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
    return;
  }
  auto f = at::TensorOptions().dtype(at::kFloat);
  at::Tensor A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, f);
  at::Tensor B = at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1}, f);
  at::Tensor C = at::from_blob(c, {m, n}, {ldc, 1}, f);
  C.addmm_(A, B.t(), beta, alpha);
}

// C (m x n, ldc) = alpha * A (m x k, lda) * B (k x n, ldb) + beta * C
inline void gemm_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
                    int64_t ldb, float beta, float* c, int64_t ldc) {
  if (have_blas()) {
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int LDA = static_cast<int>(ldb), LDB = static_cast<int>(lda), LDC = static_cast<int>(ldc);
    sgemm_("N", "N", &M, &N, &K, &alpha, b, &LDA, a, &LDB, &beta, c, &LDC);
    return;
  }
  auto f = at::TensorOptions().dtype(at::kFloat);
  at::Tensor A = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, f);
  at::Tensor B = at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, f);
  at::Tensor C = at::from_blob(c, {m, n}, {ldc, 1}, f);
  C.addmm_(A, B, beta, alpha);
}

// 16-bit GEMMs with fp32 output, row-major. Available when libtorch carries MKL.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

template <typename T>
inline bool have_half_gemm() {
  if constexpr (std::is_same_v<T, at::BFloat16>) return cblas_gemm_bf16bf16f32 != nullptr;
  if constexpr (std::is_same_v<T, at::Half>) return cblas_gemm_f16f16f32 != nullptr;
  return false;
}

template <typename T>
inline void half_gemm(bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const T* a, int64_t lda, const T* b,
                      int64_t ldb, float beta, float* c, int64_t ldc) {
  auto fn = std::is_same_v<T, at::BFloat16> ? cblas_gemm_bf16bf16f32 : cblas_gemm_f16f16f32;
  fn(kRowMajor, kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
     alpha, reinterpret_cast<const uint16_t*>(a), static_cast<int>(lda), reinterpret_cast<const uint16_t*>(b),
     static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

}  // namespace lite_boost
