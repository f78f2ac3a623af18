//! `hora-server admin …`: everything the admin API does, from the command line. Prints JSON
//! answers; errors carry the server's `ApiError` message.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use hora_common::wire::{ApiError, CreateEnrolment, CreateSyncJob, CreateTask};
use reqwest::Method;

#[derive(Args)]
pub struct AdminArgs {
    /// The server, `https://host:port` (was --url and HORA_URL).
    #[arg(
        long,
        alias = "url",
        env = "HORA_SERVER",
        default_value = "https://127.0.0.1:8443"
    )]
    pub server: String,
    /// CA certificate to trust (the development CA is <data dir>/certs/ca.pem).
    #[arg(long, env = "HORA_CA")]
    pub ca: PathBuf,
    /// Admin bearer token.
    #[arg(
        long,
        env = "HORA_ADMIN_TOKEN",
        hide_env_values = true,
        required_unless_present = "token_file"
    )]
    pub token: Option<String>,
    /// Read the admin token from this file (first line) instead.
    /// (Given with --token, the one from the higher layer wins: the flag, then the environment.)
    #[arg(long, env = "HORA_ADMIN_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Client certificate (PEM) for a server that requires mutual TLS (--client-ca).
    #[arg(long, env = "HORA_CLIENT_CERT", requires = "key")]
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, env = "HORA_CLIENT_KEY", requires = "cert")]
    pub key: Option<PathBuf>,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Upload initial weights (safetensors); prints their digest and spec.
    UploadModel {
        file: PathBuf,
    },
    /// Upload a TorchScript module; prints its digest.
    UploadModule {
        file: PathBuf,
    },
    /// Create a task from a JSON file (see CreateTask in GET /openapi.json).
    CreateTask {
        file: PathBuf,
    },
    /// List tasks.
    Tasks,
    /// Show one task.
    Task {
        task: String,
    },
    Pause {
        task: String,
    },
    Resume {
        task: String,
    },
    Stop {
        task: String,
    },
    /// Round history of a task.
    Rounds {
        task: String,
    },
    /// Download the model a round published (0: the initial model; for a task that trains
    /// part of its model, the trainable tensors).
    DownloadModel {
        task: String,
        round: u64,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Download the frozen base of a task that trains part of its model (the tensors no round
    /// changes).
    DownloadBase {
        task: String,
        #[arg(short, long)]
        output: PathBuf,
    },
    /// Make a one-time enrolment token.
    Enrol {
        #[arg(long)]
        ttl_secs: Option<u64>,
        /// A task the enrolled client may use (repeat for several; default: every task).
        #[arg(long = "task")]
        tasks: Vec<String>,
        /// The enrolled client is a regional aggregator (a `hora-server --parent`): its
        /// updates may each stand for several clients.
        #[arg(long)]
        aggregator: bool,
        /// With --aggregator: the most clients one of its updates may stand for (default:
        /// 2^24). Larger claims are refused.
        #[arg(long, requires = "aggregator")]
        max_contributors: Option<u64>,
    },
    /// List clients.
    Clients,
    /// Revoke a client's credentials.
    Revoke {
        client: String,
    },
    /// Release a quarantined client (its count of refused updates starts again).
    Release {
        client: String,
    },
    /// Create a synchronous allreduce job; prints it with the token its workers present (shown
    /// once).
    SyncCreate {
        id: String,
        /// Number of workers (ranks 0..N); an elastic job's largest world.
        #[arg(long)]
        world_size: u32,
        /// Make the job elastic: worlds of this many workers or more form from whoever joins
        /// (survivors of a lost worker, workers that join later).
        #[arg(long)]
        min_world_size: Option<u32>,
        /// An elastic job's quiet time before a world smaller than --world-size forms (ms).
        #[arg(long)]
        settle_ms: Option<u32>,
    },
    /// List sync jobs: world size, worlds formed, workers waiting now.
    SyncJobs,
    /// Delete a sync job (workers waiting in it are told so).
    SyncDelete {
        id: String,
    },
}

pub struct AdminClient {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl AdminClient {
    pub fn new(
        url: &str,
        ca: &std::path::Path,
        identity: Option<&crate::tls::CertPaths>,
        token: &str,
    ) -> Result<Self> {
        Ok(AdminClient {
            http: crate::tls::https_client(ca, identity)?,
            base: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
        })
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        json: Option<serde_json::Value>,
    ) -> Result<reqwest::Response> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token);
        if let Some(j) = json {
            req = req.json(&j);
        }
        answer(req, &self.base).await
    }

    pub async fn json(
        &self,
        method: Method,
        path: &str,
        json: Option<serde_json::Value>,
    ) -> Result<serde_json::Value> {
        Ok(self.send(method, path, json).await?.json().await?)
    }

    /// Uploads `file` to `path`, streamed from disk in 1 MiB pieces with its length declared:
    /// a model of any size costs a buffer (one body of gigabytes at once is past what an HTTP/2
    /// stream's flow control can take in one piece).
    pub async fn upload(&self, path: &str, file: &Path) -> Result<serde_json::Value> {
        let opened = tokio::fs::File::open(file)
            .await
            .with_context(|| format!("opening {}", file.display()))?;
        let length = opened
            .metadata()
            .await
            .with_context(|| format!("reading the size of {}", file.display()))?
            .len();
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
            opened,
            1 << 20,
        ));
        let mut req = self
            .http
            .request(Method::POST, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header(reqwest::header::CONTENT_LENGTH, length)
            .body(body);
        req = req.header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
        Ok(answer(req, &self.base).await?.json().await?)
    }

    /// Sends a request whose successful answer has no body.
    pub async fn empty(&self, method: Method, path: &str) -> Result<()> {
        self.send(method, path, None).await?;
        Ok(())
    }

    /// Writes what `path` answers to `output` a piece at a time (a model of any size costs a
    /// buffer), and returns its length; a download that fails leaves no file.
    pub async fn download(&self, path: &str, output: &Path) -> Result<u64> {
        use futures_util::StreamExt;
        use tokio::io::AsyncWriteExt;
        let resp = self.send(Method::GET, path, None).await?;
        let shown = output.display();
        let mut file = tokio::fs::File::create(output)
            .await
            .with_context(|| format!("creating {shown}"))?;
        let written = async {
            let mut body = resp.bytes_stream();
            let mut written = 0u64;
            while let Some(piece) = body.next().await {
                let piece = piece.with_context(|| format!("downloading {path}"))?;
                file.write_all(&piece)
                    .await
                    .with_context(|| format!("writing {shown}"))?;
                written += piece.len() as u64;
            }
            file.flush()
                .await
                .with_context(|| format!("writing {shown}"))?;
            Ok::<_, anyhow::Error>(written)
        }
        .await;
        if written.is_err() {
            let _ = tokio::fs::remove_file(output).await;
        }
        written
    }
}

