// Teacher-forced log-probabilities, vocabulary tile by vocabulary tile.
//
// Idea: the host computes one tile of logits L[rows, vt] = h · head[v0 .. v0+vt]ᵀ with cuBLASLt
// (bf16 in, f32 out, into a scratch buffer of rows·vt floats that is reused by every tile), then
// this kernel folds the tile into per-row running statistics and drops it:
//     m   ← max(m, max_j L[r, j])
//     s   ← s·exp(m_old − m) + Σ_j exp(L[r, j] − m)        (online log-sum-exp, f32)
//     tgt ← L[r, target[r] − v0]   if the row's target falls in this tile
// After the last tile log p = tgt − m − log s (on the host, in f64). `[rows, vocab]` logits never
// exist; the scratch is bounded by the host (≈64 MB). One block of LP_THREADS per row; thread t
// owns columns t, t + LP_THREADS, ...; two block reductions (max, then sum of exps about the
// tile max) in a fixed order.
//
// CPU twin: backend::cpu::logprob::logprobs (it tiles the vocabulary the same way and merges the
// per-tile (max, sum) pairs in f64).
// Launch: grid = rows, block = LP_THREADS; `first` = 1 for the first tile (initializes the state).
#include "common.cuh"

#define LP_THREADS 256

extern "C" __global__ void __launch_bounds__(LP_THREADS)
    logprob_tile(const float* __restrict__ logits, int vt, int v0, const uint32_t* __restrict__ targets,
                 float* __restrict__ run_m, float* __restrict__ run_s, float* __restrict__ tgt_logit, int first) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const float* l = logits + row * (size_t)vt;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < vt; j += LP_THREADS) mx = fmaxf(mx, l[j]);
    mx = block_max(mx, red);
    float s = 0.f;
    for (int j = threadIdx.x; j < vt; j += LP_THREADS) s += expf(l[j] - mx);
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        const long long t = (long long)targets[row] - v0;
        if (t >= 0 && t < vt) tgt_logit[row] = l[t];
        if (first) {
            run_m[row] = mx;
            run_s[row] = s;
        } else {
            const float m0 = run_m[row], s0 = run_s[row];
            const float m = fmaxf(m0, mx);
            run_s[row] = s0 * expf(m0 - m) + s * expf(mx - m);
            run_m[row] = m;
        }
    }
}

// ===============================================================================================
// Training: the head backward (second pass of the fused head)
//
// The fused head pass of training, its second half: with h the final-norm rows [rows, d] and
// W the head [vocab, d], the gradient of log p(target) w.r.t. h is −g with
//     g = Σ_v p_v·W_v − W_target,   p = softmax(h·Wᵀ)
// and [rows, vocab] never exists. The host walks the vocabulary in tiles twice:
//   pass 1 (logprob.cu's logprob_tile): logits tile → running max m and Σ exp, target logit;
//           after it lse = m + log Σ is final;
//   pass 2, per tile: logits tile again (cuBLASLt), head_probs_tile turns it into
//           P = exp(logit − lse) (bf16: a GEMM input; normalized, so in [0, 1] where bf16's
//           relative rounding is harmless) and adds Σ_v p_v·(lse − logit_v) to the row's entropy;
//           then cuBLASLt accumulates g += P·W_tile in f32;
//   finally head_grad_finish subtracts W_target from g.
// Two passes cost one extra logits GEMM but need no per-row rescaling of g between tiles
// (an online version would rescale [rows, d] on every tile where a row's max moves).
// What is f32: logits, lse, the entropy sum and g (an accumulation over the whole vocabulary).
//
// CPU twin: backend::cpu::logprob::head_grad (online, one pass; same quantities).
// Launch: grid = rows, block = LP_THREADS (both kernels).
// probs rows have a pitch of ldp >= vt elements (a multiple of 8: 16-byte aligned GEMM rows).
extern "C" __global__ void __launch_bounds__(LP_THREADS)
    head_probs_tile(const float* __restrict__ logits, int vt, const float* __restrict__ run_m,
                    const float* __restrict__ run_s, bf16* __restrict__ probs, int ldp, float* __restrict__ ent,
                    int first) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const float* l = logits + row * (size_t)vt;
    bf16* p = probs + row * (size_t)ldp;
    const float lse = run_m[row] + logf(run_s[row]);
    float acc = 0.f;
    for (int j = threadIdx.x; j < vt; j += LP_THREADS) {
        const float x = l[j];
        const float q = expf(x - lse);
        p[j] = __float2bfloat16_rn(q);
        acc += q * (lse - x);
    }
    acc = block_sum(acc, red);
    if (threadIdx.x == 0) ent[row] = first ? acc : ent[row] + acc;
}

// g[row, :] −= W[target[row], :]
extern "C" __global__ void __launch_bounds__(LP_THREADS)
    head_grad_finish(float* __restrict__ g, const bf16* __restrict__ head, const uint32_t* __restrict__ targets, int d) {
    const size_t row = blockIdx.x;
    const bf16* wt = head + (size_t)targets[row] * d;
    float* gr = g + row * d;
    for (int j = threadIdx.x; j < d; j += LP_THREADS) gr[j] -= __bfloat162float(wt[j]);
}
