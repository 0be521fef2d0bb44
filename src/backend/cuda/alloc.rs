//! Device memory: which allocator serves it, and the owned allocation type (`DevMem`).
//!
//! **Two allocators, chosen once when the backend opens** ([`choose_mode`]):
//! - `Pool`: the device's default stream-ordered pool (`cuMemAllocAsync` / `cuMemFreeAsync` on
//!   our one stream) with its release threshold raised to "never", so memory freed in stream
//!   order (the rollout's KV cache) is reused by the next phase (the update's activations)
//!   without a round trip to the driver. Used when the device reports memory pools, the
//!   threshold can be set, and a probe allocation through the pool succeeds.
//! - `Plain`: `cuMemAlloc` / `cuMemFree` behind our own cache of freed blocks (best fit within
//!   1/8 slack), for devices or virtualized drivers where the pool is missing or refuses to
//!   allocate. A freed block goes back to the cache, not the driver: every user of device memory
//!   is on the one in-order stream, so a block handed out again is only touched by work enqueued
//!   after the work that used it before — the same argument that makes the stream-ordered pool
//!   safe. The cache is released to the driver (after a synchronize) when an allocation fails,
//!   and when the backend closes.
//!
//! `INFOMEM_CUDA_ALLOC=pool|plain` forces one (pool: an error if the device cannot); the choice
//! and its reason are reported by `infomem-engine device` and in the backend's name.
//!
//! Both fall back once on an out-of-memory error: the pool is trimmed (cached but unused memory
//! returned to the driver), the plain cache emptied, and the allocation retried.
//!
//! The driver calls are behind [`DeviceAlloc`] so the bookkeeping (cache, retry, the mode
//! choice) is tested on the CPU with a fake driver.
use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Which allocator serves device memory (module comment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllocMode {
    Pool,
    /// Plain allocations with the engine's cache; `why` says why the pool is not used.
    Plain { why: String },
}

impl AllocMode {
    /// One line for logs and `infomem-engine device`.
    pub fn describe(&self) -> String {
        match self {
            AllocMode::Pool => "stream-ordered pool (cuMemAllocAsync, freed memory kept by the pool)".into(),
            AllocMode::Plain { why } => format!("plain cuMemAlloc with the engine's block cache ({why})"),
        }
    }
    pub fn short(&self) -> &'static str {
        match self {
            AllocMode::Pool => "pool",
            AllocMode::Plain { .. } => "plain",
        }
    }
}

/// What the device says about pools, and the result of trying one (`probe`: set the release
/// threshold, allocate and free a small block through the pool, synchronize).
pub fn choose_mode(forced: Option<&str>, pools_supported: bool, probe: impl FnOnce() -> std::result::Result<(), String>) -> Result<AllocMode> {
    match forced.map(str::trim) {
        None | Some("") | Some("auto") => {}
        Some("plain") => return Ok(AllocMode::Plain { why: "INFOMEM_CUDA_ALLOC=plain".into() }),
        Some("pool") => {
            if !pools_supported {
                bail!("INFOMEM_CUDA_ALLOC=pool, but the device reports no memory pool support (CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 0)");
            }
            probe().map_err(|e| anyhow!("INFOMEM_CUDA_ALLOC=pool, but the stream-ordered pool does not work here: {e}"))?;
            return Ok(AllocMode::Pool);
        }
        Some(other) => bail!("INFOMEM_CUDA_ALLOC={other:?}: expected pool, plain or auto"),
    }
    if !pools_supported {
        return Ok(AllocMode::Plain { why: "the device reports no memory pool support".into() });
    }
    match probe() {
        Ok(()) => Ok(AllocMode::Pool),
        Err(e) => Ok(AllocMode::Plain { why: format!("the stream-ordered pool failed its probe: {e}") }),
    }
}

/// The driver calls behind the allocator (the real one is `CudaDriverAlloc` in mod.rs).
pub trait DeviceAlloc: Send + Sync {
    /// Allocate `bytes` (the pool on the stream, or plain); `Err(true)` means out of memory.
    fn alloc(&self, pool: bool, bytes: usize) -> std::result::Result<u64, (bool, String)>;
    /// Free a block (in stream order for the pool, after `sync` for plain).
    fn free(&self, pool: bool, ptr: u64);
    /// Wait for the stream's work.
    fn sync(&self);
    /// Return the pool's cached, unused memory to the driver.
    fn trim_pool(&self);
}

/// Plain-mode blocks are rounded so that similar sizes share a cache entry.
fn round_block(bytes: usize) -> usize {
    let b = bytes.max(1);
    if b < (1 << 20) {
        b.next_power_of_two().max(512)
    } else {
        b.div_ceil(2 << 20) * (2 << 20)
    }
}

