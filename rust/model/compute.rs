//! Where the model computes: tinyloop's own CPU kernels on plain rows (the default), or candle tensors on a candle
//! device — a CUDA GPU, or candle's CPU device, which runs the same device code on the host so that the suite can
//! check it token for token against the CPU engine on machines without a GPU (docs/gpu.md).

use candle_core::Device;

use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub enum Compute {
    /// tinyloop's own kernels (`kernels/`) on plain rows: the CPU engine.
    Host,
    /// candle's ops on `Device`: weights, hidden states and the KV cache live there; logits come back to the host.
    Device(Device),
}

/// The device names `Engine` and `tinyloop-serve --device` take.
pub const DEVICE_NAMES: &str = "\"cpu\", \"cuda\", \"cuda:N\" or \"candle-cpu\"";

impl Compute {
    /// `"cpu"` (the CPU engine), `"cuda"` / `"cuda:N"` (GPU N through candle's CUDA backend), or `"candle-cpu"` (the
    /// device code on candle's CPU device: slower than `"cpu"`, for checking the device path without a GPU).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "cpu" => Ok(Self::Host),
            "candle-cpu" => Ok(Self::Device(Device::Cpu)),
            "cuda" => Self::cuda(0),
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(ordinal)) => Self::cuda(ordinal),
                _ => Err(Error::InvalidArgument(format!("unknown device {name:?}; one of {DEVICE_NAMES}"))),
            },
        }
    }

    fn cuda(ordinal: usize) -> Result<Self> {
        if !cfg!(feature = "cuda") {
            return Err(Error::Device(format!(
                "device \"cuda:{ordinal}\": this build of tinyloop has no CUDA support; install the CUDA build \
                 (docs/gpu.md) or use device \"cpu\""
            )));
        }
        Device::new_cuda(ordinal)
            .map(Self::Device)
            .map_err(|e| Error::Device(format!("device \"cuda:{ordinal}\": no usable NVIDIA GPU or driver ({e})")))
    }

    /// The device tensors live on (`Device::Cpu` for the CPU engine's own rows).
    pub fn device(&self) -> &Device {
        match self {
            Self::Host => &Device::Cpu,
            Self::Device(d) => d,
        }
    }

    /// Whether the model runs through candle's device code (on a GPU or on candle's CPU device).
    pub fn on_device(&self) -> bool {
        matches!(self, Self::Device(_))
    }

    /// The name `model_info` and `/health` report: "cpu", "cuda:N" or "candle-cpu".
    pub fn name(&self) -> String {
        match self {
            Self::Host => "cpu".into(),
            Self::Device(Device::Cpu) => "candle-cpu".into(),
            Self::Device(Device::Cuda(_)) => match self.device().location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
                _ => "cuda".into(),
            },
            Self::Device(Device::Metal(_)) => "metal".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_ones_are_refused_by_name() {
        assert!(matches!(Compute::parse("cpu"), Ok(Compute::Host)));
        assert_eq!(Compute::parse("candle-cpu").unwrap().name(), "candle-cpu");
        for bad in ["gpu", "cuda:x", "cuda:", "CPU"] {
            let e = Compute::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")) && e.contains("candle-cpu"), "{e}");
        }
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_so() {
        for name in ["cuda", "cuda:1"] {
            let e = Compute::parse(name).unwrap_err();
            assert!(matches!(e, Error::Device(_)), "{e}");
            assert!(e.to_string().contains("no CUDA support"), "{e}");
        }
    }
}
