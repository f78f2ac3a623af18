//! Rank 0's checkpoints, and the one a restarted job resumes from.
//!
//! Only rank 0 writes (every rank holds the same model, and N writers to one shared directory
//! would race); on a restart rank 0 reads the newest checkpoint and the others receive it by
//! broadcast, so the directory need not be shared. A checkpoint is two files written atomically
//! (temporary file, fsync, rename): `step-NNNNNNNNNN.safetensors` with the parameters
//! (`param/…`) and the optimizer state (`state/…`), then `step-NNNNNNNNNN.json` with the step,
//! the world size and the SHA-256 of the tensors — the JSON is the commit point, so a crash
//! mid-write leaves the previous checkpoint as the newest. The last [`KEEP`] are kept.

use std::fs;
use std::path::{Path, PathBuf};

use hora_common::model::{Limits, Model};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::{Result, SyncError};
use crate::state::write_atomic;

/// Checkpoints kept on disk.
pub const KEEP: usize = 3;

/// What the JSON half of a checkpoint records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Optimizer steps taken (the training loop's position).
    pub step: u64,
    /// The world size that wrote it (informational: a job may resume with another).
    pub world_size: u32,
    /// The tensors file and its SHA-256.
    pub tensors: String,
    pub sha256: String,
}

fn checkpoint_error(path: &Path, what: impl std::fmt::Display) -> SyncError {
    SyncError::Checkpoint(format!("{}: {what}", path.display()))
}

/// Writes a checkpoint of `params` and `state` at `step` into `dir` and drops old ones.
pub fn save(
    dir: &Path,
    step: u64,
    world_size: u32,
    params: &[(String, Tensor)],
    state: &[(String, Tensor)],
) -> Result<PathBuf> {
    fs::create_dir_all(dir).map_err(|e| checkpoint_error(dir, e))?;
    let tensors = params
        .iter()
        .map(|(n, t)| (format!("param/{n}"), t))
        .chain(state.iter().map(|(n, t)| (format!("state/{n}"), t)))
        .map(|(name, t)| {
            let shape = t.size().iter().map(|&d| d as usize).collect();
            let values = Vec::<f32>::try_from(
                &t.f_to_kind(Kind::Float)?
                    .f_to_device(tch::Device::Cpu)?
                    .f_flatten(0, -1)?,
            )?;
            Ok((name, shape, values))
        })
        .collect::<Result<Vec<_>>>()?;
    let model = Model::from_tensors(tensors).map_err(|e| checkpoint_error(dir, e))?;
    let bytes = model.to_safetensors();
    let name = format!("step-{step:010}");
    let tensors_file = format!("{name}.safetensors");
    write_atomic(&dir.join(&tensors_file), &bytes, false)?;
    let meta = CheckpointMeta {
        step,
        world_size,
        sha256: hora_common::sha256_hex(&bytes),
        tensors: tensors_file,
    };
    let json = serde_json::to_vec_pretty(&meta).map_err(|e| checkpoint_error(dir, e))?;
    let path = dir.join(format!("{name}.json"));
    write_atomic(&path, &json, false)?;
    prune(dir)?;
    Ok(path)
}

/// Checkpoint JSON files in `dir`, oldest first.
fn listed(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = match fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("step-") && n.ends_with(".json"))
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(checkpoint_error(dir, e)),
    };
    found.sort();
    Ok(found)
}

fn prune(dir: &Path) -> Result<()> {
    let all = listed(dir)?;
    for old in all.iter().take(all.len().saturating_sub(KEEP)) {
        let _ = fs::remove_file(old.with_extension("safetensors"));
        let _ = fs::remove_file(old);
    }
    Ok(())
}

