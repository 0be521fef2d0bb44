//! The optimizer's arithmetic on the CPU (twin of kernels/optim.cu, launched by
//! src/backend/cuda/optim.rs): squared norms, scaling, gradient accumulation, AdamW.
use crate::backend::AdamWStep;

/// Σ x² in f64 (the global gradient norm is a sum over millions of terms).
pub fn sum_squares(x: &[f32]) -> f64 {
    x.iter().map(|&v| v as f64 * v as f64).sum()
}

pub fn scale(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

/// PyTorch's `torch.optim.AdamW` step on one tensor (`AdamWStep` has the semantics).
pub fn adamw(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], h: AdamWStep) {
    let c = h.constants();
    for i in 0..p.len() {
        let gi = g[i] * h.grad_scale;
        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
        let denom = v[i].sqrt() / c.bc2_sqrt + h.eps;
        p[i] = p[i] * c.decay - c.step_size * m[i] / denom;
    }
}
