//! The frozen values Python passes to and gets from the engine: sampling parameters, the model's configuration,
//! speculative and adaptive-depth settings, grammars, a whole `Generation`, a finished completion.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::generate::{Generation, Speculative};
use crate::grammar::Grammar;
use crate::model::AutoDepth;
use crate::sampler::SamplingParams;

use super::errors::to_py;

/// Frozen sampling parameters (the module doc of `sampler/mod.rs` gives the exact semantics).
#[pyclass(name = "SamplingParams", frozen, module = "tinyloop._core")]
#[derive(Clone)]
pub(super) struct PySamplingParams(pub(super) SamplingParams);

#[pymethods]
impl PySamplingParams {
    #[new]
    #[pyo3(signature = (*, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, presence_penalty=0.0,
        frequency_penalty=0.0, seed=None, max_tokens=128, min_tokens=0, ignore_eos=false, stop_token_ids=vec![],
        logprobs=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        temperature: f32,
        top_k: usize,
        top_p: f32,
        repetition_penalty: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        seed: Option<u64>,
        max_tokens: usize,
        min_tokens: usize,
        ignore_eos: bool,
        stop_token_ids: Vec<u32>,
        logprobs: Option<usize>,
    ) -> PyResult<Self> {
        let p = SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
            max_tokens,
            min_tokens,
            ignore_eos,
            stop_token_ids,
            logprobs,
        };
        p.validate().map_err(to_py)?;
        Ok(Self(p))
    }

    #[getter]
    fn temperature(&self) -> f32 {
        self.0.temperature
    }
    #[getter]
    fn top_k(&self) -> usize {
        self.0.top_k
    }
    #[getter]
    fn top_p(&self) -> f32 {
        self.0.top_p
    }
    #[getter]
    fn repetition_penalty(&self) -> f32 {
        self.0.repetition_penalty
    }
    #[getter]
    fn presence_penalty(&self) -> f32 {
        self.0.presence_penalty
    }
    #[getter]
    fn frequency_penalty(&self) -> f32 {
        self.0.frequency_penalty
    }
    #[getter]
    fn seed(&self) -> Option<u64> {
        self.0.seed
    }
    #[getter]
    fn max_tokens(&self) -> usize {
        self.0.max_tokens
    }
    #[getter]
    fn min_tokens(&self) -> usize {
        self.0.min_tokens
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.0.ignore_eos
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.0.stop_token_ids.clone()
    }
    #[getter]
    fn logprobs(&self) -> Option<usize> {
        self.0.logprobs
    }

    fn __repr__(&self) -> String {
        format!("SamplingParams({:?})", self.0)
    }
}

/// The model's configuration, as read from the file.
#[pyclass(name = "ModelInfo", frozen, get_all, module = "tinyloop._core")]
pub(super) struct PyModelInfo {
    pub(super) name: String,
    pub(super) dim: usize,
    pub(super) n_heads: usize,
    pub(super) n_kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) ffn_dim: usize,
    pub(super) vocab_size: usize,
    pub(super) block_count: usize,
    pub(super) prelude_count: usize,
    pub(super) default_loops: usize,
    pub(super) max_trained_loops: usize,
    pub(super) context_length: usize,
    pub(super) max_seq_len: usize,
    pub(super) quant: String,
    pub(super) kv_dtype: String,
    pub(super) kv_cache_mode: String,
    /// "none" or "last" (loops share the last loop's KV after the prompt).
    pub(super) kv_share: String,
    /// Where the model computes: "cpu", "cuda:N" or "candle-cpu".
    pub(super) device: String,
    /// Tokens speculative drafts may propose through the draft head; 0 when drafts use the full head.
    pub(super) draft_vocab_size: usize,
    /// Tokens `loops="auto"`'s settling rule compares successive loops over; 0 when it reads the full head.
    pub(super) exit_vocab_size: usize,
}

#[pymethods]
impl PyModelInfo {
    fn __repr__(&self) -> String {
        format!(
            "ModelInfo(name={:?}, dim={}, n_heads={}, n_kv_heads={}, ffn_dim={}, k={}, default_loops={}, quant={:?})",
            self.name,
            self.dim,
            self.n_heads,
            self.n_kv_heads,
            self.ffn_dim,
            self.block_count,
            self.default_loops,
            self.quant
        )
    }
}

/// Self-speculative settings: draft `draft_ahead` tokens at `draft_loops` loops, verify at `verify_loops`;
/// `k_branches > 1` drafts a tree (greedy only). Checked when a generation starts, not here.
#[pyclass(name = "Speculative", frozen, module = "tinyloop._core")]
#[derive(Clone)]
pub(super) struct PySpeculative(pub(super) Speculative);