/// The newest complete checkpoint in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<(CheckpointMeta, Model)>> {
    for path in listed(dir)?.iter().rev() {
        let meta: CheckpointMeta = match fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            Ok(meta) => meta,
            Err(e) => {
                tracing::warn!("skipping unreadable checkpoint {}: {e}", path.display());
                continue;
            }
        };
        if meta.tensors.contains('/')
            || meta.tensors.contains("..")
            || !meta.tensors.ends_with(".safetensors")
        {
            return Err(checkpoint_error(
                path,
                "names a tensors file outside its directory",
            ));
        }
        let tensors = dir.join(&meta.tensors);
        let bytes = fs::read(&tensors).map_err(|e| checkpoint_error(&tensors, e))?;
        let digest = hora_common::sha256_hex(&bytes);
        if digest != meta.sha256 {
            return Err(checkpoint_error(
                &tensors,
                "contents do not match the SHA-256 recorded in its JSON: the file is corrupt; move the checkpoint away to resume from the one before",
            ));
        }
        let model = Model::from_safetensors(&bytes, &Limits::default())
            .map_err(|e| checkpoint_error(&tensors, e))?;
        return Ok(Some((meta, model)));
    }
    Ok(None)
}

/// Loads `checkpoint`'s tensors into `params` and `state` (names and shapes must match).
pub fn restore(
    checkpoint: &Model,
    params: &[(String, Tensor)],
    state: &[(String, Tensor)],
) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let targets = params
        .iter()
        .map(|(n, t)| (format!("param/{n}"), t))
        .chain(state.iter().map(|(n, t)| (format!("state/{n}"), t)));
    let mut count = 0;
    for (name, t) in targets {
        let values = checkpoint.tensor(&name).ok_or_else(|| {
            SyncError::Checkpoint(format!(
                "the checkpoint has no tensor {name}: it was written for another model or optimizer"
            ))
        })?;
        if values.len() != t.numel() {
            return Err(SyncError::Checkpoint(format!(
                "tensor {name} has {} values in the checkpoint, {} in the model",
                values.len(),
                t.numel()
            )));
        }
        let source = Tensor::f_from_slice(values)?
            .f_reshape(t.size())?
            .f_to_kind(t.kind())?
            .f_to_device(t.device())?;
        t.shallow_clone().f_copy_(&source)?;
        count += 1;
    }
    if count != checkpoint.tensors().len() {
        return Err(SyncError::Checkpoint(format!(
            "the checkpoint has {} tensors, the model and optimizer {count}",
            checkpoint.tensors().len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn save_prune_latest_restore() {
        let dir = tempfile::tempdir().unwrap();
        let opts = (Kind::Float, Device::Cpu);
        let params = vec![("w".to_string(), Tensor::zeros([2, 2], opts))];
        let state = vec![("w/momentum".to_string(), Tensor::zeros([2, 2], opts))];
        assert!(latest(dir.path()).unwrap().is_none());
        for step in 1..=5u64 {
            let _ = params[0].1.shallow_clone().fill_(step as f64);
            let _ = state[0].1.shallow_clone().fill_(-(step as f64));
            save(dir.path(), step, 2, &params, &state).unwrap();
        }
        assert_eq!(listed(dir.path()).unwrap().len(), KEEP);
        let (meta, model) = latest(dir.path()).unwrap().unwrap();
        assert_eq!((meta.step, meta.world_size), (5, 2));
        let fresh_p = vec![("w".to_string(), Tensor::zeros([2, 2], opts))];
        let fresh_s = vec![("w/momentum".to_string(), Tensor::zeros([2, 2], opts))];
        restore(&model, &fresh_p, &fresh_s).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&fresh_p[0].1.flatten(0, -1)).unwrap(),
            vec![5.0; 4]
        );
        assert_eq!(
            Vec::<f32>::try_from(&fresh_s[0].1.flatten(0, -1)).unwrap(),
            vec![-5.0; 4]
        );

        // A half-written newest checkpoint (no JSON yet) is not seen; a corrupt one is refused.
        fs::write(dir.path().join("step-0000000006.safetensors"), b"partial").unwrap();
        assert_eq!(latest(dir.path()).unwrap().unwrap().0.step, 5);
        fs::write(dir.path().join("step-0000000005.safetensors"), b"garbage").unwrap();
        let err = latest(dir.path()).unwrap_err().to_string();
        assert!(err.contains("corrupt"), "{err}");

        let wrong = vec![("v".to_string(), Tensor::zeros([2, 2], opts))];
        let (_, model) = {
            save(dir.path(), 7, 1, &params, &state).unwrap();
            latest(dir.path()).unwrap().unwrap()
        };
        assert!(restore(&model, &wrong, &state)
            .unwrap_err()
            .to_string()
            .contains("no tensor param/v"));
    }
}
