//! Where a step's time goes: wall time per stage of the forward pass and of token choice, summed over the whole
//! process while profiling is on (`start` / `stop`; `tinyloop.start_profile()` in Python, `POST /start_profile` on
//! the server). Off, each timed stage costs one relaxed atomic load.
//!
//! Stages nest: `Step` (one `Generator::step` or `step_many` call) holds the rest; `Blocks` (the prelude and the
//! loops) holds `Matmul` (the layers' weight products) and `Attention` (RoPE, the KV-cache write and attention);
//! what `Blocks` holds beyond those two is norms, residual adds and activations. Each stage is timed on the thread
//! that runs it, as wall time, so parallel work inside a stage counts once. Where a batched step runs its sequences
//! in one group per thread (`Model::run_blocks`), the stages inside `Blocks` are timed in the first group only
//! (`muted` silences the others): the groups hold about equal rows and run side by side, so one group's stages
//! split `Blocks`' wall time as the whole step's would.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// One step as the caller sees it: the forward pass, the head, choosing tokens, and bookkeeping.
    Step,
    /// Token embeddings.
    Embed,
    /// The prelude and the block loops.
    Blocks,
    /// Weight products of the layers (inside `Blocks`).
    Matmul,
    /// RoPE, the KV write and attention over the cache (inside `Blocks`).
    Attention,
    /// Final norm and output head (the full head, or the draft head for speculative drafts).
    Head,
    /// Penalties, grammar masks, sampling or verification, and emitting the tokens.
    Sample,
}

impl Stage {
    pub const ALL: [Stage; 7] =
        [Stage::Step, Stage::Embed, Stage::Blocks, Stage::Matmul, Stage::Attention, Stage::Head, Stage::Sample];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Step => "step",
            Stage::Embed => "embed",
            Stage::Blocks => "blocks",
            Stage::Matmul => "matmul",
            Stage::Attention => "attention",
            Stage::Head => "head",
            Stage::Sample => "sample",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
thread_local! {
    /// This thread's stages are not timed (`muted`).
    static MUTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static NANOS: [AtomicU64; Stage::ALL.len()] = [const { AtomicU64::new(0) }; Stage::ALL.len()];
static CALLS: [AtomicU64; Stage::ALL.len()] = [const { AtomicU64::new(0) }; Stage::ALL.len()];

/// Run `f`, adding its wall time to `stage` while profiling is on.
#[inline]
pub fn time<T>(stage: Stage, f: impl FnOnce() -> T) -> T {
    if !ON.load(Ordering::Relaxed) || MUTED.get() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let nanos = start.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
    NANOS[stage as usize].fetch_add(nanos, Ordering::Relaxed);
    CALLS[stage as usize].fetch_add(1, Ordering::Relaxed);
    out
}

/// Run `f` with this thread's stage timing off (a parallel group whose stages another group's timing stands for).
pub fn muted<T>(f: impl FnOnce() -> T) -> T {
    /// Puts the flag back however `f` ends (a panic is caught further up, and the pool thread lives on).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            MUTED.set(self.0);
        }
    }
    let _restore = Restore(MUTED.replace(true));
    f()
}

/// Zero the totals and start timing.
pub fn start() {
    for (n, c) in NANOS.iter().zip(&CALLS) {
        n.store(0, Ordering::Relaxed);
        c.store(0, Ordering::Relaxed);
    }
    ON.store(true, Ordering::SeqCst);
}

/// One stage's totals since `start`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Total {
    pub stage: Stage,
    pub seconds: f64,
    pub calls: u64,
}

/// Stop timing; the totals since `start`, every stage in `Stage::ALL` order.
pub fn stop() -> Vec<Total> {
    ON.store(false, Ordering::SeqCst);
    Stage::ALL
        .iter()
        .map(|&stage| Total {
            stage,
            seconds: NANOS[stage as usize].load(Ordering::Relaxed) as f64 * 1e-9,
            calls: CALLS[stage as usize].load(Ordering::Relaxed),
        })
        .collect()
}
