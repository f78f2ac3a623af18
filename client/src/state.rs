//! What a client keeps on its own disk so that a restart picks up where it was: its credentials,
//! the models and TorchScript modules it downloaded (by digest, so an unchanged model is never
//! fetched twice), and the round it is in the middle of — the trained delta waiting to be
//! uploaded, and whether the server acknowledged it.
//!
//! Every file is written to a temporary name and renamed, so a client killed at any moment finds
//! either the old file or the new one. Credentials and the identity key are also fsynced: losing
//! them to a power cut would mean enrolling again. The model cache and the round in progress
//! are not: they are rewritten every round, on the round's critical path, where an fsync costs
//! milliseconds; a killed process loses nothing of them (the page cache outlives it), and what a
//! power cut takes is only worth a retraining (a damaged record reads as no record, a damaged
//! cached model as a cache miss), which the server accepts once per client and round.
//! Credentials and deltas are private to the user (0600). The delta never leaves the device
//! except sealed to the round key.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use hora_common::model::{Limits, Model, ModelDigest};
use hora_common::wire::{Credentials, Metrics};
use serde::{Deserialize, Serialize};

use crate::error::{ClientError, Result};

const CREDENTIALS: &str = "credentials.json";
const IDENTITY: &str = "identity.pk8";
/// The secret a client enrols with, chosen before it asks, so that a repeat of an enrolment
/// whose answer was lost gets the same credentials.
const ENROLMENT_SECRET: &str = "enrolment-secret";
/// Downloaded models kept, the one just cached included (those used longest ago are removed).
const MODELS_KEPT: usize = 3;

/// A client's state directory.
#[derive(Debug, Clone)]
pub struct StateDir {
    dir: PathBuf,
}

/// The round a client is in the middle of, for one task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundState {
    pub round: u64,
    /// The attempt of the round the delta was uploaded to (a retried attempt of the same round
    /// trains from the same base, so it takes the same delta again).
    #[serde(default)]
    pub attempt: u32,
    /// The global model the delta was trained from.
    pub base: ModelDigest,
    pub num_examples: u64,
    pub metrics: Metrics,
    /// Set once the server acknowledged the upload.
    pub uploaded: bool,
}

/// Whether a write must survive a power cut (fsync the file and its directory), or only a
/// crash of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sync {
    Durable,
    ProcessCrash,
}

/// Writes `path` through a temporary file and a rename (0600 when `private`), fsynced as
/// `sync` says.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], private: bool) -> Result<()> {
    write_file(path, bytes, private, Sync::Durable)
}

/// Removes every file of `paths` that exists.
fn remove_all<const N: usize>(paths: [PathBuf; N]) -> Result<()> {
    for path in paths {
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ClientError::io(path, e)),
        }
    }
    Ok(())
}

pub(crate) fn write_file(path: &Path, bytes: &[u8], private: bool, sync: Sync) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let result = (|| {
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        if private {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts.open(&tmp)?;
        f.write_all(bytes)?;
        if sync == Sync::ProcessCrash {
            drop(f);
            return fs::rename(&tmp, path);
        }
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // A bare file name's parent is "": the current directory.
        if let Some(parent) = path.parent() {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            fs::File::open(parent)?.sync_all()?;
        }
        Ok(())
    })();
    result.map_err(|e| ClientError::io(path, e))
}

