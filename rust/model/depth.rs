//! The rule of adaptive depth (`loops: "auto"`), which `Model::run_auto` (`exit.rs`) applies.

/// Adaptive depth (`loops: "auto"`): each generated token runs loops one at a time and stops after loop `d` once
/// the model's exit rule says so, and at the generation's depth (`max_loops`) at the latest. The rule is the model's:
///
/// - **settling** (models without an exit gate): after loop `d ≥ max(min_loops, 2)`, when the KL divergence of the
///   exit distribution at `d` from the one at `d − 1` is below `threshold`. The exit distribution is the draft
///   head's (the file's draft vocabulary) when the model has one, else the full head's.
/// - **the exit gate** (a file with `exit_gate.*`, Ouro's): after loop `d ≥ min_loops`, when the cumulative exit
///   probability `1 − Π_{j≤d} (1 − λ_j)` reaches `threshold`, `λ_j = σ(w · h_j + b)` the gate on loop `j`'s normed
///   state — Ouro's "Q-exit".
///
/// `threshold: None` is the model's default (`Model::default_exit_threshold`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoDepth {
    pub min_loops: usize,
    pub threshold: Option<f32>,
}

impl AutoDepth {
    pub const DEFAULT_MIN_LOOPS: usize = 2;
    /// The settling rule's threshold when neither the request nor the file gives one.
    pub const DEFAULT_THRESHOLD: f32 = 3e-3;
    /// The exit gate's threshold when neither the request nor the file gives one: never before `max_loops`.
    pub const DEFAULT_GATE_THRESHOLD: f32 = 1.0;

    /// The first loop after which a row may stop: settling compares two loops' distributions, the gate needs one.
    pub(super) fn first_check(&self, gated: bool) -> usize {
        if gated {
            self.min_loops.max(1)
        } else {
            self.min_loops.max(2)
        }
    }
}

impl Default for AutoDepth {
    fn default() -> Self {
        Self { min_loops: Self::DEFAULT_MIN_LOOPS, threshold: None }
    }
}
