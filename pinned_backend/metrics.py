"""The backend's Prometheus metrics (names and labels as docs/metrics.md fixes them), on a registry it is
given.

The server owns the registry and passes it in, so two apps in one process never share counters. This module
only declares the metrics and turns the engine's per-step statistics into observations; it knows nothing of
HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pinned_backend.engine import StepStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BackendMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.info = Gauge(
            "stackpin_backend_info",
            "Always 1; carries the stack's labels.",
            ["fingerprint", "model", "kernel_mode", "hardware"],
            registry=registry,
        )
        self.requests = Counter(
            "stackpin_backend_requests_total",
            "Answered requests by HTTP status.",
            ["endpoint", "code"],
            registry=registry,
        )
        self.step_seconds = Histogram(
            "stackpin_backend_step_seconds",
            "Time of one engine step.",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "stackpin_backend_batch_size",
            "Sequences in one engine step.",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "stackpin_backend_tokens_total", "Tokens processed.", ["phase"], registry=registry
        )
        self.steps = Counter(
            "stackpin_backend_steps_total",
            "Engine steps by how they ran: replayed from a CUDA graph, captured into one first, or eagerly.",
            ["launch"],
            registry=registry,
        )
        self.padding_tokens = Counter(
            "stackpin_backend_padding_tokens_total",
            "Tokens computed only to fill a step to a captured shape.",
            registry=registry,
        )
        self.cached_tokens = Counter(
            "stackpin_backend_prefix_cache_tokens_total",
            "Prompt tokens found in the prefix cache, so not computed.",
            registry=registry,
        )
        self.draft_tokens = Counter(
            "stackpin_backend_draft_tokens_total",
            "Draft tokens verified by speculative decoding, by outcome: accepted or rejected.",
            ["outcome"],
            registry=registry,
        )
        self.running = Gauge(
            "stackpin_backend_running_sequences", "Sequences in the running batch.", registry=registry
        )
        self.queue_depth = Gauge(
            "stackpin_backend_queue_depth", "Requests waiting to join the batch.", registry=registry
        )
        self.kv_used = Gauge(
            "stackpin_backend_kv_cache_used_ratio",
            "Share of the KV cache's blocks in use.",
            registry=registry,
        )

    def set_stack(self, stack: Mapping[str, Any], fingerprint: str) -> None:
        self.info.labels(
            fingerprint=fingerprint,
            model=stack["model"],
            kernel_mode=stack["kernel_mode"],
            hardware=stack["hardware"],
        ).set(1)

    def observe_step(self, stats: StepStats) -> None:
        """Called from the engine's thread after every step; prometheus_client's metrics are thread-safe."""
        if stats.sequences:  # an idle step computed nothing, so it is not a step worth timing
            self.step_seconds.observe(stats.seconds)
            self.batch_size.observe(stats.sequences)
            self.steps.labels(launch=stats.launch).inc()
            self.padding_tokens.inc(stats.padded_tokens)
        self.tokens.labels(phase="prefill").inc(stats.prefill_tokens)
        self.tokens.labels(phase="decode").inc(stats.decode_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.draft_tokens.labels(outcome="accepted").inc(stats.accepted_draft_tokens)
        self.draft_tokens.labels(outcome="rejected").inc(stats.draft_tokens - stats.accepted_draft_tokens)
        self.running.set(stats.running)
        self.queue_depth.set(stats.waiting)
        self.kv_used.set(stats.kv_used_ratio)

    def observe_request(self, endpoint: str, code: int) -> None:
        self.requests.labels(endpoint=endpoint, code=str(code)).inc()
