#[path = "../build-support/commit.rs"]
mod commit;
#[path = "../build-support/libtorch_rpath.rs"]
mod libtorch_rpath;

fn main() {
    commit::emit();
    libtorch_rpath::emit();
}
