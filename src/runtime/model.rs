//! A loaded model on a backend: weights, optional LoRA adapter, tokenizer, RoPE frequencies.
use crate::backend::{AttnGeom, Backend};
use crate::model::config::ModelConfig;
use crate::model::lora::{LoraAdapter, Proj, ALL_PROJS};
use crate::model::tokenizer::TextTokenizer;
use crate::model::weights::{HostTensor, ModelWeights, SafetensorsSet};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub struct DeviceLayer<B: Backend> {
    pub attn_norm: B::Buf,
    pub qkv: B::Buf,
    pub qkv_bias: Option<B::Buf>,
    /// Qwen3's per-head q/k norm weights (`head_dim` each).
    pub qk_norm: Option<(B::Buf, B::Buf)>,
    pub o: B::Buf,
    pub o_bias: Option<B::Buf>,
    pub mlp_norm: B::Buf,
    pub gate_up: B::Buf,
    pub down: B::Buf,
}

/// A LoRA adapter resident on the backend. `host` is the master copy (training updates it and
/// re-uploads; export writes it).
pub struct DeviceLora<B: Backend> {
    pub host: LoraAdapter,
    pub scale: f32,
    /// `layers[l][proj.index()] = (A, B)`
    pub layers: Vec<[Option<(B::Buf, B::Buf)>; 7]>,
}

/// Tokens per KV-cache page (every model; the attention kernels are built for it).
pub const PAGE_SIZE: usize = 64;

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub be: B,
    pub dir: PathBuf,
    pub embed: B::Buf,
    pub layers: Vec<DeviceLayer<B>>,
    pub final_norm: B::Buf,
    pub lm_head: Option<B::Buf>,
    pub inv_freq: Vec<f32>,
    pub tokenizer: Option<TextTokenizer>,
    pub lora: Option<DeviceLora<B>>,
    /// When false the adapter is bypassed: the LoRA-off reference policy, at no memory cost.
    pub lora_enabled: bool,
    pub page_size: usize,
}

/// A frozen `[n, k]` matrix in the backend's weight dtype (norms and biases stay f32).
fn upload_matrix<B: Backend>(be: &B, t: HostTensor) -> Result<B::Buf> {
    let (n, k) = (t.shape[0], t.data.len() / t.shape[0].max(1));
    be.upload_weight(t.data, n, k)
}

impl<B: Backend> Model<B> {
    /// Load an HF model directory onto `be`.
    pub fn load(dir: &Path, be: B) -> Result<Self> {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!("model directory {} is not a directory", dir.display()),
            Err(e) if crate::util::fs::is_symlink_loop(&e) => {
                bail!("model directory {} is a symlink loop (following its symlinks never reaches a directory)", dir.display())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::read_link(dir) {
                Ok(t) => bail!("model directory {} is a broken symlink: its target {} does not exist", dir.display(), t.display()),
                Err(_) => bail!("model directory {} does not exist", dir.display()),
            },
            Err(e) => return Err(e).with_context(|| format!("cannot access model directory {}", dir.display())),
        }
        let cfg = ModelConfig::load(dir)?;
        let set = SafetensorsSet::open_dir(dir)?;
        ModelWeights::check_unused(&set, &cfg).with_context(|| format!("loading weights from {}", dir.display()))?;
        let tokenizer = TextTokenizer::load(dir, &cfg.eos_token_ids)?;
        if let Some(t) = &tokenizer {
            if t.vocab_size() > cfg.vocab {
                bail!(
                    "tokenizer.json has {} tokens but config.json says vocab_size {}: they belong to different models",
                    t.vocab_size(),
                    cfg.vocab
                );
            }
            // config.json's ids are checked with the config; these come from generation_config.json
            if let Some(bad) = t.eos_ids.iter().find(|&&id| id as usize >= cfg.vocab) {
                bail!(
                    "eos_token_id {bad} in {} is not a token id (vocab_size is {})",
                    dir.join("generation_config.json").display(),
                    cfg.vocab
                );
            }
        }
        Self::stream_weights(cfg, &set, tokenizer, be, dir).with_context(|| format!("loading weights from {}", dir.display()))
    }

