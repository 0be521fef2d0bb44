//! The decoded form of PTX: types, operands, instructions, functions and modules as `parse.rs`
//! produces them and `exec.rs` runs them — no strings left except names for messages.
//! Tensor cores (`Mma`) and asynchronous copies (`CpAsync*`) are `Op` variants like the rest.
use std::collections::HashMap;
/// Register / operand types. Registers hold their bits zero-extended in a u64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    Pred,
    B8,
    B16,
    B32,
    B64,
    U8,
    U16,
    U32,
    U64,
    S8,
    S16,
    S32,
    S64,
    F16,
    Bf16,
    F32,
    F64,
}

impl Ty {
    pub(super) fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "pred" => Ty::Pred,
            "b8" => Ty::B8,
            "b16" => Ty::B16,
            "b32" => Ty::B32,
            "b64" => Ty::B64,
            "u8" => Ty::U8,
            "u16" => Ty::U16,
            "u32" => Ty::U32,
            "u64" => Ty::U64,
            "s8" => Ty::S8,
            "s16" => Ty::S16,
            "s32" => Ty::S32,
            "s64" => Ty::S64,
            "f16" => Ty::F16,
            "bf16" => Ty::Bf16,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            _ => return None,
        })
    }
    /// Size in bytes (a predicate counts as 1).
    pub fn bytes(self) -> usize {
        match self {
            Ty::Pred | Ty::B8 | Ty::U8 | Ty::S8 => 1,
            Ty::B16 | Ty::U16 | Ty::S16 | Ty::F16 | Ty::Bf16 => 2,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 => 4,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 8,
        }
    }
    pub fn bits(self) -> u32 {
        self.bytes() as u32 * 8
    }
    pub fn signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }
    pub fn float(self) -> bool {
        matches!(self, Ty::F16 | Ty::Bf16 | Ty::F32 | Ty::F64)
    }
}

/// Special registers (only `.x` is used by the kernels; y/z read as 0 / extent 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sreg {
    TidX,
    NtidX,
    CtaidX,
    NctaidX,
    LaneId,
    WarpId,
    Zero,
    One,
    DynSmemSize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Opnd {
    Reg(u32),
    Imm(u64),
    Sreg(Sreg),
}

