//! The contracts every [`Storage`] keeps, written once and run against [`SledStore`] (in a
//! temporary directory), [`PostgresStore`] (on a real PostgreSQL server each test starts, see
//! `postgres::test_server`) and [`MemoryStore`]: the cases are in `records.rs` and `blobs.rs`,
//! each a function of a [`Fixture`]; `suite!` at the bottom makes one test per case and store.
//! The blob cases also run against the sled store with its blobs in an object store
//! ([`ObjectBlobs`]): a `file://` directory, and a real S3-compatible server each test starts
//! (see `crate::store::blobs::test_s3`).

use hora_common::model::{Model, ModelDigest};
use hora_common::wire::{RoundOutcome, RoundRecord, TaskState};
use serde::{Deserialize, Serialize};

use super::*;

mod blobs;
mod records;

use self::blobs::*;
use self::records::*;

/// A store under test, and the way to close and reopen it on the same data.
trait Fixture {
    fn store(&self) -> &dyn Storage;
    /// Closes the store and opens what it wrote (the same store for one kept in memory).
    fn reopen(&mut self);
    /// Makes blob `name` look written two days ago (its file's modification time, which every
    /// blob store here reports as the blob's age).
    fn backdate(&self, kind: BlobKind, name: &str);
    /// Whether the blob store under test creates a blob atomically. S3 does (a put with
    /// `If-None-Match: *`); the S3-compatible server the tests run, s3s-fs, honours the header
    /// but looks before it writes, so racers can all pass its look: there only the refusal of a
    /// blob that is there already is checked.
    fn creates_atomically(&self) -> bool {
        true
    }
}

const TWO_DAYS: std::time::Duration = std::time::Duration::from_secs(2 * 86_400);

/// Where a sled store under test keeps its blobs.
enum BlobsAt {
    /// Under its data directory (the default).
    DataDir,
    /// `file://` a directory of their own, through `object_store`.
    File(tempfile::TempDir),
    /// In a bucket of a real S3-compatible server, under a prefix.
    S3(crate::store::blobs::test_s3::TestS3),
}

const S3_PREFIX: &str = "deployment/one";

impl BlobsAt {
    fn open(&self, data_dir: &std::path::Path) -> std::sync::Arc<dyn BlobStore> {
        match self {
            BlobsAt::DataDir => std::sync::Arc::new(DirBlobs::open(data_dir).unwrap()),
            BlobsAt::File(dir) => BlobLocation::File(dir.path().to_path_buf())
                .open(data_dir)
                .unwrap(),
            BlobsAt::S3(server) => std::sync::Arc::new(
                ObjectBlobs::open_s3(
                    crate::store::blobs::test_s3::BUCKET,
                    S3_PREFIX,
                    Some(&server.endpoint()),
                    Default::default(),
                    object_store::aws::AmazonS3Builder::new()
                        .with_access_key_id(crate::store::blobs::test_s3::ACCESS_KEY)
                        .with_secret_access_key(crate::store::blobs::test_s3::SECRET_KEY)
                        .with_region("us-east-1"),
                )
                .unwrap(),
            ),
        }
    }

    fn file(&self, data_dir: &std::path::Path, kind: BlobKind, name: &str) -> std::path::PathBuf {
        let key = format!("{}/{name}", kind.folder());
        match self {
            BlobsAt::DataDir => data_dir.join(key),
            BlobsAt::File(dir) => dir.path().join(key),
            BlobsAt::S3(server) => server.object_file(&format!("{S3_PREFIX}/{key}")),
        }
    }
}

struct Sled {
    dir: tempfile::TempDir,
    blobs: BlobsAt,
    store: Option<SledStore>,
}

impl Sled {
    fn new() -> Self {
        Self::with_blobs(BlobsAt::DataDir)
    }

    fn with_blobs(blobs: BlobsAt) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = Some(SledStore::open_with(dir.path(), blobs.open(dir.path())).unwrap());
        Sled { dir, blobs, store }
    }

    fn on_file() -> Self {
        Self::with_blobs(BlobsAt::File(tempfile::tempdir().unwrap()))
    }

    fn on_s3() -> Self {
        Self::with_blobs(BlobsAt::S3(crate::store::blobs::test_s3::TestS3::start()))
    }
}

