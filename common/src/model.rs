//! The model format: named tensors held as one flat `f32` buffer, read from and written to
//! safetensors, identified by a SHA-256 digest and validated against a [`ModelSpec`].
//!
//! Why one flat buffer: every consumer of a model in Hora works on all of its parameters at once.
//! The averaging kernel folds an update into a running sum element by element, the envelope seals
//! the bytes of a whole delta, and the allreduce ring fuses tensors into large buffers anyway. With
//! the tensors laid end to end (sorted by name, so one spec always gives one layout) each of those
//! is a single pass over a slice, and two models with the same spec line up element for element.
//!
//! Input from outside (an upload, a file an operator names) is untrusted. [`Model::from_safetensors`]
//! checks every size against [`Limits`] *before* it allocates: the header length, the tensor count,
//! each tensor's rank and element count, and the total, all with checked arithmetic.
//!
//! Storage dtypes: f32 is read as is; f16 and bf16 are widened to f32 on load. Models are written
//! as f32. The dtype a tensor had on the wire is kept in [`TensorInfo::dtype`] so a spec can insist
//! on it.

use std::fmt;
use std::path::Path;

use ring::digest;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use thiserror::Error;

#[cfg(not(target_endian = "little"))]
compile_error!(
    "hora-common assumes a little-endian target (safetensors stores little-endian data)"
);

/// The storage type of a tensor on the wire. In memory every tensor is f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Bytes per element on the wire.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    fn from_safetensors(dtype: StDtype) -> Option<Self> {
        match dtype {
            StDtype::F32 => Some(DType::F32),
            StDtype::F16 => Some(DType::F16),
            StDtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// Name, shape and wire dtype of one tensor: what a task promises its models look like.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorSpec {
    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The tensors of a model, sorted by name with unique names. Two models with equal specs have
/// the same flat layout.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Vec<TensorSpec>", into = "Vec<TensorSpec>")]
pub struct ModelSpec {
    tensors: Vec<TensorSpec>,
}

impl ModelSpec {
    /// Builds a spec, sorting by name. Fails on duplicate names or an element count that
    /// overflows `usize`.
    pub fn new(mut tensors: Vec<TensorSpec>) -> Result<Self, ModelError> {
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        for pair in tensors.windows(2) {
            if pair[0].name == pair[1].name {
                return Err(ModelError::DuplicateTensor(pair[0].name.clone()));
            }
        }
        let mut total = 0usize;
        for t in &tensors {
            let n = checked_numel(&t.shape).ok_or_else(|| ModelError::TooLarge {
                what: format!("tensor `{}`", t.name),
                limit: usize::MAX as u64,
            })?;
            total = total.checked_add(n).ok_or_else(|| ModelError::TooLarge {
                what: "model".into(),
                limit: usize::MAX as u64,
            })?;
        }
        Ok(ModelSpec { tensors })
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Total number of parameters.
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(TensorSpec::numel).sum()
    }

    /// Bytes the tensor data takes on the wire in the spec's dtypes.
    pub fn wire_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .map(|t| t.numel() as u64 * t.dtype.size() as u64)
            .sum()
    }

    /// Checks that `model` has exactly this spec's tensors, shapes and dtypes.
    pub fn check(&self, model: &Model) -> Result<(), ModelError> {
        self.check_spec(&model.spec())
    }

    /// Checks that a model described by `found` has exactly this spec's tensors, shapes and
    /// dtypes, naming the first difference.
    pub fn check_spec(&self, found: &ModelSpec) -> Result<(), ModelError> {
        let mut theirs = found.tensors.iter().peekable();
        for ours in &self.tensors {
            // Both lists are sorted by name: walk them together.
            if let Some(t) = theirs.peek().filter(|t| t.name < ours.name) {
                return Err(ModelError::UnexpectedTensor(t.name.clone()));
            }
            match theirs.next_if(|t| t.name == ours.name) {
                None => return Err(ModelError::MissingTensor(ours.name.clone())),
                Some(t) if t.shape != ours.shape => {
                    return Err(ModelError::ShapeMismatch {
                        tensor: ours.name.clone(),
                        expected: ours.shape.clone(),
                        found: t.shape.clone(),
                    })
                }
                Some(t) if t.dtype != ours.dtype => {
                    return Err(ModelError::DTypeMismatch {
                        tensor: ours.name.clone(),
                        expected: ours.dtype,
                        found: t.dtype,
                    })
                }
                Some(_) => {}
            }
        }
        match theirs.next() {
            Some(extra) => Err(ModelError::UnexpectedTensor(extra.name.clone())),
            None => Ok(()),
        }
    }

    /// Limits that admit this spec's models and nothing much larger: what a server applies to
    /// uploads for a task.
    pub fn limits(&self) -> Limits {
        let header_allowance = 4096 + 256 * self.tensors.len() as u64;
        Limits {
            max_bytes: 8 + header_allowance + self.wire_bytes(),
            max_header_bytes: header_allowance,
            max_tensors: self.tensors.len(),
            max_elements: self.numel() as u64,
            max_rank: self
                .tensors
                .iter()
                .map(|t| t.shape.len())
                .max()
                .unwrap_or(0),
        }
    }
}

