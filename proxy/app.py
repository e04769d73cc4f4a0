"""create_app: the proxy's aiohttp application, its resources as cleanup contexts, its routes.

Resources, acquired in order and released in reverse: the audit store (whose streams left open by a stopped
proxy are closed as interrupted first, proxy/sweep.py, and which integrates the log and signs its checkpoints
with the log's key), the HTTP client for replicas, the embedded
local backend (when configured), the replica registry with its health monitor, which checks every replica
before the first request is accepted, and the fleet (proxy/fleet/resource.py): rate limits, and in fleet mode the
shared view in Redis. The audit page (proxy/ui/) is a sub-application at /ui over the same resources.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app_keys import PROMPTS, PROXY, ROUTES
from proxy.audit import AuditStore
from proxy.config import Secrets, Settings
from proxy.fleet.resource import fleet_for
from proxy.handlers import routes
from proxy.health import HealthMonitor
from proxy.local_backend import BackendProcess
from proxy.log_keys import serving_signer
from proxy.metrics import ProxyMetrics
from proxy.middleware import error_middleware
from proxy.prompts import PromptBook
from proxy.registry import Registry, Replica
from proxy.serving import Proxy
from proxy.sweep import mark_interrupted_streams
from proxy.ui import ui_app

log = structlog.get_logger("stackpin.app")


def utc_now() -> datetime:
    return datetime.now(UTC)


def registry_from(settings: Settings) -> Registry:
    registry = Registry()
    for replica in settings.replicas:
        declared = replica.stack is not None
        registry.add(
            Replica(
                name=replica.name,
                url=replica.url,
                declared=declared,
                stack=replica.stack,
                fingerprint=replica.stack.fingerprint if replica.stack else None,
                reachable=declared,
                endpoints=replica.served_endpoints(),
            )
        )
    return registry


def create_app(
    settings: Settings,
    secrets: Secrets,
    *,
    clock: Callable[[], datetime] = utc_now,
    local_backend: BackendProcess | None = None,
    shared_metrics: ProxyMetrics | None = None,
    sweep_at_start: bool = True,
) -> web.Application:
    """`shared_metrics` and `sweep_at_start=False` are for a worker among several (proxy/worker.py): their metrics are
    combined, and their supervisor has swept the streams left open before any worker serves."""
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[error_middleware])
    app[ROUTES] = settings.route_pins()
    app[PROMPTS] = PromptBook.from_config(settings.prompts)
    app.add_routes(routes())
    if settings.ui.enabled:
        app.add_subapp("/ui", ui_app(settings, secrets))

    async def resources(app: web.Application) -> AsyncIterator[None]:
        metrics = shared_metrics or ProxyMetrics(CollectorRegistry())
        signer = serving_signer(settings, secrets)
        store = await AuditStore.open(
            settings.store.url,
            batch_max=settings.store.batch_max,
            batch_wait_ms=settings.store.batch_wait_ms,
            # A blank SQLite file is the embedded default's first run; a shared PostgreSQL is migrated by a job.
            create_if_empty=settings.store.url.startswith("sqlite"),
            schema=settings.store.postgres_schema,
            observer=metrics,
            durability=settings.store.durability,
            signer=signer,
            checkpoint_interval_s=settings.log.checkpoint_interval_s,
        )
        try:
            if sweep_at_start:
                await mark_interrupted_streams(
                    store,
                    clock(),
                    fleet=settings.fleet.redis_url is not None,
                    replica_timeout_s=settings.server.replica_timeout_s,
                )
        except BaseException:
            await store.close()
            raise
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300))
        registry = registry_from(settings)
        monitor_task: asyncio.Task[None] | None = None
        try:
            if local_backend is not None:
                registry.add(
                    Replica(name=local_backend.name, url=await local_backend.start(), declared=False)
                )
            health = HealthMonitor(
                registry, store, session, metrics, timeout_s=settings.health.timeout_s, clock=clock
            )
            await health.check_all()
            for replica in registry.all():
                log.info(
                    "replica",
                    replica=replica.name,
                    in_rotation=replica.in_rotation,
                    fingerprint=replica.fingerprint,
                    declared=replica.declared,
                )
            monitor_task = asyncio.create_task(health.run(settings.health.interval_s))
            async with fleet_for(settings, registry, health, metrics, clock=clock) as fleet:
                app[PROXY] = Proxy(
                    settings, secrets, registry, store, session, metrics, health, clock, fleet=fleet
                )
                try:
                    yield
                finally:
                    app[PROXY].closing.shutdown()  # every stream has closed: the server has stopped
        finally:
            if monitor_task is not None:
                monitor_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await monitor_task
            await session.close()
            if local_backend is not None:
                await local_backend.stop()
            await store.close()

    app.cleanup_ctx.append(resources)
    return app
