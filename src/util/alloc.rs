//! The binary's global allocator: the system allocator, plus a cache of large freed blocks.
//!
//! Why: a training step on the CPU allocates a few GB of activation buffers (the kept layers,
//! merged weights, backward scratch) and frees them all at its end. glibc hands blocks of that
//! size straight back to the kernel (`munmap`), so the next step faults every 4 KiB page in
//! again and the kernel zeroes each one: 1.1 million faults per `bench --work train` step,
//! `clear_page_erms` 9 % of the profile. Keeping freed blocks of ≥ 1 MiB and handing them back to
//! later requests of the same size class removes that in steady state. Requests are rounded up
//! to classes 1/8 of a power of two apart (≤ 12.5 % slack), so steps whose shapes differ a little
//! (rollouts of different lengths) still reuse each other's blocks.
//!
//! The cache holds at most a quarter of physical memory (16 GiB at most); the oldest blocks are
//! returned to the system first. `INFOMEM_ALLOC_CACHE_MB=0` turns it off.
//!
//! Large blocks also start on a cache line (`LINE`), whatever alignment the type asks for. glibc
//! serves them from `mmap` 16 bytes into a page, so every 64-byte row of an f32 activation
//! matrix straddled two lines: the AMX tile loads and stores touched twice the lines, and every
//! AVX-512 load split (measurements: docs/log/code-notes.md). A block is over-allocated
//! by a line and the system's pointer kept in the 8 bytes before the one handed out (fresh zeroed
//! blocks still come from `calloc`, untouched pages and all).
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

/// Blocks below this size go straight to the system allocator.
const MIN: usize = 1 << 20;
/// Large blocks start at a multiple of this (see the module doc).
const LINE: usize = 64;
const SLOTS: usize = 256;

pub struct CachingAlloc {
    cache: Mutex<Cache>,
}

struct Cache {
    /// (size class, align, address), oldest first; `len` are in use.
    blocks: [(usize, usize, usize); SLOTS],
    len: usize,
    bytes: usize,
    /// Upper bound on `bytes`; `usize::MAX` = not yet read from the machine.
    cap: usize,
}

/// The size a request of `size` bytes is served with.
fn class(size: usize) -> usize {
    if size < MIN {
        return size;
    }
    let step = (1usize << (usize::BITS - 1 - size.leading_zeros())) / 8;
    size.div_ceil(step) * step
}

fn machine_cap() -> usize {
    // libc only: this runs inside the allocator, where allocating would recurse.
    unsafe {
        let v = libc::getenv(c"INFOMEM_ALLOC_CACHE_MB".as_ptr());
        if !v.is_null() {
            if let Some(mb) = std::ffi::CStr::from_ptr(v).to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()) {
                return mb << 20;
            }
        }
        let pages = libc::sysconf(libc::_SC_PHYS_PAGES);
        let page = libc::sysconf(libc::_SC_PAGESIZE);
        if pages <= 0 || page <= 0 {
            return 0;
        }
        ((pages as usize).saturating_mul(page as usize) / 4).min(16 << 30)
    }
}

/// A fresh block of `c ≥ MIN` bytes aligned to `align.max(LINE)` (zeroed if asked).
unsafe fn system_alloc(c: usize, align: usize, zeroed: bool) -> *mut u8 {
    if align > LINE {
        let l = Layout::from_size_align_unchecked(c, align);
        return if zeroed { System.alloc_zeroed(l) } else { System.alloc(l) };
    }
    // room for the stashed pointer and the shift to a line (the system's blocks are 8-aligned)
    let l = Layout::from_size_align_unchecked(c + LINE, 8);
    let raw = if zeroed { System.alloc_zeroed(l) } else { System.alloc(l) };
    if raw.is_null() {
        return raw;
    }
    let p = (raw as usize + 8).next_multiple_of(LINE) as *mut u8;
    (p as *mut usize).sub(1).write(raw as usize);
    p
}

/// Returns a block from `system_alloc` (same `c` and `align`) to the system.
unsafe fn system_dealloc(p: *mut u8, c: usize, align: usize) {
    if align > LINE {
        return System.dealloc(p, Layout::from_size_align_unchecked(c, align));
    }
    let raw = (p as *mut usize).sub(1).read() as *mut u8;
    System.dealloc(raw, Layout::from_size_align_unchecked(c + LINE, 8));
}

