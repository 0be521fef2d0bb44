//! Lane-by-lane ports of attn_dense_fwd_impl, attn_bwd_prep_impl, attn_dense_dq_impl and
//! attn_dense_dkdv_impl. Shared memory is a flat array indexed exactly as the kernel's
//! pointer arithmetic; a warp is 32 lanes of registers; `mma` assembles the 16×16 / 16×8
//! operands from the lanes' fragments by the PTX ISA's ownership rules (mma.cuh) — so a
//! fragment that names the wrong element, a misplaced repack or a wrong stage shows up as a
//! wrong result. f32 arithmetic, bf16 rounding where the kernels round (operands packed for
//! the tensor cores, the bf16 output); the sums inside `mma` run in f32 in k order. The
//! lane-level primitives are `backend::cuda::emulate`'s (shared with the paged-attention
//! emulator in emulate/attention.rs); unlike that one, cp.async here lands at once (`cp16`), so these
//! emulators check the stage indexing but not the wait/barrier order.
#![allow(clippy::needless_range_loop)] // loops index registers and fragments as the kernels do
use crate::backend::cuda::attention_dense::*;
use crate::backend::{AttnGeom, DenseSeq};
use super::{b_rows, bf, c_to_a, cp16, ld2, mma, online_softmax_tile, quad_reduce, AFrag, BFrag};

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2: f32 = std::f32::consts::LN_2;

/// `ld_row2(row, c)` from a global bf16 array (None: a padding row → zeros).
fn ld_row2(g: &[f32], row: Option<usize>, c: usize) -> [f32; 2] {
    match row {
        Some(r) => [g[r + c], g[r + c + 1]],
        None => [0.0, 0.0],
    }
}
/// Per-lane constants of the forward and dQ kernels (the thread's two packed rows).
#[derive(Clone, Copy, Default)]
struct RowPair {
    va: bool,
    vb: bool,
    qia: usize,
    ha: usize,
    qib: usize,
    hb: usize,
    pos_a: i64,
    pos_b: i64,
}

fn row_pair(r0: usize, warp: usize, gid: usize, n_rows: usize, group: usize) -> RowPair {
    let (ra, rb) = (r0 + warp * 16 + gid, r0 + warp * 16 + gid + 8);
    let (va, vb) = (ra < n_rows, rb < n_rows);
    let (qia, qib) = (if va { ra / group } else { 0 }, if vb { rb / group } else { 0 });
    RowPair {
        va,
        vb,
        qia,
        ha: if va { ra - qia * group } else { 0 },
        qib,
        hb: if vb { rb - qib * group } else { 0 },
        pos_a: if va { qia as i64 } else { -1 },
        pos_b: if vb { qib as i64 } else { -1 },
    }
}

/// K/V tile load of the forward and dQ kernels: `load_tile(stage, kt0)`.
#[allow(clippy::too_many_arguments)]
fn load_kv_tile(sk: &mut [f32], sv: &mut [f32], qkv: &[f32], g: &AttnGeom, s: &DenseSeqDev, kvh: usize, kend: usize, stage: usize, kt0: usize) {
    let (hd, width, q_dim, kv_dim) = (g.head_dim, g.qkv_dim(), g.q_dim(), g.kv_dim());
    let (bk, hdp, ch) = (bk(hd), hd + 8, hd / 8);
    let kbase = s.row0 as usize * width + q_dim + kvh * hd;
    for idx in 0..2 * bk * ch {
        let which = idx / (bk * ch);
        let rem = idx - which * bk * ch;
        let (j, c) = (rem / ch, rem % ch);
        let key = kt0 + j;
        let dst = (stage * bk + j) * hdp + c * 8;
        let src = (key < kend).then(|| kbase + key * width + which * kv_dim + c * 8);
        cp16(if which == 1 { &mut *sv } else { &mut *sk }, dst, qkv, src);
    }
}

