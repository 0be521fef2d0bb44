//! `cp.async` state of one CTA: the copies each thread has issued and not yet waited for.
//!
//! **Model.** A copy's source is read when it is issued (the kernels copy from memory no
//! thread writes during the launch); its data lands in shared memory only at the issuing
//! thread's `cp.async.wait_group n` / `wait_all` that covers its group — the latest moment
//! the PTX memory model allows. Until then its destination bytes are *in flight*: any shared
//! access to them, by any thread and on either side of a `bar.sync` (a barrier does not wait
//! for other threads' copies), is an error, as is a second copy into them. On a GPU such an
//! access sees old or new bytes depending on timing; here it is caught whichever it would be.
//! Groups follow the ISA: `commit_group` closes the copies issued since the last one into a
//! group (possibly empty); `wait_group n` completes all but the `n` most recent groups;
//! `wait_all` commits, then waits for 0. Copies still pending when a thread exits never land.
use std::collections::VecDeque;

/// One issued copy: `len` bytes (4, 8 or 16) for shared offset `off`.
pub struct Copy {
    pub off: usize,
    pub len: usize,
    pub data: [u8; 16],
    /// PTX line of the `cp.async`.
    pub line: u32,
}

/// An in-flight copy covering accessed bytes: the thread that issued it and its PTX line.
pub struct InFlight {
    pub thread: usize,
    pub line: u32,
}

pub struct AsyncCopies {
    /// Per thread: copies issued since its last commit.
    open: Vec<Vec<Copy>>,
    /// Per thread: committed groups, oldest first.
    groups: Vec<VecDeque<Vec<Copy>>>,
    /// Per 4-byte shared word: issuing thread + 1 of the in-flight copy covering it (0: none).
    owner: Vec<u32>,
    /// PTX line of that copy.
    line: Vec<u32>,
    /// In-flight copies in the CTA (accesses skip the word lookup while it is 0).
    pending: usize,
}

impl AsyncCopies {
    pub fn new(threads: usize, smem_bytes: usize) -> Self {
        let words = smem_bytes.div_ceil(4);
        AsyncCopies { open: (0..threads).map(|_| Vec::new()).collect(), groups: (0..threads).map(|_| VecDeque::new()).collect(), owner: vec![0; words], line: vec![0; words], pending: 0 }
    }

    /// Forget everything (a new CTA).
    pub fn reset(&mut self) {
        if self.pending > 0 || self.groups.iter().any(|g| !g.is_empty()) {
            self.open.iter_mut().for_each(Vec::clear);
            self.groups.iter_mut().for_each(VecDeque::clear);
            self.owner.fill(0);
        }
        self.pending = 0;
    }

    /// The in-flight copy covering any byte of `[off, off + len)`, if one does.
    #[inline(always)]
    pub fn check(&self, off: usize, len: usize) -> Option<InFlight> {
        if self.pending == 0 {
            return None;
        }
        (off / 4..(off + len).div_ceil(4)).find(|&w| self.owner[w] != 0).map(|w| InFlight { thread: self.owner[w] as usize - 1, line: self.line[w] })
    }

    /// Record a copy issued by `thread` (its destination must be free: see `check`).
    pub fn issue(&mut self, thread: usize, c: Copy) {
        for w in c.off / 4..(c.off + c.len).div_ceil(4) {
            self.owner[w] = thread as u32 + 1;
            self.line[w] = c.line;
        }
        self.pending += 1;
        self.open[thread].push(c);
    }

    pub fn commit(&mut self, thread: usize) {
        let g = std::mem::take(&mut self.open[thread]);
        self.groups[thread].push_back(g);
    }

    /// `wait_group n` of `thread`: the copies that land now (their bytes are no longer in
    /// flight; the caller writes them to shared memory).
    pub fn wait(&mut self, thread: usize, n: usize) -> Vec<Copy> {
        let mut out = Vec::new();
        while self.groups[thread].len() > n {
            out.extend(self.groups[thread].pop_front().unwrap());
        }
        for c in &out {
            self.owner[c.off / 4..(c.off + c.len).div_ceil(4)].fill(0);
        }
        self.pending -= out.len();
        out
    }
}
