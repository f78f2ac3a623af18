//! [`SledStore`]: the server's store, records in sled under one data directory, blobs beside
//! them or where `--blobs` says (the layout is in the [module docs](super)).

use std::path::Path;
use std::sync::Arc;

use hora_common::model::ModelDigest;
use hora_common::wire::{EvaluationSummary, RoundRecord};
use serde::{de::DeserializeOwned, Serialize};

use super::blobs::{self, BlobStore, Blobs, DirBlobs};
use super::{
    decode, referenced, remove_unused_models, ClientRecord, Durable, EnrolmentRecord, Housekeeping,
    OpenRoundRecord, Registry, Retention, RoundLog, SecaggLog, StoreError, SyncJobRecord, SyncJobs,
    TaskRead, TaskRecord,
};

pub struct SledStore {
    blobs: Arc<dyn BlobStore>,
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
    /// The models history entries name, keyed `digest\0task\0round\0attempt` (entries not
    /// pruned only): whether a model is still used is one prefix lookup, not a history scan.
    model_rounds: sled::Tree,
}

fn get<T: DeserializeOwned>(tree: &sled::Tree, key: &str) -> Result<Option<T>, StoreError> {
    match tree.get(key)? {
        None => Ok(None),
        Some(bytes) => decode(key, &bytes).map(Some),
    }
}

fn all<T: DeserializeOwned>(
    iter: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
) -> Result<Vec<(String, T)>, StoreError> {
    iter.map(|kv| {
        let (k, v) = kv?;
        let key = String::from_utf8_lossy(&k).into_owned();
        let value = decode(&key, &v)?;
        Ok((key, value))
    })
    .collect()
}

fn json<T: Serialize>(value: &T) -> Vec<u8> {
    super::json(value)
}

/// Changes the history entry under `key` as it is at the moment of the write (atomically:
/// nothing written to it in between is lost); one that is gone or does not parse is left as
/// it is.
fn amend(
    history: &sled::Tree,
    key: &str,
    change: impl Fn(&mut RoundRecord),
) -> Result<(), StoreError> {
    history.fetch_and_update(key.as_bytes(), |now| {
        let bytes = now?;
        match serde_json::from_slice::<RoundRecord>(bytes) {
            Ok(mut entry) => {
                change(&mut entry);
                Some(json(&entry))
            }
            Err(_) => Some(bytes.to_vec()),
        }
    })?;
    Ok(())
}

/// History keys sort by round then attempt.
fn history_key(task: &str, round: u64, attempt: u32) -> String {
    format!("{task}\0{round:020}\0{attempt:010}")
}

/// The index entry of a history entry that names `model`.
fn model_round_key(model: &ModelDigest, task: &str, round: u64, attempt: u32) -> String {
    format!("{}\0{}", model.to_hex(), history_key(task, round, attempt))
}

/// The meta key under which pruning remembers how far it has looked (see `prune_models`).
fn pruned_key(task: &str) -> String {
    format!("pruned_below\0{task}")
}

/// How far pruning has looked in a task's history, and under which retention.
#[derive(serde::Serialize, serde::Deserialize, PartialEq)]
struct PrunedBelow {
    last: u64,
    every: u64,
    /// Every round below this one has been judged under this retention.
    below: u64,
    /// Every entry of a round below this one is compacted (entries stay compacted whatever the
    /// retention later says, so this holds under any).
    #[serde(default)]
    compacted_below: u64,
}

/// The meta flag saying the model index covers the whole history.
const MODEL_INDEX: &str = "model_rounds_v1";

/// The meta key of the store's format, and the format this build writes: 1 has the model
/// index; 2 may hold tasks that train part of their model (`part`, `trainable`); 3 may hold
/// federated evaluations (`evaluation` in tasks and history entries, `evaluating`). A store of
/// a newer format is refused rather than written without what that format keeps (an older
/// build would add history its index does not cover, write a task back without its frozen
/// base, or drop an evaluation's counted reports).
const FORMAT_KEY: &str = "store_format";
const FORMAT: u32 = 3;

