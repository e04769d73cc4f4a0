"""The proxy's HTTP listener: aiohttp's server, with the proxy's own answers where aiohttp would answer alone.

aiohttp refuses some requests before any handler or middleware runs (a header line over 8190 bytes, too many
headers, a Content-Encoding it cannot decode such as br or zstd, bytes that are not HTTP) and would answer them in
plain text; `ProxyRequestHandler.handle_error` answers them with the proxy's OpenAI-style bodies instead, and logs
one line without a traceback.

Connections are bounded three ways:
- `server.idle_timeout_s`: a connection that sends no complete request for that long is closed (aiohttp's
  keep-alive timer, which runs from a connection's start too, so that half-sent headers are cut as well);
- `server.body_timeout_s`: the wait for a body once its headers are in (proxy/serving/handlers.py answers 408);
- `server.max_connections`: past it, a new connection evicts the oldest one that has sent nothing at all; when
  none has, the new one is marked `over_cap`, and the middleware answers it only on the probe routes, then
  closes it. A flood of idle sockets can neither exhaust the file descriptors nor keep the probes out.

Knows nothing of routes or records: `serving` runs any application.
"""

from __future__ import annotations

import asyncio
import resource
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from proxy.config import ServerSettings
from proxy.errors import BadRequest, HttpError, StackpinError

log = structlog.get_logger("stackpin.http")
DEFAULT_MAX_CONNECTIONS = 4096
# After an answer sent before its body was read (408, 413), the rest is read and dropped for this long, so that
# the client can still read the answer; aiohttp's 10 s would let a slow sender hold the connection longer.
LINGERING_S = 2.0


class ConnectionCap:
    """The open connections, oldest first, and what to do with one past the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[ProxyRequestHandler, None] = {}

    def opened(self, handler: ProxyRequestHandler) -> None:
        self._open[handler] = None
        if len(self._open) <= self.limit:
            return
        victim = next((h for h in self._open if h.silent and h is not handler), None)
        if victim is None:
            handler.over_cap = True
            return
        self._open.pop(victim)
        victim.force_close()

    def closed(self, handler: ProxyRequestHandler) -> None:
        self._open.pop(handler, None)


class ProxyRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, counted against a cap, answering protocol errors as the proxy does."""

    def __init__(self, manager: web.Server, cap: ConnectionCap, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._cap = cap
        self.silent = True  # nothing received yet: the first to go when the cap is reached
        self.over_cap = False  # read by the middleware: answer probes only

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._cap.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cap.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.silent = False
        super().data_received(data)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("a response has started already; no error response can follow it")
        error = protocol_error(status, exc, message)
        log.info("request_refused", status=status, error=error.message)
        response = error.response()
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        # A body that could not be decoded was answered 400 by the middleware; what aiohttp reports afterwards,
        # failing to drain the rest of it, says nothing more.
        if isinstance(kwargs.get("exc_info"), web.RequestPayloadError):
            return
        super().log_exception(*args, **kwargs)


def protocol_error(status: int, exc: BaseException | None, message: str | None) -> StackpinError:
    if isinstance(exc, ContentEncodingError):
        return BadRequest(
            "the request's Content-Encoding is not one the proxy reads; send the body uncompressed, "
            "or as gzip or deflate"
        )
    detail = " ".join((message or "").split())[:200] or "malformed request"
    text = f"the request cannot be read as HTTP: {detail}"
    return BadRequest(text) if status == 400 else HttpError(status, text)


class ProxySite(web.BaseSite):
    """A site on a socket bound beforehand, whose connections are `ProxyRequestHandler`s."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, server: ServerSettings) -> None:
        super().__init__(runner)
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self._name = f"http://{host}:{port}"
        self._cap = ConnectionCap(connection_limit(server.max_connections))
        self._idle_timeout_s = server.idle_timeout_s

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        manager = self._runner.server
        assert manager is not None
        loop = asyncio.get_running_loop()

        def protocol() -> ProxyRequestHandler:
            return ProxyRequestHandler(
                manager,
                self._cap,
                loop=loop,
                keepalive_timeout=self._idle_timeout_s,
                lingering_time=LINGERING_S,
                access_log=None,
            )

        self._server = await loop.create_server(protocol, sock=self._sock, backlog=self._backlog)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now, so that a port in use is refused before anything slow starts."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def connection_limit(configured: int | None) -> int:
    if configured is not None:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return DEFAULT_MAX_CONNECTIONS
    return max(16, min(DEFAULT_MAX_CONNECTIONS, soft // 2))


@asynccontextmanager
async def serving(app: web.Application, sock: socket.socket, server: ServerSettings) -> AsyncIterator[str]:
    """Starts `app` (its cleanup contexts first) and serves it on `sock` until the block ends; yields its URL."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    try:
        # Inside: a resource that fails to start must still release those started before it.
        await runner.setup()
        site = ProxySite(runner, sock, server)
        await site.start()
        yield site.name
    finally:
        await runner.cleanup()
