//! Compressed updates: a client's delta sent smaller than float32, and read back by the server
//! inside the fold, value by value, without ever widening a whole update.
//!
//! A task chooses a [`Compression`]: how each value sent travels ([`ValueCodec`]: f32, f16, bf16,
//! or 8- and 4-bit integers with one f32 scale per block of values, rounded stochastically so
//! that the decoded value is unbiased), and optionally top-k sparsification: each tensor sends
//! only its largest-magnitude fraction of values with their positions, and the client keeps what
//! it did not send and adds it to its next update (error feedback, Lin et al., "Deep Gradient
//! Compression", 2018). [`Compression::encode`] leaves that residual in the update it encoded.
//!
//! ## The wire format (update format [`UPDATE_FORMAT`])
//! A safetensors file whose metadata holds `format = hora-update`, `version` and `codec` (the
//! task's [`Compression::label`]), and for the spec's tensor number `i` (tensors in name order):
//! - `v{i}`: the values sent: F32, F16, BF16, I8, or U8 holding two 4-bit values per byte (low
//!   nibble first, each stored as q + 8, q in −7..=7), one dimension;
//! - `s{i}`: for int8 and int4, the scales (F32, one per `block_size` values sent, ≥ 0);
//! - `i{i}`: for top-k, the positions in the tensor as gaps (U8): for each value sent, in
//!   increasing position, the number of values skipped since the previous one sent (or since the
//!   start) as an unsigned LEB128 varint — one byte a position at 1%, where a U32 costs four.
//!
//! A plain float32 update (no compression) stays a safetensors file of the model's own tensors,
//! as before this module: [`Update::open`] tells the two apart by the metadata and refuses the
//! one the task did not ask for, saying which the task takes, so that an older client gets a
//! clear refusal rather than a misread.
//!
//! ## Error bounds
//! For a value x that was sent and its decoding d (tested in `tests`):
//! - f32: d = x; f16: |x − d| ≤ 2⁻¹¹·|x| + 2⁻²⁵ (|x| ≥ 65520, which rounds past f16's largest, 65504, is refused);
//!   bf16: |x − d| ≤ 2⁻⁸·|x| (round to nearest);
//! - int8: |x − d| < m/127 and int4: |x − d| < m/7, m the largest |x| in x's block; E[d] = x;
//! - top-k: values not sent decode to 0 and stay, exactly, in the client's residual.

use std::collections::HashMap;

use rand_chacha::rand_core::RngCore;
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::kernel::{CHUNK, PARALLEL_MIN};
use crate::model::{check_header, f32_le, widen_half, DType, Limits, Model, ModelSpec, ModelView};

/// The version of the encoded update format this build reads and writes.
pub const UPDATE_FORMAT: u32 = 1;

/// The metadata key and value that mark an encoded update.
const FORMAT_KEY: &str = "format";
const FORMAT: &str = "hora-update";

/// How each value of an update travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ValueCodec {
    /// 4 bytes a value, exact.
    F32,
    /// IEEE half precision, 2 bytes (values that round past ±65504 are refused by the client).
    F16,
    /// bfloat16, 2 bytes: f32's range, 8 bits of precision.
    Bf16,
    /// 1 byte a value, in −127..=127 times its block's scale, rounded stochastically.
    Int8,
    /// Half a byte a value, in −7..=7 times its block's scale, rounded stochastically.
    Int4,
}

impl ValueCodec {
    /// The integer levels each side of 0 (None: a float format).
    fn levels(self) -> Option<f32> {
        match self {
            ValueCodec::Int8 => Some(127.0),
            ValueCodec::Int4 => Some(7.0),
            _ => None,
        }
    }

    /// Bytes that `n` values take.
    fn bytes(self, n: u64) -> u64 {
        match self {
            ValueCodec::F32 => 4 * n,
            ValueCodec::F16 | ValueCodec::Bf16 => 2 * n,
            ValueCodec::Int8 => n,
            ValueCodec::Int4 => n.div_ceil(2),
        }
    }

    fn dtype(self) -> StDtype {
        match self {
            ValueCodec::F32 => StDtype::F32,
            ValueCodec::F16 => StDtype::F16,
            ValueCodec::Bf16 => StDtype::BF16,
            ValueCodec::Int8 => StDtype::I8,
            ValueCodec::Int4 => StDtype::U8,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ValueCodec::F32 => "f32",
            ValueCodec::F16 => "f16",
            ValueCodec::Bf16 => "bf16",
            ValueCodec::Int8 => "int8",
            ValueCodec::Int4 => "int4",
        }
    }
}

/// How clients compress their updates (plain and asynchronous tasks; secure aggregation has its
/// own quantisation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Compression {
    /// How each value sent travels.
    pub values: ValueCodec,
    /// Values sharing one scale, for int8 and int4 (16 to 65536).
    #[serde(default = "default_block_size")]
    #[schema(minimum = 16, maximum = 65536, default = 256)]
    pub block_size: u32,
    /// Send only this fraction of each tensor's values (at least one), those largest in
    /// magnitude, with their positions; the client keeps the rest and adds it to its next
    /// update (error feedback). Absent: every value is sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, exclusive_maximum = 1.0)]
    pub top_k: Option<f64>,
}

fn default_block_size() -> u32 {
    256
}

