//! Simulated federations: the server's round engine in this process, virtual clients trained by
//! real `hora-simulate-worker` processes on Synthetic(1,1) shards, a simulated clock.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::process::Command;

use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_server::simulation::{self, Outcome, Simulation};

mod support;
use support::binary;

fn worker() -> Vec<OsString> {
    vec![binary("hora-simulate-worker").into_os_string()]
}

/// Logistic regression 60 → 10 on Synthetic(1, 1): `target` clients a round of `clients`.
fn task(rounds: u64, target: u32, extra: serde_json::Value) -> serde_json::Value {
    let mut task = serde_json::json!({
        "id": "sim",
        "model": {"kind": "builtin", "name": "logreg", "params": {"inputs": 60, "classes": 10}},
        "rounds": rounds,
        "min_clients": 2,
        "target_clients": target,
        "round_deadline_secs": 600,
        "training": {"epochs": 1, "batch_size": 10, "learning_rate": 0.05},
    });
    for (k, v) in extra.as_object().expect("an object") {
        task[k] = v.clone();
    }
    task
}

fn simulation_of(
    task: serde_json::Value,
    clients: u64,
    workers: usize,
    seed: u64,
    profile: &str,
) -> Simulation {
    Simulation {
        task,
        initial: None,
        clients,
        data: "synthetic:alpha=1,beta=1".into(),
        partition: None,
        seed,
        workers,
        worker_command: worker(),
        profile: profile.parse().expect("a profile"),
        evaluate_clients: 40,
        checkpoint: None,
    }
}

fn run(sim: &Simulation) -> Outcome {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime
        .block_on(simulation::run(sim, &mut |_| {}))
        .expect("the simulation runs")
}

fn simulate(
    task: serde_json::Value,
    clients: u64,
    workers: usize,
    seed: u64,
    profile: &str,
) -> Outcome {
    run(&simulation_of(task, clients, workers, seed, profile))
}

#[test]
fn the_same_seed_gives_the_same_model_bit_for_bit_whatever_the_number_of_workers() {
    let task = task(3, 8, serde_json::json!({"over_selection": 0.5}));
    let one = simulate(task.clone(), 60, 1, 7, "heterogeneous:dropout=0.1");
    let three = simulate(task.clone(), 60, 3, 7, "heterogeneous:dropout=0.1");
    assert_eq!(one.history.len(), 3, "{:?}", one.history);
    assert_eq!(
        one.model.to_safetensors(),
        three.model.to_safetensors(),
        "one worker and three trained different models"
    );
    let strip = |o: &Outcome| {
        let rows = o.history.iter();
        rows.map(|r| {
            (
                r.round,
                r.participants,
                r.dropouts,
                r.examples,
                r.loss,
                r.eval_accuracy,
                r.sim_time_s,
            )
        })
        .collect::<Vec<_>>()
    };
    assert_eq!(strip(&one), strip(&three));
    // Another seed is another federation.
    let other = simulate(task, 60, 2, 8, "heterogeneous:dropout=0.1");
    assert_ne!(one.model.to_safetensors(), other.model.to_safetensors());
}

#[test]
fn a_round_holds_the_first_clients_to_finish_and_counts_the_others_as_dropped() {
    // 30% of selected clients drop out; 12 are selected for a target of 8.
    let task = task(4, 8, serde_json::json!({"over_selection": 0.5}));
    let outcome = simulate(task, 200, 2, 3, "heterogeneous:dropout=0.3");
    let config = SyntheticConfig::non_iid(1.0, 1.0, 200, 3);
    let (mut selected, mut dropped) = (0, 0);
    for record in &outcome.records {
        let participants: BTreeSet<&String> = record.participants.iter().collect();
        assert!(participants.len() <= 8, "{record:?}");
        // The round's examples are its participants' training examples, counted independently.
        let examples: u64 = participants
            .iter()
            .map(|id| {
                let k: usize = id.strip_prefix("sim-").unwrap().parse().unwrap();
                synthetic::shard(&config, k).unwrap().train.len() as u64
            })
            .sum();
        assert_eq!(record.examples, examples, "round {}", record.round);
        selected += participants.len() + record.dropped.len();
        dropped += record.dropped.len();
    }
    // Dropouts, and over-selected clients slower than the target's last: more than 30% of the
    // selections, but every round published.
    assert!(dropped * 10 >= selected * 3, "{dropped} of {selected}");
    assert!(outcome.history.iter().all(|r| r.outcome == "published"));
    assert_eq!(outcome.history.len(), 4);
}

