//! The device runtime of the CUDA backend: the context and its one stream, the embedded kernel
//! modules and their loading, device buffers (`CudaBuf`: bytes, element count, dtype, an f32
//! parameter's bf16 shadow, a merged weight's pending LoRA terms), allocation (through
//! `alloc::Heap`), host ↔ device copies, the per-kind metadata and scratch caches, and the
//! memory-management ops of the backend traits (upload, download, zeros, write, copy). The op
//! launches are in the family files beside this one.
use super::alloc::{self, AllocMode, DevMem, Heap};
use super::attention::HEAD_DIMS;
use super::gemm;
use super::seam::Device;
use anyhow::{anyhow, bail, ensure, Result};
use half::bf16;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod kernels {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// Element type of a device buffer: the library's one dtype.
pub use crate::backend::Dtype;

pub struct CudaBuf {
    pub(super) mem: DevMem,
    pub(super) len: usize,
    pub(super) dtype: Dtype,
    /// bf16 copy of an f32 parameter (see "Training" above); only `adamw` and `write` keep it.
    pub(super) shadow: Option<DevMem>,
    /// LoRA pairs folded lazily into this bf16 weight by `lora_merge` (see "Training" above).
    pub(super) terms: Vec<LoraTerm>,
}

/// `w[row0 + o, :] += scale · Σ_j b[o, j]·a[j, :]` pending on a merged weight (`w` rows of `k`);
/// `a`, `b` address bf16 `[r, k]` and `[n_out, r]` device copies of the pair made by `lora_merge`
/// and owned by the term (`_owned`), so the adapter may update or free its buffers afterwards
/// without the merged weight reading freed or changed memory.
#[derive(Clone)]
pub(super) struct LoraTerm {
    pub(super) row0: usize,
    pub(super) a: u64,
    pub(super) b: u64,
    pub(super) scale: f32,
    pub(super) k: usize,
    pub(super) r: usize,
    pub(super) n_out: usize,
    pub(super) _owned: Arc<(DevMem, DevMem)>,
}

impl CudaBuf {
    pub(super) fn new(mem: DevMem, len: usize, dtype: Dtype) -> Self {
        CudaBuf { mem, len, dtype, shadow: None, terms: Vec::new() }
    }
    pub(super) fn ptr(&self) -> u64 {
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
    pub(super) fn touch(&mut self) {
        self.shadow = None;
        self.terms.clear();
    }
    /// Declare that an op writes `n` elements of `dtype` into this buffer.
    pub(super) fn set_output(&mut self, n: usize, dtype: Dtype, op: &str) -> Result<()> {
        self.touch();
        ensure!(
            n <= self.len && n * dtype.size() <= self.mem.len(),
            "cuda {op}: output of {n} {} elements does not fit a buffer of {} elements ({} bytes)",
            dtype.name(),
            self.len,
            self.mem.len()
        );
        self.dtype = dtype;
        Ok(())
    }
    pub(super) fn need(&self, n: usize, op: &str, what: &str) -> Result<()> {
        ensure!(n <= self.len, "cuda {op}: {what} needs {n} elements, the buffer has {}", self.len);
        Ok(())
    }
}

/// Kernels of each embedded module, by family, loaded by name when the backend opens (a missing
/// one is an error then, not at first use).
pub(super) const KERNEL_NAMES: &[(&str, &[&str])] = &[
    super::norm::KERNELS,
    super::rope::KERNELS,
    super::swiglu::KERNELS,
    super::memory::KERNELS,
    super::attention::KERNELS,
    super::attention_dense::KERNELS,
    super::logprob::KERNELS,
    super::sample::KERNELS,
    super::optim::KERNELS,
    super::conformance::KERNELS,
];

/// Whether the NVIDIA driver library loads and reports at least one device. Never panics.
pub fn device_present() -> bool {
    super::real::device_present()
}

/// The embedded modules: (file stem, sm_90 cubin, compute_90 PTX).
#[cfg(test)]
pub(crate) fn embedded_kernels() -> &'static [(&'static str, &'static [u8], &'static str)] {
    kernels::KERNELS
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
    /// The device below the seam: the real GPU, or the emulated one (`seam.rs`).
    pub(super) dev: Arc<dyn Device>,
    /// Set when `dev` is the emulated device (its statistics for the tests).
    emu: Option<Arc<super::emulated::EmuDevice>>,
    /// Device memory (declared before `workspace` and the caches only for readability: every
    /// `DevMem` holds the heap alive itself).
    pub(super) heap: Arc<Heap>,
    pub(super) workspace: DevMem,
    meta: Mutex<HashMap<&'static str, (Vec<u8>, DevMem)>>,
    scratch: Mutex<HashMap<&'static str, DevMem>>,
    /// Held while an op enqueues its work: the metadata and scratch pointers an op obtains stay
    /// valid only until another op of the same kind replaces them.
    op: Mutex<()>,
    pub(super) n_sm: usize,
    pub(super) device: String,
}

