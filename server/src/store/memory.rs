//! [`MemoryStore`]: the store for tests of the round engine, with the same contracts as
//! [`SledStore`](super::SledStore) and nothing made durable.
//!
//! Records live in maps behind one mutex (so [`finish_round`](RoundLog::finish_round) is
//! atomic by holding it). Blobs are files in a scratch directory the store owns and deletes
//! when dropped ([`DirBlobs::scratch`]: written by rename, without fsync).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};

use hora_common::model::ModelDigest;
use hora_common::wire::{EvaluationSummary, RoundRecord};

use super::files::io;
use super::*;

pub struct MemoryStore {
    records: Mutex<Records>,
    blobs: DirBlobs,
    /// Where `blobs` are; deleted with the store.
    _scratch: tempfile::TempDir,
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
        Self::new_in(&std::env::temp_dir())
    }

    /// An empty store whose scratch directory is created under `parent`.
    pub fn new_in(parent: &Path) -> Result<Self, StoreError> {
        let scratch = tempfile::Builder::new()
            .prefix("hora-memory-store-")
            .tempdir_in(parent)
            .map_err(io(parent))?;
        Ok(MemoryStore {
            records: Mutex::default(),
            blobs: DirBlobs::scratch(scratch.path())?,
            _scratch: scratch,
        })
    }

    /// The file of a blob (tests that age or damage it).
    #[cfg(test)]
    pub(crate) fn blob_path(&self, kind: BlobKind, name: &str) -> std::path::PathBuf {
        self.blobs.path(kind, name).expect("a valid name")
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

    /// Writes everything the store holds into the new folder `dir`, as it is at one moment: the
    /// records as JSON, the blobs hard-linked (a blob is written once, by rename, and never
    /// changed; copied where linking fails). [`MemoryStore::load`] reads it back. A simulation's
    /// checkpoint is made of this.
    pub fn save(&self, dir: &Path) -> Result<(), StoreError> {
        // Under the records' lock, so that no blob a record names goes before it is linked.
        let records = self.records();
        let Records {
            tasks,
            open_rounds,
            history,
            clients,
            enrolments,
            sync_jobs,
            secagg,
            meta,
        } = &*records;
        let image = Image {
            tasks: tasks.clone(),
            open_rounds: open_rounds.clone(),
            history: history
                .iter()
                .map(|(task, rounds)| {
                    let entries = rounds.iter().map(|(&(round, attempt), record)| Entry {
                        round,
                        attempt,
                        record: record.clone(),
                    });
                    (task.clone(), entries.collect())
                })
                .collect(),
            clients: clients.clone(),
            enrolments: enrolments.clone(),
            sync_jobs: sync_jobs.clone(),
            secagg: secagg.clone(),
            meta: meta.clone(),
        };
        link_tree(self._scratch.path(), &dir.join("blobs"))?;
        drop(records);
        let path = dir.join("records.json");
        std::fs::write(&path, json(&image)).map_err(io(&path))
    }

    /// A store holding what [`MemoryStore::save`] wrote into `dir`, its scratch directory
    /// under `parent` (where linking the blobs from `dir` is cheapest: the same file system).
    pub fn load(dir: &Path, parent: &Path) -> Result<Self, StoreError> {
        let path = dir.join("records.json");
        let bytes = std::fs::read(&path).map_err(io(&path))?;
        let image: Image = decode(&path.display().to_string(), &bytes)?;
        let store = MemoryStore::new_in(parent)?;
        link_tree(&dir.join("blobs"), store._scratch.path())?;
        *store.records() = Records {
            tasks: image.tasks,
            open_rounds: image.open_rounds,
            history: image
                .history
                .into_iter()
                .map(|(task, rounds)| {
                    let keyed = rounds.into_iter().map(|e| ((e.round, e.attempt), e.record));
                    (task, keyed.collect())
                })
                .collect(),
            clients: image.clients,
            enrolments: image.enrolments,
            sync_jobs: image.sync_jobs,
            secagg: image.secagg,
            meta: image.meta,
        };
        Ok(store)
    }
}

/// The records of a [`MemoryStore`] as [`MemoryStore::save`] writes them.
#[derive(serde::Serialize, serde::Deserialize)]
struct Image {
    tasks: BTreeMap<String, TaskRecord>,
    open_rounds: BTreeMap<String, OpenRoundRecord>,
    /// Each task's attempts, in order.
    history: BTreeMap<String, Vec<Entry>>,
    clients: BTreeMap<String, ClientRecord>,
    enrolments: BTreeMap<String, EnrolmentRecord>,
    sync_jobs: BTreeMap<String, SyncJobRecord>,
    secagg: BTreeMap<String, Vec<u8>>,
    meta: BTreeMap<String, String>,
}

/// One attempt of a task's history, with its key.
#[derive(serde::Serialize, serde::Deserialize)]
struct Entry {
    round: u64,
    attempt: u32,
    record: RoundRecord,
}

/// Every file under `from` hard-linked (else copied) to the same place under `to`, a new
/// folder. A file that goes meanwhile (a pruned model) is left out.
pub fn link_tree(from: &Path, to: &Path) -> Result<(), StoreError> {
    std::fs::create_dir_all(to).map_err(io(to))?;
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let (source, target) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().map_err(io(&source))?;
        if kind.is_dir() {
            link_tree(&source, &target)?;
        } else if kind.is_file() && std::fs::hard_link(&source, &target).is_err() {
            match std::fs::copy(&source, &target) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && !source.exists() => {}
                done => drop(done.map_err(io(&target))?),
            }
        }
    }
    Ok(())
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

    fn end_evaluation(
        &self,
        task_id: &str,
        task: &TaskRecord,
        round: u64,
        attempt: u32,
        evaluation: &EvaluationSummary,
    ) -> Result<(), StoreError> {
        let mut records = self.records();
        records.tasks.insert(task_id.to_string(), task.clone());
        if let Some(entry) = records
            .history
            .get_mut(task_id)
            .and_then(|h| h.get_mut(&(round, attempt)))
        {
            entry.evaluation = Some(*evaluation);
        }
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
        blobs::sweep(
            &self.blobs,
            referenced(self)?.as_ref(),
            std::time::SystemTime::now(),
        )
    }
}

impl Blobs for MemoryStore {
    fn blobs(&self) -> &dyn BlobStore {
        &self.blobs
    }
}
