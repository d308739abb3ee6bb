"""Continuous batching (`Engine.step_many`): every stream's output is what it produces alone, whatever it is
batched with, whenever it joins, and whichever mode it runs in."""

from __future__ import annotations

import random

import pytest

import tinyloop
from conftest import TINY
from tinyloop import SamplingParams

SPECULATIVE = {
    4: {"loops": 5, "draft": (2, 3)},
    5: {"loops": 5, "draft": (1, 4)},
    8: {"loops": 5, "draft": (3, 2), "cache_window": 6},
    9: {"loops": 3, "draft": (1, 2), "k_branches": 2},
}


def _requests(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(10):
        prompt = [rng.randrange(50257) for _ in range(rng.randint(1, 60))]
        sampled = i % 3 == 1
        params = SamplingParams(
            temperature=0.9 if sampled else 0.0,
            top_p=0.9,
            seed=100 + i,
            max_tokens=rng.randint(3, 24),
            ignore_eos=i % 2 == 0,
        )
        kw: dict = {"loops": 5 if i == 2 else rng.choice([1, 2, 3, 5])}
        # Speculative rounds share their passes with the plain streams of their verify depth (5): drafts at
        # different depths, sampled and greedy; a tree round runs on its own between batched steps.
        if i in SPECULATIVE:
            kw = SPECULATIVE[i]
        if i == 7:
            kw["cache_window"] = 5  # windowed: prefills in chunks on its own, then decodes in the batch
        out.append({"prompt": prompt, "params": params, "kw": kw})
    return out


def _alone(engine, reqs):
    """Each request's tokens and draft counters when it runs by itself."""
    runs = [engine.generate(r["prompt"], r["params"], **r["kw"]) for r in reqs]
    return [(g.tokens, (g.draft_rounds, g.draft_proposed, g.draft_accepted)) for g in runs]


def _batched(engine, reqs, join_every: int):
    """Step all streams together; request j joins after j * join_every batched steps."""
    streams: list = []
    tokens: list[list[int]] = [[] for _ in reqs]
    stats: list = [None] * len(reqs)
    step = 0
    while len(streams) < len(reqs) or any(s is not None for s in streams):
        while len(streams) < len(reqs) and len(streams) * join_every <= step:
            r = reqs[len(streams)]
            streams.append(engine.stream(r["prompt"], r["params"], **r["kw"]))
        live = [(i, s) for i, s in enumerate(streams) if s is not None]
        for (i, s), ev in zip(live, engine.step_many([s for _, s in live]), strict=True):
            assert not isinstance(ev, BaseException), ev
            if ev.token_id >= 0:
                tokens[i].append(ev.token_id)
            if ev.finish_reason is not None:
                stats[i] = s.draft_stats
                streams[i] = None
        step += 1
    return list(zip(tokens, stats, strict=True))


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q8_0", "Q4_0"])
def test_batched_outputs_equal_solo_outputs(model_factory, weight_type):
    engine = tinyloop.Engine(model_factory(TINY, weight_type=weight_type).path)
    reqs = _requests(seed=len(weight_type))
    alone = _alone(engine, reqs)
    assert all(alone[i][1][0] > 0 for i in SPECULATIVE)  # the speculative requests did draft
    assert _batched(engine, reqs, join_every=0) == alone  # all start together
    assert _batched(engine, reqs, join_every=3) == alone  # staggered arrivals join running batches


def test_step_many_reports_finished_streams_and_errors_per_stream(tiny_engine):
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    a, b = tiny_engine.stream([1, 2], params), tiny_engine.stream([3], params)
    first = tiny_engine.step_many([a, b])
    assert [ev.finish_reason for ev in first] == ["length", "length"] and all(ev.token_id >= 0 for ev in first)
    assert tiny_engine.step_many([a, b]) == [None, None]
    other = tinyloop.Engine(tiny_engine.path)
    c = other.stream([4], params)
    (ev,) = tiny_engine.step_many([c])  # a stream of another engine instance still steps correctly
    assert ev.token_id == tiny_engine.generate([4], params).tokens[0]


def test_a_full_server_answers_503_with_retry_after(tiny_engine):
    """Backpressure, deterministically: a runner that admits nothing to run (max_running 0) holds two waiting
    choices, then refuses the next request in the API's shape, with Retry-After."""
    import asyncio

    from tinyloop.server.errors import APIError
    from tinyloop.server.metrics import Metrics
    from tinyloop.server.openai import completion_plan
    from tinyloop.server.protocol import CompletionRequest
    from tinyloop.server.request import RunningRequest, start
    from tinyloop.server.runner import EngineRunner
    from tinyloop.server.state import ServerState

    async def main():
        runner = EngineRunner(tiny_engine, Metrics(), max_running=0, max_waiting=2)
        state = ServerState(tiny_engine, runner, "m", None, "fp16", None)

        async def submit(prompt: str, n: int = 1) -> RunningRequest:
            req = CompletionRequest(model="m", prompt=prompt, max_tokens=3, n=n)
            return await start(state, await completion_plan(state, req))

        held = await submit("x", n=2)
        with pytest.raises(APIError) as e:
            await submit("y")
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        assert e.value.body()["error"]["code"] == "server_overloaded" and "2 waiting" in e.value.message
        assert runner.metrics.requests_waiting._value.get() == 2
        # Waiting requests whose client went away free their places.
        held.cancel()
        again = await submit("z")
        assert len(again.choices) == 1
        again.cancel()

    asyncio.run(main())


def test_long_prompts_prefill_in_chunks_while_others_keep_decoding(tiny):
    engine = tinyloop.Engine(tiny.path, max_seq_len=1000)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long_prompt = [(i * 37 + 11) % 50000 for i in range(600)]  # 3 chunks of at most 256
    short = engine.stream([7, 8, 9], params, loops=3)
    assert engine.step_many([short])[0].token_id >= 0
    long = engine.stream(long_prompt, params, loops=3)
    events = [engine.step_many([short, long]) for _ in range(3)]
    # While the long prompt goes in (two steps without a token), the short stream gets a token every step.
    assert [ev[1].token_id for ev in events[:2]] == [-1, -1] and events[2][1].token_id >= 0
    assert all(ev[0].token_id >= 0 and ev[1].finish_reason is None for ev in events)
    tokens = [events[2][1].token_id]
    while True:
        (ev,) = engine.step_many([long])
        tokens.append(ev.token_id)
        if ev.finish_reason:
            break
    assert tokens == engine.generate(long_prompt, params, loops=3).tokens
