//! CUDA ↔ CPU parity, one module per op family (as src/backend/cuda/<family>.rs and
//! kernels/<family>.cu): every kernel against its CPU twin on random inputs, then whole models
//! (inference in `model`, LoRA gradients and optimizer steps in `model_train`), then the whole
//! binary (`cli_e2e`: score, generate, rollout, eval and train with `--backend cuda`, on the
//! emulated device through INFOMEM_CUDA_EMULATE=1 when there is no GPU).
//! Compiled only with `--features cuda`. Without a device the tests run on the emulated device
//! (the kernels' real PTX in the interpreter, src/backend/cuda/emulated.rs, tensor cores and
//! cp.async included; the attention tests on smaller batches there); the Qwen-shaped whole-model
//! tests print "skipped on the emulated device: …" (too slow there), as does the test of opening
//! device 0 (INFOMEM_REQUIRE_CUDA=1, set by tools/gpu-check.sh, demands the real device).
//!
//! Method: inputs are rounded to bf16 before both backends see them, so the CPU twin (f32) and
//! the device compute on identical values and the bounds only have to cover what the device does
//! differently — rounding its outputs (or an internal operand) to bf16, and the order of f32
//! sums. bf16 has 8 significant bits (7 stored): rounding to nearest errs by at most 2^-8
//! relative (`BF16_ROUND`); the bounds below say where each one comes from.
#![cfg(feature = "cuda")]

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod attention;
mod attention_dense;
mod cli_e2e;
mod conformance;
mod device;
mod footprint;
mod gemm;
mod logprob;
mod memory;
mod model;
mod model_train;
mod norm;
mod optim;
mod rope;
mod sample;
mod swiglu;

pub use common::cuda::*;
pub use common::*;
pub use infomem_engine::backend::cpu::{CpuBackend, CpuBuf};
pub use infomem_engine::backend::cuda::footprint::TrainMemPlan;
pub use infomem_engine::backend::cuda::{self, CudaBackend, Dtype};
pub use infomem_engine::backend::{AdamWStep, AttnGeom, AttnSeq, Backend, DenseSeq, SampleParams, TrainBackend};
pub use infomem_engine::model::config::ModelConfig;
pub use infomem_engine::model::lora::{LoraAdapter, ALL_PROJS};
pub use infomem_engine::model::weights::{HostTensor, LayerWeights, ModelWeights};
pub use infomem_engine::rl::grpo::{self, Conversation, GrpoConfig};
pub use infomem_engine::rl::optim::{AdamW, AdamWConfig};
pub use infomem_engine::runtime::backward::{policy_grads, TrainSeq};
pub use infomem_engine::runtime::{self, Entry, GenRequest, Model, SchedOptions, ScoreRequest, Seq, Want};
pub use infomem_engine::util::rng::Rng;
pub use std::collections::BTreeMap;

/// ‖a − b‖ / ‖b‖ and the cosine of the angle between them (f64).
fn rel_and_cos(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (mut num, mut nb, mut na, mut dot) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        num += (x - y) * (x - y);
        nb += y * y;
        na += x * x;
        dot += x * y;
    }
    ((num / nb.max(1e-300)).sqrt(), dot / (na.sqrt() * nb.sqrt()).max(1e-300))
}

/// A backend a model can own: device 0, or without one a fresh emulated device.
fn own_backend() -> CudaBackend {
    if cuda::device_present() {
        CudaBackend::new(0).unwrap()
    } else {
        CudaBackend::emulated().unwrap()
    }
}

fn up(be: &CudaBackend, x: &[f32], dtype: Dtype) -> cuda::CudaBuf {
    be.upload_as(x, dtype).unwrap()
}

fn round_weights(w: &mut ModelWeights) {
    let r = |t: &mut HostTensor| t.data.iter_mut().for_each(|x| *x = bf(*x));
    r(&mut w.embed);
    r(&mut w.final_norm);
    if let Some(h) = &mut w.lm_head {
        r(h);
    }
    for l in &mut w.layers {
        for t in [&mut l.attn_norm, &mut l.qkv, &mut l.o, &mut l.mlp_norm, &mut l.gate_up, &mut l.down] {
            r(t);
        }
        if let Some(b) = &mut l.qkv_bias {
            r(b);
        }
        if let Some(b) = &mut l.o_bias {
            r(b);
        }
        if let Some((qn, kn)) = &mut l.qk_norm {
            r(qn);
            r(kn);
        }
    }
}

fn round_adapter(a: &mut LoraAdapter) {
    for pair in a.layers.iter_mut().flatten().flatten() {
        pair.a.data.iter_mut().for_each(|x| *x = bf(*x));
        pair.b.data.iter_mut().for_each(|x| *x = bf(*x));
    }
}

fn batch(lens: &[usize]) -> (Vec<DenseSeq>, usize) {
    let mut row = 0;
    let seqs = lens
        .iter()
        .map(|&len| {
            let s = DenseSeq { row0: row, len };
            row += len;
            s
        })
        .collect();
    (seqs, row)
}

fn qwen_half_b_cfg(layers: usize) -> ModelConfig {
    ModelConfig::from_json(&serde_json::json!({
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": layers,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "tie_word_embeddings": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "eos_token_id": 151645, "hidden_act": "silu"
    }))
    .unwrap()
}
