"""The engine loop: one thread advances every running request by one step per iteration — all their plain decode
steps and prompt prefills in one batched forward pass (`Engine.step_many`, continuous batching) — and hands step
events to the asyncio side. The event loop never touches the model; a cancelled request leaves at the next step,
a new one joins at the next step.

Requests beyond `max_running` wait in FIFO order; past `max_waiting` waiting ones, `submit` refuses more (the
server answers 503 with Retry-After). Each running request owns its own KV cache (in its TokenStream).

A job ends in one of four ways, each delivered to its consumer as a final event: the engine finished it (EOS, a
stop token, max_tokens), its step failed (`finish_reason` "error", the failure's message attached; the other
requests of the batch go on), it ran past the per-request wall-time limit, or the server is shutting down (both
"aborted"). A job whose consumer went away (`cancel`) is dropped without an event.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field

from .._core import Engine, Generation, StepEvent, TinyloopError, TokenStream, release_memory
from .metrics import Metrics

log = logging.getLogger("tinyloop.server")

TRIM_SECONDS = 10.0  # how often a busy engine loop hands freed memory back to the system


def _malloc_trim():
    """glibc's `malloc_trim`, or None elsewhere. The engine allocates through mimalloc (`release_memory` returns
    what it holds), Python through the C library; glibc keeps the pages of freed blocks in its arenas, and trimming
    returns them, so RSS follows the memory actually in use."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def release_all_memory() -> None:
    """Hand the memory both allocators hold but do not use back to the system."""
    release_memory()
    if _TRIM is not None:
        _TRIM(0)


class Overloaded(Exception):
    """The waiting queue is full, or the server is shutting down."""


@dataclass(frozen=True)
class Ended:
    """A final event the runner makes itself (shaped like a StepEvent that carries no token)."""

    finish_reason: str
    error: str | None = None
    token_id: int = -1
    bytes: bytes = b""
    logprob: None = None


