"""The replica registry: which replicas exist, of which kind, which stack each has, and which are in rotation.

This is the in-process registry, the embedded default. It holds state only; the health monitor feeds it what the
replicas say, and the router reads it. Every change to a replica goes through a `Registry` method; what a request
was served by is a `ReplicaSnapshot`, taken at dispatch, which no later change to the replica reaches. A replica enters rotation only once its stack is known: declared in
configuration for an upstream API, proved at `GET /v1/stack` for a pinned_backend, reported by an engine (its kind
says which, proxy/replicas/kinds/). A replica whose proven or reported stack changes is quarantined: out of rotation until an operator restarts the proxy (in fleet mode: lifts the quarantine,
`stackpin fleet lift`), because every answer it gave since its last good check is now suspect (invariant 3,
docs/invariants.md). A lift returns it as if new; the records it marked stay marked.

In fleet mode (`[fleet] redis_url`) this registry stays the router's only view: `proxy/fleet/sync.py` keeps it in
step with the leases, quarantines and outstanding counts that every proxy shares in Redis.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import Protocol

from proxy.endpoints import RESPONSES
from proxy.replicas.kinds import ReplicaKind, StackSource
from proxy.stack import Stack


class Observation(Enum):
    FIRST = "first"  # the replica proved its stack for the first time
    SAME = "same"  # the stack is the one registered
    CHANGED = "changed"  # the stack differs from the one registered: quarantine


@dataclass(frozen=True)
class ReplicaSnapshot:
    """A replica as it was when a request was dispatched to it: what the request's records and answer say it was
    served by, whatever happens to the replica afterwards (a quarantine, a lift, a new lease)."""

    name: str
    url: str
    kind: ReplicaKind
    stack: Stack
    fingerprint: str
    endpoints: frozenset[str]

    @property
    def stack_source(self) -> StackSource:
        return self.kind.source

    @property
    def self_described(self) -> bool:
        return self.kind.source is not StackSource.DECLARED

    def natively(self, endpoint: str) -> bool:
        return endpoint in self.endpoints


@dataclass
class Replica:
    name: str
    url: str
    kind: ReplicaKind
    stack: Stack | None = None
    fingerprint: str | None = None
    reachable: bool = False
    quarantined: str | None = None
    last_good_check: datetime | None = None
    outstanding: int = 0
    leased: bool = (
        False  # fleet mode: its heartbeat sidecar proves its stack, not this proxy's health monitor
    )
    # The routes it answers itself; unset: its kind's (an upstream's come from its configuration).
    endpoints: frozenset[str] = frozenset()
    model: str | None = None  # the model it is asked about, for an engine that serves several (Ollama)

    def __post_init__(self) -> None:
        if not self.endpoints:
            self.endpoints = self.kind.endpoints(None)

    @property
    def stack_source(self) -> StackSource:
        return self.kind.source

    @property
    def self_described(self) -> bool:
        """Whether its stack comes from the replica itself (proven or reported), so a check can reach it."""
        return self.kind.source is not StackSource.DECLARED

    @property
    def in_rotation(self) -> bool:
        return self.stack is not None and self.reachable and self.quarantined is None

    def natively(self, endpoint: str) -> bool:
        """Whether it answers `endpoint` itself, rather than through the proxy's translation."""
        return endpoint in self.endpoints

    def serves(self, endpoint: str) -> bool:
        return self.natively(endpoint) or (endpoint == RESPONSES and RESPONSES in self.kind.translated())

    def snapshot(self) -> ReplicaSnapshot:
        """What it is now, frozen; only a replica whose stack is known (one in rotation) can be served by."""
        assert self.stack is not None and self.fingerprint is not None
        return ReplicaSnapshot(self.name, self.url, self.kind, self.stack, self.fingerprint, self.endpoints)


class OutstandingCounter(Protocol):
    """Told of every request that starts or ends on a replica (fleet mode shares the counts); must not block."""

    def moved(self, name: str, delta: int) -> None: ...


@dataclass
class Registry:
    replicas: dict[str, Replica] = field(default_factory=dict)
    counter: OutstandingCounter | None = None  # fleet mode: the shared counts (proxy/fleet/link.py)

    @classmethod
    def of(cls, replicas: Iterable[Replica]) -> Registry:
        return cls({replica.name: replica for replica in replicas})

    def add(self, replica: Replica) -> None:
        self.replicas[replica.name] = replica

    def get(self, name: str) -> Replica | None:
        return self.replicas.get(name)

    def all(self) -> list[Replica]:
        return list(self.replicas.values())

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.in_rotation]

    def observe(self, name: str, stack: Stack, fingerprint: str, now: datetime) -> Observation:
        replica = self.replicas[name]
        if replica.fingerprint is None:
            replica.stack, replica.fingerprint = stack, fingerprint
            replica.reachable, replica.last_good_check = True, now
            return Observation.FIRST
        if replica.fingerprint == fingerprint:
            replica.reachable = True
            if replica.quarantined is None:
                replica.last_good_check = now
            return Observation.SAME
        return Observation.CHANGED

    def quarantine(self, name: str, reason: str) -> None:
        self.replicas[name].quarantined = reason

    def lift(self, name: str, now: datetime) -> None:
        """Back from quarantine. A proven or reported one comes back as if new: the next stack it describes is the
        one it is registered with, and nothing it served before `now` is its to answer for again. A declared one
        keeps the stack its configuration declares."""
        replica = self.replicas[name]
        replica.quarantined = None
        if replica.self_described:
            replica.stack = replica.fingerprint = None
            replica.reachable, replica.last_good_check = False, now

    def unreachable(self, name: str) -> None:
        self.replicas[name].reachable = False

    def lease(self, name: str, url: str) -> None:
        """Fleet mode: a heartbeat sidecar proves the replica's stack at `url` (the health monitor stops polling
        it); the lease says where it is now."""
        replica = self.replicas[name]
        replica.leased, replica.url = True, url

    def count_outstanding(self, name: str, count: int) -> None:
        """Fleet mode: the requests in flight on the replica across the fleet, as the last sync counted them."""
        self.replicas[name].outstanding = count

    def acquire(self, name: str) -> None:
        self.replicas[name].outstanding += 1
        if self.counter is not None:
            self.counter.moved(name, 1)

    def release(self, name: str) -> None:
        self.replicas[name].outstanding -= 1
        if self.counter is not None:
            self.counter.moved(name, -1)
