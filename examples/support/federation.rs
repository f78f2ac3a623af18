//! What the examples share: a real `hora-server` process on loopback (embedded sled, development
//! TLS made on the fly, in a temporary directory), or several replicas of it on one PostgreSQL
//! database, the operator's side of the admin API, and `hora-client` processes. Every process is
//! ours and is killed by its id when the federation is dropped, so an example leaves nothing
//! running, however it ends.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hora_common::model::{Limits, Model, ModelDigest};
use hora_common::wire::{CreateTask, RoundOutcome, RoundRecord, TaskInfo};
use reqwest::Method;

const ADMIN_TOKEN: &str = "example-admin-token-4f1c2d";

/// `target/<profile>/<name>`: the binaries next to this example's own directory.
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe
        .parent()
        .and_then(|examples| examples.parent())
        .context("the example runs from target/<profile>/examples")?
        .join(name);
    if !path.exists() {
        bail!(
            "{} is missing: build it first (cargo build --release --bins, or make demo)",
            path.display()
        );
    }
    Ok(path)
}

/// A server (or replicas of one), its operator, and the clients started against it.
pub struct Federation {
    /// The server processes (one, or the replicas; None once killed).
    servers: Vec<Option<Child>>,
    /// The server's URL (with replicas: the one that leads, as far as this side knows).
    pub url: String,
    /// Every replica's URL, which the clients are given.
    pub urls: Vec<String>,
    /// Replicas that start to lead, as they say so (index, URL).
    leads: Option<mpsc::Receiver<(usize, String)>>,
    pub ca: PathBuf,
    pub dir: tempfile::TempDir,
    http: reqwest::Client,
    clients: Vec<(String, Child)>,
    may_fail: Vec<String>,
}

impl Federation {
    /// Starts `hora-server serve` on an ephemeral loopback port.
    pub fn start() -> Result<Federation> {
        let dir = tempfile::Builder::new().prefix("hora-example-").tempdir()?;
        let (mut server, stdout) = serve(&dir.path().join("server"), "127.0.0.1:0", &[])?;
        let mut lines = BufReader::new(stdout).lines();
        let url = match lines.find_map(|l| listening(&l.ok()?)) {
            Some(url) => url,
            None => {
                let _ = server.kill();
                let _ = server.wait();
                bail!("hora-server exited before listening");
            }
        };
        // Keep draining the server's stdout so it never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Federation::with_servers(dir, vec![server], url.clone(), vec![url])
    }

