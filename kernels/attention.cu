// Causal GQA attention over the paged KV cache: one kernel for prefill chunks, scoring and decode
// rows, bf16 tensor cores (mma.sync m16n8k16, f32 accumulation), flash-style online softmax (no
// [T, T] scores in memory), split-K ("flash decoding") for long single-row sequences.
//
// Work decomposition. The query rows of one sequence and one kv head are *packed* with the heads
// of its GQA group: packed row r ↦ (query i = r / G, head g = r % G), G = n_heads / n_kv_heads,
// so every K/V tile loaded from the cache serves all G query heads that read it. A work item
// (one block) is (sequence, kv head, tile of BM = 64 packed rows, key split). The host builds the
// item list (src/backend/cuda/attention.rs; without a GPU this kernel's PTX runs on the emulated
// device, tests/cuda_parity/attention.rs);
// sequences with one query row (decode) and a long context are split into `split_len`-key ranges
// whose partial (unnormalized O, running max m, sum l) go to a workspace and are merged by
// attn_combine; every other item writes its normalized output directly.
//
// Block: 128 threads = 4 warps; warp w owns packed rows r0 + 16w .. r0 + 16w + 15 of the tile.
// mma fragment ownership (PTX ISA, m16n8k16, lane = 4·gid + tq): a thread holds rows gid and
// gid + 8 of its warp's 16 and, per 8-column n-tile, columns 2·tq and 2·tq + 1. Hence each thread
// owns two query rows ("a" and "b") for the softmax state (m, l), kept per thread and reduced
// across the 4 lanes of a quad with shuffles.
//
// Per key tile of BK keys (BK = 64 for head_dim <= 64, 32 for 128: registers), double-buffered:
//   1. all 128 threads cp.async the tile's K and V rows (16-byte chunks; keys past the item's
//      range are zero-filled, so no stale or NaN data enters the products) for tile t+1 while
//      tile t is computed; one barrier per stage swap;
//   2. S = Q·Kᵀ: Q stays in registers as A fragments for the whole item (loaded once from the f32
//      or bf16 qkv row, rounded to bf16), K comes from shared memory as B fragments (a 32-bit
//      load: K is stored [key][d], i.e. "col-major" B);
//   3. scale by log2(e)/sqrt(hd), causal + range mask (key < k_stop and key <= position of the
//      row, position = ctx_len − n_q + i), online softmax in base 2 (a fully masked row keeps
//      m = −inf, l = 0: the −inf − −inf case is guarded);
//   4. O += P·V: P is re-packed from the S accumulators into A fragments (the C layout of two
//      adjacent n-tiles is the A layout of one k16 step), V from shared memory as B fragments
//      (two 16-bit loads: V is [key][d] and B wants consecutive keys).
// Shared memory: 2 stages × (K + V) × BK × (hd + 8) bf16; the +8 pad (16 bytes) puts the 8 rows
// read by one B-fragment load in different banks and keeps 16-byte cp.async alignment.
// hd ∈ {16, 32, 64, 128} are instantiated (mma's k = 16 divides them).
//
// CPU twin: backend::cpu::attention::attention. Without a GPU, tests/cuda_parity/attention.rs
// runs this kernel's PTX on the emulated device (src/backend/cuda/ptx/: mma.sync fragments,
// cp.async groups with in-flight hazards, shared-memory races, bounds) against the twin.
//
//
#include "mma.cuh"  // cp.async and mma.sync helpers (shared with the dense attention kernels)

