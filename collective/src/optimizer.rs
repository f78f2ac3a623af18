//! The training API of the sync mode, with Horovod's rules built in:
//!
//! - [`DistributedOptimizer::broadcast_state`]: every rank starts from rank 0's parameters and
//!   optimizer state (fresh, or restored from a checkpoint), whatever its own initialisation;
//! - [`DistributedOptimizer::backward_step`]: backward, and after `backward_passes_per_step`
//!   local passes (gradient accumulation) the gradients are averaged over the ranks — fused,
//!   on the ring — and the optimizer steps, identically everywhere;
//! - [`LrScaling`]: the learning rate scaled by the world size (the global batch grows with it).
//!
//! The optimizer itself ([`SyncOptimizer`]: SGD with momentum, Adam) keeps its state in plain
//! tensors rather than inside libtorch's optimizer object, so that state can be broadcast from
//! rank 0 and written to checkpoints — the momentum of a resumed job is the momentum it had.

use tch::Tensor;

use crate::fusion::Fusion;
use crate::nccl::Want;
use crate::ring::{Communicator, Reduce};
use crate::{CollectiveError, Result};

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    /// PyTorch's SGD: `buf = momentum·buf + g; p -= lr·buf` (plain SGD with momentum 0).
    Sgd { momentum: f64, weight_decay: f64 },
    /// Adam (Kingma & Ba) with bias correction, as PyTorch's.
    Adam {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
}

/// Whether a world whose tensors are on GPUs averages them through NCCL.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum UseNccl {
    /// When every rank's tensors are on a GPU and every rank can load NCCL; else the ring
    /// averages them on each rank's device.
    #[default]
    Auto,
    /// Always: a rank that cannot use NCCL fails the world (naming it and why).
    On,
    /// Never: the ring averages on each rank's device (a GPU's tensors pass through host memory).
    Off,
}

impl UseNccl {
    /// Forms NCCL on `comm` for tensors on `device`, as this choice says. Every rank of the
    /// world calls it, whatever its choice (one that is `Off` says so): each learns whether all
    /// can, so all use NCCL or none does. Returns NCCL's version when it is used.
    pub fn attach(self, comm: &mut Communicator, device: tch::Device) -> Result<Option<String>> {
        let want = match (self, device) {
            (UseNccl::Off, _) => Want::Off,
            (_, tch::Device::Cuda(i)) => Want::Cuda(i32::try_from(i).unwrap_or(i32::MAX)),
            _ => Want::Cpu,
        };
        comm.attach_nccl(want, self == UseNccl::On)
    }
}

/// How the learning rate follows the world size.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    /// `lr × world size` (Goyal et al.; Horovod's advice): each rank keeps its batch size, so the
    /// global batch, and with it the step size, grows with the world.
    #[default]
    Linear,
    /// The learning rate as given.
    None,
}

impl LrScaling {
    pub fn apply(self, lr: f64, world_size: u32) -> f64 {
        match self {
            LrScaling::Linear => lr * f64::from(world_size),
            LrScaling::None => lr,
        }
    }
}

impl std::str::FromStr for LrScaling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "linear" => Ok(LrScaling::Linear),
            "none" => Ok(LrScaling::None),
            _ => Err(format!(
                "unknown learning-rate scaling `{s}`: use linear or none"
            )),
        }
    }
}

/// An optimizer whose state is a list of named tensors.
#[derive(Debug)]
pub struct SyncOptimizer {
    params: Vec<(String, Tensor)>,
    algorithm: Algorithm,
    lr: f64,
    /// Per parameter: SGD's momentum buffer, or Adam's first and second moments.
    state: Vec<Vec<Tensor>>,
    steps: u64,
}

