//! Packed bf16 weights placed one after another in shared chunks of memory advised onto 2 MiB
//! pages (`bf16::PackedBf16` keeps its words here).
//!
//! Why: decode streams every weight once per step (SmolLM2-135M in bf16: 269 MB), and on 4 KiB
//! pages that is a TLB miss every 4 KiB — on a VM a two-dimensional page walk — and a hardware
//! prefetcher that stops at every page boundary. Transparent huge pages only back a whole
//! 2 MiB-aligned range of one mapping, so a matrix in an allocation of its own gets them only
//! where such a range lies inside it; SmolLM2's matrices (the head in tiles of 1.2 MB, the layers'
//! 0.7–3.5 MB) had none (`AnonHugePages: 0 kB` in a decode run). Placed back to back in chunks
//! that start on 2 MiB and are advised `MADV_HUGEPAGE` before the first write, all of them are.
//! (The measurement: docs/log/code-notes.md.)
//!
//! A chunk is `CHUNK` bytes of address space; only the pages written become memory (so its
//! unused tail costs nothing, its last matrix at most part of one 2 MiB page). A chunk is
//! unmapped when the last matrix in it is dropped; the chunk being filled starts again from its
//! beginning once every matrix placed in it has been dropped (benches and tests pack and drop
//! matrices in turn). A matrix larger than a quarter chunk gets a chunk of its own.
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

/// 64 bytes: one cache line of packed words (keeps the packed data aligned; AMX tile rows and
/// stores that straddle two lines cost 15–20 %).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u32; 16]);

/// A huge page (x86-64's 2 MiB), the unit transparent huge pages back.
pub(crate) const HUGE: usize = 2 << 20;
/// Address space per shared chunk.
const CHUNK: usize = 64 << 20;

/// One mapping, `HUGE`-aligned at `base`, `bytes` long (a multiple of `HUGE`).
struct Chunk {
    base: *mut Line,
    bytes: usize,
    /// what to give back: the mapping as made (it was over-sized to align `base`)
    map: (*mut u8, usize),
}

// Safety: the chunk's memory is plain data; each `Lines` has its own disjoint range of it.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `bytes` (a multiple of `HUGE`) of zeroed memory starting on a 2 MiB boundary, advised onto
    /// huge pages before anything touches it; `None` when the system refuses the mapping.
    fn new(bytes: usize) -> Option<Chunk> {
        #[cfg(unix)]
        unsafe {
            let len = bytes + HUGE;
            let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            if p == libc::MAP_FAILED {
                return None;
            }
            let base = (p as usize).next_multiple_of(HUGE) as *mut u8;
            #[cfg(target_os = "linux")]
            libc::madvise(base as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE); // only a paging policy
            Some(Chunk { base: base as *mut Line, bytes, map: (p as *mut u8, len) })
        }
        #[cfg(not(unix))]
        unsafe {
            let p = std::alloc::alloc_zeroed(std::alloc::Layout::from_size_align(bytes, HUGE).ok()?);
            (!p.is_null()).then_some(Chunk { base: p as *mut Line, bytes, map: (p, bytes) })
        }
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // Safety: the mapping made in `new`, no longer referenced (the last `Lines` is gone)
        #[cfg(unix)]
        unsafe {
            libc::munmap(self.map.0 as *mut libc::c_void, self.map.1);
        }
        #[cfg(not(unix))]
        unsafe {
            std::alloc::dealloc(self.map.0, std::alloc::Layout::from_size_align_unchecked(self.bytes, HUGE));
        }
    }
}

/// The chunk being filled and how many lines of it are placed.
struct Filling {
    chunk: Arc<Chunk>,
    used: usize,
}

static FILLING: Mutex<Option<Filling>> = Mutex::new(None);

/// `len` zeroed lines of a chunk, owned exclusively; they deref to `[Line]`.
pub(crate) struct Lines {
    chunk: Option<Arc<Chunk>>,
    ptr: *mut Line,
    len: usize,
}

// Safety: a `Lines` is the only handle to its range of the chunk.
unsafe impl Send for Lines {}
unsafe impl Sync for Lines {}

