"""The 10-minute load soak (tests/soak.py; the 30-second version is tests/test_soak.py): 16 concurrent clients on
loopback against `tinyloop-serve`, on the shipped default model and on a tiny random model, one server per model.

    pytest benches/bench_soak.py --benchmark-json=.benchmarks/soak-bench.json
    TINYLOOP_SOAK_SECONDS=60 pytest benches/bench_soak.py -k tiny      # a shorter run, one model

Each run prints its figures (docs/reliability.md has the table) and writes the whole report — counts per request
type, status codes, wrong outputs, errors, tokens/s, RSS samples, the gauges after draining — to
`.benchmarks/soak.json` (TINYLOOP_SOAK_JSON to change it; reports of other models already there are kept), with the
machine it ran on. Environment: TINYLOOP_SOAK_SECONDS (default 600), TINYLOOP_SOAK_CLIENTS (16),
TINYLOOP_SOAK_SEED (0). A run fails, after writing its figures, on any 5xx, wrong output, transport error,
unexpected status, stream without [DONE], gauges that do not return to 0, or RSS that grows by more than 5% after
warm-up (between the median levels of a window right after warm-up and of one at the end, tests/soak.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import tinyloop
from tinyloop.modelfile.format import random_weights, write_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serverutil import server_process  # noqa: E402
from shapes import TINY as TINY_TEST  # noqa: E402
from soak import run_soak, summary  # noqa: E402

SECONDS = float(os.environ.get("TINYLOOP_SOAK_SECONDS", "600"))
CLIENTS = int(os.environ.get("TINYLOOP_SOAK_CLIENTS", "16"))
SEED = int(os.environ.get("TINYLOOP_SOAK_SEED", "0"))
OUT = Path(os.environ.get("TINYLOOP_SOAK_JSON", str(ROOT / ".benchmarks" / "soak.json")))
DEFAULT_MODEL = ROOT / "python" / "tinyloop" / "models" / "default.tinyloop"
# tests/shapes.py's TINY with room for the soak's prompts + 48 tokens.
TINY = dataclasses.replace(TINY_TEST, context_length=512, name="tiny-soak")


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    mem = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory": mem,
        "python": platform.python_version(),
        "tinyloop": tinyloop.__version__,
        "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


@pytest.fixture(scope="session")
def model_paths(tmp_path_factory) -> dict[str, Path]:
    tiny = tmp_path_factory.mktemp("soak") / "tiny-soak.tinyloop"
    write_model(tiny, TINY, random_weights(TINY, seed=0), weight_type="F32")
    return {"default": DEFAULT_MODEL, "tiny": tiny}


def save(model: str, report: dict) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data.setdefault("runs", {})[model] = report
    OUT.write_text(json.dumps(data, indent=1, ensure_ascii=False))


@pytest.mark.parametrize("model", ["default", "tiny"])
def test_soak(benchmark, model_paths, model, capsys):
    path = model_paths[model]
    with server_process(path) as (base, proc, output):
        with capsys.disabled():
            print(f"\nsoak: {model} model ({path.name}), {SECONDS:g} s, {CLIENTS} clients, seed {SEED}")
            report = benchmark.pedantic(
                lambda: run_soak(base, proc.pid, SECONDS, clients=CLIENTS, seed=SEED, progress=True),
                rounds=1,
                iterations=1,
            )
        log = output()
    report["model"] = {"name": model, "path": str(path), "bytes": path.stat().st_size}
    report["machine"] = machine()
    report["server_tracebacks"] = log.count("Traceback")
    if report["server_tracebacks"]:
        report["server_log_tail"] = log[-8000:]
    save(model, report)
    with capsys.disabled():
        print(summary(report))
        print(f"written to {OUT}")
    benchmark.extra_info.update(
        model=model,
        seconds=SECONDS,
        clients=CLIENTS,
        requests=report["requests"],
        completed=report["completed"],
        tokens_per_s=report["tokens_per_s"],
        server_tokens_per_s=report["server_tokens_per_s"],
        fivexx=report["5xx"],
        wrong_outputs=report["wrong_outputs"],
        transport_errors=report["transport_errors"],
        missing_done=report["missing_done"],
        rss_mib=report["rss_mib"],
        rss_change_after_warmup=report["rss_change_after_warmup"],
        final_gauges=report["final_gauges"],
    )

    assert report["reference"]["errors"] == []
    assert report["5xx"] == 0 and report["server_5xx"] == {}
    assert report["wrong_outputs"] == 0 and report["transport_errors"] == 0 and report["unexpected_status"] == 0
    assert report["missing_done"] == 0 and report["drained"]
    assert report["final_gauges"] == {
        "tinyloop_requests_running": 0,
        "tinyloop_requests_waiting": 0,
        "tinyloop_kv_cache_bytes": 0,
    }
    assert report["server_tracebacks"] == 0
    # RSS flat within 5% after warm-up (medians of a window after warm-up and of one at the end, tests/soak.py).
    assert report["rss_change_after_warmup"] <= 0.05, report["rss_mib"]
