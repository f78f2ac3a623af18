//! Test harness: the real `hora-server` binary on loopback with real TLS and a real sled data
//! directory, and a test client that enrols, joins, seals and uploads real deltas.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hora_common::envelope::{self, Binding};
use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{
    ApiError, CreateTask, Credentials, JoinResponse, ModelKind, RoundOffer, StrategyConfig,
    TaskInfo, TrainingConfig, UpdateMeta, UpdateReceipt,
};
use reqwest::{Method, StatusCode};

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// `target/<profile>/<name>`, next to this test's `deps/` directory.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins, or make test)",
        path.display()
    );
    path
}

/// `target/<profile>/examples/<name>`, next to this test's own `deps/` directory.
pub fn example(name: &str) -> PathBuf {
    let path = binary("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build the examples first (cargo build --examples, or make test)",
        path.display()
    );
    path
}

/// A running server process. Killed (by its own pid) when dropped.
/// Runs an example to success and returns its stdout and the JSON of its `RESULT` line.
pub fn run_example(name: &str, args: &[&str]) -> (String, serde_json::Value) {
    let out = Command::new(example(name))
        .args(args)
        .output()
        .expect("run the example");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{name} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let result = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line:\n{stdout}"));
    (
        stdout.clone(),
        serde_json::from_str(result).expect("RESULT json"),
    )
}

pub struct Server {
    child: Child,
    pub url: String,
    pub ca: PathBuf,
    pub data_dir: PathBuf,
}

impl Server {
    pub fn start(data_dir: &Path) -> Server {
        Server::start_with(data_dir, &[])
    }

