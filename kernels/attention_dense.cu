// Causal GQA attention over a dense batch (training): sequences concatenated along the rows,
// positions 0 .. len per sequence, no KV cache. Writes the output (bf16, the o-projection's GEMM
// input) and the per-(row, head) log-sum-exp of the scaled scores (f32, natural log), which the
// backward (further down) uses to recompute the probabilities without a [T, T] matrix.
//
// The algorithm is attention.cu's (flash attention with mma.sync, online softmax in base 2), on
// dense rows instead of cache pages:
// - rows are *packed* per (sequence, kv head): packed row r ↦ (query i = r / G, head g = r % G),
//   G = n_heads / n_kv_heads, so one K/V tile serves the whole GQA group; a block (work item,
//   built on the host, src/backend/cuda/attention_dense.rs) is (sequence, kv head, tile of 64 packed
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
// CPU twin: backend::cpu::attention_dense::attn_dense. Parity (GPU or emulated device): tests/cuda_parity/attention_dense.rs.
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
            qk_tile<NT, KQ, HDP>(s, qf, sk[st], gid, tq);
            // causal (keys >= kend are beyond every pos); padding rows (pos −1) see nothing
            online_softmax_tile<NT, DT>(s, o, m_a, m_b, l_a, l_b, kt0, tq, pos_a, pos_b, scale_log2,
                                        [](int key, int pos) { return key > pos; });
            pv_tile<NT, DT, HDP>(o, s, sv[st], gid, tq);
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

// ===============================================================================================
// Backward
//
// Backward of the dense causal GQA attention (attention_dense.cu), flash-attention-2 style:
// probabilities are recomputed from q, k and the forward's log-sum-exp, never stored as [T, T].
//
// With S = scale·Q·Kᵀ (scale = 1/sqrt(hd)), P = exp(S − lse), O = P·V and dO given:
//   D  = rowsum(dO ∘ O)                (attn_bwd_prep, one warp per (row, head))
//   dP = dO·Vᵀ,  dS = P ∘ (dP − D)
//   dQ = scale·dS·K,  dK = scale·dSᵀ·Q,  dV = Pᵀ·dO
// Two kernels, each the sole owner of what it writes, so there are no atomics and every sum has
// a fixed order (the trainer's "same step after resume" needs deterministic gradients):
// - attn_dense_dq: per (sequence, kv head, tile of 64 packed query rows) — the forward's work
//   items and structure (rows packed (query, head of the group), Q and dO in registers, K/V tiles
//   double-buffered through shared memory): S = Q·Kᵀ, P, dP = dO·Vᵀ, dS, dQ += dS·K; dQ (f32) to
//   the q columns of dqkv;
// - attn_dense_dkdv: per (sequence, kv head, tile of 64 keys); warp w owns keys 16w .. 16w+15
//   of the tile, each thread keys gid and gid + 8 (the A/C rows of mma.cuh). The block walks the
//   packed query rows that can see its keys (r >= k0·G), BQ at a time (64, 32 for hd 128:
//   registers), double-buffered: Sᵀ = K·Qᵀ (keys × rows), Pᵀ, dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ,
//   dK += dSᵀ·Q. Walking all G heads of the group inside one block is the GQA sum of dK/dV.
//   dK, dV (f32) to the k and v columns of dqkv.
// Masks: key j is visible to query i iff j <= i; padding rows (past the sequence) see nothing.
//
// What is f32 and why: S, P, dP, dS before their rounding to bf16 as mma operands, D, lse and
// all three accumulators (dQ sums over up to T keys, dK/dV over G·T rows: bf16 accumulation
// would lose them). Q, K, V, dO enter as bf16 (dO's bf16 copy is made by attn_bwd_prep).
//
// Shared memory: attn_dense_dq as the forward (static, ≤ 36 KiB). attn_dense_dkdv carves
// dynamic shared memory (its size comes from the host, attention_dense::dkdv_smem_bytes, and the
// kernel traps when given less):
//   sk [64][hd+8] bf16 | sv [64][hd+8] | sq [2][BQ][hd+8] | sdo [2][BQ][hd+8] |
//   slse [2][BQ] f32 (lse·log2 e) | sD [2][BQ] f32 | sqi [2][BQ] int (query of the row, −1: none)
//   = 19.5 KiB (hd 16), 31.5 KiB (32), 55.5 KiB (64), 68.8 KiB (128).
// CPU twin: backend::cpu::attention_dense::attn_dense_bwd. Parity (GPU or emulated device): tests/cuda_parity/attention_dense.rs.
#define DENSE_BN 64  // keys per dk/dv work item

