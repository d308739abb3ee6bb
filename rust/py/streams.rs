//! What a running generation hands out: step events from a token stream, and the low-level sequence for tests.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::generate::{Engine, Generator, Step};
use crate::kv::KvCache;

use super::errors::{computed, to_py};
use super::values::*;

/// One streamed step: a token (`token_id` >= 0, with its bytes, and its log-probability when asked for) and/or the
/// end (`finish_reason`).
#[pyclass(name = "StepEvent", frozen, get_all, module = "tinyloop._core")]
pub(super) struct PyStepEvent {
    pub(super) token_id: i64,
    pub(super) bytes: Py<PyBytes>,
    pub(super) finish_reason: Option<String>,
    pub(super) logprob: Option<PyLogprob>,
}

#[pyclass(name = "TokenStream", module = "tinyloop._core")]
pub(super) struct PyTokenStream {
    pub(super) engine: Arc<Engine>,
    pub(super) generator: Generator,
    pub(super) done: bool,
    /// Tokens handed out so far (a speculative round emits several before they are handed out one by one).
    pub(super) handed: usize,
}

impl PyTokenStream {
    pub(super) fn new(engine: Arc<Engine>, generator: Generator) -> Self {
        Self { engine, generator, done: false, handed: 0 }
    }

    pub(super) fn event(&mut self, py: Python<'_>, step: Step) -> PyResult<PyStepEvent> {
        self.done = step.finish.is_some();
        let (bytes, logprob) = match step.token {
            Some(t) => {
                let logprob = self.generator.logprobs().get(self.handed).map(|l| (l.logprob, l.top.clone()));
                self.handed += 1;
                (self.engine.tokenizer.token_bytes(t).map_err(to_py)?.to_vec(), logprob)
            }
            None => (Vec::new(), None),
        };
        Ok(PyStepEvent {
            token_id: step.token.map_or(-1, i64::from),
            bytes: PyBytes::new(py, &bytes).unbind(),
            finish_reason: step.finish.map(|f| f.as_str().to_string()),
            logprob,
        })
    }
}

#[pymethods]
impl PyTokenStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<PyStepEvent>> {
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
#[pyclass(name = "Sequence", module = "tinyloop._core")]
pub(super) struct PySequence {
    pub(super) engine: Arc<Engine>,
    pub(super) cache: KvCache,
    pub(super) len: usize,
}

#[pymethods]
impl PySequence {
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
