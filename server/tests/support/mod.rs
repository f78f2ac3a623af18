//! A real `hora-server serve` on loopback for the cross-process tests of this crate, and a test
//! client that enrols, joins, seals and uploads deltas without libtorch.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hora_common::envelope::{self, Binding};
use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{Credentials, JoinResponse, RoundOffer, TaskInfo, UpdateMeta};
use serde_json::{json, Value};

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
        Server::start_with(data_dir, &[])
    }

    /// Starts with extra `serve` flags.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Server {
        Server::spawn_on(data_dir, "127.0.0.1:0", extra).listening()
    }

    /// Starts `hora-server serve` on `listen` without waiting for it to listen (a standby
    /// replica listens only once it leads).
    pub fn spawn_on(data_dir: &Path, listen: &str, extra: &[&str]) -> Starting {
        Server::spawn_with(data_dir, listen, extra, &[])
    }

    /// [`spawn_on`](Self::spawn_on) with environment variables `envs` set.
    pub fn spawn_with(
        data_dir: &Path,
        listen: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Starting {
        let child = Command::new(env!("CARGO_BIN_EXE_hora-server"))
            .args(["serve", "--listen", listen, "--admin-token", ADMIN_TOKEN])
            .arg("--data-dir")
            .arg(data_dir)
            .args(extra)
            .env("HORA_LOG", "warn")
            .envs(envs.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start hora-server");
        Starting {
            child: Some(child),
            ca: data_dir.join("certs/ca.pem"),
            lines: None,
        }
    }

    /// An HTTPS client that trusts the server's CA.
    pub fn http(&self) -> reqwest::Client {
        hora_server::tls::https_client(&self.ca, None).expect("an HTTPS client")
    }

    /// SIGKILL (through the handle of the child this test started): no shutdown of any kind.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (to the child this test started), then waits for it to exit: a clean stop.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let pid = libc::pid_t::try_from(self.child.id()).expect("a pid");
        // SAFETY: kill only sends a signal, to the child this test started and still holds.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        self.child.wait().expect("the server exits")
    }

    /// The admin API of this server.
    pub fn admin(&self) -> Api {
        Api {
            http: self.http(),
            url: self.url.clone(),
            token: ADMIN_TOKEN.to_string(),
        }
    }
}

/// An HTTPS client of one server with one bearer token.
#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
}

