//! hora-common-tch: the averaging kernel on libtorch — the same running weighted sum as
//! `hora_common::kernel::WeightedSum`, held as one flat tensor on any tch device (CUDA when
//! present), so updates that already live on a GPU are folded there without a trip through host
//! memory. Used by the client (GPU training, the allreduce ring); never by the server, which is
//! why it is a crate and not a feature of hora-common (see that crate's `kernel` module).
//!
//! The accumulator is f64 by default, like the CPU backend, so both agree to f32 rounding; pass
//! another kind to [`TchWeightedSum::with_kind`] where speed matters more (gradient allreduce).
//! Each `add` is one fused `addcmul_` (sum += update × weight) with no temporary of model size.

use tch::{Device, Kind, Tensor};

use hora_common::kernel::{check_weight, KernelError};
use hora_common::model::{Model, ModelSpec};

fn torch(e: tch::TchError) -> KernelError {
    KernelError::Backend(format!("libtorch: {e}"))
}

/// A running weighted sum over the flattened parameters of one spec, on a tch device.
#[derive(Debug)]
pub struct TchWeightedSum {
    spec: ModelSpec,
    sum: Tensor,
    total_weight: f64,
    updates: u64,
}

impl TchWeightedSum {
    /// An empty f64 sum on `device`.
    pub fn new(spec: ModelSpec, device: Device) -> Result<Self, KernelError> {
        Self::with_kind(spec, device, Kind::Double)
    }

    /// An empty sum accumulated in `kind` (a floating kind) on `device`.
    pub fn with_kind(spec: ModelSpec, device: Device, kind: Kind) -> Result<Self, KernelError> {
        if !matches!(
            kind,
            Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
        ) {
            return Err(KernelError::Backend(format!(
                "accumulator kind {kind:?} is not floating point"
            )));
        }
        let n = i64::try_from(spec.numel())
            .map_err(|_| KernelError::LayoutMismatch("model too large".into()))?;
        let sum = Tensor::f_zeros([n], (kind, device)).map_err(torch)?;
        Ok(TchWeightedSum {
            spec,
            sum,
            total_weight: 0.0,
            updates: 0,
        })
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn device(&self) -> Device {
        self.sum.device()
    }

    pub fn total_weight(&self) -> f64 {
        self.total_weight
    }

    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Σ weight × update as a flat tensor in the accumulator's kind.
    pub fn sum(&self) -> &Tensor {
        &self.sum
    }

    /// Folds `weight × update`; `update` is a flat (or any-shaped, contiguous) floating tensor with
    /// the spec's number of elements, on any device (moved to the sum's device if needed).
    pub fn add(&mut self, weight: f64, update: &Tensor) -> Result<(), KernelError> {
        check_weight(weight)?;
        if !update.is_floating_point() {
            return Err(KernelError::LayoutMismatch(format!(
                "update kind {:?} is not floating point",
                update.kind()
            )));
        }
        if update.numel() != self.spec.numel() {
            return Err(KernelError::LayoutMismatch(format!(
                "{} values for a model of {} parameters",
                update.numel(),
                self.spec.numel()
            )));
        }
        let _guard = tch::no_grad_guard();
        let update = update
            .f_reshape([-1])
            .map_err(torch)?
            .f_to_device(self.sum.device())
            .map_err(torch)?;
        let w =
            Tensor::f_scalar_tensor(weight, (self.sum.kind(), self.sum.device())).map_err(torch)?;
        // In-place ops hand back an alias of `self.sum`; nothing to keep.
        let _ = self.sum.f_addcmul_(&update, &w).map_err(torch)?;
        self.total_weight += weight;
        self.updates += 1;
        Ok(())
    }

    /// Folds a host model (copied to the device once).
    pub fn add_model(&mut self, weight: f64, update: &Model) -> Result<(), KernelError> {
        if !update.same_layout(&self.spec) {
            return Err(KernelError::LayoutMismatch(
                "tensor names or shapes differ from the spec".into(),
            ));
        }
        self.add(weight, &Tensor::from_slice(update.data()))
    }

    /// Adds another partial sum over the same spec.
    pub fn merge(&mut self, other: &TchWeightedSum) -> Result<(), KernelError> {
        if other.spec != self.spec {
            return Err(KernelError::LayoutMismatch(
                "partial sums are over different specs".into(),
            ));
        }
        let _guard = tch::no_grad_guard();
        let theirs = other.sum.f_to_device(self.sum.device()).map_err(torch)?;
        let _ = self.sum.f_add_(&theirs).map_err(torch)?;
        self.total_weight += other.total_weight;
        self.updates += other.updates;
        Ok(())
    }

    /// The weighted mean as a flat f32 tensor on the sum's device.
    pub fn finish(&self) -> Result<Tensor, KernelError> {
        if self.updates == 0 || self.total_weight <= 0.0 {
            return Err(KernelError::Empty);
        }
        let _guard = tch::no_grad_guard();
        self.sum
            .f_div_scalar(self.total_weight)
            .map_err(torch)?
            .f_to_kind(Kind::Float)
            .map_err(torch)
    }

    /// The weighted mean copied back to the host as a model of the spec.
    pub fn finish_model(&self) -> Result<Model, KernelError> {
        let mean = self.finish()?.f_to_device(Device::Cpu).map_err(torch)?;
        let numel = self.spec.numel();
        let mut data = vec![0f32; numel];
        mean.f_copy_data(&mut data, numel).map_err(torch)?;
        Model::from_flat(&self.spec, data).map_err(|e| KernelError::LayoutMismatch(e.to_string()))
    }
}

/// The collectives' elementwise operations on a flat f32 tensor (a view into a fusion buffer) on
/// any device. The allreduce ring's wire is host memory, so the received side of each operation
/// is a host slice: f32 values, or half-precision bits when the wire is compressed.
pub mod collective {
    use half::slice::HalfBitsSliceExt;
    use tch::{Device, Kind, Tensor};

