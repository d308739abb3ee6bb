//! Every limit tinyloop enforces or sizes a buffer by, in one place. `py/mod.rs` exports the API-facing ones to Python
//! (`tinyloop._core.MAX_LOOPS`, …) so the HTTP schema checks the same numbers. Tile sizes internal to a kernel
//! (`PANEL`, `MR`, `LANES`, `ROWS`, `QK`) stay beside that kernel.

// Generation (checked by `Generator::new`, see `generate::Generation::validate`).

/// Most loops a generation may run: every KV cache reserves a slot per (loop, block layer) up to this depth.
pub const MAX_LOOPS: usize = 64;
/// Most loops a speculative draft may run (the API's range; a draft must also stay below the verify depth).
pub const MAX_DRAFT_LOOPS: usize = 32;
/// Most tokens one speculative round drafts (the API's range).
pub const MAX_DRAFT_AHEAD: usize = 16;
/// Most candidates per draft depth in tree mode (the API's range).
pub const MAX_BRANCHES: usize = 16;
/// Most rows one tree verification pass stages (`k_branches · draft_ahead`): bounds the cache's spare positions.
pub const MAX_TREE_ROWS: usize = 64;
/// Largest sliding window (`cache_window`) a request may ask for.
pub const MAX_CACHE_WINDOW: usize = 1 << 20;
/// Largest `top_k` the HTTP API accepts (the sampler itself honours any value).
pub const MAX_TOP_K: usize = 1000;
/// Most alternatives a token's log-probability may list (OpenAI's `top_logprobs` bound).
pub const MAX_LOGPROBS: usize = 20;

// Scheduling and cache sizing.

/// Prompt tokens a generator prefills per batched step, so running streams keep getting a token every step.
pub const PREFILL_CHUNK: usize = 256;
/// Prompt rows a windowed sequence prefills per pass (bounds the positions one write adds to its cache).
pub const WINDOW_PREFILL_CHUNK: usize = 64;
/// Positions a windowed cache keeps below the oldest one still visible, so that rolling back a speculative round
/// (at most `MAX_TREE_ROWS` staged rows plus the pending token) never needs a dropped key.
pub const WINDOW_SLACK: usize = MAX_TREE_ROWS + 1;

// Model files (checked by the loader, which refuses anything larger before allocating for it).

/// Most layers in the looped block, and most prelude layers.
pub const MAX_LAYERS: usize = 256;
/// Tensors of the largest model the bounds allow: embeddings, final norm, head, nine per layer.
pub const MAX_TENSORS: u64 = 3 + 9 * 2 * MAX_LAYERS as u64;
/// Largest `embedding_length` (model width).
pub const MAX_DIM: u64 = 1 << 16;
/// Largest `feed_forward_length`.
pub const MAX_FFN_DIM: u64 = 1 << 18;
/// Most attention heads (and K/V heads).
pub const MAX_HEADS: u64 = 1024;
/// Largest `context_length` a file may declare.
pub const MAX_CONTEXT: u64 = 1 << 20;
/// Most control tokens a vocabulary may list: they become one alternation regex, which costs kilobytes per token to
/// build; GPT-2 has one, and vocabularies that reserve many have a few hundred.
pub const MAX_CONTROL_TOKENS: usize = 1024;

// Parallelism and tables.

/// Below this many multiply-adds a matmul runs on the calling thread rather than split across the team of spinning
/// threads (`kernels::team`; a hand-off costs about a microsecond).
pub const TEAM_MIN: usize = 1 << 15;
/// Below this many multiply-adds a matmul the team does not take (inside `team::alone`, or while another caller
/// holds it) runs on the calling thread rather than on rayon's pool (a rayon round trip costs more).
pub const PARALLEL_MIN: usize = 1 << 18;
/// A batched step whose model has at most this many bytes of layer weights (prelude and looped block) runs its
/// sequences in one group per pool thread rather than spreading each matmul over the pool (`Model::run_blocks`):
/// weights this small stay in the last-level cache, so reading them once per thread costs less than the pool's
/// round trips. Larger models stream their weights from memory, and each thread reading them would double that.
pub const SPLIT_MAX_BYTES: usize = 16 << 20;
/// Below this many query-key products an attention call runs on the calling thread (a pool round trip per layer
/// costs more than short contexts' attention).
pub const ATTN_PARALLEL_MIN: usize = 1 << 16;
/// Positions whose RoPE angles a model keeps in a table (16 MB at head_dim 64, 32 MB at 128); positions past it
/// get their angles computed in place.
pub const ROPE_TABLE_MAX: usize = 1 << 16;
