//! `Client`: the Rust client SDK with a Python callable as its trainer.
//!
//! `run` hands the whole round to `hora_client::Client::run` (poll, join, download, train,
//! `local − global`, record on disk, seal, upload with retries, resume after a restart); only
//! the training step crosses into Python, with the GIL taken for just that call.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hora_client::trainer::{EvaluateRequest, Evaluation, TrainOutcome, TrainRequest, Trainer};
use hora_client::{ClientConfig, ClientError, RoundOutcome, RoundReport};
use hora_common::model::Model;
use hora_common::wire::Metrics;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{dict_to_model, model_to_dict};
use crate::{block_on, client_error};

/// A federated client: enrolled once (credentials kept in `state_dir`), then `run` per task.
#[pyclass(module = "hora._hora", frozen)]
pub(crate) struct Client {
    inner: Arc<hora_client::Client>,
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (server, ca, state_dir, token=None, label=None, poll_wait_secs=30.0, cert=None, key=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        server: String,
        ca: PathBuf,
        state_dir: PathBuf,
        token: Option<String>,
        label: Option<String>,
        poll_wait_secs: f64,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> PyResult<Self> {
        let mut config = ClientConfig::new(server, ca, state_dir);
        config.label = label;
        config.identity = crate::identity(cert, key)?;
        config.poll_wait = crate::seconds("poll_wait_secs", poll_wait_secs, 0.0, 300.0)?;
        let connected = block_on(py, async move {
            hora_client::Client::connect(config, token.as_deref()).await
        })?;
        let client = connected.map_err(|e| client_error(py, e))?;
        Ok(Client {
            inner: Arc::new(client),
        })
    }

    /// The id the server knows this client by.
    #[getter]
    fn id(&self) -> &str {
        self.inner.id()
    }

    /// run(task, train_fn, rounds=None, on_round=None, evaluate_fn=None) -> dict
    /// --
    ///
    /// Takes part in `task` until it ends (or `rounds` rounds). See `hora.Client.run`.
    #[pyo3(signature = (task, train_fn, rounds=None, on_round=None, evaluate_fn=None))]
    fn run(
        &self,
        py: Python<'_>,
        task: String,
        train_fn: Py<PyAny>,
        rounds: Option<u64>,
        on_round: Option<Py<PyAny>>,
        evaluate_fn: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let client = self.inner.clone();
        let failure: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let mut trainer = PyTrainer {
            train_fn,
            evaluate_fn,
            failure: failure.clone(),
        };
        let callback_failure = failure.clone();
        let run = block_on(py, async move {
            let mut on_report = |report: &RoundReport| {
                let Some(callback) = &on_round else { return };
                Python::attach(|py| {
                    let result =
                        report_dict(py, report).and_then(|d| callback.call1(py, (d,)).map(drop));
                    if let Err(e) = result {
                        e.print(py);
                        callback_failure.lock().unwrap().get_or_insert(e);
                    }
                });
            };
            client
                .run(&task, &mut trainer, rounds, &mut |_| {}, &mut on_report)
                .await
        })?;
        // An exception raised by the training function (or the callback) is re-raised as it is.
        if let Some(e) = failure.lock().unwrap().take() {
            return Err(e);
        }
        let summary = run.map_err(|e| client_error(py, e))?;
        let out = PyDict::new(py);
        let reports = PyList::empty(py);
        for report in &summary.rounds {
            reports.append(report_dict(py, report)?)?;
        }
        out.set_item("rounds", reports)?;
        out.set_item("final_state", json_value(py, &summary.final_state)?)?;
        Ok(out.into_any().unbind())
    }
}

/// The Python training function as a [`Trainer`].
pub(crate) struct PyTrainer {
    train_fn: Py<PyAny>,
    /// `evaluate_fn(weights, config) -> (num_examples, metrics)`, for federated evaluation.
    evaluate_fn: Option<Py<PyAny>>,
    /// The exception the function raised, to re-raise once the run has unwound.
    failure: Arc<Mutex<Option<PyErr>>>,
}

impl Trainer for PyTrainer {
    fn train(
        &mut self,
        global: &Model,
        request: TrainRequest<'_>,
    ) -> hora_client::Result<TrainOutcome> {
        // An exception from `on_round` stops the run here, before the next round is trained.
        if self.failure.lock().unwrap().is_some() {
            return Err(ClientError::Training(
                "stopping: the on_round callback raised".into(),
            ));
        }
        Python::attach(|py| {
            let outcome = self.call(py, global, &request);
            outcome.map_err(|e| {
                let error = raised("the training function", &e);
                self.failure.lock().unwrap().get_or_insert(e);
                error
            })
        })
        .map(|mut outcome| {
            // The function decides when to stop; past the deadline, it stopped late, not early.
            outcome.stopped_early = Instant::now() >= request.deadline;
            outcome
        })
    }

