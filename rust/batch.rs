//! Continuous batching: one step of many generators at once. Every plain decode step, every unwindowed prompt
//! prefill and every chain-speculative round among them share their forward passes per (engine, verify depth) —
//! the linear layers see all their rows together, attention runs per sequence over its own cache — so n streams
//! pay for reading the weights once per pass, not n times. A speculative round's drafts (one row per pass, loops
//! `0..draft_loops`) go through together with the other rounds' drafts, and the first of those passes also carries
//! the plain rows up to the lowest draft depth; the verification rows (loops `draft_loops..verify_loops`) then go
//! through with the rest of the plain rows: verification is just more rows. Tree rounds and windowed prefills
//! (which go in chunks) run on their own. A sequence's result does not depend on its batch-mates: rows never mix
//! outside the matmuls.
//!
//! Long prompts are prefilled `PREFILL_CHUNK` tokens per step, so the streams already running keep getting a token
//! every step while a newcomer's prompt goes in; such a step returns no token and no finish.

use std::sync::Arc;

use candle_core::Tensor;

use crate::engine::{Generator, Step};
use crate::error::{Error, Result};
use crate::model::{RowBlock, SeqChunk};
use crate::spec::{ChainRound, SpecConfig};

/// Prompt tokens a generator feeds per batched step.
pub const PREFILL_CHUNK: usize = 256;

enum Plan {
    /// Already known: a verified speculative token waiting, or the end.
    Done(Step),
    /// Joins the batch of its (engine, depth) with this work.
    Batch((usize, usize), Work),
    /// Runs its own step (tree round, windowed prefill).
    Solo,
}

/// What a generator does in a batched step.
pub(crate) enum Work {
    /// Feed these tokens (the pending one, or a prompt chunk) through every loop and sample from the last row.
    Plain(Vec<u32>),
    /// One chain-speculative draft + verify round.
    Chain(SpecConfig),
}

pub(crate) struct Member<'g> {
    pub gen: &'g mut Generator,
    pub work: Work,
}

impl Generator {
    fn plan(&mut self) -> Plan {
        if let Some(step) = self.ready.pop_front() {
            return Plan::Done(step);
        }
        if let Some(f) = self.finish {
            return Plan::Done(Step { token: None, finish: Some(f) });
        }
        let key = (Arc::as_ptr(&self.engine) as usize, self.loops);
        match (self.pending, self.spec) {
            (Some(_), Some(cfg)) if cfg.k_branches > 1 => Plan::Solo,
            (Some(_), Some(cfg)) => Plan::Batch(key, Work::Chain(cfg)),
            (Some(t), None) => Plan::Batch(key, Work::Plain(vec![t])),
            (None, _) if self.cache.window() > 0 => Plan::Solo,
            (None, _) => {
                let chunk = self.prompt[self.pos..(self.pos + PREFILL_CHUNK).min(self.prompt.len())].to_vec();
                Plan::Batch(key, Work::Plain(chunk))
            }
        }
    }
}

/// Advance every generator by one step — for each, what `Generator::step` alone would produce. A failure is
/// reported for the generator it concerns; the others go on.
pub fn step_batch(gens: &mut [&mut Generator]) -> Vec<Result<Step>> {
    let mut plans: Vec<Plan> = gens.iter_mut().map(|g| g.plan()).collect();
    let mut out: Vec<Option<Result<Step>>> = (0..gens.len()).map(|_| None).collect();
    let mut keys: Vec<(usize, usize)> =
        plans.iter().filter_map(|p| if let Plan::Batch(k, _) = p { Some(*k) } else { None }).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let (idx, mut members): (Vec<usize>, Vec<Member>) = gens
            .iter_mut()
            .zip(plans.iter_mut())
            .enumerate()
            .filter_map(|(i, (g, p))| match p {
                Plan::Batch(k, _) if *k == key => match std::mem::replace(p, Plan::Solo) {
                    Plan::Batch(_, work) => Some((i, Member { gen: g, work })),
                    _ => None,
                },
                _ => None,
            })
            .unzip();
        if run_group(&mut members).is_err() {
            // Nothing was emitted: let each one run alone, so an error lands on the request that caused it.
            for (i, m) in idx.into_iter().zip(members) {
                out[i] = Some(m.gen.step());
            }
            continue;
        }
        for (i, m) in idx.into_iter().zip(members) {
            let step = m.gen.ready.pop_front().ok_or_else(|| Error::Internal("a batched step produced nothing".into()));
            out[i] = Some(step);
        }
    }
    for (i, (g, plan)) in gens.iter_mut().zip(plans).enumerate() {
        match plan {
            Plan::Done(step) => out[i] = Some(Ok(step)),
            Plan::Solo if out[i].is_none() => out[i] = Some(g.step()),
            _ => {}
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Internal("a generator was not stepped".into())))).collect()
}

