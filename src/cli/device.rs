//! `device`: what the CUDA backend would run on — the first thing to look at on a new machine.
use super::print_json;
use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct DeviceArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub ordinal: usize,
    /// Print one JSON line instead of "key: value" lines.
    #[arg(long)]
    pub json: bool,
}

pub fn device(a: DeviceArgs) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        let be = infomem_engine::backend::cuda::CudaBackend::new(a.ordinal)?;
        let r = be.report()?;
        if a.json {
            print_json(&r);
        } else if let Some(o) = r.as_object() {
            for (k, v) in o {
                println!("{k}: {}", v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string()));
            }
        }
        Ok(())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (a.ordinal, print_json as fn(&serde_json::Value));
        anyhow::bail!("this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`); the CPU backend needs no device")
    }
}
