"""`tinyloop` (or `python -m tinyloop`): command-line access to the engine and the model tools.

tinyloop info MODEL
tinyloop generate MODEL "Once upon a time" [--max-tokens N] [--loops L|auto] [--temperature T] [--seed S]
tinyloop random-model OUT.tinyloop [--dim D ...]   # a random model, for trying the engine out
tinyloop quantize IN.tinyloop OUT.tinyloop --bits 8|4|2 [--method rtn|gptq] [--calib FILE] [--format q4_0|q4_1]
tinyloop export-llama IN.tinyloop OUT.gguf [--loops L]   # unrolled llama GGUF for llama.cpp-based tools
tinyloop convert HF_DIR OUT.tinyloop [--outtype f16|f32|q8_0|q4_0] [--loops L]   # a Hugging Face checkpoint
tinyloop draft-vocab IN.tinyloop OUT.tinyloop --corpus TEXT [--size N] [--exit-size N]   # cheaper drafts, exit checks
tinyloop launch [--client C] [--model M] [--port N] [--dry-run] [-- SERVE_FLAGS]   # serve, and set up a coding client
"""

from __future__ import annotations

import argparse
import codecs
import sys


def _info(args: argparse.Namespace) -> int:
    from . import Engine
    from ._core import isa

    print(Engine(args.model).info)
    print(f"kernels: {isa()}")
    return 0


def _depth(text: str) -> int | str:
    """`--loops`: a number of loops, or "auto" (adaptive depth)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'a number of loops or "auto", not {text!r}') from None


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
    from .modelfile.format import ModelConfig, random_weights, write_model

    cfg = ModelConfig(dim=args.dim, n_heads=args.heads, n_kv_heads=args.heads, ffn_dim=args.ffn, block_count=args.k)
    write_model(args.out, cfg, random_weights(cfg, seed=args.seed), weight_type=args.weight_type)
    print(f"wrote {args.out}")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .modelfile.quantize import Options, quantize_file

    opts = Options(
        bits=args.bits,
        method=args.method,
        format=args.format,
        group_size=args.group_size,
        calib=args.calib,
        act_order=args.act_order,
        percdamp=args.percdamp,
        loops=args.loops,
        calib_windows=args.calib_windows,
        calib_window=args.calib_window,
        progress=not args.quiet,
    )
    quantize_file(args.input, args.output, opts)
    return 0


def _export_llama(args: argparse.Namespace) -> int:
    from .modelfile.export_llama import ExportError, export_llama

    try:
        export_llama(args.input, args.output, loops=args.loops, progress=not args.quiet)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .modelfile.convert import convert

    try:
        cfg = convert(Path(args.input), Path(args.output), args.outtype, args.loops, progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:  # ConvertError, TokenizerError, a missing file: the message says
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: {cfg.block_count} layers, d = {cfg.dim}, {cfg.vocab_size} tokens, {args.outtype}")
    return 0


def _draft_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .modelfile.draft_vocab import build

    try:
        ids, exit_ids, covered = build(
            Path(args.input),
            Path(args.output),
            Path(args.corpus),
            size=args.size,
            exit_size=args.exit_size,
            exit_threshold=args.exit_threshold,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"wrote {args.output}: {len(ids)} draft tokens, covering {covered:.1%} of the corpus's tokens; "
        f"{len(exit_ids)} exit tokens"
    )
    return 0


def _engine_commands(sub) -> None:
    p = sub.add_parser("info", help="print a model's configuration")
    p.add_argument("model")
    p.set_defaults(run=_info)

    p = sub.add_parser("generate", help="stream a continuation of a prompt")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--loops", type=_depth, default=None, help='loop depth, or "auto" for adaptive depth (default: the model\'s)'
    )
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


def _file_commands(sub) -> None:
    p = sub.add_parser("quantize", help="rewrite a model's weights as Q8_0, Q4_0/Q4_1 or Q2_K (RTN or GPTQ)")
    p.add_argument("input", help="a .tinyloop file (weights of any type; they are dequantized first)")
    p.add_argument("output")
    p.add_argument("--bits", type=int, required=True, help="8 (Q8_0), 4 (Q4_0, or Q4_1 with --format) or 2 (Q2_K)")
    p.add_argument("--method", default="rtn", help="rtn (round to nearest, default) or gptq")
    p.add_argument("--format", default=None, help="with --bits 4: q4_0 (default) or q4_1")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="values per scale; fixed by the block format (32, or 16 for Q2_K): only that value is accepted",
    )
    p.add_argument("--calib", default=None, help="GPTQ calibration text (default: a sample of the training split)")
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing Hessian diagonal")
    p.add_argument("--percdamp", type=float, default=0.01, help="GPTQ dampening, a fraction of mean(diag H)")
    p.add_argument("--loops", type=int, default=None, help="GPTQ calibration depth (default: the model's)")
    p.add_argument("--calib-windows", type=int, default=16, help="GPTQ: calibration windows")
    p.add_argument("--calib-window", type=int, default=256, help="GPTQ: tokens per window")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_quantize)

    p = sub.add_parser("export-llama", help="write the unrolled model (prelude + k x L layers) as a llama GGUF")
    p.add_argument("input", help="a .tinyloop file")
    p.add_argument("output", help="the llama-architecture .gguf to write (tensor types and tokenizer unchanged)")
    p.add_argument("--loops", type=int, default=None, help="depth to unroll (default: the model's default loops)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_export_llama)

    p = sub.add_parser("convert", help="write a Hugging Face checkpoint (Llama, Qwen2, Ouro) as a .tinyloop file")
    p.add_argument("input", help="the checkpoint's directory (config.json, *.safetensors, tokenizer.json ...)")
    p.add_argument("output", help="the .tinyloop file to write")
    p.add_argument("--outtype", default="f16", choices=["f32", "f16", "q8_0", "q4_0"], help="weight type (f16)")
    p.add_argument(
        "--loops", type=int, default=None, help="the file's default loops (default: Ouro's total_ut_steps, else 1)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_convert)

    p = sub.add_parser("draft-vocab", help="list a corpus's most frequent tokens in the model, for cheaper drafts")
    p.add_argument("input", help="a .tinyloop file")
    p.add_argument("output", help="the .tinyloop file to write (may be the input)")
    p.add_argument(
        "--corpus", required=True, help="text to count tokens in (passages separated by <|endoftext|> lines)"
    )
    p.add_argument("--size", type=int, default=4096, help="draft tokens to keep (default 4096)")
    p.add_argument(
        "--exit-size",
        type=int,
        default=256,
        help="tokens loops='auto' compares successive loops over (default 256; 0: none, the draft tokens serve)",
    )
    p.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="store this as the file's default loops='auto' threshold (default: leave the file's as it is)",
    )
    p.set_defaults(run=_draft_vocab)


def _launch(args: argparse.Namespace) -> int:
    from .launch.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinyloop", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _engine_commands(sub)
    _file_commands(sub)
    from .launch.cli import add_arguments

    p = sub.add_parser("launch", help="start tinyloop-serve, optionally with a coding client set up to use it")
    add_arguments(p)
    p.set_defaults(run=_launch)
    args = parser.parse_args(argv)
    from ._core import TinyloopError

    try:
        return args.run(args)
    except TinyloopError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
