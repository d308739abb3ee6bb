"""What runs the client-library cases (`client_cases_*.py`) against `tinyloop-serve`: a recording proxy, the case
type and its registry, the runner, and what the cases share.

A toy model's answers are not the server's fault; a request the server refuses, or a response a client cannot parse,
is. So each case asserts that the client got a well-formed result in its own objects — a tool call parsed into the
client's tool-call type (and the tool run with the arguments it validated), a structured output validated by the
client against its own model, a stream assembled into the client's message — never that the answer is smart. A
forced tool choice or a structured output is held to its schema by the server's grammar, so those parse; the
schemas bound their strings (`maxLength`) so that every answer ends well within `max_tokens`.

Every client talks to the server through `Recorder`, a pass-through proxy that keeps each exchange, so a failing
case's report shows the exact requests its client sent and what the server answered. `tests/test_clients.py` runs
the cases under pytest, `benches/clients.py` as a table.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Annotated, Any

import httpx
from pydantic import BaseModel, Field

from serverutil import running_server
from tinyloop.server.config import DEFAULT_MODEL

MODEL = "default"
CASE_MODULES = ("client_cases_openai", "client_cases_other")
# instructor is not in the `test` extra: 1.17 pins `jiter<0.15` and `rich<15`, so pip would take openai down from
# 3.63 (which needs jiter>=0.16) to 3.3. It is tried installed with `--no-deps`; its cases skip where it is absent.
OPTIONAL = {"instructor"}
# What the clients read from the environment: no key is needed, and nothing may reach the network — litellm fetches
# its price list at import and openai-agents exports traces unless told not to; Hugging Face's libraries (under
# lm-eval) stay offline.
CLIENT_ENV = {
    "OPENAI_API_KEY": "unused",
    "ANTHROPIC_API_KEY": "unused",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# --- the recording proxy ------------------------------------------------------------------------------------------

_HOP = {"host", "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
_NOT_FORWARDED = _HOP | {"content-length", "accept-encoding"}  # the server then answers uncompressed, as logged
_NOT_RETURNED = _HOP | {"content-length", "content-encoding", "date", "server"}


@dataclass
class Exchange:
    method: str
    path: str
    request: bytes
    status: int = 0
    response: bytearray = field(default_factory=bytearray)

    def describe(self, limit: int = 1500) -> str:
        def cut(text: str) -> str:
            return text if len(text) <= limit else f"{text[: limit // 2]} … {text[-limit // 2 :]}"

        try:
            req = json.dumps(json.loads(self.request), ensure_ascii=False) if self.request else ""
        except ValueError:
            req = self.request.decode(errors="replace")
        resp = bytes(self.response).decode(errors="replace")
        return f"{self.method} {self.path} -> {self.status}\n  request:  {cut(req)}\n  response: {cut(resp)}"


class _Handler(BaseHTTPRequestHandler):
    """Forwards one request to the upstream server and relays its answer, keeping both in an `Exchange`."""

    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() != "chunked":
            n = int(self.headers.get("content-length") or 0)
            return self.rfile.read(n) if n else b""
        data = bytearray()
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            data += self.rfile.read(size)
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
            pass
        return bytes(data)

    def _forward(self) -> None:
        recorder = self.server.recorder
        ex = recorder.add(Exchange(self.command, self.path, self._body()))
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED]
        try:
            url = recorder.upstream + self.path
            with httpx.stream(self.command, url, headers=headers, content=ex.request, timeout=None) as r:
                self._relay(r, ex)
        except (httpx.HTTPError, OSError) as e:
            ex.response += f"[proxy: {type(e).__name__}: {e}]".encode()
            self.close_connection = True

    def _relay(self, r: httpx.Response, ex: Exchange) -> None:
        """The upstream's status and headers, then its body: whole when it had a length, else chunk by chunk as it
        comes (a stream's events reach the client as the server sends them)."""
        ex.status = r.status_code
        self.send_response(r.status_code)
        for k, v in r.headers.multi_items():
            if k.lower() not in _NOT_RETURNED:
                self.send_header(k, v)
        if "content-length" in r.headers:
            data = r.read()
            ex.response += data
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in r.iter_bytes():
                ex.response += chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    recorder: Recorder

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exception(), ConnectionError):  # not a client dropping its idle keep-alive connection
            super().handle_error(request, client_address)


