//! The device seam: everything `CudaBackend` asks of a device, as one small trait. The real
//! implementation (`real.rs`) is the CUDA driver + cuBLASLt through cudarc; the emulated one
//! (`emulated.rs`, tests and CI without a GPU) runs the kernels' real PTX on the CPU with the
//! interpreter in `ptx/`. The family files above it launch kernels by name through `launch!`,
//! which marshals the arguments as [`KArg`]s — typed, so the emulated device can check them
//! against the entry's `.param` list.
use super::alloc::DeviceAlloc;
use super::gemm::GemmArgs;
use anyhow::Result;

/// One kernel argument as the host passes it (the C type of the parameter).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KArg {
    /// A device pointer (`T*`): must lie in a live allocation, or be null.
    Ptr(u64),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
}

impl KArg {
    /// Little-endian bytes and size.
    pub fn bytes(&self) -> ([u8; 8], usize) {
        let mut b = [0u8; 8];
        let n = match *self {
            KArg::Ptr(v) => {
                b.copy_from_slice(&v.to_le_bytes());
                8
            }
            KArg::I64(v) => {
                b.copy_from_slice(&v.to_le_bytes());
                8
            }
            KArg::I32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
            KArg::U32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
            KArg::F32(v) => {
                b[..4].copy_from_slice(&v.to_le_bytes());
                4
            }
        };
        (b, n)
    }
}

/// Rust types a `launch!` argument may have: u64 is a device pointer, i32/u32 an int, i64 a
/// long long, f32 a float.
pub trait IntoKArg {
    fn karg(&self) -> KArg;
}
impl IntoKArg for u64 {
    fn karg(&self) -> KArg {
        KArg::Ptr(*self)
    }
}
impl IntoKArg for i32 {
    fn karg(&self) -> KArg {
        KArg::I32(*self)
    }
}
impl IntoKArg for u32 {
    fn karg(&self) -> KArg {
        KArg::U32(*self)
    }
}
impl IntoKArg for i64 {
    fn karg(&self) -> KArg {
        KArg::I64(*self)
    }
}
impl IntoKArg for f32 {
    fn karg(&self) -> KArg {
        KArg::F32(*self)
    }
}

/// Device memory as the backend's memory reports see it.
pub struct DevMemInfo {
    pub free: usize,
    pub total: usize,
    /// Bytes the stream-ordered pool holds but does not use (None: not known / no pool).
    pub pool_cached: Option<usize>,
}

/// What `CudaBackend` needs from a device. All work is in order on one stream; `synchronize`
/// waits for it. Addresses are device addresses (u64) of memory from `allocator()`.
pub trait Device: Send + Sync {
    /// The device's name, e.g. "NVIDIA H200" or "emulated sm_90 (PTX interpreter)".
    fn name(&self) -> String;
    /// Streaming multiprocessors (the attention planner sizes its split-K by them).
    fn sm_count(&self) -> usize;
    /// Make the device current on the calling thread (a no-op where there is no context).
    fn bind(&self) -> Result<()>;
    /// The raw allocator under `alloc::Heap` (the heap adds the caching and retry).
    fn allocator(&self) -> Box<dyn DeviceAlloc>;
    /// Whether the device reports stream-ordered memory pools.
    fn pools_supported(&self) -> bool;
    /// Try the pool (the probe of `alloc::choose_mode`); Err says why it is not used.
    fn probe_pool(&self) -> std::result::Result<(), String>;
    fn htod(&self, src: &[u8], dst: u64) -> Result<()>;
    /// Copy to the host (synchronizes).
    fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()>;
    /// Allow `name` up to `bytes` of dynamic shared memory (above the default 48 KiB).
    fn set_max_dynamic_smem(&self, name: &str, bytes: u32) -> Result<()>;
    /// Launch kernel `name` on a 1-D grid.
    fn launch(&self, name: &str, grid: u32, block: u32, dyn_smem: u32, args: &[KArg]) -> Result<()>;
    /// One cuBLASLt-style GEMM (see `gemm.rs` for the operand conventions).
    fn gemm(&self, g: &GemmArgs, workspace: u64) -> Result<()>;
    fn mem_info(&self, pool: bool) -> Result<DevMemInfo>;
    fn synchronize(&self) -> Result<()>;
    /// Device-specific fields of `infomem-engine device`'s report.
    fn report(&self) -> Result<serde_json::Value>;
}
