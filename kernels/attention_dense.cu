// Causal GQA attention over a dense batch (training): sequences concatenated along the rows,
// positions 0 .. len per sequence, no KV cache. Writes the output (bf16, the o-projection's GEMM
// input) and the per-(row, head) log-sum-exp of the scaled scores (f32, natural log), which the
// backward (attention_bwd.cu) uses to recompute the probabilities without a [T, T] matrix.
//
// The algorithm is attention.cu's (flash attention with mma.sync, online softmax in base 2), on
// dense rows instead of cache pages:
// - rows are *packed* per (sequence, kv head): packed row r ↦ (query i = r / G, head g = r % G),
//   G = n_heads / n_kv_heads, so one K/V tile serves the whole GQA group; a block (work item,
//   built on the host, src/backend/cuda/train_attn.rs) is (sequence, kv head, tile of 64 packed
//   rows) and walks the keys 0 .. kend, kend = (last query of the tile) + 1;
// - 128 threads = 4 warps; warp w owns packed rows r0 + 16w .. +15; each thread two of them
//   (rows gid and gid + 8 of the warp's 16, see mma.cuh), with its running max m and sum l
//   (quad-reduced with shuffles);
// - per key tile of BK keys (64 for head_dim <= 64, 32 for 128: registers), double-buffered
//   cp.async of K and V (16-byte chunks, keys >= kend zero-filled), S = Q·Kᵀ with Q in registers,
//   mask key > query, online softmax (exp2 of scores scaled by log2(e)/sqrt(hd)), O += P·V;
// - the end: out = O / l (bf16), lse = (m + log2 l)·ln 2 (f32, one lane of the quad writes).
// What is f32 and why: S, P before rounding, m, l, O and lse — the softmax statistics must stay
// f32 (the backward subtracts lse from recomputed scores: an error there scales every gradient);
// Q, K, V and P enter the tensor cores as bf16 (the input qkv is the bf16 copy the host makes of
// the f32 projection output).
//
// Shared memory (static): 2 stages × (K + V) × BK × (hd + 8) bf16 (+8: conflict-free fragment
// loads, 16-byte aligned rows) = 12 KiB (hd 16) … 36 KiB (hd 64), 34 KiB (hd 128).
// CPU twin: backend::train::cpu::attn_dense. Emulated lane by lane in train_attn.rs.
#include "mma.cuh"

#define DENSE_BM 64

