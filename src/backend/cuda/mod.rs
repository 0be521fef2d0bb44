//! The CUDA backend: bf16 storage, f32 accumulation, hand-written kernels (kernels/*.cu, compiled
//! by build.rs and embedded) for everything but the GEMMs, which go to cuBLASLt.
//!
//! **Buffers.** A `CudaBuf` is device bytes plus an element count and a dtype. Which dtype a
//! buffer holds is decided by the op that writes it, so the runtime's generic code needs no
//! dtype knowledge:
//! - `upload`/`upload_vec` store bf16 (weights, norms, biases, LoRA factors: bf16 is their
//!   checkpoint precision); `zeros(n)` allocates room for n f32 (either dtype fits) and reads as
//!   f32 zeros;
//! - GEMM outputs, the embedding output and the residual stream are **f32**: the residual stream
//!   accumulates ~2·n_layers deltas and bf16 would lose their low bits (HF keeps it bf16; f32 here
//!   costs a few MB of bandwidth per step and buys parity with the f32 CPU path);
//! - ops whose output feeds a GEMM (rmsnorm, add_rmsnorm, swiglu, attention) write **bf16**, the
//!   GEMM's input type. A GEMM given an f32 input converts it first (a copy; the runtime never
//!   does this).
//! Kernels take f32 or bf16 activations (template instantiations); weights must be bf16.
//!
//! **KV cache.** One preallocated bf16 pool `[page][layer][k|v][kv_head][page_size][head_dim]`
//! (`kv_new` allocates all of it); copy-on-write of a page is one contiguous device copy.
//!
//! **Training** (`TrainBackend`, in `train.rs`; kernels `attention_dense.cu`, `attention_bwd.cu`,
//! `norm_bwd.cu`, `swiglu_bwd.cu`, `head_bwd.cu`, `rows.cu`, `optim.cu`):
//! - gradients are **f32** buffers (every `zeros` is f32); an f32 gradient that feeds a GEMM is
//!   rounded to bf16 on the way in (as PyTorch's bf16 autocast does), accumulation stays f32;
//! - LoRA parameters are **f32 masters with a bf16 shadow**: the first `adamw` on a bf16 buffer
//!   widens it to f32 and keeps the bf16 bytes as its shadow; the AdamW kernel then writes both
//!   (an lr·1e-4 update would vanish in bf16's 8-bit significand). Ops that read a weight
//!   (`weight_ptr`) read the shadow of an f32 master; `write` refreshes both;
//! - `lora_merge` is **lazy**: instead of rounding `W + scale·B·A` to bf16 (which would drop a
//!   young adapter's delta below W's half-ulp), the merged copy keeps `W` in bf16 plus a list of
//!   pending LoRA terms (device pointers to the pair's bf16 A and B). `matmul` applies them as
//!   `y += scale·(x Aᵀ) Bᵀ` in f32 (exactly the rollout's `lora` op), `matmul_dx` as
//!   `dx += scale·(dy B) A`, `download` materializes them on the host. Any write to the buffer
//!   (`touch`) drops the terms, and any other weight reader refuses a buffer that has some; the
//!   runtime re-merges each layer right before using it, so the pointers are always the live
//!   adapter's;
//! - memory: allocations come from the device's default stream-ordered pool, with its release
//!   threshold raised to "never" at start, so what one phase frees (the rollout's KV cache) is
//!   reused by the next (the update's activations) without going back to the driver; see
//!   `memory.rs` for the footprint model and the "what would fit" error.
//!
//! **Streams and metadata.** Everything runs in order on one stream. Small per-call host data
//! (token ids, positions, slots, page tables) is uploaded through a per-kind cache that skips
//! the upload when the bytes equal the previous call's: a step passes the same positions, slots
//! and attention tables to every layer, so only the first layer pays for the copy.
pub mod attn;
pub mod device;
pub mod gemm;
pub mod memory;
pub mod reference;
pub mod train_attn;
#[cfg(test)] pub(crate) mod emulate;

mod kernels {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

use super::{AttnGeom, AttnSeq, Backend, SampleParams, Sampled};
use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream};
use device::{AllocMode, DevMem, DeviceAlloc, Heap};
use half::bf16;
use rayon::prelude::*;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
    fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        }
    }
}

pub struct CudaBuf {
    mem: DevMem,
    len: usize,
    dtype: Dtype,
    /// bf16 copy of an f32 parameter (see "Training" above); only `adamw` and `write` keep it.
    shadow: Option<DevMem>,
    /// LoRA pairs folded lazily into this bf16 weight by `lora_merge` (see "Training" above).
    terms: Vec<LoraTerm>,
}

/// `w[row0 + o, :] += scale · Σ_j b[o, j]·a[j, :]` pending on a merged weight (`w` rows of `k`);
/// `a`, `b` are device addresses of bf16 `[r, k]` and `[n_out, r]`.
#[derive(Clone, Copy, Debug)]
struct LoraTerm {
    row0: usize,
    a: u64,
    b: u64,
    scale: f32,
    k: usize,
    r: usize,
    n_out: usize,
}

impl CudaBuf {
    fn new(mem: DevMem, len: usize, dtype: Dtype) -> Self {
        CudaBuf { mem, len, dtype, shadow: None, terms: Vec::new() }
    }
    fn ptr(&self) -> u64 {
        self.mem.ptr()
    }
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// Whether this buffer is an f32 master with a bf16 shadow (an optimized parameter).
    pub fn has_shadow(&self) -> bool {
        self.shadow.is_some()
    }
    /// Pending LoRA terms (a lazily merged weight).
    pub fn pending_lora_terms(&self) -> usize {
        self.terms.len()
    }
    /// The buffer's content is about to change by an op other than `adamw` / `write`: the bf16
    /// shadow and the pending LoRA terms no longer describe it.
    fn touch(&mut self) {
        self.shadow = None;
        self.terms.clear();
    }
    /// Declare that an op writes `n` elements of `dtype` into this buffer.
    fn set_output(&mut self, n: usize, dtype: Dtype, op: &str) -> Result<()> {
        self.touch();
        ensure!(
            n <= self.len && n * dtype.size() <= self.mem.len(),
            "cuda {op}: output of {n} {} elements does not fit a buffer of {} elements ({} bytes)",
            dtype.suffix(),
            self.len,
            self.mem.len()
        );
        self.dtype = dtype;
        Ok(())
    }
    fn need(&self, n: usize, op: &str, what: &str) -> Result<()> {
        ensure!(n <= self.len, "cuda {op}: {what} needs {n} elements, the buffer has {}", self.len);
        Ok(())
    }
}

