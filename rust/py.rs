//! The Python module `tinyloop._core`. Everything Python-facing lives here: argument conversion, GIL release,
//! typed exceptions. Heavy calls run with the GIL released; a Rust panic becomes `EngineError`, never a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::Error;
use crate::generate::{
    step_batch, Engine as RsEngine, Generation as RsGeneration, Generator, PromptCache, Speculative as RsSpeculative,
    Step,
};
use crate::grammar::Grammar as RsGrammar;
use crate::kv::KvCache;
use crate::limits::{
    MAX_BRANCHES, MAX_CACHE_WINDOW, MAX_DRAFT_AHEAD, MAX_DRAFT_LOOPS, MAX_LOGPROBS, MAX_LOOPS, MAX_TOP_K,
    MAX_TREE_ROWS, PREFILL_CHUNK, WINDOW_SLACK,
};
use crate::model::{AutoDepth as RsAutoDepth, Compute, DEVICE_NAMES};
use crate::sampler::SamplingParams as RsParams;

create_exception!(_core, TinyloopError, PyException, "Base class of every tinyloop engine error.");
create_exception!(
    _core,
    ModelLoadError,
    TinyloopError,
    "The model file is missing, not GGUF, or not a valid tinyloop model."
);
create_exception!(
    _core,
    TokenizerError,
    TinyloopError,
    "The vocabulary in the file cannot form a GPT-2 tokenizer, or text cannot be tokenized."
);
create_exception!(_core, InvalidRequestError, TinyloopError, "An argument is out of range or inconsistent.");
create_exception!(_core, ContextLengthError, InvalidRequestError, "Prompt plus max_tokens exceeds the sequence limit.");
create_exception!(
    _core,
    DeviceError,
    TinyloopError,
    "The device asked for cannot be used: a build without its backend, or no such GPU or driver."
);
create_exception!(
    _core,
    EngineError,
    TinyloopError,
    "An internal engine failure (a bug): the request failed, the engine keeps serving."
);

fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::NotFound(_) | Error::NotGguf { .. } | Error::Format { .. } => ModelLoadError::new_err(msg),
        Error::Tokenizer(_) => TokenizerError::new_err(msg),
        Error::InvalidArgument(_) => InvalidRequestError::new_err(msg),
        Error::ContextLength { .. } => ContextLengthError::new_err(msg),
        Error::Device(_) => DeviceError::new_err(msg),
        Error::Internal(_) => EngineError::new_err(msg),
    }
}

/// Run model work `f` with the GIL released on a thread of the rayon pool: the kernels' many parallel regions per
/// step then start from a worker, instead of parking and waking the calling thread at every one of them (those
/// futex hand-offs cost ~15% of a 16-stream decode). Tokenizing and loading stay on the calling thread.
fn computed<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    detached(py, || rayon::scope(|_| f()))
}

/// Run `f` with the GIL released; map errors and panics to Python exceptions.
fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    py.detach(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(Error::Internal(format!("panic in engine: {}", what.unwrap_or_default())))
        }
    })
    .map_err(to_py)
}

#[derive(FromPyObject)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// Frozen sampling parameters (the module doc of `sampler/mod.rs` gives the exact semantics).
#[pyclass(frozen, module = "tinyloop._core")]
#[derive(Clone)]
struct SamplingParams(RsParams);

