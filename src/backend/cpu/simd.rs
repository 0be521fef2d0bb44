//! Vectorized inner loops shared by the CPU ops: dot products, axpy, and the one `exp` of the CPU
//! backend (Cephes' polynomial, ~1 ulp; the 8-lane path gives the scalar path's bits) so softmax,
//! SwiGLU and the log-sum-exps run 8 lanes at a time instead of calling libm per element. Also the
//! one place that asks the CPU what it has (`has_avx2_fma`, `has_avx512f`) and the `simd_kernel!`
//! dispatch for loops the compiler vectorizes by itself.
//!
//! The crate is built for x86-64-v3 (AVX2+FMA, see .cargo/config.toml), so the intrinsics paths
//! below are chosen at compile time; other targets get the same code through plain loops.

/// Whether the CPU has AVX2 and FMA (asked once).
#[cfg(target_arch = "x86_64")]
pub fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Whether the CPU has AVX-512F (asked once): our packed GEMM's microkernel needs it.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512f() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// Whether the CPU has AVX512_BF16 (with AVX-512F/BW/VL, which every CPU with it has; a VM may
/// hide a bit) (asked once): the bf16 GEMM's `vdpbf16ps` microkernel (`cpu::bf16`) needs it, and
/// the bf16 attention's 256-bit masked stores (`attention::tiled`) need VL.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512bf16() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512bf16"))
}

/// Define a slice kernel whose body is compiled twice, for the baseline target and with AVX2+FMA
/// enabled (picked at run time), so its loops vectorize 8 wide even in a build for an older
/// baseline. For loops without `exp` (the compiler vectorizes those itself); loops with `exp`
/// call the intrinsics helpers below.
macro_rules! simd_kernel {
    ($(#[$m:meta])* pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($arg: $ty),*) -> $ret {
                    body($($arg),*)
                }
                if $crate::backend::cpu::simd::has_avx2_fma() {
                    // Safety: the CPU supports the enabled features.
                    return unsafe { wide($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use simd_kernel;

/// Σ a[i]·b[i] with fixed-order partial sums (reproducible run to run).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    {
        // Safety: both slices hold n elements; loads are unaligned.
        unsafe { avx::dot(a.as_ptr(), b.as_ptr(), n) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    {
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = [0f32; 8];
        let ca = a.chunks_exact(8);
        let cb = b.chunks_exact(8);
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for l in 0..8 {
                acc[l] += x[l] * y[l];
            }
        }
        let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (x, y) in ra.iter().zip(rb) {
            s += x * y;
        }
        s
    }
}

/// y += alpha · x
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    let n = y.len().min(x.len());
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    {
        // Safety: both slices hold n elements and do not overlap (&mut vs &).
        unsafe { avx::axpy(y.as_mut_ptr(), alpha, x.as_ptr(), n) }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    for (a, b) in y[..n].iter_mut().zip(&x[..n]) {
        *a += alpha * b;
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
mod avx {
    use std::arch::x86_64::*;

    #[inline(always)]
    pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i + 8)), _mm256_loadu_ps(b.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc0);
            i += 8;
        }
        let mut r = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            r += *a.add(i) * *b.add(i);
            i += 1;
        }
        r
    }

    /// `exp_lane` on 8 lanes, the same operations in the same order.
    #[inline(always)]
    pub unsafe fn exp(x: __m256) -> __m256 {
        use super::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
        let ps = _mm256_set1_ps;
        // max(lo, x) then min(hi, ·) keep a NaN input NaN, as `clamp` does
        let v = _mm256_min_ps(ps(EXP_HI), _mm256_max_ps(ps(EXP_LO), x));
        let fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(v, ps(LOG2E)), ps(0.5)));
        let r = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(fx, ps(EXP_C1))), _mm256_mul_ps(fx, ps(EXP_C2)));
        let mut y = ps(EXP_P[0]);
        for &p in &EXP_P[1..] {
            y = _mm256_add_ps(_mm256_mul_ps(y, r), ps(p));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), ps(1.0));
        let e = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127))));
        _mm256_mul_ps(y, e)
    }

    /// Horizontal sum in the fixed order ((0+4)+(2+6)) + ((1+5)+(3+7)).
    #[inline(always)]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }

    /// `x[i] = exp(x[i] − m)` over the first `n8` (a multiple of 8) elements; returns the lane sums.
    #[inline(always)]
    pub unsafe fn exp_sub_sum(x: *mut f32, n8: usize, m: f32, write: bool) -> f32 {
        let (mv, mut acc) = (_mm256_set1_ps(m), _mm256_setzero_ps());
        let mut i = 0;
        while i < n8 {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), mv));
            if write {
                _mm256_storeu_ps(x.add(i), e);
            }
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        hsum(acc)
    }

    /// `exp_sub_sum_dot` over the first `n8` elements: returns (Σ e, Σ e·x) of the lanes.
    #[inline(always)]
    pub unsafe fn exp_sub_sum_dot(x: *mut f32, n8: usize, m: f32) -> (f32, f32) {
        let (mv, mut acc, mut accl) = (_mm256_set1_ps(m), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i < n8 {
            let v = _mm256_loadu_ps(x.add(i));
            let e = exp(_mm256_sub_ps(v, mv));
            accl = _mm256_add_ps(accl, _mm256_mul_ps(e, v));
            _mm256_storeu_ps(x.add(i), e);
            acc = _mm256_add_ps(acc, e);
            i += 8;
        }
        (hsum(acc), hsum(accl))
    }

    /// `x[i] = exp(x[i]·scale − sub)` over the first `n8` elements.
    #[inline(always)]
    pub unsafe fn exp_scaled_sub(x: *mut f32, n8: usize, scale: f32, sub: f32) {
        let (sc, sb) = (_mm256_set1_ps(scale), _mm256_set1_ps(sub));
        let mut i = 0;
        while i < n8 {
            let v = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(x.add(i)), sc), sb);
            _mm256_storeu_ps(x.add(i), exp(v));
            i += 8;
        }
    }

    #[inline(always)]
    pub unsafe fn axpy(y: *mut f32, alpha: f32, x: *const f32, n: usize) {
        let av = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(y.add(i), _mm256_fmadd_ps(av, _mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i))));
            i += 8;
        }
        while i < n {
            *y.add(i) += alpha * *x.add(i);
            i += 1;
        }
    }
}

