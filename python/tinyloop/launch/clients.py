"""What each coding client needs in order to use a tinyloop server, as planned file changes plus the command line
that starts the client.

Codex and Qwen Code get a configuration home of their own (`~/.codex-tinyloop`, `~/.qwen-tinyloop`), chosen with an
environment variable when the client starts, so the user's everyday configuration is never edited. Claude Code is
configured by environment variables alone, written to a file to `source`. Zed and OpenCode have no such switch, so
a `tinyloop` provider is merged into their settings file, keeping every other key and every comment (merge.py).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import files, merge
from .errors import LaunchError
from .jsonc import JsoncError

CLIENTS = {
    "server": "the server alone",
    "codex": "Codex",
    "claude-code": "Claude Code",
    "opencode": "OpenCode",
    "zed": "Zed",
    "qwen-code": "Qwen Code",
}
PROVIDER = "tinyloop"  # the provider's name in every client; Zed derives its key variable from it
KEY_VARIABLE = "TINYLOOP_API_KEY"  # the server's own key variable, so one export serves server and clients
CLIENT_TIMEOUT_MS = 86_400_000  # a day: a slow local generation is never cut off by the client


@dataclass(frozen=True)
class Target:
    """The server a client is pointed at."""

    model_id: str
    origin: str  # http://127.0.0.1:8000, without /v1: Anthropic clients append /v1/messages themselves
    api_key: str  # sent by every client; the server checks it only when it has keys
    key_required: bool
    context: int  # the model's context length, for clients that budget their prompts

    @property
    def base_url(self) -> str:
        return self.origin + "/v1"


@dataclass
class Setup:
    changes: list[files.FileChange]
    run: list[str] = field(default_factory=list)  # how to start the client once the files are written
    notes: list[str] = field(default_factory=list)  # what else the user has to know


def config_home() -> Path:
    """$XDG_CONFIG_HOME when it is set to an absolute path (as the XDG spec asks), else ~/.config."""
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    return Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"


def setup(client: str, target: Target) -> Setup:
    """The files `client` needs for `target` (nothing is written here). Raises LaunchError for a settings file that
    cannot be parsed."""
    planners: dict[str, Callable[[Target], Setup]] = {
        "server": lambda t: Setup([]),
        "codex": codex,
        "claude-code": claude_code,
        "opencode": opencode,
        "zed": zed,
        "qwen-code": qwen_code,
    }
    return planners[client](target)


def _jsonc_edit(path: Path, members: list[tuple[list[str], Any]], new_file: str = "{}\n") -> files.FileChange:
    """Merge `members` (path in the object tree, value) into the JSONC file at `path`."""

    def edit(old: str | None) -> str:
        text = new_file if old is None else old
        try:
            for keys, value in members:
                text = merge.set_path(text, keys, value)
        except JsoncError as e:
            raise LaunchError(f"{path}: cannot be read as JSON with comments ({e}); left untouched") from None
        return text

    return files.plan(path, edit)


def codex(t: Target) -> Setup:
    home = Path.home() / ".codex-tinyloop"
    lines = [
        "# Codex -> tinyloop, written by `tinyloop launch`. Used when Codex runs with CODEX_HOME set to this folder.",
        f"model = {json.dumps(t.model_id, ensure_ascii=False)}",
        f'model_provider = "{PROVIDER}"',
        "",
        f"[model_providers.{PROVIDER}]",
        f'name = "{PROVIDER}"',
        f"base_url = {json.dumps(t.base_url)}",
        'wire_api = "responses"',
    ]
    if t.key_required:  # without env_key Codex sends no key, which a server without keys wants
        lines.append(f'env_key = "{KEY_VARIABLE}"')
    change = files.plan(home / "config.toml", lambda old: "\n".join(lines) + "\n")
    key = f"{KEY_VARIABLE}={shlex.quote(t.api_key)} " if t.key_required else ""
    return Setup([change], [f"{key}CODEX_HOME={shlex.quote(str(home))} codex"])


def claude_code(t: Target) -> Setup:
    path = config_home() / "tinyloop" / "claude-code.env"
    env = {"ANTHROPIC_BASE_URL": t.origin, "ANTHROPIC_API_KEY": t.api_key}
    for name in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL"):
        env[f"ANTHROPIC_{name}"] = t.model_id
    env["CLAUDE_CODE_SUBAGENT_MODEL"] = t.model_id
    text = f"# Claude Code -> tinyloop, written by `tinyloop launch`. Use: source {shlex.quote(str(path))}\n"
    text += "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    change = files.plan(path, lambda old: text, private=True)
    note = "Claude Code asks once whether to use ANTHROPIC_API_KEY: answer yes (the key goes to this server only)."
    return Setup([change], [f"source {shlex.quote(str(path))} && claude"], [note])


def opencode(t: Target) -> Setup:
    folder = config_home() / "opencode"
    path = folder / "opencode.jsonc"
    if not path.exists() and (folder / "opencode.json").exists():
        path = folder / "opencode.json"
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": PROVIDER,
        "options": {"baseURL": t.base_url, "apiKey": t.api_key, "timeout": False},
        "models": {t.model_id: {"name": f"{t.model_id} (tinyloop)"}},
    }
    new_file = '{\n  "$schema": "https://opencode.ai/config.json"\n}\n'
    change = _jsonc_edit(path, [(["provider", PROVIDER], provider)], new_file)
    return Setup([change], [f"opencode --model {shlex.quote(f'{PROVIDER}/{t.model_id}')}"])


def zed(t: Target) -> Setup:
    path = config_home() / "zed" / "settings.json"
    provider = {
        "api_url": t.base_url,
        "available_models": [{"name": t.model_id, "display_name": f"{t.model_id} (tinyloop)", "max_tokens": t.context}],
    }
    change = _jsonc_edit(path, [(["language_models", "openai_compatible", PROVIDER], provider)])
    notes = [
        f"Zed wants a key for the provider: it reads {KEY_VARIABLE} (started as above), or enter "
        f"{t.api_key!r} under Agent Settings > LLM Providers > {PROVIDER}.",
        f"Then pick {t.model_id} ({PROVIDER}) in the agent panel's model menu.",
    ]
    return Setup([change], [f"{KEY_VARIABLE}={shlex.quote(t.api_key)} zed"], notes)


def qwen_code(t: Target) -> Setup:
    home = Path.home() / ".qwen-tinyloop"
    model = {
        "id": t.model_id,
        "name": f"{t.model_id} (tinyloop)",
        "baseUrl": t.base_url,
        "envKey": KEY_VARIABLE,
        "generationConfig": {"timeout": CLIENT_TIMEOUT_MS, "streamIdleTimeoutMs": 0, "contextWindowSize": t.context},
    }
    members: list[tuple[list[str], Any]] = [
        (["env", KEY_VARIABLE], t.api_key),
        (["env", "QWEN_STREAM_IDLE_TIMEOUT_MS"], "0"),
        (["env", "QWEN_STREAM_MAX_LIFETIME_MS"], "0"),
        (["modelProviders", "openai"], [model]),
        (["security", "auth", "selectedType"], "openai"),
        (["model", "name"], t.model_id),
    ]
    change = _jsonc_edit(home / "settings.json", members)
    return Setup([change], [f"QWEN_HOME={shlex.quote(str(home))} qwen"])
