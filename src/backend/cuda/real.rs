//! The real device behind the seam (`seam::Device`): the CUDA driver through cudarc — one
//! context, one in-order stream, the embedded modules (the sm_90 cubin, or the compute_90 PTX
//! JIT-compiled by the driver), cuBLASLt for the GEMMs, the stream-ordered pool or plain
//! allocations.
use super::alloc::DeviceAlloc;
use super::gemm::{self, GemmArgs};
use super::seam::{DevMemInfo, Device, KArg};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

pub struct RealDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    gemm: gemm::Gemm,
    name: String,
    n_sm: usize,
}

/// Whether the NVIDIA driver library loads and reports at least one device. Never panics.
pub fn device_present() -> bool {
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    matches!(CudaContext::device_count(), Ok(n) if n > 0)
}

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

impl RealDevice {
    /// Open device `ordinal` and load every kernel of `names` (family → kernel names) from the
    /// embedded `modules` (name, sm_90 cubin, compute_90 PTX).
    pub fn open(ordinal: usize, modules: &[(&str, &[u8], &str)], names: &[(&str, &[&'static str])]) -> Result<Self> {
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
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let n_sm = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(132) as usize;
        let mut funcs = HashMap::new();
        for &(module, kernel_names) in names {
            let &(_, cubin, ptx) = modules.iter().find(|k| k.0 == module).with_context(|| format!("kernels/{module}.cu is not in the build"))?;
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
            for &kname in kernel_names {
                let f = m.load_function(kname).map_err(|e| anyhow!("kernel {kname} missing from kernels/{module}.cu: {e:?}"))?;
                funcs.insert(kname, f);
            }
        }
        let gemm = gemm::Gemm::new()?;
        Ok(RealDevice { ctx, stream, funcs, gemm, name, n_sm })
    }

    fn err(what: &str, e: cudarc::driver::DriverError) -> anyhow::Error {
        anyhow!("cuda: {what} failed: {e:?}")
    }
}

/// The driver calls behind `alloc::Heap`, on the backend's one stream.
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

impl Device for RealDevice {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn sm_count(&self) -> usize {
        self.n_sm
    }
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| Self::err("binding the CUDA context (or an earlier asynchronous error)", e))
    }
    fn allocator(&self) -> Box<dyn DeviceAlloc> {
        Box::new(CudaDriverAlloc { stream: self.stream.clone() })
    }
    fn pools_supported(&self) -> bool {
        self.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED).map(|v| v > 0).unwrap_or(false)
    }
    /// Keep freed memory in the pool (release threshold "never"), then allocate, free and
    /// synchronize a 1 MiB block. Any failure says why the pool is not used.
    fn probe_pool(&self) -> std::result::Result<(), String> {
        use cudarc::driver::result;
        let stream = &self.stream;
        unsafe {
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()).result().map_err(|e| format!("cuDeviceGetDefaultMemPool: {e:?}"))?;
            let mut keep: u64 = u64::MAX;
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep as *mut u64 as *mut c_void)
                .result()
                .map_err(|e| format!("setting the pool's release threshold: {e:?}"))?;
            let p = result::malloc_async(stream.cu_stream(), 1 << 20).map_err(|e| format!("cuMemAllocAsync: {e:?}"))?;
            result::free_async(p, stream.cu_stream()).map_err(|e| format!("cuMemFreeAsync: {e:?}"))?;
        }
        stream.synchronize().map_err(|e| format!("synchronize after the pool probe: {e:?}"))
    }
    fn htod(&self, src: &[u8], dst: u64) -> Result<()> {
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(|e| Self::err("host → device copy", e))
    }
    fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if !dst.is_empty() {
            unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.map_err(|e| Self::err("device → host copy", e))?;
        }
        self.synchronize()
    }
    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }.map_err(|e| Self::err("device copy", e))
    }
    fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        unsafe { cudarc::driver::result::memset_d8_async(dst, byte, bytes, self.stream.cu_stream()) }.map_err(|e| Self::err("memset", e))
    }
    fn set_max_dynamic_smem(&self, name: &str, bytes: u32) -> Result<()> {
        let f = self.funcs.get(name).with_context(|| format!("kernel {name} missing"))?;
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .map_err(|e| anyhow!("cuda: allowing {bytes} bytes of dynamic shared memory for {name}: {e:?}"))
    }
    fn launch(&self, name: &str, grid: u32, block: u32, dyn_smem: u32, args: &[KArg]) -> Result<()> {
        let f = self.funcs.get(name).with_context(|| format!("cuda: no kernel named {name}"))?;
        // the driver reads each argument through a pointer to its bytes
        let mut slots: Vec<[u8; 8]> = args.iter().map(|a| a.bytes().0).collect();
        let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s.as_mut_ptr() as *mut c_void).collect();
        unsafe { cudarc::driver::result::launch_kernel(f.cu_function(), (grid, 1, 1), (block, 1, 1), dyn_smem, self.stream.cu_stream(), &mut ptrs) }
            .map_err(|e| anyhow!("cuda: launching {name} failed: {e:?}"))
    }
    fn gemm(&self, g: &GemmArgs, workspace: u64) -> Result<()> {
        unsafe { self.gemm.run(g, workspace, self.stream.cu_stream()) }
    }
    fn mem_info(&self, pool: bool) -> Result<DevMemInfo> {
        self.bind()?;
        let (free, total) = self.ctx.mem_get_info().map_err(|e| anyhow!("cuda: cuMemGetInfo: {e:?}"))?;
        let mut pool_cached = None;
        if pool {
            unsafe {
                let mut p: sys::CUmemoryPool = std::ptr::null_mut();
                if sys::cuDeviceGetDefaultMemPool(&mut p, self.ctx.cu_device()).result().is_ok() {
                    let get = |attr: sys::CUmemPool_attribute| {
                        let mut v: u64 = 0;
                        sys::cuMemPoolGetAttribute(p, attr, &mut v as *mut u64 as *mut c_void).result().map(|_| v as usize).unwrap_or(0)
                    };
                    let reserved = get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT);
                    let used = get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT);
                    pool_cached = Some(reserved.saturating_sub(used));
                }
            }
        }
        Ok(DevMemInfo { free, total, pool_cached })
    }
    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| Self::err("stream synchronize (an earlier kernel may have failed)", e))
    }
    fn report(&self) -> Result<serde_json::Value> {
        let mut driver = 0i32;
        unsafe { sys::cuDriverGetVersion(&mut driver) }.result().map_err(|e| anyhow!("cuDriverGetVersion: {e:?}"))?;
        let (major, minor) = self.ctx.compute_capability().map_err(|e| anyhow!("{e:?}"))?;
        let lt = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        Ok(serde_json::json!({
            "compute_capability": format!("{major}.{minor}"),
            "driver_cuda_version": format!("{}.{}", driver / 1000, (driver % 1000) / 10),
            "cublaslt_version": format!("{}.{}.{}", lt / 10000, (lt / 100) % 100, lt % 100),
            "libcuda": loaded_library("libcuda.so"),
            "libcublasLt": loaded_library("libcublasLt.so"),
        }))
    }
}

impl Drop for RealDevice {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
    }
}
