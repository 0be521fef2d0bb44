// Next-token sampling on the device: greedy, or temperature + nucleus (top-p), one uniform per row.
//
// One block of SAMPLE_THREADS per row; thread t owns vocabulary ids t, t + SAMPLE_THREADS, ...
// Every reduction is a fixed-order block reduction (no float atomics), so results are
// deterministic. The result must equal the CPU twin (backend::cpu::sample::sample_row) token for
// token given the same logits and uniform, which fixes the conventions below:
//
// 1. m = max logit, greedy token = lowest id holding m; lse = m + ln Σ exp(x − m) (f64 sum), the
//    returned log-prob is x[token] − lse (temperature 1, whatever the sampling temperature).
// 2. Weights at temperature T: w = exp(f64(x − m) · (1/T)), total W = Σ w (f64).
// 3. top_p >= 1: the CPU walks ids in order and returns the first id whose running sum exceeds
//    u·W. top_p < 1: the CPU sorts by weight descending, ties by lower id, keeps the shortest prefix
//    whose mass reaches top_p·W (the nucleus, mass C), then walks that sorted prefix and returns
//    the first token whose running sum exceeds u·C.
//
// Both walks are "find the smallest key k (in walk order) whose cumulative mass
// cum(k) = Σ_{key_j <= k} w_j reaches a threshold" (>= for the nucleus end, > for the draw). With
// a 64-bit key that sorts in walk order, that is a radix descent by mass, 4 bits per level:
//   id order:      key = id
//   nucleus order: key = bits(f32(m − x)) << 32 | id   (m − x >= 0, so its f32 bits sort like its
//                  value; smaller m − x = larger weight; ties in weight tie in m − x and fall back
//                  to the id, exactly the CPU's (weight desc, id asc) order since w is a monotone
//                  function of f32(x − m))
// At each level one pass over the row builds a 16-bucket histogram of mass (f64) and count over
// the tokens whose key matches the prefix chosen so far; the first bucket where
// below + Σ bucket masses crosses the threshold is taken. When the chosen bucket holds a single
// token (typical after 2–4 levels for peaked distributions) one more pass finds it. Each thread
// keeps its 16 partial masses/counts in registers (compile-time indices only: fully unrolled).
// Rounding can make a parent bucket cross and none of its sub-buckets cross; the descent then
// takes the last sub-bucket with mass, i.e. the crossing is resolved to within f64 rounding.
// Fallbacks mirror the CPU: no crossing at all → the last positive-weight token of the walk.
//
// Launch: grid = rows, block = SAMPLE_THREADS. temps/top_ps (f32) and uniforms (f64) per row.
#include "common.cuh"

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define NOT_FOUND 0xffffffffffffffffull

struct SampleShared {
    double h[SAMPLE_WARPS][16];
    unsigned c[SAMPLE_WARPS][16];
    double hm[16];  // bucket masses / counts summed over warps (thread 0 only)
    unsigned hc[16];
    double redd[32];
    float redf[32];
    int redi[32];
    unsigned long long key;
    double below, bucket_mass;
    unsigned long long prefix;
    unsigned count;
    int chosen;
};

template <typename T>
struct Row {
    const T* x;
    int vocab;
    float m;
    double inv_t;
    bool by_id;
    __device__ __forceinline__ float logit(int j) const { return to_f32(x[j]); }
    __device__ __forceinline__ unsigned long long key(int j, float xj) const {
        if (by_id) return (unsigned long long)j;
        float dl = m - xj;       // >= 0 (m is the max)
        if (dl == 0.0f) dl = 0.0f;  // −0.0 (from m = −0.0, x = +0.0) must key like +0.0
        return ((unsigned long long)__float_as_uint(dl) << 32) | (unsigned)j;
    }
    __device__ __forceinline__ double weight(float xj) const { return exp((double)(xj - m) * inv_t); }
};