/// Why an update could not be encoded or was refused as encoded.
#[derive(Debug, Error, PartialEq)]
pub enum CodecError {
    #[error("{0}")]
    Invalid(String),
    #[error("tensor `{tensor}`: value {value} at {index} does not fit in float16 (it rounds past ±65504): use bf16 or f32 for this task, or lower the learning rate")]
    Overflow {
        tensor: String,
        index: usize,
        value: f32,
    },
}

fn invalid(message: impl Into<String>) -> CodecError {
    CodecError::Invalid(message.into())
}

impl Compression {
    /// Checks the settings, and that `spec` can be encoded with them.
    pub fn validate(&self, spec: &ModelSpec) -> Result<(), String> {
        if !(16..=65536).contains(&self.block_size) {
            return Err(format!(
                "compression.block_size must be between 16 and 65536, not {}",
                self.block_size
            ));
        }
        if let Some(k) = self.top_k {
            if !(k.is_finite() && k > 0.0 && k < 1.0) {
                return Err(format!(
                    "compression.top_k must be a fraction between 0 and 1 (exclusive), not {k}"
                ));
            }
            if let Some(t) = spec
                .tensors()
                .iter()
                .find(|t| t.numel() > u32::MAX as usize)
            {
                return Err(format!(
                    "tensor `{}` has more than 2^32 values: top-k positions do not fit",
                    t.name
                ));
            }
        }
        Ok(())
    }

    /// The codec's name as encoded updates carry it, e.g. `int8/256`, `top0.01+int8/256`, `f16`.
    pub fn label(&self) -> String {
        let values = match self.values.levels() {
            Some(_) => format!("{}/{}", self.values.name(), self.block_size),
            None => self.values.name().to_string(),
        };
        match self.top_k {
            Some(k) => format!("top{k}+{values}"),
            None => values,
        }
    }

    /// Whether the client keeps a residual between rounds.
    pub fn error_feedback(&self) -> bool {
        self.top_k.is_some()
    }

    /// How many of a tensor's `numel` values are sent.
    pub fn sent(&self, numel: usize) -> usize {
        match self.top_k {
            Some(k) if numel > 0 => ((numel as f64 * k).ceil() as usize).clamp(1, numel),
            _ => numel,
        }
    }

    /// The most bytes a tensor of `numel` values takes encoded (values, scales, positions).
    fn tensor_bytes(&self, numel: usize) -> u64 {
        let sent = self.sent(numel) as u64;
        let scales = match self.values.levels() {
            Some(_) => 4 * sent.div_ceil(u64::from(self.block_size)),
            None => 0,
        };
        let positions = if self.top_k.is_some() {
            MAX_VARINT * sent
        } else {
            0
        };
        self.values.bytes(sent) + scales + positions
    }

    /// The most bytes of tensor data an update of `spec` encoded so takes (what the wire carries
    /// besides the header and the envelope; top-k's positions take fewer when they are close).
    pub fn data_bytes(&self, spec: &ModelSpec) -> u64 {
        spec.tensors()
            .iter()
            .map(|t| self.tensor_bytes(t.numel()))
            .sum()
    }

    /// The limits an encoded update of `spec` must be within.
    pub fn limits(&self, spec: &ModelSpec) -> Limits {
        let dense = spec.limits();
        // Only the sizes are checked against these, before parsing: the parts are then checked
        // one by one against the spec. Names are short (`v12`), but three a tensor, and the
        // metadata.
        let header = dense.max_header_bytes + 1024 + 128 * spec.tensors().len() as u64;
        Limits {
            max_bytes: 8 + header + self.data_bytes(spec),
            max_header_bytes: header,
            ..dense
        }
    }

