//! Execution of a decoded entry: CTAs one after another, the warps of a CTA each run until
//! they reach a barrier or exit, then the barrier is resolved and the next epoch starts.
//!
//! **Divergence: per-lane PCs, min-PC scheduling.** Each lane has its own PC; a warp issues the
//! instruction at the smallest PC among its runnable lanes, for exactly the lanes at that PC.
//! Lanes that branched ahead wait until the others reach them, which reconverges them at the
//! first common instruction; nvcc lays out structured control flow so that this is the
//! immediate post-dominator (the join follows both arms), and for any layout it is still a legal
//! schedule of independent threads. It needs no CFG analysis (a SIMT stack would need the
//! post-dominator tree), and a warp-synchronous instruction (`shfl.sync`, `redux.sync`,
//! `mma.sync`) whose member lanes are not all at it is exactly a divergent-collective bug,
//! reported as such.
//!
//! `cp.async` copies are kept per thread in `cp_async::AsyncCopies` and land at the issuer's
//! wait; every shared access first asks it whether its bytes are still in flight.
//!
//! Registers: `[warp][register][lane]` u64 slots, each holding its value's bits zero-extended.
use super::alu::{binary, compare, convert, sext, unary};
use super::counters::{Counters, Pending};
use super::cp_async::{self, AsyncCopies};
use super::float::{self, mask};
use super::mem::{self, GlobalMem, RaceDetector, Window};
use super::mma;
use super::ir::{Addr, BinOp, Func, Inst, Op, Opnd, RedOp, Rnd, ShflMode, Space, Sreg, Ty};
use anyhow::{anyhow, bail, Result};

/// What a launch needs besides the function and memory.
pub struct Launch<'a> {
    pub module: &'a str,
    pub files: &'a std::collections::HashMap<u32, String>,
    pub grid: u32,
    pub block: u32,
    pub dyn_smem: u32,
    pub params: &'a [u8],
    pub race_check: bool,
    /// Thread-instructions after which the launch is stopped as a runaway (a loop that never
    /// ends would otherwise hang the test that launched it).
    pub max_thread_insts: u64,
}

/// The default runaway budget: minutes of interpretation, far above any test's launch.
pub const MAX_THREAD_INSTS: u64 = 20_000_000_000;

#[derive(Default, Clone, Debug)]
pub struct Stats {
    /// Instructions issued × lanes executing them.
    pub thread_insts: u64,
    /// What the launch did (`counters.rs`).
    pub counters: Counters,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lane {
    Run,
    Bar,
    Done,
}

struct Warp {
    pc: [u32; 32],
    st: [Lane; 32],
}

struct Cta<'a> {
    f: &'a Func,
    l: &'a Launch<'a>,
    block: u32,
    regs: Vec<u64>,
    shared: Vec<u8>,
    local: Vec<u8>,
    race: Option<RaceDetector>,
    /// cp.async copies issued and not yet landed.
    cp: AsyncCopies,
    /// Global stores of this launch: address → (block + 1, PTX line), when races are checked.
    /// Blocks are unordered, so a location written by one block and accessed by another in the
    /// same launch is a race (duplicate kv_store slots, overlapping row ownership). Keyed by the
    /// access's start address (the kernels' conflicts are whole elements); reads are not logged,
    /// so a read followed by another block's write goes unseen.
    global_writes: std::collections::HashMap<u64, (u32, u32)>,
    /// bar.red predicate of each waiting thread.
    bar_pred: Vec<bool>,
    stats: Stats,
    /// The current memory instruction's lane accesses, and the launch's distinct global
    /// sectors (read, written), for the counters.
    pending: Pending,
    hbm: (std::collections::HashSet<u64>, std::collections::HashSet<u64>),
}

/// Run every CTA of the launch.
pub fn run(f: &Func, l: &Launch, gmem: &mut GlobalMem) -> Result<Stats> {
    if let Some(why) = &f.unsupported {
        bail!("emulated device: kernel {} ({}.ptx) cannot run: {why}", f.name, l.module);
    }
    let smem = f.static_smem + l.dyn_smem as usize;
    let nw = (l.block as usize).div_ceil(32);
    let mut cta = Cta {
        f,
        l,
        block: 0,
        regs: vec![0; nw * f.n_regs * 32],
        shared: vec![0; smem],
        local: vec![0; f.local_bytes * nw * 32],
        race: None,
        cp: AsyncCopies::new(nw * 32, smem),
        global_writes: std::collections::HashMap::new(),
        bar_pred: vec![false; nw * 32],
        stats: Stats::default(),
        pending: Pending::default(),
        hbm: Default::default(),
    };
    for b in 0..l.grid {
        cta.block = b;
        // fresh state per CTA: shared memory is undefined at entry; zero is one legal value
        cta.regs.fill(0);
        cta.shared.fill(0);
        cta.local.fill(0);
        cta.race = l.race_check.then(|| RaceDetector::new(smem));
        cta.cp.reset();
        cta.run_block(gmem)?;
    }
    cta.stats.counters.hbm_read_sectors = cta.hbm.0.len() as u64;
    cta.stats.counters.hbm_write_sectors = cta.hbm.1.len() as u64;
    Ok(cta.stats)
}

