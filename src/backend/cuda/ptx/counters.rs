//! What a launch did, counted by the interpreter as it runs (issue 54): instructions issued,
//! bytes moved per state space, global coalescing (sectors per request), shared-memory bank
//! conflicts (wavefronts per request), tensor-core issues and arithmetic. These are properties of
//! the PTX and the launch shape, not of timing, so they are exact and testable; the roofline
//! bounds in `docs/KERNEL-BOUNDS.md` are computed from them.
//!
//! Definitions (those of Nsight Compute's memory tables, simplified to one rule each):
//! - a **request** is one warp-level memory instruction with at least one active lane;
//! - **sectors**: distinct 32-byte global segments the active lanes touch; the **ideal** is
//!   ⌈distinct bytes / 32⌉ (a warp's 32 contiguous f32 = 4 sectors; stride 2 = 8, ideal 4);
//! - **wavefronts** of a shared request: 32 banks of 4-byte words; the request needs as many
//!   passes as the most distinct words any one bank holds (same word = broadcast, one pass);
//!   the ideal is ⌈distinct words / 32⌉ (a 128-bit access of 32 lanes needs 4), conflicts are
//!   the passes above it;
//! - **bytes** are the bytes the active lanes ask for (thread-level: a broadcast load of one
//!   f32 by 32 lanes is 128 bytes); **HBM sectors** are the distinct global sectors the whole
//!   launch reads / writes: the compulsory DRAM traffic if nothing was in L2 before it;
//! - **flops**: `fma`/`mad` on floats 2, float `add`/`sub`/`mul` 1 (per active lane);
//!   **SFU** ops: `ex2`/`lg2`/`rcp`/`rsqrt`/`sqrt`/`sin`/`cos` and float `div`; `mma.sync`
//!   m16n8k16 is 2·16·8·16 = 4096 flops per warp issue.
use super::ir::{BinOp, Op, Space, Ty, UnOp};
use std::collections::HashSet;
use std::fmt;

/// Traffic classes of `Counters::bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traffic {
    GlobalLd,
    GlobalSt,
    GlobalAtom,
    SharedLd,
    SharedSt,
    SharedAtom,
    LocalLd,
    LocalSt,
    Param,
    /// `cp.async` global → shared (counted once, as the bytes copied).
    CpAsync,
}

impl Traffic {
    pub const ALL: [Traffic; 10] = [
        Traffic::GlobalLd,
        Traffic::GlobalSt,
        Traffic::GlobalAtom,
        Traffic::SharedLd,
        Traffic::SharedSt,
        Traffic::SharedAtom,
        Traffic::LocalLd,
        Traffic::LocalSt,
        Traffic::Param,
        Traffic::CpAsync,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Traffic::GlobalLd => "global ld",
            Traffic::GlobalSt => "global st",
            Traffic::GlobalAtom => "global atom",
            Traffic::SharedLd => "shared ld",
            Traffic::SharedSt => "shared st",
            Traffic::SharedAtom => "shared atom",
            Traffic::LocalLd => "local ld",
            Traffic::LocalSt => "local st",
            Traffic::Param => "param",
            Traffic::CpAsync => "cp.async g->s",
        }
    }
}

/// Requests and their cost against the ideal (sectors for global, wavefronts for shared).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requests {
    pub requests: u64,
    pub actual: u64,
    pub ideal: u64,
}

