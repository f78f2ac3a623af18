//! Fusion of tch tensors: each bucket is copied into host memory for CPU tensors, or into one
//! flat tensor on the device otherwise, so a GPU's gradients are reduced on the GPU.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{plan, shapes_fingerprint, DEFAULT_THRESHOLD};
use crate::nccl::{DType, DeviceBuffer};
use crate::region::TensorRegion;
use crate::ring::{Communicator, Reduce};
use crate::{CollectiveError, Result};

/// Packs tensors into fusion buffers for the collectives.
#[derive(Debug)]
pub struct Fusion {
    threshold_bytes: usize,
    /// Reused between calls: the host fusion buffer.
    host: Vec<f32>,
}

impl Default for Fusion {
    fn default() -> Self {
        Fusion::new(DEFAULT_THRESHOLD)
    }
}

impl Fusion {
    pub fn new(threshold_bytes: usize) -> Self {
        Fusion {
            threshold_bytes: threshold_bytes.max(4),
            host: Vec::new(),
        }
    }

    /// Replaces each tensor by its sum or mean over all ranks.
    pub fn allreduce(
        &mut self,
        comm: &mut Communicator,
        tensors: &[Tensor],
        reduce: Reduce,
    ) -> Result<()> {
        for bucket in buckets(tensors, self.threshold_bytes)? {
            self.collective(comm, &tensors[bucket], 0, |comm, fused, fp| match fused {
                Fused::Host(buf) => comm.allreduce(buf, reduce, fp),
                Fused::Device(t) if comm.nccl().is_some() => {
                    let buf = device_buffer(comm, t)?;
                    // SAFETY: `t` is the fused bucket, a contiguous f32 tensor on NCCL's device
                    // (checked), alive until this returns; libtorch's work on it is on the
                    // default stream.
                    unsafe { comm.device_allreduce(&[buf], reduce, std::ptr::null_mut(), fp) }
                }
                Fused::Device(t) => comm.allreduce(TensorRegion::new(t)?, reduce, fp),
            })?;
        }
        Ok(())
    }

    /// Replaces each tensor by `root`'s.
    pub fn broadcast(
        &mut self,
        comm: &mut Communicator,
        tensors: &[Tensor],
        root: u32,
    ) -> Result<()> {
        for bucket in buckets(tensors, self.threshold_bytes)? {
            self.collective(comm, &tensors[bucket], 1, |comm, fused, fp| match fused {
                Fused::Host(buf) => comm.broadcast(buf, root, fp),
                Fused::Device(t) if comm.nccl().is_some() => {
                    let buf = device_buffer(comm, t)?;
                    // SAFETY: as in `allreduce`.
                    unsafe { comm.device_broadcast(&[buf], root, std::ptr::null_mut(), fp) }
                }
                Fused::Device(t) => comm.broadcast(TensorRegion::new(t)?, root, fp),
            })?;
        }
        Ok(())
    }

