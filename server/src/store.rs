//! Durable state under one data directory.
//!
//! ```text
//! <data>/db/                      sled: tasks, open rounds, round history, clients, enrolments,
//!                                 sync jobs, meta
//! <data>/blobs/models/<hex>.safetensors   global models, content-addressed by model digest
//! <data>/blobs/modules/<hex>.pt           TorchScript modules, by SHA-256 of their bytes
//! <data>/blobs/strategy/<hex>.state      stateful strategies' state (see `strategy::state`),
//!                                         by SHA-256 of its bytes; one per task, the current
//! <data>/checkpoints/<task>-r<round>-a<attempt>-<seq>.ckpt   round accumulators (f64 sums)
//! ```
//!
//! Files are written atomically: a temporary file in the same directory, fsync, rename, fsync of
//! the directory; only then is the sled record that refers to them written and flushed. So a
//! record never points at a torn file, and a crash leaves at worst an unreferenced file, which
//! [`Store::sweep_orphans`] removes at start. Records are JSON (small, and readable when an
//! operator has to look). Nothing here ever holds a client's individual update: checkpoints are
//! sums of several.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use hora_common::model::{Limits, Model, ModelDigest, ModelSpec};
use hora_common::wire::{CreateTask, Metrics, RoundRecord, TaskState};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database: {0}")]
    Db(#[from] sled::Error),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("corrupt record {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("model blob: {0}")]
    Model(#[from] hora_common::model::ModelError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A task as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskRecord {
    pub config: CreateTask,
    pub spec: ModelSpec,
    pub state: TaskState,
    /// Rounds published so far; the open round is `published + 1`.
    pub published: u64,
    pub global_model: ModelDigest,
    pub created_unix_ms: u64,
    /// The file under `blobs/strategy/` holding a stateful strategy's state after round
    /// `published`; None before the first round (the strategy's initial state) and for
    /// stateless strategies. Written with `global_model`, in the same record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy_state: Option<String>,
    /// The privacy spent so far and the clip norm, for a task with differential privacy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<crate::dp::DpState>,
    /// Why the task ended before its rounds were done (its privacy budget).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_reason: Option<String>,
}

/// A task id and its record, or why the record could not be read.
pub type TaskRead = (String, Result<TaskRecord, StoreError>);

/// One accepted update, as the round's records keep it (never the update itself).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Contribution {
    pub client: String,
    pub examples: u64,
    pub metrics: Metrics,
    /// Under differential privacy: whether the update's norm was within the round's clip norm
    /// (what adaptive clipping counts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unclipped: Option<bool>,
}

/// The durable part of a round's accumulator.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub file: String,
    pub contributions: Vec<Contribution>,
    pub total_weight: f64,
    /// The sum holds the round's differential-privacy noise already (a close that failed
    /// after adding it): it must not be noised again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub noised: bool,
}

/// The round a task has open, enough to resume it after a crash.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenRoundRecord {
    pub round: u64,
    pub attempt: u32,
    /// The round's X25519 secret (hex). Deleted with this record when the round closes.
    pub secret: String,
    pub base_model: ModelDigest,
    pub opened_unix_ms: u64,
    pub deadline_unix_ms: u64,
    pub selected: Vec<String>,
    pub checkpoint: Option<CheckpointRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClientRecord {
    pub secret_hash: String,
    pub label: Option<String>,
    pub enrolled_unix_ms: u64,
    pub revoked: bool,
    /// The Ed25519 identity key (hex) the client registered at enrolment; it signs the keys
    /// the client advertises in secure aggregation.
    #[serde(default)]
    pub identity_key: Option<String>,
    /// The tasks this client may use; None: every task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnrolmentRecord {
    pub expires_unix_ms: u64,
    /// The tasks the enrolled client may use; None: every task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks: Option<Vec<String>>,
}

/// Which published round models are kept: the last `last` rounds and every `every`th round (0
/// turns either off; both 0 keeps everything). The current global model and the task's initial
/// model are always kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub last: u64,
    pub every: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Retention {
            last: 50,
            every: 10,
        }
    }
}

impl Retention {
    /// Whether round `round`'s model is kept once `published` rounds are published.
    pub fn keeps(&self, round: u64, published: u64) -> bool {
        (self.last == 0 && self.every == 0)
            || round + self.last > published
            || (self.every > 0 && round % self.every == 0)
    }
}

