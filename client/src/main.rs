//! `hora-client`: the edge binary.
//!
//! - `hora-client train`: enrol (once), then take part in a task's rounds until it ends,
//!   training on local data with the built-in trainer. A progress bar while training, one line
//!   per round.
//! - `hora-client config check train|sync …`: the options a command would run with, and where
//!   each came from.
//!
//! Each option is a flag, a `HORA_*` environment variable and a key of the `--config` TOML file;
//! the first of those that says something wins, else the default (`hora_common::config`).
//! - `hora-client init`: initial weights for a task (a built-in architecture, or the parameters
//!   of a TorchScript module), and the `model` JSON to create the task with.
//!
//! - `hora-client sync`: a datacenter worker of a synchronous allreduce job: meet the other
//!   workers (at the server, or from `--peers`), then train a built-in model on this worker's
//!   shard of the data, averaging gradients with the others every step over a TCP ring.
//!
//! Exit status: 0 when the task ended (or `--rounds` were done), 2 when the server refused us
//! (credentials, unknown task, conflicts), 1 for everything else.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use hora_client::data::DataSource;
use hora_client::device::DeviceChoice;
use hora_client::network::{Architecture, Network};
use hora_client::transport::RetryPolicy;
use hora_client::{
    Client, ClientConfig, ClientError, Paced, RoundOutcome, RoundReport, SupervisedTrainer, Trainer,
};
use hora_collective::{LrScaling, UseNccl};
use hora_common::config::{self as layers, Layered};
use hora_common::logging;
use hora_common::tls::Identity;
use hora_common::wire::ModelKind;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

/// Environment variables renamed for one naming scheme across Hora's programs: (old, new).
const RENAMED_ENV: [(&str, &str); 1] = [("HORA_LISTEN", "HORA_RING_LISTEN")];

#[derive(Parser)]
#[command(
    name = "hora-client",
    version = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("HORA_COMMIT"), ")"),
    about = "Hora federated-learning client"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    logging: logging::LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Take part in a task's rounds until it ends.
    Train(Box<TrainArgs>),
    /// Write a task's initial weights.
    Init(InitArgs),
    /// Train in lock-step with the other workers of a sync job (ring allreduce).
    Sync(Box<SyncArgs>),
    /// Check a configuration before running with it.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    #[command(flatten)]
    Docs(layers::DocsCommand),
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print every option of `train` or `sync` as it would run (given the same flags,
    /// environment and --config file): its value and where it came from (flag, environment,
    /// file or default), secrets masked.
    Check {
        /// Print JSON instead of text: {"key": {"value": …, "source": "flag", "from": "--task"}}.
        #[arg(long, global = true)]
        json: bool,
        #[command(subcommand)]
        command: CheckCommand,
    },
}

#[derive(Subcommand)]
enum CheckCommand {
    /// The options of `hora-client train`.
    Train(Box<TrainArgs>),
    /// The options of `hora-client sync`.
    Sync(Box<SyncArgs>),
}

/// The update rule of a sync job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Optimizer {
    Sgd,
    Adam,
}