impl Lines {
    pub fn empty() -> Lines {
        Lines { chunk: None, ptr: std::ptr::NonNull::dangling().as_ptr(), len: 0 }
    }

    /// `len` zeroed lines on 2 MiB pages where the system gives them (a plain allocation of
    /// zeroed lines when it refuses the mapping: slower to stream, never an error).
    pub fn zeroed(len: usize) -> Lines {
        if len == 0 {
            return Lines::empty();
        }
        let bytes = len * 64;
        let (chunk, off) = if bytes > CHUNK / 4 {
            match Chunk::new(bytes.next_multiple_of(HUGE)) {
                Some(c) => (Arc::new(c), 0),
                None => return Lines::fallback(len),
            }
        } else {
            let mut g = FILLING.lock().unwrap_or_else(|e| e.into_inner()); // nothing panics inside
            if let Some(f) = g.as_mut() {
                if Arc::strong_count(&f.chunk) == 1 {
                    f.used = 0; // every matrix placed in it is gone: fill it again from the start
                }
            }
            if g.as_ref().is_none_or(|f| (f.used + len) * 64 > f.chunk.bytes) {
                match Chunk::new(CHUNK) {
                    Some(c) => *g = Some(Filling { chunk: Arc::new(c), used: 0 }),
                    None => return Lines::fallback(len),
                }
            }
            let Some(f) = g.as_mut() else { return Lines::fallback(len) };
            let off = f.used;
            f.used += len;
            (f.chunk.clone(), off)
        };
        // Safety: lines off..off+len of the chunk are inside it and handed to no one else
        let ptr = unsafe { chunk.base.add(off) };
        let mut l = Lines { chunk: Some(chunk), ptr, len };
        l.fill(Line([0; 16])); // a refilled chunk holds old words
        l
    }

    /// Heap lines, in a chunk-less `Lines` that frees them on drop.
    fn fallback(len: usize) -> Lines {
        let v: Box<[Line]> = vec![Line([0; 16]); len].into_boxed_slice();
        Lines { chunk: None, ptr: Box::into_raw(v) as *mut Line, len }
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        if self.chunk.is_none() && self.len > 0 {
            // Safety: made by `fallback` from a boxed slice of exactly this length
            unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len))) };
        }
    }
}

impl Deref for Lines {
    type Target = [Line];
    fn deref(&self) -> &[Line] {
        // Safety: `len` lines at `ptr` belong to this handle (dangling and 0 when empty)
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [Line] {
        // Safety: as in `deref`, and no other handle reaches these lines
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Placements do not overlap, start zeroed and on cache lines, and keep their words while
    /// others come and go (other tests place matrices concurrently: nothing here depends on
    /// where a placement lands).
    #[test]
    fn placements_are_disjoint_zeroed_and_kept() {
        let mark = |l: &mut Lines, v: u32| l.iter_mut().for_each(|x| x.0 = [v; 16]);
        let mut a = Lines::zeroed(1000);
        let mut b = Lines::zeroed(3);
        let mut big = Lines::zeroed(CHUNK / 64 / 4 + 1); // a chunk of its own
        assert!(a.iter().chain(b.iter()).chain(big.iter()).all(|x| x.0 == [0; 16]));
        mark(&mut a, 1);
        mark(&mut b, 2);
        mark(&mut big, 3);
        assert!(a.iter().all(|x| x.0 == [1; 16]) && b.iter().all(|x| x.0 == [2; 16]) && big.iter().all(|x| x.0 == [3; 16]));
        for l in [&a, &b, &big] {
            assert_eq!(l.as_ptr() as usize % 64, 0);
        }
        let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
        assert!(pb >= pa + 1000 * 64 || pa >= pb + 3 * 64, "the two placements overlap");
        drop(a);
        let c = Lines::zeroed(10);
        assert!(c.iter().all(|x| x.0 == [0; 16]), "a placement starts zeroed");
        assert!(b.iter().all(|x| x.0 == [2; 16]), "a live placement keeps its words");
        drop((b, c, big));
        assert_eq!(Lines::zeroed(0).len(), 0);
    }
}
