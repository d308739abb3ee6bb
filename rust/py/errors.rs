//! The engine's errors as Python exceptions, and how calls leave the GIL: heavy work runs with it released, and a
//! Rust panic becomes `EngineError`, never a crash.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use crate::error::Error;

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

pub(super) fn to_py(e: Error) -> PyErr {
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
pub(super) fn computed<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    detached(py, || rayon::scope(|_| f()))
}

/// Run `f` with the GIL released; map errors and panics to Python exceptions.
pub(super) fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> crate::Result<T> + Send) -> PyResult<T> {
    py.detach(|| match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
            Err(Error::Internal(format!("panic in engine: {}", what.unwrap_or_default())))
        }
    })
    .map_err(to_py)
}
