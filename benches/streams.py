"""Drive `Engine.step_many` the way the server's engine thread does, for the benches that batch streams."""

from __future__ import annotations


def step_until_done(engine, streams: list) -> int:
    """Step `streams` together until every one has finished; returns the tokens they produced."""
    produced = 0
    while streams:
        events = engine.step_many(streams)
        produced += sum(ev.token_id >= 0 for ev in events)
        streams = [s for s, ev in zip(streams, events, strict=True) if ev.finish_reason is None]
    return produced
