//! The memory a collective works on, behind one narrow interface: the ring splits a [`Region`]
//! into chunks and sub-chunks, hands each piece to the sending thread or the reducing one, and
//! never touches the elements itself. Two implementations: host `f32` slices, reduced with
//! hora-common's CPU kernel, and flat `f32` tensor views on any tch device, reduced there with
//! hora-common-tch's kernel (CUDA when the tensors live on a GPU). Pieces are disjoint, so the
//! sender can read one while the reducer writes another without locks.

use hora_common::kernel;
pub use hora_common::kernel::Received;
#[cfg(feature = "torch")]
use hora_common_tch::collective;
#[cfg(feature = "torch")]
use tch::{Kind, Tensor};

#[cfg(feature = "torch")]
use crate::CollectiveError;
use crate::Result;

/// How elements travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wire {
    #[default]
    F32,
    /// IEEE half precision: half the bytes; values are rounded to f16 (about 3 significant
    /// digits; magnitudes above 65504 overflow).
    F16,
}

impl Wire {
    pub fn width(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::F16 => 2,
        }
    }
}

/// What to do with a received piece.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Apply {
    /// `mine += received` (reduce-scatter).
    Add,
    /// `mine = received` (allgather, broadcast).
    Overwrite,
}

/// A piece of a collective's buffer.
pub trait Region: Send + Sized {
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Two disjoint pieces: `[0, mid)` and `[mid, len)`.
    fn split_at(self, mid: usize) -> (Self, Self);

    /// The values as they go on the wire (`len() × wire.width()` bytes, 4-byte aligned), for
    /// pieces [`Region::wire_bytes`] cannot give without a copy.
    fn encode(&self, out: &mut [u8], wire: Wire) -> Result<()>;

    /// The piece's own bytes when they can be sent as they are (host f32 on an f32 wire).
    fn wire_bytes(&self, _wire: Wire) -> Option<&[u8]> {
        None
    }

    fn apply(&mut self, apply: Apply, received: Received<'_>) -> Result<()>;

    /// The piece's own bytes, to receive an overwrite into directly (host f32 on an f32 wire).
    fn receive_bytes(&mut self, _wire: Wire) -> Option<&mut [u8]> {
        None
    }

    /// `apply(Add)` then `finish`, in one pass where the memory allows it.
    fn add_and_finish(
        &mut self,
        received: Received<'_>,
        factor: Option<f32>,
        wire: Wire,
    ) -> Result<()> {
        self.apply(Apply::Add, received)?;
        self.finish(factor, wire)
    }

    /// Scales by `factor` (sum → mean) and, for an f16 wire, rounds to f16 so every rank holds
    /// the same bits after the allgather.
    fn finish(&mut self, factor: Option<f32>, wire: Wire) -> Result<()>;
}

/// Decodes f16 bits in blocks on the stack, so a host reduction never allocates.
fn with_decoded(bits: &[u16], mut f: impl FnMut(usize, &[f32])) {
    let mut block = [0f32; 1024];
    for (i, chunk) in bits.chunks(block.len()).enumerate() {
        let out = &mut block[..chunk.len()];
        kernel::decode_f16(chunk, out);
        f(i * 1024, out);
    }
}

impl Region for &mut [f32] {
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }

    fn encode(&self, out: &mut [u8], wire: Wire) -> Result<()> {
        match wire {
            Wire::F32 => out.copy_from_slice(bytemuck::cast_slice(&self[..])),
            Wire::F16 => kernel::encode_f16(self, bytemuck::cast_slice_mut(out)),
        }
        Ok(())
    }

    fn wire_bytes(&self, wire: Wire) -> Option<&[u8]> {
        (wire == Wire::F32).then(|| bytemuck::cast_slice(&self[..]))
    }

    fn receive_bytes(&mut self, wire: Wire) -> Option<&mut [u8]> {
        (wire == Wire::F32).then(|| bytemuck::cast_slice_mut(&mut self[..]))
    }

    fn apply(&mut self, apply: Apply, received: Received<'_>) -> Result<()> {
        match (apply, received) {
            (Apply::Add, Received::F32(v)) => kernel::accumulate(self, v),
            (Apply::Overwrite, Received::F32(v)) => self.copy_from_slice(v),
            (Apply::Add, Received::F16(bits)) => with_decoded(bits, |at, v| {
                kernel::accumulate(&mut self[at..at + v.len()], v)
            }),
            (Apply::Overwrite, Received::F16(bits)) => kernel::decode_f16(bits, self),
        }
        Ok(())
    }

    fn add_and_finish(
        &mut self,
        received: Received<'_>,
        factor: Option<f32>,
        wire: Wire,
    ) -> Result<()> {
        match (received, factor, wire) {
            (Received::F32(v), Some(f), Wire::F32) => {
                kernel::accumulate_scaled(self, v, f);
                Ok(())
            }
            _ => {
                self.apply(Apply::Add, received)?;
                self.finish(factor, wire)
            }
        }
    }

    fn finish(&mut self, factor: Option<f32>, wire: Wire) -> Result<()> {
        if let Some(f) = factor {
            kernel::scale(self, f);
        }
        if wire == Wire::F16 {
            kernel::round_to_f16(self);
        }
        Ok(())
    }
}

/// A flat, contiguous f32 tensor (a view into a fusion buffer) on any device.
#[cfg(feature = "torch")]
#[derive(Debug)]
pub struct TensorRegion(pub Tensor);

#[cfg(feature = "torch")]
impl TensorRegion {
    /// A flat f32 view of `t`, which must be contiguous f32.
    pub fn new(t: &Tensor) -> Result<Self> {
        if t.kind() != Kind::Float || !t.is_contiguous() {
            return Err(CollectiveError::Config(format!(
                "a collective buffer must be a contiguous f32 tensor, not {:?}",
                t.kind()
            )));
        }
        Ok(TensorRegion(t.f_view([-1])?))
    }
}

#[cfg(feature = "torch")]
impl Region for TensorRegion {
    fn len(&self) -> usize {
        self.0.numel()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let n = self.len() as i64;
        let mid = mid as i64;
        (
            TensorRegion(self.0.narrow(0, 0, mid)),
            TensorRegion(self.0.narrow(0, mid, n - mid)),
        )
    }

    fn encode(&self, out: &mut [u8], wire: Wire) -> Result<()> {
        match wire {
            Wire::F32 => collective::to_host(&self.0, bytemuck::cast_slice_mut(out))?,
            Wire::F16 => collective::to_host_f16(&self.0, bytemuck::cast_slice_mut(out))?,
        }
        Ok(())
    }

    fn apply(&mut self, apply: Apply, received: Received<'_>) -> Result<()> {
        match apply {
            Apply::Add => collective::accumulate(&mut self.0, received)?,
            Apply::Overwrite => collective::overwrite(&mut self.0, received)?,
        }
        Ok(())
    }

    fn finish(&mut self, factor: Option<f32>, wire: Wire) -> Result<()> {
        if let Some(f) = factor {
            collective::scale(&mut self.0, f64::from(f))?;
        }
        if wire == Wire::F16 {
            collective::round_to_f16(&mut self.0)?;
        }
        Ok(())
    }
}
