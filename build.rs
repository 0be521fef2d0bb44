//! Compiles every `kernels/*.cu` for the H200 (sm_90 cubin + compute_90 PTX) with nvcc 13.0.x and
//! embeds them: `$OUT_DIR/kernels.rs` lists `(name, cubin, ptx)` for `src/backend/cuda`.
//!
//! Runs nvcc only with the `cuda` feature or `INFOMEM_CHECK_KERNELS=1`, so plain CPU builds stay
//! fast. Without nvcc the build still succeeds and the CUDA backend reports "built without
//! kernels" (the reason is embedded). nvcc is looked up in `INFOMEM_NVCC`, `CUDA_HOME/bin`,
//! `CUDA_PATH/bin`, `PATH`, then the pip venv made by `tools/install-nvcc.sh`
//! (`${INFOMEM_CACHE:-~/.cache/infomem-engine}/cuda-venv`). A kernel that fails to compile fails
//! the build.
use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for v in ["INFOMEM_CHECK_KERNELS", "INFOMEM_NVCC", "CUDA_HOME", "CUDA_PATH", "INFOMEM_CACHE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let want = env::var_os("CARGO_FEATURE_CUDA").is_some() || env::var("INFOMEM_CHECK_KERNELS").as_deref() == Ok("1");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    if !want {
        // Nothing includes kernels.rs without the cuda feature; keep the file valid anyway.
        write_listing(&out, &[], "", Some("the crate was built without the `cuda` feature"));
        return;
    }
    println!("cargo:rerun-if-changed=kernels");
    let dir = Path::new("kernels");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu" || e == "cuh"));
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    sources.retain(|p| p.extension().is_some_and(|e| e == "cu"));

    let Some(nvcc) = find_nvcc() else {
        let why = "nvcc was not found at build time (set INFOMEM_NVCC or CUDA_HOME, or run tools/install-nvcc.sh, then rebuild)";
        println!("cargo:warning=infomem-engine: {why}; the CUDA backend will report \"built without kernels\"");
        write_listing(&out, &[], "", Some(why));
        return;
    };
    let version = nvcc_version(&nvcc).unwrap_or_else(|e| panic!("{}: {e}", nvcc.display()));
    if !version.contains("release 13.0") {
        println!(
            "cargo:warning=infomem-engine: {} is not CUDA 13.0 ({}): PTX from a newer nvcc does not load on the 13.0 driver",
            nvcc.display(),
            version.lines().last().unwrap_or("")
        );
    }
    // Compile all files concurrently (attention.cu dominates).
    let jobs: Vec<_> = sources
        .iter()
        .map(|src| {
            let (nvcc, src, out) = (nvcc.clone(), src.clone(), out.clone());
            std::thread::spawn(move || compile(&nvcc, &src, &out))
        })
        .collect();
    let mut built = Vec::new();
    let mut errors = String::new();
    for j in jobs {
        match j.join().expect("nvcc thread") {
            Ok(k) => built.push(k),
            Err(e) => errors.push_str(&e),
        }
    }
    if !errors.is_empty() {
        panic!("kernel compilation failed:\n{errors}");
    }
    write_listing(&out, &built, version.lines().last().unwrap_or("").trim(), None);
}

/// (name, cubin path, ptx path)
type Built = (String, PathBuf, PathBuf);

/// FMA contraction policy. nvcc's default `--fmad=true` fuses `a·b + c` into one rounding where
/// the CPU twins round twice. Files whose kernels claim the twin's exact per-element operation
/// order are compiled with `-fmad=false` (nvcc then emits every f32 mul/add as `.rn`, which
/// ptxas may not fuse either); optim.cu pins its operations with `__fmul_rn`/`__fadd_rn`
/// instead. Every other file keeps contraction (one rounding fewer; its parity test's tolerance
/// covers it). `tools/check-kernels.sh` compiles with the same flags.
const NO_FMAD: &[&str] = &["rope"];

fn compile(nvcc: &Path, src: &Path, out: &Path) -> Result<Built, String> {
    let name = src.file_stem().unwrap().to_string_lossy().to_string();
    let fmad: &[&str] = if NO_FMAD.contains(&name.as_str()) { &["-fmad=false"] } else { &[] };
    let cubin = out.join(format!("{name}.cubin"));
    let ptx = out.join(format!("{name}.ptx"));
    for (what, target, arch) in [("-cubin", &cubin, "-arch=sm_90"), ("-ptx", &ptx, "-arch=compute_90")] {
        let r = Command::new(nvcc)
            .args([what, arch, "-O3", "-std=c++17", "-lineinfo", "-Ikernels"])
            .args(fmad)
            .arg("-o")
            .arg(target)
            .arg(src)
            .output()
            .map_err(|e| format!("{}: cannot run {}: {e}\n", src.display(), nvcc.display()))?;
        if !r.status.success() {
            return Err(format!(
                "{} ({what}):\n{}{}\n",
                src.display(),
                String::from_utf8_lossy(&r.stdout),
                String::from_utf8_lossy(&r.stderr)
            ));
        }
    }
    Ok((name, cubin, ptx))
}

fn write_listing(out: &Path, built: &[Built], version: &str, missing: Option<&str>) {
    let mut s = String::from("// @generated by build.rs: the kernels of kernels/*.cu, compiled for sm_90.\n");
    writeln!(s, "/// (file stem, sm_90 cubin, compute_90 PTX)").unwrap();
    writeln!(s, "pub static KERNELS: &[(&str, &[u8], &str)] = &[").unwrap();
    for (name, cubin, ptx) in built {
        writeln!(s, "    ({name:?}, include_bytes!({:?}), include_str!({:?})),", cubin.display().to_string(), ptx.display().to_string()).unwrap();
    }
    writeln!(s, "];").unwrap();
    writeln!(s, "/// nvcc's version line.").unwrap();
    writeln!(s, "pub const NVCC_VERSION: &str = {version:?};").unwrap();
    writeln!(s, "/// Why there are no kernels, when there are none.").unwrap();
    writeln!(s, "pub const MISSING: Option<&str> = {missing:?};").unwrap();
    std::fs::write(out.join("kernels.rs"), s).unwrap();
}

fn nvcc_version(nvcc: &Path) -> Result<String, String> {
    let r = Command::new(nvcc).arg("--version").output().map_err(|e| e.to_string())?;
    if !r.status.success() {
        return Err(format!("nvcc --version failed: {}", String::from_utf8_lossy(&r.stderr)));
    }
    Ok(String::from_utf8_lossy(&r.stdout).trim().to_string())
}

fn find_nvcc() -> Option<PathBuf> {
    let ok = |p: PathBuf| if p.is_file() { Some(p) } else { None };
    if let Some(p) = env::var_os("INFOMEM_NVCC") {
        return ok(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = env::var_os(var) {
            if let Some(p) = ok(PathBuf::from(h).join("bin/nvcc")) {
                return Some(p);
            }
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for d in env::split_paths(&path) {
            if let Some(p) = ok(d.join("nvcc")) {
                return Some(p);
            }
        }
    }
    let cache = env::var_os("INFOMEM_CACHE")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/infomem-engine")))?;
    let lib = cache.join("cuda-venv/lib");
    let mut pys: Vec<PathBuf> = std::fs::read_dir(&lib).ok()?.filter_map(|e| e.ok()).map(|e| e.path()).collect();
    pys.sort();
    pys.into_iter().rev().find_map(|py| ok(py.join("site-packages/nvidia/cu13/bin/nvcc")))
}
