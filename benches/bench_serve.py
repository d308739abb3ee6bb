"""Serving under load: n concurrent streaming clients (the official openai SDK, greedy completions) against
`tinyloop-serve` and against `llama_cpp.server` on the unrolled export of the same Q8_0 weights, 2 threads each.
Aggregate generated tokens/s, time to first token p50/p99, and the server's peak RSS.

    pip install 'llama-cpp-python[server]'     # for the llama.cpp rows; tinyloop rows run without it
    pytest benches/bench_serve.py --benchmark-json=.benchmarks/serve.json
    python benches/report_serve.py .benchmarks/serve.json

llama_cpp.server cancels a running stream when another request arrives unless started with
`--interrupt_requests False`, and then serves requests one after another: both configurations are measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_models import CACHE, model_path

TOKENS = 32
CLIENTS = (1, 4, 16)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd(kind: str, port: int) -> list[str]:
    src = model_path("int8")
    if kind == "tinyloop":
        return [
            sys.executable,
            "-m",
            "tinyloop.server.cli",
            "--model",
            str(src),
            "--port",
            str(port),
            "--max-running",
            "16",
            "--log-level",
            "warning",
        ]
    pytest.importorskip("llama_cpp.server")
    from tinyloop.modelfile.export_llama import export_llama

    gguf = CACHE / f"{src.stem}-llama8.gguf"
    if not gguf.exists() or gguf.stat().st_mtime < src.stat().st_mtime:
        export_llama(src, gguf, loops=8, progress=False)
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--n_threads",
        "2",
        "--n_threads_batch",
        "2",
        "--n_ctx",
        "4096",
        "--verbose",
        "False",
    ]
    if kind == "llama.cpp (no interrupt)":
        cmd += ["--interrupt_requests", "False"]
    return cmd


class Server:
    def __init__(self, kind: str):
        self.port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")}
        self.proc = subprocess.Popen(
            _server_cmd(kind, self.port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.base}/v1/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"{kind} server did not start")

    def peak_rss_mb(self) -> float:
        """Sum of the peak RSS of the server process and its descendants (granian serves from a child process)."""
        status = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    status[int(d.name)] = dict(
                        line.split(":", 1) for line in (d / "status").read_text().splitlines() if ":" in line
                    )
                except OSError:
                    continue
        tree, grew = {self.proc.pid}, True
        while grew:
            kids = {p for p, st in status.items() if int(st.get("PPid", "0")) in tree} - tree
            tree |= kids
            grew = bool(kids)
        return sum(int(status[p].get("VmHWM", "0 kB").split()[0]) for p in tree if p in status) / 1024

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _load(base: str, clients: int) -> tuple[int, list[float]]:
    """`clients` concurrent streams of TOKENS greedy tokens; (tokens received, time to first token of each)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    counts, ttfts = [0] * clients, [float("nan")] * clients

    def one(i: int) -> None:
        start = time.perf_counter()
        stream = client.completions.create(
            model="m", prompt=f"The {i} kings of the land", max_tokens=TOKENS, temperature=0, stream=True
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                if counts[i] == 0:
                    ttfts[i] = time.perf_counter() - start
                counts[i] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts), ttfts


@pytest.fixture(scope="module", params=["tinyloop", "llama.cpp", "llama.cpp (no interrupt)"])
def server(request):
    s = Server(request.param)
    s.kind = request.param
    _load(s.base, 1)  # warm up
    yield s
    s.close()


@pytest.mark.parametrize("clients", CLIENTS)
def test_concurrent_streams(benchmark, server, clients):
    results = []
    benchmark.pedantic(lambda: results.append(_load(server.base, clients)), rounds=1, iterations=1)
    received, ttfts = results[-1]
    done = sorted(t for t in ttfts if t == t)
    benchmark.extra_info.update(
        server=server.kind,
        clients=clients,
        received_chunks=received,
        completed_streams=len(done),
        peak_rss_mb=server.peak_rss_mb(),
        ttft_p50=done[len(done) // 2] if done else None,
        ttft_p99=done[min(len(done) - 1, int(0.99 * len(done)))] if done else None,
    )