// Smallest key whose cumulative mass reaches `thr` (strict: exceeds). Returns NOT_FOUND when even
// the total does not; *cum_out = cum(key).
template <typename T>
__device__ unsigned long long select_by_mass(const Row<T>& r, int level0, double thr, bool strict, double* cum_out,
                                             SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long prefix = 0;
    double below = 0.0;
    for (int level = level0; level < 16; ++level) {
        const int shift = 60 - 4 * level;  // the digit is key bits [shift, shift + 4)
        double h[16];
        unsigned c[16];
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            h[b] = 0.0;
            c[b] = 0;
        }
        for (int j = threadIdx.x; j < r.vocab; j += SAMPLE_THREADS) {
            const float xj = r.logit(j);
            const unsigned long long k = r.key(j, xj);
            const unsigned long long hi = (shift + 4 >= 64) ? 0ull : (k >> (shift + 4));
            if (hi == prefix) {
                const int dg = (int)((k >> shift) & 15);
                const double w = r.weight(xj);
#pragma unroll
                for (int b = 0; b < 16; ++b) {
                    if (dg == b) {
                        h[b] += w;
                        c[b] += 1;
                    }
                }
            }
        }
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            const double v = warp_sum(h[b]);
            const unsigned n = __reduce_add_sync(0xffffffffu, c[b]);
            if (lane == 0) {
                sh.h[warp][b] = v;
                sh.c[warp][b] = n;
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double* hm = sh.hm;  // shared, so the run-time index `chosen` needs no local memory
            unsigned* hc = sh.hc;
            for (int b = 0; b < 16; ++b) {
                hm[b] = 0.0;
                hc[b] = 0;
                for (int w = 0; w < SAMPLE_WARPS; ++w) {
                    hm[b] += sh.h[w][b];
                    hc[b] += sh.c[w][b];
                }
            }
            double cum = below;
            int chosen = -1;
            for (int b = 0; b < 16; ++b) {
                const double nb = cum + hm[b];
                if (strict ? (nb > thr) : (nb >= thr)) {
                    chosen = b;
                    break;
                }
                cum = nb;
            }
            if (chosen < 0 && level > level0) {
                // The parent bucket crossed but, summed in another order, its sub-buckets do not:
                // the crossing is at the end of the last sub-bucket holding mass.
                for (int b = 15; b >= 0; --b)
                    if (hm[b] > 0.0) {
                        chosen = b;
                        break;
                    }
                cum = below;
                for (int b = 0; b < chosen; ++b) cum += hm[b];
            }
            sh.chosen = chosen;
            if (chosen >= 0) {
                sh.below = cum;
                sh.bucket_mass = hm[chosen];
                sh.count = hc[chosen];
                sh.prefix = (prefix << 4) | (unsigned long long)chosen;
            }
            sh.key = NOT_FOUND;
        }
        __syncthreads();
        if (sh.chosen < 0) return NOT_FOUND;  // uniform across the block (shared value)
        prefix = sh.prefix;
        below = sh.below;
        const unsigned count = sh.count;
        const double bucket_mass = sh.bucket_mass;
        if (level == 15) {
            *cum_out = below + bucket_mass;
            __syncthreads();  // everyone has read sh before it is reused
            return prefix;    // all 16 digits fixed: the prefix is the key
        }
        if (count == 1) {
            // the bucket is one token: find it (exactly one thread matches)
            for (int j = threadIdx.x; j < r.vocab; j += SAMPLE_THREADS) {
                const unsigned long long k = r.key(j, r.logit(j));
                if ((k >> shift) == prefix) atomicMin(&sh.key, k);
            }
            __syncthreads();
            const unsigned long long k = sh.key;
            *cum_out = below + bucket_mass;
            __syncthreads();
            return k;
        }
        __syncthreads();  // sh is rewritten by thread 0 in the next level
    }
    return NOT_FOUND;  // not reached
}

// Largest key <= limit among tokens of positive weight (the CPU walk's `last`), or NOT_FOUND.
template <typename T>
__device__ unsigned long long last_positive(const Row<T>& r, unsigned long long limit, SampleShared& sh) {
    if (threadIdx.x == 0) sh.key = 0;
    __syncthreads();
    unsigned long long best = 0;
    bool any = false;
    for (int j = threadIdx.x; j < r.vocab; j += SAMPLE_THREADS) {
        const float xj = r.logit(j);
        const unsigned long long k = r.key(j, xj);
        if (k <= limit && r.weight(xj) > 0.0) {
            best = (!any || k > best) ? k : best;
            any = true;
        }
    }
    const int found = __syncthreads_or(any);
    if (any) atomicMax(&sh.key, best);
    __syncthreads();
    const unsigned long long k = found ? sh.key : NOT_FOUND;
    __syncthreads();
    return k;
}

