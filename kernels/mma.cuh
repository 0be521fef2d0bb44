// Tensor-core and async-copy helpers of the attention kernels: the paged inference kernel
// (attention.cu) and the dense training kernels (attention_dense.cu: forward and backward).
//
// mma.sync m16n8k16 (bf16 × bf16 → f32) fragment ownership, PTX ISA, lane = 4·gid + tq
// (gid = lane >> 2, tq = lane & 3):
//   A (16×16, row-major), 4 × b32 (two bf16 each, low half = lower column):
//     a0 = A[gid][2tq, 2tq+1]      a1 = A[gid+8][2tq, 2tq+1]
//     a2 = A[gid][2tq+8, 2tq+9]    a3 = A[gid+8][2tq+8, 2tq+9]
//   B (16×8, "col-major"), 2 × b32:
//     b0 = B[2tq, 2tq+1][gid]      b1 = B[2tq+8, 2tq+9][gid]
//   C/D (16×8 f32): c0 = C[gid][2tq]  c1 = C[gid][2tq+1]  c2 = C[gid+8][2tq]  c3 = C[gid+8][2tq+1]
// Consequences the kernels use:
//   - a row-major operand X[row][k] in shared memory gives A fragments by 32-bit loads of
//     &X[gid (+8)][kk·16 + 2tq (+8)];
//   - B = Yᵀ for a row-major Y[n][k] (e.g. Kᵀ in Q·Kᵀ) gives b0/b1 by 32-bit loads of
//     &Y[nt·8 + gid][kk·16 + 2tq (+8)];
//   - B = Y for a row-major Y[k][n] (e.g. V in P·V) needs two 16-bit loads per register:
//     b0 = {Y[2tq][gid], Y[2tq+1][gid]}, b1 = {Y[2tq+8][gid], Y[2tq+9][gid]};
//   - the C fragments of n-tiles 2j and 2j+1 are, element for element, the A fragment of k-step
//     j of the same 16 rows: a0 = (c0,c1) of 2j, a1 = (c2,c3) of 2j, a2 = (c0,c1) of 2j+1,
//     a3 = (c2,c3) of 2j+1 — so a product's result feeds the next product without shuffles.
// The PTX interpreter takes these layouts from the ISA's tables (src/backend/cuda/ptx/mma.rs);
// src/backend/cuda/emulate.rs assembles them from this description, and a test compares the two.
#pragma once
#include "common.cuh"

#define DENSE_THREADS 128  // 4 warps
#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// D = A·B + D, A 16×16 bf16 (row), B 16×8 bf16 (col), D 16×8 f32.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t ld_b32(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Two consecutive bf16 of a global row as one register; 0 for a missing (padding) row.
__device__ __forceinline__ uint32_t ld_row2(const bf16* row, int c) { return row ? ld_b32(row + c) : 0u; }

// The A fragment of k-step j from C fragments c[2j], c[2j+1] (rounded to bf16).
__device__ __forceinline__ void c_to_a(uint32_t* a, const float* c0, const float* c1) {
    a[0] = pack_bf16x2(c0[0], c0[1]);
    a[1] = pack_bf16x2(c0[2], c0[3]);
    a[2] = pack_bf16x2(c1[0], c1[1]);
    a[3] = pack_bf16x2(c1[2], c1[3]);
}

// B fragments for B = Y, Y[k][n] row-major in shared memory with row pitch P (elements), at
// k-step base row k0 = 16j + 2tq and column n = nt·8 + gid: see the header comment.
template <int P>
__device__ __forceinline__ void b_from_rows(const bf16* y, uint32_t& b0, uint32_t& b1) {
    b0 = pack_raw_bf16x2(y[0], y[P]);
    b1 = pack_raw_bf16x2(y[8 * P], y[9 * P]);
}

// ---------------------------------------------------------------------------------------------
// One key tile of flash attention for a warp's 16 packed query rows, as the paged (attention.cu)
// and the dense forward (attention_dense.cu) kernels run it. A thread holds rows gid ("a") and
// gid + 8 ("b") of the warp's 16 and, per 8-key n-tile, keys 2tq and 2tq + 1 (the C layout above).
// Runs on the emulated device (its PTX) in tests/cuda_parity/attention.rs and attention_dense.rs.

// S = Q·Kᵀ: s[nt] from the Q A-fragments in registers and K rows [key][d] in shared memory (row
// pitch HDP), one 32-bit load per B register.
template <int NT, int KQ, int HDP>
__device__ __forceinline__ void qk_tile(float (&s)[NT][4], const uint32_t (&qf)[KQ][4], const bf16 (*sk)[HDP], int gid, int tq) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KQ; ++kk) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const bf16* kr = &sk[nt * 8 + gid][kk * 16 + 2 * tq];
            mma_bf16(s[nt], qf[kk], ld_b32(kr), ld_b32(kr + 8));
        }
    }
}

// The online softmax in base 2 over one tile: scale the scores by log2(e)/sqrt(hd), mask the keys
// `masked(key, pos)` says a row must not see (pos = the row's position; −1 for a padding row),
// take the quad's row max, rescale the running (m, l, o) and turn s into the tile's unnormalized
// probabilities 2^(s − m). l stays a per-thread partial sum (the quad is reduced once, at the end).
// A row that has seen no key keeps m = −inf, l = 0: the −inf − −inf case is guarded.
template <int NT, int DT, typename Mask>
__device__ __forceinline__ void online_softmax_tile(float (&s)[NT][4], float (&o)[DT][4], float& m_a, float& m_b, float& l_a,
                                                    float& l_b, int kt0, int tq, int pos_a, int pos_b, float scale_log2,
                                                    Mask masked) {
    float mxa = -INFINITY, mxb = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kt0 + nt * 8 + 2 * tq + (e & 1);
            const int pos = e < 2 ? pos_a : pos_b;
            float v = s[nt][e] * scale_log2;
            if (masked(key, pos)) v = -INFINITY;
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
    const float mua = mna == -INFINITY ? 0.f : mna;  // guards −inf − −inf
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
    l_a = l_a * ca + la;
    l_b = l_b * cb + lb;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
        o[dt][0] *= ca;
        o[dt][1] *= ca;
        o[dt][2] *= cb;
        o[dt][3] *= cb;
    }
}

// O += P·V: P re-packed from the S accumulators into A fragments (c_to_a), V rows [key][d] in
// shared memory (pitch HDP) as B fragments of two 16-bit loads each (b_from_rows).
template <int NT, int DT, int HDP>
__device__ __forceinline__ void pv_tile(float (&o)[DT][4], const float (&s)[NT][4], const bf16 (*sv)[HDP], int gid, int tq) {
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        uint32_t pa[4];
        c_to_a(pa, s[2 * j], s[2 * j + 1]);
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            uint32_t b0, b1;
            b_from_rows<HDP>(&sv[j * 16 + 2 * tq][dt * 8 + gid], b0, b1);
            mma_bf16(o[dt], pa, b0, b1);
        }
    }
}

// Sequence and work item of the dense kernels; must match DenseSeqDev / DenseItem in
// src/backend/cuda/attention_dense.rs (#[repr(C)]).
struct DenseSeqDev {
    int row0;  // first row of the sequence in the batch
    int len;   // rows (= positions 0 .. len)
};
struct DenseItem {
    int seq, kvh, tile, pad;
};
