"""The server's settings, each declared once: a `ServerConfig` field made with `setting()` holds its default, its
parser (type and range), its help, its flag and its environment variable. `cli.py` builds the argument parser and
`--help`'s table of variables from these declarations, and `ServerConfig.load` reads flags over the environment
through the same parsers, so a bad value is refused alike from either side, naming both."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .protocol import MAX_TOKENS_LIMIT

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default.tinyloop"
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 4 MiB JSON body holds a prompt of ~500k token ids: past any context length
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds of wall time one request may take, queueing included
KV_CACHE_MODES = ("fp16", "int8", "int4", "int4-h")
KV_SHARE_MODES = ("none", "last")
LOG_LEVELS = ("debug", "info", "warning", "error")
ISA_LEVELS = ("avx512", "avx2", "neon", "scalar")
DEFAULT_PROMPT_CACHE_MIB = 256  # finished conversations' KV kept in memory for the next turn (prefix reuse)
DEFAULT_PROMPT_CACHE_ENTRIES = 4
DEFAULT_PROMPT_CACHE_DISK_MIB = 1024
SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value cannot be used; the message names its flag and its variable."""


@dataclass(frozen=True)
class Parser:
    """Text to a setting's value: `convert`, then `ok`; else ValueError saying what was expected."""

    convert: Callable[[str], Any]
    what: str
    ok: Callable[[Any], bool] = lambda _: True
    metavar: str | None = None  # how --help shows the value

    def __call__(self, text: str) -> Any:
        try:
            value = self.convert(text)
        except ValueError:
            value = None
        if value is None or not self.ok(value):
            raise ValueError(f"expected {self.what}, got {text!r}")
        return value


def whole(lo: int, hi: int | None = None) -> Parser:
    return Parser(
        int,
        f"a whole number >= {lo}" if hi is None else f"a whole number {lo}-{hi}",
        lambda n: lo <= n and (hi is None or n <= hi),
        "N",
    )


def seconds(what: str = "a number of seconds >= 0") -> Parser:
    return Parser(float, what, lambda s: 0 <= s < math.inf, "SECONDS")


def choice(values: tuple[str, ...]) -> Parser:
    return Parser(str, "one of " + ", ".join(values), lambda v: v in values, "{" + ",".join(values) + "}")


TEXT = Parser(str, "text")
PATH = Parser(Path, "a path")
SWITCH = Parser(
    lambda t: {**dict.fromkeys(SWITCH_ON, True), **dict.fromkeys(SWITCH_OFF, False)}.get(t.lower()),
    "1 or 0 (true/false, yes/no, on/off)",
)
KEYS = Parser(lambda t: tuple(k.strip() for k in t.split(",") if k.strip()), "keys separated by commas")


@dataclass(frozen=True)
class Setting:
    """One setting's declaration (the metadata of its `ServerConfig` field)."""

    parse: Parser
    help: str
    default_text: str  # the default as `--help` says it
    flag: str
    env: str
    metavar: str | None = None
    switch: bool = False  # a flag without a value; its variable takes 1/0
    repeated: bool = False  # a flag that may be given several times (its values joined by commas)

    def read(self, text: str) -> Any:
        try:
            return self.parse(text)
        except ValueError as e:
            raise SettingError(f"{self.flag} / {self.env}: {e}") from None


