//! `hora-client`: the edge binary.
//!
//! - `hora-client train`: enrol (once), then take part in a task's rounds until it ends,
//!   training on local data with the built-in trainer. A progress bar while training, one line
//!   per round. Options come from flags, then `HORA_*` environment variables, then a TOML file
//!   (`--config`), in that order.
//! - `hora-client init`: initial weights for a task (a built-in architecture, or the parameters
//!   of a TorchScript module), and the `model` JSON to create the task with.
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
    Client, ClientConfig, ClientError, RoundOutcome, RoundReport, SupervisedTrainer,
};
use hora_common::tls::Identity;
use hora_common::wire::ModelKind;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;

#[derive(Parser)]
#[command(
    name = "hora-client",
    version,
    about = "Hora federated-learning client"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Take part in a task's rounds until it ends.
    Train(Box<TrainArgs>),
    /// Write a task's initial weights.
    Init(InitArgs),
}

/// `train`'s options. Each is a flag, a `HORA_*` variable, or a key of the `--config` file.
#[derive(Args, Deserialize, Default, Debug)]
#[serde(default, deny_unknown_fields)]
struct TrainArgs {
    /// TOML file with any of these options (keys as the long flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The server, `https://host:port`.
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
    #[arg(long, env = "HORA_ENROLMENT_TOKEN")]
    token: Option<String>,
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
}

impl TrainArgs {
    /// Fills what neither a flag nor the environment set from the `--config` file.
    fn merge_file(mut self) -> anyhow::Result<Self> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let file: TrainArgs =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        macro_rules! fill {
            ($($f:ident),*) => { $( if self.$f.is_none() { self.$f = file.$f; } )* };
        }
        fill!(
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
            seed
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

fn required<T>(value: Option<T>, flag: &str) -> anyhow::Result<T> {
    value.with_context(|| {
        format!(
            "--{flag} is required (or HORA_{} / `{}` in the --config file)",
            flag.replace('-', "_").to_uppercase(),
            flag.replace('-', "_")
        )
    })
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
                if resumed { " after restart" } else { "" }
            )
        }
        RoundOutcome::Skipped => "skipped (deadline)".to_string(),
        RoundOutcome::Missed { reason } => format!("missed: {reason}"),
    };
    format!(
        "{task} round {} · {} examples{}{} · trained {:.1} s · {outcome}",
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
    let client = Client::connect(config, args.token.as_deref()).await?;
    tracing::info!(client = client.id(), task = %task, "waiting for rounds");
    let mut trainer = SupervisedTrainer::new(train, test, device)?;

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
    let summary_bar = bar.clone();
    let mut on_round = |r: &RoundReport| {
        summary_bar.finish_and_clear();
        summary_bar.reset();
        println!("{}", summary(&task, r));
    };
    let run = client
        .run(
            &task,
            &mut trainer,
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
            let digest = hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes));
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

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HORA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")
            .and_then(|rt| rt.block_on(train(*args))),
        Command::Init(args) => init(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
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
