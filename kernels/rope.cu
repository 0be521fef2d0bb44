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
// Qwen3's per-head q/k RMSNorm fused with this rotation (qk_norm_rope, and its backward) is in
// the second half of this file, with its own header.
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

// ===============================================================================================
// Qwen3: per-head q/k RMSNorm fused with RoPE (forward), and its backward
//
// Qwen3 normalizes every q and k head (head_dim wide, one weight vector for all q heads and one
// for all k heads, eps = the model's rms_norm_eps) after the projections and before RoPE, in f32
// as transformers does:
//     y = x·s·w,  s = 1/sqrt(mean(x²) + eps)            (x, w, y: one head of head_dim)
//     out = R(pos)·y                                      (the rotation above)
// Backward (the norm weights are frozen): with g the gradient w.r.t. out,
//     dy = R(pos)ᵀ·g                                      (rotation by the opposite angle)
//     dx = s·(w∘dy) − x·s³·(Σ_j w_j·dy_j·x_j)/hd          (norm.cu's rmsnorm_bwd, per head)
// Idea: one block of QKN_THREADS = 4 warps per token row. The block first stages the row's
// cos/sin (hd/2 accurate sincosf of pos·inv_freq[i], one per thread, instead of one per pair per
// head) and the two norm weights (as f32) in shared memory, then warp w takes heads w, w + 4, ...
// of the row's n_heads + n_kv_heads q/k heads (v untouched). Lane l owns the rotation pairs
// (i, i + hd/2) for i = l, l + 32, ... < hd/2 (at most QKN_MAXP = 4: head_dim <= 256), held in
// registers; Σx² (and in the backward Σw·dy·x, over the rotated-back dy) is a warp-shuffle sum, so
// no barrier is needed after the staging one. All arithmetic is f32 with the CPU twin's
// per-element operation order ((x·s)·w, then the rotation; ((s·w)·dy) − c·x); only the order of
// the f32 sums differs. A bf16 qkv (inference) is read once and rounded once, when written back.
// dqkv is the gradient (f32 in training; a bf16 instantiation exists for completeness), written
// in place on its q/k columns; `pre` (the forward's input) is f32 or bf16.
//
// CPU twin: backend::cpu::rope::{qk_norm_rope, qk_norm_rope_bwd}.
// Launch: grid = rows, block = QKN_THREADS. inv_freq has hd/2 entries, positions one per row;
// hd even, 2 <= hd <= 256.
#define QKN_THREADS 128
#define QKN_MAXP 4  // rotation pairs per lane: hd/2 <= 32·QKN_MAXP

// Stage the row's cos/sin (hd/2 of them, forward angle) and both norm weights (hd each, f32).
__device__ __forceinline__ void qkn_stage(float* cs, float* sn, float* wq, float* wk, float p,
                                          const float* __restrict__ inv_freq, const bf16* __restrict__ qn,
                                          const bf16* __restrict__ kn, int hd) {
    for (int i = threadIdx.x; i < (hd >> 1); i += blockDim.x) sincosf(p * inv_freq[i], &sn[i], &cs[i]);
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        wq[j] = __bfloat162float(qn[j]);
        wk[j] = __bfloat162float(kn[j]);
    }
    __syncthreads();
}

template <typename T>
__device__ void qk_norm_rope_impl(T* __restrict__ qkv, const uint32_t* __restrict__ pos,
                                  const float* __restrict__ inv_freq, const bf16* __restrict__ qn,
                                  const bf16* __restrict__ kn, float eps, int n_heads, int n_kv_heads, int hd,
                                  int width) {
    __shared__ float cs[128], sn[128], wq[256], wk[256];
    const size_t row = blockIdx.x;
    qkn_stage(cs, sn, wq, wk, (float)pos[row], inv_freq, qn, kn, hd);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, half = hd >> 1;
    T* base = qkv + row * (size_t)width;
    for (int h = warp; h < n_heads + n_kv_heads; h += nw) {
        T* v = base + (size_t)h * hd;
        const float* w = h < n_heads ? wq : wk;
        float x1[QKN_MAXP], x2[QKN_MAXP];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < QKN_MAXP; ++j) {
            const int i = lane + 32 * j;
            x1[j] = i < half ? to_f32(v[i]) : 0.f;
            x2[j] = i < half ? to_f32(v[i + half]) : 0.f;
            ss += x1[j] * x1[j];
            ss += x2[j] * x2[j];
        }
        ss = warp_sum(ss);
        const float s = 1.0f / sqrtf(ss / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < QKN_MAXP; ++j) {
            const int i = lane + 32 * j;
            if (i < half) {
                const float y1 = x1[j] * s * w[i], y2 = x2[j] * s * w[i + half];
                v[i] = from_f32<T>(y1 * cs[i] - y2 * sn[i]);
                v[i + half] = from_f32<T>(y2 * cs[i] + y1 * sn[i]);
            }
        }
    }
}