def setting(
    default: Any,
    parse: Parser,
    help: str,
    *,
    default_text: str | None = None,
    flag: str = "",
    env: str = "",
    metavar: str | None = None,
    repeated: bool = False,
) -> Any:
    """A `ServerConfig` field and its declaration. The flag is the field's name (`--max-running`) and the variable
    TINYLOOP_ and its name, unless given."""
    shown = default_text or ("none" if default is None else "off" if default is False else str(default))
    meta = {
        "parse": parse,
        "help": help,
        "default_text": shown,
        "flag": flag,
        "env": env,
        "metavar": metavar or parse.metavar,
        "switch": parse is SWITCH,
        "repeated": repeated,
    }
    return field(default=default, metadata={"setting": meta})


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", TEXT, "address to bind", default_text="127.0.0.1 (this machine only)")
    port: int = setting(8000, whole(0, 65535), "port to listen on")
    model_path: Path = setting(
        DEFAULT_MODEL,
        PATH,
        "model file",
        default_text="the embedded default model",
        flag="--model",
        env="TINYLOOP_MODEL_PATH",
        metavar="FILE",
    )
    max_seq_len: int | None = setting(
        None, whole(1), "longest prompt + output, in tokens", default_text="the model's context length"
    )
    served_model_name: str | None = setting(
        None, TEXT, "the id /v1/models reports", default_text="the model file's name without .tinyloop"
    )
    api_key: tuple[str, ...] = setting(
        (),
        KEYS,
        "an API key (repeat the flag, or commas in the variable): every "
        "route but /health then needs 'Authorization: Bearer <key>' or 'x-api-key'",
        default_text="no key: no authentication",
        repeated=True,
    )
    api_key_file: Path | None = setting(
        None, PATH, "a file of API keys, one per line (# comments), added to --api-key's", metavar="FILE"
    )
    max_running: int = setting(16, whole(1), "requests generated at once, batched step by step; more wait")
    max_waiting: int = setting(256, whole(0), "requests that may wait; past them the server answers 503 + Retry-After")
    kv_cache: str | None = setting(None, choice(KV_CACHE_MODES), "KV-cache mode", default_text="fp16")
    kv_int8: bool = setting(False, SWITCH, "the older switch for --kv-cache int8")
    kv_int4: bool = setting(False, SWITCH, "the older switch for --kv-cache int4 (with --kv-h-mode: int4-h)")
    kv_h_mode: bool = setting(False, SWITCH, "the older switch that makes --kv-int4 int4-h")
    kv_share: str = setting(
        "none",
        choice(KV_SHARE_MODES),
        "last: after the prompt, the loops share the last "
        "loop's KV (1/loops of the memory; no speculative decoding, no prompt reuse)",
    )
    device: str = setting(
        "cpu",
        TEXT,
        "where the model computes: cpu, cuda or cuda:N (the CUDA build), candle-cpu (the GPU's code path on the host)",
    )
    generate_config: Path | None = setting(
        None, PATH, "a JSON file of defaults for the sampling fields and loops a request leaves out", metavar="FILE"
    )
    models_dir: Path | None = setting(
        None, PATH, "serve every .tinyloop under DIR by its file name, one loaded at a time, on demand", metavar="DIR"
    )
    lazy_load: bool = setting(False, SWITCH, "load the model on the first request that needs it")
    idle_unload_seconds: float = setting(
        0.0,
        seconds(),
        "unload the model after this many seconds without a request (implies --lazy-load)",
        default_text="0: never",
    )
    no_prompt_cache: bool = setting(
        False, SWITCH, "do not reuse earlier requests' KV for prompts that start the same way"
    )
    prompt_cache_mib: int = setting(DEFAULT_PROMPT_CACHE_MIB, whole(1), "memory bound of the prompt cache, MiB")
    prompt_cache_entries: int = setting(DEFAULT_PROMPT_CACHE_ENTRIES, whole(1), "prefixes the prompt cache keeps")
    prompt_cache_disk: Path | None = setting(
        None,
        PATH,
        "a private directory that keeps prompt prefixes across restarts and unloads (its files hold conversations' KV)",
        metavar="DIR",
    )
    prompt_cache_disk_mib: int = setting(DEFAULT_PROMPT_CACHE_DISK_MIB, whole(1), "bound of --prompt-cache-disk, MiB")
    profile_dir: Path | None = setting(
        None, PATH, "enable POST /start_profile and /stop_profile, writing to DIR", flag="--profile", metavar="DIR"
    )
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, whole(1), "largest request body; larger ones get 413", default_text="4 MiB"
    )
    max_tokens_limit: int = setting(MAX_TOKENS_LIMIT, whole(1), "ceiling of a request's max_tokens")
    request_timeout: float = setting(
        DEFAULT_REQUEST_TIMEOUT,
        seconds(),
        'seconds of wall time a request may take, queueing included; past it, finish_reason "aborted" (0: no limit)',
    )
    always_include_usage: bool = setting(
        False,
        SWITCH,
        "end every /v1 and /api/v0 stream with a usage chunk "
        "(choices: []), as if each request asked for stream_options.include_usage",
    )
    threads: int | None = setting(
        None,
        whole(1),
        "compute threads (sets RAYON_NUM_THREADS); fewer than the cores "
        "keeps decode steady when other processes compete",
        default_text="one per core",
    )
    isa: str | None = setting(
        None, choice(ISA_LEVELS), "the engine's kernels at most at this level", default_text="the best the CPU has"
    )
    log_level: str = setting("info", choice(LOG_LEVELS), "log level")
    commit: str | None = setting(
        None, TEXT, "runtime.commit in /api/v0 responses", default_text="the commit built from"
    )
    ray: bool = setting(
        False,
        SWITCH,
        "serve as a Ray Serve application: replicas behind Ray's HTTP proxy (tinyloop[ray]; docs/scale-out.md)",
    )
    replicas: int = setting(1, whole(1), "with --ray: engines, one per replica")
    replica_cpus: float = setting(
        1.0,
        Parser(float, "a number of CPUs > 0", lambda c: 0 < c < math.inf),
        "with --ray: CPUs Ray reserves for each replica",
    )
    ray_address: str | None = setting(
        None, TEXT, "with --ray: an existing cluster's address", default_text="a new local cluster"
    )

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
        """The settings from `flags` (a field's name: its text, True for a given switch, a list for a repeated flag;
        None where not given) over the environment's variables; raises `SettingError` naming the flag and variable of
        a bad value, or of settings that do not go together."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for name, s in declared():
            given = (flags or {}).get(name)
            if isinstance(given, list):
                given = ",".join(given)
            if given is True:
                values[name] = True
            elif given not in (None, ""):
                values[name] = s.read(given)
            elif env.get(s.env, "").strip():
                values[name] = s.read(env[s.env].strip())
        cfg = cls(**values)
        cfg.check()
        return cfg

    @classmethod
    def from_env(cls) -> ServerConfig:
        return cls.load()

    def check(self) -> None:
        """The settings that do not go together."""
        error = self.kv_mode_error()
        if error is not None:
            raise SettingError(error)
        if not self.ray and (self.replicas != 1 or self.ray_address is not None):
            raise SettingError("--replicas and --ray-address apply only with --ray")
        if self.models_dir is not None and self.served_model_name:
            raise SettingError(
                "--served-model-name names the one model; with --models-dir each model is named by its file"
            )

    def keys(self) -> tuple[str, ...]:
        """Every API key: --api-key's and the file's (an unreadable file raises OSError)."""
        return api_keys(",".join(self.api_key), str(self.api_key_file) if self.api_key_file else None)

    def engine_options(self) -> dict:
        """The `Engine` keywords these settings give (KV mode, sequence limit, prompt cache)."""
        on = not self.no_prompt_cache
        return {
            "max_seq_len": self.max_seq_len,
            "kv_cache_mode": self.kv_cache_mode(),
            "kv_share": self.kv_share,
            "device": self.device,
            "prompt_cache_mib": self.prompt_cache_mib if on else 0,
            "prompt_cache_entries": self.prompt_cache_entries if on else 0,
            "prompt_cache_disk": str(self.prompt_cache_disk) if on and self.prompt_cache_disk else None,
            "prompt_cache_disk_mib": self.prompt_cache_disk_mib,
        }

    def dynamic_residency(self) -> bool:
        """Whether the model is loaded on demand (and may be unloaded) rather than at start-up for good."""
        return self.lazy_load or self.idle_unload_seconds > 0 or self.models_dir is not None

    def kv_cache_mode(self) -> str:
        """The KV-cache mode (docs/api.md): `kv_cache` when set; else INT4 (+ H_MODE) is int4 (int4-h), INT8 is int8,
        nothing set is fp16."""
        if self.kv_cache is not None:
            return self.kv_cache
        if self.kv_int4:
            return "int4-h" if self.kv_h_mode else "int4"
        return "int8" if self.kv_int8 else "fp16"

    def kv_mode_error(self) -> str | None:
        if self.kv_cache is not None and (self.kv_int4 or self.kv_int8 or self.kv_h_mode):
            return (
                "--kv-cache (TINYLOOP_KV_CACHE) and the older --kv-int8 / --kv-int4 / --kv-h-mode (TINYLOOP_KV_INT8 / "
                "_INT4 / _H_MODE) are both set; use --kv-cache alone"
            )
        if self.kv_h_mode and not self.kv_int4:
            return (
                "--kv-h-mode (TINYLOOP_KV_H_MODE) needs --kv-int4 (TINYLOOP_KV_INT4): the Hadamard mode rotates the "
                "int4 cache"
            )
        if self.kv_int4 and self.kv_int8:
            return (
                "--kv-int4 (TINYLOOP_KV_INT4) and --kv-int8 (TINYLOOP_KV_INT8) are both set; choose one KV-cache mode"
            )
        return None

    def build_commit(self) -> str | None:
        """`commit`, else the git commit the extension was built from (build.rs), if it was built in a checkout."""
        if self.commit:
            return self.commit
        from .. import _core

        return getattr(_core, "__commit__", "") or None


def declared() -> Iterator[tuple[str, Setting]]:
    """Every setting, in `--help`'s order: its field's name and its declaration."""
    for f in dataclasses.fields(ServerConfig):
        meta = dict(f.metadata["setting"])
        meta["flag"] = meta["flag"] or "--" + f.name.replace("_", "-")
        meta["env"] = meta["env"] or "TINYLOOP_" + f.name.upper()
        yield f.name, Setting(**meta)


def api_keys(listed: str | None, file: str | None) -> tuple[str, ...]:
    """Keys from a comma-separated list and from a file of one key per line (blank lines and `#` comments
    skipped). An unreadable file is an error: a server told to require keys must never start open."""
    keys = [k.strip() for k in (listed or "").split(",")]
    if file:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(k for k in keys if k)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
