"""The team of threads that splits each small product across the cores (`rust/kernels/team.rs`) and the stacked
Q/K/V and gate/up products (`model::linear::Group`) change where outputs are computed, never their bits: every
path — prompt prefill, plain decode, batched steps, chain and tree speculation, a sliding window, adaptive depth —
gives the same tokens and the same log-probabilities, to the last bit, as a process without the team
(`TINYLOOP_SPIN_US=0`: each product on its caller's thread) and as one with a single thread; the team side runs
two threads whatever the machine's cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tinyloop.modelfile.format import ModelConfig
from tinyloop.server.config import DEFAULT_MODEL

RUN = """
import json, sys, tinyloop
from tinyloop import Generation, SamplingParams
engine = tinyloop.Engine(sys.argv[1])
ids = engine.encode("Once upon a time there was a little dog who ran to the park, and the sun was warm on the grass")
out = {"threads": tinyloop._core.num_threads(), "score": engine.score(ids, [1, 3, 8])}
paths = {"plain": {}, "chain": {"draft": (2, 4)}, "tree": {"draft": (2, 3), "k_branches": 3},
         "window": {"cache_window": 8}}
for name, kw in paths.items():
    c = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3), loops=6, **kw)
    out[name] = [c.tokens, c.logprobs]
c = engine.generate(ids[:5], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2), loops="auto")
out["auto"] = [c.tokens, c.logprobs]
streams = [engine.stream(ids[: 3 + 4 * i], Generation(SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
           logprobs=2), loops=4)) for i in range(4)]
events = [[] for _ in streams]
live = list(range(len(streams)))
while live:
    stepped = engine.step_many([streams[i] for i in live])
    for i, ev in zip(live, stepped):
        events[i].append([ev.token_id, ev.logprob])
    live = [i for i, ev in zip(live, stepped) if ev.finish_reason is None]
out["batched"] = events
print(json.dumps(out))
"""
# Widths that are whole panels (64 rows), so the stacked products are in play, with GQA and a prelude.
PANELS = ModelConfig(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=256, block_count=2, prelude_count=1, name="panels")


def _run(model, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("TINYLOOP_SPIN_US", "RAYON_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(model)], env=base | env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("weights", ["default", "F32", "F16", "Q4_0", "Q8_0"])
def test_the_team_and_stacked_products_change_no_output_bit(model_factory, weights):
    model = DEFAULT_MODEL if weights == "default" else model_factory(PANELS, weight_type=weights).path
    team = _run(model, RAYON_NUM_THREADS="2")  # a team of two even on a one-core machine
    assert team["threads"] == 2
    for alone in (_run(model, TINYLOOP_SPIN_US="0"), _run(model, RAYON_NUM_THREADS="1")):
        for path in team:
            if path != "threads":
                assert alone[path] == team[path], path
