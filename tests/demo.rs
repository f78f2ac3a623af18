//! The demo example as a real process: one federated round through the shared pipeline must
//! fold ten sealed uploads, refuse four bad ones and publish the reference mean.

use std::process::Command;

mod support;
use support::example;

#[test]
fn demo_round_folds_good_uploads_and_refuses_bad_ones() {
    let path = example("averaging");
    let out = Command::new(&path)
        .output()
        .expect("run the averaging example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "example failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches(" folded").count(), 10, "{stdout}");
    for refusal in [
        "tampered byte",
        "replayed into round 2",
        "NaN value",
        "missing tensors",
    ] {
        assert!(
            stdout.contains(&format!("refused {refusal}")),
            "no refusal of `{refusal}`:\n{stdout}"
        );
    }
    assert!(stdout.contains("authentication failed"), "{stdout}");
    assert!(stdout.contains("non-finite value"), "{stdout}");
    assert!(stdout.contains("published: mean of 10 deltas"), "{stdout}");
}