#[pymethods]
impl SamplingParams {
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
        let p = RsParams {
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
#[pyclass(frozen, get_all, module = "tinyloop._core")]
struct ModelInfo {
    name: String,
    dim: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    ffn_dim: usize,
    vocab_size: usize,
    block_count: usize,
    prelude_count: usize,
    default_loops: usize,
    max_trained_loops: usize,
    context_length: usize,
    max_seq_len: usize,
    quant: String,
    kv_dtype: String,
    kv_cache_mode: String,
    /// "none" or "last" (loops share the last loop's KV after the prompt).
    kv_share: String,
    /// Where the model computes: "cpu", "cuda:N" or "candle-cpu".
    device: String,
    /// Tokens speculative drafts may propose through the draft head; 0 when drafts use the full head.
    draft_vocab_size: usize,
    /// Tokens `loops="auto"`'s settling rule compares successive loops over; 0 when it reads the full head.
    exit_vocab_size: usize,
}

#[pymethods]
impl ModelInfo {
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
struct PySpeculative(RsSpeculative);

#[pymethods]
impl PySpeculative {
    #[new]
    #[pyo3(signature = (draft_loops, verify_loops, draft_ahead, k_branches=1))]
    fn new(draft_loops: usize, verify_loops: usize, draft_ahead: usize, k_branches: usize) -> Self {
        Self(RsSpeculative { draft_loops, verify_loops, draft_ahead, k_branches })
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
        let RsSpeculative { draft_loops, verify_loops, draft_ahead, k_branches } = self.0;
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
struct PyAutoDepth {
    rule: RsAutoDepth,
    max_loops: Option<usize>,
}

#[pymethods]
impl PyAutoDepth {
    #[new]
    #[pyo3(signature = (min_loops=RsAutoDepth::DEFAULT_MIN_LOOPS, max_loops=None, threshold=None))]
    fn new(min_loops: usize, max_loops: Option<usize>, threshold: Option<f32>) -> Self {
        Self { rule: RsAutoDepth { min_loops, threshold }, max_loops }
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
enum LoopsArg {
    Fixed(usize),
    Auto(PyAutoDepth),
    Name(String),
}

/// A `loops` argument as (fixed depth or adaptive maximum, adaptive rule).
fn depth_of(loops: Option<LoopsArg>) -> PyResult<(Option<usize>, Option<RsAutoDepth>)> {
    match loops {
        None => Ok((None, None)),
        Some(LoopsArg::Fixed(n)) => Ok((Some(n), None)),
        Some(LoopsArg::Auto(a)) => Ok((a.max_loops, Some(a.rule))),
        Some(LoopsArg::Name(name)) if name == "auto" => Ok((None, Some(RsAutoDepth::default()))),
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
struct PyGrammar(RsGrammar);

#[pymethods]
impl PyGrammar {
    #[staticmethod]
    fn json_schema(schema: &Bound<'_, PyAny>) -> PyResult<Self> {
        let text = match schema.extract::<String>() {
            Ok(text) => text,
            Err(_) => schema.py().import("json")?.call_method1("dumps", (schema,))?.extract()?,
        };
        Ok(Self(RsGrammar::JsonSchema(text)))
    }

    #[staticmethod]
    fn lark(text: String) -> Self {
        Self(RsGrammar::Lark(text))
    }

    #[staticmethod]
    fn regex(pattern: String) -> Self {
        Self(RsGrammar::Regex(pattern))
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
    fn parts(&self) -> (&'static str, &str) {
        match &self.0 {
            RsGrammar::JsonSchema(t) => ("json_schema", t),
            RsGrammar::Lark(t) => ("lark", t),
            RsGrammar::Regex(t) => ("regex", t),
        }
    }
}

/// What one generation runs: sampling parameters, loop depth (the model's default when None), speculative
/// settings, sliding window and grammar. Checked when a generation starts, not here.
#[pyclass(name = "Generation", frozen, module = "tinyloop._core")]
struct PyGeneration(RsGeneration);

#[pymethods]
impl PyGeneration {
    #[new]
    #[pyo3(signature = (params=None, *, loops=None, speculative=None, cache_window=0, grammar=None))]
    fn new(
        params: Option<&SamplingParams>,
        loops: Option<LoopsArg>,
        speculative: Option<&PySpeculative>,
        cache_window: usize,
        grammar: Option<&PyGrammar>,
    ) -> PyResult<Self> {
        let params = params.map(|p| p.0.clone()).unwrap_or_default();
        let grammar = grammar.map(|g| g.0.clone());
        let (loops, auto) = depth_of(loops)?;
        Ok(Self(RsGeneration { params, loops, speculative: speculative.map(|s| s.0), cache_window, grammar, auto }))
    }

    #[getter]
    fn params(&self) -> SamplingParams {
        SamplingParams(self.0.params.clone())
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
            SamplingParams(self.0.params.clone()).__repr__(),
            self.0.cache_window
        )
    }
}

/// A token's log-probability and the best alternatives at its position: (logprob, [(token id, logprob), ...]).
type PyLogprob = (f32, Vec<(u32, f32)>);

/// Result of `Engine.generate`. The draft counters are 0 unless the generation was speculative; `logprobs` holds one
/// entry per token when the sampling parameters asked for them.
#[pyclass(frozen, get_all, module = "tinyloop._core")]
struct Completion {
    tokens: Vec<u32>,
    logprobs: Option<Vec<PyLogprob>>,
    text: String,
    finish_reason: String,
    prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prompt cache.
    cached_tokens: usize,
    completion_tokens: usize,
    draft_rounds: usize,
    draft_proposed: usize,
    draft_accepted: usize,
    /// Under adaptive depth: (tokens it decided, loops they ran); (0, 0) otherwise.
    auto_loops: (usize, usize),
}

/// One streamed step: a token (`token_id` >= 0, with its bytes, and its log-probability when asked for) and/or the
/// end (`finish_reason`).
#[pyclass(frozen, get_all, module = "tinyloop._core")]
struct StepEvent {
    token_id: i64,
    bytes: Py<PyBytes>,
    finish_reason: Option<String>,
    logprob: Option<PyLogprob>,
}

#[pyclass(module = "tinyloop._core")]
struct TokenStream {
    engine: Arc<RsEngine>,
    generator: Generator,
    done: bool,
    /// Tokens handed out so far (a speculative round emits several before they are handed out one by one).
    handed: usize,
}

impl TokenStream {
    fn new(engine: Arc<RsEngine>, generator: Generator) -> Self {
        Self { engine, generator, done: false, handed: 0 }
    }

    fn event(&mut self, py: Python<'_>, step: Step) -> PyResult<StepEvent> {
        self.done = step.finish.is_some();
        let (bytes, logprob) = match step.token {
            Some(t) => {
                let logprob = self.generator.logprobs().get(self.handed).map(|l| (l.logprob, l.top.clone()));
                self.handed += 1;
                (self.engine.tokenizer.token_bytes(t).map_err(to_py)?.to_vec(), logprob)
            }
            None => (Vec::new(), None),
        };
        Ok(StepEvent {
            token_id: step.token.map_or(-1, i64::from),
            bytes: PyBytes::new(py, &bytes).unbind(),
            finish_reason: step.finish.map(|f| f.as_str().to_string()),
            logprob,
        })
    }
}

#[pymethods]
impl TokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<StepEvent>> {
        if self.done {
            return Ok(None);
        }
        let generator = &mut self.generator;
        let step = computed(py, || generator.step())?;
        self.event(py, step).map(Some)
    }

    /// Tokens in the prompt.
    #[getter]
    fn prompt_tokens(&self) -> usize {
        self.generator.prompt_len()
    }

    /// End the stream (its request is over): its KV goes to the prompt cache and its memory is freed.
    fn release(&mut self, py: Python<'_>) {
        self.done = true;
        let generator = &mut self.generator;
        py.detach(|| generator.release());
    }

    /// Prompt tokens whose KV came from the prompt cache (not prefilled; known from the first step on).
    #[getter]
    fn cached_tokens(&self) -> usize {
        self.generator.cached_tokens()
    }

    /// Bytes of KV cache this request holds.
    #[getter]
    fn kv_bytes(&self) -> usize {
        self.generator.kv_bytes()
    }

    /// (rounds, proposed, accepted) draft tokens so far; zeros unless speculative.
    #[getter]
    fn draft_stats(&self) -> (usize, usize, usize) {
        let d = self.generator.draft();
        (d.rounds, d.proposed, d.accepted)
    }

    /// The loop depth every token is chosen at: the requested loops (the model's default when None), or
    /// verify_loops when speculative; the most loops under adaptive depth.
    #[getter]
    fn loops(&self) -> usize {
        self.generator.loops()
    }

    /// Under adaptive depth: (tokens it decided so far, loops they ran); (0, 0) otherwise.
    #[getter]
    fn auto_loops(&self) -> (usize, usize) {
        let a = self.generator.auto_loops();
        (a.tokens, a.loops)
    }
}

/// Low-level access to one sequence's cache: feed tokens, read logits, roll back. For tests and tools.
#[pyclass(module = "tinyloop._core")]
struct Sequence {
    engine: Arc<RsEngine>,
    cache: KvCache,
    len: usize,
}

#[pymethods]
impl Sequence {
    /// Feed `ids` at depth `loops`; returns float32 logits of every new row, `len(ids) * vocab` values, as bytes.
    fn feed<'py>(&mut self, py: Python<'py>, ids: Vec<u32>, loops: usize) -> PyResult<Bound<'py, PyBytes>> {
        let (engine, cache, pos) = (&self.engine, &mut self.cache, self.len);
        let logits = computed(py, || engine.feed(cache, pos, &ids, loops))?;
        self.len += logits.len() / self.engine.config().vocab_size;
        let raw: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(PyBytes::new(py, &raw))
    }

    /// Roll back to the first `n` positions.
    fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
        self.cache.truncate(self.len);
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// With `kv_share="last"`: keep only the last of `loops` loops' K/V per layer, as a generation does once its
    /// prompt is in; later feeds attend through it. Nothing happens on an engine that keeps every loop's.
    fn share_loops(&mut self, loops: usize) {
        self.cache.collapse(loops);
    }

    #[getter]
    fn kv_bytes(&self) -> usize {
        self.cache.bytes_in_use()
    }
}

#[pyclass(frozen, module = "tinyloop._core")]
struct Engine {
    inner: Arc<RsEngine>,
    path: String,
}

impl Engine {
    fn prompt_ids(&self, py: Python<'_>, prompt: Prompt) -> PyResult<Vec<u32>> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => detached(py, || self.inner.tokenizer.encode_text(&text, false, true)),
        }
    }

    fn generator(&self, py: Python<'_>, prompt: Prompt, args: Keywords) -> PyResult<Generator> {
        let generation = args.generation(self.inner.config().default_loops)?;
        let ids = self.prompt_ids(py, prompt)?;
        let engine = self.inner.clone();
        detached(py, || Generator::new(engine, ids, generation)) // compiling a grammar may take milliseconds
    }
}

/// The arguments of `Engine.generate` / `Engine.stream`: `params` is a `SamplingParams` (or None) with the other
/// keywords, or a whole `Generation` with the others left at their defaults. Either way one `Generation` results.
struct Keywords<'a, 'py> {
    params: Option<&'a Bound<'py, PyAny>>,
    loops: Option<LoopsArg>,
    draft: Option<(usize, usize)>,
    k_branches: usize,
    cache_window: usize,
    grammar: Option<&'a PyGrammar>,
}

impl Keywords<'_, '_> {
    /// `draft=(draft_loops, draft_ahead)` verifies at `loops` (the model's `default_loops` when None).
    fn generation(self, default_loops: usize) -> PyResult<RsGeneration> {
        let Keywords { params, loops, draft, k_branches, cache_window, grammar } = self;
        if let Some(plan) = params.and_then(|p| p.cast::<PyGeneration>().ok()) {
            if loops.is_some() || draft.is_some() || k_branches != 1 || cache_window != 0 || grammar.is_some() {
                return Err(PyTypeError::new_err(
                    "with a Generation as params, leave loops, draft, k_branches, cache_window and grammar at \
                     their defaults: the Generation holds them",
                ));
            }
            return Ok(plan.get().0.clone());
        }
        let params = match params {
            None => RsParams::default(),
            Some(p) => match p.cast::<SamplingParams>() {
                Ok(p) => p.get().0.clone(),
                Err(_) => return Err(PyTypeError::new_err("params must be a SamplingParams, a Generation or None")),
            },
        };
        let (loops, auto) = depth_of(loops)?;
        let speculative = draft.map(|(draft_loops, draft_ahead)| RsSpeculative {
            draft_loops,
            verify_loops: loops.unwrap_or(default_loops),
            draft_ahead,
            k_branches,
        });
        let loops = if speculative.is_some() { None } else { loops };
        let grammar = grammar.map(|g| g.0.clone());
        Ok(RsGeneration { params, loops, speculative, cache_window, grammar, auto })
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        path, max_seq_len=None, kv_cache_mode="fp16", draft_vocab=true, grammar_threads=None,
        prompt_cache_mib=256, prompt_cache_entries=4, prompt_cache_disk=None, prompt_cache_disk_mib=1024,
        kv_share="none", device="cpu",
    ))]
    #[allow(clippy::too_many_arguments)] // the Python keyword signature
    fn new(
        py: Python<'_>,
        path: PathBuf,
        max_seq_len: Option<usize>,
        kv_cache_mode: &str,
        draft_vocab: bool,
        grammar_threads: Option<usize>,
        prompt_cache_mib: usize,
        prompt_cache_entries: usize,
        prompt_cache_disk: Option<PathBuf>,
        prompt_cache_disk_mib: u64,
        kv_share: &str,
        device: &str,
    ) -> PyResult<Self> {
        let prompt_cache = PromptCache {
            max_bytes: prompt_cache_mib.saturating_mul(1 << 20),
            max_entries: prompt_cache_entries,
            disk: prompt_cache_disk.map(|dir| (dir, prompt_cache_disk_mib.saturating_mul(1 << 20))),
        };
        let mut inner = detached(py, || {
            let mut engine = RsEngine::load_on(&path, max_seq_len, kv_cache_mode, Compute::parse(device)?)?;
            engine.set_kv_share(kv_share)?;
            engine.set_prompt_cache(prompt_cache)?;
            Ok(engine)
        })?;
        inner.model.set_use_draft_head(draft_vocab);
        if let Some(n) = grammar_threads {
            inner.grammars.set_threads(n);
        }
        Ok(Self { inner: Arc::new(inner), path: path.display().to_string() })
    }

    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    #[getter]
    fn info(&self) -> ModelInfo {
        let c = self.inner.config();
        ModelInfo {
            name: c.name.clone(),
            dim: c.dim,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            ffn_dim: c.ffn_dim,
            vocab_size: c.vocab_size,
            block_count: c.block_count,
            prelude_count: c.prelude_count,
            default_loops: c.default_loops,
            max_trained_loops: c.max_trained_loops,
            context_length: c.context_length,
            max_seq_len: self.inner.max_seq_len,
            quant: self.inner.quant.clone(),
            kv_dtype: self.inner.model.kv_kind().name().to_string(),
            kv_cache_mode: self.inner.kv_cache_mode.clone(),
            kv_share: if self.inner.model.kv_share() { "last" } else { "none" }.to_string(),
            device: self.inner.model.compute().name(),
            draft_vocab_size: self.inner.model.draft_vocab_len_in_use(),
            exit_vocab_size: self.inner.model.exit_vocab_len(),
        }
    }

    /// The file's chat template (`tokenizer.chat_template`, Jinja as Hugging Face writes it), or None.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template.clone()
    }

    /// The sampling settings the file recommends (`tinyloop.generation.*`: temperature, top_p, top_k,
    /// repetition_penalty, presence_penalty, frequency_penalty), by field name; the server uses them where a
    /// request and its own defaults say nothing.
    #[getter]
    fn generation_defaults(&self) -> std::collections::BTreeMap<String, f64> {
        self.inner.generation.iter().cloned().collect()
    }

    /// Adaptive depth's rule on this model: "gate" (the file's exit gate) or "settle" (`AutoDepth`).
    #[getter]
    fn exit_rule(&self) -> &'static str {
        if self.inner.model.exit_gated() {
            "gate"
        } else {
            "settle"
        }
    }

    /// The exit threshold `loops="auto"` uses when a request gives none (the file's, else the rule's default).
    #[getter]
    fn exit_threshold(&self) -> f32 {
        self.inner.model.default_exit_threshold()
    }

    #[getter]
    fn eos_token_id(&self) -> u32 {
        self.inner.tokenizer.eos_token_id
    }

    /// Every token that ends generation as end-of-sequence does (`eos_token_id` first).
    #[getter]
    fn end_token_ids(&self) -> Vec<u32> {
        self.inner.tokenizer.end_ids.clone()
    }

    #[getter]
    fn bos_token_id(&self) -> u32 {
        self.inner.tokenizer.bos_token_id
    }

    /// Whether a prompt of plain text starts with `bos_token_id` (the file's `tokenizer.ggml.add_bos_token`).
    #[getter]
    fn add_bos_token(&self) -> bool {
        self.inner.tokenizer.add_bos_token
    }

    /// Token ids of `text`; `allow_special` parses control tokens' text as those tokens, `add_special` puts the
    /// beginning-of-sequence token first when the file's tokenizer adds it (`add_bos_token`).
    #[pyo3(signature = (text, allow_special=false, add_special=false))]
    fn encode(&self, py: Python<'_>, text: String, allow_special: bool, add_special: bool) -> PyResult<Vec<u32>> {
        detached(py, || self.inner.tokenizer.encode_text(&text, allow_special, add_special))
    }

    /// Decode ids to text; bytes that do not form whole UTF-8 characters become U+FFFD.
    fn decode(&self, py: Python<'_>, ids: Vec<u32>) -> PyResult<String> {
        detached(py, || self.inner.tokenizer.decode(&ids))
    }

    fn token_bytes<'py>(&self, py: Python<'py>, id: u32) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inner.tokenizer.token_bytes(id).map_err(to_py)?;
        Ok(PyBytes::new(py, b))
    }

    /// One pass over `ids`, reading the head after each depth in `depths` (ascending): per depth, a pair
    /// (log-probability of each next token, argmax prediction at each position), both of length len(ids) - 1.
    fn score(&self, py: Python<'_>, ids: Vec<u32>, depths: Vec<usize>) -> PyResult<Vec<(Vec<f32>, Vec<u32>)>> {
        computed(py, || self.inner.score(&ids, &depths))
    }

    /// `ids` scored as a generation under adaptive depth would read them: the first token runs every loop (like a
    /// prompt), each later one runs until `auto`'s rule stops it. Per token after the first: its log-probability
    /// given the tokens before it, and the loops the token before it ran.
    fn score_auto(&self, py: Python<'_>, ids: Vec<u32>, auto: PyAutoDepth) -> PyResult<(Vec<f32>, Vec<usize>)> {
        let loops = auto.max_loops.unwrap_or(self.inner.config().default_loops);
        computed(py, || self.inner.score_auto(&ids, loops, auto.rule))
    }

    /// Per token of `ids` after the first: (its log-probability given the tokens before it at depth `loops`, the
    /// `n` most likely tokens there with theirs) — a prompt's entries in the shape of `StepEvent.logprob`.
    fn prompt_logprobs(&self, py: Python<'_>, ids: Vec<u32>, loops: usize, n: usize) -> PyResult<Vec<PyLogprob>> {
        let entries = computed(py, || self.inner.prompt_logprobs(&ids, loops, n))?;
        Ok(entries.into_iter().map(|l| (l.logprob, l.top)).collect())
    }

    /// Generate to the end in Rust with the GIL released. `draft=(draft_loops, draft_ahead)` turns on
    /// self-speculative decoding with `loops` as the verify depth; `k_branches > 1` drafts a tree (greedy only).
    /// `grammar` (a `Grammar`) constrains the output to a JSON schema, Lark grammar or regex. `params` may instead be
    /// a `Generation` holding all of it (the other arguments then stay at their defaults).
    #[pyo3(signature = (prompt, params=None, loops=None, draft=None, k_branches=1, cache_window=0, grammar=None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword signature, kept for callers who pass them by hand
    fn generate(
        &self,
        py: Python<'_>,
        prompt: Prompt,
        params: Option<&Bound<'_, PyAny>>,
        loops: Option<LoopsArg>,
        draft: Option<(usize, usize)>,
        k_branches: usize,
        cache_window: usize,
        grammar: Option<&PyGrammar>,
    ) -> PyResult<Completion> {
        let args = Keywords { params, loops, draft, k_branches, cache_window, grammar };
        let mut g = self.generator(py, prompt, args)?;
        let tok = &self.inner.tokenizer;
        let (finish, text) = computed(py, || {
            let finish = g.run()?;
            Ok((finish, tok.decode(g.output())?))
        })?;
        let draft = g.draft();
        Ok(Completion {
            completion_tokens: g.output().len(),
            prompt_tokens: g.prompt_len(),
            cached_tokens: g.cached_tokens(),
            draft_rounds: draft.rounds,
            draft_proposed: draft.proposed,
            draft_accepted: draft.accepted,
            auto_loops: (g.auto_loops().tokens, g.auto_loops().loops),
            tokens: g.output().to_vec(),
            logprobs: g.wants_logprobs().then(|| g.logprobs().iter().map(|l| (l.logprob, l.top.clone())).collect()),
            text,
            finish_reason: finish.as_str().to_string(),
        })
    }

    /// An iterator of `StepEvent`s, one token per `next()` (GIL released while the model runs). With `draft`,
    /// a speculative round runs when no verified token is waiting. Arguments as `generate`.
    #[pyo3(signature = (prompt, params=None, loops=None, draft=None, k_branches=1, cache_window=0, grammar=None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword signature, kept for callers who pass them by hand
    fn stream(
        &self,
        py: Python<'_>,
        prompt: Prompt,
        params: Option<&Bound<'_, PyAny>>,
        loops: Option<LoopsArg>,
        draft: Option<(usize, usize)>,
        k_branches: usize,
        cache_window: usize,
        grammar: Option<&PyGrammar>,
    ) -> PyResult<TokenStream> {
        let args = Keywords { params, loops, draft, k_branches, cache_window, grammar };
        let generator = self.generator(py, prompt, args)?;
        Ok(TokenStream::new(self.inner.clone(), generator))
    }

    /// One step of every stream (continuous batching): the plain decode steps and prompt prefills among them run as
    /// one forward pass per loop depth, with the GIL released. Returns, per stream in order, its `StepEvent`,
    /// `None` if it had already finished, or the exception its step raised (the stream is then finished).
    fn step_many(&self, py: Python<'_>, mut streams: Vec<PyRefMut<'_, TokenStream>>) -> PyResult<Vec<Py<PyAny>>> {
        let steps = {
            let mut gens: Vec<&mut Generator> =
                streams.iter_mut().filter(|s| !s.done).map(|s| &mut s.generator).collect();
            computed(py, || Ok(step_batch(&mut gens)))?
        };
        let mut steps = steps.into_iter();
        let mut out = Vec::with_capacity(streams.len());
        for s in streams.iter_mut() {
            if s.done {
                out.push(py.None());
                continue;
            }
            let result = steps.next().ok_or_else(|| to_py(Error::Internal("missing batched step".into())))?;
            match result.map_err(to_py).and_then(|step| s.event(py, step)) {
                Ok(ev) => out.push(Py::new(py, ev)?.into_any()),
                Err(e) => {
                    s.done = true;
                    out.push(e.into_value(py).into_any());
                }
            }
        }
        Ok(out)
    }

    /// (entries, bytes) the prompt cache holds in memory.
    #[getter]
    fn prompt_cache_usage(&self) -> (usize, usize) {
        self.inner.prefixes.usage()
    }

    /// What the prompt cache skipped or could not write since the last call (damaged or foreign files, a full
    /// disk), one message each, for the caller's log.
    fn prompt_cache_notices(&self) -> Vec<String> {
        self.inner.prefixes.take_notices()
    }

    /// Wait until the prompt cache's file writes have finished; with `clear`, also drop its in-memory entries.
    #[pyo3(signature = (clear=false))]
    fn prompt_cache_flush(&self, py: Python<'_>, clear: bool) {
        py.detach(|| {
            self.inner.prefixes.flush();
            if clear {
                self.inner.prefixes.clear();
            }
        })
    }

    /// A raw sequence with its own cache of `capacity` positions (default: max_seq_len); `window > 0` makes each
    /// row attend to the last `window` positions only, and lets the cache drop older ones when it fills.
    #[pyo3(signature = (capacity=None, window=0))]
    fn sequence(&self, capacity: Option<usize>, window: usize) -> PyResult<Sequence> {
        let cap = capacity.unwrap_or(self.inner.max_seq_len);
        if window > 0 && self.inner.model.compute().on_device() {
            return Err(to_py(Error::InvalidArgument(format!(
                "window (a sliding KV window) is not available on device {:?} yet; leave it 0",
                self.inner.model.compute().name()
            ))));
        }
        Ok(Sequence { engine: self.inner.clone(), cache: self.inner.model.new_cache(cap).with_window(window), len: 0 })
    }
}

