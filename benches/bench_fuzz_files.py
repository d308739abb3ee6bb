"""The fuzzers of tests/test_fuzz_files.py run for longer (a few minutes): every prefix of the seed models, 20,000
mutated and random files through `tinyloop.Engine` and 3,000 through
`tinyloop.modelfile.format.read_gguf`, each loaded by a
worker process (tests/fuzz_files.py) so that a crash, a hang, an untyped error or a memory spike fails with the case
that caused it; then 5,000 texts through the shipped model's tokenizer.

    pytest benches/bench_fuzz_files.py                      # FUZZ_CASES=100000 for a longer run
    pytest benches/bench_fuzz_files.py --benchmark-json=.benchmarks/fuzz.json
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tqdm import tqdm

import tinyloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fuzz_files import Case, Worker, mutations, problem, write_seeds

CASES = int(os.environ.get("FUZZ_CASES", "20000"))
MODEL = Path(tinyloop.__file__).parent / "models" / "default.tinyloop"


def long_run(n: int) -> settings:
    # No deadline (the worker's own timeout catches a hang) and no example database: this is a search, not a test
    # that should replay earlier failures.
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return write_seeds(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def worker():
    with Worker() as w:
        yield w


def run_cases(benchmark, worker, strategy, n: int, desc: str, **load) -> None:
    outcomes: Counter[str] = Counter()
    with tqdm(total=n, desc=desc, unit="file") as bar:

        @long_run(n)
        @given(case=strategy)
        def fuzz(case: Case) -> None:
            result = worker.load(case.data, **load)
            outcomes[result["outcome"]] += 1
            bar.update()
            why = problem(case, result)
            assert why is None, why

        benchmark.pedantic(fuzz, rounds=1, iterations=1)
    benchmark.extra_info.update(cases=n, outcomes=dict(outcomes))


def test_every_prefix(benchmark, worker, seeds):
    """Every prefix length of every seed, not only the interesting ones the test suite tries."""
    outcomes: Counter[str] = Counter()

    def sweep() -> None:
        total = sum(len(s.data) for s in seeds)
        with tqdm(total=total, desc="prefixes", unit="file") as bar:
            for seed in seeds:
                for n in range(len(seed.data)):
                    case = Case(f"{seed.name}: first {n} bytes", seed.data[:n])
                    result = worker.load(case.data, run=False)
                    outcomes[result["outcome"]] += 1
                    bar.update()
                    why = problem(case, result) or (None if result["outcome"] != "loaded" else f"{case.label} loaded")
                    assert why is None, why

    benchmark.pedantic(sweep, rounds=1, iterations=1)
    benchmark.extra_info.update(outcomes=dict(outcomes))


def test_mutated_files(benchmark, worker, seeds):
    run_cases(benchmark, worker, mutations(seeds), CASES, "engine")


def test_mutated_files_through_read_gguf(benchmark, worker, seeds):
    run_cases(benchmark, worker, mutations(seeds), max(CASES // 7, 100), "read_gguf", reader="read_gguf")


def test_tokenizer_round_trip(benchmark):
    engine = tinyloop.Engine(MODEL)
    n = max(CASES // 4, 100)
    text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=2000)
    with tqdm(total=n, desc="texts", unit="text") as bar:

        @long_run(n)
        @given(text=text, allow_special=st.booleans())
        def fuzz(text: str, allow_special: bool) -> None:
            ids = engine.encode(text, allow_special=allow_special)
            assert engine.decode(ids) == text
            bar.update()

        benchmark.pedantic(fuzz, rounds=1, iterations=1)
    benchmark.extra_info.update(texts=n)
