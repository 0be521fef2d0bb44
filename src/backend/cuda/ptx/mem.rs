//! The emulated device's memory: global allocations (checked on every access), a CTA's shared
//! memory with the race detector, per-thread local memory, and the generic-address windows.
//!
//! **Global.** Allocations get fresh, never-reused addresses with a 64 KiB unmapped gap after
//! each, so an access past an end, before a start or after a free lands in no allocation and is
//! reported, instead of silently reading a neighbour as it could on a GPU.
//!
//! **Race detector.** Within a CTA, time is cut into epochs by barriers. For every 4-byte shared
//! word the detector remembers which warp wrote it and which warp(s) read it in the current
//! epoch; a second warp touching a word that another warp wrote in the same epoch (or writing a
//! word another warp read) is a race: nothing orders the two accesses. Lanes of one warp are one
//! agent (their accesses are ordered by the warp's instruction stream, which is what warp-
//! synchronous code relies on together with `__syncwarp`/`shfl.sync`).
use anyhow::{bail, Result};

/// Start of the global allocations (looks like a device pointer; far from the windows below).
const GLOBAL_BASE: u64 = 0x7f00_0000_0000;
/// Unmapped bytes after each allocation.
const GAP: u64 = 64 << 10;
/// Generic-address windows of the shared and local spaces (`cvta`).
pub const SHARED_WINDOW: u64 = 0x0000_1000_0000_0000;
pub const LOCAL_WINDOW: u64 = 0x0000_2000_0000_0000;
const WINDOW_SIZE: u64 = 1 << 32;

pub struct Alloc {
    pub base: u64,
    pub data: Vec<u8>,
}

/// Global memory: live allocations sorted by address (addresses only grow, so pushing keeps
/// the order).
#[derive(Default)]
pub struct GlobalMem {
    pub allocs: Vec<Alloc>,
    next: u64,
    pub live_bytes: usize,
    /// Freed ranges (most recent last, bounded) to name use-after-free.
    freed: Vec<(u64, usize)>,
}

impl GlobalMem {
    pub fn new() -> Self {
        GlobalMem { allocs: Vec::new(), next: GLOBAL_BASE, live_bytes: 0, freed: Vec::new() }
    }

    pub fn alloc(&mut self, bytes: usize) -> u64 {
        let base = self.next;
        self.next += (bytes as u64).next_multiple_of(256) + GAP;
        self.allocs.push(Alloc { base, data: vec![0; bytes] });
        self.live_bytes += bytes;
        base
    }

    pub fn free(&mut self, ptr: u64) -> Result<()> {
        match self.allocs.binary_search_by_key(&ptr, |a| a.base) {
            Ok(i) => {
                let a = self.allocs.remove(i);
                self.live_bytes -= a.data.len();
                self.freed.push((a.base, a.data.len()));
                if self.freed.len() > 4096 {
                    self.freed.drain(..2048);
                }
                Ok(())
            }
            Err(_) => bail!("emulated device: freeing 0x{ptr:x}, which is not the start of a live allocation"),
        }
    }

    /// Index of the allocation holding `[addr, addr + len)`.
    pub fn find(&self, addr: u64, len: usize) -> Option<usize> {
        let i = self.allocs.partition_point(|a| a.base <= addr).checked_sub(1)?;
        let a = &self.allocs[i];
        (addr + len as u64 <= a.base + a.data.len() as u64).then_some(i)
    }

    /// Words for an error: where `addr` is relative to the nearest allocations.
    pub fn describe_miss(&self, addr: u64, len: usize) -> String {
        if let Some(&(b, n)) = self.freed.iter().rev().find(|(b, n)| addr >= *b && addr < b + (*n as u64).max(1)) {
            return format!("inside a freed allocation [0x{b:x}, +{n}) (use after free)");
        }
        let i = self.allocs.partition_point(|a| a.base <= addr);
        let mut parts = Vec::new();
        if let Some(a) = i.checked_sub(1).map(|j| &self.allocs[j]) {
            let end = a.base + a.data.len() as u64;
            if addr < end {
                parts.push(format!("the {len}-byte access runs {} bytes past the end of the allocation [0x{:x}, +{})", addr + len as u64 - end, a.base, a.data.len()));
            } else {
                parts.push(format!("{} bytes past the end of the allocation [0x{:x}, +{}]", addr - end, a.base, a.data.len()));
            }
        }
        if let Some(a) = self.allocs.get(i) {
            parts.push(format!("{} bytes before the allocation [0x{:x}, +{})", a.base - addr, a.base, a.data.len()));
        }
        if parts.is_empty() {
            "no allocation is live".into()
        } else {
            parts.join("; ")
        }
    }

