"""`tinyloop launch`: the questions and flags, each client's configuration (checked by value), the comment-keeping
merge into Zed's and OpenCode's settings, and the rule that only a tinyloop server is ever stopped."""

from __future__ import annotations

import difflib
import io
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from serverutil import free_port, server_process
from tinyloop.__main__ import main as tinyloop_main
from tinyloop.launch import cli, clients, jsonc, merge, port
from tinyloop.launch.errors import LaunchError
from tinyloop.launch.models import installed_models, resolve_model, served_id
from tinyloop.server.config import DEFAULT_MODEL

STOPPABLE: set[int] = set()  # servers this test run started: the only ones a test may stop


class Terminal(io.StringIO):
    """Typed answers, one per line, from what looks like a terminal (so the launcher asks)."""

    def isatty(self) -> bool:
        return True


class Started(Exception):
    """Raised in place of exec'ing the server: the test sees the command and no server is left running."""

    def __init__(self, cmd: list[str]):
        super().__init__(cmd)
        self.cmd = cmd


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A temporary home for every test, no XDG_CONFIG_HOME, no TINYLOOP_* settings but a free default port (so that
    no test can stop a server someone runs on 8000), and no server ever exec'd."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for name in list(os.environ):
        if name.startswith("TINYLOOP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TINYLOOP_PORT", str(free_port()))

    def started(cmd: list[str]):
        raise Started(cmd)

    monkeypatch.setattr(cli, "_exec", started)
    real_stop = port.stop

    def guarded_stop(use: port.PortUse, host: str, *args, **kwargs) -> None:
        strangers = [s.pid for s in use.tinyloop if s.pid not in STOPPABLE]
        assert not strangers, f"a test would stop a tinyloop server it did not start: {strangers}"
        real_stop(use, host, *args, **kwargs)

    monkeypatch.setattr(port, "stop", guarded_stop)
    return home


@pytest.fixture
def port_8000_unchecked(monkeypatch):
    """The built-in default port, with its owner not looked at: a test of the default must not depend on (or stop)
    whatever this machine runs on 8000."""
    monkeypatch.delenv("TINYLOOP_PORT")
    monkeypatch.setattr(port, "inspect", lambda host, number, proc=None: port.PortUse(number))


def launch(*argv: str, answers: str | None = None) -> tuple[int, list[str] | None, str]:
    """Run the launcher: (exit status, the server command it would exec or None, what it printed)."""
    out = io.StringIO()
    stdin = Terminal(answers) if answers is not None else io.StringIO("")
    try:
        return cli.main(list(argv), stdin, out), None, out.getvalue()
    except Started as e:
        return 0, e.cmd, out.getvalue()


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.fixture
def models_dir(tmp_path) -> Path:
    """Two model files (contents do not matter: the launcher only lists them) and a file that is not a model."""
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    (d / "mini.tinyloop").write_bytes(b"x" * 3000)
    (d / "sub" / "big.tinyloop").write_bytes(b"y" * (3 << 20))
    (d / "notes.txt").write_text("not a model")
    return d


# --- questions and flags -------------------------------------------------------------------------------------------


def test_enter_at_every_question_takes_the_defaults(monkeypatch):
    p = free_port()
    monkeypatch.setenv("TINYLOOP_PORT", str(p))
    rc, cmd, out = launch(answers="\n\n\n")
    assert rc == 0 and cmd is not None
    assert "What should be launched?" in out and "Which model?" in out and f"Which port? [{p}]" in out
    assert "1) just the server   (default)" in out
    assert flag(cmd, "--model") == str(DEFAULT_MODEL.resolve())
    assert flag(cmd, "--port") == str(p) and flag(cmd, "--host") == "127.0.0.1"
    assert cmd[:3] == [sys.executable, "-m", "tinyloop.server.cli"]


def test_the_default_port_is_8000(port_8000_unchecked):
    rc, _, out = launch("--dry-run", answers="\n\n\n")
    assert rc == 0 and "Which port? [8000]" in out and "--port 8000" in out


def test_explicit_answers_and_a_re_asked_one(models_dir, home):
    p = free_port()
    rc, cmd, out = launch("--models-dir", str(models_dir), answers=f"9\nclaude code\nmini\nzero\n{p}\n")
    assert rc == 0 and cmd is not None
    assert "answer with a number from 1 to 6" in out and "expected a port number 1-65535, got 'zero'" in out
    assert flag(cmd, "--model") == str((models_dir / "mini.tinyloop").resolve()) and flag(cmd, "--port") == str(p)
    env = env_file(home / ".config" / "tinyloop" / "claude-code.env")
    assert env["ANTHROPIC_MODEL"] == "mini" and env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{p}"


