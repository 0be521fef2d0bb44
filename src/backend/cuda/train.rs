//! `TrainBackend for CudaBackend`: the LoRA training step on the device.
//!
//! Which op runs where (kernels/*.cu unless cuBLASLt):
//! - `attn_dense` / `attn_dense_bwd`: attention_dense.cu / attention_bwd.cu (flash style, lse
//!   kept, no [T, T]); the f32 qkv is rounded once to a bf16 scratch copy for the tensor cores;
//! - `rmsnorm_bwd`, `rope_bwd`, `swiglu_bwd`: norm_bwd.cu, rope.cu, swiglu_bwd.cu;
//! - `matmul_dx`, `lora_bwd`, `lora_merge`'s terms: cuBLASLt (bf16 operands, f32 accumulation),
//!   with the transposed layouts of gemm.rs;
//! - `head_grad`: cuBLASLt logits tiles + logprob.cu's `logprob_tile` (pass 1) + head_bwd.cu
//!   (pass 2: probabilities, entropy, then `g += P·W_tile` by cuBLASLt, then `− W_target`);
//! - `scale_rows`, `scatter_add_rows`: rows.cu; `sum_squares`, `scale`, `adamw`: optim.cu;
//!   `accumulate`: norm.cu's `add` kernels; `copy`: a device-to-device copy.
//! Dtypes (module doc of `cuda`): gradients f32; GEMM inputs rounded to bf16 on the way in;
//! LoRA parameters become f32 masters with a bf16 shadow at their first `adamw`.
use super::{gemm, grid_for, train_attn, CudaBackend, CudaBuf, Dtype, LoraTerm, HEAD_DIMS, LOGPROB_MAX_ROWS, LOGPROB_SCRATCH, LP_THREADS, NORM_THREADS};
use crate::backend::{AdamWConstants, AdamWStep, DenseSeq, HeadOut, TrainBackend};
use crate::backend::AttnGeom;
use anyhow::{anyhow, bail, ensure, Result};
use std::ffi::c_void;

/// Blocks of the sum-of-squares reduction (at most; fewer for short inputs).
const SS_BLOCKS: usize = 256;
const OPT_THREADS: u32 = 256;

impl CudaBackend {
    /// A bf16 copy of the fused `qkv` rows for the attention kernels: the buffer itself when it
    /// is bf16, else the f32 values rounded into a scratch buffer (valid for this op).
    fn qkv_bf16(&self, qkv: &CudaBuf, n: usize) -> Result<u64> {
        if qkv.dtype == Dtype::Bf16 {
            return Ok(qkv.ptr());
        }
        let dst = self.scratch("attn_qkv16", n * 2)?;
        let (src, n64) = (qkv.ptr(), n as i64);
        launch!(self, "f32_to_bf16", grid_for(n, 256), 256, src, dst, n64)?;
        Ok(dst)
    }

    /// Check a gradient buffer that an op accumulates into: f32 (every `zeros` is), long enough.
    fn grad_acc(buf: &mut CudaBuf, n: usize, op: &str, what: &str) -> Result<u64> {
        ensure!(buf.dtype == Dtype::F32, "cuda {op}: {what} accumulates in f32 and must be an f32 buffer (from zeros)");
        buf.need(n, op, what)?;
        buf.touch();
        Ok(buf.ptr())
    }

    /// Run the dense-attention plan checks shared by the forward and the backward.
    fn dense_plan(&self, qkv: &CudaBuf, seqs: &[DenseSeq], g: &AttnGeom) -> Result<train_attn::DensePlan> {
        ensure!(HEAD_DIMS.contains(&g.head_dim), "cuda dense attention: head_dim {} not in {:?}", g.head_dim, HEAD_DIMS);
        let width = g.qkv_dim();
        let p = train_attn::plan(seqs, g, qkv.len / width.max(1))?;
        qkv.need(p.rows * width, "dense attention", "qkv")?;
        Ok(p)
    }
}

