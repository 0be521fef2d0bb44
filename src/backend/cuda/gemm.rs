//! Row-major GEMMs through cuBLASLt: `y[m, n] = alpha · x[m, k] · w[n, k]ᵀ + beta · y`, bf16 inputs,
//! f32 accumulation (CUBLAS_COMPUTE_32F), y in f32 or bf16.
//!
//! The row-major trick: a row-major `[r, c]` matrix is a column-major `[c, r]` one. So
//! `yᵀ [n, m] = w [n, k] · xᵀ [k, m]` in column-major terms, i.e. cuBLASLt's
//! `D (n × m, ld ldy) = op(A) · op(B)` with `A = w` seen as column-major `k × n` (ld ldw) and
//! `op = T`, and `B = x` seen as column-major `k × m` (ld ldx) and `op = N` — the "TN" layout,
//! the best supported one. The LoRA delta uses the same call with `beta = 1` and a pointer into a
//! column slice of `y` (ld = the full row width).
//!
//! Descriptors, layouts and the heuristic's algorithm are cached per shape (a decode step repeats
//! the same handful of shapes every layer). The heuristic is told the real alignment of every
//! pointer (cuBLASLt assumes 256 bytes otherwise, and a column-slice pointer is not that aligned).
use anyhow::{bail, Result};
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
        if g.k == 0 || g.ldx < g.k || g.ldw < g.k || g.ldy < g.n {
            bail!("gemm: bad shape m {} n {} k {} (ld x {} w {} y {})", g.m, g.n, g.k, g.ldx, g.ldw, g.ldy);
        }
        let key = Key {
            m: g.m,
            n: g.n,
            k: g.k,
            ldx: g.ldx,
            ldw: g.ldw,
            ldy: g.ldy,
            y_bf16: g.y_bf16,
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
        let bf16 = lt::cudaDataType::CUDA_R_16BF;
        let ytype = if key.y_bf16 { bf16 } else { lt::cudaDataType::CUDA_R_32F };
        let mut desc = std::ptr::null_mut();
        check(lt::cublasLtMatmulDescCreate(&mut desc, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt::cudaDataType::CUDA_R_32F), "desc")?;
        let mut plan = Plan { desc, a: std::ptr::null_mut(), b: std::ptr::null_mut(), cd: std::ptr::null_mut(), algo: std::mem::zeroed() };
        // cublasOperation_t values (an int32 attribute): CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        let ta: i32 = 1;
        let tb: i32 = 0;
        let sz = std::mem::size_of::<i32>();
        check(lt::cublasLtMatmulDescSetAttribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const _ as *const c_void, sz), "transa")?;
        check(lt::cublasLtMatmulDescSetAttribute(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const _ as *const c_void, sz), "transb")?;
        // A = w: column-major k × n; B = x: column-major k × m; C = D = y: column-major n × m.
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.a, bf16, key.k as u64, key.n as u64, key.ldw as i64), "layout A")?;
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.b, bf16, key.k as u64, key.m as u64, key.ldx as i64), "layout B")?;
        check(lt::cublasLtMatrixLayoutCreate(&mut plan.cd, ytype, key.n as u64, key.m as u64, key.ldy as i64), "layout C/D")?;
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
                    "cuBLASLt has no algorithm for m {} n {} k {} (ld {} {} {}, alignments {:?}, y {})",
                    key.m,
                    key.n,
                    key.k,
                    key.ldx,
                    key.ldw,
                    key.ldy,
                    key.align,
                    if key.y_bf16 { "bf16" } else { "f32" }
                );
            }
            Ok(res.algo)
        })();
        lt::cublasLtMatmulPreferenceDestroy(pref);
        plan.algo = r?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;
    #[test]
    fn alignment_is_the_lowest_set_bit_capped() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1004), 4);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
    }
}