/// Sends `req` to the server at `base`; a refusal becomes an error with its message.
async fn answer(req: reqwest::RequestBuilder, base: &str) -> Result<reqwest::Response> {
    let resp = req
        .send()
        .await
        .with_context(|| format!("connecting to {base}"))?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        match serde_json::from_str::<ApiError>(&text) {
            Ok(e) => bail!("{status}: {}", e.message),
            Err(_) => bail!("{status}: {text}"),
        }
    }
    Ok(resp)
}

/// `matches` are those of `admin`, which `args` came from.
pub async fn run(args: AdminArgs, matches: &clap::ArgMatches) -> Result<()> {
    use hora_common::config::{clap_source, pick_secret};
    let token = args.token.map(|t| {
        (
            t,
            clap_source(matches, "token", "--token", "HORA_ADMIN_TOKEN"),
        )
    });
    let file = args.token_file.as_deref().map(|f| {
        let source = clap_source(
            matches,
            "token_file",
            "--token-file",
            "HORA_ADMIN_TOKEN_FILE",
        );
        (f, source)
    });
    let Some(token) =
        pick_secret(("--token", token), ("--token-file", file)).map_err(anyhow::Error::msg)?
    else {
        bail!("give the admin token with --token, HORA_ADMIN_TOKEN or --token-file")
    };
    let identity = match (args.cert, args.key) {
        (Some(cert), Some(key)) => Some(crate::tls::CertPaths { cert, key }),
        _ => None,
    };
    let c = AdminClient::new(&args.server, &args.ca, identity.as_ref(), &token)?;
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let out = match args.command {
        AdminCommand::UploadModel { file } => c.upload("/admin/v1/models", &file).await?,
        AdminCommand::UploadModule { file } => c.upload("/admin/v1/modules", &file).await?,
        AdminCommand::CreateTask { file } => {
            let task: CreateTask = serde_json::from_slice(&read(&file)?)
                .with_context(|| format!("{} is not a valid task definition", file.display()))?;
            c.json(
                Method::POST,
                "/admin/v1/tasks",
                Some(serde_json::to_value(task)?),
            )
            .await?
        }
        AdminCommand::Tasks => c.json(Method::GET, "/admin/v1/tasks", None).await?,
        AdminCommand::Task { task } => {
            c.json(Method::GET, &format!("/admin/v1/tasks/{task}"), None)
                .await?
        }
        AdminCommand::Pause { task } => {
            c.json(Method::POST, &format!("/admin/v1/tasks/{task}/pause"), None)
                .await?
        }
        AdminCommand::Resume { task } => {
            c.json(
                Method::POST,
                &format!("/admin/v1/tasks/{task}/resume"),
                None,
            )
            .await?
        }
        AdminCommand::Stop { task } => {
            c.json(Method::POST, &format!("/admin/v1/tasks/{task}/stop"), None)
                .await?
        }
        AdminCommand::Rounds { task } => {
            c.json(Method::GET, &format!("/admin/v1/tasks/{task}/rounds"), None)
                .await?
        }
        AdminCommand::DownloadModel {
            task,
            round,
            output,
        } => {
            let path = format!("/admin/v1/tasks/{task}/rounds/{round}/model");
            let bytes = c.download(&path, &output).await?;
            serde_json::json!({ "written": output.display().to_string(), "bytes": bytes })
        }
        AdminCommand::DownloadBase { task, output } => {
            let bytes = c
                .download(&format!("/admin/v1/tasks/{task}/base"), &output)
                .await?;
            serde_json::json!({ "written": output.display().to_string(), "bytes": bytes })
        }
        AdminCommand::Enrol {
            ttl_secs,
            tasks,
            aggregator,
            max_contributors,
        } => {
            let tasks = (!tasks.is_empty()).then_some(tasks);
            let request = CreateEnrolment {
                ttl_secs,
                tasks,
                aggregator,
                max_contributors,
            };
            c.json(
                Method::POST,
                "/admin/v1/enrolments",
                Some(serde_json::to_value(request)?),
            )
            .await?
        }
        AdminCommand::Clients => c.json(Method::GET, "/admin/v1/clients", None).await?,
        AdminCommand::Revoke { client } => {
            c.json(
                Method::POST,
                &format!("/admin/v1/clients/{client}/revoke"),
                None,
            )
            .await?
        }
        AdminCommand::Release { client } => {
            c.json(
                Method::POST,
                &format!("/admin/v1/clients/{client}/release"),
                None,
            )
            .await?
        }
        AdminCommand::SyncCreate {
            id,
            world_size,
            min_world_size,
            settle_ms,
        } => {
            let job = CreateSyncJob {
                id,
                world_size,
                min_world_size,
                settle_ms,
            };
            c.json(
                Method::POST,
                "/admin/v1/sync-jobs",
                Some(serde_json::to_value(job)?),
            )
            .await?
        }
        AdminCommand::SyncJobs => c.json(Method::GET, "/admin/v1/sync-jobs", None).await?,
        AdminCommand::SyncDelete { id } => {
            c.empty(Method::DELETE, &format!("/admin/v1/sync-jobs/{id}"))
                .await?;
            serde_json::json!({ "deleted": id })
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