/// A synchronous allreduce job as stored: its definition and how many worlds it has formed. The
/// world being formed is never stored (see `rendezvous`): after a restart, workers join again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncJobRecord {
    pub id: String,
    pub world_size: u32,
    /// SHA-256 of the job's bearer token (hex), as for the admin token.
    pub token_hash: String,
    /// Worlds formed so far.
    pub generations: u64,
}

pub struct Store {
    dir: PathBuf,
    db: sled::Db,
    tasks: sled::Tree,
    open_rounds: sled::Tree,
    history: sled::Tree,
    clients: sled::Tree,
    enrolments: sled::Tree,
    sync_jobs: sled::Tree,
    /// Secure-aggregation attempts' protocol state (see `secagg`), keyed `task\0kind\0client`.
    secagg: sled::Tree,
    meta: sled::Tree,
}

fn get<T: DeserializeOwned>(tree: &sled::Tree, key: &str) -> Result<Option<T>, StoreError> {
    match tree.get(key)? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StoreError::Corrupt {
                key: key.to_string(),
                reason: e.to_string(),
            }),
    }
}

fn all<T: DeserializeOwned>(
    iter: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
) -> Result<Vec<(String, T)>, StoreError> {
    iter.map(|kv| {
        let (k, v) = kv?;
        let key = String::from_utf8_lossy(&k).into_owned();
        let value = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
            key: key.clone(),
            reason: e.to_string(),
        })?;
        Ok((key, value))
    })
    .collect()
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).expect("records serialise")
}