impl SyncOptimizer {
    /// An optimizer over `params` (shallow clones of the variables) with zeroed state.
    pub fn new(params: &[(String, Tensor)], algorithm: Algorithm, lr: f64) -> Result<Self> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(CollectiveError::Config(format!(
                "the learning rate must be a positive number, not {lr}"
            )));
        }
        let buffers = match algorithm {
            Algorithm::Sgd { momentum: 0.0, .. } => 0,
            Algorithm::Sgd { .. } => 1,
            Algorithm::Adam { .. } => 2,
        };
        let state = params
            .iter()
            .map(|(_, p)| (0..buffers).map(|_| p.zeros_like()).collect())
            .collect();
        Ok(SyncOptimizer {
            params: params
                .iter()
                .map(|(n, p)| (n.clone(), p.shallow_clone()))
                .collect(),
            algorithm,
            lr,
            state,
            steps: 0,
        })
    }

    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// A new learning rate from the next step on (an elastic job's world changed size).
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(CollectiveError::Config(format!(
                "the learning rate must be a positive number, not {lr}"
            )));
        }
        self.lr = lr;
        Ok(())
    }

    /// A copy of the parameters, the state and the step count, in memory (an elastic job's
    /// commit, like `hvd.elastic.State.commit`).
    pub fn snapshot(&self) -> Result<Snapshot> {
        let _guard = tch::no_grad_guard();
        let tensors = self
            .params
            .iter()
            .map(|(_, p)| p)
            .chain(self.state.iter().flatten())
            .map(|t| {
                let mut copy = t.f_empty_like()?;
                copy.f_copy_(t)?;
                Ok(copy)
            })
            .collect::<Result<_>>()?;
        Ok(Snapshot {
            tensors,
            steps: self.steps,
        })
    }

    /// Puts back what [`Self::snapshot`] copied (an elastic job's rollback after a lost
    /// worker).
    pub fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let live: Vec<Tensor> = self
            .params
            .iter()
            .map(|(_, p)| p.shallow_clone())
            .chain(self.state.iter().flatten().map(Tensor::shallow_clone))
            .collect();
        if live.len() != snapshot.tensors.len() {
            return Err(CollectiveError::Config(
                "the snapshot is of another optimizer".into(),
            ));
        }
        for (mut t, saved) in live.into_iter().zip(&snapshot.tensors) {
            t.f_copy_(saved)?;
        }
        self.steps = snapshot.steps;
        Ok(())
    }

    /// Optimizer steps taken (restored from checkpoints: Adam's bias correction depends on it).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// The state tensors, named `{parameter}/{buffer}`.
    pub fn state(&self) -> Vec<(String, Tensor)> {
        let names: &[&str] = match self.algorithm {
            Algorithm::Sgd { .. } => &["momentum"],
            Algorithm::Adam { .. } => &["exp_avg", "exp_avg_sq"],
        };
        self.params
            .iter()
            .zip(&self.state)
            .flat_map(|((p, _), buffers)| {
                buffers
                    .iter()
                    .zip(names)
                    .map(move |(b, n)| (format!("{p}/{n}"), b.shallow_clone()))
            })
            .collect()
    }

    /// The gradients, one per parameter (a parameter without one is an error: every rank must
    /// reduce the same list).
    pub fn gradients(&self) -> Result<Vec<Tensor>> {
        self.params
            .iter()
            .map(|(name, p)| {
                let g = p.grad();
                if g.defined() {
                    Ok(g)
                } else {
                    Err(CollectiveError::Config(format!(
                        "parameter {name} has no gradient: call backward on a loss that uses every parameter"
                    )))
                }
            })
            .collect()
    }

    pub fn zero_grad(&mut self) {
        for (_, p) in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// One update from the current gradients.
    pub fn step(&mut self) -> Result<()> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        let t = self.steps as i32;
        for ((_, p), state) in self.params.iter().zip(&mut self.state) {
            let mut p = p.shallow_clone();
            let mut g = p.grad();
            if !g.defined() {
                continue;
            }
            match self.algorithm {
                Algorithm::Sgd {
                    momentum,
                    weight_decay,
                } => {
                    if weight_decay != 0.0 {
                        g = g.f_add(&(&p * weight_decay))?;
                    }
                    if let Some(buf) = state.first_mut() {
                        let _ = buf.f_mul_scalar_(momentum)?.f_add_(&g)?;
                        let _ = p.f_sub_(&(&*buf * self.lr))?;
                    } else {
                        let _ = p.f_sub_(&(&g * self.lr))?;
                    }
                }
                Algorithm::Adam {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                } => {
                    if weight_decay != 0.0 {
                        g = g.f_add(&(&p * weight_decay))?;
                    }
                    let (m, v) = state.split_at_mut(1);
                    let (m, v) = (&mut m[0], &mut v[0]);
                    let _ = m.f_mul_scalar_(beta1)?.f_add_(&(&g * (1.0 - beta1)))?;
                    let _ = v
                        .f_mul_scalar_(beta2)?
                        .f_add_(&(g.f_square()? * (1.0 - beta2)))?;
                    let c1 = 1.0 - beta1.powi(t);
                    let c2 = 1.0 - beta2.powi(t);
                    let denom = (v.f_div_scalar(c2)?.f_sqrt()?).f_add_scalar(eps)?;
                    let _ = p.f_sub_(&(m.f_div(&denom)? * (self.lr / c1)))?;
                }
            }
        }
        Ok(())
    }
}

/// The parameters, optimizer state and step count of a [`SyncOptimizer`] at a commit.
#[derive(Debug)]
pub struct Snapshot {
    tensors: Vec<Tensor>,
    steps: u64,
}

