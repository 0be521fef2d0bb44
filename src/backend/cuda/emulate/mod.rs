//! Lane-level CPU emulation primitives for the tensor-core kernels (`kernels/attention.cu`,
//! `attention_dense.cu`), used by the kernel emulators beside this file
//! (`attention.rs`, `attention_dense.rs`, `sample.rs`; tests only).
//!
//! Why: CI has no GPU, and what is easiest to get wrong in these kernels is the index math —
//! which lane owns which element of an mma fragment, the C→A repack, shared-memory offsets and
//! pitches, which stage a cp.async writes while another is read, paged-pool addresses. An
//! emulator that executes the kernel's own indexing, compared with the CPU twin, catches those
//! without a device; `tests/cuda_parity/` checks the real
//! kernels on one.
//!
//! What is emulated:
//! - a warp as 32 lanes of registers; `mma` builds the m16n8k16 operands from the lanes'
//!   fragments by the PTX ISA ownership written in `kernels/mma.cuh` (an element no lane
//!   supplies, or a NaN operand, trips an assertion);
//! - `__shfl_xor_sync` by 1 and 2 (`quad_reduce`), the C→A repack (`c_to_a`), the 32-bit and
//!   2×16-bit shared-memory fragment loads (`ld2`, `b_rows`);
//! - bf16 rounding (round to nearest even) exactly where a kernel rounds (`bf`);
//! - shared memory as a flat array indexed like the kernel's pointer arithmetic. `cp16` writes
//!   at once (the dense emulators); `AsyncSmem` models cp.async as the PTX memory model has it:
//!   per-thread commit groups that land only at the `cp.async.wait_group` covering them, data of
//!   another thread visible only after a `__syncthreads()` following its landing, and a read or
//!   a second copy racing an in-flight copy, or a copy into a slot read in the same barrier
//!   interval (write-after-read), is an error;
//! - `Gmem`: a launch's global output buffer, each element written at most once (blocks run
//!   concurrently: two writes are a race) and read by a later launch only where written.
//!
//! Not emulated: the tensor core's internal summation order and precision (`mma` adds the 16
//! products in k order in f32 onto the accumulator); ulp-level differences of exp2f and
//! division (host libm); timing, occupancy, bank conflicts, coalescing; concurrency between
//! blocks (they run one after another; cross-block conflicts show only as double writes);
//! copies landing earlier than their wait (they may on the device, which is why reading an
//! in-flight slot is an error rather than a read of the old value).
pub(crate) mod attention;
pub(crate) mod attention_dense;
pub(crate) mod sample;

use half::bf16;
use std::collections::VecDeque;

/// Round to bf16 (nearest even) and back: `__float2bfloat16_rn`, `pack_bf16x2`.
pub fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// One lane's A fragment: 4 registers of two bf16 (low half first).
pub type AFrag = [[f32; 2]; 4];
/// One lane's B fragment: 2 registers of two bf16.
pub type BFrag = [[f32; 2]; 2];
/// One lane's C/D fragment: 4 f32.
pub type CFrag = [f32; 4];

/// `D += A·B` for one warp (m16n8k16), operands assembled from the lanes' fragments.
pub fn mma(d: &mut [CFrag; 32], a: &[AFrag; 32], b: &[BFrag; 32]) {
    let mut am = [[f32::NAN; 16]; 16];
    let mut bm = [[f32::NAN; 8]; 16];
    for lane in 0..32 {
        let (gid, tq) = (lane / 4, lane % 4);
        for reg in 0..4 {
            for h in 0..2 {
                am[gid + 8 * (reg & 1)][2 * tq + h + 8 * (reg >> 1)] = a[lane][reg][h];
            }
        }
        for reg in 0..2 {
            for h in 0..2 {
                bm[2 * tq + h + 8 * reg][gid] = b[lane][reg][h];
            }
        }
    }
    // every element owned by exactly one lane
    assert!(am.iter().flatten().chain(bm.iter().flatten()).all(|v| !v.is_nan()), "mma operand element not covered by any lane (or NaN input)");
    for (lane, dl) in d.iter_mut().enumerate() {
        let (gid, tq) = (lane / 4, lane % 4);
        for (idx, dv) in dl.iter_mut().enumerate() {
            let (row, col) = (gid + 8 * (idx >> 1), 2 * tq + (idx & 1));
            let mut s = *dv;
            for k in 0..16 {
                s += am[row][k] * bm[k][col];
            }
            *dv = s;
        }
    }
}

