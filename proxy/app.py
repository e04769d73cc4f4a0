"""create_app: the proxy's aiohttp application, its resources as cleanup contexts, its routes.

What needs no releasing is set when the application is built (settings, secrets, metrics, the redactor, routes,
prompts). Each resource is one cleanup context under its own key (proxy/app_keys.py), acquired in this order and
released in reverse, and each is built with the ones before it:

1. the audit store, whose streams left open by a stopped proxy are closed as interrupted first (proxy/process/sweep.py),
   which integrates the log and signs its checkpoints with the log's key, and whose tenants' retention policies are
   applied every `store.retention_interval_s` (proxy/audit/retention.py);
2. the HTTP client for replicas;
3. the embedded local backends, when configured (one a kernel mode);
4. in fleet mode, the link to Redis (proxy/fleet/link.py) that the registry counts through and the health monitor
   shares its quarantines through;
5. the replica registry with its health monitor, which checks every replica before the first request is accepted;
6. the fleet (proxy/fleet/resource.py): rate limits, and in fleet mode the task that keeps the registry in step;
7. the serving path (proxy/serving/serve.py) over all of them, with the task that records the ends of streams the
   store was away for (proxy/serving/unclosed.py), which tries once more at a graceful stop, and the OpenTelemetry
   exporter of its answers' spans when `[telemetry]` names one (proxy/telemetry.py), flushed at the stop;
8. the stored state (proxy/state/: files, jobs, conversations, in the audit database) and the runner of its jobs
   (background responses and batches), which serve through the serving path and let their leases go at a stop.

The audit page (proxy/ui/) is a sub-application at /ui over the same keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app_keys import (
    CLIENT_SESSION,
    FLEET,
    FLEET_LINK,
    HEALTH,
    JOBS,
    LOCAL_REPLICAS,
    METRICS,
    PROMPTS,
    PROXY,
    REDACTOR,
    REGISTRY,
    ROUTES,
    SECRETS,
    SETTINGS,
    STATE,
    STORE,
)
from proxy.audit import AuditStore
from proxy.audit.keys import serving_signer
from proxy.audit.retention import keep_retention
from proxy.config import Secrets, Settings
from proxy.fleet.resource import fleet_for, fleet_link
from proxy.metrics import ProxyMetrics
from proxy.process.sweep import mark_interrupted_streams
from proxy.replicas.health import HealthMonitor
from proxy.replicas.kinds import STACKPIN, kind_named
from proxy.replicas.local_backend import BackendProcess
from proxy.replicas.registry import OutstandingCounter, Registry, Replica
from proxy.serving.handlers import routes
from proxy.serving.middleware import error_middleware
from proxy.serving.prompts import PromptBook
from proxy.serving.record_ids import RecordIds
from proxy.serving.redact import Redactor
from proxy.serving.serve import Proxy
from proxy.serving.unclosed import Unclosed
from proxy.state.background import BackgroundKind
from proxy.state.batch_run import BatchKind
from proxy.state.routes import routes as state_routes
from proxy.state.runner import JobKind, JobRunner
from proxy.state.store import StateStore
from proxy.telemetry import telemetry_for
from proxy.ui import ui_app

log = structlog.get_logger("stackpin.app")


def utc_now() -> datetime:
    return datetime.now(UTC)


def registry_from(settings: Settings, *, counter: OutstandingCounter | None = None) -> Registry:
    """The configured replicas; a declared one is in rotation on its declaration, any other once it describes its
    stack."""
    registry = Registry(counter=counter)
    for replica in settings.replicas:
        kind = kind_named(replica.kind_name)
        registry.add(
            Replica(
                name=replica.name,
                url=replica.url,
                kind=kind,
                stack=replica.stack,
                fingerprint=replica.stack.fingerprint if replica.stack else None,
                reachable=replica.stack is not None,
                endpoints=kind.endpoints(replica.endpoints),
                model=replica.model,
            )
        )
    return registry


def create_app(
    settings: Settings,
    secrets: Secrets,
    *,
    clock: Callable[[], datetime] = utc_now,
    local_backends: Sequence[BackendProcess] = (),
    shared_metrics: ProxyMetrics | None = None,
    sweep_at_start: bool = True,
) -> web.Application:
    """`shared_metrics` and `sweep_at_start=False` are for a worker among several (proxy/process/worker.py): their metrics are
    combined, and their supervisor has swept the streams left open before any worker serves."""
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=[error_middleware])
    app[SETTINGS] = settings
    app[SECRETS] = secrets
    app[METRICS] = shared_metrics or ProxyMetrics(CollectorRegistry())
    app[REDACTOR] = Redactor(key.get_secret_value() for key in secrets.replica_keys.values())
    app[ROUTES] = settings.route_pins()
    app[PROMPTS] = PromptBook.from_config(settings.prompts)
    app.add_routes(routes())
    app.add_routes(state_routes())
    if settings.ui.enabled:
        app.add_subapp("/ui", ui_app(settings, secrets))
    app.cleanup_ctx.extend(
        [
            functools.partial(audit_store, clock=clock, sweep=sweep_at_start),
            client_session,
            functools.partial(local_replicas, local_backends),
            functools.partial(fleet_connection, clock=clock),
            functools.partial(replicas, clock=clock),
            functools.partial(fleet, clock=clock),
            functools.partial(serving_path, clock=clock),
            functools.partial(stored_state, clock=clock),
        ]
    )
    return app


async def audit_store(
    app: web.Application, *, clock: Callable[[], datetime], sweep: bool
) -> AsyncIterator[None]:
    """The audit store, once the streams that a stopped proxy left open are closed as interrupted (`sweep`)."""
    settings = app[SETTINGS]
    store = await AuditStore.open(
        settings.store.url,
        batch_max=settings.store.batch_max,
        batch_wait_ms=settings.store.batch_wait_ms,
        # A blank SQLite file is the embedded default's first run; a shared PostgreSQL is migrated by a job.
        create_if_empty=settings.store.url.startswith("sqlite"),
        schema=settings.store.postgres_schema,
        observer=app[METRICS],
        durability=settings.store.durability,
        signer=serving_signer(settings, app[SECRETS]),
        checkpoint_interval_s=settings.log.checkpoint_interval_s,
    )
    try:
        if sweep:
            await mark_interrupted_streams(
                store,
                clock(),
                fleet=settings.fleet.redis_url is not None,
                replica_timeout_s=settings.server.replica_timeout_s,
            )
        app[STORE] = store
        retention = None
        if days := settings.retention_days():
            interval_s = settings.store.retention_interval_s
            retention = asyncio.create_task(keep_retention(store, days, clock, interval_s), name="retention")
        try:
            yield
        finally:
            if retention is not None:
                retention.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await retention
    finally:
        await store.close()


async def client_session(app: web.Application) -> AsyncIterator[None]:
    """The HTTP client for replicas: every request, stream and stack check.

    It keeps no cookies: every tenant's requests share this one client, so a cookie one answer set would go out
    with the next tenant's request and let an upstream tie the two together.
    """
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), cookie_jar=aiohttp.DummyCookieJar()
    ) as session:
        app[CLIENT_SESSION] = session
        yield


async def local_replicas(
    local_backends: Sequence[BackendProcess], app: web.Application
) -> AsyncIterator[None]:
    """The embedded local backends, started together as child processes and stopped with the proxy."""
    try:
        async with asyncio.TaskGroup() as starting:  # one that cannot start stops the others' start
            urls = [starting.create_task(backend.start()) for backend in local_backends]
        # Each proves its stack like any pinned_backend: the health monitor's first check puts it in rotation.
        app[LOCAL_REPLICAS] = [
            Replica(name=backend.name, url=url.result(), kind=STACKPIN)
            for backend, url in zip(local_backends, urls, strict=True)
        ]
        yield
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    finally:
        for backend in local_backends:
            await backend.stop()


async def fleet_connection(app: web.Application, *, clock: Callable[[], datetime]) -> AsyncIterator[None]:
    """In fleet mode, the link to Redis that the registry and the health monitor are built with."""
    async with fleet_link(app[SETTINGS], clock=clock) as link:
        if link is not None:
            app[FLEET_LINK] = link
        yield


async def replicas(app: web.Application, *, clock: Callable[[], datetime]) -> AsyncIterator[None]:
    """The registry and its health monitor, which checks every replica before the first request is accepted and
    then every `health.interval_s` in the background."""
    settings, link = app[SETTINGS], app.get(FLEET_LINK)
    registry = registry_from(settings, counter=link)
    for local in app.get(LOCAL_REPLICAS, []):
        registry.add(local)
    health = HealthMonitor(
        registry,
        app[STORE],
        app[CLIENT_SESSION],
        app[METRICS],
        timeout_s=settings.health.timeout_s,
        clock=clock,
        board=link,
        replica_keys=app[SECRETS].replica_keys,
    )
    await health.check_all()
    for replica in registry.all():
        log.info(
            "replica",
            replica=replica.name,
            in_rotation=replica.in_rotation,
            fingerprint=replica.fingerprint,
            kind=replica.kind.name,
            stack_source=replica.stack_source,
        )
    app[REGISTRY], app[HEALTH] = registry, health
    monitor = asyncio.create_task(health.run(settings.health.interval_s), name="health-monitor")
    try:
        yield
    finally:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor


async def fleet(app: web.Application, *, clock: Callable[[], datetime]) -> AsyncIterator[None]:
    """Rate limits, and in fleet mode the task that keeps the registry in step with the fleet."""
    resources = (app.get(FLEET_LINK), app[REGISTRY], app[HEALTH], app[METRICS])
    async with fleet_for(app[SETTINGS], *resources, clock=clock) as joined:
        app[FLEET] = joined
        yield


async def serving_path(app: web.Application, *, clock: Callable[[], datetime]) -> AsyncIterator[None]:
    """The serving path over the resources above, the thread where it builds streams' closing entries, and the
    task that records the ends of streams the store was away for (proxy/serving/unclosed.py)."""
    closing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-close")
    unclosed = Unclosed(app[STORE])
    telemetry = telemetry_for(app[SETTINGS].telemetry, app[SECRETS], clock)
    late_ends = asyncio.create_task(unclosed.run(), name="late-stream-ends")
    app[PROXY] = Proxy(
        store=app[STORE],
        registry=app[REGISTRY],
        health=app[HEALTH],
        session=app[CLIENT_SESSION],
        metrics=app[METRICS],
        limiter=app[FLEET].limiter,
        server=app[SETTINGS].server,
        replica_keys=app[SECRETS].replica_keys,
        redactor=app[REDACTOR],
        closing=closing,
        unclosed=unclosed,
        clock=clock,
        record_ids=RecordIds(),
        telemetry=telemetry,
    )
    try:
        yield
    finally:
        closing.shutdown()  # every stream has closed: the server has stopped
        late_ends.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await late_ends
        # A graceful stop: one more try for what the store was away for; what is left, the next start closes.
        if unclosed.held:
            await unclosed.commit()
            if unclosed.held:
                log.error("stream_ends_left_open", record_ids=unclosed.held)
        await asyncio.to_thread(telemetry.shutdown)  # exports the spans still batched


async def stored_state(app: web.Application, *, clock: Callable[[], datetime]) -> AsyncIterator[None]:
    """The stored state, and the runner that takes up its jobs here (any proxy of a fleet may run any of them)."""
    settings = app[SETTINGS]
    state = StateStore.open(settings.store.url, schema=settings.store.postgres_schema)
    kinds: dict[str, JobKind] = {
        "batch": BatchKind(app, state, app[STORE], settings.batches, clock),
        "response": BackgroundKind(app, state, clock),
    }
    runner = JobRunner(state.jobs, kinds, settings.jobs, clock)
    app[STATE], app[JOBS] = state, runner
    running = asyncio.create_task(runner.run(), name="job-runner")
    try:
        yield
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await runner.stop()
        await state.close()
