//! The CPU backend's buffer: f32 values, or — under `--dtype bf16` — a frozen weight matrix
//! rounded once to bf16 and packed for the `vdpbf16ps` kernels (`cpu::bf16`). Everything else
//! (activations, the residual stream, norms, biases, the KV cache, logits, LoRA parameters,
//! gradients, optimizer moments) stays f32 in either mode: the policy of the CUDA backend, stated
//! once in docs/DESIGN.md §3.
//!
//! A packed weight is cut into row tiles when it is vocabulary-sized (`TILE_ROWS` rows each), so
//! the LM head's vocabulary-tiled passes (`logprob.rs`) take a tile as it is stored. It derefs to
//! an empty slice: code that reads a weight as f32 (the embedding gather, the training merge)
//! goes through `CpuBuf::weight` instead, and a packed buffer never reaches an op that would read
//! it as plain f32 (the routing in `cpu/mod.rs` checks).
use super::bf16::{self, PackedBf16};
use super::bf16::thin::Shadow;
use super::par::SendPtr;
use rayon::prelude::*;
use std::ops::{Deref, DerefMut};

/// Rows per packed tile of a vocabulary-sized weight (the head's GEMM tile, `logprob.rs`).
pub const TILE_ROWS: usize = 1024;
/// Matrices with at least this many rows are tiled (the embeddings / LM head).
const TILE_FROM: usize = 8192;

/// A `[n, k]` weight in bf16: row tiles `(first row, packed)`.
pub struct PackedWeight {
    pub n: usize,
    pub k: usize,
    pub tiles: Vec<(usize, PackedBf16)>,
}

impl PackedWeight {
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        let rows = if n >= TILE_FROM { TILE_ROWS } else { n.max(1) };
        let tiles = (0..n)
            .step_by(rows)
            .map(|r0| {
                let rn = rows.min(n - r0);
                (r0, PackedBf16::from_f32(&w[r0 * k..(r0 + rn) * k], rn, k))
            })
            .collect();
        PackedWeight { n, k, tiles }
    }

    pub fn bytes(&self) -> usize {
        self.tiles.iter().map(|(_, t)| t.bytes()).sum()
    }

    /// The tile holding rows `r0 .. r0 + rn` exactly, if the tiling has one.
    pub fn tile(&self, r0: usize, rn: usize) -> Option<&PackedBf16> {
        self.tiles.iter().find(|(s, t)| *s == r0 && t.n() == rn).map(|(_, t)| t)
    }

    /// Row `j` as f32 (exact: every bf16 is an f32).
    pub fn row(&self, j: usize, out: &mut [f32]) {
        let (r0, t) = self.tiles.iter().rev().find(|(s, _)| *s <= j).expect("row inside the matrix");
        for (p, o) in out[..self.k].iter_mut().enumerate() {
            *o = t.get(j - r0, p).to_f32();
        }
    }

    /// The whole matrix as `[n, k]` f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut w = Vec::with_capacity(self.n * self.k);
        for (_, t) in &self.tiles {
            w.extend(t.to_f32());
        }
        w
    }

    /// `out[m, n] = x[m, k] · Wᵀ (+ bias)`, tile by tile, each into its columns of `out`.
    pub fn matmul(&self, x: &[f32], bias: Option<&[f32]>, m: usize, out: &mut [f32]) {
        let (n, k) = (self.n, self.k);
        if self.tiles.len() == 1 {
            bf16::matmul_bf16(x, &self.tiles[0].1, bias, m, k, n, out);
            return;
        }
        // one tile per task, each on its own thread's kernel call, written straight into its
        // columns of `out` (through a scratch and a copy the head of a decode step took ~10 %
        // longer): the per-row results do not depend on the split (`cpu::bf16`'s guarantee), so
        // neither do these
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedWeight::matmul: buffer too small");
        assert!(bias.is_none_or(|b| b.len() >= n), "PackedWeight::matmul: bias shorter than {n}");
        let o = SendPtr(out.as_mut_ptr());
        self.tiles.par_iter().for_each(|(r0, t)| {
            let b = bias.map(|b| &b[*r0..*r0 + t.n()]);
            // Safety: tile rows r0..r0 + t.n() are columns of `out` no other tile writes; out
            // holds m rows of n (checked above)
            unsafe { bf16::matmul_bf16_strided(x, t, b, m, o.get().add(*r0), n, bf16::Kernel::Auto, false, &[], None) };
        });
    }

    /// The packed weight when it is one tile (the fused LoRA products take only those).
    pub fn single(&self) -> Option<&PackedBf16> {
        match &self.tiles[..] {
            [(_, t)] => Some(t),
            _ => None,
        }
    }

    /// `dx[m, k] (+)= dy[m, n] · W`.
    pub fn matmul_dx(&self, dy: &[f32], m: usize, dx: &mut [f32], accumulate: bool) {
        let (n, k) = (self.n, self.k);
        if self.tiles.len() == 1 {
            bf16::matmul_dx_bf16(dy, &self.tiles[0].1, m, n, k, dx, accumulate);
            return;
        }
        // dy's column slice of each tile, then the tiles' contributions summed in tile order
        if !accumulate {
            dx[..m * k].fill(0.0);
        }
        for (r0, t) in &self.tiles {
            let tn = t.n();
            let mut sub = vec![0f32; m * tn];
            for r in 0..m {
                sub[r * tn..(r + 1) * tn].copy_from_slice(&dy[r * n + r0..r * n + r0 + tn]);
            }
            bf16::matmul_dx_bf16(&sub, t, m, tn, k, dx, true);
        }
    }
}