pub struct CudaKv {
    pool: DevMem,
    geom: AttnGeom,
    max_pages: usize,
    /// bf16 elements per page (all layers, k and v, all kv heads).
    page_elems: usize,
}

impl CudaKv {
    fn ptr(&self) -> u64 {
        self.pool.ptr()
    }
}

/// Kernels of each embedded module, loaded by name at start (a missing one is an error then,
/// not at first use).
const KERNEL_NAMES: &[(&str, &[&str])] = &[
    (
        "norm",
        &[
            "rmsnorm_f32",
            "rmsnorm_bf16",
            "add_rmsnorm_f32_f32",
            "add_rmsnorm_f32_bf16",
            "add_rmsnorm_bf16_f32",
            "add_rmsnorm_bf16_bf16",
            "add_f32_f32",
            "add_f32_bf16",
            "add_bf16_f32",
            "add_bf16_bf16",
        ],
    ),
    ("rope", &["rope_f32", "rope_bf16", "rope_bwd_f32", "rope_bwd_bf16"]),
    ("swiglu", &["swiglu_f32", "swiglu_bf16"]),
    (
        "memory",
        &["embed_bf16", "gather_rows_b16", "gather_rows_b32", "f32_to_bf16", "add_bias_bf16", "add_bias_f32", "kv_store_f32", "kv_store_bf16"],
    ),
    ("logprob", &["logprob_tile"]),
    ("head_bwd", &["head_probs_tile", "head_grad_finish"]),
    ("norm_bwd", &["rmsnorm_bwd_f32_f32", "rmsnorm_bwd_f32_bf16", "rmsnorm_bwd_bf16_f32", "rmsnorm_bwd_bf16_bf16"]),
    ("swiglu_bwd", &["swiglu_bwd_f32_f32", "swiglu_bwd_f32_bf16", "swiglu_bwd_bf16_f32", "swiglu_bwd_bf16_bf16"]),
    ("rows", &["scale_rows_f32", "scatter_add_rows_f32", "scatter_add_rows_bf16"]),
    ("optim", &["sum_squares_f32", "sum_squares_bf16", "scale_f32", "adamw_f32", "widen_bf16"]),
    (
        "attention_dense",
        &["attn_dense_fwd_hd16", "attn_dense_fwd_hd32", "attn_dense_fwd_hd64", "attn_dense_fwd_hd128"],
    ),
    (
        "attention_bwd",
        &[
            "attn_bwd_prep_bf16_f32",
            "attn_bwd_prep_bf16_bf16",
            "attn_bwd_prep_f32_f32",
            "attn_bwd_prep_f32_bf16",
            "attn_dense_dq_hd16",
            "attn_dense_dq_hd32",
            "attn_dense_dq_hd64",
            "attn_dense_dq_hd128",
            "attn_dense_dkdv_hd16",
            "attn_dense_dkdv_hd32",
            "attn_dense_dkdv_hd64",
            "attn_dense_dkdv_hd128",
        ],
    ),
    ("sample", &["sample_f32", "sample_bf16"]),
    (
        "attention",
        &[
            "attention_hd16_f32",
            "attention_hd32_f32",
            "attention_hd64_f32",
            "attention_hd128_f32",
            "attention_hd16_bf16",
            "attention_hd32_bf16",
            "attention_hd64_bf16",
            "attention_hd128_bf16",
            "attn_combine",
        ],
    ),
];

/// Head dims the attention kernel is instantiated for.
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

// Block sizes; must match the kernels' #defines / __launch_bounds__.
const NORM_THREADS: u32 = 256;
const LP_THREADS: u32 = 256;
const SAMPLE_THREADS: u32 = 512;
const ATTN_THREADS: u32 = 128;
/// Logits scratch of the log-prob op: at most this many f32 per vocabulary tile (64 MB).
const LOGPROB_SCRATCH: usize = 16 << 20;
const LOGPROB_MAX_ROWS: usize = 4096;

/// The path this process loaded a shared library from (its first mapping whose file name starts
/// with `prefix`, from /proc/self/maps), or "not loaded".
fn loaded_library(prefix: &str) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.rsplit('/').next().is_some_and(|f| f.starts_with(prefix)))
        .map(|p| std::fs::canonicalize(p).map(|c| if c.as_path() == std::path::Path::new(p) { p.to_string() } else { format!("{p} -> {}", c.display()) }).unwrap_or_else(|_| p.to_string()))
        .unwrap_or_else(|| "not loaded".into())
}

/// Whether the NVIDIA driver library loads and reports at least one device. Never panics.
pub fn device_present() -> bool {
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    matches!(CudaContext::device_count(), Ok(n) if n > 0)
}

/// nvcc's version line for the embedded kernels ("" when there are none).
pub fn nvcc_version() -> &'static str {
    kernels::NVCC_VERSION
}

/// Why kernels are missing from this build, if they are.
pub fn kernels_missing() -> Option<&'static str> {
    kernels::MISSING
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    gemm: gemm::Gemm,
    /// Device memory (declared before `workspace` and the caches only for readability: every
    /// `DevMem` holds the heap alive itself).
    heap: Arc<Heap>,
    workspace: DevMem,
    meta: Mutex<HashMap<&'static str, (Vec<u8>, DevMem)>>,
    scratch: Mutex<HashMap<&'static str, DevMem>>,
    /// Held while an op enqueues its work: the metadata and scratch pointers an op obtains stay
    /// valid only until another op of the same kind replaces them.
    op: Mutex<()>,
    n_sm: usize,
    device: String,
}

/// Launch a kernel of `$be` by name. Arguments must be locals (their addresses are passed) whose
/// Rust types match the kernel's C types: u64 for pointers, i32 for int, i64 for long long, f32.
macro_rules! launch {
    ($be:expr, $name:expr, $grid:expr, $block:expr, $($arg:ident),* $(,)?) => {
        launch_dyn!($be, $name, $grid, $block, 0u32, $($arg),*)
    };
}

/// `launch!` with `$smem` bytes of dynamic shared memory (kernels that declare
/// `extern __shared__`; more than 48 KiB needs the attribute set in `CudaBackend::new`).
macro_rules! launch_dyn {
    ($be:expr, $name:expr, $grid:expr, $block:expr, $smem:expr, $($arg:ident),* $(,)?) => {{
        let name: &str = $name;
        let f = $be.func(name)?;
        let mut args: Vec<*mut c_void> = vec![$( &$arg as *const _ as *mut c_void ),*];
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                ($grid as u32, 1, 1),
                ($block as u32, 1, 1),
                $smem as u32,
                $be.stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(|e| anyhow!("cuda: launching {name} failed: {e:?}"))
    }};
}

mod train;

