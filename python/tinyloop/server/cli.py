"""`tinyloop-serve`: start granian (ASGI, one worker) on the tinyloop FastAPI app.

Every flag has an environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import DEFAULT_MODEL

ENV_HELP = """environment variables:
  TINYLOOP_MODEL_PATH         model file (default: the embedded default model)
  TINYLOOP_MAX_SEQ_LEN        longest prompt + output, in tokens (default: the model's context length)
  TINYLOOP_SERVED_MODEL_NAME  id reported by /v1/models (default: the model path)
  TINYLOOP_API_KEY            require 'Authorization: Bearer <key>' on every route but /health
  TINYLOOP_MAX_RUNNING        requests generated at once, batched step by step; more wait (default 16)
  TINYLOOP_MAX_WAITING        requests that may wait; past it the server answers 503 + Retry-After (default 256)
  TINYLOOP_KV_INT8, TINYLOOP_KV_INT4, TINYLOOP_KV_H_MODE
                              KV-cache mode (1 = on): INT4+H_MODE -> int4-h, INT4 -> int4, INT8 -> int8,
                              none -> fp16; H_MODE without INT4, or INT4 with INT8, is a load error
  TINYLOOP_THREADS            compute threads (default: one per core); sets RAYON_NUM_THREADS for the engine
  TINYLOOP_COMMIT             runtime.commit in /api/v0 responses (default: the commit built from)
"""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tinyloop-serve", description=__doc__.split("\n\n")[0],
                                epilog=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model", default=None, help="model file (else TINYLOOP_MODEL_PATH, else the embedded default)")
    p.add_argument("--max-seq-len", type=int, default=None, help="else TINYLOOP_MAX_SEQ_LEN, else the model's context")
    p.add_argument("--served-model-name", default=None, help="else TINYLOOP_SERVED_MODEL_NAME, else the model path")
    p.add_argument("--api-key", default=None, help="else TINYLOOP_API_KEY; unset means no authentication")
    p.add_argument("--max-running", type=int, default=None, help="else TINYLOOP_MAX_RUNNING, else 16")
    p.add_argument("--max-waiting", type=int, default=None, help="else TINYLOOP_MAX_WAITING, else 256")
    p.add_argument("--threads", type=_positive, default=None,
                   help="compute threads, else TINYLOOP_THREADS, else one per core; fewer than the cores keeps decode "
                        "steady when other processes compete for them")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if args.threads is None and os.environ.get("TINYLOOP_THREADS"):
        try:
            args.threads = _positive(os.environ["TINYLOOP_THREADS"])
        except argparse.ArgumentTypeError as e:
            p.error(f"TINYLOOP_THREADS: {e}")
    return args


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads >= 1, got {text!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for env, value in [("TINYLOOP_MODEL_PATH", args.model), ("TINYLOOP_MAX_SEQ_LEN", args.max_seq_len),
                       ("TINYLOOP_SERVED_MODEL_NAME", args.served_model_name), ("TINYLOOP_API_KEY", args.api_key),
                       ("TINYLOOP_MAX_RUNNING", args.max_running), ("TINYLOOP_MAX_WAITING", args.max_waiting)]:
        if value is not None:
            os.environ[env] = str(value)
    if args.threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read by rayon and candle when the worker first computes
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = os.environ.get("TINYLOOP_MODEL_PATH") or str(DEFAULT_MODEL)
    logging.getLogger("tinyloop.server").info("serving %s on http://%s:%d/v1", model, args.host, args.port)

    from granian import Granian
    from granian.constants import Interfaces

    Granian("tinyloop.server.app:create_app", factory=True, address=args.host, port=args.port,
            interface=Interfaces.ASGI, workers=1, log_level=args.log_level, log_access=False).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
