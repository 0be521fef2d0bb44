//! Row-major GEMMs through cuBLASLt: `y[m, n] = alpha · X[m, k] · W[n, k]ᵀ + beta · y`, bf16
//! inputs, f32 accumulation (CUBLAS_COMPUTE_32F), y in f32 or bf16. `X` is `x` stored `[m, k]`,
//! or (`xt`) `xᵀ` with `x` stored `[k, m]`; `W` is `w` stored `[n, k]`, or (`wt`) `wᵀ` with `w`
//! stored `[k, n]` — the transposed forms serve the backward (`dx = dy·W`, `dA = duᵀ·x`, ...).
//!
//! The row-major trick: a row-major `[r, c]` matrix is a column-major `[c, r]` one. So
//! `yᵀ [n, m] = W [n, k] · Xᵀ [k, m]` in column-major terms, i.e. cuBLASLt's
//! `D (n × m, ld ldy) = op(A) · op(B)` with `A = w`, `B = x`:
//! - `w` stored `[n, k]` is column-major `k × n` (ld ldw): `op(A) = T`; stored `[k, n]` (`wt`) it
//!   is column-major `n × k`: `op(A) = N`;
//! - `x` stored `[m, k]` is column-major `k × m` (ld ldx): `op(B) = N`; stored `[k, m]` (`xt`) it
//!   is column-major `m × k`: `op(B) = T`.
//! The forward's plain case is "TN", the best supported one. The LoRA delta uses the same call
//! with `beta = 1` and a pointer into a column slice of `y` (ld = the full row width).
//! [`describe`] is this mapping as data; a CPU emulation of cuBLASLt's column-major semantics
//! checks it for every transpose combination (tests below).
//!
//! Descriptors, layouts and the heuristic's algorithm are cached per shape (a decode step repeats
//! the same handful of shapes every layer). The heuristic is told the real alignment of every
//! pointer (cuBLASLt assumes 256 bytes otherwise, and a column-slice pointer is not that aligned).
use super::{grid_for, CudaBackend, CudaBuf, Dtype, LoraTerm};
use anyhow::{bail, ensure, Result};
use cudarc::cublaslt::sys::{self as lt, cublasLtMatmulAlgo_t};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// cuBLASLt's recommended workspace on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    ldx: usize,
    ldw: usize,
    ldy: usize,
    y_bf16: bool,
    xt: bool,
    wt: bool,
    align: [u32; 3],
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    cd: lt::cublasLtMatrixLayout_t,
    algo: cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        unsafe {
            lt::cublasLtMatmulDescDestroy(self.desc);
            lt::cublasLtMatrixLayoutDestroy(self.a);
            lt::cublasLtMatrixLayoutDestroy(self.b);
            lt::cublasLtMatrixLayoutDestroy(self.cd);
        }
    }
}

pub struct Gemm {
    handle: lt::cublasLtHandle_t,
    plans: Mutex<HashMap<Key, Plan>>,
}

// The handle and descriptors are plain heap objects of cuBLASLt; every use goes through the
// Mutex (plans) or is a read of the immutable handle, which cuBLASLt allows from any thread.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

impl Drop for Gemm {
    fn drop(&mut self) {
        self.plans.lock().map(|mut p| p.clear()).ok();
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

fn check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        bail!("cuBLASLt {what} failed: {s:?}");
    }
    Ok(())
}

/// Largest power of two (≤ 256) dividing the address.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

/// Why cuBLASLt may find no algorithm: a bf16 operand whose leading dimension is not a multiple
/// of 8 elements (16 bytes), which its tensor-core kernels need — the LoRA GEMMs have the rank
/// as a leading dimension (`x·Aᵀ` then `·Bᵀ` with B stored `[n_out, r]`). Empty when both are.
pub fn ld_hint(ldx: usize, ldw: usize) -> String {
    match [ldx, ldw].into_iter().find(|ld| !ld.is_multiple_of(8)) {
        Some(ld) => format!(
            ": a bf16 leading dimension of {ld} is not a multiple of 8 elements (16 bytes), which cuBLASLt's tensor-core kernels need; \
             with LoRA this is the rank — use a rank that is a multiple of 8 on the CUDA backend"
        ),
        None => String::new(),
    }
}

