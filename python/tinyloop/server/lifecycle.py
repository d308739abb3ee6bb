"""Shutting down without cutting anyone off: on SIGTERM or SIGINT, every request in flight is ended by the engine
loop with `finish_reason` "aborted" (streams send their final event and `[DONE]`), new requests are refused with
503, and once the answers are out (or after `DRAIN_SECONDS`) granian's own handler stops the server.

granian installs its handlers on the worker's event loop before the application starts; `install_drain` runs in
the application's startup and puts its own in front of them, keeping theirs to call once the drain is done.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

from .gate import InFlight
from .runner import EngineRunner

log = logging.getLogger("tinyloop.server")

DRAIN_SECONDS = 3.0  # the longest wait for answers in flight before the server stops anyway
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_drain(runner: Callable[[], EngineRunner | None], inflight: InFlight) -> None:
    """`runner` gives the engine runner of the moment (None while the model is not loaded)."""
    loop = asyncio.get_running_loop()
    handlers = getattr(loop, "_signal_handlers", None)  # asyncio's Unix loops keep the registered handles here
    if not isinstance(handlers, dict):
        log.warning("cannot chain the server's signal handlers: in-flight requests will not be drained on SIGTERM")
        return
    previous = {sig: handlers.get(sig) for sig in _SIGNALS}
    started = False
    draining: set[asyncio.Task] = set()  # the loop keeps only weak references to its tasks

    def on_signal(sig: signal.Signals) -> None:
        nonlocal started
        if started:
            return
        started = True
        log.info("%s: ending %s request(s) in flight, then stopping", sig.name, inflight.count)
        current = runner()
        if current is not None:
            current.abort_all("the server is shutting down")
        draining.add(loop.create_task(_drain_then(inflight, previous.get(sig))))

    for sig in _SIGNALS:
        if previous[sig] is not None:
            loop.add_signal_handler(sig, on_signal, sig)


async def _drain_then(inflight: InFlight, then: asyncio.Handle | None) -> None:
    deadline = time.monotonic() + DRAIN_SECONDS
    while inflight.count > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if then is not None:
        then._run()  # granian's handler: stop accepting, finish the connections, exit
