//! The models a client can train, as one type: a [`Network`] holds its parameters under the
//! names the task's weights use (`fc1.weight`, …) in a tch `VarStore` (so tch's optimizers train
//! them) and runs the forward pass.
//!
//! Two kinds, as the task's [`ModelKind`] says:
//! - built-in architectures written with `tch::nn`: multinomial logistic regression (`logreg`),
//!   a multi-layer perceptron (`mlp`) and the small MNIST-shaped CNN of the FedAvg paper (`cnn`);
//! - a TorchScript module (`torch.jit.script` in Python, saved as `.pt`) that the server hands
//!   out with the weights. Its parameters are trained in place from Rust: no Python on the device.

use std::path::Path;

use hora_common::model::Model;
use hora_common::wire::ModelKind;
use serde::{Deserialize, Serialize};
use tch::nn::{self, ModuleT};
use tch::{CModule, Device, Kind, Tensor};

use crate::error::{ClientError, Result};

/// A built-in architecture and its sizes (the task's `params`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name", rename_all = "snake_case", deny_unknown_fields)]
pub enum Architecture {
    /// Multinomial logistic regression: one linear layer.
    Logreg { inputs: usize, classes: usize },
    /// Linear layers with ReLU between them.
    Mlp {
        inputs: usize,
        hidden: Vec<usize>,
        classes: usize,
    },
    /// conv5×5(32) → pool → conv5×5(64) → pool → fc(512) → fc(classes), "same" padding.
    Cnn {
        channels: usize,
        height: usize,
        width: usize,
        classes: usize,
    },
}

fn bad_params(name: &str, e: impl std::fmt::Display) -> ClientError {
    ClientError::Training(format!(
        "the task's `{name}` parameters are invalid: {e} (logreg: inputs, classes; mlp: inputs, hidden, classes; cnn: channels, height, width, classes)"
    ))
}

impl Architecture {
    /// Reads a built-in model kind: its name and architecture parameters.
    pub fn from_builtin(
        name: &str,
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        let mut object = params.clone();
        object.insert("name".into(), serde_json::Value::String(name.into()));
        let arch: Architecture = serde_json::from_value(serde_json::Value::Object(object))
            .map_err(|e| bad_params(name, e))?;
        arch.validate().map_err(|e| bad_params(name, e))?;
        Ok(arch)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let dims: Vec<usize> = match self {
            Architecture::Logreg { inputs, classes } => vec![*inputs, *classes],
            Architecture::Mlp {
                inputs,
                hidden,
                classes,
            } => [*inputs, *classes]
                .into_iter()
                .chain(hidden.clone())
                .collect(),
            Architecture::Cnn {
                channels,
                height,
                width,
                classes,
            } => {
                if height % 4 != 0 || width % 4 != 0 {
                    return Err("height and width must be multiples of 4".into());
                }
                vec![*channels, *height, *width, *classes]
            }
        };
        if dims.iter().any(|&d| d == 0 || d > 1 << 24) {
            return Err("every size must be between 1 and 16777216".into());
        }
        Ok(())
    }

    /// The task's model kind for this architecture.
    pub fn to_kind(&self) -> ModelKind {
        let mut params = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => unreachable!("an architecture serialises to an object"),
        };
        let name = params
            .remove("name")
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        ModelKind::Builtin { name, params }
    }

    /// Classes the network has a logit for.
    pub fn classes(&self) -> usize {
        match self {
            Architecture::Logreg { classes, .. }
            | Architecture::Mlp { classes, .. }
            | Architecture::Cnn { classes, .. } => *classes,
        }
    }

    /// Values per sample the network reads.
    pub fn input_len(&self) -> usize {
        match self {
            Architecture::Logreg { inputs, .. } | Architecture::Mlp { inputs, .. } => *inputs,
            Architecture::Cnn {
                channels,
                height,
                width,
                ..
            } => channels * height * width,
        }
    }

    fn build(&self, root: &nn::Path<'_>) -> nn::SequentialT {
        let linear = |name: &str, i: usize, o: usize| {
            nn::linear(root / name, i as i64, o as i64, Default::default())
        };
        match self {
            Architecture::Logreg { inputs, classes } => nn::seq_t()
                .add_fn(|x| x.flatten(1, -1))
                .add(linear("linear", *inputs, *classes)),
            Architecture::Mlp {
                inputs,
                hidden,
                classes,
            } => {
                let mut seq = nn::seq_t().add_fn(|x| x.flatten(1, -1));
                let mut width = *inputs;
                for (i, &h) in hidden.iter().enumerate() {
                    seq = seq
                        .add(linear(&format!("fc{}", i + 1), width, h))
                        .add_fn(|x| x.relu());
                    width = h;
                }
                seq.add(linear(&format!("fc{}", hidden.len() + 1), width, *classes))
            }
            Architecture::Cnn {
                channels,
                height,
                width,
                classes,
            } => {
                let shape = [-1, *channels as i64, *height as i64, *width as i64];
                let conv = |name: &str, i: usize, o: usize| {
                    let config = nn::ConvConfig {
                        padding: 2,
                        ..Default::default()
                    };
                    nn::conv2d(root / name, i as i64, o as i64, 5, config)
                };
                let flat = 64 * (height / 4) * (width / 4);
                nn::seq_t()
                    .add_fn(move |x| x.view(shape))
                    .add(conv("conv1", *channels, 32))
                    .add_fn(|x| x.relu().max_pool2d_default(2))
                    .add(conv("conv2", 32, 64))
                    .add_fn(|x| x.relu().max_pool2d_default(2).flatten(1, -1))
                    .add(linear("fc1", flat, 512))
                    .add_fn(|x| x.relu())
                    .add(linear("fc2", 512, *classes))
            }
        }
    }
}