/// The operands of one GEMM (device pointers; see the module comment for the shapes).
pub struct GemmArgs {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub x: u64,
    pub ldx: usize,
    pub w: u64,
    pub ldw: usize,
    pub y: u64,
    pub ldy: usize,
    pub y_bf16: bool,
    pub alpha: f32,
    pub beta: f32,
    /// `x` is stored `[k, m]` (the product uses its transpose).
    pub xt: bool,
    /// `w` is stored `[k, n]` (the product uses its transpose).
    pub wt: bool,
}

/// A column-major matrix layout: rows, columns, leading dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
}

/// cuBLASLt's view of a row-major GEMM (see the module comment): `D = op(A)·op(B)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LtDesc {
    /// op(A) = Aᵀ
    pub trans_a: bool,
    /// op(B) = Bᵀ
    pub trans_b: bool,
    /// A = w
    pub a: Layout,
    /// B = x
    pub b: Layout,
    /// C = D = y
    pub c: Layout,
}

/// The column-major description of `g`, or why the shapes are inconsistent.
#[allow(clippy::too_many_arguments)]
pub fn describe(m: usize, n: usize, k: usize, ldx: usize, ldw: usize, ldy: usize, xt: bool, wt: bool) -> Result<LtDesc> {
    // row lengths of the stored row-major matrices
    let (x_row, w_row) = (if xt { m } else { k }, if wt { n } else { k });
    if k == 0 || ldx < x_row || ldw < w_row || ldy < n {
        bail!("gemm: bad shape m {m} n {n} k {k} (ld x {ldx} w {ldw} y {ldy}, x{} w{})", if xt { "ᵀ" } else { "" }, if wt { "ᵀ" } else { "" });
    }
    Ok(LtDesc {
        trans_a: !wt,
        trans_b: xt,
        a: if wt { Layout { rows: n, cols: k, ld: ldw } } else { Layout { rows: k, cols: n, ld: ldw } },
        b: if xt { Layout { rows: m, cols: k, ld: ldx } } else { Layout { rows: k, cols: m, ld: ldx } },
        c: Layout { rows: n, cols: m, ld: ldy },
    })
}

impl Gemm {
    pub fn new() -> Result<Self> {
        let mut handle = std::ptr::null_mut();
        check(unsafe { lt::cublasLtCreate(&mut handle) }, "create")?;
        Ok(Gemm { handle, plans: Mutex::new(HashMap::new()) })
    }

