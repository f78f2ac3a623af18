//! Checkpoints of a long simulation (`--checkpoint DIR`), and resuming from one.
//!
//! After every synchronous round the driver writes, into `DIR/next`, everything the rest of the
//! run depends on: the engine's store as it is ([`MemoryStore::save`]: the task, its history,
//! the published model and the strategy's state), every client's state (its error-feedback
//! residual, hard-linked: a worker replaces the file, never changes it) and the driver's own
//! (the simulated clock, the rows so far). Then `DIR/next` becomes `DIR/checkpoint` by rename,
//! the previous one going only after, so a run killed at any moment leaves one whole
//! checkpoint. Between rounds nothing trains and the clock, sampling, devices and rounding all
//! derive from the seed, the round and the client, so a run resumed from round N's checkpoint
//! goes on exactly as it would have: the same model, bit for bit.
//!
//! A checkpoint belongs to one simulation: resuming with another task, federation, data, seed
//! or profile is refused.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::history::Row;
use super::{Simulation, SimulationError};
use crate::store::MemoryStore;

/// The driver's state at a round's end.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Saved {
    /// What the simulation was (see [`fingerprint`]).
    pub fingerprint: serde_json::Value,
    pub clock_s: f64,
    /// Wall-clock seconds the run had taken.
    pub wall_s: f64,
    pub rows: Vec<Row>,
    pub updates: u64,
    pub failing: u64,
}

/// What must not change between a checkpoint and its resumption.
pub fn fingerprint(sim: &Simulation) -> serde_json::Value {
    serde_json::json!({
        "task": sim.task,
        "initial": sim.initial.as_ref().map(|m| m.digest().to_string()),
        "clients": sim.clients,
        "data": sim.data,
        "partition": sim.partition,
        "seed": sim.seed,
        "profile": format!("{:?}", sim.profile),
        "evaluate_clients": sim.evaluate_clients,
    })
}

fn setup(what: String) -> SimulationError {
    SimulationError::Setup(what)
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> SimulationError + '_ {
    move |e| setup(format!("checkpoint {}: {e}", path.display()))
}

/// The checkpoint in `dir`, if it holds one, of the simulation whose [`fingerprint`] is
/// `expected`: the engine's store and the driver's state. A checkpoint half-replaced when a run
/// died is completed first.
pub fn find(
    dir: &Path,
    expected: &serde_json::Value,
) -> Result<Option<(MemoryStore, Saved)>, SimulationError> {
    let (current, previous, next) = (
        dir.join("checkpoint"),
        dir.join("previous"),
        dir.join("next"),
    );
    if !current.exists() && previous.exists() {
        std::fs::rename(&previous, &current).map_err(io(&previous))?;
    }
    for leftover in [&next, &previous] {
        if leftover.exists() {
            std::fs::remove_dir_all(leftover).map_err(io(leftover))?;
        }
    }
    let path = current.join("driver.json");
    if !path.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    let saved: Saved = serde_json::from_slice(&bytes).map_err(|e| {
        setup(format!(
            "{} is not a simulation's checkpoint: {e}",
            path.display()
        ))
    })?;
    if saved.fingerprint != *expected {
        return Err(setup(format!(
            "{} is the checkpoint of another simulation (its task, clients, data, seed or profile differ): resume with the same arguments, or give another --checkpoint folder",
            dir.display()
        )));
    }
    let store = MemoryStore::load(&current.join("store"))?;
    Ok(Some((store, saved)))
}

/// The clients' state of `dir`'s checkpoint, linked into `clients` (the run's state folder).
pub fn restore_clients(dir: &Path, clients: &Path) -> Result<(), SimulationError> {
    link_files(&dir.join("checkpoint").join("clients"), clients)
}

/// Writes the checkpoint of this moment into `dir`, replacing the last.
pub fn write(
    dir: &Path,
    store: &MemoryStore,
    clients: &Path,
    saved: &Saved,
) -> Result<(), SimulationError> {
    let (current, previous, next) = (
        dir.join("checkpoint"),
        dir.join("previous"),
        dir.join("next"),
    );
    if next.exists() {
        std::fs::remove_dir_all(&next).map_err(io(&next))?;
    }
    std::fs::create_dir_all(&next).map_err(io(&next))?;
    store.save(&next.join("store"))?;
    link_files(clients, &next.join("clients"))?;
    let json = serde_json::to_vec(saved).map_err(|e| setup(format!("checkpoint: {e}")))?;
    let path = next.join("driver.json");
    std::fs::write(&path, json).map_err(io(&path))?;
    if current.exists() {
        std::fs::rename(&current, &previous).map_err(io(&current))?;
    }
    std::fs::rename(&next, &current).map_err(io(&next))?;
    if previous.exists() {
        std::fs::remove_dir_all(&previous).map_err(io(&previous))?;
    }
    Ok(())
}

/// Every file of `from` hard-linked (else copied) into `to`.
fn link_files(from: &Path, to: &Path) -> Result<(), SimulationError> {
    std::fs::create_dir_all(to).map_err(io(to))?;
    if !from.exists() {
        return Ok(());
    }
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let (source, target): (PathBuf, PathBuf) = (entry.path(), to.join(entry.file_name()));
        if !entry.file_type().map_err(io(&source))?.is_file() {
            continue;
        }
        if target.exists() {
            std::fs::remove_file(&target).map_err(io(&target))?;
        }
        if std::fs::hard_link(&source, &target).is_err() {
            std::fs::copy(&source, &target).map_err(io(&target))?;
        }
    }
    Ok(())
}
