// RMSNorm backward w.r.t. its input (the norm weight is frozen, so no dw):
//     y = x·s·w,  s = 1/sqrt(mean(x²) + eps)
//     dx = s·(w∘dy) − x·s³·(Σ_j w_j·dy_j·x_j)/d
// Idea: one block of NORM_THREADS per row (as norm.cu); thread t owns columns t, t + NORM_THREADS,
// ... Pass 1 accumulates Σ x² and Σ w·dy·x in f32 (two block reductions, fixed order); pass 2
// writes dx, or adds it to dx (`accumulate` = 1: the residual stream's gradient gathers the
// norm's contribution on top of the skip connection's). dx is f32 — it is the residual stream's
// gradient, summed over 2·n_layers contributions. x is the residual (f32) or bf16; dy f32 or bf16.
//
// CPU twin: backend::train::cpu::rmsnorm_bwd (same formula and operation order per element).
// Launch: grid = rows, block = NORM_THREADS.
#include "common.cuh"

#define NORM_THREADS 256

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
