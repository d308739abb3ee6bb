"""Prometheus metrics (GET /metrics) and the same snapshot as JSON (GET /metrics/json)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tinyloop_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_cached_tokens = Counter(
            "tinyloop_prompt_cached_tokens", "Prompt tokens whose KV came from the prompt cache", registry=r
        )
        self.generation_tokens = Counter("tinyloop_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "tinyloop_time_to_first_token_seconds",
            "Time from submission to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tinyloop_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge("tinyloop_requests_running", "Requests being generated", registry=r)
        self.requests_waiting = Gauge("tinyloop_requests_waiting", "Requests queued for the engine", registry=r)
        self.draft_proposed = Counter(
            "tinyloop_draft_tokens_proposed", "Draft tokens proposed, by mode", ["mode"], registry=r
        )
        self.draft_accepted = Counter(
            "tinyloop_draft_tokens_accepted", "Draft tokens accepted, by mode", ["mode"], registry=r
        )
        self.threads = Gauge("tinyloop_threads", "Compute threads of the engine", registry=r)
        self.model_resident = Gauge("tinyloop_model_resident", "1 while the model is loaded, else 0", registry=r)
        self.kv_cache_bytes = Gauge("tinyloop_kv_cache_bytes", "KV-cache bytes held by running requests", registry=r)
        self.prompt_cache_bytes = Gauge(
            "tinyloop_prompt_cache_bytes", "KV bytes the prompt cache keeps in memory for later requests", registry=r
        )
        self.prompt_cache_entries = Gauge(
            "tinyloop_prompt_cache_entries", "Prompt prefixes the prompt cache keeps in memory", registry=r
        )
        self.client_disconnects = Counter(
            "tinyloop_client_disconnects",
            "Requests whose client left before the answer was complete (their generation is cancelled)",
            registry=r,
        )
        self.cancel_steps = Histogram(
            "tinyloop_cancel_steps",
            "Engine steps a cancelled request still took part in after its cancellation",
            buckets=(0, 1, 2, 3, 5, 10, 100),
            registry=r,
        )

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """Every sample, keyed by metric name; labelled samples as a list of {labels, value}."""
        out: dict[str, Any] = {}
        for family in self.registry.collect():
            for s in family.samples:
                if s.labels and not s.name.endswith(("_bucket",)):
                    out.setdefault(s.name, []).append({"labels": s.labels, "value": s.value})
                elif s.name.endswith("_bucket"):
                    out.setdefault(s.name, {})[s.labels["le"]] = s.value
                else:
                    out[s.name] = s.value
        return out