/// attn_dense_fwd_impl over every item. `qkv` holds bf16 values; writes `out` (bf16 values)
/// and `lse` for the rows of the sequences.
pub fn fwd(qkv: &[f32], g: &AttnGeom, p: &DensePlan, out: &mut [f32], lse: &mut [f32]) {
    let (hd, width, q_dim, nh) = (g.head_dim, g.qkv_dim(), g.q_dim(), g.n_heads);
    let group = g.n_heads / g.n_kv_heads;
    let (bk, hdp) = (bk(hd), hd + 8);
    let (nt_n, dt_n, kq) = (bk / 8, hd / 8, hd / 16);
    let scale_log2 = (1.0 / (hd as f32).sqrt()) * LOG2E;
    for it in &p.q_items {
        let s = p.seqs[it.seq as usize];
        let n_rows = s.len as usize * group;
        let r0 = it.tile as usize * BM;
        let kend = tile_kend(&s, group, it.tile as usize);
        let kvh = it.kvh as usize;
        let mut sk = vec![f32::NAN; 2 * bk * hdp];
        let mut sv = vec![f32::NAN; 2 * bk * hdp];
        // registers of the 4 warps × 32 lanes
        let rp: Vec<[RowPair; 32]> = (0..4).map(|w| std::array::from_fn(|lane| row_pair(r0, w, lane / 4, n_rows, group))).collect();
        let qrow = |pr: &RowPair, b: bool| -> Option<usize> {
            let (v, qi, h) = if b { (pr.vb, pr.qib, pr.hb) } else { (pr.va, pr.qia, pr.ha) };
            v.then(|| (s.row0 as usize + qi) * width + (kvh * group + h) * hd)
        };
        let qf: Vec<Vec<[AFrag; 32]>> = (0..4)
            .map(|w| {
                (0..kq)
                    .map(|kk| {
                        std::array::from_fn(|lane| {
                            let pr = &rp[w][lane];
                            let c = kk * 16 + 2 * (lane % 4);
                            [ld_row2(qkv, qrow(pr, false), c), ld_row2(qkv, qrow(pr, true), c), ld_row2(qkv, qrow(pr, false), c + 8), ld_row2(qkv, qrow(pr, true), c + 8)]
                        })
                    })
                    .collect()
            })
            .collect();
        let mut o = vec![vec![[[0f32; 4]; 32]; dt_n]; 4];
        let mut m_a = [[f32::NEG_INFINITY; 32]; 4];
        let mut m_b = [[f32::NEG_INFINITY; 32]; 4];
        let mut l_a = [[0f32; 32]; 4];
        let mut l_b = [[0f32; 32]; 4];
        let n_tiles = kend.div_ceil(bk);
        load_kv_tile(&mut sk, &mut sv, qkv, g, &s, kvh, kend, 0, 0);
        for t in 0..n_tiles {
            let st = t & 1;
            if t + 1 < n_tiles {
                load_kv_tile(&mut sk, &mut sv, qkv, g, &s, kvh, kend, st ^ 1, (t + 1) * bk);
            }
            for w in 0..4 {
                if r0 + w * 16 >= n_rows {
                    continue; // !warp_active
                }
                let kt0 = t * bk;
                let mut sc = vec![[[0f32; 4]; 32]; nt_n];
                for (kk, qfk) in qf[w].iter().enumerate() {
                    for (nt, s_nt) in sc.iter_mut().enumerate() {
                        let b: [BFrag; 32] = std::array::from_fn(|lane| {
                            let kr = (st * bk + nt * 8 + lane / 4) * hdp + kk * 16 + 2 * (lane % 4);
                            [ld2(&sk, kr), ld2(&sk, kr + 8)]
                        });
                        mma(s_nt, qfk, &b);
                    }
                }
                online_softmax_tile(&mut sc, &mut o[w], &mut m_a[w], &mut m_b[w], &mut l_a[w], &mut l_b[w], kt0 as i64, scale_log2, |lane| (rp[w][lane].pos_a, rp[w][lane].pos_b), |key, pos| key > pos);
                for j in 0..bk / 16 {
                    let pa: [AFrag; 32] = std::array::from_fn(|lane| c_to_a(&sc[2 * j][lane], &sc[2 * j + 1][lane]));
                    for (dt, od) in o[w].iter_mut().enumerate() {
                        let b: [BFrag; 32] = std::array::from_fn(|lane| b_rows(&sv, (st * bk + j * 16 + 2 * (lane % 4)) * hdp + dt * 8 + lane / 4, hdp));
                        mma(od, &pa, &b);
                    }
                }
            }
        }
        for w in 0..4 {
            quad_reduce(&mut l_a[w], |x, y| x + y);
            quad_reduce(&mut l_b[w], |x, y| x + y);
            if r0 + w * 16 >= n_rows {
                continue;
            }
            for lane in 0..32 {
                let (pr, tq) = (&rp[w][lane], lane % 4);
                for (v, qi, h, l, m, e0) in [(pr.va, pr.qia, pr.ha, l_a[w][lane], m_a[w][lane], 0), (pr.vb, pr.qib, pr.hb, l_b[w][lane], m_b[w][lane], 2)] {
                    if !v {
                        continue;
                    }
                    let inv = 1.0 / l;
                    let row = s.row0 as usize + qi;
                    let head = kvh * group + h;
                    for dt in 0..dt_n {
                        let at = row * q_dim + head * hd + dt * 8 + 2 * tq;
                        out[at] = bf(o[w][dt][lane][e0] * inv);
                        out[at + 1] = bf(o[w][dt][lane][e0 + 1] * inv);
                    }
                    if tq == 0 {
                        lse[row * nh + head] = (m + l.log2()) * LN2;
                    }
                }
            }
        }
    }
}

