//! Tree speculative decoding (greedy): each draft depth proposes the `k_branches` best candidates; the best one
//! continues the path, the others are leaves. The whole tree — `k_branches · draft_ahead` rows — is verified in
//! one pass of loops `draft_loops..verify_loops`, each node attending only to its ancestors and itself, rotated for
//! its depth. The verifier walks the path; if it picks a leaf, that leaf is kept too (and the verifier's token after
//! it), and its K/V is moved into place in every loop's cache. Output equals plain greedy generation.

use candle_core::Tensor;

use crate::engine::Generator;
use crate::error::{Error, Result};
use crate::model::{SeqChunk, TreeRows};
use crate::spec::SpecConfig;

/// Ids of the `k` largest logits, best first (lower id first among equals).
pub fn top_k(logits: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    ids.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
        logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
    });
    ids.truncate(k);
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    ids
}

impl Generator {
    pub(crate) fn tree_round(&mut self, cfg: SpecConfig) -> Result<()> {
        let model = &self.engine.model;
        let kb = cfg.k_branches;
        let x0 = self.pending.take().ok_or_else(|| Error::Internal("tree round without a pending token".into()))?;
        let k = cfg.draft_ahead.min(self.sampler.params().max_tokens - self.output.len()).max(1);
        let p0 = self.pos;
        // Path node j (depth j) is stored at p0 + j; leaf i (1-based) of depth j after the path, in order.
        let leaf_store = |j: usize, i: usize| p0 + k + (j - 1) * (kb - 1) + (i - 1);
        let mut path = vec![x0];
        let mut leaves: Vec<Vec<u32>> = vec![Vec::new()];
        let (mut rows, mut hidden) = (TreeRows::default(), Vec::new());
        let (mut path_row, mut leaf_row) = (Vec::new(), vec![Vec::new()]);
        for j in 0..=k {
            let mut tree = TreeRows::default();
            let mut toks = Vec::new();
            if j < k {
                toks.push(path[j]);
                push_row(&mut tree, p0 + j, p0 + j + 1, vec![], p0 + j);
            }
            if j >= 1 {
                for (i, &t) in leaves[j].iter().enumerate() {
                    let at = leaf_store(j, i + 1);
                    toks.push(t);
                    push_row(&mut tree, at, p0 + j, vec![at], p0 + j);
                }
            }
            let mut seqs = [SeqChunk { cache: &mut self.cache, pos: p0 + j, tokens: &toks, tree: Some(&tree) }];
            let h = model.run(model.embed(&toks)?, &mut seqs, true, 0..cfg.draft_loops)?;
            let mut leaf_rows = Vec::new();
            for r in 0..toks.len() {
                let is_path = j < k && r == 0;
                if is_path {
                    path_row.push(hidden.len());
                } else {
                    leaf_rows.push(hidden.len());
                }
                push_row(&mut rows, tree.store[r], tree.prefix[r], tree.extra[r].clone(), tree.rope[r]);
                hidden.push(h.narrow(0, r, 1)?);
            }
            if j >= 1 {
                leaf_row.push(leaf_rows);
            }
            if j < k {
                let logits = model.draft_logits(&h.narrow(0, 0, 1)?)?.swap_remove(0);
                let best = top_k(&logits, kb);
                path.push(best[0]);
                leaves.push(best[1..].to_vec());
            }
        }
        let tokens: Vec<u32> = vec![0; hidden.len()];
        let mut seqs = [SeqChunk { cache: &mut self.cache, pos: p0, tokens: &tokens, tree: Some(&rows) }];
        let h = model.run(Tensor::cat(&hidden, 0)?, &mut seqs, false, cfg.draft_loops..self.loops)?;
        let mut logits = model.logits(&h)?.to_vec2::<f32>()?;
        self.draft.rounds += 1;
        self.draft.proposed += k;
        // Walk: `fed` rows at p0.. are kept; `row` is the verified node whose successor is chosen next.
        let (mut fed, mut row) = (1, path_row[0]);
        for j in 1..=k {
            let v = self.sampler.sample(&mut logits[row]);
            let step = self.emit(v);
            self.ready.push_back(step);
            if v == path[j] {
                self.draft.accepted += 1;
                if step.finish.is_some() || j == k {
                    break;
                }
                fed += 1;
                row = path_row[j];
            } else if let Some(i) = leaves[j].iter().position(|&t| t == v) {
                self.draft.accepted += 1;
                if step.finish.is_none() {
                    let next = self.sampler.sample(&mut logits[leaf_row[j][i]]);
                    let step = self.emit(next);
                    self.ready.push_back(step);
                }
                self.cache.move_position(leaf_store(j, i + 1), p0 + j);
                fed += 1;
                break;
            } else {
                break;
            }
        }
        self.pos = p0 + fed;
        self.cache.truncate(self.pos);
        Ok(())
    }
}

fn push_row(t: &mut TreeRows, store: usize, prefix: usize, extra: Vec<usize>, rope: usize) {
    t.store.push(store);
    t.prefix.push(prefix);
    t.extra.push(extra);
    t.rope.push(rope);
}
