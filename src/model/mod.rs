//! Everything read from or written to disk about a model: config, weights, tokenizer and chat
//! template, LoRA adapters in PEFT's format, and the GGUF importer.
pub mod config;
pub mod gguf;
pub mod lora;
pub mod tokenizer;
pub mod weights;
