"""tinyloop as a Ray Serve application (`tinyloop.server.ray`): the routing rule on its own, then the whole thing on
a local Ray cluster in a network namespace of its own — every family through Ray's proxy, prefix-affine routing
measured on interleaved conversations, and a replica killed under load (tests/ray_scenario.py drives it)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_scenario import in_netns
from tinyloop.server.ray import AFFINITY_CHARS, PrefixAffinityRouter, affinity_key, lost_stream_event

SCENARIO = Path(__file__).with_name("ray_scenario.py")


def _key(body: dict) -> str | None:
    return affinity_key(json.dumps(body).encode())


def test_every_turn_of_a_conversation_has_its_first_turns_key():
    system = {"role": "system", "content": "You are terse."}
    first = {"role": "user", "content": "Where is the sea?"}
    turns = [
        [system, first],
        [system, first, {"role": "assistant", "content": "West."}, {"role": "user", "content": "?"}],
    ]
    keys = {_key({"model": "m", "messages": t, "max_tokens": n}) for t, n in zip(turns, (5, 9), strict=True)}
    assert len(keys) == 1 and None not in keys
    other = _key({"messages": [system, {"role": "user", "content": "Where is the hill?"}]})
    assert other not in keys
    # Anthropic's system field and the Responses API's instructions are part of the start
    msgs = [first, {"role": "assistant", "content": "West."}, {"role": "user", "content": "And?"}]
    assert _key({"system": "A", "messages": msgs}) == _key({"system": "A", "messages": msgs[:1]})
    assert _key({"system": "A", "messages": msgs}) != _key({"system": "B", "messages": msgs})
    assert _key({"instructions": "A", "input": msgs}) == _key({"instructions": "A", "input": msgs[:1]})


def test_plain_prompts_are_keyed_by_their_first_characters_and_bodies_without_one_by_none():
    long = "x" * AFFINITY_CHARS
    assert _key({"prompt": long + " one"}) == _key({"prompt": long + " two"})
    assert _key({"prompt": "a short prompt"}) != _key({"prompt": "another prompt"})
    assert _key({"input": "hello"}) == _key({"prompt": "hello"})
    for body in (b"not json", b"[1, 2]", json.dumps({"model": "m"}).encode()):
        assert affinity_key(body) is None


def _choose(key: str | None, replicas: list[str]) -> list[list[str]]:
    candidates = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in replicas]
    pending = SimpleNamespace(kwargs={"affinity": key})
    ranks = asyncio.run(PrefixAffinityRouter.choose_replicas(None, candidates, pending))  # type: ignore[arg-type]
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_rendezvous_routing_spreads_keys_and_moves_only_a_lost_replicas():
    replicas = ["r0", "r1", "r2", "r3"]
    homes = {f"key{i}": _choose(f"key{i}", replicas)[0][0] for i in range(2000)}
    shares = Counter(homes.values())
    assert set(shares) == set(replicas) and all(350 < n < 650 for n in shares.values()), shares
    assert all(len(_choose(k, replicas)) == 4 for k in list(homes)[:20])  # every replica ranked, the home first
    survivors = replicas[1:]  # r0 lost: only its keys move
    for key, home in homes.items():
        new = _choose(key, survivors)[0][0]
        assert new == home if home != "r0" else new in survivors
    unkeyed = _choose(None, replicas)
    assert len(unkeyed) == 1 and sorted(unkeyed[0]) == replicas


def test_a_lost_stream_ends_in_its_familys_error_event():
    openai = lost_stream_event("/v1/chat/completions").decode().split("\n\n")
    assert (
        json.loads(openai[0].removeprefix("data: "))["error"]["code"] == "replica_lost" and openai[1] == "data: [DONE]"
    )
    for path, kind in (("/v1/messages", "api_error"), ("/v1/responses", None)):
        event, data = lost_stream_event(path).decode().strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert event == "event: error" and body["type"] == "error"
        assert (body["error"]["type"] == kind) if kind else body["code"] == "server_error"


def _netns_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    if not _netns_available():
        pytest.skip("needs user and network namespaces (unshare -rn): Ray's processes listen beyond loopback")
    out = tmp_path_factory.mktemp("ray") / "scenario.json"
    proc = subprocess.run(
        in_netns([sys.executable, str(SCENARIO), str(out), "--fault"]),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=SCENARIO.parent,
    )
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result


def test_every_family_answers_through_rays_proxy_naming_its_replica(scenario):
    f = scenario["families"]
    replicas = {f[k]["replica"] for k in ("chat", "completions", "chat_stream", "messages_stream", "responses_stream")}
    assert None not in replicas and 1 <= len(replicas) <= 2
    assert f["chat"]["content"] and f["chat"]["usage"]["completion_tokens"] == 6
    assert f["completions"]["status"] == 200 and f["completions"]["body"]["usage"]["completion_tokens"] == 5
    chat = [line for line in f["chat_stream"]["text"].split("\n\n") if line]
    assert f["chat_stream"]["type"].startswith("text/event-stream") and chat[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in chat[:-1]]
    assert "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])
    kinds = [
        line.removeprefix("event: ") for line in f["messages_stream"]["text"].split("\n") if line.startswith("event:")
    ]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    events = [e.split("\n") for e in f["responses_stream"]["text"].split("\n\n") if e]
    last = json.loads(events[-1][1].removeprefix("data: "))
    tokens = last["response"]["usage"]["output_tokens"]  # the model may end before max_output_tokens
    assert events[0][0] == "event: response.created" and 1 <= tokens <= 6
    assert last["type"] == ("response.incomplete" if tokens == 6 else "response.completed")
    assert [m["id"] for m in f["models"]["body"]["data"]] == ["default"] and f["models"]["replica"]
    v0 = f["api_v0"]["body"]
    assert f["api_v0"]["status"] == 200 and v0["stats"]["loops_used"] == 2 and v0["usage"]["completion_tokens"] == 4
    assert f["bad_request"]["status"] == 400 and f["bad_request"]["body"]["error"]["param"] == "max_tokens"


def test_follow_up_turns_return_to_the_replica_holding_their_prefix(scenario):
    conversations = scenario["affinity"]
    follow_ups = [(c[t - 1], c[t]) for c in conversations for t in range(1, len(c))]
    same = sum(prev["replica"] == cur["replica"] for prev, cur in follow_ups)
    reused = sum(cur["cached_tokens"] >= prev["prompt_tokens"] for prev, cur in follow_ups)
    assert same / len(follow_ups) >= 0.9 and reused / len(follow_ups) >= 0.9, conversations


def test_a_killed_replica_cuts_its_streams_cleanly_and_its_waiting_requests_are_retried(scenario):
    fault = scenario["fault"]
    stream = fault["stream"]
    assert stream["last_events"][-1] == "data: [DONE]"
    assert json.loads(stream["last_events"][-2].removeprefix("data: "))["error"]["code"] == "replica_lost"
    assert stream["seconds_after_kill"] < 30
    assert len(fault["waiting"]) == 4 and all(w["ok"] and w["replica"] != stream["victim"] for w in fault["waiting"])
    assert stream["victim"] not in fault["replicas_after"] and len(fault["replicas_after"]) == 2
    assert fault["after"]["content"] and scenario["server_exit"] == 0


def test_each_replicas_metrics_reach_rays_export_labelled_by_replica(scenario):
    """`tinyloop_requests_total` of each replica, mirrored into Ray's metrics export: at least the turns it served."""
    served = Counter(t["replica"] for c in scenario["affinity"] for t in c)
    exported = scenario["metrics"]["requests_by_replica"]
    assert set(served) <= set(exported)
    assert all(exported[r] >= n for r, n in served.items()), (served, exported)


def test_the_documented_config_file_builds_the_application():
    """The `serve run` config in docs/scale-out.md: its import path is the builder, which takes its args."""
    import importlib
    import re

    import yaml
    from ray.serve import Application

    doc = (Path(__file__).parents[1] / "docs" / "scale-out.md").read_text(encoding="utf-8")
    config = yaml.safe_load(re.search(r"```yaml\n(.*?)```", doc, re.S).group(1))
    (app,) = config["applications"]
    module, name = app["import_path"].split(":")
    built = getattr(importlib.import_module(module), name)(app["args"])
    assert isinstance(built, Application) and app["route_prefix"] == "/"
    replica = built._bound_deployment.init_args[0]._bound_deployment  # Ingress(Replica)
    assert replica.name == "Replica" and replica.num_replicas == app["args"]["replicas"]
    assert replica.ray_actor_options["num_cpus"] == app["args"]["num_cpus"]
