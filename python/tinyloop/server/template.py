"""The chat template: how a conversation becomes the prompt text.

A model file may carry its own (`tokenizer.chat_template`, Jinja as Hugging Face writes it, e.g. from a converted
checkpoint): it is rendered the way `transformers`' `apply_chat_template` renders it — a sandboxed Jinja
environment with `trim_blocks` and `lstrip_blocks`, `raise_exception`, the conversation as `messages` (OpenAI's
message dicts, calls' arguments parsed), `tools` (OpenAI's function-tool dicts), `add_generation_prompt=True` and
the file's `bos_token` / `eos_token` — and its turns end at the model's end-of-text token. A file without one gets
the "Role: content" template, whose turns end where the model starts a new role line (`DEFAULT_STOP`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import APIError
from .protocol import ChatMessage
from .tools import ToolUse, render_calls

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}
# A raw LM keeps writing the conversation; these end the assistant's turn unless the request gives its own `stop`.
DEFAULT_STOP = ["\nUser:", "\nSystem:", "\nAssistant:", "\nTool:"]


def _raise(message: str) -> None:
    raise TemplateError(message)


class FileTemplate:
    """A file's Jinja chat template, compiled once."""

    def __init__(self, source: str, bos_token: str, eos_token: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[ChatMessage], tools: ToolUse | None) -> str:
        try:
            return self.template.render(
                messages=[_message(m) for m in messages],
                tools=[{"type": "function", "function": f.model_dump(exclude_none=True)} for f in tools.tools]
                if tools
                else None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:  # the template refused this conversation (raise_exception) or failed on it
            raise APIError(400, f"the model's chat template: {e}", param="messages") from e


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(call) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


@lru_cache(maxsize=8)
def file_template(source: str, bos_token: str, eos_token: str) -> FileTemplate:
    return FileTemplate(source, bos_token, eos_token)


class ChatFormat:
    """How one model's conversations are written: its file's template, or the "Role: content" one."""

    def __init__(self, engine) -> None:
        source = engine.chat_template
        eos = engine.token_bytes(engine.eos_token_id).decode("utf-8", "replace")
        # bos_token is the text of the beginning-of-sequence token where the tokenizer adds one (a template writes
        # it first, as Llama's do), else empty: GPT-2's and Qwen2's prompts have none.
        bos = engine.token_bytes(engine.bos_token_id).decode("utf-8", "replace") if engine.add_bos_token else ""
        self.file = file_template(source, bos, eos) if source else None
        # A file's template writes the model's control tokens (end-of-text between turns) as their text, and the
        # prompt is tokenized with them parsed, as `transformers` and llama.cpp do: message text that spells a
        # control token becomes that token too. The "Role: content" template writes none.
        self.special = self.file is not None

    @property
    def stops(self) -> list[str]:
        """The stop strings a request gets unless it names its own: none with a file's template (its turns end at
        end-of-text)."""
        return [] if self.file else DEFAULT_STOP

    def render(self, messages: list[ChatMessage], tools: ToolUse | None = None) -> str:
        if self.file is not None:
            return self.file.render(messages, tools)
        return render_chat(messages, tools)


def render_chat(messages: list[ChatMessage], tools: ToolUse | None = None) -> str:
    """The "Role: content" template: the tools' system line if any, one line per message (an assistant's calls
    after its text), then the opened assistant turn."""
    lines = [f"System: {tools.preamble()}\n"] if tools else []
    for m in messages:
        calls = render_calls(m.tool_calls) if m.tool_calls else ""
        lines.append(f"{ROLE_NAMES[m.role]}: {m.text()}{calls}\n")
    return "".join(lines) + "Assistant:"