/// attn_bwd_prep_impl: D = Σ dO·O per (row, head) and dO rounded to bf16.
pub fn prep(out: &[f32], dout: &[f32], rows: usize, nh: usize, hd: usize) -> (Vec<f32>, Vec<f32>) {
    let mut dout16 = vec![0f32; rows * nh * hd];
    let mut dsum = vec![0f32; rows * nh];
    for w in 0..rows * nh {
        let base = w * hd;
        let mut lanes = [0f32; 32];
        for (lane, acc) in lanes.iter_mut().enumerate() {
            let mut d = lane;
            while d < hd {
                *acc += dout[base + d] * out[base + d];
                dout16[base + d] = bf(dout[base + d]);
                d += 32;
            }
        }
        // warp_sum: butterfly over 16, 8, 4, 2, 1
        for m in [16usize, 8, 4, 2, 1] {
            let old = lanes;
            for lane in 0..32 {
                lanes[lane] = old[lane] + old[lane ^ m];
            }
        }
        dsum[w] = lanes[0];
    }
    (dout16, dsum)
}

/// attn_dense_dq_impl over every forward item: writes the q columns of `dqkv`.
#[allow(clippy::too_many_arguments)]
pub fn dq(qkv: &[f32], g: &AttnGeom, p: &DensePlan, dout16: &[f32], lse: &[f32], dsum: &[f32], dqkv: &mut [f32]) {
    let (hd, width, q_dim, nh) = (g.head_dim, g.qkv_dim(), g.q_dim(), g.n_heads);
    let group = g.n_heads / g.n_kv_heads;
    let (bk, hdp) = (bk(hd), hd + 8);
    let (nt_n, dt_n, kq) = (bk / 8, hd / 8, hd / 16);
    let scale = 1.0 / (hd as f32).sqrt();
    let scale_log2 = scale * LOG2E;
    for it in &p.q_items {
        let s = p.seqs[it.seq as usize];
        let n_rows = s.len as usize * group;
        let r0 = it.tile as usize * BM;
        let kend = tile_kend(&s, group, it.tile as usize);
        let kvh = it.kvh as usize;
        let mut sk = vec![f32::NAN; 2 * bk * hdp];
        let mut sv = vec![f32::NAN; 2 * bk * hdp];
        let rp: Vec<[RowPair; 32]> = (0..4).map(|w| std::array::from_fn(|lane| row_pair(r0, w, lane / 4, n_rows, group))).collect();
        let at = |pr: &RowPair, b: bool| -> Option<(usize, usize)> {
            let (v, qi, h) = if b { (pr.vb, pr.qib, pr.hb) } else { (pr.va, pr.qia, pr.ha) };
            v.then(|| (s.row0 as usize + qi, kvh * group + h))
        };
        let frags = |src: &[f32], ld: usize, w: usize, kk: usize| -> [AFrag; 32] {
            std::array::from_fn(|lane| {
                let pr = &rp[w][lane];
                let c = kk * 16 + 2 * (lane % 4);
                let ra = at(pr, false).map(|(r, h)| r * ld + h * hd);
                let rb = at(pr, true).map(|(r, h)| r * ld + h * hd);
                [ld_row2(src, ra, c), ld_row2(src, rb, c), ld_row2(src, ra, c + 8), ld_row2(src, rb, c + 8)]
            })
        };
        let qf: Vec<Vec<[AFrag; 32]>> = (0..4).map(|w| (0..kq).map(|kk| frags(qkv, width, w, kk)).collect()).collect();
        let df: Vec<Vec<[AFrag; 32]>> = (0..4).map(|w| (0..kq).map(|kk| frags(dout16, q_dim, w, kk)).collect()).collect();
        let stat = |src: &[f32], w: usize, lane: usize, b: bool, mul: f32| at(&rp[w][lane], b).map_or(0.0, |(r, h)| src[r * nh + h] * mul);
        let mut dqa = vec![vec![[[0f32; 4]; 32]; dt_n]; 4];
        let n_tiles = kend.div_ceil(bk);
        load_kv_tile(&mut sk, &mut sv, qkv, g, &s, kvh, kend, 0, 0);
        for t in 0..n_tiles {
            let st = t & 1;
            if t + 1 < n_tiles {
                load_kv_tile(&mut sk, &mut sv, qkv, g, &s, kvh, kend, st ^ 1, (t + 1) * bk);
            }
            for w in 0..4 {
                if r0 + w * 16 >= n_rows {
                    continue;
                }
                let kt0 = t * bk;
                let mut sc = vec![[[0f32; 4]; 32]; nt_n];
                let mut dp = vec![[[0f32; 4]; 32]; nt_n];
                for kk in 0..kq {
                    for nt in 0..nt_n {
                        let rowp = |lane: usize| (st * bk + nt * 8 + lane / 4) * hdp + kk * 16 + 2 * (lane % 4);
                        let bk_: [BFrag; 32] = std::array::from_fn(|lane| [ld2(&sk, rowp(lane)), ld2(&sk, rowp(lane) + 8)]);
                        mma(&mut sc[nt], &qf[w][kk], &bk_);
                        let bv: [BFrag; 32] = std::array::from_fn(|lane| [ld2(&sv, rowp(lane)), ld2(&sv, rowp(lane) + 8)]);
                        mma(&mut dp[nt], &df[w][kk], &bv);
                    }
                }
                for lane in 0..32 {
                    let tq = lane % 4;
                    for nt in 0..nt_n {
                        for e in 0..4 {
                            let key = (kt0 + nt * 8 + 2 * tq + (e & 1)) as i64;
                            let a = e < 2;
                            let pos = if a { rp[w][lane].pos_a } else { rp[w][lane].pos_b };
                            let lse2 = stat(lse, w, lane, !a, LOG2E);
                            let d = stat(dsum, w, lane, !a, 1.0);
                            let pv = if key <= pos { (sc[nt][lane][e] * scale_log2 - lse2).exp2() } else { 0.0 };
                            sc[nt][lane][e] = pv * (dp[nt][lane][e] - d);
                        }
                    }
                }
                for j in 0..bk / 16 {
                    let pa: [AFrag; 32] = std::array::from_fn(|lane| c_to_a(&sc[2 * j][lane], &sc[2 * j + 1][lane]));
                    for (dt, acc) in dqa[w].iter_mut().enumerate() {
                        let b: [BFrag; 32] = std::array::from_fn(|lane| b_rows(&sk, (st * bk + j * 16 + 2 * (lane % 4)) * hdp + dt * 8 + lane / 4, hdp));
                        mma(acc, &pa, &b);
                    }
                }
            }
        }
        for w in 0..4 {
            if r0 + w * 16 >= n_rows {
                continue;
            }
            for lane in 0..32 {
                let tq = lane % 4;
                for (b, e0) in [(false, 0), (true, 2)] {
                    let Some((row, head)) = at(&rp[w][lane], b) else { continue };
                    for dt in 0..dt_n {
                        let o = row * width + head * hd + dt * 8 + 2 * tq;
                        dqkv[o] = dqa[w][dt][lane][e0] * scale;
                        dqkv[o + 1] = dqa[w][dt][lane][e0 + 1] * scale;
                    }
                }
            }
        }
    }
}

