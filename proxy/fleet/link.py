"""This proxy's link to the fleet's shared state in Redis: what it tells the fleet as it happens.

The registry tells it of every request that starts or ends on a replica (its `OutstandingCounter`), the health
monitor of every quarantine it finds (its `QuarantineBoard`). Both are built with the link, which therefore exists
before them; the periodic sync (proxy/fleet/sync.py) reads the fleet back into the registry and uses the counts
and unshared quarantines kept here. Nothing here decides who is in rotation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

import structlog

from proxy.fleet.documents import Quarantine
from proxy.fleet.state import FleetState, FleetUnavailable, FleetView
from proxy.replicas.registry import Replica

log = structlog.get_logger("stackpin.fleet")


class FleetLink:
    def __init__(self, state: FleetState, *, proxy_id: str, clock: Callable[[], datetime]) -> None:
        self.state = state
        self.proxy_id = proxy_id
        self.clock = clock
        self.inflight: dict[str, int] = {}  # this proxy's own requests in flight, per replica: exact
        self.unshared: dict[str, Quarantine] = {}  # quarantines found while Redis was away
        self._sends: set[asyncio.Task[None]] = set()

    # The registry's OutstandingCounter: called on the hot path, so it only schedules.

    def moved(self, name: str, delta: int) -> None:
        self.inflight[name] = self.inflight.get(name, 0) + delta
        task = asyncio.get_running_loop().create_task(self.state.move_outstanding(self.proxy_id, name, delta))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    # The health monitor's QuarantineBoard.

    async def publish(self, replica: Replica, reason: str, observed: str | None, since: datetime) -> bool:
        """Shares a quarantine this proxy found; True when this proxy is the one to mark the records."""
        note = Quarantine(
            reason=reason,
            registered=replica.fingerprint,
            observed=observed,
            last_good_check=since,
            at=self.clock(),
            by=self.proxy_id,
        )
        try:
            await self.state.quarantine(replica.name, note)
            return await self.state.claim_flagging(replica.name, self.proxy_id)
        except FleetUnavailable as e:
            # Marking twice is harmless, never marking is not: mark here, publish when Redis is back.
            log.warning("quarantine_not_shared_yet", replica=replica.name, error=str(e)[:300])
            self.unshared[replica.name] = note
            return True

    async def share_unshared(self, view: FleetView) -> None:
        """Publishes the quarantines found while Redis was away, unless the fleet already holds one."""
        for name, note in list(self.unshared.items()):
            if name not in view.quarantines:
                await self.state.quarantine(name, note)
                await self.state.claim_flagging(name, self.proxy_id)  # this proxy marked them already
            del self.unshared[name]

    async def drain(self) -> None:
        """Waits for the fire-and-forget sends still in flight (at shutdown)."""
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
