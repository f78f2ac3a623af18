//! Shared by the build scripts of the crates that link libtorch (through tch / torch-sys).
//!
//! torch-sys links against libtorch's shared libraries but puts no run-time search path into the
//! final binaries, so without help every test, example and binary would need `LD_LIBRARY_PATH`.
//! torch-sys publishes the directory it linked against (`links = "tch"` → `DEP_TCH_LIBTORCH_LIB`
//! for crates that depend on it directly); we bake that directory into our binaries' RUNPATH.
//!
//! `libtorch_cuda.so` is only reached through static initialisers, so `--as-needed` would drop it
//! and CUDA would silently be unavailable; when it exists we keep it with `--no-as-needed`.
//! A program that never trains on a GPU can go without it ([`emit_cuda_for`]): loading it
//! costs a process about 120 MB.

#[allow(dead_code)] // (each build script uses one of the two)
pub fn emit() {
    emit_for(None);
}

/// [`emit`] for a crate whose targets `with_cuda` keep CUDA while its other targets link
/// libtorch without it: each as cargo's `rustc-link-arg-…` names it (`bin=NAME`, `benches`,
/// `tests`, `examples`: only kinds the crate has).
#[allow(dead_code)]
pub fn emit_cuda_for(with_cuda: &[&str]) {
    emit_for(Some(with_cuda));
}

fn emit_for(targets: Option<&[&str]>) {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return; // libtorch is not linked in this configuration (e.g. a feature is off)
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        let keep = "-Wl,--no-as-needed,-ltorch_cuda,--as-needed";
        match targets {
            None => println!("cargo:rustc-link-arg={keep}"),
            Some(targets) => {
                for target in targets {
                    println!("cargo:rustc-link-arg-{target}={keep}");
                }
            }
        }
    }
}
