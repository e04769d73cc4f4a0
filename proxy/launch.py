"""`stackpin serve`: bind the port, configure logging, start the embedded backend when wanted, run the application.

The port is bound first, so that one in use is refused at once rather than after the model has loaded. Every line
the proxy writes is a JSON log line (proxy/logs.py); a reason not to start is one plain line and exit 2.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys

import structlog
from aiohttp import web

from proxy.app import create_app
from proxy.audit import SchemaError
from proxy.config import Secrets, Settings
from proxy.errors import ConfigError
from proxy.listener import bind, serving
from proxy.local_backend import LocalBackend, wanted
from proxy.logs import configure_logging

log = structlog.get_logger("stackpin.serve")
EXIT_OK, EXIT_ERROR = 0, 2


def serve(settings: Settings, secrets: Secrets) -> int:
    host, port = settings.server.host, settings.server.port
    try:
        sock = bind(host, port)
    except OSError as e:
        print(f"stackpin: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_ERROR
    configure_logging(settings.log_level)
    local = (
        LocalBackend(settings.local_backend)
        if wanted(settings.local_backend, bool(settings.replicas))
        else None
    )
    if local is None and not settings.replicas:
        log.warning(
            "no_replicas",
            hint="configure [[replicas]] or install the backend extra (pip install 'stackpin[backend]')",
        )
    app = create_app(settings, secrets, local_backend=local)
    auth = "API key required" if secrets.tenant_key_hashes else "loopback only, no API key needed"
    ui = None
    if settings.ui.enabled:
        login = ", log in with a tenant's API key" if secrets.tenant_key_hashes else ""
        ui = f"records, replays, stacks, probes{login}"
    try:
        asyncio.run(_run(app, sock, settings, auth=auth, ui=ui))
    except (SchemaError, ConfigError) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        sock.close()
    return EXIT_OK


async def _run(
    app: web.Application, sock: socket.socket, settings: Settings, *, auth: str, ui: str | None
) -> None:
    """Serves until SIGINT or SIGTERM, which also stops a start still in progress (a model loading)."""
    task = asyncio.current_task()
    assert task is not None
    stop = asyncio.Event()
    started = False

    def on_signal() -> None:
        # Serving: stop in order, letting requests in flight finish. Starting: there is nothing to wait for.
        if started:
            stop.set()
        else:
            task.cancel()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        async with serving(app, sock, settings.server) as url:
            started = True
            links = {"audit_page": f"{url}/ui/", "audit_page_shows": ui} if ui is not None else {}
            log.info("serving", url=f"{url}/v1", auth=auth, **links)
            await stop.wait()
    except asyncio.CancelledError:
        log.info("stopped_while_starting")
        return
    log.info("stopped")
