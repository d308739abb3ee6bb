"""The base of every request schema, and the range check every family uses.

Types are strict: `"8"` or `8.0` is not an integer, `1` is not a boolean, and `NaN` / `Infinity` are not numbers
(a failure is 422). A field no schema declares is refused by name (400, `app.py`): nothing is accepted and
silently ignored, except the fields the schemas declare as ignored and docs/api.md lists with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError


def ranged(default: Any, lo: float, hi: float) -> Any:
    """A numeric field with its range: shown in `/openapi.json` (minimum, maximum) and checked by `check_ranges`
    (400 naming the field, where a schema violation would be 422)."""
    return Field(default, json_schema_extra={"minimum": lo, "maximum": hi})


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # The field a server default (`--generate-config`, `defaults.py`) sets, where this schema names it otherwise.
    DEFAULT_ALIASES: ClassVar[dict[str, str]] = {}

    def with_defaults(self, defaults: Mapping[str, Any]) -> None:
        """Take the server's defaults for the fields this request did not send (a field sent as null counts as not
        sent). A default this schema has no field for, or outside the field's range here, is not applied."""
        fields = type(self).model_fields
        for key, value in defaults.items():
            name = self.DEFAULT_ALIASES.get(key, key)
            if name not in fields or name in self.model_fields_set:
                continue
            extra = fields[name].json_schema_extra
            ranged_field = isinstance(extra, dict) and "minimum" in extra and not isinstance(value, str)
            if ranged_field and not extra["minimum"] <= value <= extra["maximum"]:  # type: ignore[index]
                continue
            setattr(self, name, value)

    def check_ranges(self) -> None:
        """Every `ranged` field within its range."""
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and "minimum" in extra:
                check_range(name, getattr(self, name), extra["minimum"], extra["maximum"])  # type: ignore[arg-type]


def check_range(name: str, value: float | int | str | None, lo: float, hi: float) -> None:
    """400 naming `name` unless `value` is None, a word (`loops: "auto"`) or within [lo, hi]."""
    if value is not None and not isinstance(value, str) and not lo <= value <= hi:
        raise APIError(400, f"{name} must be between {lo} and {hi}, got {value}", param=name)