#[test]
fn secure_aggregation_with_30_percent_dropouts_publishes_the_survivors_fedavg() {
    // Ten clients a round, each told to drop out with chance 0.3 after sharing its keys: the
    // engine must remove the masks the dropped clients agreed with their neighbours. The same
    // federation without secure aggregation takes the same survivors' updates in the clear, so
    // its FedAvg is what the unmasked sums must give (up to the quantisation's rounding).
    let (rounds, profile) = (3, "heterogeneous:dropout=0.3");
    let secure = serde_json::json!({"min_clients": 3,
        "secure_aggregation": {"clip": 5.0, "max_weight": 100_000}});
    let masked = simulate(task(rounds, 10, secure), 100, 2, 5, profile);
    // (Without the adaptive bounds on weights and norms, which masked updates cannot have.)
    let clear = serde_json::json!({"min_clients": 3, "update_bounds":
        {"adaptive_norm_factor": null, "adaptive_weight_factor": null}});
    let plain = simulate(task(rounds, 10, clear), 100, 2, 5, profile);
    assert_eq!(masked.history.len() as u64, rounds, "{:?}", masked.history);
    assert!(
        masked.history.iter().all(|r| r.outcome == "published"),
        "{:?}",
        masked.history
    );
    let (mut selected, mut dropped) = (0, 0);
    for (m, p) in masked.records.iter().zip(&plain.records) {
        let set = |ids: &[String]| ids.iter().cloned().collect::<BTreeSet<_>>();
        assert_eq!(
            set(&m.participants),
            set(&p.participants),
            "round {}",
            m.round
        );
        assert_eq!(set(&m.dropped), set(&p.dropped), "round {}", m.round);
        assert_eq!(m.examples, p.examples, "round {}", m.round);
        selected += m.participants.len() + m.dropped.len();
        dropped += m.dropped.len();
    }
    assert!(
        dropped * 100 >= selected * 15 && dropped * 100 <= selected * 45,
        "{dropped} of {selected} dropped out"
    );
    let (m, p) = (masked.model.data(), plain.model.data());
    let worst = m
        .iter()
        .zip(p)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-3,
        "the masked federation's model is {worst} from the plain one's"
    );
    assert_ne!(m, p, "quantised sums cannot be the plain sums bit for bit");
    let accuracy = |o: &Outcome| o.history.last().and_then(|r| r.eval_accuracy).unwrap();
    assert!((accuracy(&masked) - accuracy(&plain)).abs() < 0.01);

    // Twenty a round: SecAgg+'s sparse neighbour graph (14 neighbours each), drawn from the
    // seed, so the same attempts publish or are abandoned with one worker or two.
    let sparse = serde_json::json!({"min_clients": 3, "evaluation": {"clients": 5},
        "secure_aggregation": {"clip": 5.0, "max_weight": 100_000}});
    let runs: Vec<Outcome> = [1, 2]
        .into_iter()
        .map(|workers| {
            simulate(
                task(2, 20, sparse.clone()),
                100,
                workers,
                9,
                "heterogeneous:dropout=0.1",
            )
        })
        .collect();
    assert_eq!(
        runs[0].model.to_safetensors(),
        runs[1].model.to_safetensors()
    );
    assert_eq!(runs[0].history.len(), runs[1].history.len());
    for (a, b) in runs[0].history.iter().zip(&runs[1].history) {
        assert_eq!(
            (a.round, a.attempt, &a.outcome, a.participants, a.dropouts),
            (b.round, b.attempt, &b.outcome, b.participants, b.dropouts)
        );
        assert_eq!(
            (a.federated_loss, a.federated_accuracy),
            (b.federated_loss, b.federated_accuracy)
        );
    }
    // Round 2's clients evaluated round 1's model inside their masked inputs.
    let first = runs[0]
        .history
        .iter()
        .find(|r| r.round == 1 && r.outcome == "published");
    assert!(
        first.and_then(|r| r.federated_accuracy).is_some(),
        "{:?}",
        runs[0].history
    );
}