def test_answers_by_number(models_dir, home):
    p = free_port()
    rc, cmd, out = launch("--models-dir", str(models_dir), answers=f"2\n3\n{p}\n")
    assert rc == 0 and cmd is not None
    listing = [line for line in out.splitlines() if line.startswith("  ") and ".tinyloop" in line]
    assert [line.split()[1] for line in listing] == ["default", "mini", "big"]
    assert "(3.0 MiB)" in listing[2] and "(2.9 KiB)" in listing[1]
    assert flag(cmd, "--model") == str((models_dir / "sub" / "big.tinyloop").resolve())
    config = tomllib.loads((home / ".codex-tinyloop" / "config.toml").read_text())
    assert config["model"] == "big"


def test_flags_ask_nothing():
    p = free_port()
    rc, cmd, out = launch("--client", "server", "--model", "default", "--port", str(p), answers="")
    assert rc == 0 and cmd is not None and "?" not in out
    assert flag(cmd, "--port") == str(p)


def test_no_terminal_takes_the_defaults_without_asking(port_8000_unchecked):
    rc, cmd, out = launch("--dry-run")  # stdin is not a terminal
    assert rc == 0 and cmd is None
    assert "?" not in out and "launch: just the server" in out and "--port 8000" in out


def test_yes_takes_the_defaults_even_on_a_terminal():
    rc, _, out = launch("--dry-run", "--yes", answers="2\n")
    assert rc == 0 and "?" not in out and "launch: just the server" in out


def test_a_model_that_is_not_installed_is_refused_with_the_installed_ones(models_dir, capsys):
    rc, cmd, _ = launch("--models-dir", str(models_dir), "--model", "nope", "--yes")
    err = capsys.readouterr().err
    assert rc == 1 and cmd is None
    assert "model 'nope' is not installed" in err
    for name in ("default", "mini", "big"):
        assert f"  {name}  (" in err
    assert "notes" not in err


def test_a_model_by_path(models_dir):
    rc, cmd, _ = launch("--model", str(models_dir / "mini.tinyloop"), "--yes")
    assert rc == 0 and cmd is not None and flag(cmd, "--model") == str((models_dir / "mini.tinyloop").resolve())


def test_only_existing_models_are_offered(tmp_path, models_dir):
    assert installed_models(None, default=tmp_path / "missing.tinyloop") == []
    names = [m.name for m in installed_models(models_dir, default=tmp_path / "missing.tinyloop")]
    assert names == ["mini", "big"]
    with pytest.raises(LaunchError, match="not a directory"):
        installed_models(tmp_path / "nowhere")
    with pytest.raises(LaunchError, match="is not installed"):
        resolve_model(str(tmp_path / "missing.tinyloop"), installed_models(models_dir))


def test_server_flags_after_the_double_dash_are_passed_on_and_checked(capsys):
    rc, cmd, _ = launch("--yes", "--", "--kv-cache", "int8", "--threads", "2")
    assert rc == 0 and cmd is not None and cmd[-4:] == ["--kv-cache", "int8", "--threads", "2"]
    rc, cmd, _ = launch("--yes", "--", "--no-such-flag")
    assert rc == 2 and cmd is None and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    rc, cmd, _ = launch("--yes", "--", "--port", "9999")
    assert rc == 1 and cmd is None and "not after `--`" in capsys.readouterr().err


