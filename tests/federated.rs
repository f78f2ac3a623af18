//! End to end with real processes and TLS: the `federated` example runs a real `hora-server`
//! and ten `hora-client train` processes; the `torchscript` and `custom_trainer` examples train
//! a TorchScript module (written by the installed PyTorch) and an SDK-defined model the same way.
//! Each example is run as a process and its results are checked here.

use std::process::Command;

mod support;
use support::{example, run_example as run};

/// Ten clients, 15 rounds, two local epochs at 0.02 (the demo uses five at 0.01: the same
/// Synthetic-IID accuracy ratio over seeds 0-3, 0.96-0.98, at 40% of the centralised baseline's
/// cost), plus `extra` flags.
fn federation(extra: &[&str]) -> (String, serde_json::Value) {
    let mut args = vec![
        "--rounds",
        "15",
        "--epochs",
        "2",
        "--learning-rate",
        "0.02",
        "--single",
        "--json",
    ];
    args.extend_from_slice(extra);
    run("federated", &args)
}

fn curve(result: &serde_json::Value) -> Vec<f64> {
    result["runs"][0]["accuracy"]
        .as_array()
        .expect("accuracy curve")
        .iter()
        .map(|v| v.as_f64().expect("number"))
        .collect()
}

#[test]
fn synthetic_iid_federation_reaches_the_centralised_accuracy() {
    let (stdout, result) = federation(&["--iid"]);
    println!("{stdout}");
    let acc = curve(&result);
    let centralized = result["centralized"].as_f64().expect("centralized");
    assert_eq!(acc.len(), 16, "round 0 and 15 rounds");
    let last = acc[15];
    assert!(
        last >= 0.95 * centralized,
        "federated {last:.4} < 0.95 x centralised {centralized:.4}"
    );
    // Ten clients took part in every round.
    let rows = stdout
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some("10"))
        .count();
    assert_eq!(rows, 15, "{stdout}");
}

#[test]
fn synthetic_non_iid_federation_learns_over_rounds() {
    let (stdout, result) = federation(&[]);
    println!("{stdout}");
    let acc = curve(&result);
    assert_eq!(acc.len(), 16);
    assert!(
        acc[15] > acc[0] + 0.2,
        "accuracy {:.4} -> {:.4}: no clear rise over round 0",
        acc[0],
        acc[15]
    );
    // Mostly rising: the second half is better than the first.
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    assert!(mean(&acc[8..]) > mean(&acc[1..8]), "{acc:?}");
}

#[test]
fn the_demo_compares_fedavg_with_fedprox_on_the_same_data() {
    let (stdout, result) = run(
        "federated",
        &["--clients", "3", "--rounds", "2", "--epochs", "1", "--json"],
    );
    println!("{stdout}");
    let runs = result["runs"].as_array().expect("runs");
    let labels: Vec<_> = runs.iter().map(|r| r["label"].as_str()).collect();
    assert_eq!(labels, [Some("FedAvg"), Some("FedProx")], "{stdout}");
    assert_eq!(runs[0]["proximal_mu"].as_f64(), Some(0.0));
    assert_eq!(runs[1]["proximal_mu"].as_f64(), Some(0.1));
    for r in runs {
        let accuracy = r["accuracy"].as_array().expect("accuracy");
        assert_eq!(accuracy.len(), 3, "round 0 and 2 rounds: {stdout}");
        // Both start from the same initial model.
        assert_eq!(accuracy[0], runs[0]["accuracy"][0]);
    }
    assert!(stdout.contains("FedProx") && stdout.contains("centralised model"));
}

#[test]
fn a_torchscript_module_is_trained_federated() {
    let (stdout, result) = run("torchscript", &[]);
    println!("{stdout}");
    let (before, after) = (
        result["before"].as_f64().expect("before"),
        result["after"].as_f64().expect("after"),
    );
    assert!(after > before + 0.3, "{before} -> {after}");
}

#[test]
fn a_custom_trainer_recovers_the_line() {
    let out = Command::new(example("custom_trainer"))
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("federated fit after 10 rounds"), "{stdout}");
}
