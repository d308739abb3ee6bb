"""Type stubs for the Rust extension `tinyloop._core` (rust/py.rs)."""

from collections.abc import Iterator
from os import PathLike
from typing import Literal, Self, final

__all__ = [
    "DEVICE_NAMES",
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
    "__commit__",
    "__version__",
    "check_device",
    "isa",
    "num_threads",
    "read_bandwidth",
    "release_memory",
    "start_profile",
    "stop_profile",
]

__version__: str
__commit__: str

# Limits the engine enforces (rust/limits.rs); the HTTP schema checks requests against the same numbers.
MAX_LOOPS: int  # loop depth of a generation: 1..=MAX_LOOPS
MAX_TREE_ROWS: int  # k_branches * draft_ahead of a tree round
MAX_DRAFT_LOOPS: int  # speculative draft depth
MAX_DRAFT_AHEAD: int  # tokens drafted per speculative round
MAX_BRANCHES: int  # k_branches of tree speculative decoding
MAX_CACHE_WINDOW: int  # largest cache_window
MAX_TOP_K: int  # largest top_k the HTTP API accepts (the sampler honours any)
MAX_LOGPROBS: int  # most alternatives a token's log-probability lists
PREFILL_CHUNK: int  # prompt tokens a stream prefills per batched step
WINDOW_SLACK: int  # positions a windowed cache keeps below the window for speculative rollback

def isa() -> str:
    """The instruction-set level the kernels run at: "avx512+vnni", "avx512", "avx2", "neon+dotprod", "neon" or
    "scalar" (the best the CPU has, or lower as TINYLOOP_ISA asks)."""

def read_bandwidth(bytes: int, threads: int, passes: int = 5) -> float:
    """GB/s of `threads` threads each reading a buffer of `bytes` of its own, over and over: the bandwidth of the
    cache level (or memory) that working set lives in."""

def num_threads() -> int:
    """Threads the engine computes on (RAYON_NUM_THREADS when the module first computes, else one per core)."""

def check_device(name: str) -> str:
    """The canonical name of device `name` ("cpu", "cuda:N" or "candle-cpu") once it is known usable; DeviceError for
    a build without its backend or a missing GPU or driver, InvalidRequestError for an unknown name."""

def release_memory() -> None:
    """Return memory the allocator holds but no longer uses to the system (the server calls it when idle)."""

def start_profile() -> None:
    """Start timing the stages of every step in this process, from zero."""

def stop_profile() -> list[tuple[str, float, int]]:
    """Stop timing; per stage (step, embed, blocks, matmul, attention, head, sample): seconds of wall time and
    calls since `start_profile`. `blocks` holds `matmul` and `attention`; `step` holds the rest."""

class TinyloopError(Exception): ...
class ModelLoadError(TinyloopError): ...
class TokenizerError(TinyloopError): ...
class InvalidRequestError(TinyloopError): ...
class ContextLengthError(InvalidRequestError): ...
class EngineError(TinyloopError): ...
class DeviceError(TinyloopError): ...

DEVICE_NAMES: str

@final
class SamplingParams:
    """Frozen sampling parameters; `temperature == 0` is greedy, `top_k == 0` and `top_p == 1` are off."""

    def __new__(
        cls,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        max_tokens: int = 128,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] = ...,
        logprobs: int | None = None,
    ) -> Self: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> int | None:
        """Record each emitted token's log-probability (log-softmax of the raw logits, as `Engine.score`) with this
        many most likely alternatives (0..20); None: off."""

