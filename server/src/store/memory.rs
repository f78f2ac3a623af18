//! [`MemoryStore`]: the store for tests of the round engine, with the same contracts as
//! [`SledStore`](super::SledStore) and nothing made durable.
//!
//! Records live in maps behind one mutex (so [`finish_round`](RoundLog::finish_round) is
//! atomic by holding it), and checkpoints and masked sums in memory. Models, modules and
//! strategy states are files in a scratch directory the store owns and deletes when dropped:
//! their readers need paths (downloads stream them; `strategy::state` reads and writes them in
//! stretches). They are written by rename, without fsync.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use hora_common::model::ModelDigest;
use hora_common::wire::RoundRecord;

use super::files::{self, io};
use super::*;

pub struct MemoryStore {
    records: Mutex<Records>,
    /// Checkpoints and masked sums, by name: their encodings, as a file would hold them.
    sums: Mutex<HashMap<String, Vec<u8>>>,
    scratch: tempfile::TempDir,
}

#[derive(Default)]
struct Records {
    tasks: BTreeMap<String, TaskRecord>,
    open_rounds: BTreeMap<String, OpenRoundRecord>,
    /// By task, then by (round, attempt).
    history: BTreeMap<String, BTreeMap<(u64, u32), RoundRecord>>,
    clients: BTreeMap<String, ClientRecord>,
    enrolments: BTreeMap<String, EnrolmentRecord>,
    sync_jobs: BTreeMap<String, SyncJobRecord>,
    secagg: BTreeMap<String, Vec<u8>>,
    meta: BTreeMap<String, String>,
}

/// A poisoned lock only means a test panicked while holding it; the maps are still whole (every
/// change is one insert or remove), so later readers may go on.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryStore {
    /// An empty store; its scratch directory is created under the system's temporary directory.
    pub fn new() -> Result<Self, StoreError> {
        let scratch = tempfile::Builder::new()
            .prefix("hora-memory-store-")
            .tempdir()
            .map_err(io(&std::env::temp_dir()))?;
        for sub in ["models", "modules", "strategy"] {
            let dir = scratch.path().join(sub);
            fs::create_dir(&dir).map_err(io(&dir))?;
        }
        Ok(MemoryStore {
            records: Mutex::default(),
            sums: Mutex::default(),
            scratch,
        })
    }

    /// What `pick` takes of `task`'s history (nothing when it has none).
    fn history_of(
        &self,
        task: &str,
        pick: impl FnOnce(&BTreeMap<(u64, u32), RoundRecord>) -> Vec<RoundRecord>,
    ) -> Vec<RoundRecord> {
        self.records()
            .history
            .get(task)
            .map(pick)
            .unwrap_or_default()
    }

    fn records(&self) -> MutexGuard<'_, Records> {
        lock(&self.records)
    }

    /// Writes a blob file unless it exists, by rename so no reader sees it half-written.
    fn put_file(&self, path: &std::path::Path, bytes: &[u8]) -> Result<(), StoreError> {
        if path.exists() {
            return Ok(());
        }
        let tmp = path
            .parent()
            .expect("blob paths have a parent")
            .join(files::temp_name(""));
        fs::write(&tmp, bytes)
            .and_then(|()| fs::rename(&tmp, path))
            .map_err(|e| {
                let _ = fs::remove_file(&tmp);
                io(path)(e)
            })
    }
}

impl Durable for MemoryStore {
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

impl RoundLog for MemoryStore {
    fn task(&self, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        Ok(self.records().tasks.get(id).cloned())
    }

    fn tasks_each(&self) -> Result<Vec<TaskRead>, StoreError> {
        Ok(self
            .records()
            .tasks
            .iter()
            .map(|(id, t)| (id.clone(), Ok(t.clone())))
            .collect())
    }

    fn create_task(&self, id: &str, task: &TaskRecord) -> Result<bool, StoreError> {
        let mut records = self.records();
        if records.tasks.contains_key(id) {
            return Ok(false);
        }
        records.tasks.insert(id.to_string(), task.clone());
        Ok(true)
    }

    fn put_task(&self, id: &str, task: &TaskRecord) -> Result<(), StoreError> {
        self.records().tasks.insert(id.to_string(), task.clone());
        Ok(())
    }

    fn open_round(&self, task: &str) -> Result<Option<OpenRoundRecord>, StoreError> {
        Ok(self.records().open_rounds.get(task).cloned())
    }

    fn put_open_round(&self, task: &str, round: &OpenRoundRecord) -> Result<(), StoreError> {
        self.records()
            .open_rounds
            .insert(task.to_string(), round.clone());
        Ok(())
    }

