//! cuBLASLt's matmul as the emulated device computes it: `D = alpha·op(A)·op(B) + beta·C` on the
//! column-major layouts `gemm::describe` builds (A = w, B = x, C = D = y), bf16 inputs, f32
//! accumulation (CUBLAS_COMPUTE_32F), D in f32 or bf16 — exactly the one matmul the backend
//! requests (no batch, no bias/activation epilogue: the bias is a kernel of its own; `beta = 1`
//! accumulates into C). Reading the operands through the layouts, not through the row-major
//! shapes, is what checks the backend's row-major → column-major mapping end to end.
//!
//! **Summation model.** Each output is `acc = Σ_l op(A)(i, l)·op(B)(l, j)` summed in f32 in
//! ascending `l`, one rounding per addition (a bf16·bf16 product has at most 16 significant bits,
//! so it is exact in f32); then `alpha·acc` and, when `beta ≠ 0`, `+ beta·C`, each rounded to
//! f32; a bf16 D is rounded to nearest even once at the end. cuBLASLt sums in an order of its own
//! choosing (tensor-core tiles, split-K); for ANY order the f32 sum differs from the exact one by
//! at most `γ_{k−1}·Σ_l |a_l·b_l|`, `γ_n = n·u/(1 − n·u)`, `u = 2⁻²⁴` (Higham, *Accuracy and
//! Stability of Numerical Algorithms*, §3.1), so the emulation and the GPU each sit within that
//! bound of the exact product and within twice it of each other. [`f32_sum_bound`] is it.
//!
//! What this emulation does not implement it refuses (never computes something else): operands
//! whose layouts do not compose, pointers not aligned to their element, and an output that
//! overlaps an input (undefined in cuBLASLt).
use super::gemm::{GemmArgs, Layout, LtDesc};
use anyhow::{bail, Result};
use half::bf16;

/// `γ_{k−1}·Σ|a_l·b_l|`: the worst difference between any f32 summation order of a length-`k`
/// dot product and its exact value, given `Σ|a_l·b_l|` (see the module doc).
pub fn f32_sum_bound(k: usize, abs_sum: f64) -> f64 {
    let nu = k.saturating_sub(1) as f64 * f32::EPSILON as f64 / 2.0;
    nu / (1.0 - nu) * abs_sum
}

/// Elements an operand of layout `l` spans from its pointer: `(cols − 1)·ld + rows`.
pub fn span(l: &Layout) -> usize {
    (l.cols - 1) * l.ld + l.rows
}

/// Refuse what the emulation does not compute: `d` must compose (op(A) rows × inner, op(B)
/// inner × cols, C rows × cols, each ld ≥ its rows), every pointer aligned to its element and
/// non-null, and D's bytes disjoint from A's and B's.
pub fn check(g: &GemmArgs, d: &LtDesc) -> Result<()> {
    let (a_rows, a_inner) = if d.trans_a { (d.a.cols, d.a.rows) } else { (d.a.rows, d.a.cols) };
    let (b_inner, b_cols) = if d.trans_b { (d.b.cols, d.b.rows) } else { (d.b.rows, d.b.cols) };
    if a_rows != d.c.rows || b_cols != d.c.cols || a_inner != b_inner || a_inner == 0 {
        bail!("emulated cuBLASLt: op(A) {a_rows}×{a_inner}, op(B) {b_inner}×{b_cols} and D {}×{} do not compose ({d:?})", d.c.rows, d.c.cols);
    }
    for (name, l) in [("A (w)", d.a), ("B (x)", d.b), ("C/D (y)", d.c)] {
        if l.ld < l.rows || l.rows == 0 || l.cols == 0 {
            bail!("emulated cuBLASLt: layout {name} {}×{} with leading dimension {} is not a column-major matrix", l.rows, l.cols, l.ld);
        }
    }
    let esz = if g.y_bf16 { 2 } else { 4 };
    for (name, p, al) in [("A (w)", g.w, 2u64), ("B (x)", g.x, 2), ("C/D (y)", g.y, esz)] {
        if p == 0 || !p.is_multiple_of(al) {
            bail!("emulated cuBLASLt: operand {name} at 0x{p:x} is not a non-null pointer aligned to its {al}-byte element");
        }
    }
    let bytes = |p: u64, l: &Layout, e: u64| p..p + span(l) as u64 * e;
    let out = bytes(g.y, &d.c, esz);
    for (name, r) in [("A (w)", bytes(g.w, &d.a, 2)), ("B (x)", bytes(g.x, &d.b, 2))] {
        if r.start < out.end && out.start < r.end {
            bail!("emulated cuBLASLt: output D overlaps input {name} (in-place matmul is undefined in cuBLASLt)");
        }
    }
    if !g.alpha.is_finite() || !g.beta.is_finite() {
        bail!("emulated cuBLASLt: alpha {} / beta {} must be finite", g.alpha, g.beta);
    }
    Ok(())
}

