"""The long fault run of tinyloop on Ray Serve (the short one is tests/test_ray_serve.py): 8 clients stream
multi-turn conversations through `tinyloop-serve --ray --replicas 2` on the shipped default model for 90 s, and one
replica is killed (`ray.kill`, as a crash) a third of the way in — in a network namespace of its own, loopback only
(tests/ray_scenario.py).

    pytest benches/bench_ray_faults.py --benchmark-json=.benchmarks/ray-faults-bench.json
    TINYLOOP_RAY_SECONDS=30 pytest benches/bench_ray_faults.py        # a shorter run

Writes the figures docs/scale-out.md quotes to `docs/scale_out.json` (every request's outcome, replica and times
to `.benchmarks/ray_faults.json`), with the machine. Fails on any request that failed outright or a stream that did
not end (every stream either completes or ends with the error event), or when no replacement replica served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from ray_scenario import in_netns  # noqa: E402
from reporting import cpu_name  # noqa: E402

SECONDS = float(os.environ.get("TINYLOOP_RAY_SECONDS", "90"))
CLIENTS = 8


def test_kill_a_replica_under_load(benchmark, tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(ROOT / "tests" / "ray_scenario.py"), str(out), "--load", str(SECONDS)]

    def run() -> dict:
        proc = subprocess.run(in_netns(cmd), capture_output=True, text=True, timeout=SECONDS + 600)
        assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
        return json.loads(out.read_text())["load"]

    load = benchmark.pedantic(run, rounds=1, iterations=1)
    (ROOT / ".benchmarks").mkdir(exist_ok=True)
    (ROOT / ".benchmarks" / "ray_faults.json").write_text(json.dumps(load, indent=1), encoding="utf-8")
    summary = {k: v for k, v in load.items() if k != "log"} | {"machine": f"{cpu_name()}, {os.cpu_count()} cores"}
    (ROOT / "docs" / "scale_out.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))
    benchmark.extra_info.update(summary)
    assert load["outcomes"]["failed"] == 0
    assert load["running_at_kill"]["failed"] == 0 and load["first_answer_from_replacement_seconds"] is not None
