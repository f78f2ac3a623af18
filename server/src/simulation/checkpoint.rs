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

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::history::Row;
use super::{Simulation, SimulationError};
use crate::store::{link_tree, MemoryStore, RoundLog};

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
    live: &Path,
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
    let store = MemoryStore::load(&current.join("store"), live)?;
    // The round left open runs on with the engine's whole deadline from now, not from when it
    // opened before the interruption (the simulated clock, not the engine's, ends rounds).
    let task = expected["task"]["id"].as_str().unwrap_or_default();
    if let Some(mut open) = store.open_round(task)? {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        open.deadline_unix_ms = now + open.deadline_unix_ms.saturating_sub(open.opened_unix_ms);
        open.opened_unix_ms = now;
        store.put_open_round(task, &open)?;
    }
    Ok(Some((store, saved)))
}

/// The clients' state of `dir`'s checkpoint, linked into `clients` (the run's state folder).
pub fn restore_clients(dir: &Path, clients: &Path) -> Result<(), SimulationError> {
    Ok(link_tree(&dir.join("checkpoint").join("clients"), clients)?)
}

/// What marks a folder as a simulation's checkpoint folder.
const MARK: &str = "hora-simulation-checkpoint";

/// Makes `dir` a checkpoint folder, unless it holds something else: a simulation removes and
/// replaces what is in it, so it takes only a new or empty folder, or one of its own.
pub fn claim(dir: &Path) -> Result<(), SimulationError> {
    let mark = dir.join(MARK);
    if mark.exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    if std::fs::read_dir(dir).map_err(io(dir))?.next().is_some() {
        return Err(setup(format!(
            "{} holds files that are not a simulation's checkpoint: give a new or empty folder to keep checkpoints in",
            dir.display()
        )));
    }
    std::fs::write(
        &mark,
        "a Hora simulation's checkpoints; hora-server simulate --checkpoint\n",
    )
    .map_err(io(&mark))
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
    link_tree(clients, &next.join("clients"))?;
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
