"""Cases for the client libraries that speak OpenAI's API: openai-agents, instructor, langchain-openai, pydantic-ai
and llm (the CLI), each pointed at the server's `/v1` (see client_harness.py for what a case checks)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from client_harness import (
    MODEL,
    PERSON_PROMPT,
    STRUCTURED_MAX_TOKENS,
    TEXT_MAX_TOKENS,
    WEATHER_PROMPT,
    Case,
    City,
    Env,
    GetWeather,
    Person,
    check_no_usage_chunk,
    check_person,
    registrar,
)

CASES: list[Case] = []
case = registrar(CASES)


# openai-agents ----------------------------------------------------------------------------------------------------


def _agents_model(env: Env, kind: str) -> Any:
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=env.v1, api_key="unused", max_retries=0)
    cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
    return cls(model=MODEL, openai_client=client)


def _agents_run(agent: Any, stream: bool) -> Any:
    from agents import Runner

    if not stream:  # asyncio.run, not Runner.run_sync: that one leaves its event loop (and its sockets) open
        return asyncio.run(Runner.run(agent, WEATHER_PROMPT, max_turns=2)).final_output

    async def streamed() -> Any:
        result = Runner.run_streamed(agent, WEATHER_PROMPT, max_turns=2)
        async for _ in result.stream_events():
            pass
        return result.final_output

    return asyncio.run(streamed())


def _agents_tool(env: Env, kind: str, stream: bool = False) -> str:
    from agents import Agent, ModelSettings, function_tool

    calls: list[str] = []

    @function_tool
    def get_weather(city: City) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=_agents_model(env, kind),
        tools=[get_weather],
        model_settings=ModelSettings(temperature=0, max_tokens=STRUCTURED_MAX_TOKENS, tool_choice="required"),
        tool_use_behavior="stop_on_first_tool",
    )
    final = _agents_run(agent, stream)
    assert len(calls) == 1, f"the tool ran {len(calls)} times"
    assert final == f"sunny in {calls[0]}", f"final output {final!r}"
    return f"get_weather({calls[0]!r})"


def _agents_output(env: Env, kind: str) -> str:
    from agents import Agent, ModelSettings, Runner

    agent = Agent(
        name="extract",
        instructions="Extract the person.",
        model=_agents_model(env, kind),
        output_type=Person,
        model_settings=ModelSettings(temperature=0, max_tokens=STRUCTURED_MAX_TOKENS),
    )
    return check_person(asyncio.run(Runner.run(agent, PERSON_PROMPT, max_turns=1)).final_output)


@case("openai-agents", "Responses model, function tool", "agents")
def agents_responses_tool(env: Env) -> str:
    return _agents_tool(env, "responses")


@case("openai-agents", "Responses model, function tool, streamed", "agents")
def agents_responses_tool_stream(env: Env) -> str:
    return _agents_tool(env, "responses", stream=True)


@case("openai-agents", "Responses model, output_type", "agents")
def agents_responses_output(env: Env) -> str:
    return _agents_output(env, "responses")


@case("openai-agents", "chat model, function tool", "agents")
def agents_chat_tool(env: Env) -> str:
    return _agents_tool(env, "chat")


@case("openai-agents", "chat model, function tool, streamed", "agents")
def agents_chat_tool_stream(env: Env) -> str:
    return _agents_tool(env, "chat", stream=True)


@case("openai-agents", "chat model, output_type", "agents")
def agents_chat_output(env: Env) -> str:
    return _agents_output(env, "chat")


# instructor -------------------------------------------------------------------------------------------------------


def _instructor(env: Env, mode: str) -> str:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(base_url=env.v1, api_key="unused", max_retries=0), mode=getattr(instructor.Mode, mode)
    )
    person = client.chat.completions.create(
        model=MODEL,
        response_model=Person,
        messages=[{"role": "user", "content": PERSON_PROMPT}],
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
        max_retries=1,
    )
    return check_person(person)


@case("instructor", "TOOLS", "instructor")
def instructor_tools(env: Env) -> str:
    return _instructor(env, "TOOLS")


@case("instructor", "JSON_SCHEMA", "instructor")
def instructor_json_schema(env: Env) -> str:
    return _instructor(env, "JSON_SCHEMA")


@case("instructor", "RESPONSES_TOOLS", "instructor")
def instructor_responses_tools(env: Env) -> str:
    return _instructor(env, "RESPONSES_TOOLS")


@case("instructor", "JSON", "instructor")
def instructor_json(env: Env) -> str:
    """JSON mode holds the answer to JSON but not to the schema, which only the prompt gives (as OpenAI's
    `json_object` does), so the toy model's object need not end within `max_tokens`: the case asks that instructor
    read the answer — a Person, or its own exception for an answer cut at `max_tokens`, holding a JSON prefix."""
    try:
        return _instructor(env, "JSON")
    except Exception as e:
        if type(e).__name__ != "IncompleteOutputException":
            raise
        choice = e.last_completion.choices[0]  # type: ignore[attr-defined]
        assert choice.finish_reason == "length" and choice.message.content.startswith("{"), choice
        return f"cut at max_tokens (toy model): {choice.message.content[:30]!r}"


# langchain-openai -------------------------------------------------------------------------------------------------


def _chat_openai(env: Env, max_tokens: int = STRUCTURED_MAX_TOKENS) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=MODEL, base_url=env.v1, api_key="unused", temperature=0, max_tokens=max_tokens, max_retries=0
    )


def _joined(chunks: list[Any]) -> Any:
    """A stream's chunks added into one message, as langchain adds them."""
    msg = chunks[0]
    for c in chunks[1:]:
        msg = msg + c
    return msg