// D[row, h] = Σ_d dO·O over the head's hd columns, and dO as bf16 for the tensor cores.
// One warp per (row, head); 8 warps per block. q_dim = n_heads·hd.
template <typename TO, typename TD>
__device__ void attn_bwd_prep_impl(const TO* __restrict__ out, const TD* __restrict__ dout, int rows, int n_heads,
                                   int hd, bf16* __restrict__ dout16, float* __restrict__ dsum) {
    const int lane = threadIdx.x & 31;
    const long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= (long long)rows * n_heads) return;
    const size_t base = (size_t)w * hd;  // row·q_dim + h·hd
    float acc = 0.f;
    for (int d = lane; d < hd; d += 32) {
        const float g = to_f32(dout[base + d]);
        acc += g * to_f32(out[base + d]);
        dout16[base + d] = __float2bfloat16_rn(g);
    }
    acc = warp_sum(acc);
    if (lane == 0) dsum[w] = acc;
}

#define PREP(NAME, TO, TD)                                                                                 \
    extern "C" __global__ void NAME(const TO* out, const TD* dout, int rows, int n_heads, int hd, bf16* dout16, \
                                    float* dsum) {                                                         \
        attn_bwd_prep_impl<TO, TD>(out, dout, rows, n_heads, hd, dout16, dsum);                           \
    }
PREP(attn_bwd_prep_bf16_f32, bf16, float)
PREP(attn_bwd_prep_bf16_bf16, bf16, bf16)
PREP(attn_bwd_prep_f32_f32, float, float)
PREP(attn_bwd_prep_f32_bf16, float, bf16)

// ---------------------------------------------------------------------------------------------
// dQ

