// zero8's CUDA simulator: cuBLASLt's int8 x int8 -> int32 product (column-major operands, op(A) m x k,
// op(B) k x n, D m x n), run in stream order. What cuBLASLt's documentation says its int8 (IMMA) kernels
// need in the default column order (cublasLtMatmul, "IMMA kernels" restrictions: TRANSA = T and TRANSB = N,
// leading dimensions multiple of 4, pointers 4-byte aligned) is refused as CUBLAS_STATUS_NOT_SUPPORTED,
// as the library refuses it, so code the simulator accepts is code cuBLASLt accepts. A handle belongs to the
// device current when it was made (cuBLAS: one handle per device); a product through it while another device
// is current is refused as CUBLAS_STATUS_INVALID_VALUE, where a GPU would run it with the wrong context.
#include <cublasLt.h>

#include <cstring>
#include <vector>

#include "sim.h"

struct cublasLtContext {
  int device = 0;
};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  if (h == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return CUBLAS_STATUS_NOT_INITIALIZED;
  *h = new cublasLtContext{device};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (d == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t size) {
  if (d == nullptr || buf == nullptr || size != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
  cublasOperation_t op;
  std::memcpy(&op, buf, sizeof op);
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA)
    d->ta = op;
  else if (attr == CUBLASLT_MATMUL_DESC_TRANSB)
    d->tb = op;
  else
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  if (l == nullptr || ld < int64_t(rows)) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void* alpha, const void* a,
                              cublasLtMatrixLayout_t la, const void* b, cublasLtMatrixLayout_t lb, const void* beta,
                              const void* c, cublasLtMatrixLayout_t lc, void* out, cublasLtMatrixLayout_t lo,
                              const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t stream) {
  if (h == nullptr || d == nullptr || la == nullptr || lb == nullptr || lc == nullptr || lo == nullptr ||
      alpha == nullptr || beta == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device != h->device) return CUBLAS_STATUS_INVALID_VALUE;
  if (d->compute != CUBLAS_COMPUTE_32I || d->scale != CUDA_R_32I || la->type != CUDA_R_8I || lb->type != CUDA_R_8I ||
      lc->type != CUDA_R_32I || lo->type != CUDA_R_32I)
    return CUBLAS_STATUS_NOT_SUPPORTED;  // the simulator has the int8 product only
  const bool ta = d->ta == CUBLAS_OP_T, tb = d->tb == CUBLAS_OP_T;
  const uint64_t m = ta ? la->cols : la->rows, k = ta ? la->rows : la->cols;
  const uint64_t kb = tb ? lb->cols : lb->rows, n = tb ? lb->rows : lb->cols;
  if (k != kb || lo->rows != m || lo->cols != n || lc->rows != m || lc->cols != n) return CUBLAS_STATUS_INVALID_VALUE;
  if (!ta || tb || la->ld % 4 != 0 || lb->ld % 4 != 0 || lo->ld % 4 != 0 || reinterpret_cast<uintptr_t>(a) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(b) % 4 != 0)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  std::lock_guard<std::recursive_mutex> lock(zero8_cudasim::runtime_mutex());
  const size_t a_bytes = size_t(la->ld) * (la->cols - 1) + la->rows,
               b_bytes = size_t(lb->ld) * (lb->cols - 1) + lb->rows;
  const size_t o_bytes = 4 * (size_t(lo->ld) * (n - 1) + m);
  if (m == 0 || n == 0 || k == 0 || !zero8_cudasim::device_range(a, a_bytes) ||
      !zero8_cudasim::device_range(b, b_bytes) || !zero8_cudasim::device_range(out, o_bytes) ||
      (c != out && !zero8_cudasim::device_range(c, 4 * (size_t(lc->ld) * (n - 1) + m))))
    return CUBLAS_STATUS_INVALID_VALUE;
  int32_t al, be;
  std::memcpy(&al, alpha, 4);
  std::memcpy(&be, beta, 4);
  const int64_t lda = la->ld, ldb = lb->ld, ldc = lc->ld, ldo = lo->ld;
  const auto* A = static_cast<const int8_t*>(a);
  const auto* B = static_cast<const int8_t*>(b);
  const auto* C = static_cast<const int32_t*>(c);
  auto* D = static_cast<int32_t*>(out);
  const cudaError_t e = zero8_cudasim::enqueue(stream, "cublasLtMatmul", [=] {
    std::vector<int32_t> col(m);
    for (uint64_t j = 0; j < n; ++j) {
      for (uint64_t i = 0; i < m; ++i) {
        int32_t acc = 0;  // op(A)(i, kk) = A[kk + i lda] (transposed); op(B)(kk, j) = B[kk + j ldb]
        for (uint64_t kk = 0; kk < k; ++kk) acc += int32_t(A[kk + i * lda]) * int32_t(B[kk + j * ldb]);
        col[i] = al * acc + (be != 0 ? be * C[i + j * ldc] : 0);
      }
      for (uint64_t i = 0; i < m; ++i) D[i + j * ldo] = col[i];
    }
  });
  return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