impl Api {
    /// Sends a request and decodes a success body, panicking with the server's answer otherwise.
    pub async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .timeout(Duration::from_secs(60));
        if !self.token.is_empty() {
            req = req.bearer_auth(&self.token);
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.expect("an answer");
        let status = resp.status();
        let text = resp.text().await.expect("a body");
        assert!(status.is_success(), "{path}: {status}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
    }

    pub async fn upload_model(&self, model: &Model) -> ModelDigest {
        let resp = self
            .http
            .post(format!("{}/admin/v1/models", self.url))
            .bearer_auth(&self.token)
            .body(model.to_safetensors())
            .send()
            .await
            .expect("an answer");
        assert!(resp.status().is_success(), "{}", resp.status());
        let v: Value = resp.json().await.expect("json");
        serde_json::from_value(v["digest"].clone()).expect("a digest")
    }

    pub async fn task(&self, id: &str) -> TaskInfo {
        let v = self
            .call(reqwest::Method::GET, &format!("/admin/v1/tasks/{id}"), None)
            .await;
        serde_json::from_value(v).expect("TaskInfo")
    }

    /// Waits until task `id` has published `rounds` rounds.
    pub async fn wait_published(&self, id: &str, rounds: u64) -> TaskInfo {
        let started = Instant::now();
        loop {
            let info = self.task(id).await;
            if info.published_rounds >= rounds {
                return info;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "task {id} did not publish round {rounds}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The model round `round` of task `id` published.
    pub async fn round_model(&self, id: &str, round: u64) -> Model {
        let resp = self
            .http
            .get(format!(
                "{}/admin/v1/tasks/{id}/rounds/{round}/model",
                self.url
            ))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("an answer");
        assert!(resp.status().is_success(), "{}", resp.status());
        Model::from_safetensors(&resp.bytes().await.expect("a body"), &Default::default())
            .expect("a model")
    }

    /// Enrols a new client through a fresh one-time token.
    pub async fn enrol(&self) -> Client {
        let token = self
            .call(
                reqwest::Method::POST,
                "/admin/v1/enrolments",
                Some(json!({})),
            )
            .await;
        let enrolling = Api {
            token: token["token"].as_str().expect("the enrolment token").into(),
            ..self.clone()
        };
        let creds: Credentials = serde_json::from_value(
            enrolling
                .call(reqwest::Method::POST, "/v1/enrol", Some(json!({})))
                .await,
        )
        .expect("Credentials");
        Client {
            api: Api {
                token: format!("{}.{}", creds.client_id, creds.secret),
                ..self.clone()
            },
            id: creds.client_id,
        }
    }
}

/// An enrolled client.
pub struct Client {
    pub api: Api,
    pub id: String,
}

impl Client {
    /// Joins the open round of `task`; panics if not selected.
    pub async fn join(&self, task: &str) -> RoundOffer {
        let v = self
            .api
            .call(
                reqwest::Method::POST,
                &format!("/v1/tasks/{task}/join"),
                None,
            )
            .await;
        let join: JoinResponse = serde_json::from_value(v).expect("JoinResponse");
        join.offer.expect("selected for the round")
    }

    /// Seals `delta` to the offered round and uploads it, weighted by `examples`; returns once
    /// the server acknowledged it (durable).
    pub async fn upload(&self, task: &str, offer: &RoundOffer, examples: u64, delta: &Model) {
        let status = self.try_upload(task, offer, examples, delta).await;
        assert!(status < 300, "the upload was answered {status}");
    }

    /// [`upload`](Self::upload), answering the HTTP status whatever it is.
    pub async fn try_upload(
        &self,
        task: &str,
        offer: &RoundOffer,
        examples: u64,
        delta: &Model,
    ) -> u16 {
        let (status, body) = self
            .upload_plaintext(task, offer, examples, &delta.to_safetensors())
            .await;
        if status >= 300 {
            eprintln!("upload: {status}: {body}");
        }
        status
    }

    /// Seals `plaintext` (an update in any format) and uploads it: the HTTP status and body.
    pub async fn upload_plaintext(
        &self,
        task: &str,
        offer: &RoundOffer,
        examples: u64,
        plaintext: &[u8],
    ) -> (u16, String) {
        let binding = Binding {
            task,
            round: offer.round,
            client: &self.id,
            base_model: &offer.model,
        };
        let sealed = envelope::seal(plaintext, &offer.round_key, &binding).expect("sealed");
        let meta = UpdateMeta {
            num_examples: examples,
            metrics: Default::default(),
            contributors: None,
        };
        let resp = self
            .api
            .http
            .post(format!(
                "{}/v1/tasks/{task}/rounds/{}/update",
                self.api.url, offer.round
            ))
            .bearer_auth(&self.api.token)
            .header("x-hora-update", serde_json::to_string(&meta).expect("json"))
            .body(sealed)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .expect("an answer");
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap_or_default())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server process started but not (yet) listening; killed by its pid when dropped.
pub struct Starting {
    child: Option<Child>,
    pub ca: PathBuf,
    /// Its standard output, line by line, once read (drained by a thread of its own).
    lines: Option<std::sync::mpsc::Receiver<String>>,
}

impl Starting {
    /// The next line of standard output that starts with `prefix`, without it (a minute at
    /// most: then the test fails).
    fn said(&mut self, prefix: &str, what: &str) -> String {
        if self.lines.is_none() {
            let stdout = self
                .child
                .as_mut()
                .and_then(|c| c.stdout.take())
                .expect("its output not read yet");
            let (said, lines) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let _ = said.send(line);
                }
            });
            self.lines = Some(lines);
        }
        let lines = self.lines.as_ref().expect("set above");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the server exited, or did not {what} within a minute"));
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// Waits until it stands by, answering on its own port, and returns that port's URL.
    pub fn standing_by(&mut self) -> String {
        self.said("hora-server standing by on ", "stand by")
    }

    /// Waits until it serves clients while another replica leads (a follower), and returns
    /// its port's URL.
    pub fn following(&mut self) -> String {
        self.said("hora-server following on ", "follow")
    }

    /// Waits until it listens (a standby: until it leads), a minute at most (then it is
    /// killed and the test fails); its later output is drained.
    pub fn listening(mut self) -> Server {
        let url = self.said("hora-server listening on ", "listen");
        Server {
            child: self.child.take().expect("still ours"),
            url,
            ca: self.ca.clone(),
        }
    }

    /// Whether it exited already.
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
