// Row-wise helpers of the training head: scaling each row by its own coefficient (∂loss/∂logp
// per response token) and scattering rows back into the batch (the loss rows' gradient into the
// residual stream's).
// Idea: one block per row, threads stride over the row's d elements (coalesced). scatter_add's
// destination rows are distinct (the host checks), so blocks never write the same element and no
// atomics are needed. Everything f32 (gradients).
//
// CPU twins: TrainBackend::{scale_rows, scatter_add_rows} of CpuBackend.
// Launch: grid = rows (of x / of src), block = 256.
#include "common.cuh"

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
