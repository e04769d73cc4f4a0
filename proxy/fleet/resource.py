"""Wiring fleet mode into a proxy, as two resources that create_app acquires around the registry.

`fleet_link` comes first: in fleet mode the Redis client and this proxy's `FleetLink`, which the registry (its
outstanding counts) and the health monitor (its quarantines) are built with. `fleet_for` comes after them: the
rate limiter, and in fleet mode the background task that keeps the registry in step with Redis. Without
`[fleet] redis_url` there is no link, and the rate limiter counts in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime

import structlog

from proxy.config import Settings
from proxy.fleet.documents import FleetKeys
from proxy.fleet.limits import Limits, RateLimiter, RedisCounters
from proxy.fleet.link import FleetLink
from proxy.fleet.state import FleetState, connect
from proxy.fleet.sync import FleetSync
from proxy.metrics import ProxyMetrics
from proxy.replicas.health import HealthMonitor
from proxy.replicas.registry import Registry

log = structlog.get_logger("stackpin.fleet")


@dataclass(frozen=True)
class Fleet:
    limiter: RateLimiter
    sync: FleetSync | None  # None: a single proxy, the in-process registry is the whole truth


def tenant_limits(settings: Settings) -> dict[str, Limits]:
    return {
        tenant.name: Limits(tenant.requests_per_minute, tenant.tokens_per_minute)
        for tenant in settings.tenants
    }


@asynccontextmanager
async def fleet_link(settings: Settings, *, clock: Callable[[], datetime]) -> AsyncIterator[FleetLink | None]:
    """The Redis client and this proxy's link through it, in fleet mode; None for a single proxy."""
    config = settings.fleet
    if config.redis_url is None:
        yield None
        return
    state = FleetState(connect(config.redis_url, timeout_s=config.timeout_s), FleetKeys(config.key_prefix))
    link = FleetLink(state, proxy_id=f"proxy-{uuid.uuid4().hex[:12]}", clock=clock)
    try:
        yield link
    finally:
        await link.drain()
        await state.close()


@asynccontextmanager
async def fleet_for(
    settings: Settings,
    link: FleetLink | None,
    registry: Registry,
    health: HealthMonitor,
    metrics: ProxyMetrics,
    *,
    clock: Callable[[], datetime],
) -> AsyncIterator[Fleet]:
    """The rate limiter, and with a link the sync task that keeps `registry` in step with the fleet."""
    if link is None:
        yield Fleet(RateLimiter(tenant_limits(settings), None, clock=clock), None)
        return
    config = settings.fleet
    sync = FleetSync(
        link,
        registry,
        health,
        metrics,
        interval_s=config.sync_interval_s,
        max_stale_s=config.max_stale_s,
        clock=clock,
    )
    limiter = RateLimiter(
        tenant_limits(settings),
        RedisCounters(link.state.client, link.state.keys),
        clock=clock,
        shared_ok=lambda: not sync.status().stale,
    )
    if not await sync.round():
        log.error(
            "fleet_state_unreachable_at_start", hint="serving configured replicas only until Redis answers"
        )
    task = asyncio.create_task(sync.run(), name="fleet-sync")
    try:
        yield Fleet(limiter, sync)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await limiter.drain()
