"""Structured output on the OpenAI family: `response_format` becomes the engine's `Grammar`, which masks every token
that would leave the document (docs/structured-output.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .._core import Grammar
from ..errors import APIError
from .strict import Strict

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for schema and function names


class JSONSchemaFormat(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Enforced either way: the grammar holds the output to the schema whether or not `strict` asks for it.
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar.json_schema({"type": "object"})
        if self.json_schema is None:
            raise APIError(
                400, "response_format.json_schema is required when type is json_schema", param="response_format"
            )
        schema = self.json_schema.schema_
        return Grammar.json_schema({} if schema is None else schema)
