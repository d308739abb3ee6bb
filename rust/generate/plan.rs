//! What a request asks to generate — sampling, loop depth, speculative mode, sliding window — as one typed value,
//! validated once where it enters (`Generator::new`); the layers below only assert what it guarantees.

use crate::ensure_arg;
use crate::error::Result;
use crate::grammar::Grammar;
use crate::limits::{MAX_BRANCHES, MAX_CACHE_WINDOW, MAX_DRAFT_AHEAD, MAX_DRAFT_LOOPS, MAX_LOOPS, MAX_TREE_ROWS};
use crate::model::AutoDepth;
use crate::sampler::SamplingParams;

/// Self-speculative decoding: draft `draft_ahead` tokens at `draft_loops` loops, verify them at `verify_loops`.
/// `k_branches > 1` drafts a tree of that many candidates per depth (greedy only); 1 is chain mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Speculative {
    pub draft_loops: usize,
    pub verify_loops: usize,
    pub draft_ahead: usize,
    pub k_branches: usize,
}

/// The arguments of one generation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Generation {
    pub params: SamplingParams,
    /// Loop depth of every token; `None`: the model's `default_loops` (or `speculative.verify_loops`).
    pub loops: Option<usize>,
    pub speculative: Option<Speculative>,
    /// Sliding KV window: attend to the last `cache_window` positions only (0: no window).
    pub cache_window: usize,
    /// What the output must match (structured output); the grammar decides where the output ends.
    pub grammar: Option<Grammar>,
    /// Adaptive depth (`model::AutoDepth`), up to `loops` (the model's default when unset) as `max_loops`.
    pub auto: Option<AutoDepth>,
}

impl Generation {
    /// Every check that needs no model: sampling parameters, depths, speculative settings, window.
    pub fn validate(&self) -> Result<()> {
        self.params.validate()?;
        if let Some(loops) = self.loops {
            ensure_arg!((1..=MAX_LOOPS).contains(&loops), "loops must be in 1..={MAX_LOOPS}, got {loops}");
        }
        ensure_arg!(
            self.cache_window <= MAX_CACHE_WINDOW,
            "cache_window must be in 0..={MAX_CACHE_WINDOW}, got {}",
            self.cache_window
        );
        if self.grammar.is_some() {
            ensure_arg!(
                !self.params.ignore_eos && self.params.min_tokens == 0,
                "a grammar decides where the output ends: leave ignore_eos false and min_tokens 0"
            );
        }
        if let Some(auto) = self.auto {
            if let Some(spec) = &self.speculative {
                ensure_arg!(
                    spec.k_branches == 1,
                    "tree speculative decoding (K_branches > 1) is not available with loops \"auto\""
                );
                ensure_arg!(
                    spec.draft_loops < auto.min_loops.max(2),
                    "with loops \"auto\", draft_loops ({}) must be below max(min_loops, 2) ({}): drafts run loops \
                     that no token may stop before",
                    spec.draft_loops,
                    auto.min_loops.max(2)
                );
            }
            ensure_arg!(
                auto.min_loops >= 1 && self.loops.is_none_or(|l| auto.min_loops <= l),
                "min_loops must be at least 1 and at most max_loops, got {}",
                auto.min_loops
            );
            if let Some(threshold) = auto.threshold {
                ensure_arg!(
                    threshold.is_finite() && threshold >= 0.0,
                    "exit_threshold must be a finite number >= 0, got {threshold}"
                );
            }
        }
        match &self.speculative {
            Some(spec) => spec.validate(&self.params, self.loops),
            None => Ok(()),
        }
    }

    /// The depth every emitted token is chosen at: `verify_loops` when speculative, else `loops`, else the model's
    /// `default_loops`.
    pub fn depth(&self, default_loops: usize) -> usize {
        match (&self.speculative, self.loops) {
            (Some(spec), _) => spec.verify_loops,
            (None, Some(loops)) => loops,
            (None, None) => default_loops,
        }
    }
}

