"""The engine loop: one thread advances every running request by one step per iteration — all their plain decode
steps and prompt prefills in one batched forward pass (`Engine.step_many`, continuous batching) — and hands step
events to the asyncio side. The event loop never touches the model; a cancelled request leaves at the next step,
a new one joins at the next step.

Requests beyond `max_running` wait in FIFO order; past `max_waiting` waiting ones, `submit` refuses more (the
server answers 503 with Retry-After). Each running request owns its own KV cache (in its TokenStream).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field

from .._core import Engine, SamplingParams, StepEvent, TinyloopError, TokenStream
from .metrics import Metrics


class Overloaded(Exception):
    """The waiting queue is full."""


@dataclass
class Job:
    stream: TokenStream
    loop: asyncio.AbstractEventLoop
    mode: str = "generate"  # label for the draft-token metrics
    draft_stats: tuple[int, int, int] = (0, 0, 0)  # (rounds, proposed, accepted), set when the job leaves
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None

    def cancel(self) -> None:
        self.cancelled = True  # a running job leaves at the next step; a waiting one when the queue is next read

    async def events(self):
        """Step events until the finishing one; an engine failure is raised here."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class EngineRunner:
    def __init__(self, engine: Engine, metrics: Metrics, max_running: int = 16, max_waiting: int = 256):
        self.engine = engine
        self.metrics = metrics
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="tinyloop-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, loops: int | None,
               draft: tuple[int, int, int] | None = None, mode: str = "generate", cache_window: int = 0) -> Job:
        """Queue a generation (speculative when `draft` = (draft_loops, draft_ahead, k_branches); a sliding KV
        window when `cache_window` > 0). Raises the engine's typed errors (bad arguments, context length) at once."""
        spec = (draft[0], draft[1]) if draft else None
        stream = self.engine.stream(prompt, params, loops, spec, k_branches=draft[2] if draft else 1,
                                    cache_window=cache_window)
        job = Job(stream=stream, loop=asyncio.get_running_loop(), mode=mode)
        with self._cv:
            self._drop_cancelled_waiting()
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_waiting:
                raise Overloaded(f"the server is at capacity ({len(self._running)} requests running, "
                                 f"{len(self._waiting)} waiting); retry shortly")
            self._waiting.append(job)
            self.metrics.requests_waiting.set(len(self._waiting))
            self._cv.notify()
        return job

    def _drop_cancelled_waiting(self) -> None:
        """Forget waiting jobs whose client went away (caller holds the lock)."""
        if any(j.cancelled for j in self._waiting):
            self._waiting = collections.deque(j for j in self._waiting if not j.cancelled)

    def _update_gauges(self) -> None:
        """Called from the engine thread only (it owns `_running`)."""
        self.metrics.requests_running.set(len(self._running))
        self.metrics.requests_waiting.set(len(self._waiting))
        self.metrics.kv_cache_bytes.set(sum(j.stream.kv_bytes for j in self._running))

    def _retire(self, job: Job) -> None:
        """Take a job out of the running set (engine thread); its draft counters go to the metrics."""
        self._running.remove(job)
        job.draft_stats = job.stream.draft_stats
        _, proposed, accepted = job.draft_stats
        if proposed:
            self.metrics.draft_proposed.labels(job.mode).inc(proposed)
            self.metrics.draft_accepted.labels(job.mode).inc(accepted)

    def _deliver(self, job: Job, item: StepEvent | BaseException) -> None:
        job.loop.call_soon_threadsafe(job.queue.put_nowait, item)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:  # sleep until something can run (never spin on a queue that cannot move)
                    self._drop_cancelled_waiting()
                    while self._waiting and len(self._running) < self.max_running:
                        self._running.append(self._waiting.popleft())
                    if self._running:
                        break
                    self.metrics.requests_waiting.set(len(self._waiting))
                    self._cv.wait()
            for job in [j for j in self._running if j.cancelled]:
                self._retire(job)
            active = list(self._running)
            try:
                results = self.engine.step_many([job.stream for job in active]) if active else []
            except TinyloopError as e:  # the batch itself failed (an engine bug): fail its requests, keep serving
                results = [e] * len(active)
            now = time.perf_counter()
            for job, event in zip(active, results):
                if event is None or isinstance(event, BaseException):
                    self._retire(job)
                    self._deliver(job, event if event is not None else TinyloopError("the stream had ended"))
                    continue
                if event.token_id >= 0:
                    if job.first_token is None:
                        job.first_token = now
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
            self._update_gauges()