    use super::torch;
    use hora_common::kernel::KernelError;

    pub use hora_common::kernel::Received;

    /// The values as an f32 tensor on `device` (half precision crosses to the device as half
    /// and is widened there).
    fn to_tensor(received: Received<'_>, device: Device) -> Result<Tensor, KernelError> {
        let t = match received {
            Received::F32(v) => Tensor::f_from_slice(v).map_err(torch)?,
            Received::F16(v) => {
                Tensor::f_from_slice(v.reinterpret_cast::<half::f16>()).map_err(torch)?
            }
        };
        t.f_to_device(device)
            .map_err(torch)?
            .f_to_kind(Kind::Float)
            .map_err(torch)
    }

    fn check(dst: &Tensor, len: usize) -> Result<(), KernelError> {
        if dst.kind() != Kind::Float || dst.numel() != len {
            return Err(KernelError::LayoutMismatch(format!(
                "a {:?} tensor of {} elements cannot take {len} f32 values",
                dst.kind(),
                dst.numel()
            )));
        }
        Ok(())
    }

    /// `dst += received`, on `dst`'s device.
    pub fn accumulate(dst: &mut Tensor, received: Received<'_>) -> Result<(), KernelError> {
        check(dst, received.len())?;
        let _guard = tch::no_grad_guard();
        let src = to_tensor(received, dst.device())?;
        let _ = dst.f_add_(&src).map_err(torch)?;
        Ok(())
    }

    /// `dst = received`, on `dst`'s device.
    pub fn overwrite(dst: &mut Tensor, received: Received<'_>) -> Result<(), KernelError> {
        check(dst, received.len())?;
        let _guard = tch::no_grad_guard();
        let src = to_tensor(received, dst.device())?;
        dst.f_copy_(&src).map_err(torch)
    }

    /// `dst *= factor`, on `dst`'s device.
    pub fn scale(dst: &mut Tensor, factor: f64) -> Result<(), KernelError> {
        let _guard = tch::no_grad_guard();
        let _ = dst.f_mul_scalar_(factor).map_err(torch)?;
        Ok(())
    }

    /// Rounds every value to half precision and back (see `hora_common::kernel::round_to_f16`).
    pub fn round_to_f16(dst: &mut Tensor) -> Result<(), KernelError> {
        let _guard = tch::no_grad_guard();
        let rounded = dst
            .f_to_kind(Kind::Half)
            .map_err(torch)?
            .f_to_kind(Kind::Float)
            .map_err(torch)?;
        dst.f_copy_(&rounded).map_err(torch)
    }

