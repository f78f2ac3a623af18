#[path = "../build-support/libtorch_rpath.rs"]
mod libtorch_rpath;

fn main() {
    libtorch_rpath::emit();
}