impl utoipa::PartialSchema for ModelSpec {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(<TensorSpec as utoipa::PartialSchema>::schema())
            .description(Some("The model's tensors, sorted by name, names unique"))
            .into()
    }
}

impl utoipa::ToSchema for ModelSpec {
    // The items are TensorSpec's inline schema, which refers to DType: register it.
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        schemas.push((
            <DType as utoipa::ToSchema>::name().into(),
            <DType as utoipa::PartialSchema>::schema(),
        ));
        <TensorSpec as utoipa::ToSchema>::schemas(schemas);
    }
}

impl TryFrom<Vec<TensorSpec>> for ModelSpec {
    type Error = ModelError;
    fn try_from(tensors: Vec<TensorSpec>) -> Result<Self, ModelError> {
        ModelSpec::new(tensors)
    }
}

impl From<ModelSpec> for Vec<TensorSpec> {
    fn from(spec: ModelSpec) -> Self {
        spec.tensors
    }
}

/// Size limits applied to a model read from outside, all checked before allocating.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Whole safetensors file or body, header included.
    pub max_bytes: u64,
    /// The JSON header.
    pub max_header_bytes: u64,
    pub max_tensors: usize,
    /// Total elements over all tensors.
    pub max_elements: u64,
    pub max_rank: usize,
}

impl Default for Limits {
    /// Generous limits for models an operator supplies: 8 GiB, a million tensors, 2^31 elements.
    fn default() -> Self {
        Limits {
            max_bytes: 8 << 30,
            max_header_bytes: 64 << 20,
            max_tensors: 1 << 20,
            max_elements: 1 << 31,
            max_rank: 8,
        }
    }
}

/// Where one tensor sits in a [`Model`]'s flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    /// The dtype the tensor had where it was read from (f32 for models built in memory).
    pub dtype: DType,
    pub offset: usize,
    pub len: usize,
}

/// Named f32 tensors laid end to end in one buffer, sorted by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    tensors: Vec<TensorInfo>,
    data: Vec<f32>,
}

impl Model {
    /// A model of zeros with `spec`'s layout.
    pub fn zeros(spec: &ModelSpec) -> Self {
        Model {
            tensors: spec_layout(spec),
            data: vec![0.0; spec.numel()],
        }
    }

    /// Builds a model from `(name, shape, values)` triples (stored as f32).
    pub fn from_tensors<I, S>(tensors: I) -> Result<Self, ModelError>
    where
        I: IntoIterator<Item = (S, Vec<usize>, Vec<f32>)>,
        S: Into<String>,
    {
        let mut items: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
            .into_iter()
            .map(|(n, s, v)| (n.into(), s, v))
            .collect();
        items.sort_by(|a, b| a.0.cmp(&b.0));
        let spec = ModelSpec::new(
            items
                .iter()
                .map(|(name, shape, _)| TensorSpec {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: DType::F32,
                })
                .collect(),
        )?;
        for (name, shape, values) in &items {
            let expected = shape.iter().product::<usize>();
            if values.len() != expected {
                return Err(ModelError::Malformed(format!(
                    "tensor `{name}` has shape {shape:?} ({expected} elements) but {} values",
                    values.len()
                )));
            }
        }
        let mut model = Model::zeros(&spec);
        for ((_, _, values), info) in items.iter().zip(&model.tensors) {
            model.data[info.offset..info.offset + info.len].copy_from_slice(values);
        }
        Ok(model)
    }

    /// Wraps a flat buffer laid out as `spec` says.
    pub fn from_flat(spec: &ModelSpec, data: Vec<f32>) -> Result<Self, ModelError> {
        if data.len() != spec.numel() {
            return Err(ModelError::Malformed(format!(
                "flat buffer has {} values but the spec has {}",
                data.len(),
                spec.numel()
            )));
        }
        Ok(Model {
            tensors: spec_layout(spec),
            data,
        })
    }

