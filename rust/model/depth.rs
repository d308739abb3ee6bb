//! The rule of adaptive depth (`loops: "auto"`), which `Model::run_auto` (`exit.rs`) applies.

/// Adaptive depth (`loops: "auto"`): each generated token runs loops one at a time and stops once its next-token
/// distribution has settled — after loop `d ≥ max(min_loops, 2)`, when the KL divergence of the exit distribution at
/// `d` from the one at `d − 1` is below `threshold` — or at the generation's depth (`max_loops`). The exit
/// distribution is the draft head's (the file's draft vocabulary) when the model has one, else the full head's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoDepth {
    pub min_loops: usize,
    pub threshold: f32,
}

impl AutoDepth {
    pub const DEFAULT_MIN_LOOPS: usize = 2;
    pub const DEFAULT_THRESHOLD: f32 = 3e-3;

    /// The first loop after which a row may stop.
    pub(super) fn first_check(&self) -> usize {
        self.min_loops.max(2)
    }
}

impl Default for AutoDepth {
    fn default() -> Self {
        Self { min_loops: Self::DEFAULT_MIN_LOOPS, threshold: Self::DEFAULT_THRESHOLD }
    }
}