/// An f32 array, or a packed bf16 weight (then the f32 array is empty).
#[derive(Default)]
pub struct CpuBuf {
    v: Vec<f32>,
    packed: Option<Box<PackedWeight>>,
    /// A LoRA parameter's bf16 operands under `--dtype bf16` (`bf16::thin::Shadow`): made on first
    /// use, dropped by any write (`deref_mut`).
    shadow: Shadow,
}

impl CpuBuf {
    pub fn packed(w: PackedWeight) -> Self {
        CpuBuf { v: Vec::new(), packed: Some(Box::new(w)), shadow: Shadow::default() }
    }
    /// The bf16 weight, when this buffer holds one.
    pub fn bf16(&self) -> Option<&PackedWeight> {
        self.packed.as_deref()
    }
    /// Elements: the f32 length, or `n·k` of a packed weight.
    pub fn elems(&self) -> usize {
        self.packed.as_ref().map_or(self.v.len(), |w| w.n * w.k)
    }
    /// This buffer's bf16 copies as a LoRA operand (`lora::Pair::with_shadows`).
    pub fn shadow(&self) -> &Shadow {
        &self.shadow
    }
    pub fn into_vec(self) -> Vec<f32> {
        match self.packed {
            Some(w) => w.to_f32(),
            None => self.v,
        }
    }
}

impl From<Vec<f32>> for CpuBuf {
    fn from(v: Vec<f32>) -> Self {
        CpuBuf { v, packed: None, shadow: Shadow::default() }
    }
}

impl Clone for CpuBuf {
    fn clone(&self) -> Self {
        match &self.packed {
            // a packed weight is frozen; a clone (tests only) holds its f32 values
            Some(w) => CpuBuf::from(w.to_f32()),
            None => CpuBuf::from(self.v.clone()),
        }
    }
}

impl std::fmt::Debug for CpuBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.packed {
            Some(w) => write!(f, "CpuBuf(bf16 [{}, {}])", w.n, w.k),
            None => write!(f, "CpuBuf({:?})", self.v),
        }
    }
}

impl PartialEq<Vec<f32>> for CpuBuf {
    fn eq(&self, other: &Vec<f32>) -> bool {
        self.packed.is_none() && &self.v == other
    }
}

impl Deref for CpuBuf {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        &self.v
    }
}

impl DerefMut for CpuBuf {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        // the values may change: the bf16 copies no longer hold
        self.shadow = Shadow::default();
        &mut self.v
    }
}