    fn finish_round(
        &self,
        task_id: &str,
        task: &TaskRecord,
        record: &RoundRecord,
        attempt: u32,
        next: Option<&OpenRoundRecord>,
    ) -> Result<(), StoreError> {
        let mut records = self.records();
        records.tasks.insert(task_id.to_string(), task.clone());
        records
            .history
            .entry(task_id.to_string())
            .or_default()
            .insert((record.round, attempt), record.clone());
        match next {
            Some(n) => records.open_rounds.insert(task_id.to_string(), n.clone()),
            None => records.open_rounds.remove(task_id),
        };
        Ok(())
    }

    fn history_page(
        &self,
        task: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<RoundRecord>, StoreError> {
        Ok(self.history_of(task, |rounds| {
            rounds
                .values()
                .filter(|r| r.round > after)
                .take(limit)
                .cloned()
                .collect()
        }))
    }

    fn round_attempts(&self, task: &str, round: u64) -> Result<Vec<RoundRecord>, StoreError> {
        Ok(self.history_of(task, |rounds| {
            rounds
                .range((round, 0)..=(round, u32::MAX))
                .map(|(_, r)| r.clone())
                .collect()
        }))
    }

    fn model_in_history(&self, digest: &ModelDigest) -> Result<bool, StoreError> {
        Ok(self
            .records()
            .history
            .values()
            .flat_map(BTreeMap::values)
            .any(|r| !r.pruned && r.model.as_ref() == Some(digest)))
    }

    fn prune_models(
        &self,
        task: &str,
        retention: Retention,
        published: u64,
    ) -> Result<usize, StoreError> {
        let mut dropped = Vec::new();
        for r in self
            .records()
            .history
            .get_mut(task)
            .into_iter()
            .flat_map(|rounds| rounds.values_mut())
        {
            if r.model.is_some() && !r.pruned && !retention.keeps(r.round, published) {
                r.pruned = true;
                dropped.extend(r.model);
            }
            if r.round <= retention.compacted_upto(published) {
                r.compact();
            }
        }
        remove_unused_models(self, dropped)
    }
}

impl Registry for MemoryStore {
    fn client(&self, id: &str) -> Result<Option<ClientRecord>, StoreError> {
        Ok(self.records().clients.get(id).cloned())
    }

    fn clients(&self) -> Result<Vec<(String, ClientRecord)>, StoreError> {
        Ok(self
            .records()
            .clients
            .iter()
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect())
    }

    fn put_client(&self, id: &str, c: &ClientRecord) -> Result<(), StoreError> {
        self.records().clients.insert(id.to_string(), c.clone());
        Ok(())
    }

    fn update_client(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut ClientRecord),
    ) -> Result<Option<ClientRecord>, StoreError> {
        Ok(self.records().clients.get_mut(id).map(|c| {
            change(c);
            c.clone()
        }))
    }

    fn put_enrolment(&self, token_hash: &str, e: &EnrolmentRecord) -> Result<(), StoreError> {
        self.records()
            .enrolments
            .insert(token_hash.to_string(), e.clone());
        Ok(())
    }

    fn enrolment(&self, token_hash: &str) -> Result<Option<EnrolmentRecord>, StoreError> {
        Ok(self.records().enrolments.get(token_hash).cloned())
    }

    fn enrol(
        &self,
        token_hash: &str,
        id: &str,
        client: &ClientRecord,
    ) -> Result<Option<EnrolmentRecord>, StoreError> {
        let mut records = self.records();
        if records.clients.contains_key(id) {
            return Ok(None); // never replace a client (the token stays unspent)
        }
        let spent = records.enrolments.remove(token_hash);
        if spent.is_some() {
            records.clients.insert(id.to_string(), client.clone());
        }
        Ok(spent)
    }
}

impl SyncJobs for MemoryStore {
    fn sync_jobs(&self) -> Result<Vec<SyncJobRecord>, StoreError> {
        Ok(self.records().sync_jobs.values().cloned().collect())
    }

    fn create_sync_job(&self, job: &SyncJobRecord) -> Result<bool, StoreError> {
        let mut records = self.records();
        if records.sync_jobs.contains_key(&job.id) {
            return Ok(false);
        }
        records.sync_jobs.insert(job.id.clone(), job.clone());
        Ok(true)
    }

    fn put_sync_job(&self, job: &SyncJobRecord) -> Result<(), StoreError> {
        self.records().sync_jobs.insert(job.id.clone(), job.clone());
        Ok(())
    }

    fn remove_sync_job(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.records().sync_jobs.remove(id).is_some())
    }
}

