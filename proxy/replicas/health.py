"""The health monitor: asks every self-describing replica for its stack, at start and then periodically.

A replica enters rotation when it first proves its stack, leaves it while unreachable, and is quarantined when
the stack it proves differs from the one registered (or when an answer arrives under another fingerprint). Then
every record it produced since its last good check gets a `flag` entry in the audit log (invariant 3). Declared
upstream replicas cannot prove anything: they stay in rotation on their declaration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

import aiohttp
import structlog

from proxy.audit import AuditStore
from proxy.errors import ReplicaUnavailable, StackMismatch
from proxy.metrics import ProxyMetrics
from proxy.replicas.forward import describe
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
    ) -> None:
        self.registry = registry
        self.store = store
        self.session = session
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.clock = clock
        self.board = board  # fleet mode: where quarantines are shared (proxy/fleet/link.py)

    async def check_all(self) -> None:
        replicas = [
            r for r in self.registry.all() if not r.declared and not r.leased and r.quarantined is None
        ]
        await asyncio.gather(*(self.check(r) for r in replicas))
        self.metrics.observe_replicas(self.registry.all())

    async def check(self, replica: Replica) -> None:
        now = self.clock()
        try:
            described = await describe(self.session, replica.url, timeout_s=self.timeout_s)
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
            log.info("replica_proved_stack", replica=replica.name, fingerprint=computed)
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