fn to_bf16_bits(data: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; data.len()];
    out.par_chunks_mut(1 << 16).zip(data.par_chunks(1 << 16)).for_each(|(o, d)| {
        for (o, &x) in o.iter_mut().zip(d) {
            *o = bf16::from_f32(x).to_bits();
        }
    });
    out
}

/// The driver calls behind `device::Heap`, on the backend's one stream.
struct CudaDriverAlloc {
    stream: Arc<CudaStream>,
}

impl DeviceAlloc for CudaDriverAlloc {
    fn alloc(&self, pool: bool, bytes: usize) -> std::result::Result<u64, (bool, String)> {
        use cudarc::driver::result;
        self.stream.context().bind_to_thread().map_err(|e| (false, format!("binding the CUDA context: {e:?}")))?;
        let r = unsafe { if pool { result::malloc_async(self.stream.cu_stream(), bytes) } else { result::malloc_sync(bytes) } };
        r.map_err(|e| (e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY, format!("{} of {bytes} bytes: {e:?}", if pool { "cuMemAllocAsync" } else { "cuMemAlloc" })))
    }
    fn free(&self, pool: bool, ptr: u64) {
        use cudarc::driver::result;
        // Drop cannot report an error; a failed free here means the context is already broken,
        // which the next op reports.
        let _ = self.stream.context().bind_to_thread();
        let _ = unsafe { if pool { result::free_async(ptr, self.stream.cu_stream()) } else { result::free_sync(ptr) } };
    }
    fn sync(&self) {
        let _ = self.stream.synchronize();
    }
    fn trim_pool(&self) {
        let ctx = self.stream.context();
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().is_ok() {
                let _ = sys::cuMemPoolTrimTo(pool, 0).result();
            }
        }
    }
}

/// Try the stream-ordered pool: keep freed memory in it (release threshold "never"), then
/// allocate, free and synchronize a 1 MiB block. Any failure says why the pool is not used.
fn probe_pool(stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
    use cudarc::driver::result;
    let ctx = stream.context();
    unsafe {
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().map_err(|e| format!("cuDeviceGetDefaultMemPool: {e:?}"))?;
        let mut keep: u64 = u64::MAX;
        sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep as *mut u64 as *mut c_void)
            .result()
            .map_err(|e| format!("setting the pool's release threshold: {e:?}"))?;
        let p = result::malloc_async(stream.cu_stream(), 1 << 20).map_err(|e| format!("cuMemAllocAsync: {e:?}"))?;
        result::free_async(p, stream.cu_stream()).map_err(|e| format!("cuMemFreeAsync: {e:?}"))?;
    }
    stream.synchronize().map_err(|e| format!("synchronize after the pool probe: {e:?}"))
}

fn grid_for(n: usize, block: u32) -> u32 {
    (n.div_ceil(block as usize)).clamp(1, 1 << 20) as u32
}

impl CudaBackend {
    /// The forward (`op` = "rope") or backward ("rope_bwd") rotation of rope.cu on the q/k heads
    /// of a `[rows, qkv_dim]` buffer (named `buf` in errors), in place.
    pub(crate) fn rope_launch(&self, op: &str, buf: &str, qkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        let _op = self.enter()?;
        if positions.is_empty() {
            return Ok(());
        }
        ensure!(inv_freq.len() * 2 == g.head_dim, "cuda {op}: {} frequencies for head_dim {}", inv_freq.len(), g.head_dim);
        qkv.touch();
        qkv.need(positions.len() * g.qkv_dim(), op, buf)?;
        let pp = self.meta("positions", bytemuck::cast_slice(positions))?;
        let fp = self.meta("inv_freq", bytemuck::cast_slice(inv_freq))?;
        let (q, heads, hd, width) = (qkv.ptr(), (g.n_heads + g.n_kv_heads) as i32, g.head_dim as i32, g.qkv_dim() as i32);
        launch!(self, &format!("{op}_{}", qkv.dtype.suffix()), positions.len(), 128, q, pp, fp, heads, hd, width)
    }