    /// The spec this model satisfies (names, shapes and the dtypes it was read with).
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorSpec {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                })
                .collect(),
        }
    }

    /// Whether `self` and `other` have the same names and shapes (dtypes aside), so their flat
    /// buffers line up element for element.
    pub fn same_layout(&self, spec: &ModelSpec) -> bool {
        self.tensors.len() == spec.tensors.len()
            && self
                .tensors
                .iter()
                .zip(&spec.tensors)
                .all(|(a, b)| a.name == b.name && a.shape == b.shape)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The values of tensor `name`, if there is one.
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        let i = self
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()?;
        let t = &self.tensors[i];
        Some(&self.data[t.offset..t.offset + t.len])
    }

    /// All parameters, tensor after tensor in name order.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// Total number of parameters.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Fails on the first NaN or infinity, naming the tensor and the element.
    pub fn check_finite(&self) -> Result<(), ModelError> {
        // Cheap scan first (vectorises); locate the culprit only when there is one.
        if self.data.iter().all(|v| v.is_finite()) {
            return Ok(());
        }
        for t in &self.tensors {
            let values = &self.data[t.offset..t.offset + t.len];
            if let Some(index) = values.iter().position(|v| !v.is_finite()) {
                return Err(ModelError::NonFinite {
                    tensor: t.name.clone(),
                    index,
                    value: values[index],
                });
            }
        }
        Ok(())
    }

    /// SHA-256 over a canonical encoding of names, shapes and values: equal models have equal
    /// digests however their files were laid out.
    pub fn digest(&self) -> ModelDigest {
        canonical_digest(self.tensors.iter().map(|t| {
            (
                t.name.as_str(),
                t.shape.as_slice(),
                f32_bytes(&self.data[t.offset..t.offset + t.len]),
            )
        }))
    }

    /// Parses safetensors bytes, checking `limits` before allocating. f16/bf16 are widened.
    pub fn from_safetensors(bytes: &[u8], limits: &Limits) -> Result<Self, ModelError> {
        Ok(ModelView::parse(bytes, limits)?.to_model())
    }

    /// Reads a safetensors file, checking its size against `limits` before reading it.
    pub fn read_file(path: &Path, limits: &Limits) -> Result<Self, ModelError> {
        let io = |source| ModelError::Io {
            path: path.display().to_string(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > limits.max_bytes {
            return Err(ModelError::TooLarge {
                what: format!("model file {}", path.display()),
                limit: limits.max_bytes,
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        Model::from_safetensors(&bytes, limits).map_err(|e| e.in_file(path))
    }

    /// Serialises as safetensors (f32, little-endian).
    pub fn to_safetensors(&self) -> Vec<u8> {
        let views = self.tensors.iter().map(|t| {
            let bytes = f32_bytes(&self.data[t.offset..t.offset + t.len]);
            let view = TensorView::new(StDtype::F32, t.shape.clone(), bytes)
                .expect("layout matches data by construction");
            (t.name.as_str(), view)
        });
        safetensors::serialize(views, None).expect("serialising in-memory f32 tensors cannot fail")
    }

    /// Writes the safetensors serialisation to `path` (not atomically; the server's store does that).
    pub fn write_file(&self, path: &Path) -> Result<(), ModelError> {
        std::fs::write(path, self.to_safetensors()).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

/// Whether tensor `name` is one a pattern of a task's `trainable` list names: the name itself,
/// or a pattern whose `*`s stand for any run of characters, dots included (`*lora_*` names
/// every LoRA tensor, `encoder.layer.*.attention.*` every attention tensor of the encoder).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty(); // no `*`: the name itself
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// The first tensor of safetensors `bytes` that `frozen` has, if the header is one a model of
/// `part`'s and `frozen`'s tensors could have: what explains the refusal of an update that
/// carries a tensor of a task's frozen base (its values are not read).
pub fn frozen_tensor_in(bytes: &[u8], part: &ModelSpec, frozen: &ModelSpec) -> Option<String> {
    let tensors = part.tensors.len() + frozen.tensors.len();
    let limits = Limits {
        max_bytes: bytes.len() as u64,
        max_header_bytes: 4096 + 256 * tensors as u64,
        ..Limits::default()
    };
    check_header(bytes, &limits).ok()?;
    let (_, metadata) = SafeTensors::read_metadata(bytes).ok()?;
    let mut names: Vec<String> = metadata.tensors().into_keys().collect();
    names.sort();
    names.into_iter().find(|name| {
        frozen
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .is_ok()
    })
}

impl Model {
    /// The model's tensors in two models: those `trainable` admits and the others (the frozen
    /// base), each keeping its tensors' names, shapes and dtypes. Either may have no tensors.
    pub fn split(&self, trainable: impl Fn(&str) -> bool) -> (Model, Model) {
        let (part, base): (Vec<&TensorInfo>, Vec<&TensorInfo>) =
            self.tensors.iter().partition(|t| trainable(&t.name));
        (self.select(&part), self.select(&base))
    }

    /// The model's tensors that `keep` admits, as a model.
    pub fn only(&self, keep: impl Fn(&str) -> bool) -> Model {
        let kept: Vec<&TensorInfo> = self.tensors.iter().filter(|t| keep(&t.name)).collect();
        self.select(&kept)
    }

    fn select(&self, tensors: &[&TensorInfo]) -> Model {
        let infos = layout(
            tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.dtype)),
        );
        let mut data = Vec::with_capacity(infos.iter().map(|t| t.len).sum());
        for t in tensors {
            data.extend_from_slice(&self.data[t.offset..t.offset + t.len]);
        }
        Model {
            tensors: infos,
            data,
        }
    }

    /// One model of `base`'s and `part`'s tensors (a frozen base and the trainable part of a
    /// task's model). Fails when a name is in both.
    pub fn merge(base: &Model, part: &Model) -> Result<Model, ModelError> {
        let mut tensors: Vec<(&Model, &TensorInfo)> = base
            .tensors
            .iter()
            .map(|t| (base, t))
            .chain(part.tensors.iter().map(|t| (part, t)))
            .collect();
        tensors.sort_by(|a, b| a.1.name.cmp(&b.1.name));
        if let Some(pair) = tensors.windows(2).find(|p| p[0].1.name == p[1].1.name) {
            return Err(ModelError::DuplicateTensor(pair[0].1.name.clone()));
        }
        let infos = layout(
            tensors
                .iter()
                .map(|(_, t)| (t.name.clone(), t.shape.clone(), t.dtype)),
        );
        let mut data = Vec::with_capacity(base.data.len() + part.data.len());
        for (model, t) in &tensors {
            data.extend_from_slice(&model.data[t.offset..t.offset + t.len]);
        }
        Ok(Model {
            tensors: infos,
            data,
        })
    }
}

/// One tensor of a [`ModelView`]: its metadata and its raw little-endian bytes.
#[derive(Debug, Clone)]
pub struct TensorBytes<'a> {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub data: &'a [u8],
}

impl TensorBytes<'_> {
    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// The values widened to f32, in order.
    pub fn values(&self) -> impl Iterator<Item = f32> + '_ {
        let (f32s, halves) = match self.dtype {
            DType::F32 => (Some(self.data.chunks_exact(4).map(f32_le)), None),
            DType::F16 | DType::BF16 => (None, Some(self.data.chunks_exact(2))),
        };
        let dtype = self.dtype;
        f32s.into_iter().flatten().chain(
            halves
                .into_iter()
                .flatten()
                .map(move |b| widen_half(dtype, [b[0], b[1]])),
        )
    }
}

/// A safetensors buffer parsed and checked but not copied: what the server validates and folds
/// a decrypted upload from, so an upload never costs a second model-sized buffer.
#[derive(Debug, Clone)]
pub struct ModelView<'a> {
    tensors: Vec<TensorBytes<'a>>,
}

