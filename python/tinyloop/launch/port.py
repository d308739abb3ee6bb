"""Who listens on a port, and stopping it only when it is a tinyloop server.

The launcher may replace a tinyloop server it (or the user) started earlier on the same port, but must never stop
anything else. So the owner is identified from the kernel's own records rather than by asking the port: the
listening socket's inode from /proc/net/tcp and tcp6, the processes holding that inode from /proc/PID/fd, and each
holder's command line from /proc/PID/cmdline. The server's socket is held by granian's worker, a child of the
`tinyloop-serve` process; the process signalled is the topmost tinyloop server in that chain, so the whole server
shuts down (it drains its requests on SIGTERM) rather than one worker that would be restarted.

Without /proc (macOS, Windows) nothing can be identified, so nothing is stopped: a port in use is then reported
and the launch refused.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LaunchError

PROC = Path("/proc")
LISTEN = "0A"  # the TCP_LISTEN state in /proc/net/tcp
SERVER_MODULE = "tinyloop.server.cli"
STOP_TIMEOUT = 20.0  # seconds: the server drains within a few (workers_kill_timeout is 5)


@dataclass(frozen=True)
class Process:
    pid: int
    cmdline: tuple[str, ...]

    def describe(self) -> str:
        command = " ".join(" ".join(self.cmdline).split()) or "?"
        return f"pid {self.pid} ({command if len(command) <= 160 else command[:157] + '...'})"


@dataclass
class PortUse:
    port: int
    tinyloop: list[Process] = field(default_factory=list)  # tinyloop servers: may be stopped
    others: list[Process] = field(default_factory=list)  # anything else: never touched
    unknown: str | None = None  # why the listener could not be identified, if it could not

    @property
    def blocked(self) -> bool:
        return bool(self.others or self.unknown)

    def refusal(self) -> str:
        why = self.unknown or "; ".join(p.describe() for p in self.others)
        return f"port {self.port} is in use, not by a tinyloop server: {why}. Stop it, or pick another port"


def is_tinyloop_server(cmdline: tuple[str, ...] | list[str]) -> bool:
    """`tinyloop-serve ...`, `python [options] /path/tinyloop-serve ...` or `python [options] -m
    tinyloop.server.cli ...`. Wrappers whose arguments merely mention it (`timeout 60 python -m ...`) do not match:
    argv[0] must be the entry point or a Python interpreter."""
    if not cmdline:
        return False
    exe = Path(cmdline[0]).name
    if exe == "tinyloop-serve":
        return True
    if not exe.startswith("python"):
        return False
    args = list(cmdline[1:])
    while args:
        arg = args.pop(0)
        if arg == "-m":
            return bool(args) and args[0] == SERVER_MODULE
        if arg.startswith("-m"):
            return arg[2:] == SERVER_MODULE
        if arg in ("-c", "-"):
            return False
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # options that take a value
            args = args[1:]
        elif not arg.startswith("-"):
            return Path(arg).name == "tinyloop-serve"
    return False


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp's address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    v6 = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return v6.ipv4_mapped or v6


def _overlaps(listener: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str) -> bool:
    """Whether a listener on `listener` stands in the way of binding `host`: the same address, or either one is the
    wildcard. A host name is compared with everything (it may resolve to any of them)."""
    try:
        ours = ipaddress.ip_address(host)
    except ValueError:
        return True
    if isinstance(ours, ipaddress.IPv6Address) and ours.ipv4_mapped:
        ours = ours.ipv4_mapped
    return listener.is_unspecified or ours.is_unspecified or listener == ours


def listening_inodes(host: str, port: int, proc: Path | None = None) -> list[int] | None:
    """Inodes of the sockets listening on `port` in the way of `host`; None when /proc/net has no TCP tables."""
    proc = proc or PROC
    inodes, tables = [], 0
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != LISTEN:
                continue
            addr, port_hex = f[1].split(":")
            if int(port_hex, 16) == port and _overlaps(_address(addr), host):
                inodes.append(int(f[9]))
    return inodes if tables else None


def _holders(inodes: list[int], proc: Path) -> dict[int, set[int]]:
    """inode -> pids holding it, among the processes whose fds this user can read."""
    wanted = {f"socket:[{i}]": i for i in inodes}
    held: dict[int, set[int]] = {i: set() for i in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
        except OSError:  # another user's process, or one that just exited
            continue
        for fd in fds:
            try:
                link = os.readlink(entry / "fd" / fd)
            except OSError:
                continue
            if link in wanted:
                held[wanted[link]].add(int(entry.name))
    return held


def _cmdline(pid: int, proc: Path) -> tuple[str, ...]:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ()
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _parent(pid: int, proc: Path) -> int | None:
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _server_root(pid: int, proc: Path) -> Process | None:
    """The topmost tinyloop server among `pid` and its ancestors, if `pid` is one; None if it is not."""
    cmdline = _cmdline(pid, proc)
    if not is_tinyloop_server(cmdline):
        return None
    root, seen = Process(pid, cmdline), {pid}
    while (parent := _parent(root.pid, proc)) not in (None, 0, 1) and parent not in seen:
        assert parent is not None
        seen.add(parent)
        parent_cmdline = _cmdline(parent, proc)
        if not is_tinyloop_server(parent_cmdline):
            break
        root = Process(parent, parent_cmdline)
    return root


def inspect(host: str, port: int, proc: Path | None = None) -> PortUse:
    """Who listens on `port` in the way of binding `host` (see the module's docstring)."""
    proc = proc or PROC
    use = PortUse(port)
    inodes = listening_inodes(host, port, proc)
    if inodes is None:
        if _accepts(host, port):
            use.unknown = f"{proc}/net/tcp is not readable here, so the listening process cannot be identified"
        return use
    for inode, pids in _holders(inodes, proc).items():
        if not pids:
            use.unknown = f"the listening socket (inode {inode}) belongs to a process this user cannot inspect"
        for pid in sorted(pids):
            root = _server_root(pid, proc)
            if root is None:
                use.others.append(Process(pid, _cmdline(pid, proc)))
            elif root not in use.tinyloop:
                use.tinyloop.append(root)
    return use


def _accepts(host: str, port: int) -> bool:
    """Whether something answers a TCP connection on `port` (for systems without /proc)."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return True
    except OSError:
        return False


def stop(use: PortUse, host: str, timeout: float = STOP_TIMEOUT, proc: Path | None = None) -> None:
    """SIGTERM the tinyloop servers in `use` and wait until nothing listens on the port any more. Refuses (without
    signalling anything) when anything else listens there too."""
    if use.blocked:
        raise LaunchError(use.refusal())
    for server in use.tinyloop:
        try:
            os.kill(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout
    while listening_inodes(host, use.port, proc):
        if time.monotonic() > deadline:
            pids = ", ".join(str(s.pid) for s in use.tinyloop)
            raise LaunchError(f"port {use.port} is still in use {timeout:.0f} s after SIGTERM to pid {pids}")
        time.sleep(0.1)
