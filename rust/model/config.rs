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
}
