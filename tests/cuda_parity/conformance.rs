//! Conformance (kernels/conformance.cu ↔ the emulator's models, src/backend/cuda/conformance.rs):
//! on a GPU, the scalar probes (ex2.approx, rcp.approx, rcp.rn, the bf16 conversions) and one
//! mma.sync tile against the same launches on the emulated device. Exact claims must hold bit
//! for bit, approximations within their PTX ISA bounds; every difference is printed (and written
//! to $INFOMEM_CONFORMANCE_OUT as JSON when set: tools/gpu-check.sh contact runs this first).
//! On the emulated device itself the comparison is trivial and the test says so.
use super::*;
use infomem_engine::backend::cuda::conformance::{mma_case, report, report_mma, scalar_inputs, PROBES};

#[test]
fn gpu_matches_the_emulator_models() {
    let be = cuda_or_skip!();
    if emulated(be) {
        eprintln!("skipped on the emulated device: this compares a GPU with it (the emulator's own check is backend::cuda::conformance::tests)");
        return;
    }
    let emu = CudaBackend::emulated().expect("the emulated device loads the embedded PTX");
    let x = scalar_inputs();
    let got = be.conformance_scalar(&x).unwrap();
    let want = emu.conformance_scalar(&x).unwrap();
    let (text, mut bad) = report(&x, &got, &want);
    println!("conformance, scalar probes ({}), GPU vs emulator:\n{text}", PROBES.join(", "));
    let case = mma_case();
    let d = be.conformance_mma(&case).unwrap();
    let reference = match emu.emulator_unsupported("conformance_mma") {
        None => Some(emu.conformance_mma(&case).unwrap()),
        Some(why) => {
            println!("conformance: the emulator cannot run the mma tile ({why}); the GPU's tile is judged against the exact result only");
            None
        }
    };
    let (mtext, mbad) = report_mma(&case, &d, reference.as_deref());
    println!("conformance, {mtext}");
    bad.extend(mbad);
    if let Ok(path) = std::env::var("INFOMEM_CONFORMANCE_OUT") {
        let json = serde_json::json!({
            "probes": PROBES,
            "inputs": x,
            "gpu": got,
            "emulator": want,
            "mma": {"gpu": d, "emulator": reference, "exact": case.exact().iter().map(|e| e.0).collect::<Vec<_>>()},
            "violations": bad,
        });
        std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    }
    assert!(bad.is_empty(), "the GPU breaks {} claims of the emulator's models:\n{}", bad.len(), bad.join("\n"));
}
