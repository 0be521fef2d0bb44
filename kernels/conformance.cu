// Conformance probes: the instructions whose emulator models (src/backend/cuda/ptx/float.rs and
// the interpreter's mma.sync) set the parity tolerances, run on chosen inputs so that a GPU's
// results can be compared with the emulator's, bit by bit or within each model's stated bound.
// tools/gpu-check.sh contact runs them first on a real GPU; src/backend/cuda/conformance.rs has
// the inputs, the launches and the comparison. Every instruction is pinned by inline PTX, so
// nvcc cannot substitute another sequence.
#include "common.cuh"

// Probes per input of conformance_scalar, in this order (the Rust side names them).
#define CONF_PROBES 6

// One thread per input x[i]: out[i·CONF_PROBES + k] = the raw 32-bit result of probe k
// (the bf16 conversion in the low 16 bits).
extern "C" __global__ void __launch_bounds__(256) conformance_scalar(const float* __restrict__ x, int n, uint32_t* __restrict__ out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i];
    float r;
    uint32_t* o = out + (size_t)i * CONF_PROBES;
    asm("ex2.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    o[0] = __float_as_uint(r);
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    o[1] = __float_as_uint(r);
    asm("rcp.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
    o[2] = __float_as_uint(r);
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(v));
    o[3] = __float_as_uint(r);
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    o[4] = h;
    // bf16 → f32 of the low 16 bits of the input's bits (exact: a shift)
    const unsigned short lo = (unsigned short)(__float_as_uint(v) & 0xffffu);
    asm("cvt.f32.bf16 %0, %1;" : "=f"(r) : "h"(lo));
    o[5] = __float_as_uint(r);
}

// One mma.sync.m16n8k16 bf16 tile by one warp: D = A·B + C with A 16×16 row-major (bf16 bits),
// B given as Bᵀ 8×16 row-major ([n][k], bf16 bits), C and D 16×8 row-major f32. The fragments
// follow the ownership table of mma.cuh (lane = 4·gid + tq).
extern "C" __global__ void __launch_bounds__(32) conformance_mma(const uint16_t* __restrict__ a, const uint16_t* __restrict__ bt, const float* __restrict__ c, float* __restrict__ d) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
    auto pair = [](const uint16_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 16); };
    const uint32_t a0 = pair(a + gid * 16 + 2 * tq), a1 = pair(a + (gid + 8) * 16 + 2 * tq);
    const uint32_t a2 = pair(a + gid * 16 + 2 * tq + 8), a3 = pair(a + (gid + 8) * 16 + 2 * tq + 8);
    const uint32_t b0 = pair(bt + gid * 16 + 2 * tq), b1 = pair(bt + gid * 16 + 2 * tq + 8);
    float r0 = c[gid * 8 + 2 * tq], r1 = c[gid * 8 + 2 * tq + 1], r2 = c[(gid + 8) * 8 + 2 * tq], r3 = c[(gid + 8) * 8 + 2 * tq + 1];
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(r0), "+f"(r1), "+f"(r2), "+f"(r3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    d[gid * 8 + 2 * tq] = r0;
    d[gid * 8 + 2 * tq + 1] = r1;
    d[(gid + 8) * 8 + 2 * tq] = r2;
    d[(gid + 8) * 8 + 2 * tq + 1] = r3;
}