def _check_weather_call(calls: list[dict[str, Any]]) -> str:
    assert len(calls) == 1, f"tool calls: {calls!r}"
    assert calls[0]["name"] == "GetWeather", calls
    assert isinstance(calls[0]["args"].get("city"), str), calls
    return f"GetWeather({calls[0]['args']})"


@case("langchain-openai", "bind_tools", "langchain_openai")
def langchain_bind_tools(env: Env) -> str:
    from langchain_core.messages import AIMessage

    msg = _chat_openai(env).bind_tools([GetWeather], tool_choice="GetWeather").invoke(WEATHER_PROMPT)
    assert isinstance(msg, AIMessage), msg
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    return _check_weather_call(msg.tool_calls)


@case("langchain-openai", "bind_tools, streamed", "langchain_openai")
def langchain_bind_tools_stream(env: Env) -> str:
    from langchain_core.messages import AIMessageChunk

    chunks = list(_chat_openai(env).bind_tools([GetWeather], tool_choice="GetWeather").stream(WEATHER_PROMPT))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks), chunks
    msg = _joined(chunks)
    assert not msg.invalid_tool_calls, msg.invalid_tool_calls
    pieces = [t for c in chunks for t in c.tool_call_chunks]
    assert pieces[0]["name"] == "GetWeather" and not pieces[0]["args"], pieces[:2]  # the name first, then arguments
    assert len([t for t in pieces if t["args"]]) > 1, pieces  # the arguments stream as they are written
    assert not any("<tool_call>" in str(c.content) for c in chunks), [c.content for c in chunks]
    return f"{len(chunks)} chunks, " + _check_weather_call(msg.tool_calls)


@case("langchain-openai", "bind_tools, call cut by max_tokens", "langchain_openai")
def langchain_bind_tools_cut(env: Env) -> str:
    """A forced call that `max_tokens` cuts inside its arguments: whole or streamed, the client gets the call with
    the arguments written so far (kept as an invalid call, or as a partial one) and `finish_reason: "length"` —
    never the call's markup as text."""
    llm = _chat_openai(env, max_tokens=24).bind_tools([GetWeather], tool_choice="GetWeather")
    whole = llm.invoke(WEATHER_PROMPT)
    for msg in (whole, _joined(list(llm.stream(WEATHER_PROMPT)))):
        assert msg.response_metadata.get("finish_reason") == "length", msg.response_metadata
        assert "tool_call" not in str(msg.content), msg.content
        calls = [*msg.tool_calls, *msg.invalid_tool_calls]
        assert [c["name"] for c in calls] == ["GetWeather"], calls
    call = [*whole.tool_calls, *whole.invalid_tool_calls][0]
    return f"cut call, arguments so far {call['args']!r}"


@case("langchain-openai", "with_structured_output (json_schema)", "langchain_openai")
def langchain_structured_json_schema(env: Env) -> str:
    return check_person(_chat_openai(env).with_structured_output(Person).invoke(PERSON_PROMPT))


@case("langchain-openai", "with_structured_output (function_calling)", "langchain_openai")
def langchain_structured_function_calling(env: Env) -> str:
    llm = _chat_openai(env).with_structured_output(Person, method="function_calling")
    return check_person(llm.invoke(PERSON_PROMPT))


