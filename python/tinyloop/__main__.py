"""`python -m tinyloop`: command-line access to the engine.

    python -m tinyloop info MODEL
    python -m tinyloop generate MODEL "Once upon a time" [--max-tokens N] [--loops L] [--temperature T] [--seed S]
    python -m tinyloop random-model OUT.tinyloop [--dim D ...]   # a random model, for trying the engine out
"""

from __future__ import annotations

import argparse
import codecs
import sys


def _info(args: argparse.Namespace) -> int:
    from . import Engine

    print(Engine(args.model).info)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from . import Engine, SamplingParams

    engine = Engine(args.model)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens)
    # Whole characters only: bytes of a character split across tokens wait for the rest; invalid ones become U+FFFD.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(args.prompt)
    for step in engine.stream(args.prompt, params, loops=args.loops):
        sys.stdout.write(decoder.decode(step.bytes))
        sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return 0


def _random_model(args: argparse.Namespace) -> int:
    from .format import ModelConfig, random_weights, write_model

    cfg = ModelConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.heads, ffn_dim=args.ffn, block_count=args.k)
    write_model(args.out, cfg, random_weights(cfg, seed=args.seed), weight_type=args.weight_type)
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyloop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="print a model's configuration")
    p.add_argument("model")
    p.set_defaults(run=_info)

    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--loops", type=int, default=None, help="loop depth (default: the model's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(run=_generate)

    p = sub.add_parser("random-model", help="write a model with random weights")
    p.add_argument("out")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-type", default="F16", choices=["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
    p.set_defaults(run=_random_model)

    args = parser.parse_args(argv)
    from ._core import TinyloopError

    try:
        return args.run(args)
    except TinyloopError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
