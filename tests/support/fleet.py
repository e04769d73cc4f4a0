"""What the fleet tests share: a Redis key prefix of their own, a relay that can cut Redis off, a clock the test
moves, and proxies in fleet mode on loopback sharing one audit store and one Redis.

Each test gets a fresh prefix in the Redis named by STACKPIN_TEST_REDIS_URL and deletes its keys afterwards, so
runs that share the server never see each other. The relay is a real TCP hop in front of Redis: closing it is a
real outage as the proxy sees it, without touching the server others use.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from proxy.app import create_app
from proxy.config import resolve_secrets
from proxy.fleet.documents import FleetKeys
from proxy.fleet.heartbeat import Heartbeat
from proxy.fleet.state import FleetState, connect
from proxy.fleet.sync import FleetSync
from tests.support.audit_databases import LOG_KEY_ENV, LOG_SIGNER, AuditDatabase
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, settings_for
from tests.support.tcp_relay import TcpRelay

REDIS_URL = os.environ.get("STACKPIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
T0 = datetime(2026, 3, 4, 5, 6, 30, tzinfo=UTC)  # thirty seconds into a minute


@dataclass
class Clock:
    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@asynccontextmanager
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix no other run uses; every key under it is deleted at the end (never FLUSHDB)."""
    prefix = f"stackpin-test-{uuid.uuid4().hex[:12]}:"
    try:
        yield prefix
    finally:
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


class RedisRelay(TcpRelay):
    """A TCP relay on loopback in front of the test Redis; `cut()` drops every connection and refuses new ones."""

    def __init__(self, target: str = REDIS_URL) -> None:
        address = target.split("://", 1)[1].split("/", 1)[0]
        host, _, port = address.rpartition(":")
        super().__init__(host, int(port))
        self.db = target.rsplit("/", 1)[1] if target.count("/") > 2 else "0"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.listen_port}/{self.db}"


@dataclass
class Fleet:
    """Proxies in fleet mode sharing one store and one Redis prefix, and heartbeats for the fake replicas."""

    proxies: list[Harness]
    prefix: str
    clock: Clock
    state: FleetState
    beats: dict[str, Heartbeat] = field(default_factory=dict)

    def sync(self, index: int) -> FleetSync:
        sync = self.proxies[index].fleet.sync
        assert sync is not None
        return sync

    async def beat(self, *names: str) -> None:
        for name in names or tuple(self.beats):
            await self.beats[name].beat()

    async def sync_all(self) -> None:
        for index in range(len(self.proxies)):
            await self.sync(index).round()


@asynccontextmanager
async def heartbeat_for(
    state: FleetState, replica: FakeReplica, name: str, clock: Callable[[], datetime], lease_s: float = 15.0
) -> AsyncIterator[Heartbeat]:
    async with aiohttp.ClientSession() as session:
        yield Heartbeat(
            state, session, name=name, replica_url=replica.url, lease_s=lease_s, timeout_s=2.0, clock=clock
        )


@asynccontextmanager
async def running_fleet(
    database: AuditDatabase,
    leased: Mapping[str, FakeReplica],
    *,
    proxies: int = 2,
    redis_url: str = REDIS_URL,
    configured: list[FakeReplica] | None = None,
    environ: Mapping[str, str] | None = None,
    **sections: Any,
) -> AsyncIterator[Fleet]:
    """`proxies` proxies on loopback; each fake in `leased` heartbeats under its name (beats are driven by the
    test, as are the proxies' sync rounds: the background sync runs once an hour)."""
    clock = Clock()
    async with AsyncExitStack() as stack:
        prefix = await stack.enter_async_context(redis_prefix())
        state = FleetState(connect(REDIS_URL, timeout_s=2.0), FleetKeys(prefix))
        stack.push_async_callback(state.close)
        fleet = Fleet([], prefix, clock, state)
        for name, fake in leased.items():
            fleet.beats[name] = await stack.enter_async_context(heartbeat_for(state, fake, name, clock))
        await fleet.beat()
        fleet_section = {
            "redis_url": redis_url,
            "key_prefix": prefix,
            "sync_interval_s": 3600,
            "max_stale_s": 30,
        }
        fleet_section.update(sections.pop("fleet", {}))
        for _ in range(proxies):
            settings = settings_for(
                configured or [], database.url, database.schema, fleet=fleet_section, **sections
            )
            secrets = resolve_secrets(settings, {LOG_KEY_ENV: LOG_SIGNER.text, **(environ or {})})
            app = create_app(settings, secrets, clock=clock)
            runner = web.AppRunner(app)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            fleet.proxies.append(Harness(f"http://127.0.0.1:{port}", app, settings, secrets))
        yield fleet


