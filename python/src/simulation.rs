//! `simulate` and `simulate_worker`: a simulated federation from Python (`hora.simulation`).
//!
//! The engine is `hora-server`'s, in this process: `simulate` runs
//! `hora_server::simulation::run` on the module's runtime with the GIL released, and hands each
//! round's row to a Python callback on the caller's thread (the progress bar) as it closes.
//! The virtual clients train on worker processes, each running `simulate_worker`: the worker
//! loop is `hora_client::simulate`'s (the global model, `local − global`, compression with error
//! feedback, the protocol), and only the client's data and training cross into Python, through a
//! population object the worker's Python half builds.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use hora_client::simulate::{serve, Population};
use hora_client::trainer::Trainer;
use hora_common::simulation::Setup;
use hora_server::simulation::{Profile, Row, Simulation};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::client::{json_value, raised, PyTrainer};
use crate::convert::{dict_to_model, model_to_dict};
use crate::{runtime, HoraError};

/// simulate(task, clients, worker_command, data, partition=None, seed=0, workers=1,
///          profile="uniform", evaluate_clients=0, initial=None, on_row=None,
///          checkpoint=None) -> dict
/// --
///
/// Runs a simulated federation to the end of its task (`task`: CreateTask as JSON text, its
/// deadline in simulated seconds). `on_row(row)` is called with each round's row as it closes.
/// With `checkpoint` (a folder), a checkpoint is kept there after every round and the run
/// resumes from the one it holds.
/// Returns `{"history": [row, ...], "model": {name: ndarray}, "wall_seconds", "updates"}`.
#[pyfunction]
#[pyo3(signature = (task, clients, worker_command, data, partition=None, seed=0, workers=1, profile="uniform", evaluate_clients=0, initial=None, on_row=None, checkpoint=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate(
    py: Python<'_>,
    task: &str,
    clients: u64,
    worker_command: Vec<String>,
    data: String,
    partition: Option<String>,
    seed: u64,
    workers: usize,
    profile: &str,
    evaluate_clients: u64,
    initial: Option<Bound<'_, PyDict>>,
    on_row: Option<Py<PyAny>>,
    checkpoint: Option<std::path::PathBuf>,
) -> PyResult<Py<PyDict>> {
    let value = |e: String| pyo3::exceptions::PyValueError::new_err(e);
    let task: serde_json::Value =
        serde_json::from_str(task).map_err(|e| value(format!("the task is not JSON: {e}")))?;
    let profile: Profile = profile.parse().map_err(value)?;
    let initial = initial.as_ref().map(dict_to_model).transpose()?;
    let sim = Simulation {
        task,
        initial,
        clients,
        data,
        partition,
        seed,
        workers,
        worker_command: worker_command.into_iter().map(Into::into).collect(),
        profile,
        evaluate_clients,
        checkpoint,
    };
    let (rows, mut incoming) = tokio::sync::mpsc::unbounded_channel::<Row>();
    let cancel = hora_server::simulation::CancellationToken::new();
    let stop = cancel.clone();
    let mut handle = runtime().spawn(async move {
        let mut send = |row: &Row| drop(rows.send(row.clone()));
        hora_server::simulation::run_until(&sim, &mut send, stop).await
    });
    enum Step {
        Row(Row),
        Done(Result<Result<hora_server::simulation::Outcome, String>, String>),
        Tick,
    }
    let outcome = loop {
        let step = py.detach(|| {
            runtime().block_on(async {
                tokio::select! {
                    biased;
                    Some(row) = incoming.recv() => Step::Row(row),
                    done = &mut handle => Step::Done(
                        done.map(|r| r.map_err(|e| e.to_string())).map_err(|e| e.to_string()),
                    ),
                    () = tokio::time::sleep(Duration::from_millis(100)) => Step::Tick,
                }
            })
        });
        // (Signals are checked at every step: rows may come faster than the ticks.)
        let called = match step {
            Step::Row(row) => py.check_signals().and_then(|()| match &on_row {
                Some(callback) => json_value(py, &row).and_then(|r| callback.call1(py, (r,))),
                None => Ok(py.None()),
            }),
            Step::Tick => py.check_signals().map(|()| py.None()),
            Step::Done(Ok(outcome)) => break outcome.map_err(HoraError::new_err)?,
            Step::Done(Err(e)) => {
                return Err(HoraError::new_err(format!(
                    "internal error (please report it): {e}"
                )))
            }
        };
        if let Err(e) = called {
            // Ctrl-C, or the callback raised: the run stops, its engine and workers with it.
            cancel.cancel();
            py.detach(|| drop(runtime().block_on(handle)));
            return Err(e);
        }
    };
    let out = PyDict::new(py);
    let history = PyList::empty(py);
    for row in &outcome.history {
        history.append(json_value(py, row)?)?;
    }
    out.set_item("history", history)?;
    out.set_item("model", model_to_dict(py, &outcome.model)?)?;
    out.set_item("wall_seconds", outcome.wall_seconds)?;
    out.set_item("updates", outcome.updates)?;
    Ok(out.unbind())
}

