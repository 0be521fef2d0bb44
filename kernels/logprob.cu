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
