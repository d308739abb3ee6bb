"""The server's settings, walked from their one declaration (server/config.py): each has a flag, a variable, a
default and help; a flag and its variable go through the same parser, so a value refused from one is refused from
the other with the same message, naming both; values that make no sense are refused at start-up."""

from __future__ import annotations

import dataclasses

import pytest

from tinyloop.server import cli
from tinyloop.server.config import ServerConfig, SettingError, declared

SETTINGS = list(declared())
CANDIDATES = ["x", "-1", "0", "1.5", "inf", "nan", "70000", "maybe", "int3"]
# Values that make no sense, refused whatever else the parser takes.
NONSENSE = {
    "max_running": "0",
    "max_waiting": "-1",
    "request_timeout": "-1",
    "idle_unload_seconds": "-5",
    "max_body_bytes": "0",
    "max_tokens_limit": "0",
    "prompt_cache_mib": "0",
    "prompt_cache_entries": "0",
    "prompt_cache_disk_mib": "0",
    "threads": "0",
    "port": "65536",
    "replicas": "0",
    "replica_cpus": "0",
    "max_seq_len": "0",
    "log_level": "loud",
}


def refusal(capsys, argv: list[str], env: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as e:
        cli.parse(argv, env)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_every_field_is_declared_with_flag_variable_default_and_help():
    assert [name for name, _ in SETTINGS] == [f.name for f in dataclasses.fields(ServerConfig)]
    usage, table = cli.parser().format_help(), cli.env_help()
    for name, s in SETTINGS:
        assert s.flag.startswith("--") and s.env.startswith("TINYLOOP_") and s.help and s.default_text, name
        assert s.flag in usage and s.env in table, name
    assert len({s.flag for _, s in SETTINGS}) == len({s.env for _, s in SETTINGS}) == len(SETTINGS)
    assert ServerConfig.load({}, {}) == ServerConfig()


@pytest.mark.parametrize("name,s", SETTINGS, ids=[n for n, _ in SETTINGS])
def test_a_value_is_read_alike_from_the_flag_and_the_variable(capsys, name, s):
    refused = 0
    for text in [*CANDIDATES, NONSENSE.get(name, "x")]:
        try:
            want = s.parse(text)
        except ValueError:
            flag_error = refusal(capsys, [] if s.switch else [s.flag, text], {s.env: text} if s.switch else {})
            env_error = refusal(capsys, [], {s.env: text})
            assert flag_error == env_error and f"{s.flag} / {s.env}" in env_error and repr(text) in env_error
            refused += 1
            continue
        if s.switch:
            continue
        try:
            from_flag = getattr(cli.parse([s.flag, text], {}), name)
        except SystemExit:  # a value that does not go with the other defaults (--replicas 2 without --ray)
            capsys.readouterr()
            continue
        assert from_flag == want == getattr(ServerConfig.load({}, {s.env: text}), name)
    assert refused or s.parse.what in ("text", "a path", "keys separated by commas")  # any text is one
    if name in NONSENSE:
        with pytest.raises(ValueError):
            s.parse(NONSENSE[name])


def test_switches_take_one_and_zero():
    assert cli.parse(["--lazy-load"], {}).lazy_load and ServerConfig.load({}, {"TINYLOOP_LAZY_LOAD": "yes"}).lazy_load
    assert not ServerConfig.load({}, {"TINYLOOP_LAZY_LOAD": "0"}).lazy_load
    with pytest.raises(SettingError, match="--lazy-load / TINYLOOP_LAZY_LOAD: expected 1 or 0"):
        ServerConfig.load({}, {"TINYLOOP_LAZY_LOAD": "maybe"})


def test_the_flag_wins_and_the_worker_reads_what_the_command_line_said():
    argv = ["--max-running", "3", "--api-key", "a", "--api-key", "b", "--no-prompt-cache", "--kv-cache", "int8"]
    env = {"TINYLOOP_MAX_RUNNING": "9", "TINYLOOP_MAX_WAITING": "7"}
    cfg = cli.parse(argv, env)
    assert (cfg.max_running, cfg.max_waiting, cfg.api_key, cfg.no_prompt_cache) == (3, 7, ("a", "b"), True)
    assert ServerConfig.load({}, env | cli.export(argv)) == cfg  # the variables tinyloop-serve sets for its worker


def test_settings_that_do_not_go_together(capsys):
    assert "apply only with --ray" in refusal(capsys, ["--replicas", "2"], {})
    assert "--kv-cache alone" in refusal(capsys, ["--kv-cache", "int8", "--kv-int4"], {})
    assert "needs --kv-int4" in refusal(capsys, [], {"TINYLOOP_KV_H_MODE": "1"})