/// claim_checkpoint(dir)
/// --
///
/// Makes `dir` a simulation's checkpoint folder (as `simulate` would), or raises `HoraError`
/// when it holds other files: the Python half puts its scratch files in it first.
#[pyfunction]
pub(crate) fn claim_checkpoint(dir: std::path::PathBuf) -> PyResult<()> {
    hora_server::simulation::checkpoint::claim(&dir).map_err(|e| HoraError::new_err(e.to_string()))
}

/// simulate_worker(open, input_fd, output_fd)
/// --
///
/// Serves a simulation's engine on `input_fd` and `output_fd` (copies of them: the caller
/// keeps its own) until the engine closes its side. `open(setup)` is called with the setup
/// (a dict) and returns the population: an object with `examples(client) -> int` and
/// `trainer(client) -> (train_fn, evaluate_fn or None)`.
#[pyfunction]
pub(crate) fn simulate_worker(
    py: Python<'_>,
    open: Py<PyAny>,
    input_fd: RawFd,
    output_fd: RawFd,
) -> PyResult<()> {
    if input_fd < 0 || output_fd < 0 || input_fd == output_fd {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "simulate_worker needs two distinct open file descriptors",
        ));
    }
    // Copies of the caller's descriptors, which stay the caller's to close.
    let owned = |fd: RawFd| -> PyResult<File> {
        // SAFETY: the descriptor is only borrowed for the duplication (an fd that is not open
        // fails it with EBADF, which is an error here, not undefined behaviour).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let copy = borrowed.try_clone_to_owned().map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!("file descriptor {fd}: {e}"))
        })?;
        Ok(File::from(copy))
    };
    let (input, output) = (owned(input_fd)?, owned(output_fd)?);
    let served = py.detach(|| {
        serve(BufReader::new(input), BufWriter::new(output), |setup| {
            PyPopulation::open(open, setup)
        })
    });
    served.map_err(|e| HoraError::new_err(e.to_string()))
}

/// The Python half's population as a [`Population`].
struct PyPopulation {
    population: Py<PyAny>,
}

impl PyPopulation {
    fn open(open: Py<PyAny>, setup: &Setup) -> hora_client::Result<Self> {
        Python::attach(|py| {
            let setup = json_value(py, setup)?;
            let population = open.call1(py, (setup,))?;
            Ok(PyPopulation { population })
        })
        .map_err(|e: PyErr| raised("opening the simulation's population", &e))
    }
}

impl Population for PyPopulation {
    fn examples(&mut self, client: u64) -> hora_client::Result<u64> {
        Python::attach(|py| {
            let n = self.population.call_method1(py, "examples", (client,))?;
            n.extract::<u64>(py)
        })
        .map_err(|e| raised("counting a client's examples", &e))
    }

    fn trainer(&mut self, client: u64) -> hora_client::Result<Box<dyn Trainer>> {
        Python::attach(|py| {
            let made = self.population.call_method1(py, "trainer", (client,))?;
            let (train, evaluate): (Py<PyAny>, Option<Py<PyAny>>) = made.extract(py)?;
            Ok(Box::new(PyTrainer::new(train, evaluate)) as Box<dyn Trainer>)
        })
        .map_err(|e| raised("making a client's trainer", &e))
    }
}

/// A dataset's split among a federation's clients (`partition`): client `k`'s samples are
/// `indices(k)`.
#[pyclass(module = "hora._hora", frozen)]
pub(crate) struct Plan {
    plan: hora_client::data::partition::Plan,
    clients: usize,
}

#[pymethods]
impl Plan {
    /// indices(client) -> ndarray[int64]
    /// --
    ///
    /// Client `client`'s samples, as indices into the dataset.
    fn indices<'py>(
        &self,
        py: Python<'py>,
        client: usize,
    ) -> PyResult<Bound<'py, numpy::PyArray1<i64>>> {
        if client >= self.clients {
            return Err(pyo3::exceptions::PyIndexError::new_err(format!(
                "client {client} is not in the federation of {} clients",
                self.clients
            )));
        }
        let indices: Vec<i64> = self
            .plan
            .indices(client)
            .into_iter()
            .map(|i| i as i64)
            .collect();
        Ok(numpy::PyArray1::from_vec(py, indices))
    }

    fn __len__(&self) -> usize {
        self.clients
    }
}

/// partition(partitioner, labels, classes, clients, seed) -> Plan
/// --
///
/// The split of a dataset whose labels (int64, in `0..classes`) are `labels` among `clients`,
/// as `partitioner` says (`iid`, `dirichlet:alpha=A`, `shards:k=K`, `quantity:sigma=S`): the
/// same split `hora-server simulate --partition` makes of the same labels and seed.
#[pyfunction]
pub(crate) fn partition(
    py: Python<'_>,
    partitioner: &str,
    labels: numpy::PyReadonlyArray1<'_, i64>,
    classes: usize,
    clients: usize,
    seed: u64,
) -> PyResult<Plan> {
    use hora_client::data::partition::{Partitioner, Plan as Split};
    let value =
        |e: hora_client::data::DataError| pyo3::exceptions::PyValueError::new_err(e.to_string());
    let partitioner: Partitioner = partitioner.parse().map_err(value)?;
    let labels = labels.as_slice()?.to_vec();
    let plan = py
        .detach(move || Split::new(partitioner, &labels, classes, clients, seed))
        .map_err(value)?;
    Ok(Plan { plan, clients })
}