def test_the_tinyloop_command_has_launch(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    p = free_port()
    assert tinyloop_main(["launch", "--dry-run", "--port", str(p), "--", "--max-running", "4"]) == 0
    out = capsys.readouterr().out
    assert "would run:" in out and f"--port {p} --host 127.0.0.1 --max-running 4" in out


# --- model ids -----------------------------------------------------------------------------------------------------


def test_the_model_id_is_the_servers(models_dir, tmp_path):
    mini = models_dir / "mini.tinyloop"
    assert served_id(mini) == "mini"
    assert served_id(mini, "my-name") == "my-name"
    assert served_id(mini, None, str(models_dir)) == "mini"
    with pytest.raises(LaunchError, match="not under the server's --models-dir"):
        served_id(DEFAULT_MODEL, None, str(models_dir))


def test_served_model_name_reaches_the_client(home):
    rc, _, _ = launch("--client", "codex", "--yes", "--", "--served-model-name", "tiny-coder")
    assert rc == 0
    assert tomllib.loads((home / ".codex-tinyloop" / "config.toml").read_text())["model"] == "tiny-coder"


# --- each client's configuration -----------------------------------------------------------------------------------


def env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            env[key] = shlex.split(value)[0]
    return env


def test_codex_gets_its_own_config_home(home):
    p = free_port()
    rc, cmd, out = launch("--client", "codex", "--yes", "--port", str(p))
    assert rc == 0 and cmd is not None
    config = tomllib.loads((home / ".codex-tinyloop" / "config.toml").read_text())
    assert config == {
        "model": "default",
        "model_provider": "tinyloop",
        "model_providers": {
            "tinyloop": {"name": "tinyloop", "base_url": f"http://127.0.0.1:{p}/v1", "wire_api": "responses"}
        },
    }
    assert not (home / ".codex").exists()
    assert f"CODEX_HOME={home / '.codex-tinyloop'} codex" in out


def test_codex_with_a_server_key(home):
    rc, _, out = launch("--client", "codex", "--yes", "--", "--api-key", "s3cret")
    assert rc == 0
    config = tomllib.loads((home / ".codex-tinyloop" / "config.toml").read_text())
    assert config["model_providers"]["tinyloop"]["env_key"] == "TINYLOOP_API_KEY"
    assert "TINYLOOP_API_KEY=s3cret CODEX_HOME=" in out


def test_claude_code_gets_an_env_file(home):
    from tinyloop.server.anthropic import router

    assert "/v1/messages" in {r.path for r in router.routes}  # so the base URL is the server's origin, no /v1
    p = free_port()
    rc, _, out = launch("--client", "claude-code", "--yes", "--port", str(p))
    assert rc == 0
    path = home / ".config" / "tinyloop" / "claude-code.env"
    env = env_file(path)
    assert env["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{p}"
    assert env["ANTHROPIC_API_KEY"] == "local"
    for name in ("MODEL", "SMALL_FAST_MODEL", "DEFAULT_OPUS_MODEL", "DEFAULT_SONNET_MODEL", "DEFAULT_HAIKU_MODEL"):
        assert env[f"ANTHROPIC_{name}"] == "default"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert f"source {path} && claude" in out
    sourced = subprocess.run(
        ["bash", "-c", f"source {shlex.quote(str(path))} && echo $ANTHROPIC_BASE_URL"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sourced.stdout.strip() == f"http://127.0.0.1:{p}"


def test_qwen_code_gets_its_own_home(home):
    p = free_port()
    rc, _, out = launch("--client", "qwen-code", "--yes", "--port", str(p))
    assert rc == 0
    path = home / ".qwen-tinyloop" / "settings.json"
    settings = json.loads(jsonc.strip(path.read_text()))
    [model] = settings["modelProviders"]["openai"]
    assert model["id"] == "default" and model["baseUrl"] == f"http://127.0.0.1:{p}/v1"
    assert model["envKey"] == "TINYLOOP_API_KEY" and settings["env"]["TINYLOOP_API_KEY"] == "local"
    assert model["generationConfig"]["streamIdleTimeoutMs"] == 0
    assert model["generationConfig"]["contextWindowSize"] == 512  # the default model's context length
    assert settings["env"]["QWEN_STREAM_IDLE_TIMEOUT_MS"] == "0"
    assert settings["env"]["QWEN_STREAM_MAX_LIFETIME_MS"] == "0"
    assert settings["security"]["auth"]["selectedType"] == "openai" and settings["model"]["name"] == "default"
    assert not (home / ".qwen").exists()
    assert f"QWEN_HOME={home / '.qwen-tinyloop'} qwen" in out
    before = path.read_text()
    assert launch("--client", "qwen-code", "--yes", "--port", str(p))[0] == 0
    assert path.read_text() == before


def test_opencode_creates_a_jsonc_file(home):
    p = free_port()
    rc, _, out = launch("--client", "opencode", "--yes", "--port", str(p))
    assert rc == 0
    config = jsonc.loads((home / ".config" / "opencode" / "opencode.jsonc").read_text())
    assert config["$schema"] == "https://opencode.ai/config.json"
    provider = config["provider"]["tinyloop"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["name"] == "tinyloop"
    assert provider["options"]["baseURL"] == f"http://127.0.0.1:{p}/v1" and provider["options"]["apiKey"] == "local"
    assert provider["models"] == {"default": {"name": "default (tinyloop)"}}
    assert "opencode --model tinyloop/default" in out


OPENCODE_JSON = """{
  "$schema": "https://opencode.ai/config.json",
  "theme": "tokyonight",
  "provider": {
    "ollama": {"npm": "@ai-sdk/openai-compatible", "options": {"baseURL": "http://localhost:11434/v1"}}
  }
}
"""


def test_opencode_uses_an_existing_json_file(home):
    folder = home / ".config" / "opencode"
    folder.mkdir(parents=True)
    (folder / "opencode.json").write_text(OPENCODE_JSON)
    p = free_port()
    assert launch("--client", "opencode", "--yes", "--port", str(p))[0] == 0
    assert not (folder / "opencode.jsonc").exists()
    config = json.loads((folder / "opencode.json").read_text())  # still strict JSON
    assert config["theme"] == "tokyonight"
    assert config["provider"]["ollama"]["options"]["baseURL"] == "http://localhost:11434/v1"
    assert config["provider"]["tinyloop"]["options"]["baseURL"] == f"http://127.0.0.1:{p}/v1"
    assert (folder / "opencode.json.tinyloop-backup").read_text() == OPENCODE_JSON
    assert only_insertions(OPENCODE_JSON, (folder / "opencode.json").read_text())


def test_xdg_config_home_is_respected(tmp_path, home, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert launch("--client", "zed", "--yes")[0] == 0
    assert (tmp_path / "xdg" / "zed" / "settings.json").is_file()
    assert not (home / ".config").exists()


# --- merging into a settings file with comments --------------------------------------------------------------------

ZED_SETTINGS = """// Zed settings
//
// For information on how to configure Zed, see the Zed documentation.
{
  "theme": "One Dark", // the dark one
  /* fonts,
     both of them */
  "buffer_font_size": 15,
  "ui_font_size": 16,
  "language_models": {
    "openai_compatible": {
      // my other server
      "other": {
        "api_url": "http://localhost:9000/v1",
        "available_models": [{"name": "m", "max_tokens": 4096,},],
      },
    },
  },
  "vim_mode": true, /* trailing */
}
"""


def zed_settings(home: Path) -> Path:
    path = home / ".config" / "zed" / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def only_insertions(old: str, new: str) -> bool:
    """Every byte of `old` is in `new`, in order: the change only inserted text."""
    ops = difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
    return all(op in ("equal", "insert") for op, *_ in ops)


def member_span(text: str, *path: str) -> tuple[int, int]:
    node = jsonc.parse(text)
    for key in path:
        assert node is not None
        node = next(m for m in node.members if m.key == key).value
    assert node is not None
    return node.start, node.end


def test_zed_merge_keeps_every_comment_and_key(home):
    path = zed_settings(home)
    path.write_text(ZED_SETTINGS)
    p = free_port()
    rc, _, out = launch("--client", "zed", "--yes", "--port", str(p))
    assert rc == 0
    text = path.read_text()
    assert only_insertions(ZED_SETTINGS, text)
    settings = json.loads(jsonc.strip(text))
    assert settings["theme"] == "One Dark" and settings["vim_mode"] is True and settings["ui_font_size"] == 16
    providers = settings["language_models"]["openai_compatible"]
    assert providers["other"] == {
        "api_url": "http://localhost:9000/v1",
        "available_models": [{"name": "m", "max_tokens": 4096}],
    }
    assert providers["tinyloop"] == {
        "api_url": f"http://127.0.0.1:{p}/v1",
        "available_models": [{"name": "default", "display_name": "default (tinyloop)", "max_tokens": 512}],
    }
    assert (path.parent / "settings.json.tinyloop-backup").read_bytes() == ZED_SETTINGS.encode()
    assert jsonc.loads(text) == settings
    assert "TINYLOOP_API_KEY=local zed" in out


def test_zed_merge_is_idempotent_and_replaces_its_own_entry(home):
    path = zed_settings(home)
    path.write_text(ZED_SETTINGS)
    backup = path.parent / "settings.json.tinyloop-backup"
    p1, p2 = free_port(), free_port()
    assert launch("--client", "zed", "--yes", "--port", str(p1))[0] == 0
    first = path.read_text()
    assert launch("--client", "zed", "--yes", "--port", str(p1))[0] == 0
    assert path.read_text() == first and first.count('"tinyloop"') == 1
    assert backup.read_text() == ZED_SETTINGS  # an unchanged file is not rewritten, so the backup stays the original
    assert launch("--client", "zed", "--yes", "--port", str(p2))[0] == 0
    second = path.read_text()
    assert second.count('"tinyloop"') == 1
    s1, e1 = member_span(first, "language_models", "openai_compatible", "tinyloop")
    s2, e2 = member_span(second, "language_models", "openai_compatible", "tinyloop")
    assert first[:s1] == second[:s2] and first[e1:] == second[e2:]  # only the value changed
    assert jsonc.loads(second)["language_models"]["openai_compatible"]["tinyloop"]["api_url"].endswith(f":{p2}/v1")
    assert backup.read_text() == first


def test_zed_merge_into_an_empty_and_a_missing_file(home):
    path = zed_settings(home)
    assert launch("--client", "zed", "--yes")[0] == 0
    created = jsonc.loads(path.read_text())
    assert list(created) == ["language_models"]
    assert not (path.parent / "settings.json.tinyloop-backup").exists()
    path.write_text("// nothing here yet\n")
    assert launch("--client", "zed", "--yes")[0] == 0
    assert path.read_text().startswith("// nothing here yet\n{")
    assert jsonc.loads(path.read_text()) == created


@pytest.mark.parametrize(
    "broken",
    [
        '{\n  "theme": "One Dark"\n  "vim_mode": true\n}\n',  # a missing comma
        '{\n  "theme": "One Dark", /* never closed\n}\n',
        '{\n  "theme": "One Dark\n}\n',
        '[\n  "not an object"\n]\n',
        '{"language_models": {"openai_compatible": ["a list"]}}',
    ],
)
def test_an_unparseable_file_is_left_untouched(home, broken, capsys):
    path = zed_settings(home)
    path.write_text(broken)
    rc, cmd, _ = launch("--client", "zed", "--yes")
    err = capsys.readouterr().err
    assert rc == 1 and cmd is None
    assert f"{path}: cannot be read as JSON with comments" in err and "left untouched" in err
    assert path.read_text() == broken
    assert sorted(p.name for p in path.parent.iterdir()) == ["settings.json"]


def test_a_symlinked_settings_file_is_written_through_the_link(home, tmp_path):
    real = tmp_path / "dotfiles" / "zed.json"
    real.parent.mkdir()
    real.write_text('{\n  "theme": "One Light"\n}\n')
    link = zed_settings(home)
    link.symlink_to(real)
    assert launch("--client", "zed", "--yes")[0] == 0
    assert link.is_symlink()
    assert "tinyloop" in jsonc.loads(real.read_text())["language_models"]["openai_compatible"]


def test_the_scanner_and_strip_agree_with_json():
    text = '// top\n{"a": [1, 2.5e3, "x\\"y", {"b": null,},], /* c */ "d": false, "e": "// not a comment",}\n'
    expected = {"a": [1, 2500.0, 'x"y', {"b": None}], "d": False, "e": "// not a comment"}
    assert json.loads(jsonc.strip(text)) == expected and jsonc.loads(text) == expected
    for bad, where in [
        ('{"a" 1}', "line 1, column 6"),
        ("{\n  'a': 1}", "line 2, column 3"),
        ('{"a": tru}', "unexpected 't' at line 1, column 7"),
    ]:
        with pytest.raises(jsonc.JsoncError, match=where):
            jsonc.loads(bad)


def test_merge_keeps_crlf_tabs_and_a_one_line_object():
    crlf = '{\r\n\t"a": 1\r\n}\r\n'
    out = merge.set_path(crlf, ["b", "c"], [1])
    assert out == '{\r\n\t"a": 1,\r\n\t"b": {\r\n\t\t"c": [\r\n\t\t\t1\r\n\t\t]\r\n\t}\r\n}\r\n'
    assert merge.set_path('{"a": 1}', ["b"], {"c": 2}) == '{"a": 1, "b": {"c": 2}}'
    assert merge.set_path(merge.set_path('{"a": 1}', ["b"], 2), ["b"], 2) == '{"a": 1, "b": 2}'


# --- the port: only a tinyloop server is stopped --------------------------------------------------------------------


@pytest.fixture
def foreign_listener():
    """A plain Python socket server (not tinyloop) on a free loopback port: (its process, the port)."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_another_programs_port_is_never_touched(foreign_listener, home, capsys):
    proc, p = foreign_listener
    use = port.inspect("127.0.0.1", p)
    assert [o.pid for o in use.others] == [proc.pid] and use.tinyloop == [] and use.blocked
    for dry in ([], ["--dry-run"]):
        rc, cmd, _ = launch("--client", "zed", "--yes", "--port", str(p), *dry)
        err = capsys.readouterr().err
        assert rc == 1 and cmd is None
        assert f"port {p} is in use, not by a tinyloop server: pid {proc.pid}" in err
        assert proc.poll() is None
    assert not (home / ".config" / "zed").exists()  # refused before anything was written
    with pytest.raises(LaunchError, match="not by a tinyloop server"):
        port.stop(use, "127.0.0.1")
    assert proc.poll() is None


def test_without_proc_nothing_is_stopped(foreign_listener, tmp_path, monkeypatch, capsys):
    proc, p = foreign_listener
    monkeypatch.setattr(port, "PROC", tmp_path / "no-proc")
    rc, cmd, _ = launch("--yes", "--port", str(p))
    assert rc == 1 and cmd is None and "cannot be identified" in capsys.readouterr().err
    assert proc.poll() is None
    assert port.inspect("127.0.0.1", free_port()).blocked is False


def test_a_running_tinyloop_server_is_stopped_and_replaced():
    with server_process(DEFAULT_MODEL) as (base, proc, _output):
        STOPPABLE.add(proc.pid)
        p = int(base.rsplit(":", 1)[1])
        use = port.inspect("127.0.0.1", p)
        assert [s.pid for s in use.tinyloop] == [proc.pid] and not use.blocked
        rc, cmd, out = launch("--dry-run", "--yes", "--port", str(p))
        assert rc == 0 and f"would stop the tinyloop server on port {p}: pid {proc.pid}" in out
        assert proc.poll() is None
        rc, cmd, out = launch("--yes", "--port", str(p))
        assert cmd is not None and flag(cmd, "--port") == str(p)
        assert f"stopping the tinyloop server on port {p}: pid {proc.pid}" in out
        assert proc.wait(timeout=30) is not None
        assert port.listening_inodes("127.0.0.1", p) == []


def test_the_launcher_becomes_the_server_and_ctrl_c_stops_it(home):
    """The real thing, end to end: `tinyloop launch` writes the client's file, execs the server in its own process
    (same pid), and SIGINT (Ctrl-C) stops it."""
    p = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYLOOP_")} | {"HOME": str(home)}
    cmd = [sys.executable, "-m", "tinyloop", "launch", "--client", "zed", "--yes", "--port", str(p)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode()
            try:
                if httpx.get(f"http://127.0.0.1:{p}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health within 60 s"
            time.sleep(0.1)
        assert port.is_tinyloop_server(port._cmdline(proc.pid, port.PROC))  # exec'd: the launcher's pid serves
        assert (
            "tinyloop"
            in jsonc.loads((home / ".config/zed/settings.json").read_text())["language_models"]["openai_compatible"]
        )
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=30)[0].decode()
        assert f"starting: {sys.executable} -m tinyloop.server.cli" in output and "Listening at" in output
        assert port.listening_inodes("127.0.0.1", p) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        (["/usr/bin/python3", "-m", "tinyloop.server.cli", "--port", "8000"], True),
        (["python3.11", "-u", "-X", "dev", "-m", "tinyloop.server.cli"], True),
        (["/venv/bin/python", "/venv/bin/tinyloop-serve", "--port", "8000"], True),
        (["/venv/bin/tinyloop-serve"], True),
        (["timeout", "60", "python", "-m", "tinyloop.server.cli"], False),
        (["python", "-c", "import tinyloop.server.cli"], False),
        (["python", "-m", "http.server", "8000"], False),
        (["python", "serve.py", "tinyloop-serve"], False),
        (["node", "tinyloop-serve"], False),
        ([], False),
    ],
)
def test_what_counts_as_a_tinyloop_server(cmdline, expected):
    assert port.is_tinyloop_server(cmdline) is expected


def test_proc_net_addresses():
    assert str(port._address("0100007F")) == "127.0.0.1"
    assert str(port._address("00000000000000000000000001000000")) == "::1"
    assert str(port._address("0000000000000000FFFF00000100007F")) == "127.0.0.1"  # IPv4-mapped
    assert port._overlaps(port._address("00000000"), "127.0.0.1")
    assert not port._overlaps(port._address("0100007F"), "10.0.0.1")


def test_client_origin():
    assert cli.client_origin("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert cli.client_origin("::", 8000) == "http://[::1]:8000"
    assert cli.client_origin("192.168.1.5", 80) == "http://192.168.1.5:80"
    assert clients.Target("m", "http://127.0.0.1:1", "k", False, 1).base_url == "http://127.0.0.1:1/v1"
