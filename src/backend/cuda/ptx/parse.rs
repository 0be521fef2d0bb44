//! PTX text → decoded functions: the subset nvcc 13.0 emits for `kernels/*.cu` (module
//! directives, `.entry` signatures with their `.param` lists and `.maxntid`, register / shared /
//! local declarations, `.loc` line info, labels and instructions). Every instruction is decoded
//! once into [`Inst`] (register indices, immediates, resolved addresses and branch targets) so
//! that execution never looks at a string.
//!
//! Anything outside the subset is an error naming the instruction and its PTX line — never a
//! silent skip. An entry that contains such an instruction still loads (so a module with
//! tensor-core kernels can serve its other kernels); launching it returns that error.
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;

use super::ir::*;

/// Strip a `//` comment.
fn strip(l: &str) -> &str {
    match l.find("//") {
        Some(i) => &l[..i],
        None => l,
    }
}

fn parse_int(s: &str) -> Option<i64> {
    let s = s.trim().trim_end_matches('U');
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) { u64::from_str_radix(h, 16).ok()? as i64 } else { s.parse::<u64>().ok()? as i64 };
    Some(if neg { v.wrapping_neg() } else { v })
}

/// `.b8 name[N]` / `.b8 name[N] = {..}` / `.b8 name[]` after the space keyword: (align, elem bytes, name, count, init bytes).
fn parse_var(rest: &str) -> Option<(usize, String, Option<usize>, Vec<u8>)> {
    let mut align = 1;
    let mut toks = rest.split_whitespace().peekable();
    let mut elem = 1usize;
    let mut decl = String::new();
    while let Some(t) = toks.next() {
        if t == ".align" {
            align = toks.next()?.parse().ok()?;
        } else if let Some(ty) = t.strip_prefix('.').and_then(Ty::parse) {
            elem = ty.bytes();
        } else {
            decl = std::iter::once(t).chain(toks).collect::<Vec<_>>().join(" ");
            break;
        }
    }
    let (head, init) = match decl.split_once('=') {
        Some((h, i)) => (h.trim().to_string(), Some(i.trim().trim_end_matches(';').trim().to_string())),
        None => (decl.trim().trim_end_matches(';').trim().to_string(), None),
    };
    let (name, count) = match head.split_once('[') {
        Some((n, c)) => {
            let c = c.trim_end_matches(']').trim();
            (n.trim().to_string(), if c.is_empty() { None } else { Some(c.parse::<usize>().ok()? * elem) })
        }
        None => (head.clone(), Some(elem)),
    };
    let mut bytes = Vec::new();
    if let Some(i) = init {
        for v in i.trim_start_matches('{').trim_end_matches('}').split(',') {
            let x = parse_int(v)?;
            bytes.extend_from_slice(&x.to_le_bytes()[..elem]);
        }
    }
    Some((align, name, count, bytes))
}

/// Module-level symbols an instruction may name: shared variables (offset in the CTA's shared
/// window), global variables (device address), the local depot.
pub struct Symbols<'a> {
    pub globals: &'a HashMap<String, u64>,
}

struct FnCtx<'a> {
    regs: HashMap<String, u32>,
    reg_names: Vec<String>,
    shared: HashMap<String, u64>,
    params: &'a HashMap<String, (u32, Ty)>,
    syms: &'a Symbols<'a>,
    local: HashMap<String, u64>,
}

