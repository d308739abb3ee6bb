"""`tinyloop launch`: start `tinyloop-serve`, and optionally set up a coding client to use it.

Three questions (what to launch, which model, which port), each with a default; the same choices as flags ask
nothing, and neither does a run without a terminal or with --yes. The order of work keeps a refusal harmless:
every file change is computed first (a settings file that cannot be parsed stops the launch before anything is
written), then the port's owner is checked (anything but a tinyloop server stops the launch), and only then are
files written, an old tinyloop server stopped and the new one started in its place (exec: Ctrl-C reaches it
directly).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TextIO

from . import clients, files, port
from .errors import LaunchError
from .prompts import Prompter

if TYPE_CHECKING:
    from ..server.config import ServerConfig
    from .models import Model

DEFAULT_PORT = 8000
DEFAULT_HOST = "127.0.0.1"
MENU = {
    "server": "just the server",
    "codex": "the server + Codex (its own config home, ~/.codex-tinyloop)",
    "claude-code": "the server + Claude Code (environment variables in a file to source)",
    "opencode": "the server + OpenCode (a tinyloop provider in its settings)",
    "zed": "the server + Zed (a tinyloop provider in its settings)",
    "qwen-code": "the server + Qwen Code (its own config home, ~/.qwen-tinyloop)",
}


def _port_number(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise LaunchError(f"expected a port number 1-65535, got {text!r}")
    return int(text)


def _port_arg(text: str) -> int:
    try:
        return _port_number(text)
    except LaunchError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--client", choices=list(clients.CLIENTS), help="what to set up besides the server (default: server)"
    )
    p.add_argument("--model", metavar="NAME_OR_PATH", help="an installed model's name, or a model file's path")
    p.add_argument("--port", type=_port_arg, default=None, help="else TINYLOOP_PORT, else 8000")
    p.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--models-dir", metavar="DIR", help="also offer every *.tinyloop under DIR")
    p.add_argument(
        "--dry-run", action="store_true", help="print what would be written, stopped and run; change nothing"
    )
    p.add_argument("-y", "--yes", action="store_true", help="ask nothing: every choice not given takes its default")
    p.add_argument("server_args", nargs="*", metavar="-- SERVER_FLAGS", help="flags passed on to tinyloop-serve")


def main(argv: list[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinyloop launch", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), stdin, stdout)


@dataclass
class Choices:
    client: str
    model: Model
    port: int


def _default_port() -> int:
    env = os.environ.get("TINYLOOP_PORT")
    try:
        return _port_number(env) if env else DEFAULT_PORT
    except LaunchError as e:
        raise LaunchError(f"TINYLOOP_PORT: {e}") from None


def _client_named(answer: str) -> str:
    name = answer.strip().lower().replace(" ", "-")
    if name not in clients.CLIENTS:
        raise LaunchError(f"answer with a number from 1 to {len(clients.CLIENTS)}, or one of {', '.join(MENU)}")
    return name


def _choose(args: argparse.Namespace, ask: Prompter | None) -> Choices:
    """Flags win; what they leave open is asked (or, without `ask`, takes its default)."""
    from .models import installed_models, resolve_model

    installed = installed_models(args.models_dir)
    client = args.client
    if client is None:
        clients_menu = [(label, name) for name, label in MENU.items()]
        client = ask.choose("What should be launched?", clients_menu, other=_client_named) if ask else "server"
    if args.model is not None:
        model = resolve_model(args.model, installed)
    elif not installed:
        raise LaunchError("no model is installed: give --model PATH or --models-dir DIR")
    elif ask:
        models_menu = [(m.describe(), m) for m in installed]
        model = ask.choose("Which model?", models_menu, other=lambda answer: resolve_model(answer, installed))
    else:
        model = installed[0]
    port_number = args.port
    if port_number is None:
        default = _default_port()
        port_number = ask.ask("Which port?", default, _port_number, str(default)) if ask else default
    return Choices(client, model, port_number)


def _server_command(args: argparse.Namespace, c: Choices) -> tuple[list[str], ServerConfig]:
    """The command that starts the server, and its settings as tinyloop-serve reads them, flags over the environment
    (so a bad flag is refused now, by tinyloop-serve's own parser, and the settings that matter to clients are
    known)."""
    from ..server import cli as serve_cli

    flags = ["--model", str(c.model.path), "--port", str(c.port), "--host", args.host, *args.server_args]
    parsed = serve_cli.parse(flags)  # a usage error exits with tinyloop-serve's message, as the server would
    if (str(parsed.model_path), parsed.port, parsed.host) != (str(c.model.path), c.port, args.host):
        raise LaunchError("give --model, --port and --host to `tinyloop launch` itself, not after `--`")
    return [sys.executable, "-m", port.SERVER_MODULE, *flags], parsed


def client_origin(host: str, port_number: int) -> str:
    """Where a client on this machine reaches the server: a wildcard bind is reached over loopback."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"http://{host}:{port_number}"
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return f"http://[{ip}]:{port_number}" if ip.version == 6 else f"http://{ip}:{port_number}"


def _target(args: argparse.Namespace, c: Choices, served: ServerConfig) -> clients.Target:
    from .models import context_length, served_id

    try:
        keys = served.keys()
    except OSError as e:
        raise LaunchError(f"cannot read the API key file: {e}") from None
    models_dir = str(served.models_dir) if served.models_dir else None
    model_id = served_id(c.model.path, served.served_model_name, models_dir)
    context = served.max_seq_len or context_length(c.model.path) or 2048
    origin = client_origin(args.host, c.port)
    return clients.Target(model_id, origin, keys[0] if keys else "local", bool(keys), context)


def _exec(cmd: list[str]) -> NoReturn:
    """Replace this process with the server: its logs go to this terminal and Ctrl-C stops it, as if it had been
    started by hand."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        raise LaunchError(f"cannot start {cmd[0]}: {e.strerror}") from None


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    stdin, out = stdin or sys.stdin, stdout or sys.stdout
    try:
        return _run(args, stdin, out)
    except LaunchError as e:
        out.flush()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # tinyloop-serve's parser refused a flag after `--` (it printed why)
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C at a question: stop quietly, nothing has been changed yet
        print(file=out)
        return 130


def _run(args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    interactive = not args.yes and stdin.isatty()
    choices = _choose(args, Prompter(stdin, out) if interactive else None)
    cmd, served = _server_command(args, choices)
    target = _target(args, choices, served)
    setup = clients.setup(choices.client, target)
    use = port.inspect(args.host, choices.port)

    def say(line: str) -> None:
        print(line, file=out)

    if args.dry_run:
        say("dry run: nothing is written, stopped or started")
    say(f"launch: {MENU[choices.client]}")
    say(f"model:  {choices.model.describe()}  (id: {target.model_id})")
    say(f"server: {target.base_url}")
    if use.blocked:
        raise LaunchError(use.refusal())
    for change in setup.changes:
        say(files.describe(change) if args.dry_run else files.apply(change))
    verb = "would stop" if args.dry_run else "stopping"
    for server in use.tinyloop:
        say(f"{verb} the tinyloop server on port {choices.port}: {server.describe()}")
    if setup.run:
        say(f"start {clients.CLIENTS[choices.client]} with:")
        for line in setup.run:
            say(f"  {line}")
    for note in setup.notes:
        say(note)
    say(f"{'would run' if args.dry_run else 'starting'}: {shlex.join(cmd)}")
    if args.dry_run:
        return 0
    port.stop(use, args.host)
    _exec(cmd)