# Real processes: `stackpin serve` and `stackpin fleet heartbeat`, as a fleet runs them.

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def fleet_config(folder: Path, *, port: int, store_url: str, redis_url: str, sync_interval_s: float) -> Path:
    path = folder / f"proxy-{port}.toml"
    path.write_text(
        f'log_level = "warning"\n\n[server]\nport = {port}\n\n[store]\nurl = "{store_url}"\n\n[local_backend]\nenabled = "off"\n\n'
        f'[fleet]\nredis_url = "{redis_url}"\nsync_interval_s = {sync_interval_s}\n'
    )
    return path


@dataclass
class Processes:
    folder: Path
    env: dict[str, str]
    running: list[tuple[asyncio.subprocess.Process, Path]] = field(default_factory=list)

    async def start(self, *args: str, log_name: str) -> asyncio.subprocess.Process:
        log = self.folder / f"{log_name}.log"
        with log.open("wb") as sink:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "proxy.commands.cli",
                *args,
                cwd=ROOT,
                env=self.env,
                stdout=sink,
                stderr=sink,
            )
        self.running.append((process, log))
        return process

    async def run(self, *args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy.commands.cli",
            *args,
            cwd=ROOT,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        return int(process.returncode or 0), out.decode()

    async def stop_all(self) -> None:
        for process, _ in self.running:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        for process, _ in self.running:
            try:
                await asyncio.wait_for(process.wait(), 20)
            except TimeoutError:
                process.kill()
                await process.wait()

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for _, log in self.running)


@asynccontextmanager
async def proxy_processes(
    folder: Path,
    *,
    proxies: int,
    replicas: Mapping[str, str],
    store_url: str,
    schema: str | None,
    redis_url: str,
    prefix: str,
    sync_interval_s: float = 0.2,
    lease_s: float = 5.0,
) -> AsyncIterator[tuple[list[str], Processes]]:
    """`proxies` `stackpin serve` processes and one heartbeat per replica URL; yields the proxies' base URLs once
    every one of them is ready, and stops them all (SIGTERM) at the end."""
    env = {
        **os.environ,
        "STACKPIN_FLEET__KEY_PREFIX": prefix,
        "STACKPIN_LOG__SIGNING_KEY_ENV": LOG_KEY_ENV,
        LOG_KEY_ENV: LOG_SIGNER.text,
    }
    if schema is not None:
        env["STACKPIN_STORE__POSTGRES_SCHEMA"] = schema
    processes = Processes(folder, env)
    urls = []
    sidecar_config = folder / "heartbeat.toml"
    sidecar_config.write_text('log_level = "warning"\n[local_backend]\nenabled = "off"\n')
    try:
        for name, url in replicas.items():
            await processes.start(
                "fleet", "heartbeat", "--replica-url", url, "--name", name, "--redis", redis_url,
                "--lease-s", str(lease_s), "--config", str(sidecar_config), log_name=f"heartbeat-{name}",
            )  # fmt: skip
        for _ in range(proxies):
            port = free_port()
            config = fleet_config(
                folder, port=port, store_url=store_url, redis_url=redis_url, sync_interval_s=sync_interval_s
            )
            await processes.start("serve", "--config", str(config), log_name=f"proxy-{port}")
            urls.append(f"http://127.0.0.1:{port}")
        await wait_ready(urls, processes)
        yield urls, processes
    finally:
        await processes.stop_all()


async def wait_ready(urls: list[str], processes: Processes, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession() as session:
        for url in urls:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{url}/readyz") as response:
                        if response.status == 200:
                            break
                if asyncio.get_running_loop().time() > deadline or any(
                    p.returncode is not None for p, _ in processes.running
                ):
                    raise RuntimeError(f"{url} did not become ready:\n{processes.logs()}")
                await asyncio.sleep(0.2)
