// SwiGLU: out[m, j] = silu(gate[m, j]) · up[m, j] from the fused gate_up [m, 2·inter] (gate first).
//
// Idea: purely element-wise; a grid-stride loop where each thread owns output elements
// i, i + gridDim·blockDim, ...; reads are coalesced along j within the gate and the up halves.
// silu(g) = g / (1 + exp(-g)) with the accurate expf, as the CPU twin computes it. The output is
// bf16 because it is the input of the down projection's GEMM.
//
// CPU twin: backend::cpu::ops::swiglu.
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
