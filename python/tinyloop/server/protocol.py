"""Request schemas of every API family (docs/api.md), and what each request asks of the engine.

Pydantic checks shapes and types (a failure is 422); `check()` on each request checks ranges and consistency
(a failure is 400, naming the parameter). Types are strict: `"8"` or `8.0` is not an integer, `1` is not a
boolean, and `NaN` / `Infinity` are not numbers. The ranges are the engine's own limits (`tinyloop._core`). A
checked request builds the `Generation` of each of its choices, which goes to `Engine.stream` unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .._core import (
    MAX_BRANCHES,
    MAX_CACHE_WINDOW,
    MAX_DRAFT_AHEAD,
    MAX_DRAFT_LOOPS,
    MAX_LOOPS,
    MAX_TOP_K,
    MAX_TREE_ROWS,
    Generation,
    SamplingParams,
    Speculative,
)
from ..errors import APIError

MAX_TOKENS_LIMIT = 8192  # the default ceiling of max_tokens (`--max-tokens-limit`)
MAX_N = 8
SEED_MAX = 2**64 - 1


def _range(name: str, value: float | int | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise APIError(400, f"{name} must be between {lo} and {hi}, got {value}", param=name)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(_Part):
    include_usage: bool = False


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class OpenAISampling(_Request):
    """Fields shared by /v1 chat and completions."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    loops: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def resolved_max_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else 128

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        _range("max_tokens", self.max_tokens, 1, max_tokens_limit)
        _range("max_completion_tokens", self.max_completion_tokens, 1, max_tokens_limit)
        _range("seed", self.seed, 0, SEED_MAX)
        _range("temperature", self.temperature, 0.0, 2.0)
        _range("top_p", self.top_p, 0.0, 1.0)
        _range("n", self.n, 1, MAX_N)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _range("loops", self.loops, 1, MAX_LOOPS)
        _range("min_tokens", self.min_tokens, 0, self.resolved_max_tokens())
        if isinstance(self.stop, list) and len(self.stop) > 8:
            raise APIError(400, "stop may hold at most 8 strings", param="stop")

    def stops(self, default: list[str]) -> list[str]:
        if self.stop is None:
            return list(default)
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def mode_label(self) -> str:
        return "generate"

    def generations(self) -> list[Generation]:
        """One Generation per sample; with a seed, sample i uses seed + i so the n samples differ."""
        return [Generation(self._params(i), loops=self.loops) for i in range(self.n)]

    def _params(self, i: int, repetition_penalty: float = 1.0) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=repetition_penalty,
            seed=None if self.seed is None else (self.seed + i) % 2**64,
            max_tokens=self.resolved_max_tokens(),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
        )


MODES = ("generate", "speculative", "tree_speculative")


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]