#[derive(Default)]
struct Cache {
    /// Free blocks by size.
    free: BTreeMap<usize, Vec<u64>>,
    free_bytes: usize,
    /// Bytes handed out and not yet returned (both modes; for memory reports).
    live_bytes: usize,
}

/// The allocator: the mode, the driver, and (plain mode) the cache of freed blocks.
pub struct Heap {
    mode: AllocMode,
    drv: Box<dyn DeviceAlloc>,
    cache: Mutex<Cache>,
}

/// One device allocation; returned to its heap when dropped.
pub struct DevMem {
    ptr: u64,
    /// Bytes requested (the block may be larger).
    len: usize,
    /// Bytes of the block (what is returned to the cache).
    block: usize,
    heap: Arc<Heap>,
}

impl DevMem {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes usable (as requested).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        self.heap.release(self.ptr, self.block);
    }
}

impl Heap {
    pub fn new(mode: AllocMode, drv: Box<dyn DeviceAlloc>) -> Arc<Heap> {
        Arc::new(Heap { mode, drv, cache: Mutex::new(Cache::default()) })
    }

    pub fn mode(&self) -> &AllocMode {
        &self.mode
    }

    fn pool(&self) -> bool {
        self.mode == AllocMode::Pool
    }

    /// Bytes cached for reuse that the device does not count as free (plain mode's free blocks).
    pub fn cached_bytes(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).free_bytes
    }

    /// Bytes of live allocations made through this heap.
    pub fn live_bytes(&self) -> usize {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).live_bytes
    }

    /// Allocate at least `bytes` (≥ 1). Out of memory is retried once after returning cached
    /// memory to the driver; the error carries the driver's message.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> std::result::Result<DevMem, String> {
        let block = if self.pool() { bytes.max(1) } else { round_block(bytes) };
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if !self.pool() {
            // best fit: the smallest cached block ≥ block with at most 1/8 slack
            let hit = c.free.range(block..=block + block / 8).next().map(|(&sz, _)| sz);
            if let Some(sz) = hit {
                let list = c.free.get_mut(&sz).expect("the key was just found");
                let ptr = list.pop().expect("free lists are never left empty");
                if list.is_empty() {
                    c.free.remove(&sz);
                }
                c.free_bytes -= sz;
                c.live_bytes += sz;
                return Ok(DevMem { ptr, len: bytes, block: sz, heap: self.clone() });
            }
        }
        let ptr = match self.drv.alloc(self.pool(), block) {
            Ok(p) => p,
            Err((true, _)) => {
                // out of memory: give back what is cached, then try once more
                self.flush_locked(&mut c);
                self.drv.alloc(self.pool(), block).map_err(|(_, e)| e)?
            }
            Err((false, e)) => return Err(e),
        };
        c.live_bytes += block;
        Ok(DevMem { ptr, len: bytes, block, heap: self.clone() })
    }

    fn release(&self, ptr: u64, block: usize) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        c.live_bytes -= block;
        if self.pool() {
            self.drv.free(true, ptr);
        } else {
            c.free.entry(block).or_default().push(ptr);
            c.free_bytes += block;
        }
    }

    fn flush_locked(&self, c: &mut Cache) {
        self.drv.sync();
        if self.pool() {
            self.drv.trim_pool();
        }
        for (_, list) in std::mem::take(&mut c.free) {
            for p in list {
                self.drv.free(false, p);
            }
        }
        c.free_bytes = 0;
    }
}