/// History keys sort by round then attempt.
fn history_key(task: &str, round: u64, attempt: u32) -> String {
    format!("{task}\0{round:020}\0{attempt:010}")
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        make_private_dir(dir)?;
        for sub in [
            "blobs/models",
            "blobs/modules",
            "blobs/strategy",
            "checkpoints",
        ] {
            fs::create_dir_all(dir.join(sub)).map_err(io(dir))?;
        }
        let db = sled::Config::new().path(dir.join("db")).open()?;
        Ok(Store {
            dir: dir.to_path_buf(),
            tasks: db.open_tree("tasks")?,
            open_rounds: db.open_tree("open_rounds")?,
            history: db.open_tree("history")?,
            clients: db.open_tree("clients")?,
            enrolments: db.open_tree("enrolments")?,
            sync_jobs: db.open_tree("sync_jobs")?,
            secagg: db.open_tree("secagg")?,
            meta: db.open_tree("meta")?,
            db,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    // -- tasks ------------------------------------------------------------------------------

    pub fn task(&self, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        get(&self.tasks, id)
    }

    pub fn tasks(&self) -> Result<Vec<(String, TaskRecord)>, StoreError> {
        all(self.tasks.iter())
    }

    /// Every task, each read on its own: one corrupt record does not hide the others.
    pub fn tasks_each(&self) -> Result<Vec<TaskRead>, StoreError> {
        self.tasks
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                let key = String::from_utf8_lossy(&k).into_owned();
                let record = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
                    key: key.clone(),
                    reason: e.to_string(),
                });
                Ok((key, record))
            })
            .collect()
    }

    /// Creates a task if the id is free; false if it exists.
    pub fn create_task(&self, id: &str, task: &TaskRecord) -> Result<bool, StoreError> {
        let created = self
            .tasks
            .compare_and_swap(id, None as Option<&[u8]>, Some(json(task)))?
            .is_ok();
        Ok(created)
    }

    pub fn put_task(&self, id: &str, task: &TaskRecord) -> Result<(), StoreError> {
        self.tasks.insert(id, json(task))?;
        Ok(())
    }

    // -- rounds -----------------------------------------------------------------------------

    pub fn open_round(&self, task: &str) -> Result<Option<OpenRoundRecord>, StoreError> {
        get(&self.open_rounds, task)
    }

    pub fn put_open_round(&self, task: &str, round: &OpenRoundRecord) -> Result<(), StoreError> {
        self.open_rounds.insert(task, json(round))?;
        Ok(())
    }

    /// Records a finished round and moves the task on, in one transaction: either all of it is
    /// durable after the next flush or none of it.
    pub fn finish_round(
        &self,
        task_id: &str,
        task: &TaskRecord,
        record: &RoundRecord,
        attempt: u32,
        next: Option<&OpenRoundRecord>,
    ) -> Result<(), StoreError> {
        use sled::Transactional;
        (&self.tasks, &self.open_rounds, &self.history)
            .transaction(|(tasks, open, history)| {
                tasks.insert(task_id, json(task))?;
                history.insert(
                    history_key(task_id, record.round, attempt).as_bytes(),
                    json(record),
                )?;
                match next {
                    Some(n) => open.insert(task_id, json(n))?,
                    None => open.remove(task_id)?,
                };
                Ok(())
            })
            .map_err(|e: sled::transaction::TransactionError<()>| match e {
                sled::transaction::TransactionError::Storage(e) => StoreError::Db(e),
                sled::transaction::TransactionError::Abort(()) => StoreError::Corrupt {
                    key: task_id.into(),
                    reason: "transaction aborted".into(),
                },
            })?;
        Ok(())
    }

    /// Applies `retention` to `task`'s published models now that `published` rounds are out:
    /// marks the rounds that fall out of it as pruned and deletes their model files, unless
    /// another retained round or task still uses the same model (content-addressed). Returns the
    /// number of files removed.
    pub fn prune_models(
        &self,
        task: &str,
        retention: Retention,
        published: u64,
    ) -> Result<usize, StoreError> {
        let mut dropped = Vec::new();
        for (key, mut r) in all::<RoundRecord>(self.history.scan_prefix(format!("{task}\0")))? {
            if r.model.is_some() && !r.pruned && !retention.keeps(r.round, published) {
                r.pruned = true;
                self.history.insert(key.as_bytes(), json(&r))?;
                dropped.extend(r.model);
            }
        }
        if dropped.is_empty() {
            return Ok(0);
        }
        let mut in_use = std::collections::HashSet::new();
        for (id, t) in self.tasks_each()? {
            let Ok(t) = t else {
                return Ok(0); // an unreadable task may use any model: delete nothing
            };
            in_use.insert(t.global_model);
            in_use.insert(t.config.initial_model);
            for r in self.history(&id)? {
                if !r.pruned {
                    in_use.extend(r.model);
                }
            }
        }
        let mut removed = 0;
        for digest in dropped.into_iter().filter(|d| !in_use.contains(d)) {
            if fs::remove_file(self.model_path(&digest)).is_ok() {
                removed += 1;
            }
        }
        Ok(removed)
    }

    pub fn history(&self, task: &str) -> Result<Vec<RoundRecord>, StoreError> {
        let prefix = format!("{task}\0");
        Ok(all(self.history.scan_prefix(prefix))?
            .into_iter()
            .map(|(_, r)| r)
            .collect())
    }

    // -- clients and enrolment --------------------------------------------------------------

    pub fn client(&self, id: &str) -> Result<Option<ClientRecord>, StoreError> {
        get(&self.clients, id)
    }

    pub fn clients(&self) -> Result<Vec<(String, ClientRecord)>, StoreError> {
        all(self.clients.iter())
    }

    pub fn put_client(&self, id: &str, c: &ClientRecord) -> Result<(), StoreError> {
        self.clients.insert(id, json(c))?;
        Ok(())
    }

    pub fn put_enrolment(&self, token_hash: &str, e: &EnrolmentRecord) -> Result<(), StoreError> {
        self.enrolments.insert(token_hash, json(e))?;
        Ok(())
    }

    /// Removes and returns an enrolment: a token works once.
    pub fn take_enrolment(&self, token_hash: &str) -> Result<Option<EnrolmentRecord>, StoreError> {
        match self.enrolments.remove(token_hash)? {
            None => Ok(None),
            Some(v) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|e| StoreError::Corrupt {
                    key: "enrolment".into(),
                    reason: e.to_string(),
                }),
        }
    }

    // -- sync jobs ----------------------------------------------------------------------------

    pub fn sync_jobs(&self) -> Result<Vec<SyncJobRecord>, StoreError> {
        Ok(all(self.sync_jobs.iter())?
            .into_iter()
            .map(|(_, job)| job)
            .collect())
    }

    /// Creates a sync job if the id is free; false if it exists.
    pub fn create_sync_job(&self, job: &SyncJobRecord) -> Result<bool, StoreError> {
        let created = self
            .sync_jobs
            .compare_and_swap(&job.id, None as Option<&[u8]>, Some(json(job)))?
            .is_ok();
        Ok(created)
    }

    pub fn put_sync_job(&self, job: &SyncJobRecord) -> Result<(), StoreError> {
        self.sync_jobs.insert(&job.id, json(job))?;
        Ok(())
    }

    /// Deletes a sync job; false if there was none.
    pub fn remove_sync_job(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.sync_jobs.remove(id)?.is_some())
    }

    pub fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        get(&self.meta, key)
    }

    pub fn put_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.meta.insert(key, json(&value))?;
        Ok(())
    }

    // -- blobs ------------------------------------------------------------------------------

    pub fn model_path(&self, digest: &ModelDigest) -> PathBuf {
        self.dir
            .join("blobs/models")
            .join(format!("{}.safetensors", digest.to_hex()))
    }

    pub fn module_path(&self, hex_digest: &str) -> PathBuf {
        self.dir
            .join("blobs/modules")
            .join(format!("{hex_digest}.pt"))
    }

    /// Where strategy state files live (written and read by `strategy::state`).
    pub fn strategy_state_dir(&self) -> PathBuf {
        self.dir.join("blobs/strategy")
    }

    /// Deletes a strategy state file no record refers to any more.
    pub fn remove_strategy_state(&self, name: &str) {
        if crate::strategy::state::valid_name(name) {
            let _ = fs::remove_file(self.strategy_state_dir().join(name));
        }
    }

    pub fn checkpoint_path(&self, file: &str) -> PathBuf {
        self.dir.join("checkpoints").join(file)
    }

    /// Stores a model under its digest (a no-op if it is there already).
    pub fn put_model(&self, model: &Model) -> Result<ModelDigest, StoreError> {
        let digest = model.digest();
        self.put_model_bytes(&digest, &model.to_safetensors())?;
        Ok(digest)
    }

    /// Stores f32 safetensors bytes whose digest the caller computed.
    pub fn put_model_bytes(
        &self,
        digest: &ModelDigest,
        safetensors: &[u8],
    ) -> Result<(), StoreError> {
        let path = self.model_path(digest);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(safetensors))?;
        }
        Ok(())
    }

    /// The stored safetensors bytes of a model.
    pub fn model_bytes(&self, digest: &ModelDigest) -> Result<Vec<u8>, StoreError> {
        let path = self.model_path(digest);
        fs::read(&path).map_err(io(&path))
    }

    pub fn read_model(&self, digest: &ModelDigest) -> Result<Model, StoreError> {
        Ok(Model::read_file(
            &self.model_path(digest),
            &Limits::default(),
        )?)
    }

    /// Stores a TorchScript module under the hex SHA-256 of its bytes.
    pub fn put_module(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let hex_digest = hora_common::sha256_hex(bytes);
        let path = self.module_path(&hex_digest);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(bytes))?;
        }
        Ok(hex_digest)
    }

    /// Writes an accumulator checkpoint (the f64 sum, little-endian) atomically, named by the
    /// SHA-256 of its contents (hashed while writing); returns the file name.
    pub fn write_checkpoint(&self, sum: &[f64]) -> Result<String, StoreError> {
        let dir = self.dir.join("checkpoints");
        let tmp_name = format!(".tmp-ckpt-{}-{}", std::process::id(), rand::random::<u64>());
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        write_atomic(&dir.join(&tmp_name), |w| {
            let mut put = |bytes: &[u8]| {
                hash.update(bytes);
                w.write_all(bytes)
            };
            put(b"HORACKP1")?;
            put(&(sum.len() as u64).to_le_bytes())?;
            let mut buf = Vec::with_capacity(8 << 16);
            for chunk in sum.chunks(1 << 16) {
                buf.clear();
                buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
                put(&buf)?;
            }
            Ok(())
        })?;
        let name = format!("{}.ckpt", hex::encode(hash.finish()));
        let path = dir.join(&name);
        fs::rename(dir.join(&tmp_name), &path).map_err(io(&path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&dir))?;
        Ok(name)
    }

    pub fn read_checkpoint(&self, file: &str, expected_len: usize) -> Result<Vec<f64>, StoreError> {
        let path = self.checkpoint_path(file);
        let mut f = File::open(&path).map_err(io(&path))?;
        let mut header = [0u8; 16];
        f.read_exact(&mut header).map_err(io(&path))?;
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        hash.update(&header);
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
        if &header[..8] != b"HORACKP1" || len != expected_len as u64 {
            return Err(StoreError::Corrupt {
                key: file.into(),
                reason: format!("expected {expected_len} values, header says {len}"),
            });
        }
        // Read in pieces: the sum is the largest thing the server holds; never hold it twice.
        let mut values = Vec::with_capacity(expected_len);
        let mut buf = vec![0u8; 1 << 20];
        while values.len() < expected_len {
            let want = ((expected_len - values.len()) * 8).min(buf.len());
            f.read_exact(&mut buf[..want])
                .map_err(|_| StoreError::Corrupt {
                    key: file.into(),
                    reason: "truncated".into(),
                })?;
            hash.update(&buf[..want]);
            values.extend(
                buf[..want]
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))),
            );
        }
        if f.read(&mut buf[..1]).map_err(io(&path))? != 0 {
            return Err(StoreError::Corrupt {
                key: file.into(),
                reason: "trailing bytes".into(),
            });
        }
        if format!("{}.ckpt", hex::encode(hash.finish())) != file {
            return Err(StoreError::Corrupt {
                key: file.into(),
                reason: "contents do not match the checkpoint's content address".into(),
            });
        }
        Ok(values)
    }

    /// Writes the sum of a secure-aggregation attempt's masked inputs (u32, little-endian)
    /// atomically, named by the SHA-256 of its contents; returns the file name.
    pub fn write_masked_sum(&self, sum: &[u32]) -> Result<String, StoreError> {
        let mut bytes = Vec::with_capacity(8 + sum.len() * 4);
        bytes.extend_from_slice(b"HORAMSK1");
        bytes.extend(sum.iter().flat_map(|v| v.to_le_bytes()));
        let name = format!("{}.msum", hora_common::sha256_hex(&bytes));
        let path = self.checkpoint_path(&name);
        if !path.exists() {
            write_atomic(&path, |w| w.write_all(&bytes))?;
        }
        Ok(name)
    }

    pub fn read_masked_sum(&self, file: &str, expected_len: usize) -> Result<Vec<u32>, StoreError> {
        let path = self.checkpoint_path(file);
        let bytes = fs::read(&path).map_err(io(&path))?;
        let corrupt = |reason: &str| StoreError::Corrupt {
            key: file.into(),
            reason: reason.into(),
        };
        if bytes.len() != 8 + expected_len * 4 || &bytes[..8] != b"HORAMSK1" {
            return Err(corrupt("not a masked sum of the expected length"));
        }
        if format!("{}.msum", hora_common::sha256_hex(&bytes)) != file {
            return Err(corrupt("contents do not match the file's content address"));
        }
        Ok(le_words(&bytes[8..]).collect())
    }

    pub fn secagg_get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>, StoreError> {
        get(&self.secagg, key)
    }

    pub fn secagg_put<T: Serialize>(&self, key: &str, value: &T) -> Result<(), StoreError> {
        self.secagg.insert(key, json(value))?;
        Ok(())
    }

    /// Every record under `prefix`, keyed by what follows the prefix.
    pub fn secagg_scan<T: DeserializeOwned>(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, T)>, StoreError> {
        Ok(all(self.secagg.scan_prefix(prefix))?
            .into_iter()
            .map(|(k, v)| (k[prefix.len()..].to_string(), v))
            .collect())
    }

    /// Forgets a task's secure-aggregation state (a new attempt starts from nothing).
    pub fn secagg_clear(&self, task: &str) -> Result<(), StoreError> {
        for key in self.secagg.scan_prefix(format!("{task}\0")).keys() {
            self.secagg.remove(key?)?;
        }
        Ok(())
    }

    pub fn remove_checkpoint(&self, file: &str) {
        let _ = fs::remove_file(self.checkpoint_path(file));
    }

    /// Deletes temporary files and blobs no record refers to. Run at start, before serving.
    pub fn sweep_orphans(&self) -> Result<usize, StoreError> {
        let mut models = std::collections::HashSet::new();
        let mut modules = std::collections::HashSet::new();
        let mut checkpoints = std::collections::HashSet::new();
        let mut states = std::collections::HashSet::new();
        // With any task unreadable nobody can tell its blobs from orphans: keep every blob and
        // remove only temporary files.
        let mut all_known = true;
        let mut readable = Vec::new();
        for (id, task) in self.tasks_each()? {
            match task.and_then(|t| {
                let history = self.history(&id)?;
                let open = self.open_round(&id)?;
                Ok((t, history, open))
            }) {
                Ok(parts) => readable.push((id, parts)),
                Err(_) => all_known = false,
            }
        }
        for (id, (task, history, open)) in readable {
            models.insert(format!("{}.safetensors", task.global_model.to_hex()));
            models.insert(format!(
                "{}.safetensors",
                task.config.initial_model.to_hex()
            ));
            // Only the current state: the previous one is deleted once its successor is
            // published, so any other state file is a leftover of a crash.
            states.extend(task.strategy_state.clone());
            if let hora_common::wire::ModelKind::TorchScript { module_digest } = &task.config.model
            {
                modules.insert(format!("{module_digest}.pt"));
            }
            for r in history {
                if let Some(d) = r.model.filter(|_| !r.pruned) {
                    models.insert(format!("{}.safetensors", d.to_hex()));
                }
            }
            if let Some(open) = open {
                if let Some(c) = open.checkpoint {
                    checkpoints.insert(c.file);
                }
            }
            let state: Option<crate::secagg::StateRecord> =
                self.secagg_get(&format!("{id}\0state\0"))?;
            if let Some(file) = state.and_then(|s| s.sum_file) {
                checkpoints.insert(file);
            }
        }
        // Models uploaded by an admin but not (yet) used by a task are kept for a day.
        let fresh = |p: &Path| {
            fs::metadata(p)
                .and_then(|m| m.modified())
                .map(|t| t.elapsed().map(|e| e.as_secs() < 86_400).unwrap_or(true))
                .unwrap_or(false)
        };
        let mut removed = 0;
        for (sub, keep, keep_fresh) in [
            ("blobs/models", &models, true),
            ("blobs/modules", &modules, true),
            ("blobs/strategy", &states, false),
            ("checkpoints", &checkpoints, false),
        ] {
            let dir = self.dir.join(sub);
            for entry in fs::read_dir(&dir).map_err(io(&dir))? {
                let path = entry.map_err(io(&dir))?.path();
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or_default()
                    .to_string();
                let temp = name.starts_with(".tmp-");
                let kept = !all_known || keep.contains(&name) || (keep_fresh && fresh(&path));
                if temp || !kept {
                    fs::remove_file(&path).map_err(io(&path))?;
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }
}

/// Little-endian u32 words of `bytes` (a masked input or sum; a trailing partial word is ignored).
pub fn le_words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Creates `dir` (and its parents) if needed and makes it accessible to this user only.
fn make_private_dir(dir: &Path) -> Result<(), StoreError> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io(dir))?;
    }
    Ok(())
}