    /// Encodes `update` (in the spec's tensor order, as every [`Model`] is), rounding with
    /// `rng`, and leaves in `update` what the encoding did not carry: the residual, which is
    /// 0 where values were sent as f32, their rounding error where they were compressed, and
    /// the whole value where top-k left them out.
    pub fn encode(
        &self,
        update: &mut Model,
        rng: &mut impl RngCore,
    ) -> Result<Vec<u8>, CodecError> {
        let infos: Vec<_> = update
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.offset, t.len))
            .collect();
        let mut parts: Vec<(String, StDtype, Vec<u8>)> = Vec::with_capacity(3 * infos.len());
        for (i, (name, offset, len)) in infos.into_iter().enumerate() {
            let values = &mut update.data_mut()[offset..offset + len];
            let positions = self.top_k.map(|_| top_positions(values, self.sent(len)));
            let mut sent: Vec<f32> = match &positions {
                Some(p) => p.iter().map(|&j| values[j as usize]).collect(),
                None => values.to_vec(),
            };
            let (bytes, scales) = self.encode_values(&name, &mut sent, rng)?;
            // `sent` now holds the decoded values: what is left of each is the residual.
            match &positions {
                Some(p) => p
                    .iter()
                    .zip(&sent)
                    .for_each(|(&j, d)| values[j as usize] -= d),
                None => values.iter_mut().zip(&sent).for_each(|(v, d)| *v -= d),
            }
            parts.push((format!("v{i}"), self.values.dtype(), bytes));
            if let Some(scales) = scales {
                parts.push((format!("s{i}"), StDtype::F32, f32_bytes(&scales)));
            }
            if let Some(p) = positions {
                parts.push((format!("i{i}"), StDtype::U8, gaps(&p)));
            }
        }
        let views = parts.iter().map(|(name, dtype, bytes)| {
            let len = match dtype {
                StDtype::F32 => bytes.len() / 4,
                StDtype::F16 | StDtype::BF16 => bytes.len() / 2,
                _ => bytes.len(),
            };
            let view =
                TensorView::new(*dtype, vec![len], bytes).map_err(|e| invalid(e.to_string()));
            view.map(|v| (name.as_str(), v))
        });
        let views = views.collect::<Result<Vec<_>, _>>()?;
        let metadata = HashMap::from([
            (FORMAT_KEY.to_string(), FORMAT.to_string()),
            ("version".to_string(), UPDATE_FORMAT.to_string()),
            ("codec".to_string(), self.label()),
        ]);
        safetensors::serialize(views, Some(metadata)).map_err(|e| invalid(e.to_string()))
    }

    /// Encodes `values` as the codec says, replacing each with its decoding; the bytes, and the
    /// scales for the integer codecs.
    fn encode_values(
        &self,
        tensor: &str,
        values: &mut [f32],
        rng: &mut impl RngCore,
    ) -> Result<(Vec<u8>, Option<Vec<f32>>), CodecError> {
        Ok(match self.values {
            ValueCodec::F32 => (f32_bytes(values), None),
            ValueCodec::F16 => {
                let mut out = Vec::with_capacity(2 * values.len());
                for (index, v) in values.iter_mut().enumerate() {
                    let h = half::f16::from_f32(*v);
                    if !h.is_finite() {
                        return Err(CodecError::Overflow {
                            tensor: tensor.to_string(),
                            index,
                            value: *v,
                        });
                    }
                    out.extend_from_slice(&h.to_le_bytes());
                    *v = h.to_f32();
                }
                (out, None)
            }
            ValueCodec::Bf16 => {
                let mut out = Vec::with_capacity(2 * values.len());
                for v in values.iter_mut() {
                    let h = half::bf16::from_f32(*v);
                    out.extend_from_slice(&h.to_le_bytes());
                    *v = h.to_f32();
                }
                (out, None)
            }
            codec @ (ValueCodec::Int8 | ValueCodec::Int4) => {
                let levels = codec.levels().unwrap_or(1.0);
                let block = self.block_size as usize;
                let mut scales = Vec::with_capacity(values.len().div_ceil(block));
                let mut q = Vec::with_capacity(values.len());
                for chunk in values.chunks_mut(block) {
                    let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let scale = max / levels;
                    scales.push(scale);
                    for v in chunk.iter_mut() {
                        let level = match scale > 0.0 {
                            true => stochastic_round(*v / scale, levels, rng),
                            false => 0.0,
                        };
                        q.push(level as i8);
                        *v = level * scale;
                    }
                }
                let bytes = match codec {
                    ValueCodec::Int8 => q.iter().map(|&q| q as u8).collect(),
                    _ => q
                        .chunks(2)
                        .map(|p| {
                            let lo = (p[0] + 8) as u8;
                            let hi = (p.get(1).copied().unwrap_or(0) + 8) as u8;
                            lo | (hi << 4)
                        })
                        .collect(),
                };
                (bytes, Some(scales))
            }
        })
    }
}

/// `y` rounded down or up at random, up with probability y − ⌊y⌋ (so that its mean is y),
/// within ±`levels`.
fn stochastic_round(y: f32, levels: f32, rng: &mut impl RngCore) -> f32 {
    let floor = y.floor();
    // 24 random bits: a uniform in [0, 1) with f32's full precision there.
    let u = (rng.next_u32() >> 8) as f32 * (1.0 / (1u32 << 24) as f32);
    let up = u < y - floor;
    (floor + if up { 1.0 } else { 0.0 }).clamp(-levels, levels)
}

/// The most bytes a position's gap takes as a varint (a u32's 32 bits, 7 a byte).
const MAX_VARINT: u64 = 5;

/// Increasing `positions` as the gaps between them, unsigned LEB128 varints.
fn gaps(positions: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(positions.len() + positions.len() / 4);
    let mut next = 0u32;
    for &p in positions {
        let mut gap = p - next;
        next = p + 1;
        while gap >= 0x80 {
            out.push((gap & 0x7f) as u8 | 0x80);
            gap >>= 7;
        }
        out.push(gap as u8);
    }
    out
}

/// The `count` positions `bytes` holds as [`gaps`], if they are exactly that many, every one
/// below `numel` and every varint at most [`MAX_VARINT`] bytes.
fn positions_from_gaps(bytes: &[u8], count: usize, numel: usize) -> Option<Vec<u32>> {
    let mut positions = Vec::with_capacity(count);
    let mut bytes = bytes.iter();
    let mut next = 0u64;
    while positions.len() < count {
        let mut gap = 0u64;
        for shift in (0..MAX_VARINT * 7).step_by(7) {
            let b = *bytes.next()?;
            gap |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
            if shift + 7 == MAX_VARINT * 7 {
                return None;
            }
        }
        let p = next + gap;
        if p >= numel as u64 {
            return None;
        }
        positions.push(p as u32);
        next = p + 1;
    }
    bytes.next().is_none().then_some(positions)
}

/// The positions of the `k` values of largest magnitude, in increasing order.
fn top_positions(values: &[f32], k: usize) -> Vec<u32> {
    let mut positions: Vec<u32> = (0..values.len() as u32).collect();
    if k < values.len() {
        let magnitude = |j: &u32| values[*j as usize].abs();
        positions.select_nth_unstable_by(k, |a, b| magnitude(b).total_cmp(&magnitude(a)));
        positions.truncate(k);
        positions.sort_unstable();
    }
    positions
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(values).to_vec()
}