template <int HD>
__device__ void attn_dense_fwd_impl(const bf16* __restrict__ qkv, int width, int q_dim, int kv_dim, int group,
                                    int n_heads, const DenseSeqDev* __restrict__ seqs,
                                    const DenseItem* __restrict__ items, bf16* __restrict__ out,
                                    float* __restrict__ lse, float scale_log2) {
    constexpr int BK = HD <= 64 ? 64 : 32;
    constexpr int HDP = HD + 8;
    constexpr int CH = HD / 8;  // 16-byte chunks per K/V row
    constexpr int NT = BK / 8;  // n-tiles of S
    constexpr int DT = HD / 8;  // n-tiles of O
    constexpr int KQ = HD / 16; // k-steps of Q·Kᵀ
    __shared__ __align__(16) bf16 sk[2][BK][HDP];
    __shared__ __align__(16) bf16 sv[2][BK][HDP];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tq = lane & 3;
    const DenseItem it = items[blockIdx.x];
    const DenseSeqDev S = seqs[it.seq];
    const int n_rows = S.len * group;
    const int r0 = it.tile * DENSE_BM;
    const int kend = (min(r0 + DENSE_BM, n_rows) - 1) / group + 1;  // keys seen by the tile's last query

    // this thread's two packed rows (a: gid, b: gid + 8 of the warp's 16)
    const int ra = r0 + warp * 16 + gid, rb = ra + 8;
    const bool va = ra < n_rows, vb = rb < n_rows;
    const int qia = va ? ra / group : 0, ha = va ? ra - qia * group : 0;
    const int qib = vb ? rb / group : 0, hb = vb ? rb - qib * group : 0;
    const int pos_a = va ? qia : -1;  // a padding row sees no key
    const int pos_b = vb ? qib : -1;
    const bool warp_active = r0 + warp * 16 < n_rows;

    uint32_t qf[KQ][4];
    {
        const bf16* qa = va ? qkv + (size_t)(S.row0 + qia) * width + (size_t)(it.kvh * group + ha) * HD : nullptr;
        const bf16* qb = vb ? qkv + (size_t)(S.row0 + qib) * width + (size_t)(it.kvh * group + hb) * HD : nullptr;
#pragma unroll
        for (int kk = 0; kk < KQ; ++kk) {
            const int c = kk * 16 + 2 * tq;
            qf[kk][0] = ld_row2(qa, c);
            qf[kk][1] = ld_row2(qb, c);
            qf[kk][2] = ld_row2(qa, c + 8);
            qf[kk][3] = ld_row2(qb, c + 8);
        }
    }
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

    // key j of the sequence: K at kbase + j·width, V at kbase + j·width + kv_dim
    const bf16* kbase = qkv + (size_t)S.row0 * width + q_dim + (size_t)it.kvh * HD;
    auto load_tile = [&](int stage, int kt0) {
        for (int idx = tid; idx < 2 * BK * CH; idx += DENSE_THREADS) {
            const int which = idx / (BK * CH);  // 0 = K, 1 = V
            const int rem = idx - which * (BK * CH);
            const int j = rem / CH, c = rem - j * CH;
            const int key = kt0 + j;
            bf16* dst = which ? &sv[stage][j][c * 8] : &sk[stage][j][c * 8];
            const bf16* src = qkv;  // any valid address when zero-filling
            int bytes = 0;
            if (key < kend) {
                src = kbase + (size_t)key * width + which * kv_dim + c * 8;
                bytes = 16;
            }
            cp_async16(dst, src, bytes);
        }
        cp_async_commit();
    };

    const int n_tiles = (kend + BK - 1) / BK;
    load_tile(0, 0);
    for (int t = 0; t < n_tiles; ++t) {
        const int st = t & 1;
        if (t + 1 < n_tiles) {
            load_tile(st ^ 1, (t + 1) * BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_active) {
            const int kt0 = t * BK;
            float s[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const bf16* kr = &sk[st][nt * 8 + gid][kk * 16 + 2 * tq];
                    mma_bf16(s[nt], qf[kk], ld_b32(kr), ld_b32(kr + 8));
                }
            }
            float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt0 + nt * 8 + 2 * tq + (e & 1);
                    const int pos = e < 2 ? pos_a : pos_b;
                    float v = s[nt][e] * scale_log2;
                    if (key > pos) v = -INFINITY;  // causal (keys >= kend are beyond every pos)
                    s[nt][e] = v;
                    if (e < 2) mxa = fmaxf(mxa, v);
                    else mxb = fmaxf(mxb, v);
                }
            }
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
            const float mna = fmaxf(m_a, mxa), mnb = fmaxf(m_b, mxb);
            const float mua = mna == -INFINITY ? 0.f : mna;  // guards −inf − −inf (padding rows)
            const float mub = mnb == -INFINITY ? 0.f : mnb;
            const float ca = exp2f(m_a - mua), cb = exp2f(m_b - mub);
            m_a = mna;
            m_b = mnb;
            float la = 0.f, lb = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][0] = exp2f(s[nt][0] - mua);
                s[nt][1] = exp2f(s[nt][1] - mua);
                s[nt][2] = exp2f(s[nt][2] - mub);
                s[nt][3] = exp2f(s[nt][3] - mub);
                la += s[nt][0] + s[nt][1];
                lb += s[nt][2] + s[nt][3];
            }
            l_a = l_a * ca + la;  // per-thread partial sums; the quad is reduced at the end
            l_b = l_b * cb + lb;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[dt][0] *= ca;
                o[dt][1] *= ca;
                o[dt][2] *= cb;
                o[dt][3] *= cb;
            }
#pragma unroll
            for (int j = 0; j < BK / 16; ++j) {
                uint32_t pa[4];
                c_to_a(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    uint32_t b0, b1;
                    b_from_rows<HDP>(&sv[st][j * 16 + 2 * tq][dt * 8 + gid], b0, b1);
                    mma_bf16(o[dt], pa, b0, b1);
                }
            }
        }
        __syncthreads();  // stage st is overwritten by the load issued in the next iteration
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (!warp_active) return;
    // every real row sees at least its own key, so l > 0 and m is finite there
    if (va) {
        const float inv = 1.f / l_a;
        const size_t row = (size_t)(S.row0 + qia);
        const int head = it.kvh * group + ha;
        bf16* orow = out + row * q_dim + (size_t)head * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8 + 2 * tq) = __floats2bfloat162_rn(o[dt][0] * inv, o[dt][1] * inv);
        if (tq == 0) lse[row * n_heads + head] = (m_a + log2f(l_a)) * LN2_F;
    }
    if (vb) {
        const float inv = 1.f / l_b;
        const size_t row = (size_t)(S.row0 + qib);
        const int head = it.kvh * group + hb;
        bf16* orow = out + row * q_dim + (size_t)head * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8 + 2 * tq) = __floats2bfloat162_rn(o[dt][2] * inv, o[dt][3] * inv);
        if (tq == 0) lse[row * n_heads + head] = (m_b + log2f(l_b)) * LN2_F;
    }
}

#define DENSE_FWD(HD)                                                                                     \
    extern "C" __global__ void __launch_bounds__(DENSE_THREADS)                                           \
        attn_dense_fwd_hd##HD(const bf16* qkv, int width, int q_dim, int kv_dim, int group, int n_heads,  \
                              const DenseSeqDev* seqs, const DenseItem* items, bf16* out, float* lse,     \
                              float scale_log2) {                                                         \
        attn_dense_fwd_impl<HD>(qkv, width, q_dim, kv_dim, group, n_heads, seqs, items, out, lse, scale_log2); \
    }
DENSE_FWD(16)
DENSE_FWD(32)
DENSE_FWD(64)
DENSE_FWD(128)
