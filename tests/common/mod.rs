//! Shared helpers for the integration tests: fixture paths, the reference data, the SmolLM2 dir.
#![allow(dead_code)]
use infomem_engine::backend::cpu::CpuBackend;
use infomem_engine::model::weights::SafetensorsSet;
use infomem_engine::runtime::Model;
use serde_json::Value;
use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn cases() -> Value {
    let text = std::fs::read_to_string(fixtures().join("cases.json")).expect("tests/fixtures/cases.json");
    serde_json::from_str(&text).unwrap()
}

/// A tensor of `expected.safetensors` as (shape, data).
pub fn expected(name: &str) -> (Vec<usize>, Vec<f32>) {
    let set = SafetensorsSet::open_files(&[fixtures().join("expected.safetensors")]).unwrap();
    let t = set.get_f32(name, None).unwrap();
    (t.shape, t.data)
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

pub fn tiny(arch: &str) -> Model<CpuBackend> {
    Model::load(&fixtures().join(format!("tiny-{arch}")), CpuBackend::new()).unwrap()
}

pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().map(|&x| x as f64).fold(f64::NEG_INFINITY, f64::max);
    let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    row.iter().map(|&x| x as f64 - lse).collect()
}

/// The SmolLM2-135M-Instruct HF directory made by tools/fetch-smollm2.sh, if present.
/// With INFOMEM_REQUIRE_SMOL=1 (set by .ci/run) a missing model fails the test instead of skipping.
pub fn smol_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("SMOL_DIR").map(PathBuf::from).unwrap_or_else(|| {
        let cache = std::env::var_os("INFOMEM_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/infomem-engine"));
        cache.join("SmolLM2-135M-Instruct")
    });
    if dir.join("config.json").exists() {
        return Some(dir);
    }
    if std::env::var("INFOMEM_REQUIRE_SMOL").as_deref() == Ok("1") {
        panic!("SmolLM2 not found at {} (run tools/fetch-smollm2.sh)", dir.display());
    }
    eprintln!("skipped: SmolLM2 not found at {} (run tools/fetch-smollm2.sh)", dir.display());
    None
}