impl SecaggLog for MemoryStore {
    fn secagg_get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.records().secagg.get(key).cloned())
    }

    fn secagg_put_bytes(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.records()
            .secagg
            .insert(key.to_string(), value.to_vec());
        Ok(())
    }

    fn secagg_scan_bytes(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        Ok(self
            .records()
            .secagg
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k[prefix.len()..].to_string(), v.clone()))
            .collect())
    }

    fn secagg_clear(&self, task: &str) -> Result<(), StoreError> {
        let prefix = format!("{task}\0");
        self.records().secagg.retain(|k, _| !k.starts_with(&prefix));
        Ok(())
    }
}

impl Housekeeping for MemoryStore {
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(self.records().meta.get(key).cloned())
    }

    fn put_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.records()
            .meta
            .insert(key.to_string(), value.to_string());
        Ok(())
    }

    fn sweep_orphans(&self) -> Result<usize, StoreError> {
        let refs = referenced(self)?;
        let all_known = refs.is_some();
        let refs = refs.unwrap_or_default();
        let mut removed = sweep_blobs(self.scratch.path(), &refs, all_known)?;
        if all_known {
            let mut sums = lock(&self.sums);
            let before = sums.len();
            sums.retain(|name, _| refs.checkpoints.contains(name));
            removed += before - sums.len();
        }
        Ok(removed)
    }
}

impl Blobs for MemoryStore {
    fn model_path(&self, digest: &ModelDigest) -> PathBuf {
        self.scratch
            .path()
            .join("models")
            .join(format!("{}.safetensors", digest.to_hex()))
    }

    fn module_path(&self, hex_digest: &str) -> PathBuf {
        self.scratch
            .path()
            .join("modules")
            .join(format!("{hex_digest}.pt"))
    }

    fn strategy_state_dir(&self) -> PathBuf {
        self.scratch.path().join("strategy")
    }

    fn remove_strategy_state(&self, name: &str) {
        if crate::strategy::state::valid_name(name) {
            let _ = fs::remove_file(self.strategy_state_dir().join(name));
        }
    }

    fn put_model_bytes(&self, digest: &ModelDigest, safetensors: &[u8]) -> Result<(), StoreError> {
        self.put_file(&self.model_path(digest), safetensors)
    }

    fn model_bytes(&self, digest: &ModelDigest) -> Result<Vec<u8>, StoreError> {
        let path = self.model_path(digest);
        fs::read(&path).map_err(io(&path))
    }

    fn put_module(&self, bytes: &[u8]) -> Result<String, StoreError> {
        let hex_digest = hora_common::sha256_hex(bytes);
        self.put_file(&self.module_path(&hex_digest), bytes)?;
        Ok(hex_digest)
    }

    fn write_checkpoint(&self, sum: &[f64]) -> Result<String, StoreError> {
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        let mut bytes = Vec::with_capacity(16 + sum.len() * 8);
        files::encode_checkpoint(sum, |piece| {
            hash.update(piece);
            bytes.extend_from_slice(piece);
            Ok(())
        })
        .expect("writing to memory does not fail");
        let name = files::checkpoint_name(hash);
        lock(&self.sums).insert(name.clone(), bytes);
        Ok(name)
    }

    fn read_checkpoint(&self, file: &str, expected_len: usize) -> Result<Vec<f64>, StoreError> {
        let sums = lock(&self.sums);
        let bytes = sums.get(file).ok_or_else(|| missing(file))?;
        files::decode_checkpoint(&bytes[..], file, expected_len, |_| StoreError::Corrupt {
            key: file.into(),
            reason: "truncated".into(),
        })
    }

    fn write_masked_sum(&self, sum: &[u32]) -> Result<String, StoreError> {
        let (name, bytes) = files::encode_masked_sum(sum);
        lock(&self.sums).entry(name.clone()).or_insert(bytes);
        Ok(name)
    }

    fn read_masked_sum(&self, file: &str, expected_len: usize) -> Result<Vec<u32>, StoreError> {
        let sums = lock(&self.sums);
        let bytes = sums.get(file).ok_or_else(|| missing(file))?;
        files::decode_masked_sum(bytes, file, expected_len)
    }

    fn remove_checkpoint(&self, file: &str) {
        lock(&self.sums).remove(file);
    }
}

/// What reading a checkpoint that is not there gives, as [`SledStore`](super::SledStore)'s
/// missing file does.
fn missing(file: &str) -> StoreError {
    StoreError::Io {
        path: format!("checkpoints/{file}"),
        source: std::io::ErrorKind::NotFound.into(),
    }
}
