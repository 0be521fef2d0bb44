//! Progress bars on stderr (hidden automatically when stderr is not a terminal).
use indicatif::{ProgressBar, ProgressStyle};

pub fn bar(len: u64, unit: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let tpl = format!("{{spinner}} [{{elapsed_precise}}] {{bar:32}} {{pos}}/{{len}} {unit} ({{per_sec}}, ETA {{eta}}) {{msg}}");
    pb.set_style(ProgressStyle::with_template(&tpl).unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb
}
