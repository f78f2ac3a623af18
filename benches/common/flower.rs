//! What the benchmarks that compare with Flower share: its Python, the shards it trains on, and
//! a run of `benches/flower_round.py`.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Stdio};

use hora_client::data::synthetic::{self, SyntheticConfig};

/// The Python with flwr: `HORA_FLOWER_PYTHON`, else the one `scripts/setup-flower.sh` installs.
pub fn python() -> String {
    if let Ok(p) = std::env::var("HORA_FLOWER_PYTHON") {
        return p;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-flower.sh");
    let out = Command::new(&script)
        .arg("--print-env")
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/setup-flower.sh");
    assert!(out.status.success(), "scripts/setup-flower.sh failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("export HORA_FLOWER_PYTHON="))
        .map(|p| p.trim().trim_matches('\'').to_string())
        .expect("HORA_FLOWER_PYTHON from scripts/setup-flower.sh")
}

/// Flower's Python, unless `HORA_BENCH_FLOWER=0` asks for Hora alone.
pub fn wanted() -> Option<String> {
    let wanted = std::env::var("HORA_BENCH_FLOWER").map_or(true, |v| v != "0");
    wanted.then(python)
}

/// Writes each client's shard for the Flower clients (the same shards the Hora clients make).
pub fn write_shards(dir: &Path, config: &SyntheticConfig) {
    let shards = synthetic::shards(config).expect("shards");
    for (k, s) in shards.iter().enumerate() {
        let json = serde_json::json!({
            "dim": s.train.sample_len(),
            "train_features": s.train.features,
            "train_labels": s.train.labels,
            "test_features": s.test.features,
            "test_labels": s.test.labels,
        });
        std::fs::write(dir.join(format!("shard-{k}.json")), json.to_string()).expect("shard");
    }
}

/// `flower_round.py run ARGS…` with `python`: its `RESULT` object.
pub fn run<I, S>(python: &str, args: I) -> serde_json::Value
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/flower_round.py");
    let out = Command::new(python)
        .arg(&script)
        .arg("run")
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("run benches/flower_round.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "flower_round.py failed:\n{stdout}");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .and_then(|j| serde_json::from_str(j).ok())
        .unwrap_or_else(|| panic!("no RESULT line from flower_round.py:\n{stdout}"))
}