    /// Starts `replicas` `hora-server serve` processes on one PostgreSQL database (`store`),
    /// their blobs in one shared directory, each on a loopback port of its own: the first leads,
    /// the others follow (serving clients) until one of them takes the lease,
    /// `lease_secs` after the leader is gone at most.
    pub fn start_replicas(replicas: usize, store: &str, lease_secs: u64) -> Result<Federation> {
        let dir = tempfile::Builder::new()
            .prefix("hora-replicas-")
            .tempdir()?;
        let blobs = format!("file://{}", dir.path().join("blobs").display());
        let certs = dir.path().join("server/certs");
        let lease = lease_secs.to_string();
        let extra = [
            "--store",
            store,
            "--blobs",
            &blobs,
            "--lease-secs",
            &lease,
            "--certs-dir",
            certs.to_str().context("a UTF-8 temporary directory")?,
        ];
        let (leads_tx, leads) = mpsc::channel();
        // Starts replica `i` on a port of its own; its stdout's `listening` lines go to `leads`.
        let start = |i: usize, dir: &std::path::Path| -> Result<(Child, String)> {
            // (A port another process takes before the replica binds it fails the run.)
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let listen = format!("127.0.0.1:{port}");
            let (server, stdout) = serve(&dir.join(format!("replica-{i}")), &listen, &extra)?;
            let leads_tx = leads_tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if let Some(url) = listening(&line) {
                        let _ = leads_tx.send((i, url));
                    }
                }
            });
            Ok((server, format!("https://{listen}")))
        };
        // The first leads before the others start, so it is the one that leads (and it makes
        // the certificates).
        let (mut first, first_url) = start(0, dir.path())?;
        let url = match leads.recv_timeout(Duration::from_secs(60)) {
            Ok((_, url)) => url,
            Err(_) => {
                let _ = first.kill();
                let _ = first.wait();
                bail!("the first replica did not start serving");
            }
        };
        let mut fed = Federation::with_servers(dir, vec![first], url, vec![first_url])?;
        for i in 1..replicas {
            let (server, url) = start(i, fed.dir.path())?;
            fed.servers.push(Some(server));
            fed.urls.push(url);
        }
        fed.leads = Some(leads);
        Ok(fed)
    }

    fn with_servers(
        dir: tempfile::TempDir,
        servers: Vec<Child>,
        url: String,
        urls: Vec<String>,
    ) -> Result<Federation> {
        let ca = dir.path().join("server/certs/ca.pem");
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(hora_common::tls::client_config(&ca, None)?)
            .build()?;
        Ok(Federation {
            servers: servers.into_iter().map(Some).collect(),
            url,
            urls,
            leads: None,
            ca,
            dir,
            http,
            clients: Vec::new(),
            may_fail: Vec::new(),
        })
    }

    /// Waits until every replica answers `/readyz` (a follower does once it serves clients;
    /// before, it stands by and sends them to the leader).
    pub async fn wait_serving(&self, timeout: Duration) -> Result<()> {
        let until = std::time::Instant::now() + timeout;
        for url in &self.urls {
            loop {
                let ready = self.http.get(format!("{url}/readyz")).send().await;
                if ready.is_ok_and(|r| r.status().is_success()) {
                    break;
                }
                if std::time::Instant::now() > until {
                    bail!("{url} does not serve after {timeout:?}");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// SIGKILLs server (replica) `i`, by its id.
    pub fn kill_server(&mut self, i: usize) {
        if let Some(mut server) = self.servers.get_mut(i).and_then(Option::take) {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// Waits until another replica says it leads, and talks to it from then on; its index.
    pub fn wait_leader(&mut self, timeout: Duration) -> Result<usize> {
        let leads = self
            .leads
            .as_ref()
            .context("one server: nothing to fail over to")?;
        let (i, url) = leads
            .recv_timeout(timeout)
            .map_err(|_| anyhow::anyhow!("no replica took over within {timeout:?}"))?;
        self.url = url;
        Ok(i)
    }

    fn admin(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}/admin/v1{path}", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .timeout(Duration::from_secs(60))
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let resp = req.send().await?;
        if !resp.status().is_success() {
            bail!(
                "{}: {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        Ok(resp)
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
    ) -> Result<T> {
        Ok(self.send(req).await?.json().await?)
    }

    pub async fn upload_model(&self, model: &Model) -> Result<ModelDigest> {
        let v: serde_json::Value = self
            .json(
                self.admin(Method::POST, "/models")
                    .body(model.to_safetensors()),
            )
            .await?;
        Ok(serde_json::from_value(v["digest"].clone())?)
    }

    /// Uploads a TorchScript module; returns its digest (hex SHA-256).
    pub async fn upload_module(&self, bytes: Vec<u8>) -> Result<String> {
        let v: serde_json::Value = self
            .json(self.admin(Method::POST, "/modules").body(bytes))
            .await?;
        v["digest"]
            .as_str()
            .map(str::to_string)
            .context("module digest")
    }

    pub async fn create_task(&self, task: &CreateTask) -> Result<TaskInfo> {
        self.json(self.admin(Method::POST, "/tasks").json(task))
            .await
    }

    pub async fn task(&self, task: &str) -> Result<TaskInfo> {
        self.json(self.admin(Method::GET, &format!("/tasks/{task}")))
            .await
    }

    /// A link that signs a browser in to the dashboard once (within ten minutes).
    pub async fn sign_in_link(&self) -> Result<String> {
        let v: serde_json::Value = self
            .json(self.admin(Method::POST, "/dashboard/sign-in-links"))
            .await?;
        let path = v["path"].as_str().context("the link's path")?;
        Ok(format!("{}{path}", self.url))
    }

    /// A one-time enrolment token.
    pub async fn enrolment_token(&self) -> Result<String> {
        let v: serde_json::Value = self
            .json(
                self.admin(Method::POST, "/enrolments")
                    .json(&serde_json::json!({})),
            )
            .await?;
        v["token"].as_str().map(str::to_string).context("token")
    }

    /// The published record of `round`, once there is one (abandoned attempts are retried by
    /// the server, so they are waited through).
    pub async fn wait_round(
        &mut self,
        task: &str,
        round: u64,
        timeout: Duration,
    ) -> Result<RoundRecord> {
        let start = Instant::now();
        loop {
            let history: Vec<RoundRecord> = self
                .json(self.admin(Method::GET, &format!("/tasks/{task}/rounds")))
                .await?;
            if let Some(r) = history
                .into_iter()
                .find(|r| r.round == round && r.outcome == RoundOutcome::Published)
            {
                return Ok(r);
            }
            self.check_clients()?;
            if start.elapsed() > timeout {
                bail!("round {round} of `{task}` was not published within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The task's round history (published and abandoned attempts).
    pub async fn rounds(&self, task: &str) -> Result<Vec<RoundRecord>> {
        self.json(self.admin(Method::GET, &format!("/tasks/{task}/rounds")))
            .await
    }

    pub async fn round_model(&self, task: &str, round: u64) -> Result<Model> {
        let bytes = self
            .send(self.admin(Method::GET, &format!("/tasks/{task}/rounds/{round}/model")))
            .await?
            .bytes()
            .await?;
        Ok(Model::from_safetensors(&bytes, &Limits::default())?)
    }

    /// Creates a sync job of `world_size` workers; returns its token.
    pub async fn create_sync_job(&self, id: &str, world_size: u32) -> Result<String> {
        let job: hora_common::wire::SyncJobInfo =
            self.json(self.admin(Method::POST, "/sync-jobs").json(
                &hora_common::wire::CreateSyncJob {
                    id: id.into(),
                    world_size,
                    min_world_size: None,
                    settle_ms: None,
                },
            ))
            .await?;
        job.token
            .context("the server did not return the job's token")
    }

    /// Starts `hora-client` with `args` as they are (e.g. `sync …`). Its output goes to
    /// `<dir>/<name>.log`.
    pub fn spawn_process(&mut self, name: &str, args: &[String]) -> Result<()> {
        let log = std::fs::File::create(self.log_path(name))?;
        let child = Command::new(binary("hora-client")?)
            .args(args)
            .env("HORA_LOG", "warn")
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting hora-client")?;
        self.clients.push((name.to_string(), child));
        Ok(())
    }

    /// Starts `hora-client train` with `args` (the server, CA, token and a state directory of
    /// its own are added). Its output goes to `<dir>/<name>.log`. With replicas, each client is
    /// given their URLs starting at the next one, so the clients spread over them.
    pub fn spawn_client(&mut self, name: &str, token: &str, args: &[String]) -> Result<()> {
        let mut urls = self.urls.clone();
        let first = self.clients.len() % urls.len().max(1);
        urls.rotate_left(first);
        let mut all: Vec<String> = [
            "train",
            "--server",
            &urls.join(","),
            "--token",
            token,
            "--no-progress",
        ]
        .map(String::from)
        .into();
        all.extend(["--ca".into(), self.ca.display().to_string()]);
        all.extend([
            "--state-dir".into(),
            self.dir.path().join(name).display().to_string(),
        ]);
        all.extend_from_slice(args);
        self.spawn_process(name, &all)
    }

    /// Enrols and starts `clients` single-threaded CPU clients of `task`, client k training on
    /// shard k of `data` (a synthetic source), plus `extra` arguments (`{k}` becomes k).
    pub async fn spawn_clients(
        &mut self,
        task: &str,
        data: &str,
        clients: usize,
        extra: &[&str],
    ) -> Result<()> {
        for k in 0..clients {
            let index = k.to_string();
            let extra: Vec<String> = extra.iter().map(|a| a.replace("{k}", &index)).collect();
            self.spawn_shard_client(task, data, k, &extra).await?;
        }
        Ok(())
    }

    /// Enrols and starts one single-threaded CPU client of `task` training on shard `k` of
    /// `data`, plus `extra` arguments; returns its name.
    pub async fn spawn_shard_client(
        &mut self,
        task: &str,
        data: &str,
        k: usize,
        extra: &[String],
    ) -> Result<String> {
        self.spawn_named_shard_client(&format!("client-{k}"), task, data, k, extra)
            .await
    }

    /// [`Federation::spawn_shard_client`] under the name `name` (its log and state directory).
    pub async fn spawn_named_shard_client(
        &mut self,
        name: &str,
        task: &str,
        data: &str,
        k: usize,
        extra: &[String],
    ) -> Result<String> {
        let token = self.enrolment_token().await?;
        let index = k.to_string();
        let mut args: Vec<String> = [
            "--task",
            task,
            "--data",
            data,
            "--client-index",
            &index,
            "--threads",
            "1",
            "--device",
            "cpu",
        ]
        .map(String::from)
        .into();
        args.extend_from_slice(extra);
        self.spawn_client(name, &token, &args)?;
        Ok(name.to_string())
    }

    /// Kills every client started so far (by its id) and forgets them.
    pub fn kill_clients(&mut self) {
        for (_, child) in &mut self.clients {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.clients.clear();
    }

    /// Every enrolled client's label, by client id.
    pub async fn client_ids(&self) -> Result<std::collections::HashMap<String, String>> {
        let clients: Vec<hora_common::wire::ClientInfo> =
            self.json(self.admin(Method::GET, "/clients")).await?;
        Ok(clients
            .into_iter()
            .filter_map(|c| Some((c.client_id, c.label?)))
            .collect())
    }

    /// The server's Prometheus metrics, as text.
    pub async fn metrics(&self) -> Result<String> {
        self.metrics_at(&self.url).await
    }

    /// The Prometheus metrics of the server (replica) at `url`, as text.
    pub async fn metrics_at(&self, url: &str) -> Result<String> {
        Ok(self
            .send(self.http.get(format!("{url}/metrics")))
            .await?
            .text()
            .await?)
    }

    /// `pause`s, `resume`s or `stop`s `task`.
    pub async fn task_verb(&self, task: &str, verb: &str) -> Result<()> {
        self.send(self.admin(Method::POST, &format!("/tasks/{task}/{verb}")))
            .await?;
        Ok(())
    }

    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// Lets client `name` exit unsuccessfully (a fault drill's crash) without failing the run.
    pub fn allow_failure(&mut self, name: &str) {
        self.may_fail.push(name.to_string());
    }

    /// Fails if a client already exited unsuccessfully (with its log).
    fn check_clients(&mut self) -> Result<()> {
        for (name, child) in &mut self.clients {
            if self.may_fail.iter().any(|n| n == name) {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                if !status.success() {
                    let log = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                        .unwrap_or_default();
                    bail!("client {name} failed ({status}):\n{log}");
                }
            }
        }
        Ok(())
    }

    /// Whether a client is still running (an error if one already failed).
    pub fn clients_running(&mut self) -> Result<bool> {
        self.check_clients()?;
        Ok(self
            .clients
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None))))
    }

    /// Waits for every client to exit (they do once the task ends) and checks they succeeded.
    pub fn wait_clients(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        while self
            .clients
            .iter_mut()
            .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
        {
            if start.elapsed() > timeout {
                bail!("clients still running {timeout:?} after the task ended");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.check_clients()
    }
}

impl Drop for Federation {
    fn drop(&mut self) {
        for (_, child) in &mut self.clients {
            let _ = child.kill();
            let _ = child.wait();
        }
        for server in self.servers.iter_mut().flatten() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

/// Starts `hora-server serve` on `listen` with its data in `data` and `extra` flags; its stdout,
/// where it says when it listens.
fn serve(data: &std::path::Path, listen: &str, extra: &[&str]) -> Result<(Child, ChildStdout)> {
    let mut server = Command::new(binary("hora-server")?)
        .args(["serve", "--listen", listen, "--admin-token", ADMIN_TOKEN])
        .arg("--data-dir")
        .arg(data)
        .args(extra)
        .env("HORA_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting hora-server")?;
    let stdout = server.stdout.take().context("server stdout")?;
    Ok((server, stdout))
}

/// The URL a `hora-server listening on …` line names.
fn listening(line: &str) -> Option<String> {
    line.strip_prefix("hora-server listening on ")
        .map(|url| url.trim().to_string())
}
