"""create_app wires the proxy resource by resource: each resource is acquired in order under its own key and
released in reverse, one that fails to start releases those acquired before it, and collaborators are the ones
the resources were built with (in fleet mode the registry counts, and the health monitor shares its quarantines,
through the same link to Redis that the fleet's sync reads back).

The embedded local backend stands in as a fake backend on loopback: the proxy starts and stops it as it would the
child process, and checks its stack over HTTP like any replica's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.app_keys import CLIENT_SESSION, FLEET, FLEET_LINK, HEALTH, REGISTRY, STORE
from proxy.audit import AuditError
from proxy.config import resolve_secrets
from proxy.process.listener import bind, serving
from tests.support.audit_databases import audit_database
from tests.support.fake_replica import FakeReplica, tiny_stack
from tests.support.fleet import REDIS_URL, redis_prefix
from tests.support.proxy_harness import running_proxy, settings_for


@dataclass
class LocalBackendOnLoopback:
    """Shaped as proxy/replicas/local_backend.py's LocalBackend: `start` returns the URL of a backend that is already up
    (or fails, as a child that cannot load its model does); `stop` notes what was still open when it was called."""

    backend: FakeReplica | None
    name: str = "local-cpu"
    seen_at_stop: dict[str, bool] = field(default_factory=dict)
    app: web.Application | None = None

    async def start(self) -> str:
        if self.backend is None:
            raise RuntimeError("the backend could not load its model")
        return self.backend.url

    async def stop(self) -> None:
        assert self.app is not None
        session = self.app.get(CLIENT_SESSION)
        self.seen_at_stop["client_open"] = session is not None and not session.closed
        try:
            await self.app[STORE].ping()
            self.seen_at_stop["store_open"] = True
        except AuditError:
            self.seen_at_stop["store_open"] = False


@asynccontextmanager
async def app_with_local_backend(
    local: LocalBackendOnLoopback, tmp_path: Path
) -> AsyncIterator[tuple[web.Application, Callable[[], AbstractAsyncContextManager[str]]]]:
    """An application with `local` as its embedded backend over a fresh SQLite log, and how to serve it on a
    loopback socket of its own (closed at the end)."""
    async with audit_database("sqlite", tmp_path) as database:
        await database.migrate()
        settings = settings_for([], database.url)
        app = create_app(settings, resolve_secrets(settings, {}), local_backends=[local])  # type: ignore[list-item]
        local.app = app
        sock = bind("127.0.0.1", 0)
        try:
            yield app, lambda: serving(app, sock, settings.server)
        finally:
            sock.close()


async def test_the_local_backend_is_a_replica_and_is_stopped_before_the_client_and_the_store_are_released(
    replica: FakeReplica, tmp_path: Path
) -> None:
    local = LocalBackendOnLoopback(replica)
    async with app_with_local_backend(local, tmp_path) as (app, serve), serve():
        (live,) = app[REGISTRY].live()
        assert live.name == "local-cpu" and live.fingerprint == replica.fingerprint
        session, store = app[CLIENT_SESSION], app[STORE]
    assert local.seen_at_stop == {"client_open": True, "store_open": True}, "released in reverse order"
    assert session.closed
    with pytest.raises(AuditError):
        await store.ping()


async def test_local_backends_of_two_kernel_modes_are_two_replicas_of_two_stacks(tmp_path: Path) -> None:
    invariant, default = FakeReplica(), FakeReplica(stack=tiny_stack(kernel_mode="default"))
    for fake in (invariant, default):
        await fake.start()
    locals_ = [
        LocalBackendOnLoopback(invariant, name="local-cpu-batch_invariant"),
        LocalBackendOnLoopback(default, name="local-cpu-default"),
    ]
    try:
        async with audit_database("sqlite", tmp_path) as database:
            await database.migrate()
            settings = settings_for([], database.url)
            app = create_app(settings, resolve_secrets(settings, {}), local_backends=locals_)  # type: ignore[arg-type]
            for local in locals_:
                local.app = app
            sock = bind("127.0.0.1", 0)
            try:
                async with serving(app, sock, settings.server):
                    live = {r.name: r.fingerprint for r in app[REGISTRY].live()}
                    assert live == {
                        "local-cpu-batch_invariant": invariant.fingerprint,
                        "local-cpu-default": default.fingerprint,
                    }
            finally:
                sock.close()
        assert all(local.seen_at_stop == {"client_open": True, "store_open": True} for local in locals_)
    finally:
        for fake in (invariant, default):
            await fake.stop()


async def test_a_resource_that_fails_to_start_releases_those_acquired_before_it(tmp_path: Path) -> None:
    local = LocalBackendOnLoopback(None)
    async with app_with_local_backend(local, tmp_path) as (app, serve):
        with pytest.raises(RuntimeError, match="could not load its model"):
            async with serve():
                pytest.fail("nothing is served when a resource cannot start")
        assert REGISTRY not in app, "nothing after the failed resource was acquired"
        assert app[CLIENT_SESSION].closed
        with pytest.raises(AuditError):
            await app[STORE].ping()
        assert local.seen_at_stop == {"client_open": True, "store_open": True}, (
            "stopped first, as it started last"
        )


async def test_a_single_proxy_has_no_fleet_link_and_counts_in_its_registry_alone(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        assert FLEET_LINK not in harness.app and harness.app[FLEET].sync is None
        assert harness.app[REGISTRY].counter is None and harness.app[HEALTH].board is None


async def test_in_fleet_mode_the_registry_monitor_and_sync_are_built_with_one_link(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with redis_prefix() as prefix:
        fleet = {"redis_url": REDIS_URL, "key_prefix": prefix, "sync_interval_s": 3600}
        async with running_proxy([replica], tmp_path, fleet=fleet) as harness:
            link, sync = harness.app[FLEET_LINK], harness.app[FLEET].sync
            assert sync is not None and sync.link is link
            assert harness.app[REGISTRY].counter is link and harness.app[HEALTH].board is link
            assert harness.proxy.registry is harness.app[REGISTRY], (
                "the serving path serves with the same one"
            )
            status, _, _ = await harness.post(
                "/v1/chat/completions",
                {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert status == 200 and link.inflight == {"replica-0": 0}, "counted through the link, and done"