/// The passes of one step for generators of one engine at one verify depth; each member's steps are queued in its
/// `ready`. Nothing is emitted unless every pass succeeded.
pub(crate) fn run_group(members: &mut [Member]) -> Result<()> {
    let (engine, loops) = {
        let g = &members.first().ok_or_else(|| Error::Internal("empty batch".into()))?.gen;
        (g.engine.clone(), g.loops)
    };
    let model = &engine.model;
    let mut rounds: Vec<Option<ChainRound>> = members
        .iter()
        .map(|m| match m.work {
            Work::Chain(cfg) => m.gen.start_chain(cfg).map(Some),
            Work::Plain(_) => Ok(None),
        })
        .collect::<Result<_>>()?;
    // Plain rows ride along with the first draft pass up to the lowest draft depth, then join the verification.
    let pause = rounds.iter().flatten().map(|r| r.cfg.draft_loops).min().unwrap_or(loops);
    let drafts = rounds.iter().flatten().map(|r| r.k).max().unwrap_or(0);
    let mut plain_x: Vec<Option<Tensor>> = vec![None; members.len()];
    for j in 0..drafts.max(1) {
        let mut blocks = Vec::new();
        let mut owners = Vec::new();
        for (i, (m, round)) in members.iter_mut().zip(&rounds).enumerate() {
            let g = &mut *m.gen;
            let (tokens, pos, depth) = match (&m.work, round) {
                (Work::Plain(feed), _) if j == 0 => (feed.as_slice(), g.pos, pause),
                (Work::Chain(_), Some(r)) if j < r.k => (&r.inputs[j..j + 1], g.pos + j, r.cfg.draft_loops),
                _ => continue,
            };
            let x = model.embed(tokens)?;
            blocks.push(RowBlock {
                seq: SeqChunk { cache: &mut g.cache, pos, tokens, tree: None },
                x,
                loops: 0..depth,
            });
            owners.push(i);
        }
        model.run_blocks(&mut blocks)?;
        let outs: Vec<Tensor> = blocks.into_iter().map(|b| b.x).collect();
        let mut draft_rows = Vec::new();
        for (&i, x) in owners.iter().zip(outs) {
            match rounds[i] {
                Some(_) => draft_rows.push((i, x)),
                None => plain_x[i] = Some(x),
            }
        }
        if draft_rows.is_empty() {
            continue;
        }
        let h: Vec<&Tensor> = draft_rows.iter().map(|(_, x)| x).collect();
        let logits = model.draft_logits(&Tensor::cat(&h, 0)?)?;
        for ((i, x), row) in draft_rows.into_iter().zip(logits) {
            if let Some(round) = rounds[i].as_mut() {
                members[i].gen.propose(round, x, row);
            }
        }
    }
    // Verification rows and the plain rows' remaining loops, in one set of passes; then one head over the rows
    // whose logits are wanted (each plain sequence's last, every verification row).
    let finals: Vec<Tensor> = {
        let mut blocks = Vec::new();
        let hidden: Vec<Option<Tensor>> = rounds
            .iter()
            .map(|r| r.as_ref().map(|r| Tensor::cat(&r.hidden, 0)).transpose())
            .collect::<candle_core::Result<_>>()?;
        for (i, ((m, round), h)) in members.iter_mut().zip(&rounds).zip(hidden).enumerate() {
            let g = &mut *m.gen;
            let (tokens, x, depth) = match (&m.work, round, h) {
                (Work::Plain(feed), _, _) => (feed.as_slice(), plain_x[i].take(), pause),
                (Work::Chain(_), Some(r), h) => (&r.inputs[..r.k], h, r.cfg.draft_loops),
                _ => return Err(Error::Internal("a chain member without its round".into())),
            };
            let x = x.ok_or_else(|| Error::Internal("a batched row lost its hidden state".into()))?;
            blocks.push(RowBlock {
                seq: SeqChunk { cache: &mut g.cache, pos: g.pos, tokens, tree: None },
                x,
                loops: depth..loops,
            });
        }
        model.run_blocks(&mut blocks)?;
        blocks
            .into_iter()
            .zip(&rounds)
            .map(|(b, round)| match round {
                Some(_) => Ok(b.x),
                None => b.x.narrow(0, b.seq.tokens.len() - 1, 1),
            })
            .collect::<candle_core::Result<_>>()?
    };
    let mut logits = model.logits(&Tensor::cat(&finals, 0)?)?.to_vec2::<f32>()?.into_iter();
    for (m, round) in members.iter_mut().zip(rounds) {
        let g = &mut *m.gen;
        match (&m.work, round) {
            (Work::Chain(_), Some(round)) => {
                let rows: Vec<Vec<f32>> = logits.by_ref().take(round.k).collect();
                g.finish_chain(round, rows);
            }
            (Work::Plain(feed), _) => {
                let mut row = logits.next().ok_or_else(|| Error::Internal("a batched row has no logits".into()))?;
                g.pending = None;
                g.pos += feed.len();
                if g.output.is_empty() && g.pos < g.prompt.len() {
                    g.ready.push_back(Step { token: None, finish: None }); // more prompt to go: no token yet
                    continue;
                }
                let token = g.sampler.sample(&mut row);
                let step = g.emit(token);
                g.ready.push_back(step);
            }
            _ => return Err(Error::Internal("a chain member without its round".into())),
        }
    }
    Ok(())
}