impl FnCtx<'_> {
    fn reg(&mut self, name: &str) -> u32 {
        if let Some(&r) = self.regs.get(name) {
            return r;
        }
        let r = self.reg_names.len() as u32;
        self.reg_names.push(name.to_string());
        self.regs.insert(name.to_string(), r);
        r
    }

    fn opnd(&mut self, s: &str) -> Result<Opnd> {
        let s = s.trim();
        if let Some(r) = s.strip_prefix('%') {
            let sreg = match r {
                "tid.x" => Some(Sreg::TidX),
                "ntid.x" => Some(Sreg::NtidX),
                "ctaid.x" => Some(Sreg::CtaidX),
                "nctaid.x" => Some(Sreg::NctaidX),
                "laneid" => Some(Sreg::LaneId),
                "warpid" => Some(Sreg::WarpId),
                "tid.y" | "tid.z" | "ctaid.y" | "ctaid.z" => Some(Sreg::Zero),
                "ntid.y" | "ntid.z" | "nctaid.y" | "nctaid.z" => Some(Sreg::One),
                "dynamic_smem_size" => Some(Sreg::DynSmemSize),
                _ => None,
            };
            if let Some(sr) = sreg {
                return Ok(Opnd::Sreg(sr));
            }
            if r.contains('.') {
                bail!("special register {s} is not modelled");
            }
            return Ok(Opnd::Reg(self.reg(s)));
        }
        if let Some(h) = s.strip_prefix("0f").or_else(|| s.strip_prefix("0F")) {
            return Ok(Opnd::Imm(u32::from_str_radix(h, 16).with_context(|| format!("float literal {s}"))? as u64));
        }
        if let Some(h) = s.strip_prefix("0d").or_else(|| s.strip_prefix("0D")) {
            return Ok(Opnd::Imm(u64::from_str_radix(h, 16).with_context(|| format!("double literal {s}"))?));
        }
        if let Some(v) = parse_int(s) {
            return Ok(Opnd::Imm(v as u64));
        }
        if let Some(&a) = self.shared.get(s) {
            return Ok(Opnd::Imm(a));
        }
        if let Some(&a) = self.local.get(s) {
            return Ok(Opnd::Imm(a));
        }
        if let Some(&a) = self.syms.globals.get(s) {
            return Ok(Opnd::Imm(a));
        }
        bail!("unknown operand {s:?}")
    }

    fn dreg(&mut self, s: &str) -> Result<u32> {
        match self.opnd(s)? {
            Opnd::Reg(r) => Ok(r),
            o => bail!("destination {s:?} is not a register ({o:?})"),
        }
    }

    fn addr(&mut self, s: &str) -> Result<Addr> {
        let inner = s.trim().strip_prefix('[').and_then(|x| x.strip_suffix(']')).with_context(|| format!("address {s:?}"))?;
        let (base, off) = match inner.find(['+', '-']).filter(|&i| i > 0) {
            Some(i) => (&inner[..i], parse_int(&inner[i..].replace('+', "")).with_context(|| format!("address offset in {s:?}"))?),
            None => (inner, 0),
        };
        Ok(Addr { base: self.opnd(base)?, off })
    }
}

