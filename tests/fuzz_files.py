"""Malformed `.tinyloop` files for the loader fuzz tests (tests/test_fuzz_files.py, benches/bench_fuzz_files.py).

* `write_seeds`: small valid models (a 321-token vocabulary, so that a load takes about a millisecond);
* `layout`: where every field of a file's header, metadata and tensor infos lies, so mutations can aim at lengths,
  counts, types, dimensions and offsets rather than only at random bytes;
* `edge_values`: every numeric field of a seed set in turn to a few edge values (a deterministic sweep);
* `mutations`, `random_files`: hypothesis strategies of `Case`s (truncated, bit-flipped, field-overwritten,
  byte-overwritten, spliced, weight-poisoned and random files);
* `Worker`: a process that loads one file per request, with `tinyloop.Engine` (then generates) or with
  `tinyloop.modelfile.format.read_gguf`, and reports what happened, so that a crash (abort, segfault) or a hang ends the
  worker, not the test run, and each load's peak memory is measured. `python tests/fuzz_files.py serve` is that
  worker.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

N_VOCAB = 321  # 320 byte-level tokens and merges, then <|endoftext|>; 321 rows are not a multiple of 16 (padding)
# A load of a file of tens of kilobytes that raises the worker's peak RSS by more than this allocated far more
# than the file justifies.
RSS_LIMIT_MIB = 64
# Outcomes a malformed file may have: it loads (and then runs or fails typed), or it is refused typed (ValueError is
# what `tinyloop.modelfile.format.read_gguf` documents). EngineError is tinyloop's "internal failure (a bug)",
# including a caught panic: never acceptable here.
ACCEPTED = {"loaded", "ModelLoadError", "TokenizerError", "InvalidRequestError", "ContextLengthError", "ValueError"}


def seed_configs():
    from tinyloop.modelfile.format import ModelConfig

    base = ModelConfig(
        dim=8,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=8,
        block_count=1,
        prelude_count=1,
        default_loops=2,
        max_trained_loops=2,
        context_length=32,
        vocab_size=N_VOCAB,
        tied_head=False,
        name="fuzz-f32",
    )
    quant = ModelConfig(
        dim=32,
        n_heads=2,
        n_kv_heads=2,
        ffn_dim=32,
        block_count=2,
        prelude_count=0,
        default_loops=2,
        max_trained_loops=2,
        context_length=32,
        vocab_size=N_VOCAB,
        tied_head=True,
        name="fuzz-q",
    )
    # name -> (config, weight type, embedding type)
    return {"f32": (base, "F32", None), "quant": (quant, "Q4_0", "Q8_0")}


def small_vocab(n: int = N_VOCAB):
    from tinyloop.modelfile.vocab import EOT_TOKEN, Vocabulary, gpt2_vocabulary

    v = gpt2_vocabulary()  # ranks 0..255 are the bytes, merge i makes rank 256 + i
    return Vocabulary(
        [*v.tokens[: n - 1], EOT_TOKEN],
        [*v.token_types[: n - 1], 3],
        v.merges[: n - 257],
        eos_token_id=n - 1,
        bos_token_id=n - 1,
    )


@dataclass(frozen=True)
class Field:
    offset: int
    size: int
    kind: str  # magic, version, count, length, bytes, type, value, dim, offset
    owner: str  # the key or tensor it belongs to ("" in the header)


@dataclass
class Seed:
    name: str
    data: bytes
    fields: list[Field]
    data_start: int  # where the tensor data section starts
    cuts: list[int]  # interesting prefix lengths
    by_kind: dict[str, list[Field]] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    label: str
    data: bytes

    def __repr__(self) -> str:  # hypothesis prints falsifying examples: the recipe, not 40 KB of bytes
        return f"Case({self.label!r}, {len(self.data)} bytes)"


_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Walker:
    def __init__(self, data: bytes):
        self.data, self.pos, self.fields = data, 0, []

    def take(self, size: int, kind: str, owner: str, record: bool = True) -> bytes:
        if record:
            self.fields.append(Field(self.pos, size, kind, owner))
        self.pos += size
        return self.data[self.pos - size : self.pos]

    def int(self, size: int, kind: str, owner: str = "", record: bool = True) -> int:
        return int.from_bytes(self.take(size, kind, owner, record), "little")

    def string(self, owner: str, record: bool = True) -> str:
        n = self.int(8, "length", owner, record)
        return self.take(n, "bytes", owner, record).decode()

    def value(self, vtype: int, owner: str, record: bool = True) -> None:
        if vtype == 8:
            self.string(owner, record)
        elif vtype == 9:  # arrays: only the first and last two elements' fields are recorded
            etype, n = self.int(4, "type", owner, record), self.int(8, "count", owner, record)
            for i in range(n):
                self.value(etype, owner, record and (i < 2 or i >= n - 2))
        else:
            self.take(_SCALAR_SIZE[vtype], "value", owner, record)


def layout(data: bytes) -> tuple[list[Field], int, list[int]]:
    """The fields of a well-formed GGUF file, the data section's start, and each tensor's data start."""
    w = _Walker(data)
    w.take(4, "magic", "")
    w.int(4, "version")
    n_tensors, n_kv = w.int(8, "count"), w.int(8, "count")
    for _ in range(n_kv):
        key = w.string("a key")
        w.value(w.int(4, "type", key), key)
    offsets = []
    for _ in range(n_tensors):
        name = w.string("a tensor name")
        for _ in range(w.int(4, "count", name)):
            w.int(8, "dim", name)
        w.int(4, "type", name)
        offsets.append(w.int(8, "offset", name))
    data_start = -(-w.pos // 32) * 32
    return w.fields, data_start, sorted(data_start + o for o in offsets)


def make_seed(name: str, data: bytes) -> Seed:
    fields, data_start, starts = layout(data)
    cuts = {0, 1, len(data) - 1, data_start - 1, data_start}
    for f in fields:
        cuts |= {f.offset, f.offset + 1, f.offset + f.size - 1}
    for s in starts:
        cuts |= {s - 1, s, s + 1}
    seed = Seed(name, data, fields, data_start, sorted(c for c in cuts if 0 <= c < len(data)))
    for f in fields:
        seed.by_kind.setdefault(f.kind, []).append(f)
    return seed


def write_seeds(directory: Path) -> list[Seed]:
    from tinyloop.modelfile.format import V, model_contents, random_weights, write_gguf

    seeds = []
    for name, (cfg, weight_type, embedding_type) in seed_configs().items():
        contents = model_contents(cfg, random_weights(cfg, seed=1), weight_type, embedding_type, vocab=small_vocab())
        contents.metadata["tinyloop.draft.token_ids"] = (list(range(0, N_VOCAB, 5)), V.ARRAY, V.UINT32)
        # Keys tinyloop's writer leaves out, so that mutations reach them too: the alignment (its default, 32) and
        # an array of a type no key the loader reads has.
        contents.metadata["general.alignment"] = (32, V.UINT32)
        contents.metadata["fuzz.floats"] = ([0.5] * 8, V.ARRAY, V.FLOAT32)
        path = directory / f"seed-{name}.tinyloop"
        write_gguf(path, contents)
        seeds.append(make_seed(name, path.read_bytes()))
    return seeds


# --- mutations --------------------------------------------------------------------------------------------------------

_HUGE = [2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_SMALL = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 30, 31, 32, 255, 256]


@st.composite
def _field_value(draw, seed: Seed, f: Field) -> tuple[str, bytes]:
    old = int.from_bytes(seed.data[f.offset : f.offset + f.size], "little")
    if f.kind == "bytes" or f.size > 8:
        new = draw(st.binary(min_size=f.size, max_size=f.size))
        return f"bytes {new[:16]!r}", new
    top = 2 ** (8 * f.size) - 1
    choices = [v for v in _SMALL + _HUGE if v <= top]
    near = [len(seed.data) - f.offset, len(seed.data), old - 1, old + 1, old * 2, top - old]
    value = draw(st.one_of(st.sampled_from(choices), st.sampled_from(near), st.integers(0, top))) & top
    return f"{old} -> {value}", value.to_bytes(f.size, "little")


def edge_values(seed: Seed) -> list[Case]:
    """Every recorded field that is a number (counts, lengths, types, dimensions, offsets, scalar values) set in turn
    to 0, its top bit alone, all ones, and one more than it holds."""
    cases = []
    for f in seed.fields:
        if f.kind in ("magic", "bytes") or f.size > 8:
            continue
        old = int.from_bytes(seed.data[f.offset : f.offset + f.size], "little")
        top = 2 ** (8 * f.size) - 1
        for value in sorted({0, (top >> 1) + 1, top, (old + 1) & top} - {old}):
            data = seed.data[: f.offset] + value.to_bytes(f.size, "little") + seed.data[f.offset + f.size :]
            cases.append(
                Case(f"{seed.name}: {f.kind} of {f.owner or 'the header'} at {f.offset}: {old} -> {value}", data)
            )
    return cases


@st.composite
def overwritten_field(draw, seeds: list[Seed]) -> Case:
    """One field (a count, length, type, dimension, offset, scalar value or string) set to an edge value."""
    seed = draw(st.sampled_from(seeds))
    kind = draw(st.sampled_from(sorted(seed.by_kind)))
    f = draw(st.sampled_from(seed.by_kind[kind]))
    what, new = draw(_field_value(seed, f))
    data = seed.data[: f.offset] + new + seed.data[f.offset + len(new) :]
    return Case(f"{seed.name}: {f.kind} of {f.owner or 'the header'} at {f.offset}: {what}", data)


@st.composite
def truncated(draw, seeds: list[Seed]) -> Case:
    seed = draw(st.sampled_from(seeds))
    n = draw(st.one_of(st.sampled_from(seed.cuts), st.integers(0, len(seed.data) - 1)))
    return Case(f"{seed.name}: first {n} of {len(seed.data)} bytes", seed.data[:n])


@st.composite
def bit_flipped(draw, seeds: list[Seed]) -> Case:
    """A few bits flipped, in the header (metadata, tensor infos) or anywhere (the weights too)."""
    seed = draw(st.sampled_from(seeds))
    end = draw(st.sampled_from([seed.data_start, len(seed.data)]))
    bits = draw(st.lists(st.integers(0, 8 * end - 1), min_size=1, max_size=8, unique=True))
    data = bytearray(seed.data)
    for b in bits:
        data[b // 8] ^= 1 << (b % 8)
    return Case(f"{seed.name}: bits {bits} flipped", bytes(data))


# NaN, ±inf and the largest finite value as f32, then as f16 (quantized blocks keep f16 scales).
_POISON = [bytes.fromhex(h) for h in ("0000c07f", "0000807f", "000080ff", "ffff7f7f", "007e", "007c", "00fc", "ff7b")]


@st.composite
def poisoned_weights(draw, seeds: list[Seed]) -> Case:
    """Weights (or quantization scales) set to NaN, ±inf or the largest finite value: the file is well formed, so
    it loads, and generation must then still finish or fail typed."""
    seed = draw(st.sampled_from(seeds))
    data = bytearray(seed.data)
    spots = draw(
        st.lists(
            st.tuples(st.integers(seed.data_start, len(data) - 4), st.sampled_from(_POISON)), min_size=1, max_size=64
        )
    )
    for at, value in spots:
        at -= at % len(value)
        data[at : at + len(value)] = value
    return Case(f"{seed.name}: {len(spots)} weights poisoned, first at {spots[0][0]}", bytes(data))


@st.composite
def overwritten_bytes(draw, seeds: list[Seed]) -> Case:
    seed = draw(st.sampled_from(seeds))
    at = draw(st.integers(0, seed.data_start - 1))
    new = draw(st.binary(min_size=1, max_size=16))
    return Case(f"{seed.name}: {new!r} at {at}", seed.data[:at] + new + seed.data[at + len(new) :])


@st.composite
def spliced(draw, seeds: list[Seed]) -> Case:
    """A stretch of the header deleted or repeated: every later field shifts."""
    seed = draw(st.sampled_from(seeds))
    a = draw(st.integers(0, seed.data_start - 1))
    b = draw(st.integers(a + 1, min(a + 64, seed.data_start)))
    if draw(st.booleans()):
        return Case(f"{seed.name}: bytes {a}..{b} deleted", seed.data[:a] + seed.data[b:])
    return Case(f"{seed.name}: bytes {a}..{b} repeated", seed.data[:b] + seed.data[a:])


@st.composite
def random_files(draw) -> Case:
    """Random bytes, bare or behind a GGUF v3 header with small counts (so the reader gets past the magic)."""
    body = draw(st.binary(max_size=2048))
    if draw(st.booleans()):
        return Case("random bytes", body)
    n_tensors, n_kv = draw(st.integers(0, 4)), draw(st.integers(0, 40))
    head = b"GGUF" + (3).to_bytes(4, "little") + n_tensors.to_bytes(8, "little") + n_kv.to_bytes(8, "little")
    return Case(f"GGUF header ({n_tensors} tensors, {n_kv} keys), random body", head + body)


def mutations(seeds: list[Seed]) -> st.SearchStrategy[Case]:
    return st.one_of(
        truncated(seeds),
        bit_flipped(seeds),
        overwritten_field(seeds),
        overwritten_bytes(seeds),
        spliced(seeds),
        poisoned_weights(seeds),
        random_files(),
    )


# --- the worker -------------------------------------------------------------------------------------------------------


def _peak_rss_mib() -> float:
    """This process's peak RSS. Linux's VmHWM, not ru_maxrss: the latter also counts the forked parent's RSS before
    exec, so a worker started by a large test process would seem to have grown by the parent's size."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def _reset_peak_rss() -> float:
    """Reset the peak RSS to the current RSS where Linux allows it (/proc/self/clear_refs), so the next peak is one
    load's; return the level growth is measured from (the current RSS, else the peak so far)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return _peak_rss_mib()
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _outcome(e: BaseException) -> str:
    import tinyloop

    if isinstance(e, tinyloop.TinyloopError):
        return type(e).__name__
    return f"unexpected {type(e).__module__}.{type(e).__name__}"


def _run(engine) -> None:
    """A loaded model (its weights or settings perhaps mutated) must generate, or fail typed."""
    import tinyloop

    for params in (
        tinyloop.SamplingParams(temperature=0.0, max_tokens=2),
        tinyloop.SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=2),
    ):
        engine.generate([1, 2, 3], params)
    engine.decode(engine.encode("Hi <|endoftext|> there", allow_special=True))


def check_read_gguf(path: str) -> dict:
    """The Python reader (used by the quantizer and draft-vocab tools) on the same files: it may raise ValueError."""
    from tinyloop.modelfile.format import model_config, read_gguf

    try:
        model_config(read_gguf(path))
    except ValueError as e:
        return {"outcome": "ValueError", "message": str(e)[-300:]}
    except BaseException as e:
        return {"outcome": f"unexpected {type(e).__module__}.{type(e).__name__}", "message": str(e)[-300:]}
    return {"outcome": "loaded"}


def check_file(path: str, run: bool, reader: str = "engine") -> dict:
    import tinyloop

    if reader == "read_gguf":
        return check_read_gguf(path)
    try:
        engine = tinyloop.Engine(path)
    except BaseException as e:
        return {"outcome": _outcome(e), "message": str(e)[-300:]}
    if run:
        try:
            _run(engine)
        except BaseException as e:
            return {"outcome": _outcome(e), "message": f"after loading: {str(e)[-300:]}"}
    return {"outcome": "loaded"}


def serve() -> None:
    """Load the file each stdin line names (JSON: path, run, reader); answer one JSON line per request."""
    import tinyloop

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("reader") == "read_gguf":
            import tinyloop.modelfile.format  # noqa: F401 - NumPy and gguf: imported before the measurement starts
        base = _reset_peak_rss()
        result = check_file(req["path"], req.get("run", True), req.get("reader", "engine"))
        result["rss_growth_mib"] = round(_peak_rss_mib() - base, 2)
        print(json.dumps(result), flush=True)


class Worker:
    """Loads files in a `serve` process; restarts it after anything that ends it or leaves its memory high."""

    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.dir = tempfile.TemporaryDirectory(prefix="tinyloop-fuzz-")
        self.path = Path(self.dir.name) / "case.tinyloop"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.dir.cleanup()

    def _start(self) -> None:
        self.stderr = open(Path(self.dir.name) / "stderr.txt", "w+b")
        env = {**os.environ, "RUST_BACKTRACE": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            text=True,
        )
        ready = self._reply(timeout_s=120)
        assert ready.get("ready"), f"fuzz worker did not start: {ready}"

    def close(self) -> tuple[int | None, str]:
        """End the process (if any); return its exit status and the end of its stderr."""
        if self.proc is None:
            return None, ""
        self.proc.kill()
        code = self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()
        self.stderr.seek(0)
        tail = self.stderr.read()[-2000:].decode(errors="replace")
        self.stderr.close()
        self.proc = None
        return code, tail

    def _reply(self, timeout_s: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.close()
            return {"outcome": "hang", "message": f"no answer within {timeout_s} s"}
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()  # it ended by itself: close() then reports how
            code, tail = self.close()
            return {"outcome": "crash", "message": f"worker exited with {code}: {tail}"}
        return json.loads(line)

    def load(self, data: bytes, run: bool = True, reader: str = "engine") -> dict:
        """What loading `data` with `tinyloop.Engine` (then running the model, with `run`) or with
        `tinyloop.modelfile.format.read_gguf` (`reader="read_gguf"`) does: an outcome and how far the load raised the
        worker's peak RSS."""
        if self.proc is None:
            self._start()
        self.path.write_bytes(data)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"path": str(self.path), "run": run, "reader": reader}) + "\n")
        self.proc.stdin.flush()
        result = self._reply(self.timeout_s)
        if result["outcome"] not in ACCEPTED or result.get("rss_growth_mib", 0) > RSS_LIMIT_MIB:
            self.close()  # a fresh process for the next case: a clean slate and a fresh peak-RSS baseline
        return result


def problem(case: Case, result: dict) -> str | None:
    """Why `result` is not acceptable for `case`, or None."""
    if result["outcome"] not in ACCEPTED:
        return f"{case.label}: {result['outcome']}: {result.get('message', '')}"
    if result.get("rss_growth_mib", 0) > RSS_LIMIT_MIB:
        return f"{case.label}: peak RSS grew by {result['rss_growth_mib']} MiB for a {len(case.data)}-byte file"
    return None


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit(f"usage: {sys.argv[0]} serve")
