//! The emulated device behind the seam (`seam::Device`): no GPU, no driver. Memory is host
//! memory with device-like addresses (`ptx::mem`), kernels run their real compute_90 PTX in the
//! interpreter (`ptx/`) after launch validation (`ptx::launch`), with the shared-memory race
//! detector on. The GEMMs are computed on the CPU with cuBLASLt's column-major semantics applied
//! to the descriptors `gemm::describe` builds, so the backend's row-major → cuBLASLt mapping is
//! what gets checked: bf16 inputs, f32 accumulation in a stated order, refusing what it does not
//! implement (`emulated_gemm.rs`).
//!
//! Everything runs synchronously under one lock, in call order — the one in-order stream.
use super::alloc::DeviceAlloc;
use super::emulated_gemm;
use super::gemm::{describe, GemmArgs};
use super::ptx::{self, counters::Counters, mem::GlobalMem};
use super::seam::{DevMemInfo, Device, KArg};
use anyhow::{bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Memory the emulated device claims to have (allocations only use host memory as they are made).
const TOTAL_BYTES: usize = 16 << 30;

struct State {
    gmem: GlobalMem,
    max_dyn: HashMap<String, u32>,
    /// A failure found where it could not be returned (a bad free from a destructor): the next
    /// operation reports it.
    deferred: Option<String>,
}

pub struct EmuDevice {
    program: ptx::Program,
    state: Arc<Mutex<State>>,
    thread_insts: AtomicU64,
    nanos: AtomicU64,
    launches: AtomicU64,
    /// Per kernel name: what its launches did (`ptx::counters`), since the last reset.
    counters: Mutex<BTreeMap<String, KernelCounters>>,
}

/// The counters of one kernel's launches, summed.
#[derive(Clone, Debug, Default)]
pub struct KernelCounters {
    pub launches: u64,
    pub counters: Counters,
}

/// A per-kernel counter snapshot as a text table (one line per kernel).
pub fn counters_table(snap: &BTreeMap<String, KernelCounters>) -> String {
    let mut s = format!(
        "{:<34} {:>8} {:>12} {:>12} {:>12} {:>12} {:>9} {:>9} {:>10} {:>8}\n",
        "kernel", "launches", "warp issues", "global B", "HBM B (min)", "shared B", "sect/req", "ideal", "bank confl", "mma"
    );
    for (name, k) in snap {
        let c = &k.counters;
        let g = ptx::counters::Traffic::ALL.iter().filter(|t| t.name().starts_with("global")).map(|&t| c.bytes_of(t)).sum::<u64>();
        let sh = ptx::counters::Traffic::ALL.iter().filter(|t| t.name().starts_with("shared")).map(|&t| c.bytes_of(t)).sum::<u64>();
        let (req, act, ideal) = (c.global_ld.requests + c.global_st.requests, c.global_ld.actual + c.global_st.actual, c.global_ld.ideal + c.global_st.ideal);
        let per = |x: u64| if req == 0 { "-".to_string() } else { format!("{:.2}", x as f64 / req as f64) };
        s += &format!(
            "{name:<34} {:>8} {:>12} {g:>12} {:>12} {sh:>12} {:>9} {:>9} {:>10} {:>8}\n",
            k.launches,
            c.warp_insts,
            c.hbm_bytes(),
            per(act),
            per(ideal),
            c.bank_conflicts(),
            c.mma
        );
    }
    s
}

/// Interpreter throughput so far (for the speed report of the tests).
#[derive(Clone, Copy, Debug)]
pub struct EmuStats {
    pub launches: u64,
    pub thread_insts: u64,
    pub seconds: f64,
}

impl EmuStats {
    pub fn thread_insts_per_sec(&self) -> f64 {
        self.thread_insts as f64 / self.seconds.max(1e-9)
    }
}

impl EmuDevice {
    /// Load every embedded module's PTX (name, cubin, ptx).
    pub fn new(modules: &[(&str, &[u8], &str)]) -> Result<Self> {
        let mut gmem = GlobalMem::new();
        let sources: Vec<(&str, &str)> = modules.iter().map(|m| (m.0, m.2)).collect();
        let program = ptx::Program::load(&sources, &mut gmem)?;
        Ok(EmuDevice {
            program,
            state: Arc::new(Mutex::new(State { gmem, max_dyn: HashMap::new(), deferred: None })),
            thread_insts: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            counters: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn stats(&self) -> EmuStats {
        EmuStats {
            launches: self.launches.load(Ordering::Relaxed),
            thread_insts: self.thread_insts.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }

    /// What each kernel's launches did since the last `reset_counters` (or the start).
    pub fn counters(&self) -> BTreeMap<String, KernelCounters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn reset_counters(&self) {
        self.counters.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = s.deferred.take() {
            bail!("emulated device: {e}");
        }
        Ok(s)
    }

    /// The interpreter's view of the kernel names it can run (tests list them).
    pub fn kernel_names(&self) -> Vec<String> {
        self.program.modules.iter().flat_map(|m| m.funcs.iter().map(|f| f.name.clone())).collect()
    }

    /// Why a kernel cannot run here (an instruction outside the interpreter's subset), if so.
    pub fn unsupported(&self, name: &str) -> Option<String> {
        self.program.get(name).and_then(|(_, f)| f.unsupported.clone())
    }
}

struct EmuAlloc {
    state: Arc<Mutex<State>>,
}

impl DeviceAlloc for EmuAlloc {
    fn alloc(&self, _pool: bool, bytes: usize) -> std::result::Result<u64, (bool, String)> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.gmem.live_bytes + bytes > TOTAL_BYTES {
            return Err((true, format!("emulated device: {bytes} bytes do not fit ({} of {TOTAL_BYTES} in use)", s.gmem.live_bytes)));
        }
        Ok(s.gmem.alloc(bytes))
    }
    fn free(&self, _pool: bool, ptr: u64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = s.gmem.free(ptr) {
            s.deferred.get_or_insert(e.to_string());
        }
    }
    fn sync(&self) {}
    fn trim_pool(&self) {}
}

impl Device for EmuDevice {
    fn name(&self) -> String {
        "emulated sm_90 (PTX interpreter on the CPU)".into()
    }
    fn sm_count(&self) -> usize {
        132
    }
    fn bind(&self) -> Result<()> {
        Ok(())
    }
    fn allocator(&self) -> Box<dyn DeviceAlloc> {
        Box::new(EmuAlloc { state: self.state.clone() })
    }
    /// "Pool" mode of `alloc::Heap`: every allocation exactly its size and every free at once,
    /// so an access one element past a buffer or after its drop misses every live allocation
    /// (the plain mode's rounded, cached blocks would hide both).
    fn pools_supported(&self) -> bool {
        true
    }
    fn probe_pool(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn htod(&self, src: &[u8], dst: u64) -> Result<()> {
        self.lock()?.gmem.slice_mut(dst, src.len(), "host → device copy")?.copy_from_slice(src);
        Ok(())
    }
    fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(self.lock()?.gmem.slice(src, dst.len(), "device → host copy")?);
        Ok(())
    }
    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let mut s = self.lock()?;
        let tmp = s.gmem.slice(src, bytes, "device copy (source)")?.to_vec();
        s.gmem.slice_mut(dst, bytes, "device copy (destination)")?.copy_from_slice(&tmp);
        Ok(())
    }
    fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        self.lock()?.gmem.slice_mut(dst, bytes, "memset")?.fill(byte);
        Ok(())
    }
    fn set_max_dynamic_smem(&self, name: &str, bytes: u32) -> Result<()> {
        let (_, f) = self.program.get(name).with_context(|| format!("emulated device: no kernel named {name}"))?;
        if f.static_smem + bytes as usize > ptx::launch::SM90_MAX_SMEM {
            bail!("emulated device: {name}: {bytes} dynamic + {} static bytes of shared memory exceed sm_90's {}", f.static_smem, ptx::launch::SM90_MAX_SMEM);
        }
        self.lock()?.max_dyn.insert(name.to_string(), bytes);
        Ok(())
    }
    fn launch(&self, name: &str, grid: u32, block: u32, dyn_smem: u32, args: &[KArg]) -> Result<()> {
        let (m, f) = self.program.get(name).with_context(|| format!("emulated device: no kernel named {name}"))?;
        let mut s = self.lock()?;
        let params = ptx::launch::validate(f, &m.name, grid, block, dyn_smem, s.max_dyn.get(name).copied(), args, &s.gmem)?;
        let l = ptx::exec::Launch { module: &m.name, files: &m.files, grid, block, dyn_smem, params: &params, race_check: true, max_thread_insts: ptx::exec::MAX_THREAD_INSTS };
        let t = Instant::now();
        let st = ptx::exec::run(f, &l, &mut s.gmem)?;
        self.nanos.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.thread_insts.fetch_add(st.thread_insts, Ordering::Relaxed);
        self.launches.fetch_add(1, Ordering::Relaxed);
        let mut c = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let k = c.entry(name.to_string()).or_default();
        k.launches += 1;
        k.counters.add(&st.counters);
        Ok(())
    }
    /// cuBLASLt's matmul on `describe`'s layouts: `emulated_gemm` (its summation model and what
    /// it refuses).
    fn gemm(&self, g: &GemmArgs, _workspace: u64) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let d = describe(g.m, g.n, g.k, g.ldx, g.ldw, g.ldy, g.xt, g.wt)?;
        emulated_gemm::check(g, &d)?;
        let mut s = self.lock()?;
        let a = s.gmem.slice(g.w, emulated_gemm::span(&d.a) * 2, "gemm operand A (w)")?.to_vec();
        let b = s.gmem.slice(g.x, emulated_gemm::span(&d.b) * 2, "gemm operand B (x)")?.to_vec();
        let c = s.gmem.slice_mut(g.y, emulated_gemm::span(&d.c) * if g.y_bf16 { 2 } else { 4 }, "gemm output C/D (y)")?;
        emulated_gemm::run(g, &d, &a, &b, c);
        Ok(())
    }
    fn mem_info(&self, _pool: bool) -> Result<DevMemInfo> {
        let live = self.lock()?.gmem.live_bytes;
        Ok(DevMemInfo { free: TOTAL_BYTES.saturating_sub(live), total: TOTAL_BYTES, pool_cached: None })
    }
    fn synchronize(&self) -> Result<()> {
        drop(self.lock()?);
        Ok(())
    }
    fn report(&self) -> Result<serde_json::Value> {
        let st = self.stats();
        Ok(serde_json::json!({
            "compute_capability": "9.0 (emulated)",
            "emulated": true,
            "emulator_launches": st.launches,
            "emulator_thread_instructions": st.thread_insts,
        }))
    }
}
