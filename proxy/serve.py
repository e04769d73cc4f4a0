"""`stackpin serve`: configure logging, start the embedded backend when wanted, run the application."""

from __future__ import annotations

import sys

import structlog
from aiohttp import web

from proxy.app import create_app
from proxy.audit import SchemaError
from proxy.config import Secrets, Settings
from proxy.errors import ConfigError
from proxy.local_backend import LocalBackend, wanted
from proxy.logs import configure_logging

log = structlog.get_logger("stackpin.serve")


def serve(settings: Settings, secrets: Secrets) -> int:
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
    host, port = settings.server.host, settings.server.port
    auth = "API key required" if secrets.tenant_key_hashes else "loopback only, no API key needed"
    lines = [f"stackpin serving on http://{host}:{port}/v1 ({auth})"]
    if settings.ui.enabled:
        login = ", log in with a tenant's API key" if secrets.tenant_key_hashes else ""
        lines.append(f"audit page: http://{host}:{port}/ui/ (records, replays, stacks, probes{login})")
    try:
        web.run_app(
            app,
            host=host,
            port=port,
            print=lambda _: print("\n".join(lines), file=sys.stderr, flush=True),
            access_log=None,
        )
    except (SchemaError, ConfigError) as e:
        print(f"stackpin: {e}", file=sys.stderr)
        return 2
    return 0