/// `sync`'s options. Each is a flag, a `HORA_*` variable, or a key of the `--config` file.
#[derive(Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SyncArgs {
    /// TOML file with any of these options (keys as the long flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The server to meet the other workers at, `https://host:port` (or give --peers).
    #[arg(long, env = "HORA_SERVER")]
    server: Option<String>,
    /// CA certificate the server's certificate chains to.
    #[arg(long, env = "HORA_CA")]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) for servers that require mutual TLS.
    #[arg(long, env = "HORA_CLIENT_CERT", requires = "key")]
    cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "HORA_CLIENT_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// The sync job (`hora-server admin sync-create`).
    #[arg(long, env = "HORA_JOB")]
    job: Option<String>,
    /// The job's token, printed when the job was created.
    #[arg(long, env = "HORA_SYNC_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Read the job's token from this file (first line) instead.
    #[arg(long, env = "HORA_SYNC_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Instead of the server: every worker's ring address by rank, `host:port,host:port,…`.
    #[arg(long, env = "HORA_PEERS", value_delimiter = ',')]
    peers: Option<Vec<String>>,
    /// With --peers: a secret shared by every worker of the job (16 characters at least, e.g.
    /// `openssl rand -hex 16`); only workers that know it can join the ring. Prefer the
    /// variable or the config file: other users can read command lines. Not used with
    /// --server, which gives every world a fresh random session.
    #[arg(long, env = "HORA_SYNC_SECRET", hide_env_values = true)]
    session_secret: Option<String>,
    /// This worker's rank [default: from mpirun or Slurm, else assigned by the server].
    #[arg(long, env = "HORA_RANK")]
    rank: Option<u32>,
    /// Number of workers [default: from mpirun or Slurm, or the length of --peers].
    #[arg(long, env = "HORA_WORLD_SIZE")]
    world_size: Option<u32>,
    /// Where to accept the ring neighbour's connection (was --listen and HORA_LISTEN).
    #[arg(
        long,
        alias = "listen",
        env = "HORA_RING_LISTEN",
        default_value = "127.0.0.1:0"
    )]
    ring_listen: String,
    /// The host the other workers reach this one at [default: the --ring-listen address].
    #[arg(long, env = "HORA_ADVERTISE")]
    advertise: Option<String>,
    /// Seconds a silent worker is given before the others stop and name it.
    #[arg(long, env = "HORA_TIMEOUT", default_value_t = 30)]
    timeout: u64,
    /// Give up on an unreachable server after this many seconds of retries.
    #[arg(long, env = "HORA_RETRY_FOR", default_value_t = 600)]
    retry_for: u64,
    /// Built-in architecture: logreg, mlp or cnn.
    #[arg(long, env = "HORA_MODEL")]
    model: Option<String>,
    /// Its parameters as JSON, e.g. '{"inputs":784,"hidden":[200,200],"classes":10}'.
    #[arg(long, env = "HORA_MODEL_PARAMS", default_value = "{}")]
    params: String,
    /// The training data (every worker reads it and trains on its slice of each global batch):
    /// FILE.csv[?label=COLUMN], mnist:DIR or synthetic-iid:clients=1,seed=0.
    #[arg(long, env = "HORA_DATA")]
    data: Option<String>,
    /// Fraction of CSV data held out for the accuracy rank 0 reports.
    #[arg(long, env = "HORA_HOLDOUT", default_value_t = 0.2)]
    holdout: f64,
    /// Passes over the training data.
    #[arg(long, env = "HORA_EPOCHS", default_value_t = 10)]
    epochs: u64,
    /// Samples per worker per pass; the global batch is world size × this.
    #[arg(long, env = "HORA_BATCH_SIZE", default_value_t = 32)]
    batch_size: usize,
    /// Learning rate before scaling.
    #[arg(long, env = "HORA_LEARNING_RATE", default_value_t = 0.05)]
    learning_rate: f64,
    /// linear (× world size, Horovod's rule) or none.
    #[arg(long, env = "HORA_LR_SCALING", value_enum, default_value_t = LrScaling::Linear)]
    lr_scaling: LrScaling,
    /// sgd or adam.
    #[arg(long, env = "HORA_OPTIMIZER", value_enum, default_value_t = Optimizer::Sgd)]
    optimizer: Optimizer,
    /// SGD momentum.
    #[arg(long, env = "HORA_MOMENTUM", default_value_t = 0.9)]
    momentum: f64,
    /// L2 weight decay.
    #[arg(long, env = "HORA_WEIGHT_DECAY", default_value_t = 0.0)]
    weight_decay: f64,
    /// Local passes whose gradients are accumulated before each allreduce.
    #[arg(long, env = "HORA_BACKWARD_PASSES_PER_STEP", default_value_t = 1)]
    backward_passes_per_step: u32,
    /// Tensors are fused into buffers of up to this many MiB per allreduce.
    #[arg(long, env = "HORA_FUSION_MIB", default_value_t = 64)]
    fusion_mib: usize,
    /// Pipelined pieces of this many KiB on the ring.
    #[arg(long, env = "HORA_SUB_CHUNK_KIB", default_value_t = 256)]
    sub_chunk_kib: usize,
    /// Send gradients as half precision (half the bytes; about 3 significant digits).
    #[arg(long, env = "HORA_FP16")]
    fp16: bool,
    /// Leave the ring's frames unsealed (no AES-256-GCM after the handshake): only on a network
    /// that nobody else can reach, and on every worker of the job alike.
    #[arg(long, env = "HORA_RING_UNSEALED")]
    ring_unsealed: bool,
    /// Seed of the initialisation and of the shuffling (the same on every worker).
    #[arg(long, env = "HORA_SEED", default_value_t = 0)]
    seed: u64,
    /// auto (cuda:LOCAL_RANK when there are GPUs), cpu, cuda or cuda:N.
    #[arg(long, env = "HORA_DEVICE", default_value = "auto")]
    device: DeviceChoice,
    /// auto (NCCL when every worker trains on a GPU and can load it), on (fail when one
    /// cannot, naming it), off (the ring, on each worker's device).
    #[arg(long, env = "HORA_NCCL", value_enum, default_value_t = UseNccl::Auto)]
    nccl: UseNccl,
    /// CPU threads for libtorch [default: libtorch's choice].
    #[arg(long, env = "HORA_THREADS")]
    threads: Option<i32>,
    /// Rank 0 writes checkpoints here; a restarted job resumes from the newest.
    #[arg(long, env = "HORA_CHECKPOINT_DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps as well as at each epoch's end (0: at epochs only).
    #[arg(long, env = "HORA_CHECKPOINT_EVERY", default_value_t = 0)]
    checkpoint_every: u64,
    /// Rank 0 writes the trained weights here (safetensors).
    #[arg(long, env = "HORA_SAVE")]
    save: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, env = "HORA_NO_PROGRESS")]
    no_progress: bool,
    /// Work in an elastic job (`hora-server admin sync-create --min-world-size`): when a worker
    /// is lost, the others roll back to their last commit and go on in a smaller world; workers
    /// started later join at a commit. Needs --server; --world-size is the job's largest world.
    #[arg(long, env = "HORA_ELASTIC")]
    elastic: bool,
    /// An elastic job commits its training state in memory every this many steps (and at each
    /// epoch's end): what survivors roll back to, and when joining workers are taken in.
    #[arg(long, env = "HORA_COMMIT_EVERY", default_value_t = 20)]
    commit_every: u64,
}