/// `ld_b32(p)`: two consecutive bf16 of shared memory.
pub fn ld2(sm: &[f32], at: usize) -> [f32; 2] {
    [sm[at], sm[at + 1]]
}
/// `b_from_rows<P>(y)` / `pack_raw_bf16x2(y[0], y[P]), pack_raw_bf16x2(y[8P], y[9P])`.
pub fn b_rows(sm: &[f32], at: usize, p: usize) -> BFrag {
    [[sm[at], sm[at + p]], [sm[at + 8 * p], sm[at + 9 * p]]]
}
/// `c_to_a(c0, c1)` (rounds to bf16).
pub fn c_to_a(c0: &CFrag, c1: &CFrag) -> AFrag {
    [[bf(c0[0]), bf(c0[1])], [bf(c0[2]), bf(c0[3])], [bf(c1[0]), bf(c1[1])], [bf(c1[2]), bf(c1[3])]]
}
/// `x = op(x, shfl_xor(x, 1)); x = op(x, shfl_xor(x, 2))` across a warp.
pub fn quad_reduce(v: &mut [f32; 32], op: impl Fn(f32, f32) -> f32) {
    for m in [1usize, 2] {
        let old = *v;
        for lane in 0..32 {
            v[lane] = op(old[lane], old[lane ^ m]);
        }
    }
}
/// mma.cuh's `online_softmax_tile` for one warp: `sc[nt][lane]` holds the lane's raw Q·Kᵀ
/// fragments of n-tile `nt`; `pos(lane)` the positions of the lane's two rows (−1: padding);
/// `masked(key, pos)` the keys a row must not see. On return `sc` holds the tile's unnormalized
/// probabilities 2^(s − m) and (m, l, o) are updated in the kernel's order (l a per-lane partial).
#[allow(clippy::too_many_arguments)]
pub fn online_softmax_tile(
    sc: &mut [[CFrag; 32]],
    o: &mut [[CFrag; 32]],
    m_a: &mut [f32; 32],
    m_b: &mut [f32; 32],
    l_a: &mut [f32; 32],
    l_b: &mut [f32; 32],
    kt0: i64,
    scale_log2: f32,
    pos: impl Fn(usize) -> (i64, i64),
    masked: impl Fn(i64, i64) -> bool,
) {
    let (mut mxa, mut mxb) = ([f32::NEG_INFINITY; 32], [f32::NEG_INFINITY; 32]);
    for lane in 0..32 {
        let (pos_a, pos_b) = pos(lane);
        for (nt, s_nt) in sc.iter_mut().enumerate() {
            for e in 0..4 {
                let key = kt0 + (nt * 8 + 2 * (lane % 4) + (e & 1)) as i64;
                let p = if e < 2 { pos_a } else { pos_b };
                let mut v = s_nt[lane][e] * scale_log2;
                if masked(key, p) {
                    v = f32::NEG_INFINITY;
                }
                s_nt[lane][e] = v;
                if e < 2 {
                    mxa[lane] = mxa[lane].max(v);
                } else {
                    mxb[lane] = mxb[lane].max(v);
                }
            }
        }
    }
    quad_reduce(&mut mxa, f32::max);
    quad_reduce(&mut mxb, f32::max);
    for lane in 0..32 {
        let (mna, mnb) = (m_a[lane].max(mxa[lane]), m_b[lane].max(mxb[lane]));
        let mua = if mna == f32::NEG_INFINITY { 0.0 } else { mna }; // guards −inf − −inf
        let mub = if mnb == f32::NEG_INFINITY { 0.0 } else { mnb };
        let (ca, cb) = ((m_a[lane] - mua).exp2(), (m_b[lane] - mub).exp2());
        m_a[lane] = mna;
        m_b[lane] = mnb;
        let (mut la, mut lb) = (0f32, 0f32);
        for s_nt in sc.iter_mut() {
            let x = &mut s_nt[lane];
            x[0] = (x[0] - mua).exp2();
            x[1] = (x[1] - mua).exp2();
            x[2] = (x[2] - mub).exp2();
            x[3] = (x[3] - mub).exp2();
            la += x[0] + x[1];
            lb += x[2] + x[3];
        }
        l_a[lane] = l_a[lane] * ca + la; // per-thread partial sums
        l_b[lane] = l_b[lane] * cb + lb;
        for od in o.iter_mut() {
            od[lane][0] *= ca;
            od[lane][1] *= ca;
            od[lane][2] *= cb;
            od[lane][3] *= cb;
        }
    }
}