/// Writes `path` atomically: temp file, fsync, rename, fsync of the directory.
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<(), StoreError> {
    let dir = path.parent().expect("blob paths have a parent");
    let tmp = dir.join(format!(
        ".tmp-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let result = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        fill(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_and_checkpoints_round_trip_and_orphans_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let model = Model::from_tensors([("w", vec![3], vec![1.0, 2.0, 3.0])]).unwrap();
        let d = store.put_model(&model).unwrap();
        assert_eq!(store.read_model(&d).unwrap(), model);
        let ckpt = store.write_checkpoint(&[1.5, -2.0, 1e300]).unwrap();
        assert_eq!(
            store.read_checkpoint(&ckpt, 3).unwrap(),
            vec![1.5, -2.0, 1e300]
        );
        assert!(store.read_checkpoint(&ckpt, 4).is_err());
        // A flipped bit is caught by the content address.
        let path = store.checkpoint_path(&ckpt);
        let mut bytes = fs::read(&path).unwrap();
        bytes[20] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            store.read_checkpoint(&ckpt, 3),
            Err(StoreError::Corrupt { .. })
        ));
        fs::write(dir.path().join("checkpoints/.tmp-1-2"), b"torn").unwrap();
        // Unreferenced checkpoint and temp file go; the fresh unreferenced model stays.
        assert_eq!(store.sweep_orphans().unwrap(), 2);
        assert!(store.model_path(&d).exists());
        assert!(!store.checkpoint_path(&ckpt).exists());
    }

    #[test]
    fn enrolment_tokens_work_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store
            .put_enrolment(
                "h",
                &EnrolmentRecord {
                    expires_unix_ms: 5,
                    tasks: None,
                },
            )
            .unwrap();
        assert!(store.take_enrolment("h").unwrap().is_some());
        assert!(store.take_enrolment("h").unwrap().is_none());
    }

    #[test]
    fn sync_jobs_are_created_once_updated_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let mut job = SyncJobRecord {
            id: "ring".into(),
            world_size: 4,
            token_hash: "h".into(),
            generations: 0,
        };
        assert!(store.create_sync_job(&job).unwrap());
        assert!(!store.create_sync_job(&job).unwrap());
        job.generations = 3;
        store.put_sync_job(&job).unwrap();
        assert_eq!(store.sync_jobs().unwrap(), vec![job.clone()]);
        assert!(store.remove_sync_job("ring").unwrap());
        assert!(!store.remove_sync_job("ring").unwrap());
        assert!(store.sync_jobs().unwrap().is_empty());
    }
}
