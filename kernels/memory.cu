// Data movement: token embedding gather, row gather, the slot-addressed KV store, f32 → bf16,
// and the bias add that follows a GEMM (y[m, n] += b[n]; the GEMMs write f32).
//
// Ideas:
// - embed / gather_rows: one block per output row, threads stride over the row's d elements
//   (coalesced reads of one source row, coalesced writes). gather_rows moves raw 2- or 4-byte
//   elements (bf16 or f32 buffers alike); embed widens the bf16 table to the f32 residual stream.
// - kv_store: one block per token row; thread t owns elements t, t + blockDim, ... of the row's
//   k and v parts (2·kv_dim elements, contiguous in qkv right after the q part), each written to
//   its cache slot. KV pool layout (one allocation, bf16):
//       [page][layer][k|v][kv_head][page_size][head_dim]
//   so a (layer, k|v, head) run of a page is page_size·head_dim contiguous elements (what the
//   attention kernel loads), and copy-on-write of a page is one contiguous device copy.
//   slot = page·page_size + offset, as in runtime::kv. Offsets are 64-bit (pools can exceed 2^31
//   elements).
//
// CPU twins: backend::cpu::ops::{embed, gather_rows}, backend::cpu::attention::CpuKv::store.
#include "common.cuh"

extern "C" __global__ void embed_bf16(const bf16* __restrict__ table, const uint32_t* __restrict__ ids, int d,
                                      float* __restrict__ out) {
    const size_t row = blockIdx.x;
    const bf16* src = table + (size_t)ids[row] * d;
    float* dst = out + row * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = __bfloat162float(src[j]);
}

extern "C" __global__ void gather_rows_b16(const uint16_t* __restrict__ x, const uint32_t* __restrict__ rows,
                                           long long d, uint16_t* __restrict__ out) {
    const uint16_t* src = x + (size_t)rows[blockIdx.x] * d;
    uint16_t* dst = out + (size_t)blockIdx.x * d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void gather_rows_b32(const uint32_t* __restrict__ x, const uint32_t* __restrict__ rows,
                                           long long d, uint32_t* __restrict__ out) {
    const uint32_t* src = x + (size_t)rows[blockIdx.x] * d;
    uint32_t* dst = out + (size_t)blockIdx.x * d;
    for (long long j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
}

extern "C" __global__ void f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// y [rows, n] (f32) += b[n]; grid-stride over the rows·n elements.
template <typename TB>
__device__ void add_bias_impl(float* __restrict__ y, const TB* __restrict__ b, int n, long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x)
        y[i] += to_f32(b[i % n]);
}
extern "C" __global__ void add_bias_bf16(float* y, const bf16* b, int n, long long total) {
    add_bias_impl<bf16>(y, b, n, total);
}
extern "C" __global__ void add_bias_f32(float* y, const float* b, int n, long long total) {
    add_bias_impl<float>(y, b, n, total);
}

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
