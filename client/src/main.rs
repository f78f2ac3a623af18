//! `hora-client`: the edge binary.
//!
//! - `hora-client train`: enrol (once), then take part in a task's rounds until it ends,
//!   training on local data with the built-in trainer. A progress bar while training, one line
//!   per round. Options come from flags, then `HORA_*` environment variables, then a TOML file
//!   (`--config`), in that order.
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
use clap::{Args, Parser, Subcommand};
use hora_client::data::DataSource;
use hora_client::device::DeviceChoice;
use hora_client::network::{Architecture, Network};
use hora_client::transport::RetryPolicy;
use hora_client::{
    Client, ClientConfig, ClientError, Paced, RoundOutcome, RoundReport, SupervisedTrainer, Trainer,
};
use hora_common::logging;
use hora_common::tls::Identity;
use hora_common::wire::ModelKind;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

/// A secret given directly, or the first line of a file (kept off the command line, where other
/// local users can read it).
fn secret_or_file(
    value: Option<String>,
    file: Option<&std::path::Path>,
) -> anyhow::Result<Option<String>> {
    match (value, file) {
        (Some(v), _) => Ok(Some(v)),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the token file {}", path.display()))?;
            let token = text.lines().next().unwrap_or_default().trim().to_string();
            if token.is_empty() {
                anyhow::bail!("the token file {} is empty", path.display());
            }
            Ok(Some(token))
        }
        (None, None) => Ok(None),
    }
}

/// Takes each named option from `$file` where neither a flag nor the environment set it.
macro_rules! fill_from {
    ($args:ident, $file:ident; $($f:ident),* $(,)?) => {
        $( if $args.$f.is_none() { $args.$f = $file.$f; } )*
    };
}

#[derive(Parser)]
#[command(
    name = "hora-client",
    version,
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
}

