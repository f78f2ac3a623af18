//! `hora-server serve` configuration: flags, then environment variables (`HORA_*`), then an
//! optional TOML file (`--config`), then defaults — the first that says something wins.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde::Deserialize;

#[derive(Debug, Clone, Args, Default)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, with underscores).
    #[arg(long, env = "HORA_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free one; the chosen address is printed).
    #[arg(long, env = "HORA_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Where state lives (the sled database, model blobs, checkpoints; with PostgreSQL the
    /// blobs and checkpoints only).
    #[arg(long, env = "HORA_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where the records live: `sled` (the default: embedded, under the data directory) or a
    /// PostgreSQL database, postgres://user:password@host:port/database (its schema is brought
    /// up to date at start; blobs stay under the data directory). Give a URL holding a password
    /// through HORA_STORE or the config file rather than the command line, which others see.
    /// TLS: add ?sslmode=require&sslrootcert=/path/to/ca.pem (the database's certificate is
    /// verified against that CA and the host name).
    #[arg(long, env = "HORA_STORE", hide_env_values = true)]
    pub store: Option<String>,
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
    #[arg(long, env = "HORA_LEASE_SECS")]
    pub lease_secs: Option<u64>,
    /// The endpoint of an S3-compatible server for --blobs s3://… (http://127.0.0.1:9000);
    /// plain http only on loopback, unless AWS_ALLOW_HTTP=true.
    #[arg(long, env = "HORA_BLOBS_ENDPOINT")]
    pub blobs_endpoint: Option<String>,
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
    pub hosts: Vec<String>,
    /// The admin bearer token (else the one stored, else a new one printed once).
    #[arg(long, env = "HORA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Read the admin token from this file (first line) instead of the command line.
    #[arg(long, env = "HORA_ADMIN_TOKEN_FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<PathBuf>,
    /// Networks the admin API answers, comma-separated (e.g. `10.0.0.0/8,2001:db8::/32`, or
    /// addresses); default: every address. A request from elsewhere is refused 403 before its
    /// token is looked at, so guesses from the internet cannot spend the token check's budget
    /// that the operator's first request after a start needs.
    #[arg(long, env = "HORA_ADMIN_ALLOW", value_delimiter = ',', value_parser = parse_net)]
    pub admin_allow: Vec<ipnet::IpNet>,
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
    #[arg(long, env = "HORA_MAX_UNAUTHENTICATED_PER_SOURCE")]
    pub max_unauthenticated_per_source: Option<usize>,
    /// A connection with no request in flight that moves no byte for this long is closed; at a
    /// connection cap, one whose every request waits for a body that sent nothing for this long
    /// makes room like an idle one.
    #[arg(long, env = "HORA_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// Time allowed to send a request's headers (HTTP/1.1).
    #[arg(long, env = "HORA_HEADER_TIMEOUT_SECS")]
    pub header_timeout_secs: Option<u64>,
    /// Time allowed for a request that is neither a long poll nor an upload (answered 503).
    #[arg(long, env = "HORA_REQUEST_TIMEOUT_SECS")]
    pub request_timeout_secs: Option<u64>,
    /// Slowest upload body accepted, in bytes per second averaged from the start of the body
    /// (after the grace period); slower bodies are cut off with 408 `upload_too_slow`.
    #[arg(long, env = "HORA_MIN_UPLOAD_RATE")]
    pub min_upload_rate: Option<u64>,
    /// Seconds an upload body may take before the minimum rate applies.
    #[arg(long, env = "HORA_UPLOAD_GRACE_SECS")]
    pub upload_grace_secs: Option<u64>,
    /// Bytes of upload bodies held in memory at once while they are read.
    #[arg(long, env = "HORA_UPLOAD_BUFFER_BYTES")]
    pub upload_buffer_bytes: Option<u64>,
    /// The largest share of that budget one upload reserves, a fraction in (0, 1] (default
    /// 0.25). Bodies larger than the share are read one at a time, each reserving the share, so
    /// a slow large body never holds the room smaller ones are read in; memory for bodies stays
    /// within the budget plus one such body.
    #[arg(long, env = "HORA_MAX_UPLOAD_SHARE")]
    pub max_upload_share: Option<f64>,
    /// Seconds a body waits for room in that budget before it is answered 503 `busy` (and
    /// retried by its client); below the request timeout, so `busy` is what a waiter hears.
    #[arg(long, env = "HORA_BODY_WAIT_SECS")]
    pub body_wait_secs: Option<u64>,
    /// Quarantine a client after this many of its updates in a row are refused as invalid or
    /// out of bounds (0: never); the operator releases it with `hora-server admin release`.
    #[arg(long, env = "HORA_QUARANTINE_AFTER")]
    pub quarantine_after: Option<u32>,
    /// Longest an upload waits for the checkpoint that makes it durable before it is answered
    /// 503 `not_durable_yet` (the client retries; the update is not folded twice).
    #[arg(long, env = "HORA_DURABILITY_TIMEOUT_SECS")]
    pub durability_timeout_secs: Option<u64>,
    /// Keep the models of the last N published rounds of each task (0: keep every round).
    #[arg(long, env = "HORA_RETAIN_ROUNDS_LAST")]
    pub retain_rounds_last: Option<u64>,
    /// Also keep the model of every Kth round (0: none beyond the last N).
    #[arg(long, env = "HORA_RETAIN_ROUNDS_EVERY")]
    pub retain_rounds_every: Option<u64>,
    /// Keep the per-client detail (participants, dropped, staleness bases) of the history
    /// entries of the last N rounds of each task; older entries keep only their counts (0: keep
    /// every entry whole).
    #[arg(long, env = "HORA_HISTORY_DETAIL_ROUNDS")]
    pub history_detail_rounds: Option<u64>,
    /// Require the admin token for `GET /metrics`.
    #[arg(long, env = "HORA_METRICS_REQUIRE_TOKEN")]
    pub metrics_require_token: bool,
    /// Group-commit window in milliseconds.
    #[arg(long, env = "HORA_COMMIT_WINDOW_MS")]
    pub commit_window_ms: Option<u64>,
    /// Updates opened (decrypted and checked) at once: the CPU work of uploads, whose bodies
    /// are already in memory under --upload-buffer-bytes; folds into a round take its lock.
    #[arg(long, env = "HORA_MAX_CONCURRENT_UPLOADS")]
    pub max_concurrent_uploads: Option<usize>,
    /// Largest model or module an admin may upload, in bytes.
    #[arg(long, env = "HORA_MAX_MODEL_BYTES")]
    pub max_model_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<SocketAddr>,
    data_dir: Option<PathBuf>,
    store: Option<String>,
    blobs: Option<String>,
    blobs_endpoint: Option<String>,
    lease_secs: Option<u64>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    certs_dir: Option<PathBuf>,
    #[serde(default)]
    hosts: Vec<String>,
    admin_token: Option<String>,
    admin_token_file: Option<PathBuf>,
    #[serde(default)]
    admin_allow: Vec<String>,
    commit_window_ms: Option<u64>,
    max_concurrent_uploads: Option<usize>,
    max_model_bytes: Option<u64>,
    max_connections: Option<usize>,
    max_connections_per_source: Option<usize>,
    max_unauthenticated_per_source: Option<usize>,
    idle_timeout_secs: Option<u64>,
    header_timeout_secs: Option<u64>,
    request_timeout_secs: Option<u64>,
    min_upload_rate: Option<u64>,
    upload_grace_secs: Option<u64>,
    upload_buffer_bytes: Option<u64>,
    max_upload_share: Option<f64>,
    body_wait_secs: Option<u64>,
    quarantine_after: Option<u32>,
    durability_timeout_secs: Option<u64>,
    retain_rounds_last: Option<u64>,
    retain_rounds_every: Option<u64>,
    history_detail_rounds: Option<u64>,
    metrics_require_token: Option<bool>,
}