pub(crate) const EXP_LO: f32 = -87.336_54; // [-87.3, 88]: 2^fx stays a normal float (inputs here are ≤ 0 after max subtraction)
pub(crate) const EXP_HI: f32 = 88.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const EXP_C1: f32 = 0.693_359_4;
pub(crate) const EXP_C2: f32 = -2.121_944_4e-4;
pub(crate) const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 5.000_000_1e-1];

/// exp of one lane (Cephes expf: range reduction by ln 2, degree-5 polynomial, exponent bits).
/// The 8-lane AVX2 path below performs exactly these operations in this order (no fused
/// multiply-adds), so both give the same bits.
#[inline(always)]
fn exp_lane(x: f32) -> f32 {
    let v = x.clamp(EXP_LO, EXP_HI);
    let fx = (v * LOG2E + 0.5).floor();
    let r = v - fx * EXP_C1 - fx * EXP_C2;
    let mut y = EXP_P[0];
    for &p in &EXP_P[1..] {
        y = y * r + p;
    }
    let y = y * r * r + r + 1.0;
    let e = f32::from_bits((((fx as i32) + 127) as u32) << 23);
    y * e
}

/// `exp_lane` on 16 AVX-512 lanes, the same operations in the same order (the f32 softmax and
/// SiLU paths, whose scalar twins give the same bits; the bf16 attention has its own fused exp,
/// `attention::tiled::x512::exp`). Callers must have AVX-512F (checked at run time).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    #[inline(always)]
    pub unsafe fn exp(x: __m512) -> __m512 {
        use super::{EXP_C1, EXP_C2, EXP_HI, EXP_LO, EXP_P, LOG2E};
        let ps = _mm512_set1_ps;
        let v = _mm512_min_ps(ps(EXP_HI), _mm512_max_ps(ps(EXP_LO), x));
        let fx = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(_mm512_add_ps(_mm512_mul_ps(v, ps(LOG2E)), ps(0.5)));
        let r = _mm512_sub_ps(_mm512_sub_ps(v, _mm512_mul_ps(fx, ps(EXP_C1))), _mm512_mul_ps(fx, ps(EXP_C2)));
        let mut y = ps(EXP_P[0]);
        for &p in &EXP_P[1..] {
            y = _mm512_add_ps(_mm512_mul_ps(y, r), ps(p));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r), ps(1.0));
        let e = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127))));
        _mm512_mul_ps(y, e)
    }

    /// `exp(−x)`, −x by flipping the sign bit: exactly the scalar `-x` (±0, NaN included).
    #[inline(always)]
    pub unsafe fn exp_neg(x: __m512) -> __m512 {
        exp(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN))))
    }

    /// `out[i] = g[i] / (1 + exp(−g[i])) · u[i]` for the whole vectors of `n` (SwiGLU's
    /// forward, the scalar formula's operations in its order); returns how many were done.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul(g: *const f32, u: *const f32, out: *mut f32, n: usize) -> usize {
        let n16 = n & !15;
        let one = _mm512_set1_ps(1.0);
        for i in (0..n16).step_by(16) {
            let gv = _mm512_loadu_ps(g.add(i));
            let e = exp_neg(gv);
            let y = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u.add(i)));
            _mm512_storeu_ps(out.add(i), y);
        }
        n16
    }

    /// The upper 8 lanes. (`_mm512_extractf32x8_ps` needs AVX-512 DQ, which these functions do
    /// not enable: it was not inlined, a call per 16 elements.)
    #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
    #[inline(always)]
    unsafe fn hi256(v: __m512) -> __m256 {
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)))
    }

    /// `avx::exp_sub_sum` 16 lanes at a time: the same exp bits per lane, and the same sums —
    /// each 16-lane vector's low then high half added into one 8-lane accumulator, the 8-lane
    /// loop's order. For a row of `n8` (a multiple of 8); returns the 8 lane sums.
    #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub_sum(x: *mut f32, n8: usize, m: f32, write: bool) -> __m256 {
        let (mv, mut acc) = (_mm512_set1_ps(m), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n8 {
            let e = exp(_mm512_sub_ps(_mm512_loadu_ps(x.add(i)), mv));
            if write {
                _mm512_storeu_ps(x.add(i), e);
            }
            acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
            acc = _mm256_add_ps(acc, hi256(e));
            i += 16;
        }
        if i < n8 {
            let e = super::avx::exp(_mm256_sub_ps(_mm256_loadu_ps(x.add(i)), _mm512_castps512_ps256(mv)));
            if write {
                _mm256_storeu_ps(x.add(i), e);
            }
            acc = _mm256_add_ps(acc, e);
        }
        acc
    }

    /// `avx::exp_sub_sum_dot` 16 lanes at a time, the sums in its order (as `exp_sub_sum`).
    #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub_sum_dot(x: *mut f32, n8: usize, m: f32) -> (__m256, __m256) {
        let (mv, mut acc, mut accl) = (_mm512_set1_ps(m), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n8 {
            let v = _mm512_loadu_ps(x.add(i));
            let e = exp(_mm512_sub_ps(v, mv));
            let el = _mm512_mul_ps(e, v);
            accl = _mm256_add_ps(accl, _mm512_castps512_ps256(el));
            accl = _mm256_add_ps(accl, hi256(el));
            _mm512_storeu_ps(x.add(i), e);
            acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
            acc = _mm256_add_ps(acc, hi256(e));
            i += 16;
        }
        if i < n8 {
            let v = _mm256_loadu_ps(x.add(i));
            let e = super::avx::exp(_mm256_sub_ps(v, _mm512_castps512_ps256(mv)));
            accl = _mm256_add_ps(accl, _mm256_mul_ps(e, v));
            _mm256_storeu_ps(x.add(i), e);
            acc = _mm256_add_ps(acc, e);
        }
        (acc, accl)
    }

    /// `avx::exp_scaled_sub` 16 lanes at a time (then 8).
    #[cfg(all(target_feature = "avx2", target_feature = "fma"))]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_scaled_sub(x: *mut f32, n8: usize, scale: f32, sub: f32) {
        let (sc, sb) = (_mm512_set1_ps(scale), _mm512_set1_ps(sub));
        let mut i = 0;
        while i + 16 <= n8 {
            let v = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(x.add(i)), sc), sb);
            _mm512_storeu_ps(x.add(i), exp(v));
            i += 16;
        }
        if i < n8 {
            super::avx::exp_scaled_sub(x.add(i), 8, scale, sub);
        }
    }

    /// `exp` on 16 lanes of an array (for the test).
    #[cfg(test)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp16(x: [f32; 16]) -> [f32; 16] {
        let mut out = [0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), exp(_mm512_loadu_ps(x.as_ptr())));
        out
    }
}

