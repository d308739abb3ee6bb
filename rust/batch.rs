//! Continuous batching: one step of many generators at once. Every plain decode step (and every unwindowed prompt
//! prefill) among them runs in one forward pass per (engine, loop depth) — the linear layers see all their rows
//! together, attention runs per sequence over its own cache — so n streams pay for reading the weights once per
//! step, not n times. Speculative rounds and windowed prefills (which go in chunks) run on their own. A sequence's
//! result does not depend on its batch-mates: rows never mix outside the matmuls.
//!
//! Long prompts are prefilled `PREFILL_CHUNK` tokens per step, so the streams already running keep getting a token
//! every step while a newcomer's prompt goes in; such a step returns no token and no finish.

use std::sync::Arc;

use crate::engine::{Generator, Step};
use crate::error::{Error, Result};
use crate::model::{LogitRows, SeqChunk};

/// Prompt tokens a generator feeds per batched step.
pub const PREFILL_CHUNK: usize = 256;

enum Plan {
    /// Already known: a verified speculative token waiting, or the end.
    Done(Step),
    /// Joins the batch of its (engine, depth) with these new tokens.
    Batch((usize, usize), Vec<u32>),
    /// Runs its own step (speculative round, windowed prefill).
    Solo,
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
        match self.pending {
            Some(_) if self.spec.is_some() => Plan::Solo,
            Some(t) => Plan::Batch(key, vec![t]),
            None if self.cache.window() > 0 => Plan::Solo,
            None => Plan::Batch(key, self.prompt[self.pos..(self.pos + PREFILL_CHUNK).min(self.prompt.len())].to_vec()),
        }
    }
}

/// Advance every generator by one step — for each, what `Generator::step` alone would produce. A failure is
/// reported for the generator it concerns; the others go on.
pub fn step_batch(gens: &mut [&mut Generator]) -> Vec<Result<Step>> {
    let plans: Vec<Plan> = gens.iter_mut().map(|g| g.plan()).collect();
    let mut out: Vec<Option<Result<Step>>> = (0..gens.len()).map(|_| None).collect();
    let mut keys: Vec<(usize, usize)> = plans.iter().filter_map(|p| if let Plan::Batch(k, _) = p { Some(*k) } else { None }).collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let mut members: Vec<(usize, &mut Generator, &[u32])> = gens
            .iter_mut()
            .zip(&plans)
            .enumerate()
            .filter_map(|(i, (g, p))| match p {
                Plan::Batch(k, feed) if *k == key => Some((i, &mut **g, feed.as_slice())),
                _ => None,
            })
            .collect();
        if run_group(&mut members).is_err() {
            // Nothing was consumed: let each one run alone, so an error lands on the request that caused it.
            for (i, g, _) in members {
                out[i] = Some(g.step());
            }
            continue;
        }
        for (i, g, _) in members {
            let token = g.ready.pop_front().ok_or_else(|| Error::Internal("a batched step produced nothing".into()));
            out[i] = Some(token);
        }
    }
    for (i, (g, plan)) in gens.iter_mut().zip(plans).enumerate() {
        match plan {
            Plan::Done(step) => out[i] = Some(Ok(step)),
            Plan::Solo => out[i] = Some(g.step()),
            Plan::Batch(..) => {}
        }
    }
    out.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Internal("a generator was not stepped".into())))).collect()
}

/// One forward pass for generators of one engine at one depth; each sampled step is queued in its `ready`.
fn run_group(members: &mut [(usize, &mut Generator, &[u32])]) -> Result<()> {
    let (engine, loops) = {
        let g = &members.first().ok_or_else(|| Error::Internal("empty batch".into()))?.1;
        (g.engine.clone(), g.loops)
    };
    let logits = {
        let mut seqs: Vec<SeqChunk> = members
            .iter_mut()
            .map(|(_, g, feed)| SeqChunk { cache: &mut g.cache, pos: g.pos, tokens: feed, tree: None })
            .collect();
        engine.model.forward(&mut seqs, loops, LogitRows::Last)?.to_vec2::<f32>()?
    };
    for ((_, g, feed), mut row) in members.iter_mut().zip(logits) {
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
    Ok(())
}