    /// Starts with extra `serve` flags.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Server {
        Server::start_on(data_dir, "127.0.0.1:0", extra)
    }

    /// Starts listening on `listen` (a fixed port lets a restarted server keep its URL).
    pub fn start_on(data_dir: &Path, listen: &str, extra: &[&str]) -> Server {
        Server::spawn_on(data_dir, listen, extra).listening()
    }

    /// Starts `hora-server serve` on `listen` without waiting for it to listen (a standby
    /// replica listens only once it leads).
    pub fn spawn_on(data_dir: &Path, listen: &str, extra: &[&str]) -> Starting {
        let child = Command::new(binary("hora-server"))
            .args([
                "serve",
                "--listen",
                listen,
                "--admin-token",
                ADMIN_TOKEN,
                "--data-dir",
            ])
            .arg(data_dir)
            .args(extra)
            .env("HORA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start hora-server");
        Starting {
            child: Some(child),
            ca: data_dir.join("certs/ca.pem"),
            data_dir: data_dir.to_path_buf(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown of any kind.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn api(&self, token: &str) -> Api {
        Api {
            http: hora_server::tls::https_client(&self.ca, None).expect("https client"),
            url: self.url.clone(),
            token: token.to_string(),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A `hora-client train` process for `task` on `server`, enrolled with a fresh token, its
/// state in `state_dir`, training on `data` as client `k` (seeded `k`, one thread, on the
/// CPU), with `extra` arguments; its output goes to `log`.
pub async fn spawn_train_client(
    server: &Server,
    task: &str,
    state_dir: &Path,
    data: &str,
    k: usize,
    extra: &[&std::ffi::OsStr],
    log: &Path,
) -> Child {
    let admin = server.api(ADMIN_TOKEN);
    let token: serde_json::Value = admin
        .ok(admin
            .request(Method::POST, "/admin/v1/enrolments")
            .json(&serde_json::json!({})))
        .await;
    let log = std::fs::File::create(log).expect("log");
    Command::new(binary("hora-client"))
        .args(["train", "--server", &server.url, "--task", task, "--token"])
        .arg(token["token"].as_str().expect("token"))
        .arg("--ca")
        .arg(&server.ca)
        .arg("--state-dir")
        .arg(state_dir)
        .args(["--data", data])
        .args(["--client-index", &k.to_string(), "--seed", &k.to_string()])
        .args(["--threads", "1", "--device", "cpu", "--no-progress"])
        .args(extra)
        .env("HORA_LOG", "warn")
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start hora-client")
}

/// Child processes killed (by their ids) and reaped when dropped.
pub struct Processes(pub Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A server process started but not (yet) listening; killed by its pid when dropped.
pub struct Starting {
    child: Option<Child>,
    ca: PathBuf,
    data_dir: PathBuf,
}

impl Starting {
    /// Waits until it listens (a standby: until it leads), a minute at most (then it is
    /// killed and the test fails); its later output is drained.
    pub fn listening(mut self) -> Server {
        let stdout = self
            .child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .expect("not waited for yet");
        let (said, listening) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(url) = line.strip_prefix("hora-server listening on ") {
                    let _ = said.send(url.trim().to_string());
                }
            }
        });
        let url = listening
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the server exited, or did not listen within a minute");
        Server {
            child: self.child.take().expect("still ours"),
            url,
            ca: self.ca.clone(),
            data_dir: self.data_dir.clone(),
        }
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

/// The throwaway PostgreSQL server the store's tests start, this same file.
#[path = "../../server/src/store/postgres/test_server.rs"]
pub mod test_server;

/// Replicas of one server: `hora-server` processes on one PostgreSQL database of the test's own,
/// their blobs in one shared directory (`--blobs file://…`) and their development certificates
/// in another, all on one `--listen` address (a standby finds it taken, and listens only once it
/// leads) unless started [on one of its own](Replicas::spawn_on) (it follows there), each with
/// its own data directory and a lease of two seconds. [`Replicas::on_one_data_dir`] starts them
/// without `--blobs`, on one data directory instead: then none can follow, and a standby on an
/// address of its own answers clients 503 `standby` until it leads.
pub struct Replicas {
    postgres: test_server::TestServer,
    pub listen: String,
    shared: tempfile::TempDir,
    dirs: Vec<tempfile::TempDir>,
    shared_blobs: bool,
}

impl Replicas {
    pub fn new(listen: &str) -> Replicas {
        Replicas {
            postgres: test_server::TestServer::start(),
            listen: listen.to_string(),
            shared: tempfile::tempdir().expect("a temporary directory"),
            dirs: Vec::new(),
            shared_blobs: true,
        }
    }

    pub fn on_one_data_dir(listen: &str) -> Replicas {
        Replicas {
            shared_blobs: false,
            ..Replicas::new(listen)
        }
    }

    /// Starts one more replica: the first leads, the others stand by.
    pub fn spawn(&mut self) -> Starting {
        let listen = self.listen.clone();
        self.spawn_on(&listen)
    }

    /// [`spawn`](Self::spawn) on an address of its own, where it serves clients as a follower
    /// until it leads (it stands by there instead [on one data directory](Self::on_one_data_dir)).
    pub fn spawn_on(&mut self, listen: &str) -> Starting {
        let certs = self.shared.path().join("certs");
        let (store, blobs) = (self.postgres.url(), self.shared.path().join("blobs"));
        let blobs = format!("file://{}", blobs.display());
        let mut args = vec!["--store", &store, "--lease-secs", "2", "--certs-dir"];
        args.push(certs.to_str().expect("a UTF-8 path"));
        let data = match self.shared_blobs {
            true => {
                args.extend(["--blobs", &blobs]);
                let dir = tempfile::tempdir().expect("a temporary directory");
                let path = dir.path().to_path_buf();
                self.dirs.push(dir);
                path
            }
            false => self.shared.path().join("data"),
        };
        let mut starting = Server::spawn_on(&data, listen, &args);
        starting.ca = certs.join("ca.pem");
        starting
    }
}

/// A raw TLS connection to the server over loopback.
pub type RawTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// A raw TLS connection speaking HTTP/1.1, for requests no well-behaved client would send.
pub async fn raw_tls(server: &Server) -> RawTls {
    raw_tls_from(server, "127.0.0.1").await
}

/// [`raw_tls`] from another loopback address (`127.0.0.2`: another source to the server).
pub async fn raw_tls_from(server: &Server, source: &str) -> RawTls {
    let mut config = hora_common::tls::client_config(&server.ca, None).expect("tls config");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let addr: std::net::SocketAddr = server
        .url
        .trim_start_matches("https://")
        .parse()
        .expect("the server's address");
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{source}:0").parse().expect("a source address"))
        .expect("bind the source address");
    let tcp = socket.connect(addr).await.expect("connect");
    let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
    connector.connect(name, tcp).await.expect("tls handshake")
}

/// The head and the first bytes of a raw HTTP/1.1 upload of `body` by `client`; the caller
/// decides how much of the body follows.
pub fn upload_head(client: &Client, task: &str, round: u64, body_len: usize) -> String {
    format!(
        "POST /v1/tasks/{task}/rounds/{round}/update HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {}\r\nx-hora-update: {{\"num_examples\":10}}\r\ncontent-type: application/octet-stream\r\ncontent-length: {body_len}\r\n\r\n",
        client.api.token
    )
}

/// A loopback port that was free a moment ago.
/// Where the kernel's ephemeral ports start (at least 12,000): tests take ports from 10,000 up to
/// it.
pub fn below_ephemeral() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768)
        .max(12_000)
}

/// A free port below the kernel's ephemeral range, so that no process's outgoing connection or
/// port-0 listener (a sync worker's ring, a client) can take it between the probe and a server
/// started, or restarted, on it.
pub fn free_port() -> u16 {
    use rand::Rng;
    let below = below_ephemeral();
    for _ in 0..1000 {
        let port = rand::rng().random_range(10_000..below);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port below {below}");
}

/// An HTTP client with one bearer token.
#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub url: String,
    pub token: String,
}

impl Api {
    pub fn with_token(&self, token: &str) -> Api {
        Api {
            token: token.to_string(),
            ..self.clone()
        }
    }

    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .timeout(Duration::from_secs(60));
        if self.token.is_empty() {
            req
        } else {
            req.bearer_auth(&self.token)
        }
    }

    /// Signs in to the dashboard with the admin token: the session's `Cookie` header value.
    pub async fn dashboard_cookie(&self) -> String {
        let signed_in = self
            .http
            .post(format!("{}/dashboard/api/session", self.url))
            .json(&serde_json::json!({ "token": ADMIN_TOKEN }))
            .send()
            .await
            .expect("sign in to the dashboard");
        assert_eq!(signed_in.status(), StatusCode::OK);
        signed_in
            .headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .expect("a session cookie")
            .to_string()
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        self.request(Method::GET, "/metrics")
            .send()
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text")
    }

    /// The sum of the `/metrics` samples of metric `name` (any labels), or of the one sample
    /// `name` names with its labels (`name{label="value"}`).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with([' ', '{']) || name.ends_with('}'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Sends and decodes a success body, panicking with the server's error otherwise.
    pub async fn ok<T: serde::de::DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> T {
        let resp = req.send().await.expect("request");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        assert!(status.is_success(), "{status}: {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("decoding {text}: {e}"))
    }

    /// Sends and expects a refusal with `status` and error `code`; returns the message.
    pub async fn refused(
        &self,
        req: reqwest::RequestBuilder,
        status: StatusCode,
        code: &str,
    ) -> String {
        let resp = req.send().await.expect("request");
        let got = resp.status();
        let text = resp.text().await.expect("body");
        let err: ApiError = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{got}: not an ApiError body: {text}"));
        assert_eq!((got, err.code.as_str()), (status, code), "{}", err.message);
        assert!(!err.message.is_empty());
        err.message
    }

    pub async fn upload_model(&self, model: &Model) -> ModelDigest {
        let v: serde_json::Value = self
            .ok(self
                .request(Method::POST, "/admin/v1/models")
                .body(model.to_safetensors()))
            .await;
        serde_json::from_value(v["digest"].clone()).expect("digest")
    }

    pub async fn create_task(&self, task: &CreateTask) -> TaskInfo {
        self.ok(self.request(Method::POST, "/admin/v1/tasks").json(task))
            .await
    }

    /// Creates a sync job; the answer carries its token.
    pub async fn create_sync_job(
        &self,
        job: &hora_common::wire::CreateSyncJob,
    ) -> hora_common::wire::SyncJobInfo {
        self.ok(self.request(Method::POST, "/admin/v1/sync-jobs").json(job))
            .await
    }

    /// The model `task` published for `round`, waiting up to 30 s for it: a round closes in
    /// the background after the upload that filled it was acknowledged.
    pub async fn round_model(&self, task: &str, round: u64) -> Model {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let resp = loop {
            let resp = self
                .request(
                    Method::GET,
                    &format!("/admin/v1/tasks/{task}/rounds/{round}/model"),
                )
                .send()
                .await
                .expect("request");
            if resp.status() != StatusCode::NOT_FOUND || std::time::Instant::now() > deadline {
                break resp;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(resp.status(), StatusCode::OK, "round {round} of {task}");
        Model::from_safetensors(&resp.bytes().await.expect("body"), &Default::default())
            .expect("model")
    }

    /// A fresh one-time enrolment token.
    pub async fn enrolment_token(&self) -> String {
        self.enrolment_token_with(serde_json::json!({})).await
    }

    /// A fresh one-time enrolment token of these terms (`CreateEnrolment` as JSON).
    pub async fn enrolment_token_with(&self, terms: serde_json::Value) -> String {
        let token: serde_json::Value = self
            .ok(self
                .request(Method::POST, "/admin/v1/enrolments")
                .json(&terms))
            .await;
        token["token"]
            .as_str()
            .expect("the enrolment token")
            .to_string()
    }

    /// A fresh one-time enrolment token, as an API that presents it.
    pub async fn enrolling(&self) -> Api {
        self.with_token(&self.enrolment_token().await)
    }

    /// Enrols a new client through a fresh one-time token.
    pub async fn enrol(&self) -> Client {
        self.enrol_with(serde_json::json!({})).await
    }

    /// Enrols a new client through a fresh one-time token of these terms.
    pub async fn enrol_with(&self, terms: serde_json::Value) -> Client {
        let enrolling = self.with_token(&self.enrolment_token_with(terms).await);
        let creds: Credentials = enrolling
            .ok(enrolling
                .request(Method::POST, "/v1/enrol")
                .json(&serde_json::json!({})))
            .await;
        Client {
            api: self.with_token(&format!("{}.{}", creds.client_id, creds.secret)),
            id: creds.client_id,
        }
    }
}

pub fn task(
    id: &str,
    initial: ModelDigest,
    rounds: u64,
    min: u32,
    target: u32,
    deadline_secs: u64,
) -> CreateTask {
    CreateTask {
        parent: None,
        trainable: None,
        evaluation: None,
        compression: None,
        id: id.into(),
        initial_model: initial,
        model: ModelKind::Builtin {
            name: "mlp".into(),
            params: Default::default(),
        },
        strategy: StrategyConfig::FedAvg,
        rounds,
        min_clients: min,
        target_clients: target,
        over_selection: 0.0,
        round_deadline_secs: deadline_secs,
        training: TrainingConfig::default(),
        secure_aggregation: None,
        update_bounds: Default::default(),
        differential_privacy: None,
        asynchronous: None,
    }
}

/// An enrolled client.
pub struct Client {
    pub api: Api,
    pub id: String,
}

impl Client {
    pub async fn join(&self, task: &str) -> RoundOffer {
        let j: JoinResponse = self
            .api
            .ok(self
                .api
                .request(Method::POST, &format!("/v1/tasks/{task}/join")))
            .await;
        j.offer.expect("selected")
    }

    /// Joins the open round of `task`; `None` when not selected (the round is full, the task
    /// paused) or when the server refuses.
    pub async fn try_join(&self, task: &str) -> Option<RoundOffer> {
        let r = self
            .api
            .request(Method::POST, &format!("/v1/tasks/{task}/join"))
            .send()
            .await
            .ok()?;
        if !r.status().is_success() {
            return None;
        }
        r.json::<JoinResponse>().await.ok()?.offer
    }

    pub async fn global(&self, task: &str) -> (Model, String) {
        let resp = self
            .api
            .request(Method::GET, &format!("/v1/tasks/{task}/model"))
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), StatusCode::OK);
        let etag = resp.headers()["etag"]
            .to_str()
            .expect("etag")
            .trim_matches('"')
            .to_string();
        (
            Model::from_safetensors(&resp.bytes().await.expect("body"), &Default::default())
                .expect("model"),
            etag,
        )
    }

    pub fn seal(&self, task: &str, offer: &RoundOffer, delta: &Model) -> Vec<u8> {
        let binding = Binding {
            task,
            round: offer.round,
            client: &self.id,
            base_model: &offer.model,
        };
        envelope::seal(&delta.to_safetensors(), &offer.round_key, &binding).expect("seal")
    }

    pub fn upload_request(
        &self,
        task: &str,
        round: u64,
        examples: u64,
        body: Vec<u8>,
    ) -> reqwest::RequestBuilder {
        let metrics = hora_common::wire::Metrics {
            loss: Some(0.5),
            accuracy: Some(0.75),
        };
        self.upload_request_reporting(task, round, examples, body, metrics)
    }

    /// [`Client::upload_request`] with the training metrics given.
    pub fn upload_request_reporting(
        &self,
        task: &str,
        round: u64,
        examples: u64,
        body: Vec<u8>,
        metrics: hora_common::wire::Metrics,
    ) -> reqwest::RequestBuilder {
        let meta = UpdateMeta {
            num_examples: examples,
            metrics,
            contributors: None,
        };
        self.api
            .request(
                Method::POST,
                &format!("/v1/tasks/{task}/rounds/{round}/update"),
            )
            .header("x-hora-update", serde_json::to_string(&meta).expect("json"))
            .body(body)
    }

    pub async fn upload(
        &self,
        task: &str,
        offer: &RoundOffer,
        examples: u64,
        delta: &Model,
    ) -> UpdateReceipt {
        let body = self.seal(task, offer, delta);
        self.api
            .ok(self.upload_request(task, offer.round, examples, body))
            .await
    }
}

/// A deterministic pseudo-random delta for `client` in `round` (xorshift; no shared state).
pub fn delta(like: &Model, seed: u64) -> Model {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut m = Model::zeros(&like.spec());
    for v in m.data_mut() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
    }
    m
}

/// global + Σ nᵢ·δᵢ / Σ nᵢ, computed independently in f64.
pub fn fedavg(global: &Model, updates: &[(u64, Model)]) -> Model {
    let total: f64 = updates.iter().map(|(n, _)| *n as f64).sum();
    let mut out = global.clone();
    for (i, g) in out.data_mut().iter_mut().enumerate() {
        let s: f64 = updates
            .iter()
            .map(|(n, d)| *n as f64 * f64::from(d.data()[i]))
            .sum();
        *g = (f64::from(*g) + s / total) as f32;
    }
    out
}

/// A model of `spec` whose values repeat a small ramp (0 to 0.1): cheap to make at any size,
/// and not all zeros, for the benches' large models.
pub fn ramp_model(spec: &hora_common::model::ModelSpec) -> Model {
    let mut model = Model::zeros(spec);
    model
        .data_mut()
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = (i % 101) as f32 * 1e-3);
    model
}

pub fn small_model() -> Model {
    Model::from_tensors([
        (
            "fc1.weight",
            vec![16, 8],
            (0..128).map(|i| (i as f32 * 0.37).sin() * 0.1).collect(),
        ),
        ("fc1.bias", vec![16], vec![0.01; 16]),
        (
            "fc2.weight",
            vec![4, 16],
            (0..64).map(|i| (i as f32 * 0.11).cos() * 0.1).collect(),
        ),
        ("fc2.bias", vec![4], vec![0.0; 4]),
    ])
    .expect("model")
}

pub fn assert_close(got: &Model, want: &Model) {
    assert_eq!(got.spec(), want.spec());
    for (i, (g, w)) in got.data().iter().zip(want.data()).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
            "element {i}: got {g}, want {w}"
        );
    }
}