impl CachingAlloc {
    /// Cache bound read from the machine (and `INFOMEM_ALLOC_CACHE_MB`) on first use.
    pub const fn new() -> Self {
        Self::with_cap(usize::MAX)
    }
    pub const fn with_cap(cap: usize) -> Self {
        CachingAlloc { cache: Mutex::new(Cache { blocks: [(0, 0, 0); SLOTS], len: 0, bytes: 0, cap }) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        // nothing inside the lock panics; a poisoned lock still holds a consistent cache
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A cached block of exactly this class and alignment, newest first.
    fn take(&self, c: usize, align: usize) -> Option<*mut u8> {
        let mut g = self.lock();
        let len = g.len;
        let i = (0..len).rev().find(|&i| g.blocks[i].0 == c && g.blocks[i].1 == align)?;
        let p = g.blocks[i].2 as *mut u8;
        g.blocks.copy_within(i + 1..len, i);
        g.len -= 1;
        g.bytes -= c;
        Some(p)
    }

    /// Bytes currently held by the cache.
    pub fn cached_bytes(&self) -> usize {
        self.lock().bytes
    }
}

impl Default for CachingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

unsafe impl GlobalAlloc for CachingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let c = class(layout.size());
        if c < MIN {
            return System.alloc(layout);
        }
        match self.take(c, layout.align()) {
            Some(p) => p,
            None => system_alloc(c, layout.align(), false),
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let c = class(layout.size());
        if c < MIN {
            return System.alloc_zeroed(layout);
        }
        match self.take(c, layout.align()) {
            Some(p) => {
                std::ptr::write_bytes(p, 0, layout.size());
                p
            }
            // fresh pages from the kernel are zero already (calloc)
            None => system_alloc(c, layout.align(), true),
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let c = class(layout.size());
        if c < MIN {
            return System.dealloc(ptr, layout);
        }
        let mut g = self.lock();
        if g.cap == usize::MAX {
            g.cap = machine_cap();
        }
        if c > g.cap {
            drop(g);
            return system_dealloc(ptr, c, layout.align());
        }
        // make room: return the oldest blocks to the system
        while g.len == SLOTS || g.bytes + c > g.cap {
            let (oc, oa, op) = g.blocks[0];
            let len = g.len;
            g.blocks.copy_within(1..len, 0);
            g.len -= 1;
            g.bytes -= oc;
            system_dealloc(op as *mut u8, oc, oa);
        }
        let len = g.len;
        g.blocks[len] = (c, layout.align(), ptr as usize);
        g.len += 1;
        g.bytes += c;
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old_c, new_c) = (class(layout.size()), class(new_size));
        if old_c < MIN && new_c < MIN {
            return System.realloc(ptr, layout, new_size);
        }
        if old_c == new_c {
            return ptr; // the block already has room
        }
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        let p = self.alloc(new_layout);
        if !p.is_null() {
            std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
            self.dealloc(ptr, layout);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_bound_the_slack() {
        assert_eq!(class(1000), 1000);
        assert_eq!(class(MIN), MIN);
        assert_eq!(class(MIN + 1), MIN + MIN / 8);
        for s in [MIN, 3 << 20, (50 << 20) + 7, 1 << 33] {
            let c = class(s);
            assert!(c >= s && (c - s) * 8 <= s, "class({s}) = {c}");
            assert_eq!(class(c), c, "a class is its own class");
        }
    }

    #[test]
    fn large_blocks_start_on_a_line() {
        // cap 0: every large block comes from the system and goes straight back
        for cap in [0, 64 << 20] {
            let a = CachingAlloc::with_cap(cap);
            unsafe {
                for (size, align) in [(MIN, 4), ((3 << 20) + 4, 4), (5 << 20, 16), (MIN + 1, 1)] {
                    let l = Layout::from_size_align(size, align).unwrap();
                    let p = a.alloc(l);
                    assert_eq!(p as usize % LINE, 0, "alloc({size}, {align})");
                    std::ptr::write_bytes(p, 5, size); // the whole block is ours
                    let z = a.alloc_zeroed(l);
                    assert_eq!(z as usize % LINE, 0, "alloc_zeroed({size}, {align})");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    std::ptr::write_bytes(z, 6, size);
                    let r = a.realloc(z, l, 2 * size);
                    assert_eq!(r as usize % LINE, 0);
                    assert!(std::slice::from_raw_parts(r, size).iter().all(|&b| b == 6), "realloc keeps the contents");
                    a.dealloc(p, l);
                    a.dealloc(r, Layout::from_size_align(2 * size, align).unwrap());
                }
            }
        }
    }

    #[test]
    fn freed_blocks_are_reused_zeroed_and_bounded() {
        let a = CachingAlloc::with_cap(8 << 20);
        unsafe {
            let l = Layout::from_size_align(3 << 20, 64).unwrap();
            let p = a.alloc(l);
            std::ptr::write_bytes(p, 7, l.size());
            a.dealloc(p, l);
            assert_eq!(a.cached_bytes(), class(3 << 20));
            // same class, smaller request: the same block, zeroed on request
            let l2 = Layout::from_size_align((3 << 20) - 4096, 64).unwrap();
            assert_eq!(class(l2.size()), class(l.size()));
            let q = a.alloc_zeroed(l2);
            assert_eq!(q, p);
            assert!(std::slice::from_raw_parts(q, l2.size()).iter().all(|&b| b == 0));
            assert_eq!(a.cached_bytes(), 0);
            // growing within the class keeps the block; across classes copies the contents
            std::ptr::write_bytes(q, 9, l2.size());
            assert_eq!(a.realloc(q, l2, l.size()), q);
            let r = a.realloc(q, l, 5 << 20);
            let lr = Layout::from_size_align(5 << 20, 64).unwrap();
            assert!(std::slice::from_raw_parts(r, l2.size()).iter().all(|&b| b == 9));
            assert_eq!(a.cached_bytes(), class(3 << 20), "the old block went to the cache");
            a.dealloc(r, lr);
            assert_eq!(a.cached_bytes(), 8 << 20, "3 + 5 MiB fit the cap");
            // other alignments never share a block
            let l3 = Layout::from_size_align(5 << 20, 4096).unwrap();
            let s = a.alloc(l3);
            assert_ne!(s, r);
            assert_eq!(s as usize % 4096, 0);
            // over the cap: the oldest blocks go back to the system
            a.dealloc(s, l3);
            assert_eq!(a.cached_bytes(), 5 << 20);
            assert_eq!(a.take(5 << 20, 64), None, "evicted");
            // small blocks bypass the cache
            let small = Layout::from_size_align(1000, 8).unwrap();
            let t = a.alloc(small);
            a.dealloc(t, small);
            assert!(a.cached_bytes() <= 8 << 20);
        }
    }
}