impl Fixture for Sled {
    fn store(&self) -> &dyn Storage {
        self.store.as_ref().unwrap()
    }

    fn reopen(&mut self) {
        self.store.take().unwrap().flush().unwrap(); // sled allows one opener at a time
        let blobs = self.blobs.open(self.dir.path());
        self.store = Some(SledStore::open_with(self.dir.path(), blobs).unwrap());
    }

    fn backdate(&self, kind: BlobKind, name: &str) {
        let file = self.blobs.file(self.dir.path(), kind, name);
        crate::store::blobs::test_s3::backdate(&file, TWO_DAYS);
    }

    fn creates_atomically(&self) -> bool {
        !matches!(self.blobs, BlobsAt::S3(_))
    }
}

/// A real PostgreSQL server of the test's own (see `postgres::test_server`), blobs in a
/// temporary directory; reopening opens a second store on the same database and directory.
struct Postgres {
    // Dropped in this order: the store, then the server under it.
    store: Option<PostgresStore>,
    dir: tempfile::TempDir,
    server: postgres::test_server::TestServer,
}

impl Postgres {
    fn new() -> Self {
        let server = postgres::test_server::TestServer::start();
        let dir = tempfile::tempdir().unwrap();
        let store = Some(PostgresStore::open(&server.url().parse().unwrap(), dir.path()).unwrap());
        Postgres { store, dir, server }
    }
}

impl Fixture for Postgres {
    fn store(&self) -> &dyn Storage {
        self.store.as_ref().unwrap()
    }

    fn reopen(&mut self) {
        self.store = None;
        self.store = Some(
            PostgresStore::open(&self.server.url().parse().unwrap(), self.dir.path()).unwrap(),
        );
    }

    fn backdate(&self, kind: BlobKind, name: &str) {
        let file = self.dir.path().join(kind.folder()).join(name);
        crate::store::blobs::test_s3::backdate(&file, TWO_DAYS);
    }
}

struct Memory(MemoryStore);

impl Fixture for Memory {
    fn store(&self) -> &dyn Storage {
        &self.0
    }

    fn reopen(&mut self) {}

    fn backdate(&self, kind: BlobKind, name: &str) {
        crate::store::blobs::test_s3::backdate(&self.0.blob_path(kind, name), TWO_DAYS);
    }
}

pub(super) fn model(values: [f32; 3]) -> Model {
    Model::from_tensors([("w", vec![3], values.to_vec())]).unwrap()
}

pub(super) fn task(initial: ModelDigest, published: u64) -> TaskRecord {
    let config = serde_json::from_value(serde_json::json!({
        "id": "t",
        "initial_model": initial.to_hex(),
        "model": {"kind": "builtin", "name": "logreg"},
        "rounds": 10,
        "min_clients": 1,
        "target_clients": 2,
        "round_deadline_secs": 60,
    }))
    .unwrap();
    TaskRecord {
        parent: None,
        config,
        spec: model([0.0; 3]).spec(),
        state: TaskState::Running,
        published,
        global_model: initial,
        created_unix_ms: 1,
        strategy_state: None,
        dp: None,
        ended_reason: None,
        part: None,
        evaluating: None,
    }
}

pub(super) fn open_round(round: u64, checkpoint: Option<&str>) -> OpenRoundRecord {
    OpenRoundRecord {
        round,
        attempt: 0,
        secret: "00".into(),
        base_model: model([0.0; 3]).digest(),
        opened_unix_ms: 2,
        deadline_unix_ms: 3,
        selected: vec!["c1".into()],
        checkpoint: checkpoint.map(|file| CheckpointRecord {
            file: file.into(),
            contributions: vec![Contribution {
                contributors: 1,
                client: "c1".into(),
                examples: 5,
                metrics: Default::default(),
                unclipped: None,
                base: Some(round),
            }],
            total_weight: 5.0,
            noised: false,
        }),
        slots: vec![TrainingSlot {
            client: "c2".into(),
            until_unix_ms: 4,
        }],
        earlier: vec![EarlierVersion {
            round: round.saturating_sub(1),
            secret: "11".into(),
            base_model: model([1.0; 3]).digest(),
        }],
        merged: vec!["r0".into()],
    }
}