class LMStudioExtras(OpenAISampling):
    """The /api/v0 superset fields: the loop modes, the sliding window and repetition_penalty."""

    mode: str = "generate"
    draft_loops: int = 2
    verify_loops: int = 8
    draft_ahead: int = 4
    K_branches: int = 1
    cache_window: int = 0
    repetition_penalty: float = 1.0

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        super().check(max_tokens_limit)
        if self.mode not in MODES:
            raise APIError(400, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", param="mode")
        _range("repetition_penalty", self.repetition_penalty, 0.5, 2.0)
        _range("draft_loops", self.draft_loops, 1, MAX_DRAFT_LOOPS)
        _range("verify_loops", self.verify_loops, 1, MAX_LOOPS)
        _range("draft_ahead", self.draft_ahead, 1, MAX_DRAFT_AHEAD)
        _range("K_branches", self.K_branches, 1, MAX_BRANCHES)
        _range("cache_window", self.cache_window, 0, MAX_CACHE_WINDOW)
        if self.mode != "generate":
            check_speculative(
                self.mode, self.draft_ahead, self.K_branches, self.draft_loops, self.verify_loops, self.temperature
            )

    def mode_label(self) -> str:
        return self.mode

    def generations(self) -> list[Generation]:
        spec = None
        if self.mode != "generate":
            k = self.K_branches if self.mode == "tree_speculative" else 1
            spec = Speculative(self.draft_loops, self.verify_loops, self.draft_ahead, k)
        return [
            Generation(
                self._params(i, self.repetition_penalty),
                loops=None if spec else self.loops,
                speculative=spec,
                cache_window=self.cache_window,
            )
            for i in range(self.n)
        ]


class LMChatCompletionRequest(LMStudioExtras, ChatCompletionRequest):
    pass


class LMCompletionRequest(LMStudioExtras, CompletionRequest):
    pass


class GenerateRequest(_Request):
    """POST /generate: the native shape with its own defaults."""

    prompt: str | list[int]
    max_tokens: int = 128
    loops: int = 8
    temperature: float = 0.0
    top_k: int = 50
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    sample_seed: int = 0
    stream: bool = False
    stop: str | list[str | int] | None = None
    cache_window: int = 0

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        _range("max_tokens", self.max_tokens, 1, max_tokens_limit)
        _range("sample_seed", self.sample_seed, 0, SEED_MAX)
        _range("loops", self.loops, 1, MAX_LOOPS)
        _range("temperature", self.temperature, 0.0, 2.0)
        _range("top_k", self.top_k, 0, MAX_TOP_K)
        _range("top_p", self.top_p, 0.0, 1.0)
        _range("repetition_penalty", self.repetition_penalty, 0.5, 2.0)
        _range("cache_window", self.cache_window, 0, MAX_CACHE_WINDOW)
        if isinstance(self.prompt, str) and not self.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")

    def mode_label(self) -> str:
        return "generate"

    def speculative(self) -> Speculative | None:
        return None

    def generation(self, stop_token_ids: list[int]) -> Generation:
        params = SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.sample_seed,
            max_tokens=self.max_tokens,
            stop_token_ids=stop_token_ids,
        )
        spec = self.speculative()
        return Generation(params, loops=None if spec else self.loops, speculative=spec, cache_window=self.cache_window)


class SpeculativeRequest(GenerateRequest):
    """POST /generate/speculative: draft at draft_loops, verify at verify_loops."""

    mode: ClassVar[str] = "speculative"
    draft_loops: int = 2
    verify_loops: int = 8
    draft_ahead: int = 4

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        super().check(max_tokens_limit)
        _range("draft_loops", self.draft_loops, 1, MAX_DRAFT_LOOPS)
        _range("verify_loops", self.verify_loops, 1, MAX_LOOPS)
        _range("draft_ahead", self.draft_ahead, 1, MAX_DRAFT_AHEAD)
        check_speculative(
            self.mode, self.draft_ahead, self.branches(), self.draft_loops, self.verify_loops, self.temperature
        )

    def mode_label(self) -> str:
        return self.mode

    def branches(self) -> int:
        return 1

    def speculative(self) -> Speculative | None:
        return Speculative(self.draft_loops, self.verify_loops, self.draft_ahead, self.branches())


class TreeSpeculativeRequest(SpeculativeRequest):
    """POST /generate/tree_speculative: K_branches candidates per draft depth."""

    mode: ClassVar[str] = "tree_speculative"
    K_branches: int = 1

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        _range("K_branches", self.K_branches, 1, MAX_BRANCHES)
        super().check(max_tokens_limit)

    def branches(self) -> int:
        return self.K_branches


def check_speculative(
    mode: str, draft_ahead: int, k_branches: int, draft_loops: int, verify_loops: int, temperature: float
) -> None:
    if draft_loops >= verify_loops:
        raise APIError(
            400, f"draft_loops ({draft_loops}) must be below verify_loops ({verify_loops})", param="draft_loops"
        )
    if mode == "tree_speculative":
        if temperature != 0.0:
            raise APIError(400, "tree_speculative is greedy-only: temperature must be 0.0", param="temperature")
        if k_branches * draft_ahead > MAX_TREE_ROWS:
            raise APIError(
                400,
                f"K_branches * draft_ahead must be at most {MAX_TREE_ROWS}, got {k_branches} * {draft_ahead}",
                param="K_branches",
            )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
