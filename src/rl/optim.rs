//! AdamW on the LoRA adapter, with global gradient-norm clipping (PyTorch's
//! `clip_grad_norm_` + `torch.optim.AdamW`). The update runs on the backend's parameter buffers;
//! the adapter's host copy (the master for export and checkpoints) is refreshed afterwards.
use crate::backend::{AdamWStep, TrainBackend};
use crate::backend::Backend;
use crate::model::lora::ALL_PROJS;
use crate::runtime::backward::LoraGrads;
use crate::runtime::Model;
use crate::model::weights::{HostTensor, SafetensorsSet};
use anyhow::{ensure, Context, Result};
use std::collections::BTreeMap;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-5, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, max_grad_norm: Some(1.0) }
    }
}

/// Optimizer state: first and second moments shaped like the adapter, and the step count.
pub struct AdamW<B: Backend> {
    pub cfg: AdamWConfig,
    pub step: u64,
    /// `moments[l][proj] = (m_A, v_A, m_B, v_B)`
    moments: Vec<[Option<[B::Buf; 4]>; 7]>,
}

impl<B: TrainBackend> AdamW<B> {
    pub fn new(model: &Model<B>, cfg: AdamWConfig) -> Result<Self> {
        let lora = model.lora.as_ref().context("AdamW: the model has no LoRA adapter")?;
        let mut moments = Vec::with_capacity(lora.host.layers.len());
        for row in &lora.host.layers {
            let mut mrow: [Option<[B::Buf; 4]>; 7] = Default::default();
            for p in ALL_PROJS {
                if let Some(pair) = &row[p.index()] {
                    let (na, nb) = (pair.a.data.len(), pair.b.data.len());
                    let be = &model.be;
                    mrow[p.index()] = Some([be.zeros(na)?, be.zeros(na)?, be.zeros(nb)?, be.zeros(nb)?]);
                }
            }
            moments.push(mrow);
        }
        Ok(AdamW { cfg, step: 0, moments })
    }

    /// Clip, update every LoRA tensor, refresh the host copy. Returns the global gradient norm
    /// before clipping.
    pub fn step(&mut self, model: &mut Model<B>, grads: &LoraGrads<B>) -> Result<f64> {
        let norm = grads.sum_squares(&model.be)?.sqrt();
        ensure!(norm.is_finite(), "AdamW: the gradient norm is {norm}; refusing to update");
        let scale = match self.cfg.max_grad_norm {
            Some(maxn) => ((maxn as f64) / (norm + 1e-6)).min(1.0) as f32,
            None => 1.0,
        };
        self.step += 1;
        let h = AdamWStep {
            lr: self.cfg.lr,
            beta1: self.cfg.beta1,
            beta2: self.cfg.beta2,
            eps: self.cfg.eps,
            weight_decay: self.cfg.weight_decay,
            step: self.step,
            grad_scale: scale,
        };
        let be = &model.be;
        let lora = model.lora.as_mut().context("AdamW: the model has no LoRA adapter")?;
        for (l, (dev, host)) in lora.layers.iter_mut().zip(lora.host.layers.iter_mut()).enumerate() {
            for p in ALL_PROJS {
                let i = p.index();
                let (Some((a, b)), Some(pair)) = (dev[i].as_mut(), host[i].as_mut()) else { continue };
                let (Some((ga, gb)), Some([ma, va, mb, vb])) = (grads.layers[l][i].as_ref(), self.moments[l][i].as_mut()) else { continue };
                be.adamw(a, ga, ma, va, h)?;
                be.adamw(b, gb, mb, vb, h)?;
                pair.a.data = be.download(a)?;
                pair.b.data = be.download(b)?;
            }
        }
        Ok(norm)
    }

    /// The moments as host tensors, keyed by the adapter's PEFT keys plus `.exp_avg` /
    /// `.exp_avg_sq` (PyTorch's names), for checkpoints.
    pub fn state_tensors(&self, model: &Model<B>) -> Result<BTreeMap<String, HostTensor>> {
        let lora = model.lora.as_ref().context("AdamW: the model has no LoRA adapter")?;
        let mut out = BTreeMap::new();
        for (l, (mrow, host)) in self.moments.iter().zip(&lora.host.layers).enumerate() {
            for p in ALL_PROJS {
                let (Some([ma, va, mb, vb]), Some(pair)) = (&mrow[p.index()], &host[p.index()]) else { continue };
                for (which, shape, m, v) in [('A', &pair.a.shape, ma, va), ('B', &pair.b.shape, mb, vb)] {
                    let key = p.peft_key(l, which);
                    out.insert(format!("{key}.exp_avg"), HostTensor::new(shape.clone(), model.be.download(m)?));
                    out.insert(format!("{key}.exp_avg_sq"), HostTensor::new(shape.clone(), model.be.download(v)?));
                }
            }
        }
        Ok(out)
    }

    /// Restore moments written by `state_tensors` (every tensor must be present, shapes equal).
    pub fn load_state(&mut self, model: &Model<B>, set: &SafetensorsSet, step: u64) -> Result<()> {
        let lora = model.lora.as_ref().context("AdamW: the model has no LoRA adapter")?;
        for (l, (mrow, host)) in self.moments.iter_mut().zip(&lora.host.layers).enumerate() {
            for p in ALL_PROJS {
                let (Some([ma, va, mb, vb]), Some(pair)) = (mrow[p.index()].as_mut(), &host[p.index()]) else { continue };
                for (which, shape, m, v) in [('A', &pair.a.shape, ma, va), ('B', &pair.b.shape, mb, vb)] {
                    let key = p.peft_key(l, which);
                    model.be.write(m, &set.get_f32(&format!("{key}.exp_avg"), Some(shape))?.data)?;
                    model.be.write(v, &set.get_f32(&format!("{key}.exp_avg_sq"), Some(shape))?.data)?;
                }
            }
        }
        self.step = step;
        Ok(())
    }
}
