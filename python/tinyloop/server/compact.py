"""`POST /v1/responses/compact`: a conversation in, a compacted input window out, which the next `/v1/responses`
request takes as its `input`.

The window keeps the latest items verbatim — as many as fit in three quarters of `max_input_tokens` (default: half
the model's context, leaving the other half to the reply; the latest item is kept even if it needs the whole
budget) — and replaces everything before them with one `developer` message in the rest of the budget:
a digest written without the model, one line per dropped item (who said what, which function was called with which
arguments, what it returned), each cut to `DIGEST_LINE` characters, the oldest lines dropped first when even the
digest does not fit. A function call's output is never kept without its call. The window's rendered prompt never
exceeds the budget; if the latest item alone does, the request is refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter

from .errors import APIError
from .responses import FunctionCallItem, FunctionCallOutputItem, FunctionTool, MessageItem, ResponsesRequest
from .state import State
from .strict import Strict
from .template import ChatFormat

router = APIRouter()

DIGEST_LINE = 80  # characters of a dropped item kept in the digest


class CompactRequest(Strict):
    model: str
    input: str | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None  # counted: the next request's prompt lists them
    max_input_tokens: int | None = None  # tinyloop's: the window's budget

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)


def _line(item: MessageItem | FunctionCallItem | FunctionCallOutputItem) -> str:
    if isinstance(item, MessageItem):
        text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
        line = f"{item.role}: {text}"
    elif isinstance(item, FunctionCallItem):
        line = f"assistant called {item.name}({item.arguments})"
    else:
        line = f"a function returned: {item.output}"
    line = " ".join(line.split())
    return line if len(line) <= DIGEST_LINE else line[: DIGEST_LINE - 1] + "…"


def _digest(lines: list[str]) -> MessageItem:
    text = "Summary of the earlier conversation, oldest first:\n" + "\n".join(lines)
    return MessageItem(role="developer", content=text)


class Window:
    """Measures candidate windows in tokens: the prompt `/v1/responses` would prefill for them."""

    def __init__(self, engine, req: CompactRequest):
        self.engine, self.req = engine, req

    def tokens(self, items: list[Any]) -> int:
        if not items:
            items = [MessageItem(role="user", content="")]
        r = ResponsesRequest(
            model=self.req.model, input=items, instructions=self.req.instructions, tools=self.req.tools
        )
        chat = ChatFormat(self.engine)
        text = chat.render(r.conversation(), r.tool_use())
        return len(self.engine.encode(text, allow_special=chat.special, add_special=not chat.special))

    @staticmethod
    def _back(items: list[Any], i: int) -> int:
        """`i`, or the nearest item before it that is not a call's output."""
        while i > 0 and isinstance(items[i], FunctionCallOutputItem):
            i -= 1
        return i

    def compact(self, budget: int) -> list[Any]:
        items = self.req.items()
        if self.tokens(items) <= budget:
            return items
        # The longest suffix that fits and does not begin with a call's output (which stays with its call).
        start = self._back(items, len(items) - 1)
        if self.tokens(items[start:]) > budget:
            raise APIError(400, f"the latest turn alone is over max_input_tokens ({budget})", param="max_input_tokens")
        keep = budget * 3 // 4  # the rest is the digest's
        while start > 0 and self.tokens(items[self._back(items, start - 1) :]) <= keep:
            start = self._back(items, start - 1)
        lines = [_line(item) for item in items[:start]]
        while lines and self.tokens([_digest(lines), *items[start:]]) > budget:
            lines.pop(0)
        return ([_digest(lines)] if lines else []) + items[start:]


@router.post("/v1/responses/compact")
async def compact(req: CompactRequest, state: State):
    engine, _ = state.require_engine()
    budget = req.max_input_tokens or engine.info.max_seq_len // 2
    if not 1 <= budget <= engine.info.max_seq_len:
        raise APIError(
            400, f"max_input_tokens must be between 1 and {engine.info.max_seq_len}", param="max_input_tokens"
        )
    ResponsesRequest(model=req.model, input=req.input, tools=req.tools).tool_use()  # the tools' own checks
    window = Window(engine, req)
    loop = asyncio.get_running_loop()
    before, output = await loop.run_in_executor(
        state.tokenizer_pool, lambda: (window.tokens(req.items()), window.compact(budget))
    )
    after = await loop.run_in_executor(state.tokenizer_pool, window.tokens, output)
    return {
        "id": f"cmp_{uuid.uuid4().hex[:24]}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [item.model_dump(by_alias=True, exclude_unset=True) for item in output],  # as given
        "usage": {"input_tokens": before, "output_tokens": after},
    }
