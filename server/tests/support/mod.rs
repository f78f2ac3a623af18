//! A real `hora-server serve` on loopback for the cross-process tests of this crate.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub const ADMIN_TOKEN: &str = "server-tests-admin-token";

/// A `hora-server serve` child with development TLS certificates, killed (by its pid) when
/// dropped.
pub struct Server {
    child: Child,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    /// The development CA that signed the server's certificate.
    pub ca: PathBuf,
}

impl Server {
    pub fn start(data_dir: &Path) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hora-server"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-token",
                ADMIN_TOKEN,
            ])
            .arg("--data-dir")
            .arg(data_dir)
            .env("HORA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start hora-server");
        let stdout = child.stdout.take().expect("piped stdout");
        let url = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| {
                l.strip_prefix("hora-server listening on ")
                    .map(|u| u.trim().to_string())
            });
        let url = url.expect("the server exited before it was listening");
        Server {
            child,
            url,
            ca: data_dir.join("certs/ca.pem"),
        }
    }

    /// An HTTPS client that trusts the server's CA.
    pub fn http(&self) -> reqwest::Client {
        hora_server::tls::https_client(&self.ca, None).expect("an HTTPS client")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