@case("langchain-openai", ".stream", "langchain_openai")
def langchain_stream(env: Env) -> str:
    from langchain_core.messages import AIMessageChunk

    chunks = list(_chat_openai(env, TEXT_MAX_TOKENS).stream("Hello!"))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks), chunks
    msg = _joined(chunks)
    assert isinstance(msg.content, str) and msg.content, f"content {msg.content!r}"
    assert msg.response_metadata.get("finish_reason") in ("stop", "length"), msg.response_metadata
    check_no_usage_chunk(env)
    return f"{len(chunks)} chunks: {msg.content[:40]!r}"


# pydantic-ai ------------------------------------------------------------------------------------------------------


def _pydantic_ai_agent(env: Env, **kw: Any) -> Any:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=env.v1, api_key="unused"))
    return Agent(model, model_settings={"temperature": 0.0, "max_tokens": STRUCTURED_MAX_TOKENS}, **kw)


def _call_the_tool_first() -> Any:
    """A capability under which the first request forces the tool (as `tool_choice` does) and the next one answers
    in text."""
    from pydantic_ai import RunContext
    from pydantic_ai.capabilities import AbstractCapability

    @dataclass
    class CallTheToolFirst(AbstractCapability[Any]):
        def get_model_settings(self) -> Any:
            def settings(ctx: RunContext[Any]) -> Any:
                return {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else "none"}

            return settings

    return CallTheToolFirst()


@case("pydantic-ai", "function tool", "pydantic_ai")
def pydantic_ai_tool(env: Env) -> str:
    from pydantic_ai.messages import ToolCallPart

    calls: list[str] = []

    def get_weather(city: City) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = _pydantic_ai_agent(env, tools=[get_weather], capabilities=[_call_the_tool_first()])
    result = agent.run_sync(WEATHER_PROMPT)
    parts = [p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, ToolCallPart)]
    assert len(calls) == 1 and isinstance(calls[0], str), f"the tool ran with {calls!r}"
    assert [p.tool_name for p in parts] == ["get_weather"], parts
    assert isinstance(result.output, str), result.output
    return f"get_weather({calls[0]!r}), then {result.output[:30]!r}"


@case("pydantic-ai", "output_type (tool output)", "pydantic_ai")
def pydantic_ai_output(env: Env) -> str:
    return check_person(_pydantic_ai_agent(env, output_type=Person).run_sync(PERSON_PROMPT).output)


@case("pydantic-ai", "output_type (NativeOutput)", "pydantic_ai")
def pydantic_ai_native_output(env: Env) -> str:
    from pydantic_ai import NativeOutput

    agent = _pydantic_ai_agent(env, output_type=NativeOutput(Person))
    return check_person(agent.run_sync(PERSON_PROMPT).output)


# llm (the CLI) ----------------------------------------------------------------------------------------------------

LLM_MODELS_YAML = """\
- model_id: tinyloop
  model_name: {model}
  api_base: {api_base}
  supports_schema: true
  supports_tools: true
"""


def _llm(env: Env, *args: str) -> str:
    """`llm prompt` with the server registered in `extra-openai-models.yaml` (a fresh `LLM_USER_PATH`)."""
    user = env.tmp / "llm-user"
    user.mkdir(exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(LLM_MODELS_YAML.format(model=MODEL, api_base=env.v1))
    cmd = [sys.executable, "-m", "llm", "prompt", "-m", "tinyloop", "-o", "temperature", "0", *args]
    out = subprocess.run(
        cmd, env=os.environ | {"LLM_USER_PATH": str(user)}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"llm exited {out.returncode}: {out.stderr.strip()[-500:]}"
    return out.stdout


@case("llm", "plain prompt", "llm")
def llm_plain(env: Env) -> str:
    text = _llm(env, "-o", "max_tokens", str(TEXT_MAX_TOKENS), "Hello!")
    assert text.endswith("\n") and text.strip(), f"stdout {text!r}"
    events = env.streamed("/v1/chat/completions")  # llm asks for usage: it comes last, in a `choices: []` chunk
    deltas = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == deltas + "\n", (text, deltas)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0, events[-1]
    return repr(text.strip()[:40])


@case("llm", "plain prompt, --no-stream", "llm")
def llm_plain_no_stream(env: Env) -> str:
    text = _llm(env, "--no-stream", "-o", "max_tokens", str(TEXT_MAX_TOKENS), "Hello!")
    assert text.strip(), f"stdout {text!r}"
    return repr(text.strip()[:40])


@case("llm", "--schema", "llm")
def llm_schema(env: Env) -> str:
    schema = json.dumps(Person.model_json_schema())
    out = json.loads(_llm(env, "--schema", schema, "-o", "max_tokens", str(STRUCTURED_MAX_TOKENS), PERSON_PROMPT))
    return check_person(Person.model_validate(out))