impl SyncArgs {
    /// These options layered with the `--config` file (`matches` are those they came from).
    fn layered(&self, matches: &ArgMatches) -> anyhow::Result<Layered<SyncArgs>> {
        let renamed = [("listen", "ring_listen")];
        let mut layered = layers::layer(self, matches, self.config.as_deref(), &renamed)?;
        layered.value.config = self.config.clone();
        Ok(layered)
    }
}

/// How a sync worker meets the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Meet {
    /// At the server (`server`, `ca`, `job`, `token`).
    Server,
    /// At the addresses of `peers`.
    Peers,
    /// Neither given: where torchrun put the ring, if it did.
    Launcher,
}

/// What `sync` would refuse before it starts, checked: the job's token (a secret and its file),
/// and how the worker meets the others (`--server` or `--peers`, the higher layer's).
fn check_sync(layered: &Layered<SyncArgs>) -> anyhow::Result<(Option<String>, Meet)> {
    let args = &layered.value;
    let token = layered
        .secret("token", args.token.clone(), args.token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    let meet = match layered
        .higher(
            ("peers", args.peers.is_some()),
            ("server", args.server.is_some()),
        )
        .map_err(anyhow::Error::msg)?
    {
        Some(true) => Meet::Peers,
        Some(false) => {
            required(args.ca.as_ref(), "ca")?;
            required(args.job.as_ref(), "job")?;
            required(token.as_ref(), "token")?;
            Meet::Server
        }
        None => Meet::Launcher,
    };
    let params: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&args.params).context("--params must be a JSON object")?;
    Architecture::from_builtin(required(args.model.as_deref(), "model")?, &params)?;
    required(args.data.as_deref(), "data")?.parse::<DataSource>()?;
    Ok((token, meet))
}

