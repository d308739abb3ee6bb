//! Rotary position embeddings: llama.cpp's "norm" RoPE (adjacent pairs rotated), angles from a table shared by every
//! layer and loop.

use std::sync::RwLock;

use candle_core::{Device, Tensor};

use super::config::Config;
use crate::limits::ROPE_TABLE_MAX;

pub(super) struct Rope {
    head_dim: usize,
    /// Inverse frequencies θ^(-2i/d), i < head_dim/2, in f64 so angles at large positions stay exact.
    inv_freq: Vec<f64>,
    /// (cos, sin) of pos·θ_i for positions below `len / (head_dim / 2)`, `[pos][i]`, grown on demand up to
    /// `ROPE_TABLE_MAX` positions: every layer of every loop rotates the same positions, and computing the angles
    /// anew takes 3–4% of a prefill.
    table: RwLock<Vec<(f32, f32)>>,
    /// On a candle device: cos and sin of every position below the context length, `(positions, head_dim / 2)`,
    /// the same f32 values as `table`'s.
    device_tables: Option<(Tensor, Tensor)>,
}

impl Rope {
    pub(super) fn new(cfg: &Config) -> Self {
        let half = cfg.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| (cfg.rope_theta as f64).powf(-2.0 * i as f64 / cfg.head_dim as f64))
            .map(|f| cfg.rope_scaling.map_or(f, |s| s.apply(f)))
            .collect();
        Self { head_dim: cfg.head_dim, inv_freq, table: Default::default(), device_tables: None }
    }

    /// This RoPE with its angle tables on `device` for positions below `positions`.
    pub(super) fn on_device(mut self, device: &Device, positions: usize) -> candle_core::Result<Self> {
        let half = self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(positions * half), Vec::with_capacity(positions * half));
        for p in 0..positions {
            for f in &self.inv_freq {
                cos.push((p as f64 * f).cos() as f32);
                sin.push((p as f64 * f).sin() as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::from_vec(v, (positions, half), &Device::Cpu)?.to_device(device);
        self.device_tables = Some((table(cos)?, table(sin)?));
        Ok(self)
    }

    /// `apply` on the device to Q `(n, q_heads·head_dim)` and K `(n, k_heads·head_dim)`, row r rotated for
    /// `positions[r]`, through candle-nn's interleaved-pair RoPE kernel; one lookup of the rows' (cos, sin) serves
    /// both.
    pub(super) fn rotate(
        &self,
        (q, q_heads): (&Tensor, usize),
        (k, k_heads): (&Tensor, usize),
        positions: &[u32],
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let Some((cos, sin)) = &self.device_tables else { candle_core::bail!("RoPE has no device tables") };
        let (n, half, hd) = (positions.len(), self.head_dim / 2, self.head_dim);
        if let Some(&p) = positions.iter().max().filter(|&&p| p as usize >= cos.dim(0).unwrap_or(0)) {
            candle_core::bail!("position {p} is past the device's RoPE table ({} positions)", cos.dim(0)?)
        }
        let at = Tensor::from_slice(positions, n, cos.device())?;
        let (c, s) =
            (cos.index_select(&at, 0)?.reshape((n, 1, half))?, sin.index_select(&at, 0)?.reshape((n, 1, half))?);
        let turn = |x: &Tensor, heads: usize| {
            candle_nn::rotary_emb::rope_i(&x.reshape((n, heads, 1, hd))?, &c, &s)?.reshape((n, heads * hd))
        };
        Ok((turn(q, q_heads)?, turn(k, k_heads)?))
    }

    /// Rotate adjacent pairs (x[2i], x[2i+1]) of every head by pos·θ_i, row r at `positions[r]`.
    pub(super) fn apply(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        rope_rows(x, heads, self.head_dim, positions, &self.inv_freq, &self.table);
    }
}

/// `Rope::apply` over a table of angles shared by calls (`rope_table`).
fn rope_rows(
    x: &mut [f32],
    heads: usize,
    hd: usize,
    positions: &[usize],
    inv_freq: &[f64],
    rope_table: &RwLock<Vec<(f32, f32)>>,
) {
    let half = inv_freq.len();
    let angles = |p: usize| inv_freq.iter().map(move |f| ((p as f64 * f).cos() as f32, (p as f64 * f).sin() as f32));
    let needed = positions.iter().max().map_or(0, |&p| p + 1).min(ROPE_TABLE_MAX);
    if rope_table.read().unwrap_or_else(|e| e.into_inner()).len() < needed * half {
        let mut t = rope_table.write().unwrap_or_else(|e| e.into_inner());
        let (from, to) = (t.len() / half, needed.max(2 * t.len() / half).min(ROPE_TABLE_MAX));
        for p in from..to {
            t.extend(angles(p));
        }
    }
    let table = rope_table.read().unwrap_or_else(|e| e.into_inner());
    let mut far = Vec::new();
    for (row, &pos) in x.chunks_exact_mut(heads * hd).zip(positions) {
        // Positions past the table (a sliding-window stream's absolute positions can grow without bound) get
        // their angles computed in place, by the same formula.
        let cs = if pos < ROPE_TABLE_MAX {
            &table[pos * half..(pos + 1) * half]
        } else {
            far.clear();
            far.extend(angles(pos));
            far.as_slice()
        };
        for head in row.chunks_exact_mut(hd) {
            for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cs) {
                let (a, b) = (pair[0], pair[1]);
                pair[0] = a * c - b * s;
                pair[1] = a * s + b * c;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_from_the_table_and_past_it_is_the_direct_rotation() {
        let (heads, hd) = (2, 8);
        let inv_freq: Vec<f64> = (0..hd / 2).map(|i| 10000f64.powf(-2.0 * i as f64 / hd as f64)).collect();
        let positions = [0, 5, 65_535, 65_536, 70_000, 5];
        let x0: Vec<f32> = (0..positions.len() * heads * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = RwLock::default();
        let mut x = x0.clone();
        rope_rows(&mut x, heads, hd, &positions, &inv_freq, &table);
        assert_eq!(table.read().unwrap().len(), ROPE_TABLE_MAX * hd / 2, "the table stops at ROPE_TABLE_MAX");
        for (r, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                for (i, f) in inv_freq.iter().enumerate() {
                    let at = (r * heads + h) * hd + 2 * i;
                    let (c, s) = ((p as f64 * f).cos() as f32, (p as f64 * f).sin() as f32);
                    let (a, b) = (x0[at], x0[at + 1]);
                    assert_eq!((x[at], x[at + 1]), (a * c - b * s, a * s + b * c), "position {p}, pair {i}");
                }
            }
        }
    }
}
