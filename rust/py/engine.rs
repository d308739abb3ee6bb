//! `Engine`: a loaded model, its tokenizer and prompt cache, and the calls that generate, score and stream.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::Error;
use crate::generate::{step_batch, Engine, Generation, Generator, PromptCache, Speculative};
use crate::model::Compute;
use crate::sampler::SamplingParams;

use super::errors::*;
use super::streams::*;
use super::values::*;

#[derive(FromPyObject)]
pub(super) enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[pyclass(name = "Engine", frozen, module = "tinyloop._core")]
pub(super) struct PyEngine {
    pub(super) inner: Arc<Engine>,
    pub(super) path: String,
}

impl PyEngine {
    pub(super) fn prompt_ids(&self, py: Python<'_>, prompt: Prompt) -> PyResult<Vec<u32>> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => detached(py, || self.inner.tokenizer.encode_text(&text, false, true)),
        }
    }

    pub(super) fn generator(&self, py: Python<'_>, prompt: Prompt, args: Keywords) -> PyResult<Generator> {
        let generation = args.generation(self.inner.config().default_loops)?;
        let ids = self.prompt_ids(py, prompt)?;
        let engine = self.inner.clone();
        detached(py, || Generator::new(engine, ids, generation)) // compiling a grammar may take milliseconds
    }
}

/// The arguments of `Engine.generate` / `Engine.stream`: `params` is a `SamplingParams` (or None) with the other
/// keywords, or a whole `Generation` with the others left at their defaults. Either way one `Generation` results.
pub(super) struct Keywords<'a, 'py> {
    pub(super) params: Option<&'a Bound<'py, PyAny>>,
    pub(super) loops: Option<LoopsArg>,
    pub(super) draft: Option<(usize, usize)>,
    pub(super) k_branches: usize,
    pub(super) cache_window: usize,
    pub(super) grammar: Option<&'a PyGrammar>,
}

impl Keywords<'_, '_> {
    /// `draft=(draft_loops, draft_ahead)` verifies at `loops` (the model's `default_loops` when None).
    pub(super) fn generation(self, default_loops: usize) -> PyResult<Generation> {
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
            None => SamplingParams::default(),
            Some(p) => match p.cast::<PySamplingParams>() {
                Ok(p) => p.get().0.clone(),
                Err(_) => return Err(PyTypeError::new_err("params must be a SamplingParams, a Generation or None")),
            },
        };
        let (loops, auto) = depth_of(loops)?;
        let speculative = draft.map(|(draft_loops, draft_ahead)| Speculative {
            draft_loops,
            verify_loops: loops.unwrap_or(default_loops),
            draft_ahead,
            k_branches,
        });
        let loops = if speculative.is_some() { None } else { loops };
        let grammar = grammar.map(|g| g.0.clone());
        Ok(Generation { params, loops, speculative, cache_window, grammar, auto })
    }
}

#[pymethods]
impl PyEngine {
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
            let mut engine = Engine::load_on(&path, max_seq_len, kv_cache_mode, Compute::parse(device)?)?;
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
    fn info(&self) -> PyModelInfo {
        let c = self.inner.config();
        PyModelInfo {
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
    ) -> PyResult<PyCompletion> {
        let args = Keywords { params, loops, draft, k_branches, cache_window, grammar };
        let mut g = self.generator(py, prompt, args)?;
        let tok = &self.inner.tokenizer;
        let (finish, text) = computed(py, || {
            let finish = g.run()?;
            Ok((finish, tok.decode(g.output())?))
        })?;
        let draft = g.draft();
        Ok(PyCompletion {
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
    ) -> PyResult<PyTokenStream> {
        let args = Keywords { params, loops, draft, k_branches, cache_window, grammar };
        let generator = self.generator(py, prompt, args)?;
        Ok(PyTokenStream::new(self.inner.clone(), generator))
    }

    /// One step of every stream (continuous batching): the plain decode steps and prompt prefills among them run as
    /// one forward pass per loop depth, with the GIL released. Returns, per stream in order, its `StepEvent`,
    /// `None` if it had already finished, or the exception its step raised (the stream is then finished).
    fn step_many(&self, py: Python<'_>, mut streams: Vec<PyRefMut<'_, PyTokenStream>>) -> PyResult<Vec<Py<PyAny>>> {
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
    fn sequence(&self, capacity: Option<usize>, window: usize) -> PyResult<PySequence> {
        let cap = capacity.unwrap_or(self.inner.max_seq_len);
        if window > 0 && self.inner.model.compute().on_device() {
            return Err(to_py(Error::InvalidArgument(format!(
                "window (a sliding KV window) is not available on device {:?} yet; leave it 0",
                self.inner.model.compute().name()
            ))));
        }
        Ok(PySequence {
            engine: self.inner.clone(),
            cache: self.inner.model.new_cache(cap).with_window(window),
            len: 0,
        })
    }
}