/// `train`'s options. Each is a flag, a `HORA_*` variable, or a key of the `--config` file.
#[derive(Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainArgs {
    /// TOML file with any of these options (keys as the long flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The server, `https://host:port`; several, comma-separated, are tried in turn when one
    /// cannot be reached (servers of one deployment, or a standby).
    #[arg(long, env = "HORA_SERVER")]
    server: Option<String>,
    /// CA certificate the server's certificate chains to (the dev CA: <data dir>/certs/ca.pem).
    #[arg(long, env = "HORA_CA")]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) for servers that require mutual TLS.
    #[arg(long, env = "HORA_CLIENT_CERT", requires = "key")]
    cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "HORA_CLIENT_KEY", requires = "cert")]
    key: Option<PathBuf>,
    /// The task to train.
    #[arg(long, env = "HORA_TASK")]
    task: Option<String>,
    /// One-time enrolment token (`hora-server admin enrol`); needed only the first time.
    #[arg(long, env = "HORA_ENROLMENT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Read the enrolment token from this file (first line) instead.
    #[arg(long, env = "HORA_ENROLMENT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Credentials, cached models and the round in progress.
    #[arg(long, env = "HORA_STATE_DIR", default_value = "hora-client-state")]
    state_dir: PathBuf,
    /// A label operators see (host name, site).
    #[arg(long, env = "HORA_LABEL")]
    label: Option<String>,
    /// Local data: FILE.csv[?label=COLUMN], mnist:DIR, synthetic:alpha=1,beta=1,clients=10,seed=0
    /// or synthetic-iid:clients=10,seed=0.
    #[arg(long, env = "HORA_DATA")]
    data: Option<String>,
    /// This client's shard of a synthetic dataset (0-based).
    #[arg(long, env = "HORA_CLIENT_INDEX")]
    client_index: Option<usize>,
    /// Fraction of CSV data held out to report accuracy on.
    #[arg(long, env = "HORA_HOLDOUT", default_value_t = 0.2)]
    holdout: f64,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, env = "HORA_DEVICE", default_value = "auto")]
    device: DeviceChoice,
    /// CPU threads for libtorch [default: libtorch's choice].
    #[arg(long, env = "HORA_THREADS")]
    threads: Option<i32>,
    /// Stop after this many rounds [default: until the task ends].
    #[arg(long, env = "HORA_ROUNDS")]
    rounds: Option<u64>,
    /// Give up on an unreachable server after this many seconds of retries.
    #[arg(long, env = "HORA_RETRY_FOR", default_value_t = 600)]
    retry_for: u64,
    /// Seed of libtorch's generator (initialisation and shuffling).
    #[arg(long, env = "HORA_SEED")]
    seed: Option<i64>,
    /// No progress bar.
    #[arg(long, env = "HORA_NO_PROGRESS")]
    no_progress: bool,
    /// Append one JSON line per round to this file: where the round's time went (milliseconds
    /// per phase: wait, join, download, train, record, seal, upload, finish) and when the round
    /// was seen open and the update acknowledged (µs since the Unix epoch).
    #[arg(long, env = "HORA_TIMINGS")]
    timings: Option<PathBuf>,
    /// Make every local training take at least this many seconds: simulates a slower device
    /// (drills and benchmarks of a fleet whose speeds differ).
    #[arg(long, env = "HORA_MIN_TRAIN_SECS")]
    min_train_secs: Option<f64>,
    /// Fault drill for secure aggregation: vanish right after this stage of the first round
    /// (advertise, share-keys or masked-input), as a crashed device would.
    #[arg(long, hide = true, value_parser = parse_stage)]
    #[serde(skip)]
    drop_out_after: Option<hora_common::secagg::Stage>,
}

fn parse_stage(s: &str) -> Result<hora_common::secagg::Stage, String> {
    use hora_common::secagg::Stage;
    match s {
        "advertise" => Ok(Stage::Advertised),
        "share-keys" => Ok(Stage::SharedKeys),
        "masked-input" => Ok(Stage::MaskedInput),
        _ => Err("one of advertise, share-keys, masked-input".into()),
    }
}

impl TrainArgs {
    /// These options layered with the `--config` file (`matches` are those they came from).
    fn layered(&self, matches: &ArgMatches) -> anyhow::Result<Layered<TrainArgs>> {
        let mut layered = layers::layer(self, matches, self.config.as_deref(), &[])?;
        layered.value.config = self.config.clone();
        layered.value.drop_out_after = self.drop_out_after;
        Ok(layered)
    }
}

/// What `train` would refuse before it starts, checked; the enrolment token (a secret and its
/// file).
fn check_train(layered: &Layered<TrainArgs>) -> anyhow::Result<Option<String>> {
    let args = &layered.value;
    let token = layered
        .secret("token", args.token.clone(), args.token_file.as_deref())
        .map_err(anyhow::Error::msg)?;
    required(args.server.as_ref(), "server")?;
    required(args.ca.as_ref(), "ca")?;
    required(args.task.as_ref(), "task")?;
    required(args.data.as_deref(), "data")?.parse::<DataSource>()?;
    if let Some(secs) = args
        .min_train_secs
        .filter(|s| !(s.is_finite() && *s >= 0.0))
    {
        anyhow::bail!("--min-train-secs must be a number of seconds ≥ 0, not {secs}");
    }
    Ok(token)
}