/// `sync`'s options. Each is a flag, a `HORA_*` variable, or a key of the `--config` file.
#[derive(Args, Deserialize, Default, Debug)]
#[serde(default, deny_unknown_fields)]
struct SyncArgs {
    /// TOML file with any of these options (keys as the long flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The server to meet the other workers at, `https://host:port` (or give --peers).
    #[arg(long, env = "HORA_SERVER", conflicts_with = "peers")]
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
    #[arg(long, env = "HORA_SYNC_TOKEN_FILE", conflicts_with = "token")]
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
    /// Where to accept the ring neighbour's connection [default: 127.0.0.1:0].
    #[arg(long, env = "HORA_LISTEN")]
    listen: Option<String>,
    /// The host the other workers reach this one at [default: the --listen address].
    #[arg(long, env = "HORA_ADVERTISE")]
    advertise: Option<String>,
    /// Seconds a silent worker is given before the others stop and name it [default: 30].
    #[arg(long, env = "HORA_TIMEOUT")]
    timeout: Option<u64>,
    /// Give up on an unreachable server after this many seconds of retries [default: 600].
    #[arg(long, env = "HORA_RETRY_FOR")]
    retry_for: Option<u64>,
    /// Built-in architecture: logreg, mlp or cnn.
    #[arg(long, env = "HORA_MODEL")]
    model: Option<String>,
    /// Its parameters as JSON, e.g. '{"inputs":784,"hidden":[200,200],"classes":10}'.
    #[arg(long, env = "HORA_MODEL_PARAMS")]
    params: Option<String>,
    /// The training data (every worker reads it and trains on its slice of each global batch):
    /// FILE.csv[?label=COLUMN], mnist:DIR or synthetic-iid:clients=1,seed=0.
    #[arg(long, env = "HORA_DATA")]
    data: Option<String>,
    /// Fraction of CSV data held out for the accuracy rank 0 reports [default: 0.2].
    #[arg(long, env = "HORA_HOLDOUT")]
    holdout: Option<f64>,
    /// Passes over the training data [default: 10].
    #[arg(long, env = "HORA_EPOCHS")]
    epochs: Option<u64>,
    /// Samples per worker per pass; the global batch is world size × this [default: 32].
    #[arg(long, env = "HORA_BATCH_SIZE")]
    batch_size: Option<usize>,
    /// Learning rate before scaling [default: 0.05].
    #[arg(long, env = "HORA_LEARNING_RATE")]
    learning_rate: Option<f64>,
    /// linear (× world size, Horovod's rule) or none [default: linear].
    #[arg(long, env = "HORA_LR_SCALING")]
    lr_scaling: Option<String>,
    /// sgd or adam [default: sgd].
    #[arg(long, env = "HORA_OPTIMIZER")]
    optimizer: Option<String>,
    /// SGD momentum [default: 0.9].
    #[arg(long, env = "HORA_MOMENTUM")]
    momentum: Option<f64>,
    /// L2 weight decay [default: 0].
    #[arg(long, env = "HORA_WEIGHT_DECAY")]
    weight_decay: Option<f64>,
    /// Local passes whose gradients are accumulated before each allreduce [default: 1].
    #[arg(long, env = "HORA_BACKWARD_PASSES_PER_STEP")]
    backward_passes_per_step: Option<u32>,
    /// Tensors are fused into buffers of up to this many MiB per allreduce [default: 64].
    #[arg(long, env = "HORA_FUSION_MIB")]
    fusion_mib: Option<usize>,
    /// Pipelined pieces of this many KiB on the ring [default: 256].
    #[arg(long, env = "HORA_SUB_CHUNK_KIB")]
    sub_chunk_kib: Option<usize>,
    /// Send gradients as half precision (half the bytes; about 3 significant digits).
    #[arg(long, env = "HORA_FP16")]
    #[serde(default)]
    fp16: bool,
    /// Leave the ring's frames unsealed (no AES-256-GCM after the handshake): only on a network
    /// that nobody else can reach, and on every worker of the job alike.
    #[arg(long, env = "HORA_RING_UNSEALED")]
    #[serde(default)]
    ring_unsealed: bool,
    /// Seed of the initialisation and of the shuffling (the same on every worker) [default: 0].
    #[arg(long, env = "HORA_SEED")]
    seed: Option<u64>,
    /// auto (cuda:LOCAL_RANK when there are GPUs), cpu, cuda or cuda:N [default: auto].
    #[arg(long, env = "HORA_DEVICE")]
    device: Option<String>,
    /// CPU threads for libtorch [default: libtorch's choice].
    #[arg(long, env = "HORA_THREADS")]
    threads: Option<i32>,
    /// Rank 0 writes checkpoints here; a restarted job resumes from the newest.
    #[arg(long, env = "HORA_CHECKPOINT_DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every this many steps as well as at each epoch's end [default: 0, epochs only].
    #[arg(long, env = "HORA_CHECKPOINT_EVERY")]
    checkpoint_every: Option<u64>,
    /// Rank 0 writes the trained weights here (safetensors).
    #[arg(long, env = "HORA_SAVE")]
    save: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, env = "HORA_NO_PROGRESS")]
    #[serde(default)]
    no_progress: bool,
}

impl SyncArgs {
    /// Fills what neither a flag nor the environment set from the `--config` file.
    fn merge_file(mut self) -> anyhow::Result<Self> {
        let Some(file) = config_file::<SyncArgs>(self.config.as_deref())? else {
            return Ok(self);
        };
        fill_from!(self, file;
            server,
            ca,
            cert,
            key,
            job,
            token,
            peers,
            session_secret,
            rank,
            world_size,
            listen,
            advertise,
            timeout,
            retry_for,
            model,
            params,
            data,
            holdout,
            epochs,
            batch_size,
            learning_rate,
            lr_scaling,
            optimizer,
            momentum,
            weight_decay,
            backward_passes_per_step,
            fusion_mib,
            sub_chunk_kib,
            seed,
            device,
            threads,
            checkpoint_dir,
            checkpoint_every,
            save
        );
        self.fp16 |= file.fp16;
        self.no_progress |= file.no_progress;
        Ok(self)
    }
}