impl Snapshot {
    /// The step count at the commit.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

/// An optimizer that averages gradients over the ranks before each step.
pub struct DistributedOptimizer {
    optimizer: SyncOptimizer,
    comm: Communicator,
    fusion: Fusion,
    backward_passes_per_step: u32,
    passes: u32,
}

impl DistributedOptimizer {
    pub fn new(
        optimizer: SyncOptimizer,
        comm: Communicator,
        fusion: Fusion,
        backward_passes_per_step: u32,
    ) -> Result<Self> {
        if backward_passes_per_step == 0 {
            return Err(CollectiveError::Config(
                "backward_passes_per_step must be at least 1".into(),
            ));
        }
        Ok(DistributedOptimizer {
            optimizer,
            comm,
            fusion,
            backward_passes_per_step,
            passes: 0,
        })
    }

    pub fn comm(&mut self) -> &mut Communicator {
        &mut self.comm
    }

    /// The optimizer back, the communicator dropped (an elastic job's world ended).
    pub fn into_optimizer(self) -> SyncOptimizer {
        self.optimizer
    }

    pub fn optimizer(&self) -> &SyncOptimizer {
        &self.optimizer
    }

    pub fn optimizer_mut(&mut self) -> &mut SyncOptimizer {
        &mut self.optimizer
    }

    /// Rank `root`'s parameters and optimizer state (and step count) on every rank.
    pub fn broadcast_state(&mut self, root: u32) -> Result<()> {
        let mut tensors: Vec<Tensor> = self
            .optimizer
            .parameters()
            .iter()
            .map(|(_, p)| p.shallow_clone())
            .collect();
        tensors.extend(self.optimizer.state().into_iter().map(|(_, t)| t));
        self.fusion.broadcast(&mut self.comm, &tensors, root)?;
        // The step count exactly (a tensor broadcast would go through f32).
        let all = self.comm.allgather(&self.optimizer.steps().to_le_bytes())?;
        let steps = all
            .get(root as usize)
            .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| {
                CollectiveError::Protocol(format!("rank {root} sent a malformed step count"))
            })?;
        self.optimizer.set_steps(steps);
        Ok(())
    }

    /// Backpropagates `loss`; on every `backward_passes_per_step`-th call averages the
    /// accumulated gradients (over the passes and over the ranks) and steps. Returns whether it
    /// stepped.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<bool> {
        loss.f_backward()?;
        self.passes += 1;
        if self.passes < self.backward_passes_per_step {
            return Ok(false);
        }
        self.passes = 0;
        let grads = self.optimizer.gradients()?;
        if self.backward_passes_per_step > 1 {
            let _guard = tch::no_grad_guard();
            for g in &grads {
                let _ = g
                    .shallow_clone()
                    .f_div_scalar_(f64::from(self.backward_passes_per_step))?;
            }
        }
        self.fusion
            .allreduce(&mut self.comm, &grads, Reduce::Average)?;
        self.optimizer.step()?;
        self.optimizer.zero_grad();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{nn, Device, Kind};

    fn train(step: &mut dyn FnMut(&Tensor), vs: &nn::VarStore, lin: &nn::Linear) -> Vec<f32> {
        let xs = Tensor::randn([16, 5], (Kind::Float, Device::Cpu));
        let ys = Tensor::randn([16, 3], (Kind::Float, Device::Cpu));
        for _ in 0..5 {
            let loss = xs.apply(lin).mse_loss(&ys, tch::Reduction::Mean);
            step(&loss);
        }
        let _ = vs;
        Vec::<f32>::try_from(&lin.ws.flatten(0, -1)).unwrap()
    }

    fn ours(algorithm: Algorithm) -> Vec<f32> {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root(), 5, 3, Default::default());
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut opt = SyncOptimizer::new(&vars, algorithm, 0.05).unwrap();
        train(
            &mut |loss| {
                opt.zero_grad();
                loss.backward();
                opt.step().unwrap();
            },
            &vs,
            &lin,
        )
    }

    fn theirs(config: impl nn::OptimizerConfig) -> Vec<f32> {
        tch::manual_seed(7);
        let vs = nn::VarStore::new(Device::Cpu);
        let lin = nn::linear(vs.root(), 5, 3, Default::default());
        let mut opt = config.build(&vs, 0.05).unwrap();
        train(&mut |loss| opt.backward_step(loss), &vs, &lin)
    }

    fn assert_close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{what}: {x} vs {y}");
        }
        assert!(
            a.iter().any(|x| x.abs() > 1e-3),
            "{what}: the weights moved"
        );
    }

    /// Our SGD and Adam step exactly like libtorch's own optimizers.
    #[test]
    fn steps_match_libtorch() {
        let sgd = Algorithm::Sgd {
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let torch_sgd = nn::Sgd {
            momentum: 0.9,
            wd: 0.01,
            ..Default::default()
        };
        assert_close(&ours(sgd), &theirs(torch_sgd), "sgd");
        let adam = Algorithm::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert_close(&ours(adam), &theirs(nn::Adam::default()), "adam");
        assert_ne!(ours(sgd), ours(adam));
    }
}