    /// Open device `ordinal`. Errors (never panics) when the build has no kernels, there is no
    /// driver or device, the device is older than sm_90, or cuBLASLt cannot be loaded.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_allocator(ordinal, std::env::var("INFOMEM_CUDA_ALLOC").ok().as_deref())
    }

    /// `new` with the allocator chosen by `alloc` ("pool", "plain", or None / "auto" to decide
    /// from the device), as `INFOMEM_CUDA_ALLOC` does for `new`.
    pub fn with_allocator(ordinal: usize, alloc: Option<&str>) -> Result<Self> {
        if let Some(why) = kernels::MISSING {
            bail!("CUDA backend: built without kernels ({why})");
        }
        if !unsafe { sys::is_culib_present() } {
            bail!("no CUDA device: the NVIDIA driver library (libcuda.so) was not found");
        }
        let n = CudaContext::device_count().map_err(|e| anyhow!("no CUDA device: cuInit/cuDeviceGetCount failed: {e:?}"))?;
        if n <= ordinal as i32 {
            bail!("no CUDA device: {n} device(s) visible, device {ordinal} requested");
        }
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            bail!(
                "cuBLASLt (libcublasLt.so.13) was not found: put CUDA 13's cuBLAS libraries on LD_LIBRARY_PATH \
                 (e.g. a torch environment's site-packages/nvidia/cu13/lib)"
            );
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow!("creating a CUDA context on device {ordinal}: {e:?}"))?;
        // One stream, in-order: cudarc's per-buffer event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(|e| anyhow!("{e:?}"))?;
        if major < 9 {
            bail!("the CUDA kernels are built for sm_90 (Hopper); device {ordinal} is sm_{major}{minor}");
        }
        let stream = ctx.new_stream().map_err(|e| anyhow!("creating a stream: {e:?}"))?;
        let device = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let n_sm = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(132) as usize;
        let mut funcs = HashMap::new();
        for &(module, names) in KERNEL_NAMES {
            let &(_, cubin, ptx) = kernels::KERNELS
                .iter()
                .find(|k| k.0 == module)
                .with_context(|| format!("kernels/{module}.cu is not in the build"))?;
            // The sm_90 cubin on sm_90; the compute_90 PTX (JIT-compiled by the driver) elsewhere
            // or if the cubin is refused.
            let cubin_err = if (major, minor) == (9, 0) {
                match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec())) {
                    Ok(m) => Ok(m),
                    Err(e) => Err(format!("the sm_90 cubin was refused ({e:?})")),
                }
            } else {
                Err(format!("no cubin for sm_{major}{minor} (the build has sm_90)"))
            };
            let m = match cubin_err {
                Ok(m) => m,
                Err(why) => ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| {
                    anyhow!("loading kernels/{module}.cu on sm_{major}{minor}: {why}, and the compute_90 PTX fallback failed too ({e:?})")
                })?,
            };
            for &name in names {
                let f = m.load_function(name).map_err(|e| anyhow!("kernel {name} missing from kernels/{module}.cu: {e:?}"))?;
                funcs.insert(name, f);
            }
        }
        // The dense attention backward's dK/dV kernel carves its tiles from dynamic shared memory
        // (up to ~69 KiB at head_dim 128, over the 48 KiB a launch gets without asking).
        for hd in HEAD_DIMS {
            let name = format!("attn_dense_dkdv_hd{hd}");
            let f = funcs.get(name.as_str()).with_context(|| format!("kernel {name} missing"))?;
            let bytes = train_attn::dkdv_smem_bytes(hd) as i32;
            f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
                .map_err(|e| anyhow!("cuda: allowing {bytes} bytes of dynamic shared memory for {name}: {e:?}"))?;
        }
        // the allocator: the stream-ordered pool where it works, plain allocations otherwise
        let pools = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).map(|v| v > 0).unwrap_or(false);
        let mode = device::choose_mode(alloc, pools, || probe_pool(&stream))?;
        let heap = Heap::new(mode, Box::new(CudaDriverAlloc { stream: stream.clone() }));
        let gemm = gemm::Gemm::new()?;
        let workspace = heap.alloc(gemm::WORKSPACE_BYTES).map_err(|e| anyhow!("cuda: allocating the cuBLASLt workspace: {e}"))?;
        Ok(CudaBackend {
            ctx,
            stream,
            heap,
            funcs,
            gemm,
            workspace,
            meta: Mutex::new(HashMap::new()),
            scratch: Mutex::new(HashMap::new()),
            op: Mutex::new(()),
            n_sm,
            device,
        })
    }

    /// Start an op: serialize it with other threads' ops and make this backend's context current
    /// on the calling thread (the raw driver / cuBLASLt calls below do not bind it themselves).
    fn enter(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        let g = self.op.lock().unwrap_or_else(|e| e.into_inner());
        self.ctx.bind_to_thread().map_err(|e| self.err("binding the CUDA context (or an earlier asynchronous error)", e))?;
        Ok(g)
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs.get(name).with_context(|| format!("cuda: no kernel named {name}"))
    }

    fn err(&self, what: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
        anyhow!("cuda: {what} failed: {e:?}")
    }

    fn alloc(&self, bytes: usize) -> Result<DevMem> {
        self.heap.alloc(bytes).map_err(|e| self.alloc_error(bytes, e))
    }

    /// `alloc` with every byte zero (in stream order).
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevMem> {
        let m = self.alloc(bytes)?;
        unsafe { cudarc::driver::result::memset_d8_async(m.ptr(), 0, bytes, self.stream.cu_stream()) }.map_err(|e| self.err("memset", e))?;
        Ok(m)
    }

    /// Which allocator serves this backend's device memory.
    pub fn alloc_mode(&self) -> &AllocMode {
        self.heap.mode()
    }

    /// An allocation failed: say how much was asked and how much the device has.
    fn alloc_error(&self, bytes: usize, e: String) -> anyhow::Error {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        match self.mem_info() {
            Ok(m) => anyhow!(
                "cuda: allocating {:.3} GiB failed ({e}): {:.2} GiB usable on {} ({:.2} GiB free on the device, {:.2} GiB cached by the {} allocator), {:.2} GiB in total",
                gib(bytes),
                gib(m.usable()),
                self.device,
                gib(m.free),
                gib(m.cached),
                self.heap.mode().short(),
                gib(m.total)
            ),
            Err(_) => anyhow!("cuda: allocating {:.3} GiB failed: {e}", gib(bytes)),
        }
    }

    /// Copy host bytes to the start of `dst`. From pageable memory the driver stages the bytes
    /// before returning, so `bytes` may be reused at once; the copy is ordered on the stream.
    fn htod(&self, bytes: &[u8], dst: &mut DevMem) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        ensure!(bytes.len() <= dst.len(), "cuda: copying {} bytes into a device buffer of {}", bytes.len(), dst.len());
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr(), bytes, self.stream.cu_stream()) }.map_err(|e| self.err("host → device copy", e))
    }

    /// A device copy of small host data, cached per `kind` by content (see the module comment).
    /// The pointer is valid until the next call with the same kind.
    fn meta(&self, kind: &'static str, bytes: &[u8]) -> Result<u64> {
        let mut m = self.meta.lock().unwrap();
        if let Some((host, dev)) = m.get(kind) {
            if host.as_slice() == bytes {
                return Ok(dev.ptr());
            }
        }
        let reuse = m.get(kind).is_some_and(|(_, dev)| dev.len() >= bytes.len());
        if !reuse {
            let dev = self.alloc(bytes.len().next_power_of_two())?;
            m.insert(kind, (Vec::new(), dev));
        }
        let (host, dev) = m.get_mut(kind).unwrap();
        // stream order: kernels that read the old content were enqueued before this copy
        self.htod(bytes, dev)?;
        host.clear();
        host.extend_from_slice(bytes);
        Ok(dev.ptr())
    }

    /// A reusable device workspace of at least `bytes`, valid until the next call with the same name.
    fn scratch(&self, name: &'static str, bytes: usize) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        if s.get(name).is_none_or(|b| b.len() < bytes) {
            let b = self.alloc(bytes.next_power_of_two())?;
            s.insert(name, b); // the old one is freed in stream order
        }
        Ok(s[name].ptr())
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.err("stream synchronize (an earlier kernel may have failed)", e))
    }

    /// Copy `n` elements of `T` to the host (synchronizes the stream).
    fn dtoh<T: bytemuck::Pod>(&self, ptr: u64, n: usize) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); n];
        if n > 0 {
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut out, ptr, self.stream.cu_stream()) }.map_err(|e| self.err("device → host copy", e))?;
        }
        self.sync()?;
        Ok(out)
    }

    /// Upload host data as `dtype` (tests use this to feed f32 activations).
    pub fn upload_as(&self, data: &[f32], dtype: Dtype) -> Result<CudaBuf> {
        let mut mem = self.alloc(data.len() * dtype.size())?;
        match dtype {
            Dtype::F32 => self.htod(bytemuck::cast_slice(data), &mut mem)?,
            Dtype::Bf16 => self.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut mem)?,
        }
        Ok(CudaBuf::new(mem, data.len(), dtype))
    }

    /// A bf16 view of `x` for a GEMM input: its own pointer, or a converted copy (kept alive by
    /// the returned slice until the GEMM is enqueued).
    fn bf16_input(&self, x: &CudaBuf, n: usize) -> Result<(u64, Option<DevMem>)> {
        match x.dtype {
            Dtype::Bf16 => Ok((x.ptr(), None)),
            Dtype::F32 => {
                let tmp = self.alloc(n * 2)?;
                let (src, dst, n64) = (x.ptr(), tmp.ptr(), n as i64);
                if n > 0 {
                    launch!(self, "f32_to_bf16", grid_for(n, 256), 256, src, dst, n64)?;
                }
                Ok((dst, Some(tmp)))
            }
        }
    }

    /// The bf16 device address of a weight: the buffer itself, or the bf16 shadow of an f32
    /// parameter. A lazily merged weight is refused (only matmul/matmul_dx apply its terms).
    fn weight_ptr(&self, w: &CudaBuf, n: usize, op: &str, what: &str) -> Result<u64> {
        ensure!(w.terms.is_empty(), "cuda {op}: {what} carries {} pending LoRA terms (lora_merge); only matmul and matmul_dx apply them", w.terms.len());
        w.need(n, op, what)?;
        match (w.dtype, &w.shadow) {
            (Dtype::Bf16, _) => Ok(w.ptr()),
            (Dtype::F32, Some(sh)) => Ok(sh.ptr()),
            (Dtype::F32, None) => bail!("cuda {op}: {what} must be bf16 (uploaded weights are)"),
        }
    }

    /// `y[:, ..n_out] += t.scale · (x Aᵀ) Bᵀ` for a LoRA term, `x [m, k]` bf16, `y` rows of `ldy`
    /// (f32 or bf16) starting at the term's first column.
    fn lora_delta(&self, x: u64, m: usize, t: &LoraTerm, y: u64, ldy: usize, y_bf16: bool) -> Result<()> {
        // xa [m, r] = x · Aᵀ (bf16: the next GEMM's input)
        let xa = self.scratch("lora_xa", m * t.r * 2)?;
        self.gemm(gemm::GemmArgs { m, n: t.r, k: t.k, x, ldx: t.k, w: t.a, ldw: t.k, y: xa, ldy: t.r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        self.gemm(gemm::GemmArgs { m, n: t.n_out, k: t.r, x: xa, ldx: t.r, w: t.b, ldw: t.r, y, ldy, y_bf16, alpha: t.scale, beta: 1.0, xt: false, wt: false })
    }

    /// Host copy of a weight with its pending LoRA terms applied (f32, the value the buffer stands for).
    fn download_merged(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        let mut w: Vec<f32> = self.dtoh::<u16>(buf.ptr(), buf.len)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
        for t in &buf.terms {
            let a: Vec<f32> = self.dtoh::<u16>(t.a, t.r * t.k)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
            let b: Vec<f32> = self.dtoh::<u16>(t.b, t.n_out * t.r)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
            for o in 0..t.n_out {
                let row = &mut w[(t.row0 + o) * t.k..(t.row0 + o + 1) * t.k];
                for j in 0..t.r {
                    let c = t.scale * b[o * t.r + j];
                    for (x, &av) in row.iter_mut().zip(&a[j * t.k..(j + 1) * t.k]) {
                        *x += c * av;
                    }
                }
            }
        }
        Ok(w)
    }

    /// The bf16 base of a weight `[n, k]` for matmul/matmul_dx, which apply pending LoRA terms
    /// themselves (checked to fit the weight's rows and width).
    fn base_weight_ptr(&self, w: &CudaBuf, n: usize, k: usize, op: &str) -> Result<u64> {
        w.need(n * k, op, "the weight")?;
        for t in &w.terms {
            ensure!(t.k == k && t.row0 + t.n_out <= n, "cuda {op}: a pending LoRA term (rows {}..{}, width {}) does not fit the weight [{n}, {k}]", t.row0, t.row0 + t.n_out, t.k);
        }
        match (w.dtype, &w.shadow) {
            (Dtype::Bf16, _) => Ok(w.ptr()),
            (Dtype::F32, Some(sh)) if w.terms.is_empty() => Ok(sh.ptr()),
            _ => bail!("cuda {op}: the weight must be bf16 (uploaded weights are)"),
        }
    }

    pub fn device_name(&self) -> &str {
        &self.device
    }

    /// What this backend runs on, for `infomem-engine device` and the GPU check's first line:
    /// device, driver, the libraries loaded (and from where), memory, allocator, kernels.
    pub fn report(&self) -> Result<serde_json::Value> {
        let _op = self.enter()?;
        let mut driver = 0i32;
        unsafe { sys::cuDriverGetVersion(&mut driver) }.result().map_err(|e| anyhow!("cuDriverGetVersion: {e:?}"))?;
        let (major, minor) = self.ctx.compute_capability().map_err(|e| anyhow!("{e:?}"))?;
        let m = self.mem_info()?;
        let gib = |b: usize| (b as f64 / (1u64 << 30) as f64 * 100.0).round() / 100.0;
        let lt = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        Ok(serde_json::json!({
            "device": self.device,
            "compute_capability": format!("{major}.{minor}"),
            "multiprocessors": self.n_sm,
            "driver_cuda_version": format!("{}.{}", driver / 1000, (driver % 1000) / 10),
            "cublaslt_version": format!("{}.{}.{}", lt / 10000, (lt / 100) % 100, lt % 100),
            "libcuda": loaded_library("libcuda.so"),
            "libcublasLt": loaded_library("libcublasLt.so"),
            "memory_total_gib": gib(m.total),
            "memory_free_gib": gib(m.free),
            "allocator": self.heap.mode().short(),
            "allocator_detail": self.heap.mode().describe(),
            "kernels_nvcc": kernels::NVCC_VERSION,
            "kernel_modules": KERNEL_NAMES.len(),
            "kernels": KERNEL_NAMES.iter().map(|(_, n)| n.len()).sum::<usize>(),
        }))
    }

    fn gemm(&self, g: gemm::GemmArgs) -> Result<()> {
        let ws = self.workspace.ptr();
        unsafe { self.gemm.run(&g, ws, self.stream.cu_stream()) }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = &self.ctx;
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Kv = CudaKv;

    fn name(&self) -> String {
        format!("cuda ({}, {} SMs, bf16 storage / f32 accumulation, {} allocator)", self.device, self.n_sm, self.heap.mode().short())
    }
    fn synchronize(&self) -> Result<()> {
        let _op = self.enter()?;
        self.sync()
    }

    fn upload(&self, data: &[f32]) -> Result<CudaBuf> {
        let _op = self.enter()?;
        self.upload_as(data, Dtype::Bf16)
    }
    /// An f32 master with its bf16 shadow from the start (as `adamw` would make it): a resumed
    /// adapter is not rounded to bf16 on its way back to the device.
    fn upload_param(&self, data: &[f32]) -> Result<CudaBuf> {
        let _op = self.enter()?;
        let mut b = self.upload_as(data, Dtype::F32)?;
        let mut sh = self.alloc((data.len() * 2).max(1))?;
        self.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut sh)?;
        b.shadow = Some(sh);
        Ok(b)
    }
    fn zeros(&self, n: usize) -> Result<CudaBuf> {
        let _op = self.enter()?;
        let mem = self.alloc_zeroed(n * 4)?;
        Ok(CudaBuf::new(mem, n, Dtype::F32))
    }
    fn download(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
        let _op = self.enter()?;
        if !buf.terms.is_empty() {
            return self.download_merged(buf);
        }
        Ok(match buf.dtype {
            Dtype::F32 => self.dtoh::<f32>(buf.ptr(), buf.len)?,
            Dtype::Bf16 => self.dtoh::<u16>(buf.ptr(), buf.len)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect(),
        })
    }
    fn write(&self, buf: &mut CudaBuf, data: &[f32]) -> Result<()> {
        let _op = self.enter()?;
        ensure!(buf.len == data.len(), "write: length {} into buffer of {}", data.len(), buf.len);
        buf.terms.clear();
        match buf.dtype {
            Dtype::F32 => {
                self.htod(bytemuck::cast_slice(data), &mut buf.mem)?;
                // an f32 parameter keeps its bf16 shadow in step
                if let Some(mut sh) = buf.shadow.take() {
                    self.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut sh)?;
                    buf.shadow = Some(sh);
                }
                Ok(())
            }
            Dtype::Bf16 => self.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut buf.mem),
        }
    }
    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn kv_new(&self, geom: AttnGeom, max_pages: usize) -> Result<CudaKv> {
        let _op = self.enter()?;
        ensure!(
            HEAD_DIMS.contains(&geom.head_dim),
            "the CUDA attention kernel supports head_dim {:?}, this model has {}",
            HEAD_DIMS,
            geom.head_dim
        );
        ensure!(geom.page_size > 0 && max_pages > 0, "kv_new: empty pool");
        let page_elems = geom.n_layers * 2 * geom.n_kv_heads * geom.page_size * geom.head_dim;
        let bytes = max_pages * page_elems * 2;
        // say what fits before asking the driver for what cannot
        if let Ok(m) = self.mem_info() {
            if bytes > m.usable() {
                let tokens_fit = m.usable() / (page_elems * 2) * geom.page_size;
                bail!(
                    "cuda: the KV cache for {} tokens ({max_pages} pages, {:.2} GiB) does not fit: {:.2} GiB usable on {}; at most {tokens_fit} tokens fit \
                     (fewer queries or rollouts per batch, or shorter chunks/memories)",
                    max_pages * geom.page_size,
                    bytes as f64 / (1u64 << 30) as f64,
                    m.usable() as f64 / (1u64 << 30) as f64,
                    self.device
                );
            }
        }
        let pool = self.alloc_zeroed(bytes).map_err(|e| {
            anyhow!("cuda: the KV cache ({max_pages} pages, {:.2} GiB) does not fit on the device: {e:#}", bytes as f64 / (1u64 << 30) as f64)
        })?;
        Ok(CudaKv { pool, geom, max_pages, page_elems })
    }
    fn kv_copy_page(&self, kv: &mut CudaKv, src: u32, dst: u32, _n_tokens: usize) -> Result<()> {
        let _op = self.enter()?;
        ensure!((src as usize) < kv.max_pages && (dst as usize) < kv.max_pages, "kv_copy_page: page beyond the pool of {}", kv.max_pages);
        // The whole page (all layers): slots past n_tokens are rewritten before they are read.
        let bytes = kv.page_elems * 2;
        let base = kv.ptr();
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(base + (dst as usize * bytes) as u64, base + (src as usize * bytes) as u64, bytes, self.stream.cu_stream())
        }
        .map_err(|e| self.err("KV page copy", e))
    }
    fn kv_release_page(&self, _kv: &mut CudaKv, _page: u32) {}

    fn gather_rows(&self, x: &CudaBuf, rows: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if rows.is_empty() || d == 0 {
            return Ok(());
        }
        if let Some(&bad) = rows.iter().find(|&&r| (r as usize + 1) * d > x.len) {
            bail!("cuda gather_rows: row {bad} beyond a buffer of {} elements", x.len);
        }
        out.set_output(rows.len() * d, x.dtype, "gather_rows")?;
        let (src, dst, d64) = (x.ptr(), out.ptr(), d as i64);
        let rp = self.meta("rows", bytemuck::cast_slice(rows))?;
        let name = if x.dtype == Dtype::F32 { "gather_rows_b32" } else { "gather_rows_b16" };
        launch!(self, name, rows.len(), 256, src, rp, d64, dst)
    }
    fn embed(&self, table: &CudaBuf, ids: &[u32], d: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if ids.is_empty() {
            return Ok(());
        }
        let max = ids.iter().copied().max().unwrap() as usize;
        let t = self.weight_ptr(table, (max + 1) * d, "embed", "the embedding table")?;
        out.set_output(ids.len() * d, Dtype::F32, "embed")?;
        let (o, d32) = (out.ptr(), d as i32);
        let ip = self.meta("ids", bytemuck::cast_slice(ids))?;
        launch!(self, "embed_bf16", ids.len(), 256, t, ip, d32, o)
    }
    fn rmsnorm(&self, x: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if rows == 0 {
            return Ok(());
        }
        x.need(rows * d, "rmsnorm", "x")?;
        let wp = self.weight_ptr(w, d, "rmsnorm", "the norm weight")?;
        out.set_output(rows * d, Dtype::Bf16, "rmsnorm")?;
        let (xp, op, d32) = (x.ptr(), out.ptr(), d as i32);
        launch!(self, &format!("rmsnorm_{}", x.dtype.suffix()), rows, NORM_THREADS, xp, wp, eps, d32, op)
    }
    fn add_rmsnorm(&self, resid: &mut CudaBuf, delta: &CudaBuf, w: &CudaBuf, eps: f32, rows: usize, d: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if rows == 0 {
            return Ok(());
        }
        resid.touch();
        resid.need(rows * d, "add_rmsnorm", "resid")?;
        delta.need(rows * d, "add_rmsnorm", "delta")?;
        let wp = self.weight_ptr(w, d, "add_rmsnorm", "the norm weight")?;
        out.set_output(rows * d, Dtype::Bf16, "add_rmsnorm")?;
        let (rp, dp, op, d32) = (resid.ptr(), delta.ptr(), out.ptr(), d as i32);
        let name = format!("add_rmsnorm_{}_{}", resid.dtype.suffix(), delta.dtype.suffix());
        launch!(self, &name, rows, NORM_THREADS, rp, dp, wp, eps, d32, op)
    }
    fn add(&self, resid: &mut CudaBuf, delta: &CudaBuf, n: usize) -> Result<()> {
        let _op = self.enter()?;
        if n == 0 {
            return Ok(());
        }
        resid.touch();
        resid.need(n, "add", "resid")?;
        delta.need(n, "add", "delta")?;
        let (rp, dp, n64) = (resid.ptr(), delta.ptr(), n as i64);
        let name = format!("add_{}_{}", resid.dtype.suffix(), delta.dtype.suffix());
        launch!(self, &name, grid_for(n, 256), 256, rp, dp, n64)
    }
    fn matmul(&self, x: &CudaBuf, w: &CudaBuf, bias: Option<&CudaBuf>, m: usize, k: usize, n: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        x.need(m * k, "matmul", "x")?;
        let wp = self.base_weight_ptr(w, n, k, "matmul")?;
        out.set_output(m * n, Dtype::F32, "matmul")?;
        let (xp, _keep) = self.bf16_input(x, m * k)?;
        let yp = out.ptr();
        self.gemm(gemm::GemmArgs { m, n, k, x: xp, ldx: k, w: wp, ldw: k, y: yp, ldy: n, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        if let Some(b) = bias {
            b.need(n, "matmul", "the bias")?;
            let (bp, n32, total) = (b.ptr(), n as i32, (m * n) as i64);
            launch!(self, &format!("add_bias_{}", b.dtype.suffix()), grid_for(m * n, 256), 256, yp, bp, n32, total)?;
        }
        // a lazily merged weight: y[:, row0..row0 + n_out] += scale·(x Aᵀ) Bᵀ per pending pair
        for t in &w.terms {
            self.lora_delta(xp, m, t, yp + (t.row0 * 4) as u64, n, false)?;
        }
        Ok(())
    }
    fn lora(&self, x: &CudaBuf, a: &CudaBuf, b: &CudaBuf, scale: f32, m: usize, k: usize, r: usize, n_out: usize, out: &mut CudaBuf, col0: usize, ld: usize) -> Result<()> {
        let _op = self.enter()?;
        if m == 0 || n_out == 0 || r == 0 {
            return Ok(());
        }
        ensure!(col0 + n_out <= ld, "cuda lora: columns {col0}..{} beyond rows of {ld}", col0 + n_out);
        x.need(m * k, "lora", "x")?;
        out.touch();
        out.need(m * ld, "lora", "out")?;
        let ap = self.weight_ptr(a, r * k, "lora", "A")?;
        let bp = self.weight_ptr(b, n_out * r, "lora", "B")?;
        let (xp, _keep) = self.bf16_input(x, m * k)?;
        // xa [m, r] = x · Aᵀ (bf16: the next GEMM's input), then out[:, col0..] += scale · xa · Bᵀ
        let xa = self.scratch("lora_xa", m * r * 2)?;
        self.gemm(gemm::GemmArgs { m, n: r, k, x: xp, ldx: k, w: ap, ldw: k, y: xa, ldy: r, y_bf16: true, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
        let y = out.ptr() + (col0 * out.dtype.size()) as u64;
        self.gemm(gemm::GemmArgs { m, n: n_out, k: r, x: xa, ldx: r, w: bp, ldw: r, y, ldy: ld, y_bf16: out.dtype == Dtype::Bf16, alpha: scale, beta: 1.0, xt: false, wt: false })
    }
    fn rope(&self, qkv: &mut CudaBuf, positions: &[u32], inv_freq: &[f32], g: AttnGeom) -> Result<()> {
        self.rope_launch("rope", "qkv", qkv, positions, inv_freq, g)
    }
    fn kv_store(&self, kv: &mut CudaKv, layer: usize, qkv: &CudaBuf, slots: &[u32], g: AttnGeom) -> Result<()> {
        let _op = self.enter()?;
        if slots.is_empty() {
            return Ok(());
        }
        ensure!(layer < kv.geom.n_layers, "kv_store: layer {layer} of {}", kv.geom.n_layers);
        if let Some(&bad) = slots.iter().find(|&&s| s as usize / g.page_size >= kv.max_pages) {
            bail!("kv_store: slot {bad} beyond the pool of {} pages", kv.max_pages);
        }
        qkv.need(slots.len() * g.qkv_dim(), "kv_store", "qkv")?;
        let sp = self.meta("slots", bytemuck::cast_slice(slots))?;
        let (pool, q) = (kv.ptr(), qkv.ptr());
        let (layer, n_layers, n_kv, hd, ps, q_dim, width) =
            (layer as i32, g.n_layers as i32, g.n_kv_heads as i32, g.head_dim as i32, g.page_size as i32, g.q_dim() as i32, g.qkv_dim() as i32);
        launch!(self, &format!("kv_store_{}", qkv.dtype.suffix()), slots.len(), 128, pool, q, sp, layer, n_layers, n_kv, hd, ps, q_dim, width)
    }
    fn attention(&self, kv: &CudaKv, layer: usize, qkv: &CudaBuf, seqs: &[AttnSeq], g: AttnGeom, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        let rows = seqs.iter().map(|s| s.q_row + s.n_q).max().unwrap_or(0);
        if rows == 0 {
            return Ok(());
        }
        ensure!(HEAD_DIMS.contains(&g.head_dim), "cuda attention: head_dim {} not in {:?}", g.head_dim, HEAD_DIMS);
        ensure!(layer < kv.geom.n_layers, "attention: layer {layer} of {}", kv.geom.n_layers);
        qkv.need(rows * g.qkv_dim(), "attention", "qkv")?;
        let p = attn::plan(seqs, &g, kv.max_pages, rows, self.n_sm)?;
        out.set_output(rows * g.q_dim(), Dtype::Bf16, "attention")?;
        if p.items.is_empty() {
            return Ok(());
        }
        let sp = self.meta("attn_seqs", bytemuck::cast_slice(&p.seqs))?;
        let pg = self.meta("attn_pages", bytemuck::cast_slice(&p.pages))?;
        let ip = self.meta("attn_items", bytemuck::cast_slice(&p.items))?;
        let po = self.scratch("attn_part_o", p.part_slots * g.head_dim * 4)?;
        let pm = self.scratch("attn_part_ml", p.part_slots * 2 * 4)?;
        let (pool, q, o) = (kv.ptr(), qkv.ptr(), out.ptr());
        let (layer, n_layers, n_kv, ps, width, q_dim, group) =
            (layer as i32, g.n_layers as i32, g.n_kv_heads as i32, g.page_size as i32, g.qkv_dim() as i32, g.q_dim() as i32, (g.n_heads / g.n_kv_heads) as i32);
        let scale_log2 = (1.0 / (g.head_dim as f32).sqrt()) * std::f32::consts::LOG2_E;
        let name = format!("attention_hd{}_{}", g.head_dim, qkv.dtype.suffix());
        launch!(self, &name, p.items.len(), ATTN_THREADS, pool, layer, n_layers, n_kv, ps, q, width, q_dim, group, o, sp, pg, ip, po, pm, scale_log2)?;
        if !p.combine.is_empty() {
            let cp = self.meta("attn_combine", bytemuck::cast_slice(&p.combine))?;
            let hd = g.head_dim as i32;
            launch!(self, "attn_combine", p.combine.len(), 64, po, pm, cp, sp, hd, group, q_dim, o)?;
        }
        Ok(())
    }
    fn swiglu(&self, gate_up: &CudaBuf, m: usize, i: usize, out: &mut CudaBuf) -> Result<()> {
        let _op = self.enter()?;
        if m == 0 || i == 0 {
            return Ok(());
        }
        gate_up.need(m * 2 * i, "swiglu", "gate_up")?;
        out.set_output(m * i, Dtype::Bf16, "swiglu")?;
        let (gp, op, m64, i32_) = (gate_up.ptr(), out.ptr(), m as i64, i as i32);
        launch!(self, &format!("swiglu_{}", gate_up.dtype.suffix()), grid_for(m * i, 256), 256, gp, m64, i32_, op)
    }
    fn logprobs(&self, h: &CudaBuf, head: &CudaBuf, targets: &[u32], d: usize, vocab: usize) -> Result<Vec<f32>> {
        let _op = self.enter()?;
        let rows = targets.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
            bail!("logprobs: target {bad} outside the vocabulary of {vocab}");
        }
        h.need(rows * d, "logprobs", "h")?;
        let wp = self.weight_ptr(head, vocab * d, "logprobs", "the head")?;
        let (hp, _keep) = self.bf16_input(h, rows * d)?;
        let mut out = Vec::with_capacity(rows);
        for r0 in (0..rows).step_by(LOGPROB_MAX_ROWS) {
            let rb = LOGPROB_MAX_ROWS.min(rows - r0);
            // vocabulary tile: as wide as the scratch allows, a multiple of 256 columns
            let vt = ((LOGPROB_SCRATCH / rb) / 256 * 256).clamp(256, vocab.next_multiple_of(256)).min(vocab);
            let logits = self.scratch("lp_logits", rb * vt * 4)?;
            let state = self.scratch("lp_state", rb * 3 * 4)?;
            let (run_m, run_s, tgt) = (state, state + (rb * 4) as u64, state + (rb * 8) as u64);
            let tp = self.meta("targets", bytemuck::cast_slice(&targets[r0..r0 + rb]))?;
            let hrows = hp + (r0 * d * 2) as u64;
            for v0 in (0..vocab).step_by(vt) {
                let vn = vt.min(vocab - v0);
                let w = wp + (v0 * d * 2) as u64;
                self.gemm(gemm::GemmArgs { m: rb, n: vn, k: d, x: hrows, ldx: d, w, ldw: d, y: logits, ldy: vn, y_bf16: false, alpha: 1.0, beta: 0.0, xt: false, wt: false })?;
                let (vn32, v032, first) = (vn as i32, v0 as i32, (v0 == 0) as i32);
                launch!(self, "logprob_tile", rb, LP_THREADS, logits, vn32, v032, tp, run_m, run_s, tgt, first)?;
            }
            let st: Vec<f32> = self.dtoh(state, rb * 3)?;
            let (m, s, t) = (&st[..rb], &st[rb..2 * rb], &st[2 * rb..]);
            out.extend((0..rb).map(|i| (t[i] as f64 - m[i] as f64 - (s[i] as f64).ln()) as f32));
        }
        Ok(out)
    }
    fn sample(&self, logits: &CudaBuf, vocab: usize, params: &[SampleParams], uniform: &[f64]) -> Result<Vec<Sampled>> {
        let _op = self.enter()?;
        let rows = params.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        ensure!(uniform.len() >= rows, "sample: {} uniforms for {rows} rows", uniform.len());
        logits.need(rows * vocab, "sample", "logits")?;
        let temps: Vec<f32> = params.iter().map(|p| p.temperature).collect();
        let top_ps: Vec<f32> = params.iter().map(|p| p.top_p).collect();
        let tp = self.meta("temps", bytemuck::cast_slice(&temps))?;
        let pp = self.meta("top_ps", bytemuck::cast_slice(&top_ps))?;
        let up = self.meta("uniforms", bytemuck::cast_slice(&uniform[..rows]))?;
        let res = self.scratch("sample_out", rows * 8)?;
        let (lp, tok, vocab32) = (logits.ptr(), res, vocab as i32);
        let lps = res + (rows * 4) as u64;
        launch!(self, &format!("sample_{}", logits.dtype.suffix()), rows, SAMPLE_THREADS, lp, vocab32, tp, pp, up, tok, lps)?;
        let toks: Vec<u32> = self.dtoh(tok, rows)?;
        let lps: Vec<f32> = self.dtoh(lps, rows)?;
        Ok(toks.into_iter().zip(lps).map(|(token, logprob)| Sampled { token, logprob }).collect())
    }
}

#[cfg(test)]
mod kernel_table_tests {
    use super::{kernels, KERNEL_NAMES};

    /// Every kernel the backend loads by name at start is an entry point of the embedded module it
    /// is listed under, and every embedded module is listed: a renamed or moved kernel fails here,
    /// without a GPU, instead of at the first `CudaBackend::new` on one.
    #[test]
    fn every_listed_kernel_is_embedded() {
        if kernels::KERNELS.is_empty() {
            println!("skipped: built without nvcc (no kernels embedded)");
            return;
        }
        for &(module, names) in KERNEL_NAMES {
            let (_, _, ptx) = kernels::KERNELS.iter().find(|k| k.0 == module).unwrap_or_else(|| panic!("kernels/{module}.cu is not embedded"));
            for name in names {
                assert!(ptx.contains(&format!(".entry {name}(")), "kernel {name} is not an entry point of kernels/{module}.cu");
            }
        }
        for (module, _, _) in kernels::KERNELS {
            assert!(KERNEL_NAMES.iter().any(|k| k.0 == *module), "kernels/{module}.cu is embedded but none of its kernels is loaded");
        }
    }
}