/// exp of 8 lanes. Written with intrinsics because the compiler turns the scalar formula's
/// saturating `as i32` and `floor` into per-lane code: the softmax of prefill attention took
/// half of the attention time before (perf, `cargo bench --bench kernels -- prefill`).
#[inline(always)]
pub fn exp8(x: [f32; 8]) -> [f32; 8] {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    {
        use std::arch::x86_64::*;
        // Safety: AVX2 is enabled at compile time; loads/stores are unaligned on local arrays.
        unsafe {
            let mut out = [0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), avx::exp(_mm256_loadu_ps(x.as_ptr())));
            out
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    x.map(exp_lane)
}

/// Scalar exp with the same numerics as the vector path.
#[inline]
pub fn exp(x: f32) -> f32 {
    exp_lane(x)
}

/// x[i] ← exp(x[i] − m); returns Σ of the new values (f32 lanes, fixed order).
#[inline]
pub fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let n8 = x.len() & !7;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    // Safety: n8 ≤ x.len(); AVX-512F checked.
    let mut s = unsafe { if has_avx512f() { avx::hsum(avx512::exp_sub_sum(x.as_mut_ptr(), n8, m, true)) } else { avx::exp_sub_sum(x.as_mut_ptr(), n8, m, true) } };
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    let mut s = {
        let mut acc = [0f32; 8];
        for c in x[..n8].chunks_exact_mut(8) {
            for l in 0..8 {
                c[l] = exp_lane(c[l] - m);
                acc[l] += c[l];
            }
        }
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) // as avx::hsum
    };
    for v in &mut x[n8..] {
        *v = exp(*v - m);
        s += *v;
    }
    s
}

