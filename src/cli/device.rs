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
    let res = report(a.ordinal);
    match (res, a.json) {
        (Ok(r), true) => print_json(&r),
        (Ok(r), false) => {
            if let Some(o) = r.as_object() {
                for (k, v) in o {
                    println!("{k}: {}", v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string()));
                }
            }
        }
        // (with --json, main prints the failure as a JSON line)
        (Err(e), _) => return Err(e),
    }
    Ok(())
}

/// The CUDA backend's description of device `ordinal`.
fn report(ordinal: usize) -> Result<serde_json::Value> {
    #[cfg(feature = "cuda")]
    {
        super::open_cuda(ordinal)?.report()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = ordinal;
        anyhow::bail!("this binary was built without CUDA support (rebuild with `cargo build --release --features cuda`); the CPU backend needs no device")
    }
}