#[derive(Args)]
struct InitArgs {
    /// Built-in architecture: logreg, mlp or cnn.
    #[arg(
        long,
        conflicts_with = "torchscript",
        required_unless_present = "torchscript"
    )]
    model: Option<String>,
    /// Its parameters as JSON, e.g. '{"inputs":60,"classes":10}'.
    #[arg(long, default_value = "{}")]
    params: String,
    /// A TorchScript module (`torch.jit.save`): its current parameters become the weights.
    #[arg(long)]
    torchscript: Option<PathBuf>,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    seed: i64,
    /// Where to write the weights (safetensors).
    #[arg(short, long)]
    output: PathBuf,
}

fn required<T>(value: Option<T>, flag: &str) -> anyhow::Result<T> {
    value.with_context(|| {
        format!(
            "--{flag} is required (or HORA_{} / `{}` in the --config file)",
            flag.replace('-', "_").to_uppercase(),
            flag.replace('-', "_")
        )
    })
}

/// A round's line for `--timings`.
fn timings_line(r: &RoundReport) -> String {
    let mut line = serde_json::json!({
        "round": r.round,
        "outcome": r.outcome.name(),
        "seen_unix_us": r.timings.seen_unix_us,
        "acked_unix_us": r.timings.acked_unix_us,
    });
    for (phase, time) in r.timings.phases() {
        line[format!("{phase}_ms")] = (time.as_secs_f64() * 1e3).into();
    }
    line.to_string()
}

fn summary(task: &str, r: &RoundReport) -> String {
    let metric =
        |name: &str, v: Option<f64>| v.map(|v| format!(" · {name} {v:.4}")).unwrap_or_default();
    let outcome = match &r.outcome {
        RoundOutcome::Uploaded { accepted } | RoundOutcome::Resumed { accepted } => {
            let resumed = matches!(r.outcome, RoundOutcome::Resumed { .. });
            let count = accepted
                .map(|a| format!(", {a} accepted so far"))
                .unwrap_or_default();
            format!(
                "uploaded{}{count}",
                if resumed {
                    " (an update trained earlier)"
                } else {
                    ""
                }
            )
        }
        RoundOutcome::Skipped => "skipped (deadline)".to_string(),
        RoundOutcome::Missed { reason } => format!("missed: {reason}"),
        RoundOutcome::NotSelected { reason } => format!("not selected: {reason}"),
        RoundOutcome::Abandoned { reason } => format!("abandoned, will retry: {reason}"),
    };
    let attempt = match r.attempt {
        0 => String::new(),
        a => format!(" (attempt {a})"),
    };
    format!(
        "{task} round {}{attempt} · {} examples{}{} · trained {:.1} s · {outcome}",
        r.round,
        r.num_examples,
        metric("loss", r.metrics.loss),
        metric("accuracy", r.metrics.accuracy),
        r.train_time.as_secs_f64()
    )
}