/// Σ exp(x[i] − m) without writing (for log-sum-exps over logits).
#[inline]
pub fn sum_exp_sub(x: &[f32], m: f32) -> f32 {
    let n8 = x.len() & !7;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    // Safety: n8 ≤ x.len(); with write = false nothing is stored through the pointer; AVX-512F checked.
    let mut s = unsafe { if has_avx512f() { avx::hsum(avx512::exp_sub_sum(x.as_ptr() as *mut f32, n8, m, false)) } else { avx::exp_sub_sum(x.as_ptr() as *mut f32, n8, m, false) } };
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    let mut s = {
        let mut acc = [0f32; 8];
        for c in x[..n8].chunks_exact(8) {
            for l in 0..8 {
                acc[l] += exp_lane(c[l] - m);
            }
        }
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) // as avx::hsum
    };
    for &v in &x[n8..] {
        s += exp(v - m);
    }
    s
}

/// x[i] ← exp(x[i] − m); returns (Σ new, Σ new·old): the normalizer and, divided by it, the
/// expected logit (the entropy of a softmax row, `lse − Σ p·l`).
#[inline]
pub fn exp_sub_sum_dot(x: &mut [f32], m: f32) -> (f32, f32) {
    let n8 = x.len() & !7;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    // Safety: n8 ≤ x.len(); AVX-512F checked.
    let (mut s, mut sl) = unsafe {
        if has_avx512f() {
            let (a, al) = avx512::exp_sub_sum_dot(x.as_mut_ptr(), n8, m);
            (avx::hsum(a), avx::hsum(al))
        } else {
            avx::exp_sub_sum_dot(x.as_mut_ptr(), n8, m)
        }
    };
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    let (mut s, mut sl) = {
        let (mut acc, mut accl) = ([0f32; 8], [0f32; 8]);
        for c in x[..n8].chunks_exact_mut(8) {
            for l in 0..8 {
                let e = exp_lane(c[l] - m);
                accl[l] += e * c[l];
                c[l] = e;
                acc[l] += e;
            }
        }
        let h = |a: [f32; 8]| ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); // as avx::hsum
        (h(acc), h(accl))
    };
    for v in &mut x[n8..] {
        let e = exp(*v - m);
        sl += e * *v;
        *v = e;
        s += e;
    }
    (s, sl)
}

