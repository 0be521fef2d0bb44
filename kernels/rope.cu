// RoPE (HF's rotate_half convention) on the q and k heads of the fused qkv activation, in place,
// and its backward on the gradient dqkv.
//
// Idea: one block per token row; the row's (n_heads + n_kv_heads) · head_dim/2 rotation pairs are
// spread over the block's threads (thread t owns pairs t, t + blockDim, ...). Pair (h, i) rotates
// elements i and i + hd/2 of head h by angle pos·inv_freq[i], computed in f32 exactly like the
// CPU twin (f32 product, then accurate sincosf: the angle reaches ~3e4 rad at long positions, where
// the fast __sinf would be wrong). The v heads that follow the k heads are left untouched.
// The backward is the transpose of the rotation, i.e. the rotation by the opposite angle
// (sin negated, exact), so forward and backward use the same angles:
//     forward  x1' = x1·cos − x2·sin,  x2' = x2·cos + x1·sin
//     backward g1' = g1·cos + g2·sin,  g2' = g2·cos − g1·sin
// Gradients are f32 (a bf16 backward instantiation exists for completeness).
//
// CPU twin: backend::cpu::rope::rope_qkv (sign = +1 forward, −1 backward).
// Launch: grid = rows, block = 128. inv_freq has hd/2 entries; positions one per row.
#include "common.cuh"

template <typename T, int SIGN>
__device__ void rope_impl(T* __restrict__ qkv, const uint32_t* __restrict__ pos,
                          const float* __restrict__ inv_freq, int n_rot_heads, int hd, int width) {
    const size_t row = blockIdx.x;
    const int half = hd >> 1;
    const float p = (float)pos[row];
    T* base = qkv + row * (size_t)width;
    const int pairs = n_rot_heads * half;
    for (int k = threadIdx.x; k < pairs; k += blockDim.x) {
        const int h = k / half, i = k - h * half;
        T* v = base + h * hd;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        if (SIGN < 0) s = -s;
        const float x1 = to_f32(v[i]), x2 = to_f32(v[i + half]);
        v[i] = from_f32<T>(x1 * c - x2 * s);
        v[i + half] = from_f32<T>(x2 * c + x1 * s);
    }
}

extern "C" __global__ void rope_f32(float* qkv, const uint32_t* pos, const float* inv_freq, int n_rot_heads,
                                    int hd, int width) {
    rope_impl<float, 1>(qkv, pos, inv_freq, n_rot_heads, hd, width);
}
extern "C" __global__ void rope_bf16(bf16* qkv, const uint32_t* pos, const float* inv_freq, int n_rot_heads,
                                     int hd, int width) {
    rope_impl<bf16, 1>(qkv, pos, inv_freq, n_rot_heads, hd, width);
}
extern "C" __global__ void rope_bwd_f32(float* g, const uint32_t* pos, const float* inv_freq, int n_rot_heads, int hd,
                                        int width) {
    rope_impl<float, -1>(g, pos, inv_freq, n_rot_heads, hd, width);
}
extern "C" __global__ void rope_bwd_bf16(bf16* g, const uint32_t* pos, const float* inv_freq, int n_rot_heads, int hd,
                                         int width) {
    rope_impl<bf16, -1>(g, pos, inv_freq, n_rot_heads, hd, width);
}