impl<'a> ModelView<'a> {
    /// Parses safetensors bytes, checking every size against `limits` (with checked arithmetic)
    /// before anything proportional to them is allocated.
    pub fn parse(bytes: &'a [u8], limits: &Limits) -> Result<Self, ModelError> {
        check_header(bytes, limits)?;
        let st =
            SafeTensors::deserialize(bytes).map_err(|e| ModelError::Malformed(e.to_string()))?;
        if st.len() > limits.max_tensors {
            return Err(ModelError::TooLarge {
                what: format!("tensor count ({})", st.len()),
                limit: limits.max_tensors as u64,
            });
        }

        // Check every tensor's metadata and the total before allocating the buffer.
        let mut metas = Vec::with_capacity(st.len());
        let mut total: u64 = 0;
        for (name, view) in st.iter() {
            let dtype = DType::from_safetensors(view.dtype()).ok_or_else(|| {
                ModelError::UnsupportedDType {
                    tensor: name.to_string(),
                    dtype: format!("{:?}", view.dtype()),
                }
            })?;
            if view.shape().len() > limits.max_rank {
                return Err(ModelError::TooLarge {
                    what: format!("rank of tensor `{name}` ({})", view.shape().len()),
                    limit: limits.max_rank as u64,
                });
            }
            let numel = checked_numel(view.shape()).ok_or_else(|| ModelError::TooLarge {
                what: format!("tensor `{name}`"),
                limit: limits.max_elements,
            })?;
            total = total
                .checked_add(numel as u64)
                .filter(|t| *t <= limits.max_elements)
                .ok_or_else(|| ModelError::TooLarge {
                    what: "total element count".into(),
                    limit: limits.max_elements,
                })?;
            if view.data().len() != numel * dtype.size() {
                return Err(ModelError::Malformed(format!(
                    "tensor `{name}`: {} data bytes for shape {:?} of {dtype}",
                    view.data().len(),
                    view.shape()
                )));
            }
            metas.push(TensorBytes {
                name: name.to_string(),
                shape: view.shape().to_vec(),
                dtype,
                data: view.data(),
            });
        }
        metas.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(ModelView { tensors: metas })
    }

    /// Tensors in name order.
    pub fn tensors(&self) -> &[TensorBytes<'a>] {
        &self.tensors
    }

    pub fn numel(&self) -> usize {
        self.tensors.iter().map(TensorBytes::numel).sum()
    }