    /// `from_weights` one layer at a time: each layer is read from the checkpoint, converted and
    /// uploaded before the next, and the mapped file pages are released after each, so peak
    /// memory is the model in the backend's dtype plus one layer in f32 (with bf16 weights, about
    /// half the f32 model) instead of the f32 model plus the checkpoint.
    fn stream_weights(cfg: ModelConfig, set: &SafetensorsSet, tokenizer: Option<TextTokenizer>, be: B, dir: &Path) -> Result<Self> {
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            layers.push(Self::upload_layer(&be, ModelWeights::layer(set, &cfg, l)?)?);
            set.release_pages();
        }
        let embed = upload_matrix(&be, ModelWeights::embed(set, &cfg)?)?;
        set.release_pages();
        let (final_norm, lm_head) = ModelWeights::final_norm_and_head(set, &cfg)?;
        let lm_head = lm_head.map(|t| upload_matrix(&be, t)).transpose()?;
        set.release_pages();
        let final_norm = be.upload_vec(final_norm.data)?;
        Ok(Self::assemble(cfg, embed, final_norm, lm_head, layers, tokenizer, be, dir))
    }

    fn upload_layer(be: &B, l: crate::model::weights::LayerWeights) -> Result<DeviceLayer<B>> {
        let up = |t: HostTensor| be.upload_vec(t.data);
        Ok(DeviceLayer {
            attn_norm: up(l.attn_norm)?,
            qkv: upload_matrix(be, l.qkv)?,
            qkv_bias: l.qkv_bias.map(up).transpose()?,
            qk_norm: l.qk_norm.map(|(q, k)| Ok::<_, anyhow::Error>((up(q)?, up(k)?))).transpose()?,
            o: upload_matrix(be, l.o)?,
            o_bias: l.o_bias.map(up).transpose()?,
            mlp_norm: up(l.mlp_norm)?,
            gate_up: upload_matrix(be, l.gate_up)?,
            down: upload_matrix(be, l.down)?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(cfg: ModelConfig, embed: B::Buf, final_norm: B::Buf, lm_head: Option<B::Buf>, layers: Vec<DeviceLayer<B>>, tokenizer: Option<TextTokenizer>, be: B, dir: &Path) -> Self {
        let inv_freq = cfg.rope_inv_freq().iter().map(|&f| f as f32).collect();
        Model { embed, final_norm, lm_head, layers, inv_freq, tokenizer, lora: None, lora_enabled: true, page_size: PAGE_SIZE, cfg, be, dir: dir.to_path_buf() }
    }

    pub fn from_weights(cfg: ModelConfig, w: ModelWeights, tokenizer: Option<TextTokenizer>, be: B, dir: &Path) -> Result<Self> {
        let layers = w.layers.into_iter().map(|l| Self::upload_layer(&be, l)).collect::<Result<Vec<_>>>()?;
        let embed = upload_matrix(&be, w.embed)?;
        let final_norm = be.upload_vec(w.final_norm.data)?;
        let lm_head = w.lm_head.map(|t| upload_matrix(&be, t)).transpose()?;
        Ok(Self::assemble(cfg, embed, final_norm, lm_head, layers, tokenizer, be, dir))
    }

    /// The output head (the embeddings when tied).
    pub fn head(&self) -> &B::Buf {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    pub fn geom(&self) -> AttnGeom {
        AttnGeom::new(&self.cfg, self.page_size)
    }

    /// RoPE on the q/k heads of layer `l`'s fused `qkv` rows, after Qwen3's per-head q/k norm
    /// when the layer has one (fused in one op).
    pub fn rope_layer(&self, l: usize, qkv: &mut B::Buf, positions: &[u32]) -> Result<()> {
        match &self.layers[l].qk_norm {
            Some((qn, kn)) => self.be.qk_norm_rope(qkv, qn, kn, self.cfg.rms_eps, positions, &self.inv_freq, self.geom()),
            None => self.be.rope(qkv, positions, &self.inv_freq, self.geom()),
        }
    }

    pub fn load_adapter(&mut self, dir: &Path) -> Result<()> {
        let a = LoraAdapter::load(dir, &self.cfg)?;
        self.set_adapter(a)
    }

    pub fn set_adapter(&mut self, a: LoraAdapter) -> Result<()> {
        let mut layers = Vec::with_capacity(a.layers.len());
        for row in &a.layers {
            let mut dev: [Option<(B::Buf, B::Buf)>; 7] = Default::default();
            for p in ALL_PROJS {
                if let Some(pair) = &row[p.index()] {
                    dev[p.index()] = Some((self.be.upload_param(&pair.a.data)?, self.be.upload_param(&pair.b.data)?));
                }
            }
            layers.push(dev);
        }
        self.lora = Some(DeviceLora { scale: a.scale(), host: a, layers });
        self.lora_enabled = true;
        Ok(())
    }

    /// Push the host copy of the adapter to the backend (after an optimizer step).
    pub fn sync_adapter(&mut self) -> Result<()> {
        let Some(l) = &mut self.lora else { return Ok(()) };
        for (row, dev) in l.host.layers.iter().zip(l.layers.iter_mut()) {
            for p in ALL_PROJS {
                if let (Some(pair), Some((a, b))) = (&row[p.index()], &mut dev[p.index()]) {
                    self.be.write(a, &pair.a.data)?;
                    self.be.write(b, &pair.b.data)?;
                }
            }
        }
        Ok(())
    }

    /// The active LoRA pair of (layer, proj), if any.
    pub fn lora_pair(&self, layer: usize, p: Proj) -> Option<(&B::Buf, &B::Buf, f32, usize)> {
        if !self.lora_enabled {
            return None;
        }
        let l = self.lora.as_ref()?;
        let (a, b) = l.layers[layer][p.index()].as_ref()?;
        Some((a, b, l.scale, l.host.r))
    }

    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "model {} has no tokenizer (no tokenizer.json): give token ids (--prompt-ids / --context-ids / --target-ids) instead of text",
                self.dir.display()
            )
        })
    }

    /// Ids that end generation.
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.tokenizer {
            Some(t) => t.eos_ids.clone(),
            None => self.cfg.eos_token_ids.clone(),
        }
    }
}
