#[path = "../build-support/commit.rs"]
mod commit;
#[path = "../build-support/libtorch_rpath.rs"]
mod libtorch_rpath;

fn main() {
    commit::emit();
    // (`hora-simulate-worker` trains on one CPU thread: no CUDA.)
    libtorch_rpath::emit_cuda_for(&["bin=hora-client", "benches"]);
}
