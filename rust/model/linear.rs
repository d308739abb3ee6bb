//! Linear layers. F16 and F32 weights, and Q4_0 / Q8_0 where the CPU has AVX2, go through tinyloop's own kernels
//! (`kernels::dense`, `kernels::blockq`), whose outputs do not depend on how many rows are multiplied together;
//! other quantized weights through candle's `QMatMul`. On a candle device (`Compute::Device`) every weight is a
//! `DevWeight`: dense types as tensors in their own type (cuBLAS on a GPU), block types through candle's quantized
//! matmul kernels.

use std::sync::Arc;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use super::compute::Compute;
use crate::error::{Error, Result};
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use crate::kernels::blockq::{Body, Codes, QMatrix};
use crate::kernels::dense::{DenseMatrix, F16Matrix};
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
use crate::kernels::isa;
use crate::kernels::panels::PANEL;
use crate::kernels::Kernel;

#[derive(Clone)]
pub enum Linear {
    Quantized(QMatMul),
    /// F16 and F32; Q4_0 and Q8_0 through `kernels::blockq`, where the CPU runs one of its bodies.
    Own(Arc<dyn Kernel>),
    /// A weight on a candle device.
    Device(DevWeight),
}

#[derive(Clone)]
pub enum DevWeight {
    /// F32, F16 and BF16 weights in their own type, `(n, k)`: each product casts its input to that type and its
    /// output back to f32 (the residual stream's type), so a half weight is read as half.
    Dense(Tensor),
    /// Q4_0, Q8_0 and the other block types, on the device in their GGUF blocks.
    Blocks(QMatMul),
}

impl DevWeight {
    /// The host tensor `t`'s bytes, on `device`.
    pub fn new(t: &QTensor, device: &Device) -> Result<Self> {
        let dims = t.shape().dims().to_vec();
        Ok(match t.dtype() {
            GgmlDType::F32 => Self::Dense(t.dequantize(&Device::Cpu)?.to_device(device)?),
            GgmlDType::F16 => Self::Dense(t.dequantize_f16(&Device::Cpu)?.to_device(device)?),
            GgmlDType::BF16 => {
                let raw = t.data()?;
                let values: Vec<half::bf16> =
                    raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]])).collect();
                Self::Dense(Tensor::from_vec(values, dims, &Device::Cpu)?.to_device(device)?)
            }
            dtype => Self::Blocks(QMatMul::from_arc(Arc::new(qtensor_from_ggml(dtype, &t.data()?, dims, device)?))?),
        })
    }

    /// `x · Wᵀ`: `(m, k)` f32 to `(m, n)` f32, on the weight's device.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Dense(w) if w.dtype() == DType::F32 => x.matmul(&w.t()?)?,
            Self::Dense(w) => x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(DType::F32)?,
            Self::Blocks(q) => q.forward(x)?,
        })
    }
}

impl Linear {
    /// The weight where `compute` runs: the CPU engine's kernels (`new`), or a `DevWeight` on the device.
    pub fn on(t: Arc<QTensor>, compute: &Compute) -> Result<Self> {
        match compute {
            Compute::Host => Self::new(t),
            Compute::Device(device) => Ok(Self::Device(DevWeight::new(&t, device)?)),
        }
    }

    pub fn new(t: Arc<QTensor>) -> Result<Self> {
        if !Self::owns(&t)? {
            return Ok(Self::Quantized(QMatMul::from_arc(t)?));
        }
        let own: Arc<dyn Kernel> = match t.dtype() {
            GgmlDType::F16 => Arc::new(F16Matrix::new(&t)?),
            GgmlDType::F32 => Arc::new(DenseMatrix::<f32>::new(&t)?),
            // BF16 widens to f32 exactly; the CPU has no bf16 kernel of its own (a device reads it as bf16).
            GgmlDType::BF16 => {
                let wide = QTensor::quantize(&t.dequantize(&Device::Cpu)?, GgmlDType::F32)?;
                Arc::new(DenseMatrix::<f32>::new(&wide)?)
            }
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            GgmlDType::Q4_0 => Arc::new(QMatrix::new(&t, Codes::Nibbles)?),
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            GgmlDType::Q8_0 => Arc::new(QMatrix::new(&t, Codes::Bytes)?),
            dtype => return Err(Error::Internal(format!("no kernel of ours for {dtype:?}"))),
        };
        Ok(Self::Own(own))
    }

    /// Whether tinyloop's own kernels take `t` (else candle's `QMatMul` does).
    fn owns(t: &QTensor) -> Result<bool> {
        Ok(match t.dtype() {
            // F32 too: candle's f32 GEMM gives a row different bits depending on how many rows it is multiplied
            // with (from 5 rows on), which would let batch-mates change a request's output.
            GgmlDType::F16 | GgmlDType::F32 | GgmlDType::BF16 => true,
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            GgmlDType::Q4_0 => Body::best().is_some(),
            // With VNNI, Q8_0 keeps candle's repacked VNNI kernel where it applies (faster at one row than ours);
            // ours takes the shapes it does not (the default model's 704-wide ffn_down), and every shape below
            // AVX-512 (candle would still pick its AVX-512 code there, past a lower `TINYLOOP_ISA`).
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            GgmlDType::Q8_0 => Body::best().is_some() && !(isa::vnni() && candle_repacks_q8_0(t)?),
            _ => false,
        })
    }

