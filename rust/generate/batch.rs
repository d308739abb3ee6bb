//! Continuous batching: one step of many sequences at once. Every plain decode step, every unwindowed prompt
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

use candle_core::Tensor;
use rayon::prelude::*;

use super::chain::ChainRound;
use super::plan::Speculative;
use super::seq::SeqState;
use crate::error::{Error, Result};
use crate::model::{AutoDepth, Model, RowBlock, SeqChunk};
use crate::profile::{self, Stage};

/// What a sequence does in a batched step.
pub(super) enum Work {
    /// Feed these tokens (the pending one, or a prompt chunk) through every loop and sample from the last row.
    Plain(Vec<u32>),
    /// One chain-speculative draft + verify round; with a rule, each verified row stops looping by it.
    Chain(Speculative, Option<AutoDepth>),
    /// Feed the pending token through loops until the rule stops it (adaptive depth), and sample from that row.
    Auto(u32, AutoDepth),
}

pub(super) struct Member<'g> {
    pub seq: &'g mut SeqState,
    pub work: Work,
}

/// The passes of one step for sequences of one model at verify depth `loops`; each member's steps are queued in
/// its `ready`. Nothing is emitted unless every pass succeeded.
pub(super) fn run_group(model: &Model, loops: usize, members: &mut [Member]) -> Result<()> {
    let mut rounds: Vec<Option<ChainRound>> = members
        .iter_mut()
        .map(|m| match m.work {
            Work::Chain(spec, _) => ChainRound::start(m.seq, spec).map(Some),
            Work::Plain(_) | Work::Auto(..) => Ok(None),
        })
        .collect::<Result<_>>()?;
    // Plain rows ride along with the first draft pass up to the lowest draft depth, then join the verification.
    let pause = rounds.iter().flatten().map(|r| r.spec.draft_loops).min().unwrap_or(loops);
    let plain_x = draft_passes(model, members, &mut rounds, pause)?;
    let verified = verify_pass(model, loops, members, &rounds, plain_x, pause)?;
    let adaptive = auto_passes(model, loops, members, &rounds)?;
    let mut exits = Vec::with_capacity(members.len());
    let mut finals = Vec::with_capacity(members.len());
    for (v, a) in verified.into_iter().zip(adaptive) {
        let (x, e) = match (v, a) {
            (Some(x), None) => (x, None),
            (None, Some((x, e))) => (x, Some(e)),
            _ => return Err(Error::Internal("a batched row has no hidden state".into())),
        };
        finals.push(x);
        exits.push(e);
    }
    let logits = model.logits(&Tensor::cat(&finals, 0)?)?.to_vec2::<f32>()?;
    profile::time(Stage::Sample, || hand_out(members, rounds, logits, exits))
}

/// An adaptive member's rows at their exits, and the loops each ran.
type Stopped = (Tensor, Vec<usize>);

/// The rows under adaptive depth — decode rows (loops from 0) and adaptive rounds' verification rows (from
/// `draft_loops`) — in shared passes until each one's rule stops it (`Model::run_auto`); per member, its rows'
/// hidden states at their exits and the loops each ran (`None` for the other members).
fn auto_passes(
    model: &Model,
    loops: usize,
    members: &mut [Member],
    rounds: &[Option<ChainRound>],
) -> Result<Vec<Option<Stopped>>> {
    let mut out = vec![None; members.len()];
    let mut blocks = Vec::new();
    let (mut rules, mut owners) = (Vec::new(), Vec::new());
    for (i, (m, round)) in members.iter_mut().zip(rounds).enumerate() {
        let seq = &mut *m.seq;
        let (tokens, x, start, rule) = match (&m.work, round) {
            (Work::Auto(token, rule), _) => {
                let tokens = std::slice::from_ref(token);
                (tokens, model.embed(tokens)?, 0, *rule)
            }
            (Work::Chain(_, Some(rule)), Some(r)) => {
                (&r.inputs[..r.k], Tensor::cat(&r.hidden, 0)?, r.spec.draft_loops, *rule)
            }
            _ => continue,
        };
        let seq_chunk = SeqChunk { cache: &mut seq.cache, pos: seq.pos, tokens, tree: None, exits: None };
        blocks.push(RowBlock { seq: seq_chunk, x, loops: start..loops });
        rules.push(rule);
        owners.push(i);
    }
    if blocks.is_empty() {
        return Ok(out);
    }
    let exits = model.run_auto(&mut blocks, &rules)?;
    for ((i, b), e) in owners.into_iter().zip(blocks).zip(exits) {
        out[i] = Some((b.x, e));
    }
    Ok(out)
}

