"""Server configuration: flags of `tinyloop-serve`, each with an environment variable (flags win)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .protocol import MAX_TOKENS_LIMIT

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default.tinyloop"
DEFAULT_MAX_BODY_BYTES = 4 << 20  # a 4 MiB JSON body holds a prompt of ~500k token ids: past any context length
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds of wall time one request may take, queueing included
KV_CACHE_MODES = ("fp16", "int8", "int4", "int4-h")
KV_SHARE_MODES = ("none", "last")
DEFAULT_PROMPT_CACHE_MIB = 256  # finished conversations' KV kept in memory for the next turn (prefix reuse)
DEFAULT_PROMPT_CACHE_ENTRIES = 4
DEFAULT_PROMPT_CACHE_DISK_MIB = 1024


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class ServerConfig:
    model_path: Path = DEFAULT_MODEL
    max_seq_len: int | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_running: int = 16
    max_waiting: int = 256
    kv_cache: str | None = None  # --kv-cache / TINYLOOP_KV_CACHE; else the older INT8 / INT4 / H_MODE switches
    kv_int8: bool = False
    kv_int4: bool = False
    kv_h_mode: bool = False
    commit: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    generate_config: str | None = None  # a JSON file of generation defaults (defaults.py)
    profile_dir: str | None = None  # where /stop_profile writes (profiling.py); None: no profiling routes
    models_dir: str | None = None  # serve every .tinyloop under it, one resident at a time (residency.py)
    lazy_load: bool = False  # load the model on the first request that needs it (residency.py)
    idle_unload_seconds: float = 0.0  # unload it after this long without a request (0: never); implies lazy_load
    kv_share: str = "none"  # "last": after the prompt, loops share the last loop's KV (prompt reuse is then off)
    device: str = "cpu"  # where the model computes: "cpu", "cuda", "cuda:N" (the CUDA build), "candle-cpu"
    always_include_usage: bool = False  # end every stream with a usage chunk, asked for or not
    prompt_cache: bool = True  # reuse finished sequences' KV for prompts that start the same way (prefix reuse)
    prompt_cache_mib: int = DEFAULT_PROMPT_CACHE_MIB
    prompt_cache_entries: int = DEFAULT_PROMPT_CACHE_ENTRIES
    prompt_cache_disk: str | None = None  # a directory that keeps prefixes across restarts and unloads
    prompt_cache_disk_mib: int = DEFAULT_PROMPT_CACHE_DISK_MIB

    @classmethod
    def from_env(cls) -> ServerConfig:
        env = os.environ
        seq = env.get("TINYLOOP_MAX_SEQ_LEN")
        return cls(
            model_path=Path(env.get("TINYLOOP_MODEL_PATH") or DEFAULT_MODEL),
            max_seq_len=int(seq) if seq else None,
            served_model_name=env.get("TINYLOOP_SERVED_MODEL_NAME") or None,
            api_keys=api_keys(env.get("TINYLOOP_API_KEY"), env.get("TINYLOOP_API_KEY_FILE")),
            max_running=int(env.get("TINYLOOP_MAX_RUNNING") or 16),
            max_waiting=int(env.get("TINYLOOP_MAX_WAITING") or 256),
            kv_cache=env.get("TINYLOOP_KV_CACHE") or None,
            kv_int8=_flag("TINYLOOP_KV_INT8"),
            kv_int4=_flag("TINYLOOP_KV_INT4"),
            kv_h_mode=_flag("TINYLOOP_KV_H_MODE"),
            commit=env.get("TINYLOOP_COMMIT") or _baked_commit(),
            max_body_bytes=int(env.get("TINYLOOP_MAX_BODY_BYTES") or DEFAULT_MAX_BODY_BYTES),
            max_tokens_limit=int(env.get("TINYLOOP_MAX_TOKENS_LIMIT") or MAX_TOKENS_LIMIT),
            request_timeout=float(env.get("TINYLOOP_REQUEST_TIMEOUT") or DEFAULT_REQUEST_TIMEOUT),
            generate_config=env.get("TINYLOOP_GENERATE_CONFIG") or None,
            profile_dir=env.get("TINYLOOP_PROFILE_DIR") or None,
            models_dir=env.get("TINYLOOP_MODELS_DIR") or None,
            lazy_load=_flag("TINYLOOP_LAZY_LOAD"),
            idle_unload_seconds=float(env.get("TINYLOOP_IDLE_UNLOAD_SECONDS") or 0.0),
            kv_share=env.get("TINYLOOP_KV_SHARE") or "none",
            device=env.get("TINYLOOP_DEVICE") or "cpu",
            always_include_usage=_flag("TINYLOOP_ALWAYS_INCLUDE_USAGE"),
            prompt_cache=not _flag("TINYLOOP_NO_PROMPT_CACHE"),
            prompt_cache_mib=int(env.get("TINYLOOP_PROMPT_CACHE_MIB") or DEFAULT_PROMPT_CACHE_MIB),
            prompt_cache_entries=int(env.get("TINYLOOP_PROMPT_CACHE_ENTRIES") or DEFAULT_PROMPT_CACHE_ENTRIES),
            prompt_cache_disk=env.get("TINYLOOP_PROMPT_CACHE_DISK") or None,
            prompt_cache_disk_mib=int(env.get("TINYLOOP_PROMPT_CACHE_DISK_MIB") or DEFAULT_PROMPT_CACHE_DISK_MIB),
        )

    def engine_options(self) -> dict:
        """The `Engine` keywords these settings give (KV mode, sequence limit, prompt cache)."""
        on = self.prompt_cache
        return {
            "max_seq_len": self.max_seq_len,
            "kv_cache_mode": self.kv_cache_mode(),
            "kv_share": self.kv_share,
            "device": self.device,
            "prompt_cache_mib": self.prompt_cache_mib if on else 0,
            "prompt_cache_entries": self.prompt_cache_entries if on else 0,
            "prompt_cache_disk": self.prompt_cache_disk if on else None,
            "prompt_cache_disk_mib": self.prompt_cache_disk_mib,
        }

    def dynamic_residency(self) -> bool:
        """Whether the model is loaded on demand (and may be unloaded) rather than at start-up for good."""
        return self.lazy_load or self.idle_unload_seconds > 0 or self.models_dir is not None

    def kv_cache_mode(self) -> str:
        """The KV-cache mode (docs/api.md): `kv_cache` when set; else INT4 (+ H_MODE) is int4 (int4-h), INT8 is int8,
        nothing set is fp16 (`kv_mode_error` rejects an unknown mode, H_MODE without INT4, INT4 with INT8, and
        `kv_cache` together with the switches)."""
        if self.kv_cache is not None:
            return self.kv_cache
        if self.kv_int4:
            return "int4-h" if self.kv_h_mode else "int4"
        if self.kv_int8:
            return "int8"
        return "fp16"

    def kv_mode_error(self) -> str | None:
        if self.kv_cache is not None:
            if self.kv_cache not in KV_CACHE_MODES:
                modes = ", ".join(KV_CACHE_MODES)
                return f"TINYLOOP_KV_CACHE={self.kv_cache!r} is not a KV-cache mode; choose one of {modes}"
            if self.kv_int4 or self.kv_int8 or self.kv_h_mode:
                return (
                    "TINYLOOP_KV_CACHE and TINYLOOP_KV_INT8 / _INT4 / _H_MODE are both set; use TINYLOOP_KV_CACHE alone"
                )
        if self.kv_h_mode and not self.kv_int4:
            return "TINYLOOP_KV_H_MODE=1 needs TINYLOOP_KV_INT4=1 (the Hadamard mode rotates the int4 cache)"
        if self.kv_int4 and self.kv_int8:
            return "TINYLOOP_KV_INT4=1 and TINYLOOP_KV_INT8=1 are both set; choose one KV cache mode"
        return None


def api_keys(listed: str | None, file: str | None) -> tuple[str, ...]:
    """Keys from a comma-separated list and from a file of one key per line (blank lines and `#` comments
    skipped). An unreadable file is an error: a server told to require keys must never start open."""
    keys = [k.strip() for k in (listed or "").split(",")]
    if file:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
        keys += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return tuple(k for k in keys if k)


def _baked_commit() -> str | None:
    """The git commit the extension was built from (build.rs), if it was built in a checkout."""
    from .. import _core

    return getattr(_core, "__commit__", "") or None
