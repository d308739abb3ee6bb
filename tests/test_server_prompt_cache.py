"""Prompt reuse through the server: every API family reports the reused prompt tokens in its own usage shape, the
answers equal a server's without the cache, and `--prompt-cache-disk` carries prefixes across a restart."""

from __future__ import annotations

from itertools import pairwise

import anthropic
import httpx
import openai
import pytest

from serverutil import running_server, server_process

TURN = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("prompt-cache")


@pytest.fixture(scope="module")
def servers(tiny, disk):
    """(with the prompt cache and a directory, without the prompt cache)."""
    with (
        running_server(tiny.path, "--prompt-cache-disk", str(disk)) as cached,
        running_server(tiny.path, "--no-prompt-cache") as plain,
    ):
        yield cached, plain


def _chat(base: str, messages: list[dict]) -> tuple[str, int, int]:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="x") as c:
        r = c.chat.completions.create(model="m", messages=messages, **TURN)
    assert r.usage.prompt_tokens_details is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def _conversation(base: str) -> list[tuple[str, int, int]]:
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me of ships."}]
    turns = []
    for ask in ["And the sea?", "And the harbour at night?"]:
        turns.append(_chat(base, messages))
        messages += [{"role": "assistant", "content": turns[-1][0]}, {"role": "user", "content": ask}]
    turns.append(_chat(base, messages))
    return turns


def test_chat_turns_reuse_the_conversation_and_answer_the_same(servers):
    cached, plain = servers
    hits, misses = _conversation(cached), _conversation(plain)
    assert [t[0] for t in hits] == [t[0] for t in misses]
    assert [t[1] for t in hits] == [t[1] for t in misses]  # prompt_tokens counts the whole prompt either way
    assert hits[0][2] == 0 and all(t[2] == 0 for t in misses)
    for (_, prev_prompt, _), (_, prompt, reused) in pairwise(hits):
        assert prev_prompt <= reused < prompt  # at least the previous turn's prompt; never the last token


def test_every_family_reports_reuse_in_its_own_shape(servers):
    cached, _ = servers
    text = "The ship sailed out of the harbour and the sea was calm. " * 3
    with openai.OpenAI(base_url=f"{cached}/v1", api_key="x") as c:
        first = c.completions.create(model="m", prompt=text, **TURN)
        second = c.completions.create(model="m", prompt=text + first.choices[0].text + " Then", **TURN)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert first.usage.prompt_tokens <= second.usage.prompt_tokens_details.cached_tokens
        items: list = [{"role": "user", "content": text}]
        r1 = c.responses.create(model="m", input=items, temperature=0, max_output_tokens=8)
        items += [{"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Go on."}]
        r2 = c.responses.create(model="m", input=items, temperature=0, max_output_tokens=8)
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
        assert r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens
    with anthropic.Anthropic(base_url=cached, api_key="x") as a:
        msgs = [{"role": "user", "content": "About winds. " + text}]  # a prompt no earlier request began with
        one = a.messages.create(model="m", max_tokens=8, messages=msgs)
        two_msgs = [*msgs, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Go on."}]
        two = a.messages.create(model="m", max_tokens=8, messages=two_msgs)
        with a.messages.stream(model="m", max_tokens=8, messages=two_msgs) as s:
            streamed = s.get_final_message()
    assert one.usage.cache_read_input_tokens <= 2  # only the template's opening "User:" matches an earlier prompt
    assert two.usage.cache_read_input_tokens >= one.usage.input_tokens
    assert two.usage.cache_creation_input_tokens == 0
    # The same prompt again, streamed: the split arrives with message_delta, and the SDK's final message has it.
    total = two.usage.input_tokens + two.usage.cache_read_input_tokens
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == total
    assert streamed.usage.cache_read_input_tokens == total - 1
    body = {"model": "m", "messages": two_msgs, **TURN}
    stats = httpx.post(f"{cached}/api/v0/chat/completions", json=body, timeout=30).json()["stats"]
    assert stats["cached_tokens"] == stats["prompt_tokens"] - 1
    metrics = httpx.get(f"{cached}/metrics", timeout=10).text
    reused = next(line for line in metrics.splitlines() if line.startswith("tinyloop_prompt_cached_tokens_total"))
    assert float(reused.split()[-1]) > 0
    assert "tinyloop_prompt_cache_entries " in metrics


def test_a_restart_finds_the_prefixes_on_disk(tiny, disk, servers):
    """The module's cached server wrote its prefixes to `disk`; a new server on the same directory reuses them."""
    cached, plain = servers
    messages = [{"role": "user", "content": "Name three winds."}]
    answer, _, _ = _chat(cached, messages)
    follow = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And a fourth?"}]
    assert [p for p in disk.iterdir() if p.suffix == ".tlpc"]
    with running_server(tiny.path, "--prompt-cache-disk", str(disk)) as restarted:
        text, prompt, reused = _chat(restarted, follow)
    assert 0 < reused < prompt
    assert text == _chat(plain, follow)[0]


def test_flags_and_environment_configure_the_cache(monkeypatch, capsys):
    from tinyloop.server.cli import parse
    from tinyloop.server.config import ServerConfig

    args = parse(["--prompt-cache-mib", "64", "--prompt-cache-entries", "2", "--prompt-cache-disk", "/tmp/pc"])
    assert (args.prompt_cache_mib, args.prompt_cache_entries, str(args.prompt_cache_disk)) == (64, 2, "/tmp/pc")
    assert parse(["--no-prompt-cache"]).no_prompt_cache is True
    with pytest.raises(SystemExit) as e:
        parse(["--prompt-cache-mib", "0"])
    assert e.value.code == 2 and "prompt-cache-mib" in capsys.readouterr().err
    defaults = ServerConfig.from_env().engine_options()
    assert (defaults["prompt_cache_mib"], defaults["prompt_cache_entries"], defaults["prompt_cache_disk"]) == (
        256,
        4,
        None,
    )
    monkeypatch.setenv("TINYLOOP_PROMPT_CACHE_DISK", "/tmp/pc")
    monkeypatch.setenv("TINYLOOP_PROMPT_CACHE_DISK_MIB", "10")
    monkeypatch.setenv("TINYLOOP_PROMPT_CACHE_ENTRIES", "7")
    opts = ServerConfig.from_env().engine_options()
    assert (opts["prompt_cache_entries"], opts["prompt_cache_disk"], opts["prompt_cache_disk_mib"]) == (
        7,
        "/tmp/pc",
        10,
    )
    monkeypatch.setenv("TINYLOOP_NO_PROMPT_CACHE", "1")
    off = ServerConfig.from_env().engine_options()
    assert (off["prompt_cache_entries"], off["prompt_cache_mib"], off["prompt_cache_disk"]) == (0, 0, None)


def test_a_damaged_file_in_the_directory_is_logged_and_the_server_serves(tiny, tmp_path):
    (tmp_path / "0000000000000000.tlpc").write_bytes(b"TLPROMPT\x01\x00\x00\x00" + b"\xff" * 40)
    with server_process(tiny.path, "--prompt-cache-disk", str(tmp_path)) as (base, _, output):
        _, prompt, reused = _chat(base, [{"role": "user", "content": "Hello there."}])
        assert prompt > 0 and reused == 0
        log = output()
    assert "ignoring prompt cache file" in log and "0000000000000000.tlpc" in log