    /// `x · Wᵀ`: `(m, k)` to `(m, n)` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Quantized(q) => Ok(q.forward(x)?),
            Self::Own(w) => {
                let (m, _) = x.dims2()?;
                let out = self.forward_rows(&x.flatten_all()?.to_vec1::<f32>()?, m)?;
                Ok(Tensor::from_vec(out, (m, w.rows()), &Device::Cpu)?)
            }
            Self::Device(w) => w.forward(x),
        }
    }

    /// `x · Wᵀ` on plain rows: `m` rows of `k` values to `m` rows of `n`.
    pub fn forward_rows(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        match self {
            Self::Quantized(q) => {
                let t = Tensor::from_slice(x, (m, x.len() / m.max(1)), &Device::Cpu)?;
                Ok(q.forward(&t)?.flatten_all()?.to_vec1::<f32>()?)
            }
            Self::Own(w) => {
                let mut out = vec![0f32; m * w.rows()];
                w.matmul(x, m, &mut out);
                Ok(out)
            }
            Self::Device(_) => Err(on_device("a product on host rows")),
        }
    }

    /// Rows `ids` of the weight as f32, `(ids.len(), k)` (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Self::Quantized(q) => {
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
                Ok(q.embedding(&ids)?.to_dtype(candle_core::DType::F32)?)
            }
            Self::Own(w) => {
                let k = w.width();
                let mut out = vec![0f32; ids.len() * k];
                for (dst, &id) in out.chunks_exact_mut(k).zip(ids) {
                    w.row(id as usize, dst);
                }
                Ok(Tensor::from_vec(out, (ids.len(), k), &Device::Cpu)?)
            }
            Self::Device(_) => Err(on_device("an embedding lookup")),
        }
    }
}

/// Weights that multiply the same input (Q, K, V; gate, up), as one stacked weight where that gives every output
/// the same bits (all of them tinyloop's own kernels, each a whole number of panels: each output's arithmetic is its
/// own, whatever the rows beside it), else each apart. One product instead of three halves the hand-offs of a decode
/// step's small products (`kernels::team`).
pub enum Group {
    Stacked(Linear, Vec<usize>),
    Apart(Vec<Linear>),
}

impl Group {
    pub fn new(parts: Vec<QTensor>) -> Result<Self> {
        let widths: Vec<usize> = parts.iter().map(|t| t.shape().dims()[0]).collect();
        let k = parts[0].shape().dims2()?.1;
        let mut stack =
            parts.iter().all(|t| t.dtype() == parts[0].dtype() && t.shape().dims2().is_ok_and(|d| d.1 == k))
                && widths.iter().all(|n| n.is_multiple_of(PANEL));
        for t in &parts {
            stack = stack && Linear::owns(t)?;
        }
        if stack {
            let mut bytes = Vec::new();
            for t in &parts {
                bytes.extend_from_slice(&t.data()?);
            }
            let stacked = qtensor_from_ggml(parts[0].dtype(), &bytes, vec![widths.iter().sum(), k], &Device::Cpu)?;
            if Linear::owns(&stacked)? {
                return Ok(Self::Stacked(Linear::new(Arc::new(stacked))?, widths));
            }
        }
        Ok(Self::Apart(parts.into_iter().map(|t| Linear::new(Arc::new(t))).collect::<Result<_>>()?))
    }

    /// Whether every product runs tinyloop's own kernels.
    pub fn own_kernels(&self) -> bool {
        match self {
            Self::Stacked(..) => true,
            Self::Apart(each) => each.iter().all(|l| matches!(l, Linear::Own(_))),
        }
    }

    /// Each member's `x · Wᵀ` for the `m` rows of `x`, in order.
    pub fn forward_rows(&self, x: &[f32], m: usize) -> Result<Vec<Vec<f32>>> {
        match self {
            Self::Apart(each) => each.iter().map(|l| l.forward_rows(x, m)).collect(),
            Self::Stacked(l, widths) => {
                let all = l.forward_rows(x, m)?;
                let total: usize = widths.iter().sum();
                let mut outs: Vec<Vec<f32>> = widths.iter().map(|w| Vec::with_capacity(m * w)).collect();
                for row in all.chunks_exact(total) {
                    let mut at = 0;
                    for (out, &w) in outs.iter_mut().zip(widths) {
                        out.extend_from_slice(&row[at..at + w]);
                        at += w;
                    }
                }
                Ok(outs)
            }
        }
    }
}