/// An update as the server reads it: plain safetensors in the spec's own dtypes, or encoded.
#[derive(Debug, Clone)]
pub enum Update<'a> {
    Dense(ModelView<'a>),
    Encoded(EncodedView<'a>),
}

impl<'a> Update<'a> {
    /// Parses and checks an update for a task of `spec` that takes `compression`: its format is
    /// the one the task takes, its tensors, shapes and dtypes are the spec's (or the codec's),
    /// sizes are within the limits before anything is allocated, and every value it decodes to
    /// is finite.
    pub fn open(
        bytes: &'a [u8],
        spec: &ModelSpec,
        compression: Option<&Compression>,
    ) -> Result<Self, CodecError> {
        let mut update = Self::parse(bytes, spec, compression)?;
        match &mut update {
            Update::Dense(view) => {
                spec.check_spec(&view.spec())
                    .map_err(|e| invalid(e.to_string()))?;
                view.check_finite().map_err(|e| invalid(e.to_string()))?;
            }
            Update::Encoded(view) => view.norm = Some(view.squares()?.sqrt()),
        }
        Ok(update)
    }

    /// [`Update::open`] without the dense checks of names and values nor the encoded decoding
    /// of values (an encoded update's parts, codes and positions are checked again): for an
    /// update already opened, read again.
    pub fn parse(
        bytes: &'a [u8],
        spec: &ModelSpec,
        compression: Option<&Compression>,
    ) -> Result<Self, CodecError> {
        let limits = match compression {
            Some(c) => c.limits(spec),
            None => spec.limits(),
        };
        let widest = Limits {
            max_bytes: limits.max_bytes.max(spec.limits().max_bytes),
            ..limits
        };
        check_header(bytes, &widest).map_err(|e| invalid(e.to_string()))?;
        let (_, metadata) =
            SafeTensors::read_metadata(bytes).map_err(|e| invalid(e.to_string()))?;
        let meta = metadata.metadata().as_ref();
        let encoded = meta.and_then(|m| m.get(FORMAT_KEY)).map(String::as_str) == Some(FORMAT);
        match (encoded, compression) {
            (false, None) => ModelView::parse(bytes, &limits)
                .map(Update::Dense)
                .map_err(|e| invalid(e.to_string())),
            (false, Some(c)) => Err(invalid(format!(
                "this task takes compressed updates ({}, update format {UPDATE_FORMAT}) and this one is plain float32: upgrade the client to a Hora release that speaks update format {UPDATE_FORMAT}",
                c.label()
            ))),
            (true, None) => Err(invalid(
                "this update is compressed and the task takes plain float32 updates: the client must follow the task's config",
            )),
            (true, Some(c)) => {
                let get = |key: &str| meta.and_then(|m| m.get(key)).map_or("", String::as_str);
                let version = get("version");
                if version != UPDATE_FORMAT.to_string() {
                    return Err(invalid(format!(
                        "the update is in format version `{version}` and this server reads version {UPDATE_FORMAT}: client and server must be upgraded together"
                    )));
                }
                let codec = get("codec");
                if codec != c.label() {
                    return Err(invalid(format!(
                        "the update is encoded as `{codec}` and the task takes `{}`",
                        c.label()
                    )));
                }
                if bytes.len() as u64 > limits.max_bytes {
                    return Err(invalid(format!(
                        "the update is {} bytes, more than the {} an update of this task encoded as `{codec}` can be",
                        bytes.len(),
                        limits.max_bytes
                    )));
                }
                EncodedView::parse(bytes, spec, c).map(Update::Encoded)
            }
        }
    }

    /// The L2 norm of the values the update decodes to, in f64.
    pub fn l2_norm(&self) -> f64 {
        match self {
            Update::Dense(view) => view.l2_norm(),
            Update::Encoded(view) => view.l2_norm(),
        }
    }

    /// The decoded update as a [`Model`] of `spec` (for tests and checks; the fold never does).
    pub fn to_model(&self, spec: &ModelSpec) -> Model {
        match self {
            Update::Dense(view) => view.to_model(),
            Update::Encoded(view) => {
                let mut sum = vec![0.0f64; view.numel()];
                view.fold_scaled(&mut sum, 1.0);
                let mut model = Model::zeros(spec);
                model
                    .data_mut()
                    .iter_mut()
                    .zip(sum)
                    .for_each(|(m, s)| *m = s as f32);
                model
            }
        }
    }
}

/// One tensor of an encoded update, checked against its spec.
#[derive(Debug, Clone)]
struct EncodedTensor<'a> {
    name: String,
    /// Where the tensor starts in the flat model, and its values (sent or not).
    offset: usize,
    numel: usize,
    values: &'a [u8],
    /// f32 scales (the integer codecs).
    scales: &'a [u8],
    /// Positions of the values sent, strictly increasing (top-k).
    positions: Option<Vec<u32>>,
    /// Values sent.
    sent: usize,
}

/// An encoded update parsed and checked but not decoded: the fold reads values straight from
/// the buffer.
#[derive(Debug, Clone)]
pub struct EncodedView<'a> {
    codec: ValueCodec,
    block: usize,
    tensors: Vec<EncodedTensor<'a>>,
    /// Values in the whole model (sent or not).
    numel: usize,
    /// The L2 norm of the decoded values, once [`Update::open`] has checked them.
    norm: Option<f64>,
}