impl Requests {
    fn add(&mut self, o: &Requests) {
        self.requests += o.requests;
        self.actual += o.actual;
        self.ideal += o.ideal;
    }
    /// Mean cost per request (sectors or wavefronts).
    pub fn per_request(&self) -> f64 {
        self.actual as f64 / self.requests.max(1) as f64
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Warp-level issues (an instruction issued for a group of lanes, predicated-off included).
    pub warp_insts: u64,
    /// Issues × lanes executing them (guard true).
    pub thread_insts: u64,
    /// Bytes per traffic class, indexed like `Traffic::ALL`.
    pub bytes: [u64; 10],
    /// Global loads / stores: sectors per request.
    pub global_ld: Requests,
    pub global_st: Requests,
    /// Shared loads / stores: wavefronts per request (`actual − ideal` = conflict passes).
    pub shared_ld: Requests,
    pub shared_st: Requests,
    /// `mma.sync` warp issues.
    pub mma: u64,
    /// Float flops outside the tensor cores (see the module comment).
    pub fp_flops: u64,
    pub sfu_ops: u64,
    /// Distinct global sectors read / written by the launch (summed over launches).
    pub hbm_read_sectors: u64,
    pub hbm_write_sectors: u64,
}

/// flops of one `mma.sync.m16n8k16`.
pub const MMA_FLOPS: u64 = 2 * 16 * 8 * 16;

impl Counters {
    pub fn bytes_of(&self, t: Traffic) -> u64 {
        self.bytes[t as usize]
    }
    pub fn add(&mut self, o: &Counters) {
        self.warp_insts += o.warp_insts;
        self.thread_insts += o.thread_insts;
        for (a, b) in self.bytes.iter_mut().zip(o.bytes) {
            *a += b;
        }
        self.global_ld.add(&o.global_ld);
        self.global_st.add(&o.global_st);
        self.shared_ld.add(&o.shared_ld);
        self.shared_st.add(&o.shared_st);
        self.mma += o.mma;
        self.fp_flops += o.fp_flops;
        self.sfu_ops += o.sfu_ops;
        self.hbm_read_sectors += o.hbm_read_sectors;
        self.hbm_write_sectors += o.hbm_write_sectors;
    }
    /// Compulsory HBM bytes (distinct sectors read + written, 32 bytes each).
    pub fn hbm_bytes(&self) -> u64 {
        32 * (self.hbm_read_sectors + self.hbm_write_sectors)
    }
    /// All flops: CUDA-core float arithmetic plus the tensor cores'.
    pub fn flops(&self) -> u64 {
        self.fp_flops + self.mma * MMA_FLOPS
    }
    /// Shared-memory wavefronts above the ideal (bank-conflict passes).
    pub fn bank_conflicts(&self) -> u64 {
        (self.shared_ld.actual - self.shared_ld.ideal) + (self.shared_st.actual - self.shared_st.ideal)
    }

    /// One warp-level issue of `op` for `exec` (the lanes whose guard holds).
    #[inline(always)]
    pub fn issue(&mut self, op: &Op, exec: u32) {
        let n = exec.count_ones() as u64;
        self.warp_insts += 1;
        self.thread_insts += n;
        match *op {
            Op::Fma { ty: Ty::F32 | Ty::F64 | Ty::F16 | Ty::Bf16, .. } => self.fp_flops += 2 * n,
            Op::Bin { op: BinOp::Add | BinOp::Sub | BinOp::MulLo, ty, .. } if ty.float() => self.fp_flops += n,
            Op::Bin { op: BinOp::Div, ty, .. } if ty.float() => self.sfu_ops += n,
            Op::Un { op: UnOp::Sqrt | UnOp::Rcp | UnOp::RcpApprox | UnOp::Ex2Approx | UnOp::Lg2Approx | UnOp::RsqrtApprox | UnOp::SinApprox | UnOp::CosApprox, .. } => {
                self.sfu_ops += n
            }
            Op::LdParam { ty, .. } => self.bytes[Traffic::Param as usize] += ty.bytes() as u64 * n,
            // warp-collective: one issue of the whole warp (predicated off: nothing)
            Op::Mma { .. } if exec != 0 => self.mma += 1,
            _ => {}
        }
    }
}

/// The accesses of one warp-level memory instruction, gathered lane by lane by the executor
/// and charged when the instruction is done.
#[derive(Default)]
pub struct Pending {
    /// (space after generic resolution, address or offset, bytes) per active lane.
    lanes: Vec<(Space, u64, u32)>,
    sort: Vec<(u64, u64)>,
}

impl Pending {
    #[inline(always)]
    pub fn push(&mut self, space: Space, off: u64, n: usize) {
        self.lanes.push((space, off, n as u32));
    }

    /// Charge the accesses gathered for `op` to `c` (one request per state space touched) and
    /// the launch's distinct global sectors to `hbm` (read, written).
    #[inline(always)]
    pub fn flush(&mut self, op: &Op, c: &mut Counters, hbm: &mut (HashSet<u64>, HashSet<u64>)) {
        if !self.lanes.is_empty() {
            self.charge(matches!(op, Op::St { .. }), matches!(op, Op::Atom { .. }), matches!(op, Op::CpAsync { .. }), c, hbm);
        }
    }

