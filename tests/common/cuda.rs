//! Shared by the CUDA parity tests (tests/cuda_parity/): the
//! device (or a visible skip), bf16-rounded random inputs, and element/row bounds.
#![allow(dead_code, unused_macros)]
use infomem_engine::backend::cuda::{self, CudaBackend};
use infomem_engine::util::rng::Rng;
use std::sync::OnceLock;

/// Worst relative error of one round-to-nearest to bf16: 8 significant bits (7 stored), so half
/// an ulp is at most 2⁻⁸ of the value (bf16's unit roundoff).
pub const BF16_ROUND: f32 = 1.0 / 256.0;

/// Under compute-sanitizer (`tools/gpu-check.sh contact` sets INFOMEM_SANITIZER=1), tests that
/// loop over head sizes keep the ones the models use (64 and 128): racecheck instruments every
/// shared-memory access and slows the attention kernels by orders of magnitude.
pub fn under_sanitizer() -> bool {
    std::env::var("INFOMEM_SANITIZER").as_deref() == Ok("1")
}

/// `shapes` (n_heads, n_kv_heads, head_dim), or only those with head_dim 64 or 128 under a sanitizer.
pub fn attention_shapes(shapes: &[(usize, usize, usize)]) -> Vec<(usize, usize, usize)> {
    shapes.iter().copied().filter(|s| !under_sanitizer() || s.2 == 64 || s.2 == 128).collect()
}

/// The real device, or without one the emulated device (the kernels' real PTX run by the
/// interpreter on the CPU: `src/backend/cuda/emulated.rs`). INFOMEM_REQUIRE_CUDA=1 (set by
/// tools/gpu-check.sh) demands the real one.
pub fn cuda_be() -> Option<&'static CudaBackend> {
    static BE: OnceLock<Option<CudaBackend>> = OnceLock::new();
    BE.get_or_init(|| {
        if !cuda::device_present() {
            if std::env::var("INFOMEM_REQUIRE_CUDA").as_deref() == Ok("1") {
                panic!("INFOMEM_REQUIRE_CUDA=1 but no CUDA device is visible");
            }
            if cuda::kernels_missing().is_some() {
                return None;
            }
            return Some(CudaBackend::emulated().expect("the emulated device loads the embedded PTX"));
        }
        Some(CudaBackend::new(0).expect("a CUDA device is visible, so the CUDA backend must open"))
    })
    .as_ref()
}

/// Whether `be` is the emulated device.
pub fn emulated(be: &CudaBackend) -> bool {
    be.emulator_stats().is_some()
}

macro_rules! cuda_or_skip {
    () => {
        match $crate::common::cuda::cuda_be() {
            Some(b) => b,
            None => {
                eprintln!("skipped: no CUDA device and no kernels for the emulated one");
                return;
            }
        }
    };
}

/// `cuda_or_skip!` for tests that need the real device: `$why` says why the emulated one does
/// not serve (e.g. the kernels use tensor cores, which the interpreter models from issue 54).
macro_rules! gpu_or_skip {
    ($why:expr) => {
        match $crate::common::cuda::cuda_be() {
            Some(b) if !$crate::common::cuda::emulated(b) => b,
            Some(_) => {
                eprintln!("skipped on the emulated device: {}", $why);
                return;
            }
            None => {
                eprintln!("skipped: no CUDA device");
                return;
            }
        }
    };
}

pub fn bf(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}
pub fn randn(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.normal() as f32 * scale).collect()
}
pub fn randn_bf(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| bf(rng.normal() as f32 * scale)).collect()
}
pub fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &b| a.max(b.abs()))
}

/// |got − want| <= rel·|want| + abs for every element, with a readable failure.
pub fn check(what: &str, got: &[f32], want: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = (0usize, 0f32);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let excess = (g - w).abs() - (rel * w.abs() + abs);
        if !(excess <= worst.1) && (excess > 0.0 || g.is_nan()) {
            worst = (i, excess.max(f32::MIN_POSITIVE));
        }
    }
    if worst.1 > 0.0 {
        let i = worst.0;
        panic!("{what}: element {i}: got {} want {} (bound {} + {}·|want|)", got[i], want[i], abs, rel);
    }
}

/// Per-row bound: |got − want| <= frac · max|want row| (+ abs).
pub fn check_rows(what: &str, got: &[f32], want: &[f32], width: usize, frac: f32, abs: f32) {
    for (r, (g, w)) in got.chunks(width).zip(want.chunks(width)).enumerate() {
        let m = max_abs(w);
        check(&format!("{what} row {r}"), g, w, 0.0, frac * m + abs);
    }
}
