"""`--models-dir`: every `.tinyloop` under a directory served by its file name, one loaded at a time; a request's
`model` picks one (switching once the requests using the loaded one end), an unknown name is a 404 listing the ids,
and the answers are each model's own."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

import tinyloop
from conftest import TINY
from serverutil import running_server
from tinyloop import SamplingParams
from tinyloop.server import cli

PROMPT = "Which model"


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    (root / "sub").mkdir()
    files = {"alpha": root / "alpha.tinyloop", "beta": root / "beta.tinyloop", "gamma": root / "sub" / "gamma.tinyloop"}
    for seed, path in enumerate(files.values()):
        shutil.copy(model_factory(TINY, seed=seed).path, path)
    (root / "notes.txt").write_text("not a model")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = {name: tinyloop.Engine(path).generate(PROMPT, greedy).text for name, path in files.items()}
    assert len(set(want.values())) == 3  # the models answer differently, so a wrong one would show
    want["beta at loops 3"] = tinyloop.Engine(files["beta"]).generate(PROMPT, greedy, loops=3).text
    return root, want


def complete(base: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_each_model_answers_by_its_name(models):
    root, want = models
    with running_server(root / "alpha.tinyloop", "--models-dir", str(root)) as base:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["alpha", "beta", "gamma"]
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "device": "cpu", "resident": False}
        for name in ("beta", "alpha", "gamma", "gamma", "beta"):
            r = complete(base, name)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[name], name
            assert r.json()["model"] == name
        native = {"prompt": PROMPT, "max_tokens": 8, "loops": 3, "ignore_eos": True}
        native_text = httpx.post(f"{base}/generate", json=native).json()["text"]
        assert native_text == want["beta at loops 3"]  # no model named: the loaded one serves it
        for bad in ("delta", "../alpha", str(root / "alpha.tinyloop"), "alpha.tinyloop"):
            r = complete(base, bad)
            assert r.status_code == 404, bad
            assert r.json()["error"]["param"] == "model" and "alpha, beta, gamma" in r.json()["error"]["message"]


def test_a_switch_waits_for_the_requests_using_the_loaded_model(models):
    root, want = models
    with running_server(root / "alpha.tinyloop", "--models-dir", str(root)) as base:
        assert complete(base, "alpha").status_code == 200
        body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        results: dict[str, str] = {}

        def ask_beta() -> None:
            results["beta"] = complete(base, "beta").json()["choices"][0]["text"]

        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            events.append(next(lines))  # alpha's stream has begun: a request for beta waits for it, then switches
            other = threading.Thread(target=ask_beta)
            other.start()
            events.extend(lines)
        other.join(timeout=60)
        assert results == {"beta": want["beta"]}
        chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
        assert "".join(choice["text"] for c in chunks for choice in c["choices"]) == want["alpha"]


@pytest.mark.parametrize(
    "setup,words",
    [("empty", "no .tinyloop files"), ("twice", "two models are named"), ("named", "--served-model-name")],
)
def test_a_bad_catalog_stops_the_server_from_starting(
    tmp_path, monkeypatch, caplog, capsys, model_factory, setup, words
):
    for var in ("TINYLOOP_MODELS_DIR", "TINYLOOP_SERVED_MODEL_NAME"):
        monkeypatch.setenv(var, "")  # restored after the test: main() sets them
    args = ["--models-dir", str(tmp_path)]
    if setup in ("twice", "named"):
        (tmp_path / "a").mkdir()
        for where in (tmp_path / "m.tinyloop", tmp_path / "a" / ("m.tinyloop" if setup == "twice" else "n.tinyloop")):
            shutil.copy(model_factory(TINY).path, where)
    if setup == "named":
        args += ["--served-model-name", "x"]
    try:
        code = cli.main(args)
    except SystemExit as e:  # settings that do not go together are a usage error
        code = e.code
    assert code == 2 and words in caplog.text + capsys.readouterr().err