/// The draft passes: pass j runs draft row j of every round still drafting (loops `0..draft_loops`) and, in the
/// first pass, the plain rows up to `pause`; each round proposes from its row's draft logits. Returns the plain
/// rows' hidden states at `pause`.
fn draft_passes(
    model: &Model,
    members: &mut [Member],
    rounds: &mut [Option<ChainRound>],
    pause: usize,
) -> Result<Vec<Option<Tensor>>> {
    let drafts = rounds.iter().flatten().map(|r| r.k).max().unwrap_or(0);
    let mut plain_x: Vec<Option<Tensor>> = vec![None; members.len()];
    for j in 0..drafts.max(1) {
        let mut blocks = Vec::new();
        let mut owners = Vec::new();
        for (i, (m, round)) in members.iter_mut().zip(rounds.iter()).enumerate() {
            let seq = &mut *m.seq;
            let (tokens, pos, depth) = match (&m.work, round) {
                (Work::Plain(feed), _) if j == 0 => (feed.as_slice(), seq.pos, pause),
                (Work::Chain(..), Some(r)) if j < r.k => (&r.inputs[j..j + 1], seq.pos + j, r.spec.draft_loops),
                _ => continue,
            };
            let x = model.embed(tokens)?;
            blocks.push(RowBlock {
                seq: SeqChunk { cache: &mut seq.cache, pos, tokens, tree: None, exits: None },
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
                profile::time(Stage::Sample, || round.propose(members[i].seq, x, row));
            }
        }
    }
    Ok(plain_x)
}

/// Verification rows and the plain rows' remaining loops (`depth..loops`), in one set of passes; per member, the
/// rows whose logits are wanted: a plain sequence's last, every verification row (`None` for adaptive members).
fn verify_pass(
    model: &Model,
    loops: usize,
    members: &mut [Member],
    rounds: &[Option<ChainRound>],
    mut plain_x: Vec<Option<Tensor>>,
    pause: usize,
) -> Result<Vec<Option<Tensor>>> {
    let mut out = vec![None; members.len()];
    let mut blocks = Vec::new();
    let mut owners = Vec::new();
    let hidden: Vec<Option<Tensor>> = rounds
        .iter()
        .map(|r| r.as_ref().map(|r| Tensor::cat(&r.hidden, 0)).transpose())
        .collect::<candle_core::Result<_>>()?;
    for (i, ((m, round), h)) in members.iter_mut().zip(rounds).zip(hidden).enumerate() {
        let seq = &mut *m.seq;
        let (tokens, x, depth) = match (&m.work, round, h) {
            (Work::Auto(..) | Work::Chain(_, Some(_)), _, _) => continue,
            (Work::Plain(feed), _, _) => (feed.as_slice(), plain_x[i].take(), pause),
            (Work::Chain(_, None), Some(r), h) => (&r.inputs[..r.k], h, r.spec.draft_loops),
            _ => return Err(Error::Internal("a chain member without its round".into())),
        };
        let x = x.ok_or_else(|| Error::Internal("a batched row lost its hidden state".into()))?;
        let seq_chunk = SeqChunk { cache: &mut seq.cache, pos: seq.pos, tokens, tree: None, exits: None };
        blocks.push(RowBlock { seq: seq_chunk, x, loops: depth..loops });
        owners.push(i);
    }
    model.run_blocks(&mut blocks)?;
    for (i, b) in owners.into_iter().zip(blocks) {
        out[i] = Some(match rounds[i] {
            Some(_) => b.x,
            None => b.x.narrow(0, b.seq.tokens.len() - 1, 1)?,
        });
    }
    Ok(out)
}

/// Hand each member its logit rows, in order: a round's `k` verification rows, a plain member's one row. Choosing
/// the tokens (sampling, or verifying a round) is each member's own work, so the members are spread over the pool:
/// with 16 sampled streams it is 16 passes over the vocabulary.
fn hand_out(
    members: &mut [Member],
    rounds: Vec<Option<ChainRound>>,
    logits: Vec<Vec<f32>>,
    exits: Vec<Option<Vec<usize>>>,
) -> Result<()> {
    enum Rows {
        Round(ChainRound, Vec<Vec<f32>>),
        Plain { fed: usize, row: Vec<f32> },
    }
    let mut logits = logits.into_iter();
    let mut work = Vec::with_capacity(members.len());
    for ((m, round), exits) in members.iter_mut().zip(rounds).zip(exits) {
        let rows = match (&m.work, round) {
            (Work::Chain(..), Some(round)) => {
                let rows = logits.by_ref().take(round.k).collect();
                Rows::Round(round, rows)
            }
            (Work::Plain(_) | Work::Auto(..), None) => {
                let fed = if let Work::Plain(feed) = &m.work { feed.len() } else { 1 };
                let row = logits.next().ok_or_else(|| Error::Internal("a batched row has no logits".into()))?;
                Rows::Plain { fed, row }
            }
            _ => return Err(Error::Internal("a chain member without its round".into())),
        };
        work.push((&mut *m.seq, rows, exits));
    }
    work.into_par_iter().for_each(|(seq, rows, exits)| {
        let before = seq.ready.len();
        match rows {
            Rows::Round(round, rows) => round.finish(seq, rows),
            Rows::Plain { fed, mut row } => {
                let step = seq.finish_step(fed, &mut row);
                seq.ready.push_back(step);
            }
        }
        // Each emitted token was chosen from one row, in order: those rows' depths are the tokens'.
        let emitted = seq.ready.len() - before;
        for &d in exits.iter().flatten().take(emitted) {
            seq.auto_loops.record(d);
        }
    });
    Ok(())
}