#[pymethods]
impl PySpeculative {
    #[new]
    #[pyo3(signature = (draft_loops, verify_loops, draft_ahead, k_branches=1))]
    fn new(draft_loops: usize, verify_loops: usize, draft_ahead: usize, k_branches: usize) -> Self {
        Self(Speculative { draft_loops, verify_loops, draft_ahead, k_branches })
    }

    #[getter]
    fn draft_loops(&self) -> usize {
        self.0.draft_loops
    }
    #[getter]
    fn verify_loops(&self) -> usize {
        self.0.verify_loops
    }
    #[getter]
    fn draft_ahead(&self) -> usize {
        self.0.draft_ahead
    }
    #[getter]
    fn k_branches(&self) -> usize {
        self.0.k_branches
    }

    fn __repr__(&self) -> String {
        let Speculative { draft_loops, verify_loops, draft_ahead, k_branches } = self.0;
        format!("Speculative(draft_loops={draft_loops}, verify_loops={verify_loops}, draft_ahead={draft_ahead}, k_branches={k_branches})")
    }
}

/// Adaptive depth: each generated token stops looping once the model's exit rule is met, and at `max_loops` at the
/// latest (the model's default loops when None). Without an exit gate in the file: after loop `d >= max(min_loops,
/// 2)` once the KL divergence of its exit distribution at `d` from the one at `d - 1` is below `threshold`; with one
/// (Ouro's): after loop `d >= min_loops` once the gate's cumulative exit probability reaches `threshold`.
/// `threshold=None` is the model's default (`Engine.exit_threshold`). `loops="auto"` is `AutoDepth()`. Checked
/// when a generation starts.
#[pyclass(name = "AutoDepth", frozen, from_py_object, module = "tinyloop._core")]
#[derive(Clone)]
pub(super) struct PyAutoDepth {
    pub(super) rule: AutoDepth,
    pub(super) max_loops: Option<usize>,
}

#[pymethods]
impl PyAutoDepth {
    #[new]
    #[pyo3(signature = (min_loops=AutoDepth::DEFAULT_MIN_LOOPS, max_loops=None, threshold=None))]
    fn new(min_loops: usize, max_loops: Option<usize>, threshold: Option<f32>) -> Self {
        Self { rule: AutoDepth { min_loops, threshold }, max_loops }
    }

    #[getter]
    fn min_loops(&self) -> usize {
        self.rule.min_loops
    }
    #[getter]
    fn max_loops(&self) -> Option<usize> {
        self.max_loops
    }
    #[getter]
    fn threshold(&self) -> Option<f32> {
        self.rule.threshold
    }

    fn __repr__(&self) -> String {
        let show = |v: Option<String>| v.unwrap_or_else(|| "None".to_string());
        let max = show(self.max_loops.map(|l| l.to_string()));
        let threshold = show(self.rule.threshold.map(|t| t.to_string()));
        format!("AutoDepth(min_loops={}, max_loops={max}, threshold={threshold})", self.rule.min_loops)
    }
}

/// `loops` as Python gives it: a depth, `"auto"`, or an `AutoDepth`.
#[derive(FromPyObject)]
pub(super) enum LoopsArg {
    Fixed(usize),
    Auto(PyAutoDepth),
    Name(String),
}

/// A `loops` argument as (fixed depth or adaptive maximum, adaptive rule).
pub(super) fn depth_of(loops: Option<LoopsArg>) -> PyResult<(Option<usize>, Option<AutoDepth>)> {
    match loops {
        None => Ok((None, None)),
        Some(LoopsArg::Fixed(n)) => Ok((Some(n), None)),
        Some(LoopsArg::Auto(a)) => Ok((a.max_loops, Some(a.rule))),
        Some(LoopsArg::Name(name)) if name == "auto" => Ok((None, Some(AutoDepth::default()))),
        Some(LoopsArg::Name(name)) => {
            Err(PyValueError::new_err(format!("loops must be an int, \"auto\" or an AutoDepth, got {name:?}")))
        }
    }
}

/// What an output must match: `Grammar.json_schema(schema)` (a dict, or JSON text), `Grammar.lark(text)` (llguidance's
/// Lark dialect) or `Grammar.regex(pattern)`. Compiled when a generation starts: a grammar that cannot be compiled
/// raises `InvalidRequestError` naming the cause.
#[pyclass(name = "Grammar", frozen, module = "tinyloop._core")]
#[derive(Clone)]
pub(super) struct PyGrammar(pub(super) Grammar);