template <typename T>
__device__ void sample_impl(const T* __restrict__ logits, int vocab, const float* __restrict__ temps,
                            const float* __restrict__ top_ps, const double* __restrict__ uniforms,
                            uint32_t* __restrict__ out_tok, float* __restrict__ out_lp) {
    __shared__ SampleShared sh;
    const size_t row = blockIdx.x;
    const T* x = logits + row * (size_t)vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // 1. max and the lowest id holding it
    float bm = -INFINITY;
    int bi = vocab;
    for (int j = threadIdx.x; j < vocab; j += SAMPLE_THREADS) {
        const float v = to_f32(x[j]);
        if (v > bm) {  // ids increase along a thread's walk: keeps the first max; ignores NaN
            bm = v;
            bi = j;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bm, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bm || (ov == bm && oi < bi)) {
            bm = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        sh.redf[warp] = bm;
        sh.redi[warp] = bi;
    }
    __syncthreads();
    float m = -INFINITY;
    int arg = vocab;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        const float v = sh.redf[w];
        const int i = sh.redi[w];
        if (v > m || (v == m && i < arg)) {
            m = v;
            arg = i;
        }
    }
    if (arg >= vocab) arg = 0;  // all logits -inf/NaN: the CPU's position() also yields 0
    __syncthreads();

    // 2. log-sum-exp at temperature 1 and, when sampling, the total weight at temperature T
    const float temp = temps[row];
    const bool greedy = !(temp > 0.0f);
    const double inv_t = greedy ? 1.0 : 1.0 / (double)temp;
    double z = 0.0, wsum = 0.0;
    for (int j = threadIdx.x; j < vocab; j += SAMPLE_THREADS) {
        const double dlt = (double)(to_f32(x[j]) - m);
        z += exp(dlt);
        if (!greedy) wsum += exp(dlt * inv_t);
    }
    z = block_sum(z, sh.redd);
    const double lse = (double)m + log(z);
    int token = arg;
    if (!greedy) {
        wsum = block_sum(wsum, sh.redd);
        const double u = uniforms[row];
        const float top_p = top_ps[row];
        Row<T> r{x, vocab, m, inv_t, top_p >= 1.0f};
        double cum = 0.0;
        if (r.by_id) {
            // ids < 2^bits: start at the first 4-bit digit that can be non-zero
            int bits = 1;
            while (bits < 32 && ((unsigned)(vocab - 1) >> bits) != 0u) ++bits;
            const int level0 = 16 - (bits + 3) / 4;
            unsigned long long k = select_by_mass(r, level0, u * wsum, true, &cum, sh);
            if (k == NOT_FOUND) k = last_positive(r, NOT_FOUND - 1, sh);
            token = (k == NOT_FOUND) ? arg : (int)k;
        } else {
            const double need = (double)top_p * wsum;
            unsigned long long kn = select_by_mass(r, 0, need, false, &cum, sh);
            if (kn == NOT_FOUND) {  // the CPU keeps every token then
                kn = NOT_FOUND - 1;
                cum = wsum;
            }
            unsigned long long kp = select_by_mass(r, 0, u * cum, true, &cum, sh);
            if (kp == NOT_FOUND || kp > kn) kp = last_positive(r, kn, sh);
            token = (kp == NOT_FOUND) ? arg : (int)(kp & 0xffffffffull);
        }
    }
    if (threadIdx.x == 0) {
        out_tok[row] = (uint32_t)token;
        out_lp[row] = (float)((double)to_f32(x[token]) - lse);
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_f32(const float* logits, int vocab, const float* temps, const float* top_ps, const double* uniforms,
               uint32_t* out_tok, float* out_lp) {
    sample_impl<float>(logits, vocab, temps, top_ps, uniforms, out_tok, out_lp);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_bf16(const bf16* logits, int vocab, const float* temps, const float* top_ps, const double* uniforms,
                uint32_t* out_tok, float* out_lp) {
    sample_impl<bf16>(logits, vocab, temps, top_ps, uniforms, out_tok, out_lp);
}