pub(super) fn to_bf16_bits(data: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; data.len()];
    out.par_chunks_mut(1 << 16).zip(data.par_chunks(1 << 16)).for_each(|(o, d)| {
        for (o, &x) in o.iter_mut().zip(d) {
            *o = bf16::from_f32(x).to_bits();
        }
    });
    out
}

pub(super) fn grid_for(n: usize, block: u32) -> u32 {
    (n.div_ceil(block as usize)).clamp(1, 1 << 20) as u32
}

impl CudaBackend {
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
        let dev = super::real::RealDevice::open(ordinal, kernels::KERNELS, KERNEL_NAMES)?;
        Self::on(Arc::new(dev), None, alloc)
    }

    /// The backend on the emulated device: every kernel's real PTX run by the interpreter on
    /// the CPU (tests and CI without a GPU; see `emulated.rs` for what it proves).
    pub fn emulated() -> Result<Self> {
        if let Some(why) = kernels::MISSING {
            bail!("CUDA backend: built without kernels ({why})");
        }
        let dev = Arc::new(super::emulated::EmuDevice::new(kernels::KERNELS)?);
        for &(module, names) in KERNEL_NAMES {
            for name in names {
                ensure!(dev.kernel_names().iter().any(|n| n == name), "kernel {name} missing from kernels/{module}.cu");
            }
        }
        Self::on(dev.clone(), Some(dev), None)
    }

    /// Interpreter statistics when this backend runs on the emulated device.
    pub fn emulator_stats(&self) -> Option<super::emulated::EmuStats> {
        self.emu.as_ref().map(|e| e.stats())
    }

    /// Per-kernel counters of the emulated device's launches (`ptx::counters`) since the last
    /// reset; None on a real device.
    pub fn emulator_counters(&self) -> Option<std::collections::BTreeMap<String, super::emulated::KernelCounters>> {
        self.emu.as_ref().map(|e| e.counters())
    }

    pub fn emulator_reset_counters(&self) {
        if let Some(e) = &self.emu {
            e.reset_counters();
        }
    }

    /// Why kernel `name` cannot run on the emulated device (outside the interpreter's subset).
    pub fn emulator_unsupported(&self, name: &str) -> Option<String> {
        self.emu.as_ref().and_then(|e| e.unsupported(name))
    }

    /// The backend's kernels the emulated device cannot run, each with why (empty on the real
    /// device, and on the emulated one once the interpreter covers every instruction they use).
    pub fn emulator_blockers(&self) -> Vec<(&'static str, String)> {
        KERNEL_NAMES.iter().flat_map(|(_, names)| names.iter()).filter_map(|&n| self.emulator_unsupported(n).map(|why| (n, why))).collect()
    }

    fn on(dev: Arc<dyn Device>, emu: Option<Arc<super::emulated::EmuDevice>>, alloc: Option<&str>) -> Result<Self> {
        // The dense attention backward's dK/dV kernel carves its tiles from dynamic shared memory
        // (up to ~69 KiB at head_dim 128, over the 48 KiB a launch gets without asking).
        for hd in HEAD_DIMS {
            let name = format!("attn_dense_dkdv_hd{hd}");
            let bytes = super::attention_dense::dkdv_smem_bytes(hd) as u32;
            dev.set_max_dynamic_smem(&name, bytes)?;
        }
        // the allocator: the stream-ordered pool where it works, plain allocations otherwise
        let mode = alloc::choose_mode(alloc, dev.pools_supported(), || dev.probe_pool())?;
        let heap = Heap::new(mode, dev.allocator());
        let workspace = heap.alloc(gemm::WORKSPACE_BYTES).map_err(|e| anyhow!("cuda: allocating the cuBLASLt workspace: {e}"))?;
        let (n_sm, device) = (dev.sm_count(), dev.name());
        Ok(CudaBackend {
            dev,
            emu,
            heap,
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
    pub(super) fn enter(&self) -> Result<std::sync::MutexGuard<'_, ()>> {
        let g = self.op.lock().unwrap_or_else(|e| e.into_inner());
        self.dev.bind()?;
        Ok(g)
    }

    pub(super) fn alloc(&self, bytes: usize) -> Result<DevMem> {
        self.heap.alloc(bytes).map_err(|e| self.alloc_error(bytes, e))
    }

    /// `alloc` with every byte zero (in stream order).
    pub(super) fn alloc_zeroed(&self, bytes: usize) -> Result<DevMem> {
        let m = self.alloc(bytes)?;
        self.dev.memset(m.ptr(), 0, bytes)?;
        Ok(m)
    }

    /// Which allocator serves this backend's device memory.
    pub fn alloc_mode(&self) -> &AllocMode {
        self.heap.mode()
    }

    /// An allocation failed: say how much was asked and how much the device has.
    pub(super) fn alloc_error(&self, bytes: usize, e: String) -> anyhow::Error {
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
    pub(super) fn htod(&self, bytes: &[u8], dst: &mut DevMem) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        ensure!(bytes.len() <= dst.len(), "cuda: copying {} bytes into a device buffer of {}", bytes.len(), dst.len());
        self.dev.htod(bytes, dst.ptr())
    }

    /// A device copy of small host data, cached per `kind` by content (see the module comment).
    /// The pointer is valid until the next call with the same kind.
    pub(super) fn meta(&self, kind: &'static str, bytes: &[u8]) -> Result<u64> {
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
    pub(super) fn scratch(&self, name: &'static str, bytes: usize) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap();
        if s.get(name).is_none_or(|b| b.len() < bytes) {
            let b = self.alloc(bytes.next_power_of_two())?;
            s.insert(name, b); // the old one is freed in stream order
        }
        Ok(s[name].ptr())
    }

    pub(super) fn sync(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Copy `n` elements of `T` to the host (synchronizes the stream).
    pub(super) fn dtoh<T: bytemuck::Pod>(&self, ptr: u64, n: usize) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); n];
        self.dev.dtoh(ptr, bytemuck::cast_slice_mut(&mut out))?;
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
    pub(super) fn bf16_input(&self, x: &CudaBuf, n: usize) -> Result<(u64, Option<DevMem>)> {
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
    pub(super) fn weight_ptr(&self, w: &CudaBuf, n: usize, op: &str, what: &str) -> Result<u64> {
        ensure!(w.terms.is_empty(), "cuda {op}: {what} carries {} pending LoRA terms (lora_merge); only matmul and matmul_dx apply them", w.terms.len());
        w.need(n, op, what)?;
        match (w.dtype, &w.shadow) {
            (Dtype::Bf16, _) => Ok(w.ptr()),
            (Dtype::F32, Some(sh)) => Ok(sh.ptr()),
            (Dtype::F32, None) => bail!("cuda {op}: {what} must be bf16 (uploaded weights are)"),
        }
    }

    /// Host copy of a weight with its pending LoRA terms applied (f32, the value the buffer stands for).
    pub(super) fn download_merged(&self, buf: &CudaBuf) -> Result<Vec<f32>> {
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
    pub(super) fn base_weight_ptr(&self, w: &CudaBuf, n: usize, k: usize, op: &str) -> Result<u64> {
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

    /// Host copy of the whole KV pool (bf16 values as f32, layout of `attention::CudaKv`), for tests.
    pub fn kv_download(&self, kv: &super::CudaKv) -> Result<Vec<f32>> {
        let _op = self.enter()?;
        Ok(self.dtoh::<u16>(kv.ptr(), kv.max_pages * kv.page_elems)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect())
    }

    /// What this backend runs on, for `infomem-engine device` and the GPU check's first line:
    /// device, driver, the libraries loaded (and from where), memory, allocator, kernels.
    pub fn report(&self) -> Result<serde_json::Value> {
        let _op = self.enter()?;
        let m = self.mem_info()?;
        let gib = |b: usize| (b as f64 / (1u64 << 30) as f64 * 100.0).round() / 100.0;
        let mut r = serde_json::json!({
            "device": self.device,
            "multiprocessors": self.n_sm,
            "memory_total_gib": gib(m.total),
            "memory_free_gib": gib(m.free),
            "allocator": self.heap.mode().short(),
            "allocator_detail": self.heap.mode().describe(),
            "kernels_nvcc": kernels::NVCC_VERSION,
            "kernel_modules": KERNEL_NAMES.len(),
            "kernels": KERNEL_NAMES.iter().map(|(_, n)| n.len()).sum::<usize>(),
        });
        if let (Some(o), serde_json::Value::Object(d)) = (r.as_object_mut(), self.dev.report()?) {
            o.extend(d);
        }
        Ok(r)
    }

}

impl CudaBackend {
    /// Check a gradient buffer that an op accumulates into: f32 (every `zeros` is), long enough.
    pub(super) fn grad_acc(buf: &mut CudaBuf, n: usize, op: &str, what: &str) -> Result<u64> {
        ensure!(buf.dtype == Dtype::F32, "cuda {op}: {what} accumulates in f32 and must be an f32 buffer (from zeros)");
        buf.need(n, op, what)?;
        buf.touch();
        Ok(buf.ptr())
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.dev.synchronize();
    }
}

pub(super) fn synchronize(be: &CudaBackend) -> Result<()> {
    let _op = be.enter()?;
    be.sync()
}

pub(super) fn upload(be: &CudaBackend, data: &[f32]) -> Result<CudaBuf> {
    let _op = be.enter()?;
    be.upload_as(data, Dtype::Bf16)
}

/// An f32 master with its bf16 shadow from the start (as `adamw` would make it): a resumed
/// adapter is not rounded to bf16 on its way back to the device.
pub(super) fn upload_param(be: &CudaBackend, data: &[f32]) -> Result<CudaBuf> {
    let _op = be.enter()?;
    let mut b = be.upload_as(data, Dtype::F32)?;
    let mut sh = be.alloc((data.len() * 2).max(1))?;
    be.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut sh)?;
    b.shadow = Some(sh);
    Ok(b)
}

pub(super) fn zeros(be: &CudaBackend, n: usize) -> Result<CudaBuf> {
    let _op = be.enter()?;
    let mem = be.alloc_zeroed(n * 4)?;
    Ok(CudaBuf::new(mem, n, Dtype::F32))
}

pub(super) fn download(be: &CudaBackend, buf: &CudaBuf) -> Result<Vec<f32>> {
    let _op = be.enter()?;
    if !buf.terms.is_empty() {
        return be.download_merged(buf);
    }
    Ok(match buf.dtype {
        Dtype::F32 => be.dtoh::<f32>(buf.ptr(), buf.len)?,
        Dtype::Bf16 => be.dtoh::<u16>(buf.ptr(), buf.len)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect(),
    })
}

pub(super) fn write(be: &CudaBackend, buf: &mut CudaBuf, data: &[f32]) -> Result<()> {
    let _op = be.enter()?;
    ensure!(buf.len == data.len(), "write: length {} into buffer of {}", data.len(), buf.len);
    buf.terms.clear();
    match buf.dtype {
        Dtype::F32 => {
            be.htod(bytemuck::cast_slice(data), &mut buf.mem)?;
            // an f32 parameter keeps its bf16 shadow in step
            if let Some(mut sh) = buf.shadow.take() {
                be.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut sh)?;
                buf.shadow = Some(sh);
            }
            Ok(())
        }
        Dtype::Bf16 => be.htod(bytemuck::cast_slice(&to_bf16_bits(data)), &mut buf.mem),
    }
}

pub(super) fn copy(be: &CudaBackend, src: &CudaBuf, dst: &mut CudaBuf) -> Result<()> {
    let _op = be.enter()?;
    ensure!(src.len == dst.len, "copy: {} elements into a buffer of {}", src.len, dst.len);
    let bytes = src.len * src.dtype.size();
    ensure!(dst.mem.len() >= bytes, "copy: {bytes} bytes into a buffer of {} bytes", dst.mem.len());
    dst.touch();
    if bytes > 0 {
        be.dev.dtod(dst.ptr(), src.ptr(), bytes)?;
    }
    dst.dtype = src.dtype;
    // the copy stands for the same value: same pending LoRA terms, and an f32 parameter's
    // bf16 shadow is copied along so the copy can serve as a weight too
    dst.terms = src.terms.clone();
    if let Some(sh) = &src.shadow {
        let s2 = be.alloc(src.len * 2)?;
        be.dev.dtod(s2.ptr(), sh.ptr(), src.len * 2)?;
        dst.shadow = Some(s2);
    }
    Ok(())
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
