//! Lane-by-lane port of `attention_impl<HD, TQ>` and `attn_combine` (kernels/attention.cu),
//! built on the primitives of `backend::cuda::emulate`: per work item one block of 4 warps ×
//! 32 lanes of registers (Q A-fragments, O accumulators, per-thread m and partial l), the
//! two shared-memory stages `sk[2][BK][HDP]`, `sv[2][BK][HDP]` as one flat array in
//! declaration order written only by cp.async with the kernel's commit/wait/barrier order
//! (`AsyncSmem`: a copy read before its covering wait, another thread's copy read before a
//! barrier, or a copy into a stage read in the same barrier interval panics), the paged pool
//! addresses of `load_tile`, the kernel's operation order in f32 and bf16 rounding exactly
//! where it rounds (Q when TQ = f32, P in the C→A repack, the output; K/V are bf16 in the
//! pool). The outputs and split workspace are `Gmem`: written once each, combine reading only
//! what some item wrote. Not modelled: see `backend::cuda::emulate`.
//!
//! This replaces a per-row scalar port: that one shared the kernel's tiling and softmax but
//! none of its fragments, shared-memory offsets or stage order, and the CPU twin is already
//! the scalar reference the tests compare with.
#![allow(clippy::needless_range_loop)] // loops index registers and fragments as the kernel does
use crate::backend::cuda::attention::*;
use crate::backend::{AttnGeom, AttnSeq};
use super::{bf, c_to_a, mma, online_softmax_tile, quad_reduce, AFrag, AsyncSmem, BFrag, CFrag, Gmem};

/// `ATTN_THREADS`.
const THREADS: usize = 128;
/// Block size mod.rs launches attn_combine with (threads stride over head_dim, so any works).
const COMBINE_THREADS: usize = 64;

/// The kernel's `TQ`: the qkv buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tq {
    /// `_f32`: q is rounded to bf16 as it is packed into fragments.
    F32,
    /// `_bf16`: the buffer holds bf16 values (asserted), loaded raw.
    Bf16,
}

/// The device pool layout: [page][layer][k|v][kv_head][page_size][head_dim].
pub fn pool_off(g: &AttnGeom, page: usize, layer: usize, which: usize, h: usize, slot: usize) -> usize {
    ((((page * g.n_layers + layer) * 2 + which) * g.n_kv_heads + h) * g.page_size + slot) * g.head_dim
}

/// kv_store_impl (kernels/memory.cu): k, v of each row to its slot, rounded to bf16.
pub fn kv_store(pool: &mut [f32], g: &AttnGeom, layer: usize, qkv: &[f32], slots: &[u32]) {
    let (q_dim, kv_dim, width) = (g.q_dim(), g.kv_dim(), g.qkv_dim());
    for (row, &slot) in slots.iter().enumerate() {
        let (page, s) = (slot as usize / g.page_size, slot as usize % g.page_size);
        for e in 0..2 * kv_dim {
            let which = e / kv_dim;
            let rem = e % kv_dim;
            let (h, d) = (rem / g.head_dim, rem % g.head_dim);
            pool[pool_off(g, page, layer, which, h, s) + d] = bf(qkv[row * width + q_dim + e]);
        }
    }
}

/// A non-negative `int` of the kernel as an index (a negative one is an emulated fault).
fn ix(x: i64) -> usize {
    usize::try_from(x).unwrap_or_else(|_| panic!("negative index {x}"))
}

/// One thread's packed rows `ra`, `rb = ra + 8` and what the kernel derives from them.
#[derive(Clone, Copy)]
struct Rows {
    ra: i64,
    rb: i64,
    va: bool,
    vb: bool,
    qia: i64,
    ha: i64,
    qib: i64,
    hb: i64,
    pos_a: i64,
    pos_b: i64,
}

/// The `attention_hd{hd}_{f32|bf16}` launch over every item of `plan`, then `attn_combine`
/// when the plan has split rows. `pool` holds the bf16 values of the device pool (NaN where
/// never stored), `qkv` the batch's rows. Writes the elements of `out` the kernels write.
pub fn attention(pool: &[f32], g: &AttnGeom, layer: usize, qkv: &[f32], tq: Tq, plan: &AttnPlan, out: &mut [f32]) {
    let mut o = Gmem::new(out.len());
    let mut part_o = Gmem::new(plan.part_slots * g.head_dim);
    let mut part_ml = Gmem::new(plan.part_slots * 2);
    for it in &plan.items {
        block(pool, g, layer, qkv, tq, plan, it, &mut o, &mut part_o, &mut part_ml);
    }
    // the combine launch follows in stream order: it sees every write of the first
    for e in &plan.combine {
        combine(g, plan, *e, &part_o, &part_ml, &mut o);
    }
    for (i, x) in out.iter_mut().enumerate() {
        if o.written(i) {
            *x = o.v[i];
        }
    }
}

