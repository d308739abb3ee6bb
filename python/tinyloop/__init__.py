"""tinyloop: local inference for weight-shared looped transformer language models.

`Engine(path)` loads a `.tinyloop` file; `tinyloop.modelfile.format` writes one. The engine core is the Rust extension
`tinyloop._core`; see `docs/engine.md` for the Python API.
"""

from ._core import (
    ContextLengthError,
    EngineError,
    Engine,
    Generation,
    InvalidRequestError,
    ModelInfo,
    ModelLoadError,
    SamplingParams,
    Sequence,
    StepEvent,
    TinyloopError,
    TokenizerError,
    TokenStream,
    __version__,
)

__all__ = [
    "ContextLengthError",
    "Engine",
    "EngineError",
    "Generation",
    "InvalidRequestError",
    "ModelInfo",
    "ModelLoadError",
    "SamplingParams",
    "Sequence",
    "StepEvent",
    "TinyloopError",
    "TokenStream",
    "TokenizerError",
    "__version__",
]