impl Speculative {
    fn validate(&self, params: &SamplingParams, loops: Option<usize>) -> Result<()> {
        let Speculative { draft_loops, verify_loops, draft_ahead, k_branches } = *self;
        ensure_arg!(
            (1..=MAX_LOOPS).contains(&verify_loops),
            "verify_loops must be in 1..={MAX_LOOPS}, got {verify_loops}"
        );
        ensure_arg!(
            loops.is_none_or(|l| l == verify_loops),
            "loops ({}) differs from verify_loops ({verify_loops}): leave loops unset when speculative",
            loops.unwrap_or_default()
        );
        ensure_arg!(
            draft_loops >= 1 && draft_loops < verify_loops,
            "draft_loops ({draft_loops}) must be at least 1 and below verify_loops ({verify_loops})"
        );
        ensure_arg!(draft_loops <= MAX_DRAFT_LOOPS, "draft_loops must be in 1..={MAX_DRAFT_LOOPS}, got {draft_loops}");
        ensure_arg!(
            (1..=MAX_DRAFT_AHEAD).contains(&draft_ahead),
            "draft_ahead must be in 1..={MAX_DRAFT_AHEAD}, got {draft_ahead}"
        );
        ensure_arg!(
            (1..=MAX_BRANCHES).contains(&k_branches),
            "K_branches must be in 1..={MAX_BRANCHES}, got {k_branches}"
        );
        ensure_arg!(
            k_branches * draft_ahead <= MAX_TREE_ROWS,
            "K_branches * draft_ahead must be between 1 and {MAX_TREE_ROWS}, got {k_branches} * {draft_ahead}"
        );
        ensure_arg!(
            k_branches == 1 || params.temperature == 0.0,
            "tree speculative decoding (K_branches > 1) is greedy-only: set temperature to 0"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    fn spec(draft_loops: usize, verify_loops: usize, draft_ahead: usize, k_branches: usize) -> Generation {
        let speculative = Some(Speculative { draft_loops, verify_loops, draft_ahead, k_branches });
        Generation { params: greedy(), speculative, ..Default::default() }
    }

    fn error(g: &Generation) -> String {
        g.validate().unwrap_err().to_string()
    }

    #[test]
    fn each_rule_names_its_parameter() {
        assert!(Generation::default().validate().is_ok());
        assert!(spec(2, 8, 4, 1).validate().is_ok() && spec(1, 4, 8, 8).validate().is_ok());
        assert!(error(&Generation { loops: Some(0), ..Default::default() }).contains("loops must be in 1..=64"));
        assert!(error(&Generation { loops: Some(65), ..Default::default() }).contains("loops"));
        assert!(
            error(&Generation { cache_window: MAX_CACHE_WINDOW + 1, ..Default::default() }).contains("cache_window")
        );
        assert!(error(&spec(4, 4, 2, 1)).contains("below verify_loops"));
        assert!(error(&spec(33, 40, 2, 1)).contains("draft_loops must be in 1..=32"));
        assert!(error(&spec(2, 4, 0, 1)).contains("draft_ahead"));
        assert!(error(&spec(2, 4, 17, 1)).contains("draft_ahead"));
        assert!(error(&spec(2, 4, 2, 17)).contains("K_branches must be"));
        assert!(error(&spec(2, 4, 9, 8)).contains("between 1 and 64"));
        assert!(error(&spec(2, 65, 2, 1)).contains("verify_loops"));
        let sampled = Generation { params: SamplingParams::default(), ..spec(2, 4, 2, 2) };
        assert!(error(&sampled).contains("greedy-only"));
        let both = Generation { loops: Some(6), ..spec(2, 8, 4, 1) };
        assert!(error(&both).contains("leave loops unset"));
        assert!(Generation { loops: Some(8), ..spec(2, 8, 4, 1) }.validate().is_ok());
        let auto = |min_loops, threshold| Generation {
            loops: Some(8),
            auto: Some(AutoDepth { min_loops, threshold: Some(threshold) }),
            ..Default::default()
        };
        assert!(auto(2, 0.01).validate().is_ok() && auto(8, 0.0).validate().is_ok());
        assert!(error(&auto(9, 0.01)).contains("min_loops"));
        assert!(error(&auto(0, 0.01)).contains("min_loops"));
        assert!(error(&auto(2, f32::NAN)).contains("exit_threshold"));
        assert!(error(&auto(2, -1.0)).contains("exit_threshold"));
        let with_rule =
            |min_loops, g: Generation| Generation { auto: Some(AutoDepth { min_loops, threshold: Some(0.01) }), ..g };
        assert!(with_rule(3, spec(2, 8, 4, 1)).validate().is_ok() && with_rule(2, spec(1, 8, 4, 1)).validate().is_ok());
        assert!(error(&with_rule(2, spec(2, 8, 4, 1))).contains("draft_loops (2) must be below max(min_loops, 2) (2)"));
        assert!(error(&with_rule(4, spec(1, 8, 4, 2))).contains("K_branches"));
        let bad_params = Generation { params: SamplingParams { top_p: 2.0, ..greedy() }, ..Default::default() };
        assert!(error(&bad_params).contains("top_p"));
    }

    #[test]
    fn depth_is_verify_loops_then_loops_then_the_model_default() {
        assert_eq!(spec(2, 8, 4, 1).depth(5), 8);
        assert_eq!(Generation { loops: Some(3), ..Default::default() }.depth(5), 3);
        assert_eq!(Generation::default().depth(5), 5);
    }
}
