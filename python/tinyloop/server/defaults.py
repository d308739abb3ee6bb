"""Server-side generation defaults: `tinyloop-serve --generate-config FILE` (or `TINYLOOP_GENERATE_CONFIG`), a JSON
object of sampling fields and `loops`. A request's own value for a field wins; a field it leaves out (or sends as
null) takes the server's default; `"stop": []` in a request clears a default `stop`.

Every API family takes the defaults under its own field names (`Strict.with_defaults`): Anthropic's `stop` is
`stop_sequences`, the Responses API's `max_tokens` is `max_output_tokens`, the native `seed` is `sample_seed`. The
sampling fields a family has no field for (Responses' `top_k`, Messages' `frequency_penalty`, chat's
`repetition_penalty`) apply all the same (`sampling.Sampling.of`); a family
whose range excludes the value (Anthropic's temperature is 0-1) keeps its own default for it.

The file is checked when the server starts: an unknown key, a wrong type or a value out of range is an error that
names it, and the server does not start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from .._core import MAX_LOOPS, MAX_TOP_K
from .errors import APIError
from .protocol import MAX_TOKENS_LIMIT, SEED_MAX
from .strict import Strict, ranged


class GenerateDefaults(Strict):
    temperature: float | None = ranged(None, 0.0, 2.0)
    top_p: float | None = ranged(None, 0.0, 1.0)
    top_k: int | None = ranged(None, 0, MAX_TOP_K)
    seed: int | None = ranged(None, 0, SEED_MAX)
    max_tokens: int | None = ranged(None, 1, MAX_TOKENS_LIMIT)
    stop: list[str] | None = None
    presence_penalty: float | None = ranged(None, -2.0, 2.0)
    frequency_penalty: float | None = ranged(None, -2.0, 2.0)
    repetition_penalty: float | None = ranged(None, 0.5, 2.0)
    loops: int | Literal["auto"] | None = ranged(None, 1, MAX_LOOPS)


class ConfigError(Exception):
    """The generation config cannot be used (the message names the file and the field)."""


def load_defaults(path: str | Path | None) -> dict[str, Any]:
    """The defaults the file sets (only the keys it gives); {} without a file."""
    if not path:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
        parsed = GenerateDefaults.model_validate(json.loads(text))
        parsed.check_ranges()
        if parsed.stop is not None and len(parsed.stop) > 8:
            raise ConfigError(f"{path}: stop may hold at most 8 strings")
    except OSError as e:
        raise ConfigError(f"cannot read the generation config {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not JSON: {e}") from e
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the document"
        if first["type"] == "extra_forbidden":
            known = ", ".join(GenerateDefaults.model_fields)
            raise ConfigError(f"{path}: {where} is not a generation default (the file may set {known})") from e
        raise ConfigError(f"{path}: {where}: {first['msg']}") from e
    except APIError as e:
        raise ConfigError(f"{path}: {e.message}") from e
    return parsed.model_dump(exclude_unset=True, exclude_none=True)
