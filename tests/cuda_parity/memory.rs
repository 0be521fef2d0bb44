//! Row movement (kernels/memory.cu ↔ src/backend/cpu/memory.rs).
use super::*;

#[test]
fn embed_and_gather_rows() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(3);
    let (vocab, d) = (1000, 96);
    let table = CpuBuf::from(randn_bf(&mut rng, vocab * d, 1.0));
    let ids: Vec<u32> = (0..40).map(|_| rng.below(vocab as u64) as u32).collect();
    let dt = be.upload(&table).unwrap();
    let mut e = be.zeros(ids.len() * d).unwrap();
    be.embed(&dt, &ids, d, &mut e).unwrap();
    let mut ew = CpuBuf::from(vec![0f32; ids.len() * d]);
    cpu.embed(&table, &ids, d, &mut ew).unwrap();
    check("embed (exact: bf16 table widened to f32)", &be.download(&e).unwrap(), &ew, 0.0, 0.0);

    let rows: Vec<u32> = vec![39, 0, 7, 7];
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let x = be.upload_as(&ew, dtype).unwrap();
        let mut o = be.zeros(rows.len() * d).unwrap();
        be.gather_rows(&x, &rows, d, &mut o).unwrap();
        let mut ow = CpuBuf::from(vec![0f32; rows.len() * d]);
        cpu.gather_rows(&ew, &rows, d, &mut ow).unwrap();
        check("gather_rows (exact copy)", &be.download(&o).unwrap(), &ow, 0.0, 0.0);
    }
}

#[test]
fn scale_and_scatter_add_rows() {
    let be = cuda_or_skip!();
    let cpu = CpuBackend::new();
    let mut rng = Rng::new(6);
    let (rows, d) = (37, 896);
    let x = CpuBuf::from(randn(&mut rng, rows * d, 1.0));
    let coef = randn(&mut rng, rows, 1.0);
    let mut dx = up(be, &x, Dtype::F32);
    be.scale_rows(&mut dx, &coef, d).unwrap();
    let mut wx = x.clone();
    cpu.scale_rows(&mut wx, &coef, d).unwrap();
    check("scale_rows (one f32 product)", &be.download(&dx).unwrap(), &wx, 0.0, 0.0);

    let dst0 = CpuBuf::from(randn(&mut rng, 100 * d, 1.0));
    let sel: Vec<u32> = vec![99, 0, 17, 50, 3];
    let src = CpuBuf::from(randn(&mut rng, sel.len() * d, 1.0));
    let mut dd = up(be, &dst0, Dtype::F32);
    be.scatter_add_rows(&up(be, &src, Dtype::F32), &sel, d, &mut dd).unwrap();
    let mut wd = dst0.clone();
    cpu.scatter_add_rows(&src, &sel, d, &mut wd).unwrap();
    check("scatter_add_rows (one f32 add)", &be.download(&dd).unwrap(), &wd, 0.0, 0.0);
    assert!(be.scatter_add_rows(&up(be, &src[..2 * d], Dtype::F32), &[4, 4], d, &mut dd).is_err(), "repeated rows are refused");
}
