"""Cases for the clients of the server's other faces: litellm (through its `openai/` and `anthropic/` providers), the
anthropic SDK (`/v1/messages`) and lm-evaluation-harness (`/v1/completions` with log-likelihoods, and vLLM's
tokenizer routes). See client_harness.py for what a case checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from client_harness import (
    MODEL,
    STRUCTURED_MAX_TOKENS,
    TEXT_MAX_TOKENS,
    WEATHER_PROMPT,
    WEATHER_TOOL_PARAMETERS,
    Case,
    Env,
    check_no_usage_chunk,
    registrar,
)
from tinyloop.server.config import DEFAULT_MODEL

CASES: list[Case] = []
case = registrar(CASES)


# litellm ----------------------------------------------------------------------------------------------------------


def _litellm(env: Env, provider: str, **kw: Any) -> Any:
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True  # else it prints a "Provider List" banner to stdout on every call
    api_base = env.v1 if provider == "openai" else env.base
    return litellm.completion(
        model=f"{provider}/{MODEL}", api_base=api_base, api_key="unused", temperature=0, num_retries=0, **kw
    )


def _litellm_stream(env: Env, provider: str) -> str:
    messages = [{"role": "user", "content": "Hello!"}]
    chunks = list(_litellm(env, provider, messages=messages, max_tokens=TEXT_MAX_TOKENS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons and reasons[-1] in ("stop", "length"), reasons
    assert text, "no text came"
    if provider == "openai":
        check_no_usage_chunk(env)
    return f"{len(chunks)} chunks: {text[:40]!r}"


def _litellm_text(env: Env, provider: str) -> str:
    r = _litellm(env, provider, messages=[{"role": "user", "content": "Hello!"}], max_tokens=TEXT_MAX_TOKENS)
    choice = r.choices[0]
    assert isinstance(choice.message.content, str), choice
    assert choice.finish_reason in ("stop", "length"), choice.finish_reason
    assert r.usage.completion_tokens > 0, r.usage
    return repr(choice.message.content[:40])


def _litellm_tool(env: Env, provider: str) -> str:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER_TOOL_PARAMETERS},
    }
    r = _litellm(
        env,
        provider,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=STRUCTURED_MAX_TOKENS,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather", r.choices[0].message
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args.get("city"), str), args
    return f"get_weather({args})"


@case("litellm", "openai/ completion", "litellm")
def litellm_openai(env: Env) -> str:
    return _litellm_text(env, "openai")


@case("litellm", "openai/ streamed", "litellm")
def litellm_openai_stream(env: Env) -> str:
    return _litellm_stream(env, "openai")


@case("litellm", "openai/ forced tool", "litellm")
def litellm_openai_tool(env: Env) -> str:
    return _litellm_tool(env, "openai")


@case("litellm", "anthropic/ completion", "litellm")
def litellm_anthropic(env: Env) -> str:
    return _litellm_text(env, "anthropic")


@case("litellm", "anthropic/ streamed", "litellm")
def litellm_anthropic_stream(env: Env) -> str:
    return _litellm_stream(env, "anthropic")


@case("litellm", "anthropic/ forced tool", "litellm")
def litellm_anthropic_tool(env: Env) -> str:
    return _litellm_tool(env, "anthropic")


# anthropic SDK ----------------------------------------------------------------------------------------------------

_FORCED_CUSTOM_TOOL = {
    "model": MODEL,
    "max_tokens": STRUCTURED_MAX_TOKENS,
    "messages": [{"role": "user", "content": WEATHER_PROMPT}],
    "tools": [
        {
            "type": "custom",
            "name": "get_weather",
            "description": "The current weather in a city.",
            "input_schema": WEATHER_TOOL_PARAMETERS,
        }
    ],
    "tool_choice": {"type": "tool", "name": "get_weather"},
    "extra_body": {"temperature": 0},  # this SDK's methods take no temperature of their own
}


def _anthropic_client(env: Env) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=env.base, api_key="unused", max_retries=0)


def _check_tool_use(msg: Any) -> str:
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather", msg.content
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input.get("city"), str), uses[0].input
    assert msg.stop_reason == "tool_use", msg.stop_reason
    return f"tool_use get_weather({uses[0].input})"


@case("anthropic", "custom tool, forced", "anthropic")
def anthropic_custom_tool(env: Env) -> str:
    return _check_tool_use(_anthropic_client(env).messages.create(**_FORCED_CUSTOM_TOOL))


@case("anthropic", "custom tool, forced, streamed", "anthropic")
def anthropic_custom_tool_stream(env: Env) -> str:
    with _anthropic_client(env).messages.stream(**_FORCED_CUSTOM_TOOL) as stream:
        return _check_tool_use(stream.get_final_message())


@case("anthropic", "a malformed request is a 400 invalid_request_error", "anthropic")
def anthropic_bad_request(env: Env) -> str:
    import anthropic

    try:
        _anthropic_client(env).messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": 5}],  # type: ignore[list-item]
        )
    except anthropic.BadRequestError as e:
        assert e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error", e.body  # type: ignore[index]
        return f"BadRequestError: {e.body['error']['message'][:50]}"  # type: ignore[index]
    raise AssertionError("the malformed request was accepted")


# lm-evaluation-harness --------------------------------------------------------------------------------------------

LM_EVAL_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "answer": 0},
    {"question": "In the beginning God created the", "choices": ["heaven", "fish", "car"], "answer": 0},
    {"question": "To be, or not to", "choices": ["be", "see", "go"], "answer": 0},
]
LM_EVAL_TASKS = {
    "mc": """\
        task: tinyloop_mc
        output_type: multiple_choice
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
        """,
    "gen": """\
        task: tinyloop_gen
        output_type: generate_until
        doc_to_target: "{{choices[answer]}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 8
          do_sample: false
        metric_list:
          - metric: exact_match
        """,
}


def _lm_eval_tasks(env: Env) -> Path:
    """Two tasks over a local jsonl (no download): multiple choice (log-likelihoods: `logprobs` with `echo`) and
    generation (`generate_until`)."""
    d = env.tmp / "lm-eval-tasks"
    d.mkdir(exist_ok=True)
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    common = f"""\
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{question}}}}"
        """
    for name, task in LM_EVAL_TASKS.items():
        (d / f"{name}.yaml").write_text(textwrap.dedent(common) + textwrap.dedent(task))
    return d


def _expected_loglikelihoods(engine: Any) -> list[list[float]]:
    """Each choice's log-likelihood after its question, as the default model gives it at its default depth (what
    the server computes for a request that names none), split into context and continuation as lm-eval splits."""
    loops = engine.info.default_loops
    out = []
    for doc in LM_EVAL_DOCS:
        ctx = engine.encode(doc["question"])
        row = []
        for choice in doc["choices"]:
            ids = engine.encode(f"{doc['question']} {choice}")
            assert ids[: len(ctx)] == ctx
            lps = engine.prompt_logprobs(ids, loops, 1)  # entry i - 1 scores token i
            row.append(sum(lps[i - 1][0] for i in range(len(ctx), len(ids))))
        out.append(row)
    return out


def _run_lm_eval(env: Env, out: Path, *model_args: str) -> None:
    """`lm_eval run` with `local-completions` on both tasks, its samples logged under `out`."""
    args = [f"model={MODEL}", f"base_url={env.v1}/completions", "max_length=512", "max_retries=1", *model_args]
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", ",".join(args)]
    cmd += ["--tasks", "tinyloop_mc,tinyloop_gen", "--include_path", str(_lm_eval_tasks(env))]
    cmd += ["--output_path", str(out), "--log_samples"]
    cache = {"HF_DATASETS_CACHE": str(env.tmp / "hf-datasets")}  # the jsonl's Arrow copy stays in the test's dir
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=env.tmp, env=os.environ | cache)
    assert r.returncode == 0, f"lm-eval exited {r.returncode}: {r.stderr.strip()[-1500:]}"
    # With no tokenizer named, lm-eval uses the server's when `/tokenizer_info` answers.
    remote = "Auto-detected remote tokenizer support" in r.stderr or "tokenizer_backend=remote" in model_args
    assert remote, r.stderr[-1500:]


def _newest(out: Path, pattern: str) -> Path:
    return max(out.rglob(pattern), key=lambda p: p.stat().st_mtime)


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    lines = _newest(out, f"samples_{task}_*.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])


def _check_tokenizer_routes(env: Env, engine: Any, text_prompts: bool) -> None:
    """lm-eval tokenized through vLLM's routes (and, given text prompts, decoded its token lists through
    `/detokenize`), and `/tokenizer_info` held the model's chat template."""
    exchanges = [ex for ex in env.recorder.since(env.mark) if ex.status == 200]
    want = {"/tokenizer_info", "/tokenize", "/v1/completions"} | ({"/detokenize"} if text_prompts else set())
    assert want <= {ex.path for ex in exchanges}, sorted({ex.path for ex in exchanges})
    info = next(json.loads(ex.response) for ex in exchanges if ex.path == "/tokenizer_info")
    assert info["chat_template"] == engine.chat_template, info


