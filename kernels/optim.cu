// Optimizer arithmetic on the device: the squared global gradient norm (for clipping), scaling,
// and AdamW on f32 master parameters that keep a bf16 shadow for the GEMMs.
//
// sum_squares: Σ x² in f64 (the trainer sums it over every LoRA tensor and compares with a
//   threshold; f64 keeps the sum exact enough whatever the tensor count). A fixed grid of
//   SS_BLOCKS blocks (fewer for small inputs, a function of n only), each thread a grid-stride
//   f64 partial, one block reduction (fixed order) → partial[block]; the host adds the partials
//   in block order. Deterministic for a given n.
// adamw: PyTorch's torch.optim.AdamW step per element, with the host's f32 constants
//   (decay = 1 − lr·wd, step_size = lr / (1 − β1^t), bc2_sqrt = sqrt(1 − β2^t), 1 − β1, 1 − β2)
//   and IEEE round-to-nearest intrinsics for every product and sum: no FMA contraction, so each
//   value follows the CPU twin's f32 operations in the same order (bit-for-bit up to sqrtf/div,
//   which are correctly rounded on both). The new parameter is written as f32 (master) and bf16
//   (shadow, what the GEMMs read).
// widen_bf16: a bf16 buffer → f32 (a parameter's first step promotes it to an f32 master).
//
// CPU twins: backend::cpu::optim::adamw, TrainBackend::{sum_squares, scale} of CpuBackend.
// Launch: 1-D grids of 256-thread blocks (grid-stride loops).
#include "common.cuh"

#define OPT_THREADS 256

template <typename T>
__device__ void sum_squares_impl(const T* __restrict__ x, long long n, double* __restrict__ partial) {
    __shared__ double red[32];
    double acc = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double v = (double)to_f32(x[i]);
        acc += v * v;
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS) sum_squares_f32(const float* x, long long n, double* partial) {
    sum_squares_impl<float>(x, n, partial);
}
extern "C" __global__ void __launch_bounds__(OPT_THREADS) sum_squares_bf16(const bf16* x, long long n, double* partial) {
    sum_squares_impl<bf16>(x, n, partial);
}

extern "C" __global__ void scale_f32(float* __restrict__ x, float s, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        x[i] = __fmul_rn(x[i], s);
}

extern "C" __global__ void adamw_f32(float* __restrict__ p, bf16* __restrict__ shadow, const float* __restrict__ g,
                                     float* __restrict__ m, float* __restrict__ v, long long n, float beta1,
                                     float one_m_beta1, float beta2, float one_m_beta2, float eps, float decay,
                                     float step_size, float bc2_sqrt, float grad_scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float gi = __fmul_rn(g[i], grad_scale);
        const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(one_m_beta1, gi));
        const float vi = __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(one_m_beta2, gi), gi));
        m[i] = mi;
        v[i] = vi;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        const float pi = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(step_size, mi), denom));
        p[i] = pi;
        shadow[i] = __float2bfloat16_rn(pi);
    }
}

extern "C" __global__ void widen_bf16(const bf16* __restrict__ src, float* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}