/// The canonical name of device `name` ("cpu", "cuda:N" or "candle-cpu") once it is known usable: DeviceError for
/// a build without its backend or a missing GPU or driver, InvalidRequestError for an unknown name.
#[pyfunction]
fn check_device(py: Python<'_>, name: &str) -> PyResult<String> {
    py.detach(|| Compute::parse(name).map(|c| c.name())).map_err(to_py)
}

/// Return memory the allocator holds but no longer uses to the system (the server calls it when idle).
#[pyfunction]
fn release_memory(py: Python<'_>) {
    py.detach(crate::allocator::release_memory)
}

/// The instruction-set level tinyloop's kernels run at: "avx512+vnni", "avx512", "avx2", "neon+dotprod", "neon" or
/// "scalar" (the best the CPU has, or lower as `TINYLOOP_ISA` asks; `rust/kernels/isa.rs`).
#[pyfunction]
fn isa() -> String {
    crate::kernels::isa::describe()
}

/// Start timing the stages of every step in this process (`rust/profile.rs`), from zero.
#[pyfunction]
fn start_profile() {
    crate::profile::start();
}

/// Stop timing; per stage since `start_profile`: (seconds of wall time, calls).
#[pyfunction]
fn stop_profile() -> Vec<(&'static str, f64, u64)> {
    crate::profile::stop().into_iter().map(|t| (t.stage.name(), t.seconds, t.calls)).collect()
}