template <int HD>
__device__ void attn_dense_dq_impl(const bf16* __restrict__ qkv, int width, int q_dim, int kv_dim, int group,
                                   int n_heads, const DenseSeqDev* __restrict__ seqs,
                                   const DenseItem* __restrict__ items, const bf16* __restrict__ dout,
                                   const float* __restrict__ lse, const float* __restrict__ dsum,
                                   float* __restrict__ dqkv, float scale_log2, float scale) {
    constexpr int BK = HD <= 64 ? 64 : 32;
    constexpr int HDP = HD + 8;
    constexpr int CH = HD / 8;
    constexpr int NT = BK / 8;
    constexpr int DT = HD / 8;
    constexpr int KQ = HD / 16;
    __shared__ __align__(16) bf16 sk[2][BK][HDP];
    __shared__ __align__(16) bf16 sv[2][BK][HDP];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tq = lane & 3;
    const DenseItem it = items[blockIdx.x];
    const DenseSeqDev S = seqs[it.seq];
    const int n_rows = S.len * group;
    const int r0 = it.tile * DENSE_BM;
    const int kend = (min(r0 + DENSE_BM, n_rows) - 1) / group + 1;

    const int ra = r0 + warp * 16 + gid, rb = ra + 8;
    const bool va = ra < n_rows, vb = rb < n_rows;
    const int qia = va ? ra / group : 0, ha = va ? ra - qia * group : 0;
    const int qib = vb ? rb / group : 0, hb = vb ? rb - qib * group : 0;
    const int pos_a = va ? qia : -1;
    const int pos_b = vb ? qib : -1;
    const bool warp_active = r0 + warp * 16 < n_rows;
    const int head_a = it.kvh * group + ha, head_b = it.kvh * group + hb;
    const size_t row_a = (size_t)(S.row0 + qia), row_b = (size_t)(S.row0 + qib);

    uint32_t qf[KQ][4], df[KQ][4];
    {
        const bf16* qa = va ? qkv + row_a * width + (size_t)head_a * HD : nullptr;
        const bf16* qb = vb ? qkv + row_b * width + (size_t)head_b * HD : nullptr;
        const bf16* da = va ? dout + row_a * q_dim + (size_t)head_a * HD : nullptr;
        const bf16* db = vb ? dout + row_b * q_dim + (size_t)head_b * HD : nullptr;
#pragma unroll
        for (int kk = 0; kk < KQ; ++kk) {
            const int c = kk * 16 + 2 * tq;
            qf[kk][0] = ld_row2(qa, c);
            qf[kk][1] = ld_row2(qb, c);
            qf[kk][2] = ld_row2(qa, c + 8);
            qf[kk][3] = ld_row2(qb, c + 8);
            df[kk][0] = ld_row2(da, c);
            df[kk][1] = ld_row2(db, c);
            df[kk][2] = ld_row2(da, c + 8);
            df[kk][3] = ld_row2(db, c + 8);
        }
    }
    // lse in base-2 units of the scaled scores; padding rows never use theirs (masked)
    const float lse2_a = va ? lse[row_a * n_heads + head_a] * LOG2E_F : 0.f;
    const float lse2_b = vb ? lse[row_b * n_heads + head_b] * LOG2E_F : 0.f;
    const float d_a = va ? dsum[row_a * n_heads + head_a] : 0.f;
    const float d_b = vb ? dsum[row_b * n_heads + head_b] : 0.f;
    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;

    const bf16* kbase = qkv + (size_t)S.row0 * width + q_dim + (size_t)it.kvh * HD;
    auto load_tile = [&](int stage, int kt0) {
        for (int idx = tid; idx < 2 * BK * CH; idx += DENSE_THREADS) {
            const int which = idx / (BK * CH);
            const int rem = idx - which * (BK * CH);
            const int j = rem / CH, c = rem - j * CH;
            const int key = kt0 + j;
            bf16* dst = which ? &sv[stage][j][c * 8] : &sk[stage][j][c * 8];
            const bf16* src = qkv;
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
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
                dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const bf16* kr = &sk[st][nt * 8 + gid][kk * 16 + 2 * tq];
                    mma_bf16(s[nt], qf[kk], ld_b32(kr), ld_b32(kr + 8));   // S = Q·Kᵀ
                    const bf16* vr = &sv[st][nt * 8 + gid][kk * 16 + 2 * tq];
                    mma_bf16(dp[nt], df[kk], ld_b32(vr), ld_b32(vr + 8));  // dP = dO·Vᵀ
                }
            }
            // P = exp2(S·scale·log2e − lse2) where visible, dS = P·(dP − D) (into s)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kt0 + nt * 8 + 2 * tq + (e & 1);
                    const bool a = e < 2;
                    const float p = key <= (a ? pos_a : pos_b) ? exp2f(s[nt][e] * scale_log2 - (a ? lse2_a : lse2_b)) : 0.f;
                    s[nt][e] = p * (dp[nt][e] - (a ? d_a : d_b));
                }
            }
            // dQ += dS·K (B = K[key][d]: two 16-bit loads per register)
#pragma unroll
            for (int j = 0; j < BK / 16; ++j) {
                uint32_t pa[4];
                c_to_a(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    uint32_t b0, b1;
                    b_from_rows<HDP>(&sk[st][j * 16 + 2 * tq][dt * 8 + gid], b0, b1);
                    mma_bf16(dq[dt], pa, b0, b1);
                }
            }
        }
        __syncthreads();
    }
    if (!warp_active) return;
    if (va) {
        float* q = dqkv + row_a * width + (size_t)head_a * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(q + dt * 8 + 2 * tq) = make_float2(dq[dt][0] * scale, dq[dt][1] * scale);
    }
    if (vb) {
        float* q = dqkv + row_b * width + (size_t)head_b * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(q + dt * 8 + 2 * tq) = make_float2(dq[dt][2] * scale, dq[dt][3] * scale);
    }
}