impl TrainBackend for CudaBackend {
    /// `INFOMEM_KEEP_ACTIVATIONS_MB` if set; else a share of the device memory usable now (the
    /// rollout's KV cache is freed before the update), after the recompute pass's own working
    /// set: `memory::keep_budget`. On an H200 this keeps every layer of a 0.5B model's 8 × 4096
    /// batch and spares the recompute's forward.
    fn keep_activation_bytes(&self, working_set: usize) -> Result<usize> {
        if let Some(b) = crate::backend::keep_override()? {
            return Ok(b);
        }
        Ok(super::memory::keep_budget(self.mem_info()?.usable(), working_set))
    }

    fn copy(&self, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        ensure!(src.len == dst.len, "copy: {} elements into a buffer of {}", src.len, dst.len);
        let bytes = src.len * src.dtype.size();
        ensure!(dst.mem.len() >= bytes, "copy: {bytes} bytes into a buffer of {} bytes", dst.mem.len());
        dst.touch();
        if bytes > 0 {
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst.ptr(), src.ptr(), bytes, self.stream.cu_stream()) }.map_err(|e| self.err("device copy", e))?;
        }
        dst.dtype = src.dtype;
        // the copy stands for the same value: same pending LoRA terms, and an f32 parameter's
        // bf16 shadow is copied along so the copy can serve as a weight too
        dst.terms = src.terms.clone();
        if let Some(sh) = &src.shadow {
            let s2 = self.alloc(src.len * 2)?;
            unsafe { cudarc::driver::result::memcpy_dtod_async(s2.ptr(), sh.ptr(), src.len * 2, self.stream.cu_stream()) }.map_err(|e| self.err("device copy", e))?;
            dst.shadow = Some(s2);
        }
        Ok(())
    }

    fn lora_merge(&self, w: &mut CudaBuf, row0: usize, a: &CudaBuf, b: &CudaBuf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()> {
        let _op = self.enter()?;
        ensure!(w.dtype == Dtype::Bf16 && w.shadow.is_none(), "cuda lora_merge: the merged weight must be a bf16 copy of a frozen weight");
        w.need((row0 + n_out) * k, "lora_merge", "the weight")?;
        let ap = self.weight_ptr(a, r * k, "lora_merge", "A")?;
        let bp = self.weight_ptr(b, n_out * r, "lora_merge", "B")?;
        if n_out > 0 && r > 0 {
            // lazy: matmul / matmul_dx / download apply it (module doc)
            w.terms.push(LoraTerm { row0, a: ap, b: bp, scale, k, r, n_out });
        }
        Ok(())
    }

    fn attn_dense(&self, qkv: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, out: &mut CudaBuf, lse: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        let p = self.dense_plan(qkv, seqs, &g)?;
        if p.rows == 0 {
            return Ok(());
        }
        let (width, q_dim, kv_dim, nh) = (g.qkv_dim(), g.q_dim(), g.kv_dim(), g.n_heads);
        out.set_output(p.rows * q_dim, Dtype::Bf16, "attn_dense")?;
        lse.set_output(p.rows * nh, Dtype::F32, "attn_dense")?;
        let q16 = self.qkv_bf16(qkv, p.rows * width)?;
        let sp = self.meta("dense_seqs", bytemuck::cast_slice(&p.seqs))?;
        let ip = self.meta("dense_q_items", bytemuck::cast_slice(&p.q_items))?;
        let (op, lp) = (out.ptr(), lse.ptr());
        let (w32, q32, kv32, grp, nh32) = (width as i32, q_dim as i32, kv_dim as i32, (g.n_heads / g.n_kv_heads) as i32, nh as i32);
        let scale_log2 = (1.0 / (g.head_dim as f32).sqrt()) * std::f32::consts::LOG2_E;
        let name = format!("attn_dense_fwd_hd{}", g.head_dim);
        launch!(self, &name, p.q_items.len(), train_attn::THREADS, q16, w32, q32, kv32, grp, nh32, sp, ip, op, lp, scale_log2)
    }

    fn attn_dense_bwd(&self, qkv: &CudaBuf, out: &CudaBuf, dout: &CudaBuf, lse: &CudaBuf, seqs: &[DenseSeq], g: AttnGeom, dqkv: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        let p = self.dense_plan(qkv, seqs, &g)?;
        if p.rows == 0 {
            return Ok(());
        }
        let (width, q_dim, kv_dim, nh, hd) = (g.qkv_dim(), g.q_dim(), g.kv_dim(), g.n_heads, g.head_dim);
        out.need(p.rows * q_dim, "attn_dense_bwd", "out")?;
        dout.need(p.rows * q_dim, "attn_dense_bwd", "dout")?;
        ensure!(lse.dtype == Dtype::F32, "cuda attn_dense_bwd: lse must be the f32 buffer attn_dense wrote");
        lse.need(p.rows * nh, "attn_dense_bwd", "lse")?;
        dqkv.set_output(p.rows * width, Dtype::F32, "attn_dense_bwd")?;
        let q16 = self.qkv_bf16(qkv, p.rows * width)?;
        // D = rowsum(dO ∘ O) and the bf16 dO
        let do16 = self.scratch("attn_dout16", p.rows * q_dim * 2)?;
        let dsum = self.scratch("attn_dsum", p.rows * nh * 4)?;
        let (outp, doutp, rows32, nh32, hd32) = (out.ptr(), dout.ptr(), p.rows as i32, nh as i32, hd as i32);
        let prep = format!("attn_bwd_prep_{}_{}", out.dtype.suffix(), dout.dtype.suffix());
        launch!(self, &prep, (p.rows * nh).div_ceil(8), 256, outp, doutp, rows32, nh32, hd32, do16, dsum)?;
        let sp = self.meta("dense_seqs", bytemuck::cast_slice(&p.seqs))?;
        let qip = self.meta("dense_q_items", bytemuck::cast_slice(&p.q_items))?;
        let kip = self.meta("dense_k_items", bytemuck::cast_slice(&p.k_items))?;
        let (lp, dp) = (lse.ptr(), dqkv.ptr());
        let (w32, q32, kv32, grp) = (width as i32, q_dim as i32, kv_dim as i32, (g.n_heads / g.n_kv_heads) as i32);
        let scale = 1.0 / (hd as f32).sqrt();
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        launch!(self, &format!("attn_dense_dq_hd{hd}"), p.q_items.len(), train_attn::THREADS, q16, w32, q32, kv32, grp, nh32, sp, qip, do16, lp, dsum, dp, scale_log2, scale)?;
        let smem = train_attn::dkdv_smem_bytes(hd);
        launch_dyn!(self, &format!("attn_dense_dkdv_hd{hd}"), p.k_items.len(), train_attn::THREADS, smem, q16, w32, q32, kv32, grp, nh32, sp, kip, do16, lp, dsum, dp, scale_log2, scale)
    }

    fn rmsnorm_bwd(&self, x: &CudaBuf, w: &CudaBuf, dy: &CudaBuf, eps: f32, rows: usize, d: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
        let _op = self.enter()?;
        if rows == 0 {
            return Ok(());
        }
        x.need(rows * d, "rmsnorm_bwd", "x")?;
        dy.need(rows * d, "rmsnorm_bwd", "dy")?;
        let wp = self.weight_ptr(w, d, "rmsnorm_bwd", "the norm weight")?;
        let dxp = if accumulate {
            Self::grad_acc(dx, rows * d, "rmsnorm_bwd", "dx")?
        } else {
            dx.set_output(rows * d, Dtype::F32, "rmsnorm_bwd")?;
            dx.ptr()
        };
        let (xp, dyp, d32, acc) = (x.ptr(), dy.ptr(), d as i32, accumulate as i32);
        let name = format!("rmsnorm_bwd_{}_{}", x.dtype.suffix(), dy.dtype.suffix());
        launch!(self, &name, rows, NORM_THREADS, xp, wp, dyp, eps, d32, dxp, acc)
    }

    fn rope_bwd(&self, dqkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        self.rope_launch("rope_bwd", "dqkv", dqkv, positions, inv_freq, g)
    }

    fn swiglu_bwd(&self, gate_up: &CudaBuf, dact: &CudaBuf, m: usize, i: usize, dgate_up: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if m == 0 || i == 0 {
            return Ok(());
        }
        gate_up.need(m * 2 * i, "swiglu_bwd", "gate_up")?;
        dact.need(m * i, "swiglu_bwd", "dact")?;
        dgate_up.set_output(m * 2 * i, Dtype::F32, "swiglu_bwd")?;
        let (gp, dp, op, m64, i32_) = (gate_up.ptr(), dact.ptr(), dgate_up.ptr(), m as i64, i as i32);
        let name = format!("swiglu_bwd_{}_{}", gate_up.dtype.suffix(), dact.dtype.suffix());
        launch!(self, &name, grid_for(m * i, 256), 256, gp, dp, m64, i32_, op)
    }

    fn matmul_dx(&self, dy: &CudaBuf, w: &CudaBuf, m: usize, n: usize, k: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
        let _op = self.enter()?;
        if m == 0 || k == 0 {
            return Ok(());
        }
        dy.need(m * n, "matmul_dx", "dy")?;
        let wp = self.base_weight_ptr(w, n, k, "matmul_dx")?;
        let dxp = if accumulate {
            Self::grad_acc(dx, m * k, "matmul_dx", "dx")?
        } else {
            dx.set_output(m * k, Dtype::F32, "matmul_dx")?;
            dx.ptr()
        };
        if n == 0 {
            if !accumulate {
                unsafe { cudarc::driver::sys::cuMemsetD8Async(dxp, 0, m * k * 4, self.stream.cu_stream()) }.result().map_err(|e| self.err("memset", e))?;
            }
            return Ok(());
        }
        let (dyp, _keep) = self.bf16_input(dy, m * n)?;
        // dx [m, k] (+)= dy [m, n] · W [n, k]: W stored [n, k] is "[K, N]" → wt
        let beta = if accumulate { 1.0 } else { 0.0 };
        self.gemm(gemm::GemmArgs { m, n: k, k: n, x: dyp, ldx: n, w: wp, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta, xt: false, wt: true })?;
        // pending LoRA pairs: dx += scale·(dy[:, row0..] B) A
        for t in &w.terms {
            let du = self.scratch("lora_du", m * t.r * 2)?;
            self.gemm(gemm::GemmArgs { m, n: t.r, k: t.n_out, x: dyp + (t.row0 * 2) as u64, ldx: n, w: t.b, ldw: t.r, y: du, ldy: t.r, y_bf16: true, alpha: t.scale, beta: 0.0, xt: false, wt: true })?;
            self.gemm(gemm::GemmArgs { m, n: k, k: t.r, x: du, ldx: t.r, w: t.a, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: false, wt: true })?;
        }
        Ok(())
    }

    fn lora_bwd(
        &self,
        x: &CudaBuf,
        a: &CudaBuf,
        b: &CudaBuf,
        scale: f32,
        m: usize,
        k: usize,
        r: usize,
        n_out: usize,
        dy: &CudaBuf,
        col0: usize,
        ld: usize,
        da: &mut CudaBuf,
        db: &mut CudaBuf,
        dx: Option<&mut CudaBuf>,
    ) -> Result<()> {
        let _op = self.enter()?;
        ensure!(col0 + n_out <= ld, "lora_bwd: column slice {col0}+{n_out} outside rows of {ld}");
        ensure!(da.len == r * k && db.len == n_out * r, "lora_bwd: gradient buffers do not match A [{r}, {k}], B [{n_out}, {r}]");
        if m == 0 || r == 0 || n_out == 0 || k == 0 {
            return Ok(());
        }
        x.need(m * k, "lora_bwd", "x")?;
        dy.need(m * ld, "lora_bwd", "dy")?;
        let ap = self.weight_ptr(a, r * k, "lora_bwd", "A")?;
        let bp = self.weight_ptr(b, n_out * r, "lora_bwd", "B")?;
        let dap = Self::grad_acc(da, r * k, "lora_bwd", "dA")?;
        let dbp = Self::grad_acc(db, n_out * r, "lora_bwd", "dB")?;
        let dxp = match dx {
            Some(dx) => Some(Self::grad_acc(dx, m * k, "lora_bwd", "dx")?),
            None => None,
        };
        let (xp, _kx) = self.bf16_input(x, m * k)?;
        let (dyp, _kd) = self.bf16_input(dy, m * ld)?;
        let dys = dyp + (col0 * 2) as u64; // the column slice, rows of ld
        let u = self.scratch("lora_u", m * r * 2)?;
        let du = self.scratch("lora_du", m * r * 2)?;
        // u [m, r] = x · Aᵀ (recomputed; bf16 as the forward's)
        self.gemm(gemm::GemmArgs { m, n: r, k, x: xp, ldx: k, w: ap, ldw: k, y: u, ldy: r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        // dB [n_out, r] += scale · dy_sᵀ u: X = dy_sᵀ (dy_s stored [m, n_out]: xt), W = uᵀ (u stored [m, r]: wt)
        self.gemm(gemm::GemmArgs { m: n_out, n: r, k: m, x: dys, ldx: ld, w: u, ldw: r, y: dbp, ldy: r, y_bf16: false, alpha: scale, beta: 1.0, xt: true, wt: true })?;
        // du [m, r] = scale · dy_s B (B stored [n_out, r]: wt)
        self.gemm(gemm::GemmArgs { m, n: r, k: n_out, x: dys, ldx: ld, w: bp, ldw: r, y: du, ldy: r, y_bf16: true, alpha: scale, beta: 0.0, xt: false, wt: true })?;
        // dA [r, k] += duᵀ x: X = duᵀ (du stored [m, r]: xt), W = xᵀ (x stored [m, k]: wt)
        self.gemm(gemm::GemmArgs { m: r, n: k, k: m, x: du, ldx: r, w: xp, ldw: k, y: dap, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: true, wt: true })?;
        if let Some(dxp) = dxp {
            // dx [m, k] += du A (A stored [r, k]: wt)
            self.gemm(gemm::GemmArgs { m, n: k, k: r, x: du, ldx: r, w: ap, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: false, wt: true })?;
        }
        Ok(())
    }

    fn head_grad(&self, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize, g: &mut CudaBuf) -> Result<HeadOut> {
        let _op = self.enter()?;
        let rows = targets.len();
        if rows == 0 {
            return Ok(HeadOut::default());
        }
        if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("head_grad: target id {t} is outside the vocabulary (size {vocab})");
        }
        h.need(rows * d, "head_grad", "h")?;
        let wp = self.weight_ptr(head, vocab * d, "head_grad", "the head")?;
        let (hp, _keep) = self.bf16_input(h, rows * d)?;
        g.set_output(rows * d, Dtype::F32, "head_grad")?;
        let gp = g.ptr();
        let mut out = HeadOut { logprobs: Vec::with_capacity(rows), entropy: Vec::with_capacity(rows) };
        for r0 in (0..rows).step_by(LOGPROB_MAX_ROWS) {
            let rb = LOGPROB_MAX_ROWS.min(rows - r0);
            // vocabulary tile as in `logprobs`: as wide as the scratch allows, 256-column multiples
            let vt = ((LOGPROB_SCRATCH / rb) / 256 * 256).clamp(256, vocab.next_multiple_of(256)).min(vocab);
            let logits = self.scratch("lp_logits", rb * vt * 4)?;
            // probability rows padded to a multiple of 8 columns: 16-byte aligned GEMM operand rows
            let ldp = vt.next_multiple_of(8);
            let probs = self.scratch("head_probs", rb * ldp * 2)?;
            let state = self.scratch("head_state", rb * 4 * 4)?;
            let (run_m, run_s, tgt, ent) = (state, state + (rb * 4) as u64, state + (rb * 8) as u64, state + (rb * 12) as u64);
            let tp = self.meta("targets", bytemuck::cast_slice(&targets[r0..r0 + rb]))?;
            let hrows = hp + (r0 * d * 2) as u64;
            let grows = gp + (r0 * d * 4) as u64;
            // pass 1: running max / sum and the target logit (logprob.cu)
            for v0 in (0..vocab).step_by(vt) {
                let vn = vt.min(vocab - v0);
                let w = wp + (v0 * d * 2) as u64;
                self.gemm(gemm::GemmArgs { m: rb, n: vn, k: d, x: hrows, ldx: d, w, ldw: d, y: logits, ldy: vn, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
                let (vn32, v032, first) = (vn as i32, v0 as i32, (v0 == 0) as i32);
                launch!(self, "logprob_tile", rb, LP_THREADS, logits, vn32, v032, tp, run_m, run_s, tgt, first)?;
            }
            // pass 2: P = exp(l − lse) per tile, entropy, g += P·W_tile (W_tile stored [vn, d]: wt)
            for v0 in (0..vocab).step_by(vt) {
                let vn = vt.min(vocab - v0);
                let w = wp + (v0 * d * 2) as u64;
                self.gemm(gemm::GemmArgs { m: rb, n: vn, k: d, x: hrows, ldx: d, w, ldw: d, y: logits, ldy: vn, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
                let (vn32, ldp32, first) = (vn as i32, ldp as i32, (v0 == 0) as i32);
                launch!(self, "head_probs_tile", rb, LP_THREADS, logits, vn32, run_m, run_s, probs, ldp32, ent, first)?;
                let beta = if v0 == 0 { 0.0 } else { 1.0 };
                self.gemm(gemm::GemmArgs { m: rb, n: d, k: vn, x: probs, ldx: ldp, w, ldw: d, y: grows, ldy: d, y_bf16: false, alpha: 1.0, beta, xt: false, wt: true })?;
            }
            let d32 = d as i32;
            launch!(self, "head_grad_finish", rb, LP_THREADS, grows, wp, tp, d32)?;
            let st: Vec<f32> = self.dtoh(state, rb * 4)?;
            let (m, s, t, e) = (&st[..rb], &st[rb..2 * rb], &st[2 * rb..3 * rb], &st[3 * rb..]);
            out.logprobs.extend((0..rb).map(|i| (t[i] as f64 - m[i] as f64 - (s[i] as f64).ln()) as f32));
            out.entropy.extend_from_slice(e);
        }
        Ok(out)
    }

    fn scale_rows(&self, x: &mut CudaBuf, coef: &[f32], d: usize) -> Result<()> {
        let _op = self.enter()?;
        let rows = coef.len();
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let xp = Self::grad_acc(x, rows * d, "scale_rows", "x")?;
        let cp = self.meta("row_coef", bytemuck::cast_slice(coef))?;
        let d32 = d as i32;
        launch!(self, "scale_rows_f32", rows, 256, xp, cp, d32)
    }

    fn scatter_add_rows(&self, src: &CudaBuf, rows: &[u32], d: usize, dst: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if rows.is_empty() || d == 0 {
            return Ok(());
        }
        src.need(rows.len() * d, "scatter_add_rows", "src")?;
        let n_dst = dst.len / d;
        let mut seen = vec![false; n_dst];
        for &r in rows {
            let r = r as usize;
            ensure!(r < n_dst, "cuda scatter_add_rows: row {r} beyond the destination's {n_dst} rows");
            // distinct rows: one block per row writes it, no atomics (rows.cu)
            ensure!(!std::mem::replace(&mut seen[r], true), "cuda scatter_add_rows: row {r} appears twice");
        }
        let dp = Self::grad_acc(dst, n_dst * d, "scatter_add_rows", "dst")?;
        let rp = self.meta("rows", bytemuck::cast_slice(rows))?;
        let (sp, d32) = (src.ptr(), d as i32);
        launch!(self, &format!("scatter_add_rows_{}", src.dtype.suffix()), rows.len(), 256, sp, rp, d32, dp)
    }

    fn sum_squares(&self, x: &CudaBuf) -> Result<f64> {
        let _op = self.enter()?;
        let n = x.len;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = n.div_ceil(OPT_THREADS as usize).min(SS_BLOCKS);
        let partial = self.scratch("ss_partial", blocks * 8)?;
        let (xp, n64) = (x.ptr(), n as i64);
        launch!(self, &format!("sum_squares_{}", x.dtype.suffix()), blocks, OPT_THREADS, xp, n64, partial)?;
        // the partials in block order: a fixed summation order
        Ok(self.dtoh::<f64>(partial, blocks)?.iter().sum())
    }

    fn scale(&self, x: &mut CudaBuf, s: f32) -> Result<()> {
        let _op = self.enter()?;
        let n = x.len;
        if n == 0 {
            return Ok(());
        }
        let xp = Self::grad_acc(x, n, "scale", "x")?;
        let n64 = n as i64;
        launch!(self, "scale_f32", grid_for(n, 256), 256, xp, s, n64)
    }

    fn accumulate(&self, acc: &mut CudaBuf, x: &CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        ensure!(acc.len == x.len, "accumulate: {} elements into {}", x.len, acc.len);
        let n = acc.len;
        if n == 0 {
            return Ok(());
        }
        let ap = Self::grad_acc(acc, n, "accumulate", "acc")?;
        let (xp, n64) = (x.ptr(), n as i64);
        launch!(self, &format!("add_f32_{}", x.dtype.suffix()), grid_for(n, 256), 256, ap, xp, n64)
    }

    fn adamw(&self, p: &mut CudaBuf, g: &CudaBuf, m: &mut CudaBuf, v: &mut CudaBuf, h: AdamWStep) -> Result<()> {
        let _op = self.enter()?;
        let n = p.len;
        ensure!(g.len == n && m.len == n && v.len == n, "adamw: buffers of different lengths");
        ensure!(g.dtype == Dtype::F32, "cuda adamw: the gradient must be f32");
        if n == 0 {
            return Ok(());
        }
        let mp = Self::grad_acc(m, n, "adamw", "the first moment")?;
        let vp = Self::grad_acc(v, n, "adamw", "the second moment")?;
        p.terms.clear();
        // promote a bf16 parameter to an f32 master; its bf16 bytes become the shadow
        if p.dtype == Dtype::Bf16 {
            let f32mem = self.alloc(n * 4)?;
            let (src, dst, n64) = (p.ptr(), f32mem.ptr(), n as i64);
            launch!(self, "widen_bf16", grid_for(n, 256), 256, src, dst, n64)?;
            let old = std::mem::replace(&mut p.mem, f32mem);
            p.shadow = Some(old);
            p.dtype = Dtype::F32;
        } else if p.shadow.is_none() {
            p.shadow = Some(self.alloc(n * 2)?);
        }
        let shp = p.shadow.as_ref().expect("set just above").ptr();
        // the host constants of the CPU twin (`AdamWStep::constants`)
        let AdamWConstants { step_size, bc2_sqrt, decay } = h.constants();
        let (b1, omb1, b2, omb2, eps, gs) = (h.beta1, 1.0 - h.beta1, h.beta2, 1.0 - h.beta2, h.eps, h.grad_scale);
        let (pp, gp, n64) = (p.ptr(), g.ptr(), n as i64);
        launch!(self, "adamw_f32", grid_for(n, 256), 256, pp, shp, gp, mp, vp, n64, b1, omb1, b2, omb2, eps, decay, step_size, bc2_sqrt, gs)
    }
}