/// How long an open waits for a lock on the database that this process itself may still hold:
/// sled releases its file lock when its last internal reference goes, which a write finishing
/// on its I/O threads can delay past the drop of the store (a store closed and reopened in one
/// process, as an in-process restart does). Another process holding it is refused after this.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Opens sled at `path`, waiting up to [`LOCK_WAIT`] for its file lock.
fn open_db(path: &Path) -> Result<sled::Db, StoreError> {
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match sled::Config::new().path(path).open() {
            Err(sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") => {
                if std::time::Instant::now() >= deadline {
                    return Err(StoreError::Io {
                        path: path.display().to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::WouldBlock,
                            format!("{e}: is another hora-server using this data directory? Stop it first, or give this one its own --data-dir"),
                        ),
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            opened => return Ok(opened?),
        }
    }
}

impl SledStore {
    /// Opens the store in `dir`, creating it (private to this user) if needed, blobs under it.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        Self::open_with(dir, Arc::new(DirBlobs::open(dir)?))
    }

    /// Opens the store in `dir`, its blobs in `blobs`.
    pub fn open_with(dir: &Path, blobs: Arc<dyn BlobStore>) -> Result<Self, StoreError> {
        super::files::make_private_dir(dir)?;
        let db = open_db(&dir.join("db"))?;
        SledStore {
            blobs,
            tasks: db.open_tree("tasks")?,
            open_rounds: db.open_tree("open_rounds")?,
            history: db.open_tree("history")?,
            clients: db.open_tree("clients")?,
            enrolments: db.open_tree("enrolments")?,
            sync_jobs: db.open_tree("sync_jobs")?,
            secagg: db.open_tree("secagg")?,
            meta: db.open_tree("meta")?,
            model_rounds: db.open_tree("model_rounds")?,
            db,
        }
        .with_model_index()
    }

    /// Refuses a store of a newer format; builds the index of the models history entries name
    /// when the store predates it (once), and records the format.
    fn with_model_index(self) -> Result<Self, StoreError> {
        let found = get::<u32>(&self.meta, FORMAT_KEY)?.unwrap_or(0);
        if found > FORMAT {
            return Err(StoreError::NewerFormat {
                found,
                supported: FORMAT,
            });
        }
        if self.meta.get(MODEL_INDEX)?.is_some() {
            if found < FORMAT {
                self.meta.insert(FORMAT_KEY, json(&FORMAT))?;
                self.db.flush()?;
            }
            return Ok(self);
        }
        for (key, r) in all::<RoundRecord>(self.history.iter())? {
            let Some(model) = r.model.filter(|_| !r.pruned) else {
                continue;
            };
            let task = key.split('\0').next().unwrap_or_default();
            self.model_rounds
                .insert(model_round_key(&model, task, r.round, r.attempt), &[])?;
        }
        self.meta.insert(MODEL_INDEX, json(&true))?;
        self.meta.insert(FORMAT_KEY, json(&FORMAT))?;
        self.db.flush()?;
        Ok(self)
    }

    /// `task`'s history entries (key, record) of rounds `first` up to `end` (not included; None:
    /// to the last), oldest first, read without the rest of the history.
    fn history_rows(
        &self,
        task: &str,
        first: u64,
        end: Option<u64>,
    ) -> impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>> {
        // Every key of the task starts `task\0`: `task\x01` sorts after all of them.
        let end = end.map_or(format!("{task}\u{1}"), |e| history_key(task, e, 0));
        self.history
            .range(history_key(task, first, 0).into_bytes()..end.into_bytes())
    }
}

impl Blobs for SledStore {
    fn blobs(&self) -> &dyn BlobStore {
        &*self.blobs
    }
}

impl Durable for SledStore {
    fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}

impl RoundLog for SledStore {
    fn task(&self, id: &str) -> Result<Option<TaskRecord>, StoreError> {
        get(&self.tasks, id)
    }

    fn tasks_each(&self) -> Result<Vec<TaskRead>, StoreError> {
        self.tasks
            .iter()
            .map(|kv| {
                let (k, v) = kv?;
                let key = String::from_utf8_lossy(&k).into_owned();
                let record = decode(&key, &v);
                Ok((key, record))
            })
            .collect()
    }

    fn create_task(&self, id: &str, task: &TaskRecord) -> Result<bool, StoreError> {
        let created = self
            .tasks
            .compare_and_swap(id, None as Option<&[u8]>, Some(json(task)))?
            .is_ok();
        Ok(created)
    }

    fn put_task(&self, id: &str, task: &TaskRecord) -> Result<(), StoreError> {
        self.tasks.insert(id, json(task))?;
        Ok(())
    }

    fn open_round(&self, task: &str) -> Result<Option<OpenRoundRecord>, StoreError> {
        get(&self.open_rounds, task)
    }

    fn put_open_round(&self, task: &str, round: &OpenRoundRecord) -> Result<(), StoreError> {
        self.open_rounds.insert(task, json(round))?;
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
        use sled::Transactional;
        (
            &self.tasks,
            &self.open_rounds,
            &self.history,
            &self.model_rounds,
        )
            .transaction(|(tasks, open, history, models)| {
                tasks.insert(task_id, json(task))?;
                history.insert(
                    history_key(task_id, record.round, attempt).as_bytes(),
                    json(record),
                )?;
                if let Some(model) = record.model.filter(|_| !record.pruned) {
                    models.insert(
                        model_round_key(&model, task_id, record.round, attempt).as_bytes(),
                        &[],
                    )?;
                }
                match next {
                    Some(n) => open.insert(task_id, json(n))?,
                    None => open.remove(task_id)?,
                };
                Ok(())
            })
            .map_err(|e| transaction_failed(e, task_id))?;
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
        use sled::transaction::ConflictableTransactionError::Abort;
        use sled::Transactional;
        let key = history_key(task_id, round, attempt);
        (&self.tasks, &self.history)
            .transaction(|(tasks, history)| {
                tasks.insert(task_id, json(task))?;
                // (No entry: the task is written all the same, the evaluation is over.)
                if let Some(bytes) = history.get(key.as_bytes())? {
                    let mut entry: RoundRecord =
                        serde_json::from_slice(&bytes).map_err(|_| Abort(()))?;
                    entry.evaluation = Some(*evaluation);
                    history.insert(key.as_bytes(), json(&entry))?;
                }
                Ok(())
            })
            .map_err(|e| transaction_failed(e, &key))?;
        Ok(())
    }

    fn history_page(
        &self,
        task: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<RoundRecord>, StoreError> {
        // Keys sort by round: the page starts at round `after + 1`, wherever that is.
        let Some(first) = after.checked_add(1) else {
            return Ok(Vec::new());
        };
        let rows = self.history_rows(task, first, None).take(limit);
        Ok(all(rows)?.into_iter().map(|(_, r)| r).collect())
    }

    fn round_attempts(&self, task: &str, round: u64) -> Result<Vec<RoundRecord>, StoreError> {
        let Some(next) = round.checked_add(1) else {
            return Ok(Vec::new());
        };
        let rows = self.history_rows(task, round, Some(next));
        Ok(all(rows)?.into_iter().map(|(_, r)| r).collect())
    }

    fn model_in_history(&self, digest: &ModelDigest) -> Result<bool, StoreError> {
        Ok(self
            .model_rounds
            .scan_prefix(format!("{}\0", digest.to_hex()))
            .next()
            .transpose()?
            .is_some())
    }

    /// Looks only at the rounds that can have fallen out of `retention` since the last prune
    /// under the same retention (a round kept once is kept until the window passes it, and
    /// then for good), so a publication's prune costs the same however long the history is.
    fn prune_models(
        &self,
        task: &str,
        retention: Retention,
        published: u64,
    ) -> Result<usize, StoreError> {
        let keeps_all = retention.last == 0 && retention.every == 0;
        // Rounds up to `upto` are out of the window of the last rounds.
        let upto = match keeps_all {
            true => 0,
            false => published.saturating_sub(retention.last),
        };
        let looked = get::<PrunedBelow>(&self.meta, &pruned_key(task))?;
        let compacted_from = looked.as_ref().map_or(0, |p| p.compacted_below);
        let from = looked
            .filter(|p| (p.last, p.every) == (retention.last, retention.every))
            .map_or(0, |p| p.below);
        let mut dropped = Vec::new();
        if !keeps_all && from <= upto {
            let rows = self.history_rows(task, from, Some(upto + 1));
            for (key, r) in all::<RoundRecord>(rows)? {
                let Some(model) = r.model.filter(|_| !r.pruned) else {
                    continue;
                };
                if retention.keeps(r.round, published) {
                    continue;
                }
                // In place of the entry as it is now (an evaluation may have ended into it
                // since it was read).
                amend(&self.history, &key, |entry| entry.pruned = true)?;
                self.model_rounds
                    .remove(model_round_key(&model, task, r.round, r.attempt))?;
                dropped.push(model);
            }
        }
        // Then the entries that fall out of the detail window lose their per-client lists.
        let compact_upto = retention.compacted_upto(published);
        if compact_upto >= compacted_from.max(1) {
            let rows = self.history_rows(task, compacted_from, Some(compact_upto + 1));
            for (key, mut r) in all::<RoundRecord>(rows)? {
                if r.compact() {
                    amend(&self.history, &key, |entry| {
                        entry.compact();
                    })?;
                }
            }
        }
        let below = PrunedBelow {
            last: retention.last,
            every: retention.every,
            below: upto + 1,
            compacted_below: compacted_from.max(compact_upto + 1),
        };
        self.meta.insert(pruned_key(task), json(&below))?;
        remove_unused_models(self, dropped)
    }
}

/// A failed sled transaction as a store error (`key`: what it was about).
fn transaction_failed(e: sled::transaction::TransactionError<()>, key: &str) -> StoreError {
    match e {
        sled::transaction::TransactionError::Storage(e) => StoreError::Db(e),
        sled::transaction::TransactionError::Abort(()) => StoreError::Corrupt {
            key: key.into(),
            reason: "transaction aborted".into(),
        },
    }
}

impl Registry for SledStore {
    fn client(&self, id: &str) -> Result<Option<ClientRecord>, StoreError> {
        get(&self.clients, id)
    }

    fn clients(&self) -> Result<Vec<(String, ClientRecord)>, StoreError> {
        all(self.clients.iter())
    }

    fn put_client(&self, id: &str, c: &ClientRecord) -> Result<(), StoreError> {
        self.clients.insert(id, json(c))?;
        Ok(())
    }

    fn update_client(
        &self,
        id: &str,
        change: &mut dyn FnMut(&mut ClientRecord),
    ) -> Result<Option<ClientRecord>, StoreError> {
        let mut corrupt = None;
        let changed = self.clients.update_and_fetch(id, |old| {
            let old = old?;
            match decode::<ClientRecord>(id, old) {
                Ok(mut c) => {
                    change(&mut c);
                    Some(json(&c))
                }
                Err(e) => {
                    corrupt = Some(e);
                    Some(old.to_vec())
                }
            }
        })?;
        if let Some(e) = corrupt {
            return Err(e);
        }
        changed.map(|bytes| decode(id, &bytes)).transpose()
    }

    fn put_enrolment(&self, token_hash: &str, e: &EnrolmentRecord) -> Result<(), StoreError> {
        self.enrolments.insert(token_hash, json(e))?;
        Ok(())
    }

    fn enrolment(&self, token_hash: &str) -> Result<Option<EnrolmentRecord>, StoreError> {
        get(&self.enrolments, token_hash)
    }

    fn enrol(
        &self,
        token_hash: &str,
        id: &str,
        client: &ClientRecord,
    ) -> Result<Option<EnrolmentRecord>, StoreError> {
        use sled::Transactional;
        let spent = (&self.enrolments, &self.clients)
            .transaction(|(enrolments, clients)| {
                if clients.get(id)?.is_some() {
                    return Ok(None); // never replace a client (the token stays unspent)
                }
                let spent = enrolments.remove(token_hash)?;
                if spent.is_some() {
                    clients.insert(id, json(client))?;
                }
                Ok(spent)
            })
            .map_err(|e| transaction_failed(e, id))?;
        spent.map(|v| decode("enrolment", &v)).transpose()
    }
}

impl SyncJobs for SledStore {
    fn sync_jobs(&self) -> Result<Vec<SyncJobRecord>, StoreError> {
        Ok(all(self.sync_jobs.iter())?
            .into_iter()
            .map(|(_, job)| job)
            .collect())
    }

    fn create_sync_job(&self, job: &SyncJobRecord) -> Result<bool, StoreError> {
        let created = self
            .sync_jobs
            .compare_and_swap(&job.id, None as Option<&[u8]>, Some(json(job)))?
            .is_ok();
        Ok(created)
    }

    fn put_sync_job(&self, job: &SyncJobRecord) -> Result<(), StoreError> {
        self.sync_jobs.insert(&job.id, json(job))?;
        Ok(())
    }

    fn remove_sync_job(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.sync_jobs.remove(id)?.is_some())
    }
}

impl SecaggLog for SledStore {
    fn secagg_get_bytes(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.secagg.get(key)?.map(|v| v.to_vec()))
    }

    fn secagg_put_bytes(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.secagg.insert(key, value)?;
        Ok(())
    }

    fn secagg_scan_bytes(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.secagg
            .scan_prefix(prefix)
            .map(|kv| {
                let (k, v) = kv?;
                let key = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                Ok((key, v.to_vec()))
            })
            .collect()
    }

    fn secagg_clear(&self, task: &str) -> Result<(), StoreError> {
        for key in self.secagg.scan_prefix(format!("{task}\0")).keys() {
            self.secagg.remove(key?)?;
        }
        Ok(())
    }
}