#[pymethods]
impl PyGrammar {
    #[staticmethod]
    fn json_schema(schema: &Bound<'_, PyAny>) -> PyResult<Self> {
        let text = match schema.extract::<String>() {
            Ok(text) => text,
            Err(_) => schema.py().import("json")?.call_method1("dumps", (schema,))?.extract()?,
        };
        Ok(Self(Grammar::JsonSchema(text)))
    }

    #[staticmethod]
    fn lark(text: String) -> Self {
        Self(Grammar::Lark(text))
    }

    #[staticmethod]
    fn regex(pattern: String) -> Self {
        Self(Grammar::Regex(pattern))
    }

    /// "json_schema", "lark" or "regex".
    #[getter]
    fn kind(&self) -> &'static str {
        self.parts().0
    }

    /// The schema (JSON text), grammar or pattern.
    #[getter]
    fn source(&self) -> &str {
        self.parts().1
    }

    fn __repr__(&self) -> String {
        let (kind, source) = self.parts();
        format!("Grammar.{kind}({source:?})")
    }
}

impl PyGrammar {
    pub(super) fn parts(&self) -> (&'static str, &str) {
        match &self.0 {
            Grammar::JsonSchema(t) => ("json_schema", t),
            Grammar::Lark(t) => ("lark", t),
            Grammar::Regex(t) => ("regex", t),
        }
    }
}

/// What one generation runs: sampling parameters, loop depth (the model's default when None), speculative
/// settings, sliding window and grammar. Checked when a generation starts, not here.
#[pyclass(name = "Generation", frozen, module = "tinyloop._core")]
pub(super) struct PyGeneration(pub(super) Generation);

#[pymethods]
impl PyGeneration {
    #[new]
    #[pyo3(signature = (params=None, *, loops=None, speculative=None, cache_window=0, grammar=None))]
    fn new(
        params: Option<&PySamplingParams>,
        loops: Option<LoopsArg>,
        speculative: Option<&PySpeculative>,
        cache_window: usize,
        grammar: Option<&PyGrammar>,
    ) -> PyResult<Self> {
        let params = params.map(|p| p.0.clone()).unwrap_or_default();
        let grammar = grammar.map(|g| g.0.clone());
        let (loops, auto) = depth_of(loops)?;
        Ok(Self(Generation { params, loops, speculative: speculative.map(|s| s.0), cache_window, grammar, auto }))
    }

    #[getter]
    fn params(&self) -> PySamplingParams {
        PySamplingParams(self.0.params.clone())
    }
    /// The fixed depth, or the most loops under adaptive depth (None: the model's default).
    #[getter]
    fn loops(&self) -> Option<usize> {
        self.0.loops
    }
    #[getter]
    fn auto(&self) -> Option<PyAutoDepth> {
        self.0.auto.map(|rule| PyAutoDepth { rule, max_loops: self.0.loops })
    }
    #[getter]
    fn speculative(&self) -> Option<PySpeculative> {
        self.0.speculative.map(PySpeculative)
    }
    #[getter]
    fn cache_window(&self) -> usize {
        self.0.cache_window
    }
    #[getter]
    fn grammar(&self) -> Option<PyGrammar> {
        self.0.grammar.clone().map(PyGrammar)
    }

    fn __repr__(&self) -> String {
        let loops = self.0.loops.map_or("None".to_string(), |l| l.to_string());
        let spec = self.0.speculative.map_or("None".to_string(), |s| PySpeculative(s).__repr__());
        let grammar = self.grammar().map_or("None".to_string(), |g| g.__repr__());
        format!(
            "Generation(params={}, loops={loops}, speculative={spec}, cache_window={}, grammar={grammar})",
            PySamplingParams(self.0.params.clone()).__repr__(),
            self.0.cache_window
        )
    }
}

/// A token's log-probability and the best alternatives at its position: (logprob, [(token id, logprob), ...]).
pub(super) type PyLogprob = (f32, Vec<(u32, f32)>);

/// Result of `Engine.generate`. The draft counters are 0 unless the generation was speculative; `logprobs` holds one
/// entry per token when the sampling parameters asked for them.
#[pyclass(name = "Completion", frozen, get_all, module = "tinyloop._core")]
pub(super) struct PyCompletion {
    pub(super) tokens: Vec<u32>,
    pub(super) logprobs: Option<Vec<PyLogprob>>,
    pub(super) text: String,
    pub(super) finish_reason: String,
    pub(super) prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prompt cache.
    pub(super) cached_tokens: usize,
    pub(super) completion_tokens: usize,
    pub(super) draft_rounds: usize,
    pub(super) draft_proposed: usize,
    pub(super) draft_accepted: usize,
    /// Under adaptive depth: (tokens it decided, loops they ran); (0, 0) otherwise.
    pub(super) auto_loops: (usize, usize),
}
