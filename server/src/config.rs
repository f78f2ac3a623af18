//! `hora-server serve` configuration, declared once in [`ServeArgs`]: each option is a flag, a
//! `HORA_*` environment variable and a key of the `--config` TOML file, and the first of those
//! that says something wins, else the default (`hora_common::config`).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;
use clap::{ArgMatches, Args};
use hora_common::config::Layered;
use hora_common::wire::MIN_UPLOAD_CHUNK_BYTES;
use serde::{Deserialize, Serialize};

// No Debug: it holds secrets (the admin token, a store URL's password); `config check` shows
// them masked.
#[derive(Clone, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free one; the chosen address is printed).
    #[arg(long, env = "HORA_LISTEN", default_value = "127.0.0.1:8443")]
    pub listen: SocketAddr,
    /// Where state lives (the sled database, model blobs, checkpoints; with PostgreSQL the
    /// blobs and checkpoints only).
    #[arg(long, env = "HORA_DATA_DIR", default_value = "hora-data")]
    pub data_dir: PathBuf,
    /// Where the records live: `sled` (the default: embedded, under the data directory) or a
    /// PostgreSQL database, postgres://user:password@host:port/database (its schema is brought
    /// up to date at start; blobs stay under the data directory). Give a URL holding a password
    /// through HORA_STORE or the config file rather than the command line, which others see.
    /// TLS: add ?sslmode=require&sslrootcert=/path/to/ca.pem (the database's certificate is
    /// verified against that CA and the host name).
    #[arg(
        long,
        env = "HORA_STORE",
        hide_env_values = true,
        default_value = "sled"
    )]
    pub store: String,
    /// Where the blobs live (models, modules, strategy states, checkpoints): files under the
    /// data directory by default, or an object store every replica shares: file:///path/to/dir
    /// (a local or shared directory) or s3://bucket/prefix (credentials and region from the
    /// usual AWS_* environment variables).
    #[arg(long, env = "HORA_BLOBS")]
    pub blobs: Option<String>,
    /// With --store postgres://…: how long the lease of the replica that leads lasts, in
    /// seconds. It renews it every third of that; the others stand by (answering 503 `standby`) and take
    /// over once it has lapsed: after a leader dies, another serves within this time and a
    /// second or two. Shorter fails over sooner and costs more renewals.
    #[arg(long, env = "HORA_LEASE_SECS", default_value_t = 10)]
    pub lease_secs: u64,
    /// The endpoint of an S3-compatible server for --blobs s3://… (http://127.0.0.1:9000);
    /// plain http only on loopback, unless AWS_ALLOW_HTTP=true.
    #[arg(long, env = "HORA_BLOBS_ENDPOINT")]
    pub blobs_endpoint: Option<String>,
    /// Retries of a failed request to --blobs s3://… [default: 3].
    #[arg(long, env = "HORA_BLOBS_RETRIES")]
    pub blobs_retries: Option<usize>,
    /// The most seconds spent retrying one request to --blobs s3://… before the store counts
    /// as down (answered 503; clients and the server retry by themselves) [default: 15].
    #[arg(long, env = "HORA_BLOBS_RETRY_SECS")]
    pub blobs_retry_secs: Option<u64>,
    /// Makes this server a regional aggregator under a parent server, https://host:port (or
    /// several comma-separated: the parent's replicas): its tasks created with a `parent` take
    /// part in the parent's task, each round forwarding its partial there.
    #[arg(long, env = "HORA_PARENT")]
    pub parent: Option<String>,
    /// The CA certificate the parent's certificate chains to (PEM; default:
    /// <data dir>/parent/ca.pem).
    #[arg(long, env = "HORA_PARENT_CA")]
    pub parent_ca: Option<PathBuf>,
    /// The parent's aggregator enrolment token (`hora-server admin enrol --aggregator` there),
    /// needed until this server's first enrolment there; the credentials it earns are kept in
    /// <data dir>/parent. Give it through HORA_PARENT_ENROLMENT_TOKEN rather than the command
    /// line, which others see.
    #[arg(long, env = "HORA_PARENT_ENROLMENT_TOKEN", hide_env_values = true)]
    pub parent_enrolment_token: Option<String>,
    /// Server certificate (PEM). Without it development certificates are made.
    #[arg(long, env = "HORA_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, env = "HORA_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (mutual TLS).
    #[arg(long, env = "HORA_CLIENT_CA")]
    pub client_ca: Option<PathBuf>,
    /// Where development certificates are made (default: <data dir>/certs).
    #[arg(long, env = "HORA_CERTS_DIR")]
    pub certs_dir: Option<PathBuf>,
    /// Extra host names or IPs for the development server certificate.
    #[arg(long = "host", env = "HORA_HOSTS", value_delimiter = ',')]
    #[serde(default)]
    pub hosts: Vec<String>,
    /// The admin bearer token (else the one stored, else a new one printed once).
    #[arg(long, env = "HORA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (first line) instead of the command line.
    /// (Given with --admin-token, the one from the higher layer wins: flags, the environment,
    /// the file.)
    #[arg(long, env = "HORA_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// The key the dashboard's session cookies are signed with, at least 32 characters
    /// (replicas behind one load balancer are given the same, so a session works on each).
    /// Default: a random key per process, so sessions end when the server does.
    #[arg(long, env = "HORA_DASHBOARD_SECRET", hide_env_values = true)]
    pub dashboard_secret: Option<String>,
    /// Read the dashboard's session key from this file (first line) instead.
    #[arg(long, env = "HORA_DASHBOARD_SECRET_FILE")]
    pub dashboard_secret_file: Option<PathBuf>,
    /// Networks the admin API answers, comma-separated (e.g. `10.0.0.0/8,2001:db8::/32`, or
    /// addresses); default: every address. A request from elsewhere is refused 403 before its
    /// token is looked at, so guesses from the internet cannot spend the token check's budget
    /// that the operator's first request after a start needs.
    #[arg(long, env = "HORA_ADMIN_ALLOW", value_delimiter = ',', value_parser = parse_net)]
    #[serde(default)]
    pub admin_allow: Vec<Net>,
    /// Most connections held at once (default: 3/4 of the open-file limit, at most 16,384). At
    /// the cap the longest-idle connection is closed to make room.
    #[arg(long, env = "HORA_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Most connections held at once from one IP address (an IPv6 /64 counts as one; default: a
    /// quarter of the cap). At
    /// this limit that address's longest-idle connection is closed to make room; a NAT gateway
    /// in front of many devices may need it raised.
    #[arg(long, env = "HORA_MAX_CONNECTIONS_PER_SOURCE")]
    pub max_connections_per_source: Option<usize>,
    /// Requests from one IP address (an IPv6 /64 counts as one) in flight at once before their
    /// credentials passed (no, a wrong or a still-checked token, and the open routes such as
    /// `/openapi.json`; not the health probes `/healthz` and `/readyz`); beyond it that address
    /// is answered 429 `too_many_requests` (default 32). Raise it for many devices behind one
    /// NAT gateway.
    #[arg(
        long,
        env = "HORA_MAX_UNAUTHENTICATED_PER_SOURCE",
        default_value_t = 32
    )]
    pub max_unauthenticated_per_source: usize,
    /// A connection with no request in flight that moves no byte for this long is closed; at a
    /// connection cap, one whose every request waits for a body that sent nothing for this long
    /// makes room like an idle one.
    #[arg(long, env = "HORA_IDLE_TIMEOUT_SECS", default_value_t = 15)]
    pub idle_timeout_secs: u64,
    /// Time allowed to send a request's headers (HTTP/1.1).
    #[arg(long, env = "HORA_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    pub header_timeout_secs: u64,
    /// Time allowed for a request that is neither a long poll nor an upload (answered 503).
    #[arg(long, env = "HORA_REQUEST_TIMEOUT_SECS", default_value_t = 30)]
    pub request_timeout_secs: u64,
    /// Slowest upload body accepted, in bytes per second averaged from the start of the body
    /// (after the grace period); slower bodies are cut off with 408 `upload_too_slow`.
    #[arg(long, env = "HORA_MIN_UPLOAD_RATE", default_value_t = 16 << 10)]
    pub min_upload_rate: u64,
    /// Seconds an upload body may take before the minimum rate applies.
    #[arg(long, env = "HORA_UPLOAD_GRACE_SECS", default_value_t = 10)]
    pub upload_grace_secs: u64,
    /// Bytes of upload bodies held in memory at once while they are read.
    #[arg(long, env = "HORA_UPLOAD_BUFFER_BYTES", default_value_t = 64 << 20)]
    pub upload_buffer_bytes: u64,
    /// The largest share of that budget one upload reserves, a fraction in (0, 1] (default
    /// 0.25). Bodies larger than the share are read one at a time, each reserving the share, so
    /// a slow large body never holds the room smaller ones are read in; memory for bodies stays
    /// within the budget plus one such body.
    #[arg(long, env = "HORA_MAX_UPLOAD_SHARE", default_value_t = 0.25)]
    pub max_upload_share: f64,
    /// Updates whose plaintext is larger than this many bytes are uploaded in chunks of this
    /// size, each acknowledged, so a cut connection resumes where it broke off (64 KiB to
    /// 1 GiB; 0: updates come in one body only).
    #[arg(long, env = "HORA_UPLOAD_CHUNK_BYTES", default_value_t = 8 << 20)]
    pub upload_chunk_bytes: u64,
    /// Disk the chunks of uploads in progress may take together, in `<data-dir>/spool` (an
    /// upload reserves its whole length when it starts; beyond it, 503 `busy`).
    #[arg(long, env = "HORA_SPOOL_BYTES", default_value_t = 32 << 30)]
    pub spool_bytes: u64,
    /// Seconds a body waits for room in that budget before it is answered 503 `busy` (and
    /// retried by its client); below the request timeout, so `busy` is what a waiter hears.
    #[arg(long, env = "HORA_BODY_WAIT_SECS", default_value_t = 10)]
    pub body_wait_secs: u64,
    /// Quarantine a client after this many of its updates in a row are refused as invalid or
    /// out of bounds (0: never); the operator releases it with `hora-server admin release`.
    #[arg(long, env = "HORA_QUARANTINE_AFTER", default_value_t = 5)]
    pub quarantine_after: u32,
    /// Longest an upload waits for the checkpoint that makes it durable before it is answered
    /// 503 `not_durable_yet` (the client retries; the update is not folded twice).
    #[arg(long, env = "HORA_DURABILITY_TIMEOUT_SECS", default_value_t = 60)]
    pub durability_timeout_secs: u64,
    /// Keep the models of the last N published rounds of each task (0: keep every round).
    #[arg(long, env = "HORA_RETAIN_ROUNDS_LAST", default_value_t = 50)]
    pub retain_rounds_last: u64,
    /// Also keep the model of every Kth round (0: none beyond the last N).
    #[arg(long, env = "HORA_RETAIN_ROUNDS_EVERY", default_value_t = 10)]
    pub retain_rounds_every: u64,
    /// Keep the per-client detail (participants, dropped, staleness bases) of the history
    /// entries of the last N rounds of each task; older entries keep only their counts (0: keep
    /// every entry whole).
    #[arg(long, env = "HORA_HISTORY_DETAIL_ROUNDS", default_value_t = 1000)]
    pub history_detail_rounds: u64,
    /// Require the admin token for `GET /metrics`.
    #[arg(long, env = "HORA_METRICS_REQUIRE_TOKEN")]
    #[serde(default)]
    pub metrics_require_token: bool,
    /// Group-commit window in milliseconds.
    #[arg(long, env = "HORA_COMMIT_WINDOW_MS", default_value_t = 2)]
    pub commit_window_ms: u64,
    /// Updates opened (decrypted and checked) at once: the CPU work of uploads, whose bodies
    /// are already in memory under --upload-buffer-bytes; folds into a round take its lock.
    #[arg(long, env = "HORA_MAX_CONCURRENT_UPLOADS", default_value_t = 1)]
    pub max_concurrent_uploads: usize,
    /// Largest model or module an admin may upload, in bytes.
    #[arg(long, env = "HORA_MAX_MODEL_BYTES", default_value_t = 4 << 30)]
    pub max_model_bytes: u64,
}

