//! The training memory plan (src/backend/cuda/footprint.rs).
use super::*;

/// The memory plan refuses an impossible run with the settings that would fit, before allocating.
#[test]
fn memory_plan_says_what_fits() {
    let be = cuda_or_skip!();
    let cfg = qwen_half_b_cfg(24);
    let info = be.mem_info().unwrap();
    assert!(info.usable() > 0 && info.usable() <= info.total, "{info:?}");
    let plan = TrainMemPlan {
        kv_tokens: 1000,
        rollout_rows: 2048,
        sampled_rows: 64,
        update_rows: 50_000_000,
        lora_r: 16,
        lora_targets: 7 * 24,
        kv_tokens_per_query: 1000,
        queries: 1,
    };
    let e = be.check_train_fit(&cfg, &plan).unwrap_err().to_string();
    println!("{e}");
    assert!(e.contains("--micro-batch-tokens") && e.contains("usable"), "{e}");
    let ok = TrainMemPlan { update_rows: 4096, ..plan };
    be.check_train_fit(&cfg, &ok).unwrap();
    let g = AttnGeom { n_layers: 24, n_heads: 14, n_kv_heads: 2, head_dim: 64, page_size: 64 };
    let e = be.kv_new(g, 100_000_000).err().expect("a KV pool beyond the device").to_string();
    assert!(e.contains("does not fit") && e.contains("tokens fit"), "{e}");
}
