//! llama.cpp's Llama layout → HF's: tensor names (and which ones carry llama.cpp's Q/K row
//! interleave, undone by [`unpermute_qk_rows`]), the `llama.*` hyperparameters, the tensor shapes
//! they imply and the `config.json` they become.
use super::reader::{get_f64, get_str, get_usize, req_usize, GgufFile};
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Permute {
    None,
    /// Undo llama.cpp's interleave with `head_count` (Q) or `head_count_kv` (K) heads.
    Q,
    K,
}

/// Map a llama.cpp tensor name to its HF Llama name.
pub(super) fn hf_llama_name(name: &str) -> Option<(String, Permute)> {
    match name {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), Permute::None)),
        "output_norm.weight" => return Some(("model.norm.weight".into(), Permute::None)),
        "output.weight" => return Some(("lm_head.weight".into(), Permute::None)),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, suffix) = rest.split_once('.')?;
    if suffix != "weight" {
        return None;
    }
    let (hf, p) = match part {
        "attn_norm" => ("input_layernorm", Permute::None),
        "attn_q" => ("self_attn.q_proj", Permute::Q),
        "attn_k" => ("self_attn.k_proj", Permute::K),
        "attn_v" => ("self_attn.v_proj", Permute::None),
        "attn_output" => ("self_attn.o_proj", Permute::None),
        "ffn_norm" => ("post_attention_layernorm", Permute::None),
        "ffn_gate" => ("mlp.gate_proj", Permute::None),
        "ffn_up" => ("mlp.up_proj", Permute::None),
        "ffn_down" => ("mlp.down_proj", Permute::None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}.weight"), p))
}

/// Undo llama.cpp's Q/K row interleave of a row-major `[n_heads * head_dim, cols]` matrix.
///
/// llama.cpp's converter stores, within each head, HF row `a * head_dim/2 + j` at row `2j + a`
/// (it interleaves the two rotary halves). So the HF rows are the stored rows taken in the order
/// `0, 2, 4, …, 1, 3, 5, …`: `hf_row[i] = stored_row[perm[i]]`.
pub fn unpermute_qk_rows(stored: &[f32], n_heads: usize, cols: usize) -> Result<Vec<f32>> {
    if n_heads == 0 || cols == 0 || stored.len() % (n_heads * cols) != 0 {
        bail!(
            "cannot split {} values into {n_heads} heads of rows of {cols}",
            stored.len()
        );
    }
    let rows = stored.len() / cols;
    let hd = rows / n_heads;
    if hd % 2 != 0 {
        bail!("head_dim {hd} is odd; cannot undo the rotary interleave");
    }
    let half = hd / 2;
    let mut out = vec![0f32; stored.len()];
    for h in 0..n_heads {
        for i in 0..hd {
            let src = if i < half { 2 * i } else { 2 * (i - half) + 1 };
            let d = (h * hd + i) * cols;
            let s = (h * hd + src) * cols;
            out[d..d + cols].copy_from_slice(&stored[s..s + cols]);
        }
    }
    Ok(out)
}

/// The `llama.*` hyperparameters of the model, checked against what the engine supports.
pub(super) struct LlamaHparams {
    pub(super) hidden: usize,
    pub(super) layers: usize,
    pub(super) ffn: usize,
    pub(super) n_head: usize,
    pub(super) n_head_kv: usize,
    pub(super) head_dim: usize,
    pub(super) eps: f64,
    pub(super) rope_theta: f64,
    pub(super) ctx: usize,
    pub(super) vocab: usize,
}

/// Read the hparams under `{arch}.*`; `n_tokens` is the default vocabulary size.
pub(super) fn llama_hparams(g: &GgufFile, arch: &str, n_tokens: usize) -> Result<LlamaHparams> {
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = req_usize(g, &k("embedding_length"))?;
    let layers = req_usize(g, &k("block_count"))?;
    let ffn = req_usize(g, &k("feed_forward_length"))?;
    let n_head = req_usize(g, &k("attention.head_count"))?;
    let n_head_kv = get_usize(g, &k("attention.head_count_kv"))?.unwrap_or(n_head);
    if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        bail!(
            "{}: head_count {n_head} is not a positive multiple of head_count_kv {n_head_kv}",
            g.source
        );
    }
    let head_dim = match get_usize(g, &k("attention.key_length"))? {
        Some(d) => d,
        None => {
            if hidden % n_head != 0 {
                bail!(
                    "{}: embedding_length {hidden} is not divisible by head_count {n_head}",
                    g.source
                );
            }
            hidden / n_head
        }
    };
    if let Some(vd) = get_usize(g, &k("attention.value_length"))? {
        if vd != head_dim {
            bail!(
                "{}: attention.value_length {vd} differs from key_length {head_dim}: unsupported",
                g.source
            );
        }
    }
    if let Some(rd) = get_usize(g, &k("rope.dimension_count"))? {
        if rd != head_dim {
            bail!("{}: partial rotary (rope.dimension_count {rd} != head_dim {head_dim}) is not supported", g.source);
        }
    }
    if let Some(st) = get_str(g, &k("rope.scaling.type"))? {
        if st != "none" {
            bail!(
                "{}: rope scaling `{st}` is not supported (only unscaled rope)",
                g.source
            );
        }
    }
    let eps = get_f64(g, &k("attention.layer_norm_rms_epsilon"))?.ok_or_else(|| {
        anyhow!(
            "{}: required metadata `{}` is missing",
            g.source,
            k("attention.layer_norm_rms_epsilon")
        )
    })?;
    let rope_theta = get_f64(g, &k("rope.freq_base"))?.unwrap_or(10000.0);
    let ctx = get_usize(g, &k("context_length"))?.unwrap_or(2048);
    let vocab = get_usize(g, &k("vocab_size"))?.unwrap_or(n_tokens);
    Ok(LlamaHparams {
        hidden,
        layers,
        ffn,
        n_head,
        n_head_kv,
        head_dim,
        eps,
        rope_theta,
        ctx,
        vocab,
    })
}