/// A network (`10.0.0.0/8`) or one address (`192.0.2.7`, a /32 or /128).
fn parse_net(s: &str) -> Result<ipnet::IpNet, String> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| {
            format!("`{s}` is neither a network (10.0.0.0/8, 2001:db8::/32) nor an address")
        })
}

/// The resolved configuration.
#[derive(Debug, Clone)]
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
    pub body_wait: Duration,
    pub quarantine_after: u32,
    pub durability_timeout: Duration,
    pub retention: crate::store::Retention,
    pub metrics_require_token: bool,
}

impl ServeConfig {
    pub fn commit_window(&self) -> Duration {
        Duration::from_millis(self.commit_window_ms)
    }

    pub fn resolve(args: ServeArgs) -> Result<Self> {
        let file: FileConfig = match &args.config {
            Some(path) => load(path)?,
            None => FileConfig::default(),
        };
        let max_upload_share = args
            .max_upload_share
            .or(file.max_upload_share)
            .unwrap_or(0.25);
        if !(max_upload_share > 0.0 && max_upload_share <= 1.0) {
            anyhow::bail!(
                "max_upload_share is {max_upload_share}; give a fraction of the upload buffer above 0 and at most 1 (0.25: a quarter)"
            );
        }
        let store = match args.store.or(file.store) {
            Some(store) => store.parse().map_err(|e| anyhow::anyhow!("--store: {e}"))?,
            None => crate::store::StoreLocation::Sled,
        };
        let blobs = match args.blobs.or(file.blobs) {
            Some(blobs) => blobs
                .parse::<crate::store::BlobLocation>()
                .map_err(|e| anyhow::anyhow!("--blobs: {e}"))?,
            None => crate::store::BlobLocation::DataDir,
        }
        .with_endpoint(args.blobs_endpoint.or(file.blobs_endpoint))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
        let lease_secs = args.lease_secs.or(file.lease_secs).unwrap_or(10);
        if !(1..=3600).contains(&lease_secs) {
            anyhow::bail!("lease_secs is {lease_secs}; give 1 to 3600 seconds (10: the default)");
        }
        Ok(ServeConfig {
            store,
            blobs,
            lease: Duration::from_secs(lease_secs),
            listen: args
                .listen
                .or(file.listen)
                .unwrap_or_else(|| "127.0.0.1:8443".parse().expect("valid address")),
            data_dir: args
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from("hora-data")),
            tls_cert: args.tls_cert.or(file.tls_cert),
            tls_key: args.tls_key.or(file.tls_key),
            client_ca: args.client_ca.or(file.client_ca),
            certs_dir: args.certs_dir.or(file.certs_dir),
            hosts: if args.hosts.is_empty() {
                file.hosts
            } else {
                args.hosts
            },
            admin_token: match args.admin_token.or(file.admin_token).map(Ok).or_else(|| {
                args.admin_token_file
                    .or(file.admin_token_file)
                    .map(|p| read_secret(&p))
            }) {
                Some(token) => Some(token?),
                None => None,
            },
            admin_allow: if args.admin_allow.is_empty() {
                file.admin_allow
                    .iter()
                    .map(|n| parse_net(n).map_err(|e| anyhow::anyhow!("admin_allow: {e}")))
                    .collect::<Result<_, _>>()?
            } else {
                args.admin_allow
            },
            commit_window_ms: args.commit_window_ms.or(file.commit_window_ms).unwrap_or(2),
            max_concurrent_uploads: args
                .max_concurrent_uploads
                .or(file.max_concurrent_uploads)
                .unwrap_or(1),
            max_model_bytes: args
                .max_model_bytes
                .or(file.max_model_bytes)
                .unwrap_or(4 << 30),
            max_connections: args.max_connections.or(file.max_connections),
            max_connections_per_source: args
                .max_connections_per_source
                .or(file.max_connections_per_source),
            max_unauthenticated_per_source: args
                .max_unauthenticated_per_source
                .or(file.max_unauthenticated_per_source)
                .unwrap_or(32)
                .max(1),
            idle_timeout: secs(args.idle_timeout_secs.or(file.idle_timeout_secs), 15),
            header_timeout: secs(args.header_timeout_secs.or(file.header_timeout_secs), 10),
            request_timeout: secs(args.request_timeout_secs.or(file.request_timeout_secs), 30),
            min_upload_rate: args
                .min_upload_rate
                .or(file.min_upload_rate)
                .unwrap_or(16 << 10),
            upload_grace: secs(args.upload_grace_secs.or(file.upload_grace_secs), 10),
            body_wait: secs(args.body_wait_secs.or(file.body_wait_secs), 10),
            quarantine_after: args.quarantine_after.or(file.quarantine_after).unwrap_or(5),
            upload_buffer_bytes: args
                .upload_buffer_bytes
                .or(file.upload_buffer_bytes)
                .unwrap_or(64 << 20),
            max_upload_share,
            durability_timeout: secs(
                args.durability_timeout_secs
                    .or(file.durability_timeout_secs),
                60,
            ),
            retention: crate::store::Retention {
                last: args
                    .retain_rounds_last
                    .or(file.retain_rounds_last)
                    .unwrap_or(50),
                every: args
                    .retain_rounds_every
                    .or(file.retain_rounds_every)
                    .unwrap_or(10),
                detail: args
                    .history_detail_rounds
                    .or(file.history_detail_rounds)
                    .unwrap_or(1000),
            },
            metrics_require_token: args.metrics_require_token
                || file.metrics_require_token.unwrap_or(false),
        })
    }
}

