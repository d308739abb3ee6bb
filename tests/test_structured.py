"""Grammar-constrained generation in the engine (`Grammar`, llguidance): every output is a document the grammar
accepts, in every generation path — plain, batched, speculative chain and tree, windowed — and greedy speculative
output still equals plain output. Outputs are checked with `jsonschema` and `re`, which we did not write."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop
from tinyloop import Generation, Grammar, InvalidRequestError, SamplingParams, Speculative

DEFAULT = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "ok"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
}


def greedy(n: int = 120) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def document(c, schema=PERSON):
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    value = json.loads(c.text)
    jsonschema.validate(value, schema)
    return value


def drain(engine, streams):
    """Step all streams together (continuous batching) to the end; their texts."""
    tokens = [[] for _ in streams]
    finish = [None] * len(streams)
    while any(f is None for f in finish):
        for i, ev in enumerate(engine.step_many(streams)):
            if ev is None:
                continue
            assert not isinstance(ev, Exception), ev
            if ev.token_id >= 0:
                tokens[i].append(ev.token_id)
            if ev.finish_reason is not None:
                finish[i] = ev.finish_reason
    return [engine.decode(t) for t in tokens], finish


def test_every_generation_path_gives_the_same_valid_document(tiny_engine):
    g = Grammar.json_schema(PERSON)
    prompt = "A record:"
    plain = tiny_engine.generate(prompt, greedy(), loops=3, grammar=g)
    document(plain)
    chain = tiny_engine.generate(prompt, greedy(), loops=3, draft=(1, 4), grammar=g)
    tree = tiny_engine.generate(prompt, greedy(), loops=3, draft=(1, 4), k_branches=3, grammar=g)
    windowed = tiny_engine.generate(prompt, greedy(), loops=3, cache_window=512, grammar=g)
    assert chain.text == tree.text == windowed.text == plain.text
    assert chain.draft_proposed > 0 and tree.draft_proposed > 0
    # Batched: each stream keeps its own grammar state next to unconstrained and differently constrained streams.
    regex = Grammar.regex(r"[0-9]{3}-[a-z]{4}")
    streams = [
        tiny_engine.stream(prompt, greedy(), loops=3, grammar=g),
        tiny_engine.stream(prompt, greedy(20), loops=3),
        tiny_engine.stream("Code:", greedy(), loops=3, grammar=regex),
        tiny_engine.stream(prompt, params=Generation(greedy(), speculative=Speculative(1, 3, 4), grammar=g)),
    ]
    texts, finish = drain(tiny_engine, streams)
    assert texts[0] == texts[3] == plain.text and finish[0] == finish[3] == "stop"
    assert texts[1] == tiny_engine.generate(prompt, greedy(20), loops=3).text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{4}", texts[2]) and finish[2] == "stop"


@pytest.mark.parametrize("seed", range(3))
def test_masks_computed_inline_or_ahead_give_the_same_outputs(tiny, tiny_engine, seed):
    """An engine without grammar threads computes each mask when the sampler needs it; the default computes it
    during the forward pass. Seeded sampled outputs (one stream, speculative, batched) are the same either way."""
    inline = tinyloop.Engine(tiny.path, grammar_threads=0)
    g = Grammar.json_schema(PERSON)
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120)

    def outputs(engine):
        one = engine.generate("A record:", params, loops=3, grammar=g).text
        spec = engine.generate("A record:", params, loops=3, draft=(1, 4), grammar=g).text
        texts, _ = drain(engine, [engine.stream(p, params, loops=3, grammar=g) for p in ("A record:", "Data:")])
        return [one, spec, *texts]

    got = outputs(tiny_engine)
    assert got == outputs(inline)
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("seed", range(4))
def test_sampled_outputs_stay_inside_the_grammar(tiny_engine, seed):
    g = Grammar.json_schema(PERSON)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=120)
    document(tiny_engine.generate("A record:", params, loops=3, grammar=g))
    spec = tiny_engine.generate("A record:", params, loops=3, draft=(1, 4), grammar=g)
    document(spec)
    assert spec.draft_proposed > 0


def test_lark_and_regex_grammars(tiny_engine):
    lark = Grammar.lark('start: "(" NUM ("," NUM)? ("," NUM)? ")"\nNUM: /[1-9][0-9]?/')
    out = tiny_engine.generate("Tuple:", greedy(60), loops=3, grammar=lark)
    assert out.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?){0,2}\)", out.text), out.text
    assert lark.kind == "lark" and "NUM" in lark.source


def test_a_document_cut_by_max_tokens_ends_with_length(tiny_engine):
    out = tiny_engine.generate("A record:", greedy(5), loops=3, grammar=Grammar.json_schema(PERSON))
    assert out.finish_reason == "length" and len(out.tokens) == 5 and out.text.startswith('{"name": "')


def test_grammars_that_cannot_compile_or_conflict_are_refused(tiny_engine):
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        tiny_engine.generate("x", greedy(), grammar=Grammar.json_schema({"type": "array", "uniqueItems": True}))
    with pytest.raises(InvalidRequestError, match="not JSON"):
        tiny_engine.generate("x", greedy(), grammar=Grammar.json_schema("{oops"))
    with pytest.raises(InvalidRequestError, match="where the output ends"):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        tiny_engine.generate("x", params, grammar=Grammar.regex("a+"))
    with pytest.raises(TypeError, match="grammar"):
        tiny_engine.generate("x", Generation(greedy()), grammar=Grammar.regex("a+"))


# Schemas inside the documented subset, bounded so that every document fits in max_tokens.
LEAVES = st.one_of(
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(0, 10).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text("abcxyz ", min_size=1, max_size=6), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}
    ),
    st.sampled_from(["yes", 7, True, None]).map(lambda v: {"const": v}),
)
NAMES = st.text("abcdefghij_", min_size=1, max_size=8)
SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.dictionaries(NAMES, inner, min_size=1, max_size=3).map(
            lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
        ),
        st.tuples(inner, st.integers(0, 2)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        st.lists(inner, min_size=2, max_size=2).map(lambda a: {"anyOf": a}),
    ),
    max_leaves=5,
)


@pytest.fixture(scope="module")
def default_engine():
    return tinyloop.Engine(DEFAULT)


@settings(max_examples=200, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_generated_schemas_give_valid_documents_from_the_default_model(default_engine, schema):
    g = Grammar.json_schema(schema)
    prompt = "JSON:"
    plain = default_engine.generate(prompt, greedy(400), loops=2, grammar=g)
    document(plain, schema)
    spec = default_engine.generate(prompt, greedy(400), loops=4, draft=(1, 3), grammar=g)
    document(spec, schema)
    sampled = SamplingParams(temperature=0.8, seed=len(json.dumps(schema)), max_tokens=400)
    texts, finish = drain(
        default_engine,
        [default_engine.stream(prompt, sampled, loops=2, grammar=g), default_engine.stream(prompt, greedy(4), loops=2)],
    )
    assert finish[0] == "stop", texts[0]
    jsonschema.validate(json.loads(texts[0]), schema)


def scored(engine, prompt_ids, tokens, loops):
    """The log-probability of each generated token given everything before it, from `Engine.score`."""
    ids = list(prompt_ids) + list(tokens)
    logprobs, argmax = engine.score(ids, [loops])[0]
    return logprobs[len(prompt_ids) - 1 :], argmax[len(prompt_ids) - 1 :]


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "batched"])
def test_logprobs_equal_the_engines_scores_in_every_path(tiny_engine, mode):
    prompt = tiny_engine.encode("Log probabilities of")
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    if mode == "batched":
        streams = [tiny_engine.stream(prompt, params, loops=3), tiny_engine.stream(prompt, greedy(8), loops=3)]
        tokens, entries = [], []
        while True:
            ev = tiny_engine.step_many(streams)[0]
            if ev is None or (ev.finish_reason is not None and ev.token_id < 0):
                break
            if ev.token_id >= 0:
                tokens.append(ev.token_id)
                entries.append(ev.logprob)
    else:
        draft = None if mode == "plain" else (1, 4)
        out = tiny_engine.generate(prompt, params, loops=3, draft=draft, k_branches=3 if mode == "tree" else 1)
        tokens, entries = out.tokens, out.logprobs
    assert len(entries) == len(tokens) == 24
    want, argmax = scored(tiny_engine, prompt, tokens, 3)
    for i, (token, (logprob, top)) in enumerate(zip(tokens, entries, strict=True)):
        assert logprob == pytest.approx(want[i], abs=1e-4)
        assert len(top) == 3 and top[0][0] == argmax[i] == token  # greedy: the choice is the most likely token
        assert top[0][1] == pytest.approx(logprob, abs=1e-6) and top[0][1] >= top[1][1] >= top[2][1]


def test_sampled_logprobs_are_the_models_not_the_samplers(tiny_engine):
    """Temperature, top-k and a grammar change what is drawn, not the reported log-probability."""
    prompt = tiny_engine.encode("A record:")
    params = SamplingParams(temperature=1.5, top_k=5, seed=3, max_tokens=40, logprobs=0)
    out = tiny_engine.generate(prompt, params, loops=3, grammar=Grammar.json_schema(PERSON))
    want, _ = scored(tiny_engine, prompt, out.tokens, 3)
    assert [e[0] for e in out.logprobs] == pytest.approx(want[: len(out.tokens)], abs=1e-4)
    assert all(top == [] for _, top in out.logprobs)
    assert tiny_engine.generate(prompt, greedy(4)).logprobs is None
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_prompt_logprobs_equal_the_engines_scores(tiny_engine):
    ids = tiny_engine.encode("Score every token of this prompt")
    entries = tiny_engine.prompt_logprobs(ids, 3, 4)
    logprobs, argmax = tiny_engine.score(ids, [3])[0]
    assert [e[0] for e in entries] == pytest.approx(logprobs, abs=1e-4)
    assert [e[1][0][0] for e in entries] == argmax and all(len(e[1]) == 4 for e in entries)
    with pytest.raises(InvalidRequestError, match="at least two tokens"):
        tiny_engine.prompt_logprobs(ids[:1], 3, 0)