enum Body {
    Builtin(nn::SequentialT),
    Script(CModule),
}

/// A trainable model on one device, its parameters named as in the task's weights.
pub struct Network {
    vs: nn::VarStore,
    /// (model tensor name, variable), sorted by name like [`Model`]'s tensors.
    params: Vec<(String, Tensor)>,
    /// Whether each parameter may learn at all (a TorchScript module's frozen ones may not).
    learns: Vec<bool>,
    body: Body,
}

impl Network {
    /// A built-in architecture, freshly initialised (tch's default initialisers).
    pub fn builtin(arch: &Architecture, device: Device) -> Result<Self> {
        let vs = nn::VarStore::new(device);
        let body = Body::Builtin(arch.build(&vs.root()));
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let learns = vec![true; params.len()];
        Ok(Network {
            vs,
            params,
            learns,
            body,
        })
    }

    /// A TorchScript module; its parameters (as `named_parameters()` names them) are trained.
    pub fn torchscript(path: &Path, device: Device) -> Result<Self> {
        let module = CModule::load_on_device(path, device).map_err(|e| {
            ClientError::Training(format!(
                "loading the TorchScript module {}: {e} (it must be saved with torch.jit.save from a torch.jit.script-ed module)",
                path.display()
            ))
        })?;
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let mut params = Vec::new();
        for (name, tensor) in module.named_parameters()? {
            // VarStore paths may not contain dots; the model keeps the module's own names.
            // Parameters frozen in Python (requires_grad = False) stay frozen.
            let trainable = tensor.requires_grad();
            let var = root.add(&name.replace('.', "__"), tensor, trainable);
            params.push((name, var));
        }
        if params.is_empty() {
            return Err(ClientError::Training(format!(
                "the TorchScript module {} has no parameters to train",
                path.display()
            )));
        }
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let learns = params.iter().map(|(_, t)| t.requires_grad()).collect();
        Ok(Network {
            vs,
            params,
            learns,
            body: Body::Script(module),
        })
    }

