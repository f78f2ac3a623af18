//! Weights and datasets between Rust and NumPy: a [`Model`] is one flat `f32` buffer of named
//! tensors; Python sees a `dict[str, numpy.ndarray]` in the model's (sorted) order.

use hora_client::data::DataSource;
use hora_common::model::{Limits, Model};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// The model's tensors as a dict of new float32 arrays of their shapes.
pub(crate) fn model_to_dict<'py>(py: Python<'py>, model: &Model) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for info in model.tensors() {
        let values = &model.data()[info.offset..info.offset + info.len];
        let array = PyArray1::from_slice(py, values).reshape(info.shape.clone())?;
        dict.set_item(&info.name, array)?;
    }
    Ok(dict)
}

/// A dict of float32 arrays (the Python side converts tensors and other dtypes first) as a
/// model. Every value is checked before any is copied.
pub(crate) fn dict_to_model(weights: &Bound<'_, PyDict>) -> PyResult<Model> {
    let mut tensors = Vec::with_capacity(weights.len());
    for (name, value) in weights.iter() {
        let name: String = name.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "weights must be keyed by parameter name (str), not {}",
                name.get_type()
            ))
        })?;
        let array: PyReadonlyArrayDyn<'_, f32> = value.extract().map_err(|_| {
            PyValueError::new_err(format!(
                "weight `{name}` must be a float32 numpy array (got {})",
                value.get_type()
            ))
        })?;
        let shape = array.shape().to_vec();
        let values = match array.as_slice() {
            Ok(slice) => slice.to_vec(),
            Err(_) => array.as_array().iter().copied().collect(),
        };
        tensors.push((name, shape, values));
    }
    Model::from_tensors(tensors).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// encode_model(weights: dict[str, numpy.ndarray]) -> bytes
/// --
///
/// The weights as a safetensors file (float32), the format the server takes.
#[pyfunction]
pub(crate) fn encode_model<'py>(
    py: Python<'py>,
    weights: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyBytes>> {
    let model = dict_to_model(weights)?;
    model
        .check_finite()
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let bytes = py.detach(|| model.to_safetensors());
    Ok(PyBytes::new(py, &bytes))
}

/// decode_model(data: bytes) -> dict[str, numpy.ndarray]
/// --
///
/// A safetensors file (f32, f16 or bf16) as float32 arrays by name.
#[pyfunction]
pub(crate) fn decode_model<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let model = Model::from_safetensors(data, &Limits::default())
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    model_to_dict(py, &model)
}

/// One split of a dataset: features shaped `(n, *sample_shape)` and int64 labels.
type Split<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

/// load_dataset(spec, client_index=None, holdout=0.0)
/// --
///
/// Loads a dataset as the Rust client would (`FILE.csv[?label=COLUMN]`, `mnist:DIR`,
/// `synthetic:alpha=1,beta=1,clients=10,seed=0`, `synthetic-iid:clients=10`): the same bytes, so
/// Python and Rust clients can be compared on the same data. Returns
/// `(train, test, num_classes)` where each split is `(features, labels)` and `test` may be None.
#[pyfunction]
#[pyo3(signature = (spec, client_index=None, holdout=0.0))]
pub(crate) fn load_dataset<'py>(
    py: Python<'py>,
    spec: &str,
    client_index: Option<usize>,
    holdout: f64,
) -> PyResult<(Split<'py>, Option<Split<'py>>, usize)> {
    let source: DataSource = spec
        .parse()
        .map_err(|e: hora_client::data::DataError| PyValueError::new_err(e.to_string()))?;
    let (train, test) = py
        .detach(|| source.load(client_index, holdout))
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
    let classes = train.num_classes;
    let split = |d: hora_client::data::Dataset| -> PyResult<Split<'py>> {
        let mut shape = vec![d.len()];
        shape.extend(&d.sample_shape);
        let x = PyArray1::from_vec(py, d.features).reshape(shape)?;
        let y = PyArray1::from_vec(py, d.labels);
        Ok((x.into_any(), y.into_any()))
    };
    let test = test.map(split).transpose()?;
    Ok((split(train)?, test, classes))
}