/// A network (`10.0.0.0/8`) or one address (`192.0.2.7`, a /32 or /128), as flags, variables
/// and the file say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Net(pub ipnet::IpNet);

impl TryFrom<String> for Net {
    type Error = String;

    fn try_from(s: String) -> Result<Net, String> {
        parse_net(&s)
    }
}

impl From<Net> for String {
    fn from(net: Net) -> String {
        net.0.to_string()
    }
}

fn parse_net(s: &str) -> Result<Net, String> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map(Net)
        .map_err(|_| {
            format!("`{s}` is neither a network (10.0.0.0/8, 2001:db8::/32) nor an address")
        })
}

/// The resolved configuration. Its `Debug` shows the admin token only by its presence.
#[derive(Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub store: crate::store::StoreLocation,
    pub blobs: crate::store::BlobLocation,
    /// The lease of the replica that leads (PostgreSQL store only).
    pub lease: Duration,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub certs_dir: Option<PathBuf>,
    pub hosts: Vec<String>,
    pub admin_token: Option<String>,
    /// The dashboard's session key (None: a random one per process).
    pub dashboard_secret: Option<String>,
    /// Empty: the admin API answers every address.
    pub admin_allow: Vec<ipnet::IpNet>,
    pub commit_window_ms: u64,
    pub max_concurrent_uploads: usize,
    pub max_model_bytes: u64,
    /// None: derived from the open-file limit at start.
    pub max_connections: Option<usize>,
    pub max_connections_per_source: Option<usize>,
    pub max_unauthenticated_per_source: usize,
    pub idle_timeout: Duration,
    pub header_timeout: Duration,
    pub request_timeout: Duration,
    pub min_upload_rate: u64,
    pub upload_grace: Duration,
    pub upload_buffer_bytes: u64,
    pub max_upload_share: f64,
    /// 0: no chunked uploads.
    pub upload_chunk_bytes: u64,
    pub spool_bytes: u64,
    pub body_wait: Duration,
    pub quarantine_after: u32,
    pub durability_timeout: Duration,
    pub retention: crate::store::Retention,
    pub metrics_require_token: bool,
    /// The parent of a regional aggregator.
    pub parent: Option<crate::upstream::ParentConfig>,
}

