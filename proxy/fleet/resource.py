"""Wiring fleet mode into a proxy: the Redis client, the sync task and the rate limiter, as one resource.

`create_app` enters `fleet_for(...)` inside its cleanup context. Without `[fleet] redis_url` it yields only a
rate limiter that counts in this process; with it, the registry's outstanding counts and the health monitor's
quarantines are shared, and a background task keeps the registry in step with Redis.
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
from proxy.fleet.state import FleetState, connect
from proxy.fleet.sync import FleetSync
from proxy.health import HealthMonitor
from proxy.metrics import ProxyMetrics
from proxy.registry import Registry

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
async def fleet_for(
    settings: Settings,
    registry: Registry,
    health: HealthMonitor,
    metrics: ProxyMetrics,
    *,
    clock: Callable[[], datetime],
) -> AsyncIterator[Fleet]:
    config = settings.fleet
    if config.redis_url is None:
        yield Fleet(RateLimiter(tenant_limits(settings), None, clock=clock), None)
        return
    keys = FleetKeys(config.key_prefix)
    client = connect(config.redis_url, timeout_s=config.timeout_s)
    sync = FleetSync(
        FleetState(client, keys),
        registry,
        health,
        metrics,
        proxy_id=f"proxy-{uuid.uuid4().hex[:12]}",
        interval_s=config.sync_interval_s,
        max_stale_s=config.max_stale_s,
        clock=clock,
    )
    limiter = RateLimiter(
        tenant_limits(settings),
        RedisCounters(client, keys),
        clock=clock,
        shared_ok=lambda: not sync.status().stale,
    )
    registry.counter, health.board = sync, sync
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
        registry.counter, health.board = None, None
        await sync.drain()
        await limiter.drain()
        await client.aclose()
