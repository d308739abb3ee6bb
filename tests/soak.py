"""A bounded load soak against a running `tinyloop-serve`: `run_soak(base_url, pid, seconds)`.

`clients` threads (one `httpx.Client` each) loop for `seconds` over a seeded random mix of requests on a fixed list of
prompts — streaming chat, plain and seeded-sampled completions, the speculative and tree-speculative native endpoints,
`/api/v0/completions` with a sliding `cache_window` smaller than the output, native streaming `/generate` — and of
requests the client gives up on: streams closed after 0..8 events (0 = the socket is closed right after the request
is sent, before any byte of the answer is read, half of them with a TCP reset), requests cut off halfway through the
body, and non-streaming requests abandoned by a short read timeout.

Before the soak one client makes every (prompt, request type) request once, in turn: the reference. The speculative
references are checked against plain greedy generation at `verify_loops` (which they must equal, docs/api.md), so a
wrong answer the server gives every time is caught too. Every request in the soak is deterministic (greedy, or sampled
with a fixed seed), so each completed answer must equal its reference, and each cancelled stream must be a prefix of
it; any difference is a wrong output. The driver also counts status
codes (5xx is a failure), transport errors, streams without `data: [DONE]`, samples the server's RSS (VmRSS summed
over `pid` and its descendants: granian serves from a child process) four times a second, and at the end waits for the
`tinyloop_requests_running` / `tinyloop_requests_waiting` gauges to return to 0 and reads `tinyloop_kv_cache_bytes`.

Used by tests/test_soak.py (30 s, tiny model) and benches/bench_soak.py (10 minutes).
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import struct
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from tinyloop.server.runner import TRIM_SECONDS

RSS_INTERVAL = 0.25  # seconds between RSS samples (one costs ~3 ms: a walk of /proc for the server's children)

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "Q: What is 17 times 23?\nA:",
    "日本語 and emoji 👍🏽 in one line:",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "List three colours:\n1.",
    "In 1969, the first",
    "a a a a a a a a",
    "Translate to French: good morning ->",
    "Write a short story about a robot who learns to paint. It begins on a rainy Tuesday, when the robot, whose name "
    "is Unit Seven, finds a box of brushes in the basement of the museum where it sweeps the floors every night.",
]

CACHE_WINDOW = 32

# Request types and their weights in the mix.
COMPARED = [
    "chat_stream",
    "completion",
    "completion_sampled",
    "speculative",
    "tree_speculative",
    "v0_window",
    "generate_stream",
]
MIX = {
    "chat_stream": 2,
    "completion": 2,
    "completion_sampled": 1,
    "speculative": 1.5,
    "tree_speculative": 1.5,
    "v0_window": 1.5,
    "generate_stream": 2,
    "cancel_stream": 2,
    "cancel_nonstream": 1,
}


@dataclass(frozen=True)
class Spec:
    kind: str
    prompt: int
    path: str
    body: dict
    stream: bool


def build_specs(seed: int) -> dict[tuple[str, int], Spec]:
    """One fixed request per (type, prompt); its knobs (max_tokens 8..48, loops, draft sizes, stream or not) drawn
    from `seed`, so the reference pass and the soak send byte-identical bodies."""
    rng = random.Random(f"specs-{seed}")
    specs = {}
    for kind in COMPARED:
        for i, p in enumerate(PROMPTS):
            mt = rng.randint(8, 48)
            if kind == "chat_stream":
                path, stream = "/v1/chat/completions", True
                body = {
                    "model": "soak",
                    "messages": [{"role": "user", "content": p}],
                    "max_tokens": mt,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            elif kind == "completion":
                path, stream = "/v1/completions", False
                body = {"model": "soak", "prompt": p, "max_tokens": mt, "temperature": 0}
            elif kind == "completion_sampled":
                path, stream = "/v1/completions", False
                body = {
                    "model": "soak",
                    "prompt": p,
                    "max_tokens": mt,
                    "temperature": 0.9,
                    "top_p": 0.95,
                    "seed": rng.randint(0, 10_000),
                    "n": rng.choice([1, 2]),
                }
            elif kind in ("speculative", "tree_speculative"):
                path, stream = f"/generate/{kind}", rng.random() < 0.5
                body = {
                    "prompt": p,
                    "max_tokens": mt,
                    "draft_loops": rng.choice([1, 2]),
                    "verify_loops": rng.choice([3, 4, 8]),
                    "draft_ahead": rng.choice([2, 3, 4]),
                    "stream": stream,
                }
                if kind == "tree_speculative":
                    body["K_branches"] = rng.choice([2, 3, 4])
            elif kind == "v0_window":
                path, stream = "/api/v0/completions", False
                mode = rng.choice(["generate", "speculative", "tree_speculative"])
                body = {
                    "model": "soak",
                    "prompt": p,
                    "max_tokens": rng.randint(CACHE_WINDOW + 1, 48),
                    "temperature": 0,
                    "cache_window": CACHE_WINDOW,
                    "mode": mode,
                }
                if mode != "generate":
                    body.update(
                        draft_loops=1,
                        verify_loops=rng.choice([3, 4]),
                        draft_ahead=3,
                        K_branches=2 if mode == "tree_speculative" else 1,
                    )
            elif kind == "generate_stream":
                path, stream = "/generate", True
                body = {"prompt": p, "max_tokens": mt, "loops": rng.choice([2, 3, 8]), "stream": True}
            else:
                raise AssertionError(kind)
            specs[kind, i] = Spec(kind, i, path, body, stream)
    return specs


@dataclass
class Result:
    status: int | None = None  # None: no response (transport error, or abandoned before one)
    output: Any = None  # canonical output of a complete answer
    partial: Any = None  # canonical prefix of a cancelled stream
    done: bool = False  # the stream ended with data: [DONE]
    events: int = 0
    tokens: int = 0  # completion tokens of a complete answer
    error: str | None = None
    body: str | None = None  # the start of a non-200 body


def _stream_output(spec: Spec, events: list[dict]) -> tuple[Any, int]:
    """(canonical output, completion tokens) of a (possibly partial) list of SSE events."""
    if spec.path == "/v1/chat/completions":
        content, finish, tokens = "", None, 0
        for e in events:
            for c in e["choices"]:
                content += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
            if e.get("usage"):
                tokens = e["usage"]["completion_tokens"]
        return (content, finish, tokens), tokens
    ids = [e["token_id"] for e in events if e["token_id"] >= 0]  # native: token events, then token_id -1
    return (ids, "".join(e["text"] for e in events)), len(ids)


def _json_output(spec: Spec, r: dict) -> tuple[Any, int]:
    if "tokens" in r:  # native
        return (r["tokens"], r["text"], r["finish_reason"]), len(r["tokens"])
    choices = tuple((c["text"], c["finish_reason"]) for c in r["choices"])
    return (choices, r["usage"]["completion_tokens"]), r["usage"]["completion_tokens"]


def is_prefix(spec: Spec, partial: Any, full: Any) -> bool:
    if spec.path == "/v1/chat/completions":
        return full[0].startswith(partial[0])
    return full[0][: len(partial[0])] == partial[0] and full[1].startswith(partial[1])


def execute(
    client: httpx.Client, base: str, spec: Spec, cancel_after: int | None = None, timeout: httpx.Timeout | float = 120.0
) -> Result:
    """Send one request; with `cancel_after`, close a stream after that many events."""
    res = Result()
    try:
        if spec.stream:
            with client.stream("POST", base + spec.path, json=spec.body, timeout=timeout) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.body = r.read().decode(errors="replace")[:500]
                    return res
                events: list[dict] = []
                for line in r.iter_lines():
                    if not line:
                        continue
                    if res.done:
                        res.error = f"data after [DONE]: {line[:200]!r}"
                        break
                    if not line.startswith("data: "):
                        res.error = f"not an SSE data line: {line[:200]!r}"
                        break
                    if line == "data: [DONE]":
                        res.done = True
                        continue
                    events.append(json.loads(line[6:]))
                    if cancel_after is not None and len(events) >= cancel_after:
                        break  # leaving the block closes the connection with the answer unread
                res.events = len(events)
                out, tokens = _stream_output(spec, events)
                if res.done:
                    res.output, res.tokens = out, tokens
                else:
                    res.partial = out
        else:
            r = client.post(base + spec.path, json=spec.body, timeout=timeout)
            res.status = r.status_code
            if r.status_code != 200:
                res.body = r.text[:500]
                return res
            res.output, res.tokens = _json_output(spec, r.json())
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        if isinstance(e, httpx.ConnectError):
            time.sleep(0.1)  # no server: do not spin
    except (ValueError, KeyError, TypeError) as e:  # malformed JSON or shape
        res.error = f"bad response: {type(e).__name__}: {e}"
    return res


def abandon_raw(base: str, spec: Spec, rng: random.Random, partial_body: bool) -> None:
    """Send the request (or only its headers and half its body) on a bare socket and close it without reading a
    byte; half the time with SO_LINGER 0, so the server sees a TCP reset instead of a FIN."""
    u = urlsplit(base)
    data = json.dumps(spec.body).encode()
    head = (
        f"POST {spec.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(head + (data[: len(data) // 2] if partial_body else data))
        delay = rng.choice([0.0, 0.0, 0.001, 0.01, 0.05])
        if delay:
            time.sleep(delay)
        if rng.random() < 0.5:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def crosscheck_reference(
    base: str, specs: dict[tuple[str, int], Spec], reference: dict, timeout
) -> tuple[int, list[dict]]:
    """The speculative references against plain greedy generation at verify_loops, which they must equal token for
    token (docs/api.md), windowed ones included: a wrong answer the server gives every time would otherwise pass as
    its own reference. Returns (requests compared, mismatches)."""
    wrong, n = [], 0
    with httpx.Client() as c:
        for (kind, i), spec in specs.items():
            b = spec.body
            if (kind, i) not in reference or not (
                kind in ("speculative", "tree_speculative") or b.get("mode", "generate") != "generate"
            ):
                continue
            if kind == "v0_window":
                plain = Spec(
                    kind,
                    i,
                    spec.path,
                    {
                        "model": "soak",
                        "prompt": b["prompt"],
                        "max_tokens": b["max_tokens"],
                        "temperature": 0,
                        "cache_window": b["cache_window"],
                        "loops": b["verify_loops"],
                    },
                    False,
                )
            else:
                plain = Spec(
                    kind,
                    i,
                    "/generate",
                    {"prompt": b["prompt"], "max_tokens": b["max_tokens"], "loops": b["verify_loops"]},
                    False,
                )
            r = execute(c, base, plain, timeout=timeout)
            n += 1
            got, want = r.output, reference[kind, i]
            same = got is not None and (got[0] == want[0] if kind == "v0_window" else got[:2] == want[:2])
            if not same:
                wrong.append(
                    {
                        "type": "crosscheck",
                        "request": f"{spec.path} {_short(b)}",
                        "plain": f"{plain.path} {_short(plain.body)}",
                        "expected (plain)": _short(got),
                        "got": _short(want),
                        "status": r.status,
                        "error": r.error,
                    }
                )
    return n, wrong


def tree_rss_kib(pid: int) -> int:
    """VmRSS of `pid` and all its descendants, in KiB (0 once the process is gone)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        p = int(d.name)
        parents[p] = int(fields.get("PPid", "0"))
        rss[p] = int(fields.get("VmRSS", "0 kB").split()[0])  # kernel threads have no VmRSS
    tree, frontier = {pid}, {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - tree
        tree |= frontier
    return sum(rss.get(p, 0) for p in tree)


def metrics(client: httpx.Client, base: str) -> dict:
    try:
        return client.get(f"{base}/metrics/json", timeout=10).json()
    except httpx.TransportError:  # an idle keep-alive connection the server closed: once more on a new one
        return client.get(f"{base}/metrics/json", timeout=10).json()


def _server_5xx(snapshot: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in snapshot.get("tinyloop_requests_total", []):
        if s["labels"]["status"].startswith("5"):
            key = f"{s['labels']['endpoint']} {s['labels']['status']}"
            out[key] = out.get(key, 0) + s["value"]
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


MAX_DETAILS = 20


@dataclass
class _Problems:
    """A count, and the first MAX_DETAILS instances in full (a dead server makes thousands of errors)."""

    total: int = 0
    items: list = field(default_factory=list)

    def add(self, item: dict) -> None:
        self.total += 1
        if len(self.items) < MAX_DETAILS:
            self.items.append(item)


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    count: Counter = field(default_factory=Counter)
    completed: Counter = field(default_factory=Counter)
    cancelled: Counter = field(default_factory=Counter)
    status: Counter = field(default_factory=Counter)
    durations: dict = field(default_factory=lambda: defaultdict(list))
    tokens: int = 0
    wrong: _Problems = field(default_factory=_Problems)
    errors: _Problems = field(default_factory=_Problems)  # transport errors, malformed answers (not cancelled ones)
    unexpected_status: _Problems = field(default_factory=_Problems)
    missing_done: _Problems = field(default_factory=_Problems)
    cancel_errors: Counter = field(default_factory=Counter)  # transport errors where the client gave up: expected


def _short(x: Any, n: int = 300) -> str:
    s = json.dumps(x, ensure_ascii=False) if not isinstance(x, str) else x
    return s if len(s) <= n else s[:n] + "…"


def _problem(kind: str, spec: Spec, **details: Any) -> dict:
    """A report entry for one request: its type, path and shortened body, then `details` in the order given."""
    return {"type": kind, "request": f"{spec.path} {_short(spec.body)}", **details}


def _mib(kib: float) -> float:
    return round(kib / 1024, 2)


def _reference_pass(
    base: str, specs: dict[tuple[str, int], Spec], timeout: httpx.Timeout
) -> tuple[dict[tuple[str, int], Any], list[dict]]:
    """Every (type, prompt) request once, in turn, from one client, so that no other request can influence the
    answers the soak's are compared with. Returns (output by (type, prompt), the requests that failed)."""
    reference: dict[tuple[str, int], Any] = {}
    errors = []
    with httpx.Client() as c:
        for key, spec in specs.items():
            r = execute(c, base, spec, timeout=timeout)
            if r.status == 200 and r.output is not None:
                reference[key] = r.output
            else:
                errors.append(
                    {
                        "request": f"{spec.path} {_short(spec.body)}",
                        "status": r.status,
                        "error": r.error,
                        "body": r.body,
                        "done": r.done,
                    }
                )
    return reference, errors


class _Clients:
    """What the soak's client threads share: the requests, their reference answers, and the tally they count into
    (under its lock)."""

    def __init__(
        self,
        base: str,
        timeout: httpx.Timeout,
        specs: dict[tuple[str, int], Spec],
        reference: dict[tuple[str, int], Any],
        tally: _Tally,
    ) -> None:
        self.base, self.timeout, self.specs, self.reference, self.tally = base, timeout, specs, reference, tally
        self.streaming = [s for s in specs.values() if s.stream]
        self.non_streaming = [s for s in specs.values() if not s.stream]

    def one(self, c: httpx.Client, rng: random.Random) -> None:
        """Send one request of a type drawn from MIX and count what came of it."""
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
        started = time.perf_counter()
        if kind == "cancel_stream":
            self._cancel_stream(c, rng, kind, started)
        elif kind == "cancel_nonstream":
            self._cancel_nonstream(c, rng, kind, started)
        else:
            spec = self.specs[kind, rng.randrange(len(PROMPTS))]
            res = execute(c, self.base, spec, timeout=self.timeout)
            self._record(kind, spec, res, started, error_events=True)

    def _cancel_stream(self, c: httpx.Client, rng: random.Random, kind: str, started: float) -> None:
        spec = rng.choice(self.streaming)
        after = rng.choice([0, 0, 1, 2, 3, 5, 8])
        if after == 0:  # httpx returns a stream only once the headers are in: closing before them takes a socket
            self._abandon_before_answer(rng, kind, spec)
            return
        res = execute(c, self.base, spec, cancel_after=after, timeout=self.timeout)
        self._record(kind, spec, res, started, cancel_after=after)

    def _abandon_before_answer(self, rng: random.Random, kind: str, spec: Spec) -> None:
        partial_body = rng.random() < 0.2
        try:
            abandon_raw(self.base, spec, rng, partial_body)
            err = None
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        with self.tally.lock:
            self.tally.count[kind] += 1
            if err:  # connecting or sending failed: the server was not reachable
                self.tally.errors.add({"type": kind, "request": spec.path, "error": err})
            else:
                self.tally.cancelled["partial_request" if partial_body else "stream_before_first_byte"] += 1

    def _cancel_nonstream(self, c: httpx.Client, rng: random.Random, kind: str, started: float) -> None:
        spec = rng.choice(self.non_streaming)
        res = execute(c, self.base, spec, timeout=httpx.Timeout(rng.uniform(0.005, 0.3), connect=10.0))
        if isinstance(res.error, str) and res.error.startswith(("ReadTimeout", "WriteTimeout")):
            # The client gave up, as this request type means to: an expected error, and no status to count.
            with self.tally.lock:
                self.tally.count[kind] += 1
                self.tally.cancelled["nonstream_timeout"] += 1
                self.tally.cancel_errors[res.error.split(":")[0]] += 1
            return
        self._record(kind, spec, res, started)  # it finished within the timeout, or failed otherwise

    def _record(
        self,
        kind: str,
        spec: Spec,
        res: Result,
        started: float,
        *,
        cancel_after: int | None = None,
        error_events: bool = False,
    ) -> None:
        """Count a request whose answer the client read: whole, or with `cancel_after`, a stream up to that many
        events. `error_events` adds the number of events read to a transport error's entry."""
        t = self.tally
        with t.lock:
            t.count[kind] += 1
            t.status[str(res.status)] += 1
            complete = False
            if res.status not in (None, 200):
                t.unexpected_status.add(_problem(kind, spec, status=res.status, body=res.body, error=res.error))
            elif res.error:
                t.errors.add(_problem(kind, spec, error=res.error, **({"events": res.events} if error_events else {})))
            elif spec.stream and not res.done:
                if cancel_after is not None and res.events >= cancel_after:
                    t.cancelled["stream_after_events"] += 1
                else:  # fewer events than the client waited for, and no [DONE]: the server cut the stream short
                    t.missing_done.add(_problem(kind, spec, events=res.events))
            else:  # complete; for a stream to cancel, one shorter than `cancel_after` events
                complete = True
                t.completed[kind] += 1
                t.tokens += res.tokens
                t.durations[kind].append(time.perf_counter() - started)
            # What a cancelled stream did read must be a prefix of the reference whatever else went wrong; other
            # answers are compared only when complete (a failed one is already counted as a failure).
            if complete or cancel_after is not None:
                self._check(kind, spec, res)

    def _check(self, kind: str, spec: Spec, res: Result) -> None:
        """Compare a complete or partial answer with the reference (caller holds the lock)."""
        want = self.reference.get((spec.kind, spec.prompt))
        if want is None:
            return
        if res.output is not None and res.output != want:
            self.tally.wrong.add(_problem(kind, spec, expected=_short(want), got=_short(res.output)))
        elif res.output is None and res.partial is not None and not is_prefix(spec, res.partial, want):
            self.tally.wrong.add(
                _problem(kind, spec, events=res.events, **{"expected prefix of": _short(want)}, got=_short(res.partial))
            )


def _sample(
    rss: list[tuple[float, int]],
    start: float,
    seconds: float,
    pid: int,
    tally: _Tally,
    stop: threading.Event,
    progress: bool,
) -> None:
    """Append (seconds since `start`, server RSS in KiB) to `rss` every `RSS_INTERVAL` until `stop` is set; with
    `progress`, show a tqdm bar with the request and problem counts so far."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=round(seconds), unit="s", desc="soak", leave=True)
    shown = 0
    while True:
        now = time.perf_counter() - start
        rss.append((now, tree_rss_kib(pid)))
        if bar is not None:
            step = min(round(seconds), int(now)) - shown
            if step > 0:
                bar.update(step)
                shown += step
            with tally.lock:
                bad = tally.wrong.total + tally.errors.total + tally.unexpected_status.total + tally.missing_done.total
                bar.set_postfix(
                    requests=sum(tally.count.values()), rss_mib=round(rss[-1][1] / 1024, 1), problems=bad, refresh=False
                )
        if stop.wait(RSS_INTERVAL):
            break
    if bar is not None:
        bar.close()


def _run_clients(
    clients: _Clients, n: int, seconds: float, seed: int, pid: int, progress: bool
) -> tuple[float, list[tuple[float, int]]]:
    """`n` client threads sending requests for `seconds` while the server's RSS is sampled. Returns (elapsed
    seconds, RSS samples as (seconds since start, KiB))."""
    start = time.perf_counter()
    deadline = start + seconds
    stop = threading.Event()
    rss: list[tuple[float, int]] = []

    def client_loop(i: int) -> None:
        rng = random.Random(f"client-{seed}-{i}")
        with httpx.Client() as c:
            while time.perf_counter() < deadline:
                try:
                    clients.one(c, rng)
                except Exception as e:
                    with clients.tally.lock:
                        clients.tally.errors.add({"type": "driver", "error": f"{type(e).__name__}: {e}"})

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"soak-client-{i}") for i in range(n)]
    sampling = threading.Thread(
        target=_sample, args=(rss, start, seconds, pid, clients.tally, stop, progress), name="soak-rss", daemon=True
    )
    sampling.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    stop.set()
    sampling.join()
    return elapsed, rss


def _drain(control: httpx.Client, base: str, drain_timeout: float) -> tuple[bool, float, dict, str | None]:
    """Wait for every request the server still holds (abandoned ones included) to leave. Returns (drained, seconds
    waited, the last metrics snapshot ({} if none was read), the error that ended the wait early)."""
    start = time.perf_counter()
    zero_reads, snap, error = 0, {}, None
    while time.perf_counter() - start < drain_timeout:
        try:
            snap = metrics(control, base)
        except (httpx.HTTPError, ValueError) as e:  # the server is gone: the report says so
            error = f"{type(e).__name__}: {e}"
            break
        if snap.get("tinyloop_requests_running") == 0 and snap.get("tinyloop_requests_waiting") == 0:
            zero_reads += 1
            if zero_reads == 2:  # twice, 0.25 s apart: not a moment between a retire and the next admit
                break
        else:
            zero_reads = 0
        time.sleep(0.25)
    return zero_reads == 2, time.perf_counter() - start, snap, error


def _counts_report(tally: _Tally, elapsed: float, before: dict, after: dict) -> dict:
    """The report's request counts, problems and token rates (`before`/`after`: the server's metrics around the
    soak; `after` is {} when the server could not be read)."""
    server_tokens = (
        after["tinyloop_generation_tokens_total"] - before["tinyloop_generation_tokens_total"] if after else None
    )
    server_5xx = {k: v - _server_5xx(before).get(k, 0) for k, v in _server_5xx(after).items()}
    d = tally.durations
    return {
        "requests": sum(tally.count.values()),
        "completed": sum(tally.completed.values()),
        "by_type": {
            k: {
                "requests": tally.count[k],
                "completed": tally.completed[k],
                "p50_s": _pct(d[k], 0.5),
                "p99_s": _pct(d[k], 0.99),
                "max_s": round(max(d[k]), 4) if d[k] else None,
            }
            for k in MIX
        },
        "cancelled": dict(tally.cancelled),
        "cancelled_transport_errors": dict(tally.cancel_errors),
        "status_codes": dict(tally.status),
        "5xx": sum(n for s, n in tally.status.items() if s.startswith("5")),
        "server_5xx": {k: v for k, v in server_5xx.items() if v},
        "wrong_outputs": tally.wrong.total,
        "wrong": tally.wrong.items,
        "transport_errors": tally.errors.total,
        "errors": tally.errors.items,
        "unexpected_status": tally.unexpected_status.total,
        "unexpected_status_details": tally.unexpected_status.items,
        "missing_done": tally.missing_done.total,
        "missing_done_details": tally.missing_done.items,
        "completion_tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / elapsed, 1),
        "server_generated_tokens": server_tokens,
        "server_tokens_per_s": round(server_tokens / elapsed, 1) if server_tokens is not None else None,
    }


def _rss_report(rss: list[tuple[float, int]], elapsed: float, rss_after_drain: int) -> dict:
    """The report's RSS figures. Growth is measured from the end of a warm-up (the first 20% of the soak), by
    which time caches and pools have reached their working size, as the change between two levels: the median of
    the samples in a window right after warm-up and of those in a window at the end. RSS goes up and down by 10-20
    MiB from one second to the next: freed memory stays with the process until the engine loop hands it back, which
    it does every `TRIM_SECONDS` under load, so the samples draw a saw-tooth of that period. A window is a tenth of
    the soak, and never shorter than one period, so that each level covers whole teeth whatever their phase; a
    shorter window (3 s of a 30 s soak) can catch the top of one tooth and the foot of another and report a growth
    that is only the saw."""
    soak_rss = [v for _, v in rss]
    window = max(elapsed / 10, TRIM_SECONDS)

    def level(lo: float, hi: float) -> int:
        values = [v for t, v in rss if lo <= t < hi]
        return int(statistics.median(values)) if values else soak_rss[-1]

    warm, end = level(0.2 * elapsed, 0.2 * elapsed + window), level(elapsed - window, elapsed + 1)
    step = max(1, len(rss) // 120)  # about 120 samples, whatever the length of the soak
    return {
        "rss_mib": {
            "start": _mib(soak_rss[0]),
            "warmup_end": _mib(warm),
            "end": _mib(end),
            "max": _mib(max(soak_rss)),
            "after_drain": _mib(rss_after_drain),
        },
        "rss_change_after_warmup": round((end - warm) / warm, 4) if warm else None,
        "rss_samples_mib": [(round(t, 1), _mib(v)) for t, v in rss[::step]],
        "server_gone": rss_after_drain == 0,
    }


def run_soak(
    base_url: str,
    pid: int,
    seconds: float,
    clients: int = 16,
    seed: int = 0,
    progress: bool = False,
    request_timeout: float = 120.0,
    drain_timeout: float = 60.0,
) -> dict:
    """Run the soak and return its report (see the module docstring). `progress` shows a tqdm bar;
    `request_timeout` is the longest wait for any byte of an answer before it counts as a transport error (a hang),
    `drain_timeout` the longest wait for the gauges to return to 0 at the end."""
    base = base_url.rstrip("/")
    timeout = httpx.Timeout(request_timeout, connect=10.0)
    specs = build_specs(seed)
    control = httpx.Client(timeout=10)

    t0 = time.perf_counter()
    reference, reference_errors = _reference_pass(base, specs, timeout)
    crosschecks, crosscheck_wrong = crosscheck_reference(base, specs, reference, timeout)
    reference_s = time.perf_counter() - t0

    tally = _Tally()
    for w in crosscheck_wrong:
        tally.wrong.add(w)
    before = metrics(control, base)
    elapsed, rss = _run_clients(_Clients(base, timeout, specs, reference, tally), clients, seconds, seed, pid, progress)
    drained, drain_s, after, drain_error = _drain(control, base, drain_timeout)
    rss_after_drain = tree_rss_kib(pid)
    control.close()

    return {
        "seconds": seconds,
        "elapsed_s": round(elapsed, 2),
        "clients": clients,
        "seed": seed,
        **_counts_report(tally, elapsed, before, after),
        **_rss_report(rss, elapsed, rss_after_drain),
        "drained": drained,
        "drain_s": round(drain_s, 2),
        "drain_error": drain_error,
        "final_gauges": {
            "tinyloop_requests_running": after.get("tinyloop_requests_running"),
            "tinyloop_requests_waiting": after.get("tinyloop_requests_waiting"),
            "tinyloop_kv_cache_bytes": after.get("tinyloop_kv_cache_bytes"),
        },
        "reference": {
            "requests": len(specs),
            "crosschecks": crosschecks,
            "crosscheck_mismatches": len(crosscheck_wrong),
            "seconds": round(reference_s, 2),
            "errors": reference_errors,
        },
    }


def summary(report: dict) -> str:
    """A few lines for a terminal."""
    r = report
    lines = [
        f"{r['requests']} requests in {r['elapsed_s']} s from {r['clients']} clients ({r['completed']} completed, "
        f"cancelled {r['cancelled']}); {r['completion_tokens']} tokens in completed answers = "
        f"{r['tokens_per_s']} tok/s, server generated {r['server_generated_tokens']} = "
        f"{r['server_tokens_per_s']} tok/s",
        f"status {r['status_codes']}; 5xx {r['5xx']} (server counted {r['server_5xx'] or 0}); wrong outputs "
        f"{r['wrong_outputs']}; transport errors {r['transport_errors']}; unexpected status {r['unexpected_status']}; "
        f"streams without [DONE] {r['missing_done']}",
        f"RSS MiB start {r['rss_mib']['start']}, after warm-up {r['rss_mib']['warmup_end']}, "
        f"end {r['rss_mib']['end']}, max {r['rss_mib']['max']}, after drain {r['rss_mib']['after_drain']}; "
        f"change after warm-up {100 * (r['rss_change_after_warmup'] or 0):+.2f}%",
        f"drained in {r['drain_s']} s: {r['final_gauges']}; reference pass {r['reference']['requests']} requests in "
        f"{r['reference']['seconds']} s, {len(r['reference']['errors'])} errors; {r['reference']['crosschecks']} "
        f"speculative references checked against plain generation, {r['reference']['crosscheck_mismatches']} differ",
    ]
    for k, v in r["by_type"].items():
        lines.append(
            f"  {k:<20} {v['requests']:>6} requests {v['completed']:>6} completed  p50 {v['p50_s']} s  "
            f"p99 {v['p99_s']} s  max {v['max_s']} s"
        )
    return "\n".join(lines)