/// A memory operand: `[base + off]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Addr {
    pub base: Opnd,
    pub off: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    Global,
    Shared,
    Local,
    Const,
    /// No state space named: a generic address (windows in `mem.rs`).
    Generic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rnd {
    /// No modifier (float ops: round to nearest, but ptxas may contract mul+add).
    Default,
    Rn,
    Rz,
    Rm,
    Rp,
    /// Integer rounding of a float→int / float→float conversion (rni, rzi, rmi, rpi).
    Ri(char),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinOp {
    Add,
    Sub,
    MulLo,
    MulHi,
    MulWide,
    Div,
    Rem,
    Min,
    Max,
    And,
    Or,
    Xor,
    Shl,
    Shr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnOp {
    Mov,
    Neg,
    Abs,
    Not,
    Sqrt,
    Rcp,
    RcpApprox,
    Ex2Approx,
    Lg2Approx,
    RsqrtApprox,
    SinApprox,
    CosApprox,
    Popc,
    Clz,
    Brev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Equ,
    Neu,
    Ltu,
    Leu,
    Gtu,
    Geu,
    Num,
    Nan,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedOp {
    Add,
    Min,
    Max,
    And,
    Or,
    Xor,
    Popc,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShflMode {
    Bfly,
    Up,
    Down,
    Idx,
}

/// A decoded instruction. Warp-collective ones (`Shfl`, `Redux`, `Mma`) get the whole warp.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    Un { op: UnOp, ty: Ty, ftz: bool, d: u32, a: Opnd },
    Bin { op: BinOp, ty: Ty, rnd: Rnd, d: u32, a: Opnd, b: Opnd },
    /// `fma` (fused, one rounding) and integer `mad.lo` / `mad.wide`.
    Fma { ty: Ty, rnd: Rnd, d: u32, a: Opnd, b: Opnd, c: Opnd },
    Mad { ty: Ty, wide: bool, d: u32, a: Opnd, b: Opnd, c: Opnd },
    /// `mov.b64 d, {a, b}`: parts low first, `bits` each.
    Pack { bits: u32, d: u32, parts: Vec<Opnd> },
    /// `mov.b64 {a, b}, s` (None = `_`).
    Unpack { bits: u32, ds: Vec<Option<u32>>, a: Opnd },
    Setp { cmp: Cmp, ty: Ty, d: u32, d2: Option<u32>, a: Opnd, b: Opnd },
    Selp { ty: Ty, d: u32, a: Opnd, b: Opnd, p: Opnd },
    /// Predicate logic (`and.pred` etc. are `Bin` on Pred).
    Cvt { dty: Ty, sty: Ty, rnd: Rnd, sat: bool, ftz: bool, d: u32, a: Opnd },
    /// `cvt.rn.bf16x2.f32 d, a, b`: both rounded to bf16, `a` in the upper half (PTX ISA).
    CvtBf16x2 { d: u32, a: Opnd, b: Opnd },
    /// `trap`: the kernel aborts (an error naming its line).
    Trap,
    /// `cvta.shared.u64` (to generic: +window) / `cvta.to.shared.u64` (−window); global is the identity.
    Cvta { space: Space, to: bool, d: u32, a: Opnd },
    Bfi { ty: Ty, d: u32, a: Opnd, b: Opnd, pos: Opnd, len: Opnd },
    Ld { space: Space, ty: Ty, ds: Vec<u32>, addr: Addr },
    St { space: Space, ty: Ty, srcs: Vec<Opnd>, addr: Addr },
    LdParam { ty: Ty, d: u32, off: u32 },
    Atom { space: Space, op: RedOp, ty: Ty, d: u32, addr: Addr, b: Opnd },
    Bra { target: u32, uni: bool },
    Ret,
    BarSync { id: Opnd },
    BarRed { op: RedOp, d: u32, p: Opnd, neg: bool },
    Shfl { mode: ShflMode, d: u32, dp: Option<u32>, a: Opnd, b: Opnd, c: Opnd, mask: Opnd },
    Redux { op: RedOp, ty: Ty, d: u32, a: Opnd, mask: Opnd },
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}`
    /// (the only shape and types modelled; semantics in `mma.rs`).
    Mma { d: [u32; 4], a: [Opnd; 4], b: [Opnd; 2], c: [Opnd; 4] },
    /// `cp.async.{ca,cg}.shared.global [dst], [src], size{, src_size}`: `size` bytes to shared
    /// memory, of which the first `src_size` (default `size`) come from global, the rest zero.
    CpAsync { dst: Addr, src: Addr, size: u32, src_size: Option<Opnd> },
    /// `cp.async.commit_group`.
    CpAsyncCommit,
    /// `cp.async.wait_group n` (`all`: `cp.async.wait_all`, i.e. commit then wait for 0).
    CpAsyncWait { n: u32, all: bool },
}

#[derive(Clone, Debug)]
pub struct Inst {
    pub op: Op,
    /// `@p` / `@!p`: (predicate register, negated).
    pub guard: Option<(u32, bool)>,
    /// 1-based line in the PTX text.
    pub line: u32,
    /// The `.loc` in force: (file index, source line).
    pub loc: (u32, u32),
}

#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub ty: Ty,
    pub offset: usize,
    /// `.ptr` annotation (nvcc adds it for pointer parameters it can prove global).
    pub ptr: bool,
}

#[derive(Clone, Debug)]
pub struct Func {
    pub name: String,
    pub line: u32,
    pub params: Vec<Param>,
    pub param_bytes: usize,
    pub maxntid: Option<u32>,
    pub insts: Vec<Inst>,
    pub n_regs: usize,
    pub reg_names: Vec<String>,
    pub static_smem: usize,
    /// Alignment of the dynamic shared window (the `extern .shared` array), if declared.
    pub dyn_smem_align: Option<usize>,
    pub local_bytes: usize,
    /// Why this entry cannot run (an instruction outside the subset), with its PTX line.
    pub unsupported: Option<String>,
}

impl Func {
    /// Float `add`/`sub`/`mul` without a rounding modifier: ptxas may still fuse such a pair
    /// into an FMA (the PTX ISA allows it), so the emulator's separately rounded result is then
    /// not guaranteed to be the GPU's. `.rn` forms and `fma` are fixed by the PTX itself.
    pub fn contractible_ops(&self) -> usize {
        self.insts.iter().filter(|i| matches!(i.op, Op::Bin { op: BinOp::Add | BinOp::Sub | BinOp::MulLo, ty: Ty::F32 | Ty::F64, rnd: Rnd::Default, .. })).count()
    }
    /// `fma.rn.f32` instructions (contractions nvcc made, or explicit `fmaf`).
    pub fn f32_fmas(&self) -> usize {
        self.insts.iter().filter(|i| matches!(i.op, Op::Fma { ty: Ty::F32, .. })).count()
    }
}

#[derive(Clone, Debug)]
pub struct GlobalVar {
    pub name: String,
    pub align: usize,
    pub init: Vec<u8>,
}

#[derive(Clone, Debug)]
pub struct Module {
    pub name: String,
    pub funcs: Vec<Func>,
    pub globals: Vec<GlobalVar>,
    pub files: HashMap<u32, String>,
}

