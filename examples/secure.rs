//! Secure aggregation end to end, with real processes: a `hora-server` and N `hora-client
//! train` processes on Synthetic-IID shards run one round under SecAgg+, some clients vanishing
//! after a chosen stage (`--drop advertise=2,share-keys=2,masked-input=2`: the first two clients
//! crash after advertising their keys, the next two after sharing them, the next two after
//! uploading their masked update). Then the same round is run again *without* secure
//! aggregation by exactly the clients whose updates the secure round summed (same shards, seeds
//! and initial model), and the two published models are compared: they must agree within the
//! quantisation bound the protocol states, `clients / (scale × total examples)` per weight.
//!
//! With `--evaluate` the secure task also evaluates its models (federated evaluation inside the
//! masked inputs) and runs a second round, whose clients evaluate round 1's model on their
//! held-out shards: what the server recorded, having learnt only the sum, is compared with the
//! same evaluation computed here from every shard.
//!
//! With `--replicas 3` the secure round runs on three replicas sharing a PostgreSQL database
//! started here (and a blob directory), the clients spread over them: every replica takes
//! messages of every stage, and the leader alone moves the stages on. The result then says how
//! many advertisements and masked inputs each replica took.
//!
//! `cargo run --release --example secure -- --clients 20 --drop share-keys=2` prints the round
//! history and a `RESULT {json}` line.

#[path = "support/federation.rs"]
mod federation;

/// The throwaway PostgreSQL server the store's tests start, this same file.
#[allow(dead_code)]
#[path = "../server/src/store/postgres/test_server.rs"]
mod test_server;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use hora_client::data::synthetic::{self, SyntheticConfig};
use hora_client::network::{Architecture, Network};
use hora_client::supervised::{evaluate, DeviceData};
use hora_common::model::Model;
use hora_common::secagg::Quantiser;
use hora_common::wire::{
    CreateTask, EvaluationConfig, OptimizerConfig, RoundOutcome, RoundRecord,
    SecureAggregationConfig, StrategyConfig, TrainingConfig, UpdateBounds,
};
use tch::Device;

use federation::Federation;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 20)]
    clients: usize,
    /// Clients that crash, by the stage they complete first: `advertise=N,share-keys=N,masked-input=N`.
    #[arg(long, default_value = "")]
    drop: String,
    /// The task's minimum clients per round.
    #[arg(long)]
    min_clients: Option<u32>,
    /// Deadline of each key-exchange stage.
    #[arg(long, default_value_t = 8)]
    stage_secs: u64,
    /// Time for training once the keys are exchanged; also how long advertising waits for the
    /// selected clients after the round opens, which must cover twenty client processes
    /// starting at once on a loaded two-core machine.
    #[arg(long, default_value_t = 20)]
    round_deadline_secs: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train only these tensors (names or `*` patterns; repeat for several): the task's
    /// `trainable`, in both rounds.
    #[arg(long)]
    trainable: Vec<String>,
    /// Federated evaluation in the secure task, over a second round (no dropouts).
    #[arg(long, conflicts_with = "drop")]
    evaluate: bool,
    /// Run the secure round on this many replicas sharing a PostgreSQL database (the plain
    /// round it is compared with runs on one server).
    #[arg(long, default_value_t = 1)]
    replicas: usize,
}

/// What each replica of a secure round took: advertisements and masked inputs accepted.
#[derive(Default)]
struct Taken {
    advertised: Vec<u64>,
    masked: Vec<u64>,
}

