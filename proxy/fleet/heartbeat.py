"""The heartbeat sidecar: runs beside one backend, proves its stack, and renews its lease in Redis.

`stackpin fleet heartbeat --replica-url URL --name NAME [--kind KIND]` asks the replica's kind for its stack (a
pinned_backend's `GET /v1/stack`, whose fingerprint it recomputes from the document, docs/protocol.md; an engine's
self-description, proxy/replicas/kinds/), and renews the lease with the stack it found and the kind, so the backend
itself never speaks to Redis. A backend that stops answering stops being renewed: its lease expires and it leaves
rotation for every proxy. A backend whose stack differs from the one it registered with, or whose claimed
fingerprint is not the one its document hashes to, is quarantined for every proxy; marking the records it served
is left to the proxies, which hold the audit store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from enum import Enum
from typing import Any

import aiohttp
import structlog

from proxy.errors import ReplicaUnavailable
from proxy.fleet.documents import FleetKeys, Lease, Quarantine
from proxy.fleet.state import FleetState, FleetUnavailable, connect
from proxy.replicas.kinds import STACKPIN, ReplicaKind
from proxy.replicas.kinds.base import Target

log = structlog.get_logger("stackpin.heartbeat")


class Beat(Enum):
    PROVED = "proved"  # renewed with the registered stack
    CHANGED = "changed"  # the stack differs from the registered one: quarantined
    LIED = "lied"  # the claimed fingerprint is not the document's: quarantined
    UNREACHABLE = "unreachable"  # the backend did not describe itself: not renewed
    NO_REDIS = "no_redis"  # Redis could not be reached: the lease runs down


class Heartbeat:
    def __init__(
        self,
        state: FleetState,
        session: aiohttp.ClientSession,
        *,
        name: str,
        replica_url: str,
        lease_s: float,
        timeout_s: float,
        clock: Callable[[], datetime],
        kind: ReplicaKind = STACKPIN,
        model: str | None = None,
    ) -> None:
        self.state = state
        self.kind = kind
        self.model = model
        self.session = session
        self.name = name
        self.replica_url = replica_url.rstrip("/")
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.clock = clock

    async def beat(self) -> Beat:
        now = self.clock()
        try:
            target = Target(self.replica_url, self.timeout_s, model=self.model)
            described = await self.kind.describe(self.session, target)
        except ReplicaUnavailable as e:
            log.warning("replica_unreachable", replica=self.name, error=str(e))
            return Beat.UNREACHABLE
        try:
            return await self._record(described.document, described.fingerprint, described.claimed, now)
        except FleetUnavailable as e:
            log.warning("fleet_state_unreachable", replica=self.name, error=str(e)[:300])
            return Beat.NO_REDIS

    async def _record(self, document: dict[str, Any], computed: str, claimed: object, now: datetime) -> Beat:
        if claimed != computed:
            await self._quarantine("fingerprint_mismatch", registered=None, observed=str(claimed), now=now)
            return Beat.LIED
        registered = await self.state.register(self.name, computed)
        good = registered == computed
        lease = Lease(
            name=self.name,
            url=self.replica_url,
            stack=document,
            fingerprint=computed,
            registered=registered,
            proved_at=now,
            lease_s=self.lease_s,
            kind=self.kind.name,
        )
        if not good:
            await self._quarantine("stack_changed", registered=registered, observed=computed, now=now)
        # The lease always carries what was proved, so Redis shows the truth; proxies keep a lease
        # whose fingerprint is not its registered one out of rotation whatever else they know.
        await self.state.renew(lease, good=good)
        return Beat.PROVED if good else Beat.CHANGED

    async def _quarantine(self, reason: str, *, registered: str | None, observed: str, now: datetime) -> None:
        note = Quarantine(
            reason=reason,
            registered=registered,
            observed=observed,
            last_good_check=await self.state.last_good(self.name),
            at=now,
            by=f"heartbeat:{self.name}",
        )
        if await self.state.quarantine(self.name, note):
            log.error(
                "replica_quarantined",
                replica=self.name,
                reason=reason,
                registered=registered,
                observed=observed,
            )

    async def run(self, interval_s: float) -> None:
        while True:
            outcome = await self.beat()
            log.debug("heartbeat", replica=self.name, outcome=outcome.value)
            await asyncio.sleep(interval_s)


async def run_sidecar(
    redis_url: str,
    *,
    key_prefix: str,
    name: str,
    replica_url: str,
    lease_s: float,
    interval_s: float,
    timeout_s: float,
    clock: Callable[[], datetime],
    kind: ReplicaKind = STACKPIN,
    model: str | None = None,
) -> None:
    """`stackpin fleet heartbeat`: beats until it is stopped; its lease runs out on its own after that."""
    state = FleetState(connect(redis_url, timeout_s=timeout_s), FleetKeys(key_prefix))
    try:
        async with aiohttp.ClientSession() as session:
            heartbeat = Heartbeat(
                state,
                session,
                name=name,
                replica_url=replica_url,
                lease_s=lease_s,
                timeout_s=timeout_s,
                clock=clock,
                kind=kind,
                model=model,
            )
            log.info(
                "heartbeat_started", replica=name, url=replica_url, lease_s=lease_s, interval_s=interval_s
            )
            await heartbeat.run(interval_s)
    finally:
        await state.close()