/// The device path embeds on the host and multiplies on the device tensors; the host-row calls are the CPU
/// engine's.
fn on_device(what: &str) -> Error {
    Error::Internal(format!("{what} was asked of a weight on a device"))
}

/// Whether candle 0.11 runs this Q8_0 matrix through its repacked AVX-512 VNNI tiles: output count a multiple of 16
/// and input width a multiple of 256 (its `repack_x86::select`).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn candle_repacks_q8_0(t: &QTensor) -> Result<bool> {
    let (n, k) = t.shape().dims2()?;
    Ok(n % 16 == 0 && k % 256 == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    fn weight(n: usize, k: usize) -> (Vec<f32>, QTensor) {
        let w: Vec<f32> = (0..n * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
        let w16: Vec<f32> = w.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        let t = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap();
        (w16, QTensor::quantize(&t, GgmlDType::F16).unwrap())
    }

    #[test]
    fn f16_matmul_matches_f64_and_is_independent_of_the_row_count() {
        // m = 14: row blocks of 6, 6 and 2; m = 1 one row per pass.
        for &(n, k, m) in &[(33, 40, 3), (50, 256, 5), (1030, 704, 9), (130, 96, 14)] {
            let (w, q) = weight(n, k);
            let lin = Linear::new(Arc::new(q)).unwrap();
            let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
            let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
            let all = lin.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
            for i in 0..m {
                let one = lin.forward(&xt.narrow(0, i, 1).unwrap()).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(one[0], all[i], "row {i} differs when multiplied alone (n {n}, k {k})");
                for j in 0..n {
                    let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                    assert!(
                        (all[i][j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "({i}, {j}): {} vs {want}",
                        all[i][j]
                    );
                }
            }
        }
    }

    #[test]
    fn f16_rows_are_the_widened_weight_rows() {
        let (w, q) = weight(20, 48);
        let lin = Linear::new(Arc::new(q)).unwrap();
        let got = lin.rows(&[3, 0, 19]).unwrap().to_vec2::<f32>().unwrap();
        for (r, &id) in got.iter().zip(&[3usize, 0, 19]) {
            assert_eq!(r.as_slice(), &w[id * 48..(id + 1) * 48]);
        }
    }

    #[test]
    fn f32_weights_run_the_own_kernel_and_rows_do_not_depend_on_their_batch() {
        for (n, k) in [(64, 64), (96, 64), (70, 100)] {
            let w: Vec<f32> = (0..n * k).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
            let t =
                QTensor::quantize(&Tensor::from_vec(w.clone(), (n, k), &Device::Cpu).unwrap(), GgmlDType::F32).unwrap();
            let lin = Linear::new(Arc::new(t)).unwrap();
            assert!(matches!(lin, Linear::Own(_)));
            for m in [2, 5, 8, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
                let all = lin.forward_rows(&x, m).unwrap();
                for i in 0..m {
                    assert_eq!(
                        lin.forward_rows(&x[i * k..(i + 1) * k], 1).unwrap(),
                        all[i * n..(i + 1) * n],
                        "({n}, {k}) m = {m}"
                    );
                    for j in 0..n {
                        let exact: f64 = (0..k).map(|c| x[i * k + c] as f64 * w[j * k + c] as f64).sum();
                        assert!((all[i * n + j] as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
                    }
                }
            }
        }
    }

    #[test]
    fn a_stacked_group_gives_each_member_the_bits_it_gives_alone() {
        let tensor = |n: usize, k: usize, seed: usize, dtype: GgmlDType| {
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 + seed * 131) % 1000) as f32 / 500.0 - 1.0).collect();
            QTensor::quantize(&Tensor::from_vec(w, (n, k), &Device::Cpu).unwrap(), dtype).unwrap()
        };
        for dtype in [GgmlDType::F16, GgmlDType::F32, GgmlDType::Q4_0, GgmlDType::Q8_0] {
            for (widths, stacks) in [(vec![256, 64, 64], true), (vec![704, 704], true), (vec![64, 100], false)] {
                let k = 256;
                let members = || widths.iter().enumerate().map(|(s, &n)| tensor(n, k, s, dtype)).collect::<Vec<_>>();
                let group = Group::new(members()).unwrap();
                let alone: Vec<Linear> = members().into_iter().map(|t| Linear::new(Arc::new(t)).unwrap()).collect();
                let own = alone.iter().all(|l| matches!(l, Linear::Own(_)));
                assert_eq!(matches!(group, Group::Stacked(..)), stacks && own, "{dtype:?} {widths:?}");
                for m in [1, 2, 7] {
                    let x: Vec<f32> = (0..m * k).map(|i| (i * 104729 % 997) as f32 / 400.0 - 1.2).collect();
                    let got = group.forward_rows(&x, m).unwrap();
                    for (g, l) in got.iter().zip(&alone) {
                        assert_eq!(g, &l.forward_rows(&x, m).unwrap(), "{dtype:?} {widths:?} m {m}");
                    }
                }
            }
        }
    }
}