impl StateDir {
    /// Opens (creating it if needed) the state directory `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        for sub in ["", "models", "modules", "rounds"] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).map_err(|e| ClientError::io(&d, e))?;
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                .map_err(|e| ClientError::io(dir, e))?;
        }
        Ok(StateDir {
            dir: dir.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn corrupt(&self, what: &Path, e: impl std::fmt::Display) -> ClientError {
        ClientError::State {
            dir: self.dir.clone(),
            message: format!("{} is unreadable: {e}", what.display()),
        }
    }

    /// A JSON file of the state, if it exists.
    fn read_json<T: serde::de::DeserializeOwned>(&self, path: PathBuf) -> Result<Option<T>> {
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| self.corrupt(&path, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ClientError::io(path, e)),
        }
    }

    pub fn credentials(&self) -> Result<Option<Credentials>> {
        self.read_json(self.dir.join(CREDENTIALS))
    }

    pub fn save_credentials(&self, creds: &Credentials) -> Result<()> {
        let json = serde_json::to_vec_pretty(creds).expect("credentials serialise");
        write_atomic(&self.dir.join(CREDENTIALS), &json, true)
    }

    /// The client's Ed25519 identity (signs its secure-aggregation keys), if it has one.
    pub fn identity(&self) -> Result<Option<hora_common::secagg::Identity>> {
        let path = self.dir.join(IDENTITY);
        match fs::read(&path) {
            Ok(doc) => hora_common::secagg::Identity::from_pkcs8(&doc)
                .map(Some)
                .map_err(|e| self.corrupt(&path, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(ClientError::io(path, e)),
        }
    }

    /// The secret to enrol with: the one chosen for an enrolment not yet answered, else a new
    /// one (32 bytes from the system's RNG, hex), recorded durably before it is sent.
    pub fn enrolment_secret(&self) -> Result<String> {
        let path = self.dir.join(ENROLMENT_SECRET);
        match fs::read_to_string(&path) {
            Ok(s) if s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()) => return Ok(s),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ClientError::io(path, e)),
        }
        let mut bytes = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes).map_err(
            |_| ClientError::State {
                dir: self.dir.clone(),
                message: "the system RNG failed".into(),
            },
        )?;
        let secret = hex::encode(bytes);
        write_atomic(&path, secret.as_bytes(), true)?;
        Ok(secret)
    }

    /// Stores the credentials enrolment returned, and forgets the enrolment secret.
    pub fn save_enrolled(&self, creds: &Credentials) -> Result<()> {
        self.save_credentials(creds)?;
        let _ = fs::remove_file(self.dir.join(ENROLMENT_SECRET));
        Ok(())
    }

    /// Makes and stores (0600) a new identity.
    pub fn create_identity(&self) -> Result<hora_common::secagg::Identity> {
        let (identity, doc) =
            hora_common::secagg::Identity::generate().map_err(|e| ClientError::State {
                dir: self.dir.clone(),
                message: format!("making an identity key: {e}"),
            })?;
        write_atomic(&self.dir.join(IDENTITY), &doc, true)?;
        Ok(identity)
    }

    fn model_path(&self, digest: &ModelDigest) -> PathBuf {
        self.dir
            .join("models")
            .join(format!("{}.safetensors", digest.to_hex()))
    }

    /// The cached model with this digest, if there is one and it is intact.
    pub fn cached_model(&self, digest: &ModelDigest, limits: &Limits) -> Option<Model> {
        let path = self.model_path(digest);
        let model = Model::read_file(&path, limits).ok()?;
        if model.digest() == *digest {
            // Used now: the newest to keep (a task's frozen base outlives its rounds' models).
            let now = std::time::SystemTime::now();
            let _ = fs::File::options()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_modified(now));
            Some(model)
        } else {
            let _ = fs::remove_file(&path);
            None
        }
    }

    /// Caches `model` (whose digest is `digest`) and drops all but the few others used last.
    pub fn cache_model(&self, digest: &ModelDigest, model: &Model) -> Result<()> {
        self.cache_model_bytes(digest, &model.to_safetensors())
    }

    /// [`StateDir::cache_model`] for a model's safetensors bytes (as downloaded and verified).
    pub fn cache_model_bytes(&self, digest: &ModelDigest, safetensors: &[u8]) -> Result<()> {
        write_file(
            &self.model_path(digest),
            safetensors,
            false,
            Sync::ProcessCrash,
        )?;
        let dir = self.dir.join("models");
        let mut others: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(&dir)
            .map_err(|e| ClientError::io(&dir, e))?
            .filter_map(|e| e.ok())
            .filter(|e| e.path() != self.model_path(digest))
            // (Only models: a write in progress is not one to drop.)
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        others.sort();
        let excess = others.len().saturating_sub(MODELS_KEPT - 1);
        for (_, path) in others.into_iter().take(excess) {
            let _ = fs::remove_file(path);
        }
        Ok(())
    }

    /// Where the TorchScript module with this digest (hex SHA-256) lives once downloaded.
    pub fn module_path(&self, digest: &str) -> PathBuf {
        self.dir.join("modules").join(format!("{digest}.pt"))
    }

    pub fn save_module(&self, digest: &str, bytes: &[u8]) -> Result<PathBuf> {
        let path = self.module_path(digest);
        write_atomic(&path, bytes, false)?;
        Ok(path)
    }

    fn round_path(&self, task: &str) -> PathBuf {
        self.dir.join("rounds").join(format!("{task}.json"))
    }

    fn delta_path(&self, task: &str) -> PathBuf {
        self.dir
            .join("rounds")
            .join(format!("{task}.delta.safetensors"))
    }

    /// The round this client was last in for `task`. A damaged record (a power cut while it
    /// was written) is no record: the client trains the round again.
    pub fn round(&self, task: &str) -> Result<Option<RoundState>> {
        match self.read_json(self.round_path(task)) {
            Err(ClientError::State { message, .. }) => {
                tracing::warn!("{message}; training the round again");
                Ok(None)
            }
            other => other,
        }
    }

    /// Records a trained, not yet uploaded delta (the delta first, then the record naming it).
    /// What error feedback carried into it is in it now: the earlier remainders go before the
    /// record (a crash between finds the old record and no remainder: the new delta, never
    /// sent, carries whole).
    pub fn save_trained(&self, task: &str, state: &RoundState, delta: &Model) -> Result<()> {
        write_file(
            &self.delta_path(task),
            &delta.to_safetensors(),
            true,
            Sync::ProcessCrash,
        )?;
        remove_all([self.unsent_path(task), self.residual_path(task)])?;
        self.save_round(task, state)
    }

    pub fn save_round(&self, task: &str, state: &RoundState) -> Result<()> {
        let json = serde_json::to_vec_pretty(state).expect("round state serialises");
        write_file(&self.round_path(task), &json, false, Sync::ProcessCrash)
    }

    /// The delta recorded by [`StateDir::save_trained`], if it is still there and readable.
    pub fn trained_delta(&self, task: &str, limits: &Limits) -> Option<Model> {
        Model::read_file(&self.delta_path(task), limits).ok()
    }

    /// Records what the encoding of the recorded update left out (error feedback, see
    /// [`hora_common::codec`]: it carries into the next update once the server took this one).
    pub fn save_unsent(&self, task: &str, unsent: &Model) -> Result<()> {
        write_file(
            &self.unsent_path(task),
            &unsent.to_safetensors(),
            true,
            Sync::ProcessCrash,
        )
    }

    /// What error feedback carries into the next update trained for `task`: what the encoding
    /// of the recorded update left out, once it was encoded and sent (taken, or perhaps taken:
    /// an acknowledgement lost on the way must not count it twice); all of a recorded update
    /// never sent; with no round recorded, what [`StateDir::untaken`] kept (an update the server
    /// refused as late). Nothing if that is missing or unreadable.
    pub fn carried(&self, task: &str, limits: &Limits) -> Option<Model> {
        let read = |path: PathBuf| Model::read_file(&path, limits).ok();
        match self.round(task).ok().flatten() {
            Some(_) => read(self.unsent_path(task)).or_else(|| read(self.delta_path(task))),
            None => read(self.residual_path(task)),
        }
    }

    /// The recorded update can never be taken (its round closed without it): with error
    /// feedback, all of it carries into the next update.
    pub fn untaken(&self, task: &str) -> Result<()> {
        let (delta, residual) = (self.delta_path(task), self.residual_path(task));
        match fs::rename(&delta, &residual) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ClientError::io(delta, e)),
        }
        remove_all([self.round_path(task), self.unsent_path(task)])
    }

    fn unsent_path(&self, task: &str) -> PathBuf {
        self.dir
            .join("rounds")
            .join(format!("{task}.unsent.safetensors"))
    }

    fn residual_path(&self, task: &str) -> PathBuf {
        self.dir
            .join("rounds")
            .join(format!("{task}.residual.safetensors"))
    }

    /// Forgets the round in progress (its update can no longer be accepted) and what error
    /// feedback would carry (the task has ended, or does not use it).
    pub fn clear_round(&self, task: &str) -> Result<()> {
        remove_all([
            self.delta_path(task),
            self.round_path(task),
            self.unsent_path(task),
            self.residual_path(task),
        ])
    }

    /// Marks the round uploaded to `attempt`. The delta stays (until the next round's replaces
    /// it): should that attempt be abandoned, its retry trains from the same base and takes the
    /// same delta again, without training twice.
    pub fn mark_uploaded(&self, task: &str, state: &RoundState, attempt: u32) -> Result<()> {
        self.save_round(
            task,
            &RoundState {
                uploaded: true,
                attempt,
                ..state.clone()
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(v: f32) -> Model {
        Model::from_tensors([("w", vec![2], vec![v, -v])]).unwrap()
    }

    #[test]
    fn survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        assert_eq!(state.credentials().unwrap(), None);
        let creds = Credentials {
            client_id: "c-1".into(),
            secret: "s".into(),
        };
        state.save_credentials(&creds).unwrap();
        let m = model(1.0);
        state.cache_model(&m.digest(), &m).unwrap();
        let round = RoundState {
            round: 3,
            attempt: 0,
            base: m.digest(),
            num_examples: 12,
            metrics: Metrics::default(),
            uploaded: false,
        };
        state.save_trained("t", &round, &model(0.5)).unwrap();

        let state = StateDir::open(dir.path()).unwrap();
        assert_eq!(state.credentials().unwrap(), Some(creds));
        let limits = Limits::default();
        assert_eq!(state.cached_model(&m.digest(), &limits), Some(m.clone()));
        assert_eq!(state.round("t").unwrap(), Some(round.clone()));
        assert_eq!(state.trained_delta("t", &limits), Some(model(0.5)));
        state.mark_uploaded("t", &round, 2).unwrap();
        let uploaded = state.round("t").unwrap().unwrap();
        assert!(uploaded.uploaded);
        assert_eq!(uploaded.attempt, 2);
        // Kept for a retried attempt of the same round.
        assert_eq!(state.trained_delta("t", &limits), Some(model(0.5)));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join(CREDENTIALS))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "credentials are private");
        }
    }

    #[test]
    fn a_corrupt_cache_entry_is_a_miss_and_old_models_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let limits = Limits::default();
        let models: Vec<Model> = (0..4).map(|i| model(i as f32)).collect();
        for m in &models {
            state.cache_model(&m.digest(), m).unwrap();
        }
        let kept = fs::read_dir(dir.path().join("models")).unwrap().count();
        assert_eq!(kept, MODELS_KEPT);
        // A model used again (a task's frozen base, each round) outlives newer ones.
        let (used, unused) = (&models[1], &models[2]);
        assert_eq!(
            state.cached_model(&used.digest(), &limits).as_ref(),
            Some(used)
        );
        for m in [model(10.0), model(11.0)] {
            state.cache_model(&m.digest(), &m).unwrap();
        }
        assert_eq!(
            state.cached_model(&used.digest(), &limits).as_ref(),
            Some(used)
        );
        assert_eq!(state.cached_model(&unused.digest(), &limits), None);
        let newest = &models[3];
        fs::write(state.model_path(&newest.digest()), b"garbage").unwrap();
        assert_eq!(state.cached_model(&newest.digest(), &limits), None);

        fs::write(dir.path().join(CREDENTIALS), b"{").unwrap();
        let err = state.credentials().unwrap_err().to_string();
        assert!(err.contains("credentials.json"), "{err}");
    }

    /// What error feedback carries follows the round's record: what the encoding left out once
    /// the server took the update, all of an update it never acknowledged or could not take,
    /// nothing once the task has ended.
    #[test]
    fn error_feedback_carries_what_the_server_did_not_take() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        let limits = Limits::default();
        assert_eq!(state.carried("t", &limits), None);
        let round = RoundState {
            round: 1,
            attempt: 0,
            base: model(0.0).digest(),
            num_examples: 1,
            metrics: Metrics::default(),
            uploaded: false,
        };
        let (update, unsent) = (model(2.0), model(0.25));
        state.save_trained("t", &round, &update).unwrap();
        // Trained, not yet encoded and sent: all of it.
        assert_eq!(state.carried("t", &limits), Some(update.clone()));
        state.save_unsent("t", &unsent).unwrap();
        assert_eq!(state.carried("t", &limits), Some(unsent.clone()));
        state.mark_uploaded("t", &round, 0).unwrap();
        assert_eq!(state.carried("t", &limits), Some(unsent));
        // Refused as late: all of it, until the next update takes it in.
        state.untaken("t").unwrap();
        assert_eq!(state.round("t").unwrap(), None);
        assert_eq!(state.carried("t", &limits), Some(update));
        state.save_trained("t", &round, &model(3.0)).unwrap();
        assert_eq!(state.carried("t", &limits), Some(model(3.0)));
        state.clear_round("t").unwrap();
        assert_eq!(state.carried("t", &limits), None);
    }

    #[test]
    fn a_damaged_round_record_is_no_record() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::open(dir.path()).unwrap();
        fs::write(state.round_path("t"), b"").unwrap();
        assert_eq!(state.round("t").unwrap(), None);
    }
}