/// `cp_async16` of 8 bf16 (or zeros when `src` is None), landing at once.
pub fn cp16(sm: &mut [f32], dst: usize, g: &[f32], src: Option<usize>) {
    for e in 0..8 {
        sm[dst + e] = src.map_or(0.0, |s| g[s + e]);
    }
}

/// One element (bf16) of `AsyncSmem`.
#[derive(Clone, Copy, Default)]
struct Slot {
    /// A cp.async to this element is issued and has not landed.
    inflight: bool,
    /// Barrier interval in which the last copy landed (0: never written).
    landed: u64,
    /// Thread whose copy landed last.
    writer: usize,
    /// Last barrier interval in which some thread read the element (0: never).
    read: u64,
}

/// Shared memory of one block written by cp.async (16-byte copies, commit groups, wait_group)
/// and separated by `__syncthreads()`, with the hazards that ordering exists to prevent
/// checked: any violation panics, naming the missing wait or barrier.
///
/// Barrier intervals ("epochs") are numbered from 1; `barrier()` starts the next. Within one
/// interval threads may run in any order, so a copy issued and a read of the same element in
/// one interval race whatever the emulation's order. Copies land (become the element's value)
/// at the issuing thread's `wait_group` that covers their group; other threads may read them
/// only in a later interval.
pub struct AsyncSmem {
    /// Landed values; NaN until first written.
    pub val: Vec<f32>,
    slot: Vec<Slot>,
    epoch: u64,
    /// Per thread: copies issued since its last commit.
    open: Vec<Vec<Copy16>>,
    /// Per thread: committed groups not yet landed, oldest first.
    groups: Vec<VecDeque<Vec<Copy16>>>,
}

/// One issued cp.async: destination element and the 8 values it will write.
type Copy16 = (usize, [f32; 8]);

impl AsyncSmem {
    pub fn new(len: usize, threads: usize) -> Self {
        AsyncSmem { val: vec![f32::NAN; len], slot: vec![Slot::default(); len], epoch: 1, open: vec![Vec::new(); threads], groups: vec![VecDeque::new(); threads] }
    }

    /// `cp_async16(&sm[dst], &g[src], src ? 16 : 0)` by thread `tid` (None: zero-fill).
    pub fn cp_async16(&mut self, tid: usize, dst: usize, g: &[f32], src: Option<usize>) {
        assert!(dst % 8 == 0 && src.is_none_or(|s| s % 8 == 0), "cp.async of 16 bytes needs 16-byte aligned addresses (dst {dst}, src {src:?})");
        for e in dst..dst + 8 {
            let s = &mut self.slot[e];
            assert!(!s.inflight, "thread {tid}: cp.async to shared element {e} while an earlier copy to it is in flight");
            assert!(s.read != self.epoch, "thread {tid}: cp.async to shared element {e}, which was read in this barrier interval (write-after-read race: missing __syncthreads)");
            s.inflight = true;
        }
        let v: [f32; 8] = std::array::from_fn(|e| src.map_or(0.0, |s| g[s + e]));
        self.open[tid].push((dst, v));
    }

    /// `cp_async_commit()` by thread `tid`.
    pub fn commit(&mut self, tid: usize) {
        let group = std::mem::take(&mut self.open[tid]);
        self.groups[tid].push_back(group);
    }

    /// `cp_async_wait<n>()` by thread `tid`: its committed groups but the newest `n` land.
    pub fn wait_group(&mut self, tid: usize, n: usize) {
        while self.groups[tid].len() > n {
            for (dst, v) in self.groups[tid].pop_front().unwrap() {
                for (e, x) in v.into_iter().enumerate() {
                    self.val[dst + e] = x;
                    self.slot[dst + e] = Slot { inflight: false, landed: self.epoch, writer: tid, read: self.slot[dst + e].read };
                }
            }
        }
    }

