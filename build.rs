#[path = "build-support/libtorch_rpath.rs"]
mod libtorch_rpath;

// The examples and cross-process tests link the client SDK, and with it libtorch.
fn main() {
    libtorch_rpath::emit();
}
