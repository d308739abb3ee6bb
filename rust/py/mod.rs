//! The Python module `tinyloop._core`. Everything Python-facing lives here: argument conversion (`values`),
//! the engine's calls (`engine`), what they stream (`streams`), GIL release and typed exceptions (`errors`).

mod engine;
mod errors;
mod streams;
mod values;

use pyo3::prelude::*;

use crate::limits::{
    MAX_BRANCHES, MAX_CACHE_WINDOW, MAX_DRAFT_AHEAD, MAX_DRAFT_LOOPS, MAX_LOGPROBS, MAX_LOOPS, MAX_TOP_K,
    MAX_TREE_ROWS, PREFILL_CHUNK, WINDOW_SLACK,
};
use crate::model::{Compute, DEVICE_NAMES};

use engine::PyEngine;
use errors::*;
use streams::*;
use values::*;

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

/// GB/s of `threads` threads each reading a buffer of `bytes` of its own, over and over (`rust/probe.rs`): the
/// bandwidth of the cache level (or memory) that working set lives in. With the GIL released.
#[pyfunction]
#[pyo3(signature = (bytes, threads, passes = 5))]
fn read_bandwidth(py: Python<'_>, bytes: usize, threads: usize, passes: usize) -> f64 {
    py.detach(|| crate::probe::read_bandwidth(bytes, threads, passes))
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
    m.add_function(wrap_pyfunction!(read_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(stop_profile, m)?)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PySamplingParams>()?;
    m.add_class::<PyModelInfo>()?;
    m.add_class::<PyGeneration>()?;
    m.add_class::<PyGrammar>()?;
    m.add_class::<PySpeculative>()?;
    m.add_class::<PyAutoDepth>()?;
    m.add_class::<PyCompletion>()?;
    m.add_class::<PyStepEvent>()?;
    m.add_class::<PyTokenStream>()?;
    m.add_class::<PySequence>()?;
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
