//! RMSNorm on plain rows, as ggml computes it.

/// RMSNorm of each `w.len()`-wide row, as ggml computes it: the mean square summed in f64, then
/// `x · (1 / √(mean + ε)) · w` in f32.
pub(super) fn rms_norm(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mean = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let scale = (1.0 / (mean + eps).sqrt()) as f32;
        o.iter_mut().zip(row).zip(w).for_each(|((o, &v), &g)| *o = v * scale * g);
    }
    out
}