@final
class ModelInfo:
    @property
    def name(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def ffn_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def block_count(self) -> int: ...
    @property
    def prelude_count(self) -> int: ...
    @property
    def default_loops(self) -> int: ...
    @property
    def max_trained_loops(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def quant(self) -> str: ...
    @property
    def kv_dtype(self) -> str: ...
    @property
    def kv_cache_mode(self) -> str: ...
    @property
    def kv_share(self) -> str:
        """Either "none", or "last": after the prompt, loops share the last loop's KV."""
    @property
    def device(self) -> str:
        """Where the model computes: "cpu", "cuda:N", or "candle-cpu" (the device path on candle's CPU device)."""
    @property
    def draft_vocab_size(self) -> int:
        """Tokens speculative drafts may propose via the draft head; 0: drafts use the full head."""
    @property
    def exit_vocab_size(self) -> int:
        """Tokens `loops="auto"`'s settling rule compares successive loops over; 0: it reads the full head."""

@final
class Speculative:
    """Self-speculative settings: draft `draft_ahead` tokens at `draft_loops` loops, verify them at `verify_loops`;
    `k_branches > 1` drafts a tree (greedy only). Frozen; checked when a generation starts."""

    def __new__(cls, draft_loops: int, verify_loops: int, draft_ahead: int, k_branches: int = 1) -> Self: ...
    @property
    def draft_loops(self) -> int: ...
    @property
    def verify_loops(self) -> int: ...
    @property
    def draft_ahead(self) -> int: ...
    @property
    def k_branches(self) -> int: ...

@final
class AutoDepth:
    """Adaptive depth: each generated token stops looping once the model's exit rule is met, and at `max_loops` at
    the latest (the model's default loops when None). Without an exit gate in the file: after loop d >=
    max(min_loops, 2) once the KL divergence of its exit distribution at d from the one at d - 1 is below
    `threshold`; with one (Ouro's): after loop d >= min_loops once the gate's cumulative exit probability reaches
    `threshold`. `threshold=None` is the model's default (`Engine.exit_threshold`). `loops="auto"` is
    `AutoDepth()`. Frozen; checked when a generation starts."""

    def __new__(cls, min_loops: int = ..., max_loops: int | None = None, threshold: float | None = None) -> Self: ...
    @property
    def min_loops(self) -> int: ...
    @property
    def max_loops(self) -> int | None: ...
    @property
    def threshold(self) -> float | None: ...

@final
class Grammar:
    """What an output must match (structured output, through llguidance). Compiled when a generation starts: a
    grammar that cannot be compiled (e.g. a JSON schema keyword outside the supported subset) raises
    InvalidRequestError naming the cause. The grammar decides where the output ends."""

    @staticmethod
    def json_schema(schema: object) -> Grammar:
        """A JSON schema, as a dict (or anything `json.dumps` takes) or as JSON text."""
    @staticmethod
    def lark(text: str) -> Grammar:
        """A grammar in llguidance's Lark dialect (`%json {...}` embeds a JSON schema)."""
    @staticmethod
    def regex(pattern: str) -> Grammar:
        """A regular expression the whole output matches."""
    @property
    def kind(self) -> str:
        """ "json_schema", "lark" or "regex"."""
    @property
    def source(self) -> str: ...

@final
class Generation:
    """What one generation runs: sampling parameters (defaults when None), loop depth (the model's default_loops
    when None; must be None or equal verify_loops when speculative), speculative settings, sliding KV window
    (0: none) and grammar. Frozen; checked when a generation starts (InvalidRequestError)."""

    def __new__(
        cls,
        params: SamplingParams | None = None,
        *,
        loops: int | Literal["auto"] | AutoDepth | None = None,
        speculative: Speculative | None = None,
        cache_window: int = 0,
        grammar: Grammar | None = None,
    ) -> Self: ...
    @property
    def params(self) -> SamplingParams: ...
    @property
    def loops(self) -> int | None:
        """The fixed depth, or the most loops under adaptive depth (None: the model's default)."""
    @property
    def auto(self) -> AutoDepth | None: ...
    @property
    def speculative(self) -> Speculative | None: ...
    @property
    def cache_window(self) -> int: ...
    @property
    def grammar(self) -> Grammar | None: ...

@final
class Completion:
    """Result of `Engine.generate`."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Per token (its log-probability, [(id, log-probability) of the best alternatives]) when asked for."""
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prompt cache (not prefilled)."""
    @property
    def completion_tokens(self) -> int: ...
    @property
    def draft_rounds(self) -> int: ...
    @property
    def draft_proposed(self) -> int: ...
    @property
    def draft_accepted(self) -> int: ...
    @property
    def auto_loops(self) -> tuple[int, int]:
        """Under adaptive depth: (tokens it decided, loops they ran); (0, 0) otherwise."""

@final
class StepEvent:
    @property
    def token_id(self) -> int: ...
    @property
    def bytes(self) -> bytes: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def logprob(self) -> tuple[float, list[tuple[int, float]]] | None:
        """The token's log-probability and the best alternatives, when the sampling parameters ask for them."""

@final
class TokenStream(Iterator[StepEvent]):
    def __iter__(self) -> TokenStream: ...
    def __next__(self) -> StepEvent: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prompt cache (known from the first step on)."""
    def release(self) -> None:
        """End the stream: its KV goes to the prompt cache and its memory is freed."""
    @property
    def kv_bytes(self) -> int: ...
    @property
    def draft_stats(self) -> tuple[int, int, int]: ...
    @property
    def auto_loops(self) -> tuple[int, int]:
        """Under adaptive depth: (tokens it decided so far, loops they ran); (0, 0) otherwise."""
    @property
    def loops(self) -> int:
        """The loop depth every token is chosen at: `loops` (the model's default_loops when None), or verify_loops
        when speculative."""

@final
class Sequence:
    def feed(self, ids: list[int], loops: int) -> bytes: ...
    def truncate(self, n: int) -> None: ...
    def __len__(self) -> int: ...
    def share_loops(self, loops: int) -> None:
        """With kv_share="last": keep only the last of `loops` loops' KV, as a generation does after its prompt."""
    @property
    def kv_bytes(self) -> int: ...

@final
class Engine:
    def __new__(
        cls,
        path: str | PathLike[str],
        max_seq_len: int | None = None,
        kv_cache_mode: str = "fp16",
        draft_vocab: bool = True,  # draft through the file's draft vocabulary, when it lists one
        grammar_threads: int | None = None,  # threads computing grammar masks ahead; None: cores (≤ 4), 0: inline
        prompt_cache_mib: int = 256,  # finished sequences' KV kept for prompts that start the same way
        prompt_cache_entries: int = 4,  # 0: no prompt cache
        prompt_cache_disk: str | PathLike[str] | None = None,  # a directory keeping prefixes across restarts
        prompt_cache_disk_mib: int = 1024,
        kv_share: str = "none",  # "last": after the prompt, loops share the last loop's KV (no drafts, no reuse)
        device: str = "cpu",  # "cuda", "cuda:N" (the CUDA build), "candle-cpu" (the device path on the host)
    ) -> Self: ...
    @property
    def prompt_cache_usage(self) -> tuple[int, int]:
        """(entries, bytes) the prompt cache holds in memory."""
    def prompt_cache_notices(self) -> list[str]:
        """Files the prompt cache skipped or could not write since the last call, one message each."""
    def prompt_cache_flush(self, clear: bool = False) -> None:
        """Wait for the prompt cache's file writes; with `clear`, also drop its in-memory entries."""
    @property
    def path(self) -> str: ...
    @property
    def info(self) -> ModelInfo: ...
    @property
    def chat_template(self) -> str | None:
        """The file's chat template (`tokenizer.chat_template`, Jinja), or None."""
    @property
    def generation_defaults(self) -> dict[str, float]:
        """The sampling settings the file recommends (`tinyloop.generation.*`: temperature, top_p, top_k,
        repetition_penalty, presence_penalty, frequency_penalty), by field name; the server uses them where a
        request and its own defaults say nothing."""
    @property
    def exit_rule(self) -> Literal["settle", "gate"]:
        """Adaptive depth's rule on this model: "gate" (the file's exit gate) or "settle" (`AutoDepth`)."""
    @property
    def exit_threshold(self) -> float:
        """The exit threshold `loops="auto"` uses when a request gives none (the file's, else the rule's default)."""
    @property
    def eos_token_id(self) -> int: ...
    @property
    def end_token_ids(self) -> list[int]:
        """Every token that ends generation as end-of-sequence does (`eos_token_id` first)."""
    @property
    def bos_token_id(self) -> int: ...
    @property
    def add_bos_token(self) -> bool:
        """Whether a prompt of plain text starts with `bos_token_id` (the file's `tokenizer.ggml.add_bos_token`)."""
    def encode(self, text: str, allow_special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids of `text`; `allow_special` parses control tokens' text as those tokens, `add_special` puts the
        beginning-of-sequence token first when the file's tokenizer adds it (`add_bos_token`)."""
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, id: int) -> bytes: ...
    def score(self, ids: list[int], depths: list[int]) -> list[tuple[list[float], list[int]]]: ...
    def score_auto(self, ids: list[int], auto: AutoDepth) -> tuple[list[float], list[int]]:
        """`ids` as a generation under adaptive depth reads them (the first token through every loop, each later one
        until the rule stops it): per token after the first, its log-probability and the loops its predecessor ran."""
    def prompt_logprobs(self, ids: list[int], loops: int, n: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """Per token of `ids` after the first: its log-probability given the tokens before it at depth `loops`, and
        the `n` most likely tokens there (0..20) with theirs."""
    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | Generation | None = None,
        loops: int | Literal["auto"] | AutoDepth | None = None,
        draft: tuple[int, int] | None = None,
        k_branches: int = 1,
        cache_window: int = 0,
        grammar: Grammar | None = None,
    ) -> Completion:
        """`draft=(draft_loops, draft_ahead)` drafts speculatively and verifies at `loops`; `grammar` constrains the
        output. `params` may instead be a `Generation` holding every setting; the other arguments must then stay at
        their defaults (else TypeError)."""
    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | Generation | None = None,
        loops: int | Literal["auto"] | AutoDepth | None = None,
        draft: tuple[int, int] | None = None,
        k_branches: int = 1,
        cache_window: int = 0,
        grammar: Grammar | None = None,
    ) -> TokenStream:
        """A stream of `StepEvent`s; arguments as `generate`."""
    def step_many(self, streams: list[TokenStream]) -> list[StepEvent | TinyloopError | None]:
        """One step of every stream, batched (continuous batching); per stream: its event, None if it had
        finished, or the exception its step raised. Long prompts go in PREFILL_CHUNK (256) tokens per step: such a
        step's event
        has token_id -1 and no finish_reason."""
        ...
    def sequence(self, capacity: int | None = None, window: int = 0) -> Sequence: ...