impl<'a> IntoIterator for &'a CpuBuf {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.v.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    fn randn(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.normal() as f32).collect()
    }

    /// A vocabulary-sized weight is stored in row tiles: every product through the tiles gives what
    /// one untiled packed matrix gives (the same kernel per output column), its rows read back
    /// exactly, and the head passes of `logprob.rs` agree with the f32 pass on the same values.
    #[test]
    fn tiled_weight_equals_one_packed_matrix() {
        let mut rng = Rng::new(3);
        // the tiles write into column slices of the output: a reduction of whole 16-pair steps
        // (AMX where the CPU has it) with a full 32-row strip and a short one, and one without
        for (k, m) in [(64, 37), (40, 5)] {
            let n = TILE_FROM + 300;
            let w = randn(&mut rng, n * k);
            let tiled = PackedWeight::from_f32(&w, n, k);
            let whole = PackedBf16::from_f32(&w, n, k);
            let x = randn(&mut rng, m * k);
            let bias = randn(&mut rng, n);
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
            tiled.matmul(&x, Some(&bias), m, &mut a);
            bf16::matmul_bf16(&x, &whole, Some(&bias), m, k, n, &mut b);
            assert_eq!(a, b, "tiled product, k {k}, m {m}");
            tiled.matmul(&x, None, m, &mut a);
            bf16::matmul_bf16(&x, &whole, None, m, k, n, &mut b);
            assert_eq!(a, b, "tiled product without bias, k {k}, m {m}");
        }
        let (n, k, m) = (TILE_FROM + 300, 40, 5);
        let w = randn(&mut rng, n * k);
        let tiled = PackedWeight::from_f32(&w, n, k);
        assert_eq!(tiled.tiles.len(), n.div_ceil(TILE_ROWS));
        let whole = PackedBf16::from_f32(&w, n, k);
        let dy = randn(&mut rng, m * n);
        let (mut da, mut db) = (vec![1f32; m * k], vec![1f32; m * k]);
        tiled.matmul_dx(&dy, m, &mut da, true);
        bf16::matmul_dx_bf16(&dy, &whole, m, n, k, &mut db, true);
        for (p, q) in da.iter().zip(&db) {
            // the tiles' partial sums are added in tile order: f32 rounding only
            assert!((p - q).abs() <= 1e-4 * (1.0 + q.abs()), "{p} vs {q}");
        }
        let deq = tiled.to_f32();
        assert_eq!(deq, whole.to_f32());
        let mut row = vec![0f32; k];
        for j in [0, TILE_ROWS - 1, TILE_ROWS, n - 1] {
            tiled.row(j, &mut row);
            assert_eq!(&row[..], &deq[j * k..(j + 1) * k]);
        }
        // the head passes: bf16 tiles vs the dequantized f32 head (inputs rounded to bf16 in the
        // kernel only: within bf16's rounding of h)
        let targets = [0u32, (n - 1) as u32, TILE_ROWS as u32, 77, 5000];
        let h = randn(&mut rng, targets.len() * k);
        let lp_b = super::super::logprob::logprobs(&h, &tiled, &targets, k, n);
        let lp_f = super::super::logprob::logprobs(&h, deq.as_slice(), &targets, k, n);
        let (mut g_b, mut g_f) = (vec![0f32; h.len()], vec![0f32; h.len()]);
        let hb = super::super::logprob::head_grad(&h, &tiled, &targets, k, n, &mut g_b);
        let hf = super::super::logprob::head_grad(&h, deq.as_slice(), &targets, k, n, &mut g_f);
        for r in 0..targets.len() {
            assert!((lp_b[r] - lp_f[r]).abs() < 0.1, "logprob {r}: {} vs {}", lp_b[r], lp_f[r]);
            assert!((hb.logprobs[r] - lp_f[r]).abs() < 0.1, "head_grad logprob {r}");
            assert!((hb.entropy[r] - hf.entropy[r]).abs() < 0.1, "entropy {r}");
        }
        let rel = (g_b.iter().zip(&g_f).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / g_f.iter().map(|b| (*b as f64).powi(2)).sum::<f64>()).sqrt();
        assert!(rel < 2e-2, "head gradient relative error {rel}");
    }
}
