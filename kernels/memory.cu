// Row movement: token embedding gather, row gather, f32 → bf16, the bias add that follows a
// GEMM (y[m, n] += b[n]; the GEMMs write f32), and the training head's row scaling and
// scatter-add (further down).
//
// Ideas:
// - embed / gather_rows: one block per output row, threads stride over the row's d elements
//   (coalesced reads of one source row, coalesced writes). gather_rows moves raw 2- or 4-byte
//   elements (bf16 or f32 buffers alike); embed widens the bf16 table to the f32 residual stream.
// - the KV cache's slot-addressed store is with the paged attention (attention.cu).
//
// CPU twins: backend::cpu::memory::{embed, gather_rows, scale_rows, scatter_add_rows}.
// Launches: src/backend/cuda/memory.rs.
#include "common.cuh"

extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const uint32_t* __restrict__ ids, int d,
                                      float* __restrict__ out) {
    const size_t row = blockIdx.x;
    const bf16* src = table + (size_t)ids[row] * d;
    float* dst = out + row * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = __bfloat162float(src[j]);
}

extern "C" __global__ void gather_rows_b16(const uint16_t* __restrict__ x, const uint32_t* __restrict__ rows,
                                           long long d, uint16_t* __restrict__ out) {
    const uint16_t* src = x + (size_t)rows[blockIdx.x] * d;
    uint16_t* dst = out + (size_t)blockIdx.x * d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void gather_rows_b32(const uint32_t* __restrict__ x, const uint32_t* __restrict__ rows,
                                           long long d, uint32_t* __restrict__ out) {
    const uint32_t* src = x + (size_t)rows[blockIdx.x] * d;
    uint32_t* dst = out + (size_t)blockIdx.x * d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// y [rows, n] (f32) += b[n]; grid-stride over the rows·n elements.
template <typename TB>
__device__ void add_bias_impl(float* __restrict__ y, const TB* __restrict__ b, int n, long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += to_f32(b[i % n]);
}
extern "C" __global__ void add_bias_bf16(float* y, const bf16* b, int n, long long total) {
    add_bias_impl<bf16>(y, b, n, total);
}
extern "C" __global__ void add_bias_f32(float* y, const float* b, int n, long long total) {
    add_bias_impl<float>(y, b, n, total);
}


// ===============================================================================================
// Rows of the training head: scale and scatter-add
//
// Row-wise helpers of the training head: scaling each row by its own coefficient (∂loss/∂logp
// per response token) and scattering rows back into the batch (the loss rows' gradient into the
// residual stream's).
// Idea: one block per row, threads stride over the row's d elements (coalesced). scatter_add's
// destination rows are distinct (the host checks), so blocks never write the same element and no
// atomics are needed. Everything f32 (gradients).
//
// Launch: grid = rows (of x / of src), block = 256.
extern "C" __global__ void scale_rows_f32(float* __restrict__ x, const float* __restrict__ coef, int d) {
    const size_t row = blockIdx.x;
    const float c = coef[row];
    float* xr = x + row * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) xr[j] *= c;
}

template <typename T>
__device__ void scatter_add_rows_impl(const T* __restrict__ src, const uint32_t* __restrict__ rows, int d,
                                      float* __restrict__ dst) {
    const T* s = src + (size_t)blockIdx.x * d;
    float* o = dst + (size_t)rows[blockIdx.x] * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) o[j] += to_f32(s[j]);
}
extern "C" __global__ void scatter_add_rows_f32(const float* src, const uint32_t* rows, int d, float* dst) {
    scatter_add_rows_impl<float>(src, rows, d, dst);
}
extern "C" __global__ void scatter_add_rows_bf16(const bf16* src, const uint32_t* rows, int d, float* dst) {
    scatter_add_rows_impl<bf16>(src, rows, d, dst);
}
