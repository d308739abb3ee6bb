"""tinyloop on a local Ray cluster, driven end to end: `python tests/ray_scenario.py OUT.json [--fault]`.

Run inside a network namespace of its own (`unshare -rn`, see `in_netns`): Ray's processes listen on more than
loopback, and there nothing but loopback exists. Starts `tinyloop-serve --ray --replicas 2` on the embedded model,
then records, as JSON for tests/test_ray_serve.py and benches/bench_ray_faults.py to judge:

- `families`: one request of each API family through Ray's proxy (values, the replica header);
- `affinity`: 8 interleaved 3-turn conversations — each turn's replica and cached prompt tokens;
- with `--fault`: one replica killed (`ray.kill`, as a crash) while a stream it serves runs and other requests
  wait on it — how the stream ended, what became of the waiting requests, how long until two replicas serve again;
- or, with `--load SECONDS`, only a load run: `--clients` conversations streaming turn after turn, one replica
  killed a third of the way in — every request's outcome, replica and times (benches/bench_ray_faults.py).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

PORT = 8321
BASE = f"http://127.0.0.1:{PORT}"
REPLICA = "x-tinyloop-replica"


def in_netns(argv: list[str]) -> list[str]:
    """`argv` in a new user and network namespace: loopback only (see `loopback_up`)."""
    return ["unshare", "-rn", *argv]


def loopback_up() -> None:
    """A new network namespace starts with `lo` down: bring it up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack("16sh", fcntl.ioctl(s, 0x8913, struct.pack("16sh", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sh", b"lo", flags | 0x1))
    s.close()


def replica_ids() -> set[str]:
    """The live replicas of the `Replica` deployment, by the id `x-tinyloop-replica` reports."""
    import ray

    prefix = "SERVE_REPLICA::tinyloop#Replica#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return {n["name"][len(prefix) :] for n in names if n["name"].startswith(prefix)}


def serve_status() -> dict[str, int]:
    """Replica states of the `Replica` deployment (a second driver on the same cluster)."""
    from ray import serve

    app = serve.status().applications.get("tinyloop")
    if app is None or "Replica" not in app.deployments:
        return {}
    return {str(k): int(v) for k, v in app.deployments["Replica"].replica_states.items()}


def wait_for(cond, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise TimeoutError(what)
        time.sleep(0.25)
    return time.monotonic() - start


def chat(client: httpx.Client, messages: list[dict], **extra) -> tuple[str, dict]:
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": messages, **extra})
    r.raise_for_status()
    return r.headers[REPLICA], r.json()


def families(client: httpx.Client) -> dict:
    """One request per family, with what a test checks of each."""
    out: dict = {}
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    replica, body = chat(client, msgs, max_tokens=6, temperature=0, ignore_eos=True)
    out["chat"] = {"replica": replica, "usage": body["usage"], "content": body["choices"][0]["message"]["content"]}
    complete = {"model": "default", "prompt": "The sea", "max_tokens": 5, "ignore_eos": True}
    r = client.post("/v1/completions", json=complete)
    out["completions"] = {"status": r.status_code, "replica": r.headers.get(REPLICA), "body": r.json()}
    greedy = {"model": "default", "temperature": 0, "stream": True}  # the same output every run
    with client.stream("POST", "/v1/chat/completions", json={**greedy, "messages": msgs, "max_tokens": 6}) as r:
        out["chat_stream"] = {"replica": r.headers.get(REPLICA), "type": r.headers["content-type"], "text": r.read()}
    with client.stream("POST", "/v1/messages", json={**greedy, "max_tokens": 6, "messages": msgs}) as r:
        out["messages_stream"] = {"replica": r.headers.get(REPLICA), "text": r.read()}
    with client.stream("POST", "/v1/responses", json={**greedy, "input": "Hi", "max_output_tokens": 6}) as r:
        out["responses_stream"] = {"replica": r.headers.get(REPLICA), "text": r.read()}
    v0 = {"model": "default", "messages": msgs, "max_tokens": 4, "loops": 2, "ignore_eos": True}
    r = client.post("/api/v0/chat/completions", json=v0)
    out["api_v0"] = {"status": r.status_code, "replica": r.headers.get(REPLICA), "body": r.json()}
    r = client.get("/v1/models")
    out["models"] = {"replica": r.headers.get(REPLICA), "body": r.json()}
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": msgs, "max_tokens": -1})
    out["bad_request"] = {"status": r.status_code, "body": r.json()}
    for key in ("chat_stream", "messages_stream", "responses_stream"):
        out[key]["text"] = out[key]["text"].decode()
    return out


def affinity(client: httpx.Client, conversations: int = 8, turns: int = 3) -> list[list[dict]]:
    """Interleaved multi-turn conversations: per conversation, each turn's replica and cached tokens."""
    history = [
        [{"role": "user", "content": f"Conversation {i}: what do you think of the number {i * 7}?"}]
        for i in range(conversations)
    ]
    record: list[list[dict]] = [[] for _ in range(conversations)]
    for turn in range(turns):
        for i in range(conversations):
            replica, body = chat(client, history[i], max_tokens=8, temperature=0)
            usage = body["usage"]
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            record[i].append({"replica": replica, "cached_tokens": cached, "prompt_tokens": usage["prompt_tokens"]})
            history[i] += [body["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
    return record


def ray_metrics(served: dict[str, int], timeout: float = 120) -> dict[str, float]:
    """`ray_tinyloop_requests_total` from Ray's metrics export, summed per replica label, once it counts for every
    replica at least the requests `served` says it answered (the mirror and Ray's export each lag a few seconds)."""
    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    found: dict[str, float] = {}

    def complete() -> bool:
        found.clear()
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("ray_tinyloop_requests_total{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
                replica = labels.get("replica", "").strip('"')
                found[replica] = found.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return all(found.get(r, 0.0) >= n for r, n in served.items())

    start = time.monotonic()
    while not complete() and time.monotonic() - start < timeout:
        time.sleep(0.5)
    return dict(found)  # complete, or what had arrived at the timeout (the test says which)


def fault(client: httpx.Client) -> dict:
    """Kill the replica serving a running stream while other requests for the same conversation wait on it."""
    import ray

    msgs = [{"role": "user", "content": "Conversation 0: what do you think of the number 0?"}]
    long = {"model": "default", "messages": msgs, "max_tokens": 400, "ignore_eos": True, "stream": True}
    out: dict = {}
    waiting: list[dict] = []

    def follow_up(k: int) -> None:
        t = time.monotonic()
        try:  # long enough to be running, its response not started, when the replica dies
            replica, _ = chat(client, msgs, max_tokens=400, ignore_eos=True, temperature=0)
            waiting.append({"ok": True, "replica": replica, "seconds": time.monotonic() - t})
        except httpx.HTTPError as e:
            waiting.append({"ok": False, "error": repr(e), "seconds": time.monotonic() - t})

    with client.stream("POST", "/v1/chat/completions", json=long) as r:
        victim = r.headers[REPLICA]
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        threads = [threading.Thread(target=follow_up, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the follow-ups are running beside the stream on its replica
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(f"SERVE_REPLICA::tinyloop#Replica#{victim}", namespace="serve"), no_restart=True)
        rest = list(lines)
        out["stream"] = {
            "victim": victim,
            "first": first,
            "last_events": [x for x in rest if x][-3:],
            "seconds_after_kill": time.monotonic() - killed_at,
        }
    for t in threads:
        t.join(timeout=120)
    out["waiting"] = waiting

    def replaced() -> bool:
        ids = replica_ids()
        return victim not in ids and len(ids) == 2 and serve_status().get("RUNNING") == 2

    out["recovered_seconds"] = time.monotonic() - killed_at + wait_for(replaced, 180, "a replacement replica")
    out["replicas_after"] = sorted(replica_ids())
    replica, body = chat(client, msgs, max_tokens=8, temperature=0)
    out["after"] = {"replica": replica, "content": body["choices"][0]["message"]["content"]}
    return out


def _stream_turn(client: httpx.Client, messages: list[dict]) -> dict:
    """One streamed chat turn: its outcome ("ok": ended with [DONE]; "cut": an error event; "failed"), replica,
    start and end times, time to the first token, and the reply."""
    t0, first, reply, outcome, replica, status = time.monotonic(), None, "", "failed", None, None
    body = {"model": "default", "messages": messages, "max_tokens": 120, "stream": True}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            replica, status = r.headers.get(REPLICA), r.status_code
            if r.status_code == 200:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        outcome = "ok" if outcome == "failed" else outcome
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            outcome = "cut"
                            continue
                        for c in event["choices"]:
                            if c["delta"].get("content"):
                                first = first or time.monotonic()
                                reply += c["delta"]["content"]
    except httpx.HTTPError as e:
        replica = replica or repr(e)
    end = time.monotonic()
    return {
        "outcome": outcome,
        "status": status,
        "replica": replica,
        "start": t0,
        "end": end,
        "ttft": (first or end) - t0,
        "reply": reply,
    }


def load(client: httpx.Client, seconds: float, clients: int, kill_at: float) -> dict:
    """`clients` conversations streaming turn after turn for `seconds`; at `kill_at` one replica is killed."""
    import ray

    t0, stop, log = time.monotonic(), time.monotonic() + seconds, []
    lock = threading.Lock()

    def client_loop(i: int) -> None:
        turn, messages = 0, []
        while time.monotonic() < stop:
            if turn % 3 == 0:  # a new conversation every 3 turns (three 120-token replies fit the context)
                messages = [{"role": "user", "content": f"Client {i}, conversation {turn // 3}: tell me a story."}]
            rec = _stream_turn(client, messages)
            with lock:
                log.append({"client": i, **rec})
            messages = [
                *messages,
                {"role": "assistant", "content": rec["reply"]},
                {"role": "user", "content": "Go on."},
            ]
            turn += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(kill_at)
    with lock:
        victim = log[-1]["replica"]
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::tinyloop#Replica#{victim}", namespace="serve"), no_restart=True)

    def replaced() -> bool:
        ids = replica_ids()
        return victim not in ids and len(ids) == 2 and serve_status().get("RUNNING") == 2

    recovered = wait_for(replaced, 180, "a replacement replica") + time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=300)
    new = (replica_ids() - {r["replica"] for r in log if r["start"] < killed_at}).pop()
    first_new = min((r["end"] for r in log if r["replica"] == new), default=None)
    span = [r for r in log if r["start"] < killed_at < r["end"]]
    return {
        "seconds": seconds,
        "clients": clients,
        "victim": victim,
        "kill_at": killed_at - t0,
        "requests": len(log),
        "outcomes": {k: sum(r["outcome"] == k for r in log) for k in ("ok", "cut", "failed")},
        "running_at_kill": {k: sum(r["outcome"] == k for r in span) for k in ("ok", "cut", "failed")},
        "recovered_seconds": recovered,
        "first_answer_from_replacement_seconds": None if first_new is None else first_new - killed_at,
        "by_replica": dict(Counter(r["replica"] for r in log)),
        "ttft_before_kill": _quantiles([r["ttft"] for r in log if r["end"] < killed_at]),
        "ttft_after_kill": _quantiles([r["ttft"] for r in log if r["start"] > killed_at]),
        "log": [
            {k: (round(v - t0, 3) if k in ("start", "end") else v) for k, v in r.items() if k != "reply"} for r in log
        ],
    }


def _quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None  # noqa: E731
    return {"n": len(xs), "p50": pick(0.5), "p90": pick(0.9), "max": pick(1.0)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--fault", action="store_true")
    ap.add_argument("--load", type=float, default=0, metavar="SECONDS", help="a load run of this length instead")
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    loopback_up()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [
        sys.executable,
        "-m",
        "tinyloop.server.cli",
        "--ray",
        "--replicas",
        "2",
        "--threads",
        "1",
        "--port",
        str(PORT),
        "--log-level",
        "warning",
        "--prompt-cache-entries",  # every conversation and family request fits, however the keys fall
        "32",
    ]
    log = args.out.with_suffix(".server.log").open("w")  # Ray's per-request lines would fill a pipe
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    result: dict = {}
    try:
        with httpx.Client(base_url=BASE, timeout=60) as client:
            result["startup_seconds"] = wait_for(lambda: _healthy(client), 240, "the server")
            import ray

            ray.init(address="auto", namespace="serve", log_to_driver=False, _node_ip_address="127.0.0.1")
            wait_for(lambda: serve_status().get("RUNNING") == 2, 120, "two replicas")
            if args.load:
                result["load"] = load(client, args.load, args.clients, kill_at=args.load / 3)
                return 0
            result["families"] = families(client)
            result["affinity"] = affinity(client)
            served = Counter(t["replica"] for c in result["affinity"] for t in c)
            result["metrics"] = {"served_by": dict(served), "requests_by_replica": ray_metrics(served)}
            if args.fault:
                result["fault"] = fault(client)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        result["server_exit"] = server.returncode
        log.close()
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


def _healthy(client: httpx.Client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