#define DENSE_DQ(HD)                                                                                       \
    extern "C" __global__ void __launch_bounds__(DENSE_THREADS)                                            \
        attn_dense_dq_hd##HD(const bf16* qkv, int width, int q_dim, int kv_dim, int group, int n_heads,    \
                             const DenseSeqDev* seqs, const DenseItem* items, const bf16* dout,            \
                             const float* lse, const float* dsum, float* dqkv, float scale_log2, float scale) { \
        attn_dense_dq_impl<HD>(qkv, width, q_dim, kv_dim, group, n_heads, seqs, items, dout, lse, dsum, dqkv, \
                               scale_log2, scale);                                                         \
    }
DENSE_DQ(16)
DENSE_DQ(32)
DENSE_DQ(64)
DENSE_DQ(128)

// ---------------------------------------------------------------------------------------------
// dK, dV

// Byte offsets of the dynamic shared memory regions (mirrored by attention_dense::dkdv_smem_layout).
template <int HD>
struct DkdvSmem {
    static constexpr int BQ = HD <= 64 ? 64 : 32;
    static constexpr int HDP = HD + 8;
    static constexpr int SK = 0;
    static constexpr int SV = SK + DENSE_BN * HDP * 2;
    static constexpr int SQ = SV + DENSE_BN * HDP * 2;
    static constexpr int SDO = SQ + 2 * BQ * HDP * 2;
    static constexpr int SLSE = SDO + 2 * BQ * HDP * 2;
    static constexpr int SD = SLSE + 2 * BQ * 4;
    static constexpr int SQI = SD + 2 * BQ * 4;
    static constexpr int BYTES = SQI + 2 * BQ * 4;
};

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned v;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}

