"""`stackpin serve`: bind the port, configure logging, start the embedded backend when wanted, run the application
on a uvloop event loop.

The port is bound first, so that one in use is refused at once rather than after the model has loaded. Every line
the proxy writes is a JSON log line (proxy/logs.py); a reason not to start is one plain line and exit 2. With
`server.workers` above 1 this process supervises that many serving processes instead (proxy/process/supervisor.py), each
of which runs its application through `run_app`, as a single proxy does.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog
import uvloop
from aiohttp import web

from proxy.app import create_app
from proxy.audit import SchemaError
from proxy.config import Secrets, Settings
from proxy.errors import ConfigError
from proxy.logs import configure_logging
from proxy.process.listener import bind, serving
from proxy.process.stopping import Stopping
from proxy.process.supervisor import supervise, workers_refused
from proxy.replicas.local_backend import local_backends_for

log = structlog.get_logger("stackpin.serve")
EXIT_OK, EXIT_ERROR = 0, 2
T = TypeVar("T")
# Net allocations of tracked objects between two collections of the youngest generation (CPython's default is
# 700, which a proxy under load reaches every eight requests or so; see `collect_for_serving`).
YOUNG_COLLECTION_THRESHOLD = 20_000


def serve(settings: Settings, secrets: Secrets) -> int:
    host, port = settings.server.host, settings.server.port
    refused = workers_refused(settings)
    if refused is not None:
        print(f"stackpin: {refused}", file=sys.stderr)
        return EXIT_ERROR
    try:
        sock = bind(host, port)
    except OSError as e:
        print(f"stackpin: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    configure_logging(settings.log_level)
    if settings.server.workers > 1:
        try:
            return supervise(settings, secrets, sock)
        finally:
            sock.close()
    app = create_app(settings, secrets, local_backends=local_backends_for(settings))
    return serve_on(sock, run_app(app, sock, settings, serving_line(settings, secrets)))


def serve_on(sock: socket.socket, serving: Coroutine[Any, Any, None]) -> int:
    """Runs `serving` (run_app's) on uvloop, and closes the listening socket however it ends: the exit status,
    a reason not to start being one line and EXIT_ERROR."""
    try:
        run_on_uvloop(serving)
    except (SchemaError, ConfigError) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        sock.close()
    return EXIT_OK


def run_on_uvloop(main: Coroutine[Any, Any, T]) -> T:
    """Runs a serving process's `main` on uvloop: its transports and scheduling are C, where asyncio's are Python
    that every request passes through several times (bench/results/proxy_overhead.md)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def serving_line(settings: Settings, secrets: Secrets) -> dict[str, Any]:
    """What the `serving` log line says besides the URL: who may call, and what the audit page shows."""
    auth = "API key required" if secrets.tenant_key_hashes else "loopback only, no API key needed"
    if not settings.ui.enabled:
        return {"auth": auth}
    login = ", log in with a tenant's API key" if secrets.tenant_key_hashes else ""
    return {"auth": auth, "audit_page_shows": f"records, replays, stacks, probes{login}"}


async def run_app(
    app: web.Application,
    sock: socket.socket,
    settings: Settings,
    line: dict[str, Any],
    *,
    on_serving: Callable[[], None] | None = None,
    stop_when: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Serves until SIGINT or SIGTERM (or until `stop_when` returns), any of which also stops a start still in
    progress (a model loading); `on_serving` is called once requests are accepted."""
    stopping = Stopping()
    watcher = asyncio.create_task(_signal_when(stop_when, stopping.signal)) if stop_when is not None else None
    try:
        async with serving(app, sock, settings.server) as url:
            collect_for_serving()
            stopping.serving()
            links = {"audit_page": f"{url}/ui/"} if "audit_page_shows" in line else {}
            log.info("serving", url=f"{url}/v1", **line, **links)
            if on_serving is not None:
                on_serving()
            await stopping.requested.wait()
    except asyncio.CancelledError:
        log.info("stopped_while_starting")
        return
    finally:
        if watcher is not None:
            watcher.cancel()
    log.info("stopped")


def collect_for_serving() -> None:
    """Sets the garbage collector up for serving, once start-up is done. What start-up built (modules, the
    application, the store's statements, pools) lives as long as the process: frozen, no collection walks it again.
    Requests allocate fast and free almost everything by reference counting, so the youngest generation is
    collected after YOUNG_COLLECTION_THRESHOLD allocations rather than 700; the cycles that wait longer to be
    freed are a few MB at most."""
    gc.collect()  # what start-up left as garbage, before freezing what remains
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, oldest)


async def _signal_when(condition: Callable[[], Awaitable[None]], on_signal: Callable[[], None]) -> None:
    await condition()
    on_signal()
