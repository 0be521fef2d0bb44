//! Page bookkeeping for the paged KV cache: page tables, reference counts and copy-on-write.
//!
//! A `Seq` is a page table plus a length. `fork` shares every page of a sequence (reference
//! counts go up); the first write into a shared, partially filled page copies it first, so forks
//! never see each other's tokens. This is how a group's `n` rollouts share the KV cache of the
//! common `[template head, question, section]` prefix (docs/DESIGN.md §4.1).
use crate::backend::{AttnGeom, Backend};
use anyhow::{bail, Result};

#[derive(Debug, Default)]
pub struct Seq {
    pub pages: Vec<u32>,
    pub len: usize,
}

pub struct KvCache<B: Backend> {
    pub store: B::Kv,
    pub geom: AttnGeom,
    refcount: Vec<u32>,
    free: Vec<u32>,
    max_pages: usize,
    /// Tokens written (a measure of prefill + decode work that hit the cache).
    pub tokens_written: u64,
}

impl<B: Backend> KvCache<B> {
    pub fn new(be: &B, geom: AttnGeom, max_pages: usize) -> Result<Self> {
        Ok(KvCache {
            store: be.kv_new(geom, max_pages)?,
            geom,
            refcount: Vec::new(),
            free: Vec::new(),
            max_pages,
            tokens_written: 0,
        })
    }

    pub fn page_size(&self) -> usize {
        self.geom.page_size
    }

    pub fn pages_in_use(&self) -> usize {
        self.refcount.iter().filter(|&&r| r > 0).count()
    }

    fn alloc(&mut self) -> Result<u32> {
        if let Some(p) = self.free.pop() {
            self.refcount[p as usize] = 1;
            return Ok(p);
        }
        if self.refcount.len() >= self.max_pages {
            bail!(
                "KV cache is full ({} pages of {} tokens); lower the batch or context size, or raise --kv-tokens",
                self.max_pages,
                self.geom.page_size
            );
        }
        self.refcount.push(1);
        Ok((self.refcount.len() - 1) as u32)
    }

    fn unref(&mut self, be: &B, p: u32) {
        let r = &mut self.refcount[p as usize];
        debug_assert!(*r > 0, "page {p} released twice");
        *r -= 1;
        if *r == 0 {
            self.free.push(p);
            be.kv_release_page(&mut self.store, p);
        }
    }

    /// A new sequence sharing all of `s`'s tokens.
    pub fn fork(&mut self, s: &Seq) -> Seq {
        for &p in &s.pages {
            self.refcount[p as usize] += 1;
        }
        Seq { pages: s.pages.clone(), len: s.len }
    }

    /// Forget tokens from `len` on (pages no longer needed are released).
    pub fn truncate(&mut self, be: &B, s: &mut Seq, len: usize) {
        assert!(len <= s.len);
        let keep = len.div_ceil(self.geom.page_size);
        for p in s.pages.drain(keep..).collect::<Vec<_>>() {
            self.unref(be, p);
        }
        s.len = len;
    }

    pub fn release(&mut self, be: &B, s: Seq) {
        for p in s.pages {
            self.unref(be, p);
        }
    }

    /// Make room for `n` more tokens and return their slots. The page holding position `s.len`
    /// is copied first if it is shared (copy-on-write). `s.len` is not advanced here.
    pub fn reserve(&mut self, be: &B, s: &mut Seq, n: usize) -> Result<Vec<u32>> {
        let ps = self.geom.page_size;
        let start = s.len;
        if start % ps != 0 {
            let idx = start / ps;
            let p = s.pages[idx];
            if self.refcount[p as usize] > 1 {
                let fresh = self.alloc()?;
                be.kv_copy_page(&mut self.store, p, fresh, start % ps)?;
                self.refcount[p as usize] -= 1;
                s.pages[idx] = fresh;
            }
        }
        let need = (start + n).div_ceil(ps);
        while s.pages.len() < need {
            let p = self.alloc()?;
            s.pages.push(p);
        }
        self.tokens_written += n as u64;
        Ok((start..start + n).map(|pos| s.pages[pos / ps] * ps as u32 + (pos % ps) as u32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn geom() -> AttnGeom {
        AttnGeom { n_layers: 1, n_heads: 1, n_kv_heads: 1, head_dim: 2, page_size: 4 }
    }

    #[test]
    fn fork_shares_then_copies_on_write() {
        let be = CpuBackend::new();
        let mut kv = KvCache::new(&be, geom(), 16).unwrap();
        let mut a = Seq::default();
        let slots = kv.reserve(&be, &mut a, 6).unwrap();
        a.len = 6;
        assert_eq!(slots, vec![0, 1, 2, 3, 4, 5]);
        let qkv: crate::backend::cpu::CpuBuf = vec![1.0f32; 6 * 6].into();
        be.kv_store(&mut kv.store, 0, &qkv, &slots, geom()).unwrap();
        let mut b = kv.fork(&a);
        assert_eq!(kv.pages_in_use(), 2);
        // b writes position 6: its second page (shared, half full) is copied
        let sb = kv.reserve(&be, &mut b, 1).unwrap();
        b.len += 1;
        assert_eq!(b.pages[0], a.pages[0]);
        assert_ne!(b.pages[1], a.pages[1]);
        assert_eq!(sb[0], b.pages[1] * 4 + 2);
        assert_eq!(kv.pages_in_use(), 3);
        // a can now write its own page without copying
        let sa = kv.reserve(&be, &mut a, 3).unwrap();
        assert_eq!(sa, vec![6, 7, a.pages[2] * 4]);
        a.len += 3;
        kv.release(&be, a);
        kv.release(&be, b);
        assert_eq!(kv.pages_in_use(), 0);
    }

    #[test]
    fn full_cache_is_a_clear_error() {
        let be = CpuBackend::new();
        let mut kv = KvCache::new(&be, geom(), 2).unwrap();
        let mut a = Seq::default();
        let e = kv.reserve(&be, &mut a, 9).unwrap_err().to_string();
        assert!(e.contains("KV cache is full"), "{e}");
    }
}