    /// # Safety
    /// The pointers must address device memory of the stated shapes; `stream` is the backend's.
    pub unsafe fn run(&self, g: &GemmArgs, workspace: u64, stream: cudarc::driver::sys::CUstream) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        describe(g.m, g.n, g.k, g.ldx, g.ldw, g.ldy, g.xt, g.wt)?;
        let key = Key {
            m: g.m,
            n: g.n,
            k: g.k,
            ldx: g.ldx,
            ldw: g.ldw,
            ldy: g.ldy,
            y_bf16: g.y_bf16,
            xt: g.xt,
            wt: g.wt,
            align: [alignment(g.x), alignment(g.w), alignment(g.y)],
        };
        let mut plans = self.plans.lock().unwrap();
        if !plans.contains_key(&key) {
            let p = self.make_plan(&key)?;
            plans.insert(key, p);
        }
        let p = &plans[&key];
        let (alpha, beta) = (g.alpha, g.beta);
        check(
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                g.w as *const c_void,
                p.a,
                g.x as *const c_void,
                p.b,
                &beta as *const f32 as *const c_void,
                g.y as *const c_void,
                p.cd,
                g.y as *mut c_void,
                p.cd,
                &p.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as lt::cudaStream_t,
            ),
            "matmul",
        )
    }

    unsafe fn make_plan(&self, key: &Key) -> Result<Plan> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let d = describe(key.m, key.n, key.k, key.ldx, key.ldw, key.ldy, key.xt, key.wt)?;
        let bf16 = lt::cudaDataType::CUDA_R_16BF;
        let ytype = if key.y_bf16 { bf16 } else { lt::cudaDataType::CUDA_R_32F };
        let mut desc = std::ptr::null_mut();
        check(lt::cublasLtMatmulDescCreate(&mut desc, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt::cudaDataType::CUDA_R_32F), "desc")?;
        let mut plan = Plan { desc, a: std::ptr::null_mut(), b: std::ptr::null_mut(), cd: std::ptr::null_mut(), algo: std::mem::zeroed() };
        // cublasOperation_t values (an int32 attribute): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        let ta: i32 = d.trans_a as i32;
        let tb: i32 = d.trans_b as i32;
        let sz = std::mem::size_of::<i32>();
        check(lt::cublasLtMatmulDescSetAttribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const _ as *const c_void, sz), "transa")?;
        check(lt::cublasLtMatmulDescSetAttribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const _ as *const c_void, sz), "transb")?;
        // A = w, B = x, C = D = y, column-major as `describe` says.
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.a, bf16, d.a.rows as u64, d.a.cols as u64, d.a.ld as i64), "layout A")?;
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.b, bf16, d.b.rows as u64, d.b.cols as u64, d.b.ld as i64), "layout B")?;
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.cd, ytype, d.c.rows as u64, d.c.cols as u64, d.c.ld as i64), "layout C/D")?;
        let mut pref = std::ptr::null_mut();
        check(lt::cublasLtMatmulPreferenceCreate(&mut pref), "preference")?;
        let ws = WORKSPACE_BYTES as u64;
        let set = |attr: P, v: *const c_void, n: usize| check(lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n), "preference attribute");
        let r = (|| -> Result<cublasLtMatmulAlgo_t> {
            set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8)?;
            // A is w, B is x, C and D are y
            let [ax, aw, ay] = key.align;
            set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw as *const u32 as *const c_void, 4)?;
            set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax as *const u32 as *const c_void, 4)?;
            set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay as *const u32 as *const c_void, 4)?;
            set(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay as *const u32 as *const c_void, 4)?;
            let mut res: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
            let mut count = 0i32;
            check(
                lt::cublasLtMatmulAlgoGetHeuristic(self.handle, desc, plan.a, plan.b, plan.cd, plan.cd, pref, 1, &mut res, &mut count),
                "heuristic",
            )?;
            if count == 0 {
                bail!(
                    "cuBLASLt has no algorithm for m {} n {} k {} (ld {} {} {}, x{} w{}, alignments {:?}, y {}){}",
                    key.m,
                    key.n,
                    key.k,
                    key.ldx,
                    key.ldw,
                    key.ldy,
                    if key.xt { "ᵀ" } else { "" },
                    if key.wt { "ᵀ" } else { "" },
                    key.align,
                    if key.y_bf16 { "bf16" } else { "f32" },
                    ld_hint(key.ldx, key.ldw)
                );
            }
            Ok(res.algo)
        })();
        lt::cublasLtMatmulPreferenceDestroy(pref);
        plan.algo = r?;
        Ok(plan)
    }
}

// ---------------------------------------------------------------------------------------------
// The projections of the transformer through the wrapper above: matmul (+ bias, + a lazily
// merged weight's pending LoRA terms), the LoRA delta, and their backward. CPU twin:
// src/backend/cpu/matmul.rs. Parity test: tests/cuda_parity/gemm.rs.

