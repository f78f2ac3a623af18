#[path = "../build-support/commit.rs"]
mod commit;

fn main() {
    commit::emit();
}
