"""The proxy's Prometheus metrics, built on a registry the application owns (names: docs/metrics.md).

With several workers (proxy/process/supervisor.py) every worker's values are kept in files of one folder, in
prometheus_client's multiprocess mode, and each worker's /metrics answers for them all: a scrape lands on any one
worker and must see the whole proxy. Gauges say how workers' values combine (`multiprocess_mode`, which a single
process ignores).
"""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.replicas.registry import Replica

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_COMMIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STACK_LABELS = ("endpoint", "fingerprint", "model", "kernel_mode", "hardware")


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, *, shared_folder: Path | None = None) -> None:
        """`shared_folder`: the multiprocess folder every worker writes to (set in the worker's environment as
        PROMETHEUS_MULTIPROC_DIR before prometheus_client is imported, which is how that library is told)."""
        self.registry = registry
        self.shared_folder = shared_folder
        # Each answer's counter and histogram children, by their labels: finding them by name every time costs
        # several times the update itself. As many entries as the metrics have label sets.
        self._answered: dict[tuple[tuple[str, ...], int], tuple[Counter, Histogram]] = {}
        self._tokens: dict[tuple[str, str, str], Counter] = {}
        self.requests = Counter(
            "stackpin_requests",
            "Answered requests by HTTP status",
            [*STACK_LABELS, "code"],
            registry=registry,
        )
        self.duration = Histogram(
            "stackpin_request_duration_seconds",
            "Time from receipt to the last byte",
            STACK_LABELS,
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "stackpin_request_errors",
            "Errors by OpenAI error type",
            ["endpoint", "fingerprint", "error"],
            registry=registry,
        )
        self.tokens = Counter(
            "stackpin_tokens",
            "Prompt and completion tokens",
            ["fingerprint", "model", "direction"],
            registry=registry,
        )
        self.replays = Counter("stackpin_replays", "Replays by outcome", ["outcome"], registry=registry)
        self.replica_up = Gauge(
            "stackpin_replica_up",
            "1 while the replica is in rotation",
            ["replica", "fingerprint"],
            registry=registry,
            multiprocess_mode="min",  # in rotation only if every worker has it there
        )
        self.replica_outstanding = Gauge(
            "stackpin_replica_outstanding",
            "Requests in flight to the replica",
            ["replica"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.quarantines = Counter(
            "stackpin_quarantines", "Replicas taken out of rotation", ["replica", "reason"], registry=registry
        )
        self.records_marked = Counter(
            "stackpin_records_marked",
            "Records marked because their stack changed",
            ["reason"],
            registry=registry,
        )
        self.audit_commit = Histogram(
            "stackpin_audit_commit_seconds",
            "Time of one group commit",
            buckets=_COMMIT_BUCKETS,
            registry=registry,
        )
        self.audit_batch = Histogram(
            "stackpin_audit_batch_size",
            "Records in one group commit",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.audit_queue = Gauge(
            "stackpin_audit_queue_depth",
            "Records waiting to be committed",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.fleet_stale = Gauge(
            "stackpin_fleet_state_stale",
            "1 while the shared fleet state is unreachable",
            registry=registry,
            multiprocess_mode="max",
        )

        self.log_diverged = Gauge(
            "stackpin_audit_log_diverged",
            "1 while the audit log refuses to integrate new entries: new answers cannot be proven",
            registry=registry,
            # Set by the worker a scrape reaches, from its integrator; every worker's reads the one log, so the
            # latest scrape's value is the log's state, and an older 1 must not outlive a repair.
            multiprocess_mode="livemostrecent",
        )

    def exposition(self) -> bytes:
        """The text a scrape gets: this process's metrics, or every worker's together."""
        if self.shared_folder is None:
            return generate_latest(self.registry)
        combined = CollectorRegistry()
        MultiProcessCollector(combined, path=str(self.shared_folder))
        return generate_latest(combined)

    def answered(self, labels: tuple[str, ...], status: int, seconds: float) -> None:
        """One answer, of the stack `labels` (STACK_LABELS) with HTTP `status`, `seconds` from receipt."""
        children = self._answered.get((labels, status))
        if children is None:
            children = (self.requests.labels(*labels, str(status)), self.duration.labels(*labels))
            self._answered[(labels, status)] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(seconds)

    def counted_tokens(self, fingerprint: str, model: str, direction: str, count: int) -> None:
        """`count` tokens of an answer from the stack `fingerprint`, `direction` prompt or completion."""
        key = (fingerprint, model, direction)
        counter = self._tokens.get(key)
        if counter is None:
            counter = self._tokens[key] = self.tokens.labels(*key)
        counter.inc(count)

    def observe_replicas(self, replicas: list[Replica]) -> None:
        for replica in replicas:
            self.replica_up.labels(replica.name, replica.fingerprint or "none").set(
                1 if replica.in_rotation else 0
            )
            self.replica_outstanding.labels(replica.name).set(replica.outstanding)

    # The audit store's CommitObserver.
    def committed(self, batch_size: int, seconds: float) -> None:
        self.audit_batch.observe(batch_size)
        self.audit_commit.observe(seconds)

    def queue_depth(self, depth: int) -> None:
        self.audit_queue.set(depth)
