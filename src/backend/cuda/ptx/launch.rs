//! Launch validation on the emulated device: what the driver would accept or silently get wrong.
//! Every launch is checked before a single instruction runs:
//! - the arguments against the entry's `.param` list: count, each one's size, float vs integer
//!   (a swapped `float eps` / `int d` has equal sizes and would be reinterpreted bits on a GPU);
//! - the block size against `.maxntid` (the kernels' `__launch_bounds__`) and the 1024 limit;
//! - dynamic shared memory against the attribute the backend set (over 48 KiB) and sm_90's
//!   227 KiB per block, static included;
//! - every pointer argument inside a live allocation (or null).
use super::mem::GlobalMem;
use super::ir::{Func, Ty};
use crate::backend::cuda::seam::KArg;
use anyhow::{bail, Result};

/// sm_90: shared memory one block may use (static + dynamic).
pub const SM90_MAX_SMEM: usize = 227 * 1024;
/// Dynamic shared memory a launch gets without the attribute.
pub const DEFAULT_DYN_SMEM: u32 = 48 * 1024;

/// Check a launch of `f` and build its parameter buffer.
pub fn validate(f: &Func, module: &str, grid: u32, block: u32, dyn_smem: u32, max_dyn_attr: Option<u32>, args: &[KArg], gmem: &GlobalMem) -> Result<Vec<u8>> {
    let at = format!("launch of {} ({module}.ptx line {})", f.name, f.line);
    if args.len() != f.params.len() {
        bail!("{at}: {} arguments passed, the entry declares {} parameters", args.len(), f.params.len());
    }
    let mut buf = vec![0u8; f.param_bytes];
    for (i, (a, p)) in args.iter().zip(&f.params).enumerate() {
        let (bytes, n) = a.bytes();
        if n != p.ty.bytes() {
            bail!("{at}: argument {i} ({a:?}) is {n} bytes, parameter {} is .{:?} ({} bytes) — wrong order or type", p.name, p.ty, p.ty.bytes());
        }
        let float_param = p.ty == Ty::F32 || p.ty == Ty::F64;
        let float_arg = matches!(a, KArg::F32(_));
        if float_param != float_arg {
            bail!("{at}: argument {i} ({a:?}) {} a float, parameter {} is .{:?} — wrong order or type", if float_arg { "is" } else { "is not" }, p.name, p.ty);
        }
        if let KArg::Ptr(ptr) = *a {
            if ptr != 0 && gmem.find(ptr, 1).is_none() {
                bail!("{at}: pointer argument {i} (parameter {}) = 0x{ptr:x} is outside every live allocation ({})", p.name, gmem.describe_miss(ptr, 1));
            }
        }
        buf[p.offset..p.offset + n].copy_from_slice(&bytes[..n]);
    }
    if grid == 0 || block == 0 {
        bail!("{at}: empty launch (grid {grid}, block {block})");
    }
    if block > 1024 {
        bail!("{at}: block of {block} threads (at most 1024)");
    }
    if let Some(m) = f.maxntid {
        if block > m {
            bail!("{at}: block of {block} threads exceeds the kernel's .maxntid {m} (__launch_bounds__)");
        }
    }
    let allowed = max_dyn_attr.unwrap_or(DEFAULT_DYN_SMEM);
    if dyn_smem > allowed {
        bail!(
            "{at}: {dyn_smem} bytes of dynamic shared memory, {allowed} allowed ({})",
            if max_dyn_attr.is_some() { "the attribute set for this kernel" } else { "the default: set CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first" }
        );
    }
    if f.static_smem + dyn_smem as usize > SM90_MAX_SMEM {
        bail!("{at}: {} static + {dyn_smem} dynamic bytes of shared memory exceed sm_90's {SM90_MAX_SMEM} per block", f.static_smem);
    }
    if dyn_smem > 0 && f.dyn_smem_align.is_none() {
        bail!("{at}: {dyn_smem} bytes of dynamic shared memory for a kernel that declares no extern __shared__ array");
    }
    Ok(buf)
}