    /// Names, shapes and wire dtypes.
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorSpec {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                })
                .collect(),
        }
    }

    /// The L2 norm over every value of every tensor, accumulated in f64 (finite for any finite
    /// f32 values).
    pub fn l2_norm(&self) -> f64 {
        let mut squares = 0.0f64;
        for t in &self.tensors {
            squares += match t.dtype {
                DType::F32 => t
                    .data
                    .chunks_exact(4)
                    .map(|b| {
                        let v = f64::from(f32_le(b));
                        v * v
                    })
                    .sum::<f64>(),
                DType::F16 | DType::BF16 => {
                    t.values().map(|v| f64::from(v) * f64::from(v)).sum::<f64>()
                }
            };
        }
        squares.sqrt()
    }

    /// Fails on the first NaN or infinity, naming the tensor and the element.
    pub fn check_finite(&self) -> Result<(), ModelError> {
        for t in &self.tensors {
            // Fast scan first (vectorises); locate the culprit only when there is one.
            let all_finite = match t.dtype {
                // Branch-free within a block so it vectorises; stop at the first bad block.
                DType::F32 => t.data.chunks(1 << 16).all(|block| {
                    block
                        .chunks_exact(4)
                        .fold(true, |ok, b| ok & f32_le(b).is_finite())
                }),
                DType::F16 | DType::BF16 => t.values().all(f32::is_finite),
            };
            if all_finite {
                continue;
            }
            if let Some((index, value)) = t.values().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(ModelError::NonFinite {
                    tensor: t.name.clone(),
                    index,
                    value,
                });
            }
        }
        Ok(())
    }

    /// The same digest as [`Model::digest`] of the model this view holds, without copying it.
    /// Only for all-f32 views (what Hora writes); `None` otherwise.
    pub fn digest(&self) -> Option<ModelDigest> {
        self.tensors.iter().all(|t| t.dtype == DType::F32).then(|| {
            canonical_digest(
                self.tensors
                    .iter()
                    .map(|t| (t.name.as_str(), t.shape.as_slice(), t.data)),
            )
        })
    }

    /// Where each tensor's data lies in the buffer the view was parsed from, as byte ranges:
    /// for updating a safetensors buffer in place (its header stays valid).
    pub fn byte_ranges(&self, buffer: &[u8]) -> Vec<std::ops::Range<usize>> {
        let base = buffer.as_ptr() as usize;
        self.tensors
            .iter()
            .map(|t| {
                let start = t.data.as_ptr() as usize - base;
                start..start + t.data.len()
            })
            .collect()
    }

    /// Copies into an owned [`Model`] (f16/bf16 widened).
    pub fn to_model(&self) -> Model {
        let tensors = layout(
            self.tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.dtype)),
        );
        let mut data = Vec::with_capacity(self.numel());
        for t in &self.tensors {
            data.extend(t.values());
        }
        Model { tensors, data }
    }
}

/// SHA-256 of a model's canonical encoding; shown and serialised as lowercase hex.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelDigest(pub [u8; 32]);

impl ModelDigest {
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Result<Self, ModelError> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|_| ModelError::Malformed(format!("`{s}` is not a 64-digit hex digest")))?;
        Ok(ModelDigest(out))
    }
}

impl fmt::Display for ModelDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ModelDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelDigest({})", self.to_hex())
    }
}

impl utoipa::PartialSchema for ModelDigest {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        hex_schema("SHA-256 digest of a model's canonical encoding, 64 hex digits")
    }
}

impl utoipa::ToSchema for ModelDigest {}

/// The OpenAPI schema of a 32-byte value written as 64 hex digits (lowercase when the server
/// writes them; either case is read).
pub(crate) fn hex_schema(
    description: &str,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .pattern(Some("^[0-9a-fA-F]{64}$"))
        .description(Some(description))
        .into()
}

impl Serialize for ModelDigest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ModelDigest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ModelDigest::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// What can be wrong with a model.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("malformed safetensors: {0}")]
    Malformed(String),
    #[error("{what} exceeds the limit of {limit}")]
    TooLarge { what: String, limit: u64 },
    #[error("tensor `{tensor}` has dtype {dtype}; only f32, f16 and bf16 are supported")]
    UnsupportedDType { tensor: String, dtype: String },
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("tensor `{0}` is missing")]
    MissingTensor(String),
    #[error("tensor `{0}` is not part of the model")]
    UnexpectedTensor(String),
    #[error("tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{tensor}` has dtype {found}, expected {expected}")]
    DTypeMismatch {
        tensor: String,
        expected: DType,
        found: DType,
    },
    #[error("tensor `{tensor}` holds a non-finite value ({value}) at element {index}")]
    NonFinite {
        tensor: String,
        index: usize,
        value: f32,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    InFile {
        path: String,
        source: Box<ModelError>,
    },
}

impl ModelError {
    fn in_file(self, path: &Path) -> Self {
        ModelError::InFile {
            path: path.display().to_string(),
            source: Box::new(self),
        }
    }
}

