"""tinyloop: local inference for weight-shared looped transformer language models.

`Engine(path)` loads a `.tinyloop` file; `tinyloop.modelfile.format` writes one. The engine core is the Rust extension
`tinyloop._core`; see `docs/engine.md` for the Python API.
"""

try:
    from . import _core  # noqa: F401
except ImportError as e:  # the CUDA build (docs/gpu.md), where the driver's or the CUDA runtime's libraries are missing
    if "libcu" not in str(e) and "libnvrtc" not in str(e):
        raise
    raise ImportError(
        "this is tinyloop's CUDA build: it needs the NVIDIA driver (libcuda.so.1) and the CUDA 13 runtime, cuBLAS, "
        f"cuRAND and NVRTC libraries on the library path (docs/gpu.md): {e}"
    ) from e

from ._core import (
    MAX_BRANCHES,
    MAX_CACHE_WINDOW,
    MAX_DRAFT_AHEAD,
    MAX_DRAFT_LOOPS,
    MAX_LOGPROBS,
    MAX_LOOPS,
    MAX_TOP_K,
    MAX_TREE_ROWS,
    PREFILL_CHUNK,
    WINDOW_SLACK,
    AutoDepth,
    Completion,
    ContextLengthError,
    DeviceError,
    Engine,
    EngineError,
    Generation,
    Grammar,
    InvalidRequestError,
    ModelInfo,
    ModelLoadError,
    SamplingParams,
    Sequence,
    Speculative,
    StepEvent,
    TinyloopError,
    TokenizerError,
    TokenStream,
    __version__,
    check_device,
    start_profile,
    stop_profile,
)

__all__ = [
    "MAX_BRANCHES",
    "MAX_CACHE_WINDOW",
    "MAX_DRAFT_AHEAD",
    "MAX_DRAFT_LOOPS",
    "MAX_LOGPROBS",
    "MAX_LOOPS",
    "MAX_TOP_K",
    "MAX_TREE_ROWS",
    "PREFILL_CHUNK",
    "WINDOW_SLACK",
    "AutoDepth",
    "Completion",
    "ContextLengthError",
    "DeviceError",
    "Engine",
    "EngineError",
    "Generation",
    "Grammar",
    "InvalidRequestError",
    "ModelInfo",
    "ModelLoadError",
    "SamplingParams",
    "Sequence",
    "Speculative",
    "StepEvent",
    "TinyloopError",
    "TokenStream",
    "TokenizerError",
    "__version__",
    "check_device",
    "start_profile",
    "stop_profile",
]
