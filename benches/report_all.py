"""Every performance table from one benchmark run: the machine's limits, then each bench's own report, all from one
pytest-benchmark JSON, so that tinyloop's figures, its peers' and the machine's bandwidth and FLOP rate come from
the same stretch of time on the same machine.

    pytest benches/bench_machine.py benches/bench_sampling.py benches/bench_profile.py \
        benches/bench_speculative.py benches/bench_batch.py benches/bench_server_overhead.py \
        benches/bench_prompt_cache.py benches/bench_llama.py --benchmark-json=.benchmarks/all.json
    python benches/report_all.py .benchmarks/all.json

A bench missing from the run is skipped with a line saying so.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (bench file, its report module, title, whether the report relates figures to the machine's limits and so reads
# the bench_machine rows too).
REPORTS = [
    ("bench_sampling.py", "report_sampling", "Sampled decoding against greedy", False),
    ("bench_profile.py", "report_profile", "Where a step's time goes, against the machine's limits", True),
    ("bench_speculative.py", "report_speculative", "Self-speculative decoding against plain", False),
    ("bench_batch.py", "report_batch", "Continuous batching", False),
    ("bench_server_overhead.py", "report_server_overhead", "The server against the engine", False),
    ("bench_prompt_cache.py", "report_prompt_cache", "Prompt reuse: a conversation's next turn", False),
    ("bench_llama.py", "report_llama", "Next to llama.cpp and mistral.rs", False),
]
MACHINE = "bench_machine.py"


def rows_of(data: dict, bench: str) -> list[dict]:
    return [b for b in data["benchmarks"] if Path(b["fullname"].split("::")[0]).name == bench]


def machine_limits(data: dict) -> None:
    limits = {b["name"]: b["extra_info"] for b in rows_of(data, MACHINE)}
    cpu = data["machine_info"].get("cpu", {})
    print(f"## Machine: {cpu.get('brand_raw', '?')}, {cpu.get('count', '?')} cores\n")
    if not limits:
        print("(bench_machine.py was not in this run: no limits to compare with)\n")
        return
    bandwidth = limits.get("test_read_bandwidth", {}).get("gb_per_s", "?")
    gflops = limits.get("test_f32_flops", {}).get("gflops", "?")
    print("| limit | measured |\n|---|---|")
    print(f"| read bandwidth | {bandwidth} GB/s |\n| f32 FLOP rate | {gflops} GFLOP/s |")
    for name, e in sorted(limits.items()):
        if name.startswith("test_cache_bandwidth"):
            per = f"{e['bytes_per_thread'] >> 10} KiB per thread"
            print(f"| L{e['level']} read bandwidth, {e['threads']} thread(s) ({per}) | {e['gb_per_s']} GB/s |")
    print()


def main(path: str) -> None:
    data = json.load(open(path))
    machine_limits(data)
    machine_rows = rows_of(data, MACHINE)
    for bench, module, title, with_limits in REPORTS:
        rows = rows_of(data, bench)
        print(f"## {title} ({bench})\n")
        if not rows:
            print("(not in this run)\n")
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({**data, "benchmarks": (machine_rows if with_limits else []) + rows}, f)
            f.flush()
            importlib.import_module(module).main(f.name)
        print()


if __name__ == "__main__":
    main(sys.argv[1])
