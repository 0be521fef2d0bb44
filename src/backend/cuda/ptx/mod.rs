//! A PTX interpreter: the emulated device's execution engine (tests and CI only; the real
//! device never touches this). It loads the very `.ptx` text `build.rs` embeds and runs an
//! entry's CTAs on the CPU, 32-lane warps with divergence and reconvergence, every memory
//! access checked, shared-memory races detected.
//!
//! One room per idea: `ir.rs` (the decoded form), `parse.rs` (text → it), `mem.rs` (global allocations,
//! shared/local memory, the race detector), `float.rs` (rounding modes and the models of the
//! approximate instructions, with their error bounds), `exec.rs` (warps, barriers, memory
//! instructions), `alu.rs` (per-lane arithmetic), `launch.rs` (launch validation), `mma.rs`
//! (the tensor-core instruction: fragment layouts and arithmetic model), `cp_async.rs` (the
//! asynchronous copies in flight per thread), `counters.rs` (what a launch did: issues, bytes
//! per state space, coalescing, bank conflicts, flops). cuBLASLt lives in the emulated device,
//! not here.
pub mod alu;
pub mod counters;
pub mod cp_async;
pub mod exec;
pub mod float;
pub mod ir;
pub mod launch;
pub mod mem;
pub mod mma;
pub mod parse;

use anyhow::{Context, Result};
use std::collections::HashMap;

/// The loaded kernels of all modules.
pub struct Program {
    pub modules: Vec<ir::Module>,
    /// kernel name → (module index, function index)
    index: HashMap<String, (usize, usize)>,
}

impl Program {
    /// Parse every module (`(name, ptx text)`), placing their `.global` variables in `gmem`.
    pub fn load(sources: &[(&str, &str)], gmem: &mut mem::GlobalMem) -> Result<Program> {
        let mut modules = Vec::new();
        let mut index = HashMap::new();
        for (name, text) in sources {
            let mut globals = HashMap::new();
            for g in parse::module_globals(text).with_context(|| format!("{name}.ptx"))? {
                let a = gmem.alloc(g.init.len());
                gmem.slice_mut(a, g.init.len(), "global initializer")?.copy_from_slice(&g.init);
                globals.insert(g.name.clone(), a);
            }
            let m = parse::parse_module(name, text, &globals).with_context(|| format!("parsing {name}.ptx"))?;
            for (i, f) in m.funcs.iter().enumerate() {
                index.insert(f.name.clone(), (modules.len(), i));
            }
            modules.push(m);
        }
        Ok(Program { modules, index })
    }

    pub fn get(&self, name: &str) -> Option<(&ir::Module, &ir::Func)> {
        self.index.get(name).map(|&(m, f)| (&self.modules[m], &self.modules[m].funcs[f]))
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod counters_tests;
#[cfg(test)]
mod tests_mma_cp;
