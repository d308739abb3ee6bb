"""`tinyloop quantize`: rewrite a `.tinyloop` file's matrices in a quantized GGUF block type.

    --bits 8 → Q8_0; --bits 4 → Q4_0 (or Q4_1 with --format q4_1); --bits 2 → Q2_K.
    --method rtn rounds every block to nearest; --method gptq runs GPTQ (``gptq.py``) on Hessians from a calibration
    forward pass (``calibrate.py``) and writes its integer codes as raw blocks, on exactly the stored grid.

Every matrix is quantized, token_embd.weight and output.weight included; norms stay F32; metadata and tokenizer keys
are copied unchanged except general.file_type. Q2_K needs rows of a multiple of 256 values: other matrices (e.g.
ffn_down with 704 inputs) fall back to Q4_0 (with GPTQ, onto Q4_0's grid), and the command names them. With an untied
head, token_embd.weight is
only an embedding lookup (no input to calibrate against), so GPTQ rounds it to nearest.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._core import TinyloopError
from . import calibrate
from .format import FILE_TYPES, GGUFContents, V, model_config, read_gguf, write_gguf
from .gptq import Prepared, column_blocks, gptq, prepare
from .quants import FORMATS, rtn

CALIB_TEXT = Path(__file__).parents[1] / "assets" / "calib.txt"  # training-split sample (scripts/make_calib.py)
FALLBACK = "Q4_0"  # for matrices whose rows the target type's block does not divide
BITS = {8: "Q8_0", 4: "Q4_0", 2: "Q2_K"}


class QuantizeError(TinyloopError):
    """A bad input file or a bad combination of options (the CLI prints it and exits with status 1)."""


@dataclass
class Options:
    """The command's options (see `tinyloop quantize --help`)."""

    bits: int
    method: str = "rtn"
    format: str | None = None  # "q4_0" | "q4_1", only with bits 4
    group_size: int | None = None  # only the target format's own group is possible
    calib: str | os.PathLike[str] | None = None  # plain text; default CALIB_TEXT
    act_order: bool = False
    percdamp: float = 0.01
    loops: int | None = None  # calibration depth; default the file's loops.default
    calib_windows: int = 16
    calib_window: int = 256
    progress: bool = True


@dataclass
class Report:
    """What was written: each tensor's type, the matrices that fell back to FALLBACK, the time taken."""

    types: dict[str, str] = field(default_factory=dict)  # tensor name -> stored type
    fallbacks: list[str] = field(default_factory=list)
    seconds: float = 0.0


def target_type(opts: Options) -> str:
    """The GGUF type that `opts` asks for, or a QuantizeError saying why the combination is impossible."""
    if opts.method not in ("rtn", "gptq"):
        raise QuantizeError(f"--method must be rtn or gptq, got {opts.method!r}")
    if opts.bits not in BITS:
        raise QuantizeError(f"--bits must be 8 (Q8_0), 4 (Q4_0/Q4_1) or 2 (Q2_K), got {opts.bits}")
    name = BITS[opts.bits]
    if opts.format is not None:
        if opts.bits != 4 or opts.format.lower() not in ("q4_0", "q4_1"):
            raise QuantizeError(f"--format {opts.format}: only q4_0 or q4_1, and only with --bits 4")
        name = opts.format.upper()
    if opts.method == "rtn":
        given = {"--calib": opts.calib is not None, "--act-order": opts.act_order, "--loops": opts.loops is not None}
        used = [flag for flag, on in given.items() if on]
        if used:
            raise QuantizeError(f"{', '.join(used)} only applies to --method gptq")
    if not 0.0 < opts.percdamp <= 1.0:
        raise QuantizeError(f"--percdamp must be in (0, 1], got {opts.percdamp}")
    if opts.calib_windows < 1 or opts.calib_window < 2:
        raise QuantizeError("--calib-windows must be at least 1 and --calib-window at least 2")
    group = FORMATS[name].sub
    if opts.group_size is not None and opts.group_size != group:
        where = "16 inside each 256-value super-block" if name == "Q2_K" else f"{group}"
        raise QuantizeError(
            f"--group-size {opts.group_size}: {name} stores one scale per {where} values; the GGUF "
            f"block format fixes the group, so only --group-size {group} is possible"
        )
    return name


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=not enabled, leave=True)