impl std::fmt::Debug for ServeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeConfig")
            .field("listen", &self.listen)
            .field("data_dir", &self.data_dir)
            .field("store", &self.store)
            .field("blobs", &self.blobs)
            .field("lease", &self.lease)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("client_ca", &self.client_ca)
            .field("certs_dir", &self.certs_dir)
            .field("hosts", &self.hosts)
            .field(
                "admin_token",
                &self.admin_token.as_ref().map(|_| "(secret)"),
            )
            .field(
                "dashboard_secret",
                &self.dashboard_secret.as_ref().map(|_| "(secret)"),
            )
            .field("admin_allow", &self.admin_allow)
            .field("commit_window_ms", &self.commit_window_ms)
            .field("max_concurrent_uploads", &self.max_concurrent_uploads)
            .field("max_model_bytes", &self.max_model_bytes)
            .field("max_connections", &self.max_connections)
            .field(
                "max_connections_per_source",
                &self.max_connections_per_source,
            )
            .field(
                "max_unauthenticated_per_source",
                &self.max_unauthenticated_per_source,
            )
            .field("idle_timeout", &self.idle_timeout)
            .field("header_timeout", &self.header_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("min_upload_rate", &self.min_upload_rate)
            .field("upload_grace", &self.upload_grace)
            .field("upload_buffer_bytes", &self.upload_buffer_bytes)
            .field("max_upload_share", &self.max_upload_share)
            .field("upload_chunk_bytes", &self.upload_chunk_bytes)
            .field("spool_bytes", &self.spool_bytes)
            .field("body_wait", &self.body_wait)
            .field("quarantine_after", &self.quarantine_after)
            .field("durability_timeout", &self.durability_timeout)
            .field("retention", &self.retention)
            .field("metrics_require_token", &self.metrics_require_token)
            .field("parent", &self.parent)
            .finish()
    }
}