@dataclass
class Job:
    stream: TokenStream
    loop: asyncio.AbstractEventLoop
    mode: str = "generate"  # label for the draft-token metrics
    loops: int = 0  # the loops it runs (verifies, when speculative) at: read once, the engine thread owns the stream
    draft_stats: tuple[int, int, int] = (0, 0, 0)  # (rounds, proposed, accepted), set when the job leaves
    auto_loops: tuple[int, int] = (0, 0)  # adaptive depth's (tokens decided, loops they ran), set when it leaves
    cached: int = 0  # prompt tokens the prompt cache supplied: set before the first token is handed out
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    cancelled_at_step: int | None = None  # the runner's step count when the consumer left
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None

    async def events(self):
        """Step events (or a final `Ended`) until the finishing one."""
        while True:
            item = await self.queue.get()
            yield item
            if item.finish_reason is not None:
                return


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        max_running: int = 16,
        max_waiting: int = 256,
        request_timeout: float = 0.0,
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout  # seconds of wall time per request; 0: no limit
        self.steps = 0  # batched steps run so far
        self._trimmed = time.monotonic()
        self._closing: str | None = None  # set by `abort_all`: why new work is refused
        self._stopped = False  # set by `close`: the engine thread ends once nothing runs or waits
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt: list[int], generation: Generation, mode: str = "generate") -> Job:
        """Queue a generation (`mode` labels its draft-token metrics). Raises the engine's typed errors (bad
        arguments, context length) at once. A generation with a grammar is set up off the event loop: compiling
        one takes milliseconds (the first, which builds the vocabulary's token trie, a hundred or more)."""
        if generation.grammar is None:
            stream = self.engine.stream(prompt, generation)
        else:
            stream = await asyncio.get_running_loop().run_in_executor(None, self.engine.stream, prompt, generation)
        job = Job(stream=stream, loop=asyncio.get_running_loop(), mode=mode, loops=stream.loops)
        with self._cv:
            if self._closing:
                raise Overloaded(self._closing)
            self._drop_cancelled_waiting()
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_waiting:
                raise Overloaded(
                    f"the server is at capacity ({len(self._running)} requests running, "
                    f"{len(self._waiting)} waiting); retry shortly"
                )
            self._waiting.append(job)
            self.metrics.requests_waiting.set(len(self._waiting))
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The consumer went away: a running job leaves at the next step, a waiting one at once."""
        with self._cv:
            if job.cancelled:
                return
            job.cancelled, job.cancelled_at_step = True, self.steps
            self._cv.notify()

    def abort_all(self, reason: str) -> None:
        """Shutdown: refuse new work, and end every waiting and running job with `finish_reason` "aborted"."""
        with self._cv:
            self._closing = reason
            self._cv.notify()

    def close(self) -> None:
        """End the engine thread and wait for it (the model is being unloaded: nothing runs or waits, and the
        server sends no more work here)."""
        with self._cv:
            self._closing = self._closing or "the model is being unloaded"
            self._stopped = True
            self._cv.notify()
        self._thread.join()

    def idle(self) -> bool:
        """Nothing running or waiting."""
        with self._cv:
            return not self._running and not self._waiting

    def _drop_cancelled_waiting(self) -> None:
        """Forget waiting jobs whose client went away (caller holds the lock)."""
        if any(j.cancelled for j in self._waiting):
            for _ in range(sum(j.cancelled for j in self._waiting)):
                self.metrics.cancel_steps.observe(0)  # it never took a step
            self._waiting = collections.deque(j for j in self._waiting if not j.cancelled)
            self.metrics.requests_waiting.set(len(self._waiting))

    def _update_gauges(self) -> None:
        """Called from the engine thread only (it owns `_running`). The running count is set last, so a reader
        that sees it fall to 0 also sees the KV bytes and the queue as they are then."""
        self.metrics.kv_cache_bytes.set(sum(j.stream.kv_bytes for j in self._running))
        self.metrics.requests_waiting.set(len(self._waiting))
        self.metrics.requests_running.set(len(self._running))

    def _retire(self, job: Job) -> None:
        """Take a job out of the running set (engine thread); its draft counters go to the metrics."""
        self._running.remove(job)
        job.draft_stats, job.auto_loops = job.stream.draft_stats, job.stream.auto_loops
        job.stream.release()  # its KV goes to the prompt cache before the next step looks there
        self._prompt_cache_report()
        _, proposed, accepted = job.draft_stats
        if proposed:
            self.metrics.draft_proposed.labels(job.mode).inc(proposed)
            self.metrics.draft_accepted.labels(job.mode).inc(accepted)
        if job.cancelled:
            self.metrics.cancel_steps.observe(self.steps - (job.cancelled_at_step or 0))

    def _prompt_cache_report(self) -> None:
        """The prompt cache's gauges and what it skipped (damaged or foreign files), logged: it changes when a job
        leaves (its KV is offered) or starts (a file may be read), so this runs per job, not per step."""
        entries, held = self.engine.prompt_cache_usage
        self.metrics.prompt_cache_bytes.set(held)
        self.metrics.prompt_cache_entries.set(entries)
        for notice in self.engine.prompt_cache_notices():
            log.warning("%s", notice)

    def _deliver(self, job: Job, item: StepEvent | Ended) -> None:
        job.loop.call_soon_threadsafe(job.queue.put_nowait, item)

    def _admit(self) -> list[Job]:
        """Wait until something can run; move waiting jobs in; return the jobs to end now (shutdown)."""
        with self._cv:
            while True:  # sleep until something can run (never spin on a queue that cannot move)
                self._drop_cancelled_waiting()
                ending = list(self._waiting) + [j for j in self._running if not j.cancelled]
                if self._closing and ending:
                    self._waiting.clear()
                    return ending
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                if self._running or self._stopped:
                    return []
                self.metrics.requests_waiting.set(len(self._waiting))
                self._trim(idle=True)
                self._cv.wait()

    def _loop(self) -> None:
        while not (self._stopped and not self._running and not self._waiting):
            try:
                self._iteration()
            except Exception as e:
                log.exception("the engine loop failed; ending its running requests")
                failed, self._running = self._running, []
                for job in failed:
                    self._deliver(job, Ended("error", f"internal error: {type(e).__name__}"))

    def _iteration(self) -> None:
        for job in self._admit():
            if job in self._running:
                self._retire(job)
            self._deliver(job, Ended("aborted"))
        now = time.perf_counter()
        for job in list(self._running):
            if job.cancelled:
                self._retire(job)
            elif self.request_timeout and now - job.submitted > self.request_timeout:
                log.warning("a request ran past the %.0f s wall-time limit: aborted", self.request_timeout)
                self._retire(job)
                self._deliver(job, Ended("aborted"))
        active = list(self._running)
        results = self._step(active)
        self.steps += bool(active)
        self._hand_out(active, results)
        self._update_gauges()
        self._trim(idle=False)

    def _trim(self, idle: bool) -> None:
        now = time.monotonic()
        if idle or now - self._trimmed > TRIM_SECONDS:
            release_all_memory()
            self._trimmed = now

    def _step(self, active: list[Job]) -> list:
        """One batched step; if the batch as a whole fails, each stream steps alone, so that only the stream
        at fault fails."""
        if not active:
            return []
        try:
            return self.engine.step_many([job.stream for job in active])
        except TinyloopError:
            log.exception("a batched step failed; stepping its %d streams one by one", len(active))
        results = []
        for job in active:
            try:
                results.append(self.engine.step_many([job.stream])[0])
            except TinyloopError as e:
                results.append(e)
        return results

    def _hand_out(self, active: list[Job], results: list) -> None:
        now = time.perf_counter()
        for job, event in zip(active, results, strict=True):
            if event is None or isinstance(event, BaseException):
                log.error("a request's generation failed: %s", event or "the stream had ended")
                self._retire(job)
                self._deliver(job, Ended("error", str(event) if event is not None else "the stream had ended"))
                continue
            if event.token_id >= 0:
                if job.first_token is None:
                    job.first_token, job.cached = now, job.stream.cached_tokens
                    self.metrics.prompt_cached_tokens.inc(job.cached)
                    self.metrics.ttft.observe(now - job.submitted)
                else:
                    self.metrics.itl.observe(now - (job.last_token or now))
                job.last_token = now
                self.metrics.generation_tokens.inc()
            if event.finish_reason is not None:
                self._retire(job)
            elif event.token_id < 0:
                continue  # a step of a long prompt's chunked prefill: nothing to hand out yet
            self._deliver(job, event)
