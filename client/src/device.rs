//! Where training runs: the user says `auto`, `cpu`, `cuda` or `cuda:N`; this module turns that
//! into a [`tch::Device`] and tells the user what to do when the choice cannot be honoured.

use std::str::FromStr;

use tch::Device;
use thiserror::Error;

/// A device as the user asked for it (`auto`, `cpu`, `cuda` or `cuda:N`; so in files too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceChoice {
    /// The first CUDA device if there is one, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum DeviceError {
    #[error("unknown device `{0}`: use auto, cpu, cuda or cuda:N")]
    Unknown(String),
    #[error("CUDA device {asked} requested, but {available} CUDA device(s) are visible: use --device cpu, or check the driver and CUDA_VISIBLE_DEVICES")]
    Unavailable { asked: usize, available: usize },
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| DeviceError::Unknown(s.to_string())),
        }
    }
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceChoice::Auto => f.write_str("auto"),
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl TryFrom<String> for DeviceChoice {
    type Error = DeviceError;

    fn try_from(s: String) -> Result<Self, DeviceError> {
        s.parse()
    }
}

impl From<DeviceChoice> for String {
    fn from(d: DeviceChoice) -> String {
        d.to_string()
    }
}

impl DeviceChoice {
    /// Resolves the choice against the devices this process can see.
    pub fn resolve(self) -> Result<Device, DeviceError> {
        let available = tch::Cuda::device_count().max(0) as usize;
        match self {
            DeviceChoice::Cpu => Ok(Device::Cpu),
            DeviceChoice::Auto if available > 0 => Ok(Device::Cuda(0)),
            DeviceChoice::Auto => Ok(Device::Cpu),
            DeviceChoice::Cuda(asked) if asked < available => Ok(Device::Cuda(asked)),
            DeviceChoice::Cuda(asked) => Err(DeviceError::Unavailable { asked, available }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_users_type() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("CPU".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert!(matches!(
            "tpu".parse::<DeviceChoice>(),
            Err(DeviceError::Unknown(_))
        ));
        assert!(matches!(
            "cuda:x".parse::<DeviceChoice>(),
            Err(DeviceError::Unknown(_))
        ));
    }

    #[test]
    fn resolves_against_the_visible_devices() {
        let n = tch::Cuda::device_count() as usize;
        assert_eq!(DeviceChoice::Cpu.resolve(), Ok(Device::Cpu));
        let auto = DeviceChoice::Auto.resolve().unwrap();
        assert_eq!(auto, if n > 0 { Device::Cuda(0) } else { Device::Cpu });
        assert_eq!(
            DeviceChoice::Cuda(n).resolve(),
            Err(DeviceError::Unavailable {
                asked: n,
                available: n
            })
        );
        // A real tensor op on the resolved device works.
        let t = tch::Tensor::ones([4], (tch::Kind::Float, auto));
        assert_eq!(t.sum(tch::Kind::Float).double_value(&[]), 4.0);
    }
}