/// How many `POST …/secagg/…/{stage}` requests the metrics `text` count as answered 200.
fn accepted(text: &str, stage: &str) -> u64 {
    let route = format!("route=\"/v1/tasks/{{task}}/secagg/{{round}}/{{attempt}}/{stage}\"");
    text.lines()
        .filter(|l| {
            l.starts_with("hora_http_requests_total{")
                && l.contains(&route)
                && l.contains("method=\"POST\"")
                && l.contains("status=\"200\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn drops(spec: &str) -> Result<Vec<(String, usize)>> {
    spec.split(',')
        .filter(|s| !s.is_empty())
        .map(|part| {
            let (stage, n) = part
                .split_once('=')
                .context("--drop takes stage=count pairs")?;
            if !["advertise", "share-keys", "masked-input"].contains(&stage) {
                bail!("unknown stage `{stage}`");
            }
            Ok((stage.to_string(), n.parse()?))
        })
        .collect()
}

/// Runs one round of `task` with the clients `indices`; `secure` turns secure aggregation on.
/// With `store` (a PostgreSQL URL), on `args.replicas` replicas sharing it.
async fn federation(
    args: &Args,
    initial: &Model,
    arch: &Architecture,
    data: &str,
    indices: &[(usize, Option<String>)],
    secure: bool,
    store: Option<&str>,
) -> Result<(Vec<RoundRecord>, Model, Taken)> {
    let mut fed = match store {
        Some(store) => {
            let fed = Federation::start_replicas(args.replicas, store, 5)?;
            fed.wait_serving(Duration::from_secs(60)).await?;
            fed
        }
        None => Federation::start()?,
    };
    let digest = fed.upload_model(initial).await?;
    let task = "secure";
    let n = indices.len() as u32;
    let evaluate = secure && args.evaluate;
    let rounds = if evaluate { 2 } else { 1 };
    fed.create_task(&CreateTask {
        parent: None,
        trainable: (!args.trainable.is_empty()).then(|| args.trainable.clone()),
        evaluation: evaluate.then_some(EvaluationConfig {
            every: 1,
            clients: n,
            fraction: None,
            held_out: false,
            deadline_secs: None,
        }),
        compression: None,
        id: task.into(),
        initial_model: digest,
        model: arch.to_kind(),
        strategy: StrategyConfig::FedAvg,
        rounds,
        min_clients: args.min_clients.unwrap_or(3).min(n),
        target_clients: n,
        over_selection: 0.0,
        round_deadline_secs: args.round_deadline_secs,
        training: TrainingConfig {
            epochs: 1,
            batch_size: 10,
            learning_rate: 0.01,
            optimizer: OptimizerConfig::Sgd { momentum: 0.0 },
            ..Default::default()
        },
        secure_aggregation: secure.then(|| SecureAggregationConfig {
            stage_secs: args.stage_secs,
            ..Default::default()
        }),
        // The comparison is of the aggregation alone: secure rounds have no adaptive bounds, so
        // the plain round has none either.
        update_bounds: UpdateBounds {
            adaptive_norm_factor: None,
            adaptive_weight_factor: None,
            ..Default::default()
        },
        differential_privacy: None,
        asynchronous: None,
    })
    .await?;
    for (k, drop) in indices {
        let mut flags = vec!["--seed".to_string(), k.to_string()];
        if let Some(stage) = drop {
            flags.extend(["--drop-out-after".into(), stage.clone()]);
        }
        let name = fed.spawn_shard_client(task, data, *k, &flags).await?;
        if drop.is_some() {
            fed.allow_failure(&name);
        }
    }
    fed.wait_round(task, rounds, Duration::from_secs(300))
        .await?;
    fed.wait_clients(Duration::from_secs(60))?;
    let history: Vec<RoundRecord> = fed.rounds(task).await?;
    let model = fed.round_model(task, 1).await?;
    let mut taken = Taken::default();
    for url in &fed.urls {
        let text = fed.metrics_at(url).await?;
        taken.advertised.push(accepted(&text, "advertise"));
        taken.masked.push(accepted(&text, "masked"));
    }
    Ok((history, model, taken))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = Args::parse();
    tch::set_num_threads(1);
    let config = SyntheticConfig::iid(args.clients, args.seed);
    let data = config.to_string();
    let arch = Architecture::Logreg {
        inputs: config.dim,
        classes: config.classes,
    };
    tch::manual_seed(args.seed as i64);
    let initial = Network::builtin(&arch, Device::Cpu)?.weights()?;

    let mut plan: Vec<(usize, Option<String>)> = (0..args.clients).map(|k| (k, None)).collect();
    let mut next = 0;
    for (stage, count) in drops(&args.drop)? {
        for slot in plan.iter_mut().skip(next).take(count) {
            slot.1 = Some(stage.clone());
        }
        next += count;
    }
    // (Started first, stopped last: the replicas' database.)
    let postgres = (args.replicas > 1).then(test_server::TestServer::start);
    let store = postgres.as_ref().map(test_server::TestServer::url);
    let (history, secure_model, taken) =
        federation(&args, &initial, &arch, &data, &plan, true, store.as_deref()).await?;
    if args.replicas > 1 {
        println!(
            "advertisements taken by each replica: {:?}; masked inputs: {:?}",
            taken.advertised, taken.masked
        );
    }
    for r in &history {
        let outcome = match &r.outcome {
            RoundOutcome::Published => "published".to_string(),
            RoundOutcome::Abandoned { reason } => format!("abandoned: {reason}"),
        };
        println!(
            "round {} attempt {}: {} clients summed, {} dropped, {} examples — {outcome}",
            r.round,
            r.attempt,
            r.participants.len(),
            r.dropped.len(),
            r.examples
        );
    }
    let published = history
        .iter()
        .find(|r| r.outcome == RoundOutcome::Published)
        .context("no published round")?;
    let evaluation = match args.evaluate {
        true => Some(compare_evaluation(
            &args,
            &arch,
            &config,
            published,
            &secure_model,
        )?),
        false => None,
    };

    // The plain round of exactly the clients the secure round summed.
    let ids = published.participants.len();
    let summed: Vec<(usize, Option<String>)> = plan
        .iter()
        .filter(|(_, d)| d.as_deref().is_none_or(|s| s == "masked-input"))
        .map(|(k, _)| (*k, None))
        .collect();
    if summed.len() != ids {
        bail!(
            "the secure round summed {ids} clients; {} should have survived",
            summed.len()
        );
    }
    let (plain_history, plain_model, _) =
        federation(&args, &initial, &arch, &data, &summed, false, None).await?;
    let plain = plain_history
        .iter()
        .find(|r| r.outcome == RoundOutcome::Published)
        .context("the plain round was not published")?;

    let quantiser = Quantiser::for_round(
        1.0,
        SecureAggregationConfig::default().max_weight,
        args.clients,
    )?;
    let bound = quantiser.error_bound(ids, published.examples);
    let max_diff = secure_model
        .data()
        .iter()
        .zip(plain_model.data())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "secure vs plain FedAvg of the same {ids} clients ({} vs {} examples): max |difference| {max_diff:.3e}, \
         stated quantisation bound {bound:.3e} (+ f32 rounding)",
        published.examples, plain.examples
    );
    println!(
        "RESULT {}",
        serde_json::json!({
            "attempts": history.len(),
            "abandoned": history.iter().filter(|r| r.outcome != RoundOutcome::Published).count(),
            "summed": ids,
            "examples": published.examples,
            "plain_examples": plain.examples,
            "max_diff": max_diff,
            "bound": bound,
            "tensors": secure_model.tensors().len(),
            "model_tensors": initial.tensors().len(),
            "evaluation": evaluation,
            "replica_advertised": taken.advertised,
            "replica_masked": taken.masked,
        })
    );
    Ok(())
}

/// Round 1's federated evaluation (made by round 2's clients inside their masked inputs) next
/// to the same evaluation of round 1's model computed here on every client's held-out shard,
/// and the bound the quantisation of the slots keeps the two within.
fn compare_evaluation(
    args: &Args,
    arch: &Architecture,
    config: &SyntheticConfig,
    round: &RoundRecord,
    model: &Model,
) -> Result<serde_json::Value> {
    let summary = round
        .evaluation
        .context("round 1 has no federated evaluation")?;
    let mut net = Network::builtin(arch, Device::Cpu)?;
    let (mut n, mut loss, mut correct) = (0u64, 0.0, 0.0);
    for k in 0..args.clients {
        let shard = synthetic::shard(config, k)?;
        net.set_weights(model)?;
        let test = DeviceData::new(&shard.test, Device::Cpu)?;
        let own = evaluate(&mut net, &test, 1024)?;
        n += own.examples;
        loss += own.examples as f64 * own.loss;
        correct += own.examples as f64 * own.accuracy;
    }
    let quantiser = Quantiser::for_round(
        SecureAggregationConfig::default().clip,
        SecureAggregationConfig::default().max_weight,
        args.clients,
    )?;
    // Each client's rounding moves each slot's sum by less than one unit of `clip · scale`.
    let unit = args.clients as f64 / (quantiser.clip * quantiser.scale * n as f64);
    println!(
        "round 1's federated evaluation, inside the masked inputs: accuracy {:?}, loss {:?} over {} examples of {} clients; \
         computed here: accuracy {:.6}, loss {:.6} over {n} examples",
        summary.accuracy,
        summary.loss,
        summary.examples,
        summary.clients,
        correct / n as f64,
        loss / n as f64
    );
    Ok(serde_json::json!({
        "clients": summary.clients,
        "examples": summary.examples,
        "accuracy": summary.accuracy,
        "loss": summary.loss,
        "expected_examples": n,
        "expected_accuracy": correct / n as f64,
        "expected_loss": loss / n as f64,
        "accuracy_bound": unit,
        "loss_bound": unit * hora_common::secagg::quantise::LOSS_CAP,
    }))
}
