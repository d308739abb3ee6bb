"""Structured output over HTTP: `response_format` (chat, completions), `text.format` (Responses) and
`output_config.format` (Messages) become the engine's `Grammar`, which masks every token that would leave the document
(docs/structured-output.md). Every schema the server compiles — those and tool parameters — is `closed` first."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .._core import Grammar
from .errors import APIError
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

    def document_schema(self) -> dict[str, Any] | None:
        """The schema the output must match; None for plain text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            raise APIError(
                400, "response_format.json_schema is required when type is json_schema", param="response_format"
            )
        return self.json_schema.schema_ or {}


def schema_grammar(schema: dict[str, Any] | None) -> Grammar | None:
    """A structured output's grammar: its schema, closed."""
    return None if schema is None else Grammar.json_schema(closed(schema))


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")  # `items` as a list: the older tuple form
SCHEMA_VALUES = (
    *("items", "additionalItems", "additionalProperties", "unevaluatedProperties"),
    *("not", "if", "then", "else"),
)


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """`schema` with every object schema that lists `properties` and says nothing of `additionalProperties` closed
    (`additionalProperties: false`), at every depth — what llama.cpp's schema-to-grammar and xgrammar's strict mode
    (vLLM, SGLang) do. A client that leaves it out (langchain's `@tool`, instructor, `llm --schema`) means the keys it
    listed, and a model offered free keys adds them until `max_tokens`. A schema that says `true` keeps its free keys;
    `{"type": "object"}` without `properties` stays any object; a branch of `allOf` (whose properties add up) and a
    schema with an `allOf` are left open. Values (`enum`, `const`, `default`, ...) are not schemas and stay as
    they are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, in_all_of=True) for sub in out["allOf"]]
    opens = ("additionalProperties", "unevaluatedProperties", "allOf")
    if "properties" in out and not in_all_of and not any(k in out for k in opens):
        out["additionalProperties"] = False
    return out