fn secs(value: Option<u64>, default: u64) -> Duration {
    Duration::from_secs(value.unwrap_or(default).max(1))
}

/// A secret kept in a file: its first line, trimmed. The file should be readable by the
/// server's user only.
pub fn read_secret(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the secret file {}", path.display()))?;
    let secret = text.lines().next().unwrap_or_default().trim().to_string();
    if secret.is_empty() {
        anyhow::bail!("the secret file {} is empty", path.display());
    }
    Ok(secret)
}

fn load(path: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("in the config file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hora.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/srv/hora\"\ncommit_window_ms = 50\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            data_dir: Some("here".into()),
            ..Default::default()
        };
        let c = ServeConfig::resolve(args).unwrap();
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
        let c = ServeConfig::resolve(ServeArgs {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (c.max_upload_share, c.max_unauthenticated_per_source),
            (0.5, 4)
        );
        let nets: Vec<String> = c.admin_allow.iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["10.0.0.0/8", "2001:db8::7/128"]);
        std::fs::write(&path, "admin_allow = [\"10.0.0.0/33\"]\n").unwrap();
        let err = ServeConfig::resolve(ServeArgs {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("admin_allow: `10.0.0.0/33`"),
            "{err:#}"
        );
        for share in [0.0, 1.5, f64::NAN] {
            let err = ServeConfig::resolve(ServeArgs {
                max_upload_share: Some(share),
                ..Default::default()
            })
            .unwrap_err();
            assert!(format!("{err:#}").contains("max_upload_share"), "{err:#}");
        }
        std::fs::write(
            &path,
            "store = \"postgres://hora:secret@db.example:5433/fl\"\n",
        )
        .unwrap();
        let c = ServeConfig::resolve(ServeArgs {
            config: Some(path.clone()),
            ..Default::default()
        })
        .unwrap();
        let crate::store::StoreLocation::Postgres(target) = &c.store else {
            panic!("{:?}", c.store)
        };
        assert_eq!(target.to_string(), "db.example:5433/fl");
        assert!(!format!("{c:?}").contains("secret"), "{c:?}");
        let c = ServeConfig::resolve(ServeArgs {
            config: Some(path.clone()),
            store: Some("sled".into()),
            ..Default::default()
        })
        .unwrap();
        assert!(matches!(c.store, crate::store::StoreLocation::Sled));
        for (store, says) in [
            ("mysql://x", "unknown store `mysql`"),
            ("postgres://h/db?sslmode=require", "sslmode=require"),
            (
                "postgres://h/db?frobnicate=1",
                "not a PostgreSQL connection URL",
            ),
        ] {
            let err = ServeConfig::resolve(ServeArgs {
                store: Some(store.into()),
                ..Default::default()
            })
            .unwrap_err();
            assert!(format!("{err:#}").contains(says), "{store}: {err:#}");
        }
        std::fs::write(&path, "lisen = \"x\"\n").unwrap();
        let err = ServeConfig::resolve(ServeArgs {
            config: Some(path),
            ..Default::default()
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("lisen"), "{err:#}");
    }

    #[test]
    fn blobs_are_under_the_data_directory_unless_told() {
        use crate::store::BlobLocation;
        let resolve = |blobs: Option<&str>, endpoint: Option<&str>| {
            ServeConfig::resolve(ServeArgs {
                blobs: blobs.map(Into::into),
                blobs_endpoint: endpoint.map(Into::into),
                ..Default::default()
            })
            .map(|c| c.blobs)
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
            }
        );
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
