//! GGUF import: turns a llama.cpp GGUF file (v2/v3) into an HF model directory (`config.json`,
//! `model.safetensors` in f32, `tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`,
//! `generation_config.json`). Nothing past the import knows about GGUF: the engine loads the
//! directory like any other HF checkpoint, through `model::config`, `model::weights` and
//! `model::tokenizer`.
//!
//! What it does, and nothing more:
//! - parses the header, every metadata value type (arrays included), the tensor infos, the
//!   alignment (`general.alignment`, default 32) and the data offset, over a memory map;
//! - dequantizes F32, F16, BF16, Q4_0, Q4_1 and Q8_0 to f32 with ggml's block layouts and ggml's
//!   own float32 arithmetic (so the result is bit-identical to `gguf-py`/transformers);
//! - maps llama.cpp tensor names to HF Llama names and undoes llama.cpp's Q/K row interleave;
//! - rebuilds a byte-level BPE `tokenizer.json` from `tokenizer.ggml.*` (model `gpt2`).
//!
//! Refused with a clear error: architectures other than `llama`, tokenizer models other than
//! `gpt2`, other ggml types (K-quants, Q5_*, I-quants, …), big-endian files, partial rotary and
//! rope scaling; an unsupported architecture or tokenizer before a single output file is written.
//! The weights are always written as f32 (no re-quantization), and GGUF is never written.
//!
//! The files, in the order the data flows:
//! - `reader.rs`: [`GgufFile`] (header, [`GgufValue`] metadata, [`GgufTensorInfo`], the memory
//!   map) and the typed metadata lookups;
//! - `dequant.rs`: [`GgmlType`] and [`dequantize`];
//! - `names.rs`: llama.cpp → HF tensor names, [`unpermute_qk_rows`], the `llama.*` hparams, the
//!   tensor shapes and `config.json` they imply;
//! - `tokenizer.rs`: `tokenizer.json` from `tokenizer.ggml.*`;
//! - `import.rs`: [`import_gguf`] and [`ImportSummary`]: validate everything, then write each file
//!   atomically, `config.json` last;
//! - `test_builders.rs` (tests only): a tiny GGUF writer and block encoders.
mod dequant;
mod import;
mod names;
mod reader;
#[cfg(test)]
mod test_builders;
mod tokenizer;

pub use dequant::{dequantize, GgmlType};
pub use import::{import_gguf, import_gguf_with, ImportSummary, SUPPORTED_ARCHS};
pub use names::unpermute_qk_rows;
pub use reader::{GgufFile, GgufTensorInfo, GgufValue};