impl Drop for Heap {
    fn drop(&mut self) {
        let mut c = std::mem::take(&mut *self.cache.lock().unwrap_or_else(|e| e.into_inner()));
        self.flush_locked(&mut c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A device with `cap` bytes: counts calls, refuses what does not fit.
    #[derive(Default)]
    struct Fake {
        cap: usize,
        used: AtomicUsize,
        next: AtomicUsize,
        allocs: AtomicUsize,
        frees: AtomicUsize,
        syncs: AtomicUsize,
        trims: AtomicUsize,
        sizes: Mutex<std::collections::HashMap<u64, usize>>,
    }
    impl DeviceAlloc for Arc<Fake> {
        fn alloc(&self, _pool: bool, bytes: usize) -> std::result::Result<u64, (bool, String)> {
            if self.used.load(Ordering::SeqCst) + bytes > self.cap {
                return Err((true, "CUDA_ERROR_OUT_OF_MEMORY".into()));
            }
            self.used.fetch_add(bytes, Ordering::SeqCst);
            self.allocs.fetch_add(1, Ordering::SeqCst);
            let p = 0x1000 * (1 + self.next.fetch_add(1, Ordering::SeqCst)) as u64;
            self.sizes.lock().unwrap().insert(p, bytes);
            Ok(p)
        }
        fn free(&self, _pool: bool, ptr: u64) {
            let b = self.sizes.lock().unwrap().remove(&ptr).expect("freed a pointer the fake never handed out (double free?)");
            self.used.fetch_sub(b, Ordering::SeqCst);
            self.frees.fetch_add(1, Ordering::SeqCst);
        }
        fn sync(&self) {
            self.syncs.fetch_add(1, Ordering::SeqCst);
        }
        fn trim_pool(&self) {
            self.trims.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn fake(cap: usize) -> Arc<Fake> {
        Arc::new(Fake { cap, ..Default::default() })
    }

    #[test]
    fn the_mode_follows_the_device_and_the_probe() {
        assert_eq!(choose_mode(None, true, || Ok(())).unwrap(), AllocMode::Pool);
        let m = choose_mode(None, false, || panic!("no probe without pool support")).unwrap();
        assert!(matches!(&m, AllocMode::Plain { why } if why.contains("no memory pool support")), "{m:?}");
        let m = choose_mode(None, true, || Err("cuMemAllocAsync: CUDA_ERROR_NOT_SUPPORTED".into())).unwrap();
        assert!(matches!(&m, AllocMode::Plain { why } if why.contains("CUDA_ERROR_NOT_SUPPORTED")), "{m:?}");
        assert!(m.describe().contains("plain cuMemAlloc") && m.describe().contains("probe"));
        assert_eq!(choose_mode(Some("plain"), true, || panic!("a forced plain mode needs no probe")).unwrap().short(), "plain");
        assert_eq!(choose_mode(Some("pool"), true, || Ok(())).unwrap(), AllocMode::Pool);
        let e = choose_mode(Some("pool"), true, || Err("refused".into())).unwrap_err().to_string();
        assert!(e.contains("INFOMEM_CUDA_ALLOC=pool") && e.contains("refused"), "{e}");
        assert!(choose_mode(Some("pool"), false, || Ok(())).is_err());
        let e = choose_mode(Some("fast"), true, || Ok(())).unwrap_err().to_string();
        assert!(e.contains("\"fast\"") && e.contains("pool, plain or auto"), "{e}");
    }

    #[test]
    fn plain_mode_reuses_freed_blocks() {
        let f = fake(1 << 30);
        let h = Heap::new(AllocMode::Plain { why: "test".into() }, Box::new(f.clone()));
        let a = h.alloc(3 << 20).unwrap(); // 3 MiB → a 4 MiB block
        let pa = a.ptr();
        assert_eq!((a.len(), h.live_bytes()), (3 << 20, 4 << 20));
        drop(a);
        assert_eq!((h.cached_bytes(), h.live_bytes(), f.frees.load(Ordering::SeqCst)), (4 << 20, 0, 0), "freed blocks stay cached");
        // a request of the same class gets the cached block back, without the driver
        let b = h.alloc((3 << 20) + 17).unwrap();
        assert_eq!((b.ptr(), f.allocs.load(Ordering::SeqCst)), (pa, 1));
        // beyond 1/8 slack a new block is allocated: a 1 MiB request does not take an 8 MiB block
        let big = h.alloc(8 << 20).unwrap();
        drop(big);
        let small = h.alloc(1 << 20).unwrap();
        assert_ne!(small.ptr(), pa);
        assert_eq!(f.allocs.load(Ordering::SeqCst), 3);
        drop((b, small));
        drop(h);
        assert_eq!((f.used.load(Ordering::SeqCst), f.frees.load(Ordering::SeqCst)), (0, 3), "closing the heap frees every block");
    }

    #[test]
    fn out_of_memory_flushes_the_cache_and_retries() {
        let f = fake(10 << 20);
        let h = Heap::new(AllocMode::Plain { why: "test".into() }, Box::new(f.clone()));
        drop(h.alloc(6 << 20).unwrap()); // cached: the device has 4 MiB left
        let x = h.alloc(8 << 20).expect("the cached 6 MiB is returned to the driver and the allocation retried");
        assert_eq!((f.syncs.load(Ordering::SeqCst), f.frees.load(Ordering::SeqCst)), (1, 1), "synchronize before freeing cached blocks");
        assert_eq!(h.cached_bytes(), 0);
        let e = h.alloc(4 << 20).err().expect("2 MiB left: no room after the retry either");
        assert!(e.contains("OUT_OF_MEMORY"), "{e}");
        drop(x);
    }

    #[test]
    fn pool_mode_frees_in_stream_order_and_trims_on_oom() {
        let f = fake(10 << 20);
        let h = Heap::new(AllocMode::Pool, Box::new(f.clone()));
        let a = h.alloc(1000).unwrap();
        assert_eq!(a.len(), 1000);
        drop(a);
        assert_eq!((f.frees.load(Ordering::SeqCst), h.cached_bytes()), (1, 0), "the pool does its own caching");
        let _b = h.alloc(9 << 20).unwrap();
        assert!(h.alloc(2 << 20).is_err());
        assert_eq!(f.trims.load(Ordering::SeqCst), 1, "an out-of-memory error trims the pool before the retry");
    }
}
