//! Row movement on the CPU (twin of kernels/memory.cu, launched by src/backend/cuda/memory.rs):
//! embedding lookup, row gather, the row scaling and scatter-add of the head's backward, and the
//! strided transpose the attention kernels use for their Kᵀ panels. (The paged KV cache's store
//! lives with the cache, in `attention.rs`.)

pub fn embed(table: &[f32], ids: &[u32], d: usize, out: &mut [f32]) {
    for (row, &id) in out.chunks_exact_mut(d).zip(ids) {
        let id = id as usize;
        row.copy_from_slice(&table[id * d..(id + 1) * d]);
    }
}

pub fn gather_rows(x: &[f32], rows: &[u32], d: usize, out: &mut [f32]) {
    for (o, &r) in out.chunks_exact_mut(d).zip(rows) {
        let r = r as usize;
        o.copy_from_slice(&x[r * d..(r + 1) * d]);
    }
}

/// `x[r, :] *= coef[r]`, rows of `d`.
pub fn scale_rows(x: &mut [f32], coef: &[f32], d: usize) {
    for (row, &c) in x.chunks_exact_mut(d).zip(coef) {
        for v in row {
            *v *= c;
        }
    }
}

/// `dst[rows[i], :] += src[i, :]`, rows of `d`.
pub fn scatter_add_rows(src: &[f32], rows: &[u32], d: usize, dst: &mut [f32]) {
    for (s, &r) in src.chunks_exact(d).zip(rows) {
        let r = r as usize;
        for (a, b) in dst[r * d..(r + 1) * d].iter_mut().zip(s) {
            *a += b;
        }
    }
}

/// `dst[c·dst_rs + r] = src[r·src_rs + c]` for `rows × cols`: the attention kernels keep Kᵀ
/// (and dKᵀ, dVᵀ) with the key index contiguous, so their GEMMs read B row-major.
///
/// # Safety
/// Both strided extents must be valid and must not overlap.
pub unsafe fn transpose(src: *const f32, src_rs: usize, rows: usize, cols: usize, dst: *mut f32, dst_rs: usize) {
    for r in 0..rows {
        for c in 0..cols {
            *dst.add(c * dst_rs + r) = *src.add(r * src_rs + c);
        }
    }
}