#[test]
fn a_task_that_trains_part_of_its_model_changes_only_that_part_and_its_clients_evaluate_it() {
    tch::manual_seed(11);
    let arch = hora_client::network::Architecture::Logreg {
        inputs: 60,
        classes: 10,
    };
    let network = hora_client::network::Network::builtin(&arch, tch::Device::Cpu).unwrap();
    let initial = network.weights().unwrap();
    let part = task(
        3,
        4,
        serde_json::json!({"trainable": ["*.bias"],
        "evaluation": {"every": 2, "clients": 5, "held_out": true}}),
    );
    let mut sim = simulation_of(part, 40, 2, 3, "uniform");
    sim.initial = Some(initial.clone());
    let outcome = run(&sim);
    assert!(outcome.history.iter().all(|r| r.outcome == "published"));
    // The outcome is the whole model: the frozen weight as it was, the bias trained.
    assert_eq!(outcome.model.spec(), initial.spec());
    let tensor = |m: &hora_common::model::Model, name: &str| m.tensor(name).unwrap().to_vec();
    assert_eq!(
        tensor(&outcome.model, "linear.weight"),
        tensor(&initial, "linear.weight")
    );
    assert_ne!(
        tensor(&outcome.model, "linear.bias"),
        tensor(&initial, "linear.bias")
    );
    // Each update carried the trainable part only: 10 values a client.
    assert!(outcome
        .history
        .iter()
        .all(|r| r.bytes_up < r.participants * 200));
    // The engine's federated evaluation: every second round and the last, five clients each
    // (evaluating the whole model: the part with its base), in the history and the rows.
    let evaluated: Vec<u64> = outcome
        .records
        .iter()
        .filter_map(|r| r.evaluation.map(|_| r.round))
        .collect();
    assert_eq!(evaluated, [2, 3], "{:?}", outcome.records);
    for (record, row) in outcome.records.iter().zip(&outcome.history) {
        match record.evaluation {
            Some(e) => {
                assert_eq!(e.clients, 5, "round {}", record.round);
                let accuracy = row.federated_accuracy.expect("a federated accuracy");
                assert_eq!(Some(accuracy), e.accuracy);
                // Five clients' held-out data against the pooled forty's: the same model.
                let pooled = row.eval_accuracy.unwrap();
                assert!(
                    (accuracy - pooled).abs() < 0.25,
                    "{accuracy} against {pooled}"
                );
            }
            None => assert_eq!((row.federated_loss, row.federated_accuracy), (None, None)),
        }
    }
}

#[test]
fn fedbuff_reaches_the_target_accuracy_sooner_in_simulated_time_on_a_heterogeneous_fleet() {
    // Devices two orders of magnitude apart: a synchronous round waits for its tenth finisher
    // (of 13 selected), FedBuff folds whoever finishes, against the version it started from.
    let target = 0.5;
    let training = serde_json::json!({"epochs": 3, "batch_size": 10, "learning_rate": 0.05});
    let sync = task(
        30,
        10,
        serde_json::json!({"over_selection": 0.3, "round_deadline_secs": 120, "training": training}),
    );
    let buffered = task(
        30,
        10,
        serde_json::json!({"asynchronous": {"buffer_size": 10, "concurrency": 20}, "training": training}),
    );
    let run = |task| {
        let sim = Simulation {
            data: "synthetic-iid:".into(),
            ..simulation_of(task, 300, 2, 11, "heterogeneous:dropout=0.05")
        };
        run(&sim)
    };
    let (sync, buffered) = (run(sync), run(buffered));
    let at = |o: &Outcome| simulation::history::time_to_accuracy(&o.history, target);
    let (s, b) = (at(&sync), at(&buffered));
    println!(
        "simulated seconds to accuracy {target}: synchronous {s:?}, FedBuff {b:?}; 30 rounds: {:.1} s and {:.1} s",
        sync.history.last().unwrap().sim_time_s,
        buffered.history.last().unwrap().sim_time_s
    );
    let (s, b) = (
        s.expect("synchronous reaches it"),
        b.expect("FedBuff reaches it"),
    );
    assert!(b < s, "FedBuff took {b:.1} s, synchronous rounds {s:.1} s");
    // Each version holds a buffer of updates.
    assert!(buffered.history.iter().all(|r| r.participants == 10));
    assert_eq!(buffered.history.len(), 30);
}

