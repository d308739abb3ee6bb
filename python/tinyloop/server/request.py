"""One API request in flight, whatever its family: a `Plan` (prompts and one `Generation` per choice, built by the
family's schema) becomes a `RunningRequest` — its choices submitted to the engine runner — whose answer the family
renders as a JSON body or as SSE events (`respond`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from .._core import ContextLengthError, Generation, InvalidRequestError
from . import depth
from .errors import APIError
from .generation import ChoiceRun
from .logprobs import Echo
from .protocol import usage
from .runner import Overloaded
from .sse import sse_response
from .state import ServerState


@dataclass(frozen=True)
class Plan:
    """What a request asks of the engine: every prompt runs once per generation (one generation per choice)."""

    prompts: list[list[int]]
    generations: list[Generation]
    mode: str = "generate"  # generate / speculative / tree_speculative: the label of stats and metrics
    stop: Sequence[str] = ()
    lstrip: bool = False  # chat: drop the whitespace the model puts after "Assistant:"
    grammar_param: str | None = None  # the request field a grammar that does not compile came from
    echo: list[Echo] | None = None  # completions with `echo`: each prompt, returned before its choices' text

    def prompt_of(self, choice: int) -> int:
        """The prompt choice `choice` answers (choice p·n + i is sample i of prompt p)."""
        return choice // len(self.generations)


async def tokenize(state: ServerState, texts: list[str], special: bool = False) -> list[list[int]]:
    """Token ids of each text, computed off the event loop (a long prompt takes milliseconds to encode). Plain text
    starts with the model's beginning-of-sequence token when its tokenizer adds one; with `special` (a chat
    template's output, `ChatFormat.special`) control tokens' text is parsed as those tokens and the template has
    written any beginning-of-sequence token itself."""
    engine, _ = state.require_engine()
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(
        state.tokenizer_pool,
        lambda: [engine.encode(t, allow_special=special, add_special=not special) for t in texts],
    )


def _check_prompts(state: ServerState, plan: Plan) -> None:
    engine, _ = state.require_engine()
    limit, vocab = engine.info.max_seq_len, engine.info.vocab_size
    max_tokens = max(g.params.max_tokens for g in plan.generations)
    for p in plan.prompts:
        if not p:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
        if len(p) + max_tokens > limit:
            raise APIError(
                400,
                f"prompt has {len(p)} tokens and max_tokens is {max_tokens}: "
                f"{len(p) + max_tokens} exceeds the maximum sequence length {limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )


class RunningRequest:
    """The choices of one request, submitted to the engine (`start`); `complete()` or `merged_deltas()` consumes
    them."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.started = time.perf_counter()
        self.choices: list[ChoiceRun] = []

    def cancel(self) -> None:
        for c in self.choices:
            c.cancel()

    async def complete(self) -> None:
        try:
            await asyncio.gather(*(c.run() for c in self.choices))
        finally:
            self.cancel()

    async def merged_deltas(self) -> AsyncIterator[tuple[int, str, str | None, int]]:
        """(choice index, delta, finish, tokens handed out so far) from all choices as they come. The token count
        is taken when the delta is made: the choice may already have produced more by the time the consumer reads
        it."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, c: ChoiceRun) -> None:
            try:
                async for delta, finish, count in c.deltas():
                    await queue.put((i, delta, finish, count))
            except BaseException as e:
                await queue.put(e)

        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(self.choices)]
        try:
            finished = 0
            while finished < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[2] is not None:
                    finished += 1
                yield item
        finally:
            for t in tasks:
                t.cancel()
            self.cancel()

    def error(self) -> str | None:
        """The first engine failure among the choices, if any."""
        return next((c.error or "generation failed" for c in self.choices if c.finish_reason == "error"), None)

    def cached_tokens(self) -> int:
        """Prompt tokens the prompt cache supplied, counted once per prompt (as the prompt tokens are): its first
        choice's."""
        per_prompt = len(self.plan.generations)
        return sum(c.job.cached for c in self.choices[::per_prompt])

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.plan.prompts)
        return usage(prompt, sum(c.generated for c in self.choices), self.cached_tokens())

    def stats(self) -> dict[str, Any]:
        """The `stats` section of the LM Studio and native answers."""
        wall = time.perf_counter() - self.started
        completion = sum(c.generated for c in self.choices)
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        ttft = (min(firsts) - self.started) if firsts else None
        first = self.choices[0] if self.choices else None
        out = {
            "wall_ms": round(wall * 1000, 3),
            "tokens_per_second": round(completion / wall, 3) if wall > 0 else 0.0,
            "prompt_tokens": sum(len(p) for p in self.plan.prompts),
            "cached_tokens": self.cached_tokens(),
            "completion_tokens": completion,
            "mode": self.plan.mode,
            "loops_used": first.loops if first else None,
            "time_to_first_token": round(ttft, 6) if ttft is not None else None,
            "generation_time": round(wall - (ttft or 0.0), 6),
            "stop_reason": stop_reason(first),
        }
        if self.plan.mode != "generate":
            out.update(self._draft_stats())
        if any(g.auto is not None for g in self.plan.generations):
            out.update(depth.stats([c.auto_loops() for c in self.choices]))
        return out

    def _draft_stats(self) -> dict[str, Any]:
        rounds = proposed = accepted = 0
        for c in self.choices:
            r, p, a = c.draft_stats()
            rounds, proposed, accepted = rounds + r, proposed + p, accepted + a
        return {
            "accepted_draft_tokens_count": accepted,
            "rejected_draft_tokens_count": proposed - accepted,
            "total_draft_tokens_count": proposed,
            "mean_accepted_length": round(accepted / rounds, 4) if rounds else 0.0,
        }


def stop_reason(c: ChoiceRun | None) -> str | None:
    """LM Studio's `stats.stop_reason` for how a choice ended."""
    if c is None or c.finish_reason is None:
        return None
    if c.stopped_by_string:
        return "stopStringFound"
    return {"stop": "eosFound", "length": "maxPredictedTokensReached", "aborted": "userStopped", "error": "failed"}.get(
        c.finish_reason, c.finish_reason
    )


async def start(state: ServerState, plan: Plan) -> RunningRequest:
    """Check the plan's prompts and submit every choice to the engine runner."""
    _check_prompts(state, plan)
    _, runner = state.require_engine()
    r = RunningRequest(plan)
    try:
        for p in plan.prompts:
            for g in plan.generations:
                job = await runner.submit(p, g, plan.mode)
                r.choices.append(ChoiceRun(runner, job, plan.stop, plan.lstrip))
    except (InvalidRequestError, ContextLengthError) as e:
        r.cancel()
        raise APIError(400, str(e), param=plan.grammar_param if "grammar:" in str(e) else None) from e
    except Overloaded as e:
        r.cancel()
        raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": "1"}) from e
    except BaseException:  # cancelled while a grammar compiled: no choice may run without its request
        r.cancel()
        raise
    runner.metrics.prompt_tokens.inc(sum(len(p) for p in plan.prompts))
    return r


async def respond(
    state: ServerState,
    plan: Plan,
    stream: bool,
    body: Callable[[RunningRequest], dict[str, Any]],
    events: Callable[[RunningRequest], AsyncIterator[bytes]],
) -> dict[str, Any] | Response:
    """Run a plan and answer: SSE events as they come, or the JSON body once every choice has finished."""
    r = await start(state, plan)
    if stream:
        return sse_response(events(r))
    await r.complete()
    return body(r)