template <int HD>
__device__ void attn_dense_dkdv_impl(const bf16* __restrict__ qkv, int width, int q_dim, int kv_dim, int group,
                                     int n_heads, const DenseSeqDev* __restrict__ seqs,
                                     const DenseItem* __restrict__ items, const bf16* __restrict__ dout,
                                     const float* __restrict__ lse, const float* __restrict__ dsum,
                                     float* __restrict__ dqkv, float scale_log2, float scale) {
    using L = DkdvSmem<HD>;
    constexpr int BQ = L::BQ;
    constexpr int HDP = L::HDP;
    constexpr int CH = HD / 8;
    constexpr int NQ = BQ / 8;  // n-tiles over the query rows of Sᵀ
    constexpr int DT = HD / 8;
    constexpr int KQ = HD / 16;
    extern __shared__ __align__(16) unsigned char smem[];
    if (dynamic_smem_bytes() < (unsigned)L::BYTES) __trap();  // the host must pass dkdv_smem_bytes(HD)
    bf16(*sk)[HDP] = reinterpret_cast<bf16(*)[HDP]>(smem + L::SK);
    bf16(*sv)[HDP] = reinterpret_cast<bf16(*)[HDP]>(smem + L::SV);
    bf16(*sq)[BQ][HDP] = reinterpret_cast<bf16(*)[BQ][HDP]>(smem + L::SQ);
    bf16(*sdo)[BQ][HDP] = reinterpret_cast<bf16(*)[BQ][HDP]>(smem + L::SDO);
    float(*slse)[BQ] = reinterpret_cast<float(*)[BQ]>(smem + L::SLSE);
    float(*sD)[BQ] = reinterpret_cast<float(*)[BQ]>(smem + L::SD);
    int(*sqi)[BQ] = reinterpret_cast<int(*)[BQ]>(smem + L::SQI);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gid = lane >> 2, tq = lane & 3;
    const DenseItem it = items[blockIdx.x];
    const DenseSeqDev S = seqs[it.seq];
    const int n_rows = S.len * group;
    const int k0 = it.tile * DENSE_BN;

    // the tile's K and V (keys past the sequence zero-filled), once
    const bf16* kbase = qkv + (size_t)S.row0 * width + q_dim + (size_t)it.kvh * HD;
    for (int idx = tid; idx < 2 * DENSE_BN * CH; idx += DENSE_THREADS) {
        const int which = idx / (DENSE_BN * CH);
        const int rem = idx - which * (DENSE_BN * CH);
        const int j = rem / CH, c = rem - j * CH;
        const int key = k0 + j;
        bf16* dst = which ? &sv[j][c * 8] : &sk[j][c * 8];
        const bf16* src = qkv;
        int bytes = 0;
        if (key < S.len) {
            src = kbase + (size_t)key * width + which * kv_dim + c * 8;
            bytes = 16;
        }
        cp_async16(dst, src, bytes);
    }
    cp_async_commit();

    // packed query rows rt0 .. rt0 + BQ: Q and dO rows (cp.async), lse·log2e, D, query index
    auto load_rows = [&](int stage, int rt0) {
        for (int idx = tid; idx < 2 * BQ * CH; idx += DENSE_THREADS) {
            const int which = idx / (BQ * CH);  // 0 = Q, 1 = dO
            const int rem = idx - which * (BQ * CH);
            const int j = rem / CH, c = rem - j * CH;
            const int r = rt0 + j;
            bf16* dst = which ? &sdo[stage][j][c * 8] : &sq[stage][j][c * 8];
            const bf16* src = qkv;
            int bytes = 0;
            if (r < n_rows) {
                const int i = r / group, head = it.kvh * group + (r - i * group);
                src = which ? dout + (size_t)(S.row0 + i) * q_dim + (size_t)head * HD + c * 8
                            : qkv + (size_t)(S.row0 + i) * width + (size_t)head * HD + c * 8;
                bytes = 16;
            }
            cp_async16(dst, src, bytes);
        }
        cp_async_commit();
        for (int j = tid; j < BQ; j += DENSE_THREADS) {
            const int r = rt0 + j;
            if (r < n_rows) {
                const int i = r / group;
                const size_t at = (size_t)(S.row0 + i) * n_heads + it.kvh * group + (r - i * group);
                slse[stage][j] = lse[at] * LOG2E_F;
                sD[stage][j] = dsum[at];
                sqi[stage][j] = i;
            } else {
                slse[stage][j] = 0.f;
                sD[stage][j] = 0.f;
                sqi[stage][j] = -1;  // sees no key
            }
        }
    };

    const int r_begin = k0 * group;  // the first packed row whose query (k0) sees a key of the tile
    const int n_qt = (n_rows - r_begin + BQ - 1) / BQ;  // >= 1: k0 < len
    const int key_a = k0 + warp * 16 + gid, key_b = key_a + 8;
    const bool warp_active = k0 + warp * 16 < S.len;
    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        dk[dt][0] = dk[dt][1] = dk[dt][2] = dk[dt][3] = 0.f;
        dv[dt][0] = dv[dt][1] = dv[dt][2] = dv[dt][3] = 0.f;
    }

    load_rows(0, r_begin);
    for (int t = 0; t < n_qt; ++t) {
        const int st = t & 1;
        if (t + 1 < n_qt) {
            load_rows(st ^ 1, r_begin + (t + 1) * BQ);
            cp_async_wait<1>();  // K/V and rows t are in; rows t+1 may still fly
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_active) {
            float s[NQ][4], dp[NQ][4];
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
                dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
            }
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: A fragments of the warp's 16 keys from sk / sv
#pragma unroll
            for (int kk = 0; kk < KQ; ++kk) {
                const bf16* ka = &sk[warp * 16 + gid][kk * 16 + 2 * tq];
                const bf16* va_ = &sv[warp * 16 + gid][kk * 16 + 2 * tq];
                const uint32_t ak[4] = {ld_b32(ka), ld_b32(ka + 8 * HDP), ld_b32(ka + 8), ld_b32(ka + 8 * HDP + 8)};
                const uint32_t av[4] = {ld_b32(va_), ld_b32(va_ + 8 * HDP), ld_b32(va_ + 8), ld_b32(va_ + 8 * HDP + 8)};
#pragma unroll
                for (int nt = 0; nt < NQ; ++nt) {
                    const bf16* qr = &sq[st][nt * 8 + gid][kk * 16 + 2 * tq];
                    mma_bf16(s[nt], ak, ld_b32(qr), ld_b32(qr + 8));
                    const bf16* dr = &sdo[st][nt * 8 + gid][kk * 16 + 2 * tq];
                    mma_bf16(dp[nt], av, ld_b32(dr), ld_b32(dr + 8));
                }
            }
            // Pᵀ (into s) where key <= query of the column; dSᵀ = Pᵀ·(dPᵀ − D) (into dp)
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = nt * 8 + 2 * tq + (e & 1);
                    const int key = e < 2 ? key_a : key_b;
                    const float p = key <= sqi[st][c] ? exp2f(s[nt][e] * scale_log2 - slse[st][c]) : 0.f;
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - sD[st][c]);
                }
            }
            // dV += Pᵀ·dO, dK += dSᵀ·Q (B = dO / Q rows: two 16-bit loads per register)
