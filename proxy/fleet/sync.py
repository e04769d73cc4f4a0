"""Folding the fleet's shared view into this proxy's registry, once a second or so, and knowing when it is stale.

Each round publishes this proxy's in-flight counts and reads every lease, quarantine and the other proxies'
counts; then it updates the local `Registry`, which the router reads without ever waiting on Redis:

- a replica with a live lease is in rotation with the stack its sidecar proved; one whose lease expired leaves;
- a lease whose stack is not the one its replica registered with, or a quarantine in Redis, quarantines the
  replica here too, and a quarantine found here is published there. No proxy or sidecar lifts one: an operator
  does (`stackpin fleet lift`), and a quarantine this proxy has seen in Redis that is gone from it is lifted here;
- outstanding counts are the other proxies' published counts plus this proxy's own, exact ones. Requests move
  the shared counters fire-and-forget (`FleetLink.moved`), so routing never waits on Redis; every round rewrites
  this proxy's absolute counts, which heals a lost increment, and a crashed proxy's counts expire with it.

When Redis cannot be reached the proxy keeps its last view for `max_stale_s`, reports itself stale
(`stackpin_fleet_state_stale`, `/readyz`), then takes the leased replicas out of rotation: it refuses rather than
trust a view it cannot renew. Pins are matched against proved stacks only, so staleness can cost availability,
never a wrong stack; an answer under another fingerprint is still caught per request (`dispatch.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import structlog
from pydantic import ValidationError

from proxy.fleet.documents import Lease
from proxy.fleet.link import FleetLink
from proxy.fleet.state import FleetUnavailable, FleetView
from proxy.metrics import ProxyMetrics
from proxy.replicas.health import HealthMonitor
from proxy.replicas.kinds import KINDS
from proxy.replicas.registry import Observation, Registry, Replica
from proxy.stack import Stack

log = structlog.get_logger("stackpin.fleet")


@dataclass(frozen=True)
class Staleness:
    stale: bool
    stale_for_s: float  # 0 while fresh
    expired: bool  # stale for longer than the bound: the last view is no longer served


def staleness(
    last_ok: datetime | None, stale_since: datetime | None, now: datetime, max_stale_s: float
) -> Staleness:
    """Whether the last view may still be served; stale from the first failed round since the last good one."""
    if stale_since is None:
        return Staleness(False, 0.0, False)
    for_s = max(0.0, (now - (last_ok or stale_since)).total_seconds())
    return Staleness(True, for_s, for_s > max_stale_s)


class FleetSync:
    def __init__(
        self,
        link: FleetLink,
        registry: Registry,
        health: HealthMonitor,
        metrics: ProxyMetrics,
        *,
        interval_s: float,
        max_stale_s: float,
        clock: Callable[[], datetime],
    ) -> None:
        self.link = link
        self.state = link.state
        self.proxy_id = link.proxy_id
        self.registry = registry
        self.health = health
        self.metrics = metrics
        self.interval_s = interval_s
        self.max_stale_s = max_stale_s
        self.clock = clock
        self.last_ok: datetime | None = None
        self.stale_since: datetime | None = None
        self.last_error: str | None = None
        # Quarantines seen in Redis: only these are lifted here when they leave it. One this proxy has just
        # published but not yet read back is not, whatever a view read before the publish says.
        self._seen_in_fleet: set[str] = set()

    def status(self) -> Staleness:
        return staleness(self.last_ok, self.stale_since, self.clock(), self.max_stale_s)

    async def round(self) -> bool:
        """One sync; False when Redis could not be reached (the last view stays, within the bound)."""
        now = self.clock()
        ttl_s = max(5.0, 5 * self.interval_s)
        try:
            own = {name: count for name, count in self.link.inflight.items() if count > 0}
            await self.state.publish_outstanding(
                self.proxy_id, own, expires_at=now.timestamp() + ttl_s, ttl_s=ttl_s
            )
            view = await self.state.read(self.proxy_id, now.timestamp())
            await self.link.share_unshared(view)
        except FleetUnavailable as e:
            self._went_stale(now, str(e))
            return False
        if self.stale_since is not None:
            log.info("fleet_state_reachable_again", stale_s=(now - self.stale_since).total_seconds())
        self.last_ok, self.stale_since, self.last_error = now, None, None
        self.metrics.fleet_stale.set(0)
        await self.apply(view)
        return True

    def _went_stale(self, now: datetime, error: str) -> None:
        if self.stale_since is None:
            self.stale_since = now
            log.error("fleet_state_unreachable", error=error[:300], max_stale_s=self.max_stale_s)
        self.last_error = error
        self.metrics.fleet_stale.set(1)
        if self.status().expired:
            for replica in self.registry.all():
                if replica.leased and replica.reachable:
                    log.error("fleet_view_expired", replica=replica.name)
                    self.registry.unreachable(replica.name)

    async def apply(self, view: FleetView) -> None:
        leased = {r.name for r in self.registry.all() if r.leased}
        for name in sorted(view.names | leased):
            lease, note = view.leases.get(name), view.quarantines.get(name)
            replica = self.registry.get(name)
            if replica is None:
                if lease is None:
                    continue
                if lease.kind not in KINDS:
                    log.error("lease_of_unknown_kind", replica=name, kind=lease.kind)
                    continue
                replica = Replica(name=name, url=lease.url, kind=KINDS[lease.kind], leased=True)
                self.registry.add(replica)
                log.info("replica_leased", replica=name, url=lease.url, fingerprint=lease.fingerprint)
            elif lease is not None and not replica.leased and replica.self_described:
                self.registry.lease(name, lease.url)  # its sidecar now speaks for it
            if note is not None:
                self._seen_in_fleet.add(name)
                if replica.quarantined is None:
                    await self.health.quarantine(
                        replica, note.reason, claimed=note.observed, since=note.last_good_check
                    )
            elif name in self._seen_in_fleet and name not in self.link.unshared:
                self._seen_in_fleet.discard(name)
                if replica.quarantined is not None:
                    log.warning("quarantine_lifted", replica=name, reason=replica.quarantined)
                    self.registry.lift(name, self.clock())
            if replica.leased:
                await self._apply_lease(replica, lease)
        for replica in self.registry.all():
            own = max(0, self.link.inflight.get(replica.name, 0))
            self.registry.count_outstanding(replica.name, view.outstanding.get(replica.name, 0) + own)

    async def _apply_lease(self, replica: Replica, lease: Lease | None) -> None:
        if lease is None:
            if replica.reachable:
                log.warning("lease_expired", replica=replica.name)
            self.registry.unreachable(replica.name)
            return
        self.registry.lease(replica.name, lease.url)
        try:
            stack = Stack.model_validate(lease.stack)
        except ValidationError:
            self.registry.unreachable(replica.name)
            return
        if lease.fingerprint != lease.registered:
            await self.health.quarantine(replica, "stack_changed", claimed=lease.fingerprint)
            return
        outcome = self.registry.observe(replica.name, stack, lease.fingerprint, lease.proved_at)
        if outcome is Observation.CHANGED:
            await self.health.quarantine(replica, "stack_changed", claimed=lease.fingerprint)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.round()
            except Exception:  # one bad round must not end the sync
                log.exception("fleet_round_failed")