/// One block of attention_impl<HD, TQ>: work item `it`.
#[allow(clippy::too_many_arguments)]
fn block(pool: &[f32], g: &AttnGeom, layer: usize, qkv: &[f32], tq: Tq, plan: &AttnPlan, it: &AttnItem, out: &mut Gmem, part_o: &mut Gmem, part_ml: &mut Gmem) {
    let hd = g.head_dim;
    let bk = if hd <= 64 { 64 } else { 32 };
    let (hdp, ch) = (hd + 8, hd / 8);
    let (nt_n, dt_n, kq) = (bk / 8, hd / 8, hd / 16);
    let (width, q_dim, group) = (g.qkv_dim(), g.q_dim(), (g.n_heads / g.n_kv_heads) as i64);
    let ps = g.page_size as i64;
    let scale_log2 = (1.0 / (hd as f32).sqrt()) * std::f32::consts::LOG2_E; // as the host passes it
    // __shared__ bf16 sk[2][BK][HDP], sv[2][BK][HDP]
    let (sk, sv) = (0usize, 2 * bk * hdp);
    let mut sm = AsyncSmem::new(4 * bk * hdp, THREADS);

    let s = plan.seqs[ix(it.seq as i64)];
    let kvh = it.kvh as i64;
    let n_rows = s.n_q as i64 * group;
    let r0 = it.tile as i64 * BM as i64;
    let first_pos = (s.ctx_len - s.n_q) as i64;
    let r_last = (r0 + BM as i64).min(n_rows) - 1;
    let kend = first_pos + r_last / group + 1;
    let k_begin = it.split as i64 * s.split_len as i64;
    let k_stop = kend.min(k_begin + s.split_len as i64);

    let rows: [[Rows; 32]; 4] = std::array::from_fn(|warp| {
        std::array::from_fn(|lane| {
            let ra = r0 + warp as i64 * 16 + (lane / 4) as i64;
            let rb = ra + 8;
            let (va, vb) = (ra < n_rows, rb < n_rows);
            let (qia, qib) = (if va { ra / group } else { 0 }, if vb { rb / group } else { 0 });
            Rows {
                ra,
                rb,
                va,
                vb,
                qia,
                ha: if va { ra - qia * group } else { 0 },
                qib,
                hb: if vb { rb - qib * group } else { 0 },
                pos_a: if va { first_pos + qia } else { -1 }, // a padding row sees no key
                pos_b: if vb { first_pos + qib } else { -1 },
            }
        })
    });
    let warp_active: [bool; 4] = std::array::from_fn(|w| r0 + w as i64 * 16 < n_rows);

    // qf[kk]: load_q2 of the thread's rows (nullptr → 0 for a padding row)
    let q_row = |v: bool, qi: i64, h: i64| v.then(|| ix((s.q_row as i64 + qi) * width as i64 + (kvh * group + h) * hd as i64));
    let load_q2 = |row: Option<usize>, c: usize| -> [f32; 2] {
        let Some(p) = row else { return [0.0, 0.0] };
        let v = [qkv[p + c], qkv[p + c + 1]];
        match tq {
            Tq::F32 => v.map(bf), // pack_bf16x2
            Tq::Bf16 => {
                assert!(v.iter().all(|&x| bf(x) == x), "a bf16 qkv buffer holds bf16 values");
                v
            }
        }
    };
    let qf: Vec<Vec<[AFrag; 32]>> = (0..4)
        .map(|w| {
            (0..kq)
                .map(|kk| {
                    std::array::from_fn(|lane| {
                        let r = &rows[w][lane];
                        let (qa, qb) = (q_row(r.va, r.qia, r.ha), q_row(r.vb, r.qib, r.hb));
                        let c = kk * 16 + 2 * (lane % 4);
                        [load_q2(qa, c), load_q2(qb, c), load_q2(qa, c + 8), load_q2(qb, c + 8)]
                    })
                })
                .collect()
        })
        .collect();
    let mut o: Vec<Vec<[CFrag; 32]>> = vec![vec![[[0f32; 4]; 32]; dt_n]; 4];
    let (mut m_a, mut m_b) = ([[f32::NEG_INFINITY; 32]; 4], [[f32::NEG_INFINITY; 32]; 4]);
    let (mut l_a, mut l_b) = ([[0f32; 32]; 4], [[0f32; 32]; 4]);

    let head_stride = g.page_size * hd; // one (layer, k|v, head) run of a page
    let load_tile = |sm: &mut AsyncSmem, stage: usize, kt0: i64| {
        for tid in 0..THREADS {
            let mut idx = tid;
            while idx < 2 * bk * ch {
                let which = idx / (bk * ch); // 0 = K, 1 = V
                let rem = idx - which * (bk * ch);
                let (j, c) = (rem / ch, rem % ch);
                let key = kt0 + j as i64;
                let dst = if which == 1 { sv } else { sk } + (stage * bk + j) * hdp + c * 8;
                let src = (key < k_stop).then(|| {
                    let page = plan.pages[ix(s.page_off as i64 + key / ps)] as usize;
                    let slot = ix(key % ps);
                    (((page * g.n_layers + layer) * 2 + which) * g.n_kv_heads + ix(kvh)) * head_stride + slot * hd + c * 8
                });
                sm.cp_async16(tid, dst, pool, src);
                idx += THREADS;
            }
            sm.commit(tid);
        }
    };
    let wait_all = |sm: &mut AsyncSmem, n: usize| (0..THREADS).for_each(|tid| sm.wait_group(tid, n));

    let n_tiles = if k_stop > k_begin { ix((k_stop - k_begin + bk as i64 - 1) / bk as i64) } else { 0 };
    if n_tiles > 0 {
        load_tile(&mut sm, 0, k_begin);
    }
    for t in 0..n_tiles {
        let st = t & 1;
        if t + 1 < n_tiles {
            load_tile(&mut sm, st ^ 1, k_begin + ((t + 1) * bk) as i64);
            wait_all(&mut sm, 1);
        } else {
            wait_all(&mut sm, 0);
        }
        sm.barrier();
        for w in 0..4 {
            if !warp_active[w] {
                continue;
            }
            let kt0 = k_begin + (t * bk) as i64;
            let mut sc: Vec<[CFrag; 32]> = vec![[[0f32; 4]; 32]; nt_n];
            for (kk, qfk) in qf[w].iter().enumerate() {
                for (nt, s_nt) in sc.iter_mut().enumerate() {
                    // kr = &sk[st][nt·8 + gid][kk·16 + 2tq]; b0 = *kr, b1 = *(kr + 8)
                    let b: [BFrag; 32] = std::array::from_fn(|lane| {
                        let kr = sk + (st * bk + nt * 8 + lane / 4) * hdp + kk * 16 + 2 * (lane % 4);
                        [sm.ld2(32 * w + lane, kr), sm.ld2(32 * w + lane, kr + 8)]
                    });
                    mma(s_nt, qfk, &b);
                }
            }
            // causal, and the item's key range
            online_softmax_tile(&mut sc, &mut o[w], &mut m_a[w], &mut m_b[w], &mut l_a[w], &mut l_b[w], kt0, scale_log2, |lane| (rows[w][lane].pos_a, rows[w][lane].pos_b), |key, pos| key >= k_stop || key > pos);
            for j in 0..bk / 16 {
                let pa: [AFrag; 32] = std::array::from_fn(|lane| c_to_a(&sc[2 * j][lane], &sc[2 * j + 1][lane]));
                for (dt, od) in o[w].iter_mut().enumerate() {
                    // vc = &sv[st][j·16 + 2tq][dt·8 + gid]; {vc[0], vc[HDP]}, {vc[8·HDP], vc[9·HDP]}
                    let b: [BFrag; 32] = std::array::from_fn(|lane| sm.b_rows(32 * w + lane, sv + (st * bk + j * 16 + 2 * (lane % 4)) * hdp + dt * 8 + lane / 4, hdp));
                    mma(od, &pa, &b);
                }
            }
        }
        sm.barrier(); // stage st is overwritten by the load issued in the next iteration
    }

    for w in 0..4 {
        // the shuffles run in every warp, before the inactive ones return
        quad_reduce(&mut l_a[w], |x, y| x + y);
        quad_reduce(&mut l_b[w], |x, y| x + y);
    }
    for w in (0..4).filter(|&w| warp_active[w]) {
        for lane in 0..32 {
            let (r, tq2) = (&rows[w][lane], 2 * (lane % 4));
            for (v, row, qi, h, m, l, e0) in [(r.va, r.ra, r.qia, r.ha, m_a[w][lane], l_a[w][lane], 0), (r.vb, r.rb, r.qib, r.hb, m_b[w][lane], l_b[w][lane], 2)] {
                if !v {
                    continue;
                }
                if s.n_splits == 1 {
                    let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
                    let orow = ix((s.q_row as i64 + qi) * q_dim as i64 + (kvh * group + h) * hd as i64);
                    for dt in 0..dt_n {
                        out.store(orow + dt * 8 + tq2, bf(o[w][dt][lane][e0] * inv));
                        out.store(orow + dt * 8 + tq2 + 1, bf(o[w][dt][lane][e0 + 1] * inv));
                    }
                } else {
                    // workspace slot of (kv head, packed row, split)
                    let slot = ix(s.part_base as i64 + (kvh * n_rows + row) * s.n_splits as i64 + it.split as i64);
                    for dt in 0..dt_n {
                        part_o.store(slot * hd + dt * 8 + tq2, o[w][dt][lane][e0]);
                        part_o.store(slot * hd + dt * 8 + tq2 + 1, o[w][dt][lane][e0 + 1]);
                    }
                    if tq2 == 0 {
                        part_ml.store(slot * 2, m);
                        part_ml.store(slot * 2 + 1, l);
                    }
                }
            }
        }
    }
    sm.exit();
}