    /// The tensor's values in host memory, as f32.
    pub fn to_host(src: &Tensor, out: &mut [f32]) -> Result<(), KernelError> {
        check(src, out.len())?;
        let host = src.f_to_device(Device::Cpu).map_err(torch)?;
        host.f_copy_data(out, out.len()).map_err(torch)
    }

    /// The tensor's values in host memory, as half-precision bits (narrowed on the device).
    pub fn to_host_f16(src: &Tensor, out: &mut [u16]) -> Result<(), KernelError> {
        check(src, out.len())?;
        let host = src
            .f_to_kind(Kind::Half)
            .map_err(torch)?
            .f_to_device(Device::Cpu)
            .map_err(torch)?;
        let n = out.len();
        host.f_copy_data(out.reinterpret_cast_mut::<half::f16>(), n)
            .map_err(torch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hora_common::kernel::WeightedSum;
    use hora_common::testing::{max_relative_error, reference, spec, updates};

    /// The devices to test on: the CPU always, CUDA when this machine has one.
    fn devices() -> Vec<Device> {
        let mut d = vec![Device::Cpu];
        if tch::Cuda::is_available() {
            d.push(Device::Cuda(0));
        } else {
            eprintln!("no CUDA device: testing the tch backend on the CPU only");
        }
        d
    }

    #[test]
    fn matches_f64_reference_and_cpu_backend() {
        let spec = spec(&[20_000, 17, 1]);
        let ups = updates(&spec, 1000, 7);
        let want = reference(&ups);
        let mut cpu = WeightedSum::new(spec.clone());
        for (w, m) in &ups {
            cpu.add(*w, m).unwrap();
        }
        let cpu = cpu.finish().unwrap();
        for device in devices() {
            let mut sum = TchWeightedSum::new(spec.clone(), device).unwrap();
            for (w, m) in &ups {
                sum.add_model(*w, m).unwrap();
            }
            let got = sum.finish_model().unwrap();
            let err = max_relative_error(got.data(), &want);
            assert!(err < 1e-6, "{device:?}: max relative error {err:e}");
            // Both accumulate in f64: they agree to within one f32 rounding step.
            for (a, b) in got.data().iter().zip(cpu.data()) {
                assert!(
                    (a - b).abs() <= f32::EPSILON * b.abs(),
                    "{device:?}: tch {a} vs cpu {b}"
                );
            }
        }
    }

    #[test]
    fn merge_and_refusals() {
        let spec = spec(&[64, 3]);
        let ups = updates(&spec, 10, 3);
        for device in devices() {
            let mut a = TchWeightedSum::new(spec.clone(), device).unwrap();
            let mut b = TchWeightedSum::new(spec.clone(), device).unwrap();
            let mut whole = TchWeightedSum::new(spec.clone(), device).unwrap();
            for (i, (w, m)) in ups.iter().enumerate() {
                if i % 3 == 0 { &mut a } else { &mut b }
                    .add_model(*w, m)
                    .unwrap();
                whole.add_model(*w, m).unwrap();
            }
            a.merge(&b).unwrap();
            assert_eq!(a.updates(), 10);
            let (x, y) = (a.finish_model().unwrap(), whole.finish_model().unwrap());
            for (p, q) in x.data().iter().zip(y.data()) {
                assert!((p - q).abs() <= 2.0 * f32::EPSILON * q.abs());
            }
            assert!(matches!(
                a.add(0.0, &Tensor::zeros([67], (Kind::Float, device))),
                Err(KernelError::BadWeight(_))
            ));
            assert!(matches!(
                a.add(1.0, &Tensor::zeros([66], (Kind::Float, device))),
                Err(KernelError::LayoutMismatch(_))
            ));
            assert!(matches!(
                a.add(1.0, &Tensor::zeros([67], (Kind::Int, device))),
                Err(KernelError::LayoutMismatch(_))
            ));
            assert_eq!(a.updates(), 10, "refused adds change nothing");
            let empty = TchWeightedSum::new(spec.clone(), device).unwrap();
            assert!(matches!(empty.finish(), Err(KernelError::Empty)));
        }
    }
}
