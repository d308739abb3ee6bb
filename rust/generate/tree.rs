//! Tree speculative decoding (greedy): each draft depth proposes the `k_branches` best candidates; the best one
//! continues the path, the others are leaves. The whole tree — `k_branches · draft_ahead` rows — is verified in
//! one pass of loops `draft_loops..verify_loops`, each node attending only to its ancestors and itself, rotated for
//! its depth. The verifier walks the path; if it picks a leaf, that leaf is kept too (and the verifier's token after
//! it), and its K/V is moved into place in every loop's cache. Output equals plain greedy generation.

use candle_core::Tensor;

use super::plan::Speculative;
use super::seq::SeqState;
use crate::error::{Error, Result};
use crate::model::{Model, SeqChunk, TreeRows};
use crate::profile::{self, Stage};
use crate::sampler::top_ids;

/// One tree round: draft the tree, verify it in one pass, keep what the verifier agrees with.
pub(super) fn round(model: &Model, seq: &mut SeqState, spec: Speculative) -> Result<()> {
    let x0 = seq.pending.ok_or_else(|| Error::Internal("tree round without a pending token".into()))?;
    let k = spec.draft_ahead.min(seq.remaining()).max(1);
    seq.sampler.rewind_drafts(); // a round that failed after drafting left its drafts in the grammar
    let tree = Tree::draft(model, seq, spec, x0, k)?;
    let tokens: Vec<u32> = vec![0; tree.hidden.len()];
    let mut seqs =
        [SeqChunk { cache: &mut seq.cache, pos: tree.p0, tokens: &tokens, tree: Some(&tree.rows), exits: None }];
    let h = model.run(Tensor::cat(&tree.hidden, 0)?, &mut seqs, false, spec.draft_loops..spec.verify_loops)?;
    let logits = model.logits(&h)?.to_vec2::<f32>()?;
    seq.pending = None;
    profile::time(Stage::Sample, || tree.walk(seq, logits))
}

/// A drafted tree of `k` depths from position `p0`: path node j (`path[j]`, depth j; `path[0]` the pending token)
/// is stored at p0 + j, the leaves after the path; every node's row is in `rows` / `hidden`, at index
/// `path_row[j]` or `leaf_row[j][i]`.
struct Tree {
    p0: usize,
    k: usize,
    kb: usize,
    path: Vec<u32>,
    leaves: Vec<Vec<u32>>,
    rows: TreeRows,
    hidden: Vec<Tensor>,
    path_row: Vec<usize>,
    leaf_row: Vec<Vec<usize>>,
}

impl Tree {
    /// Draft depth after depth, each pass over loops `0..draft_loops` of the new path node and the leaves of the
    /// depth before; the draft head's `k_branches` best continue the path and become leaves.
    fn draft(model: &Model, seq: &mut SeqState, spec: Speculative, x0: u32, k: usize) -> Result<Self> {
        let p0 = seq.pos;
        let mut t = Tree {
            p0,
            k,
            kb: spec.k_branches,
            path: vec![x0],
            leaves: vec![Vec::new()],
            rows: TreeRows::default(),
            hidden: Vec::new(),
            path_row: Vec::new(),
            leaf_row: vec![Vec::new()],
        };
        for j in 0..=k {
            let mut level = TreeRows::default();
            let mut toks = Vec::new();
            if j < k {
                toks.push(t.path[j]);
                push_row(&mut level, p0 + j, p0 + j + 1, vec![], p0 + j);
            }
            if j >= 1 {
                for (i, &tok) in t.leaves[j].iter().enumerate() {
                    let at = t.leaf_store(j, i + 1);
                    toks.push(tok);
                    push_row(&mut level, at, p0 + j, vec![at], p0 + j);
                }
            }
            let mut seqs =
                [SeqChunk { cache: &mut seq.cache, pos: p0 + j, tokens: &toks, tree: Some(&level), exits: None }];
            let h = model.run(model.embed(&toks)?, &mut seqs, true, 0..spec.draft_loops)?;
            t.record(j, &level, &h)?;
            if j < k {
                let mut logits = model.draft_logits(&h.narrow(0, 0, 1)?)?.swap_remove(0);
                seq.sampler.constrain(&mut logits);
                let best = top_ids(&logits, t.kb);
                seq.sampler.draft(best[0]);
                t.path.push(best[0]);
                t.leaves.push(best[1..].to_vec());
            }
        }
        Ok(t)
    }

    /// Where leaf `i` (1-based) of depth `j` is stored: after the path, depth by depth.
    fn leaf_store(&self, j: usize, i: usize) -> usize {
        self.p0 + self.k + (j - 1) * (self.kb - 1) + (i - 1)
    }

    /// Keep depth `j`'s drafted rows (`level`, hidden states `h`) for verification.
    fn record(&mut self, j: usize, level: &TreeRows, h: &Tensor) -> Result<()> {
        let mut leaf_rows = Vec::new();
        for r in 0..level.store.len() {
            let is_path = j < self.k && r == 0;
            if is_path {
                self.path_row.push(self.hidden.len());
            } else {
                leaf_rows.push(self.hidden.len());
            }
            push_row(&mut self.rows, level.store[r], level.prefix[r], level.extra[r].clone(), level.rope[r]);
            self.hidden.push(h.narrow(0, r, 1)?);
        }
        if j >= 1 {
            self.leaf_row.push(leaf_rows);
        }
        Ok(())
    }

    /// Walk the verified tree with the verifier's `logits` (one row per node): emit its tokens, keep the agreed
    /// rows, move a chosen leaf's K/V into place and roll back the rest.
    fn walk(&self, seq: &mut SeqState, mut logits: Vec<Vec<f32>>) -> Result<()> {
        seq.sampler.rewind_drafts();
        seq.draft.rounds += 1;
        seq.draft.proposed += self.k;
        // `fed` rows at p0.. are kept; `row` is the verified node whose successor is chosen next.
        let (mut fed, mut row) = (1, self.path_row[0]);
        for j in 1..=self.k {
            let v = seq.sampler.sample(&mut logits[row]);
            let step = seq.emit(v);
            seq.ready.push_back(step);
            if v == self.path[j] {
                seq.draft.accepted += 1;
                if step.finish.is_some() || j == self.k {
                    break;
                }
                fed += 1;
                row = self.path_row[j];
            } else if let Some(i) = self.leaves[j].iter().position(|&t| t == v) {
                seq.draft.accepted += 1;
                if step.finish.is_none() {
                    let next = seq.sampler.sample(&mut logits[self.leaf_row[j][i]]);
                    let step = seq.emit(next);
                    seq.ready.push_back(step);
                }
                seq.cache.move_position(self.leaf_store(j, i + 1), self.p0 + j)?;
                fed += 1;
                break;
            } else {
                break;
            }
        }
        seq.commit(fed);
        Ok(())
    }
}

fn push_row(t: &mut TreeRows, store: usize, prefix: usize, extra: Vec<usize>, rope: usize) {
    t.store.push(store);
    t.prefix.push(prefix);
    t.extra.push(extra);
    t.rope.push(rope);
}
