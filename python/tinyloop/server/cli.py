"""`tinyloop-serve`: start granian (ASGI, one worker) on the tinyloop FastAPI app.

Every setting has a flag and an environment variable (config.py declares them); a flag given on the command line
wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

from ..extras import require_or_exit
from .config import ServerConfig, SettingError, declared, is_loopback
from .defaults import ConfigError, load_defaults
from .residency import CatalogError, scan_catalog

GROUPS = {"ray": "scale-out (tinyloop[ray]; docs/scale-out.md)"}  # the settings from this field on


def env_help() -> str:
    """`--help`'s table of the variables, from the settings' declarations."""
    lines = ["environment variables (a flag given wins over its variable):"]
    for _, s in declared():
        text = f"{s.help}{'; 1 = on' if s.switch else ''} (default: {s.default_text})"
        wrapped = textwrap.wrap(text, 118 - 32) or [""]
        lines.append(f"  {s.env:<30}{wrapped[0]}" if len(s.env) < 30 else f"  {s.env}\n{'':32}{wrapped[0]}")
        lines += [f"{'':32}{rest}" for rest in wrapped[1:]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """`tinyloop-serve`'s flags, one per setting (config.py). Values stay text here: `ServerConfig.load` parses a
    flag and its variable alike."""
    p = argparse.ArgumentParser(
        prog="tinyloop-serve",
        description=__doc__.split("\n\n")[0],
        epilog=env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group: argparse._ActionsContainer = p
    for name, s in declared():
        group = p.add_argument_group(GROUPS[name]) if name in GROUPS else group
        hint = f"{s.help} (else {s.env}; default: {s.default_text})".replace("%", "%%")
        if s.switch:
            group.add_argument(s.flag, dest=name, action="store_true", default=None, help=hint)
        else:
            action = "append" if s.repeated else "store"
            group.add_argument(s.flag, dest=name, action=action, default=None, metavar=s.metavar, help=hint)
    return p


def parse(argv: list[str] | None = None, env: dict[str, str] | None = None) -> ServerConfig:
    """The settings from the command line over the environment; a bad value exits 2 naming its flag and variable."""
    p = parser()
    flags = vars(p.parse_args(argv))
    try:
        return ServerConfig.load(flags, env)
    except SettingError as e:
        p.error(str(e))


def export(argv: list[str] | None = None) -> dict[str, str]:
    """The variables that carry the command line's flags to the server's worker process (and Ray's replicas)."""
    flags = vars(parser().parse_args(argv))
    out = {}
    for name, s in declared():
        given = flags.get(name)
        if given is True:
            out[s.env] = "1"
        elif isinstance(given, list):
            out[s.env] = ",".join(given)
        elif given is not None:
            out[s.env] = given
    return out


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    if cfg.ray:
        require_or_exit("ray", "--ray", "ray", "ray.serve")
    os.environ.update(export(argv))
    if cfg.threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(cfg.threads)  # read by rayon and candle when the worker first computes
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("tinyloop.server")
    error = _start_error(cfg)
    if error is not None:
        log.error("%s", error)
        return 2
    if not cfg.keys() and not is_loopback(cfg.host):
        log.warning(
            "listening on %s without an API key: anyone who can reach this address can use the server "
            "(set --api-key or --api-key-file)",
            cfg.host,
        )
    log.info("serving %s on http://%s:%d/v1", cfg.model_path, cfg.host, cfg.port)
    if cfg.ray:
        from .ray import run

        return run(cfg.host, cfg.port, cfg.replicas, cfg.replica_cpus, cfg.ray_address)
    _serve(cfg)
    return 0


def _start_error(cfg: ServerConfig) -> str | None:
    """What keeps the server from starting: an unreadable key file, an unusable device, a bad generation config or
    models directory."""
    from tinyloop import TinyloopError, check_device

    try:
        cfg.keys()
    except OSError as e:
        return f"cannot read the API key file: {e}"
    try:
        check_device(cfg.device)
        load_defaults(cfg.generate_config)
        if cfg.models_dir is not None:
            scan_catalog(cfg.models_dir)
    except (TinyloopError, ConfigError, CatalogError) as e:
        return str(e)
    return None


def _serve(cfg: ServerConfig) -> None:
    from granian import Granian
    from granian.constants import Interfaces, Loops
    from granian.log import LogLevels

    # workers_kill_timeout: the worker drains its requests on SIGTERM (lifecycle.py) within a few seconds; if it
    # ever does not, it is killed rather than holding the process open. loop: asyncio's, always — granian picks
    # uvloop when it is installed, and under uvloop the worker does not stop gracefully on SIGTERM (it is killed at
    # the timeout), so whether a shutdown drains would depend on what else is installed.
    Granian(
        "tinyloop.server.app:create_app",
        factory=True,
        address=cfg.host,
        port=cfg.port,
        interface=Interfaces.ASGI,
        loop=Loops.asyncio,
        workers=1,
        log_level=LogLevels(cfg.log_level),
        log_access=False,
        workers_kill_timeout=5,
    ).serve()


if __name__ == "__main__":
    sys.exit(main())