impl Cta<'_> {
    fn where_(&self, inst: &Inst, warp: usize, lane: usize) -> String {
        let src = self.l.files.get(&inst.loc.0).map(|f| format!(" ({f}:{})", inst.loc.1)).unwrap_or_default();
        format!("kernel {} ({}.ptx line {}{src}), block {}, thread {}", self.f.name, self.l.module, inst.line, self.block, warp * 32 + lane)
    }

    /// The source position (" (file:line)") of the instruction at PTX line `line`, for messages.
    fn src_of_line(&self, line: u32) -> String {
        self.f
            .insts
            .iter()
            .find(|i| i.line == line)
            .and_then(|i| self.l.files.get(&i.loc.0).map(|f| format!(" ({f}:{})", i.loc.1)))
            .unwrap_or_default()
    }

    fn run_block(&mut self, gmem: &mut GlobalMem) -> Result<()> {
        let nthreads = self.l.block as usize;
        let nw = nthreads.div_ceil(32);
        let mut warps: Vec<Warp> = (0..nw)
            .map(|w| {
                let mut st = [Lane::Run; 32];
                for (i, s) in st.iter_mut().enumerate() {
                    if w * 32 + i >= nthreads {
                        *s = Lane::Done;
                    }
                }
                Warp { pc: [0; 32], st }
            })
            .collect();
        loop {
            for (w, warp) in warps.iter_mut().enumerate() {
                self.run_warp(w, warp, gmem)?;
            }
            // every live thread is at a barrier (or all are done)
            let mut at: Option<(u32, usize, usize)> = None;
            let mut any = false;
            let mut red = (false, true, 0u32); // or, and, popc
            for (w, warp) in warps.iter().enumerate() {
                for lane in 0..32 {
                    if warp.st[lane] != Lane::Bar {
                        continue;
                    }
                    any = true;
                    let pc = warp.pc[lane];
                    match at {
                        None => at = Some((pc, w, lane)),
                        Some((p0, w0, l0)) if p0 != pc => {
                            let (a, b) = (&self.f.insts[p0 as usize], &self.f.insts[pc as usize]);
                            bail!(
                                "emulated device: divergent barrier in {}: thread {} waits at the barrier of PTX line {} while thread {} waits at PTX line {} (a __syncthreads() not reached by the whole block)",
                                self.where_(b, w, lane),
                                w0 * 32 + l0,
                                a.line,
                                w * 32 + lane,
                                b.line
                            );
                        }
                        _ => {}
                    }
                    let p = self.bar_pred[w * 32 + lane];
                    red.0 |= p;
                    red.1 &= p;
                    red.2 += p as u32;
                }
            }
            if !any {
                return Ok(());
            }
            let pc = at.unwrap().0;
            let inst = &self.f.insts[pc as usize];
            for (w, warp) in warps.iter_mut().enumerate() {
                for lane in 0..32 {
                    if warp.st[lane] == Lane::Bar {
                        if let Op::BarRed { op, d, .. } = inst.op {
                            let v = match op {
                                RedOp::Or => red.0 as u64,
                                RedOp::And => red.1 as u64,
                                _ => red.2 as u64,
                            };
                            self.regs[(w * self.f.n_regs + d as usize) * 32 + lane] = v;
                        }
                        warp.st[lane] = Lane::Run;
                        warp.pc[lane] = pc + 1;
                    }
                }
            }
            if let Some(r) = &mut self.race {
                r.epoch += 1;
            }
        }
    }

    #[inline(always)]
    fn reg(&self, w: usize, r: u32, lane: usize) -> u64 {
        self.regs[(w * self.f.n_regs + r as usize) * 32 + lane]
    }

    #[inline(always)]
    fn set(&mut self, w: usize, r: u32, lane: usize, v: u64) {
        self.regs[(w * self.f.n_regs + r as usize) * 32 + lane] = v;
    }

    #[inline(always)]
    fn val(&self, w: usize, o: Opnd, lane: usize) -> u64 {
        match o {
            Opnd::Reg(r) => self.reg(w, r, lane),
            Opnd::Imm(v) => v,
            Opnd::Sreg(s) => match s {
                Sreg::TidX => (w * 32 + lane) as u64,
                Sreg::NtidX => self.l.block as u64,
                Sreg::CtaidX => self.block as u64,
                Sreg::NctaidX => self.l.grid as u64,
                Sreg::LaneId => lane as u64,
                Sreg::WarpId => w as u64,
                Sreg::Zero => 0,
                Sreg::One => 1,
                Sreg::DynSmemSize => self.l.dyn_smem as u64,
            },
        }
    }

    fn run_warp(&mut self, w: usize, warp: &mut Warp, gmem: &mut GlobalMem) -> Result<()> {
        let n_insts = self.f.insts.len() as u32;
        loop {
            // the lanes at the smallest PC among the runnable ones
            let mut pc = u32::MAX;
            let mut m = 0u32;
            for lane in 0..32 {
                if warp.st[lane] == Lane::Run {
                    let p = warp.pc[lane];
                    if p < pc {
                        pc = p;
                        m = 1 << lane;
                    } else if p == pc {
                        m |= 1 << lane;
                    }
                }
            }
            if m == 0 {
                return Ok(());
            }
            // runnable lanes outside the group (they may be waiting at a later PC)
            let others: u32 = (0..32).filter(|&l| warp.st[l] == Lane::Run && m & (1 << l) == 0).fold(0, |a, l| a | (1 << l));
            // straight-line run of the group until something may change the grouping
            loop {
                if pc >= n_insts {
                    // falling off the end is a return
                    for lane in lanes(m) {
                        warp.st[lane] = Lane::Done;
                    }
                    break;
                }
                let f = self.f;
                let inst = &f.insts[pc as usize];
                let exec = match inst.guard {
                    None => m,
                    Some((p, neg)) => {
                        let mut e = 0;
                        for lane in lanes(m) {
                            if (self.reg(w, p, lane) != 0) != neg {
                                e |= 1 << lane;
                            }
                        }
                        e
                    }
                };
                self.stats.thread_insts += exec.count_ones() as u64;
                self.stats.counters.issue(&inst.op, exec);
                if self.stats.thread_insts > self.l.max_thread_insts {
                    bail!("emulated device: {}: the launch ran past {} thread-instructions (a loop that does not end?)", self.where_(inst, w, lanes(m).next().unwrap_or(0)), self.l.max_thread_insts);
                }
                match &inst.op {
                    Op::Bra { target, .. } => {
                        for lane in lanes(m) {
                            warp.pc[lane] = if exec & (1 << lane) != 0 { *target } else { pc + 1 };
                        }
                        break;
                    }
                    Op::Ret => {
                        for lane in lanes(m) {
                            if exec & (1 << lane) != 0 {
                                warp.st[lane] = Lane::Done;
                            } else {
                                warp.pc[lane] = pc + 1;
                            }
                        }
                        break;
                    }
                    Op::BarSync { .. } | Op::BarRed { .. } => {
                        for lane in lanes(m) {
                            if exec & (1 << lane) != 0 {
                                warp.st[lane] = Lane::Bar;
                                warp.pc[lane] = pc;
                                if let Op::BarRed { p, neg, .. } = inst.op {
                                    self.bar_pred[w * 32 + lane] = (self.val(w, p, lane) != 0) != neg;
                                }
                            } else {
                                warp.pc[lane] = pc + 1;
                            }
                        }
                        break;
                    }
                    Op::Shfl { .. } | Op::Redux { .. } => {
                        self.collective(w, warp, inst, exec, m)?;
                    }
                    Op::Mma { d, a, b, c } => {
                        self.mma(w, warp, inst, exec, *d, *a, *b, *c)?;
                    }
                    op => {
                        if exec != 0 {
                            self.exec(w, inst, op, exec, gmem)?;
                            // a memory instruction's lanes are one request
                            self.pending.flush(op, &mut self.stats.counters, &mut self.hbm);
                        }
                    }
                }
                pc += 1;
                // another group may be waiting at the next PC: regroup (lane PCs are written
                // back only when the group changes)
                if pc >= n_insts || (others != 0 && lanes(others).any(|l| warp.pc[l] == pc)) {
                    for lane in lanes(m) {
                        warp.pc[lane] = pc;
                    }
                    break;
                }
            }
        }
    }

    /// `shfl.sync` / `redux.sync`: every lane of the member mask must be here.
    fn collective(&mut self, w: usize, warp: &Warp, inst: &Inst, exec: u32, _m: u32) -> Result<()> {
        let (mask_op, lane0) = match &inst.op {
            Op::Shfl { mask, .. } | Op::Redux { mask, .. } => (*mask, lanes(exec).next()),
            _ => unreachable!(),
        };
        let Some(lane0) = lane0 else { return Ok(()) };
        let member = self.val(w, mask_op, lane0) as u32;
        let live: u32 = (0..32).filter(|&l| warp.st[l] != Lane::Done).fold(0, |a, l| a | (1 << l));
        if member & live & !exec != 0 || exec & !member != 0 {
            let missing = member & live & !exec;
            bail!(
                "emulated device: {}: warp-synchronous {} with member mask 0x{member:08x}, but lanes 0x{missing:08x} of it are not at this instruction and lanes 0x{:08x} execute it outside the mask (divergent warp)",
                self.where_(inst, w, lane0),
                if matches!(inst.op, Op::Shfl { .. }) { "shfl.sync" } else { "redux.sync" },
                exec & !member
            );
        }
        match inst.op {
            Op::Shfl { mode, d, dp, a, b, c, .. } => {
                let src: Vec<u64> = (0..32).map(|l| self.val(w, a, l)).collect();
                for lane in lanes(exec) {
                    let bval = (self.val(w, b, lane) & 31) as i32;
                    let cv = self.val(w, c, lane) as u32;
                    let (cval, seg) = ((cv & 31) as i32, ((cv >> 8) & 31) as i32);
                    let li = lane as i32;
                    let max_lane = (li & seg) | (cval & !seg);
                    let min_lane = li & seg;
                    let (j, ok) = match mode {
                        ShflMode::Up => (li - bval, li - bval >= max_lane),
                        ShflMode::Down => (li + bval, li + bval <= max_lane),
                        ShflMode::Bfly => (li ^ bval, (li ^ bval) <= max_lane),
                        ShflMode::Idx => {
                            let j = min_lane | (bval & !seg);
                            (j, j <= max_lane)
                        }
                    };
                    let j = if ok { j as usize } else { lane };
                    if exec & (1 << j) == 0 {
                        bail!("emulated device: {}: shfl.sync reads lane {j}, which does not execute it (undefined value)", self.where_(inst, w, lane));
                    }
                    self.set(w, d, lane, src[j] & 0xffff_ffff);
                    if let Some(p) = dp {
                        self.set(w, p, lane, ok as u64);
                    }
                }
            }
            Op::Redux { op, ty, d, a, .. } => {
                let vals: Vec<u64> = lanes(exec).map(|l| self.val(w, a, l) & 0xffff_ffff).collect();
                let r = match (op, ty.signed()) {
                    (RedOp::Add, _) => vals.iter().fold(0u32, |s, &v| s.wrapping_add(v as u32)) as u64,
                    (RedOp::Min, false) => *vals.iter().min().unwrap(),
                    (RedOp::Max, false) => *vals.iter().max().unwrap(),
                    (RedOp::Min, true) => vals.iter().map(|&v| v as u32 as i32).min().unwrap() as u32 as u64,
                    (RedOp::Max, true) => vals.iter().map(|&v| v as u32 as i32).max().unwrap() as u32 as u64,
                    (RedOp::And, _) => vals.iter().fold(u32::MAX as u64, |s, &v| s & v),
                    (RedOp::Or, _) => vals.iter().fold(0, |s, &v| s | v),
                    (RedOp::Xor, _) => vals.iter().fold(0, |s, &v| s ^ v),
                    (RedOp::Popc, _) => bail!("redux.popc is not modelled"),
                };
                for lane in lanes(exec) {
                    self.set(w, d, lane, r);
                }
            }
            _ => unreachable!(),
        }
        Ok(())
    }

    /// `mma.sync.aligned`: all 32 lanes of the warp execute it together (semantics in `mma.rs`).
    #[allow(clippy::too_many_arguments)]
    fn mma(&mut self, w: usize, warp: &Warp, inst: &Inst, exec: u32, d: [u32; 4], a: [Opnd; 4], b: [Opnd; 2], c: [Opnd; 4]) -> Result<()> {
        if exec == 0 {
            return Ok(()); // predicated off for the whole warp
        }
        if exec != u32::MAX {
            let exited: u32 = (0..32).filter(|&l| warp.st[l] == Lane::Done).fold(0, |a, l| a | (1 << l));
            bail!(
                "emulated device: {}: mma.sync.aligned is warp-collective: all 32 lanes must execute it converged, but lanes 0x{:08x} do not (0x{exited:08x} have exited; the rest are diverged or predicated off)",
                self.where_(inst, w, lanes(exec).next().unwrap_or(0)),
                !exec
            );
        }
        let (mut ra, mut rb, mut rc) = ([[0u64; 4]; 32], [[0u64; 2]; 32], [[0u64; 4]; 32]);
        for lane in 0..32 {
            for i in 0..4 {
                ra[lane][i] = self.val(w, a[i], lane);
                rc[lane][i] = self.val(w, c[i], lane);
            }
            for i in 0..2 {
                rb[lane][i] = self.val(w, b[i], lane);
            }
        }
        let rd = mma::mma_m16n8k16_bf16(&ra, &rb, &rc);
        for (lane, dl) in rd.iter().enumerate() {
            for i in 0..4 {
                self.set(w, d[i], lane, dl[i]);
            }
        }
        Ok(())
    }

    /// `cp.async` of one lane: bounds and alignment now, the source read now, the shared bytes
    /// marked in flight until the issuer's wait (`cp_async.rs`).
    #[allow(clippy::too_many_arguments)]
    fn cp_async_issue(&mut self, inst: &Inst, w: usize, lane: usize, dst: Addr, src: Addr, size: u32, src_size: Option<Opnd>, gmem: &mut GlobalMem) -> Result<()> {
        let n = size as usize;
        let (d, s) = (self.addr(w, dst, lane), self.addr(w, src, lane));
        let from = src_size.map_or(n as u64, |o| self.val(w, o, lane) & 0xffff_ffff);
        if from > n as u64 {
            bail!("emulated device: {}: cp.async src-size {from} exceeds its cp-size {n}", self.where_(inst, w, lane));
        }
        if !d.is_multiple_of(n as u64) || !s.is_multiple_of(n as u64) {
            bail!("emulated device: {}: misaligned {n}-byte cp.async (shared 0x{d:x}, global 0x{s:x}; both must be multiples of {n})", self.where_(inst, w, lane));
        }
        let off = d as usize;
        if off + n > self.shared.len() {
            bail!("emulated device: {}: out-of-bounds {n}-byte cp.async into shared offset {off} (the block has {} bytes)", self.where_(inst, w, lane), self.shared.len());
        }
        self.shared_check(inst, w, lane, off, n, true, "cp.async")?;
        let mut data = [0u8; 16];
        if from > 0 {
            self.access(inst, w, lane, Space::Global, s, &mut data[..from as usize], false, gmem)?;
        }
        self.cp.issue(w * 32 + lane, cp_async::Copy { off, len: n, data, line: inst.line });
        Ok(())
    }

    /// `cp.async.wait_group n` of one lane: its completed copies land in shared memory (a write
    /// by its warp, for the race detector, at the wait's epoch).
    fn cp_async_wait(&mut self, inst: &Inst, w: usize, lane: usize, n: u32, all: bool) -> Result<()> {
        if all {
            self.cp.commit(w * 32 + lane);
        }
        for c in self.cp.wait(w * 32 + lane, n as usize) {
            if let Some(r) = &mut self.race {
                if let Some(race) = r.access(c.off, c.len, w, true, c.line) {
                    bail!(
                        "emulated device: {}: shared-memory race on the word at offset {}: the cp.async of PTX line {}{} lands here (warp {w}), and a {} by warp {} at PTX line {}{} has no barrier between them",
                        self.where_(inst, w, lane),
                        race.word * 4,
                        c.line,
                        self.src_of_line(c.line),
                        if race.other_write { "store" } else { "load" },
                        race.other_warp,
                        race.other_line,
                        self.src_of_line(race.other_line)
                    );
                }
            }
            self.shared[c.off..c.off + c.len].copy_from_slice(&c.data[..c.len]);
        }
        Ok(())
    }

    /// Shared-memory checks of an access by warp `w` (lane `lane`): no byte of it in flight in
    /// a cp.async, and no race with another warp in this barrier epoch.
    #[allow(clippy::too_many_arguments)]
    fn shared_check(&mut self, inst: &Inst, w: usize, lane: usize, o: usize, n: usize, write: bool, what: &str) -> Result<()> {
        if let Some(f) = self.cp.check(o, n) {
            bail!(
                "emulated device: {}: this {what} at shared offset {o} (+{n}) touches bytes of the cp.async issued by thread {} at PTX line {}{}, which that thread has not yet waited for (cp.async.wait_group): the data is in flight, and a GPU would read or overwrite old or new bytes depending on timing",
                self.where_(inst, w, lane),
                f.thread,
                f.line,
                self.src_of_line(f.line)
            );
        }
        if let Some(r) = &mut self.race {
            if let Some(race) = r.access(o, n, w, write, inst.line) {
                let other = if race.other_warp == usize::MAX { "several other warps".to_string() } else { format!("warp {}", race.other_warp) };
                bail!(
                    "emulated device: {}: shared-memory race on the word at offset {}: this {what} (warp {w}) and a {} by {other} at PTX line {}{} with no barrier between them",
                    self.where_(inst, w, lane),
                    race.word * 4,
                    if race.other_write { "store" } else { "load" },
                    race.other_line,
                    self.src_of_line(race.other_line)
                );
            }
        }
        Ok(())
    }

    /// One per-lane instruction for the lanes of `exec`.
    fn exec(&mut self, w: usize, inst: &Inst, op: &Op, exec: u32, gmem: &mut GlobalMem) -> Result<()> {
        match *op {
            Op::Un { op, ty, ftz, d, a } => {
                for lane in lanes(exec) {
                    let x = self.val(w, a, lane);
                    let v = unary(op, ty, ftz, x);
                    self.set(w, d, lane, v);
                }
            }
            Op::Bin { op, ty, rnd, d, a, b } => {
                for lane in lanes(exec) {
                    let (x, y) = (self.val(w, a, lane), self.val(w, b, lane));
                    let v = binary(op, ty, rnd, x, y).ok_or_else(|| anyhow!("emulated device: {}: integer division by zero", self.where_(inst, w, lane)))?;
                    self.set(w, d, lane, v);
                }
            }
            Op::Fma { ty, rnd, d, a, b, c } => {
                for lane in lanes(exec) {
                    let (x, y, z) = (self.val(w, a, lane), self.val(w, b, lane), self.val(w, c, lane));
                    let v = match ty {
                        Ty::F32 => float::fma_f32(f32::from_bits(x as u32), f32::from_bits(y as u32), f32::from_bits(z as u32), rnd).to_bits() as u64,
                        Ty::F64 if matches!(rnd, Rnd::Rn | Rnd::Default) => f64::from_bits(x).mul_add(f64::from_bits(y), f64::from_bits(z)).to_bits(),
                        _ => bail!("emulated device: {}: fma of this type/rounding is not modelled", self.where_(inst, w, lane)),
                    };
                    self.set(w, d, lane, v);
                }
            }
            Op::Mad { ty, wide, d, a, b, c } => {
                for lane in lanes(exec) {
                    let (x, y, z) = (self.val(w, a, lane), self.val(w, b, lane), self.val(w, c, lane));
                    let v = if wide {
                        let p = binary(BinOp::MulWide, ty, Rnd::Default, x, y).unwrap();
                        p.wrapping_add(z) & mask(ty.bits() * 2)
                    } else {
                        x.wrapping_mul(y).wrapping_add(z) & mask(ty.bits())
                    };
                    self.set(w, d, lane, v);
                }
            }
            Op::Pack { bits, d, ref parts } => {
                for lane in lanes(exec) {
                    let mut v = 0u64;
                    for (i, p) in parts.iter().enumerate() {
                        v |= (self.val(w, *p, lane) & mask(bits)) << (bits * i as u32);
                    }
                    self.set(w, d, lane, v);
                }
            }
            Op::Unpack { bits, ref ds, a } => {
                for lane in lanes(exec) {
                    let v = self.val(w, a, lane);
                    for (i, d) in ds.iter().enumerate() {
                        if let Some(d) = d {
                            self.set(w, *d, lane, (v >> (bits * i as u32)) & mask(bits));
                        }
                    }
                }
            }
            Op::Setp { cmp, ty, d, d2, a, b } => {
                for lane in lanes(exec) {
                    let r = compare(cmp, ty, self.val(w, a, lane), self.val(w, b, lane));
                    self.set(w, d, lane, r as u64);
                    if let Some(d2) = d2 {
                        self.set(w, d2, lane, !r as u64);
                    }
                }
            }
            Op::Selp { ty, d, a, b, p } => {
                for lane in lanes(exec) {
                    let v = if self.val(w, p, lane) != 0 { self.val(w, a, lane) } else { self.val(w, b, lane) };
                    self.set(w, d, lane, v & mask(ty.bits()));
                }
            }
            Op::Cvt { dty, sty, rnd, sat, ftz, d, a } => {
                for lane in lanes(exec) {
                    let v = convert(dty, sty, rnd, sat, ftz, self.val(w, a, lane)).map_err(|e| anyhow!("emulated device: {}: {e}", self.where_(inst, w, lane)))?;
                    self.set(w, d, lane, v);
                }
            }
            Op::CvtBf16x2 { d, a, b } => {
                for lane in lanes(exec) {
                    let cv = |x: u64| convert(Ty::Bf16, Ty::F32, Rnd::Rn, false, false, x);
                    let (hi, lo) = (cv(self.val(w, a, lane)), cv(self.val(w, b, lane)));
                    let v = (hi.map_err(|e| anyhow!("emulated device: {}: {e}", self.where_(inst, w, lane)))? << 16) | lo.map_err(|e| anyhow!("emulated device: {}: {e}", self.where_(inst, w, lane)))?;
                    self.set(w, d, lane, v);
                }
            }
            Op::Trap => bail!("emulated device: {}: the kernel executed trap (it aborts: a device-side check failed)", self.where_(inst, w, lanes(exec).next().unwrap_or(0))),
            Op::Cvta { space, to, d, a } => {
                let win = match space {
                    Space::Shared => mem::SHARED_WINDOW,
                    Space::Local => mem::LOCAL_WINDOW,
                    _ => 0,
                };
                for lane in lanes(exec) {
                    let x = self.val(w, a, lane);
                    self.set(w, d, lane, if to { x.wrapping_sub(win) } else { x.wrapping_add(win) });
                }
            }
            Op::Bfi { ty, d, a, b, pos, len } => {
                let bits = ty.bits();
                for lane in lanes(exec) {
                    let (x, y) = (self.val(w, a, lane), self.val(w, b, lane));
                    let (p, n) = ((self.val(w, pos, lane) & 0xff) as u32, (self.val(w, len, lane) & 0xff) as u32);
                    let v = if n == 0 || p >= bits {
                        y
                    } else {
                        let n = n.min(bits - p);
                        let m = mask(n) << p;
                        (y & !m) | ((x << p) & m)
                    };
                    self.set(w, d, lane, v & mask(bits));
                }
            }
            Op::LdParam { ty, d, off } => {
                let n = ty.bytes();
                let o = off as usize;
                let Some(bytes) = self.l.params.get(o..o + n) else {
                    bail!("emulated device: {}: ld.param at offset {o} beyond the {} parameter bytes", self.where_(inst, w, 0), self.l.params.len());
                };
                let mut b8 = [0u8; 8];
                b8[..n].copy_from_slice(bytes);
                let v = u64::from_le_bytes(b8);
                for lane in lanes(exec) {
                    self.set(w, d, lane, v);
                }
            }
            Op::Ld { space, ty, ref ds, addr } => {
                let n = ty.bytes();
                for lane in lanes(exec) {
                    let a = self.addr(w, addr, lane);
                    let mut buf = [0u8; 32];
                    self.access(inst, w, lane, space, a, &mut buf[..n * ds.len()], false, gmem)?;
                    for (i, d) in ds.iter().enumerate() {
                        let mut b8 = [0u8; 8];
                        b8[..n].copy_from_slice(&buf[i * n..(i + 1) * n]);
                        let v = u64::from_le_bytes(b8);
                        let v = if ty.signed() { (sext(v, ty.bits()) as u64) & mask(ty.bits().max(32)) } else { v };
                        self.set(w, *d, lane, v);
                    }
                }
            }
            Op::St { space, ty, ref srcs, addr } => {
                let n = ty.bytes();
                for lane in lanes(exec) {
                    let a = self.addr(w, addr, lane);
                    let mut buf = [0u8; 32];
                    for (i, s) in srcs.iter().enumerate() {
                        let v = self.val(w, *s, lane);
                        buf[i * n..(i + 1) * n].copy_from_slice(&v.to_le_bytes()[..n]);
                    }
                    self.access(inst, w, lane, space, a, &mut buf[..n * srcs.len()], true, gmem)?;
                }
            }
            Op::Atom { space, op, ty, d, addr, b } => {
                let n = ty.bytes();
                // lanes in order: one legal serialization of the warp's atomics
                for lane in lanes(exec) {
                    let a = self.addr(w, addr, lane);
                    let mut buf = [0u8; 8];
                    self.access_atomic(inst, w, lane, space, a, n, gmem, &mut buf)?;
                    let old = u64::from_le_bytes(buf);
                    let x = self.val(w, b, lane) & mask(ty.bits());
                    let new = match (op, ty.signed()) {
                        (RedOp::Add, _) => old.wrapping_add(x),
                        (RedOp::Min, false) => old.min(x),
                        (RedOp::Max, false) => old.max(x),
                        (RedOp::Min, true) => (sext(old, ty.bits()).min(sext(x, ty.bits()))) as u64,
                        (RedOp::Max, true) => (sext(old, ty.bits()).max(sext(x, ty.bits()))) as u64,
                        (RedOp::And, _) => old & x,
                        (RedOp::Or, _) => old | x,
                        (RedOp::Xor, _) => old ^ x,
                        (RedOp::Popc, _) => bail!("atom.popc does not exist"),
                    } & mask(ty.bits());
                    let mut out = new.to_le_bytes();
                    self.store_raw(space, a, &mut out[..n], gmem);
                    self.set(w, d, lane, old);
                }
            }
            Op::CpAsync { dst, src, size, src_size } => {
                for lane in lanes(exec) {
                    self.cp_async_issue(inst, w, lane, dst, src, size, src_size, gmem)?;
                }
            }
            Op::CpAsyncCommit => {
                for lane in lanes(exec) {
                    self.cp.commit(w * 32 + lane);
                }
            }
            Op::CpAsyncWait { n, all } => {
                for lane in lanes(exec) {
                    self.cp_async_wait(inst, w, lane, n, all)?;
                }
            }
            _ => bail!("emulated device: {}: instruction reached the generic executor unexpectedly", self.where_(inst, w, 0)),
        }
        Ok(())
    }

    #[inline(always)]
    fn addr(&self, w: usize, a: Addr, lane: usize) -> u64 {
        self.val(w, a.base, lane).wrapping_add(a.off as u64)
    }

    /// Checked load (`write = false`: fill `buf`) or store (`write = true`: from `buf`).
    #[allow(clippy::too_many_arguments)]
    fn access(&mut self, inst: &Inst, w: usize, lane: usize, space: Space, addr: u64, buf: &mut [u8], write: bool, gmem: &mut GlobalMem) -> Result<()> {
        let n = buf.len();
        let what = if write { "store" } else { "load" };
        if !addr.is_multiple_of(n as u64) && n.is_power_of_two() {
            bail!("emulated device: {}: misaligned {n}-byte {what} at 0x{addr:x}", self.where_(inst, w, lane));
        }
        let (space, off) = match (space, mem::window(addr)) {
            (Space::Generic, Window::Shared(o)) => (Space::Shared, o),
            (Space::Generic, Window::Local(o)) => (Space::Local, o),
            (Space::Generic, Window::Global(a)) => (Space::Global, a),
            (s, _) => (s, addr),
        };
        self.pending.push(space, off, n);
        match space {
            Space::Global | Space::Const => {
                if self.l.race_check {
                    let me = self.block + 1;
                    let seen = if write { self.global_writes.insert(off, (me, inst.line)) } else { self.global_writes.get(&off).copied() };
                    if let Some((other, line)) = seen.filter(|&(b, _)| b != me) {
                        bail!(
                            "emulated device: {}: global-memory race at 0x{off:x}: this {what} and a store by block {} at PTX line {line}{} in the same launch (blocks are unordered)",
                            self.where_(inst, w, lane),
                            other - 1,
                            self.src_of_line(line)
                        );
                    }
                }
                let Some(i) = gmem.find(off, n) else {
                    bail!("emulated device: {}: out-of-bounds {n}-byte global {what} at 0x{off:x}: {}", self.where_(inst, w, lane), gmem.describe_miss(off, n));
                };
                let al = &mut gmem.allocs[i];
                let o = (off - al.base) as usize;
                if write {
                    al.data[o..o + n].copy_from_slice(buf);
                } else {
                    buf.copy_from_slice(&al.data[o..o + n]);
                }
            }
            Space::Shared => {
                let o = off as usize;
                if off as usize + n > self.shared.len() {
                    bail!(
                        "emulated device: {}: out-of-bounds {n}-byte shared {what} at offset {off} (the block has {} bytes: {} static + {} dynamic)",
                        self.where_(inst, w, lane),
                        self.shared.len(),
                        self.f.static_smem,
                        self.l.dyn_smem
                    );
                }
                self.shared_check(inst, w, lane, o, n, write, what)?;
                if write {
                    self.shared[o..o + n].copy_from_slice(buf);
                } else {
                    buf.copy_from_slice(&self.shared[o..o + n]);
                }
            }
            Space::Local => {
                let per = self.f.local_bytes;
                let o = off as usize;
                if o + n > per {
                    bail!("emulated device: {}: out-of-bounds {n}-byte local {what} at offset {off} (the thread has {per} bytes)", self.where_(inst, w, lane));
                }
                let base = (w * 32 + lane) * per + o;
                if write {
                    self.local[base..base + n].copy_from_slice(buf);
                } else {
                    buf.copy_from_slice(&self.local[base..base + n]);
                }
            }
            Space::Generic => unreachable!(),
        }
        Ok(())
    }

    /// The read half of an atomic: bounds, alignment; atomics are exempt from the race detector
    /// among themselves, but still see plain writes of other warps.
    #[allow(clippy::too_many_arguments)]
    fn access_atomic(&mut self, inst: &Inst, w: usize, lane: usize, space: Space, addr: u64, n: usize, gmem: &mut GlobalMem, buf: &mut [u8; 8]) -> Result<()> {
        let saved = self.race.take();
        let r = self.access(inst, w, lane, space, addr, &mut buf[..n], false, gmem);
        self.race = saved;
        r
    }

    fn store_raw(&mut self, space: Space, addr: u64, buf: &mut [u8], gmem: &mut GlobalMem) {
        let n = buf.len();
        let (space, off) = match (space, mem::window(addr)) {
            (Space::Generic, Window::Shared(o)) => (Space::Shared, o),
            (Space::Generic, Window::Global(a)) => (Space::Global, a),
            (s, _) => (s, addr),
        };
        match space {
            Space::Shared => self.shared[off as usize..off as usize + n].copy_from_slice(buf),
            _ => {
                if let Some(i) = gmem.find(off, n) {
                    let al = &mut gmem.allocs[i];
                    let o = (off - al.base) as usize;
                    al.data[o..o + n].copy_from_slice(buf);
                }
            }
        }
    }
}

/// Lanes of a mask, lowest first.
#[inline(always)]
fn lanes(m: u32) -> impl Iterator<Item = usize> {
    let mut m = m;
    std::iter::from_fn(move || {
        if m == 0 {
            None
        } else {
            let l = m.trailing_zeros();
            m &= m - 1;
            Some(l as usize)
        }
    })
}
