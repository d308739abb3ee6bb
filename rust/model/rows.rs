//! What a forward pass takes: new rows of several sequences, each with its cache, as plain chunks or token trees.

use std::ops::Range;

use candle_core::Tensor;

use crate::kv::KvCache;

/// New tokens of one sequence: written at positions `pos..pos+tokens.len()` of `cache`, or laid out as a tree.
pub struct SeqChunk<'a> {
    pub cache: &'a mut KvCache,
    pub pos: usize,
    pub tokens: &'a [u32],
    /// Tree rows (speculative verification): where each row is stored, what it sees, its RoPE position.
    pub tree: Option<&'a TreeRows>,
    /// Adaptive depth: per row, the loops it ran before it stopped (`usize::MAX` while it runs). In a later loop's
    /// pass the row is still computed with the others, but its K/V there is its exit loop's (`RowLayout::fills`).
    pub exits: Option<&'a [usize]>,
}

/// Rows of a token tree: row i is stored at `store[i]`, attends to `0..prefix[i]` and `extra[i]`, and is rotated
/// for position `rope[i]` (its depth), so a node computes exactly what it would as the next token of its path.
#[derive(Debug, Clone, Default)]
pub struct TreeRows {
    pub store: Vec<usize>,
    pub prefix: Vec<usize>,
    pub extra: Vec<Vec<usize>>,
    pub rope: Vec<usize>,
}

/// Rows of one sequence on their way through loops `loops` (see `Model::run_blocks`); `x` holds their hidden
/// states, `(seq.tokens.len(), dim)`, and is replaced by the output.
pub struct RowBlock<'a> {
    pub seq: SeqChunk<'a>,
    pub x: Tensor,
    pub loops: Range<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only each sequence's last row: `(n_seqs, vocab)`.
    Last,
    /// Every row of every sequence, in order: `(total_tokens, vocab)`.
    All,
}