def _lm_eval(env: Env, *model_args: str) -> str:
    """The server's log-likelihoods are the engine's, choice by choice, and so is the accuracy; the generations are
    text."""
    import tinyloop

    out, engine = env.tmp / "lm-eval-out", tinyloop.Engine(str(DEFAULT_MODEL))
    _run_lm_eval(env, out, *model_args)
    _check_tokenizer_routes(env, engine, text_prompts="tokenized_requests=False" in model_args)
    results = json.loads(_newest(out, "results_*.json").read_text())["results"]
    acc, exact = results["tinyloop_mc"]["acc,none"], results["tinyloop_gen"]["exact_match,none"]
    got = [[float(ll) for (ll, _greedy) in (r[0] for r in s["resps"])] for s in _samples(out, "tinyloop_mc")]
    generations = [s["resps"][0][0] for s in _samples(out, "tinyloop_gen")]
    shutil.rmtree(out)
    want = _expected_loglikelihoods(engine)
    assert [x for row in got for x in row] == pytest.approx([x for row in want for x in row], abs=1e-3), (got, want)
    best = [max(range(len(w)), key=w.__getitem__) for w in want]
    expected_acc = sum(b == d["answer"] for b, d in zip(best, LM_EVAL_DOCS, strict=True)) / len(LM_EVAL_DOCS)
    assert acc == pytest.approx(expected_acc), (acc, expected_acc)
    assert 0.0 <= exact <= 1.0, results
    assert len(generations) == len(LM_EVAL_DOCS) and all(isinstance(g, str) for g in generations), generations
    return f"acc {acc:.2f} (log-likelihoods = engine's), generations {generations[0][:20]!r}…"


@case("lm-eval", "local-completions, remote tokenizer", "lm_eval")
def lm_eval_remote_tokenizer(env: Env) -> str:
    return _lm_eval(env)


@case("lm-eval", "local-completions, remote tokenizer, text prompts", "lm_eval")
def lm_eval_text_prompts(env: Env) -> str:
    """`tokenized_requests=False`: prompts go as text, decoded through `/detokenize`."""
    return _lm_eval(env, "tokenizer_backend=remote", "tokenized_requests=False")