async fn train(layered: Layered<TrainArgs>) -> anyhow::Result<()> {
    let token = check_train(&layered)?;
    let args = layered.value;
    let server = required(args.server, "server")?;
    let ca = required(args.ca, "ca")?;
    let task = required(args.task, "task")?;
    let source: DataSource = required(args.data, "data")?.parse()?;
    let device = args.device.resolve()?;
    if let Some(t) = args.threads {
        tch::set_num_threads(t.max(1));
    }
    if let Some(seed) = args.seed {
        tch::manual_seed(seed);
    }
    let (train, test) = source.load(args.client_index, args.holdout)?;
    tracing::info!(
        train = train.len(),
        test = test.as_ref().map_or(0, |t| t.len()),
        ?device,
        "local data loaded"
    );
    let mut config = ClientConfig::new(server, ca, args.state_dir);
    config.label = args.label;
    config.identity = match (args.cert, args.key) {
        (Some(cert), Some(key)) => Some(Identity { cert, key }),
        _ => None,
    };
    config.retry = RetryPolicy {
        budget: Duration::from_secs(args.retry_for),
        ..RetryPolicy::default()
    };
    config.drop_out_after = args.drop_out_after;
    let client = Client::connect(config, token.as_deref()).await?;
    tracing::info!(client = client.id(), task = %task, "waiting for rounds");
    let supervised = SupervisedTrainer::new(train, test, device)?.with_seed(args.seed);
    let mut trainer: Box<dyn Trainer> = match args.min_train_secs {
        // (Checked by check_train.)
        Some(secs) => Box::new(Paced {
            inner: supervised,
            min: Duration::from_secs_f64(secs),
        }),
        None => Box::new(supervised),
    };

    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} samples · {msg} · {eta}")
            .expect("progress template")
            .progress_chars("=> "),
    );
    let progress_bar = bar.clone();
    let mut progress = move |p: hora_client::Progress| {
        progress_bar.set_length(p.total_samples);
        progress_bar.set_position(p.samples);
        progress_bar.set_prefix(format!("epoch {}/{}", p.epoch, p.epochs));
        progress_bar.set_message(format!("loss {:.4}", p.loss));
    };
    let mut timings = match &args.timings {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("opening the timings file {}", path.display()))?,
        ),
        None => None,
    };
    let summary_bar = bar.clone();
    let mut on_round = |r: &RoundReport| {
        summary_bar.finish_and_clear();
        summary_bar.reset();
        println!("{}", summary(&task, r));
        if let Some(file) = &mut timings {
            use std::io::Write;
            if let Err(e) = writeln!(file, "{}", timings_line(r)) {
                tracing::warn!(error = %e, "writing the round's timings failed");
            }
        }
    };
    let run = client
        .run(
            &task,
            &mut *trainer,
            args.rounds,
            &mut progress,
            &mut on_round,
        )
        .await?;
    bar.finish_and_clear();
    println!(
        "{task}: {} rounds contributed; the task is {:?}",
        run.rounds.len(),
        run.final_state
    );
    Ok(())
}

/// `config check train|sync`: the options as the command would run with them.
fn check(command: CheckCommand, json: bool, matches: &ArgMatches) -> anyhow::Result<()> {
    let report = match command {
        CheckCommand::Train(args) => {
            let layered = args.layered(matches)?;
            (layered.report(), check_train(&layered).map(drop))
        }
        CheckCommand::Sync(args) => {
            let layered = args.layered(matches)?;
            (layered.report(), check_sync(&layered).map(drop))
        }
    };
    // The options first, then what the command would refuse.
    println!("{}", layers::render(&report.0, json)?);
    report.1
}

fn init(args: InitArgs) -> anyhow::Result<()> {
    tch::manual_seed(args.seed);
    let (net, kind) = match (&args.model, &args.torchscript) {
        (Some(name), None) => {
            let params: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&args.params).context("--params must be a JSON object")?;
            let arch = Architecture::from_builtin(name, &params)?;
            (Network::builtin(&arch, tch::Device::Cpu)?, arch.to_kind())
        }
        (None, Some(path)) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let digest = hora_common::sha256_hex(&bytes);
            (
                Network::torchscript(path, tch::Device::Cpu)?,
                ModelKind::TorchScript {
                    module_digest: digest,
                },
            )
        }
        _ => bail!("give either --model or --torchscript"),
    };
    let weights = net.weights()?;
    weights
        .write_file(&args.output)
        .with_context(|| format!("writing {}", args.output.display()))?;
    println!(
        "weights: {} ({} parameters)",
        args.output.display(),
        weights.numel()
    );
    println!("digest: {}", weights.digest().to_hex());
    println!("model: {}", serde_json::to_string(&kind)?);
    Ok(())
}