    /// `__syncthreads()`.
    pub fn barrier(&mut self) {
        self.epoch += 1;
    }

    /// A read of element `at` by thread `tid`.
    pub fn read(&mut self, tid: usize, at: usize) -> f32 {
        let s = &mut self.slot[at];
        assert!(!s.inflight, "thread {tid}: read of shared element {at} with a cp.async to it in flight (missing or too weak cp_async_wait)");
        assert!(s.landed != 0, "thread {tid}: read of shared element {at}, which no copy wrote (NaN-poisoned)");
        assert!(s.landed < self.epoch || s.writer == tid, "thread {tid}: read of shared element {at} copied by thread {} with no __syncthreads since it landed", s.writer);
        s.read = self.epoch;
        self.val[at]
    }

    /// `ld_b32(&sm[at])` by thread `tid`.
    pub fn ld2(&mut self, tid: usize, at: usize) -> [f32; 2] {
        for e in [at, at + 1] {
            self.read(tid, e);
        }
        ld2(&self.val, at)
    }

    /// `b_from_rows<p>(&sm[at])` by thread `tid`.
    pub fn b_rows(&mut self, tid: usize, at: usize, p: usize) -> BFrag {
        for e in [at, at + p, at + 8 * p, at + 9 * p] {
            self.read(tid, e);
        }
        b_rows(&self.val, at, p)
    }

    /// The block exits: no copy may still be in flight.
    pub fn exit(&self) {
        for (tid, (o, g)) in self.open.iter().zip(&self.groups).enumerate() {
            assert!(o.is_empty() && g.iter().all(|x| x.is_empty()), "thread {tid} exits with cp.async copies not waited for");
        }
    }
}

/// A global output buffer of emulated launches: NaN until written, each element written at
/// most once (two writes are a race between blocks, or a wrong index), and `load` only of
/// written elements (a later launch reading what no block of the earlier one wrote).
pub struct Gmem {
    pub v: Vec<f32>,
    written: Vec<bool>,
}