/// `train`'s options. Each is a flag, a `HORA_*` variable, or a key of the `--config` file.
#[derive(Args, Deserialize, Default, Debug)]
#[serde(default, deny_unknown_fields)]
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
    #[arg(long, env = "HORA_ENROLMENT_TOKEN_FILE", conflicts_with = "token")]
    token_file: Option<PathBuf>,
    /// Credentials, cached models and the round in progress [default: hora-client-state].
    #[arg(long, env = "HORA_STATE_DIR")]
    state_dir: Option<PathBuf>,
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
    /// Fraction of CSV data held out to report accuracy on [default: 0.2].
    #[arg(long, env = "HORA_HOLDOUT")]
    holdout: Option<f64>,
    /// auto, cpu, cuda or cuda:N [default: auto].
    #[arg(long, env = "HORA_DEVICE")]
    device: Option<String>,
    /// CPU threads for libtorch [default: libtorch's choice].
    #[arg(long, env = "HORA_THREADS")]
    threads: Option<i32>,
    /// Stop after this many rounds [default: until the task ends].
    #[arg(long, env = "HORA_ROUNDS")]
    rounds: Option<u64>,
    /// Give up on an unreachable server after this many seconds of retries [default: 600].
    #[arg(long, env = "HORA_RETRY_FOR")]
    retry_for: Option<u64>,
    /// Seed of libtorch's generator (initialisation and shuffling).
    #[arg(long, env = "HORA_SEED")]
    seed: Option<i64>,
    /// No progress bar.
    #[arg(long, env = "HORA_NO_PROGRESS")]
    #[serde(default)]
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
    /// Fills what neither a flag nor the environment set from the `--config` file.
    fn merge_file(mut self) -> anyhow::Result<Self> {
        let Some(file) = config_file::<TrainArgs>(self.config.as_deref())? else {
            return Ok(self);
        };
        fill_from!(self, file;
            server,
            ca,
            cert,
            key,
            task,
            token,
            state_dir,
            label,
            data,
            client_index,
            holdout,
            device,
            threads,
            rounds,
            retry_for,
            seed,
            timings,
            min_train_secs
        );
        self.no_progress |= file.no_progress;
        Ok(self)
    }
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

/// The `--config` TOML file, if one was given.
fn config_file<T: serde::de::DeserializeOwned>(
    path: Option<&std::path::Path>,
) -> anyhow::Result<Option<T>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(Some(file))
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

