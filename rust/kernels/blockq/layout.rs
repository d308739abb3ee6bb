//! The block-quantized kernel's data: the repacked weight (`QMatrix`), its inputs quantized per block (`Q8Rows`),
//! and the body that multiplies them (`Body`).

use candle_core::quantized::QTensor;
use half::f16;

use crate::error::{Error, Result};
use crate::kernels::isa::{self, Isa};
use crate::kernels::panels::PANEL;

/// Values per block.
pub(super) const QK: usize = 32;

/// The instruction set a matrix's products run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// AVX-512 F/BW with VNNI's `vpdpbusd`.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX2 and FMA: `vpmaddubsw` and `vpmaddwd`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// NEON with the dot-product extension's `SDOT`.
    #[cfg(target_arch = "aarch64")]
    NeonDot,
}

impl Body {
    /// The best body at the kernels' level (`isa`), if this CPU runs any.
    pub fn best() -> Option<Body> {
        match isa::level() {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if isa::vnni() => Some(Body::Avx512Vnni),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx2 => Some(Body::Avx2),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon if isa::dotprod() => Some(Body::NeonDot),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codes {
    /// Q4_0: ggml's 16 bytes per block (value j in the low nibble of byte j, value j + 16 in its high nibble),
    /// taken as unsigned 0..15 (offset 8).
    Nibbles,
    /// Q8_0: one signed byte per value.
    Bytes,
}

impl Codes {
    /// Bytes of one row's block.
    pub(super) fn block_bytes(self) -> usize {
        match self {
            Self::Nibbles => 16,
            Self::Bytes => 32,
        }
    }
}

/// An `(n, k)` Q4_0 or Q8_0 weight in panels of 64 rows. Block `b` of panel `p` (`pb = p · nb + b`) holds its
/// codes at `qs[pb · 64 · block_bytes..]` as groups of 256 bytes, each the 64 rows' 4 bytes of one byte
/// position group (`g · 256 + row · 4 + j` is the row's block byte `4g + j`); the rows' scales at `d[pb · 64..]`;
/// for Q8_0 the rows' `−128 · Σ codes` at `start[pb · 64..]`. Rows past `n` have scale 0.
pub struct QMatrix {
    pub(super) body: Body,
    pub(super) codes: Codes,
    pub(super) qs: Vec<u8>,
    pub(super) d: Vec<f32>,
    // Read by the VNNI body only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) start: Vec<i32>,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) nb: usize,
}

/// Input rows quantized to Q8_0: row `i`'s block `b` (`ib = i · nb + b`) at `qs[ib · 32..]` (+ 128 for Q8_0
/// weights, which take the inputs as the unsigned operand), its scale `d[ib]` and, for Q4_0 weights, `−8 · Σ q` at
/// `start[ib]`.
pub(super) struct Q8Rows {
    pub(super) qs: Vec<u8>,
    pub(super) d: Vec<f32>,
    pub(super) start: Vec<i32>,
}

impl QMatrix {
    /// The repacked weight, multiplied by the best body at the kernels' level; an error where there is none
    /// (`Body::best`).
    pub fn new(t: &QTensor, codes: Codes) -> Result<Self> {
        let body = Body::best().ok_or_else(|| {
            Error::Internal("the Q4_0 / Q8_0 kernel needs AVX2, or NEON with the dot-product extension".into())
        })?;
        Self::with_body(t, codes, body)
    }

    /// The repacked weight, multiplied by `body`, which the caller has checked this CPU runs.
    pub(super) fn with_body(t: &QTensor, codes: Codes, body: Body) -> Result<Self> {
        let (n, k) = t.shape().dims2()?;
        if k % QK != 0 {
            return Err(Error::Internal(format!("block-quantized weight width {k} is not a multiple of {QK}")));
        }
        let raw = t.data()?;
        let (nb, bb) = (k / QK, codes.block_bytes());
        let stride = 2 + bb; // ggml block: f16 scale, then the codes
        if raw.len() != n * nb * stride {
            return Err(Error::Internal(format!("quantized weight of {} bytes for shape ({n}, {k})", raw.len())));
        }
        let blocks = n.div_ceil(PANEL) * nb;
        let pad = if codes == Codes::Nibbles { 0x88 } else { 0 }; // value 0 either way
        let mut qs = vec![pad; blocks * PANEL * bb];
        let mut d = vec![0f32; blocks * PANEL];
        let mut start = vec![0i32; if codes == Codes::Bytes { blocks * PANEL } else { 0 }];
        for r in 0..n {
            let (p, o) = (r / PANEL, r % PANEL);
            for b in 0..nb {
                let src = &raw[(r * nb + b) * stride..(r * nb + b + 1) * stride];
                let pb = p * nb + b;
                d[pb * PANEL + o] = f16::from_le_bytes([src[0], src[1]]).to_f32();
                for (t, &byte) in src[2..].iter().enumerate() {
                    qs[pb * PANEL * bb + (t / 4) * 4 * PANEL + o * 4 + t % 4] = byte;
                }
                if codes == Codes::Bytes {
                    start[pb * PANEL + o] = -128 * src[2..].iter().map(|&v| v as i8 as i32).sum::<i32>();
                }
            }
        }
        Ok(Self { body, codes, qs, d, start, n, k, nb })
    }

    /// Block byte `t` of row `r`'s block `b`.
    pub(super) fn byte(&self, r: usize, b: usize, t: usize) -> u8 {
        let (pb, o, bb) = ((r / PANEL) * self.nb + b, r % PANEL, self.codes.block_bytes());
        self.qs[pb * PANEL * bb + (t / 4) * 4 * PANEL + o * 4 + t % 4]
    }
}