class Recorder:
    """A pass-through HTTP proxy in front of the server at `upstream` that keeps every exchange: the request's body,
    the status, and the response's body (a stream's events as they came, forwarded as they come)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._server.recorder = self
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, name="recorder", daemon=True).start()

    def add(self, ex: Exchange) -> Exchange:
        with self._lock:
            self.exchanges.append(ex)
        return ex

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return self.exchanges[mark:]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- cases and their runner ---------------------------------------------------------------------------------------


@dataclass
class Env:
    recorder: Recorder  # every client is pointed at it
    tmp: Path
    mark: int = 0  # where the running case's exchanges start

    @property
    def base(self) -> str:
        return self.recorder.base

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def streamed(self, path: str) -> list[dict[str, Any]]:
        """The events (`data:` JSON) of the streams the running case's client got from `path`."""
        events = []
        for ex in self.recorder.since(self.mark):
            if ex.path.split("?")[0] == path:
                for line in bytes(ex.response).decode().splitlines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: ") :]))
        return events


CaseFn = Callable[[Env], str]  # raises on failure; returns a short note on what the client got


@dataclass(frozen=True)
class Case:
    client: str
    name: str
    module: str  # the client's import name
    run: CaseFn

    @property
    def id(self) -> str:
        return f"{self.client}: {self.name}"


def registrar(cases: list[Case]) -> Callable[[str, str, str], Callable[[CaseFn], CaseFn]]:
    """A decorator factory, `@case(client, name, module)`, that appends each function it decorates to `cases`."""

    def case(client: str, name: str, module: str) -> Callable[[CaseFn], CaseFn]:
        def register(fn: CaseFn) -> CaseFn:
            cases.append(Case(client, name, module, fn))
            return fn

        return register

    return case


def all_cases() -> list[Case]:
    """Every module's cases, in order."""
    return [c for name in CASE_MODULES for c in importlib.import_module(name).CASES]


@dataclass
class Outcome:
    case: Case
    passed: bool
    note: str  # what the client got, or why it failed (the exception, first line)
    detail: str = ""  # the traceback's last lines, on failure
    exchanges: list[Exchange] = field(default_factory=list)
    seconds: float = 0.0

    def report(self) -> str:
        shown = "\n".join(e.describe() for e in self.exchanges) or "(no request reached the server)"
        return f"{self.case.id}: {self.note}\n{self.detail}\nexchanges:\n{shown}"


def run_case(c: Case, env: Env) -> Outcome:
    """Run one case, keeping the exchanges its client had with the server."""
    env.mark, start = env.recorder.mark(), time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the clients' own deprecation notices are not the server's business
            try:
                note = c.run(env)
            finally:
                gc.collect()  # the clients' connections are finalized here, where their warnings are ignored
        passed, detail = True, ""
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        note = f"{type(e).__name__}: {first}"[:300]
        passed, detail = False, "".join(traceback.format_exception(e)[-6:])
    return Outcome(c, passed, note, detail, env.recorder.since(env.mark), time.perf_counter() - start)


@contextmanager
def client_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in CLIENT_ENV}
    os.environ.update(CLIENT_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def recorded(upstream: str, tmp: Path) -> Iterator[Env]:
    recorder = Recorder(upstream)
    try:
        yield Env(recorder, tmp)
    finally:
        recorder.close()


@contextmanager
def serving(tmp: Path, base: str | None = None) -> Iterator[Env]:
    """The default model's server (or the one at `base`) behind a recorder, with the clients' environment."""
    with client_env():
        if base is not None:
            with recorded(base, tmp) as env:
                yield env
            return
        with running_server(DEFAULT_MODEL) as upstream, recorded(upstream, tmp) as env:
            yield env


# --- what the cases share -----------------------------------------------------------------------------------------

# Schemas: bounded strings and integers, so every grammar-held answer ends well within max_tokens.
City = Annotated[str, Field(max_length=20)]


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: City


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


WEATHER_PROMPT = "What is the weather in Paris?"
PERSON_PROMPT = "Ann is 30 years old. Extract the person."
WEATHER_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 64
TEXT_MAX_TOKENS = 12


def check_person(p: object) -> str:
    assert isinstance(p, Person), f"not a Person: {p!r}"
    return repr(p)[:80]


def check_no_usage_chunk(env: Env) -> None:
    """A stream that did not ask for usage (`stream_options.include_usage`) gets no `choices: []` usage chunk."""
    events = env.streamed("/v1/chat/completions")
    assert events and all(e["choices"] for e in events), [e for e in events if not e["choices"]]