/// SHA-256 over "hora-model-v1", the tensor count, and for each tensor in name order its name,
/// shape and little-endian f32 data, every variable-length field length-prefixed.
fn canonical_digest<'a>(
    tensors: impl ExactSizeIterator<Item = (&'a str, &'a [usize], &'a [u8])>,
) -> ModelDigest {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(b"hora-model-v1\0");
    ctx.update(&(tensors.len() as u64).to_le_bytes());
    for (name, shape, data) in tensors {
        ctx.update(&(name.len() as u64).to_le_bytes());
        ctx.update(name.as_bytes());
        ctx.update(&(shape.len() as u64).to_le_bytes());
        for d in shape {
            ctx.update(&(*d as u64).to_le_bytes());
        }
        ctx.update(data);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    ModelDigest(out)
}

fn spec_layout(spec: &ModelSpec) -> Vec<TensorInfo> {
    layout(
        spec.tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone(), t.dtype)),
    )
}

/// Offsets for tensors given in name order.
fn layout(tensors: impl Iterator<Item = (String, Vec<usize>, DType)>) -> Vec<TensorInfo> {
    let mut offset = 0;
    tensors
        .map(|(name, shape, dtype)| {
            let len = shape.iter().product();
            let info = TensorInfo {
                name,
                shape,
                dtype,
                offset,
                len,
            };
            offset += len;
            info
        })
        .collect()
}

/// Checks a safetensors buffer's size and its header's claimed length against `limits`, before
/// the header is parsed.
pub(crate) fn check_header(bytes: &[u8], limits: &Limits) -> Result<(), ModelError> {
    if bytes.len() as u64 > limits.max_bytes {
        return Err(ModelError::TooLarge {
            what: "model file".into(),
            limit: limits.max_bytes,
        });
    }
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| {
            ModelError::Malformed("shorter than the 8-byte safetensors header length".into())
        })?;
    if header_len > limits.max_header_bytes {
        return Err(ModelError::TooLarge {
            what: "safetensors header".into(),
            limit: limits.max_header_bytes,
        });
    }
    if header_len > bytes.len() as u64 - 8 {
        return Err(ModelError::Malformed(format!(
            "header claims {header_len} bytes but only {} follow",
            bytes.len() - 8
        )));
    }
    Ok(())
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The little-endian bytes of an f32 slice (the target is little-endian: see the top of the file).
pub(crate) fn f32_bytes(values: &[f32]) -> &[u8] {
    bytemuck::cast_slice(values)
}