impl Gmem {
    pub fn new(len: usize) -> Self {
        Gmem { v: vec![f32::NAN; len], written: vec![false; len] }
    }
    pub fn store(&mut self, i: usize, x: f32) {
        assert!(!self.written[i], "global element {i} written twice");
        self.written[i] = true;
        self.v[i] = x;
    }
    pub fn load(&self, i: usize) -> f32 {
        assert!(self.written[i], "global element {i} read but never written");
        self.v[i]
    }
    pub fn written(&self, i: usize) -> bool {
        self.written[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The emulated `mma` follows the documented ownership: A·B of known matrices.
    #[test]
    fn mma_fragment_layout() {
        let a: [[f32; 16]; 16] = std::array::from_fn(|r| std::array::from_fn(|c| (r * 16 + c) as f32 / 256.0));
        let b: [[f32; 8]; 16] = std::array::from_fn(|k| std::array::from_fn(|n| ((k * 8 + n) % 7) as f32 - 3.0));
        let af: [AFrag; 32] = std::array::from_fn(|lane| {
            let (gid, tq) = (lane / 4, lane % 4);
            // a0 = A[gid][2tq..], a1 = A[gid+8][2tq..], a2 = A[gid][2tq+8..], a3 = A[gid+8][2tq+8..]
            [[a[gid][2 * tq], a[gid][2 * tq + 1]], [a[gid + 8][2 * tq], a[gid + 8][2 * tq + 1]], [a[gid][2 * tq + 8], a[gid][2 * tq + 9]], [a[gid + 8][2 * tq + 8], a[gid + 8][2 * tq + 9]]]
        });
        let bfr: [BFrag; 32] = std::array::from_fn(|lane| {
            let (gid, tq) = (lane / 4, lane % 4);
            [[b[2 * tq][gid], b[2 * tq + 1][gid]], [b[2 * tq + 8][gid], b[2 * tq + 9][gid]]]
        });
        let mut d = [[0f32; 4]; 32];
        mma(&mut d, &af, &bfr);
        for (lane, dl) in d.iter().enumerate() {
            let (gid, tq) = (lane / 4, lane % 4);
            for (idx, &v) in dl.iter().enumerate() {
                let (r, c) = (gid + 8 * (idx >> 1), 2 * tq + (idx & 1));
                let want: f32 = (0..16).map(|k| a[r][k] * b[k][c]).sum();
                assert!((v - want).abs() < 1e-4, "lane {lane} c{idx}");
            }
        }
    }

    fn panics(f: impl FnOnce() + std::panic::UnwindSafe) -> bool {
        std::panic::catch_unwind(f).is_err()
    }

    /// The double-buffered schedule of the kernels passes, and each reordering the kernel
    /// comments warn about panics: the hazard model is what makes an emulated stage-order
    /// mistake fail a test, so it is checked on its own here.
    #[test]
    fn async_smem_hazards() {
        let g: Vec<f32> = (0..64).map(|i| i as f32).collect();
        // thread t copies g[8t..] into stage `st` (8 elements per thread, 2 threads, 2 stages)
        let load = |sm: &mut AsyncSmem, st: usize| {
            for tid in 0..2 {
                sm.cp_async16(tid, st * 16 + tid * 8, &g, Some(st * 16 + tid * 8));
                sm.commit(tid);
            }
        };
        let wait = |sm: &mut AsyncSmem, n: usize| (0..2).for_each(|tid| sm.wait_group(tid, n));
        // thread 0 reads an element thread 1 copied, and vice versa
        let use_stage = |sm: &mut AsyncSmem, st: usize| {
            assert_eq!(sm.read(0, st * 16 + 8), (st * 16 + 8) as f32);
            assert_eq!(sm.read(1, st * 16), (st * 16) as f32);
        };
        // the kernel's order: load 0; [load 1; wait 1; sync; use 0; sync]; [wait 0; sync; use 1; sync]; then 0 again
        let good = |sm: &mut AsyncSmem| {
            load(sm, 0);
            load(sm, 1);
            wait(sm, 1);
            sm.barrier();
            use_stage(sm, 0);
            sm.barrier();
            load(sm, 0);
            wait(sm, 1);
            sm.barrier();
            use_stage(sm, 1);
            sm.barrier();
            wait(sm, 0);
            sm.barrier();
            use_stage(sm, 0);
            sm.barrier();
            sm.exit();
        };
        good(&mut AsyncSmem::new(32, 2));
        // wait<2> instead of <1>: stage 0 still in flight when read
        assert!(panics(|| {
            let mut sm = AsyncSmem::new(32, 2);
            load(&mut sm, 0);
            load(&mut sm, 1);
            wait(&mut sm, 2);
            sm.barrier();
            use_stage(&mut sm, 0);
        }));
        // no barrier between the wait and the read: another thread's copy is not yet visible
        assert!(panics(|| {
            let mut sm = AsyncSmem::new(32, 2);
            load(&mut sm, 0);
            wait(&mut sm, 0);
            use_stage(&mut sm, 0);
        }));
        // but a thread may read its own landed copy without one
        let mut sm = AsyncSmem::new(32, 2);
        load(&mut sm, 0);
        wait(&mut sm, 0);
        assert_eq!(sm.read(1, 8), 8.0);
        // no trailing barrier: the next load into the stage just read (write-after-read)
        assert!(panics(|| {
            let mut sm = AsyncSmem::new(32, 2);
            load(&mut sm, 0);
            wait(&mut sm, 0);
            sm.barrier();
            use_stage(&mut sm, 0);
            load(&mut sm, 0);
        }));
        // loading the stage being read (st instead of st ^ 1), copy issued before the read
        assert!(panics(|| {
            let mut sm = AsyncSmem::new(32, 2);
            load(&mut sm, 0);
            wait(&mut sm, 0);
            sm.barrier();
            load(&mut sm, 0);
            use_stage(&mut sm, 0);
        }));
        // never written, and exiting with copies in flight
        assert!(panics(|| {
            AsyncSmem::new(32, 2).read(0, 3);
        }));
        assert!(panics(|| {
            let mut sm = AsyncSmem::new(32, 2);
            load(&mut sm, 0);
            sm.exit();
        }));
        // a global element written twice, or read unwritten
        assert!(panics(|| {
            let mut gm = Gmem::new(4);
            gm.store(1, 1.0);
            gm.store(1, 2.0);
        }));
        assert!(panics(|| {
            Gmem::new(4).load(2);
        }));
    }
}
