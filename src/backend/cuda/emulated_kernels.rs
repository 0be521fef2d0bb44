//! The mma-free kernels that no backend op exercises alone (they sit behind tensor-core kernels
//! in attention.cu / attention_dense.cu), run from their real PTX on the emulated device against
//! host references; and the interpreter's coverage: every kernel the backend loads decodes,
//! those with `mma.sync` / `cp.async` included.
use super::attention::AttnSeqDev;
use super::{CudaBackend, Dtype, KERNEL_TABLE};
use half::bf16;

fn emulated() -> Option<CudaBackend> {
    match CudaBackend::emulated() {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// Deterministic values in [-1, 1).
fn vals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Since the interpreter models `mma.sync` and `cp.async` (issue 54, branch emu-mma), every
/// kernel decodes, the tensor-core ones included.
#[test]
fn every_kernel_decodes() {
    let Some(be) = emulated() else { return };
    let (mut n, mut tensor) = (0, 0);
    for &(module, names) in KERNEL_TABLE {
        let ptx = super::device::embedded_kernels().iter().find(|k| k.0 == module).unwrap().2;
        for &name in names {
            let start = ptx.find(&format!(".entry {name}(")).unwrap();
            let body = &ptx[start..];
            let body = &body[..body[1..].find(".entry ").map(|i| i + 1).unwrap_or(body.len())];
            if let Some(why) = be.emulator_unsupported(name) {
                panic!("{name} does not decode: {why}");
            }
            n += 1;
            tensor += (body.contains("mma.sync") || body.contains("cp.async")) as usize;
        }
    }
    println!("{n} kernels decode, {tensor} of them with mma.sync / cp.async");
    assert!(n >= 50 && tensor >= 8, "{n} kernels, {tensor} with tensor cores");
}

/// attn_combine: M = max m_s, L = Σ l_s·2^(m_s − M), O = Σ O_s·2^(m_s − M) / L, bf16 out; a
/// split with m = −inf (no visible key) weighs nothing.
#[test]
fn attn_combine_merges_split_partials() {
    let Some(be) = emulated() else { return };
    let (hd, group, n_kv, n_splits) = (64usize, 3usize, 2usize, 4usize);
    let q_dim = n_kv * group * hd;
    // one decode sequence (n_q = 1) at output row 2 of 4
    let seq = AttnSeqDev { q_row: 2, n_q: 1, ctx_len: 1000, page_off: 0, n_splits: n_splits as i32, split_len: 256, part_base: 0, pad: 0 };
    let n_rows = group;
    let slots = n_kv * n_rows * n_splits;
    let part_o = vals(slots * hd, 1);
    let mut part_ml: Vec<f32> = vals(slots * 2, 2).iter().map(|v| v * 8.0).collect();
    for e in 0..n_kv * n_rows {
        for s in 0..n_splits {
            let i = (e * n_splits + s) * 2;
            part_ml[i + 1] = part_ml[i + 1].abs() + 0.5; // l > 0
        }
    }
    part_ml[2 * 5] = f32::NEG_INFINITY; // slot 5 (entry 1, split 1) saw no key
    part_ml[2 * 5 + 1] = 0.0;
    let entries: Vec<[i32; 2]> = (0..(n_kv * n_rows) as i32).map(|e| [0, e]).collect();
    let _op = be.enter().unwrap();
    let up = |bytes: &[u8]| {
        let mut m = be.alloc(bytes.len()).unwrap();
        be.htod(bytes, &mut m).unwrap();
        m
    };
    let (po, pm, en, sq) = (up(bytemuck::cast_slice(&part_o)), up(bytemuck::cast_slice(&part_ml)), up(bytemuck::cast_slice(&entries)), up(bytemuck::bytes_of(&seq)));
    let out = be.alloc_zeroed(4 * q_dim * 2).unwrap();
    let (pop, pmp, enp, sqp, op) = (po.ptr(), pm.ptr(), en.ptr(), sq.ptr(), out.ptr());
    let (hd32, g32, qd32) = (hd as i32, group as i32, q_dim as i32);
    launch!(be, "attn_combine", entries.len(), 64, pop, pmp, enp, sqp, hd32, g32, qd32, op).unwrap();
    let got: Vec<f32> = be.dtoh::<u16>(out.ptr(), 4 * q_dim).unwrap().into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
    for e in 0..n_kv * n_rows {
        let (kvh, r) = (e / n_rows, e % n_rows);
        let ml = |s: usize| (part_ml[(e * n_splits + s) * 2] as f64, part_ml[(e * n_splits + s) * 2 + 1] as f64);
        let mx = (0..n_splits).map(|s| ml(s).0).fold(f64::NEG_INFINITY, f64::max);
        let l: f64 = (0..n_splits).filter(|&s| ml(s).0.is_finite()).map(|s| ml(s).1 * (ml(s).0 - mx).exp2()).sum();
        for d in 0..hd {
            let o: f64 = (0..n_splits).filter(|&s| ml(s).0.is_finite()).map(|s| part_o[(e * n_splits + s) * hd + d] as f64 * (ml(s).0 - mx).exp2()).sum();
            let want = o / l;
            let g = got[2 * q_dim + (kvh * group + r) * hd + d] as f64;
            // bf16 output (2^-8 relative) + f32 sums and ex2.approx (2 ulp each)
            let scale: f64 = (0..n_splits).map(|s| (part_o[(e * n_splits + s) * hd + d] as f64).abs()).sum::<f64>() / l.min(1.0);
            assert!((g - want).abs() <= want.abs() / 256.0 + 1e-5 * scale + 1e-6, "entry {e} d {d}: {g} vs {want}");
        }
    }
    // rows of other sequences untouched
    assert!(got[..2 * q_dim].iter().chain(&got[3 * q_dim..]).all(|&v| v == 0.0));
}

/// attn_bwd_prep: D[row, h] = Σ_d dO·O over the head (a warp sum), and dO rounded to bf16.
#[test]
fn attn_bwd_prep_row_sums_and_bf16_copy() {
    let Some(be) = emulated() else { return };
    let (rows, nh, hd) = (7usize, 3usize, 64usize);
    let n = rows * nh * hd;
    let (o, g) = (vals(n, 3), vals(n, 4));
    for (to, td) in [(Dtype::F32, Dtype::F32), (Dtype::F32, Dtype::Bf16), (Dtype::Bf16, Dtype::F32), (Dtype::Bf16, Dtype::Bf16)] {
        let r = |v: &[f32], t: Dtype| -> Vec<f32> { v.iter().map(|&x| if t == Dtype::Bf16 { bf16::from_f32(x).to_f32() } else { x }).collect() };
        let (o, g) = (r(&o, to), r(&g, td));
        let (ob, gb) = (be.upload_as(&o, to).unwrap(), be.upload_as(&g, td).unwrap());
        let _op = be.enter().unwrap();
        let (do16, dsum) = (be.alloc(n * 2).unwrap(), be.alloc(rows * nh * 4).unwrap());
        let (outp, doutp, rows32, nh32, hd32, d16, dsp) = (ob.ptr(), gb.ptr(), rows as i32, nh as i32, hd as i32, do16.ptr(), dsum.ptr());
        let name = format!("attn_bwd_prep_{}_{}", to.name(), td.name());
        launch!(be, &name, (rows * nh).div_ceil(8), 256, outp, doutp, rows32, nh32, hd32, d16, dsp).unwrap();
        let sums: Vec<f32> = be.dtoh(dsum.ptr(), rows * nh).unwrap();
        let copy: Vec<u16> = be.dtoh(do16.ptr(), n).unwrap();
        for w in 0..rows * nh {
            let want: f64 = (0..hd).map(|d| g[w * hd + d] as f64 * o[w * hd + d] as f64).sum();
            let mag: f64 = (0..hd).map(|d| (g[w * hd + d] as f64 * o[w * hd + d] as f64).abs()).sum();
            // f32 products and a warp-order f32 sum: ≤ hd·2^-24 of Σ|dO·O|
            assert!((sums[w] as f64 - want).abs() <= hd as f64 * 6e-8 * mag + 1e-7, "{name} row·head {w}: {} vs {want}", sums[w]);
        }
        for i in 0..n {
            assert_eq!(copy[i], bf16::from_f32(g[i]).to_bits(), "{name} dout16[{i}]");
        }
    }
}
