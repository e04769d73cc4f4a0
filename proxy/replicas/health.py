"""The health monitor: asks every self-describing replica's kind for its stack, at start and then periodically.

A replica enters rotation when it first proves its stack, leaves it while unreachable, and is quarantined when
the stack it proves differs from the one registered (or when an answer arrives under another fingerprint). Then
every record it produced since its last good check gets a `flag` entry in the audit log (invariant 3). A stack an
engine reports is checked the same way as one a pinned_backend proves: a restart with another model, dtype or
length limit shows as a changed stack. Declared upstream replicas cannot describe anything: they stay in rotation
on their declaration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Protocol

import aiohttp
import structlog
from pydantic import SecretStr

from proxy.audit import AuditStore
from proxy.errors import ReplicaUnavailable, StackMismatch
from proxy.metrics import ProxyMetrics
from proxy.replicas.kinds.base import Target
from proxy.replicas.registry import Observation, Registry, Replica
from proxy.serving.records import flag_entry

log = structlog.get_logger("stackpin.health")


class QuarantineBoard(Protocol):
    """Where a fleet shares its quarantines (proxy/fleet/sync.py); absent for a single proxy."""

    async def publish(self, replica: Replica, reason: str, observed: str | None, since: datetime) -> bool:
        """Shares the quarantine; True when this proxy is the one to mark the replica's records."""
        ...


class HealthMonitor:
    def __init__(
        self,
        registry: Registry,
        store: AuditStore,
        session: aiohttp.ClientSession,
        metrics: ProxyMetrics,
        *,
        timeout_s: float,
        clock: Callable[[], datetime],
        board: QuarantineBoard | None = None,
        replica_keys: Mapping[str, SecretStr] | None = None,
    ) -> None:
        self.registry = registry
        self.store = store
        self.session = session
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.clock = clock
        self.board = board  # fleet mode: where quarantines are shared (proxy/fleet/link.py)
        self.replica_keys = replica_keys or {}  # an engine's describing routes may want its key

    async def check_all(self) -> None:
        replicas = [
            r for r in self.registry.all() if r.self_described and not r.leased and r.quarantined is None
        ]
        await asyncio.gather(*(self.check(r) for r in replicas))
        self.metrics.observe_replicas(self.registry.all())

    async def check(self, replica: Replica) -> None:
        now = self.clock()
        try:
            target = Target(replica.url, self.timeout_s, self.replica_keys.get(replica.name), replica.model)
            described = await replica.kind.describe(self.session, target)
        except ReplicaUnavailable as e:
            if replica.reachable:
                log.warning("replica_unreachable", replica=replica.name, error=str(e))
            self.registry.unreachable(replica.name)
            return
        if not described.honest:
            await self.quarantine(replica, "fingerprint_mismatch", claimed=str(described.claimed))
            return
        stack, computed = described.stack, described.fingerprint
        outcome = self.registry.observe(replica.name, stack, computed, now)
        if outcome is Observation.FIRST:
            log.info(
                "replica_described_stack",
                replica=replica.name,
                fingerprint=computed,
                source=replica.stack_source,
            )
        elif outcome is Observation.CHANGED:
            await self.quarantine(replica, "stack_changed", claimed=computed)

    async def on_mismatch(self, mismatch: StackMismatch) -> None:
        replica = self.registry.get(mismatch.replica.name)
        if replica is not None:
            await self.quarantine(replica, "fingerprint_mismatch", claimed=mismatch.claimed)

    async def quarantine(
        self, replica: Replica, reason: str, *, claimed: str | None, since: datetime | None = None
    ) -> None:
        """Out of rotation for good, and a `flag` on every record since `since` (default: its last good check)."""
        if replica.quarantined is not None:
            return
        self.registry.quarantine(replica.name, reason)
        self.metrics.quarantines.labels(replica.name, reason).inc()
        log.error(
            "replica_quarantined",
            replica=replica.name,
            reason=reason,
            registered=replica.fingerprint,
            observed=claimed,
        )
        since = since or replica.last_good_check or datetime(1970, 1, 1, tzinfo=UTC)
        if self.board is not None and not await self.board.publish(replica, reason, claimed, since):
            return  # another proxy of the fleet marks the records
        now = self.clock()
        for record_id in await self.store.records_served_since(replica.name, since):
            record = await self.store.get_record(record_id, None)
            if record is None:
                continue
            detail = {
                "registered": replica.fingerprint,
                "observed": claimed,
                "last_good_check": since.isoformat(),
            }
            await self.store.append(
                flag_entry(record_id, record.tenant, now, reason=reason, replica=replica.name, detail=detail)
            )
            self.metrics.records_marked.labels(reason).inc()

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_all()
            except Exception:  # one bad round must not end the monitor
                log.exception("health_round_failed")