impl<'a> EncodedView<'a> {
    fn parse(bytes: &'a [u8], spec: &ModelSpec, c: &Compression) -> Result<Self, CodecError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| invalid(e.to_string()))?;
        let quantised = c.values.levels().is_some();
        let expected =
            spec.tensors().len() * (1 + usize::from(quantised) + usize::from(c.top_k.is_some()));
        if st.len() != expected {
            return Err(invalid(format!(
                "an update encoded as `{}` holds {expected} tensors for this task, not {}",
                c.label(),
                st.len()
            )));
        }
        // A part of the update: `len` bytes of `dtype` (at most `len` with `up_to`).
        let part = |name: String, dtype: StDtype, len: u64, up_to: bool| {
            let view = st
                .tensor(&name)
                .map_err(|_| invalid(format!("the encoded update has no tensor `{name}`")))?;
            let size = view.data().len() as u64;
            if view.dtype() != dtype
                || view.shape().len() != 1
                || size > len
                || (!up_to && size != len)
            {
                return Err(invalid(format!(
                    "encoded tensor `{name}` is {:?} {:?} ({} bytes); expected {dtype:?} of {}{len} bytes",
                    view.dtype(),
                    view.shape(),
                    view.data().len(),
                    if up_to { "at most " } else { "" },
                )));
            }
            Ok::<&'a [u8], CodecError>(view.data())
        };
        let mut tensors = Vec::with_capacity(spec.tensors().len());
        let mut offset = 0;
        for (i, t) in spec.tensors().iter().enumerate() {
            let numel = t.numel();
            let sent = c.sent(numel);
            let values = part(
                format!("v{i}"),
                c.values.dtype(),
                c.values.bytes(sent as u64),
                false,
            )?;
            let scales = match quantised {
                true => part(
                    format!("s{i}"),
                    StDtype::F32,
                    4 * (sent as u64).div_ceil(u64::from(c.block_size)),
                    false,
                )?,
                false => &[],
            };
            if let Some(bad) = scales
                .chunks_exact(4)
                .map(f32_le)
                .find(|s| !(s.is_finite() && *s >= 0.0))
            {
                return Err(invalid(format!(
                    "tensor `{}`: scale {bad} is not a finite number ≥ 0",
                    t.name
                )));
            }
            let positions = match c.top_k {
                Some(_) => {
                    let gaps = part(format!("i{i}"), StDtype::U8, MAX_VARINT * sent as u64, true)?;
                    let positions = positions_from_gaps(gaps, sent, numel).ok_or_else(|| {
                        invalid(format!(
                            "tensor `{}`: the positions must be {sent} gaps (varints of at most {MAX_VARINT} bytes) that stay below {numel}",
                            t.name
                        ))
                    })?;
                    Some(positions)
                }
                None => None,
            };
            match c.values {
                ValueCodec::Int8 if values.contains(&0x80) => {
                    return Err(invalid(format!(
                        "tensor `{}`: int8 values are in −127..=127, not −128",
                        t.name
                    )))
                }
                ValueCodec::Int4
                    if values.iter().any(|b| b & 0x0f == 0 || b >> 4 == 0)
                        || (sent % 2 == 1 && values.last().is_some_and(|b| b >> 4 != 8)) =>
                {
                    return Err(invalid(format!(
                        "tensor `{}`: 4-bit values are stored as q + 8 in 1..=15 (an odd count padded with 8)",
                        t.name
                    )))
                }
                _ => {}
            }
            tensors.push(EncodedTensor {
                name: t.name.clone(),
                numel,
                offset,
                values,
                scales,
                positions,
                sent,
            });
            offset += numel;
        }
        Ok(EncodedView {
            codec: c.values,
            block: c.block_size as usize,
            tensors,
            numel: offset,
            norm: None,
        })
    }

    /// Values in the whole model the update is for (sent or not).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Adds `factor ×` every decoded value into `sum` (laid out as the flat model): pieces of
    /// [`CHUNK`] values decoded into a buffer and added, over rayon's pool for large dense
    /// tensors, like the kernel's own fold; top-k ones scattered to their positions.
    pub fn fold_scaled(&self, sum: &mut [f64], factor: f64) {
        for t in &self.tensors {
            let dst = &mut sum[t.offset..t.offset + t.numel];
            match &t.positions {
                Some(positions) => {
                    let mut values = vec![0.0f32; CHUNK.min(t.sent)];
                    for start in (0..t.sent).step_by(CHUNK) {
                        let values = &mut values[..CHUNK.min(t.sent - start)];
                        t.decode(self.codec, self.block, start, values);
                        for (p, v) in positions[start..].iter().zip(values.iter()) {
                            dst[*p as usize] += factor * f64::from(*v);
                        }
                    }
                }
                None => {
                    let fold = |c: usize, piece: &mut [f64]| {
                        let mut values = vec![0.0f32; piece.len()];
                        t.decode(self.codec, self.block, c * CHUNK, &mut values);
                        piece
                            .iter_mut()
                            .zip(&values)
                            .for_each(|(s, v)| *s += factor * f64::from(*v));
                    };
                    if dst.len() < PARALLEL_MIN {
                        dst.chunks_mut(CHUNK)
                            .enumerate()
                            .for_each(|(c, p)| fold(c, p));
                    } else {
                        dst.par_chunks_mut(CHUNK)
                            .enumerate()
                            .for_each(|(c, p)| fold(c, p));
                    }
                }
            }
        }
    }