async fn train(args: TrainArgs) -> anyhow::Result<()> {
    let args = args.merge_file()?;
    let server = required(args.server, "server")?;
    let ca = required(args.ca, "ca")?;
    let task = required(args.task, "task")?;
    let source: DataSource = required(args.data, "data")?.parse()?;
    let device = args
        .device
        .as_deref()
        .unwrap_or("auto")
        .parse::<DeviceChoice>()?
        .resolve()?;
    if let Some(t) = args.threads {
        tch::set_num_threads(t.max(1));
    }
    if let Some(seed) = args.seed {
        tch::manual_seed(seed);
    }
    let (train, test) = source.load(args.client_index, args.holdout.unwrap_or(0.2))?;
    tracing::info!(
        train = train.len(),
        test = test.as_ref().map_or(0, |t| t.len()),
        ?device,
        "local data loaded"
    );
    let mut config = ClientConfig::new(
        server,
        ca,
        args.state_dir.unwrap_or_else(|| "hora-client-state".into()),
    );
    config.label = args.label;
    config.identity = match (args.cert, args.key) {
        (Some(cert), Some(key)) => Some(Identity { cert, key }),
        _ => None,
    };
    config.retry = RetryPolicy {
        budget: Duration::from_secs(args.retry_for.unwrap_or(600)),
        ..RetryPolicy::default()
    };
    config.drop_out_after = args.drop_out_after;
    let token = secret_or_file(args.token, args.token_file.as_deref())?;
    let client = Client::connect(config, token.as_deref()).await?;
    tracing::info!(client = client.id(), task = %task, "waiting for rounds");
    let supervised = SupervisedTrainer::new(train, test, device)?.with_seed(args.seed);
    let mut trainer: Box<dyn Trainer> = match args.min_train_secs {
        Some(secs) if secs.is_finite() && secs >= 0.0 => Box::new(Paced {
            inner: supervised,
            min: Duration::from_secs_f64(secs),
        }),
        Some(secs) => anyhow::bail!("--min-train-secs must be a number of seconds ≥ 0, not {secs}"),
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

fn sync(args: SyncArgs) -> anyhow::Result<()> {
    use hora_client::sync::rendezvous::ServerRendezvous;
    use hora_client::sync::worker::{self, Meeting, SyncTraining};
    use hora_client::sync::{Algorithm, CommOptions, LaunchRank, LrScaling, Wire};

    let args = args.merge_file()?;
    let launch = LaunchRank::detect(args.rank, args.world_size, |k| std::env::var(k).ok())?;
    let launch = LaunchRank {
        world_size: launch
            .world_size
            .or(args.peers.as_ref().map(|p| p.len() as u32)),
        ..launch
    };
    let device = match (args.device.as_deref().unwrap_or("auto"), launch.local_rank) {
        ("auto", Some(local)) if tch::Cuda::device_count() > 0 => {
            tch::Device::Cuda(local as usize % tch::Cuda::device_count() as usize)
        }
        (choice, _) => choice.parse::<DeviceChoice>()?.resolve()?,
    };
    if let Some(t) = args.threads {
        tch::set_num_threads(t.max(1));
    }
    let name = required(args.model, "model")?;
    let params: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(args.params.as_deref().unwrap_or("{}"))
            .context("--params must be a JSON object")?;
    let architecture = Architecture::from_builtin(&name, &params)?;
    let optimizer = args.optimizer.as_deref().unwrap_or("sgd");
    let weight_decay = args.weight_decay.unwrap_or(0.0);
    let algorithm = match optimizer {
        "sgd" => Algorithm::Sgd {
            momentum: args.momentum.unwrap_or(0.9),
            weight_decay,
        },
        "adam" => Algorithm::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        },
        other => bail!("unknown optimizer `{other}`: use sgd or adam"),
    };
    let lr_scaling: LrScaling = args
        .lr_scaling
        .as_deref()
        .unwrap_or("linear")
        .parse()
        .map_err(anyhow::Error::msg)?;
    let training = SyncTraining {
        architecture,
        data: required(args.data, "data")?.parse()?,
        holdout: args.holdout.unwrap_or(0.2),
        epochs: args.epochs.unwrap_or(10),
        batch_size: args.batch_size.unwrap_or(32),
        learning_rate: args.learning_rate.unwrap_or(0.05),
        lr_scaling,
        algorithm,
        backward_passes_per_step: args.backward_passes_per_step.unwrap_or(1),
        seed: args.seed.unwrap_or(0),
        device,
        fusion_bytes: args.fusion_mib.unwrap_or(64) << 20,
        checkpoint_dir: args.checkpoint_dir,
        checkpoint_every: args.checkpoint_every.unwrap_or(0),
        save: args.save,
    };
    let options = CommOptions {
        sub_chunk_bytes: args.sub_chunk_kib.unwrap_or(256).max(1) << 10,
        wire: if args.fp16 { Wire::F16 } else { Wire::F32 },
        // A day at most: longer is a hang in all but name (and would overflow deadlines).
        timeout: Duration::from_secs(args.timeout.unwrap_or(30).clamp(1, 86_400)),
        seal_frames: !args.ring_unsealed,
        ..CommOptions::default()
    };

    let identity = match (args.cert, args.key) {
        (Some(cert), Some(key)) => Some(Identity { cert, key }),
        _ => None,
    };
    let (server, ca, job, token);
    let meeting = match args.peers {
        Some(peers) => Meeting::Peers {
            peers,
            secret: args.session_secret,
        },
        None => {
            server = required(args.server, "server")?;
            ca = required(args.ca, "ca")?;
            job = required(args.job, "job")?;
            token = required(
                secret_or_file(args.token, args.token_file.as_deref())?,
                "token",
            )?;
            Meeting::Server(ServerRendezvous {
                server: &server,
                ca: &ca,
                identity: identity.as_ref(),
                job: &job,
                token: &token,
                timeout: options.timeout,
                retry_for: Duration::from_secs(args.retry_for.unwrap_or(600)),
            })
        }
    };
    let comm = worker::form_world(
        meeting,
        &launch,
        args.listen.as_deref().unwrap_or("127.0.0.1:0"),
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

    let bar = if args.no_progress || rank != 0 {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(0)
    };
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
        if rank == 0 {
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
    let report = worker::train(&training, comm, &mut on_step, &mut on_epoch)?;
    bar.finish_and_clear();
    if let Some(step) = report.resumed_from {
        println!("resumed from step {step}");
    }
    println!(
        "rank {rank} done: {} steps on {size} workers (learning rate {})",
        report.steps, report.learning_rate
    );
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init(cli.logging.log_format, "info");
    let cli_format = cli.logging.log_format;
    let result = match cli.command {
        Command::Train(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")
            .and_then(|rt| rt.block_on(train(*args))),
        Command::Init(args) => init(args),
        Command::Sync(args) => sync(*args),
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