/// x[i] ← exp(x[i]·scale − sub): the probabilities of a score row from its log-sum-exp.
#[inline]
pub fn exp_scaled_sub(x: &mut [f32], scale: f32, sub: f32) {
    let n8 = x.len() & !7;
    #[cfg(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma"))]
    // Safety: n8 ≤ x.len(); AVX-512F checked.
    unsafe {
        if has_avx512f() {
            avx512::exp_scaled_sub(x.as_mut_ptr(), n8, scale, sub)
        } else {
            avx::exp_scaled_sub(x.as_mut_ptr(), n8, scale, sub)
        }
    };
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx2", target_feature = "fma")))]
    for v in &mut x[..n8] {
        *v = exp_lane(*v * scale - sub);
    }
    for v in &mut x[n8..] {
        *v = exp(*v * scale - sub);
    }
}

#[inline]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = x.chunks_exact(8);
    let rem = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] = acc[l].max(c[l]);
        }
    }
    let mut m = acc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &v in rem {
        m = m.max(v);
    }
    m
}

/// out[i] = silu(g[i]) · u[i]
#[inline]
pub fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
    let (g, u, out) = (&g[..out.len()], &u[..out.len()], out);
    #[cfg(target_arch = "x86_64")]
    if has_avx512f() {
        // Safety: AVX-512F checked; the three slices have out.len() elements.
        let done = unsafe { avx512::silu_mul(g.as_ptr(), u.as_ptr(), out.as_mut_ptr(), out.len()) };
        return silu_mul_8(&g[done..], &u[done..], &mut out[done..]);
    }
    silu_mul_8(g, u, out)
}