impl ServeConfig {
    pub fn commit_window(&self) -> Duration {
        Duration::from_millis(self.commit_window_ms)
    }

    /// The configuration a `serve` command line gives (with the file it names; not the
    /// environment), for programs that start a server themselves: `["--data-dir", "d", …]`.
    pub fn from_args<I, T>(args: I) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            args: ServeArgs,
        }
        let matches = <Serve as clap::CommandFactory>::command()
            // What this process's environment says is not the caller's configuration.
            .mut_args(|a| a.env(None::<&'static str>))
            .try_get_matches_from(
                std::iter::once(OsString::from("serve")).chain(args.into_iter().map(Into::into)),
            )?;
        let serve = <Serve as clap::FromArgMatches>::from_arg_matches(&matches)?;
        Self::resolve(&serve.args, &matches)
    }

    /// `args` (from `matches`) layered with the file they name: what `config check` shows.
    pub fn layered(args: &ServeArgs, matches: &ArgMatches) -> Result<Layered<ServeArgs>> {
        let mut layered = hora_common::config::layer(args, matches, args.config.as_deref(), &[])?;
        layered.value.config = args.config.clone();
        Ok(layered)
    }

    /// The configuration `args` (from `matches`) and the file they name give, checked.
    pub fn resolve(args: &ServeArgs, matches: &ArgMatches) -> Result<Self> {
        Self::from_layered(Self::layered(args, matches)?)
    }

    /// The configuration `layered` gives, checked.
    pub fn from_layered(layered: Layered<ServeArgs>) -> Result<Self> {
        let admin_token = layered
            .secret(
                "admin_token",
                layered.value.admin_token.clone(),
                layered.value.admin_token_file.as_deref(),
            )
            .map_err(anyhow::Error::msg)?;
        let dashboard_secret = layered
            .secret(
                "dashboard_secret",
                layered.value.dashboard_secret.clone(),
                layered.value.dashboard_secret_file.as_deref(),
            )
            .map_err(anyhow::Error::msg)?;
        if let Some(secret) = &dashboard_secret {
            let min = crate::dashboard::session::MIN_SECRET_BYTES;
            if secret.len() < min {
                anyhow::bail!(
                    "dashboard_secret is {} characters; give at least {min} (e.g. the output of `openssl rand -hex 32`)",
                    secret.len()
                );
            }
        }
        let args = layered.value;
        let max_upload_share = args.max_upload_share;
        if !(max_upload_share > 0.0 && max_upload_share <= 1.0) {
            anyhow::bail!(
                "max_upload_share is {max_upload_share}; give a fraction of the upload buffer above 0 and at most 1 (0.25: a quarter)"
            );
        }
        let chunk = args.upload_chunk_bytes;
        if chunk != 0 && !(MIN_UPLOAD_CHUNK_BYTES..=(1 << 30)).contains(&chunk) {
            anyhow::bail!(
                "upload_chunk_bytes is {chunk}; give 65536 (64 KiB) to 1073741824 (1 GiB), or 0 to take updates in one body only"
            );
        }
        let store = args
            .store
            .parse()
            .map_err(|e| anyhow::anyhow!("--store: {e}"))?;
        let blobs = match args.blobs {
            Some(blobs) => blobs
                .parse::<crate::store::BlobLocation>()
                .map_err(|e| anyhow::anyhow!("--blobs: {e}"))?,
            None => crate::store::BlobLocation::DataDir,
        }
        .with_endpoint(args.blobs_endpoint)
        .and_then(|b| b.with_retry(args.blobs_retries, args.blobs_retry_secs))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let parent = match args.parent {
            None => None,
            Some(url) => Some(crate::upstream::ParentConfig {
                urls: crate::upstream::parent_urls(&url)
                    .map_err(|e| anyhow::anyhow!("--parent: {e}"))?,
                ca: args
                    .parent_ca
                    .unwrap_or_else(|| args.data_dir.join("parent").join("ca.pem")),
                enrolment_token: args.parent_enrolment_token,
                state_dir: args.data_dir.join("parent"),
            }),
        };
        let lease_secs = args.lease_secs;
        if !(1..=3600).contains(&lease_secs) {
            anyhow::bail!("lease_secs is {lease_secs}; give 1 to 3600 seconds (10: the default)");
        }
        Ok(ServeConfig {
            store,
            blobs,
            lease: Duration::from_secs(lease_secs),
            listen: args.listen,
            data_dir: args.data_dir,
            tls_cert: args.tls_cert,
            tls_key: args.tls_key,
            client_ca: args.client_ca,
            certs_dir: args.certs_dir,
            hosts: args.hosts,
            admin_token,
            dashboard_secret,
            admin_allow: args.admin_allow.into_iter().map(|n| n.0).collect(),
            commit_window_ms: args.commit_window_ms,
            max_concurrent_uploads: args.max_concurrent_uploads,
            max_model_bytes: args.max_model_bytes,
            max_connections: args.max_connections,
            max_connections_per_source: args.max_connections_per_source,
            max_unauthenticated_per_source: args.max_unauthenticated_per_source.max(1),
            idle_timeout: secs(args.idle_timeout_secs),
            header_timeout: secs(args.header_timeout_secs),
            request_timeout: secs(args.request_timeout_secs),
            min_upload_rate: args.min_upload_rate,
            upload_grace: secs(args.upload_grace_secs),
            body_wait: secs(args.body_wait_secs),
            quarantine_after: args.quarantine_after,
            upload_buffer_bytes: args.upload_buffer_bytes,
            max_upload_share,
            upload_chunk_bytes: chunk,
            spool_bytes: args.spool_bytes,
            durability_timeout: secs(args.durability_timeout_secs),
            retention: crate::store::Retention {
                last: args.retain_rounds_last,
                every: args.retain_rounds_every,
                detail: args.history_detail_rounds,
            },
            metrics_require_token: args.metrics_require_token,
            parent,
        })
    }
}