#pragma unroll
            for (int j = 0; j < BQ / 16; ++j) {
                uint32_t pa[4], sa[4];
                c_to_a(pa, s[2 * j], s[2 * j + 1]);
                c_to_a(sa, dp[2 * j], dp[2 * j + 1]);
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    uint32_t b0, b1;
                    b_from_rows<HDP>(&sdo[st][j * 16 + 2 * tq][dt * 8 + gid], b0, b1);
                    mma_bf16(dv[dt], pa, b0, b1);
                    b_from_rows<HDP>(&sq[st][j * 16 + 2 * tq][dt * 8 + gid], b0, b1);
                    mma_bf16(dk[dt], sa, b0, b1);
                }
            }
        }
        __syncthreads();  // stage st is refilled by the next iteration's load
    }
    if (!warp_active) return;
    if (key_a < S.len) {
        float* kr = dqkv + (size_t)(S.row0 + key_a) * width + q_dim + (size_t)it.kvh * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(kr + dt * 8 + 2 * tq) = make_float2(dk[dt][0] * scale, dk[dt][1] * scale);
            *reinterpret_cast<float2*>(kr + kv_dim + dt * 8 + 2 * tq) = make_float2(dv[dt][0], dv[dt][1]);
        }
    }
    if (key_b < S.len) {
        float* kr = dqkv + (size_t)(S.row0 + key_b) * width + q_dim + (size_t)it.kvh * HD;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            *reinterpret_cast<float2*>(kr + dt * 8 + 2 * tq) = make_float2(dk[dt][2] * scale, dk[dt][3] * scale);
            *reinterpret_cast<float2*>(kr + kv_dim + dt * 8 + 2 * tq) = make_float2(dv[dt][2], dv[dt][3]);
        }
    }
}

#define DENSE_DKDV(HD)                                                                                     \
    extern "C" __global__ void __launch_bounds__(DENSE_THREADS)                                            \
        attn_dense_dkdv_hd##HD(const bf16* qkv, int width, int q_dim, int kv_dim, int group, int n_heads,  \
                               const DenseSeqDev* seqs, const DenseItem* items, const bf16* dout,          \
                               const float* lse, const float* dsum, float* dqkv, float scale_log2, float scale) { \
        attn_dense_dkdv_impl<HD>(qkv, width, q_dim, kv_dim, group, n_heads, seqs, items, dout, lse, dsum, dqkv, \
                                 scale_log2, scale);                                                       \
    }
DENSE_DKDV(16)
DENSE_DKDV(32)
DENSE_DKDV(64)
DENSE_DKDV(128)