/// Threads the engine's matmuls and attention run on: rayon's global pool, sized from `RAYON_NUM_THREADS` when the
/// module first uses it (else one per core). Candle reads the same variable.
#[pyfunction]
fn num_threads() -> usize {
    rayon::current_num_threads()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    crate::allocator::configure_allocator();
    let py = m.py();
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(release_memory, m)?)?;
    m.add_function(wrap_pyfunction!(check_device, m)?)?;
    m.add_function(wrap_pyfunction!(start_profile, m)?)?;
    m.add_function(wrap_pyfunction!(isa, m)?)?;
    m.add_function(wrap_pyfunction!(stop_profile, m)?)?;
    m.add_class::<Engine>()?;
    m.add_class::<SamplingParams>()?;
    m.add_class::<ModelInfo>()?;
    m.add_class::<PyGeneration>()?;
    m.add_class::<PyGrammar>()?;
    m.add_class::<PySpeculative>()?;
    m.add_class::<PyAutoDepth>()?;
    m.add_class::<Completion>()?;
    m.add_class::<StepEvent>()?;
    m.add_class::<TokenStream>()?;
    m.add_class::<Sequence>()?;
    m.add("TinyloopError", py.get_type::<TinyloopError>())?;
    m.add("ModelLoadError", py.get_type::<ModelLoadError>())?;
    m.add("TokenizerError", py.get_type::<TokenizerError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("ContextLengthError", py.get_type::<ContextLengthError>())?;
    m.add("EngineError", py.get_type::<EngineError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("DEVICE_NAMES", DEVICE_NAMES)?;
    // The limits the HTTP layer checks requests against (`limits.rs`).
    m.add("MAX_LOOPS", MAX_LOOPS)?;
    m.add("MAX_TREE_ROWS", MAX_TREE_ROWS)?;
    m.add("MAX_DRAFT_LOOPS", MAX_DRAFT_LOOPS)?;
    m.add("MAX_DRAFT_AHEAD", MAX_DRAFT_AHEAD)?;
    m.add("MAX_BRANCHES", MAX_BRANCHES)?;
    m.add("MAX_CACHE_WINDOW", MAX_CACHE_WINDOW)?;
    m.add("MAX_TOP_K", MAX_TOP_K)?;
    m.add("MAX_LOGPROBS", MAX_LOGPROBS)?;
    m.add("PREFILL_CHUNK", PREFILL_CHUNK)?;
    m.add("WINDOW_SLACK", WINDOW_SLACK)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("__commit__", env!("TINYLOOP_GIT_COMMIT"))?;
    Ok(())
}