/// Split operands at top-level commas (not inside `{}` / `[]`).
fn split_ops(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut cur) = (0, String::new());
    for c in s.chars() {
        match c {
            '{' | '[' => {
                depth += 1;
                cur.push(c)
            }
            '}' | ']' => {
                depth -= 1;
                cur.push(c)
            }
            ',' if depth == 0 => out.push(std::mem::take(&mut cur).trim().to_string()),
            _ => cur.push(c),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

fn vec_items(s: &str) -> Option<Vec<String>> {
    s.trim().strip_prefix('{').and_then(|x| x.strip_suffix('}')).map(|x| x.split(',').map(|t| t.trim().to_string()).collect())
}

fn cmp_of(s: &str) -> Option<Cmp> {
    Some(match s {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" | "lo" => Cmp::Lt,
        "le" | "ls" => Cmp::Le,
        "gt" | "hi" => Cmp::Gt,
        "ge" | "hs" => Cmp::Ge,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

fn red_of(s: &str) -> Option<RedOp> {
    Some(match s {
        "add" => RedOp::Add,
        "min" => RedOp::Min,
        "max" => RedOp::Max,
        "and" => RedOp::And,
        "or" => RedOp::Or,
        "xor" => RedOp::Xor,
        "popc" => RedOp::Popc,
        _ => return None,
    })
}

fn space_of(s: &str) -> Option<Space> {
    Some(match s {
        "global" => Space::Global,
        "shared" => Space::Shared,
        "local" => Space::Local,
        "const" => Space::Const,
        _ => return None,
    })
}

/// Decode one instruction (`opcode` with its dotted modifiers, `args` its operand text).
fn decode(cx: &mut FnCtx, opcode: &str, args: &str, labels: &HashMap<String, u32>) -> Result<Op> {
    let parts: Vec<&str> = opcode.split('.').collect();
    let base = parts[0];
    let mods = &parts[1..];
    let has = |m: &str| mods.contains(&m);
    let tys: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
    let ty = |i: usize| tys.get(i).copied().ok_or_else(|| anyhow!("missing type"));
    let rnd = mods
        .iter()
        .find_map(|m| match *m {
            "rn" => Some(Rnd::Rn),
            "rz" => Some(Rnd::Rz),
            "rm" => Some(Rnd::Rm),
            "rp" => Some(Rnd::Rp),
            "rni" => Some(Rnd::Ri('n')),
            "rzi" => Some(Rnd::Ri('z')),
            "rmi" => Some(Rnd::Ri('m')),
            "rpi" => Some(Rnd::Ri('p')),
            _ => None,
        })
        .unwrap_or(Rnd::Default);
    let space = mods.iter().find_map(|m| space_of(m)).unwrap_or(Space::Generic);
    let ops = split_ops(args);
    let n = ops.len();
    let need = |k: usize| -> Result<()> {
        if n != k {
            bail!("expected {k} operands, found {n}");
        }
        Ok(())
    };
    // modifiers this decoder ignores because they do not change the result on one device
    let known = |extra: &[&str]| -> Result<()> {
        for m in mods {
            let ok = Ty::parse(m).is_some()
                || space_of(m).is_some()
                || matches!(*m, "rn" | "rz" | "rm" | "rp" | "rni" | "rzi" | "rmi" | "rpi" | "nc" | "uni" | "sync" | "aligned")
                || extra.contains(m);
            if !ok {
                bail!("modifier .{m} is not modelled");
            }
        }
        Ok(())
    };
    Ok(match base {
        "mov" => {
            known(&[])?;
            need(2)?;
            let t = ty(0)?;
            if let Some(items) = vec_items(&ops[1]) {
                let parts = items.iter().map(|x| cx.opnd(x)).collect::<Result<Vec<_>>>()?;
                Op::Pack { bits: t.bits() / parts.len() as u32, d: cx.dreg(&ops[0])?, parts }
            } else if let Some(items) = vec_items(&ops[0]) {
                let ds = items.iter().map(|x| if x == "_" { Ok(None) } else { cx.dreg(x).map(Some) }).collect::<Result<Vec<_>>>()?;
                Op::Unpack { bits: t.bits() / ds.len() as u32, ds, a: cx.opnd(&ops[1])? }
            } else {
                Op::Un { op: UnOp::Mov, ty: t, ftz: false, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])? }
            }
        }
        "neg" | "abs" | "not" | "sqrt" | "rcp" | "ex2" | "lg2" | "rsqrt" | "sin" | "cos" | "popc" | "clz" | "brev" => {
            known(&["approx", "ftz", "full"])?;
            need(2)?;
            let approx = has("approx");
            let op = match (base, approx) {
                ("neg", _) => UnOp::Neg,
                ("abs", _) => UnOp::Abs,
                ("not", _) => UnOp::Not,
                ("sqrt", false) => UnOp::Sqrt,
                ("rcp", false) => UnOp::Rcp,
                ("rcp", true) => UnOp::RcpApprox,
                ("ex2", true) => UnOp::Ex2Approx,
                ("lg2", true) => UnOp::Lg2Approx,
                ("rsqrt", true) => UnOp::RsqrtApprox,
                ("sin", true) => UnOp::SinApprox,
                ("cos", true) => UnOp::CosApprox,
                ("popc", _) => UnOp::Popc,
                ("clz", _) => UnOp::Clz,
                ("brev", _) => UnOp::Brev,
                _ => bail!("this form is not modelled"),
            };
            if matches!(op, UnOp::Sqrt | UnOp::Rcp) && rnd != Rnd::Rn {
                bail!("only the .rn form is modelled");
            }
            Op::Un { op, ty: ty(0)?, ftz: has("ftz"), d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])? }
        }
        "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl" | "shr" => {
            known(&["lo", "hi", "wide", "full", "ftz"])?;
            need(3)?;
            if has("ftz") || has("sat") {
                bail!("the .ftz/.sat forms are not modelled");
            }
            let op = match base {
                "add" => BinOp::Add,
                "sub" => BinOp::Sub,
                "mul" if has("wide") => BinOp::MulWide,
                "mul" if has("hi") => BinOp::MulHi,
                "mul" => BinOp::MulLo,
                "div" => BinOp::Div,
                "rem" => BinOp::Rem,
                "min" => BinOp::Min,
                "max" => BinOp::Max,
                "and" => BinOp::And,
                "or" => BinOp::Or,
                "xor" => BinOp::Xor,
                "shl" => BinOp::Shl,
                _ => BinOp::Shr,
            };
            let t = ty(0)?;
            if op == BinOp::Div && t.float() && !(rnd == Rnd::Rn || has("full")) {
                bail!("approximate float division is not modelled");
            }
            if has("full") {
                bail!("div.full is not modelled");
            }
            Op::Bin { op, ty: t, rnd, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])? }
        }
        "fma" => {
            known(&[])?;
            need(4)?;
            Op::Fma { ty: ty(0)?, rnd, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])?, c: cx.opnd(&ops[3])? }
        }
        "mad" => {
            known(&["lo", "wide"])?;
            need(4)?;
            let t = ty(0)?;
            if t.float() {
                bail!("float mad is not modelled");
            }
            Op::Mad { ty: t, wide: has("wide"), d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])?, c: cx.opnd(&ops[3])? }
        }
        "setp" => {
            need(3)?;
            let cmp = mods.iter().find_map(|m| cmp_of(m)).ok_or_else(|| anyhow!("no comparison"))?;
            if mods.iter().any(|m| matches!(*m, "and" | "or" | "xor")) {
                bail!("setp with a boolean combiner is not modelled");
            }
            let (d, d2) = match ops[0].split_once('|') {
                Some((a, b)) => (cx.dreg(a)?, Some(cx.dreg(b)?)),
                None => (cx.dreg(&ops[0])?, None),
            };
            Op::Setp { cmp, ty: ty(0)?, d, d2, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])? }
        }
        "selp" => {
            known(&[])?;
            need(4)?;
            Op::Selp { ty: ty(0)?, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])?, p: cx.opnd(&ops[3])? }
        }
        "cvt" if has("bf16x2") => {
            if opcode != "cvt.rn.bf16x2.f32" {
                bail!("only cvt.rn.bf16x2.f32 of the packed conversions is modelled");
            }
            need(3)?;
            Op::CvtBf16x2 { d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])? }
        }
        "cvt" => {
            known(&["sat", "ftz"])?;
            need(2)?;
            Op::Cvt { dty: ty(0)?, sty: ty(1)?, rnd, sat: has("sat"), ftz: has("ftz"), d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])? }
        }
        "cvta" => {
            known(&["to"])?;
            need(2)?;
            Op::Cvta { space, to: has("to"), d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])? }
        }
        "bfi" => {
            known(&[])?;
            need(5)?;
            Op::Bfi { ty: ty(0)?, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])?, pos: cx.opnd(&ops[3])?, len: cx.opnd(&ops[4])? }
        }
        "ld" | "st" => {
            known(&["v2", "v4", "param"])?;
            if has("volatile") || has("relaxed") || has("acquire") {
                bail!("memory-order qualifiers are not modelled");
            }
            need(2)?;
            let t = ty(0)?;
            if base == "ld" && mods.first() == Some(&"param") {
                let d = cx.dreg(&ops[0])?;
                let name = ops[1].trim().trim_start_matches('[').trim_end_matches(']');
                let (pname, off) = match name.split_once('+') {
                    Some((p, o)) => (p.trim(), parse_int(o).unwrap_or(0)),
                    None => (name, 0),
                };
                let &(poff, _) = cx.params.get(pname).ok_or_else(|| anyhow!("unknown parameter {pname}"))?;
                return Ok(Op::LdParam { ty: t, d, off: poff + off as u32 });
            }
            if mods.first() == Some(&"param") {
                bail!("st.param is not modelled (no device functions)");
            }
            if base == "ld" {
                let ds = match vec_items(&ops[0]) {
                    Some(items) => items.iter().map(|x| cx.dreg(x)).collect::<Result<Vec<_>>>()?,
                    None => vec![cx.dreg(&ops[0])?],
                };
                Op::Ld { space, ty: t, ds, addr: cx.addr(&ops[1])? }
            } else {
                let srcs = match vec_items(&ops[1]) {
                    Some(items) => items.iter().map(|x| cx.opnd(x)).collect::<Result<Vec<_>>>()?,
                    None => vec![cx.opnd(&ops[1])?],
                };
                Op::St { space, ty: t, srcs, addr: cx.addr(&ops[0])? }
            }
        }
        "atom" => {
            known(&["add", "min", "max", "and", "or", "xor"])?;
            need(3)?;
            let op = mods.iter().find_map(|m| red_of(m)).ok_or_else(|| anyhow!("no atomic operation"))?;
            Op::Atom { space, op, ty: ty(0)?, d: cx.dreg(&ops[0])?, addr: cx.addr(&ops[1])?, b: cx.opnd(&ops[2])? }
        }
        "bra" => {
            known(&[])?;
            need(1)?;
            let target = *labels.get(ops[0].trim()).ok_or_else(|| anyhow!("unknown label {}", ops[0]))?;
            Op::Bra { target, uni: has("uni") }
        }
        "ret" | "exit" => Op::Ret,
        "trap" => Op::Trap,
        "bar" | "barrier" => {
            if has("arrive") {
                bail!("bar.arrive is not modelled");
            }
            if has("red") {
                known(&["red", "or", "and", "popc"])?;
                need(3)?;
                let op = mods.iter().find_map(|m| red_of(m)).ok_or_else(|| anyhow!("no reduction"))?;
                let (neg, p) = match ops[2].trim().strip_prefix('!') {
                    Some(p) => (true, p.to_string()),
                    None => (false, ops[2].clone()),
                };
                Op::BarRed { op, d: cx.dreg(&ops[0])?, p: cx.opnd(&p)?, neg }
            } else {
                known(&[])?;
                if n != 1 {
                    bail!("bar.sync with a thread count is not modelled");
                }
                Op::BarSync { id: cx.opnd(&ops[0])? }
            }
        }
        "shfl" => {
            known(&["bfly", "up", "down", "idx"])?;
            need(5)?;
            let mode = if has("bfly") {
                ShflMode::Bfly
            } else if has("up") {
                ShflMode::Up
            } else if has("down") {
                ShflMode::Down
            } else {
                ShflMode::Idx
            };
            let (d, dp) = match ops[0].split_once('|') {
                Some((a, b)) => (cx.dreg(a)?, Some(cx.dreg(b)?)),
                None => (cx.dreg(&ops[0])?, None),
            };
            Op::Shfl { mode, d, dp, a: cx.opnd(&ops[1])?, b: cx.opnd(&ops[2])?, c: cx.opnd(&ops[3])?, mask: cx.opnd(&ops[4])? }
        }
        "redux" => {
            known(&["add", "min", "max", "and", "or", "xor"])?;
            need(3)?;
            let op = mods.iter().find_map(|m| red_of(m)).ok_or_else(|| anyhow!("no reduction"))?;
            Op::Redux { op, ty: ty(0)?, d: cx.dreg(&ops[0])?, a: cx.opnd(&ops[1])?, mask: cx.opnd(&ops[2])? }
        }
        "mma" => {
            // one shape and type combination: the attention kernels' (kernels/mma.cuh)
            if opcode != "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" {
                bail!("only mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 is modelled");
            }
            need(4)?;
            let regs = |s: &str, k: usize, cx: &mut FnCtx| -> Result<Vec<Opnd>> {
                let items = vec_items(s).ok_or_else(|| anyhow!("expected a vector operand, found {s:?}"))?;
                if items.len() != k {
                    bail!("expected {k} registers in {s:?}");
                }
                items.iter().map(|x| cx.opnd(x)).collect()
            };
            let d = vec_items(&ops[0]).filter(|v| v.len() == 4).ok_or_else(|| anyhow!("expected 4 destination registers"))?;
            let d = [cx.dreg(&d[0])?, cx.dreg(&d[1])?, cx.dreg(&d[2])?, cx.dreg(&d[3])?];
            let (a, b, c) = (regs(&ops[1], 4, cx)?, regs(&ops[2], 2, cx)?, regs(&ops[3], 4, cx)?);
            Op::Mma { d, a: [a[0], a[1], a[2], a[3]], b: [b[0], b[1]], c: [c[0], c[1], c[2], c[3]] }
        }
        "cp" => match mods {
            ["async", "commit_group"] => {
                need(0)?;
                Op::CpAsyncCommit
            }
            ["async", "wait_group"] => {
                need(1)?;
                let n = parse_int(&ops[0]).filter(|&n| (0..=u32::MAX as i64).contains(&n)).ok_or_else(|| anyhow!("wait_group needs an immediate count"))?;
                Op::CpAsyncWait { n: n as u32, all: false }
            }
            ["async", "wait_all"] => {
                need(0)?;
                Op::CpAsyncWait { n: 0, all: true }
            }
            ["async", level @ ("ca" | "cg"), "shared" | "shared::cta", "global"] => {
                if n != 3 && n != 4 {
                    bail!("expected [dst], [src], cp-size{{, src-size}} (cache hints and ignore-src are not modelled)");
                }
                let size = parse_int(&ops[2]).ok_or_else(|| anyhow!("cp-size must be an immediate"))?;
                if !matches!(size, 4 | 8 | 16) || (*level == "cg" && size != 16) {
                    bail!("cp-size {size} is not valid for cp.async.{level} (ca: 4, 8, 16; cg: 16)");
                }
                let src_size = if n == 4 { Some(cx.opnd(&ops[3])?) } else { None };
                Op::CpAsync { dst: cx.addr(&ops[0])?, src: cx.addr(&ops[1])?, size: size as u32, src_size }
            }
            _ => bail!("this cp form is not modelled (only cp.async.{{ca,cg}}.shared.global, commit_group, wait_group, wait_all)"),
        },
        _ => bail!("instruction is not modelled by the emulator"),
    })
}

