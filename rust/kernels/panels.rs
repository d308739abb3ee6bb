//! The driver shared by tinyloop's own matmul kernels (F16/F32 in `dense.rs`, Q4_0/Q8_0 in `blockq`).
//!
//! Weights are repacked at load into *panels* of `PANEL` (64) output rows, interleaved along the input dimension so
//! that one step of a kernel reads the 64 outputs' weights for the same input position(s) as four 16-lane vectors.
//! Each output then lives in one lane of an accumulator and walks the input in order: no horizontal sums at the
//! end (4 × 4 dot-product blocks spend as much on those as on the multiply-adds at k = 256), and an
//! output's arithmetic is the same whichever rows it is multiplied with — batched == solo, bit for bit.
//!
//! `panels` splits the panels across the `team` (above `TEAM_MIN` multiply-adds; one contiguous share per core, the
//! same share each call), else spreads them over the rayon pool (above `PARALLEL_MIN`, on rayon's own threads), and
//! inside a panel runs the input rows in blocks of up to `MR` through the kernel, writing the valid columns straight
//! into the output.

use rayon::prelude::*;

use super::team;
use crate::limits::{PARALLEL_MIN, TEAM_MIN};

/// Output rows per panel (four 16-lane vectors).
pub(crate) const PANEL: usize = 64;
/// Most input rows one kernel call handles (their accumulators stay in registers).
pub(crate) const MR: usize = 6;

/// Results of one kernel call: `out[a][o]` = input row `i0 + a` · weight row `panel · 64 + o`.
pub(crate) type Block = [[f32; PANEL]; MR];

/// A kernel: `(panel, i0, rows, out)` fills `out[..rows]` (rows ≤ MR) for input rows `i0..i0 + rows`. A panel's
/// set-up (e.g. widening its weights once for many rows) goes in `prepare`, called once per panel per matmul; the
/// scratch it fills is reused for the worker's next panel, so `prepare` must overwrite whatever it relies on.
pub(crate) trait PanelKernel: Sync {
    /// Per-panel scratch the kernel may fill before the rows run (unit when it needs none).
    type Scratch: Default;
    fn prepare(&self, _panel: usize, _m: usize, _scratch: &mut Self::Scratch) {}
    fn block(&self, panel: usize, scratch: &Self::Scratch, i0: usize, rows: usize, out: &mut Block);
}

/// The output buffer, shared by the panels of one call: each panel writes only its own columns.
struct Columns(*mut f32);
// SAFETY: panels write disjoint columns of the buffer (see `panels`), which outlives the parallel region.
unsafe impl Sync for Columns {}

impl Columns {
    /// Copy `vals` to `out[at..]`.
    ///
    /// # Safety
    /// The range must lie inside the buffer and belong to the calling panel alone.
    unsafe fn write(&self, at: usize, vals: &[f32]) {
        if vals.len() == PANEL {
            // A constant length: inlined vector moves instead of a memcpy call per row (3% of a prefill).
            std::ptr::copy_nonoverlapping(vals.as_ptr(), self.0.add(at), PANEL);
        } else {
            std::ptr::copy_nonoverlapping(vals.as_ptr(), self.0.add(at), vals.len());
        }
    }
}

/// `out (m, n)` for a weight of `n` rows in `n.div_ceil(PANEL)` panels; `macs` decides whether to go parallel.
pub(crate) fn panels<K: PanelKernel>(kernel: &K, m: usize, n: usize, macs: usize, out: &mut [f32]) {
    assert_eq!(out.len(), m * n, "panel output buffer size");
    let cols = Columns(out.as_mut_ptr());
    // One scratch per worker, reused across its panels (`prepare` overwrites what it uses).
    let run = |scratch: &mut K::Scratch, p: usize| {
        kernel.prepare(p, m, scratch);
        let (c0, width) = (p * PANEL, PANEL.min(n - p * PANEL));
        let mut block = [[0f32; PANEL]; MR];
        let mut i = 0;
        while i < m {
            let rows = MR.min(m - i);
            kernel.block(p, scratch, i, rows, &mut block);
            for (a, vals) in block.iter().take(rows).enumerate() {
                // SAFETY: i + a < m and c0 + width <= n, so the range lies inside the m · n buffer; only panel p
                // writes columns c0..c0 + width, and `cols` points at `out`, alive for the whole call.
                unsafe { cols.write((i + a) * n + c0, &vals[..width]) };
            }
            i += rows;
        }
    };
    let count = n.div_ceil(PANEL);
    let parts = |range: std::ops::Range<usize>| {
        let mut scratch = K::Scratch::default();
        range.for_each(|p| run(&mut scratch, p));
    };
    if count >= 2 && macs >= TEAM_MIN && team::spread(count, &parts) {
        return;
    }
    if macs >= PARALLEL_MIN {
        (0..count).into_par_iter().for_each_init(K::Scratch::default, run);
    } else {
        let mut scratch = K::Scratch::default();
        (0..count).for_each(|p| run(&mut scratch, p));
    }
}

/// Dispatch on a row count known only at run time to a kernel taking it as a const generic (1..=MR).
macro_rules! by_rows {
    ($rows:expr, $f:ident :: <$($t:ty),*> ($($arg:expr),*)) => {
        match $rows {
            1 => $f::<$($t,)* 1>($($arg),*),
            2 => $f::<$($t,)* 2>($($arg),*),
            3 => $f::<$($t,)* 3>($($arg),*),
            4 => $f::<$($t,)* 4>($($arg),*),
            5 => $f::<$($t,)* 5>($($arg),*),
            6 => $f::<$($t,)* 6>($($arg),*),
            r => unreachable!("{r} rows in one kernel call"),
        }
    };
}
pub(crate) use by_rows;