    /// `cp`: a `cp.async`, whose lanes' global reads are its only accesses here (the shared
    /// bytes land at the wait): its bytes count as `CpAsync`, its sectors as a global load's.
    fn charge(&mut self, write: bool, atomic: bool, cp: bool, c: &mut Counters, hbm: &mut (HashSet<u64>, HashSet<u64>)) {
        for space in [Space::Global, Space::Shared, Space::Local] {
            self.sort.clear();
            let mut bytes = 0u64;
            for &(s, off, n) in &self.lanes {
                if s == space || (space == Space::Global && s == Space::Const) {
                    self.sort.push((off, off + n as u64));
                    bytes += n as u64;
                }
            }
            if self.sort.is_empty() {
                continue;
            }
            let t = match (space, write, atomic) {
                (Space::Global, _, _) if cp => Traffic::CpAsync,
                (Space::Global, _, true) => Traffic::GlobalAtom,
                (Space::Global, true, _) => Traffic::GlobalSt,
                (Space::Global, false, _) => Traffic::GlobalLd,
                (Space::Shared, _, true) => Traffic::SharedAtom,
                (Space::Shared, true, _) => Traffic::SharedSt,
                (Space::Shared, false, _) => Traffic::SharedLd,
                (_, true, _) => Traffic::LocalSt,
                _ => Traffic::LocalLd,
            };
            c.bytes[t as usize] += bytes;
            match space {
                Space::Global => {
                    let (sectors, ideal) = sectors(&mut self.sort, |s| {
                        if write || atomic {
                            hbm.1.insert(s);
                        }
                        if !write || atomic {
                            hbm.0.insert(s);
                        }
                    });
                    let r = if write && !atomic { &mut c.global_st } else { &mut c.global_ld };
                    if !atomic {
                        r.requests += 1;
                        r.actual += sectors;
                        r.ideal += ideal;
                    }
                }
                Space::Shared if !atomic => {
                    let (waves, ideal) = wavefronts(&mut self.sort);
                    let r = if write { &mut c.shared_st } else { &mut c.shared_ld };
                    r.requests += 1;
                    r.actual += waves;
                    r.ideal += ideal;
                }
                _ => {}
            }
        }
        self.lanes.clear();
    }
}

/// Distinct 32-byte sectors of the byte ranges `r` (each sector passed to `each`), and the
/// ideal ⌈distinct bytes / 32⌉.
pub fn sectors(r: &mut [(u64, u64)], mut each: impl FnMut(u64)) -> (u64, u64) {
    r.sort_unstable();
    let (mut n, mut last, mut bytes, mut end) = (0u64, u64::MAX, 0u64, 0u64);
    for &(a, b) in r.iter() {
        // distinct bytes: the union of the ranges
        let a2 = a.max(end);
        if b > a2 {
            bytes += b - a2;
        }
        end = end.max(b);
        for s in a / 32..b.div_ceil(32) {
            if s != last && (last == u64::MAX || s > last) {
                n += 1;
                each(s);
                last = s;
            }
        }
    }
    (n, bytes.div_ceil(32))
}

/// Wavefronts of a shared request over the byte ranges `r`: the most distinct 4-byte words in
/// one of the 32 banks, and the ideal ⌈distinct words / 32⌉.
pub fn wavefronts(r: &mut [(u64, u64)]) -> (u64, u64) {
    let mut words: Vec<u64> = Vec::with_capacity(r.len() * 4);
    for &(a, b) in r.iter() {
        words.extend(a / 4..b.div_ceil(4));
    }
    words.sort_unstable();
    words.dedup();
    let mut per_bank = [0u64; 32];
    for w in &words {
        per_bank[(w % 32) as usize] += 1;
    }
    (per_bank.into_iter().max().unwrap_or(0), (words.len() as u64).div_ceil(32))
}

impl fmt::Display for Counters {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} warp issues, {} thread instructions", self.warp_insts, self.thread_insts)?;
        for t in Traffic::ALL {
            let b = self.bytes_of(t);
            if b > 0 {
                write!(f, "; {} {b} B", t.name())?;
            }
        }
        let req = |f: &mut fmt::Formatter, what: &str, r: &Requests, unit: &str| {
            if r.requests > 0 {
                write!(f, "; {what} {} requests, {:.2} {unit}/request (ideal {:.2})", r.requests, r.per_request(), r.ideal as f64 / r.requests as f64)
            } else {
                Ok(())
            }
        };
        req(f, "global ld", &self.global_ld, "sectors")?;
        req(f, "global st", &self.global_st, "sectors")?;
        req(f, "shared ld", &self.shared_ld, "wavefronts")?;
        req(f, "shared st", &self.shared_st, "wavefronts")?;
        if self.bank_conflicts() > 0 {
            write!(f, "; {} bank-conflict wavefronts", self.bank_conflicts())?;
        }
        write!(f, "; HBM ≥ {} B; {} fp flops, {} SFU ops, {} mma.sync", self.hbm_bytes(), self.fp_flops, self.sfu_ops, self.mma)
    }
}