fn bf16_at(d: &[u8], i: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([d[2 * i], d[2 * i + 1]])).to_f32()
}

/// Compute D in place: `a`, `b` are the bytes of A and B from their pointers (at least `span`
/// elements, bf16), `c` those of C/D (f32, or bf16 when `g.y_bf16`). `check` must have passed.
pub fn run(g: &GemmArgs, d: &LtDesc, a: &[u8], b: &[u8], c: &mut [u8]) {
    let (rows, cols) = (d.c.rows, d.c.cols);
    let inner = if d.trans_a { d.a.rows } else { d.a.cols };
    // op(A) as rows × inner and op(B)ᵀ as cols × inner, contiguous (bf16 is exact in f32)
    let mut opa = vec![0f32; rows * inner];
    for i in 0..rows {
        for l in 0..inner {
            opa[i * inner + l] = if d.trans_a { bf16_at(a, l + i * d.a.ld) } else { bf16_at(a, i + l * d.a.ld) };
        }
    }
    let mut opbt = vec![0f32; cols * inner];
    for j in 0..cols {
        for l in 0..inner {
            opbt[j * inner + l] = if d.trans_b { bf16_at(b, j + l * d.b.ld) } else { bf16_at(b, l + j * d.b.ld) };
        }
    }
    // the f32 sums in ascending l (the module's model), columns of D in parallel
    let acc: Vec<f32> = {
        use rayon::prelude::*;
        (0..cols)
            .into_par_iter()
            .flat_map_iter(|j| {
                let bj = &opbt[j * inner..(j + 1) * inner];
                let opa = &opa;
                (0..rows).map(move |i| opa[i * inner..(i + 1) * inner].iter().zip(bj).fold(0f32, |s, (&x, &y)| s + x * y))
            })
            .collect()
    };
    let esz = if g.y_bf16 { 2 } else { 4 };
    for j in 0..cols {
        for i in 0..rows {
            let o = (i + j * d.c.ld) * esz;
            let mut v = g.alpha * acc[j * rows + i];
            // beta = 0: C is not read (cuBLASLt's rule; it may hold anything, NaN included)
            if g.beta != 0.0 {
                let old = if g.y_bf16 { bf16_at(c, o / 2) } else { f32::from_le_bytes(c[o..o + 4].try_into().unwrap()) };
                v += g.beta * old;
            }
            if g.y_bf16 {
                c[o..o + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
            } else {
                c[o..o + 4].copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gemm::describe;
    use super::*;
    use crate::util::rng::Rng;

    /// One case in row-major terms, the way the backend thinks of it: `y[i, col0 + j] =
    /// alpha·Σ_l X(i, l)·W(j, l) + beta·y` with X = x or xᵀ, W = w or wᵀ as stored.
    struct Case {
        m: usize,
        n: usize,
        k: usize,
        xt: bool,
        wt: bool,
        y_bf16: bool,
        alpha: f32,
        beta: f32,
    }

    fn bits(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes()).collect()
    }

    /// Runs `c` through `describe` + `run` on buffers with padded leading dimensions and an output
    /// column slice (as the LoRA delta writes), and checks every element of the output rows —
    /// inside the slice against two references computed here from the row-major shapes (never
    /// from the layouts): the same f32 summation order, bit for bit, and the exact f64 product
    /// within `f32_sum_bound` (+ the epilogue's and bf16 output's roundings); outside the slice
    /// untouched.
    fn case(c: &Case, rng: &mut Rng) {
        let Case { m, n, k, xt, wt, y_bf16, alpha, beta } = *c;
        let (ldx, ldw, col0) = ((if xt { m } else { k }) + 3, (if wt { n } else { k }) + 1, 2);
        let ldy = col0 + n + 5;
        let mut r = |len: usize| (0..len).map(|_| half::bf16::from_f32(rng.normal() as f32).to_f32()).collect::<Vec<f32>>();
        let (x, w, y0) = (r(if xt { k } else { m } * ldx), r(if wt { k } else { n } * ldw), r(m * ldy));
        let (xb, wb) = (bits(&x), bits(&w));
        let esz = if y_bf16 { 2 } else { 4 };
        let mut yb: Vec<u8> = if y_bf16 { bits(&y0) } else { y0.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let d = describe(m, n, k, ldx, ldw, ldy, xt, wt).unwrap();
        // pointers as the device would have them: y's points at column col0 of row 0
        let g = GemmArgs { m, n, k, x: 0x1000, ldx, w: 0x100000, ldw, y: 0x200000 + (col0 * esz) as u64, ldy, y_bf16, alpha, beta, xt, wt };
        check(&g, &d).unwrap();
        run(&g, &d, &wb, &xb, &mut yb[col0 * esz..]);
        let read = |buf: &[u8], e: usize| if y_bf16 { bf16_at(buf, e) } else { f32::from_le_bytes(buf[4 * e..4 * e + 4].try_into().unwrap()) };
        let what = format!("m{m} n{n} k{k} x{} w{} y {} alpha {alpha} beta {beta}", if xt { "ᵀ" } else { "" }, if wt { "ᵀ" } else { "" }, if y_bf16 { "bf16" } else { "f32" });
        for i in 0..m {
            for jj in 0..ldy {
                let got = read(&yb, i * ldy + jj);
                let old = if y_bf16 { half::bf16::from_f32(y0[i * ldy + jj]).to_f32() } else { y0[i * ldy + jj] };
                if !(col0..col0 + n).contains(&jj) {
                    assert_eq!(got.to_bits(), old.to_bits(), "{what}: ({i}, {jj}) outside the output slice changed");
                    continue;
                }
                let j = jj - col0;
                let xv = |l: usize| if xt { x[l * ldx + i] } else { x[i * ldx + l] };
                let wv = |l: usize| if wt { w[l * ldw + j] } else { w[j * ldw + l] };
                // the model, bit for bit: ascending-l f32 sum, then the f32 epilogue
                let mut s = 0f32;
                for l in 0..k {
                    s += xv(l) * wv(l);
                }
                let mut v = alpha * s;
                if beta != 0.0 {
                    v += beta * old;
                }
                let model = if y_bf16 { half::bf16::from_f32(v).to_f32() } else { v };
                assert_eq!(got.to_bits(), model.to_bits(), "{what}: ({i}, {j}): {got} vs the f32 model's {model}");
                // the exact product: within the summation bound, the two epilogue roundings
                // (u each on |alpha·s|, |beta·C| and the
                // result) and, for a bf16 D, its rounding (bf16's unit roundoff 2⁻⁸, relative)
                let (exact, abs): (f64, f64) = (0..k).map(|l| (xv(l) as f64 * wv(l) as f64, (xv(l) as f64 * wv(l) as f64).abs())).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
                let want = alpha as f64 * exact + beta as f64 * old as f64;
                let u = f32::EPSILON as f64 / 2.0;
                let mut bound = alpha.abs() as f64 * f32_sum_bound(k, abs) + u * (alpha.abs() as f64 * abs + 2.0 * want.abs() + (beta * old).abs() as f64);
                if y_bf16 {
                    bound += want.abs() / 256.0 + bound / 256.0;
                }
                assert!((got as f64 - want).abs() <= bound, "{what}: ({i}, {j}): {got} vs exact {want} (bound {bound:.3e})");
            }
        }
    }

    /// Every combination the backend requests (gemm.rs): the plain forward (x·Wᵀ, f32 out),
    /// LoRA's x·Aᵀ into bf16 and `+= scale·(·)Bᵀ` into a column slice (beta 1, f32 or bf16),
    /// matmul_dx's dy·W (wt, beta 0 or 1), lora_bwd's dyᵀ·u (xt + wt, alpha scale, beta 1) and
    /// du = scale·dy·B (wt into bf16) — on small odd shapes, k from 1 to past a few hundred.
    #[test]
    fn every_requested_combination_matches_independent_references() {
        let mut rng = Rng::new(54);
        let shapes = [(1usize, 1usize, 1usize), (3, 5, 7), (7, 3, 1), (5, 9, 33), (2, 4, 301)];
        let mut n = 0;
        for &(m, nn, k) in &shapes {
            for (xt, wt) in [(false, false), (false, true), (true, true), (true, false)] {
                for y_bf16 in [false, true] {
                    for (alpha, beta) in [(1.0f32, 0.0f32), (0.375, 1.0), (1.0, 1.0), (-2.5, 0.5)] {
                        case(&Case { m, n: nn, k, xt, wt, y_bf16, alpha, beta }, &mut rng);
                        n += 1;
                    }
                }
            }
        }
        assert_eq!(n, shapes.len() * 4 * 2 * 4);
    }

    /// beta = 0 never reads C: a NaN there does not reach D.
    #[test]
    fn beta_zero_ignores_c() {
        let d = describe(1, 1, 2, 2, 2, 1, false, false).unwrap();
        let g = GemmArgs { m: 1, n: 1, k: 2, x: 0x10, ldx: 2, w: 0x20, ldw: 2, y: 0x40, ldy: 1, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false };
        let mut c = f32::NAN.to_le_bytes().to_vec();
        run(&g, &d, &bits(&[1.0, 2.0]), &bits(&[3.0, 4.0]), &mut c);
        assert_eq!(f32::from_le_bytes(c[..4].try_into().unwrap()), 11.0);
    }

    /// The ascending f32 order is what `run` does: 2²⁴ + 1 + 1 in f32 loses both ones one by one
    /// (each addition rounds back to 2²⁴), where the exact sum is 2²⁴ + 2.
    #[test]
    fn summation_is_ascending_f32() {
        let d = describe(1, 1, 3, 3, 3, 1, false, false).unwrap();
        let g = GemmArgs { m: 1, n: 1, k: 3, x: 0x10, ldx: 3, w: 0x20, ldw: 3, y: 0x40, ldy: 1, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false };
        let mut c = vec![0u8; 4];
        run(&g, &d, &bits(&[16777216.0, 1.0, 1.0]), &bits(&[1.0, 1.0, 1.0]), &mut c);
        assert_eq!(f32::from_le_bytes(c[..4].try_into().unwrap()), 16777216.0);
        assert!(f32_sum_bound(3, 16777218.0) >= 2.0);
    }

    #[test]
    fn what_is_not_implemented_is_refused() {
        let base = GemmArgs { m: 2, n: 3, k: 4, x: 0x1000, ldx: 4, w: 0x2000, ldw: 4, y: 0x3000, ldy: 3, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false };
        let d = describe(2, 3, 4, 4, 4, 3, false, false).unwrap();
        check(&base, &d).unwrap();
        let err = |g: GemmArgs, d: &LtDesc| check(&g, d).unwrap_err().to_string();
        assert!(err(GemmArgs { x: 0x1001, ..base }, &d).contains("aligned"));
        assert!(err(GemmArgs { y: 0x3002, ..base }, &d).contains("4-byte"));
        assert!(err(GemmArgs { w: 0, ..base }, &d).contains("non-null"));
        // D's 2·3 f32 over the first bytes of x
        assert!(err(GemmArgs { y: 0x1004, ..base }, &d).contains("overlaps input B"));
        assert!(err(GemmArgs { alpha: f32::NAN, ..base }, &d).contains("finite"));
        let mut bad = d;
        bad.c.rows = 4;
        assert!(err(GemmArgs { ..base }, &bad).contains("do not compose"));
        let mut bad = d;
        bad.a.ld = 1;
        assert!(err(GemmArgs { ..base }, &bad).contains("leading dimension"));
    }
}
