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
    /// Where state lives (sled database, model blobs, checkpoints).
    #[arg(long, env = "HORA_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
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
    /// Group-commit window in milliseconds.
    #[arg(long, env = "HORA_COMMIT_WINDOW_MS")]
    pub commit_window_ms: Option<u64>,
    /// Update bodies read and folded at once (bounds memory: each holds one sealed delta).
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
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
    certs_dir: Option<PathBuf>,
    #[serde(default)]
    hosts: Vec<String>,
    admin_token: Option<String>,
    commit_window_ms: Option<u64>,
    max_concurrent_uploads: Option<usize>,
    max_model_bytes: Option<u64>,
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
    pub certs_dir: Option<PathBuf>,
    pub hosts: Vec<String>,
    pub admin_token: Option<String>,
    pub commit_window_ms: u64,
    pub max_concurrent_uploads: usize,
    pub max_model_bytes: u64,
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
        Ok(ServeConfig {
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
            admin_token: args.admin_token.or(file.admin_token),
            commit_window_ms: args.commit_window_ms.or(file.commit_window_ms).unwrap_or(2),
            max_concurrent_uploads: args
                .max_concurrent_uploads
                .or(file.max_concurrent_uploads)
                .unwrap_or(1),
            max_model_bytes: args
                .max_model_bytes
                .or(file.max_model_bytes)
                .unwrap_or(4 << 30),
        })
    }
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
        assert_eq!(c.commit_window_ms, 50);
        assert_eq!(c.max_concurrent_uploads, 1);
        std::fs::write(&path, "lisen = \"x\"\n").unwrap();
        let err = ServeConfig::resolve(ServeArgs {
            config: Some(path),
            ..Default::default()
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("lisen"), "{err:#}");
    }
}