/// An f32 from the first four little-endian bytes of `b`.
#[inline]
pub(crate) fn f32_le(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[inline]
pub(crate) fn widen_half(dtype: DType, b: [u8; 2]) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_le_bytes(b).to_f32(),
        _ => half::f16::from_le_bytes(b).to_f32(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Model {
        Model::from_tensors([
            (
                "layer.weight",
                vec![2, 3],
                vec![1.0, -2.0, 3.5, 0.25, 1e-8, -7.0],
            ),
            ("layer.bias", vec![2], vec![0.5, -0.5]),
            ("scale", vec![], vec![3.0]),
        ])
        .unwrap()
    }

    #[test]
    fn a_trainable_pattern_names_tensors_by_name_or_by_wildcards() {
        for (pattern, name, expected) in [
            ("layer.bias", "layer.bias", true),
            ("layer.bias", "layer.bias2", false),
            ("layer", "layer.bias", false),
            ("*", "anything.at.all", true),
            ("*lora_*", "base_model.model.q.lora_A.default.weight", true),
            ("*lora_*", "base_model.model.q.weight", false),
            ("encoder.*.bias", "encoder.layer.0.bias", true),
            ("encoder.*.bias", "decoder.layer.0.bias", false),
            ("*.bias", "bias", false),
            ("a*a", "a", false),
            ("a*a", "aa", true),
            ("a*b*c", "a_c_b_c", true),
            ("a*b*c", "a_c_c", false),
        ] {
            assert_eq!(name_matches(pattern, name), expected, "{pattern} vs {name}");
        }
    }

    #[test]
    fn a_model_split_into_a_base_and_a_part_merges_back_into_itself() {
        let model = sample();
        let (part, base) = model.split(|name| name_matches("layer.*", name));
        assert_eq!(
            part.tensors()
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>(),
            ["layer.bias", "layer.weight"]
        );
        assert_eq!(part.tensor("layer.weight"), model.tensor("layer.weight"));
        assert_eq!(base.tensor("scale"), Some(&[3.0f32][..]));
        assert_eq!(base.numel() + part.numel(), model.numel());
        let merged = Model::merge(&base, &part).unwrap();
        assert_eq!(merged, model);
        assert_eq!(merged.digest(), model.digest());
        // A tensor in both is refused, not silently doubled.
        assert!(matches!(
            Model::merge(&model, &part),
            Err(ModelError::DuplicateTensor(n)) if n == "layer.bias"
        ));
    }

    fn raw_safetensors(tensors: &[(&str, StDtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<_> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn layout_is_sorted_by_name_and_flat() {
        let m = sample();
        let names: Vec<_> = m.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["layer.bias", "layer.weight", "scale"]);
        assert_eq!(
            m.data(),
            &[0.5, -0.5, 1.0, -2.0, 3.5, 0.25, 1e-8, -7.0, 3.0]
        );
        assert_eq!(m.tensor("scale"), Some(&[3.0][..]));
        assert_eq!(m.tensor("nope"), None);
    }

    #[test]
    fn safetensors_round_trip_preserves_values_and_digest() {
        let m = sample();
        let bytes = m.to_safetensors();
        let back = Model::from_safetensors(&bytes, &Limits::default()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.digest(), m.digest());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        m.write_file(&path).unwrap();
        assert_eq!(Model::read_file(&path, &Limits::default()).unwrap(), m);
    }

    #[test]
    fn digest_depends_on_values_names_and_shapes() {
        let m = sample();
        let mut changed = m.clone();
        changed.data_mut()[4] = 0.26;
        assert_ne!(changed.digest(), m.digest());
        let renamed = Model::from_tensors([("a", vec![2], vec![1.0, 2.0])]).unwrap();
        let renamed2 = Model::from_tensors([("b", vec![2], vec![1.0, 2.0])]).unwrap();
        assert_ne!(renamed.digest(), renamed2.digest());
        let reshaped = Model::from_tensors([("a", vec![2, 1], vec![1.0, 2.0])]).unwrap();
        assert_ne!(renamed.digest(), reshaped.digest());
        let hex = m.digest().to_hex();
        assert_eq!(ModelDigest::from_hex(&hex).unwrap(), m.digest());
        assert_eq!(
            serde_json::to_string(&m.digest()).unwrap(),
            format!("\"{hex}\"")
        );
    }

    #[test]
    fn a_view_has_the_digest_of_its_model_and_can_be_updated_in_place() {
        let m = sample();
        let mut bytes = m.to_safetensors();
        let view = ModelView::parse(&bytes, &Limits::default()).unwrap();
        assert_eq!(view.digest(), Some(m.digest()));
        let ranges = view.byte_ranges(&bytes);
        assert_eq!(ranges.len(), 3);
        // Double every value in place: the header stays valid and the digest follows.
        for r in ranges {
            for chunk in bytes[r].chunks_exact_mut(4) {
                let v = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) * 2.0;
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
        let mut doubled = m.clone();
        doubled.data_mut().iter_mut().for_each(|v| *v *= 2.0);
        let view = ModelView::parse(&bytes, &Limits::default()).unwrap();
        assert_eq!(view.digest(), Some(doubled.digest()));
        assert_eq!(view.to_model(), doubled);
    }

    #[test]
    fn f16_and_bf16_are_widened() {
        let vals = [1.5f32, -0.25, 65504.0];
        let f16: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let bf16: Vec<u8> = vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let bytes = raw_safetensors(&[
            ("h", StDtype::F16, vec![3], f16),
            ("b", StDtype::BF16, vec![3], bf16),
        ]);
        let m = Model::from_safetensors(&bytes, &Limits::default()).unwrap();
        assert_eq!(m.tensor("h").unwrap(), &vals);
        assert_eq!(m.tensor("b").unwrap(), &[1.5, -0.25, 65536.0]); // bf16 rounds 65504 up
        assert_eq!(m.tensors()[1].dtype, DType::F16);
    }

    #[test]
    fn rejects_malformed_input() {
        let lim = Limits::default();
        assert!(matches!(
            Model::from_safetensors(b"", &lim),
            Err(ModelError::Malformed(_))
        ));
        assert!(matches!(
            Model::from_safetensors(&[1, 2, 3], &lim),
            Err(ModelError::Malformed(_))
        ));
        // A header length pointing past the end.
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        assert!(matches!(
            Model::from_safetensors(&bytes, &lim),
            Err(ModelError::Malformed(_))
        ));
        // Garbage JSON.
        let mut bytes = 4u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{{{{");
        assert!(matches!(
            Model::from_safetensors(&bytes, &lim),
            Err(ModelError::Malformed(_))
        ));
        // Truncated data section.
        let good = sample().to_safetensors();
        let cut = &good[..good.len() - 3];
        assert!(matches!(
            Model::from_safetensors(cut, &lim),
            Err(ModelError::Malformed(_))
        ));
        // Unsupported dtype.
        let ints = raw_safetensors(&[("i", StDtype::I32, vec![1], vec![0; 4])]);
        assert!(matches!(
            Model::from_safetensors(&ints, &lim),
            Err(ModelError::UnsupportedDType { .. })
        ));
    }

    #[test]
    fn rejects_oversized_input_before_allocating() {
        let good = sample().to_safetensors();
        let tight = |f: fn(&mut Limits)| {
            let mut l = Limits::default();
            f(&mut l);
            Model::from_safetensors(&good, &l)
        };
        assert!(matches!(
            tight(|l| l.max_bytes = 10),
            Err(ModelError::TooLarge { .. })
        ));
        assert!(matches!(
            tight(|l| l.max_header_bytes = 10),
            Err(ModelError::TooLarge { .. })
        ));
        assert!(matches!(
            tight(|l| l.max_tensors = 2),
            Err(ModelError::TooLarge { .. })
        ));
        assert!(matches!(
            tight(|l| l.max_elements = 8),
            Err(ModelError::TooLarge { .. })
        ));
        assert!(matches!(
            tight(|l| l.max_rank = 1),
            Err(ModelError::TooLarge { .. })
        ));
        // A header that claims an absurd length is refused without reading further.
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(
            Model::from_safetensors(&huge, &Limits::default()),
            Err(ModelError::TooLarge { .. })
        ));
        // A file larger than the limit is refused before it is read.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("big.safetensors");
        std::fs::write(&path, &good).unwrap();
        let l = Limits {
            max_bytes: 16,
            ..Limits::default()
        };
        let err = Model::read_file(&path, &l).unwrap_err();
        assert!(err.to_string().contains("big.safetensors"), "{err}");
    }

    #[test]
    fn spec_check_names_what_is_wrong() {
        let m = sample();
        let spec = m.spec();
        spec.check(&m).unwrap();
        assert_eq!(spec.limits().max_elements, 9);
        assert!(Model::from_safetensors(&m.to_safetensors(), &spec.limits()).is_ok());

        let missing = Model::from_tensors([
            ("layer.bias", vec![2], vec![0.0; 2]),
            ("scale", vec![], vec![1.0]),
        ])
        .unwrap();
        assert!(
            matches!(spec.check(&missing), Err(ModelError::MissingTensor(n)) if n == "layer.weight")
        );

        let extra = Model::from_tensors([
            ("layer.weight", vec![2, 3], vec![0.0; 6]),
            ("layer.bias", vec![2], vec![0.0; 2]),
            ("scale", vec![], vec![1.0]),
            ("zzz", vec![1], vec![1.0]),
        ])
        .unwrap();
        assert!(matches!(spec.check(&extra), Err(ModelError::UnexpectedTensor(n)) if n == "zzz"));
        let early_extra = Model::from_tensors([
            ("a", vec![1], vec![1.0]),
            ("layer.weight", vec![2, 3], vec![0.0; 6]),
            ("layer.bias", vec![2], vec![0.0; 2]),
            ("scale", vec![], vec![1.0]),
        ])
        .unwrap();
        assert!(
            matches!(spec.check(&early_extra), Err(ModelError::UnexpectedTensor(n)) if n == "a")
        );

        let reshaped = Model::from_tensors([
            ("layer.weight", vec![3, 2], vec![0.0; 6]),
            ("layer.bias", vec![2], vec![0.0; 2]),
            ("scale", vec![], vec![1.0]),
        ])
        .unwrap();
        assert!(matches!(
            spec.check(&reshaped),
            Err(ModelError::ShapeMismatch { .. })
        ));

        let f16 = half::f16::from_f32(1.0).to_le_bytes().repeat(2);
        let f32b: Vec<u8> = [0f32; 6].iter().flat_map(|v| v.to_le_bytes()).collect();
        let bytes = raw_safetensors(&[
            ("layer.weight", StDtype::F32, vec![2, 3], f32b),
            ("layer.bias", StDtype::F16, vec![2], f16),
            ("scale", StDtype::F32, vec![], 1f32.to_le_bytes().to_vec()),
        ]);
        let half_bias = Model::from_safetensors(&bytes, &Limits::default()).unwrap();
        assert!(matches!(
            spec.check(&half_bias),
            Err(ModelError::DTypeMismatch { .. })
        ));
    }

    #[test]
    fn non_finite_values_are_located() {
        let mut m = sample();
        m.check_finite().unwrap();
        m.data_mut()[5] = f32::NAN;
        match m.check_finite() {
            Err(ModelError::NonFinite { tensor, index, .. }) => {
                assert_eq!((tensor.as_str(), index), ("layer.weight", 3))
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
        m.data_mut()[5] = 0.0;
        m.data_mut()[8] = f32::NEG_INFINITY;
        assert!(
            matches!(m.check_finite(), Err(ModelError::NonFinite { tensor, .. }) if tensor == "scale")
        );
    }

    #[test]
    fn spec_rejects_duplicates_and_round_trips_as_json() {
        let t = TensorSpec {
            name: "w".into(),
            shape: vec![2],
            dtype: DType::F32,
        };
        assert!(matches!(
            ModelSpec::new(vec![t.clone(), t.clone()]),
            Err(ModelError::DuplicateTensor(_))
        ));
        let spec = sample().spec();
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<ModelSpec>(&json).unwrap(), spec);
        let dup = format!("[{0},{0}]", serde_json::to_string(&t).unwrap());
        assert!(serde_json::from_str::<ModelSpec>(&dup).is_err());
        assert!(Model::from_tensors([("w", vec![3], vec![1.0])]).is_err());
    }
}
