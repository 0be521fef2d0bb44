//! bf16 weights on the CPU: `out = x Wᵀ (+ bias)` and `dx (+)= dy W` with W stored once in bf16
//! (rounded to nearest-even from f32 at load: `half::bf16::from_f32`'s bits), activations f32,
//! rounded to bf16 on the fly, products accumulated in f32. Why: the bf16 dot-product instructions
//! issue at up to twice the f32 FMA rate (AMX tiles far more), and decode streams half the weight
//! bytes. Measurements and their history: docs/log/code-notes.md.
//!
//! The rooms: `pack` (the packed layout, made once at load, and the f32 → bf16 rounding),
//! `kernel` (which microkernel runs a product: `Kernel`, the CPU's features, the AMX tile state),
//! `gemm` (the driver: conversion of A, tasks over panels and rows, the `dy · W` repack, the LoRA
//! tails), the microkernels `amx` (`tdpbf16ps`), `avx512` (`vdpbf16ps`), `avx2` (plain FMAs on
//! widened bf16) and `portable` (f32 FMAs emulating `vdpbf16ps`: the reference), and `thin` (the
//! thin LoRA products, one side the rank r).
//!
//! **Determinism.** Every output element has its own f32 accumulator lane and is computed by the
//! same sequence of operations whatever m, its row's position, the thread count, the task split
//! and the microkernel shape (rows per strip and panels per call only choose which register
//! holds it). Per k block, from +0: for each pair in order `acc ← acc + x₂q₊₁·w₂q₊₁`, then
//! `acc ← acc + x₂q·w₂q` (fused multiply-adds rounded to nearest even, bf16 denormals read as
//! zero, denormal results flushed to signed zero: `vdpbf16ps` as the Intel SDM specifies it,
//! checked on this CPU, see `denormals_flush_like_vdpbf16ps`). Block sums are added to the output
//! in block order (the first block stores, or with `accumulate` adds to dx), then the bias. The
//! block size depends only on the reduction length. So there is one summation order for every
//! m (no small-m kernel with another), and a batch equals its rows one by one bit for bit
//! (`rows_are_batch_invariant`, 1–3 threads, every kernel). AMX's `tdpbf16ps` has its own internal
//! order and precision (its bits are not the `vdpbf16ps` order's, within the same bounds), chosen
//! per product, never per row count, so its rows are batch invariant too.
#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
mod gemm;
mod kernel;
mod pack;
mod portable;
pub(crate) mod thin;
#[cfg(test)]
mod tests;

pub use gemm::{matmul_bf16, matmul_bf16_with, matmul_dx_bf16, matmul_dx_bf16_with, swiglu_fusable};
pub(crate) use gemm::{matmul_bf16_strided, matmul_bf16_tails, matmul_dx_bf16_hooked, matmul_dx_bf16_tails, matmul_swiglu_bf16_tails, RowHook, Tail, TailU};
pub use kernel::{amx_available, auto_kernel, avx2_available, native_available, vdp_available, Kernel};
pub(crate) use kernel::Tiles;
pub use pack::{f32_to_bf16, f32_to_bf16_bits, k_block_pairs, PackedBf16, MR, NR};