    /// Host access (copies, memset): the range must lie in one live allocation.
    pub fn slice_mut(&mut self, addr: u64, len: usize, what: &str) -> Result<&mut [u8]> {
        if len == 0 {
            return Ok(&mut []);
        }
        match self.find(addr, len) {
            Some(i) => {
                let a = &mut self.allocs[i];
                let o = (addr - a.base) as usize;
                Ok(&mut a.data[o..o + len])
            }
            None => bail!("emulated device: {what} of {len} bytes at 0x{addr:x} is outside every live allocation ({})", self.describe_miss(addr, len)),
        }
    }

    pub fn slice(&mut self, addr: u64, len: usize, what: &str) -> Result<&[u8]> {
        self.slice_mut(addr, len, what).map(|s| &*s)
    }
}

/// Which generic window an address is in.
pub enum Window {
    Global(u64),
    Shared(u64),
    Local(u64),
}

pub fn window(addr: u64) -> Window {
    if (SHARED_WINDOW..SHARED_WINDOW + WINDOW_SIZE).contains(&addr) {
        Window::Shared(addr - SHARED_WINDOW)
    } else if (LOCAL_WINDOW..LOCAL_WINDOW + WINDOW_SIZE).contains(&addr) {
        Window::Local(addr - LOCAL_WINDOW)
    } else {
        Window::Global(addr)
    }
}

/// Per-word access record of the current epoch (see the module comment).
#[derive(Clone, Copy, Default)]
struct WordLog {
    w_epoch: u32,
    writer: u16,
    r_epoch: u32,
    /// Reading warp + 1, or `MANY`.
    reader: u16,
}
const MANY: u16 = u16::MAX;

/// A conflicting pair of shared accesses.
pub struct Race {
    pub word: usize,
    pub other_warp: usize,
    pub other_line: u32,
    pub other_write: bool,
}

pub struct RaceDetector {
    log: Vec<WordLog>,
    /// PTX line of the last write / read of each word (for the message).
    w_line: Vec<u32>,
    r_line: Vec<u32>,
    pub epoch: u32,
}

impl RaceDetector {
    pub fn new(bytes: usize) -> Self {
        let words = bytes.div_ceil(4);
        RaceDetector { log: vec![WordLog::default(); words], w_line: vec![0; words], r_line: vec![0; words], epoch: 1 }
    }

    /// Record an access of `len` bytes at shared offset `off` by `warp`; the first conflicting
    /// earlier access of this epoch, if any.
    pub fn access(&mut self, off: usize, len: usize, warp: usize, write: bool, line: u32) -> Option<Race> {
        let me = warp as u16 + 1;
        let e = self.epoch;
        for word in off / 4..(off + len).div_ceil(4) {
            let l = &mut self.log[word];
            if l.w_epoch == e && l.writer != me {
                return Some(Race { word, other_warp: l.writer as usize - 1, other_line: self.w_line[word], other_write: true });
            }
            if write {
                if l.r_epoch == e && l.reader != me {
                    let other = if l.reader == MANY { usize::MAX } else { l.reader as usize - 1 };
                    return Some(Race { word, other_warp: other, other_line: self.r_line[word], other_write: false });
                }
                l.w_epoch = e;
                l.writer = me;
                self.w_line[word] = line;
            } else {
                if l.r_epoch != e {
                    l.r_epoch = e;
                    l.reader = me;
                } else if l.reader != me {
                    l.reader = MANY;
                }
                self.r_line[word] = line;
            }
        }
        None
    }
}
