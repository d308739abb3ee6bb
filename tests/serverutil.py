"""Start the real `tinyloop-serve` process on a free port and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: Path | str, *extra: str, env: dict[str, str] | None = None, expect_health: int = 200):
    with server_process(model, *extra, env=env, expect_health=expect_health) as (base, _proc, _output):
        yield base


@contextmanager
def server_process(model: Path | str, *extra: str, env: dict[str, str] | None = None, expect_health: int = 200):
    """Like `running_server`, yielding (base URL, the Popen, a function returning the output so far)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tinyloop.server.cli", "--model", str(model), "--port", str(port), *extra]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")} | (env or {})
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def output() -> str:
        log.seek(0)
        return log.read().decode(errors="replace")

    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {output()}")
            try:
                r = httpx.get(f"{base}/health", timeout=1.0)
                if r.status_code == expect_health:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server did not become ready in 60 s: {output()}")
            time.sleep(0.1)
        yield base, proc, output
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