/// A sample of one option for [`check_layering`]: its key and two different values as a flag
/// would give them.
pub type Sample = (&'static str, &'static str, &'static str);

/// Checks, through `config check --json` of the real binary (`program` with `check_args`),
/// that every declared option is honoured from the `--config` file, its `HORA_*` variable and
/// its flag, with flags > environment > file > default. The options come from the declaration
/// itself (the report of a bare run), so `samples` must name each of them: a new option without
/// a sample fails here. `pairs` say one thing two ways and cannot both be given in one layer
/// (`token` and `token_file`): the first of each is checked in one set of runs, the second in
/// another. A secret shows only its length, so secrets' samples differ in length.
pub fn check_layering(
    program: &str,
    check_args: &[&str],
    samples: &[Sample],
    pairs: &[(&str, &str)],
) {
    use serde_json::Value;
    use std::collections::{BTreeMap, BTreeSet};

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    // (A bare run may be refused for what it lacks; it still prints its options.)
    let run_as = |bare: bool,
                  file: Option<&str>,
                  env: &[(String, String)],
                  flags: &[String]|
     -> BTreeMap<String, Value> {
        let mut cmd = Command::new(binary(program));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .args(check_args)
            .arg("--json");
        if let Some(text) = file {
            std::fs::write(&config, text).unwrap();
            cmd.arg("--config").arg(&config);
        }
        cmd.envs(env.iter().map(|(k, v)| (k, v))).args(flags);
        let out = cmd.output().unwrap();
        assert!(
            bare || out.status.success(),
            "{program} {check_args:?} {flags:?} with {env:?} and {file:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{program} {check_args:?}: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    };
    let run = |file: Option<&str>, env: &[(String, String)], flags: &[String]| {
        run_as(false, file, env, flags)
    };
    let bare = run_as(true, None, &[], &[]);
    let declared: BTreeSet<&str> = bare.keys().map(String::as_str).collect();
    let sampled: BTreeSet<&str> = samples.iter().map(|s| s.0).collect();
    assert_eq!(
        declared, sampled,
        "{program} {check_args:?}: every declared option needs a sample here, and only those"
    );
    for (key, setting) in &bare {
        assert_eq!(setting["source"], "default", "{key}: {setting}");
    }
    let name = |key: &str, what: &str| -> String {
        bare[key][what]
            .as_str()
            .unwrap_or_else(|| panic!("{key} has no {what}"))
            .to_string()
    };
    // A file's secret (token_file) must exist: each sample path names a file holding a token.
    for (_, a, b) in samples {
        for v in [a, b] {
            if let Some(file) = v.strip_prefix("secret-file:") {
                // (Long enough for any secret's minimum: the dashboard's is 32.)
                let secret = format!("token-in-{file}-long-enough-for-every-secret");
                std::fs::write(dir.path().join(file), format!("{secret}\n")).unwrap();
            }
        }
    }
    let value = |v: &str| -> String {
        match v.strip_prefix("secret-file:") {
            Some(file) => dir.path().join(file).to_str().unwrap().to_string(),
            None => v.to_string(),
        }
    };
    for first in [true, false] {
        let left_out: Vec<&str> = pairs
            .iter()
            .map(|p| if first { p.1 } else { p.0 })
            .collect();
        let keys: Vec<&Sample> = samples
            .iter()
            .filter(|s| !left_out.contains(&s.0))
            .collect();
        let flags = |pick: fn(&Sample) -> &'static str| -> Vec<String> {
            let mut flags = Vec::new();
            for s in &keys {
                let v = value(pick(s));
                match v.as_str() {
                    "true" => flags.push(name(s.0, "flag")),
                    "false" => {}
                    _ => flags.extend([name(s.0, "flag"), v]),
                }
            }
            flags
        };
        let (a, b) = (
            run(None, &[], &flags(|s| s.1)),
            run(None, &[], &flags(|s| s.2)),
        );
        let file: String = keys
            .iter()
            .map(|s| format!("{} = {}\n", s.0, a[s.0]["value"]))
            .collect();
        // A secret's value is masked: the file gets it from the flag's sample instead.
        let file: String = file
            .lines()
            .zip(&keys)
            .map(|(line, s)| match a[s.0]["value"].as_str() {
                Some(v) if v.starts_with("(secret") => format!("{} = {:?}\n", s.0, value(s.1)),
                _ => format!("{line}\n"),
            })
            .collect();
        let env: Vec<(String, String)> = keys
            .iter()
            .map(|s| (name(s.0, "env"), value(s.2)))
            .collect();
        let check = |got: &BTreeMap<String, Value>,
                     want: &BTreeMap<String, Value>,
                     source: &str,
                     layers: &str| {
            for s in &keys {
                let (g, w) = (&got[s.0], &want[s.0]);
                assert_eq!(g["value"], w["value"], "{program}: {} from {layers}", s.0);
                assert_eq!(g["source"], source, "{program}: {} from {layers}: {g}", s.0);
            }
        };
        check(&run(Some(&file), &[], &[]), &a, "file", "the file");
        check(
            &run(Some(&file), &env, &[]),
            &b,
            "env",
            "the file and the environment",
        );
        check(
            &run(Some(&file), &env, &flags(|s| s.1)),
            &a,
            "flag",
            "the file, the environment and flags",
        );
        if !first {
            // The other of each pair in the environment beside these flags: taken, the flag's
            // winning (not refused as a conflict).
            for (other, _) in pairs {
                let sample = samples.iter().find(|s| s.0 == *other).unwrap();
                let env = [(name(other, "env"), value(sample.2))];
                let got = run(None, &env, &flags(|s| s.1));
                assert_eq!(got[*other]["source"], "env", "{program}: {other}");
            }
        }
    }
}

/// Which way a [`cutting_relay`] cuts its first connection.
#[derive(Clone, Copy)]
pub enum Cut {
    /// Once this many bytes came back from the server (a download that drops).
    Back(u64),
    /// Once this many bytes went to the server (an upload that drops).
    Forth(u64),
}

/// A TCP relay on loopback to `upstream` that cuts its first connection as `cut` says (later
/// connections pass whole). Its port, and the count of bytes all its connections passed in the
/// cut direction.
pub async fn cutting_relay(upstream: std::net::SocketAddr, cut: Cut) -> (u16, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let passed = Arc::new(AtomicU64::new(0));
    let counted = passed.clone();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((down, _)) = listener.accept().await {
            let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                continue;
            };
            // (Small writes go at once, as on the direct connection: no Nagle delays.)
            let _ = (down.set_nodelay(true), up.set_nodelay(true));
            let (counted, cutting) = (counted.clone(), std::mem::replace(&mut first, false));
            tokio::spawn(async move {
                let (down_r, down_w) = down.into_split();
                let (up_r, up_w) = up.into_split();
                let limit = |n: u64| if cutting { n } else { u64::MAX };
                let (back_limit, forth_limit, back_count, forth_count) = match cut {
                    Cut::Back(n) => (limit(n), u64::MAX, Some(counted), None),
                    Cut::Forth(n) => (u64::MAX, limit(n), None, Some(counted)),
                };
                // Either way ends the connection: both halves are dropped.
                tokio::select! {
                    _ = pipe(up_r, down_w, back_limit, back_count) => {}
                    _ = pipe(down_r, up_w, forth_limit, forth_count) => {}
                }
            });
        }
    });
    (port, passed)
}

/// Copies `from` to `to` until either ends or `limit` bytes passed, counting them in `count`.
pub async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    limit: u64,
    count: Option<Arc<AtomicU64>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut passed, mut buf) = (0u64, vec![0u8; 1 << 14]);
    while passed < limit {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n.min((limit - passed) as usize),
        };
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        passed += n as u64;
        if let Some(count) = &count {
            count.fetch_add(n as u64, Ordering::SeqCst);
        }
    }
}

/// The peak resident set size of process `pid` (VmHWM), in bytes; None where `/proc` does not
/// say.
pub fn peak_rss(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
}