/// `silu_mul` 8 lanes at a time (and the tail one by one): the same bits as the 16-lane path.
fn silu_mul_8(g: &[f32], u: &[f32], out: &mut [f32]) {
    let mut o = out.chunks_exact_mut(8);
    let mut gc = g.chunks_exact(8);
    let mut uc = u.chunks_exact(8);
    for ((oc, gg), uu) in (&mut o).zip(&mut gc).zip(&mut uc) {
        let mut neg = [0f32; 8];
        for l in 0..8 {
            neg[l] = -gg[l];
        }
        let e = exp8(neg);
        for l in 0..8 {
            oc[l] = gg[l] / (1.0 + e[l]) * uu[l];
        }
    }
    for ((oo, &gg), &uu) in o.into_remainder().iter_mut().zip(gc.remainder()).zip(uc.remainder()) {
        *oo = gg / (1.0 + exp(-gg)) * uu;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// `silu_mul` gives the scalar formula's bits on every path (16 lanes, 8 lanes, the tail),
    /// including ±0, large magnitudes, infinities and NaN.
    #[test]
    fn silu_mul_matches_the_scalar_formula() {
        // the special values first (the 16-lane path), again at 16..27 (the 8-lane path when
        // AVX-512 is missing) and at the end (the scalar tail)
        let special = [0.0, -0.0, 88.5, -88.5, 1e30, -1e30, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40, -3.0];
        let mut g: Vec<f32> = special.iter().chain(&[0.5; 5]).chain(&special).copied().collect();
        g.extend((0..1000).map(|i| (i as f32 - 500.0) * 0.173));
        g.extend(special);
        let u: Vec<f32> = (0..g.len()).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.31).collect();
        for n in [g.len(), 1030, 1000, 27, 17, 9, 3] {
            let mut out = vec![0f32; n];
            silu_mul(&g[..n], &u[..n], &mut out);
            for i in 0..n {
                let want = g[i] / (1.0 + exp(-g[i])) * u[i];
                assert!(out[i].to_bits() == want.to_bits() || (out[i].is_nan() && want.is_nan()), "silu_mul({}, {}) = {} vs {want} (n {n})", g[i], u[i], out[i]);
            }
        }
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let got = exp(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "max relative error {worst}");
        assert!(exp(-1e30) < 1e-37 && exp(-1e30) >= 0.0);
        // the 8-lane path gives the scalar path's bits, NaN stays NaN
        let mut x = -100.0f32;
        while x < 100.0 {
            let lanes = [x, x + 0.001, -x, x * 0.5, x - 1e-3, 0.0, -0.0, x * 1e-3];
            let v = exp8(lanes);
            for l in 0..8 {
                assert_eq!(v[l].to_bits(), exp_lane(lanes[l]).to_bits(), "exp({})", lanes[l]);
            }
            x += 0.0173;
        }
        assert!(exp8([f32::NAN; 8])[3].is_nan() && exp(f32::NAN).is_nan());
        // and so does the 16-lane AVX-512 path
        #[cfg(target_arch = "x86_64")]
        if has_avx512f() {
            let mut x = -100.0f32;
            while x < 100.0 {
                let lanes: [f32; 16] = std::array::from_fn(|l| x * (1.0 - l as f32 * 0.07) + l as f32 * 1e-3);
                // Safety: AVX-512F checked above
                let v = unsafe { avx512::exp16(lanes) };
                for l in 0..16 {
                    assert_eq!(v[l].to_bits(), exp_lane(lanes[l]).to_bits(), "exp16({})", lanes[l]);
                }
                x += 0.0173;
            }
        }
        assert_eq!(exp8([f32::NEG_INFINITY; 8])[0], exp(f32::NEG_INFINITY));
        let mut v: Vec<f32> = (0..21).map(|i| i as f32 * 0.3 - 2.0).collect();
        let want: f32 = v.iter().map(|x| (x - 1.0).exp()).sum();
        assert!((sum_exp_sub(&v, 1.0) - want).abs() < 1e-5 * want);
        let s = exp_sub_sum(&mut v, 1.0);
        assert!((s - want).abs() < 1e-5 * want);
        assert_eq!(max(&[1.0, 5.0, -2.0, 3.0, 0.0, 9.0, 1.0, 2.0, 4.0, 11.0]), 11.0);
        // the softmax-row helpers: every element is the scalar exp's bits, the sums in f64 agree
        let base: Vec<f32> = (0..37).map(|i| i as f32 * 0.41 - 7.0).collect();
        let mut a = base.clone();
        let (s, sl) = exp_sub_sum_dot(&mut a, 1.5);
        for (e, x) in a.iter().zip(&base) {
            assert_eq!(e.to_bits(), exp(x - 1.5).to_bits());
        }
        let (ws, wsl) = base.iter().fold((0f64, 0f64), |(s, sl), &x| (s + ((x - 1.5) as f64).exp(), sl + ((x - 1.5) as f64).exp() * x as f64));
        assert!((s as f64 - ws).abs() < 1e-5 * ws && (sl as f64 - wsl).abs() < 1e-5 * wsl.abs(), "{s} {ws} {sl} {wsl}");
        let mut b = base.clone();
        exp_scaled_sub(&mut b, 0.125, 2.0);
        for (e, x) in b.iter().zip(&base) {
            assert_eq!(e.to_bits(), exp(x * 0.125 - 2.0).to_bits());
        }
        assert!((dot(&[1.0; 13], &[2.0; 13]) - 26.0).abs() < 1e-6);
    }

    /// The softmax-row helpers give the bits of the 8-lane spec — every element `exp_lane`, the
    /// sums in 8 lane accumulators over whole 8-blocks, `hsum`'s order, then the tail one by one —
    /// whichever path runs (16 lanes with AVX-512, 8 with AVX2, scalar): a row's bits do not
    /// depend on the CPU. Lengths cover an odd 8-block after the 16-blocks and every tail.
    #[test]
    fn row_helpers_give_the_8_lane_bits() {
        let h = |a: [f32; 8]| ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        let spec = |x: &[f32], f: &dyn Fn(f32) -> f32, dot: bool| -> (Vec<f32>, f32, f32) {
            let n8 = x.len() & !7;
            let (mut acc, mut accl) = ([0f32; 8], [0f32; 8]);
            let e: Vec<f32> = x.iter().map(|&v| f(v)).collect();
            for i in 0..n8 {
                acc[i % 8] += e[i];
                accl[i % 8] += e[i] * x[i];
            }
            let (mut s, mut sl) = (h(acc), h(accl));
            for i in n8..x.len() {
                if dot {
                    sl += e[i] * x[i];
                }
                s += e[i];
            }
            (e, s, sl)
        };
        // terms of comparable size (a sum's order shows in its last bits), and values the clamp
        // and the exponent bits must handle
        let special = [0.0, -0.0, -200.0, 1e-40, 3.5, -87.5, -1e3, 0.25];
        for (n, m) in [0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 40, 47, 48, 56, 100, 203, 512, 777, 1001].into_iter().flat_map(|n| [(n, 2.25f32), (n, -1.0)]) {
            let x: Vec<f32> = (0..n).map(|i| if i % 13 == 5 { special[i % special.len()] } else { ((i * 7919) % 2003) as f32 * 0.003 - 3.0 }).collect();
            let (we, ws, wsl) = spec(&x, &|v| exp_lane(v - m), true);
            let mut a = x.clone();
            let s = exp_sub_sum(&mut a, m);
            assert!(a.iter().zip(&we).all(|(g, w)| g.to_bits() == w.to_bits()) && s.to_bits() == ws.to_bits(), "exp_sub_sum, n {n}: {s} vs {ws}");
            assert_eq!(sum_exp_sub(&x, m).to_bits(), ws.to_bits(), "sum_exp_sub, n {n}");
            let mut b = x.clone();
            let (s, sl) = exp_sub_sum_dot(&mut b, m);
            assert!(b.iter().zip(&we).all(|(g, w)| g.to_bits() == w.to_bits()) && s.to_bits() == ws.to_bits() && sl.to_bits() == wsl.to_bits(), "exp_sub_sum_dot, n {n}: {s} {sl} vs {ws} {wsl}");
            let (we, _, _) = spec(&x, &|v| exp_lane(v * 0.125 - m), false);
            let mut c = x.clone();
            exp_scaled_sub(&mut c, 0.125, m);
            assert!(c.iter().zip(&we).all(|(g, w)| g.to_bits() == w.to_bits()), "exp_scaled_sub, n {n}");
        }
        let mut nan = vec![1.0f32; 40];
        nan[21] = f32::NAN;
        assert!(exp_sub_sum(&mut nan, 0.0).is_nan() && nan[21].is_nan() && nan[20] == exp(1.0));
        let mut inf = vec![1.0f32; 40];
        inf[3] = f32::NEG_INFINITY;
        assert!(exp_sub_sum(&mut inf, 0.0) == 39.0 * exp(1.0) + inf[3] && inf[3] == exp(f32::NEG_INFINITY));
    }
}