pub(super) fn matmul(be: &CudaBackend, x: &CudaBuf, w: &CudaBuf, bias: Option<&CudaBuf>, m: usize, k: usize, n: usize, out: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    x.need(m * k, "matmul", "x")?;
    let wp = be.base_weight_ptr(w, n, k, "matmul")?;
    out.set_output(m * n, Dtype::F32, "matmul")?;
    let (xp, _keep) = be.bf16_input(x, m * k)?;
    let yp = out.ptr();
    be.gemm(GemmArgs { m, n, k, x: xp, ldx: k, w: wp, ldw: k, y: yp, ldy: n, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
    if let Some(b) = bias {
        b.need(n, "matmul", "the bias")?;
        let (bp, n32, total) = (b.ptr(), n as i32, (m * n) as i64);
        launch!(be, &format!("add_bias_{}", b.dtype.name()), grid_for(m * n, 256), 256, yp, bp, n32, total)?;
    }
    // a lazily merged weight: y[:, row0..row0 + n_out] += scale·(x Aᵀ) Bᵀ per pending pair
    for t in &w.terms {
        be.lora_delta(xp, m, t, yp + (t.row0 * 4) as u64, n, false)?;
    }
    Ok(())
}

pub(super) fn lora(be: &CudaBackend, x: &CudaBuf, a: &CudaBuf, b: &CudaBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut CudaBuf, col0: usize, ld: usize) -> Result<()> {
    let _op = be.enter()?;
    if m == 0 || n_out == 0 || r == 0 {
        return Ok(());
    }
    ensure!(col0 + n_out <= ld, "cuda lora: columns {col0}..{} beyond rows of {ld}", col0 + n_out);
    x.need(m * k, "lora", "x")?;
    out.touch();
    out.need(m * ld, "lora", "out")?;
    let ap = be.weight_ptr(a, r * k, "lora", "A")?;
    let bp = be.weight_ptr(b, n_out * r, "lora", "B")?;
    let (xp, _keep) = be.bf16_input(x, m * k)?;
    // xa [m, r] = x · Aᵀ (bf16: the next GEMM's input), then out[:, col0..] += scale · xa · Bᵀ
    let xa = be.scratch("lora_xa", m * r * 2)?;
    be.gemm(GemmArgs { m, n: r, k, x: xp, ldx: k, w: ap, ldw: k, y: xa, ldy: r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
    let y = out.ptr() + (col0 * out.dtype.size()) as u64;
    be.gemm(GemmArgs { m, n: n_out, k: r, x: xa, ldx: r, w: bp, ldw: r, y, ldy: ld, y_bf16: out.dtype == Dtype::Bf16, alpha: scale, beta: 1.0, xt: false, wt: false })
}

pub(super) fn matmul_dx(be: &CudaBackend, dy: &CudaBuf, w: &CudaBuf, m: usize, n: usize, k: usize, dx: &mut CudaBuf, accumulate: bool) -> Result<()> {
    let _op = be.enter()?;
    if m == 0 || k == 0 {
        return Ok(());
    }
    dy.need(m * n, "matmul_dx", "dy")?;
    let wp = be.base_weight_ptr(w, n, k, "matmul_dx")?;
    let dxp = if accumulate {
        CudaBackend::grad_acc(dx, m * k, "matmul_dx", "dx")?
    } else {
        dx.set_output(m * k, Dtype::F32, "matmul_dx")?;
        dx.ptr()
    };
    if n == 0 {
        if !accumulate {
            be.dev.memset(dxp, 0, m * k * 4)?;
        }
        return Ok(());
    }
    let (dyp, _keep) = be.bf16_input(dy, m * n)?;
    // dx [m, k] (+)= dy [m, n] · W [n, k]: W stored [n, k] is "[K, N]" → wt
    let beta = if accumulate { 1.0 } else { 0.0 };
    be.gemm(GemmArgs { m, n: k, k: n, x: dyp, ldx: n, w: wp, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta, xt: false, wt: true })?;
    // pending LoRA pairs: dx += scale·(dy[:, row0..] B) A
    for t in &w.terms {
        let du = be.scratch("lora_du", m * t.r * 2)?;
        be.gemm(GemmArgs { m, n: t.r, k: t.n_out, x: dyp + (t.row0 * 2) as u64, ldx: n, w: t.b, ldw: t.r, y: du, ldy: t.r, y_bf16: true, alpha: t.scale, beta: 0.0, xt: false, wt: true })?;
        be.gemm(GemmArgs { m, n: k, k: t.r, x: du, ldx: t.r, w: t.a, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: false, wt: true })?;
    }
    Ok(())
}

pub(super) fn lora_bwd(be: &CudaBackend, x: &CudaBuf, a: &CudaBuf, b: &CudaBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, dy: &CudaBuf, col0: usize, ld: usize, da: &mut CudaBuf, db: &mut CudaBuf, dx: Option<&mut CudaBuf>) -> Result<()> {
    let _op = be.enter()?;
    ensure!(col0 + n_out <= ld, "lora_bwd: column slice {col0}+{n_out} outside rows of {ld}");
    ensure!(da.len == r * k && db.len == n_out * r, "lora_bwd: gradient buffers do not match A [{r}, {k}], B [{n_out}, {r}]");
    if m == 0 || r == 0 || n_out == 0 || k == 0 {
        return Ok(());
    }
    x.need(m * k, "lora_bwd", "x")?;
    dy.need(m * ld, "lora_bwd", "dy")?;
    let ap = be.weight_ptr(a, r * k, "lora_bwd", "A")?;
    let bp = be.weight_ptr(b, n_out * r, "lora_bwd", "B")?;
    let dap = CudaBackend::grad_acc(da, r * k, "lora_bwd", "dA")?;
    let dbp = CudaBackend::grad_acc(db, n_out * r, "lora_bwd", "dB")?;
    let dxp = match dx {
        Some(dx) => Some(CudaBackend::grad_acc(dx, m * k, "lora_bwd", "dx")?),
        None => None,
    };
    let (xp, _kx) = be.bf16_input(x, m * k)?;
    let (dyp, _kd) = be.bf16_input(dy, m * ld)?;
    let dys = dyp + (col0 * 2) as u64; // the column slice, rows of ld
    let u = be.scratch("lora_u", m * r * 2)?;
    let du = be.scratch("lora_du", m * r * 2)?;
    // u [m, r] = x · Aᵀ (recomputed; bf16 as the forward's)
    be.gemm(GemmArgs { m, n: r, k, x: xp, ldx: k, w: ap, ldw: k, y: u, ldy: r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
    // dB [n_out, r] += scale · dy_sᵀ u: X = dy_sᵀ (dy_s stored [m, n_out]: xt), W = uᵀ (u stored [m, r]: wt)
    be.gemm(GemmArgs { m: n_out, n: r, k: m, x: dys, ldx: ld, w: u, ldw: r, y: dbp, ldy: r, y_bf16: false, alpha: scale, beta: 1.0, xt: true, wt: true })?;
    // du [m, r] = scale · dy_s B (B stored [n_out, r]: wt)
    be.gemm(GemmArgs { m, n: r, k: n_out, x: dys, ldx: ld, w: bp, ldw: r, y: du, ldy: r, y_bf16: true, alpha: scale, beta: 0.0, xt: false, wt: true })?;
    // dA [r, k] += duᵀ x: X = duᵀ (du stored [m, r]: xt), W = xᵀ (x stored [m, k]: wt)
    be.gemm(GemmArgs { m: r, n: k, k: m, x: du, ldx: r, w: xp, ldw: k, y: dap, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: true, wt: true })?;
    if let Some(dxp) = dxp {
        // dx [m, k] += du A (A stored [r, k]: wt)
        be.gemm(GemmArgs { m, n: k, k: r, x: du, ldx: r, w: ap, ldw: k, y: dxp, ldy: k, y_bf16: false, alpha: 1.0, beta: 1.0, xt: false, wt: true })?;
    }
    Ok(())
}

pub(super) fn lora_merge(be: &CudaBackend, w: &mut CudaBuf, row0: usize, a: &CudaBuf, b: &CudaBuf, scale: f32, k: usize, r: usize, n_out: usize) -> Result<()> {
    let _op = be.enter()?;
    ensure!(w.dtype == Dtype::Bf16 && w.shadow.is_none(), "cuda lora_merge: the merged weight must be a bf16 copy of a frozen weight");
    w.need((row0 + n_out) * k, "lora_merge", "the weight")?;
    let ap = be.weight_ptr(a, r * k, "lora_merge", "A")?;
    let bp = be.weight_ptr(b, n_out * r, "lora_merge", "B")?;
    if n_out > 0 && r > 0 {
        // lazy: matmul / matmul_dx / download apply it (module doc), from copies of A and B
        // that the term owns (device.rs, LoraTerm)
        let (ca, cb) = (be.alloc(r * k * 2)?, be.alloc(n_out * r * 2)?);
        be.dev.dtod(ca.ptr(), ap, r * k * 2)?;
        be.dev.dtod(cb.ptr(), bp, n_out * r * 2)?;
        let (a, b) = (ca.ptr(), cb.ptr());
        w.terms.push(LoraTerm { row0, a, b, scale, k, r, n_out, _owned: std::sync::Arc::new((ca, cb)) });
    }
    Ok(())
}


impl CudaBackend {
    /// `y[:, ..n_out] += t.scale · (x Aᵀ) Bᵀ` for a LoRA term, `x [m, k]` bf16, `y` rows of `ldy`
    /// (f32 or bf16) starting at the term's first column.
    pub(super) fn lora_delta(&self, x: u64, m: usize, t: &LoraTerm, y: u64, ldy: usize, y_bf16: bool) -> Result<()> {
        // xa [m, r] = x · Aᵀ (bf16: the next GEMM's input)
        let xa = self.scratch("lora_xa", m * t.r * 2)?;
        self.gemm(GemmArgs { m, n: t.r, k: t.k, x, ldx: t.k, w: t.a, ldw: t.k, y: xa, ldy: t.r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        self.gemm(GemmArgs { m, n: t.n_out, k: t.r, x: xa, ldx: t.r, w: t.b, ldw: t.r, y, ldy, y_bf16, alpha: t.scale, beta: 1.0, xt: false, wt: false })
    }

    pub(super) fn gemm(&self, g: GemmArgs) -> Result<()> {
        self.dev.gemm(&g, self.workspace.ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::rng::Rng;

    #[test]
    fn a_lora_rank_not_multiple_of_8_is_named_when_cublaslt_refuses() {
        let h = ld_hint(4, 896);
        assert!(h.contains("leading dimension of 4") && h.contains("multiple of 8"), "{h}");
        assert_eq!(ld_hint(16, 896), "");
    }

    #[test]
    fn alignment_is_the_lowest_set_bit_capped() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1004), 4);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
    }

    /// cuBLASLt's definition, column-major: element (i, j) of a layout lives at `i + j·ld`;
    /// `D(i, j) = alpha·Σ_l op(A)(i, l)·op(B)(l, j) + beta·C(i, j)`, op(M)(i, l) = M(l, i) when
    /// transposed. `a`, `b`, `c` are the buffers the device pointers address (a column slice is
    /// an offset into `c`).
    fn lt_emulate(d: &LtDesc, alpha: f32, beta: f32, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (rows, cols) = (d.c.rows, d.c.cols);
        let inner = if d.trans_a { d.a.rows } else { d.a.cols };
        let at = |i: usize, l: usize| if d.trans_a { a[l + i * d.a.ld] } else { a[i + l * d.a.ld] };
        let bt = |l: usize, j: usize| if d.trans_b { b[j + l * d.b.ld] } else { b[l + j * d.b.ld] };
        // op(A) must be rows × inner and op(B) inner × cols
        assert_eq!(if d.trans_a { d.a.cols } else { d.a.rows }, rows);
        assert_eq!(if d.trans_b { d.b.cols } else { d.b.rows }, inner);
        assert_eq!(if d.trans_b { d.b.rows } else { d.b.cols }, cols);
        for j in 0..cols {
            for i in 0..rows {
                let s: f64 = (0..inner).map(|l| at(i, l) as f64 * bt(l, j) as f64).sum();
                let o = i + j * d.c.ld;
                c[o] = (alpha as f64 * s + beta as f64 * c[o] as f64) as f32;
            }
        }
    }

    /// Every transpose combination, with padded leading dimensions and a column-slice output,
    /// computes the row-major product the module comment promises.
    #[test]
    fn describe_matches_row_major_products() {
        let mut rng = Rng::new(9);
        let mut r = |n: usize| (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        for &(m, n, k) in &[(5usize, 3usize, 7usize), (1, 16, 4), (9, 1, 2), (16, 896, 16)] {
            for xt in [false, true] {
                for wt in [false, true] {
                    let (ldx, ldw, col0, ldy) = ((if xt { m } else { k }) + 3, (if wt { n } else { k }) + 1, 2, n + 5);
                    let x = r(if xt { k } else { m } * ldx);
                    let w = r(if wt { k } else { n } * ldw);
                    let y0 = r(m * ldy);
                    let (alpha, beta) = (0.5f32, 1.0f32);
                    let d = describe(m, n, k, ldx, ldw, ldy, xt, wt).unwrap();
                    let mut got = y0.clone();
                    // the output pointer addresses column col0 of row 0 (n + col0 <= ldy)
                    assert!(col0 + n <= ldy);
                    lt_emulate(&d, alpha, beta, &w, &x, &mut got[col0..]);
                    for i in 0..m {
                        for jj in 0..ldy {
                            let want = if (col0..col0 + n).contains(&jj) {
                                let j = jj - col0;
                                let xv = |l: usize| if xt { x[l * ldx + i] } else { x[i * ldx + l] };
                                let wv = |l: usize| if wt { w[l * ldw + j] } else { w[j * ldw + l] };
                                let s: f64 = (0..k).map(|l| xv(l) as f64 * wv(l) as f64).sum();
                                (alpha as f64 * s + beta as f64 * y0[i * ldy + jj] as f64) as f32
                            } else {
                                y0[i * ldy + jj]
                            };
                            let g = got[i * ldy + jj];
                            assert!((g - want).abs() <= 1e-5 * (1.0 + want.abs()), "m{m} n{n} k{k} xt {xt} wt {wt} ({i}, {jj}): {g} vs {want}");
                        }
                    }
                }
            }
        }
        assert!(describe(2, 3, 4, 3, 4, 3, false, false).is_err(), "ldx < k");
        assert!(describe(2, 3, 4, 2, 3, 3, true, true).is_ok());
        assert!(describe(2, 3, 4, 2, 2, 3, true, true).is_err(), "ldw < n when w is stored [k, n]");
    }
}