impl Housekeeping for SledStore {
    fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        get(&self.meta, key)
    }

    fn put_meta(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.meta.insert(key, json(&value))?;
        Ok(())
    }

    fn sweep_orphans(&self) -> Result<usize, StoreError> {
        blobs::sweep(
            &*self.blobs,
            referenced(self)?.as_ref(),
            std::time::SystemTime::now(),
        )
    }
}

/// What only the sled store has: files to damage and an on-disk format to keep. The contracts
/// both stores keep are in `conformance.rs`.
#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::store::Blobs;
    use hora_common::model::Model;

    #[test]
    fn a_data_directory_in_use_is_refused_with_what_to_do_and_free_once_closed() {
        let dir = tempfile::tempdir().unwrap();
        let first = SledStore::open(dir.path()).unwrap();
        let refused = SledStore::open(dir.path()).err().expect("a second opener");
        assert!(
            refused
                .to_string()
                .contains("is another hora-server using this data directory? Stop it first"),
            "{refused}"
        );
        first.put_meta("k", "v").unwrap();
        drop(first);
        let reopened = SledStore::open(dir.path()).unwrap();
        assert_eq!(reopened.meta("k").unwrap().as_deref(), Some("v"));
    }

    #[test]
    fn a_damaged_checkpoint_file_is_caught_by_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let ckpt = store.write_checkpoint(&[1.5, -2.0, 1e300]).unwrap();
        let path = dir.path().join("checkpoints").join(&ckpt);
        let mut bytes = fs::read(&path).unwrap();
        bytes[20] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            store.read_checkpoint(&ckpt, 3),
            Err(StoreError::Corrupt { .. })
        ));
        fs::write(&path, &bytes[..30]).unwrap();
        assert!(matches!(
            store.read_checkpoint(&ckpt, 3),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn checkpoints_of_the_first_format_named_by_their_hash_still_read() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let mut bytes = b"HORACKP1".to_vec();
        bytes.extend(2u64.to_le_bytes());
        bytes.extend([1.5f64, -2.0].iter().flat_map(|v| v.to_le_bytes()));
        let name = format!("{}.ckpt", hora_common::sha256_hex(&bytes));
        let path = dir.path().join("checkpoints").join(&name);
        fs::write(&path, &bytes).unwrap();
        assert_eq!(store.read_checkpoint(&name, 2).unwrap(), [1.5, -2.0]);
        bytes[20] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            store.read_checkpoint(&name, 2),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_store_from_before_the_model_index_gets_it_built_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let model = Model::from_tensors([("w", vec![1], vec![1.0])]).unwrap();
        let digest = {
            let store = SledStore::open(dir.path()).unwrap();
            let digest = store.put_model(&model).unwrap();
            let round = RoundRecord {
                contributors: None,
                forwarded_to: None,
                round: 1,
                attempt: 0,
                outcome: hora_common::wire::RoundOutcome::Published,
                participants: vec![],
                dropped: vec![],
                examples: 1,
                metrics: Default::default(),
                duration_ms: 1,
                model: Some(digest),
                pruned: false,
                privacy: None,
                staleness: None,
                compacted: None,
                evaluation: None,
            };
            // As an older server wrote it: the history entry, no index and no flag.
            store
                .history
                .insert(history_key("t", 1, 0).as_bytes(), json(&round))
                .unwrap();
            store.meta.remove(MODEL_INDEX).unwrap();
            store.flush().unwrap();
            digest
        };
        let store = SledStore::open(dir.path()).unwrap();
        assert!(store.model_in_history(&digest).unwrap());
        assert_eq!(get::<u32>(&store.meta, FORMAT_KEY).unwrap(), Some(FORMAT));
    }

    #[test]
    fn a_store_of_a_newer_format_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = SledStore::open(dir.path()).unwrap();
            store.meta.insert(FORMAT_KEY, json(&(FORMAT + 1))).unwrap();
            store.flush().unwrap();
        }
        let refused = SledStore::open(dir.path()).err().expect("refused");
        assert!(
            refused.to_string().contains("newer hora-server"),
            "{refused}"
        );
        let db = sled::open(dir.path().join("db")).unwrap();
        let meta = db.open_tree("meta").unwrap();
        assert_eq!(
            get::<u32>(&meta, FORMAT_KEY).unwrap(),
            Some(FORMAT + 1),
            "untouched"
        );
    }

    #[test]
    fn a_corrupt_task_hides_no_other_and_keeps_every_blob_from_the_sweep() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let model = Model::from_tensors([("w", vec![1], vec![1.0])]).unwrap();
        let digest = store.put_model(&model).unwrap();
        let orphan = store.write_checkpoint(&[1.0]).unwrap();
        store.tasks.insert("a", b"{not json".as_slice()).unwrap();
        store.tasks.insert("b", b"{}".as_slice()).unwrap();
        let each = store.tasks_each().unwrap();
        assert_eq!(each.len(), 2);
        assert!(each
            .iter()
            .all(|(_, r)| matches!(r, Err(StoreError::Corrupt { .. }))));
        assert!(store.tasks().is_err());
        fs::write(dir.path().join("checkpoints/.tmp-1-2"), b"torn").unwrap();
        // Nobody can tell the corrupt tasks' blobs from orphans: only the temporary file goes.
        assert_eq!(store.sweep_orphans().unwrap(), 1);
        assert!(store.has_model(&digest).unwrap());
        assert!(store.read_checkpoint(&orphan, 1).is_ok());
    }

    /// Data directories written before the store was split still open: the trees, keys and
    /// JSON are as they were.
    #[test]
    fn the_on_disk_format_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::open(dir.path().join("db")).unwrap();
            let record = |round: u64| {
                serde_json::json!({
                    "round": round, "attempt": 0, "outcome": {"status": "published"},
                    "participants": [], "dropped": [], "examples": 1,
                    "metrics": {"loss": null, "accuracy": null}, "duration_ms": 1, "model": null,
                })
                .to_string()
            };
            let history = db.open_tree("history").unwrap();
            for round in [2, 10] {
                history
                    .insert(
                        format!("t\0{round:020}\0{:010}", 0),
                        record(round).as_bytes(),
                    )
                    .unwrap();
            }
            let meta = db.open_tree("meta").unwrap();
            meta.insert("admin_token_hash", b"\"h\"".as_slice())
                .unwrap();
            let secagg = db.open_tree("secagg").unwrap();
            secagg.insert("t\0adv\0c1", b"1".as_slice()).unwrap();
            db.open_tree("enrolments")
                .unwrap()
                .insert("tok", br#"{"expires_unix_ms": 5}"#.as_slice())
                .unwrap();
            db.flush().unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        let rounds: Vec<_> = store
            .history("t")
            .unwrap()
            .iter()
            .map(|r| r.round)
            .collect();
        assert_eq!(rounds, [2, 10]);
        assert_eq!(
            store.meta("admin_token_hash").unwrap().as_deref(),
            Some("h")
        );
        assert_eq!(
            store.secagg_scan_bytes("t\0adv\0").unwrap(),
            [("c1".to_string(), b"1".to_vec())]
        );
        assert!(store.enrolment("tok").unwrap().is_some());
    }
}