fn secs(value: u64) -> Duration {
    Duration::from_secs(value.max(1))
}

/// A secret kept in a file: its first line, trimmed. The file should be readable by the
/// server's user only.
pub fn read_secret(path: &Path) -> Result<String> {
    hora_common::config::read_secret(path).map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_names_the_admin_token_only_by_its_presence() {
        let token = "a-secret-admin-token-of-some-length";
        let c = ServeConfig::from_args(["--admin-token", token]).unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains(token), "{shown}");
        assert!(shown.contains("admin_token: Some(\"(secret)\")"), "{shown}");
        assert!(shown.contains("listen: 127.0.0.1:8443"), "{shown}");
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hora.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/srv/hora\"\ncommit_window_ms = 50\n",
        )
        .unwrap();
        let config = path.to_str().unwrap();
        let c = ServeConfig::from_args(["--config", config, "--data-dir", "here"]).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.data_dir, PathBuf::from("here"));
        assert!(matches!(c.store, crate::store::StoreLocation::Sled));
        assert_eq!(c.commit_window_ms, 50);
        assert_eq!(c.max_concurrent_uploads, 1);
        assert_eq!(c.max_upload_share, 0.25);
        assert_eq!(c.max_unauthenticated_per_source, 32);
        std::fs::write(
            &path,
            "max_upload_share = 0.5\nmax_unauthenticated_per_source = 4\nadmin_allow = [\"10.0.0.0/8\", \"2001:db8::7\"]\n",
        )
        .unwrap();
        let c = ServeConfig::from_args(["--config", config]).unwrap();
        assert_eq!(
            (c.max_upload_share, c.max_unauthenticated_per_source),
            (0.5, 4)
        );
        let nets: Vec<String> = c.admin_allow.iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["10.0.0.0/8", "2001:db8::7/128"]);
        std::fs::write(&path, "admin_allow = [\"10.0.0.0/33\"]\n").unwrap();
        let err = ServeConfig::from_args(["--config", config]).unwrap_err();
        assert!(
            format!("{err:#}").contains("`10.0.0.0/33` is neither")
                && format!("{err:#}").contains("key \"admin_allow.0\""),
            "{err:#}"
        );
        for share in [0.0, 1.5, f64::NAN] {
            let err =
                ServeConfig::from_args(["--max-upload-share", &share.to_string()]).unwrap_err();
            assert!(format!("{err:#}").contains("max_upload_share"), "{err:#}");
        }
        std::fs::write(
            &path,
            "store = \"postgres://hora:pw-7f3a9@db.example:5433/fl\"\n",
        )
        .unwrap();
        let c = ServeConfig::from_args(["--config", config]).unwrap();
        let crate::store::StoreLocation::Postgres(target) = &c.store else {
            panic!("{:?}", c.store)
        };
        assert_eq!(target.to_string(), "db.example:5433/fl");
        assert!(!format!("{c:?}").contains("pw-7f3a9"), "{c:?}");
        let c = ServeConfig::from_args(["--config", config, "--store", "sled"]).unwrap();
        assert!(matches!(c.store, crate::store::StoreLocation::Sled));
        for (store, says) in [
            ("mysql://x", "unknown store `mysql`"),
            ("postgres://h/db?sslmode=require", "sslmode=require"),
            (
                "postgres://h/db?frobnicate=1",
                "not a PostgreSQL connection URL",
            ),
        ] {
            let err = ServeConfig::from_args(["--store", store]).unwrap_err();
            assert!(format!("{err:#}").contains(says), "{store}: {err:#}");
        }
        std::fs::write(&path, "lisen = \"x\"\n").unwrap();
        let err = ServeConfig::from_args(["--config", config]).unwrap_err();
        assert!(format!("{err:#}").contains("lisen"), "{err:#}");
    }

    #[test]
    fn blobs_are_under_the_data_directory_unless_told() {
        use crate::store::BlobLocation;
        let resolve = |blobs: Option<&str>, endpoint: Option<&str>| {
            let mut args = Vec::new();
            if let Some(blobs) = blobs {
                args.extend(["--blobs", blobs]);
            }
            if let Some(endpoint) = endpoint {
                args.extend(["--blobs-endpoint", endpoint]);
            }
            ServeConfig::from_args(args).map(|c| c.blobs)
        };
        assert_eq!(resolve(None, None).unwrap(), BlobLocation::DataDir);
        assert_eq!(
            resolve(Some("file:///srv/hora-blobs"), None).unwrap(),
            BlobLocation::File("/srv/hora-blobs".into())
        );
        assert_eq!(
            resolve(Some("s3://fl/hora/prod/"), Some("http://127.0.0.1:9000")).unwrap(),
            BlobLocation::S3 {
                bucket: "fl".into(),
                prefix: "hora/prod".into(),
                endpoint: Some("http://127.0.0.1:9000".into()),
                retry: Default::default(),
            }
        );
        let retried = ServeConfig::from_args([
            "--blobs",
            "s3://fl",
            "--blobs-retries",
            "0",
            "--blobs-retry-secs",
            "120",
        ])
        .map(|c| c.blobs)
        .unwrap();
        assert!(matches!(
            retried,
            BlobLocation::S3 { retry, .. } if retry.max_retries == 0 && retry.timeout_secs == 120
        ));
        for (args, says) in [
            (vec!["--blobs-retries", "2"], "are for --blobs s3"),
            (
                vec!["--blobs", "s3://fl", "--blobs-retry-secs", "0"],
                "within 1 to 3600 s",
            ),
        ] {
            let err = ServeConfig::from_args(args).unwrap_err();
            assert!(format!("{err:#}").contains(says), "{err:#}");
        }
        for (blobs, endpoint, says) in [
            (Some("gs://b"), None, "unknown blob store"),
            (Some("file://relative"), None, "absolute"),
            (Some("s3:///x"), None, "no bucket"),
            (
                Some("file:///d"),
                Some("http://h"),
                "--blobs-endpoint is for",
            ),
            (None, Some("http://h"), "--blobs-endpoint is for"),
        ] {
            let err = resolve(blobs, endpoint).unwrap_err();
            assert!(format!("{err:#}").contains(says), "{blobs:?}: {err:#}");
        }
    }
}