/// Parse one module's PTX text. `globals` gives the device address of each module-level
/// `.global` variable (allocated by the caller from [`module_globals`]).
pub fn parse_module(name: &str, text: &str, globals: &HashMap<String, u64>) -> Result<Module> {
    let lines: Vec<&str> = text.lines().collect();
    let mut m = Module { name: name.to_string(), funcs: Vec::new(), globals: module_globals(text)?, files: HashMap::new() };
    let syms = Symbols { globals };
    // module-level shared variables (visible to every function), in declaration order
    let mut mod_shared: Vec<(String, usize, usize)> = Vec::new();
    let mut mod_extern_align: Option<(String, usize)> = None;
    let mut i = 0;
    let mut brace_depth = 0i32;
    while i < lines.len() {
        let l = strip(lines[i]).trim();
        if let Some(rest) = l.strip_prefix(".file") {
            let mut it = rest.trim().splitn(2, ' ');
            if let (Some(idx), Some(path)) = (it.next().and_then(|x| x.parse::<u32>().ok()), it.next()) {
                let path = path.split('"').nth(1).unwrap_or(path).to_string();
                let short = path.find("kernels/").map(|k| path[k..].to_string()).unwrap_or(path);
                m.files.insert(idx, short);
            }
        }
        if brace_depth == 0 && (l.starts_with(".shared") || l.starts_with(".extern .shared")) {
            let is_extern = l.starts_with(".extern");
            let rest = l.trim_start_matches(".extern").trim().trim_start_matches(".shared");
            let (align, vname, size, _) = parse_var(rest).with_context(|| format!("PTX line {}: {l}", i + 1))?;
            match (is_extern, size) {
                (true, _) | (false, None) => mod_extern_align = Some((vname, align)),
                (false, Some(s)) => mod_shared.push((vname, align, s)),
            }
        }
        if l.contains(".entry ") {
            let (f, next) = parse_entry(&lines, i, &syms, &mod_shared, &mod_extern_align)?;
            m.funcs.push(f);
            i = next;
            continue;
        }
        if l.contains(".func ") {
            bail!("{name}.ptx line {}: device functions (.func) are not modelled: {l}", i + 1);
        }
        brace_depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
        i += 1;
    }
    Ok(m)
}