// The KV cache store: one block per token row; thread t owns elements t, t + blockDim, ... of the
// row's k and v parts (2·kv_dim elements, contiguous in qkv right after the q part), each written
// to its cache slot. Pool layout (one allocation, bf16): [page][layer][k|v][kv_head][page_size][head_dim],
// so a (layer, k|v, head) run of a page is page_size·head_dim contiguous elements (what the
// attention kernel loads) and copy-on-write of a page is one contiguous device copy.
// slot = page·page_size + offset, as in runtime::kv; offsets are 64-bit (pools can exceed 2^31
// elements). CPU twin: backend::cpu::attention::CpuKv::store.
template <typename T>
__device__ void kv_store_impl(bf16* __restrict__ pool, const T* __restrict__ qkv, const uint32_t* __restrict__ slots,
                              int layer, int n_layers, int n_kv, int hd, int page_size, int q_dim, int width) {
    const size_t row = blockIdx.x;
    const uint32_t slot = slots[row];
    const size_t page = slot / (uint32_t)page_size;
    const int s = (int)(slot % (uint32_t)page_size);
    const int kv_dim = n_kv * hd;
    const T* src = qkv + row * (size_t)width + q_dim;  // k heads, then v heads
    for (int e = threadIdx.x; e < 2 * kv_dim; e += blockDim.x) {
        const int which = e / kv_dim;  // 0 = k, 1 = v
        const int rem = e - which * kv_dim;
        const int h = rem / hd, dd = rem - h * hd;
        const size_t off = ((((page * n_layers + layer) * 2 + which) * n_kv + h) * page_size + s) * (size_t)hd + dd;
        pool[off] = from_f32<bf16>(to_f32(src[e]));
    }
}

extern "C" __global__ void kv_store_f32(bf16* pool, const float* qkv, const uint32_t* slots, int layer, int n_layers,
                                        int n_kv, int hd, int page_size, int q_dim, int width) {
    kv_store_impl<float>(pool, qkv, slots, layer, n_layers, n_kv, hd, page_size, q_dim, width);
}
extern "C" __global__ void kv_store_bf16(bf16* pool, const bf16* qkv, const uint32_t* slots, int layer, int n_layers,
                                         int n_kv, int hd, int page_size, int q_dim, int width) {
    kv_store_impl<bf16>(pool, qkv, slots, layer, n_layers, n_kv, hd, page_size, q_dim, width);
}

// Must match `AttnSeqDev` / `AttnItem` in src/backend/cuda/attention.rs (#[repr(C)], 8 + 4 ints).
struct AttnSeqDev {
    int q_row;      // first row of the sequence in the batch (qkv and out rows)
    int n_q;        // query rows
    int ctx_len;    // keys visible to the last query row (positions 0 .. ctx_len)
    int page_off;   // index of the sequence's first page in `pages`
    int n_splits;   // key splits (1: output written directly)
    int split_len;  // keys per split (a multiple of 64); >= ctx_len when n_splits == 1
    int part_base;  // first workspace slot of the sequence when split (n_kv · n_q · G rows × n_splits slots)
    int pad;
};
struct AttnItem {
    int seq, kvh, tile, split;
};

#define ATTN_THREADS 128
#define ATTN_BM 64

// Two consecutive q elements (c, c + 1) of a row as one bf16x2 register; 0 for a padding row.
__device__ __forceinline__ uint32_t load_q2(const float* p, int c) {
    if (!p) return 0u;
    const float2 v = *reinterpret_cast<const float2*>(p + c);
    return pack_bf16x2(v.x, v.y);
}
__device__ __forceinline__ uint32_t load_q2(const bf16* p, int c) {
    if (!p) return 0u;
    return *reinterpret_cast<const uint32_t*>(p + c);
}

