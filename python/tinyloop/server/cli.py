"""`tinyloop-serve`: start granian (ASGI, one worker) on the tinyloop FastAPI app.

Every flag has an environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from ..extras import require_or_exit
from .config import DEFAULT_MODEL, KV_CACHE_MODES, KV_SHARE_MODES, api_keys
from .defaults import ConfigError, load_defaults
from .residency import CatalogError, scan_catalog

LOG_LEVELS = ("debug", "info", "warning", "error")

ENV_HELP = """environment variables:
  TINYLOOP_HOST, TINYLOOP_PORT  address and port to listen on (default 127.0.0.1:8000)
  TINYLOOP_MODEL_PATH         model file (default: the embedded default model)
  TINYLOOP_MAX_SEQ_LEN        longest prompt + output, in tokens (default: the model's context length)
  TINYLOOP_SERVED_MODEL_NAME  id reported by /v1/models (default: the model file's name without .tinyloop)
  TINYLOOP_API_KEY            API keys, comma-separated: every route but /health then needs
                              'Authorization: Bearer <key>' (or 'x-api-key: <key>')
  TINYLOOP_API_KEY_FILE       a file of API keys, one per line (added to TINYLOOP_API_KEY's)
  TINYLOOP_MAX_RUNNING        requests generated at once, batched step by step; more wait (default 16)
  TINYLOOP_MAX_WAITING        requests that may wait; past it the server answers 503 + Retry-After (default 256)
  TINYLOOP_KV_CACHE           KV-cache mode: fp16 (default), int8, int4 or int4-h
  TINYLOOP_KV_INT8, TINYLOOP_KV_INT4, TINYLOOP_KV_H_MODE
                              the same as switches (1 = on): INT4+H_MODE -> int4-h, INT4 -> int4, INT8 -> int8;
                              H_MODE without INT4, INT4 with INT8, or any with TINYLOOP_KV_CACHE is a load error
  TINYLOOP_GENERATE_CONFIG    a JSON file of generation defaults (sampling fields and loops) for the fields a
                              request leaves out
  TINYLOOP_MODELS_DIR         serve every .tinyloop under this directory by its file name, one loaded at a time
  TINYLOOP_LAZY_LOAD          1: load the model on the first request that needs it, not at start-up
  TINYLOOP_IDLE_UNLOAD_SECONDS  unload the model after this many seconds in which no request needed it (implies
                              lazy loading; health probes and metrics scrapes do not count)
  TINYLOOP_KV_SHARE           last: after the prompt, the loops share the last loop's KV (1/loops of the memory
                              per position; no speculative decoding, no prompt reuse); none (default): one per loop
  TINYLOOP_DEVICE             where the model computes: cpu (default), cuda or cuda:N (the CUDA build, docs/gpu.md),
                              candle-cpu (the GPU's code path on the host, for checking it without a GPU)
  TINYLOOP_NO_PROMPT_CACHE    1: do not reuse earlier requests' KV for prompts that start the same way
  TINYLOOP_PROMPT_CACHE_MIB, TINYLOOP_PROMPT_CACHE_ENTRIES
                              bounds of the in-memory prompt cache (default 256 MiB, 4 prefixes)
  TINYLOOP_PROMPT_CACHE_DISK  a private directory that keeps prompt prefixes across restarts and unloads; its
                              files hold conversation text's KV, so keep it local and unsynchronized
  TINYLOOP_PROMPT_CACHE_DISK_MIB  bound of that directory (default 1024 MiB)
  TINYLOOP_PROFILE_DIR        enables POST /start_profile and /stop_profile, which write profiles here
  TINYLOOP_MAX_BODY_BYTES     largest request body; larger ones get 413 (default 4 MiB)
  TINYLOOP_MAX_TOKENS_LIMIT   ceiling of a request's max_tokens (default 8192)
  TINYLOOP_ALWAYS_INCLUDE_USAGE  1: end every /v1 and /api/v0 stream with a usage chunk (choices: []), as if each
                              request asked for stream_options.include_usage (default: only those that ask)
  TINYLOOP_REQUEST_TIMEOUT    seconds of wall time a request may take, queueing included; past it the
                              generation ends with finish_reason "aborted" (default 600; 0: no limit)
  TINYLOOP_THREADS            compute threads (default: one per core); sets RAYON_NUM_THREADS for the engine
  TINYLOOP_LOG_LEVEL          debug, info (default), warning or error
  TINYLOOP_COMMIT             runtime.commit in /api/v0 responses (default: the commit built from)
  TINYLOOP_ISA                the engine's kernels at most at this level: avx512, avx2 or scalar (default: the
                              best the CPU has; runtime.isa in /api/v0 responses reports the one in use)
"""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tinyloop-serve",
        description=__doc__.split("\n\n")[0],
        epilog=ENV_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ
    p.add_argument(
        "--host",
        default=env.get("TINYLOOP_HOST") or "127.0.0.1",
        help="address to bind, else TINYLOOP_HOST, else 127.0.0.1 (this machine only)",
    )
    p.add_argument("--port", type=_port, default=None, help="else TINYLOOP_PORT, else 8000")
    p.add_argument("--model", default=None, help="model file (else TINYLOOP_MODEL_PATH, else the embedded default)")
    p.add_argument("--max-seq-len", type=int, default=None, help="else TINYLOOP_MAX_SEQ_LEN, else the model's context")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="else TINYLOOP_SERVED_MODEL_NAME, else the model file's name without .tinyloop",
    )
    p.add_argument(
        "--kv-cache",
        choices=KV_CACHE_MODES,
        default=None,
        help="KV-cache mode, else TINYLOOP_KV_CACHE (or the older switches), else fp16",
    )
    p.add_argument(
        "--kv-share",
        choices=KV_SHARE_MODES,
        default=None,
        help="last: loops share the last loop's KV after the prompt; else TINYLOOP_KV_SHARE, else none",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, cuda:N (the CUDA build) or candle-cpu; else TINYLOOP_DEVICE, else cpu",
    )
    p.add_argument(
        "--generate-config",
        default=None,
        metavar="FILE",
        help="JSON defaults for the sampling fields and loops a request leaves out, else TINYLOOP_GENERATE_CONFIG",
    )
    p.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every .tinyloop under DIR by its file name; a request's model picks one, loaded on demand "
        "(else TINYLOOP_MODELS_DIR)",
    )
    p.add_argument(
        "--lazy-load",
        action="store_true",
        default=None,
        help="load the model on the first request that needs it (else TINYLOOP_LAZY_LOAD)",
    )
    p.add_argument(
        "--idle-unload-seconds",
        type=_seconds,
        default=None,
        help="unload the model after this many seconds without a request; implies --lazy-load "
        "(else TINYLOOP_IDLE_UNLOAD_SECONDS, else never)",
    )
    p.add_argument(
        "--no-prompt-cache",
        action="store_true",
        default=None,
        help="do not reuse earlier requests' KV for prompts that start the same way (else TINYLOOP_NO_PROMPT_CACHE)",
    )
    p.add_argument(
        "--prompt-cache-mib",
        type=_positive,
        default=None,
        help="memory bound of the prompt cache, else TINYLOOP_PROMPT_CACHE_MIB, else 256",
    )
    p.add_argument(
        "--prompt-cache-entries",
        type=_positive,
        default=None,
        help="prefixes the prompt cache keeps, else TINYLOOP_PROMPT_CACHE_ENTRIES, else 4",
    )
    p.add_argument(
        "--prompt-cache-disk",
        default=None,
        metavar="DIR",
        help="keep prompt prefixes in DIR across restarts and unloads (private: it holds conversations' KV), else "
        "TINYLOOP_PROMPT_CACHE_DISK",
    )
    p.add_argument(
        "--prompt-cache-disk-mib",
        type=_positive,
        default=None,
        help="bound of --prompt-cache-disk, else TINYLOOP_PROMPT_CACHE_DISK_MIB, else 1024",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="enable POST /start_profile and /stop_profile, writing to DIR; else TINYLOOP_PROFILE_DIR",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="an API key (repeat for several), else TINYLOOP_API_KEY; no key means no authentication",
    )
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line; else TINYLOOP_API_KEY_FILE")
    p.add_argument("--max-body-bytes", type=_positive, default=None, help="else TINYLOOP_MAX_BODY_BYTES, else 4 MiB")
    p.add_argument(
        "--max-tokens-limit",
        type=_positive,
        default=None,
        help="ceiling of max_tokens, else TINYLOOP_MAX_TOKENS_LIMIT, else 8192",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds one request may take (0: no limit), else TINYLOOP_REQUEST_TIMEOUT, else 600",
    )
    p.add_argument(
        "--always-include-usage",
        action="store_true",
        help="end every stream with a usage chunk, asked for or not; else TINYLOOP_ALWAYS_INCLUDE_USAGE",
    )
    p.add_argument("--max-running", type=int, default=None, help="else TINYLOOP_MAX_RUNNING, else 16")
    p.add_argument("--max-waiting", type=int, default=None, help="else TINYLOOP_MAX_WAITING, else 256")
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help="compute threads, else TINYLOOP_THREADS, else one per core; fewer than the cores keeps decode "
        "steady when other processes compete for them",
    )
    p.add_argument(
        "--isa",
        default=None,
        help="kernels at most at this level (avx512, avx2, neon, scalar), else TINYLOOP_ISA, else the CPU's best",
    )
    p.add_argument("--commit", default=None, help="runtime.commit in /api/v0, else TINYLOOP_COMMIT, else the build's")
    scale = p.add_argument_group("scale-out (tinyloop[ray]; docs/scale-out.md)")
    scale.add_argument(
        "--ray", action="store_true", help="serve as a Ray Serve application: replicas behind Ray's HTTP proxy"
    )
    scale.add_argument("--replicas", type=_positive, default=1, help="with --ray: engines, one per replica (1)")
    scale.add_argument(
        "--replica-cpus", type=float, default=1.0, help="with --ray: CPUs Ray reserves for each replica (1)"
    )
    scale.add_argument(
        "--ray-address", default=None, help="with --ray: an existing cluster's address (else a local one is started)"
    )
    p.add_argument(
        "--log-level",
        default=env.get("TINYLOOP_LOG_LEVEL") or "info",
        choices=LOG_LEVELS,
        help="else TINYLOOP_LOG_LEVEL, else info",
    )
    args = p.parse_args(argv)
    if not args.ray and (args.replicas != 1 or args.ray_address is not None):
        p.error("--replicas and --ray-address apply only with --ray")
    if args.log_level not in LOG_LEVELS:
        p.error(f"TINYLOOP_LOG_LEVEL: expected one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.port is None:
        try:
            args.port = _port(env.get("TINYLOOP_PORT") or "8000")
        except argparse.ArgumentTypeError as e:
            p.error(f"TINYLOOP_PORT: {e}")
    if args.threads is None and os.environ.get("TINYLOOP_THREADS"):
        try:
            args.threads = _positive(os.environ["TINYLOOP_THREADS"])
        except argparse.ArgumentTypeError as e:
            p.error(f"TINYLOOP_THREADS: {e}")
    return args


def _checked(convert, ok, what: str):
    """An argparse type: `convert` the text and accept the value where `ok(value)`; else a usage error saying what
    was expected."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_port = _checked(int, lambda n: 0 <= n <= 65535, "a port number 0-65535")
_seconds = _checked(float, lambda s: 0 < s < float("inf"), "a number of seconds > 0")
_positive = _checked(int, lambda n: n >= 1, "a whole number >= 1")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.ray:
        require_or_exit("ray", "--ray", "ray", "ray.serve")
    for env, value in [
        ("TINYLOOP_MODEL_PATH", args.model),
        ("TINYLOOP_MAX_SEQ_LEN", args.max_seq_len),
        ("TINYLOOP_SERVED_MODEL_NAME", args.served_model_name),
        ("TINYLOOP_API_KEY", ",".join(args.api_key) if args.api_key else None),
        ("TINYLOOP_API_KEY_FILE", args.api_key_file),
        ("TINYLOOP_MAX_RUNNING", args.max_running),
        ("TINYLOOP_MAX_WAITING", args.max_waiting),
        ("TINYLOOP_MAX_BODY_BYTES", args.max_body_bytes),
        ("TINYLOOP_MAX_TOKENS_LIMIT", args.max_tokens_limit),
        ("TINYLOOP_REQUEST_TIMEOUT", args.request_timeout),
        ("TINYLOOP_ALWAYS_INCLUDE_USAGE", "1" if args.always_include_usage else None),
        ("TINYLOOP_KV_CACHE", args.kv_cache),
        ("TINYLOOP_KV_SHARE", args.kv_share),
        ("TINYLOOP_DEVICE", args.device),
        ("TINYLOOP_GENERATE_CONFIG", args.generate_config),
        ("TINYLOOP_PROFILE_DIR", args.profile),
        ("TINYLOOP_MODELS_DIR", args.models_dir),
        ("TINYLOOP_LAZY_LOAD", "1" if args.lazy_load else None),
        ("TINYLOOP_IDLE_UNLOAD_SECONDS", args.idle_unload_seconds),
        ("TINYLOOP_NO_PROMPT_CACHE", "1" if args.no_prompt_cache else None),
        ("TINYLOOP_PROMPT_CACHE_MIB", args.prompt_cache_mib),
        ("TINYLOOP_PROMPT_CACHE_ENTRIES", args.prompt_cache_entries),
        ("TINYLOOP_PROMPT_CACHE_DISK", args.prompt_cache_disk),
        ("TINYLOOP_PROMPT_CACHE_DISK_MIB", args.prompt_cache_disk_mib),
        ("TINYLOOP_ISA", args.isa),
        ("TINYLOOP_COMMIT", args.commit),
    ]:
        if value is not None:
            os.environ[env] = str(value)
    if args.threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read by rayon and candle when the worker first computes
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = os.environ.get("TINYLOOP_MODEL_PATH") or str(DEFAULT_MODEL)
    log = logging.getLogger("tinyloop.server")
    try:
        keys = api_keys(os.environ.get("TINYLOOP_API_KEY"), os.environ.get("TINYLOOP_API_KEY_FILE"))
    except OSError as e:
        log.error("cannot read the API key file: %s", e)
        return 2
    from tinyloop import TinyloopError, check_device

    try:
        check_device(os.environ.get("TINYLOOP_DEVICE") or "cpu")
    except TinyloopError as e:
        log.error("%s", e)
        return 2
    try:
        load_defaults(os.environ.get("TINYLOOP_GENERATE_CONFIG"))
        if os.environ.get("TINYLOOP_MODELS_DIR"):
            if os.environ.get("TINYLOOP_SERVED_MODEL_NAME"):
                raise CatalogError(
                    "--served-model-name names the one model; with --models-dir each model is named by its file"
                )
            scan_catalog(os.environ["TINYLOOP_MODELS_DIR"])
    except (ConfigError, CatalogError) as e:
        log.error("%s", e)
        return 2
    if not keys and not is_loopback(args.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this address can use the server "
            "(set --api-key or --api-key-file)",
            args.host,
        )
    log.info("serving %s on http://%s:%d/v1", model, args.host, args.port)
    if args.ray:
        from .ray import run

        return run(args.host, args.port, args.replicas, args.replica_cpus, args.ray_address)

    from granian import Granian
    from granian.constants import Interfaces, Loops

    # workers_kill_timeout: the worker drains its requests on SIGTERM (lifecycle.py) within a few seconds; if it
    # ever does not, it is killed rather than holding the process open. loop: asyncio's, always — granian picks
    # uvloop when it is installed, and under uvloop the worker does not stop gracefully on SIGTERM (it is killed at
    # the timeout), so whether a shutdown drains would depend on what else is installed.
    Granian(
        "tinyloop.server.app:create_app",
        factory=True,
        address=args.host,
        port=args.port,
        interface=Interfaces.ASGI,
        loop=Loops.asyncio,
        workers=1,
        log_level=args.log_level,
        log_access=False,
        workers_kill_timeout=5,
    ).serve()
    return 0


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


if __name__ == "__main__":
    sys.exit(main())
