//! `hora._hora`: the native half of the Python package `hora`.
//!
//! The Python package is a thin layer over the Rust client, not a reimplementation: enrolment,
//! polling, sealing (X25519, HKDF, AES-256-GCM), uploads with retries, the round on disk and its
//! resumption after a crash, secure aggregation and asynchronous tasks all run here, in
//! `hora-client` built without libtorch. Python brings its own `torch`; weights cross the
//! boundary as NumPy `float32` arrays, one copy each way (the Rust model is one flat buffer).
//!
//! - [`client`]: `Client` — a federated client whose training step is a Python callable;
//! - [`admin`]: `AdminConnection` — the admin API over the same TLS transport;
//! - [`ring`]: `Ring` and `PendingRing` — the sync ring's collectives over NumPy buffers;
//! - [`simulation`]: `simulate` and `simulate_worker` — a simulated federation on
//!   `hora-server`'s round engine, its clients trained by Python;
//! - here: the exceptions, model and dataset conversions, the runtime.
//!
//! Long calls release the GIL and check for Ctrl-C every tenth of a second.

mod admin;
mod client;
mod convert;
mod ring;
mod simulation;

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use hora_client::ClientError;
use hora_collective::CollectiveError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _hora,
    HoraError,
    PyException,
    "Anything Hora could not do; the message says what to do about it."
);
create_exception!(
    _hora,
    Refused,
    HoraError,
    "The server refused a request (4xx). `code` is the server's error code (`round_closed`, `unauthorized`, …)."
);
create_exception!(
    _hora,
    Unavailable,
    HoraError,
    "The server could not be reached (or kept failing) for the whole retry budget."
);
create_exception!(
    _hora,
    TaskEnded,
    HoraError,
    "The task was stopped or has finished."
);
create_exception!(
    _hora,
    SyncFailed,
    HoraError,
    "A collective failed. `rank` names the worker that died, stalled or disagreed (None when unknown); `survivable` says whether it was a lost or stalled worker, which an elastic job survives."
);

/// The runtime every network call of the module runs on.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hora")
            .enable_all()
            .build()
            .expect("starting the Tokio runtime")
    })
}

/// Runs `future` on the runtime with the GIL released, checking for signals (Ctrl-C) every
/// 100 ms; a signal cancels the future and raises its exception.
fn block_on<T: Send + 'static>(
    py: Python<'_>,
    future: impl Future<Output = T> + Send + 'static,
) -> PyResult<T> {
    let mut handle = runtime().spawn(future);
    loop {
        let done = py.detach(|| {
            runtime().block_on(async {
                tokio::time::timeout(Duration::from_millis(100), &mut handle).await
            })
        });
        match done {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => {
                return Err(HoraError::new_err(format!(
                    "internal error (please report it): {e}"
                )))
            }
            Err(_) => {
                if let Err(e) = py.check_signals() {
                    handle.abort();
                    return Err(e);
                }
            }
        }
    }
}

/// `secs` seconds as a duration within `[min, max]`, or `ValueError` when it is not a number
/// (NaN, ±inf): never a panic from Rust's duration conversion.
fn seconds(name: &str, secs: f64, min: f64, max: f64) -> PyResult<Duration> {
    if !secs.is_finite() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name} must be a finite number of seconds, not {secs}"
        )));
    }
    Ok(Duration::from_secs_f64(secs.clamp(min, max)))
}

/// A client error as the matching Python exception.
fn client_error(py: Python<'_>, e: ClientError) -> PyErr {
    let message = e.to_string();
    match &e {
        ClientError::Unavailable { .. } | ClientError::Failing { .. } => {
            Unavailable::new_err(message)
        }
        ClientError::TaskEnded { .. } => TaskEnded::new_err(message),
        _ => match e.code() {
            Some(code) => {
                let err = Refused::new_err(message);
                let _ = err.value(py).setattr("code", code.to_string());
                err
            }
            None => HoraError::new_err(message),
        },
    }
}

/// A client certificate and its key for mutual TLS: both or neither.
fn identity(
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
) -> PyResult<Option<hora_common::tls::Identity>> {
    match (cert, key) {
        (Some(cert), Some(key)) => Ok(Some(hora_common::tls::Identity { cert, key })),
        (None, None) => Ok(None),
        _ => Err(pyo3::exceptions::PyValueError::new_err(
            "mutual TLS needs both cert= and key= (the client certificate and its private key)",
        )),
    }
}

/// A sync error as `SyncFailed`, with the failed rank when one is known.
fn sync_error(py: Python<'_>, e: CollectiveError) -> PyErr {
    let rank = match &e {
        CollectiveError::PeerFailed { rank, .. } => Some(*rank),
        _ => None,
    };
    let err = SyncFailed::new_err(e.to_string());
    let _ = err.value(py).setattr("rank", rank);
    // A lost or stalled worker, which an elastic job survives.
    let _ = err.value(py).setattr("survivable", e.survivable());
    // An elastic job whose training finished before this worker joined.
    let _ = err
        .value(py)
        .setattr("finished", matches!(e, CollectiveError::JobFinished(_)));
    err
}

/// Logs of the Rust core go to stderr, filtered by `HORA_LOG` (default `info`; a simulated
/// federation's engine says only its errors, and the simulation its warnings: its rounds are
/// the history, not log lines), as text or, with `HORA_LOG_FORMAT=json`, JSON.
fn init_logging() {
    use hora_common::logging::{init, LogFormat};
    init(
        LogFormat::from_env(),
        "info,hora_server=error,hora_server::simulation=warn",
    );
}

#[pymodule]
fn _hora(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    let py = m.py();
    m.add("HoraError", py.get_type::<HoraError>())?;
    m.add("Refused", py.get_type::<Refused>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("TaskEnded", py.get_type::<TaskEnded>())?;
    m.add("SyncFailed", py.get_type::<SyncFailed>())?;
    m.add_class::<client::Client>()?;
    m.add_class::<admin::AdminConnection>()?;
    m.add_class::<ring::Ring>()?;
    m.add_class::<ring::PendingRing>()?;
    m.add_class::<simulation::Plan>()?;
    m.add_function(wrap_pyfunction!(ring::launch_rank, m)?)?;
    m.add_function(wrap_pyfunction!(ring::torchrun_peers, m)?)?;
    m.add_function(wrap_pyfunction!(ring::sync_job_status, m)?)?;
    m.add_function(wrap_pyfunction!(ring::nccl_probe, m)?)?;
    m.add_function(wrap_pyfunction!(ring::sync_job_finish, m)?)?;
    m.add_function(wrap_pyfunction!(simulation::simulate, m)?)?;
    m.add_function(wrap_pyfunction!(simulation::simulate_worker, m)?)?;
    m.add_function(wrap_pyfunction!(simulation::claim_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(simulation::partition, m)?)?;
    m.add_function(wrap_pyfunction!(convert::encode_model, m)?)?;
    m.add_function(wrap_pyfunction!(convert::decode_model, m)?)?;
    m.add_function(wrap_pyfunction!(convert::load_dataset, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
