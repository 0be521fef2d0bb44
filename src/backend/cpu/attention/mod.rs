//! Causal GQA attention on the CPU, both dtypes: `paged` (the paged KV cache and the attention of
//! a forward step over it: prefill and scoring chunks as GEMM tiles, decode rows straight from the
//! pages), `decode` (the decode-row kernels over f32 or bf16 pages, `KvElem`), `dense` (the
//! training forward and backward over a dense batch) and `tiled` (the many-row attention of
//! `--dtype bf16` on AMX tiles or `vdpbf16ps`, which prefill and the dense passes use where the CPU
//! has them). Measurements and their history: docs/log/code-notes.md.
pub mod decode;
pub mod dense;
mod paged;
mod tiled;

pub use decode::{decode_usable, softmax_inplace, KvElem};
pub use paged::{attention, CpuKv, KvPages};
