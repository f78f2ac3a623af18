//! `AdminConnection`: the admin API over the client's TLS transport (same CA handling, same
//! retries of transient failures, same error types). `hora.Admin` in Python gives it its verbs.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use hora_client::transport::{check, Connection, RetryPolicy};
use hora_client::ClientError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use reqwest::Method;

use crate::{block_on, client_error};

#[pyclass(module = "hora._hora", frozen)]
pub(crate) struct AdminConnection {
    conn: Connection,
}

fn method(name: &str) -> PyResult<Method> {
    match name {
        "GET" => Ok(Method::GET),
        "POST" => Ok(Method::POST),
        "DELETE" => Ok(Method::DELETE),
        other => Err(PyValueError::new_err(format!("unsupported method {other}"))),
    }
}

/// How much of an upload's body goes at once: one buffer of gigabytes stalls an HTTP/2 stream.
const SLICE: usize = 8 << 20;

/// `bytes` as a body sent a slice at a time, with its length (what every retry sends anew;
/// the slices share `bytes`).
fn sliced(bytes: &Bytes) -> reqwest::Body {
    let slices: Vec<Result<Bytes, std::io::Error>> = (0..bytes.len())
        .step_by(SLICE)
        .map(|at| Ok(bytes.slice(at..(at + SLICE).min(bytes.len()))))
        .collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(slices))
}

/// The body of a 2xx answer, or the refusal as an error.
async fn answer(
    conn: Connection,
    method: Method,
    path: String,
    body: Option<(Bytes, &'static str)>,
) -> Result<Vec<u8>, ClientError> {
    let what = format!("{method} {path}");
    let (resp, _) = conn
        .send(&what, || {
            let req = conn.request(method.clone(), &path, Duration::ZERO);
            match &body {
                Some((bytes, kind)) => req
                    .header(reqwest::header::CONTENT_TYPE, *kind)
                    .header(reqwest::header::CONTENT_LENGTH, bytes.len())
                    .body(sliced(bytes)),
                None => req,
            }
        })
        .await?;
    let resp = check(resp).await?;
    resp.bytes()
        .await
        .map(|b| b.to_vec())
        .map_err(|e| ClientError::Protocol(format!("{what}: reading the answer: {e}")))
}

#[pymethods]
impl AdminConnection {
    #[new]
    #[pyo3(signature = (url, ca, token, cert=None, key=None))]
    fn new(
        url: &str,
        ca: PathBuf,
        token: String,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
    ) -> PyResult<Self> {
        let identity = crate::identity(cert, key)?;
        let conn = Connection::new(url, &ca, identity.as_ref(), RetryPolicy::default())
            .map_err(|e| crate::HoraError::new_err(e.to_string()))?
            .with_token(token);
        Ok(AdminConnection { conn })
    }

    /// request(method, path, json=None) -> bytes
    /// --
    ///
    /// Sends `json` (a JSON text) to `path` and returns the answer's body.
    #[pyo3(signature = (method, path, json=None))]
    fn request<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        path: String,
        json: Option<String>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let method = self::method(method)?;
        let body = json.map(|j| (Bytes::from(j), "application/json"));
        let answer = block_on(py, answer(self.conn.clone(), method, path, body))?
            .map_err(|e| client_error(py, e))?;
        Ok(PyBytes::new(py, &answer))
    }

    /// upload(path, data) -> bytes
    /// --
    ///
    /// POSTs `data` as `application/octet-stream` (a model or a TorchScript module), a slice
    /// at a time (a model past 2 GB goes as well as a small one).
    fn upload<'py>(
        &self,
        py: Python<'py>,
        path: String,
        data: Vec<u8>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let body = Some((Bytes::from(data), "application/octet-stream"));
        let answer = block_on(py, answer(self.conn.clone(), Method::POST, path, body))?
            .map_err(|e| client_error(py, e))?;
        Ok(PyBytes::new(py, &answer))
    }
}
