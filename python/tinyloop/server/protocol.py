"""Request schemas of the OpenAI, LM Studio and native families (docs/api.md), and what each request asks of the
engine. The Responses and Messages schemas live beside their routes (`responses.py`, `anthropic.py`), and every
family's sampling settings go through one builder (`sampling.py`).

Pydantic checks shapes and types (a failure is 422; types are strict, `strict.py`); `check()` on each request
checks ranges and consistency (a failure is 400, naming the parameter). The ranges are the engine's own limits
(`tinyloop._core`). A checked request builds the `Generation` of each of its choices, which goes to
`Engine.stream` unchanged. On the OpenAI family a `null` field means its default, as OpenAI's API defines it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator

from .._core import (
    MAX_BRANCHES,
    MAX_CACHE_WINDOW,
    MAX_DRAFT_AHEAD,
    MAX_DRAFT_LOOPS,
    MAX_LOGPROBS,
    MAX_LOOPS,
    MAX_TOP_K,
    Generation,
    Grammar,
    SamplingParams,
    Speculative,
)
from .depth import DepthFields
from .errors import APIError
from .sampling import Sampling, check_speculative
from .strict import Strict, ranged
from .strict import check_range as _range
from .structured import ResponseFormat, schema_grammar
from .tools import Tool, ToolCall, ToolChoice, ToolUse

MAX_TOKENS_LIMIT = 8192  # the default ceiling of max_tokens (`--max-tokens-limit`)
DEFAULT_MAX_TOKENS = 128  # when a request does not say (lowered to the ceiling when that is lower)
MAX_N = 8
SEED_MAX = 2**64 - 1


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class OpenAISampling(DepthFields):
    """Fields shared by /v1 chat and completions."""

    model: str
    max_tokens: int | None = ranged(None, 1, MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = ranged(None, 1, MAX_TOKENS_LIMIT)
    temperature: float = ranged(1.0, 0.0, 2.0)
    top_p: float = ranged(1.0, 0.0, 1.0)
    top_k: int = ranged(0, 0, MAX_TOP_K)
    n: int = ranged(1, 1, MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = ranged(None, 0, SEED_MAX)
    presence_penalty: float = ranged(0.0, -2.0, 2.0)
    frequency_penalty: float = ranged(0.0, -2.0, 2.0)
    min_tokens: int = ranged(0, 0, MAX_TOKENS_LIMIT)
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # Accepted and ignored (docs/api.md): nothing is stored or billed, and the prompt cache needs no key.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    # tinyloop's own fields on this family, where null is not a value.
    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset()
    # A default `repetition_penalty` (the server's or the model file's) applies here too, though only /api/v0 has
    # the field.
    _repetition_penalty: float = PrivateAttr(1.0)

    def with_defaults(self, defaults: Mapping[str, Any]) -> None:
        super().with_defaults(defaults)
        self._repetition_penalty = float(defaults.get("repetition_penalty", 1.0))

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.NULL_REFUSED}
        return data

    def resolved_max_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        if self.max_tokens is None and self.max_completion_tokens is None:
            self.max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
        self.check_ranges()
        _range("max_tokens", self.max_tokens, 1, max_tokens_limit)
        _range("max_completion_tokens", self.max_completion_tokens, 1, max_tokens_limit)
        _range("min_tokens", self.min_tokens, 0, self.resolved_max_tokens())
        if isinstance(self.stop, list) and len(self.stop) > 8:
            raise APIError(400, "stop may hold at most 8 strings", param="stop")
        if self.grammar() is not None and (self.min_tokens or self.ignore_eos):
            raise APIError(
                400,
                "a structured output ends where its grammar ends: min_tokens and ignore_eos cannot be set with it",
                param="min_tokens" if self.min_tokens else "ignore_eos",
            )

    def wanted_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability lists; None: no log-probabilities."""
        return None

    def grammar(self) -> Grammar | None:
        """What the output must match (`response_format`), if anything."""
        return schema_grammar(self.text_schema())

    def text_schema(self) -> dict[str, Any] | None:
        """The schema a text answer must match (`response_format`), if any."""
        return self.response_format.document_schema() if self.response_format else None

    def grammar_param(self) -> str:
        """The field a grammar compile error names."""
        return "response_format"

    def stops(self, default: list[str]) -> list[str]:
        if self.stop is None:
            return list(default)
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def mode_label(self) -> str:
        return "generate"

    def generations(self) -> list[Generation]:
        """One Generation per sample (`Sampling.params` gives each its seed)."""
        sampling = self.sampling()
        return [Generation(sampling.params(i), loops=self.loop_arg(), grammar=self.grammar()) for i in range(self.n)]

    def sampling(self) -> Sampling:
        return Sampling(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self._repetition_penalty,
            seed=self.seed,
            max_tokens=self.resolved_max_tokens(),
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=self.wanted_logprobs(),
        )


