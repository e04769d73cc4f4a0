"""The stored-state routes, as one table for create_app (proxy/app.py)."""

from __future__ import annotations

from aiohttp import web

from proxy.state import batch_routes, conversation_routes, response_routes


def routes() -> list[web.RouteDef]:
    return [*response_routes.routes(), *batch_routes.routes(), *conversation_routes.routes()]