/// The module-level `.global` variables and their initial bytes.
pub fn module_globals(text: &str) -> Result<Vec<GlobalVar>> {
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let l = strip(l).trim();
        for prefix in [".global", ".visible .global", ".const"] {
            if let Some(rest) = l.strip_prefix(prefix).filter(|r| r.starts_with(' ')) {
                let (align, name, size, mut init) = parse_var(rest).with_context(|| format!("PTX line {}: {l}", i + 1))?;
                let size = size.with_context(|| format!("PTX line {}: a global of unknown size", i + 1))?;
                init.resize(size, 0);
                out.push(GlobalVar { name, align, init });
            }
        }
    }
    Ok(out)
}

fn parse_entry(lines: &[&str], start: usize, syms: &Symbols, mod_shared: &[(String, usize, usize)], mod_extern: &Option<(String, usize)>) -> Result<(Func, usize)> {
    // the signature, from `.entry name(` to its `)`, on one line or many
    let mut sig = String::new();
    let mut i = start;
    while i < lines.len() {
        sig.push_str(strip(lines[i]));
        sig.push(' ');
        i += 1;
        if sig.contains(')') {
            break;
        }
    }
    let after = sig.split(".entry").nth(1).unwrap_or("");
    let (name, rest) = after.split_once('(').with_context(|| format!("PTX line {}: entry without a parameter list", start + 1))?;
    let name = name.trim().to_string();
    let plist = rest.split(')').next().unwrap_or("");
    let mut f = Func {
        name: name.clone(),
        line: start as u32 + 1,
        params: Vec::new(),
        param_bytes: 0,
        maxntid: None,
        insts: Vec::new(),
        n_regs: 0,
        reg_names: Vec::new(),
        static_smem: 0,
        dyn_smem_align: None,
        local_bytes: 0,
        unsupported: None,
    };
    for decl in plist.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let rest = decl.strip_prefix(".param").with_context(|| format!("PTX line {}: parameter {decl:?}", start + 1))?;
        let toks: Vec<&str> = rest.split_whitespace().collect();
        let ty = toks.first().and_then(|t| t.strip_prefix('.')).and_then(Ty::parse).with_context(|| format!("PTX line {}: parameter type in {decl:?}", start + 1))?;
        if toks.iter().any(|t| t.contains('[')) {
            bail!("PTX line {}: array parameters are not modelled: {decl}", start + 1);
        }
        let pname = toks.last().unwrap().to_string();
        let off = f.param_bytes.next_multiple_of(ty.bytes());
        f.params.push(Param { name: pname, ty, offset: off, ptr: toks.contains(&".ptr") });
        f.param_bytes = off + ty.bytes();
    }
    // directives up to the body's '{'
    while i < lines.len() {
        let l = strip(lines[i]).trim();
        i += 1;
        if let Some(rest) = l.strip_prefix(".maxntid") {
            let x: u32 = rest.split(',').next().unwrap_or("").trim().parse().with_context(|| format!("PTX line {i}: .maxntid"))?;
            f.maxntid = Some(x);
        }
        if l == "{" {
            break;
        }
    }
    let body_start = i;
    // pass 1: body extent, labels (instruction index), declarations
    let mut shared: HashMap<String, u64> = HashMap::new();
    let mut smem = 0usize;
    for (vname, align, size) in mod_shared {
        smem = smem.next_multiple_of(*align);
        shared.insert(vname.clone(), smem as u64);
        smem += size;
    }
    let mut local: HashMap<String, u64> = HashMap::new();
    let mut labels: HashMap<String, u32> = HashMap::new();
    let mut stmts: Vec<(u32, String)> = Vec::new(); // (line, statement)
    let mut n_insts = 0u32;
    let mut depth = 1;
    let mut extern_align = mod_extern.as_ref().map(|(_, a)| *a);
    let mut extern_name = mod_extern.as_ref().map(|(n, _)| n.clone());
    let mut end = lines.len();
    let mut j = body_start;
    while j < lines.len() {
        let raw = strip(lines[j]).trim();
        let line = j as u32 + 1;
        j += 1;
        if raw.is_empty() {
            continue;
        }
        // braces of the body and of inline-asm scopes; statements in between
        let opens = raw.matches('{').count() as i32;
        let closes = raw.matches('}').count() as i32;
        let is_vec_operand = raw.contains("{%") || raw.contains(", {") || raw.contains("{_");
        if !is_vec_operand {
            depth += opens - closes;
        }
        if depth <= 0 {
            end = j;
            break;
        }
        let body = if is_vec_operand { raw.to_string() } else { raw.replace(['{', '}'], " ") };
        let body = body.trim();
        if body.is_empty() {
            continue;
        }
        if let Some(lbl) = body.strip_suffix(':') {
            labels.insert(lbl.trim().to_string(), n_insts);
            continue;
        }
        for st in body.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            if st.starts_with(".reg") || st.starts_with(".pragma") {
                continue;
            }
            if let Some(rest) = st.strip_prefix(".shared") {
                let (align, vname, size, _) = parse_var(rest).with_context(|| format!("PTX line {line}: {st}"))?;
                match size {
                    Some(s) => {
                        smem = smem.next_multiple_of(align);
                        shared.insert(vname, smem as u64);
                        smem += s;
                    }
                    None => {
                        extern_align = Some(align);
                        extern_name = Some(vname);
                    }
                }
                continue;
            }
            if let Some(rest) = st.strip_prefix(".local") {
                let (align, vname, size, _) = parse_var(rest).with_context(|| format!("PTX line {line}: {st}"))?;
                f.local_bytes = f.local_bytes.next_multiple_of(align);
                local.insert(vname, f.local_bytes as u64);
                f.local_bytes += size.unwrap_or(0);
                continue;
            }
            if !st.starts_with('.') {
                n_insts += 1;
            }
            stmts.push((line, st.to_string()));
        }
    }
    // the dynamic window follows the static variables
    if let (Some(a), Some(n)) = (extern_align, extern_name) {
        smem = smem.next_multiple_of(a.max(16));
        shared.insert(n, smem as u64);
        f.dyn_smem_align = Some(a);
    }
    f.static_smem = smem;
    let params: HashMap<String, (u32, Ty)> = f.params.iter().map(|p| (p.name.clone(), (p.offset as u32, p.ty))).collect();
    let mut cx = FnCtx { regs: HashMap::new(), reg_names: Vec::new(), shared, params: &params, syms, local };
    // pass 2: decode
    let mut loc = (0u32, 0u32);
    for (line, st) in &stmts {
        if let Some(rest) = st.strip_prefix(".loc") {
            let v: Vec<u32> = rest.split(',').next().unwrap_or("").split_whitespace().filter_map(|x| x.parse().ok()).collect();
            if v.len() >= 2 {
                loc = (v[0], v[1]);
            }
            continue;
        }
        if st.starts_with('.') {
            continue; // other directives inside a body (.section etc. do not occur)
        }
        let (guard, text) = match st.strip_prefix('@') {
            Some(r) => {
                let (p, rest) = r.split_once(char::is_whitespace).with_context(|| format!("PTX line {line}: guard without instruction"))?;
                let (neg, p) = match p.strip_prefix('!') {
                    Some(p) => (true, p),
                    None => (false, p),
                };
                (Some((cx.reg(p), neg)), rest.trim())
            }
            None => (None, st.as_str()),
        };
        let (opcode, args) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
        match decode(&mut cx, opcode, args.trim(), &labels) {
            Ok(op) => f.insts.push(Inst { op, guard, line: *line, loc }),
            Err(e) => {
                if f.unsupported.is_none() {
                    f.unsupported = Some(format!("PTX line {line}: `{text}`: {e}"));
                }
                // keep instruction indices aligned with the labels
                f.insts.push(Inst { op: Op::Ret, guard, line: *line, loc });
            }
        }
    }
    f.n_regs = cx.reg_names.len();
    f.reg_names = cx.reg_names;
    Ok((f, end))
}