MODES = ("generate", "speculative", "tree_speculative")


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # No tinyloop model reasons before it answers: only the values that ask for no reasoning are accepted.
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = ranged(None, 0, MAX_LOGPROBS)

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self) -> ToolUse | None:
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def grammar(self) -> Grammar | None:
        tools = self.tool_use()
        return super().grammar() if tools is None else tools.grammar(self.text_schema())

    def grammar_param(self) -> str:
        tools = self.tool_use()
        return "tools" if tools is not None and tools.forced else "response_format"

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        super().check(max_tokens_limit)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for i, m in enumerate(self.messages):
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, "only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls")
            if (m.role == "tool") != (m.tool_call_id is not None):
                raise APIError(
                    400, "tool messages, and only they, need tool_call_id", param=f"messages.{i}.tool_call_id"
                )
        if self.reasoning_effort not in (None, "none"):
            raise APIError(
                400, 'this model does not reason: reasoning_effort may only be "none"', param="reasoning_effort"
            )
        if self.include_reasoning:
            raise APIError(
                400, "this model does not reason: include_reasoning may only be false", param="include_reasoning"
            )
        for key, value in (self.chat_template_kwargs or {}).items():
            if not (key == "enable_thinking" and value is False):
                raise APIError(
                    400,
                    f"chat_template_kwargs.{key} is not supported (the template takes only enable_thinking: false)",
                    param=f"chat_template_kwargs.{key}",
                )


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = ranged(None, 0, MAX_LOGPROBS)  # alternatives per token; null: none
    echo: bool = False  # return the prompt before the completion (with its log probabilities, when asked)

    def depth(self, default_loops: int) -> int:
        """The depth tokens are chosen (and an echoed prompt scored) at."""
        g = self.generations()[0]
        return g.speculative.verify_loops if g.speculative else (g.loops or default_loops)

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


class LMStudioExtras(OpenAISampling):
    """The /api/v0 superset fields: the loop modes, the sliding window and repetition_penalty."""

    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset(
        {"mode", "draft_loops", "verify_loops", "draft_ahead", "K_branches", "cache_window", "repetition_penalty"}
    )

    mode: str = "generate"
    draft_loops: int = ranged(2, 1, MAX_DRAFT_LOOPS)
    verify_loops: int = ranged(8, 1, MAX_LOOPS)
    draft_ahead: int = ranged(4, 1, MAX_DRAFT_AHEAD)
    K_branches: int = ranged(1, 1, MAX_BRANCHES)
    cache_window: int = ranged(0, 0, MAX_CACHE_WINDOW)
    repetition_penalty: float = ranged(1.0, 0.5, 2.0)

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        super().check(max_tokens_limit)
        if self.mode not in MODES:
            raise APIError(400, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", param="mode")
        if self.mode != "generate":
            self.check_drafts(self.draft_loops, self.verify_loops, tree=self.mode == "tree_speculative")
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
                dataclasses.replace(self.sampling(), repetition_penalty=self.repetition_penalty).params(i),
                loops=self.loop_arg_for(spec),
                speculative=spec,
                cache_window=self.cache_window,
                grammar=self.grammar(),
            )
            for i in range(self.n)
        ]


class LMChatCompletionRequest(LMStudioExtras, ChatCompletionRequest):
    pass


class LMCompletionRequest(LMStudioExtras, CompletionRequest):
    pass


class GenerateRequest(DepthFields):
    """POST /generate: the native shape with its own defaults."""

    prompt: str | list[int]
    DEFAULT_ALIASES: ClassVar[dict[str, str]] = {"seed": "sample_seed"}
    max_tokens: int = ranged(DEFAULT_MAX_TOKENS, 1, MAX_TOKENS_LIMIT)
    loops: int | Literal["auto"] = ranged(8, 1, MAX_LOOPS)
    temperature: float = ranged(0.0, 0.0, 2.0)
    top_k: int = ranged(50, 0, MAX_TOP_K)
    top_p: float = ranged(0.9, 0.0, 1.0)
    repetition_penalty: float = ranged(1.0, 0.5, 2.0)
    sample_seed: int = ranged(0, 0, SEED_MAX)
    stream: bool = False
    stop: str | list[str | int] | None = None
    cache_window: int = ranged(0, 0, MAX_CACHE_WINDOW)
    ignore_eos: bool = False

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        if "max_tokens" not in self.model_fields_set:
            self.max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
        self.check_ranges()
        _range("max_tokens", self.max_tokens, 1, max_tokens_limit)
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
            ignore_eos=self.ignore_eos,
            stop_token_ids=stop_token_ids,
        )
        spec = self.speculative()
        return Generation(params, loops=self.loop_arg_for(spec), speculative=spec, cache_window=self.cache_window)


class SpeculativeRequest(GenerateRequest):
    """POST /generate/speculative: draft at draft_loops, verify at verify_loops."""

    mode: ClassVar[str] = "speculative"
    draft_loops: int = ranged(2, 1, MAX_DRAFT_LOOPS)
    verify_loops: int = ranged(8, 1, MAX_LOOPS)
    draft_ahead: int = ranged(4, 1, MAX_DRAFT_AHEAD)

    def check(self, max_tokens_limit: int = MAX_TOKENS_LIMIT) -> None:
        super().check(max_tokens_limit)
        self.check_drafts(self.draft_loops, self.verify_loops, tree=self.branches() > 1 or self.mode != "speculative")
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
    K_branches: int = ranged(1, 1, MAX_BRANCHES)

    def branches(self) -> int:
        return self.K_branches


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV the prompt cache supplied."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