def _calibrate(path: Path, contents: GGUFContents, opts: Options) -> calibrate.Hessians:
    from .. import Engine

    cfg = model_config(contents)
    loops = opts.loops if opts.loops is not None else cfg.default_loops
    if not 1 <= loops <= 64:
        raise QuantizeError(f"--loops must be in 1..64, got {loops}")
    calib = Path(opts.calib) if opts.calib is not None else CALIB_TEXT
    if not calib.is_file():
        raise QuantizeError(f"calibration file {calib} not found")
    engine = Engine(path)
    text = calib.read_text(encoding="utf-8", errors="replace")
    try:
        windows = calibrate.calibration_windows(
            text, engine.encode, engine.eos_token_id, opts.calib_windows, min(opts.calib_window, cfg.context_length)
        )
    except ValueError as e:
        raise QuantizeError(f"{calib}: {e}") from e
    print(
        f"calibration: {windows.shape[0]} windows × {windows.shape[1]} tokens from {calib.name}, {loops} loops",
        file=sys.stderr,
    )
    weights = {name: array for name, (array, _) in contents.tensors.items()}
    batch = 4
    with _bar(-(-len(windows) // batch), "calibrate", opts.progress) as bar:
        return calibrate.hessians(cfg, weights, windows, loops, batch=batch, progress=bar.update)


def _storage_types(contents: GGUFContents, target: str) -> dict[str, str]:
    """Each tensor's type in the output: F32 for norms, biases and the exit gate, else `target`, else FALLBACK where
    its rows don't fit."""
    types = {}
    for name, (array, _) in contents.tensors.items():
        matrix = array.ndim == 2 and not name.startswith("exit_gate.")
        fits = [t for t in (target, FALLBACK) if matrix and array.shape[1] % FORMATS[t].block == 0]
        if matrix and not fits:
            raise QuantizeError(f"{name}: rows of {array.shape[1]} values fit neither {target} nor {FALLBACK}")
        types[name] = fits[0] if fits else "F32"
    return types


def quantize_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: Options) -> Report:
    """Read `src`, quantize its matrices as `opts` says, write `dst`. Raises QuantizeError for bad input."""
    start = time.monotonic()
    target = target_type(opts)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise QuantizeError(f"{src}: no such file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise QuantizeError("the output must be a different file from the input")
    try:
        contents = read_gguf(src)
        model_config(contents)
    except ValueError as e:
        raise QuantizeError(str(e)) from e

    report = Report(types=_storage_types(contents, target))
    report.fallbacks = [n for n, t in report.types.items() if t not in ("F32", target)]
    if report.fallbacks:
        rows = ", ".join(f"{n} ({contents.tensors[n][0].shape[1]} per row)" for n in report.fallbacks)
        print(
            f"{target} needs rows of a multiple of {FORMATS[target].block} values; stored as {FALLBACK} "
            f"instead: {rows}",
            file=sys.stderr,
        )

    hessians = _calibrate(src, contents, opts) if opts.method == "gptq" else {}
    steps = {
        n: column_blocks(contents.tensors[n][0].shape[1], FORMATS[t]) if n in hessians else 1
        for n, t in report.types.items()
    }
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    prepared: dict[int, Prepared] = {}  # by Hessian identity: matrices that share an input share it
    with _bar(sum(steps.values()), f"quantize {target}", opts.progress) as bar:
        for name, (array, _) in contents.tensors.items():
            ttype, h = report.types[name], hessians.get(name)
            if ttype == "F32":
                data = array
            elif h is not None:
                if id(h) not in prepared:
                    prepared[id(h)] = prepare(h, opts.percdamp, opts.act_order)
                data = gptq(array, prepared[id(h)], ttype, progress=bar.update).raw()  # updates per column block
            else:
                data = rtn(array, ttype)[0]
            tensors[name] = (data, ttype)
            if h is None:
                bar.update()

    metadata = dict(contents.metadata)
    metadata["general.file_type"] = (FILE_TYPES[target], V.UINT32)
    write_gguf(dst, GGUFContents(metadata, tensors))
    report.seconds = time.monotonic() - start
    summary = ", ".join(f"{n} {t}" for t, n in sorted(Counter(report.types.values()).items()))
    print(f"wrote {dst}: {summary}; {dst.stat().st_size / 1e6:.1f} MB in {report.seconds:.1f} s", file=sys.stderr)
    return report