    fn evaluate(
        &mut self,
        model: &Model,
        request: EvaluateRequest<'_>,
    ) -> hora_client::Result<Option<Evaluation>> {
        let Some(evaluate_fn) = &self.evaluate_fn else {
            return Ok(None);
        };
        // (An exception is the evaluation's failure, which the client logs and goes on from:
        // it is not kept to stop the run.)
        Python::attach(|py| {
            let weights = model_to_dict(py, model)?;
            let config = PyDict::new(py);
            config.set_item("task", request.task)?;
            config.set_item("round", request.round)?;
            config.set_item("model", json_value(py, request.model_kind)?)?;
            let result = evaluate_fn.call1(py, (weights, config))?;
            let (num_examples, metrics): (u64, Option<Bound<'_, PyAny>>) =
                result.extract(py).map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(
                        "evaluate_fn must return (num_examples: int, metrics: dict with loss and/or accuracy)",
                    )
                })?;
            let metric = |key: &str| -> PyResult<f64> {
                match metrics.as_ref().map(|m| m.get_item(key)) {
                    Some(Ok(v)) if !v.is_none() => v.extract(),
                    _ => Ok(f64::NAN),
                }
            };
            Ok(Some(Evaluation {
                loss: metric("loss")?,
                accuracy: metric("accuracy")?,
                examples: num_examples,
            }))
        })
        .map_err(|e: PyErr| raised("the evaluation function", &e))
    }
}

impl PyTrainer {
    /// A trainer of its own (a simulated client's): what the functions raise is in its errors.
    pub(crate) fn new(train_fn: Py<PyAny>, evaluate_fn: Option<Py<PyAny>>) -> Self {
        PyTrainer {
            train_fn,
            evaluate_fn,
            failure: Arc::default(),
        }
    }

    fn call(
        &self,
        py: Python<'_>,
        global: &Model,
        request: &TrainRequest<'_>,
    ) -> PyResult<TrainOutcome> {
        let weights = model_to_dict(py, global)?;
        let config = json_value(py, &request.config)?;
        let config = config.bind(py).cast::<PyDict>()?.clone();
        config.set_item("task", request.task)?;
        config.set_item("round", request.round)?;
        config.set_item("model", json_value(py, request.model_kind)?)?;
        let left = request.deadline.saturating_duration_since(Instant::now());
        config.set_item("seconds_left", left.as_secs_f64())?;
        if let Some(trainable) = request.trainable {
            config.set_item("trainable", trainable.to_vec())?;
        }
        let result = self.train_fn.call1(py, (weights, config))?;
        let result = result.bind(py);
        let tuple = result.cast::<PyTuple>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "train_fn must return (weights: dict[str, ndarray], num_examples: int, metrics: dict | None)",
            )
        })?;
        if tuple.len() != 3 {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "train_fn returned {} values; it must return (weights, num_examples, metrics)",
                tuple.len()
            )));
        }
        let weights = tuple.get_item(0)?;
        let weights = weights.cast::<PyDict>().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err("train_fn's weights must be a dict of arrays")
        })?;
        let model = dict_to_model(weights)?;
        let num_examples: u64 = tuple.get_item(1)?.extract().map_err(|_| {
            pyo3::exceptions::PyTypeError::new_err(
                "train_fn's num_examples must be a non-negative int",
            )
        })?;
        let metrics = tuple.get_item(2)?;
        let metric = |key: &str| -> PyResult<Option<f64>> {
            if metrics.is_none() {
                return Ok(None);
            }
            match metrics.get_item(key) {
                Ok(v) if v.is_none() => Ok(None),
                Ok(v) => Ok(Some(v.extract()?)),
                Err(_) => Ok(None),
            }
        };
        Ok(TrainOutcome {
            weights: model,
            num_examples,
            metrics: Metrics {
                loss: metric("loss")?,
                accuracy: metric("accuracy")?,
            },
            stopped_early: false,
        })
    }
}

/// What a Python call made while `doing` something raised, as a training error.
pub(crate) fn raised(doing: &str, e: &PyErr) -> ClientError {
    let message = Python::attach(|py| {
        e.value(py)
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "an exception".into())
    });
    ClientError::Training(format!("{doing} raised {message}"))
}

/// A serde value as the Python object `json.loads` would make of it.
pub(crate) fn json_value(py: Python<'_>, value: &impl serde::Serialize) -> PyResult<Py<PyAny>> {
    let text = serde_json::to_string(value)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

/// A round's report as a dict (`round`, `outcome`, `accepted`, `reason`, `num_examples`,
/// `metrics`, `train_secs`, `timings`).
fn report_dict<'py>(py: Python<'py>, report: &RoundReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("round", report.round)?;
    d.set_item("attempt", report.attempt)?;
    let (accepted, reason) = match &report.outcome {
        RoundOutcome::Uploaded { accepted } | RoundOutcome::Resumed { accepted } => {
            (*accepted, None)
        }
        RoundOutcome::Skipped => (None, None),
        RoundOutcome::Missed { reason }
        | RoundOutcome::NotSelected { reason }
        | RoundOutcome::Abandoned { reason } => (None, Some(reason.clone())),
    };
    d.set_item("outcome", report.outcome.name())?;
    d.set_item("accepted", accepted)?;
    d.set_item("reason", reason)?;
    d.set_item("num_examples", report.num_examples)?;
    d.set_item("metrics", json_value(py, &report.metrics)?)?;
    d.set_item("train_secs", report.train_time.as_secs_f64())?;
    let timings = PyDict::new(py);
    for (name, time) in report.timings.phases() {
        timings.set_item(name, time.as_secs_f64())?;
    }
    d.set_item("timings", timings)?;
    Ok(d)
}