    /// The network a task's model kind names (`module` is the downloaded TorchScript file).
    pub fn for_kind(kind: &ModelKind, module: Option<&Path>, device: Device) -> Result<Self> {
        match (kind, module) {
            (ModelKind::Builtin { name, params }, _) => {
                Network::builtin(&Architecture::from_builtin(name, params)?, device)
            }
            (ModelKind::TorchScript { .. }, Some(path)) => Network::torchscript(path, device),
            (ModelKind::TorchScript { .. }, None) => Err(ClientError::Training(
                "a TorchScript task needs its module downloaded first".into(),
            )),
        }
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// The trainable parameters, by model name.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Logits for a batch.
    pub fn forward(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match &mut self.body {
            Body::Builtin(seq) => Ok(seq.forward_t(xs, train)),
            Body::Script(module) => {
                if train {
                    module.f_set_train()?;
                } else {
                    module.f_set_eval()?;
                }
                Ok(module.forward_ts(&[xs])?)
            }
        }
    }

    /// Trains only the parameters `trainable` names (sorted; every one when None): a task's
    /// frozen base gets no gradients. A module's own frozen parameters stay frozen.
    pub fn train_only(&mut self, trainable: Option<&[String]>) {
        for ((name, var), learns) in self.params.iter_mut().zip(&self.learns) {
            let on = *learns && trainable.is_none_or(|t| t.binary_search(name).is_ok());
            if var.requires_grad() != on {
                let _ = var.set_requires_grad(on);
            }
        }
    }

    /// Loads `model`'s values into the parameters; names and shapes must match exactly.
    pub fn set_weights(&mut self, model: &Model) -> Result<()> {
        let ours: Vec<(&str, Vec<usize>)> = self
            .params
            .iter()
            .map(|(n, t)| (n.as_str(), t.size().iter().map(|&d| d as usize).collect()))
            .collect();
        let theirs: Vec<(&str, Vec<usize>)> = model
            .tensors()
            .iter()
            .map(|t| (t.name.as_str(), t.shape.clone()))
            .collect();
        if ours != theirs {
            return Err(ClientError::Training(format!(
                "the task's weights do not fit the model: it has {theirs:?}, the network {ours:?}"
            )));
        }
        tch::no_grad(|| -> Result<()> {
            for ((_, var), info) in self.params.iter_mut().zip(model.tensors()) {
                let values = &model.data()[info.offset..info.offset + info.len];
                let src = Tensor::from_slice(values).view(var.size().as_slice());
                var.f_copy_(&src)?;
            }
            Ok(())
        })
    }

    /// The parameters as a [`Model`].
    pub fn weights(&self) -> Result<Model> {
        let mut tensors = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let flat = var
                .detach()
                .to_device(Device::Cpu)
                .to_kind(Kind::Float)
                .flatten(0, -1);
            let values = Vec::<f32>::try_from(&flat)?;
            let shape = var.size().iter().map(|&d| d as usize).collect();
            tensors.push((name.clone(), shape, values));
        }
        Ok(Model::from_tensors(tensors)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_round_trip_through_the_task_kind() {
        for arch in [
            Architecture::Logreg {
                inputs: 60,
                classes: 10,
            },
            Architecture::Mlp {
                inputs: 784,
                hidden: vec![200, 200],
                classes: 10,
            },
            Architecture::Cnn {
                channels: 1,
                height: 28,
                width: 28,
                classes: 10,
            },
        ] {
            let ModelKind::Builtin { name, params } = arch.to_kind() else {
                panic!("builtin")
            };
            assert_eq!(Architecture::from_builtin(&name, &params).unwrap(), arch);
        }
        let bad = serde_json::json!({"inputs": 0, "classes": 10});
        let err = Architecture::from_builtin("logreg", bad.as_object().unwrap()).unwrap_err();
        assert!(err.to_string().contains("between 1 and"), "{err}");
        let typo = serde_json::json!({"inputz": 3, "classes": 10});
        assert!(Architecture::from_builtin("logreg", typo.as_object().unwrap()).is_err());
        assert!(Architecture::from_builtin("resnet", &Default::default()).is_err());
    }

    #[test]
    fn weights_round_trip_and_names_follow_the_layers() {
        let arch = Architecture::Mlp {
            inputs: 6,
            hidden: vec![5],
            classes: 3,
        };
        let mut net = Network::builtin(&arch, Device::Cpu).unwrap();
        let w = net.weights().unwrap();
        let names: Vec<_> = w.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);
        assert_eq!(w.tensor("fc1.weight").unwrap().len(), 30);

        let mut other = w.clone();
        for (i, v) in other.data_mut().iter_mut().enumerate() {
            *v = i as f32 * 0.01;
        }
        net.set_weights(&other).unwrap();
        assert_eq!(net.weights().unwrap(), other);
        let out = net.forward(&Tensor::ones([4, 6], (Kind::Float, Device::Cpu)), false);
        assert_eq!(out.unwrap().size(), [4, 3]);

        let wrong = Model::from_tensors([("fc1.weight", vec![5, 6], vec![0.0; 30])]).unwrap();
        let err = net.set_weights(&wrong).unwrap_err().to_string();
        assert!(err.contains("do not fit"), "{err}");
    }

    #[test]
    fn the_cnn_takes_images() {
        let arch = Architecture::Cnn {
            channels: 1,
            height: 28,
            width: 28,
            classes: 10,
        };
        let mut net = Network::builtin(&arch, Device::Cpu).unwrap();
        let out = net
            .forward(&Tensor::zeros([2, 784], (Kind::Float, Device::Cpu)), true)
            .unwrap();
        assert_eq!(out.size(), [2, 10]);
        // The FedAvg paper's CNN: 1,663,370 parameters.
        assert_eq!(net.weights().unwrap().numel(), 1_663_370);
    }
}
