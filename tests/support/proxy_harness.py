"""A real proxy for the proxy's tests: create_app behind the proxy's own listener on a loopback port, fake
replicas, a real audit store.

`running_proxy` yields a `Harness` with the proxy's base URL, its application, and helpers to build clients. The
store is an SQLite file or a fresh PostgreSQL schema (tests/support/audit_databases.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.app import create_app
from proxy.app_keys import FLEET, PROXY
from proxy.config import Secrets, Settings, resolve_secrets
from proxy.fleet.resource import Fleet
from proxy.process.listener import bind, serving
from proxy.serving.serve import Proxy
from tests.support.audit_databases import LOG_KEY_ENV, LOG_SIGNER, audit_database
from tests.support.fake_replica import FakeReplica


@dataclass
class Harness:
    url: str
    app: web.Application
    settings: Settings
    secrets: Secrets

    @property
    def proxy(self) -> Proxy:
        """The serving path, and through it the store, registry and health monitor it serves with."""
        return self.app[PROXY]

    @property
    def fleet(self) -> Fleet:
        return self.app[FLEET]

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    async def post(
        self, path: str, body: Any, *, headers: Mapping[str, str] | None = None
    ) -> tuple[int, dict[str, Any], Mapping[str, str]]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + path, json=body, headers=headers or {}) as response,
        ):
            return response.status, await response.json(content_type=None), response.headers

    async def get(self, path: str, *, headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + path, headers=headers or {}) as response,
        ):
            return response.status, await response.json(content_type=None)


def settings_for(
    fakes: list[FakeReplica], store_url: str, schema: str | None = None, **sections: Any
) -> Settings:
    data: dict[str, Any] = {
        "replicas": [{"name": f"replica-{i}", "url": r.url} for i, r in enumerate(fakes)],
        "store": {"url": store_url, "postgres_schema": schema, "batch_wait_ms": 0.5},
        "local_backend": {"enabled": "off"},
        "health": {"interval_s": 3600},
        "server": {"retry_deadline_s": 5},
        # SQLite: the key the embedded default makes beside the database; PostgreSQL: the test key.
        "log": {"signing_key_env": LOG_KEY_ENV} if schema is not None else {},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return Settings(**data)


@asynccontextmanager
async def running_proxy(
    fakes: list[FakeReplica],
    folder: Path,
    *,
    store: str = "sqlite",
    store_url: Callable[[str], str] | None = None,
    environ: Mapping[str, str] | None = None,
    store_options: Mapping[str, Any] | None = None,
    **sections: Any,
) -> AsyncIterator[Harness]:
    """`store_url`, given the database's URL, returns the one the proxy uses (e.g. through a relay);
    `store_options` are more `[store]` settings (`store` names the kind of database)."""
    async with audit_database(store, folder) as database:
        await database.migrate()
        url = database.url if store_url is None else store_url(database.url)
        if store_options:
            sections["store"] = dict(store_options)
        settings = settings_for(fakes, url, database.schema, **sections)
        secrets = resolve_secrets(settings, {LOG_KEY_ENV: LOG_SIGNER.text, **(environ or {})})
        app = create_app(settings, secrets)
        sock = bind("127.0.0.1", 0)
        try:
            async with serving(app, sock, settings.server) as url:
                yield Harness(url, app, settings, secrets)
        finally:
            sock.close()
