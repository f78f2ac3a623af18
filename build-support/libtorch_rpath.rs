//! Shared by the build scripts of the crates that link libtorch (through tch / torch-sys).
//!
//! torch-sys links against libtorch's shared libraries but puts no run-time search path into the
//! final binaries, so without help every test, example and binary would need `LD_LIBRARY_PATH`.
//! torch-sys publishes the directory it linked against (`links = "tch"` → `DEP_TCH_LIBTORCH_LIB`
//! for crates that depend on it directly); we bake that directory into our binaries' RUNPATH.
//!
//! `libtorch_cuda.so` is only reached through static initialisers, so `--as-needed` would drop it
//! and CUDA would silently be unavailable; when it exists we keep it with `--no-as-needed`.

pub fn emit() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return; // libtorch is not linked in this configuration (e.g. a feature is off)
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
