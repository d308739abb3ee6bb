//! The model's shape.

/// The model's shape, from the file's `tinyloop.*` keys (read and bounded by the loader).
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub name: String,
    pub context_length: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f64,
    pub rope_theta: f32,
    /// k: layers in the looped block.
    pub block_count: usize,
    pub prelude_count: usize,
    pub default_loops: usize,
    pub max_trained_loops: usize,
    pub vocab_size: usize,
    pub file_type: u32,
    /// Q, K and V projections carry biases (`blk.N.attn_q.bias` …: Qwen2's layers).
    pub attn_bias: bool,
    /// Each layer norms its attention and feed-forward outputs before adding them (`blk.N.attn_post_norm` …:
    /// Ouro's "sandwich" layers).
    pub post_norms: bool,
    /// The file carries an early-exit gate (`exit_gate.weight`, `exit_gate.bias`: Ouro's), which adaptive depth
    /// then follows (`depth.rs`).
    pub exit_gate: bool,
    /// The model's default exit threshold for adaptive depth under its rule (`tinyloop.exit_threshold`).
    pub exit_threshold: Option<f32>,
    /// `output_norm` is applied after every loop and the normed state is what the next loop reads (Ouro's
    /// recurrence); the head then reads it as it is (`tinyloop.loop_norm`).
    pub loop_norm: bool,
    pub rope_scaling: Option<RopeScaling>,
}

/// How RoPE's frequencies are stretched for contexts longer than the model was first trained on
/// (`tinyloop.rope.scaling.*`, from a converted checkpoint's `rope_scaling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// Llama 3.1's: wavelengths longer than `original / low_freq_factor` divided by `factor`, shorter than
    /// `original / high_freq_factor` kept, the ones between blended smoothly.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_context: f64 },
}

impl RopeScaling {
    /// The scaled inverse frequency of one unscaled `inv_freq`.
    pub fn apply(self, inv_freq: f64) -> f64 {
        match self {
            Self::Linear { factor } => inv_freq / factor,
            Self::Llama3 { factor, low_freq_factor, high_freq_factor, original_context } => {
                let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
                if wavelen < original_context / high_freq_factor {
                    inv_freq
                } else if wavelen > original_context / low_freq_factor {
                    inv_freq / factor
                } else {
                    let smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
                }
            }
        }
    }
}