    /// The L2 norm of the decoded update, in f64 ([`Update::open`] works it out as it checks
    /// the values).
    pub fn l2_norm(&self) -> f64 {
        self.norm
            .or_else(|| self.squares().ok().map(f64::sqrt))
            .unwrap_or(f64::NAN)
    }

    /// The sum of the squares of the decoded values; fails on the first that is a NaN or an
    /// infinity (a huge scale, or a half-precision infinity).
    fn squares(&self) -> Result<f64, CodecError> {
        let mut total = 0.0;
        for t in &self.tensors {
            let squares = |c: usize| -> Result<f64, usize> {
                let start = c * CHUNK;
                let mut values = vec![0.0f32; CHUNK.min(t.sent - start)];
                t.decode(self.codec, self.block, start, &mut values);
                if let Some(k) = values.iter().position(|v| !v.is_finite()) {
                    return Err(start + k);
                }
                Ok(values.iter().map(|v| f64::from(*v) * f64::from(*v)).sum())
            };
            let chunks = t.sent.div_ceil(CHUNK);
            let sum = if t.sent < PARALLEL_MIN {
                (0..chunks).try_fold(0.0, |acc, c| squares(c).map(|s| acc + s))
            } else {
                (0..chunks)
                    .into_par_iter()
                    .map(squares)
                    .try_reduce(|| 0.0, |a, b| Ok(a + b))
            };
            total += sum.map_err(|j| {
                let mut value = [0.0f32];
                t.decode(self.codec, self.block, j, &mut value);
                let at = t.positions.as_ref().map_or(j, |p| p[j] as usize);
                invalid(format!(
                    "tensor `{}`: value {at} decodes to {}; every value must be finite",
                    t.name, value[0]
                ))
            })?;
        }
        Ok(total)
    }
}

