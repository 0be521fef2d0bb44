//! Causal GQA attention over the paged KV cache on the CPU, both dtypes (the training attention over
//! a dense batch is its sibling `attention_dense.rs`): `attention/paged.rs` (the cache, and the
//! attention of a forward step over it: prefill and scoring chunks as GEMM tiles, decode rows
//! straight from the pages), `attention/decode.rs` (the decode-row kernels over f32 or bf16 pages,
//! `KvElem`) and `attention/tiled.rs` (the many-row attention of `--dtype bf16` on AMX tiles or
//! `vdpbf16ps`, which prefill and the dense passes use where the CPU has them). Measurements and
//! their history: docs/log/code-notes.md.
pub mod decode;
pub(crate) mod paged;
pub(crate) mod tiled;

pub use decode::{decode_usable, softmax_inplace, KvElem};
pub use paged::{attention, CpuKv, KvPages};
