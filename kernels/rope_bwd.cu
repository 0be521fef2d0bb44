// RoPE backward: RoPE rotates each (i, i + hd/2) pair of a q or k head by the angle
// pos·inv_freq[i]; its transpose is the rotation by the opposite angle, applied in place to the
// q and k parts of the gradient dqkv (the v part is left as it is):
//     g1' = g1·cos + g2·sin,   g2' = g2·cos − g1·sin
// Idea: rope.cu's layout — one block per row, threads stride over the row's
// (n_heads + n_kv_heads)·hd/2 pairs; the angle is the f32 product pos·inv_freq[i] and accurate
// sincosf (angles reach ~3e4 rad), exactly as the forward, so forward and backward rotate by the
// same (negated) angle. Gradients are f32 (a bf16 instantiation exists for completeness).
//
// CPU twin: backend::cpu::ops::rope_qkv with sign = −1.
// Launch: grid = rows, block = 128.
#include "common.cuh"

template <typename T>
__device__ void rope_bwd_impl(T* __restrict__ g, const uint32_t* __restrict__ pos, const float* __restrict__ inv_freq,
                              int n_rot_heads, int hd, int width) {
    const size_t row = blockIdx.x;
    const int half = hd >> 1;
    const float p = (float)pos[row];
    T* base = g + row * (size_t)width;
    const int pairs = n_rot_heads * half;
    for (int k = threadIdx.x; k < pairs; k += blockDim.x) {
        const int h = k / half, i = k - h * half;
        T* v = base + h * hd;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const float g1 = to_f32(v[i]), g2 = to_f32(v[i + half]);
        v[i] = from_f32<T>(g1 * c + g2 * s);
        v[i + half] = from_f32<T>(g2 * c - g1 * s);
    }
}

extern "C" __global__ void rope_bwd_f32(float* g, const uint32_t* pos, const float* inv_freq, int n_rot_heads, int hd,
                                        int width) {
    rope_bwd_impl<float>(g, pos, inv_freq, n_rot_heads, hd, width);
}
extern "C" __global__ void rope_bwd_bf16(bf16* g, const uint32_t* pos, const float* inv_freq, int n_rot_heads, int hd,
                                         int width) {
    rope_bwd_impl<bf16>(g, pos, inv_freq, n_rot_heads, hd, width);
}
