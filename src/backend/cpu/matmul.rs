//! The projections on the CPU (twin of the cuBLASLt calls in src/backend/cuda/gemm.rs): `y = x Wᵀ`,
//! its backward `dx = dy W`, and the merge `W + s·B A` the training passes use (the LoRA delta and
//! its gradients, thin products, are `lora.rs`).
//!
//! Large `m` (prefill, scoring, training) goes to `gemm512` (our AVX-512 packed GEMM, ~90% of the
//! FMA peak here) or, without AVX-512 or for outputs narrower than one 32-column panel, to the
//! `gemm` crate. Small `m` (decode: a handful of rows) is bandwidth-bound: packing `W` would cost
//! more than the product, so a hand-written AVX2/FMA kernel streams each weight row once from
//! memory and multiplies it against all `m` input rows held in L1 (tiles of 4 inputs × 2 weight
//! rows = 8 accumulators).
use super::par::SendPtr;
use rayon::prelude::*;

/// Below this many rows, `matmul` uses the streaming kernel.
pub const SMALL_M: usize = 16;

fn threads() -> usize {
    rayon::current_num_threads()
}

/// General strided GEMM: `dst = (accumulate ? dst : 0) + alpha · A · B`, with A `[m, k]`,
/// B `[k, n]`, dst `[m, n]`, each given by (row stride, column stride).
///
/// # Safety
/// The pointers must cover the strided extents; `dst` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_raw(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    accumulate: bool,
    a: *const f32,
    a_rs: isize,
    a_cs: isize,
    b: *const f32,
    b_rs: isize,
    b_cs: isize,
    alpha: f32,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    *dst.offset(i as isize * dst_rs + j as isize * dst_cs) = 0.0;
                }
            }
        }
        return;
    }
    let parallel = parallel && threads() > 1 && m * n * k >= 1 << 18;
    #[cfg(target_arch = "x86_64")]
    if super::gemm512::available() && dst_cs == 1 && dst_rs >= 0 && n >= 32 {
        return super::gemm512::gemm(m, n, k, dst, dst_rs as usize, accumulate, a, a_rs, a_cs, b, b_rs, b_cs, alpha, parallel);
    }
    let par = if parallel {
        gemm::Parallelism::Rayon(threads())
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(m, n, k, dst, dst_cs, dst_rs, accumulate, a, a_cs, a_rs, b, b_cs, b_rs, 1.0, alpha, false, false, false, par);
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ (+ bias)`, parallel over the machine's threads.
pub fn matmul(x: &[f32], w: &[f32], bias: Option<&[f32]>, m: usize, k: usize, n: usize, out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matmul: buffer too small");
    if m == 0 || n == 0 {
        return;
    }
    if m <= SMALL_M {
        small_m(x, w, m, k, n, out, true);
    } else {
        unsafe {
            gemm_raw(m, n, k, out.as_mut_ptr(), n as isize, 1, false, x.as_ptr(), k as isize, 1, w.as_ptr(), 1, k as isize, 1.0, true);
        }
    }
    if let Some(b) = bias {
        for row in out[..m * n].chunks_exact_mut(n) {
            for (o, bb) in row.iter_mut().zip(b) {
                *o += bb;
            }
        }
    }
}

/// Single-threaded `out[m, n] = x · wᵀ` (for use inside already-parallel loops).
pub fn matmul_serial(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32]) {
    if m <= SMALL_M {
        small_m(x, w, m, k, n, out, false);
    } else {
        unsafe {
            gemm_raw(m, n, k, out.as_mut_ptr(), n as isize, 1, false, x.as_ptr(), k as isize, 1, w.as_ptr(), 1, k as isize, 1.0, false);
        }
    }
}

fn small_m(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: &mut [f32], parallel: bool) {
    let outp = SendPtr(out.as_mut_ptr());
    let run = |j0: usize, j1: usize| {
        // Safety: each task writes columns j0..j1 of every row, disjoint across tasks.
        unsafe { small_m_cols(x, w, m, k, n, outp.get(), j0, j1) }
    };
    let t = threads();
    if !parallel || t == 1 || n * k < 1 << 15 {
        run(0, n);
        return;
    }
    // ~4 chunks per thread for balance; even sizes keep the 2-row tiles whole.
    let chunk = (n.div_ceil(t * 4) + 1) & !1;
    let chunk = chunk.max(16);
    (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let j0 = c * chunk;
        run(j0, (j0 + chunk).min(n));
    });
}

/// # Safety
/// `out` must have room for `m` rows of `ldo = n` and columns `j0..j1 <= n`.
unsafe fn small_m_cols(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, out: *mut f32, j0: usize, j1: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::simd::has_avx2_fma() {
            return avx2::cols(x.as_ptr(), w.as_ptr(), m, k, n, out, j0, j1);
        }
    }
    for j in j0..j1 {
        let wr = &w[j * k..(j + 1) * k];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = 0f32;
            for (a, b) in xr.iter().zip(wr) {
                acc += a * b;
            }
            *out.add(i * n + j) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let hi = _mm256_extractf128_ps(v, 1);
        let lo = _mm256_castps256_ps128(v);
        let s = _mm_add_ps(hi, lo);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// MR input rows × NR weight rows, full k.
    #[inline(always)]
    unsafe fn tile<const MR: usize, const NR: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        n: usize,
        out: *mut f32,
        i0: usize,
        j: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        let k8 = k & !7;
        let mut kk = 0;
        // The first row group streams W from memory: prefetch the weight rows two tiles ahead into
        // L2 so DRAM requests overlap the FMAs (without it a core reaches only ~6 GB/s here; into
        // L2 rather than L1, and two tiles rather than one ahead: decode 130 → 157 tok/s,
        // `cargo bench --bench kernels -- decode` +40 %).
        let prefetch = i0 == 0;
        while kk < k8 {
            let mut wv = [_mm256_setzero_ps(); NR];
            for c in 0..NR {
                if prefetch && kk % 16 == 0 {
                    // wrapping: past the last row this is only a hint, never dereferenced
                    _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add((j + 2 * NR + c) * k + kk) as *const i8);
                }
                wv[c] = _mm256_loadu_ps(w.add((j + c) * k + kk));
            }
            for r in 0..MR {
                let xv = _mm256_loadu_ps(x.add((i0 + r) * k + kk));
                for c in 0..NR {
                    acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
                }
            }
            kk += 8;
        }
        for r in 0..MR {
            for c in 0..NR {
                let mut s = hsum(acc[r][c]);
                for t in k8..k {
                    s += *x.add((i0 + r) * k + t) * *w.add((j + c) * k + t);
                }
                *out.add((i0 + r) * n + j + c) = s;
            }
        }
    }

    #[inline(always)]
    unsafe fn rows<const NR: usize>(x: *const f32, w: *const f32, m: usize, k: usize, n: usize, out: *mut f32, j: usize) {
        let mut i0 = 0;
        while i0 + 4 <= m {
            tile::<4, NR>(x, w, k, n, out, i0, j);
            i0 += 4;
        }
        match m - i0 {
            3 => tile::<3, NR>(x, w, k, n, out, i0, j),
            2 => tile::<2, NR>(x, w, k, n, out, i0, j),
            1 => tile::<1, NR>(x, w, k, n, out, i0, j),
            _ => {}
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn cols(x: *const f32, w: *const f32, m: usize, k: usize, n: usize, out: *mut f32, j0: usize, j1: usize) {
        let mut j = j0;
        while j + 2 <= j1 {
            rows::<2>(x, w, m, k, n, out, j);
            j += 2;
        }
        if j < j1 {
            rows::<1>(x, w, m, k, n, out, j);
        }
    }
}

/// `w[row0 + o, :] += scale · (B A)[o, :]`.
#[allow(clippy::too_many_arguments)]
pub fn lora_merge(w: &mut [f32], row0: usize, a: &[f32], b: &[f32], scale: f32, k: usize, r: usize, n_out: usize) {
    // Safety: extents checked by the caller.
    unsafe {
        gemm_raw(n_out, k, r, w.as_mut_ptr().add(row0 * k), k as isize, 1, true, b.as_ptr(), r as isize, 1, a.as_ptr(), k as isize, 1, scale, true);
    }
}

/// `dx[m, k] (+)= dy[m, n] · w[n, k]`.
pub fn matmul_dx(dy: &[f32], w: &[f32], m: usize, n: usize, k: usize, dx: &mut [f32], accumulate: bool) {
    assert!(dy.len() >= m * n && w.len() >= n * k && dx.len() >= m * k, "matmul_dx: buffer too small");
    // Safety: sizes checked above; dx does not alias dy or w (distinct borrows).
    unsafe {
        gemm_raw(m, k, n, dx.as_mut_ptr(), k as isize, 1, accumulate, dy.as_ptr(), n as isize, 1, w.as_ptr(), k as isize, 1, 1.0, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut o = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k).map(|t| x[i * k + t] as f64 * w[j * k + t] as f64).sum();
            }
        }
        o
    }

    #[test]
    fn small_and_large_m_match_f64() {
        let mut r = crate::util::rng::Rng::new(3);
        for &(m, k, n) in &[(1, 7, 3), (3, 64, 33), (5, 577, 130), (16, 64, 2049), (17, 100, 37), (40, 576, 200)] {
            let x: Vec<f32> = (0..m * k).map(|_| r.normal() as f32).collect();
            let w: Vec<f32> = (0..n * k).map(|_| r.normal() as f32).collect();
            let b: Vec<f32> = (0..n).map(|_| r.normal() as f32).collect();
            let mut out = vec![0f32; m * n];
            matmul(&x, &w, Some(&b), m, k, n, &mut out);
            let want = reference(&x, &w, m, k, n);
            for i in 0..m * n {
                let e = (out[i] as f64 - want[i] - b[i % n] as f64).abs();
                assert!(e < 1e-4 * (k as f64).sqrt() * 4.0, "m{m} k{k} n{n} i{i}: {} vs {}", out[i], want[i]);
            }
            let mut o2 = vec![0f32; m * n];
            matmul_serial(&x, &w, m, k, n, &mut o2);
            for i in 0..m * n {
                assert!((o2[i] + b[i % n] - out[i]).abs() < 1e-4 * (k as f32).sqrt());
            }
        }
    }
}