    fn collective(
        &mut self,
        comm: &mut Communicator,
        tensors: &[Tensor],
        salt: u64,
        op: impl FnOnce(&mut Communicator, Fused<'_>, u64) -> Result<()>,
    ) -> Result<()> {
        let _guard = tch::no_grad_guard();
        // As `HostFusion` fingerprints the same shapes: the two kinds of worker agree.
        let shapes: Vec<Vec<u64>> = tensors
            .iter()
            .map(|t| t.size().into_iter().map(|d| d as u64).collect())
            .collect();
        let fp = shapes_fingerprint(shapes.iter().map(Vec::as_slice), salt);
        let device = tensors.first().map_or(Device::Cpu, Tensor::device);
        let flats: Vec<Tensor> = tensors
            .iter()
            .map(|t| t.f_detach()?.f_to_kind(Kind::Float)?.f_reshape([-1]))
            .collect::<Result<_, _>>()?;
        if device == Device::Cpu {
            let total: usize = flats.iter().map(Tensor::numel).sum();
            self.host.resize(total, 0.0);
            let mut at = 0;
            for flat in &flats {
                let n = flat.numel();
                flat.f_contiguous()?
                    .f_copy_data(&mut self.host[at..at + n], n)?;
                at += n;
            }
            op(comm, Fused::Host(&mut self.host[..total]), fp)?;
            let mut at = 0;
            for t in tensors {
                let n = t.numel();
                let values = Tensor::f_from_slice(&self.host[at..at + n])?
                    .f_reshape(t.size())?
                    .f_to_kind(t.kind())?;
                let mut t = t.shallow_clone();
                t.f_copy_(&values)?;
                at += n;
            }
        } else {
            let fused = Tensor::f_cat(&flats, 0)?;
            op(comm, Fused::Device(&fused), fp)?;
            let mut at = 0i64;
            for t in tensors {
                let n = t.numel() as i64;
                let values = fused
                    .f_narrow(0, at, n)?
                    .f_reshape(t.size())?
                    .f_to_kind(t.kind())?;
                let mut t = t.shallow_clone();
                t.f_copy_(&values)?;
                at += n;
            }
        }
        Ok(())
    }
}

/// A fused bucket as NCCL takes it: a contiguous f32 tensor on the device the ring's NCCL is on
/// (a bucket elsewhere is refused).
fn device_buffer(comm: &Communicator, t: &Tensor) -> Result<DeviceBuffer> {
    let on = comm
        .nccl()
        .map(|n| Device::Cuda(n.device().max(0) as usize));
    match t.device() {
        device if Some(device) == on && t.is_contiguous() && t.kind() == Kind::Float => {
            Ok(DeviceBuffer {
                ptr: t.data_ptr(),
                count: t.numel(),
                dtype: DType::F32,
            })
        }
        other => Err(CollectiveError::Config(format!(
            "NCCL reduces contiguous f32 buckets on {on:?}, not on {other:?}: keep the model on the ring's GPU"
        ))),
    }
}

enum Fused<'a> {
    Host(&'a mut [f32]),
    Device(&'a Tensor),
}

/// Consecutive runs of tensors of at most `threshold` f32 bytes (a larger tensor alone), all on
/// one device and floating point.
fn buckets(tensors: &[Tensor], threshold: usize) -> Result<Vec<Range<usize>>> {
    if let Some((i, t)) = tensors
        .iter()
        .enumerate()
        .find(|(_, t)| !t.is_floating_point())
    {
        return Err(CollectiveError::Config(format!(
            "tensor {i} is {:?}: collectives average floating-point tensors",
            t.kind()
        )));
    }
    let sizes = tensors.iter().enumerate().map(|(i, t)| {
        let apart = i > 0 && t.device() != tensors[i - 1].device();
        (t.numel() * 4, apart)
    });
    Ok(plan(sizes, threshold))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tests::with_world;
    use crate::CommOptions;

    #[test]
    fn buckets_respect_the_threshold() {
        let ts: Vec<Tensor> = [10, 10, 30, 5, 5]
            .iter()
            .map(|&n| Tensor::zeros([n], (Kind::Float, Device::Cpu)))
            .collect();
        assert_eq!(buckets(&ts, 80).unwrap(), vec![0..2, 2..3, 3..5]);
        assert_eq!(buckets(&ts, 1 << 20).unwrap(), vec![0..5]);
        assert_eq!(buckets(&ts, 4).unwrap().len(), 5);
        let ints = [Tensor::zeros([3], (Kind::Int64, Device::Cpu))];
        assert!(buckets(&ints, 80).is_err());
    }

    #[test]
    fn fused_tensors_of_mixed_shapes_and_kinds_are_averaged_and_broadcast() {
        let results = with_world(3, CommOptions::default(), |comm| {
            let r = f64::from(comm.rank());
            let opts = (Kind::Float, Device::Cpu);
            let tensors = vec![
                Tensor::full([2, 3], r, opts),
                Tensor::full([7], 10.0 * r, (Kind::Double, Device::Cpu)),
                Tensor::full([], r + 1.0, opts),
            ];
            // A threshold that splits the list into several buckets.
            let mut fusion = Fusion::new(32);
            fusion.allreduce(comm, &tensors, Reduce::Average).unwrap();
            let averaged: Vec<f64> = tensors
                .iter()
                .map(|t| t.mean(Kind::Double).double_value(&[]))
                .collect();
            let own = Tensor::full([4], r, opts);
            fusion
                .broadcast(comm, std::slice::from_ref(&own), 1)
                .unwrap();
            (
                averaged,
                Vec::<f32>::try_from(&own).unwrap(),
                tensors[1].kind(),
            )
        });
        for (averaged, own, kind) in results {
            assert_eq!(averaged, vec![1.0, 10.0, 2.0]);
            assert_eq!(own, vec![1.0; 4]);
            assert_eq!(kind, Kind::Double, "a tensor keeps its kind");
        }
    }

    #[test]
    fn different_shapes_on_different_ranks_are_an_error() {
        let results = with_world(2, CommOptions::default(), |comm| {
            let shape = if comm.rank() == 0 { [2, 3] } else { [3, 2] };
            let t = Tensor::zeros(shape, (Kind::Float, Device::Cpu));
            Fusion::default()
                .allreduce(comm, &[t], Reduce::Sum)
                .map_err(|e| e.to_string())
        });
        let errors: Vec<String> = results.into_iter().map(|r| r.unwrap_err()).collect();
        assert!(
            errors.iter().all(|e| e.contains("differs between ranks")),
            "both ranks compare the other's shapes with their own: {errors:?}"
        );
    }
}
