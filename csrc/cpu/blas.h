// Row-major fp32 GEMMs for the CPU kernels on the BLAS that libtorch itself links (MKL / OpenBLAS
// export the Fortran `sgemm_`). Declared weak: a torch built without an external BLAS still loads the
// library and the kernels fall back to at::addmm_ on borrowed buffers (correct, slower).
#pragma once

#include <ATen/ATen.h>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

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

}  // namespace lite_boost
