// RMSNorm, RMSNorm fused with the residual add, and the plain residual add.
//
// Idea: one block of NORM_THREADS threads per row; thread t owns columns t, t + NORM_THREADS, ...
// (a strided loop, so any width d works and no shared memory scales with d). Pass 1 computes
// the row (for add_rmsnorm: resid + delta, stored back to resid) and each thread's partial sum of
// squares in f32; one block reduction gives inv_rms = 1/sqrt(ss/d + eps); pass 2 re-reads the
// values this same thread wrote (no other thread touches them, so no barrier is needed beyond the
// reduction's) and writes x·inv_rms·w as bf16 — the input of the next GEMM. The residual stream is
// normally f32 (TR = float); a bf16 residual is rounded when stored and the norm is computed from
// the rounded values, so what is stored and what is normalized agree.
//
// CPU twins: backend::cpu::norm::{rmsnorm, add_rmsnorm, add}.
// Launch: grid = rows, block = NORM_THREADS (add: grid-stride, any grid).
#include "common.cuh"

#define NORM_THREADS 256

template <typename TX>
__device__ void rmsnorm_impl(const TX* __restrict__ x, const bf16* __restrict__ w, float eps, int d,
                             bf16* __restrict__ out) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const TX* xr = x + row * d;
    float ss = 0.f;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        float v = to_f32(xr[j]);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    bf16* o = out + row * d;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        o[j] = __float2bfloat16_rn(to_f32(xr[j]) * inv * __bfloat162float(w[j]));
    }
}

template <typename TR, typename TD>
__device__ void add_rmsnorm_impl(TR* __restrict__ resid, const TD* __restrict__ delta,
                                 const bf16* __restrict__ w, float eps, int d, bf16* __restrict__ out) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    TR* r = resid + row * d;
    const TD* dl = delta + row * d;
    float ss = 0.f;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        TR s = from_f32<TR>(to_f32(r[j]) + to_f32(dl[j]));
        r[j] = s;
        float v = to_f32(s);
        ss += v * v;
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    bf16* o = out + row * d;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        o[j] = __float2bfloat16_rn(to_f32(r[j]) * inv * __bfloat162float(w[j]));
    }
}

template <typename TR, typename TD>
__device__ void add_impl(TR* __restrict__ resid, const TD* __restrict__ delta, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        resid[i] = from_f32<TR>(to_f32(resid[i]) + to_f32(delta[i]));
    }
}

#define RMSNORM(NAME, TX)                                                                          \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                     \
        NAME(const TX* x, const bf16* w, float eps, int d, bf16* out) {                            \
        rmsnorm_impl<TX>(x, w, eps, d, out);                                                       \
    }
RMSNORM(rmsnorm_f32, float)
RMSNORM(rmsnorm_bf16, bf16)

#define ADD_RMSNORM(NAME, TR, TD)                                                                  \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                     \
        NAME(TR* resid, const TD* delta, const bf16* w, float eps, int d, bf16* out) {             \
        add_rmsnorm_impl<TR, TD>(resid, delta, w, eps, d, out);                                    \
    }
ADD_RMSNORM(add_rmsnorm_f32_f32, float, float)
ADD_RMSNORM(add_rmsnorm_f32_bf16, float, bf16)
ADD_RMSNORM(add_rmsnorm_bf16_f32, bf16, float)
ADD_RMSNORM(add_rmsnorm_bf16_bf16, bf16, bf16)

#define ADD(NAME, TR, TD)                                                                          \
    extern "C" __global__ void NAME(TR* resid, const TD* delta, long long n) { add_impl<TR, TD>(resid, delta, n); }
ADD(add_f32_f32, float, float)
ADD(add_f32_bf16, float, bf16)
ADD(add_bf16_f32, bf16, float)
ADD(add_bf16_bf16, bf16, bf16)

// ===============================================================================================
// Backward (training): RMSNorm w.r.t. its input
//
// RMSNorm backward w.r.t. its input (the norm weight is frozen, so no dw):
//     y = x·s·w,  s = 1/sqrt(mean(x²) + eps)
//     dx = s·(w∘dy) − x·s³·(Σ_j w_j·dy_j·x_j)/d
// Idea: one block of NORM_THREADS per row (as norm.cu); thread t owns columns t, t + NORM_THREADS,
// ... Pass 1 accumulates Σ x² and Σ w·dy·x in f32 (two block reductions, fixed order); pass 2
// writes dx, or adds it to dx (`accumulate` = 1: the residual stream's gradient gathers the
// norm's contribution on top of the skip connection's). dx is f32 — it is the residual stream's
// gradient, summed over 2·n_layers contributions. x is the residual (f32) or bf16; dy f32 or bf16.
//
// CPU twin: backend::cpu::norm::rmsnorm_bwd (same formula and operation order per element).
// Launch: grid = rows, block = NORM_THREADS.
template <typename TX, typename TD>
__device__ void rmsnorm_bwd_impl(const TX* __restrict__ x, const bf16* __restrict__ w, const TD* __restrict__ dy,
                                 float eps, int d, float* __restrict__ dx, int accumulate) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const TX* xr = x + row * d;
    const TD* gr = dy + row * d;
    float ss = 0.f, dot = 0.f;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        const float v = to_f32(xr[j]);
        ss += v * v;
        dot += __bfloat162float(w[j]) * to_f32(gr[j]) * v;
    }
    ss = block_sum(ss, red);
    dot = block_sum(dot, red);
    const float s = 1.0f / sqrtf(ss / (float)d + eps);
    const float c = dot * s * s * s / (float)d;
    float* o = dx + row * d;
    for (int j = threadIdx.x; j < d; j += NORM_THREADS) {
        const float v = s * __bfloat162float(w[j]) * to_f32(gr[j]) - c * to_f32(xr[j]);
        o[j] = accumulate ? o[j] + v : v;
    }
}

#define RMSNORM_BWD(NAME, TX, TD)                                                                   \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                      \
        NAME(const TX* x, const bf16* w, const TD* dy, float eps, int d, float* dx, int accumulate) { \
        rmsnorm_bwd_impl<TX, TD>(x, w, dy, eps, d, dx, accumulate);                                 \
    }
RMSNORM_BWD(rmsnorm_bwd_f32_f32, float, float)
RMSNORM_BWD(rmsnorm_bwd_f32_bf16, float, bf16)
RMSNORM_BWD(rmsnorm_bwd_bf16_f32, bf16, float)
RMSNORM_BWD(rmsnorm_bwd_bf16_bf16, bf16, bf16)