impl EncodedTensor<'_> {
    /// Decodes the values sent number `start..start + out.len()` into `out`: block by block
    /// for the integer codecs, so that each block's loop is a plain multiply that vectorises.
    fn decode(&self, codec: ValueCodec, block: usize, start: usize, out: &mut [f32]) {
        let halves = |dtype: DType, out: &mut [f32]| {
            let bytes = &self.values[2 * start..2 * (start + out.len())];
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = widen_half(dtype, [b[0], b[1]]);
            }
        };
        match codec {
            ValueCodec::F32 => {
                let bytes = &self.values[4 * start..4 * (start + out.len())];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32_le(b);
                }
            }
            ValueCodec::F16 => halves(DType::F16, out),
            ValueCodec::Bf16 => halves(DType::BF16, out),
            ValueCodec::Int8 | ValueCodec::Int4 => {
                let mut done = 0;
                while done < out.len() {
                    let j = start + done;
                    let n = (block - j % block).min(out.len() - done);
                    let scale = f32_le(&self.scales[4 * (j / block)..]);
                    let out = &mut out[done..done + n];
                    if codec == ValueCodec::Int8 {
                        for (o, q) in out.iter_mut().zip(&self.values[j..j + n]) {
                            *o = f32::from(*q as i8) * scale;
                        }
                    } else {
                        for (k, o) in out.iter_mut().enumerate() {
                            let j = j + k;
                            let nibble = (self.values[j / 2] >> (4 * (j % 2))) & 0x0f;
                            *o = f32::from(nibble as i8 - 8) * scale;
                        }
                    }
                    done += n;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand_chacha::rand_core::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    use super::*;

    fn compression(values: ValueCodec, top_k: Option<f64>) -> Compression {
        Compression {
            values,
            block_size: 16,
            top_k,
        }
    }

    fn model(a: Vec<f32>, b: Vec<f32>) -> Model {
        let (na, nb) = (a.len(), b.len());
        Model::from_tensors([("a", vec![na], a), ("b", vec![nb], b)]).unwrap()
    }

    const CODECS: [ValueCodec; 5] = [
        ValueCodec::F32,
        ValueCodec::F16,
        ValueCodec::Bf16,
        ValueCodec::Int8,
        ValueCodec::Int4,
    ];

    /// Encodes, opens as the server does, and decodes: (decoded, residual).
    fn round_trip(c: &Compression, m: &Model, seed: u64) -> (Model, Model) {
        let mut residual = m.clone();
        let bytes = c
            .encode(&mut residual, &mut ChaCha8Rng::seed_from_u64(seed))
            .unwrap();
        let spec = m.spec();
        let update = Update::open(&bytes, &spec, Some(c)).unwrap();
        (update.to_model(&spec), residual)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every codec decodes within its documented bound, and decoded + residual is what was
        /// encoded.
        #[test]
        fn every_codec_round_trips_within_its_bound(
            a in prop::collection::vec(-1e3f32..1e3, 1..200),
            b in prop::collection::vec(-1e-3f32..1e-3, 1..50),
            codec in 0usize..5,
            top in prop::option::of(0.01f64..0.9),
            seed in any::<u64>(),
        ) {
            let c = compression(CODECS[codec], top);
            let m = model(a, b);
            let (decoded, residual) = round_trip(&c, &m, seed);
            for t in m.tensors() {
                let x = &m.data()[t.offset..t.offset + t.len];
                let d = &decoded.data()[t.offset..t.offset + t.len];
                let r = &residual.data()[t.offset..t.offset + t.len];
                let sent = d.iter().filter(|d| **d != 0.0).count();
                prop_assert!(sent <= c.sent(t.len));
                for j in 0..t.len {
                    // decoded + residual = the original (to f32 rounding of the subtraction).
                    prop_assert!((d[j] + r[j] - x[j]).abs() <= 1e-6 * (x[j].abs() + d[j].abs()), "{} {} {}", x[j], d[j], r[j]);
                    if d[j] == 0.0 {
                        continue; // not sent (top-k), or rounded to 0
                    }
                    let block = j / 16;
                    let m = x[block * 16..((block + 1) * 16).min(t.len)]
                        .iter()
                        .fold(0.0f32, |m, v| m.max(v.abs()));
                    let bound = match c.values {
                        ValueCodec::F32 => 0.0,
                        ValueCodec::F16 => x[j].abs() * 2f32.powi(-11) + 2f32.powi(-25),
                        ValueCodec::Bf16 => x[j].abs() * 2f32.powi(-8),
                        ValueCodec::Int8 if top.is_none() => m / 127.0 * 1.0001,
                        ValueCodec::Int4 if top.is_none() => m / 7.0 * 1.0001,
                        // Blocks of the values sent, not of the tensor: bound by the tensor's max.
                        ValueCodec::Int8 => x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0 * 1.0001,
                        ValueCodec::Int4 => x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 7.0 * 1.0001,
                    };
                    prop_assert!((x[j] - d[j]).abs() <= bound, "{:?}: {} decoded as {} (bound {})", c.values, x[j], d[j], bound);
                }
            }
        }
    }

    /// Top-k sends the largest values: what it leaves out is no larger than what it sends.
    #[test]
    fn top_k_sends_the_largest_values_and_keeps_the_rest_exactly() {
        let c = compression(ValueCodec::F32, Some(0.25));
        let m = model(vec![0.1, -5.0, 0.2, 3.0, 0.0, -0.3, 0.05, 1.0], vec![7.0]);
        let (decoded, residual) = round_trip(&c, &m, 1);
        assert_eq!(
            decoded.data(),
            &[0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0, 7.0]
        );
        assert_eq!(
            residual.data(),
            &[0.1, 0.0, 0.2, 0.0, 0.0, -0.3, 0.05, 1.0, 0.0]
        );
    }

    /// Stochastic rounding is unbiased: the mean of many decodings of the same value is the value,
    /// within five standard errors, for values between levels and at awkward fractions.
    #[test]
    fn stochastic_rounding_is_unbiased() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for codec in [ValueCodec::Int8, ValueCodec::Int4] {
            // The block's largest value fixes the scale (1/levels); the others fall between levels.
            let values = vec![1.0f32, 0.3, -0.0123, 0.77777, -0.5001, 1e-4, 0.999, -0.25];
            let c = compression(codec, None);
            let trials = 20_000;
            let mut sums = vec![0.0f64; values.len()];
            for _ in 0..trials {
                let mut m =
                    Model::from_tensors([("w", vec![values.len()], values.clone())]).unwrap();
                let bytes = c.encode(&mut m, &mut rng).unwrap();
                let spec = m.spec();
                let d = Update::open(&bytes, &spec, Some(&c))
                    .unwrap()
                    .to_model(&spec);
                sums.iter_mut()
                    .zip(d.data())
                    .for_each(|(s, d)| *s += f64::from(*d));
            }
            let step = 1.0 / f64::from(codec.levels().unwrap());
            for (x, s) in values.iter().zip(&sums) {
                let mean = s / trials as f64;
                // A rounding between two levels a step apart has standard deviation ≤ step/2.
                let se = step / 2.0 / (trials as f64).sqrt();
                assert!(
                    (mean - f64::from(*x)).abs() <= 5.0 * se,
                    "{codec:?}: {x} decodes to {mean} on average (standard error {se})"
                );
            }
        }
    }

    /// Gaps round-trip, near and far (a position past 2^28 takes five bytes).
    #[test]
    fn positions_travel_as_gaps() {
        let positions = [0u32, 1, 2, 131, 132, 20_000, 1 << 29, u32::MAX - 1];
        let bytes = gaps(&positions);
        assert_eq!(bytes.len(), 1 + 1 + 1 + 2 + 1 + 3 + 5 + 5);
        assert_eq!(
            positions_from_gaps(&bytes, positions.len(), u32::MAX as usize).as_deref(),
            Some(&positions[..])
        );
        assert_eq!(positions_from_gaps(&bytes, positions.len(), 1 << 29), None);
    }

    #[test]
    fn int8_is_four_times_smaller_and_top_k_fifty() {
        let spec = model(vec![0.0; 100_000], vec![0.0; 1000]).spec();
        let dense = spec.wire_bytes() as f64;
        let int8 = compression(ValueCodec::Int8, None);
        let int8 = Compression {
            block_size: 256,
            ..int8
        };
        assert!(dense / int8.data_bytes(&spec) as f64 > 3.9);
        let top = compression(ValueCodec::Int8, Some(0.01));
        assert!(dense / top.data_bytes(&spec) as f64 > 50.0);
    }

    #[test]
    fn the_wrong_format_is_refused_with_what_the_task_takes() {
        let m = model(vec![1.0, 2.0], vec![3.0]);
        let spec = m.spec();
        let c = compression(ValueCodec::Int8, None);
        let plain = m.to_safetensors();
        let err = Update::open(&plain, &spec, Some(&c))
            .unwrap_err()
            .to_string();
        assert!(err.contains("int8/16") && err.contains("upgrade"), "{err}");
        let encoded = c
            .encode(&mut m.clone(), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        let err = Update::open(&encoded, &spec, None).unwrap_err().to_string();
        assert!(err.contains("compressed"), "{err}");
        let other = compression(ValueCodec::Int4, None);
        let err = Update::open(&encoded, &spec, Some(&other))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`int8/16`") && err.contains("`int4/16`"),
            "{err}"
        );
        // A future version is refused by name.
        let future = encoded_with(&encoded, |meta| {
            meta.insert("version".into(), "2".into());
        });
        let err = Update::open(&future, &spec, Some(&c))
            .unwrap_err()
            .to_string();
        assert!(err.contains("version `2`"), "{err}");
    }

    /// `bytes` re-serialised with its metadata changed by `f`.
    fn encoded_with(bytes: &[u8], f: impl FnOnce(&mut HashMap<String, String>)) -> Vec<u8> {
        let st = SafeTensors::deserialize(bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
        let mut meta = meta.metadata().clone().unwrap();
        f(&mut meta);
        safetensors::serialize(st.tensors(), Some(meta)).unwrap()
    }

    #[test]
    fn malformed_encodings_are_refused() {
        let m = model(vec![1.0, -2.0, 3.0, 0.5], vec![3.0]);
        let spec = m.spec();
        let c = compression(ValueCodec::Int8, Some(0.5));
        let bytes = c
            .encode(&mut m.clone(), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone();
        let with = |name: &str, dtype: StDtype, data: Vec<u8>| {
            let mut tensors: Vec<(String, TensorView<'_>)> = st
                .tensors()
                .into_iter()
                .filter(|(n, _)| n != name)
                .collect();
            let len = data.len() / (dtype.bitsize() / 8).max(1);
            let data: &'static [u8] = Box::leak(data.into_boxed_slice());
            tensors.push((
                name.to_string(),
                TensorView::new(dtype, vec![len], data).unwrap(),
            ));
            let bytes = safetensors::serialize(tensors, meta.clone()).unwrap();
            Update::open(&bytes, &spec, Some(&c))
                .unwrap_err()
                .to_string()
        };
        // Gaps that run past the tensor, one too many or too few, a varint past 5 bytes.
        for gaps in [
            vec![0u8, 4],
            vec![0, 0, 0],
            vec![0],
            vec![0x80, 0x80, 0x80, 0x80, 0x80, 0],
        ] {
            let err = with("i0", StDtype::U8, gaps);
            assert!(err.contains("the positions must be"), "{err}");
        }
        // More bytes than any 2 positions take.
        let err = with("i0", StDtype::U8, vec![0; 11]);
        assert!(err.contains("expected U8"), "{err}");
        // A scale that is not finite, or one that overflows what it scales.
        let err = with("s0", StDtype::F32, f32::NAN.to_le_bytes().to_vec());
        assert!(err.contains("scale"), "{err}");
        let err = with("s0", StDtype::F32, f32::MAX.to_le_bytes().to_vec());
        assert!(err.contains("finite"), "{err}");
        // A value tensor of the wrong type, and an int8 code out of range.
        let err = with("v0", StDtype::F32, vec![0; 8]);
        assert!(err.contains("expected I8"), "{err}");
        let err = with("v0", StDtype::I8, vec![0x80, 1]);
        assert!(err.contains("−127..=127"), "{err}");
        // 4-bit codes are 1..=15, an odd count padded with 8.
        let c = compression(ValueCodec::Int4, None);
        let m = model(vec![1.0, -2.0, 3.0], vec![3.0]);
        let bytes = c
            .encode(&mut m.clone(), &mut ChaCha8Rng::seed_from_u64(0))
            .unwrap();
        let spec = m.spec();
        assert!(Update::open(&bytes, &spec, Some(&c)).is_ok());
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let at = st.tensor("v0").unwrap().data().as_ptr() as usize - bytes.as_ptr() as usize;
        for (byte, bad) in [(0, 0x80u8), (1, 0x08)] {
            let mut broken = bytes.clone();
            broken[at + byte] = bad; // a 0 nibble (q = −8), or a padding that is not 8
            let err = Update::open(&broken, &spec, Some(&c))
                .unwrap_err()
                .to_string();
            assert!(err.contains("q + 8"), "{err}");
        }
    }

    /// Large dense tensors fold in pieces over the pool: the same sums as one value at a time.
    #[test]
    fn a_large_update_folds_in_parallel_to_what_it_decodes_to() {
        let n = 3 * PARALLEL_MIN + 17;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let m = Model::from_tensors([("w", vec![n], values)]).unwrap();
        for codec in [ValueCodec::Int8, ValueCodec::F16] {
            let c = Compression {
                block_size: 256,
                ..compression(codec, None)
            };
            let (decoded, residual) = round_trip(&c, &m, 5);
            for ((x, d), r) in m.data().iter().zip(decoded.data()).zip(residual.data()) {
                assert!((x - r - d).abs() <= 1e-6, "{codec:?}: {x} − {r} != {d}");
            }
        }
    }
}