#[test]
fn hora_server_simulate_prints_the_table_and_writes_the_history_and_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let task_path = dir.path().join("task.json");
    std::fs::write(&task_path, task(2, 5, serde_json::json!({})).to_string()).unwrap();
    let (history, model) = (dir.path().join("h.csv"), dir.path().join("m.safetensors"));
    let out = Command::new(binary("hora-server"))
        .arg("simulate")
        .arg(&task_path)
        .args([
            "--clients",
            "30",
            "--workers",
            "2",
            "--seed",
            "5",
            "--evaluate-clients",
            "10",
        ])
        .arg("--history")
        .arg(&history)
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("published"), "{stdout}");
    let csv = std::fs::read_to_string(&history).unwrap();
    assert_eq!(csv.lines().count(), 3, "{csv}");
    // The command line and the library are one engine: the same seed, the same model.
    let library = simulate(task(2, 5, serde_json::json!({})), 30, 1, 5, "uniform");
    let written = hora_common::model::Model::read_file(&model, &Default::default()).unwrap();
    assert_eq!(written.to_safetensors(), library.model.to_safetensors());

    // A task the simulation cannot run is refused with what to do.
    std::fs::write(&task_path, r#"{"id": "x"}"#).unwrap();
    let out = Command::new(binary("hora-server"))
        .arg("simulate")
        .arg(&task_path)
        .args(["--clients", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("round_deadline_secs"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_federation_publishes_the_models_the_same_federation_deployed_publishes() {
    let (clients, seed, rounds) = (4u64, 21u64, 3u64);
    tch::manual_seed(1);
    let arch = hora_client::network::Architecture::Logreg {
        inputs: 60,
        classes: 10,
    };
    let initial = hora_client::network::Network::builtin(&arch, tch::Device::Cpu)
        .unwrap()
        .weights()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server = support::Server::start(&dir.path().join("server"));
    let admin = server.api(support::ADMIN_TOKEN);
    let digest = admin.upload_model(&initial).await;
    let mut task = support::task("twin", digest, rounds, 4, 4, 600);
    task.model = arch.to_kind();
    task.training = serde_json::from_value(
        serde_json::json!({"epochs": 1, "batch_size": 10, "learning_rate": 0.05}),
    )
    .unwrap();
    admin.create_task(&task).await;

    // Deployed: four `hora-client train` processes, each on its own Synthetic(1,1) shard and
    // seeded as the simulation seeds that client.
    let data = format!("synthetic:alpha=1,beta=1,clients={clients},seed={seed}");
    let mut deployed = Vec::new();
    for k in 0..clients {
        let token: serde_json::Value = admin
            .ok(admin
                .request(reqwest::Method::POST, "/admin/v1/enrolments")
                .json(&serde_json::json!({})))
            .await;
        let trainer_seed = hora_common::simulation::client_seed(seed, k, 0) as i64;
        let child = Command::new(binary("hora-client"))
            .args([
                "train",
                "--server",
                &server.url,
                "--task",
                "twin",
                "--token",
            ])
            .arg(token["token"].as_str().unwrap())
            .arg("--ca")
            .arg(&server.ca)
            .arg("--state-dir")
            .arg(dir.path().join(format!("client-{k}")))
            .args(["--data", &data, "--client-index", &k.to_string()])
            .arg(format!("--seed={trainer_seed}"))
            .args(["--threads", "1", "--device", "cpu", "--no-progress"])
            .env("HORA_LOG", "warn")
            .spawn()
            .unwrap();
        deployed.push(child);
    }
    let deployed = support::Processes(deployed);
    let waited = tokio::task::spawn_blocking(move || {
        let mut deployed = deployed;
        deployed
            .0
            .iter_mut()
            .map(|c| c.wait().unwrap())
            .collect::<Vec<_>>()
    });
    for status in waited.await.unwrap() {
        assert!(status.success(), "a deployed client failed: {status}");
    }

    // Simulated: the same task, data, seeds and initial weights.
    let sim = Simulation {
        initial: Some(initial.clone()),
        data: "synthetic:alpha=1,beta=1".into(),
        ..simulation_of(
            serde_json::to_value(&task).unwrap(),
            clients,
            2,
            seed,
            "uniform",
        )
    };
    let simulated = tokio::task::spawn_blocking(move || run(&sim))
        .await
        .unwrap();
    assert_eq!(simulated.history.len(), rounds as usize);
    let published = admin.round_model("twin", rounds).await;
    assert_eq!(published.spec(), simulated.model.spec());
    let (mut largest, mut moved) = (0f32, 0f32);
    for ((d, s), i) in published
        .data()
        .iter()
        .zip(simulated.model.data())
        .zip(initial.data())
    {
        largest = largest.max((d - s).abs());
        moved = moved.max((d - i).abs());
    }
    // Updates fold in another order when deployed (whoever uploads first): f32 rounding apart,
    // the same model (a client seeded otherwise moves it by about 0.03); and one far from where
    // both started.
    assert!(largest < 1e-5, "the models differ by up to {largest}");
    assert!(moved > 1e-2, "training moved no weight more than {moved}");
}

#[test]
fn a_worker_killed_mid_run_costs_at_most_the_client_it_held_and_the_run_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("pids");
    // Each worker writes its process id, then becomes hora-simulate-worker (same id).
    let command = vec![
        OsString::from("sh"),
        "-c".into(),
        r#"echo $$ >> "$0"; exec "$1""#.into(),
        pids.clone().into_os_string(),
        binary("hora-simulate-worker").into_os_string(),
    ];
    let sim = Simulation {
        worker_command: command,
        ..simulation_of(task(4, 10, serde_json::json!({})), 60, 3, 2, "uniform")
    };
    let mut killed = None;
    let mut on_row = |row: &simulation::Row| {
        if row.round == 1 {
            let text = std::fs::read_to_string(&pids).unwrap();
            let pid: i32 = text.lines().next().unwrap().trim().parse().unwrap();
            // SAFETY: kill(2) on a process this test started.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            killed = Some(pid);
        }
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let outcome = runtime
        .block_on(simulation::run(&sim, &mut on_row))
        .expect("the simulation finishes without the worker");
    assert!(killed.is_some());
    assert_eq!(outcome.history.len(), 4, "{:?}", outcome.history);
    assert!(outcome.history.iter().all(|r| r.outcome == "published"));
    // The dead worker fails the one job it takes next: a client's training (that client's
    // dropout) or a look-up, which another worker answers.
    let dropouts: u64 = outcome.history.iter().map(|r| r.dropouts).sum();
    assert!(dropouts <= 1, "{:?}", outcome.history);
    assert_eq!(outcome.updates, 40 - dropouts);
    outcome.model.check_finite().unwrap();
}

#[test]
fn a_csv_dataset_split_by_label_skew_gives_each_round_its_clients_shares() {
    use hora_client::data::partition::{Partitioner, Plan};
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("points.csv");
    // Three classes of 4-feature points, by which of three directions a point is nearest.
    let mut text = String::from("a,b,c,d,label\n");
    let mut labels = Vec::new();
    for i in 0..3_000u32 {
        let x: Vec<f32> = (0..4)
            .map(|j| ((i * 7 + j * 13) % 17) as f32 / 17.0 - 0.5)
            .collect();
        let label = [x[0] + x[1], x[2] - x[1], x[3] - x[0]]
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0;
        labels.push(label as i64);
        text.push_str(&format!("{},{},{},{},{label}\n", x[0], x[1], x[2], x[3]));
    }
    std::fs::write(&csv, text).unwrap();
    let mut skewed = task(3, 6, serde_json::json!({}));
    skewed["model"] = serde_json::json!({"kind": "builtin", "name": "logreg", "params": {"inputs": 4, "classes": 3}});
    let sim = Simulation {
        data: csv.display().to_string(),
        partition: Some("dirichlet:alpha=0.3".into()),
        ..simulation_of(skewed, 30, 2, 4, "uniform")
    };
    let outcome = run(&sim);
    assert_eq!(outcome.history.len(), 3);
    // Each round's examples are its participants' training shares: the Dirichlet split of the
    // file (seeded as the simulation), 80% of each client's share.
    let plan = Plan::new(Partitioner::Dirichlet { alpha: 0.3 }, &labels, 3, 30, 4).unwrap();
    for record in &outcome.records {
        let expected: u64 = record
            .participants
            .iter()
            .map(|id| {
                let k: usize = id.strip_prefix("sim-").unwrap().parse().unwrap();
                let n = plan.indices(k).len();
                // (Dataset::split's rounding, both parts kept non-empty.)
                let train =
                    ((0.8 * n as f64).round() as usize).clamp(1.min(n), n.saturating_sub(1).max(1));
                train as u64
            })
            .sum();
        assert_eq!(record.examples, expected, "round {}", record.round);
    }
    // A partition of synthetic data is refused: its generator splits it.
    let sim = Simulation {
        partition: Some("iid".into()),
        ..simulation_of(task(1, 2, serde_json::json!({})), 5, 1, 4, "uniform")
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let e = runtime
        .block_on(simulation::run(&sim, &mut |_| {}))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("split among clients by its generator"),
        "{e}"
    );
}

/// `hora-server simulate TASK --clients 12 --seed SEED …` with `extra` arguments.
fn simulate_command(task: &std::path::Path, seed: u64, extra: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new(binary("hora-server"));
    command
        .arg("simulate")
        .arg(task)
        .args([
            "--clients",
            "12",
            "--workers",
            "2",
            "--seed",
            &seed.to_string(),
        ])
        .args([
            "--profile",
            "heterogeneous:dropout=0.2",
            "--evaluate-clients",
            "6",
        ])
        .args(extra);
    command
}

/// The history without its wall-clock column (the one thing a resumed run may not repeat).
fn simulated_history(path: &std::path::Path) -> Vec<String> {
    let csv = std::fs::read_to_string(path).unwrap();
    csv.lines()
        .map(|line| {
            let mut fields: Vec<&str> = line.split(',').collect();
            fields.remove(4); // wall_time_s
            fields.join(",")
        })
        .collect()
}

#[test]
fn a_simulation_killed_mid_run_resumes_from_its_checkpoint_to_the_same_model() {
    use std::io::BufRead;
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    // Top-k compression: each client's error-feedback residual carries over between its rounds,
    // so a resumed run must have every client's state as it was.
    let extra = serde_json::json!({
        "compression": {"values": "int8", "top_k": 0.2},
        "round_deadline_secs": 60,
    });
    std::fs::write(path.join("task.json"), task(6, 4, extra).to_string()).unwrap();
    let arg = |s: &str| std::ffi::OsStr::from_bytes(s.as_bytes()).to_owned();
    let file = |name: &str| path.join(name).into_os_string();
    let finish = |checkpoint: Option<&str>, tag: &str| {
        let mut extra = vec![arg("--history"), file(&format!("{tag}.csv"))];
        extra.extend([arg("--model"), file(&format!("{tag}.safetensors"))]);
        if let Some(c) = checkpoint {
            extra.extend([arg("--checkpoint"), file(c)]);
        }
        let refs: Vec<&std::ffi::OsStr> = extra.iter().map(|a| a.as_os_str()).collect();
        let out = simulate_command(&path.join("task.json"), 9, &refs)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };
    finish(None, "plain");
    finish(Some("uninterrupted"), "uninterrupted");

    // Killed once the third round's row is out, then the same command again.
    let checkpoint = [arg("--checkpoint"), file("killed")];
    let refs: Vec<&std::ffi::OsStr> = checkpoint.iter().map(|a| a.as_os_str()).collect();
    let mut child = simulate_command(&path.join("task.json"), 9, &refs)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    loop {
        let line = lines
            .next()
            .expect("a row of round 3 before the end")
            .unwrap();
        seen.push(line.clone());
        let mut words = line.split_whitespace();
        if words.next() == Some("3") && words.nth(1).is_some_and(|o| o == "published") {
            break;
        }
        assert!(!line.starts_with("done"), "{seen:?}");
    }
    // SAFETY: kill(2) of the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let _ = child.wait();
    let resumed = finish(Some("killed"), "killed");
    // It went on from a checkpoint, not from the start.
    assert!(
        !resumed.lines().any(|l| l.trim_start().starts_with("1 ")),
        "{resumed}"
    );

    let model = |tag: &str| {
        let file = path.join(format!("{tag}.safetensors"));
        hora_common::model::Model::read_file(&file, &Default::default())
            .unwrap()
            .digest()
    };
    assert_eq!(
        model("uninterrupted"),
        model("plain"),
        "a checkpoint changes nothing"
    );
    assert_eq!(model("killed"), model("uninterrupted"), "the resumed model");
    let history = simulated_history(&path.join("uninterrupted.csv"));
    assert_eq!(
        history.len(),
        1 + history
            .iter()
            .filter(|l| l.contains(",published,") || l.contains(",abandoned,"))
            .count()
    );
    assert!(history.len() >= 7, "{history:?}");
    assert_eq!(simulated_history(&path.join("killed.csv")), history);
    assert_eq!(simulated_history(&path.join("plain.csv")), history);

    // A checkpoint is its simulation's own: another seed is refused, saying so.
    let out = simulate_command(&path.join("task.json"), 10, &refs)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("checkpoint of another simulation"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