/// One block of attn_combine: workspace entry `e` = (sequence, kv_head · n_rows + row).
fn combine(g: &AttnGeom, plan: &AttnPlan, e: [i32; 2], part_o: &Gmem, part_ml: &Gmem, out: &mut Gmem) {
    let (hd, q_dim, group) = (g.head_dim, g.q_dim() as i64, (g.n_heads / g.n_kv_heads) as i64);
    let s = plan.seqs[ix(e[0] as i64)];
    let n_rows = s.n_q as i64 * group;
    let y = e[1] as i64;
    let (kvh, r) = (y / n_rows, y % n_rows);
    let (qi, h) = (r / group, r % group);
    let base = ix(s.part_base as i64 + y * s.n_splits as i64);
    let ns = ix(s.n_splits as i64);
    for tid in 0..COMBINE_THREADS {
        let mut mx = f32::NEG_INFINITY;
        for sp in 0..ns {
            mx = mx.max(part_ml.load((base + sp) * 2));
        }
        let mut l = 0f32;
        for sp in 0..ns {
            let ms = part_ml.load((base + sp) * 2);
            if ms != f32::NEG_INFINITY {
                l += part_ml.load((base + sp) * 2 + 1) * (ms - mx).exp2();
            }
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        let orow = ix((s.q_row as i64 + qi) * q_dim + (kvh * group + h) * hd as i64);
        let mut d = tid;
        while d < hd {
            let mut acc = 0f32;
            for sp in 0..ns {
                let ms = part_ml.load((base + sp) * 2);
                if ms != f32::NEG_INFINITY {
                    acc += part_o.load((base + sp) * hd + d) * (ms - mx).exp2();
                }
            }
            out.store(orow + d, bf(acc * inv));
            d += COMBINE_THREADS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuBuf};
    use crate::backend::Backend;
    use crate::util::rng::Rng;

    fn geom(n_heads: usize, n_kv: usize, hd: usize) -> AttnGeom {
        AttnGeom { n_layers: 2, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: 16 }
    }

    /// Every (sequence, kv head, packed row) sees each key 0..=pos in exactly one item, and the
    /// workspace slots of split rows are distinct and in range.
    #[test]
    fn items_cover_each_visible_key_once() {
        let g = geom(14, 2, 64);
        let group = 7;
        let pages: Vec<u32> = (0..400).collect();
        let shapes = [(1usize, 1usize), (1, 700), (1, 5000), (5, 9), (37, 37), (100, 1300), (1, 129), (3, 2000)];
        let mut rows = 0;
        let seqs: Vec<AttnSeq> = shapes
            .iter()
            .map(|&(n_q, ctx)| {
                let s = AttnSeq { q_row: rows, n_q, ctx_len: ctx, pages: &pages, sampled: false };
                rows += n_q;
                s
            })
            .collect();
        for n_sm in [1, 132] {
            let p = plan(&seqs, &g, 400, rows, n_sm).unwrap();
            let mut seen = std::collections::HashMap::new();
            let mut slots = std::collections::HashSet::new();
            for it in &p.items {
                let s = p.seqs[it.seq as usize];
                let n_rows = s.n_q as usize * group;
                let kend = tile_kend(&s, group, it.tile as usize);
                let k0 = it.split as usize * s.split_len as usize;
                let k1 = kend.min(k0 + s.split_len as usize);
                for r in it.tile as usize * BM..((it.tile as usize + 1) * BM).min(n_rows) {
                    let pos = (s.ctx_len - s.n_q) as usize + r / group;
                    for key in k0..k1.min(pos + 1) {
                        *seen.entry((it.seq, it.kvh, r, key)).or_insert(0) += 1;
                    }
                    if s.n_splits > 1 {
                        let slot = s.part_base as usize + (it.kvh as usize * n_rows + r) * s.n_splits as usize + it.split as usize;
                        assert!(slot < p.part_slots && slots.insert(slot));
                    }
                }
            }
            let mut want = 0;
            for (si, s) in p.seqs.iter().enumerate() {
                for kvh in 0..2 {
                    for r in 0..s.n_q as usize * group {
                        let pos = (s.ctx_len - s.n_q) as usize + r / group;
                        for key in 0..=pos {
                            assert_eq!(seen.get(&(si as i32, kvh, r, key)), Some(&1), "seq {si} kvh {kvh} row {r} key {key}");
                            want += 1;
                        }
                    }
                }
            }
            assert_eq!(seen.len(), want);
            assert_eq!(slots.len(), p.part_slots);
            if n_sm == 132 {
                assert!(p.seqs.iter().any(|s| s.n_splits > 1), "long decode rows are split");
                assert!(p.seqs.iter().all(|s| s.n_splits == 1 || s.n_q == 1));
            }
        }
    }

    /// CPU twin, emulated device pool and the |V| twin of one test: the same bf16 K/V stored
    /// through `CpuBackend::kv_store` and the emulated kv_store_impl.
    struct Fixture {
        g: AttnGeom,
        layer: usize,
        max_pages: usize,
        be: CpuBackend,
        kv: <CpuBackend as Backend>::Kv,
        /// The same cache with |v|: the twin over it gives Σ p·|v| / l, the scale of the error
        /// that rounding P to bf16 can make.
        kv_abs: <CpuBackend as Backend>::Kv,
        /// Device pool values; NaN where nothing was stored (other layer, unwritten slots), so
        /// a load from a wrong address poisons an mma operand and panics.
        pool: Vec<f32>,
        rng: Rng,
    }

    impl Fixture {
        fn new(g: AttnGeom, max_pages: usize, seed: u64) -> Self {
            let be = CpuBackend::new();
            let (kv, kv_abs) = (be.kv_new(g, max_pages).unwrap(), be.kv_new(g, max_pages).unwrap());
            let pool = vec![f32::NAN; max_pages * g.n_layers * 2 * g.kv_dim() * g.page_size];
            Fixture { g, layer: 1, max_pages, be, kv, kv_abs, pool, rng: Rng::new(seed) }
        }

        /// Store positions `from..to` of a sequence whose page table is `pages`.
        fn write(&mut self, pages: &[u32], from: usize, to: usize) {
            let (g, ps, width) = (self.g, self.g.page_size, self.g.qkv_dim());
            let qkv: CpuBuf = (0..(to - from) * width).map(|_| bf(self.rng.normal() as f32)).collect::<Vec<f32>>().into();
            let slots: Vec<u32> = (from..to).map(|p| pages[p / ps] * ps as u32 + (p % ps) as u32).collect();
            self.be.kv_store(&mut self.kv, self.layer, &qkv, &slots, g).unwrap();
            kv_store(&mut self.pool, &g, self.layer, &qkv, &slots);
            let v0 = g.q_dim() + g.kv_dim();
            let abs: CpuBuf = qkv.iter().enumerate().map(|(i, &x)| if i % width >= v0 { x.abs() } else { x }).collect::<Vec<f32>>().into();
            self.be.kv_store(&mut self.kv_abs, self.layer, &abs, &slots, g).unwrap();
        }

        /// Run the emulated kernels for each plan and each TQ on a fresh batch of query rows and
        /// compare with the twin.
        ///
        /// Bound per element, both sides on the same bf16 Q (the f32 buffer is not bf16-exact:
        /// the kernel rounds it when packing, the twin gets it rounded), K, V. The kernel rounds
        /// (1) P to bf16 for P·V: each p gets a relative error ≤ 2^-8 (one round-to-nearest of
        /// an 8-bit significand), and l sums the unrounded p, so |ΔO| ≤ 2^-8·Σ p·|v| / l =
        /// 2^-8·want_abs; (2) the output to bf16: ≤ 2^-8·|O|. f32 differences (exp2 vs the
        /// twin's exp, summation orders, the 2^-16 cross term) are far below 2^-13·want_abs.
        fn check(&mut self, label: &str, seqs: &[AttnSeq], plans: &[(String, AttnPlan)], tqs: &[Tq]) {
            let (g, q_dim, width) = (self.g, self.g.q_dim(), self.g.qkv_dim());
            let rows = seqs.iter().map(|s| s.q_row + s.n_q).max().unwrap();
            let qkv: Vec<f32> = (0..rows * width).map(|_| self.rng.normal() as f32 * 2.0).collect();
            let qkv16: CpuBuf = qkv.iter().map(|&x| bf(x)).collect::<Vec<f32>>().into();
            let mut want = CpuBuf::from(vec![0f32; rows * q_dim]);
            self.be.attention(&self.kv, self.layer, &qkv16, seqs, g, &mut want).unwrap();
            let mut want_abs = CpuBuf::from(vec![0f32; rows * q_dim]);
            self.be.attention(&self.kv_abs, self.layer, &qkv16, seqs, g, &mut want_abs).unwrap();
            for (name, p) in plans {
                let mut first: Option<Vec<f32>> = None;
                for &tq in tqs {
                    let mut got = vec![f32::NAN; rows * q_dim];
                    attention(&self.pool, &g, self.layer, if tq == Tq::F32 { &qkv } else { &qkv16 }, tq, p, &mut got);
                    let (mut sum_err, mut sum_tol, mut run_worst) = (0f64, 0f64, 0f32);
                    for (i, ((&a, &w), &wa)) in got.iter().zip(&want).zip(&want_abs).enumerate() {
                        let at = format!("{label} {name} {tq:?}: row {} col {}", i / q_dim, i % q_dim);
                        assert!(a.is_finite(), "{at}: not written ({a})");
                        let tol = (w.abs() + wa) / 256.0 + wa / 8192.0;
                        assert!((a - w).abs() <= tol, "{at}: {a} vs {w} (bound {tol})");
                        run_worst = run_worst.max((a - w).abs() / tol);
                        sum_err += (a - w).abs() as f64;
                        sum_tol += tol as f64;
                    }
                    // Rounding errors are spread over ±half an ulp, so on average far inside the
                    // worst-case bound (measured ≈ 0.1 of it); a wrong key or weight in a long
                    // context that hides under the per-element bound shows here.
                    assert!(sum_err <= 0.25 * sum_tol, "{label} {name} {tq:?}: mean error {:.3} of the bound", sum_err / sum_tol);
                    println!("{label} {name} {tq:?}: max |err|/bound {run_worst:.3}, mean {:.3}", sum_err / sum_tol);
                    // TQ = f32 differs from bf16 only by where the rounding happens
                    match &first {
                        Some(f) => assert!(f.iter().zip(&got).all(|(x, y)| x.to_bits() == y.to_bits()), "{label} {name}: f32 and bf16 q give different outputs"),
                        None => first = Some(got),
                    }
                }
            }
        }
    }

    /// Rewrite `plan` so that sequence `si` is split into `split_len`-key ranges (whatever its
    /// query count: `plan` splits only single-row sequences, the kernel and attn_combine take
    /// any), with its workspace slots, combine entries and one item per split.
    fn force_split(p: &mut AttnPlan, g: &AttnGeom, si: usize, split_len: usize) {
        let group = g.n_heads / g.n_kv_heads;
        let s = &mut p.seqs[si];
        assert_eq!(s.n_splits, 1);
        let n = (s.ctx_len as usize).div_ceil(split_len);
        assert!(n > 1, "one split is no split: the kernel writes the output directly");
        s.n_splits = n as i32;
        s.split_len = split_len as i32;
        s.part_base = p.part_slots as i32;
        let rows = g.n_kv_heads * s.n_q as usize * group;
        p.part_slots += rows * n;
        p.combine.extend((0..rows).map(|y| [si as i32, y as i32]));
        p.items = p.items.iter().flat_map(|it| if it.seq == si as i32 { (0..n as i32).map(|split| AttnItem { split, ..*it }).collect() } else { vec![*it] }).collect();
    }

    /// The lane-level emulation of attention.cu equals the CPU twin on a mixed batch over shared
    /// and scattered pages: a decode row at 300 (split in two with n_sm = 132), a 70-row prefill
    /// chunk starting at 180 on pages forked from it, a 1-token prompt, 37 scoring rows from 63,
    /// a decode row at 17 and 3 rows at 40 (the twin's direct path); GQA groups 1, 2, 7, 8,
    /// head_dim 16 .. 128, q as f32 and as bf16.
    #[test]
    fn lane_emulation_matches_cpu_twin_mixed_batch() {
        let shapes = [(4usize, 4usize, 64usize), (4, 2, 64), (14, 2, 64), (16, 2, 64), (4, 4, 128), (4, 2, 128), (14, 2, 128), (16, 2, 128), (4, 1, 16), (6, 3, 32)];
        for (ci, &(nh, nkv, hd)) in shapes.iter().enumerate() {
            let g = geom(nh, nkv, hd);
            let group = nh / nkv;
            let mut f = Fixture::new(g, 96, 100 + ci as u64);
            // non-contiguous page ids; B shares A's first 10 pages (160 tokens), then its own
            let pa: Vec<u32> = vec![17, 3, 40, 8, 22, 5, 31, 12, 0, 27, 14, 35, 9, 19, 2, 44, 25, 38, 11];
            let mut pb: Vec<u32> = pa[..10].to_vec();
            pb.extend([50u32, 47, 53, 49, 60, 55]);
            let (pc, pd, pe, pf) = (vec![70u32], vec![61u32, 64, 62, 66, 65, 67, 71], vec![80u32, 72], vec![75u32, 77, 76]);
            f.write(&pa, 0, 300);
            f.write(&pb, 160, 250);
            f.write(&pc, 0, 1);
            f.write(&pd, 0, 100);
            f.write(&pe, 0, 17);
            f.write(&pf, 0, 40);
            // batch rows not in list order
            let seqs = vec![
                AttnSeq { q_row: 37, n_q: 1, ctx_len: 300, pages: &pa, sampled: false },
                AttnSeq { q_row: 38, n_q: 70, ctx_len: 250, pages: &pb, sampled: false },
                AttnSeq { q_row: 108, n_q: 1, ctx_len: 1, pages: &pc, sampled: false },
                AttnSeq { q_row: 0, n_q: 37, ctx_len: 100, pages: &pd, sampled: false },
                AttnSeq { q_row: 112, n_q: 1, ctx_len: 17, pages: &pe, sampled: false },
                AttnSeq { q_row: 109, n_q: 3, ctx_len: 40, pages: &pf, sampled: false },
            ];
            let rows = 113;
            let plans: Vec<(String, AttnPlan)> = [1usize, 132].iter().map(|&n_sm| (format!("n_sm {n_sm}"), plan(&seqs, &g, f.max_pages, rows, n_sm).unwrap())).collect();
            let split = &plans[1].1;
            assert!(split.seqs[0].n_splits == 2 && split.seqs.iter().skip(1).all(|s| s.n_splits == 1), "the decode row at 300 is split with n_sm = 132: {:?}", split.seqs);
            // a tile whose last warp has no row (70·G and 37·G are not multiples of 64 for these G)
            assert!(split.items.iter().any(|it| {
                let s = split.seqs[it.seq as usize];
                (s.n_q as usize * group).saturating_sub(it.tile as usize * BM) <= 48
            }));
            f.check(&format!("nh {nh} nkv {nkv} hd {hd}"), &seqs, &plans, &[Tq::F32, Tq::Bf16]);
        }
    }

    /// Split-K decode: long single-row contexts that `plan` splits (n_sm = 132) into 7 .. 11
    /// splits, the last one ending inside a key tile (2049 keys: a single key), on scattered
    /// pages of 32 tokens.
    #[test]
    fn lane_emulation_matches_cpu_twin_split_k() {
        for (ci, &(nh, nkv, hd)) in [(16usize, 2usize, 128usize), (14, 2, 64), (4, 4, 64)].iter().enumerate() {
            let mut g = geom(nh, nkv, hd);
            g.page_size = 32;
            let mut f = Fixture::new(g, 157, 200 + ci as u64);
            // page ids: consecutive runs of the permutation k ↦ 7k mod 157
            let perm: Vec<u32> = (0..157).map(|k| (7 * k % 157) as u32).collect();
            let long = [2049usize, 1000, 1337];
            let mut next = 0;
            let tables: Vec<Vec<u32>> = long
                .iter()
                .map(|&n| {
                    let t = perm[next..next + n.div_ceil(32)].to_vec();
                    next += t.len();
                    t
                })
                .collect();
            for (t, &n) in tables.iter().zip(&long) {
                f.write(t, 0, n);
            }
            let seqs: Vec<AttnSeq> = tables.iter().zip(&long).enumerate().map(|(j, (t, &n))| AttnSeq { q_row: j, n_q: 1, ctx_len: n, pages: t, sampled: false }).collect();
            let p = plan(&seqs, &g, f.max_pages, 3, 132).unwrap();
            assert!(p.seqs.iter().all(|s| s.n_splits >= 6), "{:?}", p.seqs);
            let bk = if hd <= 64 { 64 } else { 32 };
            assert_eq!((p.seqs[0].ctx_len % p.seqs[0].split_len) % bk, 1, "the last split of 2049 keys has one key");
            f.check(&format!("split-K nh {nh} nkv {nkv} hd {hd}"), &seqs, &[("n_sm 132".into(), p)], &[Tq::F32, Tq::Bf16]);
        }
    }

    /// Splits that some rows see nothing of: multi-row sequences split by hand at key 192 (3
    /// rows at positions 191..193; 40 rows at 160..199, whose first tile of packed rows ends
    /// at or before key 192 and so has an item with no key tile at all). Their partials are m = −inf,
    /// l = 0, which attn_combine must give weight 0; the other items of the batch stay direct.
    /// A second plan splits every 100 keys: `plan`'s splits are multiples of 64 keys, so a split
    /// never ends inside a key tile and the kernel's `key >= k_stop` mask is redundant there;
    /// here it is what keeps the next split's keys (zero-filled, score 0) out.
    #[test]
    fn lane_emulation_split_rows_without_visible_keys() {
        for (ci, &(nh, nkv, hd)) in [(14usize, 2usize, 64usize), (16, 2, 128), (4, 2, 32)].iter().enumerate() {
            let g = geom(nh, nkv, hd);
            let group = nh / nkv;
            let mut f = Fixture::new(g, 64, 300 + ci as u64);
            let p3: Vec<u32> = (0..13).map(|i| 2 * i + 1).collect();
            let p40: Vec<u32> = (0..13).map(|i| 50 - 2 * i).collect();
            let pd = vec![60u32, 63, 61];
            f.write(&p3, 0, 194);
            f.write(&p40, 0, 200);
            f.write(&pd, 0, 40);
            let seqs = vec![
                AttnSeq { q_row: 0, n_q: 3, ctx_len: 194, pages: &p3, sampled: false },
                AttnSeq { q_row: 3, n_q: 40, ctx_len: 200, pages: &p40, sampled: false },
                AttnSeq { q_row: 43, n_q: 1, ctx_len: 40, pages: &pd, sampled: false },
            ];
            let mut p = plan(&seqs, &g, f.max_pages, 44, 1).unwrap();
            let mut p100 = plan(&seqs, &g, f.max_pages, 44, 1).unwrap();
            force_split(&mut p, &g, 0, 192);
            force_split(&mut p, &g, 1, 192);
            force_split(&mut p100, &g, 0, 100);
            force_split(&mut p100, &g, 1, 100);
            // what the case is for: an item with no key tile, and valid rows with no visible key
            let (mut empty, mut blind) = (false, false);
            for it in &p.items {
                let s = p.seqs[it.seq as usize];
                let k0 = it.split as usize * s.split_len as usize;
                let kend = tile_kend(&s, group, it.tile as usize);
                empty |= kend <= k0;
                let n_rows = s.n_q as usize * group;
                let first_row = it.tile as usize * BM;
                blind |= kend > k0 && first_row < n_rows && (s.ctx_len - s.n_q) as usize + first_row / group < k0;
            }
            assert!(empty && blind);
            f.check(&format!("forced split nh {nh} nkv {nkv} hd {hd}"), &seqs, &[("split at 192".into(), p), ("splits of 100".into(), p100)], &[Tq::Bf16]);
        }
    }
}