fn sync(layered: Layered<SyncArgs>) -> anyhow::Result<()> {
    use hora_client::sync::worker::{self, Elastic, SyncTraining, Worlds};
    use hora_client::sync::ServerRendezvous;
    use hora_collective::ElasticMeeting;
    use hora_collective::{Algorithm, CommOptions, LaunchRank, Meeting, Wire};

    let (job_token, meet) = check_sync(&layered)?;
    let args = layered.value;
    if args.elastic && meet != Meet::Server {
        bail!("--elastic needs --server: an elastic job's worlds form at the server");
    }
    let launch = LaunchRank::detect(args.rank, args.world_size, |k| std::env::var(k).ok())?;
    let peers = match meet {
        Meet::Peers => args.peers,
        Meet::Server => None,
        // A job torchrun started on one host finds its ring by itself.
        Meet::Launcher => hora_collective::torchrun_peers(|k| std::env::var(k).ok())?,
    };
    let launch = LaunchRank {
        world_size: launch.world_size.or(peers.as_ref().map(|p| p.len() as u32)),
        ..launch
    };
    let device = match (args.device, launch.local_rank) {
        (DeviceChoice::Auto, Some(local)) if tch::Cuda::device_count() > 0 => {
            tch::Device::Cuda(local as usize % tch::Cuda::device_count() as usize)
        }
        (choice, _) => choice.resolve()?,
    };
    if let Some(t) = args.threads {
        tch::set_num_threads(t.max(1));
    }
    let name = required(args.model, "model")?;
    let params: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&args.params).context("--params must be a JSON object")?;
    let architecture = Architecture::from_builtin(&name, &params)?;
    let weight_decay = args.weight_decay;
    let algorithm = match args.optimizer {
        Optimizer::Sgd => Algorithm::Sgd {
            momentum: args.momentum,
            weight_decay,
        },
        Optimizer::Adam => Algorithm::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        },
    };
    let training = SyncTraining {
        architecture,
        data: required(args.data, "data")?.parse()?,
        holdout: args.holdout,
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.learning_rate,
        lr_scaling: args.lr_scaling,
        algorithm,
        backward_passes_per_step: args.backward_passes_per_step,
        seed: args.seed,
        device,
        fusion_bytes: args.fusion_mib << 20,
        nccl: args.nccl,
        checkpoint_dir: args.checkpoint_dir,
        checkpoint_every: args.checkpoint_every,
        save: args.save,
    };
    let options = CommOptions {
        sub_chunk_bytes: args.sub_chunk_kib.max(1) << 10,
        wire: if args.fp16 { Wire::F16 } else { Wire::F32 },
        // A day at most: longer is a hang in all but name (and would overflow deadlines).
        timeout: Duration::from_secs(args.timeout.clamp(1, 86_400)),
        seal_frames: !args.ring_unsealed,
        ..CommOptions::default()
    };

    let identity = match (args.cert, args.key) {
        (Some(cert), Some(key)) => Some(Identity { cert, key }),
        _ => None,
    };
    let (server, ca, job, token, rendezvous);
    let meeting = match peers {
        Some(peers) => Meeting::Peers {
            peers,
            secret: args.session_secret,
        },
        None => {
            server = required(args.server, "server")?;
            ca = required(args.ca, "ca")?;
            job = required(args.job, "job")?;
            token = required(job_token, "token")?;
            rendezvous = ServerRendezvous {
                server: &server,
                ca: &ca,
                identity: identity.as_ref(),
                job: &job,
                token: &token,
                timeout: options.timeout,
                retry_for: Duration::from_secs(args.retry_for),
            };
            Meeting::Server(&rendezvous)
        }
    };
    let worlds = match meeting {
        Meeting::Server(service) if args.elastic => Worlds::Elastic(Elastic {
            meeting: ElasticMeeting {
                service,
                listen: &args.ring_listen,
                advertise: args.advertise.as_deref(),
                max_world_size: launch.world_size.ok_or_else(|| {
                    anyhow::anyhow!("--elastic needs --world-size: the job's largest world")
                })?,
                options,
            },
            commit_every: args.commit_every,
        }),
        meeting => {
            let comm = worker::form_world(
                meeting,
                &launch,
                &args.ring_listen,
                args.advertise.as_deref(),
                options,
            )?;
            let (rank, size) = (comm.rank(), comm.size());
            // Tests and scripts read this line.
            let origin = if launch.rank.is_some() {
                launch.source
            } else {
                "the server"
            };
            println!("rank {rank} of {size} (rank from {origin}, device {device:?})");
            Worlds::Fixed(Box::new(comm))
        }
    };

    // Rank 0 of the current world shows the progress and the epochs (an elastic job's rank
    // changes from world to world).
    let rank = std::cell::Cell::new(match &worlds {
        Worlds::Fixed(comm) => comm.rank(),
        Worlds::Elastic(_) => u32::MAX,
    });
    let size = std::cell::Cell::new(0);
    let draw = |bar: &ProgressBar, rank: u32| {
        bar.set_draw_target(if args.no_progress || rank != 0 {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        })
    };
    let bar = ProgressBar::new(0);
    draw(&bar, rank.get());
    bar.set_style(
        ProgressStyle::with_template("step {pos}/{len} [{bar:30}] {eta}")
            .expect("progress template")
            .progress_chars("=> "),
    );
    let step_bar = bar.clone();
    let mut on_step = move |step: u64, total: u64| {
        step_bar.set_length(total);
        step_bar.set_position(step);
    };
    let epoch_bar = bar.clone();
    let mut on_epoch = |e: &worker::EpochReport| {
        if rank.get() == 0 {
            let accuracy = e
                .accuracy
                .map(|a| format!(" · accuracy {a:.4}"))
                .unwrap_or_default();
            epoch_bar.suspend(|| {
                println!(
                    "epoch {}/{} · loss {:.4}{accuracy} · {} samples · {:.1} s",
                    e.epoch,
                    e.epochs,
                    e.loss,
                    e.samples,
                    e.elapsed.as_secs_f64()
                )
            });
        }
    };
    let world_bar = bar.clone();
    let elastic = args.elastic;
    let mut on_world = |w: &worker::WorldReport| {
        rank.set(w.rank);
        size.set(w.size);
        draw(&world_bar, w.rank);
        if elastic {
            let recovered = w
                .recovered_in
                .map(|d| {
                    format!(
                        ", training again {} ms after losing a worker",
                        d.as_millis()
                    )
                })
                .unwrap_or_default();
            // Tests and scripts read this line.
            world_bar.suspend(|| {
                println!(
                    "world {}: rank {} of {} from step {} (learning rate {}, state {}){recovered}",
                    w.generation,
                    w.rank,
                    w.size,
                    w.step,
                    w.learning_rate,
                    w.digest.as_deref().unwrap_or_default()
                )
            });
        }
    };
    let report = match worker::train(
        &training,
        worlds,
        &mut on_step,
        &mut on_epoch,
        &mut on_world,
    ) {
        // A worker started (or retried by its launcher) after the job's training finished.
        Err(hora_client::sync::SyncError::Collective(
            hora_collective::CollectiveError::JobFinished(why),
        )) => {
            bar.finish_and_clear();
            println!("nothing to do: {why}");
            return Ok(());
        }
        report => report?,
    };
    bar.finish_and_clear();
    if let Some(step) = report.resumed_from {
        println!("resumed from step {step}");
    }
    println!(
        "rank {} done: {} steps on {} workers (learning rate {})",
        rank.get(),
        report.steps,
        size.get(),
        report.learning_rate
    );
    if elastic {
        println!(
            "{} commits, {:.2} ms each",
            report.commits,
            report.commit_time.as_secs_f64() * 1e3 / report.commits.max(1) as f64
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let renamed = layers::rename_env(&RENAMED_ENV);
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    logging::init(cli.logging.log_format, "info");
    layers::warn_renamed(&renamed);
    let cli_format = cli.logging.log_format;
    let matches = layers::leaf(&matches);
    let result = match cli.command {
        Command::Train(args) => args.layered(matches).and_then(|layered| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("starting the async runtime")
                .and_then(|rt| rt.block_on(train(layered)))
        }),
        Command::Init(args) => init(args),
        Command::Sync(args) => args.layered(matches).and_then(sync),
        Command::Config {
            command: ConfigCommand::Check { json, command },
        } => check(command, json, matches),
        Command::Docs(docs) => docs.run(Cli::command()).map_err(anyhow::Error::msg),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if let Some(ClientError::DroppedOut(stage)) = e.downcast_ref::<ClientError>() {
                // The drill's crash: no goodbye, no clean-up.
                eprintln!("fault drill: dropped out after the {stage:?} stage");
                return ExitCode::from(3);
            }
            logging::fatal(cli_format, &format!("{e:#}"));
            let refused = matches!(
                e.downcast_ref::<ClientError>(),
                Some(
                    ClientError::Unauthorized { .. }
                        | ClientError::NotFound { .. }
                        | ClientError::Conflict { .. }
                        | ClientError::Rejected { .. }
                )
            );
            ExitCode::from(if refused { 2 } else { 1 })
        }
    }
}