/// The HF tensors of a Llama with these hparams and their row-major shapes, in the order the
/// importer checks them; `lm_head.weight` only when the head is not tied to the embeddings.
pub(super) fn llama_tensor_shapes(hp: &LlamaHparams, tied: bool) -> Vec<(String, Vec<usize>)> {
    let q_rows = hp.n_head * hp.head_dim;
    let kv_rows = hp.n_head_kv * hp.head_dim;
    let mut expect: Vec<(String, Vec<usize>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![hp.vocab, hp.hidden],
        ),
        ("model.norm.weight".into(), vec![hp.hidden]),
    ];
    for l in 0..hp.layers {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        expect.push((p("input_layernorm"), vec![hp.hidden]));
        expect.push((p("self_attn.q_proj"), vec![q_rows, hp.hidden]));
        expect.push((p("self_attn.k_proj"), vec![kv_rows, hp.hidden]));
        expect.push((p("self_attn.v_proj"), vec![kv_rows, hp.hidden]));
        expect.push((p("self_attn.o_proj"), vec![hp.hidden, q_rows]));
        expect.push((p("post_attention_layernorm"), vec![hp.hidden]));
        expect.push((p("mlp.gate_proj"), vec![hp.ffn, hp.hidden]));
        expect.push((p("mlp.up_proj"), vec![hp.ffn, hp.hidden]));
        expect.push((p("mlp.down_proj"), vec![hp.hidden, hp.ffn]));
    }
    if !tied {
        expect.push(("lm_head.weight".into(), vec![hp.vocab, hp.hidden]));
    }
    expect
}

/// The HF `config.json` of a Llama with these hparams (the importer adds the special token ids
/// and the model name).
pub(super) fn llama_config_json(hp: &LlamaHparams, tied: bool) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": true,
        "hidden_size": hp.hidden,
        "intermediate_size": hp.ffn,
        "num_attention_heads": hp.n_head,
        "num_key_value_heads": hp.n_head_kv,
        "head_dim": hp.head_dim,
        "num_hidden_layers": hp.layers,
        "rms_norm_eps": hp.eps,
        "rope_theta": hp.rope_theta,
        "rope_parameters": {"rope_theta": hp.rope_theta, "rope_type": "default"},
        "max_position_embeddings": hp.ctx,
        "vocab_size": hp.vocab,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
        "dtype": "float32",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py):
    /// `w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)`.
    fn llama_cpp_permute(hf: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
        let rows = hf.len() / cols;
        let hd = rows / n_head;
        let half = hd / 2;
        let mut out = vec![0f32; hf.len()];
        for hh in 0..n_head {
            for j in 0..half {
                for a in 0..2 {
                    let dst = hh * hd + 2 * j + a; // stored [h, j, a]
                    let src = hh * hd + a * half + j; // hf [h, a, j]
                    out[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_takes_evens_then_odds() {
        // 2 heads of head_dim 6, 1 column: stored row r holds value r.
        let stored: Vec<f32> = (0..12).map(|r| r as f32).collect();
        let hf = unpermute_qk_rows(&stored, 2, 1).unwrap();
        assert_eq!(hf, vec![0., 2., 4., 1., 3., 5., 6., 8., 10., 7., 9., 11.]);
        // And it inverts llama.cpp's permutation on a wider matrix.
        let orig: Vec<f32> = (0..3 * 8 * 5).map(|x| x as f32 * 0.5 - 3.0).collect();
        let st = llama_cpp_permute(&orig, 3, 5);
        assert_ne!(st, orig);
        assert_eq!(unpermute_qk_rows(&st, 3, 5).unwrap(), orig);
        assert!(unpermute_qk_rows(&stored, 4, 1).is_err()); // head_dim 3 is odd
    }
}
