// SwiGLU: out[m, j] = silu(gate[m, j]) · up[m, j] from the fused gate_up [m, 2·inter] (gate first).
//
// Idea: purely element-wise; a grid-stride loop where each thread owns output elements
// i, i + gridDim·blockDim, ...; reads are coalesced along j within the gate and the up halves.
// silu(g) = g / (1 + exp(-g)) with the accurate expf, as the CPU twin computes it. The output is
// bf16 because it is the input of the down projection's GEMM.
//
// CPU twin: backend::cpu::swiglu::swiglu.
// Launch: any 1-D grid (the host uses ceil(n/256) capped at 65535·… blocks of 256).
#include "common.cuh"

template <typename T>
__device__ void swiglu_impl(const T* __restrict__ gu, long long m, int inter, bf16* __restrict__ out) {
    const long long n = m * inter;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / inter;
        const int j = (int)(i - r * inter);
        const float g = to_f32(gu[r * 2 * inter + j]);
        const float u = to_f32(gu[r * 2 * inter + inter + j]);
        out[i] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
    }
}

extern "C" __global__ void swiglu_f32(const float* gu, long long m, int inter, bf16* out) {
    swiglu_impl<float>(gu, m, inter, out);
}
extern "C" __global__ void swiglu_bf16(const bf16* gu, long long m, int inter, bf16* out) {
    swiglu_impl<bf16>(gu, m, inter, out);
}

// ===============================================================================================
// Backward (training)
//
// SwiGLU backward: act = silu(g)·u with g, u the two halves of gate_up [m, 2·inter]; given dact,
//     σ = 1/(1 + e^−g),  du = dact·g·σ,  dg = dact·u·σ·(1 + g·(1 − σ))
// written to dgate_up [m, 2·inter] (gate half first, as gate_up), f32: it is a gradient that
// feeds two GEMMs (the input gradient and the gate/up LoRA gradients) and the host rounds it to
// bf16 only there.
// Idea: element-wise, a grid-stride loop where a thread owns element (r, j) of [m, inter] and
// writes both halves; reads and writes are coalesced along j. Accurate expf as the CPU twin.
//
// CPU twin: backend::cpu::swiglu::swiglu_bwd.
// Launch: any 1-D grid of 256-thread blocks.
template <typename TG, typename TD>
__device__ void swiglu_bwd_impl(const TG* __restrict__ gu, const TD* __restrict__ dact, long long m, int inter,
                                float* __restrict__ dgu) {
    const long long n = m * inter;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long r = idx / inter;
        const int j = (int)(idx - r * inter);
        const size_t at = (size_t)r * 2 * inter + j;
        const float g = to_f32(gu[at]);
        const float u = to_f32(gu[at + inter]);
        const float da = to_f32(dact[idx]);
        const float sig = 1.0f / (1.0f + expf(-g));
        dgu[at + inter] = da * g * sig;
        dgu[at] = da * u * sig * (1.0f + g * (1.0f - sig));
    }
}

#define SWIGLU_BWD(NAME, TG, TD)                                                                    \
    extern "C" __global__ void NAME(const TG* gu, const TD* dact, long long m, int inter, float* dgu) { \
        swiglu_bwd_impl<TG, TD>(gu, dact, m, inter, dgu);                                           \
    }
SWIGLU_BWD(swiglu_bwd_f32_f32, float, float)
SWIGLU_BWD(swiglu_bwd_f32_bf16, float, bf16)
SWIGLU_BWD(swiglu_bwd_bf16_f32, bf16, float)
SWIGLU_BWD(swiglu_bwd_bf16_bf16, bf16, bf16)