/// attn_dense_dkdv_impl over every key item: writes the k and v columns of `dqkv`. The
/// shared memory is one flat array of f32 slots laid out by `dkdv_smem_layout` (a byte
/// offset b ↦ slot b/2 for bf16 regions, b/4 for the f32/int ones, as separate arrays).
#[allow(clippy::too_many_arguments)]
pub fn dkdv(qkv: &[f32], g: &AttnGeom, p: &DensePlan, dout16: &[f32], lse: &[f32], dsum: &[f32], dqkv: &mut [f32]) {
    let (hd, width, q_dim, kv_dim, nh) = (g.head_dim, g.qkv_dim(), g.q_dim(), g.kv_dim(), g.n_heads);
    let group = g.n_heads / g.n_kv_heads;
    let lay = dkdv_smem_layout(hd);
    let (bq, hdp, ch) = (bq(hd), hd + 8, hd / 8);
    let (nq, dt_n, kq) = (bq / 8, hd / 8, hd / 16);
    let scale = 1.0 / (hd as f32).sqrt();
    let scale_log2 = scale * LOG2E;
    // bf16 regions as f32 slots at byte offset / 2; f32/int regions in their own arrays
    let (k_at, v_at, q_at, do_at) = (lay.sk / 2, lay.sv / 2, lay.sq / 2, lay.sdo / 2);
    for it in &p.k_items {
        let s = p.seqs[it.seq as usize];
        let n_rows = s.len as usize * group;
        let k0 = it.tile as usize * BN;
        let kvh = it.kvh as usize;
        let mut sm = vec![f32::NAN; lay.slse / 2];
        let mut slse = vec![f32::NAN; 2 * bq];
        let mut sd = vec![f32::NAN; 2 * bq];
        let mut sqi = vec![i64::MIN; 2 * bq];
        let kbase = s.row0 as usize * width + q_dim + kvh * hd;
        for idx in 0..2 * BN * ch {
            let which = idx / (BN * ch);
            let rem = idx - which * BN * ch;
            let (j, c) = (rem / ch, rem % ch);
            let key = k0 + j;
            let dst = if which == 1 { v_at } else { k_at } + j * hdp + c * 8;
            cp16(&mut sm, dst, qkv, (key < s.len as usize).then(|| kbase + key * width + which * kv_dim + c * 8));
        }
        let load_rows = |sm: &mut Vec<f32>, slse: &mut Vec<f32>, sd: &mut Vec<f32>, sqi: &mut Vec<i64>, stage: usize, rt0: usize| {
            for idx in 0..2 * bq * ch {
                let which = idx / (bq * ch);
                let rem = idx - which * bq * ch;
                let (j, c) = (rem / ch, rem % ch);
                let r = rt0 + j;
                let dst = if which == 1 { do_at } else { q_at } + (stage * bq + j) * hdp + c * 8;
                let src = (r < n_rows).then(|| {
                    let (i, head) = (r / group, kvh * group + r % group);
                    if which == 1 {
                        (s.row0 as usize + i) * q_dim + head * hd + c * 8
                    } else {
                        (s.row0 as usize + i) * width + head * hd + c * 8
                    }
                });
                cp16(sm, dst, if which == 1 { dout16 } else { qkv }, src);
            }
            for j in 0..bq {
                let r = rt0 + j;
                if r < n_rows {
                    let i = r / group;
                    let at = (s.row0 as usize + i) * nh + kvh * group + r % group;
                    slse[stage * bq + j] = lse[at] * LOG2E;
                    sd[stage * bq + j] = dsum[at];
                    sqi[stage * bq + j] = i as i64;
                } else {
                    slse[stage * bq + j] = 0.0;
                    sd[stage * bq + j] = 0.0;
                    sqi[stage * bq + j] = -1;
                }
            }
        };
        let r_begin = k0 * group;
        let n_qt = (n_rows - r_begin).div_ceil(bq);
        let mut dk = vec![vec![[[0f32; 4]; 32]; dt_n]; 4];
        let mut dv = vec![vec![[[0f32; 4]; 32]; dt_n]; 4];
        load_rows(&mut sm, &mut slse, &mut sd, &mut sqi, 0, r_begin);
        for t in 0..n_qt {
            let st = t & 1;
            if t + 1 < n_qt {
                load_rows(&mut sm, &mut slse, &mut sd, &mut sqi, st ^ 1, r_begin + (t + 1) * bq);
            }
            for w in 0..4 {
                if k0 + w * 16 >= s.len as usize {
                    continue;
                }
                let mut sc = vec![[[0f32; 4]; 32]; nq];
                let mut dp = vec![[[0f32; 4]; 32]; nq];
                for kk in 0..kq {
                    let afr = |base: usize| -> [AFrag; 32] {
                        std::array::from_fn(|lane| {
                            let a = base + (w * 16 + lane / 4) * hdp + kk * 16 + 2 * (lane % 4);
                            [ld2(&sm, a), ld2(&sm, a + 8 * hdp), ld2(&sm, a + 8), ld2(&sm, a + 8 * hdp + 8)]
                        })
                    };
                    let (ak, av) = (afr(k_at), afr(v_at));
                    for nt in 0..nq {
                        let rowp = |base: usize, lane: usize| base + (st * bq + nt * 8 + lane / 4) * hdp + kk * 16 + 2 * (lane % 4);
                        let bq_: [BFrag; 32] = std::array::from_fn(|lane| [ld2(&sm, rowp(q_at, lane)), ld2(&sm, rowp(q_at, lane) + 8)]);
                        mma(&mut sc[nt], &ak, &bq_);
                        let bd: [BFrag; 32] = std::array::from_fn(|lane| [ld2(&sm, rowp(do_at, lane)), ld2(&sm, rowp(do_at, lane) + 8)]);
                        mma(&mut dp[nt], &av, &bd);
                    }
                }
                for lane in 0..32 {
                    let (gid, tq) = (lane / 4, lane % 4);
                    let key_a = (k0 + w * 16 + gid) as i64;
                    for nt in 0..nq {
                        for e in 0..4 {
                            let c = nt * 8 + 2 * tq + (e & 1);
                            let key = if e < 2 { key_a } else { key_a + 8 };
                            let pv = if key <= sqi[st * bq + c] { (sc[nt][lane][e] * scale_log2 - slse[st * bq + c]).exp2() } else { 0.0 };
                            sc[nt][lane][e] = pv;
                            dp[nt][lane][e] = pv * (dp[nt][lane][e] - sd[st * bq + c]);
                        }
                    }
                }
                for j in 0..bq / 16 {
                    let pa: [AFrag; 32] = std::array::from_fn(|lane| c_to_a(&sc[2 * j][lane], &sc[2 * j + 1][lane]));
                    let sa: [AFrag; 32] = std::array::from_fn(|lane| c_to_a(&dp[2 * j][lane], &dp[2 * j + 1][lane]));
                    for dt in 0..dt_n {
                        let rowp = |base: usize, lane: usize| base + (st * bq + j * 16 + 2 * (lane % 4)) * hdp + dt * 8 + lane / 4;
                        let b: [BFrag; 32] = std::array::from_fn(|lane| b_rows(&sm, rowp(do_at, lane), hdp));
                        mma(&mut dv[w][dt], &pa, &b);
                        let b: [BFrag; 32] = std::array::from_fn(|lane| b_rows(&sm, rowp(q_at, lane), hdp));
                        mma(&mut dk[w][dt], &sa, &b);
                    }
                }
            }
        }
        for w in 0..4 {
            if k0 + w * 16 >= s.len as usize {
                continue;
            }
            for lane in 0..32 {
                let (gid, tq) = (lane / 4, lane % 4);
                for (key, e0) in [(k0 + w * 16 + gid, 0), (k0 + w * 16 + gid + 8, 2)] {
                    if key >= s.len as usize {
                        continue;
                    }
                    let kr = (s.row0 as usize + key) * width + q_dim + kvh * hd;
                    for dt in 0..dt_n {
                        let o = kr + dt * 8 + 2 * tq;
                        dqkv[o] = dk[w][dt][lane][e0] * scale;
                        dqkv[o + 1] = dk[w][dt][lane][e0 + 1] * scale;
                        dqkv[o + kv_dim] = dv[w][dt][lane][e0];
                        dqkv[o + kv_dim + 1] = dv[w][dt][lane][e0 + 1];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::attention_dense as twin;
    use crate::util::rng::Rng;

    fn geom(n_heads: usize, n_kv: usize, hd: usize) -> AttnGeom {
        AttnGeom { n_layers: 1, n_heads, n_kv_heads: n_kv, head_dim: hd, page_size: 16 }
    }

    fn batch(lens: &[usize]) -> (Vec<DenseSeq>, usize) {
        let mut row = 0;
        let seqs = lens
            .iter()
            .map(|&len| {
                let s = DenseSeq { row0: row, len };
                row += len;
                s
            })
            .collect();
        (seqs, row)
    }

    /// Every (sequence, kv head, packed row) is in exactly one forward/dQ item, every (sequence,
    /// kv head, key) in exactly one dK/dV item, and the packed rows a dK/dV item walks
    /// (k0·G .. len·G) are exactly the rows that see any of its keys.
    #[test]
    fn items_cover_rows_and_keys_once() {
        let g = geom(14, 2, 64);
        let group = 7;
        let (seqs, rows) = batch(&[1, 9, 64, 65, 130, 700, 0, 3]);
        let p = plan(&seqs, &g, rows).unwrap();
        assert_eq!(p.rows, rows);
        assert_eq!(p.seqs.len(), 7, "empty sequences are dropped");
        let mut seen_rows = std::collections::HashMap::new();
        for it in &p.q_items {
            let s = p.seqs[it.seq as usize];
            let n_rows = s.len as usize * group;
            let r0 = it.tile as usize * BM;
            assert!(r0 < n_rows);
            let kend = tile_kend(&s, group, it.tile as usize);
            for r in r0..(r0 + BM).min(n_rows) {
                assert!(r / group < kend, "a row's own key is inside the tile's key range");
                *seen_rows.entry((it.seq, it.kvh, r)).or_insert(0) += 1;
            }
        }
        let mut seen_keys = std::collections::HashMap::new();
        for it in &p.k_items {
            let s = p.seqs[it.seq as usize];
            let k0 = it.tile as usize * BN;
            assert!(k0 < s.len as usize);
            for key in k0..(k0 + BN).min(s.len as usize) {
                *seen_keys.entry((it.seq, it.kvh, key)).or_insert(0) += 1;
                // rows r with r / G >= key are exactly r >= key·G >= k0·G
                assert!(key * group >= k0 * group);
            }
        }
        for (si, s) in p.seqs.iter().enumerate() {
            for kvh in 0..2 {
                for r in 0..s.len as usize * group {
                    assert_eq!(seen_rows.get(&(si as i32, kvh, r)), Some(&1), "seq {si} kvh {kvh} row {r}");
                }
                for key in 0..s.len as usize {
                    assert_eq!(seen_keys.get(&(si as i32, kvh, key)), Some(&1), "seq {si} kvh {kvh} key {key}");
                }
            }
        }
        assert_eq!(seen_rows.len(), p.seqs.iter().map(|s| s.len as usize * group * 2).sum::<usize>());
        assert_eq!(seen_keys.len(), p.seqs.iter().map(|s| s.len as usize * 2).sum::<usize>());
        assert!(plan(&seqs, &g, rows - 1).is_err(), "rows beyond the batch are refused");
        assert!(plan(&seqs, &geom(14, 3, 64), rows).is_err(), "heads not a multiple of kv heads");
    }

    /// The dK/dV kernel's dynamic shared memory: regions disjoint, 16-byte aligned where cp.async
    /// writes, within what an H100/H200 block may have, and the sizes the kernel comment states.
    #[test]
    fn dkdv_shared_memory_layout() {
        for (hd, want) in [(16usize, 19968usize), (32, 32256), (64, 56832), (128, 70400)] {
            let l = dkdv_smem_layout(hd);
            let regions = [l.sk, l.sv, l.sq, l.sdo, l.slse, l.sd, l.sqi, l.bytes];
            assert!(regions.windows(2).all(|w| w[0] < w[1]), "hd {hd}: {l:?}");
            assert!([l.sk, l.sv, l.sq, l.sdo].iter().all(|o| o % 16 == 0), "cp.async destinations 16-byte aligned");
            let hdp = hd + 8;
            assert_eq!(l.sv - l.sk, BN * hdp * 2);
            assert_eq!(l.sdo - l.sq, 2 * bq(hd) * hdp * 2);
            assert_eq!(l.bytes, want, "hd {hd}");
            assert!(l.bytes <= 227 * 1024);
        }
    }

    fn qkv_batch(rng: &mut Rng, rows: usize, g: &AttnGeom, scale: f32) -> Vec<f32> {
        (0..rows * g.qkv_dim()).map(|_| bf(rng.normal() as f32 * scale)).collect()
    }

    const SHAPES: [(usize, usize, usize); 5] = [(4, 1, 16), (14, 2, 64), (16, 2, 128), (6, 3, 32), (2, 2, 64)];
    const LENS: [usize; 6] = [5, 70, 1, 33, 130, 64];

    /// The emulated forward kernel equals the CPU twin on bf16 inputs: the output within bf16
    /// rounding of P (before P·V) and of the output itself, the log-sum-exp to f32 accuracy.
    #[test]
    fn emulated_forward_matches_cpu_twin() {
        for &(nh, nkv, hd) in &SHAPES {
            let g = geom(nh, nkv, hd);
            let mut rng = Rng::new(nh as u64 * 7 + hd as u64);
            let (seqs, rows) = batch(&LENS);
            let qkv = qkv_batch(&mut rng, rows, &g, 1.5);
            let (mut want, mut want_lse) = (vec![0f32; rows * g.q_dim()], vec![0f32; rows * nh]);
            twin::attn_dense(&qkv, &seqs, g, &mut want, &mut want_lse, false);
            let p = plan(&seqs, &g, rows).unwrap();
            let (mut got, mut got_lse) = (vec![f32::NAN; rows * g.q_dim()], vec![f32::NAN; rows * nh]);
            fwd(&qkv, &g, &p, &mut got, &mut got_lse);
            let vmax = qkv.iter().fold(0f32, |a, &b| a.max(b.abs()));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                // P rounded to bf16 (≤ 2^-8 relative per p: one round-to-nearest of an 8-bit
                // significand; Σp/l = 1 → ≤ 2^-8·max|v|) + the bf16 output (≤ 2^-8·|out|). The
                // second-order and f32 terms fit in the slack of vmax (max over the whole batch's
                // q, k, v, not over the visible v of one head).
                assert!((a - b).abs() <= 2.0 / 512.0 * b.abs() + 2.0 / 512.0 * vmax, "hd {hd} out[{i}]: {a} vs {b}");
            }
            for (i, (a, b)) in got_lse.iter().zip(&want_lse).enumerate() {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "hd {hd} lse[{i}]: {a} vs {b}");
            }
        }
    }

    /// ‖a − b‖ / ‖b‖ over a column range of every row.
    fn rel_cols(a: &[f32], b: &[f32], width: usize, cols: std::ops::Range<usize>) -> f64 {
        let (mut num, mut den) = (0f64, 0f64);
        for (ra, rb) in a.chunks(width).zip(b.chunks(width)) {
            for c in cols.clone() {
                num += ((ra[c] - rb[c]) as f64).powi(2);
                den += (rb[c] as f64).powi(2);
            }
        }
        (num / den.max(1e-300)).sqrt()
    }

    /// The emulated backward kernels (prep, dQ, dK/dV) equal the CPU twin, given the same
    /// forward output (bf16 on the device, so the twin gets the rounded values too) and lse.
    /// The device rounds dO, P and dS to bf16 as tensor-core operands: each is a relative error
    /// of at most 2^-8 (≈ 0.4%) on one factor of a product, of random sign, so they add in
    /// quadrature over the sums: measured ‖Δ‖/‖want‖ is 0.2–0.4%. The bound is 1% of each
    /// part's norm (statistical: the worst case, three 2^-8 errors aligned on every term, 1.2%,
    /// does not occur over these sums) and 3% of its largest entry per element.
    #[test]
    fn emulated_backward_matches_cpu_twin() {
        for &(nh, nkv, hd) in &SHAPES {
            let g = geom(nh, nkv, hd);
            let mut rng = Rng::new(nh as u64 * 13 + hd as u64);
            let (seqs, rows) = batch(&LENS);
            let (w, q_dim, kv_dim) = (g.qkv_dim(), g.q_dim(), g.kv_dim());
            let qkv = qkv_batch(&mut rng, rows, &g, 1.5);
            let (mut out, mut lse) = (vec![0f32; rows * q_dim], vec![0f32; rows * nh]);
            twin::attn_dense(&qkv, &seqs, g, &mut out, &mut lse, false);
            let out: Vec<f32> = out.iter().map(|&x| bf(x)).collect();
            let dout: Vec<f32> = (0..rows * q_dim).map(|_| rng.normal() as f32).collect();
            let mut want = vec![f32::NAN; rows * w];
            twin::attn_dense_bwd(&qkv, &out, &dout, &lse, &seqs, g, &mut want, false);

            let p = plan(&seqs, &g, rows).unwrap();
            let (dout16, dsum) = prep(&out, &dout, rows, nh, hd);
            let mut got = vec![f32::NAN; rows * w];
            dq(&qkv, &g, &p, &dout16, &lse, &dsum, &mut got);
            dkdv(&qkv, &g, &p, &dout16, &lse, &dsum, &mut got);
            assert!(got.iter().all(|v| v.is_finite()), "hd {hd}: every column of every row is written");
            for (name, cols) in [("dq", 0..q_dim), ("dk", q_dim..q_dim + kv_dim), ("dv", q_dim + kv_dim..w)] {
                let e = rel_cols(&got, &want, w, cols.clone());
                let mx = want.chunks(w).flat_map(|r| r[cols.clone()].iter()).fold(0f32, |a, &b| a.max(b.abs()));
                println!("nh {nh} nkv {nkv} hd {hd}: {name} ‖Δ‖/‖want‖ = {e:.2e}");
                assert!(e < 1e-2, "hd {hd} {name}: relative error {e}");
                for (r, (ra, rb)) in got.chunks(w).zip(want.chunks(w)).enumerate() {
                    for c in cols.clone() {
                        assert!((ra[c] - rb[c]).abs() <= 3e-2 * mx, "hd {hd} {name} row {r} col {c}: {} vs {}", ra[c], rb[c]);
                    }
                }
            }
        }
    }
}