template <int HD, typename TQ>
__device__ void attention_impl(const bf16* __restrict__ pool, int layer, int n_layers, int n_kv, int page_size,
                               const TQ* __restrict__ qkv, int width, int q_dim, int group,
                               bf16* __restrict__ out, const AttnSeqDev* __restrict__ seqs,
                               const uint32_t* __restrict__ pages, const AttnItem* __restrict__ items,
                               float* __restrict__ part_o, float* __restrict__ part_ml, float scale_log2) {
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
    const AttnItem it = items[blockIdx.x];
    const AttnSeqDev S = seqs[it.seq];
    const int n_rows = S.n_q * group;
    const int r0 = it.tile * ATTN_BM;
    const int first_pos = S.ctx_len - S.n_q;
    const int r_last = min(r0 + ATTN_BM, n_rows) - 1;
    const int kend = first_pos + r_last / group + 1;  // keys seen by the tile's last query
    const int k_begin = it.split * S.split_len;
    const int k_stop = min(kend, k_begin + S.split_len);

    // this thread's two packed rows
    const int ra = r0 + warp * 16 + gid, rb = ra + 8;
    const bool va = ra < n_rows, vb = rb < n_rows;
    const int qia = va ? ra / group : 0, ha = va ? ra - qia * group : 0;
    const int qib = vb ? rb / group : 0, hb = vb ? rb - qib * group : 0;
    const int pos_a = va ? first_pos + qia : -1;  // a padding row sees no key
    const int pos_b = vb ? first_pos + qib : -1;
    const bool warp_active = r0 + warp * 16 < n_rows;

    uint32_t qf[KQ][4];
    {
        const TQ* qa = va ? qkv + (size_t)(S.q_row + qia) * width + (size_t)(it.kvh * group + ha) * HD : nullptr;
        const TQ* qb = vb ? qkv + (size_t)(S.q_row + qib) * width + (size_t)(it.kvh * group + hb) * HD : nullptr;
#pragma unroll
        for (int kk = 0; kk < KQ; ++kk) {
            const int c = kk * 16 + 2 * tq;
            qf[kk][0] = load_q2(qa, c);
            qf[kk][1] = load_q2(qb, c);
            qf[kk][2] = load_q2(qa, c + 8);
            qf[kk][3] = load_q2(qb, c + 8);
        }
    }
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

    const size_t head_stride = (size_t)page_size * HD;  // one (layer, k|v, head) run of a page
    auto load_tile = [&](int stage, int kt0) {
        for (int idx = tid; idx < 2 * BK * CH; idx += ATTN_THREADS) {
            const int which = idx / (BK * CH);  // 0 = K, 1 = V
            const int rem = idx - which * (BK * CH);
            const int j = rem / CH, c = rem - j * CH;
            const int key = kt0 + j;
            bf16* dst = which ? &sv[stage][j][c * 8] : &sk[stage][j][c * 8];
            const bf16* src = pool;
            int bytes = 0;
            if (key < k_stop) {
                const size_t page = pages[S.page_off + key / page_size];
                const int slot = key % page_size;
                src = pool + (((page * n_layers + layer) * 2 + which) * n_kv + it.kvh) * head_stride +
                      (size_t)slot * HD + c * 8;
                bytes = 16;
            }
            cp_async16(dst, src, bytes);
        }
        cp_async_commit();
    };

    const int n_tiles = k_stop > k_begin ? (k_stop - k_begin + BK - 1) / BK : 0;
    if (n_tiles > 0) load_tile(0, k_begin);
    for (int t = 0; t < n_tiles; ++t) {
        const int st = t & 1;
        if (t + 1 < n_tiles) {
            load_tile(st ^ 1, k_begin + (t + 1) * BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (warp_active) {
            const int kt0 = k_begin + t * BK;
            float s[NT][4];
            qk_tile<NT, KQ, HDP>(s, qf, sk[st], gid, tq);
            // causal, and the item's key range (keys >= k_stop belong to another split or none)
            online_softmax_tile<NT, DT>(s, o, m_a, m_b, l_a, l_b, kt0, tq, pos_a, pos_b, scale_log2,
                                        [&](int key, int pos) { return key >= k_stop || key > pos; });
            pv_tile<NT, DT, HDP>(o, s, sv[st], gid, tq);
        }
        __syncthreads();  // stage st is overwritten by the load issued in the next iteration
    }

    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    if (!warp_active) return;

    if (S.n_splits == 1) {
        if (va) {
            const float inv = l_a > 0.f ? 1.f / l_a : 0.f;
            bf16* orow = out + (size_t)(S.q_row + qia) * q_dim + (size_t)(it.kvh * group + ha) * HD;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8 + 2 * tq) =
                    __floats2bfloat162_rn(o[dt][0] * inv, o[dt][1] * inv);
        }
        if (vb) {
            const float inv = l_b > 0.f ? 1.f / l_b : 0.f;
            bf16* orow = out + (size_t)(S.q_row + qib) * q_dim + (size_t)(it.kvh * group + hb) * HD;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<__nv_bfloat162*>(orow + dt * 8 + 2 * tq) =
                    __floats2bfloat162_rn(o[dt][2] * inv, o[dt][3] * inv);
        }
    } else {
        // workspace slot of (kv head, packed row, split)
        if (va) {
            const size_t slot = (size_t)S.part_base + ((size_t)it.kvh * n_rows + ra) * S.n_splits + it.split;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(part_o + slot * HD + dt * 8 + 2 * tq) = make_float2(o[dt][0], o[dt][1]);
            if (tq == 0) *reinterpret_cast<float2*>(part_ml + slot * 2) = make_float2(m_a, l_a);
        }
        if (vb) {
            const size_t slot = (size_t)S.part_base + ((size_t)it.kvh * n_rows + rb) * S.n_splits + it.split;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(part_o + slot * HD + dt * 8 + 2 * tq) = make_float2(o[dt][2], o[dt][3]);
            if (tq == 0) *reinterpret_cast<float2*>(part_ml + slot * 2) = make_float2(m_b, l_b);
        }
    }
}

#define ATTENTION(NAME, HD, TQ)                                                                       \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                        \
        NAME(const bf16* pool, int layer, int n_layers, int n_kv, int page_size, const TQ* qkv, int width, \
             int q_dim, int group, bf16* out, const AttnSeqDev* seqs, const uint32_t* pages,          \
             const AttnItem* items, float* part_o, float* part_ml, float scale_log2) {                \
        attention_impl<HD, TQ>(pool, layer, n_layers, n_kv, page_size, qkv, width, q_dim, group, out, seqs, \
                               pages, items, part_o, part_ml, scale_log2);                            \
    }
ATTENTION(attention_hd16_f32, 16, float)
ATTENTION(attention_hd32_f32, 32, float)
ATTENTION(attention_hd64_f32, 64, float)
ATTENTION(attention_hd128_f32, 128, float)
ATTENTION(attention_hd16_bf16, 16, bf16)
ATTENTION(attention_hd32_bf16, 32, bf16)
ATTENTION(attention_hd64_bf16, 64, bf16)
ATTENTION(attention_hd128_bf16, 128, bf16)

// Merge the split partials of one workspace row: M = max m_s, L = Σ l_s·2^(m_s − M),
// O = Σ O_s·2^(m_s − M) / L, written as bf16 to the row's output head. One block per workspace
// row (entry = (sequence, kv_head · n_q · G + packed row)); threads stride over head_dim.
// Splits that saw no visible key carry m = −inf, l = 0 and get weight 0.
extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                        const int2* __restrict__ entries, const AttnSeqDev* __restrict__ seqs,
                                        int hd, int group, int q_dim, bf16* __restrict__ out) {
    const int2 e = entries[blockIdx.x];
    const AttnSeqDev S = seqs[e.x];
    const int n_rows = S.n_q * group;
    const int kvh = e.y / n_rows, r = e.y - kvh * n_rows;
    const int qi = r / group, g = r - qi * group;
    const size_t base = (size_t)S.part_base + (size_t)e.y * S.n_splits;
    float mx = -INFINITY;
    for (int s = 0; s < S.n_splits; ++s) mx = fmaxf(mx, part_ml[(base + s) * 2]);
    float l = 0.f;
    for (int s = 0; s < S.n_splits; ++s) {
        const float ms = part_ml[(base + s) * 2];
        if (ms != -INFINITY) l += part_ml[(base + s) * 2 + 1] * exp2f(ms - mx);
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    bf16* orow = out + (size_t)(S.q_row + qi) * q_dim + (size_t)(kvh * group + g) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < S.n_splits; ++s) {
            const float ms = part_ml[(base + s) * 2];
            if (ms != -INFINITY) acc += part_o[(base + s) * hd + d] * exp2f(ms - mx);
        }
        orow[d] = __float2bfloat16_rn(acc * inv);
    }
}