pub(super) fn published(round: u64, attempt: u32, model: Option<ModelDigest>) -> RoundRecord {
    RoundRecord {
        contributors: None,
        forwarded_to: None,
        round,
        attempt,
        outcome: RoundOutcome::Published,
        participants: vec!["c1".into()],
        dropped: vec![],
        examples: 5,
        metrics: Default::default(),
        duration_ms: 4,
        model,
        pruned: false,
        privacy: None,
        staleness: None,
        compacted: None,
        evaluation: None,
    }
}

pub(super) fn client(label: &str) -> ClientRecord {
    ClientRecord {
        aggregator: false,
        max_contributors: None,
        secret_hash: "h".into(),
        label: Some(label.into()),
        enrolled_unix_ms: 1,
        revoked: false,
        identity_key: None,
        tasks: Some(vec!["t".into()]),
        strikes: 0,
        quarantined: None,
    }
}

fn job(id: &str, generations: u64) -> SyncJobRecord {
    SyncJobRecord {
        id: id.into(),
        world_size: 4,
        token_hash: "h".into(),
        generations,
        // Every other job elastic: both shapes of record go through every store.
        elastic: (generations % 2 == 1).then_some(ElasticSyncJob {
            min_world_size: 2,
            settle_ms: 500,
        }),
        // And one in three finished.
        finished: generations % 3 == 2,
    }
}

/// What secure aggregation keeps per attempt, as far as the store cares.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct SecaggState {
    stage: String,
    sum_file: Option<String>,
}

fn secagg_state(sum_file: Option<&str>) -> SecaggState {
    SecaggState {
        stage: "masked".into(),
        sum_file: sum_file.map(Into::into),
    }
}

macro_rules! suite {
    ($($case:ident),* $(,)?) => {
        mod sled_store {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Sled::new())
            })*
        }

        mod postgres_store {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Postgres::new())
            })*
        }

        mod memory_store {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Memory(super::MemoryStore::new().unwrap()))
            })*
        }
    };
}

/// The cases that touch blobs, on a store whose blobs are in an object store.
macro_rules! blob_suite {
    ($($case:ident),* $(,)?) => {
        mod blobs_on_file {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Sled::on_file())
            })*
        }

        mod blobs_on_s3 {
            $(#[test]
            fn $case() {
                super::$case(&mut super::Sled::on_s3())
            })*
        }
    };
}

suite!(
    tasks_are_created_once_and_listed_in_id_order,
    open_rounds_are_kept_per_task,
    finish_round_records_the_round_and_moves_the_task_on,
    ending_an_evaluation_writes_the_task_and_its_round_entry_together,
    pruning_drops_models_out_of_retention_unless_still_used,
    history_entries_out_of_the_detail_window_are_compacted,
    clients_are_read_back_in_id_order,
    enrolment_tokens_work_once,
    sync_jobs_are_created_once_updated_and_removed,
    secagg_records_are_scanned_by_prefix_and_cleared_per_task,
    secagg_messages_go_in_through_an_open_gate_and_a_claim_once,
    meta_is_kept,
    models_and_modules_are_content_addressed,
    checkpoints_and_masked_sums_round_trip,
    strategy_states_are_removed_by_valid_name_only,
    the_sweep_removes_what_no_record_refers_to,
    everything_written_is_there_after_reopening,
    stores_are_shared_across_threads,
    blobs_stream_in_ranges_and_large_ones_in_parts,
    an_uncommitted_blob_leaves_nothing,
    a_blob_is_created_once,
);

blob_suite!(
    pruning_drops_models_out_of_retention_unless_still_used,
    models_and_modules_are_content_addressed,
    checkpoints_and_masked_sums_round_trip,
    strategy_states_are_removed_by_valid_name_only,
    the_sweep_removes_what_no_record_refers_to,
    everything_written_is_there_after_reopening,
    blobs_stream_in_ranges_and_large_ones_in_parts,
    an_uncommitted_blob_leaves_nothing,
    a_blob_is_created_once,
);