template <typename TX, typename TG>
__device__ void qk_norm_rope_bwd_impl(const TX* __restrict__ pre, const bf16* __restrict__ qn,
                                      const bf16* __restrict__ kn, TG* __restrict__ dqkv,
                                      const uint32_t* __restrict__ pos, const float* __restrict__ inv_freq, float eps,
                                      int n_heads, int n_kv_heads, int hd, int width) {
    __shared__ float cs[128], sn[128], wq[256], wk[256];
    const size_t row = blockIdx.x;
    qkn_stage(cs, sn, wq, wk, (float)pos[row], inv_freq, qn, kn, hd);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, half = hd >> 1;
    const TX* xbase = pre + row * (size_t)width;
    TG* gbase = dqkv + row * (size_t)width;
    for (int h = warp; h < n_heads + n_kv_heads; h += nw) {
        const TX* x = xbase + (size_t)h * hd;
        TG* g = gbase + (size_t)h * hd;
        const float* w = h < n_heads ? wq : wk;
        float x1[QKN_MAXP], x2[QKN_MAXP], d1[QKN_MAXP], d2[QKN_MAXP];
        float ss = 0.f, dot = 0.f;
#pragma unroll
        for (int j = 0; j < QKN_MAXP; ++j) {
            const int i = lane + 32 * j;
            x1[j] = x2[j] = d1[j] = d2[j] = 0.f;
            if (i < half) {
                x1[j] = to_f32(x[i]);
                x2[j] = to_f32(x[i + half]);
                // inverse rotation (sin negated, exact), the CPU twin's rope_apply with sign −1
                const float c = cs[i], sm = -sn[i], g1 = to_f32(g[i]), g2 = to_f32(g[i + half]);
                d1[j] = g1 * c - g2 * sm;
                d2[j] = g2 * c + g1 * sm;
                dot += w[i] * d1[j] * x1[j];
                dot += w[i + half] * d2[j] * x2[j];
            }
            ss += x1[j] * x1[j];
            ss += x2[j] * x2[j];
        }
        ss = warp_sum(ss);
        dot = warp_sum(dot);
        const float s = 1.0f / sqrtf(ss / (float)hd + eps);
        const float c = dot * s * s * s / (float)hd;
#pragma unroll
        for (int j = 0; j < QKN_MAXP; ++j) {
            const int i = lane + 32 * j;
            if (i < half) {
                g[i] = from_f32<TG>(s * w[i] * d1[j] - c * x1[j]);
                g[i + half] = from_f32<TG>(s * w[i + half] * d2[j] - c * x2[j]);
            }
        }
    }
}

#define QK_NORM_ROPE(NAME, T)                                                                       \
    extern "C" __global__ void __launch_bounds__(QKN_THREADS)                                       \
        NAME(T* qkv, const uint32_t* pos, const float* inv_freq, const bf16* q_norm, const bf16* k_norm, \
             float eps, int n_heads, int n_kv_heads, int hd, int width) {                           \
        qk_norm_rope_impl<T>(qkv, pos, inv_freq, q_norm, k_norm, eps, n_heads, n_kv_heads, hd, width); \
    }
QK_NORM_ROPE(qk_norm_rope_f32, float)
QK_NORM_ROPE(qk_norm_rope_bf16, bf16)

#define QK_NORM_ROPE_BWD(NAME, TX, TG)                                                              \
    extern "C" __global__ void __launch_bounds__(QKN_THREADS)                                       \
        NAME(const TX* pre, const bf16* q_norm, const bf16* k_norm, TG* dqkv, const uint32_t* pos,   \
             const float* inv_freq, float eps, int n_heads, int n_kv_heads, int hd, int width) {    \
        qk_norm_rope_bwd_impl<TX, TG>(pre, q_norm, k_norm, dqkv, pos, inv_freq, eps, n_heads, n_kv_heads, hd, \
                                      width);                                                       \
    }
QK_NORM_ROPE_BWD(qk_norm_rope_bwd_f32_f32, float, float)
QK_NORM_ROPE_BWD(qk_norm_rope_bwd_f32_bf16, float, bf16)
QK_NORM_ROPE_BWD(qk_norm_rope_bwd_bf16_f32, bf16, float)
QK_NORM_ROPE_BWD(qk_norm_rope_bwd_bf16_bf16, bf16, bf16)
